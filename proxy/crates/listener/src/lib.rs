//! Listeners: what happens between accept and a network filter. A listener's
//! compiled config ([`config`], compiled from Envoy's by [`compile`]), its listener
//! filters ([`inspector`]: `tls_inspector`, `http_inspector`; [`original_dst`]), filter
//! chain matching in Envoy's order ([`filter_chain`]) or by the xDS matcher API
//! ([`chain_matcher`]), and the per-connection handling
//! that hands the connection to `tcp_proxy` or the HTTP connection manager
//! ([`connection_handler`]), for sockets and for internal listeners' in-process
//! connections ([`internal`]).

#![forbid(unsafe_code)]

pub mod chain_matcher;
pub mod compile;
pub mod config;
pub mod connection_handler;
pub mod filter_chain;
pub mod inspector;
pub mod internal;
pub mod original_dst;

use std::net::SocketAddr;
use std::sync::Arc;

pub use compile::ListenerStats;
pub use config::Listener;

use shunt_filters::http::{ConfigProvider, RequestConfig};

/// The config a connection is served with: the snapshot current when it was accepted.
pub trait ConnectionConfig: RequestConfig {
    fn listener(&self, name: &str) -> Option<&Arc<Listener>>;
    /// The listener bound to `destination`, for `use_original_dst` hand-offs.
    fn listener_for_address(&self, destination: SocketAddr) -> Option<&Arc<Listener>>;
    fn listener_stats(&self, listener: &Listener) -> Option<&ListenerStats>;
}

/// Where each accepted connection finds the config current then (the snapshot store).
pub trait ListenerProvider: ConfigProvider {
    fn connection_config(&self) -> Arc<dyn ConnectionConfig>;
}
