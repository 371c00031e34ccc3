//! Arbitrary bytes as a connection's first bytes, through the listener filters'
//! sniffers: `tls_inspector`'s ClientHello parser and `http_inspector`'s protocol check,
//! on the whole input and on every prefix of it (as the bytes arrive).
#![no_main]

use libfuzzer_sys::fuzz_target;
use shunt::listener::inspector::{self, HttpVerdict, TlsVerdict};

fuzz_target!(|data: &[u8]| {
    let whole_tls = inspector::parse_client_hello(data);
    let whole_http = inspector::inspect_http(data);
    // A verdict on a prefix is either "need more" or final: more bytes never change a
    // final verdict.
    for end in (0..data.len()).step_by(1 + data.len() / 64) {
        match inspector::parse_client_hello(&data[..end]) {
            TlsVerdict::NeedMore => {}
            verdict => assert_eq!(verdict, whole_tls, "prefix {end}"),
        }
        match inspector::inspect_http(&data[..end]) {
            HttpVerdict::NeedMore => {}
            verdict => assert_eq!(verdict, whole_http, "prefix {end}"),
        }
    }
});
