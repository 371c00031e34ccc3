//! One proxy instance, whatever runs it (ztunnel's `ProxyFactory` and `ProxyInputs`;
//! Envoy's `Server::InstanceImpl` with its `ListenerManager`).
//!
//! `shunt proxy` without a bootstrap (Istio's passthrough), `shunt proxy -c` (a
//! bootstrap, static or from xDS), the proxy `shunt agent` runs in its own process and
//! each pod of `shunt node` are all a [`ProxyInstance`] started from [`ProxyInputs`]:
//! what it serves ([`InstanceConfig`]), the sockets opened for it before it starts,
//! where its connections run ([`ConnectionScope`]: a pod's network namespace and
//! same-node client) and how long they get to finish. An instance owns its snapshot
//! store and xDS streams, its listeners and their accept loops ([`listener_manager`]),
//! the internal-listener registry its connections reach, and its connections
//! ([`connections`]): counted, drained, cut. There is one accept loop, and one way a
//! connection is spawned.
//!
//! What stays with the program that runs an instance: its signals, the admin API, the
//! DNS proxy's sockets, privileges.

#![forbid(unsafe_code)]

pub mod connections;
mod instance;
pub mod listener_manager;
pub mod local_reply;
pub mod passthrough;

pub use connections::Connections;
pub use instance::{
    BoundEvent, Configured, ConnectionScope, InstanceConfig, ProxyInputs, ProxyInstance, XdsInputs,
};
pub use listener_manager::{Serves, Socket};
