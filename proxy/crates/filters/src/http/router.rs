//! Envoy's router filter: sends a routed request to its cluster (looked up in the
//! current snapshot), choosing a host with the cluster's load balancer, over a pooled
//! connection, within the route's timeout, retrying as the retry policy allows. Its
//! failures become Envoy's local replies with Envoy's response flags.

use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::body::Body as _;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri, Version};

use super::route::{RetryPolicy, RouteAction};
use shunt_core::access_log::{Entry, ResponseFlag};
use shunt_upstream::backoff::Backoff;
use shunt_upstream::cluster::UpstreamProtocol;
use shunt_upstream::http_pool::RequestBody;
use shunt_upstream::http_pool::{CheckoutError, SendError, UpstreamBody};
use shunt_upstream::stats::ActiveRequest;
use shunt_upstream::{Cluster, LbContext};

/// A response shunt makes itself (Envoy's local reply).
#[derive(Debug)]
pub struct LocalReply {
    pub status: StatusCode,
    pub body: &'static str,
    pub flag: Option<ResponseFlag>,
}

impl LocalReply {
    pub fn new(status: StatusCode, body: &'static str, flag: Option<ResponseFlag>) -> Self {
        LocalReply { status, body, flag }
    }

    fn no_healthy_upstream() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy upstream",
            Some(ResponseFlag::NoHealthyUpstream),
        )
    }

    fn connect_failure() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
            Some(ResponseFlag::UpstreamConnectionFailure),
        )
    }

    fn overflow() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error or disconnect/reset before headers. reset reason: overflow",
            Some(ResponseFlag::UpstreamOverflow),
        )
    }

    fn reset() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error or disconnect/reset before headers. reset reason: connection termination",
            Some(ResponseFlag::UpstreamConnectionTermination),
        )
    }

    /// An upstream response hyper could not parse: Envoy's 502 with flag UPE.
    pub fn upstream_protocol_error() -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream connect error or disconnect/reset before headers. reset reason: protocol error",
            Some(ResponseFlag::UpstreamProtocolError),
        )
    }

    /// A request the downstream's codec rejected (a malformed chunked body, a CONNECT
    /// without an authority): Envoy's 400 `Bad Request` with flag DPE.
    pub fn downstream_protocol_error() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "Bad Request",
            Some(ResponseFlag::DownstreamProtocolError),
        )
    }

    fn timeout() -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream request timeout",
            Some(ResponseFlag::UpstreamRequestTimeout),
        )
    }

    pub fn response(&self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::from_static(self.body.as_bytes()));
        *response.status_mut() = self.status;
        if !self.body.is_empty() {
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        }
        response
    }
}

/// What the router needs besides the request.
pub struct Upstream<'a> {
    pub cluster: &'a Arc<Cluster>,
    /// Where the downstream connection was going (ORIGINAL_DST clusters go there).
    pub destination: SocketAddr,
    pub downstream_local: SocketAddr,
    pub own_ports: &'a [u16],
    pub retry_policy: Option<&'a RetryPolicy>,
    pub suppress_envoy_headers: bool,
    /// The request's hash under the route's `hash_policy` (RING_HASH, MAGLEV).
    pub hash: Option<u64>,
    /// The secrets the cluster's TLS context names (the current snapshot's).
    pub secrets: &'a shunt_tls::Secrets,
    /// The ALPN list to offer instead of the cluster's (`istio.alpn`).
    pub alpn: Option<shunt_upstream::http_pool::Alpn>,
}

/// `ms` as a header value. The small counts most responses carry
/// (`x-envoy-upstream-service-time`) come from a table made once, so they allocate
/// nothing per request.
pub fn millis_header(ms: u64) -> HeaderValue {
    const TABLE: usize = 128;
    static SMALL: std::sync::OnceLock<Vec<HeaderValue>> = std::sync::OnceLock::new();
    let small = SMALL.get_or_init(|| {
        (0..TABLE)
            .map(|n| HeaderValue::from_static(String::leak(n.to_string())))
            .collect()
    });
    match small.get(ms as usize) {
        Some(value) => value.clone(),
        None => HeaderValue::from(ms),
    }
}

/// The upstream's response and how long it took to its head
/// (`x-envoy-upstream-service-time`).
pub struct Forwarded {
    pub response: Response<UpstreamBody>,
    pub service_time: Duration,
    /// When the route's timeout ends: the response body must be complete by then.
    pub deadline: Option<Instant>,
}

enum Attempt {
    /// The response head, and when it arrived.
    Response(Response<UpstreamBody>, Instant),
    /// Failed before a response head; whether a retry policy may retry it.
    Failed(LocalReply, Retriable),
    /// Fatal for the request (no host, overflow).
    Fatal(LocalReply),
}

#[derive(Clone, Copy)]
enum Retriable {
    ConnectFailure,
    Reset,
}

/// The request head as forwarded: method, authority, path and headers after rewrites.
pub struct Head {
    pub method: hyper::Method,
    pub authority: String,
    pub path: String,
    /// The downstream's path as its codec parsed it: an HTTP/1.1 upstream request whose
    /// `path` is still this one reuses it rather than parsing the string again.
    pub received_path: Option<hyper::http::uri::PathAndQuery>,
    pub headers: HeaderMap,
    pub downstream_version: Version,
}

impl Head {
    /// The request for one attempt, in the upstream's HTTP version: HTTP/1.1 in origin
    /// form with a Host header, HTTP/2 with the authority in the URI. The `last` attempt
    /// takes the headers rather than copying them (nothing will send them again).
    pub fn request(&mut self, http2: bool, body: RequestBody, last: bool) -> Request<RequestBody> {
        let mut request = Request::new(body);
        *request.method_mut() = self.method.clone();
        *request.headers_mut() = if last {
            std::mem::take(&mut self.headers)
        } else {
            self.headers.clone()
        };
        if http2 {
            *request.version_mut() = Version::HTTP_2;
            *request.uri_mut() = Uri::builder()
                .scheme("http")
                .authority(self.authority.as_str())
                .path_and_query(self.path.as_str())
                .build()
                .unwrap_or_else(|_| Uri::from_static("/"));
            request.headers_mut().remove(header::HOST);
        } else {
            *request.version_mut() = Version::HTTP_11;
            *request.uri_mut() = match &self.received_path {
                Some(received) if received.as_str() == self.path => Uri::from(received.clone()),
                _ => {
                    // The last attempt hands its strings over rather than copying them.
                    let path = if last {
                        std::mem::take(&mut self.path)
                    } else {
                        self.path.clone()
                    };
                    Uri::try_from(path).unwrap_or_else(|_| Uri::from_static("/"))
                }
            };
            let authority = if last {
                std::mem::take(&mut self.authority)
            } else {
                self.authority.clone()
            };
            if let Ok(host) = HeaderValue::try_from(authority) {
                request.headers_mut().insert(header::HOST, host);
            }
        }
        request
    }
}

/// Forwards one request to `upstream.cluster`. A reply of the router's own for the
/// cluster (no healthy upstream, connect failure, overflow, reset, timeout) is charged
/// to the cluster's code stats, as Envoy's `chargeUpstreamAbort` does.
// One async fn, not a wrapper around another: each level's future is moved whole
// (over 4 KiB here) into its caller's when it starts (`callgrind`).
pub async fn forward(
    upstream: &Upstream<'_>,
    action: &RouteAction,
    mut head: Head,
    body: RequestBody,
    entry: &mut Entry,
) -> Result<Forwarded, LocalReply> {
    let cluster = upstream.cluster;
    let http2 = match cluster.http_protocol {
        UpstreamProtocol::Http1 => false,
        UpstreamProtocol::Http2 => true,
        UpstreamProtocol::UseDownstream => head.downstream_version == Version::HTTP_2,
    };
    if let Some(timeout) = &action.timeout_header
        && !upstream.suppress_envoy_headers
    {
        head.headers.insert(
            super::headers::ENVOY_EXPECTED_RQ_TIMEOUT_MS,
            timeout.clone(),
        );
    }
    // A body still arriving cannot be sent twice: only complete requests are retried.
    let retry = upstream.retry_policy.filter(|_| body.is_end_stream());
    let attempts = 1 + retry.map_or(0, |r| r.num_retries);
    let mut now = Instant::now();
    let deadline = action.timeout.map(|t| now + t);
    let mut body = Some(body);
    let mut tried: Vec<SocketAddr> = Vec::new();
    let mut last = LocalReply::connect_failure();
    let forwarded = 'forwarded: {
        for attempt in 0..attempts {
            if attempt > 0 {
                cluster.stats.upstream_rq_retry.inc();
                tokio::time::sleep(RETRY_BACKOFF.delay(attempt)).await;
                now = Instant::now();
            }
            let remaining = deadline.map(|d| d.saturating_duration_since(now));
            if remaining.is_some_and(|r| r.is_zero()) {
                break;
            }
            let per_try = match (remaining, retry.and_then(|r| r.per_try_timeout)) {
                (Some(r), Some(p)) => Some(r.min(p)),
                (r, p) => r.or(p),
            };
            let body = body.take().unwrap_or_else(RequestBody::empty);
            let started = now;
            let final_attempt = attempt + 1 == attempts;
            // `None`: the per-try timeout fired first.
            let outcome = {
                // Pinned where it lies and raced against the timer there: wrapped in
                // `timeout_at` and then awaited, the attempt (about 3 KiB) was copied
                // twice per request (`callgrind`).
                let run = attempt_once(
                    upstream,
                    &mut head,
                    http2,
                    body,
                    final_attempt,
                    &tried,
                    entry,
                );
                tokio::pin!(run);
                match per_try {
                    Some(limit) => {
                        // From the instant already read: `timeout` would read the clock
                        // again.
                        let timer = tokio::time::sleep_until((now + limit).into());
                        tokio::pin!(timer);
                        std::future::poll_fn(|cx| match run.as_mut().poll(cx) {
                            Poll::Ready(attempt) => Poll::Ready(Some(attempt)),
                            Poll::Pending => timer.as_mut().poll(cx).map(|()| None),
                        })
                        .await
                    }
                    None => Some(run.await),
                }
            };
            match outcome {
                Some(Attempt::Response(response, answered)) => {
                    if let Some(retry) = retry
                        && attempt + 1 < attempts
                        && retry.retries_status(response.status())
                    {
                        tracing::debug!(cluster = %cluster.name, status = %response.status(), "retrying on status");
                        if let Some(host) = entry.upstream_host {
                            tried.push(host);
                        }
                        continue;
                    }
                    break 'forwarded Ok(Forwarded {
                        response,
                        service_time: answered.saturating_duration_since(started),
                        deadline,
                    });
                }
                Some(Attempt::Fatal(reply)) => break 'forwarded Err(reply),
                Some(Attempt::Failed(reply, why)) => {
                    if let Some(host) = entry.upstream_host {
                        tried.push(host);
                    }
                    let again = retry.is_some_and(|r| match why {
                        Retriable::ConnectFailure => r.retries_connect_failure(),
                        Retriable::Reset => r.retries_reset(),
                    });
                    last = reply;
                    if !again {
                        break;
                    }
                }
                None => {
                    let overall = deadline.is_some_and(|d| Instant::now() >= d);
                    if overall || !retry.is_some_and(RetryPolicy::retries_reset) {
                        cluster.stats.upstream_rq_timeout.inc();
                        break 'forwarded Err(LocalReply::timeout());
                    }
                    if let Some(host) = entry.upstream_host {
                        tried.push(host);
                    }
                    last = LocalReply::timeout();
                }
            }
        }
        if last.flag == Some(ResponseFlag::UpstreamRequestTimeout) {
            cluster.stats.upstream_rq_timeout.inc();
        }
        Err(last)
    };
    if let Err(reply) = &forwarded {
        upstream.cluster.stats.charge(reply.status.as_u16());
    }
    forwarded
}

/// Envoy's default retry back-off: 25 ms doubling per retry, fully jittered, at most
/// 250 ms.
const RETRY_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(25), Duration::from_millis(250)).full_jitter(0.0);

async fn attempt_once(
    upstream: &Upstream<'_>,
    head: &mut Head,
    http2: bool,
    body: RequestBody,
    last: bool,
    tried: &[SocketAddr],
    entry: &mut Entry,
) -> Attempt {
    let cluster = upstream.cluster;
    let ctx = LbContext {
        hash: upstream.hash,
        tried,
    };
    let Some(host) = cluster.choose_host(&ctx, Some(upstream.destination)) else {
        return Attempt::Fatal(LocalReply::no_healthy_upstream());
    };
    if crate::tcp::loops_back(host.address, upstream.downstream_local, upstream.own_ports) {
        tracing::warn!(upstream = %host.address, "refusing an HTTP request whose destination is the proxy itself");
        return Attempt::Fatal(LocalReply::no_healthy_upstream());
    }
    entry.upstream_host = Some(host.address);
    let _active = ActiveRequest::new(&cluster.stats);
    let mut request = head.request(http2, body, last);
    // A request that never left a reused connection (the upstream closed it while
    // idle) goes on another one; a few times at most, the last one new.
    for _ in 0..3 {
        let sender = match cluster
            .http_pools
            .checkout_with_alpn(
                cluster,
                &host,
                http2,
                upstream.secrets,
                upstream.alpn.as_ref(),
            )
            .await
        {
            Ok(sender) => sender,
            Err(CheckoutError::Overflow) => return Attempt::Fatal(LocalReply::overflow()),
            Err(err) => {
                tracing::info!(cluster = %cluster.name, upstream = %host.address, %err, "upstream connection failed");
                return Attempt::Failed(LocalReply::connect_failure(), Retriable::ConnectFailure);
            }
        };
        let reused = sender.reused();
        let session = sender.session();
        let tls = session.as_deref();
        entry.upstream_peer_uri_sans = tls.map(|t| t.peer_uri_sans.clone()).unwrap_or_default();
        entry.upstream_local_uri_sans = tls.map(|t| t.local_uri_sans.clone()).unwrap_or_default();
        let sent = Instant::now();
        match sender.send(request).await {
            Ok(response) => {
                let stats = &cluster.stats;
                stats.upstream_rq_total.inc();
                stats.charge(response.status().as_u16());
                let answered = Instant::now();
                stats
                    .upstream_rq_time
                    .record((answered - sent).as_secs_f64() * 1000.0);
                return Attempt::Response(response, answered);
            }
            Err(SendError {
                unsent: Some(unsent),
                error,
                ..
            }) if reused => {
                tracing::debug!(cluster = %cluster.name, upstream = %host.address, %error, "pooled connection closed before the request left; sending it on another");
                request = unsent;
            }
            Err(SendError {
                error,
                malformed: true,
                ..
            }) => {
                cluster.stats.upstream_rq_total.inc();
                cluster.stats.upstream_cx_protocol_error.inc();
                tracing::debug!(cluster = %cluster.name, upstream = %host.address, %error, "upstream response malformed");
                return Attempt::Failed(LocalReply::upstream_protocol_error(), Retriable::Reset);
            }
            Err(SendError { error, .. }) => {
                cluster.stats.upstream_rq_total.inc();
                tracing::debug!(cluster = %cluster.name, upstream = %host.address, %error, "upstream reset before the response");
                return Attempt::Failed(LocalReply::reset(), Retriable::Reset);
            }
        }
    }
    Attempt::Failed(LocalReply::reset(), Retriable::Reset)
}

/// Headers that describe one hop's connection, never forwarded (RFC 9110 7.6.1), with
/// those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    static HOP_BY_HOP: [HeaderName; 6] = [
        header::CONNECTION,
        super::headers::KEEP_ALIVE,
        super::headers::PROXY_CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        super::headers::HTTP2_SETTINGS,
    ];
    // One look at each name, noting which are there: most requests carry none of
    // these and most responses only `connection: keep-alive`, so only those present
    // are looked up again to be removed (each removal hashes its name). `LENGTHS` holds
    // the names' lengths (2 is `te`): one bit test rules out almost every other name
    // before any comparison (a response's scan was ~600 instructions, `callgrind`).
    const LENGTHS: u32 = 1 << 2 | 1 << 7 | 1 << 10 | 1 << 14 | 1 << 16 | 1 << 17;
    let (mut present, mut te) = (0u8, false);
    for name in headers.keys() {
        let len = name.as_str().len();
        if len >= 32 || LENGTHS & (1 << len) == 0 {
            continue;
        }
        if let Some(i) = HOP_BY_HOP.iter().position(|hop| hop == name) {
            present |= 1 << i;
        } else if name == header::TE {
            te = true;
        }
    }
    if present & 1 != 0 {
        // The headers `Connection` names, but for its usual tokens (which name none).
        let named: Vec<HeaderName> = shunt_upstream::http1::tokens(headers, header::CONNECTION)
            .filter(|token| {
                !token.eq_ignore_ascii_case(b"keep-alive") && !token.eq_ignore_ascii_case(b"close")
            })
            .filter_map(|token| HeaderName::from_bytes(token).ok())
            .collect();
        for name in named {
            te |= name == header::TE;
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
    // `te: trailers` is how gRPC says it understands trailers; keep only that.
    if te
        && let Some(value) = headers.get(header::TE)
        && !value.as_bytes().eq_ignore_ascii_case(b"trailers")
    {
        headers.remove(header::TE);
    }
}
