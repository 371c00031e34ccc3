//! Envoy's fault injection filter (`envoy.filters.http.fault`,
//! `envoy.extensions.filters.http.fault.v3.HTTPFault`), as VirtualService fault
//! injection uses it: the config compiled once, and the decisions a request meets
//! (which faults apply, the delay, the abort) as functions of its headers and a random
//! draw, so they are tested without a clock or a connection.
//!
//! Envoy's order: the per-route config replaces the filter's; then `upstream_cluster`,
//! `downstream_nodes` (`x-envoy-downstream-service-node`) and `headers` must all match;
//! a delay comes first (flag DI), and after it, independently, an abort (flag FI);
//! `max_active_faults` counts requests being delayed or aborted. Header-controlled
//! faults read `x-envoy-fault-delay-request`, `x-envoy-fault-abort-request`,
//! `x-envoy-fault-abort-grpc-request` and their `-percentage` headers, which can lower
//! (never raise) the configured percentage.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::filters::common::fault::v3::fault_delay::FaultDelaySecifier;
use envoy_types::pb::envoy::extensions::filters::http::fault::v3::{
    HttpFault, fault_abort::ErrorType,
};

use crate::common::matcher::{HeaderMatcher, RequestView, header_matcher};
use crate::common::percent::Percent;
use shunt_config::{Diagnostics, JsonPath, convert};

pub mod filter;
#[cfg(test)]
mod tests;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.fault.v3.HTTPFault";

pub const HEADER_DELAY: &str = "x-envoy-fault-delay-request";
pub const HEADER_DELAY_PERCENTAGE: &str = "x-envoy-fault-delay-request-percentage";
pub const HEADER_ABORT: &str = "x-envoy-fault-abort-request";
pub const HEADER_ABORT_GRPC: &str = "x-envoy-fault-abort-grpc-request";
pub const HEADER_ABORT_PERCENTAGE: &str = "x-envoy-fault-abort-request-percentage";
pub const DOWNSTREAM_NODE: &str = "x-envoy-downstream-service-node";
pub const DOWNSTREAM_CLUSTER: &str = "x-envoy-downstream-service-cluster";

/// The local reply's body when the config names none.
pub const DEFAULT_ABORT_BODY: &str = "fault filter abort";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DelaySource {
    Fixed(Duration),
    /// Milliseconds from `x-envoy-fault-delay-request`.
    Header,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AbortSource {
    Http(u16),
    Grpc(u32),
    /// From `x-envoy-fault-abort-request` / `x-envoy-fault-abort-grpc-request`.
    Header,
}

/// An abort decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abort {
    Http(u16),
    /// Answered as gRPC: HTTP 200 with this `grpc-status` (trailers-only).
    Grpc(u32),
}

#[derive(Debug)]
pub struct Delay {
    pub source: DelaySource,
    pub percent: Percent,
}

#[derive(Debug)]
pub struct AbortConfig {
    pub source: AbortSource,
    pub percent: Percent,
    pub body: String,
}

/// One compiled `HTTPFault` (the filter's own or a route's override).
#[derive(Debug)]
pub struct FaultConfig {
    pub delay: Option<Delay>,
    pub abort: Option<AbortConfig>,
    pub upstream_cluster: Option<String>,
    pub headers: Vec<HeaderMatcher>,
    pub downstream_nodes: Vec<String>,
    /// `None`: no limit.
    pub max_active_faults: Option<u64>,
    pub downstream_cluster_stats: bool,
}

/// Whether a request is a candidate for faults at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// Some matcher (cluster, node, headers) says no.
    No,
    Yes,
}

/// Compiles an `HTTPFault`. `path` is the JSON path of the config.
pub fn compile(
    config: &HttpFault,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<FaultConfig> {
    let before = problems.errors.len();
    let delay = config.delay.as_ref().and_then(|d| {
        let d_path = path.field("delay");
        let source =
            match &d.fault_delay_secifier {
                Some(FaultDelaySecifier::FixedDelay(fixed)) => DelaySource::Fixed(
                    convert::duration(fixed, &d_path.field("fixed_delay"), problems)?,
                ),
                Some(FaultDelaySecifier::HeaderDelay(_)) => DelaySource::Header,
                None => {
                    problems.error(&d_path, "a delay needs fixed_delay or header_delay");
                    return None;
                }
            };
        Some(Delay {
            source,
            percent: Percent::from_proto(d.percentage.as_ref()),
        })
    });
    let abort = config.abort.as_ref().and_then(|a| {
        let a_path = path.field("abort");
        let source = match a.error_type {
            Some(ErrorType::HttpStatus(code)) if (200..600).contains(&code) => {
                AbortSource::Http(code as u16)
            }
            Some(ErrorType::HttpStatus(code)) => {
                problems.error(
                    a_path.field("http_status"),
                    format!("{code} is not an HTTP status in [200, 600)"),
                );
                return None;
            }
            Some(ErrorType::GrpcStatus(code)) => AbortSource::Grpc(code),
            Some(ErrorType::HeaderAbort(_)) => AbortSource::Header,
            None => {
                problems.error(
                    &a_path,
                    "an abort needs http_status, grpc_status or header_abort",
                );
                return None;
            }
        };
        Some(AbortConfig {
            source,
            percent: Percent::from_proto(a.percentage.as_ref()),
            body: if a.response_body.is_empty() {
                DEFAULT_ABORT_BODY.to_owned()
            } else {
                a.response_body.clone()
            },
        })
    });
    let headers = config
        .headers
        .iter()
        .enumerate()
        .filter_map(|(i, h)| header_matcher(h, &path.field("headers").index(i), problems))
        .collect();
    if config.response_rate_limit.is_some() {
        problems.warning(
            path.field("response_rate_limit"),
            "response rate limiting is not implemented: responses are not slowed",
        );
    }
    if problems.errors.len() > before {
        return None;
    }
    Some(FaultConfig {
        delay,
        abort,
        upstream_cluster: (!config.upstream_cluster.is_empty())
            .then(|| config.upstream_cluster.clone()),
        headers,
        downstream_nodes: config.downstream_nodes.clone(),
        max_active_faults: config.max_active_faults.map(|m| u64::from(m.value)),
        downstream_cluster_stats: !config.disable_downstream_cluster_stats,
    })
}

impl FaultConfig {
    /// Envoy's checks before any fault: the route's cluster, the downstream node, the
    /// header matchers. `cluster` is the route's cluster, if it has one.
    pub fn applies(&self, request: &RequestView<'_>, cluster: Option<&str>) -> Applies {
        if let Some(want) = &self.upstream_cluster
            && cluster != Some(want.as_str())
        {
            return Applies::No;
        }
        if !self.downstream_nodes.is_empty() {
            let node = request.header(DOWNSTREAM_NODE);
            if !node.is_some_and(|n| self.downstream_nodes.iter().any(|d| *d == n)) {
                return Applies::No;
            }
        }
        if !self.headers.iter().all(|m| m.matches(request)) {
            return Applies::No;
        }
        Applies::Yes
    }

    /// Whether another fault would exceed `max_active_faults`.
    pub fn overflows(&self, active: u64) -> bool {
        self.max_active_faults.is_some_and(|max| active >= max)
    }

    /// The delay for this request, if any (`random`: a uniform draw). A header delay
    /// without a parsable header, or a zero delay, is none.
    pub fn delay(&self, request: &RequestView<'_>, random: u64) -> Option<Duration> {
        let delay = self.delay.as_ref()?;
        let percent = match delay.source {
            DelaySource::Header => delay
                .percent
                .capped_by(request.header(HEADER_DELAY_PERCENTAGE)),
            DelaySource::Fixed(_) => delay.percent,
        };
        if !percent.hit(random) {
            return None;
        }
        let duration = match delay.source {
            DelaySource::Fixed(d) => d,
            DelaySource::Header => {
                Duration::from_millis(request.header(HEADER_DELAY)?.trim().parse::<u64>().ok()?)
            }
        };
        (!duration.is_zero()).then_some(duration)
    }

    /// The abort for this request, if any, and the body to answer with. A header abort
    /// takes an HTTP status in [200, 600) from `x-envoy-fault-abort-request`, else a
    /// gRPC status from `x-envoy-fault-abort-grpc-request`.
    pub fn abort(&self, request: &RequestView<'_>, random: u64) -> Option<(Abort, &str)> {
        let abort = self.abort.as_ref()?;
        let percent = match abort.source {
            AbortSource::Header => abort
                .percent
                .capped_by(request.header(HEADER_ABORT_PERCENTAGE)),
            _ => abort.percent,
        };
        if !percent.hit(random) {
            return None;
        }
        let decided = match abort.source {
            AbortSource::Http(code) => Abort::Http(code),
            AbortSource::Grpc(code) => Abort::Grpc(code),
            AbortSource::Header => {
                let http = request
                    .header(HEADER_ABORT)
                    .and_then(|h| h.trim().parse::<u64>().ok())
                    .filter(|code| (200..600).contains(code));
                match http {
                    Some(code) => Abort::Http(code as u16),
                    None => Abort::Grpc(
                        request
                            .header(HEADER_ABORT_GRPC)?
                            .trim()
                            .parse::<u32>()
                            .ok()?,
                    ),
                }
            }
        };
        Some((decided, &abort.body))
    }
}
