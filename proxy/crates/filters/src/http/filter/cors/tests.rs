use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use super::*;
use shunt_config::JsonPath;

fn policy(json: serde_json::Value) -> Policy {
    let p: CorsPolicy = shunt_config::message_from_json(json).expect("CorsPolicy JSON");
    let mut problems = Diagnostics::default();
    let compiled = compile(&p, &JsonPath::new("cors"), &mut problems).expect("compiles");
    assert!(problems.errors.is_empty());
    compiled
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        map.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    map
}

fn preflight(origin: &str) -> HeaderMap {
    headers(&[
        ("origin", origin),
        ("access-control-request-method", "PUT"),
        ("access-control-request-headers", "x-a, x-b"),
    ])
}

#[test]
fn preflight_from_an_allowed_origin_is_answered() {
    let route = policy(serde_json::json!({
        "allow_origin_string_match": [{"exact": "https://a.example"}],
        "allow_methods": "*",
        "allow_credentials": true
    }));
    let vhost = policy(serde_json::json!({
        "allow_origin_string_match": [{"exact": "https://vhost.example"}],
        "allow_methods": "GET",
        "allow_headers": "*",
        "max_age": "600",
        "expose_headers": "x-exposed"
    }));
    let policies = Policies(vec![&route, &vhost]);
    let mut counted = Counted::default();
    let got = policies.on_request("OPTIONS", &preflight("https://a.example"), 0, &mut counted);
    assert_eq!(
        got,
        OnRequest::Preflight(vec![
            ("access-control-allow-origin", "https://a.example".into()),
            ("access-control-allow-credentials", "true".into()),
            ("access-control-allow-methods", "PUT".into()),
            ("access-control-allow-headers", "x-a, x-b".into()),
            ("access-control-max-age", "600".into()),
        ])
    );
    assert!(counted.origin_valid);
    // The route's origins win: the virtual host's is not allowed.
    let mut counted = Counted::default();
    let got = policies.on_request(
        "OPTIONS",
        &preflight("https://vhost.example"),
        0,
        &mut counted,
    );
    assert_eq!(got, OnRequest::Forward { origin: None });
    assert!(counted.origin_invalid);
    assert_eq!(
        policies.simple_response_headers("https://a.example"),
        vec![
            ("access-control-allow-origin", "https://a.example".into()),
            ("access-control-allow-credentials", "true".into()),
            ("access-control-expose-headers", "x-exposed".into()),
        ]
    );
}

#[test]
fn not_matching_preflights_are_answered_bare_when_not_forwarded() {
    let p = policy(serde_json::json!({
        "allow_origin_string_match": [{"prefix": "https://ok"}],
        "forward_not_matching_preflights": false
    }));
    let policies = Policies(vec![&p]);
    let got = policies.on_request(
        "OPTIONS",
        &preflight("https://bad"),
        0,
        &mut Counted::default(),
    );
    assert_eq!(got, OnRequest::Preflight(vec![]));
}

#[test]
fn simple_requests_disabled_and_shadow_policies() {
    let p = policy(serde_json::json!({
        "allow_origin_string_match": [{"exact": "*"}]
    }));
    let policies = Policies(vec![&p]);
    let h = headers(&[("origin", "https://any")]);
    assert_eq!(
        policies.on_request("GET", &h, 0, &mut Counted::default()),
        OnRequest::Forward {
            origin: Some("https://any".into())
        }
    );
    // OPTIONS without Access-Control-Request-Method is not a preflight.
    assert!(matches!(
        policies.on_request("OPTIONS", &h, 0, &mut Counted::default()),
        OnRequest::Forward { .. }
    ));
    // No origin: not CORS.
    assert_eq!(
        policies.on_request("GET", &HeaderMap::new(), 0, &mut Counted::default()),
        OnRequest::Ignore
    );

    let off = policy(serde_json::json!({
        "allow_origin_string_match": [{"exact": "https://a"}],
        "filter_enabled": {"default_value": {"numerator": 0}},
        "shadow_enabled": {"default_value": {"numerator": 100}}
    }));
    let policies = Policies(vec![&off]);
    let mut counted = Counted::default();
    let h = headers(&[("origin", "https://a")]);
    assert_eq!(
        policies.on_request("GET", &h, 0, &mut counted),
        OnRequest::Ignore
    );
    assert!(counted.origin_valid, "shadow mode still counts");
    assert_eq!(
        Policies(vec![]).on_request("GET", &h, 0, &mut Counted::default()),
        OnRequest::Ignore
    );
}
