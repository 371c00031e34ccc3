//! A listener as compiled from Envoy's `Listener`: where it listens, which listener
//! filters run on an accepted connection, and its filter chains. Immutable; held by the
//! snapshot.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::filter_chain::FilterChains;
use shunt_core::access_log::{Direction, Sink};
use shunt_filters::http::HttpConnectionManager;
use shunt_filters::tcp::tcp_proxy::TcpProxy;

/// Envoy's default `listener_filters_timeout`.
pub const DEFAULT_LISTENER_FILTERS_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug)]
pub struct Listener {
    pub name: Arc<str>,
    /// `address`, then `additional_addresses`.
    pub addresses: Vec<SocketAddr>,
    /// False: never bound; the listener only takes connections handed off to it.
    pub bind_to_port: bool,
    /// `internal_listener`: no address; only upstream connections to
    /// `envoy_internal_address`es in this process reach it.
    pub internal: bool,
    /// Hands connections whose original destination was restored to the listener for
    /// that destination (Istio's virtualOutbound 15001).
    pub use_original_dst: bool,
    pub transparent: bool,
    pub freebind: bool,
    pub direction: Direction,
    pub listener_filters: ListenerFilters,
    pub filter_chains: FilterChains<Arc<FilterChain>>,
    /// Listener-level access logs: connections that never reached a filter chain.
    pub access_log: Vec<Sink>,
    /// Set once an update removed or replaced this listener and the drain time passed:
    /// its remaining connections close.
    pub draining: Draining,
}

/// The end of a listener's drain: its connections wait on it.
#[derive(Debug)]
pub struct Draining(tokio::sync::watch::Sender<bool>);

impl Default for Draining {
    fn default() -> Self {
        Draining(tokio::sync::watch::Sender::new(false))
    }
}

impl Draining {
    /// Closes every connection still served under this listener.
    pub fn close_connections(&self) {
        self.0.send_replace(true);
    }

    /// Resolves once [`Draining::close_connections`] was called.
    pub async fn closed(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives as long as `self`, so this cannot fail while we wait.
        let _ = rx.wait_for(|closed| *closed).await;
    }
}

/// The listener filters shunt implements, as flags: they run in this order whatever
/// order the config lists them in, which gives the same result since each only adds a
/// fact (the destination, the SNI/ALPN, the HTTP protocol) the others do not read,
/// except `http_inspector`, which skips TLS connections as Envoy's does.
#[derive(Debug, Clone, Default)]
pub struct ListenerFilters {
    pub original_dst: bool,
    /// Istio's `istio.set_internal_dst_address` (internal listeners only).
    pub set_internal_dst_address: bool,
    pub tls_inspector: bool,
    pub http_inspector: bool,
    /// `None` when configured as 0s (no timeout).
    pub timeout: Option<Duration>,
    pub continue_on_timeout: bool,
}

impl ListenerFilters {
    pub fn inspects(&self) -> bool {
        self.tls_inspector || self.http_inspector
    }
}

#[derive(Debug)]
pub struct FilterChain {
    /// The chain's `name`, or `filter_chains[i]` when unnamed.
    pub name: String,
    /// `transport_socket`: TLS to terminate before the network filter runs; `None` for
    /// raw bytes.
    pub transport_socket: Option<Arc<shunt_tls::DownstreamTls>>,
    /// `transport_socket_connect_timeout`: how long the TLS handshake may take; `None`
    /// waits as long as the client does (Envoy's default).
    pub transport_socket_connect_timeout: Option<Duration>,
    /// The network filters before the terminal one (RBAC, istio_authn, ...).
    pub filters: shunt_filters::network::NetworkFilters,
    pub network: NetworkFilter,
}

/// The terminal network filter of a chain.
#[derive(Debug)]
pub enum NetworkFilter {
    TcpProxy(TcpProxy),
    /// `http_connection_manager`; shared with the requests it serves.
    Http(Arc<HttpConnectionManager>),
}
