//! shunt: an eBPF-accelerated transparent proxy for service meshes, as a library.
//!
//! Modules are layered, bottom first, and a module only imports the ones below it
//! (`cargo xtask lint` checks it):
//!
//! | layer | modules |
//! |---|---|
//! | 1 | [`stats`], [`event`] (event-loop helpers), [`config`] (Envoy types in, diagnostics, conversions, the config tracker's resources), [`access_log`], [`stream_info`] (what filters share about a connection and a stream), [`peer`] (Istio peer metadata and its exchange formats), [`istio_stats`] (Istio's standard metrics and labels) |
//! | 2 | [`tls`] (rustls contexts, SPIFFE verification, secrets, the raw-or-TLS stream) |
//! | 3 | [`upstream`] (clusters, endpoints, load balancing, health, circuit breakers, connection pools) |
//! | 4 | [`tcp`] (`tcp_proxy`), [`http`] (connection manager, HTTP filters, router), [`network`] (network filters before the terminal one), [`dns`] (Istio's DNS proxy and name table) |
//! | 5 | [`listener`] (listener filters, filter-chain match, per-connection handling) |
//! | 6 | [`snapshot`] (assembles one immutable compiled config), [`xds`] (the xDS client) |
//! | 7 | [`admin`] (the admin API over the live proxy), [`agent`] (pilot-agent's jobs), [`node`] (node mode: every enrolled pod in one process) |
//! | 8 | [`server`] (start-up, runtimes, privilege drop, serve loops, `--mode validate`) |
//!
//! The kernel side (eBPF capture, the iptables fallback, `shunt inspect`) is the
//! `shunt-capture` crate.

// Every `unsafe` says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

pub use shunt_admin as admin;
pub use shunt_agent as agent;
pub use shunt_config as config;
pub use shunt_core::{
    access_log, event, formatter, istio_stats, peer, set_filter_state, stats, stream_info,
};
pub use shunt_dns as dns;
pub use shunt_filters::{http, network, tcp};
pub use shunt_listener as listener;
pub use shunt_memory as memory;
pub use shunt_node as node;
pub use shunt_tls as tls;
pub use shunt_upstream as upstream;
pub use shunt_xds as xds;
pub use shunt_xds::snapshot;

pub mod server;
