//! Istio's `istio.alpn` HTTP filter
//! (`istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig`): the ALPN list an
//! upstream TLS connection offers is replaced by the one configured for the HTTP
//! version the request goes upstream in (`istio-http/1.0`, `istio-http/1.1`,
//! `istio-h2`, ...), so an Istio server sidecar learns that it is talking to a
//! sidecar, unless the cluster's metadata says `istio.alpn_override: "false"`.
//!
//! As istio-proxy, the filter leaves its choice in the stream's filter state; the
//! router reads it ([`upstream_alpn`]) with the cluster it sends to, as does a
//! `set_filter_state` of `envoy.network.application_protocols` (a comma list).
//! Connections made with an override are pooled apart.

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::google::protobuf::{Any, value::Kind};
use hyper::Version;

use super::factory::{CompileCtx, Factory};
use super::{Flow, HttpFilter, HttpFilterConfig, RequestHeaders, StreamCtx};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::{FilterState, FilterStateObject, LifeSpan};
use shunt_upstream::Cluster;
use shunt_upstream::cluster::UpstreamProtocol;
use shunt_upstream::http_pool::Alpn;

pub const TYPE_NAME: &str = "istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig";
/// Envoy's filter state key of an ALPN override.
pub const APPLICATION_PROTOCOLS: &str = "envoy.network.application_protocols";
/// Where this filter leaves its per-version lists for the router.
const OVERRIDES_KEY: &str = "istio.alpn";

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile,
    per_route_types: &[],
    compile_per_route: None,
};

/// istio/api's config (config/protos/istio/alpn.proto).
#[derive(Clone, PartialEq, prost::Message)]
struct Config {
    #[prost(message, repeated, tag = "1")]
    alpn_override: Vec<AlpnOverride>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct AlpnOverride {
    /// HTTP10 = 0, HTTP11 = 1, HTTP2 = 2.
    #[prost(int32, tag = "1")]
    upstream_protocol: i32,
    #[prost(string, repeated, tag = "2")]
    alpn_override: Vec<String>,
}

/// The upstream HTTP versions an override is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Protocol {
    Http10,
    Http11,
    Http2,
}

/// The lists by upstream HTTP version: the filter's config, and its filter state.
#[derive(Debug)]
struct Overrides(HashMap<Protocol, Alpn>);

impl FilterStateObject for Overrides {
    fn serialize_as_string(&self) -> Option<String> {
        None
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[derive(Debug)]
struct AlpnFilter(Arc<Overrides>);

fn compile(
    any: &Any,
    _ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config = match <Config as prost::Message>::decode(any.value.as_slice()) {
        Ok(config) => config,
        Err(err) => {
            problems.error(path, format!("cannot decode {TYPE_NAME}: {err}"));
            return None;
        }
    };
    let mut lists = HashMap::new();
    for (i, entry) in config.alpn_override.iter().enumerate() {
        let protocol = match entry.upstream_protocol {
            0 => Protocol::Http10,
            1 => Protocol::Http11,
            2 => Protocol::Http2,
            other => {
                problems.error(
                    path.field("alpn_override")
                        .index(i)
                        .field("upstream_protocol"),
                    format!("{other} is not HTTP10, HTTP11 or HTTP2"),
                );
                return None;
            }
        };
        lists.insert(protocol, Alpn::from(entry.alpn_override.clone()));
    }
    Some(Arc::new(AlpnFilter(Arc::new(Overrides(lists)))))
}

impl HttpFilterConfig for AlpnFilter {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(AlpnFilter(self.0.clone()))
    }
}

impl HttpFilter for AlpnFilter {
    fn decode_headers<'a>(
        &'a mut self,
        _request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        if let Err(err) =
            ctx.info
                .filter_state
                .set(OVERRIDES_KEY, self.0.clone(), true, LifeSpan::FilterChain)
        {
            tracing::debug!(%err, "istio.alpn: already set");
        }
        Flow::CONTINUE
    }
}

/// Whether the cluster's metadata turns Istio's override off
/// (`filter_metadata.istio.alpn_override: "false"`).
fn override_disabled(cluster: &Cluster) -> bool {
    let Some(metadata) = cluster.metadata.as_deref() else {
        return false;
    };
    metadata
        .filter_metadata
        .get("istio")
        .and_then(|s| s.fields.get("alpn_override"))
        .and_then(|v| v.kind.as_ref())
        .is_some_and(|k| matches!(k, Kind::StringValue(s) if s == "false"))
}

/// The ALPN list a request's upstream connection to `cluster` offers instead of the
/// cluster's: a `set_filter_state` of `envoy.network.application_protocols`, else
/// `istio.alpn`'s list for the version the cluster speaks for `downstream`.
pub fn upstream_alpn(state: &FilterState, cluster: &Cluster, downstream: Version) -> Option<Alpn> {
    if let Some(list) = state.get_string(APPLICATION_PROTOCOLS) {
        let protocols: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect();
        return (!protocols.is_empty()).then(|| protocols.into());
    }
    let overrides = state.get_as::<Overrides>(OVERRIDES_KEY)?;
    if override_disabled(cluster) {
        return None;
    }
    let protocol = match cluster.http_protocol {
        UpstreamProtocol::Http1 => Protocol::Http11,
        UpstreamProtocol::Http2 => Protocol::Http2,
        UpstreamProtocol::UseDownstream => match downstream {
            Version::HTTP_10 => Protocol::Http10,
            Version::HTTP_2 => Protocol::Http2,
            _ => Protocol::Http11,
        },
    };
    overrides
        .0
        .get(&protocol)
        .filter(|l| !l.is_empty())
        .cloned()
}
