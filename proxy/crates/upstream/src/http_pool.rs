//! Upstream HTTP connection pools, one per (cluster, host), held by the cluster so they
//! go away with it. HTTP/1.1 connections serve one request at a time and go back to the
//! pool once their response has been read to the end; an HTTP/2 connection is shared
//! by every request to the host. Each connection holds its circuit breaker slot and its
//! `upstream_cx_*` accounting until it closes.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http2;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite};

use super::Cluster;
use super::circuit_breaker::OwnedConnectionSlot;
use super::cluster::UpstreamConnection;
use super::host::Host;
use super::http1;

/// Who is told of the data bytes a [`RequestBody`] reads from the downstream (the
/// request's access log line).
pub trait BodyObserver: Send + Sync + std::fmt::Debug {
    fn received(&self, bytes: u64);
    /// The data itself, for the HTTP filters that watch the body.
    fn data(&self, _data: &Bytes) {}
    /// The downstream's body broke HTTP's framing (a bad chunk size, say): the request
    /// is the downstream's fault, not the upstream's.
    fn protocol_error(&self) {}
    /// The whole body was read.
    fn ended(&self) {}
}

/// Whether a body error is the peer breaking HTTP/1.1's framing (hyper's decoder says
/// `InvalidInput` or `InvalidData`), rather than the peer going away.
fn is_framing_error(error: &hyper::Error) -> bool {
    let mut source = std::error::Error::source(error);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData
            );
        }
        source = err.source();
    }
    false
}

/// A request body sent upstream.
#[derive(Debug)]
pub struct RequestBody {
    incoming: Option<Incoming>,
    observer: Option<Arc<dyn BodyObserver>>,
    /// A body an HTTP filter read whole (and maybe changed): its data, then trailers.
    buffered: Option<(Option<Bytes>, Option<hyper::HeaderMap>)>,
}

impl RequestBody {
    pub fn new(incoming: Incoming, observer: Arc<dyn BodyObserver>) -> Self {
        RequestBody {
            incoming: Some(incoming),
            observer: Some(observer),
            buffered: None,
        }
    }

    /// A body read whole by an HTTP filter (already counted when it was read).
    pub fn buffered(data: Bytes, trailers: Option<hyper::HeaderMap>) -> Self {
        RequestBody {
            incoming: None,
            observer: None,
            buffered: Some(((!data.is_empty()).then_some(data), trailers)),
        }
    }

    /// No body: what a retry of a request without one sends.
    pub fn empty() -> Self {
        RequestBody {
            incoming: None,
            observer: None,
            buffered: None,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some((data, trailers)) = this.buffered.as_mut() {
            // The data, then the trailers, then the end.
            if let Some(data) = data.take() {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            return Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        let Some(incoming) = this.incoming.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = Pin::new(&mut *incoming).poll_frame(cx);
        if let Some(observer) = &this.observer {
            match &frame {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Some(data) = frame.data_ref() {
                        observer.received(data.len() as u64);
                        observer.data(data);
                    }
                }
                Poll::Ready(Some(Err(err))) if is_framing_error(err) => observer.protocol_error(),
                Poll::Ready(None) => observer.ended(),
                _ => {}
            }
            if matches!(frame, Poll::Ready(Some(Ok(_)))) && Body::is_end_stream(incoming) {
                observer.ended();
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        if let Some((data, trailers)) = &self.buffered {
            return data.is_none() && trailers.is_none();
        }
        self.incoming.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        if let Some((data, _)) = &self.buffered {
            return SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64));
        }
        self.incoming
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// Any upstream byte stream: plain TCP today, TLS once a cluster has a transport socket.
pub trait UpstreamIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> UpstreamIo for T {}

pub type BoxedIo = Box<dyn UpstreamIo>;

/// Opens one upstream connection for `cluster` to `host`, counted by the cluster (the
/// returned guard) and reported to outlier detection.
///
/// The one place an upstream HTTP connection is made: the cluster's transport socket
/// (`UpstreamTlsContext`, with ALPN h2/http1.1) belongs here, wrapping `stream`.
pub async fn connect_upstream(
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    secrets: &shunt_tls::Secrets,
    alpn: Option<&[String]>,
    fallback: Option<&str>,
) -> io::Result<(BoxedIo, UpstreamConnection, Session)> {
    use super::transport_socket::{self, ConnectError};
    let shared = super::internal::SharedFilterState::default();
    let connected =
        transport_socket::connect_with(cluster, host, secrets, shared, alpn, fallback).await;
    let (stream, guard) = match connected {
        Ok(connected) => connected,
        Err(ConnectError::Connect(err)) => return Err(err),
        Err(err @ ConnectError::Tls(_)) => return Err(io::Error::other(err)),
    };
    stream.set_nodelay();
    let session = transport_socket::session(cluster, host, &stream, secrets).map(Arc::new);
    // Bytes counted as they move (`upstream_cx_rx_bytes_total`, `_tx_`).
    let stats = &cluster.stats;
    let counted = shunt_core::event::counted::Counted::new(
        stream.defer_writes(),
        stats.upstream_cx_rx_bytes_total.clone(),
        stats.upstream_cx_tx_bytes_total.clone(),
    );
    Ok((Box::new(counted), guard, session))
}

/// What an upstream connection's TLS session told (`None` without TLS), kept with the
/// connection so each request on it can tell its filters (Istio's client-side
/// principals).
pub type Session = Option<Arc<shunt_core::stream_info::Tls>>;

#[derive(Debug, thiserror::Error)]
pub enum CheckoutError {
    /// The cluster's circuit breaker is at `max_connections` (flag UO).
    #[error("circuit breaker overflow")]
    Overflow,
    /// Connecting or the HTTP handshake failed (flag UF).
    #[error("connection failure: {0}")]
    Connect(io::Error),
    #[error("HTTP handshake failed: {0}")]
    Handshake(hyper::Error),
}

/// Envoy's default circuit breaker `max_pending_requests`: requests that may wait for
/// an HTTP/1.1 connection while the cluster is at `max_connections`.
pub const MAX_PENDING_REQUESTS: u64 = 1024;

/// An ALPN list offered instead of the cluster's (`istio.alpn`): connections made
/// with one are pooled apart, as Envoy hashes transport socket options into the pool.
pub type Alpn = Arc<[String]>;

/// A host's pool key: its address and the ALPN override its connections offer.
type PoolKey = (SocketAddr, Option<Alpn>);

/// The pools of one cluster, by host address (and ALPN override). Looked up on every
/// request: foldhash, not SipHash (only endpoints insert keys).
#[derive(Debug, Default)]
pub struct Pools {
    hosts: Mutex<std::collections::HashMap<PoolKey, Arc<HostPool>, foldhash::fast::RandomState>>,
    /// Requests waiting for a connection now (Envoy's pending requests).
    pending: AtomicU64,
}

/// One request counted in [`Pools::pending`] while it waits.
struct Pending<'a>(&'a AtomicU64);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, Default)]
pub struct HostPool {
    /// HTTP/1.1 connections not carrying a request.
    idle: Mutex<IdleSet>,
    /// Wakes a request waiting at `max_connections` for a connection to come back.
    returned: tokio::sync::Notify,
    /// The host's HTTP/2 connection; the async lock makes concurrent first requests
    /// share one handshake.
    h2: tokio::sync::Mutex<Option<(http2::SendRequest<RequestBody>, Session)>>,
}

/// The idle HTTP/1.1 connections of a host, and the task that closes those the
/// upstream closes while they wait (as Envoy does: it reads idle connections too).
#[derive(Debug, Default)]
struct IdleSet {
    connections: Vec<(http1::Connection, Session)>,
    /// The reaper's waker, once it ran; whether it was started.
    reaper: Option<Waker>,
    reaping: bool,
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // The reaper ends when it finds its pool gone.
        let idle = self.idle.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(reaper) = idle.reaper.take() {
            reaper.wake();
        }
    }
}

/// A connection taken for one request.
#[derive(Debug)]
pub enum Sender {
    /// With its pool, whether it was reused, and its TLS session.
    Http1(http1::Connection, Arc<HostPool>, bool, Session),
    Http2(http2::SendRequest<RequestBody>, bool, Session),
}

impl Pools {
    /// Keeps the pools of the hosts `keep` says yes to; the others' idle connections
    /// close as their senders drop.
    pub fn retain(&self, keep: impl Fn(&SocketAddr) -> bool) {
        self.hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|(address, _), _| keep(address));
    }

    /// How many hosts have a pool.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.hosts.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes the pool of `address`, as a first request to it does.
    #[cfg(test)]
    pub fn touch(&self, address: SocketAddr) {
        self.host(address, None);
    }

    fn host(&self, address: SocketAddr, alpn: Option<&Alpn>) -> Arc<HostPool> {
        self.hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((address, alpn.cloned()))
            .or_default()
            .clone()
    }

    /// A connection to `host` ready for a request: an idle pooled one, the shared
    /// HTTP/2 one, or a new one.
    pub async fn checkout(
        &self,
        cluster: &Arc<Cluster>,
        host: &Arc<Host>,
        http2: bool,
        secrets: &shunt_tls::Secrets,
    ) -> Result<Sender, CheckoutError> {
        self.checkout_with_alpn(cluster, host, http2, secrets, None)
            .await
    }

    /// [`Pools::checkout`] from the pool of connections that offer `alpn`.
    pub async fn checkout_with_alpn(
        &self,
        cluster: &Arc<Cluster>,
        host: &Arc<Host>,
        http2: bool,
        secrets: &shunt_tls::Secrets,
        alpn: Option<&Alpn>,
    ) -> Result<Sender, CheckoutError> {
        let pool = self.host(host.address, alpn);
        let alpn = alpn.map(|a| &a[..]);
        // Envoy's `upstream_rq_pending_total`: the request found no connection ready
        // and waited for one (being made, or coming back to the pool).
        let pending_total = &cluster.stats.upstream_rq_pending_total;
        if http2 {
            let (mut shared, waited) = match pool.h2.try_lock() {
                Ok(shared) => (shared, false),
                // Another request is making the connection: this one waits for it.
                Err(_) => {
                    pending_total.inc();
                    (pool.h2.lock().await, true)
                }
            };
            if let Some((sender, session)) = shared.as_ref().filter(|(s, _)| !s.is_closed()) {
                return Ok(Sender::Http2(sender.clone(), true, session.clone()));
            }
            if !waited {
                pending_total.inc();
            }
            // Boxed: connecting is rare, and every request's future would otherwise
            // carry its size.
            let (sender, session) = Box::pin(connect_http2(cluster, host, secrets, alpn))
                .await
                .inspect_err(|err| ejected(cluster, err))?;
            *shared = Some((sender.clone(), session.clone()));
            return Ok(Sender::Http2(sender, false, session));
        }
        let mut pending = None;
        let mut waited = false;
        let slot = loop {
            if let Some((connection, session)) = pool.take_idle() {
                return Ok(Sender::Http1(connection, pool, true, session));
            }
            if !waited {
                pending_total.inc();
                waited = true;
            }
            // The first refusal counts as an overflow; then only room is watched for.
            let slot = if pending.is_none() || !cluster.circuit_breaker.is_full() {
                cluster.circuit_breaker.try_acquire_owned()
            } else {
                None
            };
            if let Some(slot) = slot {
                break slot;
            }
            // At max_connections: as in Envoy, the request waits (up to its route
            // timeout) for a connection to come back or for room, unless too many wait.
            if pending.is_none() {
                if self.pending.fetch_add(1, Ordering::AcqRel) >= MAX_PENDING_REQUESTS {
                    self.pending.fetch_sub(1, Ordering::AcqRel);
                    return Err(CheckoutError::Overflow);
                }
                pending = Some(Pending(&self.pending));
            }
            // Room may come from a connection to another host closing: look again
            // every 20 ms, or as soon as one of this host's comes back.
            let returned = pool.returned.notified();
            let recheck = tokio::time::sleep(std::time::Duration::from_millis(20));
            tokio::select! {
                () = returned => {}
                () = recheck => {}
            }
        };
        drop(pending);
        let (connection, session) = Box::pin(connect_http1(cluster, host, secrets, slot, alpn))
            .await
            .inspect_err(|err| ejected(cluster, err))?;
        Ok(Sender::Http1(connection, pool, false, session))
    }
}

impl HostPool {
    /// An idle connection still open, newest first (the likeliest to be), opened on
    /// this worker if one was (as Envoy's pools are per worker): another worker's
    /// would be woken by that worker's event loop, one thread wake-up more each time.
    /// Those the upstream closed are dropped.
    fn take_idle(&self) -> Option<(http1::Connection, Session)> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let mut cx = Context::from_waker(Waker::noop());
        let here = shunt_core::event::workers::current();
        loop {
            let connections = &mut idle.connections;
            let at = connections
                .iter()
                .rposition(|(c, _)| c.worker() == here)
                .or(connections.len().checked_sub(1))?;
            let (mut connection, session) = connections.remove(at);
            if connection.poll_unusable(&mut cx).is_pending() {
                return Some((connection, session));
            }
        }
    }

    /// A connection whose response was read to its end, back for the next request.
    pub(super) fn give_back(self: &Arc<Self>, mut connection: http1::Connection, session: Session) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if !idle.reaping {
            idle.reaping = true;
            tokio::spawn(reap(Arc::downgrade(self)));
        }
        // Looked at with the reaper's waker: it is woken if the upstream closes it.
        let mut cx = Context::from_waker(idle.reaper.as_ref().unwrap_or(Waker::noop()));
        if connection.poll_unusable(&mut cx).is_ready() {
            return;
        }
        idle.connections.push((connection, session));
        drop(idle);
        // Lock-free when nobody waits (a permit is kept: one extra look, at worst).
        self.returned.notify_one();
    }
}

/// Closes a pool's idle connections as their upstream closes them, until the pool is
/// gone. It runs only when one of them has something to read.
async fn reap(pool: Weak<HostPool>) {
    std::future::poll_fn(|cx| {
        let Some(pool) = pool.upgrade() else {
            return Poll::Ready(());
        };
        let mut idle = pool.idle.lock().unwrap_or_else(|e| e.into_inner());
        if !idle
            .reaper
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            idle.reaper = Some(cx.waker().clone());
        }
        idle.connections
            .retain_mut(|(connection, _)| connection.poll_unusable(cx).is_pending());
        Poll::Pending
    })
    .await
}

/// A request waiting for a connection that failed: Envoy's
/// `upstream_rq_pending_failure_eject`.
fn ejected(cluster: &Cluster, err: &CheckoutError) {
    if !matches!(err, CheckoutError::Overflow) {
        cluster.stats.upstream_rq_pending_failure_eject.inc();
    }
}

/// The breaker slot and the accounting guard of a new connection.
fn open(cluster: &Cluster) -> Result<OwnedConnectionSlot, CheckoutError> {
    cluster
        .circuit_breaker
        .try_acquire_owned()
        .ok_or(CheckoutError::Overflow)
}

async fn connect_http1(
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    secrets: &shunt_tls::Secrets,
    slot: OwnedConnectionSlot,
    alpn: Option<&[String]>,
) -> Result<(http1::Connection, Session), CheckoutError> {
    // Envoy counts the protocol as the connection is made, failed connects too.
    cluster.stats.upstream_cx_http1_total.inc();
    let (io, guard, session) = connect_upstream(cluster, host, secrets, alpn, Some("http/1.1"))
        .await
        .map_err(CheckoutError::Connect)?;
    Ok((http1::Connection::new(io, (slot, guard)), session))
}

pub(super) async fn connect_http2(
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    secrets: &shunt_tls::Secrets,
    alpn: Option<&[String]>,
) -> Result<(http2::SendRequest<RequestBody>, Session), CheckoutError> {
    let slot = open(cluster)?;
    cluster.stats.upstream_cx_http2_total.inc();
    let (io, guard, session) = connect_upstream(cluster, host, secrets, alpn, Some("h2"))
        .await
        .map_err(CheckoutError::Connect)?;
    let (sender, connection) = http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(io))
        .await
        .map_err(CheckoutError::Handshake)?;
    drive(connection, (slot, guard), host.address, "HTTP/2");
    Ok((sender, session))
}

/// Drives an upstream connection in the background until it ends, holding its breaker
/// slot and the cluster's count of it as long.
fn drive(
    connection: impl Future<Output = hyper::Result<()>> + Send + 'static,
    held: (OwnedConnectionSlot, UpstreamConnection),
    address: SocketAddr,
    protocol: &'static str,
) {
    tokio::spawn(async move {
        let _held = held;
        if let Err(err) = connection.await {
            tracing::debug!(upstream = %address, %err, "upstream {protocol} connection ended with an error");
        }
    });
}

/// A request that failed; `unsent` gives it back when it never left (the connection
/// was already closing), so it can go on another connection.
#[derive(Debug)]
pub struct SendError {
    pub error: BoxError,
    /// The upstream's response broke HTTP (Envoy's `UPE`).
    pub malformed: bool,
    pub unsent: Option<Request<RequestBody>>,
}

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Sender {
    /// Whether the connection served a request before: an upstream may close an idle
    /// keep-alive connection just as a request is sent on it.
    pub fn reused(&self) -> bool {
        match self {
            Sender::Http1(_, _, reused, _) | Sender::Http2(_, reused, _) => *reused,
        }
    }

    /// The connection's TLS session, if it has one.
    pub fn session(&self) -> Session {
        match self {
            Sender::Http1(_, _, _, session) | Sender::Http2(_, _, session) => session.clone(),
        }
    }

    /// Sends `request` and waits for the response head. An HTTP/1.1 connection returns
    /// to its pool once the response body has been read.
    pub async fn send(
        self,
        mut request: Request<RequestBody>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        match self {
            Sender::Http1(connection, pool, _, session) => connection
                .send(request, http1::Back { pool, session })
                .await
                .map(|response| response.map(UpstreamBody::Http1))
                .map_err(|failed| SendError {
                    malformed: failed.error.is_malformed(),
                    error: Box::new(failed.error),
                    unsent: failed.unsent,
                }),
            Sender::Http2(mut sender, _, _) => {
                never_index_credentials(request.headers_mut());
                sender
                    .try_send_request(request)
                    .await
                    .map(|response| response.map(UpstreamBody::Http2))
                    .map_err(|mut err| {
                        let unsent = err.take_message();
                        let error = err.into_error();
                        SendError {
                            malformed: error.is_parse(),
                            error: Box::new(error),
                            unsent,
                        }
                    })
            }
        }
    }
}

/// The credentials in `headers`, marked to be sent as never-indexed HPACK literals
/// (RFC 7541 7.1.3), as nghttp2 sends them (Envoy's HTTP/2 codec for most of its
/// life): `authorization`, `proxy-authorization`, and a `cookie` under 20 bytes, which
/// is short enough to guess. A field in a connection's dynamic table can be recovered
/// by a compression oracle (CRIME). h2 keeps `authorization` and `cookie` out of its
/// own table, but as literals *without* indexing, which a proxy after us may index,
/// and it indexes `proxy-authorization`. Its decoder does not keep the never-indexed
/// mark a field arrived with, so an HTTP/2 downstream's marks are set again here.
fn never_index_credentials(headers: &mut hyper::HeaderMap) {
    use hyper::header::{AUTHORIZATION, COOKIE, Entry, PROXY_AUTHORIZATION};
    for name in [AUTHORIZATION, PROXY_AUTHORIZATION, COOKIE] {
        let short_only = name == COOKIE;
        if let Entry::Occupied(mut values) = headers.entry(name) {
            for value in values.iter_mut() {
                if !short_only || value.len() < 20 {
                    value.set_sensitive(true);
                }
            }
        }
    }
}

/// An upstream response body: from an HTTP/1.1 connection of ours, or hyper's HTTP/2.
#[derive(Debug)]
pub enum UpstreamBody {
    Http1(http1::ResponseBody),
    Http2(Incoming),
}

impl From<Incoming> for UpstreamBody {
    fn from(incoming: Incoming) -> Self {
        UpstreamBody::Http2(incoming)
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Http1(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(BoxError::from))),
            UpstreamBody::Http2(body) => Pin::new(body)
                .poll_frame(cx)
                .map(|f| f.map(|r| r.map_err(BoxError::from))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Http1(body) => body.is_end_stream(),
            UpstreamBody::Http2(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Http1(body) => body.size_hint(),
            UpstreamBody::Http2(body) => body.size_hint(),
        }
    }
}
