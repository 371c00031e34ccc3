//! Compiling a `tcp_proxy` network filter's config.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::{
    TcpProxy as EnvoyTcpProxy, tcp_proxy::ClusterSpecifier as EnvoySpecifier,
};
use envoy_types::pb::envoy::r#type::v3::hash_policy::PolicySpecifier;

use super::tcp_proxy::{ClusterSpecifier, DEFAULT_IDLE_TIMEOUT, TcpProxy, TcpProxyStats};
use shunt_config::convert::duration_or;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::Store;
use shunt_upstream::Clusters;

pub fn compile(
    proxy: &EnvoyTcpProxy,
    clusters: &Clusters,
    stats: &Store,
    node: &envoy_types::pb::envoy::config::core::v3::Node,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<TcpProxy> {
    let errors_before = problems.errors.len();
    if proxy.stat_prefix.is_empty() {
        problems.error(path.field("stat_prefix"), "is required");
    }
    let check_cluster = |name: &str, path: JsonPath, problems: &mut Diagnostics| {
        if !clusters.contains_key(name) {
            problems.warning(
                path,
                format!("no cluster named {name:?}: its connections will be closed (NC)"),
            );
        }
    };
    let specifier = match &proxy.cluster_specifier {
        Some(EnvoySpecifier::Cluster(name)) if !name.is_empty() => {
            check_cluster(name, path.field("cluster"), problems);
            Some(ClusterSpecifier::Cluster(name.as_str().into()))
        }
        Some(EnvoySpecifier::WeightedClusters(weighted)) => {
            let mut list = Vec::new();
            for (i, c) in weighted.clusters.iter().enumerate() {
                let c_path = path.field("weighted_clusters").field("clusters").index(i);
                if c.name.is_empty() {
                    problems.error(c_path.field("name"), "is required");
                    continue;
                }
                check_cluster(&c.name, c_path.field("name"), problems);
                if c.metadata_match.is_some() {
                    problems.warning(
                        c_path.field("metadata_match"),
                        "subset load balancing is not implemented; ignored",
                    );
                }
                list.push((Arc::from(c.name.as_str()), c.weight));
            }
            if list.iter().all(|(_, w)| *w == 0) {
                problems.error(
                    path.field("weighted_clusters"),
                    "needs at least one cluster with a positive weight",
                );
                None
            } else {
                Some(ClusterSpecifier::Weighted(list))
            }
        }
        _ => {
            problems.error(path, "tcp_proxy needs cluster or weighted_clusters");
            None
        }
    };
    let idle = duration_or(
        proxy.idle_timeout.as_ref(),
        DEFAULT_IDLE_TIMEOUT,
        &path.field("idle_timeout"),
        problems,
    );
    let max_connect_attempts = proxy.max_connect_attempts.map_or(1, |v| v.value);
    if max_connect_attempts == 0 {
        problems.error(path.field("max_connect_attempts"), "must be at least 1");
    }
    for (i, policy) in proxy.hash_policy.iter().enumerate() {
        if !matches!(policy.policy_specifier, Some(PolicySpecifier::SourceIp(_))) {
            problems.warning(
                path.field("hash_policy").index(i),
                "only source_ip hashing is implemented; the source IP is hashed",
            );
        }
    }
    let tunneling = proxy
        .tunneling_config
        .as_ref()
        .and_then(|t| super::tunnel::compile(t, &path.field("tunneling_config"), problems));
    if proxy.on_demand.is_some() {
        problems.error(
            path.field("on_demand"),
            "on-demand cluster discovery is not implemented yet",
        );
    }
    if proxy.metadata_match.is_some() {
        problems.warning(
            path.field("metadata_match"),
            "subset load balancing is not implemented; ignored",
        );
    }
    if proxy.max_downstream_connection_duration.is_some() {
        problems.warning(
            path.field("max_downstream_connection_duration"),
            "not implemented yet; connections last until closed or idle",
        );
    }
    let access_log = crate::common::access_log::compile(
        &proxy.access_log,
        crate::common::access_log::Env {
            clusters,
            stats,
            node,
        },
        &path.field("access_log"),
        problems,
    );
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(TcpProxy {
        stat_prefix: proxy.stat_prefix.clone(),
        clusters: specifier?,
        idle_timeout: (!idle.is_zero()).then_some(idle),
        max_connect_attempts,
        access_log,
        stats: TcpProxyStats::new(stats, &proxy.stat_prefix),
        tunneling,
        node: Default::default(),
    })
}
