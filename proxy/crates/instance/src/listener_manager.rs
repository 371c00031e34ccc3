//! An instance's listening sockets and their accept loops (Envoy's `ListenerManager`):
//! the one accept loop of shunt, what each socket serves ([`Serves`]), sockets added
//! and removed as xDS changes listeners, closed on a drain or a stop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

use crate::instance::Shared;
use crate::local_reply::{self, LocalReply};
use shunt_core::access_log::Direction;
use shunt_core::event::workers;
use shunt_xds::manager::ListenerChange;

/// What a listening socket serves.
#[derive(Clone)]
pub enum Serves {
    /// A listener of the instance's configuration.
    Listener {
        name: Arc<str>,
        direction: Direction,
    },
    /// Istio's passthrough on a capture port (an instance without configuration).
    Passthrough(Direction),
    /// One local HTTP reply per connection (node mode's per-pod health and stats ports).
    LocalReply(Arc<dyn LocalReply>),
}

impl Serves {
    fn direction(&self) -> Direction {
        match self {
            Serves::Listener { direction, .. } | Serves::Passthrough(direction) => *direction,
            Serves::LocalReply(_) => Direction::Unspecified,
        }
    }

    fn name(&self) -> Option<&Arc<str>> {
        match self {
            Serves::Listener { name, .. } => Some(name),
            Serves::Passthrough(_) | Serves::LocalReply(_) => None,
        }
    }
}

impl std::fmt::Debug for Serves {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Serves::Listener { name, direction } => write!(f, "listener {name} ({direction})"),
            Serves::Passthrough(direction) => write!(f, "passthrough ({direction})"),
            Serves::LocalReply(_) => write!(f, "local reply"),
        }
    }
}

/// A listening socket opened for an instance.
#[derive(Debug)]
pub struct Socket {
    pub addr: SocketAddr,
    pub listener: std::net::TcpListener,
    pub serves: Serves,
}

/// Observes the addresses the instance's configured listeners are bound at (the admin
/// API's `/listeners`).
pub type OnBound = Arc<dyn Fn(BoundEvent<'_>) + Send + Sync>;

/// A listener of the configuration started or stopped accepting at an address.
#[derive(Debug, Clone, Copy)]
pub enum BoundEvent<'a> {
    Bound(&'a str, SocketAddr),
    Unbound(&'a str, SocketAddr),
}

/// One socket's accept loops, one on each worker.
struct AcceptLoop {
    serves: Serves,
    addr: SocketAddr,
    /// A second handle on the socket: `stop(refuse)` shuts it down at once (an aborted
    /// accept task drops its listener only when the runtime gets to it).
    control: std::net::TcpListener,
    tasks: Vec<AbortHandle>,
}

impl AcceptLoop {
    fn abort(&self) {
        self.tasks.iter().for_each(AbortHandle::abort);
    }
}

/// The sockets an instance accepts on.
pub struct ListenerManager {
    shared: Arc<Shared>,
    loops: Vec<AcceptLoop>,
    on_bound: Option<OnBound>,
    drain_time: Duration,
}

impl ListenerManager {
    pub(crate) fn new(
        shared: Arc<Shared>,
        on_bound: Option<OnBound>,
        drain_time: Duration,
    ) -> Self {
        ListenerManager {
            shared,
            loops: Vec::new(),
            on_bound,
            drain_time,
        }
    }

    /// Starts accepting on `socket`: on every worker (`event::workers`), as each Envoy
    /// worker listens on every listener, each connection then served on the worker
    /// that accepted it; on the current runtime in a process without workers.
    pub fn add(&mut self, socket: Socket) -> std::io::Result<()> {
        let control = socket.listener.try_clone()?;
        let addr = socket.listener.local_addr().unwrap_or(socket.addr);
        match &socket.serves {
            Serves::Listener { name, .. } => tracing::info!(listener = %name, %addr, "listening"),
            Serves::Passthrough(direction) => tracing::info!(%direction, %addr, "listening"),
            Serves::LocalReply(_) => tracing::debug!(%addr, "listening: local replies"),
        }
        if let (Some(name), Some(on_bound)) = (socket.serves.name(), &self.on_bound) {
            on_bound(BoundEvent::Bound(name, addr));
        }
        let current;
        let workers = match workers::handles() {
            [] => {
                current = [tokio::runtime::Handle::current()];
                &current[..]
            }
            all => all,
        };
        let mut tasks = Vec::with_capacity(workers.len());
        for worker in workers {
            // The same socket in each worker's epoll: whichever is free takes the next
            // connection, the others find nothing to accept.
            let registered = socket.listener.try_clone().and_then(|listener| {
                let _in = worker.enter();
                TcpListener::from_std(listener)
            });
            let listener = match registered {
                Ok(listener) => listener,
                Err(err) => {
                    // Not half-started: the workers already accepting stop.
                    tasks.iter().for_each(AbortHandle::abort);
                    return Err(err);
                }
            };
            let serving = accept_loop(listener, socket.serves.clone(), addr, self.shared.clone());
            tasks.push(worker.spawn(serving).abort_handle());
        }
        self.loops.push(AcceptLoop {
            serves: socket.serves,
            addr: socket.addr,
            control,
            tasks,
        });
        Ok(())
    }

    /// An xDS update's listener changes: accept on the new sockets, close the removed
    /// ones, and close the connections of replaced or removed listeners after the
    /// drain time.
    pub fn apply(&mut self, change: ListenerChange) {
        for (name, addr) in &change.unbound {
            self.loops.retain(|l| {
                let gone = l.serves.name() == Some(name) && l.addr == *addr;
                if gone {
                    l.abort();
                    tracing::info!(listener = %name, %addr, "listener removed: no longer accepting");
                }
                !gone
            });
            if let Some(on_bound) = &self.on_bound {
                on_bound(BoundEvent::Unbound(name, *addr));
            }
        }
        let ports: Vec<u16> = change.bound.iter().map(|b| b.addr.port()).collect();
        for b in change.bound {
            let socket = Socket {
                addr: b.addr,
                listener: b.socket,
                serves: Serves::Listener {
                    name: b.listener.clone(),
                    direction: b.direction,
                },
            };
            if let Err(err) = self.add(socket) {
                tracing::error!(listener = %b.listener, addr = %b.addr, %err, "registering a listener failed");
            }
        }
        self.shared.add_own_ports(&ports);
        if !change.retired.is_empty() {
            let (retired, drain_time) = (change.retired, self.drain_time);
            tokio::spawn(async move {
                tokio::time::sleep(drain_time).await;
                for listener in retired {
                    listener.draining.close_connections();
                }
            });
        }
    }

    /// Stops accepting on every socket, or on the INBOUND ones (Envoy's
    /// `/drain_listeners[?inboundonly]`); connections already accepted carry on.
    pub fn close(&mut self, inbound_only: bool) {
        self.loops.retain(|l| {
            let close = !inbound_only || l.serves.direction() == Direction::Inbound;
            if close {
                l.abort();
                tracing::info!(serves = ?l.serves, addr = %l.addr, "no longer accepting");
            }
            !close
        });
    }

    /// Stops accepting everywhere. With `refuse` the sockets stop listening at once, so a
    /// connect is refused rather than queued for an accept that never comes; without,
    /// they stay open in whoever else holds them (an upgrade's new process).
    pub fn stop(&mut self, refuse: bool) {
        for l in self.loops.drain(..) {
            l.abort();
            if refuse {
                let _ = socket2::SockRef::from(&l.control).shutdown(std::net::Shutdown::Both);
            }
        }
    }

    /// The configured listener accepting at `addr`, if any.
    pub fn listener_at(&self, addr: SocketAddr) -> Option<Arc<str>> {
        self.loops
            .iter()
            .find(|l| l.addr == addr)
            .and_then(|l| l.serves.name().cloned())
    }

    /// The addresses accepted on.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.loops.iter().map(|l| l.addr).collect()
    }
}

/// shunt's accept loop: every connection accepted is served by what the socket serves,
/// in a task of its own.
async fn accept_loop(listener: TcpListener, serves: Serves, addr: SocketAddr, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => serve(&shared, stream, peer, &serves, addr),
            // The client gave up while queued; nothing to back off from.
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
            Err(err) => {
                // Out of file descriptors or memory: back off instead of spinning, the
                // pending connections stay queued in the backlog.
                tracing::warn!(serves = ?serves, %addr, %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn serve(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    serves: &Serves,
    addr: SocketAddr,
) {
    match serves {
        Serves::Listener { name, .. } => shared.serve_listener(stream, peer, name.clone(), addr),
        Serves::Passthrough(direction) => shared.serve_passthrough(stream, peer, *direction, addr),
        Serves::LocalReply(replies) => {
            let replies = replies.clone();
            tokio::spawn(async move { local_reply::serve(stream, replies.as_ref()).await });
        }
    }
}
