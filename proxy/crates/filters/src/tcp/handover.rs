//! Established L4 flows handed to another process (node mode's upgrade). A proxy
//! instance whose flows may be handed over runs its connections in the [`scope`] of
//! its [`Flows`]; every plain-TCP copy ([`super::copy`]) made there can then be parked:
//! asked to, each direction finishes the bytes it holds, stops at the top of its loop,
//! and the copy gives its two sockets up instead of closing them. Nothing is held in
//! user space at that point: bytes in flight wait in the sockets' kernel queues, and
//! whoever copies next (the new process) picks them up. Copies through TLS, network
//! filters, tunnels or HTTP are not parkable; they finish or drain as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::TcpStream;
use tokio::sync::{Notify, mpsc};

/// The parkable flows of one instance.
pub struct Flows {
    parking: AtomicBool,
    /// Wakes every copy to look at `parking`.
    park: Notify,
    /// Copies running, and whether parked flows are still taken: one lock, so a copy
    /// that starts after the taker counted none running never parks (see [`Flows::close`]).
    state: Mutex<State>,
    parked_tx: mpsc::UnboundedSender<ParkedFlow>,
    parked_rx: Mutex<Option<mpsc::UnboundedReceiver<ParkedFlow>>>,
}

#[derive(Debug, Default)]
struct State {
    running: u64,
    closed: bool,
}

/// A flow's two sockets, given up by its copy.
#[derive(Debug)]
pub struct ParkedFlow {
    pub downstream: TcpStream,
    pub upstream: TcpStream,
}

impl Default for Flows {
    fn default() -> Self {
        let (parked_tx, parked_rx) = mpsc::unbounded_channel();
        Flows {
            parking: AtomicBool::new(false),
            park: Notify::new(),
            state: Mutex::default(),
            parked_tx,
            parked_rx: Mutex::new(Some(parked_rx)),
        }
    }
}

impl std::fmt::Debug for Flows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flows")
            .field("parking", &self.parking.load(Ordering::Relaxed))
            .field("state", &*self.state())
            .finish()
    }
}

tokio::task_local! {
    static FLOWS: Arc<Flows>;
}

/// Runs `f` with its plain-TCP copies parkable through `flows`.
pub fn scope<F: std::future::Future>(
    flows: Arc<Flows>,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    // Not an `async fn`: that would hold `f` twice (captured, and inside the scope).
    FLOWS.scope(flows, f)
}

/// The current task's flows, if its copies are parkable.
pub fn current() -> Option<Arc<Flows>> {
    FLOWS.try_with(Arc::clone).ok()
}

impl Flows {
    /// Asks every copy, running and to come, to park. Their sockets arrive on the
    /// receiver [`Flows::parked`] gives (once).
    pub fn park_all(&self) {
        self.parking.store(true, Ordering::SeqCst);
        self.park.notify_waiters();
    }

    /// Where parked flows arrive; `None` after the first call.
    pub fn parked(&self) -> Option<mpsc::UnboundedReceiver<ParkedFlow>> {
        self.parked_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Copies running (not yet parked or ended).
    pub fn running(&self) -> u64 {
        self.state().running
    }

    /// Stops taking parked flows once no copy is running, or at once with `force`.
    /// From then on no copy parks: those that start copy here to the end, and those
    /// still running (forced) copy on here when they would have parked. Every flow
    /// parked before is already on the receiver. Returns the copies left running, or
    /// `None` while some still run (not forced).
    pub fn close(&self, force: bool) -> Option<u64> {
        let mut state = self.state();
        if state.running > 0 && !force {
            return None;
        }
        state.closed = true;
        Some(state.running)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn parking(&self) -> bool {
        self.parking.load(Ordering::SeqCst)
    }

    /// Resolves once parking is asked for.
    pub(super) async fn parking_asked(&self) {
        loop {
            let woken = self.park.notified();
            if self.parking() {
                return;
            }
            woken.await;
        }
    }

    /// A copy starting: counted until the guard drops, parkable unless the flows
    /// are closed.
    pub(super) fn started(self: &Arc<Self>) -> Running {
        let mut state = self.state();
        state.running += 1;
        Running {
            flows: self.clone(),
            parkable: !state.closed,
        }
    }

    /// Hands a parked flow to the taker; gives it back if parked flows are no longer
    /// taken (closed, or the taker gone), to be copied on here.
    pub(super) fn deliver(&self, flow: ParkedFlow) -> Result<(), ParkedFlow> {
        // Under the lock: `close` then sees the flow either counted or on the receiver.
        let state = self.state();
        if state.closed {
            return Err(flow);
        }
        self.parked_tx.send(flow).map_err(|e| e.0)
    }
}

/// Counts a copy running until dropped.
pub(super) struct Running {
    flows: Arc<Flows>,
    parkable: bool,
}

impl Running {
    /// The flows to park in, if this copy may park.
    pub(super) fn parks_in(&self) -> Option<&Flows> {
        self.parkable.then_some(&*self.flows)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.flows.state().running -= 1;
    }
}
