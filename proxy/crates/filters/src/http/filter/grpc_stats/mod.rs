//! Envoy's gRPC statistics filter (`envoy.filters.http.grpc_stats`): counts gRPC
//! calls by their `grpc-status` and their messages in each direction, under the
//! routed cluster's `cluster.<name>.grpc.` namespace, as Envoy's `Grpc::Context`
//! names them:
//!
//! - `grpc.[<service>.<method>.]<status>`, `...success` or `...failure`, `...total`
//!   for every call that ends with a `grpc-status` (in the trailers, or a
//!   trailers-only response);
//! - `grpc.[<service>.<method>.]request_message_count` / `response_message_count`
//!   for every message that starts in the body;
//! - `grpc.[<service>.<method>.]upstream_rq_time` with `enable_upstream_stats`.
//!
//! The `<service>.<method>` part is there for every method with
//! `stats_for_all_methods`, for the allowlisted ones with
//! `individual_method_stats_allowlist`, and never by default.
//!
//! With `emit_filter_state` the message counts are the stream's filter state
//! `envoy.filters.http.grpc_stats` (`"<request>,<response>"` as a string), which
//! Istio's stats read.

pub mod filter;

use std::collections::HashSet;

use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::FilterConfig;
use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::filter_config::PerMethodStatSpecifier;
use hyper::HeaderMap;

use shunt_config::{Diagnostics, JsonPath};

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.grpc_stats.v3.FilterConfig";
/// The filter state key of the message counts (Envoy's filter name).
pub const FILTER_STATE_KEY: &str = "envoy.filters.http.grpc_stats";

/// Which calls get their `<service>.<method>` in the stat names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerMethod {
    /// None: every call counts under `grpc.` alone.
    None,
    All {
        /// `replace_dots_in_grpc_service_name`.
        replace_dots: bool,
    },
    /// `individual_method_stats_allowlist`: (service, method).
    Allowlist(HashSet<(String, String)>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcStatsConfig {
    pub emit_filter_state: bool,
    pub enable_upstream_stats: bool,
    pub per_method: PerMethod,
}

pub fn compile(
    config: &FilterConfig,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<GrpcStatsConfig> {
    let per_method = match &config.per_method_stat_specifier {
        None => PerMethod::None,
        Some(PerMethodStatSpecifier::StatsForAllMethods(all)) if all.value => PerMethod::All {
            replace_dots: config.replace_dots_in_grpc_service_name,
        },
        Some(PerMethodStatSpecifier::StatsForAllMethods(_)) => PerMethod::None,
        Some(PerMethodStatSpecifier::IndividualMethodStatsAllowlist(list)) => {
            let mut allowed = HashSet::new();
            for (i, service) in list.services.iter().enumerate() {
                if service.name.is_empty() {
                    problems.error(
                        path.field("individual_method_stats_allowlist")
                            .field("services")
                            .index(i)
                            .field("name"),
                        "must not be empty",
                    );
                    return None;
                }
                for method in &service.method_names {
                    allowed.insert((service.name.clone(), method.clone()));
                }
            }
            PerMethod::Allowlist(allowed)
        }
    };
    Some(GrpcStatsConfig {
        emit_filter_state: config.emit_filter_state,
        enable_upstream_stats: config.enable_upstream_stats,
        per_method,
    })
}

impl GrpcStatsConfig {
    /// The stat name part between `grpc.` and the stat for a call to `path`: `None`
    /// when the call is not tracked at all (not `/<service>/<method>`), `Some("")`
    /// when it counts without its method, else `Some("<service>.<method>.")`.
    pub fn method_prefix(&self, path: &str) -> Option<String> {
        let (service, method) = service_and_method(path)?;
        Some(match &self.per_method {
            PerMethod::None => String::new(),
            PerMethod::All { replace_dots } => {
                let service = if *replace_dots {
                    service.replace('.', "_")
                } else {
                    service.to_owned()
                };
                format!("{service}.{method}.")
            }
            PerMethod::Allowlist(allowed) => {
                if allowed.contains(&(service.to_owned(), method.to_owned())) {
                    format!("{service}.{method}.")
                } else {
                    String::new()
                }
            }
        })
    }
}

/// `/<service>/<method>` (the query, if any, left out): Envoy's
/// `resolveServiceAndMethod`, which wants exactly two non-empty parts.
pub fn service_and_method(path: &str) -> Option<(&str, &str)> {
    let path = path.split('?').next().unwrap_or_default();
    let mut parts = path.split('/').filter(|p| !p.is_empty());
    let service = parts.next()?;
    let method = parts.next()?;
    parts.next().is_none().then_some((service, method))
}

/// `application/grpc`, or `application/grpc+<codec>` / `application/grpc;...`.
pub fn is_grpc_content_type(headers: &HeaderMap) -> bool {
    headers
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.strip_prefix("application/grpc")
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['+', ';']))
        })
}

/// Envoy's `Grpc::FrameInspector`: counts the messages that start in a stream of
/// gRPC frames (a 1-byte flag, a 4-byte big-endian length, the message), however the
/// bytes are split across reads. A message counts when its flag byte is seen.
#[derive(Debug, Default, Clone)]
pub struct FrameCounter {
    count: u64,
    /// Header bytes still to read of the current frame (0: at a frame's start).
    header_left: u8,
    length: u32,
    /// Message bytes still to skip.
    body_left: u64,
}

impl FrameCounter {
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Reads `data`; returns how many messages started in it.
    pub fn inspect(&mut self, mut data: &[u8]) -> u64 {
        let before = self.count;
        while !data.is_empty() {
            if self.body_left > 0 {
                let skip = usize::try_from(self.body_left)
                    .unwrap_or(usize::MAX)
                    .min(data.len());
                self.body_left -= skip as u64;
                data = &data[skip..];
                continue;
            }
            if self.header_left == 0 {
                // The flag byte: a new message.
                self.count += 1;
                self.header_left = 4;
                self.length = 0;
                data = &data[1..];
                continue;
            }
            self.length = (self.length << 8) | u32::from(data[0]);
            self.header_left -= 1;
            data = &data[1..];
            if self.header_left == 0 {
                self.body_left = u64::from(self.length);
            }
        }
        self.count - before
    }
}

#[cfg(test)]
mod tests;
