//! What every tracer's export shares: a bounded queue of finished spans, flushed in
//! batches by a task of its own (when `min_flush_spans` are waiting, and at every
//! `flush_interval`), never on a request's path. A slow or unreachable collector holds
//! up only that task: spans arriving meanwhile wait in the queue, and spans beyond its
//! bound are dropped and counted.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use super::span::Span;
use shunt_core::stats::Counter;
use shunt_tls::Secrets;
use shunt_upstream::Cluster;

/// Envoy's defaults (`tracing.opentelemetry.flush_interval_ms`, `min_flush_spans`,
/// and OpenTelemetry's `max_cache_size`).
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(5);
pub const MIN_FLUSH_SPANS: usize = 5;
pub const MAX_QUEUED_SPANS: usize = 1024;

/// Where the collector cluster is looked up: the config current when a traced request
/// last came through (the HCM's view, which xDS swaps).
pub trait CollectorSource: Send + Sync {
    fn cluster(&self, name: &str) -> Option<Arc<Cluster>>;
    fn secrets(&self) -> &Secrets;
}

/// A tracer's queue and its flush task.
pub struct Exporter {
    queue: Mutex<Vec<Span>>,
    wake: Arc<tokio::sync::Notify>,
    started: std::sync::Once,
    /// The config last seen, with a key saying which it is (its address: the source
    /// holds it, so the key is not reused while it is here).
    source: Mutex<Option<(usize, Arc<dyn CollectorSource>)>>,
    /// Counted when a span does not fit in the queue.
    pub dropped: Counter,
    pub timer_flushed: Counter,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter").finish_non_exhaustive()
    }
}

impl Exporter {
    pub fn new(dropped: Counter, timer_flushed: Counter) -> Self {
        Exporter {
            queue: Mutex::new(Vec::new()),
            wake: Arc::new(tokio::sync::Notify::new()),
            started: std::sync::Once::new(),
            source: Mutex::new(None),
            dropped,
            timer_flushed,
        }
    }

    /// Remembers the config to find the collector cluster in, when it changed.
    pub fn observe(&self, key: usize, source: impl FnOnce() -> Arc<dyn CollectorSource>) {
        let mut current = self.source.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_none_or(|(k, _)| *k != key) {
            *current = Some((key, source()));
        }
    }

    pub fn source(&self) -> Option<Arc<dyn CollectorSource>> {
        let current = self.source.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().map(|(_, s)| s.clone())
    }

    /// Queues a finished span; wakes the flush task once a batch is waiting.
    pub fn push(&self, span: Span) {
        let waiting = {
            let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            if queue.len() >= MAX_QUEUED_SPANS {
                self.dropped.inc();
                return;
            }
            queue.push(span);
            queue.len()
        };
        if waiting >= MIN_FLUSH_SPANS {
            self.wake.notify_one();
        }
    }

    fn take(&self) -> Vec<Span> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Starts the flush task once, in the calling task's connection scope (a pod's
    /// network namespace), holding the tracer only weakly: it ends with the tracer.
    pub fn start<T: Flush>(&self, tracer: Weak<T>) {
        self.started.call_once(|| {
            let scope = shunt_upstream::scope::ConnectionScope::current();
            tokio::spawn(scope.run(flush_loop(tracer, self.wake.clone())));
        });
    }
}

/// A tracer that sends its batches somewhere.
pub trait Flush: Send + Sync + 'static {
    fn exporter(&self) -> &Exporter;
    /// Sends one batch; its own stats say how it went.
    fn send(self: Arc<Self>, batch: Vec<Span>) -> impl std::future::Future<Output = ()> + Send;
}

async fn flush_loop<T: Flush>(tracer: Weak<T>, wake: Arc<tokio::sync::Notify>) {
    let mut timer = tokio::time::interval(FLUSH_INTERVAL);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer.tick().await;
    loop {
        // The tracer is not held while waiting: it may go with its config meanwhile.
        let woken = tokio::select! {
            _ = timer.tick() => false,
            () = wake.notified() => true,
        };
        let Some(t) = tracer.upgrade() else { return };
        if !woken {
            t.exporter().timer_flushed.inc();
        }
        let batch = t.exporter().take();
        if !batch.is_empty() {
            t.send(batch).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracers::span::{Kind, SpanContext};

    fn span() -> Span {
        Span {
            context: SpanContext {
                trace_id: 1,
                span_id: 1,
                parent_id: None,
                sampled: true,
            },
            kind: Kind::Server,
            name: "ingress".into(),
            start: std::time::SystemTime::now(),
            duration: Duration::ZERO,
            tags: Vec::new(),
            trace_state: String::new(),
            local_ip: None,
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_what_does_not_fit() {
        let exporter = Exporter::new(Counter::default(), Counter::default());
        for _ in 0..MAX_QUEUED_SPANS + 3 {
            exporter.push(span());
        }
        assert_eq!(exporter.dropped.value(), 3);
        assert_eq!(exporter.take().len(), MAX_QUEUED_SPANS);
        // Taken for a flush: room again.
        exporter.push(span());
        assert_eq!(exporter.dropped.value(), 3);
        assert_eq!(exporter.take().len(), 1);
    }
}
