//! An instance's connections: counted while they run (Envoy's `downstream_cx_total`
//! and `downstream_cx_active` of the instance), waited for in a drain, and cut when the
//! drain time is over. Cutting aborts their tasks, so a running connection pays nothing
//! for being cuttable.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::AbortHandle;

/// The connections of one instance.
#[derive(Debug, Default)]
pub struct Connections {
    total: AtomicU64,
    active: AtomicUsize,
    finished: Notify,
    next_id: AtomicU64,
    /// Each running connection's task, to cut it.
    tasks: Mutex<HashMap<u64, AbortHandle>>,
}

/// Held by one connection's task; dropping it counts the connection finished.
#[derive(Debug)]
struct Open {
    connections: Arc<Connections>,
    id: u64,
}

impl Connections {
    /// Runs one connection on the current runtime, counted and cuttable.
    pub fn spawn(self: &Arc<Self>, connection: impl Future<Output = ()> + Send + 'static) {
        self.total.fetch_add(1, Ordering::Relaxed);
        self.active.fetch_add(1, Ordering::SeqCst);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let open = Open {
            connections: self.clone(),
            id,
        };
        // Held while spawning: the task cannot unregister itself before it is registered.
        let mut tasks = self.lock();
        let task = tokio::spawn(async move {
            connection.await;
            drop(open);
        });
        tasks.insert(id, task.abort_handle());
    }

    /// Connections accepted (or handed over) since the instance started.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Connections running now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Resolves once no connection runs.
    pub async fn all_finished(&self) {
        loop {
            let finished = self.finished.notified();
            if self.active() == 0 {
                return;
            }
            finished.await;
        }
    }

    /// Waits for the running connections to finish, at most `drain_time` (Envoy's drain
    /// on shutdown); cuts what is still running then.
    pub async fn drain(&self, drain_time: Duration) {
        let open = self.active();
        if open == 0 {
            return;
        }
        tracing::info!(
            connections = open,
            drain_time_s = drain_time.as_secs_f64(),
            "draining: waiting for open connections to finish"
        );
        match tokio::time::timeout(drain_time, self.all_finished()).await {
            Ok(()) => tracing::info!("drained: every connection finished"),
            Err(_) => {
                tracing::info!(
                    connections = self.active(),
                    "drain time over: closing the connections still open"
                );
                self.cut();
            }
        }
    }

    /// Ends every running connection now.
    pub fn cut(&self) {
        let tasks = std::mem::take(&mut *self.lock());
        for task in tasks.into_values() {
            task.abort();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, AbortHandle>> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.connections.lock().remove(&self.id);
        if self.connections.active.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.connections.finished.notify_waiters();
        }
    }
}
