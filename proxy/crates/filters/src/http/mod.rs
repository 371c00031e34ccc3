//! HTTP: Envoy's `http_connection_manager` network filter and its router. A listener's
//! filter chain hands its connection to [`connection_manager::serve`], which speaks
//! HTTP/1.1 and HTTP/2 to the downstream, routes each request with a [`RouteConfig`]
//! ([`route`]: virtual hosts, routes, actions; compiled by [`route_config::compile`])
//! and forwards it with the [`router`] over the cluster's connection pools
//! (`upstream::http_pool`).
//!
//! Each request reads the config current when it arrives through [`ConfigProvider`]:
//! the snapshot, which sits above this module, implements it.

pub mod body;
pub mod compile;
pub mod config;
pub mod connect;
pub mod connection_manager;
pub mod delayed_close;
pub mod filter;
pub mod header_rules;
pub mod headers;
pub mod limits;
pub mod path_normalization;
pub mod rate_limit_policy;
pub mod route;
pub mod route_action;
pub mod route_config;
pub mod router;
pub mod timeouts;
pub mod upgrade;
pub mod wire;

#[cfg(test)]
mod tests;

use std::sync::Arc;

pub use config::HttpConnectionManager;
pub use route::RouteConfig;

use shunt_tls::Secrets;
use shunt_upstream::Clusters;

/// The config one request is routed with: the snapshot current when it arrived.
pub trait RequestConfig: Send + Sync {
    /// A route configuration from RDS, by name.
    fn route_config(&self, name: &str) -> Option<&Arc<RouteConfig>>;
    fn clusters(&self) -> &Clusters;
    /// Named secrets (static or SDS), looked up at each upstream handshake.
    fn secrets(&self) -> &Secrets;
}

/// A tracer's collector cluster, looked up in the config a traced request saw.
pub struct Collectors(pub Arc<dyn RequestConfig>);

impl crate::tracers::CollectorSource for Collectors {
    fn cluster(&self, name: &str) -> Option<Arc<shunt_upstream::Cluster>> {
        self.0.clusters().get(name).cloned()
    }

    fn secrets(&self) -> &Secrets {
        self.0.secrets()
    }
}

/// Where the connection manager finds the config current at each request (the
/// snapshot store, which xDS swaps).
pub trait ConfigProvider: Send + Sync {
    fn request_config(&self) -> Arc<dyn RequestConfig>;
}
