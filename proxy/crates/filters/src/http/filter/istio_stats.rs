//! istio-proxy's `istio.stats` HTTP filter (`stats.PluginConfig` in `http_filters`):
//! at the end of each stream, Istio's request metrics (`istio_requests_total`,
//! `istio_request_duration_milliseconds`, `istio_request_bytes`, `istio_response_bytes`)
//! under Istio's labels. The peer is what the peer metadata filter (or the TCP metadata
//! exchange of the connection) found: the downstream peer on the inbound side, the
//! upstream peer on the outbound side.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;
use hyper::HeaderMap;

use super::factory::{CompileCtx, Factory};
use super::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, RequestHeaders, ResponseHeaders, StreamCtx,
};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::istio_stats::expr::{Attributes, Segment};
use shunt_core::istio_stats::labels::{self, ClusterService, HttpOutcome, Observation};
use shunt_core::istio_stats::{Metric, Recorder, Reporter};
use shunt_core::peer::PeerInfo;
use shunt_core::peer::filter_state::Side;
use shunt_core::stream_info::StreamInfo;

pub const TYPE: &str = "stats.PluginConfig";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
    per_route_types: &[],
    compile_per_route: None,
};

#[derive(Debug)]
struct IstioStats(Arc<Recorder>);

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let recorder =
        shunt_core::istio_stats::compile(any, ctx.stats, ctx.node, ctx.inbound, path, problems)?;
    Some(Arc::new(IstioStats(Arc::new(recorder))))
}

impl HttpFilterConfig for IstioStats {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(Active {
            recorder: self.0.clone(),
            request: None,
            grpc: false,
            grpc_status: None,
        })
    }
}

struct Active {
    recorder: Arc<Recorder>,
    /// The request head as it reached this filter (the Host, and what custom
    /// dimensions read).
    request: Option<RequestHeaders>,
    grpc: bool,
    grpc_status: Option<u32>,
}

fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// The peer recorded on `side`, in the stream's filter state or its connection's.
fn peer(info: &StreamInfo, side: Side) -> Option<&shunt_core::peer::Workload> {
    info.filter_state
        .get_as::<PeerInfo>(side.peer_key())
        .or_else(|| {
            info.connection
                .filter_state
                .get_as::<PeerInfo>(side.peer_key())
        })
        .map(|p| &p.0)
}

impl HttpFilter for Active {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        self.grpc = is_grpc(&request.headers);
        self.request = Some(request.clone());
        Flow::CONTINUE
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        self.grpc_status = response
            .headers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        FilterStatus::Continue
    }

    fn encode_trailers(&mut self, trailers: &mut HeaderMap, _ctx: &mut StreamCtx) -> FilterStatus {
        if let Some(status) = trailers
            .get("grpc-status")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
        {
            self.grpc_status = Some(status);
        }
        FilterStatus::Continue
    }

    fn on_stream_complete(&mut self, info: &StreamInfo) {
        let config = self.recorder.config();
        let client = config.reporter == Reporter::ClientSidecar;
        let peer = peer(
            info,
            if client {
                Side::Upstream
            } else {
                Side::Downstream
            },
        );
        let (peer_principal, local_principal) = if client {
            // The upstream TLS session the request went over.
            (
                info.upstream_peer_uri_sans.first().cloned(),
                info.upstream_local_uri_sans.first().cloned(),
            )
        } else {
            shunt_core::istio_stats::downstream_principals(&info.connection)
        };
        let service = shunt_core::interned::EncodedMetadata::of(&info.upstream_cluster_metadata)
            .and_then(shunt_core::istio_stats::cluster_service);
        let obs = Observation {
            peer,
            endpoint: None,
            host: self.request.as_ref().map(|r| r.authority.as_str()),
            route_name: info.route_name.as_deref(),
            cluster_name: info.upstream_cluster.as_deref(),
            cluster_service: service.as_ref().map(|(host, name)| ClusterService {
                host: Some(host.as_str()),
                name: name.as_deref(),
            }),
            peer_principal: peer_principal.as_deref(),
            local_principal: local_principal.as_deref(),
        };
        let flags: Vec<&str> = info.response_flags.iter().map(|f| f.code()).collect();
        let flags = flags.join(",");
        let outcome = HttpOutcome {
            grpc: self.grpc,
            response_code: info.response_code.unwrap_or(0),
            grpc_status: self.grpc_status,
            response_flags: &flags,
        };
        let tags = labels::http(config, self.recorder.node(), &obs, &outcome);
        let attributes = StreamAttributes {
            request: self.request.as_ref(),
            info,
        };
        let recorder = &self.recorder;
        recorder.add(Metric::RequestsTotal, &tags, &attributes, 1);
        let millis = info.start.elapsed().as_secs_f64() * 1000.0;
        recorder.record(
            Metric::RequestDurationMilliseconds,
            &tags,
            &attributes,
            millis,
        );
        recorder.record(
            Metric::RequestBytes,
            &tags,
            &attributes,
            (info.request_head_bytes + info.bytes_received) as f64,
        );
        recorder.record(
            Metric::ResponseBytes,
            &tags,
            &attributes,
            (info.response_head_bytes + info.bytes_sent) as f64,
        );
        recorder.record_custom(&attributes);
    }
}

/// The attributes custom dimensions read: `request.host`, `request.path`,
/// `request.method`, `request.headers['name']`, `response.code`,
/// `request.total_size`, `response.total_size`.
struct StreamAttributes<'a> {
    request: Option<&'a RequestHeaders>,
    info: &'a StreamInfo,
}

impl Attributes for StreamAttributes<'_> {
    fn attribute(&self, path: &[Segment]) -> Option<String> {
        let field = |i: usize| match path.get(i) {
            Some(Segment::Field(f)) => Some(f.as_str()),
            _ => None,
        };
        match (field(0)?, field(1)?) {
            ("request", "host") => self.request.map(|r| r.authority.clone()),
            ("request", "path") => self.request.map(|r| r.path.clone()),
            ("request", "method") => self.request.map(|r| r.method.to_string()),
            ("request", "headers") => {
                let Some(Segment::Index(name)) = path.get(2) else {
                    return None;
                };
                let value = self.request?.headers.get(name.as_str())?;
                value.to_str().ok().map(str::to_owned)
            }
            ("request", "total_size") => {
                Some((self.info.request_head_bytes + self.info.bytes_received).to_string())
            }
            ("response", "total_size") => {
                Some((self.info.response_head_bytes + self.info.bytes_sent).to_string())
            }
            ("response", "code") => self.info.response_code.map(|c| c.to_string()),
            _ => None,
        }
    }
}
