//! The local rate limit's config: defaults and refusals.

use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit;
use hyper::StatusCode;
use serde_json::json;

use super::{Decider, compile, request_allowed};
use crate::common::ratelimit::{Descriptor, Entry};
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
fn matched_descriptors_take_from_their_buckets_slowest_first() {
    let (limit, problems) = compiled(json!({"stat_prefix": "rl",
        "token_bucket": {"max_tokens": 10, "fill_interval": "60s"},
        "descriptors": [
            {"entries": [{"key": "k", "value": "fast"}],
             "token_bucket": {"max_tokens": 5, "tokens_per_fill": 5, "fill_interval": "60s"}},
            {"entries": [{"key": "k", "value": "slow"}],
             "token_bucket": {"max_tokens": 1, "fill_interval": "120s"}}]}));
    let limit = limit.unwrap_or_else(|| panic!("{problems:?}"));
    let request = |values: &[&str]| -> Vec<Descriptor> {
        values
            .iter()
            .map(|v| Descriptor {
                entries: vec![Entry::new("k", *v)],
            })
            .collect()
    };
    // Both match: the slow bucket decides (and its headers are shown).
    assert_eq!(
        request_allowed(&limit, &request(&["fast", "slow"])),
        (true, Decider::Descriptor(1))
    );
    assert_eq!(
        request_allowed(&limit, &request(&["fast", "slow"])),
        (false, Decider::Descriptor(1))
    );
    // Nothing matched: the filter's own bucket.
    assert_eq!(
        request_allowed(&limit, &request(&["other"])),
        (true, Decider::Default)
    );
    assert_eq!(
        limit.descriptors[0].bucket.remaining(),
        4,
        "taken once: the refused request stopped at the slow bucket"
    );
    // The default bucket was taken from by every allowed request (always_consume).
    assert_eq!(limit.bucket.as_ref().unwrap().remaining(), 8);
}

#[test]
fn descriptor_errors_name_their_path() {
    for (descriptors, path) in [
        (
            json!([{"entries": [{"key": "k", "value": ""}],
            "token_bucket": {"max_tokens": 1, "fill_interval": "60s"}}]),
            "local_ratelimit.descriptors[0].entries[0].value",
        ),
        (
            json!([{"entries": [{"key": "k", "value": "v"}],
            "token_bucket": {"max_tokens": 1, "fill_interval": "90s"}}]),
            "local_ratelimit.descriptors[0].token_bucket.fill_interval",
        ),
        (
            json!([{"entries": [{"key": "k", "value": "v"}]}]),
            "local_ratelimit.descriptors[0].token_bucket",
        ),
        (
            json!([{"entries": [{"key": "k", "value": "v"}],
            "token_bucket": {"max_tokens": 1, "fill_interval": "60s"}},
            {"entries": [{"key": "k", "value": "v"}],
            "token_bucket": {"max_tokens": 1, "fill_interval": "60s"}}]),
            "local_ratelimit.descriptors[1]",
        ),
    ] {
        let (limit, problems) = compiled(json!({"stat_prefix": "rl",
            "token_bucket": {"max_tokens": 1, "fill_interval": "60s"},
            "descriptors": descriptors}));
        assert!(limit.is_none(), "{descriptors}");
        assert!(
            problems.errors.iter().any(|e| e.path == path),
            "{path}: {:?}",
            problems.errors
        );
    }
}
