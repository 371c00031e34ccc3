//! Writes that leave once the worker has run what is ready, as Envoy's
//! `ConnectionImpl::write` adds the bytes to the connection's write buffer and
//! activates its write event instead of writing: the dispatcher writes after the
//! callbacks of this loop iteration.
//!
//! Why: a proxy that sends each request upstream and each response downstream the
//! moment it has them spreads its sends over the worker's run of ready tasks, and each
//! send that finds its peer idle wakes it (`cargo xtask bench http --wakeups`). Held to
//! the end of the run, the sends leave together, and a peer woken by the first finds
//! the rest queued.
//!
//! A worker that defers writes runs [`flusher`]: the first write held back in a run
//! wakes it, and the current-thread scheduler queues it behind every task already
//! ready, so it writes when they are done. Only the current-thread worker runs one:
//! under the multi-threaded scheduler a task may move between threads, and a stream
//! polled on a thread without a flusher writes at once.
//!
//! What a stream holds back is bounded ([`HOLD_MAX`]); a write that would pass it waits
//! for what is held to leave, as a full socket would make it wait. A failed deferred
//! write fails the stream's next read, write or flush, as a failed write would have.

use std::cell::RefCell;
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker, ready};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::TcpStream;

/// Bytes a stream holds back at most. Batching pays for the small messages of
/// request/response traffic; a bigger write goes out at once, after what is held, as
/// copying a body to send it later would cost more than it saves.
pub const HOLD_MAX: usize = 4096;

/// A stream's buffer grown past this (by a write it could not send whole) is freed
/// once empty, not kept for the connection's life.
const KEEP_CAPACITY: usize = 2 * HOLD_MAX;

/// How long the bytes of a stream dropped before they left may wait for room in its
/// socket, as the kernel would hold them for a closed socket.
const ORPHAN_FLUSH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

thread_local! {
    /// This thread's worker, while its flusher runs.
    static WORKER: RefCell<Option<Worker>> = const { RefCell::new(None) };
}

/// A worker's streams with bytes held back.
struct Worker {
    /// In the order their first byte was held.
    queue: Vec<Arc<Socket>>,
    /// The flusher's waker; taken when it is woken, so one run wakes it once.
    flusher: Option<Waker>,
}

/// Whether a stream polled on this thread now would hold its writes back.
pub fn defers_here() -> bool {
    WORKER.with_borrow(Option::is_some)
}

/// Queues `socket` for this worker's flusher; `false` on a thread without one.
fn schedule(socket: &Arc<Socket>) -> bool {
    WORKER.with_borrow_mut(|worker| {
        let Some(worker) = worker else {
            return false;
        };
        worker.queue.push(Arc::clone(socket));
        if let Some(flusher) = worker.flusher.take() {
            flusher.wake();
        }
        true
    })
}

/// The worker's flusher: spawn it once on a current-thread runtime. Each time it is
/// woken it writes what the streams queued since it last ran. Dropped (the runtime
/// ends), it writes what is queued and the thread writes at once from then on.
pub async fn flusher() {
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            if let Some(worker) = WORKER.with_borrow_mut(Option::take) {
                worker.queue.iter().for_each(|socket| socket.flush_queued());
            }
        }
    }
    let _stop = Stop;
    let mut running = Vec::new();
    std::future::poll_fn(|cx| {
        WORKER.with_borrow_mut(|worker| {
            let worker = worker.get_or_insert_with(|| Worker {
                queue: Vec::new(),
                flusher: None,
            });
            worker.flusher = Some(cx.waker().clone());
            // Swapped, so the queue's buffer is reused and not borrowed while writing.
            std::mem::swap(&mut worker.queue, &mut running);
        });
        for socket in running.drain(..) {
            socket.flush_queued();
        }
        Poll::<()>::Pending
    })
    .await;
}

/// A TCP stream whose writes wait for the end of the worker's run (see the module).
pub struct DeferredWrite {
    socket: Arc<Socket>,
}

/// What the stream and the flusher share.
struct Socket {
    tcp: TcpStream,
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    bytes: BytesMut,
    /// In the worker's queue.
    queued: bool,
    /// The flusher found the socket full: the stream's next poll writes the rest,
    /// waiting for room.
    stream_flushes: bool,
    /// Why a deferred write failed (its errno, or its kind): every later call fails.
    failed: Option<Failure>,
    /// The task that last wrote: woken when the flusher could not finish.
    writer: Option<Waker>,
    /// The stream was dropped: nobody polls it any more.
    dropped: bool,
}

#[derive(Clone, Copy)]
enum Failure {
    Os(i32),
    Kind(io::ErrorKind),
}

impl Failure {
    fn of(err: &io::Error) -> Self {
        err.raw_os_error()
            .map_or(Failure::Kind(err.kind()), Failure::Os)
    }

    fn error(self) -> io::Error {
        match self {
            Failure::Os(code) => io::Error::from_raw_os_error(code),
            Failure::Kind(kind) => io::Error::from(kind),
        }
    }
}

impl DeferredWrite {
    pub fn new(tcp: TcpStream) -> Self {
        DeferredWrite {
            socket: Arc::new(Socket {
                tcp,
                held: Mutex::new(Held::default()),
            }),
        }
    }

    pub fn tcp(&self) -> &TcpStream {
        &self.socket.tcp
    }
}

impl Socket {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The flusher's part: writes what the stream held, without waiting.
    fn flush_queued(self: &Arc<Self>) {
        let mut held = self.lock();
        held.queued = false;
        match write_now(&self.tcp, &mut held.bytes) {
            Ok(true) => shrink(&mut held.bytes),
            Ok(false) if held.dropped => {
                drop(held);
                orphan_flush(Arc::clone(self));
            }
            Ok(false) => {
                held.stream_flushes = true;
                if let Some(writer) = &held.writer {
                    writer.wake_by_ref();
                }
            }
            Err(err) => {
                held.failed = Some(Failure::of(&err));
                held.bytes.clear();
                if let Some(writer) = &held.writer {
                    writer.wake_by_ref();
                }
            }
        }
    }

    /// Writes what is held, waiting for room: a stream's own flush.
    fn poll_write_held(&self, held: &mut Held, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match write_now(&self.tcp, &mut held.bytes) {
                Ok(true) => {
                    held.stream_flushes = false;
                    shrink(&mut held.bytes);
                    return Poll::Ready(Ok(()));
                }
                // `try_write` cleared the readiness: this registers for the next.
                Ok(false) => ready!(self.tcp.poll_write_ready(cx))?,
                Err(err) => {
                    held.failed = Some(Failure::of(&err));
                    held.bytes.clear();
                    return Poll::Ready(Err(err));
                }
            }
        }
    }
}

/// Writes `bytes` until they are all out (`true`) or the socket is full (`false`).
fn write_now(tcp: &TcpStream, bytes: &mut BytesMut) -> io::Result<bool> {
    while !bytes.is_empty() {
        match tcp.try_write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => bytes.advance(written),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(err) => return Err(err),
        }
    }
    Ok(true)
}

fn shrink(bytes: &mut BytesMut) {
    if bytes.capacity() > KEEP_CAPACITY {
        *bytes = BytesMut::new();
    }
}

/// A dropped stream's bytes still go out, as the kernel sends what a closed socket
/// had buffered; the socket closes when they are written (or given up on).
fn orphan_flush(socket: Arc<Socket>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let flushed = std::future::poll_fn(|cx| socket.poll_write_held(&mut socket.lock(), cx));
        let _ = tokio::time::timeout(ORPHAN_FLUSH_TIMEOUT, flushed).await;
    });
}

impl Drop for DeferredWrite {
    fn drop(&mut self) {
        let mut held = self.socket.lock();
        held.dropped = true;
        held.writer = None;
        // Queued: the flusher writes it. Not queued but held: the flusher found the
        // socket full and left the rest to this stream.
        if !held.queued && !held.bytes.is_empty() && held.failed.is_none() {
            drop(held);
            orphan_flush(Arc::clone(&self.socket));
        }
    }
}

impl AsyncRead for DeferredWrite {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let socket = &self.socket;
        {
            let mut held = socket.lock();
            if let Some(failed) = held.failed {
                return Poll::Ready(Err(failed.error()));
            }
            // The flusher left bytes to this stream: write them as room comes, while
            // waiting to read (the peer may read them before it writes again).
            if held.stream_flushes {
                let _ = socket.poll_write_held(&mut held, cx)?;
            }
        }
        loop {
            ready!(socket.tcp.poll_read_ready(cx))?;
            // SAFETY: recv writes at most `unfilled.len()` bytes into it; those it
            // reports written are then initialised.
            let unfilled = unsafe { buf.unfilled_mut() };
            let mut got = None;
            let read = socket.tcp.try_io(Interest::READABLE, || {
                use std::os::fd::AsRawFd;
                // SAFETY: the fd is the socket's, open while `socket` is borrowed;
                // the buffer is `unfilled`, valid for its length.
                let n = unsafe {
                    libc::recv(
                        socket.tcp.as_raw_fd(),
                        unfilled.as_mut_ptr().cast(),
                        unfilled.len(),
                        0,
                    )
                };
                let n = usize::try_from(n).map_err(|_| io::Error::last_os_error())?;
                got = Some(n);
                // A short read drained the socket: cleared readiness (as tokio's own
                // TcpStream does) spares the next read a recv that finds nothing.
                if n > 0 && n < unfilled.len() {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(n)
            });
            match (read, got) {
                (_, Some(n)) | (Ok(n), None) => {
                    // SAFETY: recv initialised the first `n` bytes of `unfilled`.
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                (Err(err), None) if err.kind() == io::ErrorKind::WouldBlock => continue,
                (Err(err), None) => return Poll::Ready(Err(err)),
            }
        }
    }
}

impl AsyncWrite for DeferredWrite {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let socket = &self.socket;
        let total = bufs.iter().map(|b| b.len()).fold(0, usize::saturating_add);
        let mut held = socket.lock();
        if let Some(failed) = held.failed {
            return Poll::Ready(Err(failed.error()));
        }
        let fits = held.bytes.len().saturating_add(total) <= HOLD_MAX;
        if held.stream_flushes || !fits {
            ready!(socket.poll_write_held(&mut held, cx))?;
        }
        let deferred = total <= HOLD_MAX && (held.queued || schedule(socket));
        if !deferred {
            // Too big to hold, or no flusher on this thread: what was held is out (the
            // flusher wrote it, or the line above did), so this goes out now, in order.
            if !held.bytes.is_empty() {
                ready!(socket.poll_write_held(&mut held, cx))?;
            }
            drop(held);
            return crate::event::write::poll_write_vectored(&socket.tcp, cx, bufs);
        }
        held.queued = true;
        for buf in bufs {
            held.bytes.extend_from_slice(buf);
        }
        match &mut held.writer {
            Some(writer) if writer.will_wake(cx.waker()) => {}
            writer => *writer = Some(cx.waker().clone()),
        }
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Ready once the bytes are held: they leave at the end of the worker's run.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut held = self.socket.lock();
        if let Some(failed) = held.failed {
            return Poll::Ready(Err(failed.error()));
        }
        if held.stream_flushes || (!held.bytes.is_empty() && !held.queued) {
            return self.socket.poll_write_held(&mut held, cx);
        }
        Poll::Ready(Ok(()))
    }

    /// Everything held goes out before the FIN.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let socket = &self.socket;
        let mut held = socket.lock();
        if let Some(failed) = held.failed {
            return Poll::Ready(Err(failed.error()));
        }
        ready!(socket.poll_write_held(&mut held, cx))?;
        drop(held);
        Poll::Ready(socket2::SockRef::from(&socket.tcp).shutdown(std::net::Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A deferring stream (when this thread runs a flusher) and its raw peer.
    async fn pair() -> (DeferredWrite, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (DeferredWrite::new(client), server)
    }

    /// Starts this thread's flusher and lets it run once (it then defers).
    async fn start_flusher() {
        tokio::spawn(flusher());
        tokio::task::yield_now().await;
        assert!(defers_here());
    }

    /// What `peer` has to read now, without waiting.
    fn readable_now(peer: &TcpStream) -> Vec<u8> {
        let mut got = vec![0; 64 * 1024];
        match peer.try_read(&mut got) {
            Ok(n) => got.truncate(n),
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => got.clear(),
            Err(err) => panic!("read: {err}"),
        }
        got
    }

    #[tokio::test]
    async fn writes_leave_when_the_run_of_ready_tasks_ends_in_order() {
        start_flusher().await;
        let (mut stream, peer) = pair().await;
        stream.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        let head = [IoSlice::new(b"host: a\r\n"), IoSlice::new(b"\r\n")];
        assert_eq!(stream.write_vectored(&head).await.unwrap(), 11);
        stream.flush().await.unwrap();
        assert_eq!(readable_now(&peer), b"", "sent before the run ended");
        tokio::task::yield_now().await;
        peer.readable().await.unwrap();
        assert_eq!(readable_now(&peer), b"GET / HTTP/1.1\r\nhost: a\r\n\r\n");
    }

    #[tokio::test]
    async fn without_a_flusher_writes_leave_at_once() {
        assert!(!defers_here());
        let (mut stream, peer) = pair().await;
        stream.write_all(b"hello").await.unwrap();
        peer.readable().await.unwrap();
        assert_eq!(readable_now(&peer), b"hello");
    }

    #[tokio::test]
    async fn a_big_write_leaves_at_once_after_what_was_held() {
        start_flusher().await;
        let (mut stream, mut peer) = pair().await;
        let body: Vec<u8> = (0..3 * HOLD_MAX).map(|i| (i % 251) as u8).collect();
        stream.write_all(b"head").await.unwrap();
        stream.write_all(&body).await.unwrap();
        // Both are out before this task yields.
        let mut got = vec![0; 4 + body.len()];
        peer.read_exact(&mut got).await.unwrap();
        assert_eq!(&got[..4], b"head");
        assert_eq!(&got[4..], &body[..]);
    }

    #[tokio::test]
    async fn a_full_socket_holds_the_rest_until_the_peer_reads() {
        start_flusher().await;
        let (mut stream, mut peer) = pair().await;
        // 16 MiB in writes the stream may hold: far more than the socket buffers take.
        let chunks: Vec<Vec<u8>> = (0..16 * 1024u32)
            .map(|i| (0..1024u32).map(|j| (i ^ j) as u8).collect())
            .collect();
        let expected = chunks.concat();
        let writer = tokio::spawn(async move {
            for (i, chunk) in chunks.iter().enumerate() {
                stream.write_all(chunk).await.unwrap();
                stream.flush().await.unwrap();
                // Half the time the flusher writes (and finds the socket full), half
                // the time the stream itself, once it holds too much.
                if i % 2 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            stream.shutdown().await.unwrap();
        });
        // The reader starts late, so the writer finds the socket full.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        writer.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "bytes reordered or lost");
    }

    #[tokio::test]
    async fn shutdown_sends_what_is_held_before_the_fin() {
        start_flusher().await;
        let (mut stream, mut peer) = pair().await;
        stream.write_all(b"last words").await.unwrap();
        stream.shutdown().await.unwrap();
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last words");
    }

    #[tokio::test]
    async fn a_dropped_streams_held_bytes_still_arrive() {
        start_flusher().await;
        let (mut stream, mut peer) = pair().await;
        stream.write_all(b"goodbye").await.unwrap();
        drop(stream);
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"goodbye");
    }

    #[tokio::test]
    async fn a_stream_dropped_with_its_socket_full_still_delivers_everything() {
        start_flusher().await;
        let (mut stream, mut peer) = pair().await;
        let chunk = vec![7u8; 1024];
        let mut sent = 0;
        // Until the flusher finds the socket full and leaves the rest to the stream.
        while !stream.socket.lock().stream_flushes {
            stream.write_all(&chunk).await.unwrap();
            sent += chunk.len();
            tokio::task::yield_now().await;
        }
        drop(stream);
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got.len(), sent);
    }

    #[tokio::test]
    async fn a_failed_deferred_write_fails_the_streams_next_calls() {
        start_flusher().await;
        let (mut stream, peer) = pair().await;
        // The peer resets the connection.
        peer.set_zero_linger().unwrap();
        drop(peer);
        stream.write_all(b"into the void").await.unwrap();
        tokio::task::yield_now().await;
        let write = stream.write_all(b"more").await.unwrap_err();
        assert!(
            matches!(
                write.kind(),
                io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
            ),
            "{write:?}"
        );
        assert!(stream.flush().await.is_err());
        assert!(stream.read(&mut [0; 8]).await.is_err());
    }

    #[tokio::test]
    async fn a_short_read_leaves_the_socket_not_ready_so_no_recv_finds_nothing() {
        let (mut stream, mut peer) = pair().await;
        peer.write_all(b"hello").await.unwrap();
        let mut buf = [0; 64];
        assert_eq!(stream.read(&mut buf).await.unwrap(), 5);
        // Not ready: tokio answers without calling the closure (no syscall).
        let mut called = false;
        let probe = stream.tcp().try_io(Interest::READABLE, || {
            called = true;
            Ok(())
        });
        assert!(!called, "readiness was left set after a short read");
        assert_eq!(probe.unwrap_err().kind(), io::ErrorKind::WouldBlock);
        // And a later message still wakes the reader.
        peer.write_all(b"again").await.unwrap();
        assert_eq!(stream.read(&mut buf).await.unwrap(), 5);
        assert_eq!(&buf[..5], b"again");
    }

    #[tokio::test]
    async fn reads_pass_through() {
        start_flusher().await;
        let (mut stream, mut peer) = pair().await;
        peer.write_all(b"response").await.unwrap();
        peer.shutdown().await.unwrap();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"response");
    }
}
