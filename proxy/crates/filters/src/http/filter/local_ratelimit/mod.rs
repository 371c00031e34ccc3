//! Envoy's HTTP local rate limit filter (`envoy.filters.http.local_ratelimit`), as an
//! EnvoyFilter adds it: a token bucket per filter config (the listener's, or a route's
//! own `LocalRateLimit` in `typed_per_filter_config`, which replaces it there),
//! `filter_enabled` / `filter_enforced` fractions (absent: 0 %), the 429 (or
//! `status`) answer `local_rate_limited` with `response_headers_to_add`, the request
//! headers added when a limited request is let through unenforced, and the
//! `x-ratelimit-*` headers (DRAFT_VERSION_03). With `descriptors`, the route's (and
//! virtual host's) `rate_limits` actions make the request's descriptors; each one equal
//! to a configured descriptor takes a token from that descriptor's bucket (the
//! slowest to refill first), and the filter's own bucket is taken from too when none
//! matched or `always_consume_default_token_bucket` (default true) ([`request_allowed`]).
//! Stats, as Envoy names them:
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
use crate::common::ratelimit::{Descriptor, Entry};
use crate::common::token_bucket::TokenBucket;
use crate::http::header_rules::{self, HeaderRules};
use crate::http::rate_limit_policy::{self, Filter, Inputs, MAX_STAGE, VhRateLimits};
use crate::http::route::Action;
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
    /// Each with its own bucket, matched against the route's descriptors.
    pub descriptors: Vec<LocalDescriptor>,
    pub stage: u32,
    pub vh_rate_limits: VhRateLimits,
    pub always_consume_default_bucket: bool,
}

#[derive(Debug)]
pub struct LocalDescriptor {
    pub descriptor: Descriptor,
    pub bucket: TokenBucket,
}

/// The bucket that decided a request: the filter's own or a descriptor's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decider {
    Default,
    Descriptor(usize),
}

impl Limit {
    fn bucket_of(&self, decider: Decider) -> Option<&TokenBucket> {
        match decider {
            Decider::Default => self.bucket.as_ref(),
            Decider::Descriptor(i) => self.descriptors.get(i).map(|d| &d.bucket),
        }
    }
}

/// Envoy's `LocalRateLimiterImpl::requestAllowed`: the configured descriptors equal to
/// one of the request's, slowest to refill first, each take a token (the first that
/// has none refuses); then the filter's own bucket when none matched or
/// `always_consume_default_bucket`. Returns whether the request may pass and the
/// bucket its `x-ratelimit-*` headers describe.
pub fn request_allowed(limit: &Limit, request: &[Descriptor]) -> (bool, Decider) {
    let mut matched: Vec<usize> = limit
        .descriptors
        .iter()
        .enumerate()
        .filter(|(_, d)| request.contains(&d.descriptor))
        .map(|(i, _)| i)
        .collect();
    matched.sort_by(|a, b| {
        let rate = |i: &usize| limit.descriptors[*i].bucket.fill_rate();
        rate(a).total_cmp(&rate(b))
    });
    for &i in &matched {
        if !limit.descriptors[i].bucket.consume() {
            return (false, Decider::Descriptor(i));
        }
    }
    let decider = matched
        .first()
        .map_or(Decider::Default, |i| Decider::Descriptor(*i));
    if (matched.is_empty() || limit.always_consume_default_bucket)
        && !limit.bucket.as_ref().is_none_or(TokenBucket::consume)
    {
        return (false, Decider::Default);
    }
    (true, decider)
}

fn local_descriptors(
    config: &LocalRateLimit,
    default_interval: Option<std::time::Duration>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Vec<LocalDescriptor> {
    let mut out: Vec<LocalDescriptor> = Vec::new();
    for (i, d) in config.descriptors.iter().enumerate() {
        let d_path = path.field("descriptors").index(i);
        let mut entries = Vec::new();
        for (k, e) in d.entries.iter().enumerate() {
            if e.value.is_empty() {
                problems.error(
                    d_path.field("entries").index(k).field("value"),
                    "dynamic descriptors (an empty value) are not implemented",
                );
            }
            entries.push(Entry::new(&e.key, &e.value));
        }
        if entries.is_empty() {
            problems.error(d_path.field("entries"), "needs at least one entry");
            continue;
        }
        if d.shadow_mode {
            problems.error(d_path.field("shadow_mode"), "is not implemented");
        }
        let Some(b) = &d.token_bucket else {
            problems.error(d_path.field("token_bucket"), "is required");
            continue;
        };
        let Some(bucket) = TokenBucket::compile(b, &d_path.field("token_bucket"), problems) else {
            continue;
        };
        if let Some(default) = default_interval
            && bucket.fill_interval().as_millis() % default.as_millis().max(1) != 0
        {
            problems.error(
                d_path.field("token_bucket").field("fill_interval"),
                "must be a multiple of the filter's token_bucket.fill_interval",
            );
        }
        let descriptor = Descriptor { entries };
        if out.iter().any(|o| o.descriptor == descriptor) {
            problems.error(&d_path, "a duplicate of an earlier descriptor");
            continue;
        }
        out.push(LocalDescriptor { descriptor, bucket });
    }
    out
}

#[derive(Debug)]
struct RouteLimit(Arc<Limit>);

impl RouteSpecificConfig for RouteLimit {
    fn as_any(&self) -> &dyn Any {
        self
    }

    /// Its token buckets.
    fn holds_state(&self) -> bool {
        true
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
        (!config.rate_limits.is_empty(), "rate_limits"),
        (
            config.max_dynamic_descriptors.is_some(),
            "max_dynamic_descriptors",
        ),
        (
            config.rate_limited_as_resource_exhausted,
            "rate_limited_as_resource_exhausted",
        ),
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
    if config.stage > MAX_STAGE {
        problems.error(
            path.field("stage"),
            format!("{} is above {MAX_STAGE}", config.stage),
        );
    }
    let vh_rate_limits = VhRateLimits::from_i32(config.vh_rate_limits).unwrap_or_else(|| {
        problems.error(path.field("vh_rate_limits"), "is not a known option");
        VhRateLimits::Override
    });
    let descriptors = local_descriptors(
        config,
        bucket.as_ref().map(TokenBucket::fill_interval),
        path,
        problems,
    );
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
        descriptors,
        stage: config.stage,
        vh_rate_limits,
        always_consume_default_bucket: config
            .always_consume_default_token_bucket
            .is_none_or(|b| b.value),
    })
}

#[derive(Debug)]
struct Config {
    limit: Arc<Limit>,
    stats: Store,
    /// The node's `cluster` (`source_cluster` actions).
    local_cluster: Arc<str>,
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
        local_cluster: Arc::from(ctx.node.cluster.as_str()),
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
            local_cluster: self.local_cluster.clone(),
            applied: None,
        })
    }
}

struct LocalRateLimitFilter {
    limit: Arc<Limit>,
    stats: Store,
    local_cluster: Arc<str>,
    /// The limit the request went through and the bucket that decided, for the
    /// response's `x-ratelimit-*`.
    applied: Option<(Arc<Limit>, Decider)>,
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

    /// The request's descriptors from its route's `rate_limits` (none when the limit
    /// has no descriptors to match them against).
    fn descriptors(
        &self,
        limit: &Limit,
        request: &RequestHeaders,
        ctx: &StreamCtx,
    ) -> Vec<Descriptor> {
        if limit.descriptors.is_empty() {
            return Vec::new();
        }
        let Some(routed) = ctx.route.as_ref() else {
            return Vec::new();
        };
        let route = routed.route();
        if !matches!(route.action, Action::Route(_)) {
            return Vec::new();
        }
        let route_cluster = routed.cluster_name(&request.headers).unwrap_or_default();
        let inputs = Inputs {
            local_cluster: &self.local_cluster,
            route_cluster: &route_cluster,
            request: request.view(),
            info: &ctx.info,
        };
        let filter = Filter {
            stage: limit.stage,
            local: true,
        };
        rate_limit_policy::route_descriptors(
            &route.rate_limits,
            &routed.virtual_host().rate_limits,
            limit.vh_rate_limits,
            filter,
            &inputs,
        )
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
        let descriptors = self.descriptors(&limit, request, ctx);
        let (allowed, decider) = request_allowed(&limit, &descriptors);
        self.applied = Some((limit.clone(), decider));
        if allowed {
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
        let Some((limit, decider)) = &self.applied else {
            return FilterStatus::Continue;
        };
        let Some(bucket) = limit
            .bucket_of(*decider)
            .filter(|_| limit.x_ratelimit_headers)
        else {
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
