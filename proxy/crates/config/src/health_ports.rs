//! Istio's two static HTTP listeners, served directly: 15090 (`/stats/prometheus`, routed
//! to the `prometheus_stats` cluster, which is the admin address) and 15021
//! (`/healthz/ready`, routed to the `agent` cluster, pilot-agent's 15020).
//!
//! In an Istio sidecar these are HTTP connection managers whose routes forward to Envoy's
//! own admin and to pilot-agent. shunt has no pilot-agent beside it to forward 15021 to
//! (the agent issue adds one), so this module recognises the two listeners by their route
//! (the prefix and the cluster it goes to) and the admin API answers in place of the
//! upstream: 15090 with its Prometheus stats, 15021 with 200 while the proxy is ready and
//! not failing health checks (what the agent would answer after asking Envoy's `/ready`),
//! else 503. The data plane leaves the listeners [`find`] returns to the admin API.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::route::v3::route::Action;
use envoy_types::pb::envoy::config::route::v3::route_action::ClusterSpecifier;
use envoy_types::pb::envoy::config::route::v3::route_match::PathSpecifier;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::RouteSpecifier;

use super::resources::{http_connection_managers, socket_addr};

/// What a recognised route answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The admin API's `/stats/prometheus`.
    PrometheusStats,
    /// Readiness: 200 when ready and not failing health checks, else 503.
    Readiness,
}

/// The routes this module recognises: `(path prefix, cluster, answer)`.
const ROUTES: &[(&str, &str, Answer)] = &[
    (
        "/stats/prometheus",
        "prometheus_stats",
        Answer::PrometheusStats,
    ),
    ("/healthz/ready", "agent", Answer::Readiness),
];

/// A static listener served here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthListener {
    pub name: String,
    /// As configured; port 0 binds an ephemeral port.
    pub address: SocketAddr,
    /// `(path prefix, answer)`; other paths get 404, as from a router with no route.
    pub routes: Vec<(String, Answer)>,
}

impl HealthListener {
    /// The answer for a request path (query excluded), by prefix as Envoy's route match.
    pub fn answer(&self, path: &str) -> Option<Answer> {
        self.routes
            .iter()
            .find(|(prefix, _)| path.starts_with(prefix.as_str()))
            .map(|(_, answer)| *answer)
    }
}

/// The bootstrap's static listeners whose HTTP connection manager routes only to what
/// this module answers for.
pub fn find(bootstrap: &Bootstrap) -> Vec<HealthListener> {
    let Some(statics) = &bootstrap.static_resources else {
        return Vec::new();
    };
    statics
        .listeners
        .iter()
        .filter_map(|listener| {
            let address = socket_addr(listener.address.as_ref()?)?;
            let mut routes = Vec::new();
            for hcm in http_connection_managers(listener) {
                let Some(RouteSpecifier::RouteConfig(config)) = hcm.route_specifier else {
                    return None;
                };
                for route in config.virtual_hosts.iter().flat_map(|vh| &vh.routes) {
                    let prefix = match route.r#match.as_ref()?.path_specifier.as_ref()? {
                        PathSpecifier::Prefix(prefix) => prefix,
                        _ => return None,
                    };
                    let cluster = match route.action.as_ref()? {
                        Action::Route(action) => match action.cluster_specifier.as_ref()? {
                            ClusterSpecifier::Cluster(cluster) => cluster,
                            _ => return None,
                        },
                        _ => return None,
                    };
                    let (_, _, answer) = ROUTES
                        .iter()
                        .find(|(p, c, _)| p == prefix && c == cluster)?;
                    routes.push((prefix.clone(), *answer));
                }
            }
            (!routes.is_empty()).then(|| HealthListener {
                name: listener.name.clone(),
                address,
                routes,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_istios_two_listeners() {
        let path = std::path::Path::new(crate::testing::TESTDATA).join("istio-default_golden.json");
        let options = crate::Options {
            config_path: Some(path),
            ..Default::default()
        };
        let found = find(&crate::load::load(&options).unwrap().bootstrap);
        assert_eq!(
            found,
            vec![
                HealthListener {
                    name: "0.0.0.0_15090".into(),
                    address: "0.0.0.0:15090".parse().unwrap(),
                    routes: vec![("/stats/prometheus".into(), Answer::PrometheusStats)],
                },
                HealthListener {
                    name: "0.0.0.0_15021".into(),
                    address: "0.0.0.0:15021".parse().unwrap(),
                    routes: vec![("/healthz/ready".into(), Answer::Readiness)],
                },
            ]
        );
        assert_eq!(found[1].answer("/healthz/ready"), Some(Answer::Readiness));
        assert_eq!(found[1].answer("/other"), None);
    }
}
