//! The buffer between the request path and a log service: entries are encoded and
//! appended under a lock (nothing else happens on the request path), and one task per
//! logger sends them in batches, every `buffer_flush_interval` or as soon as
//! `buffer_size_bytes` are waiting. The buffer is bounded by `buffer_size_bytes`: an
//! entry that does not fit while a batch is on its way, or while the service is
//! unreachable, is dropped and counted (`logs_dropped`), as in Envoy; an accepted one
//! counts as `logs_written`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use shunt_core::stats::Counter;

/// Sends one batch; the error says why it did not arrive.
pub trait Exporter: std::fmt::Debug + Send + Sync + 'static {
    type Message: Send + 'static;
    fn export(
        &self,
        batch: &[Self::Message],
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;
}

/// Envoy's `logs_written` and `logs_dropped` for one logger, and the entries of the
/// batches that arrived (`grpc_entries_flushed`) or did not (`grpc_entries_flush_failed`).
#[derive(Debug, Clone, Default)]
pub struct LogStats {
    pub written: Counter,
    pub dropped: Counter,
    pub flushed: Counter,
    pub flush_failed: Counter,
}

#[derive(Debug)]
pub struct Batcher<E: Exporter> {
    exporter: E,
    state: Mutex<Pending<E::Message>>,
    wake: tokio::sync::Notify,
    flush_interval: Duration,
    buffer_size: usize,
    stats: LogStats,
    started: AtomicBool,
}

#[derive(Debug)]
struct Pending<M> {
    messages: Vec<(M, usize)>,
    bytes: usize,
}

impl<E: Exporter> Batcher<E> {
    pub fn new(
        exporter: E,
        flush_interval: Duration,
        buffer_size: usize,
        stats: LogStats,
    ) -> Arc<Self> {
        Arc::new(Batcher {
            exporter,
            state: Mutex::new(Pending {
                messages: Vec::new(),
                bytes: 0,
            }),
            wake: tokio::sync::Notify::new(),
            flush_interval,
            buffer_size: buffer_size.max(1),
            stats,
            started: AtomicBool::new(false),
        })
    }

    pub fn exporter(&self) -> &E {
        &self.exporter
    }

    /// Buffers one encoded entry of `size` bytes, or drops it when the buffer is full.
    pub fn push(self: &Arc<Self>, message: E::Message, size: usize) {
        self.start();
        let full = {
            let mut pending = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if pending.bytes > 0 && pending.bytes + size > self.buffer_size {
                drop(pending);
                self.stats.dropped.inc();
                self.wake.notify_one();
                return;
            }
            pending.messages.push((message, size));
            pending.bytes += size;
            pending.bytes >= self.buffer_size
        };
        self.stats.written.inc();
        if full {
            self.wake.notify_one();
        }
    }

    /// Starts the flushing task on the current runtime, once (none: no task; entries
    /// wait, bounded, until a logger on a runtime starts it).
    fn start(self: &Arc<Self>) {
        if self.started.load(Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        runtime.spawn(flush_loop(Arc::downgrade(self)));
    }

    fn take(&self) -> Vec<(E::Message, usize)> {
        let mut pending = self.state.lock().unwrap_or_else(|e| e.into_inner());
        pending.bytes = 0;
        std::mem::take(&mut pending.messages)
    }

    /// A batch that did not arrive goes back in front, as far as the buffer has room
    /// (the service may come back); what does not fit is dropped.
    fn put_back(&self, mut batch: Vec<(E::Message, usize)>) {
        let mut pending = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut room = self.buffer_size.saturating_sub(pending.bytes);
        let mut kept = 0;
        while kept < batch.len() && batch[kept].1 <= room {
            room -= batch[kept].1;
            kept += 1;
        }
        self.stats.dropped.add((batch.len() - kept) as u64);
        batch.truncate(kept);
        let bytes: usize = batch.iter().map(|(_, size)| size).sum();
        pending.bytes += bytes;
        batch.append(&mut pending.messages);
        pending.messages = batch;
    }
}

/// Sends what is waiting every interval, or when woken by a full buffer, until the
/// logger is gone (a config update replaced it: at most one interval later).
async fn flush_loop<E: Exporter>(logger: Weak<Batcher<E>>) {
    while let Some(logger) = logger.upgrade() {
        let _ = tokio::time::timeout(logger.flush_interval, logger.wake.notified()).await;
        let (messages, sizes): (Vec<E::Message>, Vec<usize>) = logger.take().into_iter().unzip();
        if messages.is_empty() {
            continue;
        }
        let count = messages.len() as u64;
        match logger.exporter.export(&messages).await {
            Ok(()) => logger.stats.flushed.add(count),
            Err(why) => {
                logger.stats.flush_failed.add(count);
                tracing::debug!(exporter = ?logger.exporter, %why, "access log batch not sent");
                logger.put_back(messages.into_iter().zip(sizes).collect());
            }
        }
    }
}
