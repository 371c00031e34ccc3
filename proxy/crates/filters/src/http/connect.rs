//! CONNECT termination (Envoy's `connect_matcher` routes whose action has an
//! `upgrade_configs` entry `CONNECT` with a `connect_config`): the router opens a TCP
//! connection (or an internal listener's pipe) to the route's cluster, answers the
//! CONNECT with 200, and copies the tunnel's bytes both ways. Istio's HBONE inbound
//! (`connect_terminate` on 15008) works this way, routing to the `main_internal`
//! listener.
//!
//! The original destination and source the stream's filters shared with the upstream
//! (`envoy.filters.listener.original_dst.local_ip` / `remote_ip`, from
//! `set_filter_state` or `connect_authority`) go to an internal listener upstream, so
//! its `original_dst` restores the tunnel's destination; without them, the request's
//! authority and the downstream address, which is what Istio's filters share on every
//! CONNECT listener it writes.

use std::net::SocketAddr;
use std::sync::Arc;

use hyper::Response;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;

use super::body::{LogSlot, ResponseBody};
pub use super::route::ConnectUpgrade;
use super::router::{LocalReply, Upstream};
use shunt_core::access_log::{Entry, ResponseFlag};
use shunt_upstream::LbContext;
use shunt_upstream::internal::SharedFilterState;

/// Terminates a CONNECT for `authority` on `upstream`; the tunnel runs in a task of
/// its own that holds the request's log until it closes.
pub async fn terminate(
    upstream: &Upstream<'_>,
    authority: &str,
    remote: SocketAddr,
    downstream: OnUpgrade,
    log: Arc<LogSlot>,
    stats: &super::config::HttpStats,
    entry: &mut Entry,
) -> Result<Response<ResponseBody>, LocalReply> {
    let cluster = upstream.cluster.clone();
    let Some(host) = cluster.choose_host(
        &LbContext {
            hash: upstream.hash,
            tried: &[],
        },
        Some(upstream.destination),
    ) else {
        return Err(LocalReply::new(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "no healthy upstream",
            Some(ResponseFlag::NoHealthyUpstream),
        ));
    };
    entry.upstream_host = Some(host.address);
    if crate::tcp::loops_back(host.address, upstream.downstream_local, upstream.own_ports) {
        tracing::warn!(upstream = %host.address, "refusing a CONNECT whose destination is the proxy itself");
        return Err(LocalReply::new(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "no healthy upstream",
            Some(ResponseFlag::NoHealthyUpstream),
        ));
    }
    let Some(slot) = cluster.circuit_breaker.try_acquire_owned() else {
        return Err(LocalReply::new(
            hyper::StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error or disconnect/reset before headers. reset reason: overflow",
            Some(ResponseFlag::UpstreamOverflow),
        ));
    };
    // What the stream's filters shared (Istio's `set_filter_state` or
    // `connect_authority`), else the authority and the downstream, which is what those
    // filters share on every CONNECT listener istiod writes.
    let (local, shared_remote) = log.shared_original_dst();
    let shared = SharedFilterState {
        local: local.or_else(|| authority.parse().ok()),
        remote: shared_remote.or(Some(remote)),
        objects: Default::default(),
    };
    let connected = shunt_upstream::transport_socket::connect_sharing(
        &cluster,
        &host,
        upstream.secrets,
        shared,
    )
    .await;
    let (stream, guard) = match connected {
        Ok(connected) => connected,
        Err(err) => {
            tracing::debug!(cluster = %cluster.name, upstream = %host.address, %err, "CONNECT: upstream connection failed");
            return Err(LocalReply::new(
                hyper::StatusCode::SERVICE_UNAVAILABLE,
                "upstream connect error or disconnect/reset before headers. reset reason: connection failure",
                Some(ResponseFlag::UpstreamConnectionFailure),
            ));
        }
    };
    entry.upstream_local_address = stream.local_addr().ok();
    cluster.stats.upstream_rq_total.inc();
    cluster.stats.charge(200);
    let tunnel_log = log.clone();
    // Counted as Envoy counts it: once the 200 is the answer.
    let upgraded = stats.upgrade();
    tokio::spawn(async move {
        let _held = (slot, guard, tunnel_log.clone(), upgraded);
        let Ok(down) = downstream.await else {
            tracing::debug!("a CONNECT did not complete");
            return;
        };
        let mut down = TokioIo::new(down);
        let mut up = stream;
        match tokio::io::copy_bidirectional(&mut down, &mut up).await {
            Ok((received, sent)) => tunnel_log.add(received, sent),
            Err(err) => tracing::debug!(%err, "CONNECT tunnel ended with an error"),
        }
    });
    Ok(Response::new(ResponseBody::full(bytes::Bytes::new())))
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
    use hyper::HeaderMap;
    use serde_json::json;

    use super::super::route::Action;
    use super::super::route_config::compile;
    use crate::common::matcher::RequestView;
    use shunt_config::{Diagnostics, JsonPath};

    fn routes(routes: serde_json::Value) -> (Option<super::super::RouteConfig>, Diagnostics) {
        let config: RouteConfiguration = shunt_config::message_from_json(json!({
            "name": "default",
            "virtual_hosts": [{"name": "default", "domains": ["*"], "routes": routes}]
        }))
        .unwrap();
        let mut problems = Diagnostics::default();
        (
            compile(&config, &JsonPath::new("rc"), &mut problems),
            problems,
        )
    }

    fn routed<'a>(config: &'a super::super::RouteConfig, method: &str) -> Option<&'a str> {
        let headers = HeaderMap::new();
        let view = RequestView {
            method,
            authority: "10.0.0.5:80",
            path: "/",
            scheme: "https",
            headers: &headers,
        };
        config.route(&view).map(|(_, r)| r.name.as_str())
    }

    #[test]
    fn only_connect_matchers_match_connect_and_they_match_nothing_else() {
        let (config, problems) = routes(json!([
            {"name": "tunnel", "match": {"connect_matcher": {}},
             "route": {"cluster": "main_internal",
                       "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}]}},
            {"name": "all", "match": {"prefix": "/"}, "route": {"cluster": "web"}}
        ]));
        let config = config.unwrap_or_else(|| panic!("{problems:?}"));
        assert!(config.has_connect_routes());
        assert_eq!(routed(&config, "CONNECT"), Some("tunnel"));
        assert_eq!(routed(&config, "GET"), Some("all"));
        let route = config.virtual_hosts[0]
            .routes
            .iter()
            .find(|r| r.name == "tunnel")
            .unwrap();
        let Action::Route(action) = &route.action else {
            panic!("a route action");
        };
        assert_eq!(
            action.connect,
            Some(super::ConnectUpgrade { terminate: true })
        );

        // Without a connect_matcher, a CONNECT matches no route (404 NR).
        let (config, _) = routes(json!([{"match": {"prefix": "/"}, "route": {"cluster": "web"}}]));
        let config = config.unwrap();
        assert!(!config.has_connect_routes());
        assert_eq!(routed(&config, "CONNECT"), None);
    }

    #[test]
    fn forwarding_connect_upstream_is_refused_at_its_path() {
        let (config, problems) = routes(json!([
            {"match": {"connect_matcher": {}},
             "route": {"cluster": "next", "upgrade_configs": [{"upgrade_type": "CONNECT"}]}}
        ]));
        assert!(config.is_none());
        assert!(
            problems.errors.iter().any(|e| e
                .path
                .ends_with("routes[0].route.upgrade_configs[0].connect_config")),
            "{problems:?}"
        );
    }
}
