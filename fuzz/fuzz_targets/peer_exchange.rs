//! Arbitrary bytes as what a peer sends first on an `istio-peer-exchange` connection, and
//! as an `x-envoy-peer-metadata` header value. Decoding never panics; a header that
//! decodes takes no more bytes than it has and no fewer than its prefix; what decodes
//! re-encodes to a header that decodes to the same peer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use shunt::peer::exchange::{self, Decoded};
use shunt::peer::{LocalNode, headers};

fuzz_target!(|data: &[u8]| {
    match exchange::decode(data) {
        Ok(Decoded::Done { peer, consumed }) => {
            assert!(consumed >= exchange::PREFIX_LEN && consumed <= data.len());
            let node = LocalNode {
                id: peer.id.clone().unwrap_or_default(),
                metadata: peer.metadata.clone().unwrap_or_default(),
                ..LocalNode::default()
            };
            let again = exchange::encode(&node);
            let Ok(Decoded::Done {
                peer: back,
                consumed,
            }) = exchange::decode(&again)
            else {
                panic!("our own header does not decode");
            };
            assert_eq!(consumed, again.len());
            assert_eq!(back.metadata.unwrap_or_default(), node.metadata);
        }
        Ok(Decoded::NeedMore { want }) => assert!(want > data.len()),
        Err(_) => {}
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(metadata) = headers::decode_metadata(text)
    {
        let again = headers::encode_metadata(&metadata);
        assert_eq!(headers::decode_metadata(&again).unwrap(), metadata);
    }
});
