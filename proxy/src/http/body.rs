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
use hyper::body::{Body, Frame, Incoming, SizeHint};

use super::config::HttpConnectionManager;
use crate::access_log::{Entry, ResponseFlag};
use crate::stats::Counter;

/// The access log line of one request, written when the last holder lets go.
#[derive(Debug, Default)]
pub struct LogSlot {
    /// Data bytes read from the downstream (`bytes_received`) and written to it.
    received: AtomicU64,
    sent: AtomicU64,
    /// The downstream's request body broke HTTP's framing.
    downstream_protocol_error: AtomicBool,
    /// Set once the request has its response (or was given up); empty: no line.
    line: Mutex<Option<(Entry, Arc<HttpConnectionManager>)>>,
}

impl LogSlot {
    pub fn new() -> Arc<LogSlot> {
        Arc::default()
    }

    /// The entry to write, to `hcm`'s access logs.
    pub fn fill(&self, entry: Entry, hcm: Arc<HttpConnectionManager>) {
        *self.line.lock().unwrap_or_else(|e| e.into_inner()) = Some((entry, hcm));
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
        if let Some((mut entry, hcm)) = line {
            entry.bytes_received = *self.received.get_mut();
            entry.bytes_sent = *self.sent.get_mut();
            entry.emit_to(&hcm.access_log);
        }
    }
}

/// The request body reads report their bytes here (`bytes_received`).
impl crate::upstream::http_pool::BodyObserver for LogSlot {
    fn received(&self, bytes: u64) {
        self.received.fetch_add(bytes, Ordering::Relaxed);
    }

    fn protocol_error(&self) {
        self.downstream_protocol_error
            .store(true, Ordering::Relaxed);
    }
}

#[derive(Debug)]
enum Content {
    Full(Option<Bytes>),
    /// With the end of the route's timeout, and the counter a timeout raises.
    Upstream(Incoming, Option<(Pin<Box<tokio::time::Sleep>>, Counter)>),
}

/// Why a response body stopped short.
#[derive(Debug, thiserror::Error)]
#[error("upstream request timeout")]
struct UpstreamRequestTimeout;

/// A response body sent downstream.
#[derive(Debug)]
pub struct ResponseBody {
    content: Content,
    log: Option<Arc<LogSlot>>,
}

impl ResponseBody {
    pub fn full(bytes: Bytes) -> Self {
        ResponseBody {
            content: Content::Full((!bytes.is_empty()).then_some(bytes)),
            log: None,
        }
    }

    /// The upstream's body, cut off (the downstream stream reset, flag UT) if it is
    /// not complete by `deadline`: Envoy's route timeout covers the whole response.
    pub fn upstream(incoming: Incoming, deadline: Option<(std::time::Instant, Counter)>) -> Self {
        let deadline = deadline.map(|(at, counter)| {
            (
                Box::pin(tokio::time::sleep_until(tokio::time::Instant::from_std(at))),
                counter,
            )
        });
        ResponseBody {
            content: Content::Upstream(incoming, deadline),
            log: None,
        }
    }

    /// Counts what is sent in `log`, and holds it until sent or dropped.
    pub fn logged(mut self, log: Arc<LogSlot>) -> Self {
        self.log = Some(log);
        self
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
        let this = self.get_mut();
        let frame = match &mut this.content {
            Content::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Content::Upstream(incoming, deadline) => {
                let frame = Pin::new(incoming).poll_frame(cx);
                let timed_out = frame.is_pending()
                    && deadline
                        .as_mut()
                        .is_some_and(|(sleep, _)| sleep.as_mut().poll(cx).is_ready());
                if timed_out {
                    if let Some((_, timeouts)) = deadline {
                        timeouts.inc();
                    }
                    if let Some(log) = this.log.as_ref() {
                        log.flag(ResponseFlag::UpstreamRequestTimeout);
                    }
                    // Dropping the upstream body resets its stream (or closes its
                    // HTTP/1.1 connection).
                    this.content = Content::Full(None);
                    return Poll::Ready(Some(Err(Box::new(UpstreamRequestTimeout))));
                }
                frame.map(|f| f.map(|r| r.map_err(BoxError::from)))
            }
        };
        match &frame {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(log)) = (frame.data_ref(), this.log.as_ref()) {
                    log.sent.fetch_add(data.len() as u64, Ordering::Relaxed);
                }
            }
            Poll::Ready(Some(Err(err))) => {
                tracing::debug!(%err, "upstream response body failed");
                if let Some(log) = this.log.as_ref() {
                    log.flag(ResponseFlag::UpstreamConnectionTermination);
                }
            }
            // Sent: let go of the line, which is written once the request body is done too.
            Poll::Ready(None) => this.log = None,
            Poll::Pending => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        match &self.content {
            Content::Full(bytes) => bytes.is_none(),
            Content::Upstream(incoming, _) => incoming.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.content {
            Content::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Content::Upstream(incoming, _) => incoming.size_hint(),
        }
    }
}
