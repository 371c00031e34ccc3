//! The fault filter on a stream: the compiled [`FaultConfig`] (the route's override
//! wins) applied in Envoy's order, with Envoy's stats under
//! `http.<stat_prefix>.fault.` (and `fault.<downstream cluster>.` per
//! `x-envoy-downstream-service-cluster`).

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::fault::v3::HttpFault;
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};

use super::{Abort, Applies, DOWNSTREAM_CLUSTER, FaultConfig, TYPE_NAME, compile};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders,
    RouteSpecificConfig, StreamCtx,
};
use crate::http::route::{Action, ClusterChoice};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::access_log::ResponseFlag;
use shunt_core::stats::{Counter, Gauge, Store};

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[TYPE_NAME],
    compile_per_route: Some(compile_route),
};

#[derive(Debug)]
struct Stats {
    store: Store,
    /// `http.<stat_prefix>.fault.`
    prefix: String,
    aborts_injected: Counter,
    delays_injected: Counter,
    faults_overflow: Counter,
    active_faults: Gauge,
}

#[derive(Debug)]
struct Config {
    fault: Arc<FaultConfig>,
    stats: Arc<Stats>,
}

#[derive(Debug)]
struct RouteFault(Arc<FaultConfig>);

impl RouteSpecificConfig for RouteFault {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: HttpFault = decode(any, path, problems)?;
    let fault = compile(&config, path, problems)?;
    let prefix = format!("http.{}.fault.", ctx.stat_prefix);
    let stat = |name: &str| format!("{prefix}{name}");
    let stats = Stats {
        store: ctx.stats.clone(),
        aborts_injected: ctx.stats.counter(&stat("aborts_injected")),
        delays_injected: ctx.stats.counter(&stat("delays_injected")),
        faults_overflow: ctx.stats.counter(&stat("faults_overflow")),
        active_faults: ctx.stats.gauge(&stat("active_faults")),
        prefix: prefix.clone(),
    };
    ctx.stats.counter(&stat("response_rl_injected"));
    Some(Arc::new(Config {
        fault: Arc::new(fault),
        stats: Arc::new(stats),
    }))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let config: HttpFault = decode(any, path, problems)?;
    Some(Arc::new(RouteFault(Arc::new(compile(
        &config, path, problems,
    )?))))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(Fault {
            config: self.fault.clone(),
            stats: self.stats.clone(),
            active: false,
        })
    }
}

struct Fault {
    config: Arc<FaultConfig>,
    stats: Arc<Stats>,
    /// Counted in `active_faults` (until the stream ends).
    active: bool,
}

impl Fault {
    fn count(&self, downstream: Option<&str>, what: &str, counter: &Counter) {
        counter.inc();
        if let Some(cluster) = downstream {
            self.stats
                .store
                .counter(&format!("{}{cluster}.{what}", self.stats.prefix))
                .inc();
        }
    }

    fn activate(&mut self) {
        if !self.active {
            self.active = true;
            self.stats.active_faults.inc();
        }
    }
}

impl Drop for Fault {
    fn drop(&mut self) {
        if self.active {
            self.stats.active_faults.dec();
        }
    }
}

fn route_cluster(ctx: &StreamCtx) -> Option<&str> {
    match &ctx.route.as_ref()?.route().action {
        Action::Route(action) => match &action.cluster {
            ClusterChoice::Cluster(name) => Some(name),
            _ => None,
        },
        _ => None,
    }
}

/// Envoy's local reply for an abort: the HTTP status, or for a gRPC status, a gRPC
/// trailers-only answer to a gRPC request and a plain 200 to any other.
fn abort_reply(abort: Abort, body: &str, grpc_request: bool) -> LocalReply {
    let details = "fault_filter_abort";
    match abort {
        Abort::Http(code) => LocalReply::new(
            StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            body.to_owned(),
            details,
        ),
        Abort::Grpc(code) if grpc_request => LocalReply::new(StatusCode::OK, "", details)
            .with_header(
                HeaderName::from_static("content-type"),
                HeaderValue::from_static("application/grpc"),
            )
            .with_header(
                HeaderName::from_static("grpc-status"),
                HeaderValue::from(code),
            )
            .with_header(
                HeaderName::from_static("grpc-message"),
                HeaderValue::from_str(body).unwrap_or(HeaderValue::from_static("")),
            ),
        Abort::Grpc(_) => LocalReply::new(StatusCode::OK, body.to_owned(), details),
    }
    .with_flag(ResponseFlag::FaultInjected)
}

impl HttpFilter for Fault {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        if let Some(route) = ctx.route_config::<RouteFault>() {
            self.config = route.0.clone();
        }
        let config = self.config.clone();
        let view = request.view();
        if config.applies(&view, route_cluster(ctx)) == Applies::No {
            return Flow::CONTINUE;
        }
        let downstream = config
            .downstream_cluster_stats
            .then(|| view.header(DOWNSTREAM_CLUSTER))
            .flatten()
            .filter(|c| !c.is_empty())
            .map(std::borrow::Cow::into_owned);
        let grpc_request = view
            .header("content-type")
            .is_some_and(|t| t.starts_with("application/grpc"));
        let overflow = |this: &Self| {
            let over = config.overflows(this.stats.active_faults.value());
            if over {
                this.stats.faults_overflow.inc();
            }
            over
        };
        if let Some(delay) = config.delay(&view, fastrand::u64(..))
            && !overflow(self)
        {
            self.activate();
            self.count(
                downstream.as_deref(),
                "delays_injected",
                &self.stats.delays_injected,
            );
            ctx.info.response_flags.push(ResponseFlag::DelayInjected);
            return Flow::Pending(Box::pin(async move {
                tokio::time::sleep(delay).await;
                // After a delay, an abort is decided on its own.
                let view = request.view();
                match config.abort(&view, fastrand::u64(..)) {
                    Some((abort, body)) => {
                        self.count(
                            downstream.as_deref(),
                            "aborts_injected",
                            &self.stats.aborts_injected,
                        );
                        FilterStatus::Reply(abort_reply(abort, body, grpc_request))
                    }
                    None => FilterStatus::Continue,
                }
            }));
        }
        if let Some((abort, body)) = config.abort(&view, fastrand::u64(..))
            && !overflow(self)
        {
            self.activate();
            self.count(
                downstream.as_deref(),
                "aborts_injected",
                &self.stats.aborts_injected,
            );
            return FilterStatus::Reply(abort_reply(abort, body, grpc_request)).into();
        }
        Flow::CONTINUE
    }
}
