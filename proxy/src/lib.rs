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

pub mod access_log;
pub mod admin;
pub mod agent;
pub mod config;
pub mod dns;
pub mod event;
pub mod formatter;
pub mod http;
pub mod istio_stats;
pub mod listener;
pub mod memory;
pub mod network;
pub mod node;
pub mod peer;
pub mod server;
pub mod set_filter_state;
pub mod snapshot;
pub mod stats;
pub mod stream_info;
pub mod tcp;
pub mod tls;
pub mod upstream;
pub mod xds;
