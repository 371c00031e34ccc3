//! The global rate limit filter's config and decisions, without a connection.

use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3::RateLimit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    DescriptorStatus, RateLimit as Limit,
};
use envoy_types::pb::google::protobuf::Duration;
use serde_json::json;

use super::*;

fn compiled(config: serde_json::Value) -> (Option<RateLimitConfig>, Diagnostics) {
    let proto: RateLimit = shunt_config::message_from_json(config).expect("RateLimit JSON");
    let mut problems = Diagnostics::default();
    let compiled = compile(&proto, &JsonPath::new("ratelimit"), &mut problems);
    (compiled, problems)
}

fn service() -> serde_json::Value {
    json!({"grpc_service": {"envoy_grpc": {"cluster_name": "rls"}}, "transport_api_version": "V3"})
}

#[test]
fn defaults_are_envoys() {
    let (config, problems) = compiled(json!({"domain": "d", "rate_limit_service": service()}));
    assert!(problems.errors.is_empty(), "{problems:?}");
    let config = config.unwrap();
    assert_eq!(
        config.service.timeout,
        Some(std::time::Duration::from_millis(20))
    );
    assert_eq!(config.service.authority, "rls");
    assert_eq!(config.rate_limited_status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(config.status_on_error, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(config.x_envoy_ratelimited_header && !config.x_ratelimit_headers);
    assert_eq!(config.request_type, RequestType::Both);
}

#[test]
fn a_rate_limited_status_below_400_is_429() {
    let (config, _) = compiled(json!({"domain": "d", "rate_limit_service": service(),
        "rate_limited_status": {"code": 302}}));
    assert_eq!(
        config.unwrap().rate_limited_status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[test]
fn errors_name_their_path() {
    for (config, path) in [
        (json!({"rate_limit_service": service()}), "ratelimit.domain"),
        (json!({"domain": "d"}), "ratelimit.rate_limit_service"),
        (
            json!({"domain": "d", "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "rls"}}}}),
            "ratelimit.rate_limit_service.transport_api_version",
        ),
        (
            json!({"domain": "d", "stage": 11, "rate_limit_service": service()}),
            "ratelimit.stage",
        ),
        (
            json!({"domain": "d", "request_type": "all", "rate_limit_service": service()}),
            "ratelimit.request_type",
        ),
    ] {
        let (compiled, problems) = compiled(config.clone());
        assert!(compiled.is_none(), "{config}");
        assert!(
            problems.errors.iter().any(|e| e.path == path),
            "{config}: {:?}",
            problems.errors
        );
    }
}

fn status(limit: u32, remaining: u32, reset: i64, unit: Unit, name: &str) -> DescriptorStatus {
    DescriptorStatus {
        code: 1,
        current_limit: Some(Limit {
            name: name.into(),
            requests_per_unit: limit,
            unit: unit as i32,
        }),
        limit_remaining: remaining,
        duration_until_reset: Some(Duration {
            seconds: reset,
            nanos: 0,
        }),
        quota: None,
    }
}

#[test]
fn x_ratelimit_headers_show_the_limit_closest_to_its_end() {
    let headers = x_ratelimit_headers(&[
        status(10, 7, 30, Unit::Minute, ""),
        status(1000, 2, 3000, Unit::Hour, "per-ip"),
        DescriptorStatus::default(),
    ]);
    assert_eq!(
        headers,
        vec![
            (
                "x-ratelimit-limit",
                "1000, 10;w=60, 1000;w=3600;name=\"per-ip\"".to_owned()
            ),
            ("x-ratelimit-remaining", "2".to_owned()),
            ("x-ratelimit-reset", "3000".to_owned()),
        ]
    );
    assert!(x_ratelimit_headers(&[DescriptorStatus::default()]).is_empty());
}
