//! Moves bytes between a downstream and an upstream socket until both directions end.
//!
//! TCP's semantics pass through unchanged, so neither end can tell a proxy sits between:
//! - a half-close (FIN) from one side becomes `shutdown(Write)` on the other, and the
//!   opposite direction keeps flowing until it ends too;
//! - a reset, or any other failure, on one side aborts the other with `SO_LINGER=0`, so
//!   its peer sees RST rather than a clean FIN that would pass a truncated stream off as
//!   complete.
//!
//! A direction holds a buffer only while bytes are in flight: it waits for its source to
//! turn readable with none, borrows a buffer from a per-thread pool, reads once, writes
//! all of it and hands the buffer back. Backpressure is TCP's own (we stop reading while
//! a write is blocked). Buffers are 1 MiB, so a bulk stream moves its whole receive
//! queue per wake-up in one read and one write instead of a 64 KiB slice at a time (a
//! quarter to 40% less proxy CPU per byte on `cargo xtask bench l4`); each is an
//! anonymous mapping whose pages cost memory only once a read writes them, so a
//! connection that moves 64 bytes makes one page resident.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::net::tcp::{ReadHalf, WriteHalf};

use shunt_upstream::backoff::Backoff;

/// Which socket of the pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Downstream,
    Upstream,
}

/// How a proxied connection ended.
#[derive(Debug)]
pub enum End {
    /// Both directions reached EOF and were half-closed in turn.
    Closed,
    /// `side` failed (reset, broken pipe, timeout...); the other side was aborted.
    Failed { side: Side, error: io::Error },
    /// Nothing moved for the idle timeout; both sides were closed.
    IdleTimeout,
    /// Parked and given up, both sockets open, to be copied on by another process
    /// ([`super::handover`]).
    HandedOver,
}

/// When bytes last moved, for the idle timeout: milliseconds since the copy started,
/// stored by either direction without a lock.
pub(super) struct Activity {
    start: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    pub(super) fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    pub(super) fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Resolves once nothing has moved for `idle`.
    pub(super) async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let deadline = self.start + last + idle;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline.into()).await;
        }
    }
}

/// What one connection moved, in Envoy's terms.
#[derive(Debug)]
pub struct Outcome {
    /// Bytes read from the downstream.
    pub bytes_received: u64,
    /// Bytes written to the downstream.
    pub bytes_sent: u64,
    /// Bytes written to the upstream.
    pub upstream_bytes_sent: u64,
    /// Bytes read from the upstream.
    pub upstream_bytes_received: u64,
    pub end: End,
}

/// Copies both ways until both directions end or one side fails, then closes both
/// sockets: gracefully after two EOFs, with RST to the surviving side after a failure.
pub async fn copy_bidirectional(downstream: TcpStream, upstream: TcpStream) -> Outcome {
    copy_with_idle_timeout(downstream, upstream, None).await
}

/// As [`copy_bidirectional`], and if no byte moves either way for `idle_timeout`
/// (tcp_proxy's `idle_timeout`), closes both sockets with FIN and ends as
/// [`End::IdleTimeout`].
pub async fn copy_with_idle_timeout(
    mut downstream: TcpStream,
    mut upstream: TcpStream,
    idle_timeout: Option<Duration>,
) -> Outcome {
    let mut counts = Counts::default();
    let activity = Activity::new();
    // In an instance whose flows may be handed over, this copy can be parked.
    let running = super::handover::current().map(|f| f.started());
    let mut park = running.as_ref().and_then(|r| r.parks_in());
    loop {
        let end = copy_until_end(
            &mut downstream,
            &mut upstream,
            &mut counts,
            &activity,
            idle_timeout,
            park,
        )
        .await;
        if let End::Failed { side, .. } = &end {
            let survivor = match side {
                Side::Downstream => &upstream,
                Side::Upstream => &downstream,
            };
            abort(survivor);
        }
        if let (End::HandedOver, Some(flows)) = (&end, park) {
            let parked = super::handover::ParkedFlow {
                downstream,
                upstream,
            };
            // No one takes it any more: copy on here, never parking again. Nothing was
            // held, so nothing is lost.
            if let Err(back) = flows.deliver(parked) {
                (downstream, upstream, park) = (back.downstream, back.upstream, None);
                continue;
            }
        }
        return Outcome {
            bytes_received: counts.received,
            bytes_sent: counts.sent,
            upstream_bytes_sent: counts.forwarded,
            upstream_bytes_received: counts.fetched,
            end,
        };
    }
}

/// Copies both ways until both directions end, one fails, the idle timeout passes, or
/// (with `park`) each direction is parked or ended.
async fn copy_until_end(
    downstream: &mut TcpStream,
    upstream: &mut TcpStream,
    counts: &mut Counts,
    activity: &Activity,
    idle_timeout: Option<Duration>,
    park: Option<&super::handover::Flows>,
) -> End {
    let work = async {
        let (mut down_read, mut down_write) = downstream.split();
        let (mut up_read, mut up_write) = upstream.split();
        let mut to_upstream = std::pin::pin!(pump(
            &mut down_read,
            &mut up_write,
            &mut counts.received,
            &mut counts.forwarded,
            activity,
            park,
        ));
        let mut to_downstream = std::pin::pin!(pump(
            &mut up_read,
            &mut down_write,
            &mut counts.fetched,
            &mut counts.sent,
            activity,
            park,
        ));
        // A failure belongs to the socket it happened on: a direction's source when
        // reading, its sink when writing.
        let to_upstream_side = |at: At| match at {
            At::Read => Side::Downstream,
            At::Write => Side::Upstream,
        };
        let to_downstream_side = |at: At| match at {
            At::Read => Side::Upstream,
            At::Write => Side::Downstream,
        };
        let first = tokio::select! {
            done = &mut to_upstream => First::ToUpstream(done),
            done = &mut to_downstream => First::ToDownstream(done),
        };
        // One direction has ended or parked. If it ended cleanly the other keeps
        // flowing (or parks); if it failed, the other is abandoned here, mid-read or
        // mid-write.
        let (first_parked, rest) = match first {
            First::ToUpstream(Ok(pumped)) => (
                pumped,
                to_downstream
                    .await
                    .map_err(|(at, error)| (to_downstream_side(at), error)),
            ),
            First::ToDownstream(Ok(pumped)) => (
                pumped,
                to_upstream
                    .await
                    .map_err(|(at, error)| (to_upstream_side(at), error)),
            ),
            First::ToUpstream(Err((at, error))) => {
                (Pumped::Ended, Err((to_upstream_side(at), error)))
            }
            First::ToDownstream(Err((at, error))) => {
                (Pumped::Ended, Err((to_downstream_side(at), error)))
            }
        };
        match (first_parked, rest) {
            (_, Err((side, error))) => End::Failed { side, error },
            (Pumped::Ended, Ok(Pumped::Ended)) => End::Closed,
            // Each direction quiet (parked, or ended and half-closed): handed on whole.
            _ => End::HandedOver,
        }
    };
    match idle_timeout {
        None => work.await,
        Some(idle) => tokio::select! {
            end = work => end,
            () = activity.idle_for(idle) => End::IdleTimeout,
        },
    }
}

pub use shunt_tls::stream::abort;

#[derive(Default)]
struct Counts {
    /// Read from downstream.
    received: u64,
    /// Written to upstream.
    forwarded: u64,
    /// Read from upstream.
    fetched: u64,
    /// Written to downstream.
    sent: u64,
}

enum First {
    ToUpstream(Result<Pumped, (At, io::Error)>),
    ToDownstream(Result<Pumped, (At, io::Error)>),
}

/// How a one-way copy stopped without failing.
enum Pumped {
    /// EOF read and the sink half-closed.
    Ended,
    /// Asked to park: nothing held, the sockets are left as they are.
    Parked,
}

/// Which half of a one-way copy failed: reading its source or writing its sink.
#[derive(Clone, Copy, Debug)]
enum At {
    Read,
    Write,
}

/// Copies `from` to `to` until EOF, then half-closes `to`. The counters live outside
/// the future so they survive its cancellation when the other direction fails. With
/// `park`, it stops at the top of its loop (holding nothing) once parking is asked for.
async fn pump(
    from: &mut ReadHalf<'_>,
    to: &mut WriteHalf<'_>,
    read: &mut u64,
    written: &mut u64,
    activity: &Activity,
    park: Option<&super::handover::Flows>,
) -> Result<Pumped, (At, io::Error)> {
    loop {
        // A connection holds a buffer only while bytes are in flight: wait for something
        // to read (data, EOF or an error) with none, take one, hand it back once written.
        match park {
            None => from.readable().await.map_err(|e| (At::Read, e))?,
            Some(flows) => {
                if flows.parking() {
                    return Ok(Pumped::Parked);
                }
                tokio::select! {
                    biased;
                    ready = from.readable() => ready.map_err(|e| (At::Read, e))?,
                    () = flows.parking_asked() => return Ok(Pumped::Parked),
                }
            }
        }
        let mut buf = buffers::Buffer::take();
        let n = match from.try_read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err((At::Read, e)),
        };
        if n == 0 {
            break;
        }
        *read += n as u64;
        activity.touch();
        let mut chunk = &buf[..n];
        while !chunk.is_empty() {
            let w = write_retrying_enomem(to, chunk)
                .await
                .map_err(|e| (At::Write, e))?;
            if w == 0 {
                return Err((At::Write, io::ErrorKind::WriteZero.into()));
            }
            *written += w as u64;
            activity.touch();
            chunk = &chunk[w..];
        }
    }
    match to.shutdown().await {
        // The sink is already fully closed; if that was a reset, the other direction
        // reports it when it reads.
        Err(e) if e.kind() != io::ErrorKind::NotConnected => Err((At::Write, e)),
        _ => Ok(Pumped::Ended),
    }
}

/// Copy buffers kept per worker thread between uses, so idle connections cost no buffer
/// and busy ones do not allocate per read.
///
/// A buffer is its own anonymous private mapping (`memmap2`'s `map_anon`: `MAP_PRIVATE |
/// MAP_ANONYMOUS`, no `MAP_POPULATE`), not a heap block: its pages become resident only
/// when a read writes them, and one the pool does not keep is unmapped,
/// its memory back to the system at once. A 1 MiB `calloc` would give neither for sure:
/// once glibc's mmap threshold has risen (it follows the largest block freed), it is
/// served from the heap, zeroed page by page, and stays there when freed.
mod buffers {
    use std::cell::RefCell;
    use std::ops::{Deref, DerefMut};

    use memmap2::MmapMut;

    /// How much one read takes at most: a bulk transfer's whole receive queue (Envoy
    /// buffers up to 1 MiB per connection too).
    pub(super) const SIZE: usize = 1 << 20;
    /// If mapping fails, a heap buffer of this size does.
    const FALLBACK_SIZE: usize = 64 * 1024;
    /// Free buffers kept per thread, each as resident as the most any read wrote in it
    /// (so at most 2 MiB per worker after bulk transfers); more are unmapped. Only a
    /// direction whose write is blocked holds a buffer across an await, so two cover a
    /// worker's common case.
    pub(super) const KEEP: usize = 2;

    thread_local! {
        static FREE: RefCell<Vec<Storage>> = const { RefCell::new(Vec::new()) };
    }

    /// Zeroed memory owned by one buffer.
    enum Storage {
        /// `SIZE` bytes of a private anonymous mapping, unmapped on drop.
        Mapped(MmapMut),
        Heap(Box<[u8]>),
    }

    impl Storage {
        fn new() -> Storage {
            match MmapMut::map_anon(SIZE) {
                Ok(map) => Storage::Mapped(map),
                Err(_) => Storage::Heap(vec![0u8; FALLBACK_SIZE].into_boxed_slice()),
            }
        }
    }

    impl Deref for Storage {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            match self {
                Storage::Mapped(map) => map,
                Storage::Heap(b) => b,
            }
        }
    }

    impl DerefMut for Storage {
        fn deref_mut(&mut self) -> &mut [u8] {
            match self {
                Storage::Mapped(map) => map,
                Storage::Heap(b) => b,
            }
        }
    }

    /// Free buffers in this thread's pool.
    #[cfg(test)]
    pub(super) fn pooled() -> usize {
        FREE.with(|f| f.borrow().len())
    }

    /// A buffer on loan; going out of scope (even when the copy is cancelled) returns it.
    pub struct Buffer(Option<Storage>);

    impl Buffer {
        pub fn take() -> Buffer {
            let reused = FREE.with(|f| f.borrow_mut().pop());
            Buffer(Some(reused.unwrap_or_else(Storage::new)))
        }
    }

    impl Drop for Buffer {
        fn drop(&mut self) {
            if let Some(buf) = self.0.take() {
                let _ = FREE.try_with(|f| {
                    let mut free = f.borrow_mut();
                    if free.len() < KEEP {
                        free.push(buf);
                    }
                });
            }
        }
    }

    impl Deref for Buffer {
        type Target = [u8];
        fn deref(&self) -> &[u8] {
            self.0.as_deref().unwrap_or_default()
        }
    }

    impl DerefMut for Buffer {
        fn deref_mut(&mut self) -> &mut [u8] {
            self.0.as_deref_mut().unwrap_or_default()
        }
    }
}

/// How long a write that fails with ENOMEM is retried before the connection is given
/// up: the kernel's sockmap path (`sk_msg` redirect into the peer's receive queue)
/// fails a send with ENOMEM under memory pressure where TCP would just block, and
/// nothing was written, so retrying loses no byte.
const ENOMEM_RETRY_FOR: Duration = Duration::from_secs(30);

/// Backoff between ENOMEM retries: 1 ms doubling to 100 ms, no jitter (a pause is only
/// a wait for the kernel to free memory; nothing synchronises on it).
const ENOMEM_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(1), Duration::from_millis(100));

/// The pause before ENOMEM retry `attempt`, `None` once `budget` is spent.
pub fn enomem_backoff(attempt: u32, waited: Duration, budget: Duration) -> Option<Duration> {
    if waited >= budget {
        return None;
    }
    Some(ENOMEM_BACKOFF.delay(attempt).min(budget - waited))
}

async fn write_retrying_enomem(to: &mut WriteHalf<'_>, chunk: &[u8]) -> io::Result<usize> {
    let mut attempt = 0;
    let mut waited = Duration::ZERO;
    loop {
        match to.write(chunk).await {
            Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => {
                let Some(pause) = enomem_backoff(attempt, waited, ENOMEM_RETRY_FOR) else {
                    return Err(e);
                };
                tracing::debug!(
                    "write failed with ENOMEM (sockmap back-pressure); retrying in {pause:?}"
                );
                tokio::time::sleep(pause).await;
                waited += pause;
                attempt += 1;
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    #[test]
    fn enomem_backoff_grows_then_gives_up_at_the_budget() {
        let budget = Duration::from_millis(300);
        let mut waited = Duration::ZERO;
        let mut pauses = Vec::new();
        for attempt in 0.. {
            match super::enomem_backoff(attempt, waited, budget) {
                Some(p) => {
                    pauses.push(p);
                    waited += p;
                }
                None => break,
            }
        }
        assert_eq!(&pauses[..4], &[1, 2, 4, 8].map(Duration::from_millis));
        assert!(pauses.iter().all(|p| *p <= Duration::from_millis(100)));
        assert_eq!(
            waited, budget,
            "retries stop exactly when the budget is spent"
        );
    }
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncRead, AsyncWrite};
    use tokio::net::TcpListener;
    use tokio::time::timeout;

    const PATIENCE: Duration = Duration::from_secs(30);

    /// A client connected through `copy_bidirectional` to a server: the two streams the
    /// test drives, and the copy's outcome once it ends.
    struct Proxied {
        client: TcpStream,
        server: TcpStream,
        outcome: tokio::task::JoinHandle<Outcome>,
    }

    async fn proxied() -> Proxied {
        proxied_in(None).await
    }

    /// As [`proxied`], the copy parkable in `flows` when given.
    async fn proxied_in(flows: Option<std::sync::Arc<super::super::handover::Flows>>) -> Proxied {
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend_addr = backend.local_addr().unwrap();
        let front_addr = front.local_addr().unwrap();
        // Both legs are established before the copy starts, so a test can reset either
        // end at once without racing the proxy's own connect.
        let client = TcpStream::connect(front_addr).await.unwrap();
        let (downstream, _) = front.accept().await.unwrap();
        let upstream = TcpStream::connect(backend_addr).await.unwrap();
        let (server, _) = backend.accept().await.unwrap();
        let copy = copy_bidirectional(downstream, upstream);
        let proxy = match flows {
            Some(flows) => tokio::spawn(super::super::handover::scope(flows, copy)),
            None => tokio::spawn(copy),
        };
        Proxied {
            client,
            server,
            outcome: proxy,
        }
    }

    /// Deterministic, non-repeating test data: block `i` of a stream seeded with `seed`.
    fn block(seed: u64, i: u64, out: &mut [u8]) {
        let mut x = seed ^ (i.wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for chunk in out.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
    }

    fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        hash
    }
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

    /// Sends `blocks` MiB of seeded data, then half-closes; returns the data's hash.
    async fn send_stream(mut to: impl AsyncWrite + Unpin, seed: u64, blocks: u64) -> u64 {
        let mut buf = vec![0u8; 1 << 20];
        let mut hash = FNV_OFFSET;
        for i in 0..blocks {
            block(seed, i, &mut buf);
            hash = fnv1a(hash, &buf);
            to.write_all(&buf).await.unwrap();
        }
        to.shutdown().await.unwrap();
        hash
    }

    /// Reads to EOF; returns the byte count and hash.
    async fn receive_stream(mut from: impl AsyncRead + Unpin) -> (u64, u64) {
        let mut buf = vec![0u8; 256 * 1024];
        let (mut total, mut hash) = (0u64, FNV_OFFSET);
        loop {
            let n = from.read(&mut buf).await.unwrap();
            if n == 0 {
                return (total, hash);
            }
            total += n as u64;
            hash = fnv1a(hash, &buf[..n]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn thirty_two_mib_cross_intact_in_both_directions_at_once() {
        const MIB: u64 = 32;
        let Proxied {
            client,
            server,
            outcome,
        } = proxied().await;
        let (client_read, client_write) = client.into_split();
        let (server_read, server_write) = server.into_split();

        let work = async {
            tokio::join!(
                send_stream(client_write, 1, MIB),
                receive_stream(server_read),
                send_stream(server_write, 2, MIB),
                receive_stream(client_read),
            )
        };
        let (up_sent, (up_len, up_got), down_sent, (down_len, down_got)) =
            timeout(PATIENCE, work).await.expect("transfer stalled");

        assert_eq!(up_len, MIB << 20);
        assert_eq!(up_got, up_sent, "client to server bytes differ");
        assert_eq!(down_len, MIB << 20);
        assert_eq!(down_got, down_sent, "server to client bytes differ");
        let outcome = outcome.await.unwrap();
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
        assert_eq!(outcome.bytes_received, MIB << 20);
        assert_eq!(outcome.bytes_sent, MIB << 20);
    }

    /// Flows to park copies in, and where the parked ones arrive.
    fn parkable() -> (
        std::sync::Arc<super::super::handover::Flows>,
        tokio::sync::mpsc::UnboundedReceiver<super::super::handover::ParkedFlow>,
    ) {
        let flows = std::sync::Arc::new(super::super::handover::Flows::default());
        let parked = flows.parked().unwrap();
        (flows, parked)
    }

    /// A copy running parkable, its flows and where parked ones arrive.
    async fn proxied_parkable() -> (
        Proxied,
        std::sync::Arc<super::super::handover::Flows>,
        tokio::sync::mpsc::UnboundedReceiver<super::super::handover::ParkedFlow>,
    ) {
        let (flows, parked) = parkable();
        (proxied_in(Some(flows.clone())).await, flows, parked)
    }

    /// The next `n` bytes from `stream`.
    async fn next_bytes(stream: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut got = vec![0u8; n];
        timeout(PATIENCE, stream.read_exact(&mut got))
            .await
            .unwrap()
            .unwrap();
        got
    }

    /// The copy's outcome, once it ends.
    async fn ended(outcome: tokio::task::JoinHandle<Outcome>) -> Outcome {
        timeout(PATIENCE, outcome).await.unwrap().unwrap()
    }

    /// One request and reply through the copy, then both ends close.
    async fn exchange_and_close(client: &mut TcpStream, server: &mut TcpStream) {
        client.write_all(b"request").await.unwrap();
        assert_eq!(next_bytes(server, 7).await, b"request");
        server.write_all(b"reply").await.unwrap();
        server.shutdown().await.unwrap();
        client.shutdown().await.unwrap();
        assert_eq!(read_to_eof(client).await, b"reply");
        assert_eq!(read_to_eof(server).await, b"");
    }

    #[tokio::test]
    async fn a_copy_that_starts_after_the_flows_closed_never_parks() {
        let (flows, mut parked) = parkable();
        flows.park_all();
        assert_eq!(flows.close(false), Some(0), "no copy running: closes");
        // Accepted before the hand-over, its copy starting only now (say, after its
        // upstream connect): nothing takes parked flows any more, so it copies here.
        let Proxied {
            mut client,
            mut server,
            outcome,
        } = proxied_in(Some(flows.clone())).await;
        exchange_and_close(&mut client, &mut server).await;
        let outcome = ended(outcome).await;
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
        assert!(parked.try_recv().is_err(), "nothing parked");
        assert_eq!(flows.running(), 0);
    }

    #[tokio::test]
    async fn a_copy_still_running_when_the_flows_close_copies_on_here() {
        let (
            Proxied {
                mut client,
                mut server,
                outcome,
            },
            flows,
            mut parked,
        ) = proxied_parkable().await;
        client.write_all(b"early").await.unwrap();
        assert_eq!(next_bytes(&mut server, 5).await, b"early");
        assert_eq!(flows.running(), 1);
        // The taker gave up waiting (its time limit) before this copy parked.
        assert_eq!(flows.close(true), Some(1));
        flows.park_all();
        exchange_and_close(&mut client, &mut server).await;
        let outcome = ended(outcome).await;
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
        assert_eq!(outcome.bytes_received, 5 + 7, "counted across the park");
        assert!(parked.try_recv().is_err(), "nothing parked");
    }

    #[tokio::test]
    async fn a_parked_copy_is_delivered_while_the_flows_are_open() {
        let (
            Proxied {
                mut client,
                mut server,
                outcome,
            },
            flows,
            mut parked,
        ) = proxied_parkable().await;
        flows.park_all();
        let outcome = ended(outcome).await;
        assert!(matches!(outcome.end, End::HandedOver), "{:?}", outcome.end);
        assert_eq!(flows.close(false), Some(0));
        // Bytes written meanwhile wait in the kernel for whoever copies next.
        client.write_all(b"after").await.unwrap();
        let flow = parked.try_recv().expect("the flow parked");
        let resumed = tokio::spawn(copy_bidirectional(flow.downstream, flow.upstream));
        assert_eq!(next_bytes(&mut server, 5).await, b"after");
        drop((client, server));
        let _ = timeout(PATIENCE, resumed).await.unwrap();
    }

    /// Everything until the peer's FIN.
    async fn read_to_eof(stream: &mut TcpStream) -> Vec<u8> {
        let mut all = Vec::new();
        timeout(PATIENCE, stream.read_to_end(&mut all))
            .await
            .unwrap()
            .unwrap();
        all
    }

    #[tokio::test]
    async fn client_half_close_still_receives_the_servers_later_reply() {
        let Proxied {
            mut client,
            mut server,
            outcome,
        } = proxied().await;

        client.write_all(b"request").await.unwrap();
        client.shutdown().await.unwrap();
        // The server sees the request and then EOF: the FIN passed through.
        let request = read_to_eof(&mut server).await;
        assert_eq!(request, b"request");

        // Only after that does it answer, on the direction still open.
        server.write_all(b"late reply").await.unwrap();
        server.shutdown().await.unwrap();
        let reply = read_to_eof(&mut client).await;
        assert_eq!(reply, b"late reply");

        let outcome = outcome.await.unwrap();
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
        assert_eq!((outcome.bytes_received, outcome.bytes_sent), (7, 10));
    }

    #[tokio::test]
    async fn server_half_close_still_receives_the_clients_later_data() {
        let Proxied {
            mut client,
            mut server,
            outcome,
        } = proxied().await;

        server.write_all(b"banner").await.unwrap();
        server.shutdown().await.unwrap();
        let banner = read_to_eof(&mut client).await;
        assert_eq!(banner, b"banner");

        client.write_all(b"after the server's FIN").await.unwrap();
        client.shutdown().await.unwrap();
        let late = read_to_eof(&mut server).await;
        assert_eq!(late, b"after the server's FIN");

        let outcome = outcome.await.unwrap();
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
    }

    /// Closes `stream` with RST instead of FIN.
    fn reset(stream: TcpStream) {
        stream.set_zero_linger().unwrap();
        drop(stream);
    }

    async fn read_error(stream: &mut TcpStream) -> io::ErrorKind {
        let mut buf = [0u8; 64];
        match timeout(PATIENCE, stream.read(&mut buf)).await.unwrap() {
            Ok(n) => panic!("expected a reset, read {n} bytes (0 is a FIN)"),
            Err(e) => e.kind(),
        }
    }

    #[tokio::test]
    async fn a_server_reset_reaches_the_client_as_a_reset() {
        let Proxied {
            mut client,
            server,
            outcome,
        } = proxied().await;
        reset(server);
        assert_eq!(
            read_error(&mut client).await,
            io::ErrorKind::ConnectionReset
        );
        let outcome = outcome.await.unwrap();
        assert!(
            matches!(
                outcome.end,
                End::Failed {
                    side: Side::Upstream,
                    ..
                }
            ),
            "{:?}",
            outcome.end
        );
    }

    #[tokio::test]
    async fn a_client_reset_reaches_the_server_as_a_reset() {
        let Proxied {
            client,
            mut server,
            outcome,
        } = proxied().await;
        reset(client);
        assert_eq!(
            read_error(&mut server).await,
            io::ErrorKind::ConnectionReset
        );
        let outcome = outcome.await.unwrap();
        assert!(
            matches!(
                outcome.end,
                End::Failed {
                    side: Side::Downstream,
                    ..
                }
            ),
            "{:?}",
            outcome.end
        );
    }

    #[tokio::test]
    async fn a_reset_after_a_half_close_still_reaches_the_other_side() {
        let Proxied {
            mut client,
            server,
            outcome,
        } = proxied().await;
        client.shutdown().await.unwrap();
        // Let the FIN through before the server resets, so the reset arrives on the
        // one direction still open.
        tokio::time::sleep(Duration::from_millis(50)).await;
        reset(server);
        assert_eq!(
            read_error(&mut client).await,
            io::ErrorKind::ConnectionReset
        );
        outcome.await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reader_that_stops_reading_does_not_stall_another_connection() {
        // The stalled connection: the server floods, the client never reads, so the
        // copy ends up blocked writing to the client.
        let stalled = proxied().await;
        let mut flooding_server = stalled.server;
        let flood = tokio::spawn(async move {
            let chunk = vec![7u8; 1 << 20];
            loop {
                if flooding_server.write_all(&chunk).await.is_err() {
                    return;
                }
            }
        });
        // Give the flood time to fill every buffer on the way.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!flood.is_finished());

        // Meanwhile another connection through another copy works end to end.
        let Proxied {
            mut client,
            mut server,
            outcome,
        } = proxied().await;
        let echo = async {
            client.write_all(b"ping").await.unwrap();
            client.shutdown().await.unwrap();
            let mut got = Vec::new();
            server.read_to_end(&mut got).await.unwrap();
            server.write_all(&got).await.unwrap();
            server.shutdown().await.unwrap();
            let mut back = Vec::new();
            client.read_to_end(&mut back).await.unwrap();
            back
        };
        let back = timeout(Duration::from_secs(5), echo)
            .await
            .expect("a second connection stalled behind a slow reader");
        assert_eq!(back, b"ping");
        outcome.await.unwrap();

        flood.abort();
        drop(stalled.client);
    }

    #[test]
    fn buffers_are_zeroed_megabytes_and_the_pool_keeps_only_a_few() {
        let mut taken: Vec<_> = (0..buffers::KEEP + 3)
            .map(|_| buffers::Buffer::take())
            .collect();
        for buf in &mut taken {
            assert_eq!(buf.len(), buffers::SIZE);
            assert!(buf[0] == 0 && buf[buffers::SIZE - 1] == 0);
            buf[buffers::SIZE - 1] = 1;
        }
        drop(taken);
        assert_eq!(buffers::pooled(), buffers::KEEP, "the rest were unmapped");
        // A reused buffer is whole and writable again.
        let mut again = buffers::Buffer::take();
        assert_eq!(buffers::pooled(), buffers::KEEP - 1);
        assert_eq!(again.len(), buffers::SIZE);
        again.fill(7);
        drop(again);
        assert_eq!(buffers::pooled(), buffers::KEEP);
    }

    #[test]
    fn the_test_data_does_not_repeat_between_blocks() {
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        block(1, 0, &mut a);
        block(1, 1, &mut b);
        assert_ne!(a, b);
    }
}
