//! Arbitrary bytes as what a downstream HTTP client sends, fed to the HTTP connection
//! manager over an in-memory duplex (as `proxy/src/http/tests.rs` does), through the
//! codec, Envoy's header limits and routing to direct responses; bounded in time.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    shunt_fuzz::serve_http(data);
});
