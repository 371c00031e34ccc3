//! Envoy's HTTP filters: the chain a connection manager runs in front of its router.
//!
//! - [`HttpFilterConfig`] is a filter as compiled from its `typed_config` (shared by
//!   every stream); [`HttpFilterConfig::create`] makes the per-stream [`HttpFilter`].
//! - [`registry`] finds the compiler for a type URL (typed, or wrapped in a
//!   `TypedStruct`), and for the per-route configs in `typed_per_filter_config`; each
//!   filter gives it a [`factory::Factory`].
//! - [`chain`] runs a stream through the filters: decode in config order, then the
//!   router, then encode in reverse order; [`HttpFilter::on_stream_complete`] when the
//!   stream is over (after the access log's facts are known).
//! - [`per_route`] compiles the `typed_per_filter_config` of virtual hosts, routes and
//!   weighted clusters (into [`PerFilterConfigs`], which the routes hold);
//!   [`StreamCtx::route_config`] picks the most specific.
//! - The filters themselves, one module each (`rbac`, `fault`, `cors`, ...).
//!
//! A filter sees the request's pseudo-headers as fields of [`RequestHeaders`] and the
//! stream's shared facts in [`StreamCtx::info`] ([`shunt_core::stream_info`]).

pub mod chain;
pub mod factory;
pub mod per_route;
pub mod registry;

// The filters, one module each, named as Envoy's (`envoy.filters.http.<name>`) or
// Istio's (`istio.alpn`: `alpn`).
pub mod alpn;
pub mod compressor;
pub mod connect_authority;
pub mod connect_baggage;
pub mod cors;
pub mod decompressor;
pub mod ext_authz;
pub mod fault;
pub mod grpc_stats;
pub mod istio_stats;
pub mod jwt_authn;
pub mod local_ratelimit;
pub mod peer_metadata;
pub mod ratelimit;
pub mod rbac;
pub mod set_filter_state;

use std::any::Any;
use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Method, StatusCode, Version};

use super::route::{Action, ClusterChoice, Route, RouteConfig, VirtualHost, WeightedCluster};
use crate::common::matcher::RequestView;
use shunt_core::access_log::ResponseFlag;
use shunt_core::stream_info::StreamInfo;

pub use super::route::{PerFilterConfig, PerFilterConfigs, RouteSpecificConfig};
pub use crate::common::compression::BodyTransform;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a filter tells the chain.
#[derive(Debug)]
pub enum FilterStatus {
    /// Go on to the next filter.
    Continue,
    /// From `decode_headers` / `encode_headers`: this filter wants the whole body
    /// before the stream goes on. The chain buffers it (up to the connection
    /// manager's limit) and calls `decode_data`/`encode_data` once with
    /// `end_stream`, then `*_trailers` if there are any. From `*_data`/`*_trailers`
    /// it is the same as `Continue`.
    StopIteration,
    /// Answer the request now (Envoy's `sendLocalReply`): no further decoder filter
    /// and no router; the reply goes through the encoder filters.
    Reply(LocalReply),
}

/// A filter step: done now, or a future (an authorization call, a delay). Most steps
/// are done now, so no allocation for them.
pub enum Flow<'a> {
    Ready(FilterStatus),
    Pending(BoxFuture<'a, FilterStatus>),
}

impl Flow<'_> {
    pub const CONTINUE: Flow<'static> = Flow::Ready(FilterStatus::Continue);

    pub async fn resolve(self) -> FilterStatus {
        match self {
            Flow::Ready(status) => status,
            Flow::Pending(future) => future.await,
        }
    }
}

impl From<FilterStatus> for Flow<'_> {
    fn from(status: FilterStatus) -> Self {
        Flow::Ready(status)
    }
}

/// A response a filter makes (Envoy's local reply).
#[derive(Debug, Clone)]
pub struct LocalReply {
    pub status: StatusCode,
    /// Sent with `content-type: text/plain` when not empty, as Envoy does.
    pub body: Bytes,
    /// Added to the reply's headers.
    pub headers: HeaderMap,
    /// `%RESPONSE_CODE_DETAILS%`, e.g. `rbac_access_denied_matched_policy[none]`.
    pub details: Cow<'static, str>,
    pub flag: Option<ResponseFlag>,
}

impl LocalReply {
    pub fn new(
        status: StatusCode,
        body: impl Into<Bytes>,
        details: impl Into<Cow<'static, str>>,
    ) -> Self {
        LocalReply {
            status,
            body: body.into(),
            headers: HeaderMap::new(),
            details: details.into(),
            flag: None,
        }
    }

    pub fn with_flag(mut self, flag: ResponseFlag) -> Self {
        self.flag = Some(flag);
        self
    }

    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.append(name, value);
        self
    }

    pub fn response(&self) -> hyper::Response<Bytes> {
        let mut response = hyper::Response::new(self.body.clone());
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        if !self.body.is_empty() {
            headers.insert(
                hyper::header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain"),
            );
        }
        for (name, value) in &self.headers {
            headers.append(name, value.clone());
        }
        response
    }
}

/// A request's head as filters see and change it. Pseudo-headers are fields: HTTP/1
/// requests do not carry them as headers.
#[derive(Debug, Clone)]
pub struct RequestHeaders {
    pub method: Method,
    /// `:authority` (Host), after `strip_*_host_port`.
    pub authority: String,
    /// `:path`: path and query, after path normalization.
    pub path: String,
    pub scheme: &'static str,
    pub version: Version,
    pub headers: HeaderMap,
}

impl RequestHeaders {
    pub fn view(&self) -> RequestView<'_> {
        RequestView {
            method: self.method.as_str(),
            authority: &self.authority,
            path: &self.path,
            scheme: self.scheme,
            headers: &self.headers,
        }
    }
}

/// A response's head as encoder filters see and change it.
pub type ResponseHeaders = hyper::http::response::Parts;

/// The route a stream was matched to: filters read it on both sides (decode and
/// encode), as Envoy's `route()`.
#[derive(Debug, Clone)]
pub struct Routed {
    pub config: Arc<RouteConfig>,
    pub vhost: usize,
    pub route: usize,
    /// The weighted cluster picked, when the route splits by weight.
    pub weighted: Option<usize>,
}

impl Routed {
    /// Routes `request` with `config`: the virtual host, the first route that matches,
    /// and (for weighted clusters) the cluster picked at random by weight.
    pub fn find(config: &Arc<RouteConfig>, request: &RequestView<'_>) -> Option<Routed> {
        let (vhost, route) = config.route(request)?;
        let vhost_index = config
            .virtual_hosts
            .iter()
            .position(|v| std::ptr::eq(v, vhost))?;
        let route_index = vhost.routes.iter().position(|r| std::ptr::eq(r, route))?;
        let weighted = match &route.action {
            Action::Route(action) => match &action.cluster {
                ClusterChoice::Weighted(clusters) => action
                    .cluster
                    .pick(request)
                    .and_then(|(_, w)| w)
                    .and_then(|w| clusters.iter().position(|c| std::ptr::eq(c, w))),
                _ => None,
            },
            _ => None,
        };
        Some(Routed {
            config: config.clone(),
            vhost: vhost_index,
            route: route_index,
            weighted,
        })
    }

    pub fn virtual_host(&self) -> &VirtualHost {
        &self.config.virtual_hosts[self.vhost]
    }

    pub fn route(&self) -> &Route {
        &self.virtual_host().routes[self.route]
    }

    pub fn weighted_cluster(&self) -> Option<&WeightedCluster> {
        let Action::Route(action) = &self.route().action else {
            return None;
        };
        match (&action.cluster, self.weighted) {
            (ClusterChoice::Weighted(clusters), Some(i)) => clusters.get(i),
            _ => None,
        }
    }

    /// The cluster the router will send the request to (Envoy's `clusterInfo()` for
    /// filters): the route's, the weighted cluster picked, or the one `headers` name.
    pub fn cluster_name(&self, headers: &HeaderMap) -> Option<Arc<str>> {
        let Action::Route(action) = &self.route().action else {
            return None;
        };
        match &action.cluster {
            ClusterChoice::Cluster(name) => Some(name.clone()),
            ClusterChoice::Weighted(_) => self.weighted_cluster().map(|w| w.name.clone()),
            ClusterChoice::Header(name) => headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .filter(|v| !v.is_empty())
                .map(Arc::from),
        }
    }

    /// The most specific `typed_per_filter_config` entry for filter `name`: weighted
    /// cluster, route, virtual host, route configuration.
    pub fn per_filter_config(&self, name: &str) -> Option<&PerFilterConfig> {
        self.weighted_cluster()
            .and_then(|w| w.per_filter_configs.get(name))
            .or_else(|| self.route().per_filter_configs.get(name))
            .or_else(|| self.virtual_host().per_filter_configs.get(name))
            .or_else(|| self.config.per_filter_configs.get(name))
    }
}

/// What a filter gets beside the headers or data: the stream's info, its route, and
/// its own per-route config.
#[derive(Debug)]
pub struct StreamCtx {
    pub info: StreamInfo,
    pub route: Option<Routed>,
    /// The name of the filter being called (its `http_filters[].name`), which keys
    /// `typed_per_filter_config`.
    filter_name: Arc<str>,
    route_cache_cleared: bool,
}

impl StreamCtx {
    pub fn new(info: StreamInfo, route: Option<Routed>) -> Self {
        StreamCtx {
            info,
            route,
            filter_name: Arc::from(""),
            route_cache_cleared: false,
        }
    }

    pub fn filter_name(&self) -> &str {
        &self.filter_name
    }

    /// This filter's most specific per-route config, as its compiled type.
    pub fn route_config<T: Any>(&self) -> Option<&T> {
        self.route
            .as_ref()?
            .per_filter_config(&self.filter_name)?
            .config
            .as_ref()?
            .as_any()
            .downcast_ref()
    }

    /// A decoder filter changed what routing reads (headers, path): route again
    /// before the router (Envoy's `clearRouteCache`).
    pub fn clear_route_cache(&mut self) {
        self.route_cache_cleared = true;
    }
}

/// One filter on one stream. Every method has Envoy's default: continue.
///
/// Decoder methods may wait (return [`Flow::Pending`]); encoder methods run inline.
/// `decode_data`/`encode_data` are called only when a filter asked for the body with
/// [`FilterStatus::StopIteration`]; otherwise the body streams through untouched.
pub trait HttpFilter: Send {
    fn decode_headers<'a>(
        &'a mut self,
        _request: &'a mut RequestHeaders,
        _end_stream: bool,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        Flow::CONTINUE
    }

    fn decode_data<'a>(
        &'a mut self,
        _data: &'a mut Bytes,
        _end_stream: bool,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        Flow::CONTINUE
    }

    fn decode_trailers<'a>(
        &'a mut self,
        _trailers: &'a mut HeaderMap,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        Flow::CONTINUE
    }

    /// After `decode_data`/`decode_trailers` of a buffered body: the request head may
    /// still be changed (ext_authz applies its check's headers after sending the body).
    fn decode_complete(&mut self, _request: &mut RequestHeaders, _ctx: &mut StreamCtx) {}

    /// The response head (from the upstream or a local reply). A `Reply` here replaces
    /// the response.
    fn encode_headers(
        &mut self,
        _response: &mut ResponseHeaders,
        _end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        FilterStatus::Continue
    }

    fn encode_data(
        &mut self,
        _data: &mut Bytes,
        _end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        FilterStatus::Continue
    }

    fn encode_trailers(&mut self, _trailers: &mut HeaderMap, _ctx: &mut StreamCtx) -> FilterStatus {
        FilterStatus::Continue
    }

    /// Whether the filter watches the body as it streams by, without holding it up:
    /// then the `on_*_data` / `on_response_trailers` calls below come for every
    /// frame sent upstream or downstream (buffered by a filter or not).
    fn observes_body(&self) -> bool {
        false
    }

    /// Request body bytes on their way upstream.
    fn on_request_data(&mut self, _data: &[u8], _ctx: &mut StreamCtx) {}

    /// Response body bytes on their way downstream.
    fn on_response_data(&mut self, _data: &[u8], _ctx: &mut StreamCtx) {}

    /// The response's trailers on their way downstream.
    fn on_response_trailers(&mut self, _trailers: &HeaderMap, _ctx: &mut StreamCtx) {}

    /// The stream is over (Envoy's access log time): `info` has the response code,
    /// flags, upstream and bytes. Called for every filter created for the stream.
    fn on_stream_complete(&mut self, _info: &StreamInfo) {}

    /// Asked after `encode_headers`: a change the filter makes to every frame of the
    /// response body as it streams (the compressor, the decompressor), without holding
    /// the body whole as `StopIteration` does.
    fn response_body_transform(&mut self) -> Option<Box<dyn BodyTransform>> {
        None
    }
}

/// A filter as compiled from its config; makes one [`HttpFilter`] per stream.
pub trait HttpFilterConfig: fmt::Debug + Send + Sync {
    fn create(&self) -> Box<dyn HttpFilter>;
}

#[cfg(test)]
mod tests;
