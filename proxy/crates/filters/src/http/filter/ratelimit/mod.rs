//! Envoy's global rate limit filter (`envoy.filters.http.ratelimit`), as an EnvoyFilter
//! adds it (Istio's "Enabling Rate Limits using Envoy"): the config compiled
//! ([`RateLimitConfig`], the per-route `RateLimitPerRoute`), Envoy's decisions as
//! functions (which of the route's and virtual host's `rate_limits` apply, the
//! `x-ratelimit-*` headers from the service's descriptor statuses), and the filter on a
//! stream ([`filter`]): the descriptors of the filter's `stage` go to the rate limit
//! service ([`crate::common::ratelimit`]); `OVER_LIMIT` answers 429 (or
//! `rate_limited_status`) with `x-envoy-ratelimited`; a failed call lets the request
//! through (`failure_mode_allowed`) unless `failure_mode_deny` (500, or
//! `status_on_error`). Stats under the route's cluster: `cluster.<name>.ratelimit.*`.

use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3::{
    RateLimit, RateLimitPerRoute,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use hyper::StatusCode;

use crate::common::percent::Percent;
use crate::common::ratelimit::{self, Service};
use crate::http::header_rules::{self, HeaderRules};
use crate::http::rate_limit_policy::{MAX_STAGE, VhRateLimits};
use shunt_config::{Diagnostics, JsonPath};

pub mod filter;
#[cfg(test)]
mod tests;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.ratelimit.v3.RateLimit";
pub const PER_ROUTE_TYPE_NAME: &str =
    "envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute";

/// `request_type`: which requests the filter applies to, by `x-envoy-internal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestType {
    Both,
    Internal,
    External,
}

/// One compiled `RateLimit`.
#[derive(Debug)]
pub struct RateLimitConfig {
    pub domain: String,
    pub stage: u32,
    pub request_type: RequestType,
    pub service: Service,
    pub failure_mode_deny: bool,
    pub x_ratelimit_headers: bool,
    pub x_envoy_ratelimited_header: bool,
    pub rate_limited_status: StatusCode,
    pub status_on_error: StatusCode,
    /// Added to the rate limited replies.
    pub response_headers: HeaderRules,
    /// `ratelimit.<stat_prefix>.` under the route's cluster when set.
    pub stat_prefix: String,
    /// `None`: always (Envoy's runtime default, 100 %).
    pub enabled: Option<Percent>,
    pub enforced: Option<Percent>,
}

/// A route's `RateLimitPerRoute`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerRoute {
    pub vh_rate_limits: VhRateLimits,
    /// Replaces the filter's `domain` when set.
    pub domain: Option<String>,
}

/// Compiles a `RateLimit`. `path`: its JSON path.
pub fn compile(
    config: &RateLimit,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<RateLimitConfig> {
    let errors_before = problems.errors.len();
    if config.domain.is_empty() {
        problems.error(path.field("domain"), "is required");
    }
    if config.stage > MAX_STAGE {
        problems.error(
            path.field("stage"),
            format!("{} is above {MAX_STAGE}", config.stage),
        );
    }
    let request_type = match config.request_type.as_str() {
        "" | "both" => RequestType::Both,
        "internal" => RequestType::Internal,
        "external" => RequestType::External,
        other => {
            problems.error(
                path.field("request_type"),
                format!("{other:?} is not internal, external or both"),
            );
            RequestType::Both
        }
    };
    for (set, field) in [
        (!config.rate_limits.is_empty(), "rate_limits"),
        (
            config.failure_mode_deny_percent.is_some(),
            "failure_mode_deny_percent",
        ),
        (
            config.rate_limited_as_resource_exhausted,
            "rate_limited_as_resource_exhausted",
        ),
        (
            config.enable_retry_after_header,
            "enable_retry_after_header",
        ),
    ] {
        if set {
            problems.error(path.field(field), "is not implemented");
        }
    }
    if !config.metadata_namespace.is_empty() {
        problems.warning(
            path.field("metadata_namespace"),
            "the service's dynamic metadata is not kept; ignored",
        );
    }
    let service = ratelimit::service(
        config.rate_limit_service.as_ref(),
        config.timeout.as_ref(),
        path,
        problems,
    );
    // Envoy: a rate limited status below 400 is 429.
    let rate_limited_status = config
        .rate_limited_status
        .as_ref()
        .and_then(|s| u16::try_from(s.code).ok())
        .filter(|c| *c >= 400)
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
    let status_on_error = match config.status_on_error.as_ref().map(|s| s.code) {
        None | Some(0) => StatusCode::INTERNAL_SERVER_ERROR,
        Some(code) => match u16::try_from(code)
            .ok()
            .and_then(|c| StatusCode::from_u16(c).ok())
        {
            Some(s) => s,
            None => {
                problems.error(
                    path.field("status_on_error").field("code"),
                    format!("{code} is not an HTTP status"),
                );
                StatusCode::INTERNAL_SERVER_ERROR
            }
        },
    };
    let response_headers = header_rules::compile(
        &config.response_headers_to_add,
        &[],
        path,
        "response",
        problems,
    );
    let fraction =
        |f: &Option<envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent>| {
            f.as_ref()
                .map(|f| Percent::from_proto(f.default_value.as_ref()))
        };
    (problems.errors.len() == errors_before).then(|| RateLimitConfig {
        domain: config.domain.clone(),
        stage: config.stage,
        request_type,
        service: service.expect("no errors, so compiled"),
        failure_mode_deny: config.failure_mode_deny,
        x_ratelimit_headers: config.enable_x_ratelimit_headers == 1,
        x_envoy_ratelimited_header: !config.disable_x_envoy_ratelimited_header,
        rate_limited_status,
        status_on_error,
        response_headers,
        stat_prefix: config.stat_prefix.clone(),
        enabled: fraction(&config.filter_enabled),
        enforced: fraction(&config.filter_enforced),
    })
}

/// Compiles a `RateLimitPerRoute`.
pub fn compile_per_route(
    config: &RateLimitPerRoute,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<PerRoute> {
    if !config.rate_limits.is_empty() {
        problems.error(path.field("rate_limits"), "is not implemented");
        return None;
    }
    if config.override_option != 0 {
        problems.error(path.field("override_option"), "is not implemented");
        return None;
    }
    let Some(vh_rate_limits) = VhRateLimits::from_i32(config.vh_rate_limits) else {
        problems.error(path.field("vh_rate_limits"), "is not a known option");
        return None;
    };
    Some(PerRoute {
        vh_rate_limits,
        domain: (!config.domain.is_empty()).then(|| config.domain.clone()),
    })
}

/// The window of a limit's unit in seconds (0: unknown, left out of the policy).
fn window(unit: i32) -> u64 {
    match Unit::try_from(unit) {
        Ok(Unit::Second) => 1,
        Ok(Unit::Minute) => 60,
        Ok(Unit::Hour) => 3600,
        Ok(Unit::Day) => 86_400,
        Ok(Unit::Week) => 604_800,
        Ok(Unit::Month) => 2_592_000,
        Ok(Unit::Year) => 31_536_000,
        _ => 0,
    }
}

/// Envoy's `XRateLimitHeaderUtils::create` (DRAFT_VERSION_03): the status closest to
/// its limit gives `x-ratelimit-limit` (with every limit's quota policy),
/// `x-ratelimit-remaining` and `x-ratelimit-reset`; no status with a limit, no headers.
pub fn x_ratelimit_headers(statuses: &[DescriptorStatus]) -> Vec<(&'static str, String)> {
    let mut closest: Option<&DescriptorStatus> = None;
    let mut policy = String::new();
    for status in statuses {
        let Some(limit) = &status.current_limit else {
            continue;
        };
        if closest.is_none_or(|c| status.limit_remaining < c.limit_remaining) {
            closest = Some(status);
        }
        let window = window(limit.unit);
        if window != 0 {
            policy.push_str(&format!(", {};w={window}", limit.requests_per_unit));
            if !limit.name.is_empty() {
                policy.push_str(&format!(";name=\"{}\"", limit.name));
            }
        }
    }
    let Some(closest) = closest else {
        return Vec::new();
    };
    let limit = closest
        .current_limit
        .as_ref()
        .map_or(0, |l| l.requests_per_unit);
    let reset = closest
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds.max(0));
    vec![
        ("x-ratelimit-limit", format!("{limit}{policy}")),
        ("x-ratelimit-remaining", closest.limit_remaining.to_string()),
        ("x-ratelimit-reset", reset.to_string()),
    ]
}
