//! A connection manager's HTTP filter chain: as compiled ([`FilterChain`]) and on one
//! stream ([`ActiveChain`]).
//!
//! Envoy's order: decoder filters in config order, then the router; encoder filters in
//! reverse order, for upstream responses and local replies alike. A filter disabled in
//! the connection manager runs only on routes whose `typed_per_filter_config` enables
//! it; one a route disables is not created for that stream (Envoy builds the chain
//! after routing).

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{HeaderMap, Response, StatusCode};

use super::{
    FilterStatus, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders, Routed, StreamCtx,
};
use crate::http::body::ResponseBody;
use shunt_core::access_log::{Entry, ResponseFlag};
use shunt_upstream::http_pool::RequestBody;

/// How much of a body a filter may have buffered: Envoy's default
/// `per_connection_buffer_limit_bytes` (1 MiB). More is a 413 for a request, a 500
/// for a response, as Envoy's buffering filters answer.
pub const BUFFER_LIMIT: usize = 1024 * 1024;

/// The HTTP filters of one connection manager, router excluded, in order.
#[derive(Debug, Default)]
pub struct FilterChain {
    pub filters: Vec<ConfiguredFilter>,
}

#[derive(Debug)]
pub struct ConfiguredFilter {
    /// `http_filters[].name`, the key of `typed_per_filter_config`.
    pub name: Arc<str>,
    pub config: Arc<dyn HttpFilterConfig>,
    /// `disabled`: off unless a route's per-filter config turns it on.
    pub disabled: bool,
}

impl FilterChain {
    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }
}

struct Active {
    name: Arc<str>,
    filter: Box<dyn HttpFilter>,
}

/// The filters of one stream and what they share.
pub struct ActiveChain {
    filters: Vec<Active>,
    pub ctx: StreamCtx,
}

impl std::fmt::Debug for ActiveChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveChain")
            .field(
                "filters",
                &self.filters.iter().map(|a| &a.name).collect::<Vec<_>>(),
            )
            .field("ctx", &self.ctx)
            .finish()
    }
}

fn enabled(filter: &ConfiguredFilter, route: Option<&Routed>) -> bool {
    match route.and_then(|r| r.per_filter_config(&filter.name)) {
        Some(per_route) => !per_route.disabled,
        None => !filter.disabled,
    }
}

impl ActiveChain {
    /// Creates the stream's filters: those enabled for `ctx.route`.
    pub fn new(chain: &FilterChain, ctx: StreamCtx) -> Self {
        let filters = chain
            .filters
            .iter()
            .filter(|f| enabled(f, ctx.route.as_ref()))
            .map(|f| Active {
                name: f.name.clone(),
                filter: f.config.create(),
            })
            .collect();
        ActiveChain { filters, ctx }
    }

    pub fn len(&self) -> usize {
        self.filters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }

    fn enter(&mut self, i: usize) -> (&mut dyn HttpFilter, &mut StreamCtx) {
        let active = &mut self.filters[i];
        if !Arc::ptr_eq(&self.ctx.filter_name, &active.name) {
            self.ctx.filter_name = active.name.clone();
        }
        (&mut *active.filter, &mut self.ctx)
    }

    /// Whether a decoder filter asked to route again; clears the request.
    pub fn take_route_cache_cleared(&mut self) -> bool {
        std::mem::take(&mut self.ctx.route_cache_cleared)
    }

    /// Runs the decoder filters over the request. When one asks for the body, `body`
    /// is read whole (up to [`BUFFER_LIMIT`]) and replaced by what the filters made of
    /// it. `Err` is the local reply that ends the stream.
    pub async fn decode(
        &mut self,
        request: &mut RequestHeaders,
        body: &mut RequestBody,
        end_stream: bool,
    ) -> Result<(), LocalReply> {
        let mut buffered: Option<(Bytes, Option<HeaderMap>)> = None;
        for i in 0..self.filters.len() {
            let (filter, ctx) = self.enter(i);
            let status = filter
                .decode_headers(request, end_stream, ctx)
                .resolve()
                .await;
            match status {
                FilterStatus::Continue => {}
                FilterStatus::Reply(reply) => return Err(reply),
                FilterStatus::StopIteration => {
                    if buffered.is_none() && !end_stream {
                        let (mut data, mut trailers) = buffer_request(body).await?;
                        // The filters before this one would have seen the body stream by.
                        for j in 0..i {
                            self.decode_body(j, &mut data, trailers.as_mut()).await?;
                        }
                        buffered = Some((data, trailers));
                    }
                }
            }
            if let Some((data, trailers)) = buffered.as_mut() {
                self.decode_body(i, data, trailers.as_mut()).await?;
                // The filter has seen the whole request: it may change the head now.
                let (filter, ctx) = self.enter(i);
                filter.decode_complete(request, ctx);
            }
        }
        if let Some((data, trailers)) = buffered {
            // A buffered body is sent without an observer: the watching filters see it here.
            self.observe_request_data(&data);
            *body = RequestBody::buffered(data, trailers);
        }
        Ok(())
    }

    async fn decode_body(
        &mut self,
        i: usize,
        data: &mut Bytes,
        trailers: Option<&mut HeaderMap>,
    ) -> Result<(), LocalReply> {
        let (filter, ctx) = self.enter(i);
        let end_stream = trailers.is_none();
        if let FilterStatus::Reply(reply) =
            filter.decode_data(data, end_stream, ctx).resolve().await
        {
            return Err(reply);
        }
        if let Some(trailers) = trailers {
            let (filter, ctx) = self.enter(i);
            if let FilterStatus::Reply(reply) =
                filter.decode_trailers(trailers, ctx).resolve().await
            {
                return Err(reply);
            }
        }
        Ok(())
    }

    /// Whether a filter watches the body frames ([`HttpFilter::observes_body`]).
    pub fn observes_body(&self) -> bool {
        self.filters.iter().any(|a| a.filter.observes_body())
    }

    fn each_observer(&mut self, mut call: impl FnMut(&mut dyn HttpFilter, &mut StreamCtx)) {
        for i in 0..self.filters.len() {
            if self.filters[i].filter.observes_body() {
                let (filter, ctx) = self.enter(i);
                call(filter, ctx);
            }
        }
    }

    pub fn observe_request_data(&mut self, data: &[u8]) {
        if !data.is_empty() {
            self.each_observer(|f, ctx| f.on_request_data(data, ctx));
        }
    }

    /// A frame of the response body on its way downstream: data or trailers.
    pub fn observe_response_frame(&mut self, frame: &hyper::body::Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            if !data.is_empty() {
                self.each_observer(|f, ctx| f.on_response_data(data, ctx));
            }
        } else if let Some(trailers) = frame.trailers_ref() {
            self.each_observer(|f, ctx| f.on_response_trailers(trailers, ctx));
        }
    }

    /// Runs the encoder filters (last to first) over `response`. A reply from one
    /// replaces the response (it is not encoded again).
    pub async fn encode(&mut self, response: Response<ResponseBody>) -> Response<ResponseBody> {
        if self.filters.is_empty() {
            return response;
        }
        let (mut parts, body) = response.into_parts();
        let end_stream = hyper::body::Body::is_end_stream(&body);
        let mut wants_body = false;
        let mut transforms = Vec::new();
        for i in (0..self.filters.len()).rev() {
            let (filter, ctx) = self.enter(i);
            match filter.encode_headers(&mut parts, end_stream, ctx) {
                FilterStatus::Continue => {}
                FilterStatus::StopIteration => wants_body = true,
                FilterStatus::Reply(reply) => return self.replace(reply),
            }
            if !end_stream && let Some(transform) = filter.response_body_transform() {
                transforms.push(transform);
            }
        }
        if !wants_body || end_stream {
            return Response::from_parts(parts, body.transformed(transforms));
        }
        let collected = match http_body_util::Limited::new(body, BUFFER_LIMIT)
            .collect()
            .await
        {
            Ok(collected) => collected,
            Err(err) => {
                tracing::debug!(%err, "buffering a response body for an HTTP filter failed");
                let reply = LocalReply::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "Internal Server Error",
                    "response_payload_too_large",
                );
                return self.replace(reply);
            }
        };
        let mut trailers = collected.trailers().cloned();
        let mut data = collected.to_bytes();
        for i in (0..self.filters.len()).rev() {
            let (filter, ctx) = self.enter(i);
            if let FilterStatus::Reply(reply) =
                filter.encode_data(&mut data, trailers.is_none(), ctx)
            {
                return self.replace(reply);
            }
            if let Some(trailers) = trailers.as_mut() {
                let (filter, ctx) = self.enter(i);
                if let FilterStatus::Reply(reply) = filter.encode_trailers(trailers, ctx) {
                    return self.replace(reply);
                }
            }
        }
        parts.headers.remove(hyper::header::CONTENT_LENGTH);
        // Streaming transforms run after every buffering filter (a buffering filter
        // nearer the downstream than a compressor would see uncompressed bytes).
        let body = ResponseBody::buffered(data, trailers).transformed(transforms);
        Response::from_parts(parts, body)
    }

    fn replace(&mut self, reply: LocalReply) -> Response<ResponseBody> {
        self.note_reply(&reply);
        reply.response().map(ResponseBody::full)
    }

    /// Records a local reply's details and flag in the stream info.
    pub fn note_reply(&mut self, reply: &LocalReply) {
        self.ctx.info.response_code_details = Some(reply.details.to_string());
        if let Some(flag) = reply.flag {
            self.ctx.info.flag(flag);
        }
    }

    /// Runs the encoder filters over a local reply's head (Envoy sends its local
    /// replies through them too).
    pub async fn encode_local_reply(&mut self, reply: &LocalReply) -> Response<ResponseBody> {
        self.note_reply(reply);
        self.encode(reply.response().map(ResponseBody::full)).await
    }

    /// The stream is over: the access log's facts go into the stream info and every
    /// filter hears of it.
    pub fn complete(mut self, entry: &Entry) {
        let info = &mut self.ctx.info;
        info.response_code = entry
            .http
            .as_ref()
            .map(|h| h.response_code)
            .filter(|&c| c != 0)
            .or(info.response_code);
        for flag in &entry.response_flags {
            info.flag(*flag);
        }
        info.upstream_cluster = entry.upstream_cluster.clone();
        info.upstream_cluster_metadata = entry.upstream_cluster_metadata.clone();
        info.upstream_host = entry.upstream_host;
        info.upstream_peer_uri_sans = entry.upstream_peer_uri_sans.clone();
        info.upstream_local_uri_sans = entry.upstream_local_uri_sans.clone();
        info.request_head_bytes = entry.request_head_bytes;
        info.response_head_bytes = entry.response_head_bytes;
        info.bytes_received = entry.bytes_received;
        info.bytes_sent = entry.bytes_sent;
        for active in &mut self.filters {
            active.filter.on_stream_complete(&self.ctx.info);
        }
    }
}

/// Reads the rest of the request body for a filter that asked for it.
async fn buffer_request(body: &mut RequestBody) -> Result<(Bytes, Option<HeaderMap>), LocalReply> {
    let taken = std::mem::replace(body, RequestBody::empty());
    match http_body_util::Limited::new(taken, BUFFER_LIMIT)
        .collect()
        .await
    {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            Ok((collected.to_bytes(), trailers))
        }
        Err(err) if err.is::<http_body_util::LengthLimitError>() => Err(LocalReply::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "Payload Too Large",
            "request_payload_too_large",
        )),
        Err(err) => {
            tracing::debug!(%err, "reading a request body for an HTTP filter failed");
            Err(LocalReply::new(
                StatusCode::BAD_REQUEST,
                "Bad Request",
                "request_body_read_failed",
            )
            .with_flag(ResponseFlag::DownstreamProtocolError))
        }
    }
}
