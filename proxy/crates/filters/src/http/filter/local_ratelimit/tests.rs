//! The local rate limit's config: defaults and refusals.

use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit;
use hyper::StatusCode;
use serde_json::json;

use super::compile;
use shunt_config::{Diagnostics, JsonPath};

fn compiled(config: serde_json::Value) -> (Option<super::Limit>, Diagnostics) {
    let proto: LocalRateLimit =
        shunt_config::message_from_json(config).expect("LocalRateLimit JSON");
    let mut problems = Diagnostics::default();
    let limit = compile(&proto, &JsonPath::new("local_ratelimit"), &mut problems);
    (limit, problems)
}

#[test]
fn defaults_and_bucket() {
    let (limit, problems) = compiled(json!({"stat_prefix": "rl",
        "token_bucket": {"max_tokens": 2, "fill_interval": "60s"}}));
    let limit = limit.unwrap_or_else(|| panic!("{problems:?}"));
    assert_eq!(limit.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limit.enabled.numerator, 0, "absent filter_enabled is 0 %");
    let bucket = limit.bucket.unwrap();
    assert!(bucket.consume() && bucket.consume());
    assert!(!bucket.consume(), "two tokens, no refill within a minute");
    assert_eq!(bucket.remaining(), 0);
}

#[test]
fn descriptors_are_refused_by_path() {
    let (limit, problems) = compiled(json!({"stat_prefix": "rl",
        "descriptors": [{"entries": [{"key": "k", "value": "v"}],
            "token_bucket": {"max_tokens": 1, "fill_interval": "1s"}}]}));
    assert!(limit.is_none());
    assert!(
        format!("{problems:?}").contains("descriptors"),
        "{problems:?}"
    );
}
