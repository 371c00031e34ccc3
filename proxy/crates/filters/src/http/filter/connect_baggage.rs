//! istio-proxy's `connect_baggage` HTTP filter (`io.istio.http.connect_baggage.Config`,
//! in the configs of istiods before 1.21): the downstream peer's workload, read from
//! a request's `baggage` header, becomes the stream's filter state
//! `wasm.downstream_peer` (and `wasm.downstream_peer_id` "unknown"), shared with the
//! upstream, where Istio's stats read the peer of an HBONE tunnel.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use super::factory::{CompileCtx, Factory};
use super::{Flow, HttpFilter, HttpFilterConfig, RequestHeaders, StreamCtx};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::peer::Workload;
use shunt_core::set_filter_state::store;
use shunt_core::stream_info::{FilterStateEntry, FilterStateObject, LifeSpan, StringAccessor};

pub const TYPE_NAME: &str = "io.istio.http.connect_baggage.Config";
pub const DOWNSTREAM_PEER: &str = "wasm.downstream_peer";
pub const DOWNSTREAM_PEER_ID: &str = "wasm.downstream_peer_id";

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile,
    per_route_types: &[],
    compile_per_route: None,
};

#[derive(Debug)]
struct ConnectBaggage;

fn compile(
    _any: &Any,
    _ctx: &CompileCtx<'_>,
    _path: &JsonPath,
    _problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    // The config has no fields.
    Some(Arc::new(ConnectBaggage))
}

impl HttpFilterConfig for ConnectBaggage {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(ConnectBaggage)
    }
}

/// The downstream peer a `baggage` header described.
#[derive(Debug, Clone)]
pub struct DownstreamPeer(pub Workload);

impl FilterStateObject for DownstreamPeer {
    fn serialize_as_string(&self) -> Option<String> {
        Some(self.0.baggage())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn shared(value: Arc<dyn FilterStateObject>) -> FilterStateEntry {
    FilterStateEntry {
        value,
        read_only: false,
        life_span: LifeSpan::FilterChain,
        shared_with_upstream: true,
        transitive: false,
    }
}

impl HttpFilter for ConnectBaggage {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        // Every baggage header, joined as one list (Envoy's getAllOfHeaderAsString).
        let values: Vec<&str> = request
            .headers
            .get_all("baggage")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        if values.is_empty() {
            return Flow::CONTINUE;
        }
        let peer = Workload::from_baggage(&values.join(","));
        let state = &mut ctx.info.filter_state;
        store(
            state,
            DOWNSTREAM_PEER,
            shared(Arc::new(DownstreamPeer(peer))),
        );
        let id = Arc::new(StringAccessor("unknown".into()));
        store(state, DOWNSTREAM_PEER_ID, shared(id));
        Flow::CONTINUE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::filter::StreamCtx;
    use shunt_core::stream_info::{Connection, StreamInfo};

    #[test]
    fn the_baggage_header_becomes_the_downstream_peer() {
        let connection =
            Connection::new("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        let mut ctx = StreamCtx::new(StreamInfo::new(Arc::new(connection)), None);
        let mut headers = hyper::HeaderMap::new();
        headers.append(
            "baggage",
            "k8s.deployment.name=productpage-v1,k8s.namespace.name=default"
                .parse()
                .unwrap(),
        );
        headers.append("baggage", "service.version=v1".parse().unwrap());
        let mut request = RequestHeaders {
            method: hyper::Method::GET,
            authority: "a".into(),
            path: "/".into(),
            scheme: "http",
            version: hyper::Version::HTTP_2,
            headers,
        };
        let mut filter = ConnectBaggage;
        let _ = filter.decode_headers(&mut request, true, &mut ctx);
        let peer = ctx
            .info
            .filter_state
            .get_as::<DownstreamPeer>(DOWNSTREAM_PEER)
            .expect("peer set");
        assert_eq!(peer.0.workload_name, "productpage-v1");
        assert_eq!(peer.0.namespace_name, "default");
        assert_eq!(peer.0.canonical_revision, "v1");
        let entry = ctx.info.filter_state.get(DOWNSTREAM_PEER_ID).unwrap();
        assert!(entry.shared_with_upstream);
        assert_eq!(
            entry.value.serialize_as_string().as_deref(),
            Some("unknown")
        );
    }
}
