//! Arbitrary istio-iptables command lines (arguments split at NUL bytes or newlines)
//! through `shunt capture`'s flag parsing and config checks, and each accepted config
//! rendered as iptables and ip6tables rules.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    shunt_fuzz::capture_flags(data);
});
