//! The compressor's decisions: the encoding chosen from `accept-encoding` among the
//! chain's compressors, and which responses are compressible.

use std::collections::HashSet;
use std::sync::Arc;

use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use super::*;

const V2: hyper::Version = hyper::Version::HTTP_2;

fn registered(encoding: &'static str, types: &[&str]) -> Registered {
    Registered {
        encoding,
        content_types: Arc::new(types.iter().map(|t| t.to_string()).collect::<HashSet<_>>()),
    }
}

fn chosen(accept: &str, chain: &[Registered], content_type: Option<&str>) -> (String, HeaderStat) {
    let d = choose_encoding(accept, chain, content_type);
    (d.encoding, d.stat)
}

#[test]
fn the_highest_q_value_a_compressor_provides_wins() {
    let chain = [
        registered("gzip", &["text/plain"]),
        registered("br", &["text/plain"]),
    ];
    let text = Some("text/plain");
    assert_eq!(
        chosen("gzip, br", &chain, text),
        ("gzip".into(), HeaderStat::ValidCompressor)
    );
    assert_eq!(
        chosen("gzip;q=0.5, br", &chain, text),
        ("br".into(), HeaderStat::ValidCompressor)
    );
    assert_eq!(chosen("deflate", &chain, text).1, HeaderStat::NotValid);
    assert_eq!(
        chosen("identity, gzip;q=0.5", &chain, text).1,
        HeaderStat::Identity
    );
    // `*` is the first compressor not ruled out by `q=0`.
    assert_eq!(
        chosen("*", &chain, text),
        ("gzip".into(), HeaderStat::Wildcard)
    );
    assert_eq!(
        chosen("gzip;q=0, *", &chain, text),
        ("br".into(), HeaderStat::Wildcard)
    );
    // An unparsable q-value drops the entry.
    assert_eq!(chosen("gzip;q=x", &chain, text).1, HeaderStat::NotValid);
    // A compressor whose content types exclude the response's takes no part.
    let chain = [
        registered("gzip", &["text/html"]),
        registered("br", &["text/plain"]),
    ];
    assert_eq!(
        chosen("gzip, br;q=0.1", &chain, text),
        ("br".into(), HeaderStat::ValidCompressor)
    );
}

fn direction() -> ResponseDirection {
    ResponseDirection {
        enabled: true,
        min_content_length: 30,
        content_types: content_types(&[]),
        disable_on_etag_header: false,
        weaken_etag_on_compress: false,
        remove_accept_encoding_header: false,
        uncompressible_response_codes: vec![206],
    }
}

fn head(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
    pairs
        .iter()
        .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
        .collect()
}

#[test]
fn responses_are_compressible_as_envoy_judges_them() {
    let d = direction();
    let json = ("content-type", "application/json; charset=utf-8");
    assert!(
        d.compressible(200, V2, &head(&[json, ("content-length", "30")]))
            .allowed
    );
    let short = d.compressible(200, V2, &head(&[json, ("content-length", "29")]));
    assert!(!short.allowed && short.too_small);
    // No length: only a chunked body is long enough, and no length is not "too small".
    let unknown = d.compressible(200, V2, &head(&[json]));
    assert!(!unknown.allowed && !unknown.too_small);
    assert!(
        d.compressible(200, V2, &head(&[json, ("transfer-encoding", "chunked")]))
            .allowed
    );
    assert!(
        d.compressible(200, hyper::Version::HTTP_11, &head(&[json]))
            .allowed
    );
    let long = ("content-length", "100");
    assert!(
        !d.compressible(200, V2, &head(&[("content-type", "image/png"), long]))
            .allowed
    );
    assert!(
        d.compressible(200, V2, &head(&[long])).allowed,
        "no content type is allowed"
    );
    assert!(
        !d.compressible(
            200,
            V2,
            &head(&[json, long, ("cache-control", "max-age=1, No-Transform")])
        )
        .allowed
    );
    assert!(
        !d.compressible(200, V2, &head(&[json, long, ("content-encoding", "br")]))
            .allowed
    );
    assert!(!d.compressible(206, V2, &head(&[json, long])).allowed);
    let mut etag = direction();
    etag.disable_on_etag_header = true;
    let refused = etag.compressible(200, V2, &head(&[json, long, ("etag", "\"x\"")]));
    assert!(!refused.allowed && refused.etag_refused);
}
