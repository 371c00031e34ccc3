//! A fixed compiled RouteConfiguration (every match kind shunt serves) and an arbitrary
//! request: authority, path, method and headers, split from the input at NUL bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    shunt_fuzz::route_request(data);
});
