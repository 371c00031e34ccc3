use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::{
    ExtAuthz, ExtAuthzPerRoute,
};
use envoy_types::pb::envoy::service::auth::v3::CheckResponse;
use hyper::HeaderMap;

use super::*;
use crate::common::ext_authz::check::{
    Apply, CheckInput, HeaderChange, Verdict, apply, request, verdict,
};
use crate::common::ext_authz::grpc;

fn compiled(json: serde_json::Value) -> Result<ExtAuthzConfig, Diagnostics> {
    let config: ExtAuthz = shunt_config::message_from_json(json).expect("ExtAuthz JSON");
    let mut problems = Diagnostics::default();
    match compile(&config, &JsonPath::new("ext_authz"), &mut problems) {
        Some(c) if problems.errors.is_empty() => Ok(c),
        _ => Err(problems),
    }
}

#[test]
fn istio_custom_policy_config_compiles() {
    // As istiod writes it for a CUSTOM AuthorizationPolicy (authz_configdump.yaml).
    let c = compiled(serde_json::json!({
        "grpc_service": {
            "envoy_grpc": {"cluster_name": "outbound|9191||sample-ext-authz-grpc", "authority": "sample-ext-authz-grpc.local"},
            "timeout": "600s"
        },
        "with_request_body": {"max_request_bytes": 8000},
        "transport_api_version": "V3",
        "filter_enabled_metadata": {
            "filter": "envoy.filters.http.rbac",
            "path": [{"key": "istio_ext_authz_shadow_effective_policy_id"}],
            "value": {"string_match": {"prefix": "istio-ext-authz"}}
        }
    }))
    .unwrap();
    assert_eq!(
        c.service,
        Service::Grpc {
            cluster: "outbound|9191||sample-ext-authz-grpc".into(),
            authority: "sample-ext-authz-grpc.local".into(),
            timeout: Duration::from_secs(600)
        }
    );
    assert_eq!(c.with_request_body.unwrap().max_request_bytes, 8000);
    assert_eq!(c.status_on_error, 403);
    let m = c.filter_enabled_metadata.unwrap();
    assert_eq!(m.filter, "envoy.filters.http.rbac");
    assert_eq!(m.path, ["istio_ext_authz_shadow_effective_policy_id"]);
    assert!(m.value.matches("istio-ext-authz-ns-policy"));
}

#[test]
fn http_service_and_errors() {
    let c = compiled(serde_json::json!({
        "http_service": {"server_uri": {"uri": "http://authz.local:8000", "cluster": "authz", "timeout": "1s"}, "path_prefix": "/check"},
        "status_on_error": {"code": 503},
        "failure_mode_allow": true
    }))
    .unwrap();
    assert_eq!(
        c.service,
        Service::Http {
            cluster: "authz".into(),
            authority: "authz.local:8000".into(),
            path_prefix: "/check".into(),
            timeout: Duration::from_secs(1)
        }
    );
    assert_eq!(c.status_on_error, 503);
    assert!(c.failure_mode_allow);

    let err = compiled(serde_json::json!({})).unwrap_err();
    assert_eq!(err.errors[0].path, "ext_authz");
    let err = compiled(serde_json::json!({"grpc_service": {"google_grpc": {"target_uri": "x", "stat_prefix": "y"}}})).unwrap_err();
    assert_eq!(err.errors[0].path, "ext_authz.grpc_service.google_grpc");
}

#[test]
fn per_route_settings() {
    let per_route = |json| {
        let c: ExtAuthzPerRoute = shunt_config::message_from_json(json).unwrap();
        compile_per_route(&c, &JsonPath::new("r"), &mut Diagnostics::default())
    };
    assert!(
        per_route(serde_json::json!({"disabled": true}))
            .unwrap()
            .disabled
    );
    let p = per_route(serde_json::json!({"check_settings": {"context_extensions": {"k": "v"}}}))
        .unwrap();
    assert_eq!(p.context_extensions.get("k").map(String::as_str), Some("v"));
    assert!(!p.disabled);
}

#[test]
fn check_request_carries_the_request() {
    let mut headers = HeaderMap::new();
    headers.append("x-a", "1".parse().unwrap());
    headers.append("x-a", "2".parse().unwrap());
    let input = CheckInput {
        source: Some("10.0.0.1:5000".parse().unwrap()),
        destination: Some("10.0.0.2:80".parse().unwrap()),
        source_principal: "spiffe://cluster.local/ns/default/sa/sleep",
        method: "POST",
        path: "/p?q=1",
        host: "svc",
        scheme: "http",
        protocol: "HTTP/1.1",
        headers: Some(&headers),
        body: Some(b"hello"),
        stream_id: 7,
        ..Default::default()
    };
    let r = request(&input);
    let a = r.attributes.unwrap();
    let http = a.request.unwrap().http.unwrap();
    assert_eq!(http.headers["x-a"], "1,2");
    assert_eq!(http.headers[":path"], "/p?q=1");
    assert_eq!(http.query, "q=1");
    assert_eq!(http.body, "hello");
    assert_eq!(http.size, 5);
    assert_eq!(http.id, "7");
    assert_eq!(
        a.source.unwrap().principal,
        "spiffe://cluster.local/ns/default/sa/sleep"
    );
}

#[test]
fn verdicts_from_check_responses() {
    let ok: CheckResponse = shunt_config::message_from_json(serde_json::json!({
        "status": {"code": 0},
        "ok_response": {
            "headers": [
                {"header": {"key": "x-set", "value": "s"}},
                {"header": {"key": "x-app", "value": "a"}, "append": true}
            ],
            "headers_to_remove": ["x-secret", ":path", "host"],
            "response_headers_to_add": [{"header": {"key": "x-down", "value": "d"}}]
        }
    }))
    .unwrap();
    let Verdict::Allow(allowed) = verdict(&ok) else {
        panic!("allowed")
    };
    assert_eq!(allowed.remove, ["x-secret"]);
    let mut h = HeaderMap::new();
    h.insert("x-set", "old".parse().unwrap());
    h.insert("x-app", "old".parse().unwrap());
    apply(&mut h, &allowed.upstream);
    assert_eq!(h.get_all("x-set").iter().count(), 1);
    assert_eq!(h["x-set"], "s");
    assert_eq!(h["x-app"], "old,a", "appended as Envoy's appendCopy does");
    let mut absent = HeaderMap::new();
    apply(&mut absent, &allowed.upstream);
    assert!(
        !absent.contains_key("x-app"),
        "appends only to a present header"
    );
    assert_eq!(
        allowed.downstream,
        [HeaderChange {
            name: "x-down".into(),
            value: "d".into(),
            apply: Apply::Set
        }]
    );

    let denied: CheckResponse = shunt_config::message_from_json(serde_json::json!({
        "status": {"code": 7},
        "denied_response": {"status": {"code": "Unauthorized"}, "body": "no", "headers": [{"header": {"key": "x-why", "value": "because"}}]}
    }))
    .unwrap();
    let Verdict::Deny(d) = verdict(&denied) else {
        panic!("denied")
    };
    assert_eq!((d.status, d.body), (401, Bytes::from("no")));
    assert_eq!(d.headers[0].name, "x-why");
    let bare: CheckResponse =
        shunt_config::message_from_json(serde_json::json!({"status": {"code": 16}})).unwrap();
    assert!(matches!(verdict(&bare), Verdict::Deny(d) if d.status == 403 && d.body.is_empty()));
}

#[test]
fn grpc_frames_round_trip() {
    let r: CheckResponse =
        shunt_config::message_from_json(serde_json::json!({"status": {"code": 3}})).unwrap();
    let framed = grpc::frame(&r);
    assert_eq!(framed[0], 0);
    assert_eq!(grpc::unframe::<CheckResponse>(framed).unwrap(), r);
    assert!(grpc::unframe::<CheckResponse>(Bytes::from_static(b"\0\0\0")).is_err());
}
