//! shunt's own downstream HTTP/1.1 codec, for the requests a proxy sees most (a whole
//! HTTP/1.1 head, no body, no upgrade: see `request.rs`). As an Envoy worker drives its
//! codec, the connection's task reads the head, runs the request's future in place and
//! writes the response as its body comes: no dispatcher, no channel and no fresh read
//! buffer per request, the response head and a body whole in memory in one write.
//!
//! A request it does not serve, and everything after it on the connection, goes to
//! hyper's server with the bytes already read (`Served::HandOver`); so does HTTP/2.

mod request;
mod response;
mod rewind;

use std::future::{Future, poll_fn};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body as _, Incoming};
use hyper::{Method, Request, Response};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

pub use rewind::Rewind;

use super::body::ResponseBody;
use crate::upstream::http1::{Framing, poll_write_queue};
use request::{KeepAlive, Parsed};

/// What a read asks the kernel for at least.
const READ_SIZE: usize = 8 * 1024;
/// Buffers queued before they are written, at most (a chunk takes three).
const QUEUED: usize = 8;

/// How the connection left this codec.
pub enum Served<IO> {
    /// It closed, or is closing (either side, or the drain).
    Closed,
    /// hyper serves the rest of it.
    HandOver(Rewind<IO>),
}

/// Serves HTTP/1.1 requests on `io` with `respond` until the connection closes or a
/// request is one for hyper. Once `stop` resolves (or if `draining` already), an idle
/// connection closes and a busy one closes after its response, as hyper's graceful
/// shutdown does; `draining` tells the caller it happened.
pub async fn serve<IO, F, Fut>(
    mut io: IO,
    mut respond: F,
    mut stop: Pin<&mut impl Future<Output = ()>>,
    draining: &mut bool,
    max_headers: usize,
) -> Served<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    F: FnMut(Request<Option<Incoming>>) -> Fut,
    Fut: Future<Output = Response<ResponseBody>>,
{
    let mut read = BytesMut::with_capacity(READ_SIZE);
    let mut write = BytesMut::new();
    let mut queue: Vec<Bytes> = Vec::new();
    let mut poll_stop = |cx: &mut Context<'_>, draining: &mut bool| {
        if !*draining && stop.as_mut().poll(cx).is_ready() {
            *draining = true;
        }
    };
    loop {
        // The next request's head: buffered already (pipelined), or still to come.
        let (request, keep_alive) = loop {
            if !read.is_empty() {
                match request::parse(&mut read, max_headers) {
                    Parsed::Request(request, keep_alive) => break (request, keep_alive),
                    Parsed::Other(prefix) => return Served::HandOver(Rewind::new(io, prefix)),
                    // A head in pieces: hyper waits for the rest (under its header timeout).
                    Parsed::Partial => {
                        return Served::HandOver(Rewind::new(io, read.split().freeze()));
                    }
                }
            }
            if *draining {
                let _ = io.shutdown().await;
                return Served::Closed;
            }
            let filled = poll_fn(|cx| {
                poll_stop(cx, draining);
                if *draining {
                    return Poll::Ready(Ok(None));
                }
                poll_fill(&mut io, &mut read, cx).map_ok(Some)
            })
            .await;
            match filled {
                Ok(Some(0)) => {
                    let _ = io.shutdown().await;
                    return Served::Closed;
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::debug!(%err, "downstream read failed");
                    return Served::Closed;
                }
            }
        };
        let head_request = request.method() == Method::HEAD;
        let handled = {
            // Pinned where it is made, so the request's ~10 KiB future never moves.
            let mut handled = std::pin::pin!(respond(request.map(|()| None)));
            poll_fn(|cx| {
                if let Poll::Ready(response) = handled.as_mut().poll(cx) {
                    return Poll::Ready(Some(response));
                }
                poll_stop(cx, draining);
                // The downstream going away drops the request's work (logged DC).
                if poll_gone(&mut io, &mut read, cx) {
                    return Poll::Ready(None);
                }
                Poll::Pending
            })
            .await
        };
        let Some(response) = handled else {
            tracing::debug!("downstream closed before the response");
            return Served::Closed;
        };
        let (mut parts, body) = response.into_parts();
        let keep_alive = keep_alive == KeepAlive::Yes && !*draining;
        if !keep_alive {
            request::say_close(&mut parts.headers);
        }
        let head = match response::head(&mut write, &parts, &body, head_request) {
            Ok(head) => head,
            Err(why) => {
                tracing::debug!(why, "response head not sent");
                return Served::Closed;
            }
        };
        queue.push(write.split().freeze());
        let mut exchange = Exchange {
            framing: head.framing,
            // A body that may not be sent is dropped unread, as hyper drops it.
            body: (!matches!(head.framing, Framing::Empty | Framing::Length(0))).then_some(body),
            declared: head.declared,
            trailers: None,
            offset: 0,
        };
        let sent =
            poll_fn(|cx| exchange.poll_send(&mut io, cx, &mut write, &mut queue, &mut read)).await;
        if let Err(err) = sent {
            tracing::debug!(%err, "response not sent whole");
            return Served::Closed;
        }
        if head.last || !keep_alive {
            let _ = io.shutdown().await;
            return Served::Closed;
        }
    }
}

/// A response on its way out.
struct Exchange {
    framing: Framing,
    body: Option<ResponseBody>,
    declared: Vec<hyper::header::HeaderName>,
    trailers: Option<hyper::HeaderMap>,
    /// How far into the queue's first buffer has been written.
    offset: usize,
}

impl Exchange {
    /// Queues the body's frames as they come and writes them; ready once all of it is
    /// written and flushed. Frames ready at once are gathered before a write: the
    /// head and a body whole in memory leave in one `writev`.
    fn poll_send<IO: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut IO,
        cx: &mut Context<'_>,
        write: &mut BytesMut,
        queue: &mut Vec<Bytes>,
        read: &mut BytesMut,
    ) -> Poll<io::Result<()>> {
        loop {
            let waiting = self.poll_frames(cx, write, queue)?;
            let mut wrote = false;
            if poll_write_queue(io, cx, queue, &mut self.offset, &mut wrote)?.is_pending() {
                return gone_or_pending(io, read, cx);
            }
            if self.body.is_none() {
                return Pin::new(&mut *io).poll_flush(cx);
            }
            if waiting {
                // Whatever TLS holds goes out while the body waits.
                let _ = Pin::new(&mut *io).poll_flush(cx)?;
                return gone_or_pending(io, read, cx);
            }
        }
    }

    /// Frames what the body has ready onto `queue` (a few buffers at most); `true`
    /// when the body has nothing more for now.
    fn poll_frames(
        &mut self,
        cx: &mut Context<'_>,
        write: &mut BytesMut,
        queue: &mut Vec<Bytes>,
    ) -> io::Result<bool> {
        while let Some(body) = self.body.as_mut() {
            if queue.len() >= QUEUED {
                return Ok(false);
            }
            let ended = match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    match frame.into_data() {
                        Ok(data) => {
                            crate::upstream::http1::data(&mut self.framing, data, write, queue)
                                .map_err(io::Error::other)?
                        }
                        Err(frame) => self.trailers = frame.into_trailers().ok(),
                    }
                    // As hyper does: a body that says it ended is not polled again.
                    body.is_end_stream()
                }
                // The body failed (a stream timer, the upstream reset): the response is
                // cut off, the connection closed.
                Poll::Ready(Some(Err(err))) => return Err(io::Error::other(err)),
                Poll::Ready(None) => true,
                Poll::Pending => return Ok(true),
            };
            if ended {
                crate::upstream::http1::end(
                    self.framing,
                    self.trailers.as_ref(),
                    &self.declared,
                    write,
                    queue,
                )
                .map_err(io::Error::other)?;
                self.body = None;
            }
        }
        Ok(false)
    }
}

/// `Pending`, unless the downstream went away meanwhile.
fn gone_or_pending<IO: AsyncRead + Unpin>(
    io: &mut IO,
    read: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    if poll_gone(io, read, cx) {
        return Poll::Ready(Err(io::ErrorKind::ConnectionAborted.into()));
    }
    Poll::Pending
}

/// Whether the downstream closed (or failed) while a request is in flight. Read only
/// while nothing is buffered, as hyper does: a pipelined request waits its turn.
fn poll_gone<IO: AsyncRead + Unpin>(
    io: &mut IO,
    read: &mut BytesMut,
    cx: &mut Context<'_>,
) -> bool {
    if !read.is_empty() {
        return false;
    }
    matches!(poll_fill(io, read, cx), Poll::Ready(Ok(0) | Err(_)))
}

/// Reads what the socket has into `read`, into the room the last head left when there
/// is enough (so no allocation per request).
fn poll_fill<IO: AsyncRead + Unpin>(
    io: &mut IO,
    read: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    if read.capacity() - read.len() < READ_SIZE / 4 {
        read.reserve(READ_SIZE);
    }
    tokio_util::io::poll_read_buf(Pin::new(io), cx, read)
}
