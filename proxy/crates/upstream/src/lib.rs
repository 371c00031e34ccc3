//! Upstreams: clusters, their hosts, and everything that decides which host a connection
//! goes to and whether it may go at all. Named after Envoy's pieces so an Envoy user
//! finds them: [`cluster`] (discovery types, host sets), [`clusters`] (the cluster
//! manager's clusters by name, made on first use when deferred), [`load_balancer`] (`lb_policy`),
//! [`circuit_breaker`], [`outlier`] (outlier detection), [`health_check`] (active
//! health checks), [`dns_cluster`] (STRICT_DNS / LOGICAL_DNS discovery), [`connect`]
//! (the connect itself, with `upstream_bind_config` and `connect_timeout`), [`internal`]
//! (connections to internal listeners), [`http_pool`] and [`http1`] (the HTTP
//! connection pools, and the HTTP/1.1 codec their connections speak) and [`stats`] (the
//! `cluster.<name>.*` stats the admin API shows). [`backoff`] is the retry back-off
//! `tcp`, `http` and `xds` share.

pub mod backoff;
pub mod circuit_breaker;
pub mod cluster;
pub mod clusters;
pub mod compile;
pub mod connect;
pub mod dns_cluster;
pub mod health_check;
pub mod host;
pub mod http1;
pub mod http_pool;
pub mod internal;
pub mod load_balancer;
pub mod netns;
pub mod outlier;
pub mod same_node;
pub mod scope;
pub mod stats;
pub mod transport_socket;
pub mod tunnel_pool;

pub use cluster::{Cluster, ClusterConfig, Discovery};
pub use clusters::Clusters;
pub use load_balancer::LbContext;
