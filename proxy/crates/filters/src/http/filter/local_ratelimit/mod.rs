//! Envoy's HTTP local rate limit filter (`envoy.filters.http.local_ratelimit`), as an
//! EnvoyFilter adds it: a token bucket per filter config (the listener's, or a route's
//! own `LocalRateLimit` in `typed_per_filter_config`, which replaces it there),
//! `filter_enabled` / `filter_enforced` fractions (absent: 0 %), the 429 (or
//! `status`) answer `local_rate_limited` with `response_headers_to_add`, the request
//! headers added when a limited request is let through unenforced, and the
//! `x-ratelimit-*` headers (DRAFT_VERSION_03). Stats, as Envoy names them:
//! `<stat_prefix>.http_local_rate_limit.{enabled,enforced,rate_limited,ok}`.

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
use envoy_types::pb::envoy::extensions::filters::http::local_ratelimit::v3::LocalRateLimit;
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};

use super::factory::{CompileCtx, Factory};
use super::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders, ResponseHeaders,
    RouteSpecificConfig, StreamCtx,
};
use crate::common::percent::Percent;
use crate::common::token_bucket::TokenBucket;
use crate::http::header_rules::{self, HeaderRules};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::access_log::ResponseFlag;
use shunt_core::stats::Store;

#[cfg(test)]
mod tests;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit";

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[TYPE_NAME],
    compile_per_route: Some(compile_route),
};

/// One compiled `LocalRateLimit` (the listener's or a route's).
#[derive(Debug)]
pub struct Limit {
    pub stat_prefix: String,
    pub status: StatusCode,
    /// `None`: no bucket, every request passes.
    pub bucket: Option<TokenBucket>,
    pub enabled: Percent,
    pub enforced: Percent,
    pub request_headers_when_not_enforced: HeaderRules,
    pub response_headers: HeaderRules,
    pub x_ratelimit_headers: bool,
}

#[derive(Debug)]
struct RouteLimit(Arc<Limit>);

impl RouteSpecificConfig for RouteLimit {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn fraction(f: Option<&RuntimeFractionalPercent>) -> Percent {
    Percent::from_proto(f.and_then(|f| f.default_value.as_ref()))
}

pub fn compile(
    config: &LocalRateLimit,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Limit> {
    let errors_before = problems.errors.len();
    for (set, field) in [
        (!config.descriptors.is_empty(), "descriptors"),
        (!config.rate_limits.is_empty(), "rate_limits"),
        (
            config.local_cluster_rate_limit.is_some(),
            "local_cluster_rate_limit",
        ),
        (
            config.local_rate_limit_per_downstream_connection,
            "local_rate_limit_per_downstream_connection",
        ),
    ] {
        if set {
            problems.error(path.field(field), format!("{field} is not implemented"));
        }
    }
    if config.enable_retry_after_header {
        problems.warning(
            path.field("enable_retry_after_header"),
            "not implemented; ignored",
        );
    }
    let status = match config.status.as_ref().map(|s| s.code) {
        None | Some(0) => StatusCode::TOO_MANY_REQUESTS,
        Some(code) => match u16::try_from(code)
            .ok()
            .and_then(|c| StatusCode::from_u16(c).ok())
        {
            Some(s) if s.as_u16() >= 400 => s,
            _ => {
                problems.error(
                    path.field("status").field("code"),
                    format!("{code} is not an error status"),
                );
                return None;
            }
        },
    };
    let bucket = match &config.token_bucket {
        Some(b) => Some(TokenBucket::compile(
            b,
            &path.field("token_bucket"),
            problems,
        )?),
        None => None,
    };
    let request_headers_when_not_enforced = header_rules::compile(
        &config.request_headers_to_add_when_not_enforced,
        &[],
        path,
        "request",
        problems,
    );
    let response_headers = header_rules::compile(
        &config.response_headers_to_add,
        &[],
        path,
        "response",
        problems,
    );
    (problems.errors.len() == errors_before).then(|| Limit {
        stat_prefix: config.stat_prefix.clone(),
        status,
        bucket,
        enabled: fraction(config.filter_enabled.as_ref()),
        enforced: fraction(config.filter_enforced.as_ref()),
        request_headers_when_not_enforced,
        response_headers,
        x_ratelimit_headers: config.enable_x_ratelimit_headers == 1,
    })
}

#[derive(Debug)]
struct Config {
    limit: Arc<Limit>,
    stats: Store,
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: LocalRateLimit = decode(any, path, problems)?;
    if config.stat_prefix.is_empty() {
        problems.error(path.field("stat_prefix"), "is required");
        return None;
    }
    Some(Arc::new(Config {
        limit: Arc::new(compile(&config, path, problems)?),
        stats: ctx.stats.clone(),
    }))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let config: LocalRateLimit = decode(any, path, problems)?;
    Some(Arc::new(RouteLimit(Arc::new(compile(
        &config, path, problems,
    )?))))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(LocalRateLimitFilter {
            limit: self.limit.clone(),
            stats: self.stats.clone(),
            applied: None,
        })
    }
}

struct LocalRateLimitFilter {
    limit: Arc<Limit>,
    stats: Store,
    /// The limit the request went through, for the response's `x-ratelimit-*`.
    applied: Option<Arc<Limit>>,
}

impl LocalRateLimitFilter {
    fn count(&self, limit: &Limit, name: &str) {
        self.stats
            .counter(&format!(
                "{}.http_local_rate_limit.{name}",
                limit.stat_prefix
            ))
            .inc();
    }
}

impl HttpFilter for LocalRateLimitFilter {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let limit = match ctx.route_config::<RouteLimit>() {
            Some(RouteLimit(limit)) => limit.clone(),
            None => self.limit.clone(),
        };
        if !limit.enabled.hit(fastrand::u64(..)) {
            return Flow::CONTINUE;
        }
        self.count(&limit, "enabled");
        self.applied = Some(limit.clone());
        if limit.bucket.as_ref().is_none_or(TokenBucket::consume) {
            self.count(&limit, "ok");
            return Flow::CONTINUE;
        }
        self.count(&limit, "rate_limited");
        if !limit.enforced.hit(fastrand::u64(..)) {
            limit
                .request_headers_when_not_enforced
                .apply(&mut request.headers);
            return Flow::CONTINUE;
        }
        self.count(&limit, "enforced");
        let mut reply = LocalReply::new(limit.status, "local_rate_limited", "local_rate_limited")
            .with_flag(ResponseFlag::RateLimited);
        limit.response_headers.apply(&mut reply.headers);
        FilterStatus::Reply(reply).into()
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let Some(limit) = &self.applied else {
            return FilterStatus::Continue;
        };
        let Some(bucket) = limit.bucket.as_ref().filter(|_| limit.x_ratelimit_headers) else {
            return FilterStatus::Continue;
        };
        for (name, value) in [
            ("x-ratelimit-limit", u64::from(bucket.max_tokens)),
            ("x-ratelimit-remaining", u64::from(bucket.remaining())),
            ("x-ratelimit-reset", bucket.reset_seconds()),
        ] {
            response
                .headers
                .insert(HeaderName::from_static(name), HeaderValue::from(value));
        }
        FilterStatus::Continue
    }
}
