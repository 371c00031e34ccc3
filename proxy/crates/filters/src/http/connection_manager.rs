//! The HTTP connection manager serving one downstream connection: hyper's HTTP/1.1
//! (keep-alive) and HTTP/2 servers (AUTO tells them apart by the HTTP/2 preface), and
//! per request Envoy's steps: request id, route lookup in the route config current
//! *now* (RDS updates apply to the next request), the route's action, header rules,
//! the router, response headers, stats and one access log line.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::http::request::Parts;
use hyper::service::service_fn;
use hyper::upgrade::OnUpgrade;
use hyper::{Request, Response, StatusCode, Version};
use hyper_util::rt::TokioIo;
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};

use super::ConfigProvider;
use super::body::{LogSlot, ResponseBody};
use super::config::{Codec, HttpConnectionManager, RouteSource, ServerHeader, StripHostPort};
use super::filter::chain::ActiveChain;
use super::filter::{RequestHeaders, Routed, StreamCtx};
use super::headers::REQUEST_ID;
use super::path_normalization::Normalized;
use super::route::{
    Action, PathRedirect, Redirect, Route, RouteAction, RouteConfig, WeightedCluster,
};
use super::router::{self, Head, LocalReply, Upstream};
use crate::common::matcher::RequestView;
use shunt_core::access_log::{Direction, Entry, HttpFields, ResponseFlag};
use shunt_upstream::Cluster;
use shunt_upstream::http_pool::RequestBody;

/// The downstream connection a request arrived on.
#[derive(Debug, Clone)]
pub struct Downstream {
    pub remote: SocketAddr,
    pub local: SocketAddr,
    /// The original destination, when the listener restored one.
    pub original_dst: Option<SocketAddr>,
    pub direction: Direction,
    /// Whether the connection is TLS (terminated by shunt): `x-forwarded-proto: https`.
    pub secure: bool,
    /// The proxy's own listener ports (ORIGINAL_DST loop protection).
    pub own_ports: Arc<[u16]>,
    /// What HTTP filters read about the connection (TLS peer, SNI, filter state).
    pub connection: Arc<shunt_core::stream_info::Connection>,
}

impl Downstream {
    /// The request's `:scheme`: `https` on a connection shunt terminated TLS on.
    fn scheme(&self) -> &'static str {
        if self.secure { "https" } else { "http" }
    }
}

struct Shared {
    hcm: Arc<HttpConnectionManager>,
    config: Arc<dyn ConfigProvider>,
    downstream: Downstream,
}

/// Serves HTTP on `io` until the downstream closes it. Generic over the stream so a TLS
/// stream is served the same way as a TCP one. Once `drain` resolves (the proxy is
/// shutting down) the connection closes gracefully: requests in flight finish, an idle
/// HTTP/1 connection closes and HTTP/2 sends GOAWAY, as Envoy's drain does.
pub async fn serve<IO>(
    hcm: Arc<HttpConnectionManager>,
    config: Arc<dyn ConfigProvider>,
    io: IO,
    downstream: Downstream,
    drain: impl std::future::Future<Output = ()>,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let counted = Arc::new(hcm.stats.connection());
    let codec = hcm.codec;
    let remote = downstream.remote;
    let shared = Arc::new(Shared {
        hcm,
        config,
        downstream,
    });
    let limits = shared.hcm.limits.clone();
    let stats = shared.hcm.stats.clone();
    let requests = Arc::new(std::sync::atomic::AtomicU32::new(0));
    // HTTP/2's last request under `max_requests_per_connection`: GOAWAY.
    let goaway = Arc::new(tokio::sync::Notify::new());
    let reached = goaway.clone();
    let service = service_fn(move |request: Request<Incoming>| {
        let shared = shared.clone();
        let version = request.version();
        counted.saw(version);
        let last = super::limits::last_request(&shared.hcm, &requests);
        if last && version == Version::HTTP_2 {
            reached.notify_one();
        }
        // Boxed: the request's future is ~10 KiB (every filter's and the router's
        // states), and hyper moves its service future several times per request (into
        // the h2 stream, into a spawned task, back out on completion). A pointer moves
        // instead of 10 KiB; the one allocation costs less than those copies. Written
        // into an uninitialised box: `Box::pin(future)` built it on the stack first and
        // copied all of it into the heap.
        Box::into_pin(Box::write(Box::new_uninit(), async move {
            let mut response = handle_timed(request, &shared).await;
            if last && version <= Version::HTTP_11 {
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok::<_, Infallible>(response)
        }))
    });
    // Streams run in the connection's scope (a pod's namespace, internal listeners).
    let mut builder = auto::Builder::new(shunt_upstream::scope::ScopedExecutor::current());
    builder = match codec {
        Codec::Auto => builder,
        Codec::Http1 => builder.http1_only(),
        Codec::Http2 => builder.http2_only(),
    };
    // The codecs bound what one connection may hold while a request's headers arrive;
    // the exact limits (Envoy's counting, its 431 body) are checked per request.
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(limits.request_headers_timeout)
        .max_headers(limits.max_headers_count)
        .max_buf_size(super::limits::http1_buffer(&limits));
    builder
        .http2()
        .max_header_list_size(u32::try_from(limits.max_request_headers_bytes).unwrap_or(u32::MAX))
        .max_concurrent_streams(limits.http2.max_concurrent_streams);
    if let Some(window) = limits.http2.initial_stream_window_size {
        builder.http2().initial_stream_window_size(window);
    }
    if let Some(window) = limits.http2.initial_connection_window_size {
        builder.http2().initial_connection_window_size(window);
    }
    let io = super::delayed_close::DelayedClose::new(io, limits.delayed_close_timeout);
    let io = shunt_core::event::counted::Counted::new(
        io,
        stats.downstream_cx_rx_bytes_total.clone(),
        stats.downstream_cx_tx_bytes_total.clone(),
    );
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
    // What makes the connection drain: the drain signal, `max_connection_duration`, or
    // (HTTP/2) the last request `max_requests_per_connection` allows. Polled only when
    // one of them woke the task, not at every byte the connection moves.
    let drains = std::pin::pin!(async {
        tokio::select! {
            () = drain => {}
            () = async {
                match limits.max_connection_duration {
                    Some(max) => tokio::time::sleep(max).await,
                    None => std::future::pending().await,
                }
            } => {
                tracing::debug!(%remote, "max_connection_duration reached: draining");
                stats.downstream_cx_max_duration_reached.inc();
            }
            () = goaway.notified() => {
                tracing::debug!(%remote, "max_requests_per_connection reached: GOAWAY");
            }
        }
    });
    let mut drains = shunt_core::event::when_woken(drains);
    tokio::pin!(connection);
    let mut draining = false;
    let result = loop {
        tokio::select! {
            result = connection.as_mut() => break result,
            () = &mut drains, if !draining => {}
        }
        // Requests in flight finish; an idle HTTP/1 connection closes, a busy one
        // closes after its response; HTTP/2 sends GOAWAY.
        draining = true;
        connection.as_mut().graceful_shutdown();
    };
    if let Err(err) = result {
        let hyper_error = err.downcast_ref::<hyper::Error>();
        if hyper_error.is_some_and(hyper::Error::is_timeout) {
            stats.downstream_rq_header_timeout.inc();
        }
        if hyper_error.is_some_and(hyper::Error::is_parse) {
            stats.downstream_cx_protocol_error.inc();
        }
        tracing::debug!(%remote, %err, "downstream HTTP connection ended with an error");
    }
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

fn header_string(headers: &hyper::HeaderMap, name: impl header::AsHeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// A random UUID (version 4), Envoy's `x-request-id`.
pub fn uuid4() -> String {
    String::from_utf8_lossy(&uuid4_bytes()).into_owned()
}

/// [`uuid4`] as its 36 ASCII bytes: every request gets one, so no formatting machinery.
fn uuid4_bytes() -> [u8; 36] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let a = (fastrand::u64(..) & !0xf000) | 0x4000;
    let b = (fastrand::u64(..) & !(0b11 << 62)) | (0b10 << 62);
    let mut digits = [0u8; 32];
    for i in 0..16 {
        digits[i] = HEX[((a >> (60 - 4 * i)) & 0xf) as usize];
        digits[16 + i] = HEX[((b >> (60 - 4 * i)) & 0xf) as usize];
    }
    // 8-4-4-4-12: a's 16 digits, then b's 16.
    let mut out = [b'-'; 36];
    out[0..8].copy_from_slice(&digits[0..8]);
    out[9..13].copy_from_slice(&digits[8..12]);
    out[14..18].copy_from_slice(&digits[12..16]);
    out[19..23].copy_from_slice(&digits[16..20]);
    out[24..36].copy_from_slice(&digits[20..32]);
    out
}

/// [`handle`] under the stream's timers: one that fires before the response is ready
/// answers 408 (the request's work dropped); once it is, they run with its body.
async fn handle_timed(request: Request<Incoming>, shared: &Shared) -> Response<ResponseBody> {
    let hcm = &shared.hcm;
    let timeouts = hcm.limits.stream;
    let http1 = request.version() <= Version::HTTP_11;
    let log = LogSlot::new();
    log.count_resets(
        hcm.stats.downstream_rq_rx_reset.clone(),
        hcm.stats.downstream_rq_tx_reset.clone(),
    );
    if hyper::body::Body::is_end_stream(request.body()) {
        log.set_request_complete();
    }
    // Pinned where it is made: `select!` on the future itself moved all of it (~9 KiB)
    // into its own tuple on every request.
    let handled = std::pin::pin!(handle(request, shared, log.clone()));
    // Not gated by `event::when_woken`: its first poll is most of its cost, and the
    // gate's own allocation cost more than the later polls it saved (`callgrind`).
    let outcome = tokio::select! {
        response = handled => Ok(response),
        why = super::timeouts::watch(timeouts, &hcm.stats, &log, false) => Err(why),
    };
    let response = match outcome {
        Ok(response) => response,
        Err(why) => {
            // Envoy: 408 while the request is still arriving, 504 once it is all in
            // (then it is the answer that is late).
            let code = if log.request_complete() {
                StatusCode::GATEWAY_TIMEOUT
            } else {
                StatusCode::REQUEST_TIMEOUT
            };
            let reply = LocalReply::new(code, why.body(), why.flag());
            let mut response = reply.response();
            // The rest of the request will not be read.
            if http1 && !log.request_complete() {
                close_connection(&mut response);
            }
            response
                .headers_mut()
                .insert(header::SERVER, hcm.server_name.clone());
            if hcm.tracing.is_some() {
                log.with_span(|span| span.on_response(code.as_u16(), response.headers_mut()));
            }
            hcm.stats.response(code.as_u16());
            return response.map(|body| ResponseBody::full(body).logged(log));
        }
    };
    response.map(|body| body.watched(timeouts, hcm.clone(), log))
}

/// One request through Envoy's `ActiveStream` stages: admitted (the codec's limits,
/// CONNECT, Host), its path normalised, routed in the route config current now (RDS
/// updates apply to the next request), through the HTTP filters' decoders, forwarded by
/// the router (or answered from the route), and finished. A stage that answers the
/// request itself breaks out of `'reply` with its local reply: every response leaves
/// through the one `finish` at the end.
async fn handle(
    request: Request<Incoming>,
    shared: &Shared,
    log: Arc<LogSlot>,
) -> Response<ResponseBody> {
    let hcm = &shared.hcm;
    let _active = hcm.stats.request(request.version());
    let (mut parts, body) = request.into_parts();
    // Admit: the codec's limits, CONNECT, Host.
    let (mut pending, admitted) = admit(shared, &mut parts, &log);
    let entry = pending.entry();
    let (response, from_upstream) = 'reply: {
        let target = match admitted {
            Ok(target) => target,
            Err(reply) => break 'reply (reply, false),
        };
        // Normalise the path, which filters and routing read.
        let path = match normalize_path(hcm, target.path) {
            Ok(path) => path,
            Err(reply) => break 'reply (reply, false),
        };
        // Route, in the route config current now.
        let snapshot = shared.config.request_config();
        let config = route_config(hcm, &*snapshot);
        let mut request = RequestHeaders {
            method: parts.method.clone(),
            authority: target.authority,
            path,
            scheme: shared.downstream.scheme(),
            version: parts.version,
            headers: std::mem::take(&mut parts.headers),
        };
        let mut routed = config
            .as_ref()
            .and_then(|c| Routed::find(c, &request.view()));
        // Trace it: decided, its span begun and named by the route.
        if let Some(tracing) = &hcm.tracing {
            start_span(
                shared,
                tracing,
                &snapshot,
                &mut request,
                routed.as_ref(),
                &log,
            );
        }
        let mut body = RequestBody::new(body, log.clone());
        // The HTTP filters' decoders, which may route the request again.
        if !hcm.filters.is_empty()
            && let Err(reply) = decode_filters(
                shared,
                config.as_ref(),
                &mut request,
                &mut body,
                &mut routed,
                entry,
                &log,
            )
            .await
        {
            break 'reply (reply, false);
        }
        let (authority, path, scheme) = (request.authority, request.path, request.scheme);
        (parts.method, parts.headers) = (request.method, request.headers);
        let Some(routed) = routed else {
            break 'reply (no_route(hcm, &authority, &path, entry), false);
        };
        // Forward it upstream, or answer from the route.
        let (config, vhost, route) = (&*routed.config, routed.virtual_host(), routed.route());
        if let Some(http) = entry.http.as_mut()
            && !route.name.is_empty()
        {
            http.route_name = Some(Arc::from(route.name.as_str()));
        }
        tracing::debug!(route_config = %config.name, virtual_host = %vhost.name, route = %route.name, %path, "routed");
        let (mut response, from_upstream) = match &route.action {
            Action::DirectResponse { status, body } => (direct_response(hcm, *status, body), false),
            Action::Redirect(redirect) => {
                let response = redirect_response(hcm, redirect, route, scheme, &authority, &path);
                (response, false)
            }
            Action::Route(action) => {
                if let Some(max) = action
                    .stream_duration
                    .and_then(|d| d.for_request(&parts.headers))
                {
                    log.set_max_duration(max);
                }
                let view = RequestView {
                    method: parts.method.as_str(),
                    authority: &authority,
                    path: &path,
                    scheme,
                    headers: &parts.headers,
                };
                let (cluster, weighted) =
                    match pick_cluster(hcm, &*snapshot, &routed, action, &view, entry) {
                        Ok(picked) => picked,
                        Err(reply) => break 'reply (reply, false),
                    };
                let upstream = upstream_of(shared, &*snapshot, cluster);
                if parts.method == hyper::Method::CONNECT {
                    let on_upgrade = parts.extensions.remove::<OnUpgrade>();
                    // Rare paths are boxed: the request's future is as large as its
                    // largest state.
                    let tunnel = terminate_connect(
                        shared, &upstream, action, &authority, on_upgrade, &log, entry,
                    );
                    break 'reply (Box::pin(tunnel).await, true);
                }
                let upstream = Upstream {
                    retry_policy: action
                        .retry_policy
                        .as_deref()
                        .or(vhost.retry_policy.as_deref()),
                    hash: super::route::request_hash(
                        &action.hash_policy,
                        &view,
                        shared.downstream.remote.ip(),
                    ),
                    alpn: log.upstream_alpn(cluster, parts.version),
                    ..upstream
                };
                if hcm.tracing.is_some() {
                    log.with_span(|span| span.inject(&mut parts.headers));
                }
                let (head, upgrade) = upstream_head(
                    shared, &mut parts, &routed, action, weighted, authority, path,
                );
                let forwarded = match upgrade {
                    Some(kind) => match accept_upgrade(hcm, &kind, &mut parts) {
                        Ok(on_upgrade) => {
                            let upgrade = super::upgrade::forward(
                                &upstream,
                                head,
                                body,
                                on_upgrade,
                                log.clone(),
                                &hcm.stats,
                                entry,
                            );
                            Box::pin(upgrade).await
                        }
                        Err(reply) => Err(reply),
                    },
                    None => router::forward(&upstream, action, head, body, entry)
                        .await
                        .map(|forwarded| upstream_response(hcm, forwarded, weighted, cluster)),
                };
                match forwarded {
                    Ok(response) => (response, true),
                    Err(reply) => break 'reply (upstream_failure(reply, &log, entry), false),
                }
            }
        };
        for rules in config.header_rules(vhost, route, true) {
            rules.apply(response.headers_mut());
        }
        (response, from_upstream)
    };
    // Finish: the encoders, Server header, stats, the access log line.
    finish(shared, response, pending.take(), &log, from_upstream).await
}

/// The request's `:authority` and `:path` as it arrived (the path not yet normalised).
struct Target {
    authority: String,
    path: String,
}

/// Envoy's codec and the stream's start: the request's head measured as it arrived,
/// `Upgrade: h2c` ignored, the codec's limits checked, `x-request-id` generated and the
/// access-log entry begun. Then what answers the request before routing: a codec limit,
/// a CONNECT no route serves, an HTTP/1 Host missing or doubled.
fn admit(
    shared: &Shared,
    parts: &mut Parts,
    log: &Arc<LogSlot>,
) -> (Pending, Result<Target, Response<ResponseBody>>) {
    let hcm = &shared.hcm;
    // Measured before anything changes the request: its head as it arrived.
    let request_head_bytes = if hcm.measures_wire_sizes() {
        super::wire::request_head(parts)
    } else {
        0
    };
    log.set_closes(super::wire::closes(parts));
    if parts.version != Version::HTTP_2 {
        super::upgrade::ignore_h2c(&mut parts.headers);
    }
    let hosts = parts.headers.get_all(header::HOST).iter().count();
    let refused = super::limits::check_request(hcm, parts.version, &mut parts.headers);
    let target = request_target(hcm, &shared.downstream, parts);
    generate_request_id(hcm, &mut parts.headers);
    let mut pending = begin_entry(shared, parts, &target, log, request_head_bytes);
    let admitted = match refusal(shared, parts, hosts, refused, pending.entry()) {
        Some(reply) => Err(reply),
        None => Ok(target),
    };
    (pending, admitted)
}

/// Envoy's `traceRequest`: the trace decided (and packed into `x-request-id`), the span
/// begun and named by the route's decorator, then kept in the log slot until the stream
/// ends. A sampled span's tracer learns the config its collector cluster is in.
fn start_span(
    shared: &Shared,
    tracing: &Arc<crate::tracers::HttpTracing>,
    snapshot: &Arc<dyn super::RequestConfig>,
    request: &mut RequestHeaders,
    routed: Option<&Routed>,
    log: &LogSlot,
) {
    use crate::tracers::active::{ActiveSpan, RequestFacts};
    let downstream = &shared.downstream;
    let facts = RequestFacts {
        method: request.method.as_str(),
        authority: &request.authority,
        path: &request.path,
        scheme: request.scheme,
        protocol: protocol(request.version),
        peer: downstream.remote.ip(),
        local: downstream.local.ip(),
    };
    let Some(mut span) = ActiveSpan::start(tracing, &mut request.headers, &facts) else {
        return;
    };
    let decorator = routed
        .and_then(|r| r.route().decorator.as_ref())
        .map(|d| (d.operation.as_str(), d.propagate));
    span.decorate(decorator, &mut request.headers);
    if span.sampled() {
        let key = Arc::as_ptr(snapshot) as *const () as usize;
        tracing
            .driver
            .exporter()
            .observe(key, || Arc::new(super::Collectors(snapshot.clone())));
    }
    log.set_span(span);
}

/// The `:authority` (the URI's, else Host, without its port as `strip_*_host_port`
/// say) and the `:path` (with its query).
fn request_target(hcm: &HttpConnectionManager, downstream: &Downstream, parts: &Parts) -> Target {
    let authority = parts
        .uri
        .authority()
        .map(|a| a.as_str().to_owned())
        .or_else(|| header_string(&parts.headers, header::HOST))
        .unwrap_or_default();
    let authority = strip_host_port(
        authority,
        hcm.strip_host_port,
        downstream.local.port(),
        &parts.method,
    );
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    Target { authority, path }
}

/// `x-request-id`, when the connection manager generates one and the request has none.
fn generate_request_id(hcm: &HttpConnectionManager, headers: &mut hyper::HeaderMap) {
    // One lookup (the entry) where a check and an insert hashed the name twice.
    if hcm.generate_request_id
        && let header::Entry::Vacant(vacant) = headers.entry(REQUEST_ID)
        && let Ok(mut id) = HeaderValue::from_bytes(&uuid4_bytes())
    {
        // Not indexed by an HTTP/2 upstream's HPACK encoder (h2 sends a sensitive value
        // as a never-indexed literal): a value no later request repeats would take a
        // slot of the connection's 4 KiB dynamic table, evicting the fields that do
        // repeat, and every request would walk the chain of the earlier ids.
        id.set_sensitive(true);
        vacant.insert(id);
    }
}

/// The request's access-log entry, begun; [`Pending`] logs it however the request ends.
fn begin_entry(
    shared: &Shared,
    parts: &Parts,
    target: &Target,
    log: &Arc<LogSlot>,
    request_head_bytes: u64,
) -> Pending {
    let (hcm, downstream) = (&shared.hcm, &shared.downstream);
    let mut entry = Entry::started_at(
        downstream.direction,
        downstream.remote,
        downstream.local,
        log.started().into_std(),
    );
    entry.original_dst = downstream.original_dst;
    entry.request_head_bytes = request_head_bytes;
    // The line's HTTP fields are copies of the request's: made only when a log is on,
    // its headers only for a logger that reads them.
    if !hcm.access_log.is_empty() {
        let wants_headers = hcm.access_log.iter().any(|sink| sink.wants_headers());
        entry.http = Some(Box::new(HttpFields {
            method: parts.method.to_string(),
            path: target.path.clone(),
            protocol: protocol(parts.version),
            response_code: 0,
            authority: (!target.authority.is_empty()).then(|| target.authority.clone()),
            request_id: header_string(&parts.headers, REQUEST_ID),
            user_agent: header_string(&parts.headers, header::USER_AGENT),
            response_code_details: None,
            route_name: None,
            scheme: downstream.scheme(),
            request_headers: wants_headers.then(|| parts.headers.clone()),
            response_headers: None,
        }));
        entry.connection = Some(downstream.connection.clone());
    }
    Pending {
        entry: Some(Box::new(entry)),
        hcm: hcm.clone(),
        log: log.clone(),
    }
}

/// What refuses a request before it is routed, if anything: a codec limit (Envoy's
/// codec refuses a request over them as it arrives), a CONNECT no route serves, an
/// HTTP/1 request without exactly one Host.
fn refusal(
    shared: &Shared,
    parts: &Parts,
    hosts: usize,
    refused: Option<LocalReply>,
    entry: &mut Entry,
) -> Option<Response<ResponseBody>> {
    if let Some(reply) = refused {
        return Some(local_reply(reply));
    }
    // A CONNECT goes on to routing only to a route with a connect_matcher.
    if parts.method == hyper::Method::CONNECT
        && (parts.version != Version::HTTP_2 && parts.uri.authority().is_none()
            || !routes_connect(shared))
    {
        return Some(refuse_connect(shared, parts, entry));
    }
    if let Some(reply) = super::limits::check_http1_request(&shared.hcm, parts) {
        return Some(reply);
    }
    // RFC 9112 3.2: an HTTP/1.1 request without Host (and without an absolute target),
    // or any HTTP/1 request with more than one Host line, is answered 400.
    let http1 = matches!(parts.version, Version::HTTP_10 | Version::HTTP_11);
    let missing_host =
        parts.version == Version::HTTP_11 && hosts == 0 && parts.uri.authority().is_none();
    if missing_host || (http1 && hosts > 1) {
        tracing::debug!(hosts, "HTTP/1 request without exactly one Host: 400");
        let mut response = LocalReply::new(StatusCode::BAD_REQUEST, "", None).response();
        close_connection(&mut response);
        return Some(response.map(ResponseBody::full));
    }
    None
}

/// Envoy's path normalization, before filters and routing read the path: the path to
/// go on with, or the local reply (400, or a redirect to the normalised path).
fn normalize_path(
    hcm: &HttpConnectionManager,
    path: String,
) -> Result<String, Response<ResponseBody>> {
    match hcm.path_normalization.apply(&path) {
        Normalized::Path(std::borrow::Cow::Borrowed(_)) => Ok(path),
        Normalized::Path(std::borrow::Cow::Owned(normalized)) => Ok(normalized),
        Normalized::Reject => {
            hcm.stats.downstream_rq_failed_path_normalization.inc();
            let reply = LocalReply::new(StatusCode::BAD_REQUEST, "", None);
            Err(local_reply(reply))
        }
        Normalized::Redirect(location) => {
            hcm.stats
                .downstream_rq_redirected_with_normalized_path
                .inc();
            let mut reply = LocalReply::new(StatusCode::TEMPORARY_REDIRECT, "", None).response();
            if let Ok(location) = HeaderValue::from_str(&location) {
                reply.headers_mut().insert(header::LOCATION, location);
            }
            Err(reply.map(ResponseBody::full))
        }
    }
}

/// The route configuration requests are routed with: the connection manager's own, or
/// the RDS one of that name in `snapshot` (none until it arrives).
fn route_config(
    hcm: &HttpConnectionManager,
    snapshot: &dyn super::RequestConfig,
) -> Option<Arc<RouteConfig>> {
    match &hcm.routes {
        RouteSource::Static(config) => Some(config.clone()),
        RouteSource::Rds(name) => snapshot.route_config(name).cloned(),
    }
}

/// The HTTP filters' decoders, in front of the router. A filter may change the request,
/// clear the route cache (the request is then routed again) or answer the request (its
/// local reply is the error). The chain then waits in the log slot for the encoders.
async fn decode_filters(
    shared: &Shared,
    config: Option<&Arc<RouteConfig>>,
    request: &mut RequestHeaders,
    body: &mut RequestBody,
    routed: &mut Option<Routed>,
    entry: &mut Entry,
    log: &Arc<LogSlot>,
) -> Result<(), Response<ResponseBody>> {
    let mut info = shunt_core::stream_info::StreamInfo::new(shared.downstream.connection.clone());
    info.route_name = routed
        .as_ref()
        .map(|r| r.route().name.as_str())
        .filter(|n| !n.is_empty())
        .map(Arc::from);
    let mut chain = ActiveChain::new(&shared.hcm.filters, StreamCtx::new(info, routed.clone()));
    let end_stream = hyper::body::Body::is_end_stream(&*body);
    let decoded = chain.decode(request, body, end_stream).await;
    if chain.take_route_cache_cleared() {
        *routed = config.and_then(|c| Routed::find(c, &request.view()));
        chain.ctx.route = routed.clone();
    }
    if let Err(reply) = decoded {
        tracing::debug!(status = %reply.status, details = %reply.details, "HTTP filter local reply");
        if let Some(flag) = reply.flag {
            entry.flag(flag);
        }
        chain.note_reply(&reply);
        log.set_chain(chain);
        return Err(reply.response().map(ResponseBody::full));
    }
    log.set_chain(chain);
    Ok(())
}

/// No route matched: 404, flag NR.
fn no_route(
    hcm: &HttpConnectionManager,
    authority: &str,
    path: &str,
    entry: &mut Entry,
) -> Response<ResponseBody> {
    tracing::debug!(stat_prefix = %hcm.stat_prefix, %authority, %path, "no route");
    hcm.stats.no_route.inc();
    entry.flag(ResponseFlag::NoRouteFound);
    local_reply(LocalReply::new(StatusCode::NOT_FOUND, "", None))
}

/// A route's `direct_response`.
fn direct_response(
    hcm: &HttpConnectionManager,
    status: StatusCode,
    body: &Bytes,
) -> Response<ResponseBody> {
    hcm.stats.rq_direct_response.inc();
    let mut response = Response::new(ResponseBody::full(body.clone()));
    *response.status_mut() = status;
    if !body.is_empty() {
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    }
    response
}

/// A route's `redirect`.
fn redirect_response(
    hcm: &HttpConnectionManager,
    redirect: &Redirect,
    route: &Route,
    scheme: &str,
    authority: &str,
    path: &str,
) -> Response<ResponseBody> {
    hcm.stats.rq_redirect.inc();
    let location = redirect_location(
        redirect,
        route.matcher.matched_prefix_len(),
        scheme,
        authority,
        path,
    );
    let mut response = Response::new(ResponseBody::full(Bytes::new()));
    *response.status_mut() = redirect.status;
    if let Ok(location) = HeaderValue::from_str(&location) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

/// The cluster the request goes to: the weighted cluster picked when it was routed, or
/// the one the route names (or its `cluster_header` does), as `snapshot` has it. None
/// of that name, or none picked (a `cluster_header` the request lacks), is answered
/// with the route's `cluster_not_found` status, flag NC.
fn pick_cluster<'a>(
    hcm: &HttpConnectionManager,
    snapshot: &'a dyn super::RequestConfig,
    routed: &'a Routed,
    action: &'a RouteAction,
    view: &RequestView<'_>,
    entry: &mut Entry,
) -> Result<(&'a Arc<Cluster>, Option<&'a WeightedCluster>), Response<ResponseBody>> {
    let picked = match routed.weighted_cluster() {
        Some(weighted) => Some((weighted.name.clone(), Some(weighted))),
        None => action.cluster.pick(view),
    };
    if let Some((name, _)) = &picked {
        entry.upstream_cluster = Some(name.clone());
    }
    let found = picked.and_then(|(name, weighted)| match snapshot.clusters().get(&name) {
        Some(cluster) => Some((cluster, weighted)),
        None => {
            tracing::debug!(cluster = %name, "route names an unknown cluster");
            None
        }
    });
    match found {
        Some((cluster, weighted)) => {
            entry.upstream_cluster_metadata = cluster.metadata.clone();
            Ok((cluster, weighted))
        }
        None => {
            hcm.stats.no_cluster.inc();
            entry.flag(ResponseFlag::NoClusterFound);
            Err(local_reply(LocalReply::new(
                action.cluster_not_found,
                "",
                None,
            )))
        }
    }
}

/// Where the router sends the request: `cluster`, for the downstream connection's
/// destination; no retries, hash or ALPN of the route's (the caller adds those).
fn upstream_of<'a>(
    shared: &'a Shared,
    snapshot: &'a dyn super::RequestConfig,
    cluster: &'a Arc<Cluster>,
) -> Upstream<'a> {
    let downstream = &shared.downstream;
    Upstream {
        cluster,
        destination: downstream.original_dst.unwrap_or(downstream.local),
        downstream_local: downstream.local,
        own_ports: &downstream.own_ports,
        retry_policy: None,
        suppress_envoy_headers: shared.hcm.suppress_envoy_headers,
        hash: None,
        secrets: snapshot.secrets(),
        alpn: None,
    }
}

/// A CONNECT to a route that terminates it (`connect_config`): the tunnel to one of the
/// cluster's hosts. Envoy refuses (403) a CONNECT the route does not upgrade.
async fn terminate_connect(
    shared: &Shared,
    upstream: &Upstream<'_>,
    action: &RouteAction,
    authority: &str,
    on_upgrade: Option<OnUpgrade>,
    log: &Arc<LogSlot>,
    entry: &mut Entry,
) -> Response<ResponseBody> {
    let result = match (action.connect, on_upgrade) {
        (Some(connect), Some(on_upgrade)) if connect.terminate => {
            super::connect::terminate(
                upstream,
                authority,
                shared.downstream.remote,
                on_upgrade,
                log.clone(),
                &shared.hcm.stats,
                entry,
            )
            .await
        }
        _ => Err(LocalReply::new(StatusCode::FORBIDDEN, "", None)),
    };
    match result {
        Ok(response) => response,
        Err(reply) => {
            if let Some(flag) = reply.flag {
                entry.flag(flag);
            }
            local_reply(reply)
        }
    }
}

/// The request as the router sends it upstream (Envoy's request header mutations):
/// hop-by-hop headers stripped (HTTP/1), the header rules of the weighted cluster,
/// route, virtual host and route configuration, `x-forwarded-proto` and `-for`, the
/// route's path and host rewrites. With the upgrade the request asks for, if any (its
/// `Upgrade` header goes on with it).
fn upstream_head(
    shared: &Shared,
    parts: &mut Parts,
    routed: &Routed,
    action: &RouteAction,
    weighted: Option<&WeightedCluster>,
    authority: String,
    path: String,
) -> (Head, Option<String>) {
    let (config, vhost, route) = (&*routed.config, routed.virtual_host(), routed.route());
    let mut headers = std::mem::take(&mut parts.headers);
    // HTTP/2's codec refuses a request with any of these (RFC 9113 8.2.2; `te` only as
    // `trailers`): there is nothing to upgrade or strip.
    let upgrade = if parts.version == Version::HTTP_2 {
        None
    } else {
        let upgrade =
            super::upgrade::requested(&headers).zip(headers.get(header::UPGRADE).cloned());
        router::strip_hop_by_hop(&mut headers);
        upgrade
    };
    if let Some(weighted) = weighted {
        weighted.request_headers.apply(&mut headers);
    }
    for rules in config.header_rules(vhost, route, false) {
        rules.apply(&mut headers);
    }
    forwarded_headers(shared, &mut headers);
    let upstream_path = match rewrite_path(action, route, &path) {
        Some(rewritten) => {
            if rewritten != path
                && let Ok(original) = HeaderValue::from_str(&path)
            {
                headers.insert(super::headers::ENVOY_ORIGINAL_PATH, original);
            }
            rewritten
        }
        None => path,
    };
    let upstream_authority = weighted
        .and_then(|w| w.host_rewrite.clone())
        .or_else(|| action.host_rewrite.clone())
        .unwrap_or(authority);
    let upgrade = upgrade.map(|(kind, value)| {
        headers.insert(header::UPGRADE, value);
        kind
    });
    let head = Head {
        method: parts.method.clone(),
        authority: upstream_authority,
        path: upstream_path,
        received_path: parts.uri.path_and_query().cloned(),
        headers,
        downstream_version: parts.version,
    };
    (head, upgrade)
}

/// `x-forwarded-proto` (unless the request has one) and, with `use_remote_address`,
/// the downstream's address appended to `x-forwarded-for`.
fn forwarded_headers(shared: &Shared, headers: &mut hyper::HeaderMap) {
    let downstream = &shared.downstream;
    headers
        .entry(super::headers::FORWARDED_PROTO)
        .or_insert_with(|| HeaderValue::from_static(downstream.scheme()));
    if shared.hcm.use_remote_address {
        let xff = super::headers::FORWARDED_FOR;
        let ip = downstream.remote.ip().to_canonical().to_string();
        let value = match header_string(headers, &xff) {
            Some(existing) => format!("{existing},{ip}"),
            None => ip,
        };
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(xff, value);
        }
    }
}

/// The path after the route's `prefix_rewrite` or `regex_rewrite`; None when the route
/// rewrites nothing (most do not: the request's path then goes on as it is).
fn rewrite_path(action: &RouteAction, route: &Route, path: &str) -> Option<String> {
    if let (Some(rewrite), Some(len)) = (&action.prefix_rewrite, route.matcher.matched_prefix_len())
    {
        let rest = path.get(len..).unwrap_or("");
        Some(format!("{rewrite}{rest}"))
    } else if let Some((pattern, substitution)) = &action.regex_rewrite {
        let (only, query) = match path.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (path, None),
        };
        let rewritten = pattern.replace_all(only, substitution.as_str());
        Some(match query {
            Some(q) => format!("{rewritten}?{q}"),
            None => rewritten.into_owned(),
        })
    } else {
        None
    }
}

/// The upstream's response as the downstream gets it: hop-by-hop headers stripped,
/// `x-envoy-upstream-service-time`, the weighted cluster's response header rules, and
/// its body bounded by the route's timeout.
fn upstream_response(
    hcm: &HttpConnectionManager,
    forwarded: router::Forwarded,
    weighted: Option<&WeightedCluster>,
    cluster: &Cluster,
) -> Response<ResponseBody> {
    let (mut parts, incoming) = forwarded.response.into_parts();
    router::strip_hop_by_hop(&mut parts.headers);
    if !hcm.suppress_envoy_headers {
        parts.headers.insert(
            super::headers::ENVOY_UPSTREAM_SERVICE_TIME,
            router::millis_header(forwarded.service_time.as_millis() as u64),
        );
    }
    if let Some(weighted) = weighted {
        weighted.response_headers.apply(&mut parts.headers);
    }
    let deadline = forwarded
        .deadline
        .map(|d| (d, cluster.stats.upstream_rq_timeout.clone()));
    Response::from_parts(parts, ResponseBody::upstream(incoming, deadline))
}

/// The local reply for a request the router could not forward. When the downstream's
/// body broke the protocol, that is the fault: Envoy's codec answers 400 and closes the
/// connection.
fn upstream_failure(reply: LocalReply, log: &LogSlot, entry: &mut Entry) -> Response<ResponseBody> {
    let downstream_fault = log.downstream_protocol_error();
    let reply = if downstream_fault {
        LocalReply::downstream_protocol_error()
    } else {
        reply
    };
    if let Some(flag) = reply.flag {
        entry.flag(flag);
    }
    let mut response = reply.response();
    if downstream_fault {
        close_connection(&mut response);
    }
    response.map(ResponseBody::full)
}

/// The downstream's side of an upgrade the connection manager allows (its
/// `upgrade_configs`, over HTTP/1.1); Envoy refuses others (403).
fn accept_upgrade(
    hcm: &HttpConnectionManager,
    kind: &str,
    parts: &mut Parts,
) -> Result<OnUpgrade, LocalReply> {
    let allowed = parts.version == Version::HTTP_11 && hcm.upgrades.iter().any(|u| u == kind);
    parts
        .extensions
        .remove::<OnUpgrade>()
        .filter(|_| allowed)
        .ok_or_else(|| LocalReply::new(StatusCode::FORBIDDEN, "", None))
}

/// A local reply as a response (its flag, if any, is the caller's to log).
fn local_reply(reply: LocalReply) -> Response<ResponseBody> {
    reply.response().map(ResponseBody::full)
}

/// Envoy's `strip_any_host_port` / `strip_matching_host_port` (the latter when the port
/// is the listener's): the Host without its port, for routing and upstream alike.
fn strip_host_port(
    authority: String,
    mode: StripHostPort,
    listener_port: u16,
    method: &hyper::Method,
) -> String {
    // A CONNECT's port is where the tunnel goes.
    if mode == StripHostPort::Keep || method == hyper::Method::CONNECT {
        return authority;
    }
    let host = super::route::strip_port(&authority);
    let port = authority.get(host.len() + 1..).unwrap_or("");
    let strip = !port.is_empty()
        && (mode == StripHostPort::Any || port.parse::<u16>().ok() == Some(listener_port));
    if strip { host.to_owned() } else { authority }
}

/// Whether the connection manager's routes can serve a CONNECT at all (one has a
/// `connect_matcher`); RDS routes are looked at as they are now.
fn routes_connect(shared: &Shared) -> bool {
    match &shared.hcm.routes {
        RouteSource::Static(config) => config.has_connect_routes(),
        RouteSource::Rds(name) => shared
            .config
            .request_config()
            .route_config(name)
            .is_some_and(|c| c.has_connect_routes()),
    }
}

/// CONNECT, which only a route with a `connect_matcher` serves in Envoy: without one,
/// a CONNECT is answered as Envoy answers one no route matches: 404 NR, and the HTTP/1
/// connection closed. A CONNECT whose target is not `host:port` is a malformed request
/// to Envoy's HTTP/1 codec: 400 DPE.
fn refuse_connect(shared: &Shared, parts: &Parts, entry: &mut Entry) -> Response<ResponseBody> {
    let http1 = parts.version != Version::HTTP_2;
    let reply = if http1 && parts.uri.authority().is_none() {
        LocalReply::downstream_protocol_error()
    } else {
        tracing::debug!(stat_prefix = %shared.hcm.stat_prefix, uri = %parts.uri, "CONNECT: no route");
        shared.hcm.stats.no_route.inc();
        LocalReply::new(StatusCode::NOT_FOUND, "", Some(ResponseFlag::NoRouteFound))
    };
    if let Some(flag) = reply.flag {
        entry.flag(flag);
    }
    let mut response = reply.response();
    if http1 {
        close_connection(&mut response);
    }
    response.map(ResponseBody::full)
}

/// Asks hyper to close the downstream connection once this response is sent (and says
/// so in `connection: close`), as Envoy does after a protocol error.
fn close_connection<B>(response: &mut Response<B>) {
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// The log entry of a request still being handled. hyper drops the request's future
/// when the downstream goes away; the request is then logged with flag DC, as Envoy
/// logs a stream the downstream reset.
struct Pending {
    /// Boxed: the entry (~350 bytes) moves from here into `finish` and on into the log
    /// slot; a pointer moves instead (`memcpy` calls were ~15% of h2's instructions).
    entry: Option<Box<Entry>>,
    hcm: Arc<HttpConnectionManager>,
    log: Arc<LogSlot>,
}

impl Pending {
    fn entry(&mut self) -> &mut Entry {
        self.entry.as_mut().expect("not yet finished")
    }

    fn take(&mut self) -> Box<Entry> {
        self.entry.take().expect("a request is finished once")
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(mut entry) = self.entry.take() {
            // Dropped for a stream timer's 408, or because the downstream went away.
            match self.log.timeout() {
                Some(why) => {
                    if let Some(flag) = why.flag() {
                        entry.flag(flag);
                    }
                    if let Some(http) = entry.http.as_mut() {
                        http.response_code = 408;
                    }
                }
                None => {
                    entry.flag(ResponseFlag::DownstreamConnectionTermination);
                    self.log.rx_reset();
                }
            }
            self.log.fill(entry, self.hcm.clone());
        }
    }
}

/// Server header, version, stats, the access log line: what every response gets.
async fn finish(
    shared: &Shared,
    mut response: Response<ResponseBody>,
    mut entry: Box<Entry>,
    log: &Arc<LogSlot>,
    from_upstream: bool,
) -> Response<ResponseBody> {
    let hcm = &shared.hcm;
    // The encoder filters, last to first; the chain then waits in the log slot for the
    // end of the stream. Boxed: their state (over 2 KiB) would size every `finish`,
    // and each `finish` future is moved whole into its caller's when it starts.
    if let Some(mut chain) = log.take_chain() {
        // Encoders see the upstream host, as in Envoy (peer_metadata's workload discovery
        // finds the upstream peer by it).
        chain.ctx.info.upstream_host = entry.upstream_host;
        response = Box::pin(async {
            let response = chain.encode(response).await;
            chain.ctx.info.response_code = Some(response.status().as_u16());
            log.set_chain(chain);
            response
        })
        .await;
    }
    let headers = response.headers_mut();
    match hcm.server_header {
        ServerHeader::Overwrite => {
            headers.insert(header::SERVER, hcm.server_name.clone());
        }
        ServerHeader::AppendIfAbsent => {
            if !headers.contains_key(header::SERVER) {
                headers.insert(header::SERVER, hcm.server_name.clone());
            }
        }
        ServerHeader::PassThrough => {
            if !from_upstream {
                headers.insert(header::SERVER, hcm.server_name.clone());
            }
        }
    }
    let status = response.status().as_u16();
    if hcm.tracing.is_some() {
        log.with_span(|span| span.on_response(status, response.headers_mut()));
    }
    hcm.stats.response(status);
    if let Some(http) = entry.http.as_mut() {
        http.response_code = status;
        if from_upstream {
            http.response_code_details = Some("via_upstream".into());
        }
        if http.request_headers.is_some() {
            http.response_headers = Some(response.headers().clone());
        }
    }
    let body_len = hyper::body::Body::size_hint(response.body()).exact();
    let (parts, body) = response.into_parts();
    if hcm.measures_wire_sizes() {
        entry.response_head_bytes = super::wire::response_head(&parts, body_len, log.closes());
        if super::wire::chunked(&parts, body_len) {
            log.set_chunked();
        }
    }
    log.fill(entry, hcm.clone());
    Response::from_parts(parts, body.logged(log.clone()))
}

/// The `Location` of a redirect: each part of the request's URL the redirect replaces.
pub fn redirect_location(
    redirect: &Redirect,
    matched_prefix_len: Option<usize>,
    scheme: &str,
    authority: &str,
    path: &str,
) -> String {
    let new_scheme = redirect.scheme.as_deref().unwrap_or(scheme);
    let host = redirect
        .host
        .as_deref()
        .unwrap_or_else(|| super::route::strip_port(authority));
    let original_port = (redirect.host.is_none())
        .then(|| authority.get(super::route::strip_port(authority).len() + 1..))
        .flatten()
        .filter(|p| !p.is_empty());
    let port = match (redirect.port, original_port) {
        (Some(port), _) => Some(port.to_string()),
        // A scheme change drops the old scheme's port, as Envoy does.
        (None, Some(port)) if new_scheme == scheme => Some(port.to_owned()),
        _ => None,
    };
    let (only_path, query) = match path.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path, None),
    };
    let mut new_path = match &redirect.path {
        PathRedirect::Keep => only_path.to_owned(),
        PathRedirect::Path(p) => p.clone(),
        PathRedirect::Prefix(prefix) => {
            let rest = matched_prefix_len
                .and_then(|len| only_path.get(len..))
                .unwrap_or("");
            format!("{prefix}{rest}")
        }
    };
    let path_has_query = new_path.contains('?');
    if !redirect.strip_query
        && !path_has_query
        && let Some(q) = query
    {
        new_path = format!("{new_path}?{q}");
    }
    match port {
        Some(port) => format!("{new_scheme}://{host}:{port}{new_path}"),
        None => format!("{new_scheme}://{host}{new_path}"),
    }
}
