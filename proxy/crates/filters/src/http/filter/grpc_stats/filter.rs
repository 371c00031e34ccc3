//! The gRPC stats filter on a stream: decides at the request's head whether the call
//! is tracked (a gRPC content type, a routed cluster, a `/<service>/<method>` path),
//! then counts messages as the bodies stream by and the call's status from the
//! trailers (or a trailers-only response head), as Envoy's `GrpcStatsFilter`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::grpc_stats::v3::FilterConfig;
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::HeaderMap;

use super::{FILTER_STATE_KEY, FrameCounter, GrpcStatsConfig, TYPE_NAME, compile};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, RequestHeaders, ResponseHeaders, StreamCtx,
};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::stats::Store;
use shunt_core::stream_info::{FilterStateObject, LifeSpan};

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[],
    compile_per_route: None,
};

#[derive(Debug)]
struct Config {
    config: Arc<GrpcStatsConfig>,
    stats: Store,
    /// The clusters whose stats are under another name (`alt_stat_name`), as known
    /// when the listener was compiled.
    stat_names: Arc<HashMap<Arc<str>, Arc<str>>>,
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: FilterConfig = decode(any, path, problems)?;
    let stat_names = ctx
        .clusters
        .alt_stat_names()
        .map(|(name, alt)| (name.clone(), alt.clone()))
        .collect();
    Some(Arc::new(Config {
        config: Arc::new(compile(&config, path, problems)?),
        stats: ctx.stats.clone(),
        stat_names: Arc::new(stat_names),
    }))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(GrpcStats {
            config: self.config.clone(),
            stats: self.stats.clone(),
            stat_names: self.stat_names.clone(),
            tracked: None,
            grpc_request: false,
            grpc_response: false,
            request: FrameCounter::default(),
            response: FrameCounter::default(),
            started: Instant::now(),
        })
    }
}

/// The message counts as filter state (Envoy's `GrpcStatsObject`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcStatsObject {
    pub request_message_count: u64,
    pub response_message_count: u64,
}

impl FilterStateObject for GrpcStatsObject {
    fn serialize_as_string(&self) -> Option<String> {
        Some(format!(
            "{},{}",
            self.request_message_count, self.response_message_count
        ))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct GrpcStats {
    config: Arc<GrpcStatsConfig>,
    stats: Store,
    stat_names: Arc<HashMap<Arc<str>, Arc<str>>>,
    /// `cluster.<name>.grpc.<service>.<method>.` (or without the method) when the
    /// call is tracked.
    tracked: Option<String>,
    grpc_request: bool,
    grpc_response: bool,
    request: FrameCounter,
    response: FrameCounter,
    started: Instant,
}

impl GrpcStats {
    fn add(&self, stat: &str, n: u64) {
        if let Some(prefix) = &self.tracked {
            self.stats.counter(&format!("{prefix}{stat}")).add(n);
        }
    }

    /// Envoy's `chargeStat`: by the status's value, success or failure, and total.
    fn charge_status(&self, headers: &HeaderMap) {
        let Some(prefix) = &self.tracked else {
            return;
        };
        let Some(status) = headers.get("grpc-status") else {
            return;
        };
        let status = String::from_utf8_lossy(status.as_bytes());
        self.add(&status, 1);
        self.add(if status == "0" { "success" } else { "failure" }, 1);
        self.add("total", 1);
        if self.config.enable_upstream_stats {
            let ms = self.started.elapsed().as_secs_f64() * 1000.0;
            self.stats
                .histogram(&format!("{prefix}upstream_rq_time"))
                .record(ms);
        }
    }

    fn write_filter_state(&self, ctx: &mut StreamCtx) {
        if !self.config.emit_filter_state {
            return;
        }
        let object = GrpcStatsObject {
            request_message_count: self.request.count(),
            response_message_count: self.response.count(),
        };
        if let Err(err) = ctx.info.filter_state.set(
            FILTER_STATE_KEY,
            Arc::new(object),
            false,
            LifeSpan::FilterChain,
        ) {
            tracing::debug!(%err, "grpc_stats: filter state not written");
        }
    }
}

impl HttpFilter for GrpcStats {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        self.started = Instant::now();
        self.grpc_request = super::is_grpc_content_type(&request.headers);
        if self.grpc_request
            && let Some(cluster) = ctx
                .route
                .as_ref()
                .and_then(|r| r.cluster_name(&request.headers))
            && let Some(method) = self.config.method_prefix(&request.path)
        {
            // Envoy counts under the cluster's stats scope: its observability name.
            let cluster = self.stat_names.get(&cluster).unwrap_or(&cluster);
            self.tracked = Some(format!("cluster.{cluster}.grpc.{method}"));
        }
        Flow::CONTINUE
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        // Envoy's `isGrpcResponseHeader`: a trailers-only answer carries a status; any
        // other is a 200 with a gRPC content type.
        self.grpc_response = if end_stream {
            response.headers.contains_key("grpc-status")
        } else {
            response.status == hyper::StatusCode::OK
                && super::is_grpc_content_type(&response.headers)
        };
        self.charge_status(&response.headers);
        FilterStatus::Continue
    }

    fn observes_body(&self) -> bool {
        true
    }

    fn on_request_data(&mut self, data: &[u8], ctx: &mut StreamCtx) {
        if !self.grpc_request {
            return;
        }
        let started = self.request.inspect(data);
        if started > 0 {
            self.write_filter_state(ctx);
            self.add("request_message_count", started);
        }
    }

    fn on_response_data(&mut self, data: &[u8], ctx: &mut StreamCtx) {
        if !self.grpc_response {
            return;
        }
        let started = self.response.inspect(data);
        if started > 0 {
            self.write_filter_state(ctx);
            self.add("response_message_count", started);
        }
    }

    fn on_response_trailers(&mut self, trailers: &HeaderMap, _ctx: &mut StreamCtx) {
        self.charge_status(trailers);
    }
}
