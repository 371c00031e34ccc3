//! The bodies the connection manager moves: a request body on its way upstream (counted,
//! or empty for a retry), and a response body on its way downstream (counted). Both hold
//! the request's [`LogSlot`], which writes the access log line once neither is in use:
//! both directions are over, so the line carries the bytes and the whole duration, as
//! Envoy logs at the end of a stream.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};

use super::config::{HttpConnectionManager, StreamTimeouts};
use super::filter::BodyTransform;
use super::filter::chain::{ActiveChain, BUFFER_LIMIT};
use super::timeouts::Timeout;
use crate::tracers::active::ActiveSpan;
use shunt_core::access_log::{Entry, ResponseFlag};
use shunt_core::stats::Counter;
use shunt_upstream::http_pool::UpstreamBody;

/// The access log line of one request, written when the last holder lets go.
#[derive(Debug)]
pub struct LogSlot {
    /// When the stream started, and when a byte last moved (ms after the start): the
    /// stream timers' clock.
    started: tokio::time::Instant,
    activity_ms: AtomicU64,
    /// The whole request body was read.
    request_complete: AtomicBool,
    /// The stream timer that ended the stream, if one did.
    ended_by: Mutex<Option<Timeout>>,
    /// The route's `max_stream_duration`, once routed: `Some(None)` turns it off.
    max_duration: Mutex<Option<Option<std::time::Duration>>>,
    /// Wakes the stream timers when the route changes their deadline.
    rescheduled: tokio::sync::Notify,
    /// Data bytes read from the downstream (`bytes_received`) and written to it.
    received: AtomicU64,
    sent: AtomicU64,
    /// The response goes out chunked: its chunks' framing, counted as they are sent,
    /// belongs to its wire size (Istio's `istio_response_bytes`).
    chunked: AtomicBool,
    framing: AtomicU64,
    /// The downstream asked to close after this request (hyper then says so).
    closes: AtomicBool,
    /// The downstream's request body broke HTTP's framing.
    downstream_protocol_error: AtomicBool,
    /// Set once the request has its response (or was given up); empty: no line.
    line: Mutex<Option<(Box<Entry>, Arc<HttpConnectionManager>)>>,
    /// The stream's HTTP filters, told when the stream is over.
    chain: Mutex<ChainSlot>,
    /// Whether a filter of `chain` watches the body frames (saves the lock otherwise).
    observed: AtomicBool,
    /// `downstream_rq_rx_reset` and `downstream_rq_tx_reset` of the stream's HCM.
    resets: std::sync::OnceLock<[Counter; 2]>,
    /// The request's span, ended with the line.
    span: Mutex<Option<Box<ActiveSpan>>>,
}

/// Where the stream's filters wait between their calls.
#[derive(Debug, Default)]
struct ChainSlot {
    chain: Option<ActiveChain>,
    /// Lent to the encoders ([`LogSlot::take_chain`]).
    lent: bool,
    /// Request data that passed while they were lent, up to [`BUFFER_LIMIT`] bytes
    /// (an encoder that buffers a large response must not make the upload's bytes
    /// stay with it).
    missed: Vec<Bytes>,
    missed_bytes: usize,
}

impl LogSlot {
    pub fn new() -> Arc<LogSlot> {
        Arc::new(LogSlot {
            started: tokio::time::Instant::now(),
            activity_ms: AtomicU64::new(0),
            request_complete: AtomicBool::new(false),
            ended_by: Mutex::new(None),
            max_duration: Mutex::new(None),
            rescheduled: tokio::sync::Notify::new(),
            received: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            chunked: AtomicBool::new(false),
            framing: AtomicU64::new(0),
            closes: AtomicBool::new(false),
            downstream_protocol_error: AtomicBool::new(false),
            line: Mutex::new(None),
            chain: Mutex::new(ChainSlot::default()),
            observed: AtomicBool::new(false),
            resets: std::sync::OnceLock::new(),
            span: Mutex::new(None),
        })
    }

    /// Keeps the request's span until the stream ends.
    pub fn set_span(&self, span: ActiveSpan) {
        *self.span.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(span));
    }

    /// Runs `call` on the request's span, if it has one.
    pub fn with_span(&self, call: impl FnOnce(&mut ActiveSpan)) {
        if let Some(span) = self.span.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            call(span);
        }
    }

    /// Where the stream's resets are counted.
    pub fn count_resets(&self, rx: Counter, tx: Counter) {
        let _ = self.resets.set([rx, tx]);
    }

    /// The downstream reset the stream (or went away) before its response was sent.
    pub fn rx_reset(&self) {
        if let Some([rx, _]) = self.resets.get() {
            rx.inc();
        }
    }

    /// shunt reset the stream: its response could not be sent whole.
    fn tx_reset(&self) {
        if let Some([_, tx]) = self.resets.get() {
            tx.inc();
        }
    }

    /// The response is sent chunked: count its framing, the last chunk included.
    pub fn set_chunked(&self) {
        self.chunked.store(true, Ordering::Relaxed);
        self.framing
            .fetch_add(super::wire::LAST_CHUNK, Ordering::Relaxed);
    }

    pub fn set_closes(&self, closes: bool) {
        self.closes.store(closes, Ordering::Relaxed);
    }

    pub fn closes(&self) -> bool {
        self.closes.load(Ordering::Relaxed)
    }

    pub fn started(&self) -> tokio::time::Instant {
        self.started
    }

    pub fn last_activity(&self) -> tokio::time::Instant {
        self.started + std::time::Duration::from_millis(self.activity_ms.load(Ordering::Relaxed))
    }

    /// A byte moved on the stream: its idle timer starts again.
    pub fn active(&self) {
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.activity_ms.fetch_max(ms, Ordering::Relaxed);
    }

    pub fn request_complete(&self) -> bool {
        self.request_complete.load(Ordering::Relaxed)
    }

    pub fn set_request_complete(&self) {
        self.request_complete.store(true, Ordering::Relaxed);
    }

    /// The route's `max_stream_duration` replaces the connection manager's (Envoy
    /// recomputes the timer once the route is known; the stream's age still counts).
    pub fn set_max_duration(&self, max: Option<std::time::Duration>) {
        *self.max_duration.lock().unwrap_or_else(|e| e.into_inner()) = Some(max);
        self.rescheduled.notify_waiters();
    }

    /// The stream's duration limit: the route's if it set one, else `default`.
    pub fn max_duration(
        &self,
        default: Option<std::time::Duration>,
    ) -> Option<std::time::Duration> {
        self.max_duration
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwrap_or(default)
    }

    /// Resolves when the route changed the stream's deadlines.
    pub fn rescheduled(&self) -> tokio::sync::futures::Notified<'_> {
        self.rescheduled.notified()
    }

    /// Whether the route set its own duration limit.
    pub fn has_route_max_duration(&self) -> bool {
        self.max_duration
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Notes the timer that ended the stream (flag, 408 if the request is then dropped
    /// unanswered).
    pub fn ended_by(&self, why: Timeout) {
        *self.ended_by.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        if let Some(flag) = why.flag() {
            self.flag(flag);
        }
    }

    pub fn timeout(&self) -> Option<Timeout> {
        *self.ended_by.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The entry to write, to `hcm`'s access logs.
    pub fn fill(&self, entry: Box<Entry>, hcm: Arc<HttpConnectionManager>) {
        *self.line.lock().unwrap_or_else(|e| e.into_inner()) = Some((entry, hcm));
    }

    /// Keeps the stream's filters until the stream ends ([`ActiveChain::complete`]).
    /// Request data that passed while the encoders had them is shown to them now,
    /// in order, before any that follows.
    pub fn set_chain(&self, mut chain: ActiveChain) {
        self.observed
            .store(chain.observes_body(), Ordering::Relaxed);
        let mut slot = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        for data in std::mem::take(&mut slot.missed) {
            chain.observe_request_data(&data);
        }
        slot.missed_bytes = 0;
        slot.lent = false;
        slot.chain = Some(chain);
    }

    /// Lends the stream's filters to the encoders, who give them back with
    /// [`LogSlot::set_chain`].
    pub fn take_chain(&self) -> Option<ActiveChain> {
        let mut slot = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let chain = slot.chain.take();
        slot.lent = chain.is_some();
        chain
    }

    /// Lets the stream's body-watching filters see `call`.
    fn observe(&self, call: impl FnOnce(&mut ActiveChain)) {
        if self.observed.load(Ordering::Relaxed)
            && let Some(chain) = self
                .chain
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .chain
                .as_mut()
        {
            call(chain);
        }
    }

    /// Shows the body-watching filters request data on its way upstream. The request
    /// body flows while the response's headers are encoded (a gRPC stream's next
    /// message): what passes then is held for the filters' return, not lost.
    fn observe_request_data(&self, data: &Bytes) {
        if !self.observed.load(Ordering::Relaxed) || data.is_empty() {
            return;
        }
        let slot = &mut *self.chain.lock().unwrap_or_else(|e| e.into_inner());
        match slot.chain.as_mut() {
            Some(chain) => chain.observe_request_data(data),
            None if slot.lent && slot.missed_bytes + data.len() <= BUFFER_LIMIT => {
                slot.missed_bytes += data.len();
                slot.missed.push(data.clone());
            }
            None => {}
        }
    }

    /// The original destination and source the stream's filters shared with the
    /// upstream (`set_filter_state`, `connect_authority`), if any did.
    pub fn shared_original_dst(
        &self,
    ) -> (Option<std::net::SocketAddr>, Option<std::net::SocketAddr>) {
        use shunt_core::set_filter_state::{
            ORIGINAL_DST_LOCAL, ORIGINAL_DST_REMOTE, shared_address,
        };
        let slot = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let Some(chain) = slot.chain.as_ref() else {
            return (None, None);
        };
        let state = &chain.ctx.info.filter_state;
        (
            shared_address(state, ORIGINAL_DST_LOCAL),
            shared_address(state, ORIGINAL_DST_REMOTE),
        )
    }

    /// The ALPN list the stream's filters ask its upstream connection to `cluster` to
    /// offer (`istio.alpn`, `envoy.network.application_protocols`), if any.
    pub fn upstream_alpn(
        &self,
        cluster: &shunt_upstream::Cluster,
        downstream: hyper::Version,
    ) -> Option<shunt_upstream::http_pool::Alpn> {
        let slot = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let state = &slot.chain.as_ref()?.ctx.info.filter_state;
        if state.is_empty() {
            return None;
        }
        super::filter::alpn::upstream_alpn(state, cluster, downstream)
    }

    /// Bytes a tunnel moved (an upgraded connection): `received` from the downstream,
    /// `sent` to it.
    pub fn add(&self, received: u64, sent: u64) {
        self.received.fetch_add(received, Ordering::Relaxed);
        self.sent.fetch_add(sent, Ordering::Relaxed);
    }

    /// Whether the request body failed on a framing error of the downstream's.
    pub fn downstream_protocol_error(&self) -> bool {
        self.downstream_protocol_error.load(Ordering::Relaxed)
    }

    fn flag(&self, flag: ResponseFlag) {
        if let Some((entry, _)) = self.line.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            entry.flag(flag);
        }
    }
}

impl Drop for LogSlot {
    fn drop(&mut self) {
        let line = self
            .line
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let chain = self
            .chain
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .chain
            .take();
        if let Some((mut entry, hcm)) = line {
            entry.bytes_received = *self.received.get_mut();
            entry.bytes_sent = *self.sent.get_mut();
            entry.response_head_bytes += *self.framing.get_mut();
            entry.emit_to(&hcm.access_log);
            if let Some(span) = self
                .span
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                span.finish(&entry, chain.as_ref().map(|c| &c.ctx.info.metadata));
            }
            if let Some(chain) = chain {
                chain.complete(&entry);
            }
        }
    }
}

/// The request body reads report their bytes here (`bytes_received`).
impl shunt_upstream::http_pool::BodyObserver for LogSlot {
    fn received(&self, bytes: u64) {
        self.received.fetch_add(bytes, Ordering::Relaxed);
        self.active();
    }

    fn data(&self, data: &Bytes) {
        self.observe_request_data(data);
    }

    fn ended(&self) {
        self.set_request_complete();
        self.active();
    }

    fn protocol_error(&self) {
        self.downstream_protocol_error
            .store(true, Ordering::Relaxed);
    }
}

#[derive(Debug)]
enum Content {
    Full(Option<Bytes>),
    /// A body an HTTP filter read whole: data, then trailers.
    Buffered(Option<Bytes>, Option<hyper::HeaderMap>),
    /// With the route's timeout.
    Upstream(UpstreamBody, Option<Deadline>),
    /// Changed frame by frame by HTTP filters (the compressor).
    Transformed(Box<Transformed>),
}

/// A body with the streaming transforms of HTTP filters applied, in the order the
/// filters encode (the first one's output is the next one's input).
#[derive(Debug)]
struct Transformed {
    inner: ResponseBody,
    transforms: Vec<Box<dyn BodyTransform>>,
    /// Held back while the transforms' last bytes go out first.
    trailers: Option<hyper::HeaderMap>,
    done: bool,
}

impl Transformed {
    fn apply(&mut self, data: &[u8], end_stream: bool) -> Result<Bytes, BoxError> {
        let mut data = Bytes::copy_from_slice(data);
        for transform in &mut self.transforms {
            data = transform.transform(&data, end_stream)?;
        }
        Ok(data)
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.done {
            return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
        }
        loop {
            let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Err(err))) => return Poll::Ready(Some(Err(err))),
                Poll::Ready(Some(Ok(frame))) => frame,
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(match self.apply(&[], true) {
                        Ok(out) if out.is_empty() => None,
                        Ok(out) => Some(Ok(Frame::data(out))),
                        Err(err) => Some(Err(err)),
                    });
                }
            };
            let (data, end_stream) = match frame.into_data() {
                Ok(data) => (data, self.inner.is_end_stream()),
                Err(trailers) => {
                    self.trailers = trailers.into_trailers().ok();
                    (Bytes::new(), true)
                }
            };
            self.done = end_stream;
            match self.apply(&data, end_stream) {
                Err(err) => return Poll::Ready(Some(Err(err))),
                Ok(out) if !out.is_empty() => return Poll::Ready(Some(Ok(Frame::data(out)))),
                Ok(_) if end_stream => {
                    return Poll::Ready(self.trailers.take().map(|t| Ok(Frame::trailers(t))));
                }
                Ok(_) => {}
            }
        }
    }
}

/// The route's timeout over a response body. Its timer is made only once the body
/// waits: most bodies arrive whole with their head, and never need one.
#[derive(Debug)]
struct Deadline {
    at: std::time::Instant,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The counter a timeout raises.
    timeouts: Counter,
}

impl Deadline {
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        let at = self.at;
        let timer = self.timer.get_or_insert_with(|| {
            Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at)))
        });
        timer.as_mut().poll(cx).is_ready()
    }
}

/// Why a response body stopped short.
#[derive(Debug, thiserror::Error)]
#[error("upstream request timeout")]
struct UpstreamRequestTimeout;

/// Why a response body stopped short: a stream timer.
#[derive(Debug, thiserror::Error)]
#[error("downstream stream timeout: {0:?}")]
struct StreamTimeout(Timeout);

type Watch = Pin<Box<dyn std::future::Future<Output = Timeout> + Send>>;

/// The stream timers over a response body. Started only once the body waits: most
/// bodies are whole in memory and are sent in their first poll, so for them nothing
/// is allocated (the timers read their deadlines from the log when first polled, so
/// starting later changes nothing).
struct StreamWatch {
    timeouts: StreamTimeouts,
    hcm: Arc<HttpConnectionManager>,
    log: Arc<LogSlot>,
    running: Option<Watch>,
}

impl StreamWatch {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Timeout> {
        let watch = self.running.get_or_insert_with(|| {
            let (timeouts, hcm, log) = (self.timeouts, self.hcm.clone(), self.log.clone());
            Box::pin(async move { super::timeouts::watch(timeouts, &hcm.stats, &log, true).await })
        });
        watch.as_mut().poll(cx)
    }
}

/// A response body sent downstream.
///
/// Boxed: a response (head and body) is moved a dozen times on its way out, through
/// shunt's stages and hyper's; with the body's ~200 bytes inline, each move was a
/// `memcpy` call, with a pointer the head's ~120 bytes move in registers.
pub struct ResponseBody(Box<Inner>);

struct Inner {
    content: Content,
    log: Option<Arc<LogSlot>>,
    /// The stream timers still running once the response started.
    watch: Option<StreamWatch>,
}

/// An upstream body dropped before its end while its line is still open: the
/// downstream reset the stream or closed the connection mid-response.
impl Drop for Inner {
    fn drop(&mut self) {
        if let (Some(log), Content::Upstream(incoming, _)) = (&self.log, &self.content)
            && !incoming.is_end_stream()
        {
            log.rx_reset();
        }
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody")
            .field("content", &self.0.content)
            .field("log", &self.0.log)
            .finish_non_exhaustive()
    }
}

impl ResponseBody {
    pub fn full(bytes: Bytes) -> Self {
        ResponseBody(Box::new(Inner {
            content: Content::Full((!bytes.is_empty()).then_some(bytes)),
            log: None,
            watch: None,
        }))
    }

    /// A body an HTTP filter read whole (and maybe changed), with its trailers.
    pub fn buffered(data: Bytes, trailers: Option<hyper::HeaderMap>) -> Self {
        ResponseBody(Box::new(Inner {
            content: Content::Buffered((!data.is_empty()).then_some(data), trailers),
            log: None,
            watch: None,
        }))
    }

    /// The upstream's body, cut off (the downstream stream reset, flag UT) if it is
    /// not complete by `deadline`: Envoy's route timeout covers the whole response.
    pub fn upstream(
        incoming: impl Into<UpstreamBody>,
        deadline: Option<(std::time::Instant, Counter)>,
    ) -> Self {
        let deadline = deadline.map(|(at, timeouts)| Deadline {
            at,
            timer: None,
            timeouts,
        });
        ResponseBody(Box::new(Inner {
            content: Content::Upstream(incoming.into(), deadline),
            log: None,
            watch: None,
        }))
    }

    /// The body changed frame by frame by `transforms` (none: unchanged).
    pub fn transformed(self, transforms: Vec<Box<dyn BodyTransform>>) -> Self {
        if transforms.is_empty() {
            return self;
        }
        ResponseBody(Box::new(Inner {
            content: Content::Transformed(Box::new(Transformed {
                inner: self,
                transforms,
                trailers: None,
                done: false,
            })),
            log: None,
            watch: None,
        }))
    }

    /// Counts what is sent in `log`, and holds it until sent or dropped.
    pub fn logged(mut self, log: Arc<LogSlot>) -> Self {
        self.0.log = Some(log);
        self
    }

    /// Ends the body (a stream reset) when a stream timer fires while it is sent.
    pub fn watched(
        mut self,
        timeouts: StreamTimeouts,
        hcm: Arc<HttpConnectionManager>,
        log: Arc<LogSlot>,
    ) -> Self {
        if timeouts.idle.is_some()
            || timeouts.max_duration.is_some()
            || log.has_route_max_duration()
        {
            // The manager, not a copy of its stats: one reference count, not dozens.
            self.0.watch = Some(StreamWatch {
                timeouts,
                hcm,
                log,
                running: None,
            });
        }
        self
    }
}

impl Inner {
    fn is_end_stream(&self) -> bool {
        match &self.content {
            Content::Full(bytes) => bytes.is_none(),
            Content::Buffered(data, trailers) => data.is_none() && trailers.is_none(),
            Content::Upstream(incoming, _) => incoming.is_end_stream(),
            Content::Transformed(t) => t.done && t.trailers.is_none(),
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this: &mut Inner = &mut self.get_mut().0;
        let frame = match &mut this.content {
            Content::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Content::Buffered(data, trailers) => Poll::Ready(match data.take() {
                Some(data) => Some(Ok(Frame::data(data))),
                None => trailers.take().map(|t| Ok(Frame::trailers(t))),
            }),
            Content::Upstream(incoming, deadline) => {
                let frame = Pin::new(incoming).poll_frame(cx);
                let timed_out =
                    frame.is_pending() && deadline.as_mut().is_some_and(|d| d.poll_expired(cx));
                if timed_out {
                    if let Some(deadline) = deadline {
                        deadline.timeouts.inc();
                    }
                    if let Some(log) = this.log.as_ref() {
                        log.flag(ResponseFlag::UpstreamRequestTimeout);
                    }
                    // Dropping the upstream body resets its stream (or closes its
                    // HTTP/1.1 connection).
                    this.content = Content::Full(None);
                    if let Some(log) = this.log.as_ref() {
                        log.tx_reset();
                    }
                    return Poll::Ready(Some(Err(Box::new(UpstreamRequestTimeout))));
                }
                frame
            }
            Content::Transformed(t) => t.poll_frame(cx),
        };
        if frame.is_pending()
            && let Some(watch) = this.watch.as_mut()
            && let Poll::Ready(why) = watch.poll(cx)
        {
            this.watch = None;
            this.content = Content::Full(None);
            if let Some(log) = this.log.as_ref() {
                log.tx_reset();
            }
            return Poll::Ready(Some(Err(Box::new(StreamTimeout(why)))));
        }
        match &frame {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(log) = this.log.as_ref() {
                    if let Some(data) = frame.data_ref() {
                        log.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
                        if !data.is_empty() && log.chunked.load(Ordering::Relaxed) {
                            log.framing.fetch_add(
                                super::wire::chunk_framing(data.len()),
                                Ordering::Relaxed,
                            );
                        }
                        // Only a stream that goes on needs its idle timer moved (a clock
                        // read): most bodies end with their first frame.
                        if !this.is_end_stream() {
                            log.active();
                        }
                    }
                    log.observe(|chain| chain.observe_response_frame(frame));
                }
            }
            Poll::Ready(Some(Err(err))) if err.is::<StreamTimeout>() => {}
            Poll::Ready(Some(Err(err))) => {
                tracing::debug!(%err, "upstream response body failed");
                if let Some(log) = this.log.as_ref() {
                    log.flag(ResponseFlag::UpstreamConnectionTermination);
                    log.tx_reset();
                }
            }
            // Sent: let go of the line, which is written once the request body is done too.
            Poll::Ready(None) => {
                this.log = None;
                this.watch = None;
            }
            Poll::Pending => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0.content {
            Content::Full(bytes) | Content::Buffered(bytes, _) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Content::Upstream(incoming, _) => incoming.size_hint(),
            Content::Transformed(_) => SizeHint::default(),
        }
    }
}
