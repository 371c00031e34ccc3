//! An upstream HTTP/1.1 connection driven by the task of the request it carries, as an
//! Envoy worker drives its HTTP/1 codec on its own event loop: no task per connection,
//! no channels between a request and its connection, and the response body read from
//! the socket as the downstream takes it. When the response is read to its end, the
//! connection goes back to its pool (with the whole of a small response, at once).
//!
//! `encode.rs` frames the request, `decode.rs` the response.

mod decode;
mod encode;

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};
use hyper::{HeaderMap, Method, Request, Response};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::circuit_breaker::OwnedConnectionSlot;
use super::cluster::UpstreamConnection;
use super::http_pool::{BoxedIo, HostPool, RequestBody, Session};

/// What a read asks the kernel for at least: a response head and a small body in one.
const READ_SIZE: usize = 8 * 1024;
/// Buffers written in one gathered write, at most: more wait for the next.
const WRITE_SLICES: usize = 8;
/// Queued bytes joined into one buffer, at most, for a stream without gathered writes.
const FLATTEN: usize = 16 * 1024;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("upstream connection closed")]
    Closed,
    #[error("upstream connection: {0}")]
    Io(#[from] io::Error),
    #[error("upstream response malformed: {0}")]
    Malformed(&'static str),
    #[error("request body: {0}")]
    RequestBody(hyper::Error),
    #[error("request body does not match its content-length")]
    RequestLength,
}

impl Error {
    /// The upstream broke HTTP/1.1 (Envoy's `UPE`), rather than going away.
    pub fn is_malformed(&self) -> bool {
        matches!(self, Error::Malformed(_))
    }
}

/// The comma-separated tokens of every `name` field (HTTP's list syntax), trimmed,
/// empty ones skipped: how `connection`, `trailer` and the like are read.
pub fn tokens(
    headers: &HeaderMap,
    name: impl hyper::header::AsHeaderName,
) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(name)
        .into_iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|token| !token.is_empty())
}

/// A message's `content-length`, when it has one: several values must agree.
fn content_length(headers: &HeaderMap) -> Result<Option<u64>, &'static str> {
    let mut length = None;
    for value in headers.get_all(hyper::header::CONTENT_LENGTH) {
        let parsed = std::str::from_utf8(value.as_bytes())
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or("invalid content-length")?;
        if length.is_some_and(|l| l != parsed) {
            return Err("conflicting content-length");
        }
        length = Some(parsed);
    }
    Ok(length)
}

/// What a connection holds until it closes: its circuit breaker slot and its place in
/// the cluster's connection stats.
pub type Held = (OwnedConnectionSlot, UpstreamConnection);

/// An open HTTP/1.1 connection, idle in its pool or carrying one request.
pub struct Connection {
    io: BoxedIo,
    read: BytesMut,
    write: BytesMut,
    /// The request's bytes still to write, in order: head, data, chunk framing.
    queue: Vec<Bytes>,
    held: Held,
    /// The worker whose event loop watches its socket (`event::workers`).
    worker: Option<usize>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("buffered", &self.read.len())
            .finish_non_exhaustive()
    }
}

/// Where a connection goes back once its response is read.
pub struct Back {
    pub pool: Arc<HostPool>,
    pub session: Session,
}

/// A request that failed, given back when nothing of it left (the connection had
/// closed), so it can go on another connection.
pub struct Failed {
    pub error: Error,
    pub unsent: Option<Request<RequestBody>>,
}

impl Connection {
    pub fn new(io: BoxedIo, held: Held) -> Self {
        Connection {
            io,
            read: BytesMut::new(),
            write: BytesMut::new(),
            queue: Vec::new(),
            held,
            worker: shunt_core::event::workers::current(),
        }
    }

    /// The worker it was opened on: its socket's events reach that worker first.
    pub fn worker(&self) -> Option<usize> {
        self.worker
    }

    /// Whether an idle connection can no longer carry a request: the upstream closed it
    /// or sent bytes nobody asked for. `Pending` means usable, and `cx` is woken when
    /// that changes.
    pub fn poll_unusable(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.read.is_empty() {
            return Poll::Ready(());
        }
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        match Pin::new(&mut self.io).poll_read(cx, &mut buf) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(read) => {
                if matches!(read, Ok(())) && buf.filled().is_empty() {
                    self.held.1.closed_by_remote();
                }
                Poll::Ready(())
            }
        }
    }

    /// Sends `request` and reads the response head; the body is read as the returned
    /// response's body is polled.
    pub async fn send(
        mut self,
        request: Request<RequestBody>,
        back: Back,
    ) -> Result<Response<ResponseBody>, Failed> {
        let (parts, body) = request.into_parts();
        let framing = match encode::head(&mut self.write, &parts, &body) {
            Ok(framing) => framing,
            Err(error) => {
                return Err(Failed {
                    error,
                    unsent: None,
                });
            }
        };
        self.queue.push(self.write.split().freeze());
        let declared = if framing == encode::Framing::Chunked {
            encode::declared_trailers(&parts.headers)
        } else {
            Vec::new()
        };
        let mut exchange = Exchange {
            body: (framing != encode::Framing::Empty).then_some(body),
            framing,
            trailers: None,
            declared,
            offset: 0,
            wrote: false,
            sent: false,
            write_failed: None,
            early: None,
        };
        let head =
            std::future::poll_fn(|cx| self.poll_exchange(cx, &mut exchange, &parts.method)).await;
        let head = match head {
            Ok(head) => head,
            Err(error) => {
                // Nothing left: the request can go elsewhere, whole.
                let unsent = (!exchange.wrote).then(|| {
                    let body = exchange.body.take().unwrap_or_else(RequestBody::empty);
                    Request::from_parts(parts, body)
                });
                return Err(Failed { error, unsent });
            }
        };
        self.queue.clear();
        // A request that could not be sent whole ends the connection.
        let keep_alive = head.keep_alive && exchange.sent;
        let (parts, ()) = head.response.into_parts();
        let body = match head.framing {
            decode::Framing::Length(length) if self.read.len() as u64 >= length => {
                let data =
                    (length > 0).then(|| decode::take_bytes(&mut self.read, length as usize));
                self.done(keep_alive, back);
                ResponseBody::Full(data)
            }
            framing => ResponseBody::Reading(Box::new(Reading {
                connection: self,
                framing,
                keep_alive,
                back,
            })),
        };
        Ok(Response::from_parts(parts, body))
    }

    /// One poll of the exchange: the request goes out as far as the socket and the body
    /// allow, and the response head is looked for in what came back.
    fn poll_exchange(
        &mut self,
        cx: &mut Context<'_>,
        exchange: &mut Exchange,
        method: &Method,
    ) -> Poll<Result<decode::Head, Error>> {
        loop {
            if !exchange.sent
                && exchange.write_failed.is_none()
                && let Err(err) = self.poll_send(cx, exchange)
            {
                // An upstream may answer early and close (a 413 to a large upload): once
                // part of the request left, its answer is still read before giving up.
                if !(exchange.wrote && matches!(err, Error::Io(_))) {
                    return Poll::Ready(Err(err));
                }
                exchange.body = None;
                exchange.write_failed = Some(err);
            }
            let request_over = exchange.sent || exchange.write_failed.is_some();
            // An answer that came before the whole request left waits for the rest to go
            // (as hyper keeps sending it): the downstream's body is read whole, and the
            // connection may carry another request. An upstream that stops reading
            // closes (then the write fails), or the route's timeout ends the wait.
            if let Some(head) = exchange.early.take() {
                if request_over {
                    return Poll::Ready(Ok(head));
                }
                exchange.early = Some(head);
                // poll_send left a waker on what it waits for.
                return Poll::Pending;
            }
            if !self.read.is_empty()
                && let Some(head) = decode::head(&mut self.read, method)?
            {
                if request_over {
                    return Poll::Ready(Ok(head));
                }
                exchange.early = Some(head);
                continue;
            }
            let failed = match ready!(self.poll_fill(cx)) {
                // A head cut off mid-way is a protocol error (Envoy's 502), not a reset.
                Ok(0) => {
                    self.held.1.closed_by_remote();
                    if self.read.is_empty() {
                        Error::Closed
                    } else {
                        Error::Malformed("response head cut off")
                    }
                }
                Ok(_) => continue,
                Err(err) => err.into(),
            };
            return Poll::Ready(Err(exchange.write_failed.take().unwrap_or(failed)));
        }
    }

    /// Writes what is queued, then the body's frames as they come; done (`sent`) once
    /// the body ended and everything is flushed.
    fn poll_send(&mut self, cx: &mut Context<'_>, exchange: &mut Exchange) -> Result<(), Error> {
        loop {
            if !self.queue.is_empty() {
                let written = poll_write_queue(
                    &mut self.io,
                    cx,
                    &mut self.queue,
                    &mut exchange.offset,
                    &mut exchange.wrote,
                )?;
                match written {
                    Poll::Ready(()) => {}
                    Poll::Pending => return Ok(()),
                }
            }
            let Some(body) = exchange.body.as_mut() else {
                if Pin::new(&mut self.io).poll_flush(cx)?.is_ready() {
                    exchange.sent = true;
                }
                return Ok(());
            };
            let ended = match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    match frame.into_data() {
                        Ok(data) => encode::data(
                            &mut exchange.framing,
                            data,
                            &mut self.write,
                            &mut self.queue,
                        )?,
                        Err(frame) => exchange.trailers = frame.into_trailers().ok(),
                    }
                    // As hyper does: a body that says it ended is not polled again.
                    body.is_end_stream()
                }
                Poll::Ready(Some(Err(err))) => {
                    exchange.body = None;
                    return Err(Error::RequestBody(err));
                }
                Poll::Ready(None) => true,
                Poll::Pending => {
                    // Whatever TLS holds goes out while the body waits.
                    let _ = Pin::new(&mut self.io).poll_flush(cx)?;
                    return Ok(());
                }
            };
            if ended {
                encode::end(
                    exchange.framing,
                    exchange.trailers.as_ref(),
                    &exchange.declared,
                    &mut self.write,
                    &mut self.queue,
                )?;
                exchange.body = None;
            }
        }
    }

    /// Reads what the socket has into the read buffer.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.read.capacity() - self.read.len() < READ_SIZE / 4 {
            self.read.reserve(READ_SIZE);
        }
        tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.read)
    }

    /// The response was read to its end: back to the pool if the connection may carry
    /// another request, closed otherwise.
    fn done(self, keep_alive: bool, back: Back) {
        if keep_alive && self.read.is_empty() {
            back.pool.give_back(self, back.session);
        }
    }
}

/// Writes `queue` (from `offset` into its first buffer), gathered when the stream
/// takes several buffers at once; what went out whole is dropped from it. `wrote` is
/// set once any byte left.
fn poll_write_queue<IO: AsyncWrite + Unpin + ?Sized>(
    io: &mut IO,
    cx: &mut Context<'_>,
    queue: &mut Vec<Bytes>,
    offset: &mut usize,
    wrote: &mut bool,
) -> io::Result<Poll<()>> {
    // A stream without gathered writes gets small buffers joined into one (as hyper
    // flattens them): one write, not one per buffer.
    if queue.len() > 1 && !io.is_write_vectored() {
        let total: usize = queue.iter().map(Bytes::len).sum::<usize>() - *offset;
        if total <= FLATTEN {
            let mut joined = BytesMut::with_capacity(total);
            joined.extend_from_slice(&queue[0][*offset..]);
            for bytes in &queue[1..] {
                joined.extend_from_slice(bytes);
            }
            queue.clear();
            queue.push(joined.freeze());
            *offset = 0;
        }
    }
    while !queue.is_empty() {
        let written = if queue.len() > 1 && io.is_write_vectored() {
            let mut slices = [IoSlice::new(&[]); WRITE_SLICES];
            for (slice, (i, bytes)) in slices.iter_mut().zip(queue.iter().enumerate()) {
                let skip = if i == 0 { *offset } else { 0 };
                *slice = IoSlice::new(&bytes[skip..]);
            }
            let count = queue.len().min(WRITE_SLICES);
            Pin::new(&mut *io).poll_write_vectored(cx, &slices[..count])
        } else {
            Pin::new(&mut *io).poll_write(cx, &queue[0][*offset..])
        };
        let mut written = match written {
            Poll::Pending => return Ok(Poll::Pending),
            Poll::Ready(Ok(0)) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Poll::Ready(Ok(n)) => n,
            Poll::Ready(Err(err)) => return Err(err),
        };
        *wrote = true;
        // Drop what went out whole; remember how far into the next one.
        let mut done = 0;
        for bytes in queue.iter() {
            let left = bytes.len() - if done == 0 { *offset } else { 0 };
            if written < left {
                break;
            }
            written -= left;
            done += 1;
            *offset = 0;
        }
        queue.drain(..done);
        *offset += written;
    }
    Ok(Poll::Ready(()))
}

/// One request on its way out.
struct Exchange {
    body: Option<RequestBody>,
    framing: encode::Framing,
    trailers: Option<HeaderMap>,
    /// The trailer fields the request declared (see [`encode::declared_trailers`]).
    declared: Vec<hyper::header::HeaderName>,
    /// How far into the queue's first buffer has been written.
    offset: usize,
    /// Whether any of the request has been written.
    wrote: bool,
    /// The whole request was written and flushed.
    sent: bool,
    /// Writing failed after part of the request left; the answer is still looked for.
    write_failed: Option<Error>,
    /// A response head that came before the whole request left.
    early: Option<decode::Head>,
}

/// A response body being read from its connection.
pub struct Reading {
    connection: Connection,
    framing: decode::Framing,
    keep_alive: bool,
    back: Back,
}

/// An upstream HTTP/1.1 response body.
pub enum ResponseBody {
    /// Read with the head (or none): the connection is already back in its pool.
    Full(Option<Bytes>),
    Reading(Box<Reading>),
    Done,
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResponseBody::Full(data) => write!(f, "Full({:?})", data.as_ref().map(Bytes::len)),
            ResponseBody::Reading(_) => f.write_str("Reading"),
            ResponseBody::Done => f.write_str("Done"),
        }
    }
}

impl ResponseBody {
    /// The body's end: the connection goes back (or closes).
    fn finish(&mut self) {
        if let ResponseBody::Reading(reading) = std::mem::replace(self, ResponseBody::Done) {
            let Reading {
                connection,
                keep_alive,
                back,
                ..
            } = *reading;
            connection.done(keep_alive, back);
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        let reading = match this {
            ResponseBody::Full(data) => {
                let frame = data.take().map(|d| Ok(Frame::data(d)));
                if frame.is_none() {
                    *this = ResponseBody::Done;
                }
                return Poll::Ready(frame);
            }
            ResponseBody::Done => return Poll::Ready(None),
            ResponseBody::Reading(reading) => reading,
        };
        loop {
            let read = &mut reading.connection.read;
            match &mut reading.framing {
                decode::Framing::Length(0) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                decode::Framing::Length(left) if !read.is_empty() => {
                    let take = (*left).min(read.len() as u64);
                    *left -= take;
                    let data = decode::take_bytes(read, take as usize);
                    if *left == 0 {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                decode::Framing::Chunked(chunked) => match chunked.decode(read) {
                    Err(err) => {
                        *this = ResponseBody::Done;
                        return Poll::Ready(Some(Err(err)));
                    }
                    Ok(Some(frame)) => {
                        if chunked.finish_early(read) {
                            this.finish();
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    Ok(None) if chunked.is_done() => {
                        this.finish();
                        return Poll::Ready(None);
                    }
                    Ok(None) => {}
                },
                decode::Framing::Close if !read.is_empty() => {
                    let all = read.len();
                    return Poll::Ready(Some(Ok(Frame::data(decode::take_bytes(read, all)))));
                }
                _ => {}
            }
            match ready!(reading.connection.poll_fill(cx)) {
                Ok(0) => {
                    reading.connection.held.1.closed_by_remote();
                    let ended = matches!(reading.framing, decode::Framing::Close);
                    *this = ResponseBody::Done;
                    return Poll::Ready((!ended).then_some(Err(Error::Closed)));
                }
                Ok(_) => {}
                Err(err) => {
                    *this = ResponseBody::Done;
                    return Poll::Ready(Some(Err(err.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Full(data) => data.is_none(),
            ResponseBody::Done => true,
            ResponseBody::Reading(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Full(data) => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseBody::Done => SizeHint::with_exact(0),
            ResponseBody::Reading(reading) => match reading.framing {
                decode::Framing::Length(left) => SizeHint::with_exact(left),
                _ => SizeHint::default(),
            },
        }
    }
}

/// Decodes `wire` as an upstream's answer to a request of `method`: its head, then
/// as much of its body as `wire` holds; the body's data bytes, or the error. For the
/// fuzz target (`fuzz/fuzz_targets/http1_response.rs`): any bytes, no panic.
#[doc(hidden)]
pub fn decode_response(wire: &[u8], method: &Method) -> Result<u64, Error> {
    let mut buf = BytesMut::from(wire);
    let Some(head) = decode::head(&mut buf, method)? else {
        return Ok(0);
    };
    let mut data = 0;
    match head.framing {
        decode::Framing::Length(length) => {
            let take = length.min(buf.len() as u64) as usize;
            data = decode::take_bytes(&mut buf, take).len() as u64;
        }
        decode::Framing::Chunked(mut chunked) => {
            while let Some(frame) = chunked.decode(&mut buf)? {
                data += frame.data_ref().map_or(0, |d| d.len() as u64);
                chunked.finish_early(&mut buf);
            }
        }
        decode::Framing::Close => data = buf.len() as u64,
    }
    Ok(data)
}

#[cfg(test)]
mod tests;
