//! istio-proxy's HTTP peer metadata filter (`io.istio.http.peer_metadata.Config`, Istio's
//! HTTP `istio.metadata_exchange`): discovers the downstream peer from the request
//! (`x-envoy-peer-metadata` / `-id` headers, `baggage`) and the upstream peer from the
//! response, in the configured order, first found wins; records it as
//! `wasm.downstream_peer` / `wasm.upstream_peer` for the stats; removes the exchange
//! headers it read; and propagates this node's headers upstream (always) and downstream
//! (only when the request carried them), as istio-proxy does. Workload discovery finds
//! the peer by address in the workloads istiod serves over xDS
//! (`shunt_core::peer::workload_discovery`, on when the bootstrap has Istio's extension): the
//! downstream by the connection's remote address, the upstream by the host's.

use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};
use serde_json::Value;

use super::factory::{CompileCtx, Factory};
use super::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, RequestHeaders, ResponseHeaders, StreamCtx,
};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::peer::Workload;
use shunt_core::peer::filter_state::{self, Side};
use shunt_core::peer::headers::{
    BAGGAGE_HEADER, METADATA_HEADER, METADATA_ID_HEADER, decode_metadata, encode_metadata,
};
use shunt_core::peer::workload_discovery::WorkloadDiscovery;
use shunt_core::stream_info::{FilterState, LifeSpan};

pub const TYPE: &str = "io.istio.http.peer_metadata.Config";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
    per_route_types: &[],
    compile_per_route: None,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Discovery {
    IstioHeaders,
    Baggage,
    /// istio-proxy's workload metadata xDS.
    Workloads,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Propagation {
    skip_external_clusters: bool,
}

#[derive(Debug)]
struct PeerMetadata(Arc<Shared>);

fn discovery(
    methods: Option<&Value>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Vec<Discovery> {
    let mut out = Vec::new();
    for (i, method) in methods
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        if method.get("istio_headers").is_some() {
            out.push(Discovery::IstioHeaders);
        } else if method.get("baggage").is_some() {
            out.push(Discovery::Baggage);
        } else if method.get("workload_discovery").is_some() {
            out.push(Discovery::Workloads);
        } else {
            problems.warning(
                path.index(i),
                "no discovery method set; this entry finds no peer",
            );
        }
    }
    out
}

fn propagation(methods: Option<&Value>) -> Vec<Propagation> {
    methods
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|method| method.get("istio_headers"))
        .map(|headers| Propagation {
            skip_external_clusters: headers
                .get("skip_external_clusters")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        })
        .collect()
}

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let json = match shunt_config::any_to_json(any) {
        Ok(json) => json,
        Err(err) => {
            problems.error(path, format!("{TYPE}: {err}"));
            return None;
        }
    };
    let header = |text: String, what: &str, problems: &mut Diagnostics| {
        HeaderValue::try_from(text)
            .map_err(|err| {
                problems.error(
                    path,
                    format!("this node's {what} is not a header value: {err}"),
                )
            })
            .ok()
    };
    let id = header(ctx.node.id.clone(), "id", problems)?;
    let value = header(encode_metadata(&ctx.node.metadata), "metadata", problems)?;
    Some(Arc::new(PeerMetadata(Arc::new(Shared {
        downstream_discovery: discovery(
            json.get("downstream_discovery"),
            &path.field("downstream_discovery"),
            problems,
        ),
        upstream_discovery: discovery(
            json.get("upstream_discovery"),
            &path.field("upstream_discovery"),
            problems,
        ),
        downstream_propagation: propagation(json.get("downstream_propagation")),
        upstream_propagation: propagation(json.get("upstream_propagation")),
        id,
        value,
        workloads: ctx.node.workloads.clone(),
    }))))
}

impl HttpFilterConfig for PeerMetadata {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(Active {
            config: self.0.clone(),
            request_peer_received: false,
            request_peer_id_received: false,
        })
    }
}

#[derive(Debug)]
struct Shared {
    /// `x-envoy-peer-metadata-id` and `x-envoy-peer-metadata` for this node are `id`
    /// and `value`.
    downstream_discovery: Vec<Discovery>,
    upstream_discovery: Vec<Discovery>,
    downstream_propagation: Vec<Propagation>,
    upstream_propagation: Vec<Propagation>,
    id: HeaderValue,
    value: HeaderValue,
    /// The instance's workload index, for the `workload_discovery` method.
    workloads: Arc<WorkloadDiscovery>,
}

struct Active {
    config: Arc<Shared>,
    request_peer_received: bool,
    request_peer_id_received: bool,
}

/// The peer a method finds in `headers`, or at `address` (the downstream's or the
/// upstream host's), if any.
fn derive(
    method: Discovery,
    headers: &HeaderMap,
    address: Option<IpAddr>,
    workloads: &WorkloadDiscovery,
) -> Option<Workload> {
    match method {
        Discovery::IstioHeaders => {
            let value = headers.get(METADATA_HEADER)?.to_str().ok()?;
            if value.is_empty() {
                return None;
            }
            decode_metadata(value).ok().map(|node| node.workload())
        }
        Discovery::Baggage => {
            let values: Vec<&str> = headers
                .get_all(BAGGAGE_HEADER)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            (!values.is_empty()).then(|| Workload::from_baggage(&values.join(",")))
        }
        Discovery::Workloads => workloads.get(address?).map(|w| Workload::clone(&w)),
    }
}

fn discover(
    methods: &[Discovery],
    workloads: &WorkloadDiscovery,
    headers: &mut HeaderMap,
    address: Option<IpAddr>,
    state: &mut FilterState,
    side: Side,
) {
    if let Some(peer) = methods
        .iter()
        .find_map(|m| derive(*m, headers, address, workloads))
    {
        // istio-proxy records the id as "unknown": the stats only need it present.
        filter_state::set_peer(state, side, peer, "unknown", LifeSpan::FilterChain);
    }
    if methods.contains(&Discovery::IstioHeaders) {
        headers.remove(METADATA_ID_HEADER);
        headers.remove(METADATA_HEADER);
    }
}

/// Whether `skip_external_clusters` keeps the headers from the routed cluster: the
/// passthrough, or a cluster istiod marked `istio.external`.
fn external(ctx: &StreamCtx) -> bool {
    let Some(route) = &ctx.route else {
        return false;
    };
    let super::super::route::Action::Route(action) = &route.route().action else {
        return false;
    };
    matches!(&action.cluster, super::super::route::ClusterChoice::Cluster(name) if &**name == "PassthroughCluster")
}

impl HttpFilter for Active {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let config = &self.config;
        self.request_peer_id_received = request.headers.contains_key(METADATA_ID_HEADER);
        self.request_peer_received = request.headers.contains_key(METADATA_HEADER);
        discover(
            &config.downstream_discovery,
            &config.workloads,
            &mut request.headers,
            Some(ctx.info.connection.remote.ip()),
            &mut ctx.info.filter_state,
            Side::Downstream,
        );
        for method in &config.upstream_propagation {
            if method.skip_external_clusters && external(ctx) {
                continue;
            }
            request.headers.insert(
                HeaderName::from_static(METADATA_ID_HEADER),
                config.id.clone(),
            );
            request.headers.insert(
                HeaderName::from_static(METADATA_HEADER),
                config.value.clone(),
            );
        }
        Flow::CONTINUE
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let config = &self.config;
        discover(
            &config.upstream_discovery,
            &config.workloads,
            &mut response.headers,
            ctx.info.upstream_host.map(|host| host.ip()),
            &mut ctx.info.filter_state,
            Side::Upstream,
        );
        for _ in &config.downstream_propagation {
            if self.request_peer_id_received {
                response.headers.insert(
                    HeaderName::from_static(METADATA_ID_HEADER),
                    config.id.clone(),
                );
            }
            if self.request_peer_received {
                response.headers.insert(
                    HeaderName::from_static(METADATA_HEADER),
                    config.value.clone(),
                );
            }
        }
        FilterStatus::Continue
    }
}
