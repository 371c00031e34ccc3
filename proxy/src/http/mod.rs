//! HTTP: Envoy's `http_connection_manager` network filter and its router. A listener's
//! filter chain hands its connection to [`connection_manager::serve`], which speaks
//! HTTP/1.1 and HTTP/2 to the downstream, routes each request with a [`RouteConfig`]
//! ([`route`]: virtual hosts, routes, actions; compiled by [`route_config::compile`])
//! and forwards it with the [`router`] over the cluster's connection [`pool`]s.

pub mod body;
pub mod compile;
pub mod config;
pub mod connection_manager;
pub mod header_rules;
pub mod matcher;
pub mod pool;
pub mod route;
pub mod route_action;
pub mod route_config;
pub mod router;
pub mod upgrade;

#[cfg(test)]
mod tests;

pub use config::HttpConnectionManager;
pub use route::RouteConfig;
