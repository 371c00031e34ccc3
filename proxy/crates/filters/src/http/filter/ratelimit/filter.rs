//! The global rate limit filter on a stream (Envoy's `ratelimit.cc`): the request's
//! descriptors (the route's `rate_limits` of the filter's stage, and the virtual
//! host's as `vh_rate_limits` says), one `ShouldRateLimit` call when there are any,
//! and its answer applied: the headers the service adds upstream or downstream, the
//! `x-ratelimit-*` headers, the rate limited or failed local reply.

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3::{
    RateLimit, RateLimitPerRoute,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::header::{CONTENT_TYPE, HeaderName, HeaderValue};

use super::{
    PER_ROUTE_TYPE_NAME, PerRoute, RateLimitConfig, RequestType, TYPE_NAME, compile,
    compile_per_route, x_ratelimit_headers,
};
use crate::common::ratelimit::Descriptor;
use crate::common::ratelimit::client::{self, Answer, LimitStatus};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders, ResponseHeaders,
    RouteSpecificConfig, StreamCtx,
};
use crate::http::rate_limit_policy::{Filter, Inputs, VhRateLimits, route_descriptors};
use crate::http::route::Action;
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::access_log::ResponseFlag;
use shunt_core::stats::Store;
use shunt_upstream::Cluster;

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[PER_ROUTE_TYPE_NAME],
    compile_per_route: Some(compile_route),
};

#[derive(Debug)]
struct RouteSettings(PerRoute);

impl RouteSpecificConfig for RouteSettings {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug)]
struct Config {
    limit: Arc<RateLimitConfig>,
    /// The rate limit service's cluster as compiled with the listener; `None`: it did
    /// not exist then, and every call fails.
    cluster: Option<Arc<Cluster>>,
    /// The node's `cluster` (`source_cluster` actions).
    local_cluster: Arc<str>,
    stats: Store,
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: RateLimit = decode(any, path, problems)?;
    let limit = compile(&config, path, problems)?;
    let cluster = ctx.clusters.get(limit.service.cluster.as_str()).cloned();
    if cluster.is_none() {
        problems.warning(
            path.field("rate_limit_service"),
            format!(
                "cluster {:?} of the rate limit service is not known: calls fail until the listener is updated",
                limit.service.cluster
            ),
        );
    }
    Some(Arc::new(Config {
        limit: Arc::new(limit),
        cluster,
        local_cluster: Arc::from(ctx.node.cluster.as_str()),
        stats: ctx.stats.clone(),
    }))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let config: RateLimitPerRoute = decode(any, path, problems)?;
    Some(Arc::new(RouteSettings(compile_per_route(
        &config, path, problems,
    )?)))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(RateLimitFilter {
            limit: self.limit.clone(),
            cluster: self.cluster.clone(),
            local_cluster: self.local_cluster.clone(),
            stats: self.stats.clone(),
            response_headers: Vec::new(),
            replied: false,
        })
    }
}

struct RateLimitFilter {
    limit: Arc<RateLimitConfig>,
    cluster: Option<Arc<Cluster>>,
    local_cluster: Arc<str>,
    stats: Store,
    /// What the answer adds to the response (or the local reply), in order.
    response_headers: Vec<(HeaderName, HeaderValue)>,
    /// The filter answered the request itself (rate limited, or the call failed).
    replied: bool,
}

fn header(name: &str, value: &str) -> Option<(HeaderName, HeaderValue)> {
    Some((
        HeaderName::from_bytes(name.as_bytes()).ok()?,
        HeaderValue::from_str(value).ok()?,
    ))
}

impl RateLimitFilter {
    /// Envoy's `initiateCall` up to the call: the request's descriptors, and the
    /// cluster its stats go under. `None`: no call.
    fn descriptors(
        &self,
        request: &RequestHeaders,
        ctx: &StreamCtx,
    ) -> Option<(Vec<Descriptor>, String)> {
        let internal = request
            .headers
            .get("x-envoy-internal")
            .is_some_and(|v| v == "true");
        match self.limit.request_type {
            RequestType::Internal if !internal => return None,
            RequestType::External if internal => return None,
            _ => {}
        }
        let routed = ctx.route.as_ref()?;
        // Envoy calls only for a route entry (not a redirect or a direct response).
        let route = routed.route();
        if !matches!(route.action, Action::Route(_)) {
            return None;
        }
        let route_cluster = routed.cluster_name(&request.headers)?;
        let inputs = Inputs {
            local_cluster: &self.local_cluster,
            route_cluster: &route_cluster,
            request: request.view(),
            info: &ctx.info,
        };
        let vh = ctx
            .route_config::<RouteSettings>()
            .map_or(VhRateLimits::Override, |r| r.0.vh_rate_limits);
        let filter = Filter {
            stage: self.limit.stage,
            local: false,
        };
        let descriptors = route_descriptors(
            &route.rate_limits,
            &routed.virtual_host().rate_limits,
            vh,
            filter,
            &inputs,
        );
        (!descriptors.is_empty()).then(|| (descriptors, route_cluster.to_string()))
    }

    fn count(&self, cluster: &str, what: &str) {
        let prefix = &self.limit.stat_prefix;
        let name = if prefix.is_empty() {
            format!("cluster.{cluster}.ratelimit.{what}")
        } else {
            format!("cluster.{cluster}.ratelimit.{prefix}.{what}")
        };
        self.stats.counter(&name).inc();
    }

    /// Envoy's `complete`: the answer counted and applied.
    fn complete(
        &mut self,
        answer: Answer,
        route_cluster: &str,
        request: &mut RequestHeaders,
    ) -> FilterStatus {
        let limit = self.limit.clone();
        self.response_headers = answer
            .response_headers
            .iter()
            .filter_map(|(n, v)| header(n, v))
            .collect();
        match answer.status {
            LimitStatus::Ok => self.count(route_cluster, "ok"),
            LimitStatus::Error => self.count(route_cluster, "error"),
            LimitStatus::OverLimit => {
                self.count(route_cluster, "over_limit");
                self.charge_429(route_cluster);
                if limit.x_envoy_ratelimited_header {
                    self.response_headers.push((
                        HeaderName::from_static("x-envoy-ratelimited"),
                        HeaderValue::from_static("true"),
                    ));
                }
            }
        }
        if limit.x_ratelimit_headers {
            let added = x_ratelimit_headers(&answer.statuses);
            self.response_headers
                .extend(added.iter().filter_map(|(n, v)| header(n, v)));
        }
        match answer.status {
            LimitStatus::OverLimit if limit.enforced.is_none_or(|p| p.hit(fastrand::u64(..))) => {
                self.replied = true;
                FilterStatus::Reply(
                    LocalReply::new(
                        limit.rate_limited_status,
                        answer.body,
                        "request_rate_limited",
                    )
                    .with_flag(ResponseFlag::RateLimited),
                )
            }
            LimitStatus::Error if limit.failure_mode_deny => {
                self.replied = true;
                FilterStatus::Reply(
                    LocalReply::new(limit.status_on_error, answer.body, "rate_limiter_error")
                        .with_flag(ResponseFlag::RateLimitServiceError),
                )
            }
            LimitStatus::Error => {
                self.count(route_cluster, "failure_mode_allowed");
                self.add_request_headers(&answer, request);
                FilterStatus::Continue
            }
            _ => {
                self.add_request_headers(&answer, request);
                FilterStatus::Continue
            }
        }
    }

    fn add_request_headers(&self, answer: &Answer, request: &mut RequestHeaders) {
        for (name, value) in &answer.request_headers {
            if let Some((name, value)) = header(name, value) {
                request.headers.append(name, value);
            }
        }
    }

    /// Envoy charges the route's cluster with the 429 it answers in its place, as an
    /// internal request's.
    fn charge_429(&self, cluster: &str) {
        for name in [
            "upstream_rq_429",
            "upstream_rq_4xx",
            "upstream_rq_completed",
            "internal.upstream_rq_429",
            "internal.upstream_rq_4xx",
            "internal.upstream_rq_completed",
        ] {
            self.stats
                .counter(&format!("cluster.{cluster}.{name}"))
                .inc();
        }
    }
}

impl HttpFilter for RateLimitFilter {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        if !self.limit.enabled.is_none_or(|p| p.hit(fastrand::u64(..))) {
            return Flow::CONTINUE;
        }
        let Some((descriptors, route_cluster)) = self.descriptors(request, ctx) else {
            return Flow::CONTINUE;
        };
        let per_route = ctx.route_config::<RouteSettings>().map(|r| r.0.clone());
        Flow::Pending(Box::pin(async move {
            let domain = per_route
                .as_ref()
                .and_then(|p| p.domain.as_deref())
                .unwrap_or(&self.limit.domain);
            let answer = client::should_rate_limit(
                &self.limit.service,
                self.cluster.as_ref(),
                domain,
                &descriptors,
            )
            .await;
            self.complete(answer, &route_cluster, request)
        }))
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let headers = std::mem::take(&mut self.response_headers);
        // The service's content-type wins over the local reply's text/plain.
        if self.replied && headers.iter().any(|(n, _)| n == CONTENT_TYPE) {
            response.headers.remove(CONTENT_TYPE);
        }
        for (name, value) in headers {
            response.headers.append(name, value);
        }
        if self.replied {
            self.limit.response_headers.apply(&mut response.headers);
        }
        FilterStatus::Continue
    }
}
