use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use super::*;
use shunt_config::{Diagnostics, JsonPath};

fn fault(json: serde_json::Value) -> Result<FaultConfig, Diagnostics> {
    let config: HttpFault = shunt_config::message_from_json(json).expect("HTTPFault JSON");
    let mut problems = Diagnostics::default();
    match compile(&config, &JsonPath::new("fault"), &mut problems) {
        Some(c) if problems.errors.is_empty() => Ok(c),
        _ => Err(problems),
    }
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

fn view(h: &HeaderMap) -> RequestView<'_> {
    RequestView {
        method: "GET",
        authority: "svc",
        path: "/",
        scheme: "http",
        headers: h,
    }
}

#[test]
fn fixed_abort_and_delay_follow_their_percentages() {
    let f = fault(serde_json::json!({
        "abort": {"http_status": 503, "percentage": {"numerator": 30}},
        "delay": {"fixed_delay": "0.25s", "percentage": {"numerator": 5, "denominator": "TEN_THOUSAND"}}
    }))
    .unwrap();
    let h = HeaderMap::new();
    let v = view(&h);
    // 30 of 100: draws 0..29 abort, 30..99 do not, and the draw wraps by the denominator.
    assert_eq!(f.abort(&v, 29).map(|a| a.0), Some(Abort::Http(503)));
    assert_eq!(f.abort(&v, 30), None);
    assert_eq!(f.abort(&v, 129).map(|a| a.1), Some(DEFAULT_ABORT_BODY));
    assert_eq!(f.delay(&v, 4), Some(Duration::from_millis(250)));
    assert_eq!(f.delay(&v, 5), None);
    assert_eq!(f.delay(&v, 10_004), Some(Duration::from_millis(250)));
}

#[test]
fn a_missing_percentage_is_zero_percent() {
    let f = fault(serde_json::json!({"abort": {"http_status": 500}})).unwrap();
    let h = HeaderMap::new();
    assert!((0..1000).all(|r| f.abort(&view(&h), r).is_none()));
}

#[test]
fn header_faults_read_the_request_and_percentage_headers_only_lower() {
    let f = fault(serde_json::json!({
        "abort": {"header_abort": {}, "percentage": {"numerator": 50}},
        "delay": {"header_delay": {}, "percentage": {"numerator": 100}}
    }))
    .unwrap();
    let h = headers(&[(HEADER_ABORT, "418"), (HEADER_DELAY, "40")]);
    assert_eq!(f.abort(&view(&h), 10).map(|a| a.0), Some(Abort::Http(418)));
    assert_eq!(f.abort(&view(&h), 60), None);
    assert_eq!(f.delay(&view(&h), 99), Some(Duration::from_millis(40)));

    // 90 % asked, 50 % configured: still 50 %.
    let h = headers(&[(HEADER_ABORT, "500"), (HEADER_ABORT_PERCENTAGE, "90")]);
    assert_eq!(f.abort(&view(&h), 60), None);
    let h = headers(&[(HEADER_ABORT, "500"), (HEADER_ABORT_PERCENTAGE, "0")]);
    assert_eq!(f.abort(&view(&h), 0), None);

    // Out of range or unparsable statuses are no abort; a gRPC status is the fallback.
    for bad in ["199", "600", "x", ""] {
        let h = headers(&[(HEADER_ABORT, bad)]);
        assert_eq!(f.abort(&view(&h), 0), None, "{bad}");
    }
    let h = headers(&[(HEADER_ABORT, "700"), (HEADER_ABORT_GRPC, "14")]);
    assert_eq!(f.abort(&view(&h), 0).map(|a| a.0), Some(Abort::Grpc(14)));

    // No header, a zero or a bad delay: no delay.
    for h in [
        headers(&[]),
        headers(&[(HEADER_DELAY, "0")]),
        headers(&[(HEADER_DELAY, "-3")]),
    ] {
        assert_eq!(f.delay(&view(&h), 0), None);
    }
}

#[test]
fn matchers_cluster_nodes_and_overflow() {
    let f = fault(serde_json::json!({
        "abort": {"grpc_status": 14, "percentage": {"numerator": 100}},
        "upstream_cluster": "backend",
        "downstream_nodes": ["node-a"],
        "headers": [{"name": "x-user", "string_match": {"exact": "tester"}}],
        "max_active_faults": 2
    }))
    .unwrap();
    let ok = headers(&[(DOWNSTREAM_NODE, "node-a"), ("x-user", "tester")]);
    assert_eq!(f.applies(&view(&ok), Some("backend")), Applies::Yes);
    assert_eq!(f.applies(&view(&ok), Some("other")), Applies::No);
    assert_eq!(f.applies(&view(&ok), None), Applies::No);
    let other_node = headers(&[(DOWNSTREAM_NODE, "node-b"), ("x-user", "tester")]);
    assert_eq!(f.applies(&view(&other_node), Some("backend")), Applies::No);
    let other_user = headers(&[(DOWNSTREAM_NODE, "node-a"), ("x-user", "else")]);
    assert_eq!(f.applies(&view(&other_user), Some("backend")), Applies::No);
    assert!(!f.overflows(1));
    assert!(f.overflows(2));
    assert_eq!(f.abort(&view(&ok), 7).map(|a| a.0), Some(Abort::Grpc(14)));
}

#[test]
fn bad_configs_name_the_field() {
    let err = fault(serde_json::json!({"abort": {"http_status": 99}})).unwrap_err();
    assert_eq!(err.errors[0].path, "fault.abort.http_status");
    let err = fault(serde_json::json!({"abort": {"percentage": {"numerator": 1}}})).unwrap_err();
    assert_eq!(err.errors[0].path, "fault.abort");
    let err = fault(serde_json::json!({"delay": {"percentage": {"numerator": 1}}})).unwrap_err();
    assert_eq!(err.errors[0].path, "fault.delay");
}
