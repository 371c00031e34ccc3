//! Arbitrary bytes as what an upstream answers an HTTP/1.1 request: the first byte
//! picks the request's method (GET or HEAD), the rest goes through shunt's upstream
//! HTTP/1.1 decoder (`upstream/http1/decode.rs`): the head, interim heads, and the body
//! by content-length, chunks (with trailers) or until close. A bad answer is an error,
//! never a panic; decoding the same bytes twice gives the same result.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shunt::upstream::http1::decode_response;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, wire)) = data.split_first() else {
        return;
    };
    let method = if pick & 1 == 0 {
        hyper::Method::GET
    } else {
        hyper::Method::HEAD
    };
    let first = decode_response(wire, &method).map_err(|e| e.to_string());
    let second = decode_response(wire, &method).map_err(|e| e.to_string());
    assert_eq!(first, second);
    if method == hyper::Method::HEAD {
        // A HEAD's answer has no body, whatever its head says.
        assert!(matches!(first, Ok(0) | Err(_)));
    }
});
