//! Envoy's network external authorization filter (`envoy.filters.network.ext_authz`):
//! when the downstream's first bytes arrive, one `Authorization/Check` (gRPC) with the
//! connection's peers, principals and SNI; an allowing answer lets the connection go on,
//! a denying one closes it (flag `UAEX`), and so does a failed call unless
//! `failure_mode_allow`. Stats under `ext_authz.<stat_prefix>.`, as Envoy's.

use std::sync::Arc;
use std::time::SystemTime;

use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress, address, socket_address};
use envoy_types::pb::envoy::extensions::filters::network::ext_authz::v3::ExtAuthz;
use envoy_types::pb::envoy::service::auth::v3::{
    AttributeContext, CheckRequest, attribute_context,
};
use envoy_types::pb::google::protobuf::{Any, Timestamp};

use crate::common::ext_authz::check::Verdict;
use crate::common::ext_authz::{Service, grpc, grpc_service};
use crate::network::factory::{CompileCtx, Factory};
use crate::network::{
    NetworkFilter, NetworkFilterConfig, NetworkFlow, NetworkStatus, NewConnection,
};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::access_log::ResponseFlag;
use shunt_core::stats::{Counter, Gauge};
use shunt_core::stream_info::Connection;
use shunt_upstream::Cluster;

pub const TYPE: &str = "envoy.extensions.filters.network.ext_authz.v3.ExtAuthz";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct Stats {
    total: Counter,
    ok: Counter,
    denied: Counter,
    error: Counter,
    failure_mode_allowed: Counter,
    cx_closed: Counter,
    active: Gauge,
}

#[derive(Debug)]
struct Config {
    cluster_name: String,
    cluster: Option<Arc<Cluster>>,
    authority: String,
    timeout: std::time::Duration,
    failure_mode_allow: bool,
    stats: Arc<Stats>,
}

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let config: ExtAuthz = decode(any, path, problems)?;
    if config.filter_enabled_metadata.is_some() {
        problems.error(path.field("filter_enabled_metadata"), "is not implemented");
        return None;
    }
    if config.include_peer_certificate {
        problems.warning(
            path.field("include_peer_certificate"),
            "is not implemented: checks carry the peer's principal, not its certificate",
        );
    }
    let Some(g) = &config.grpc_service else {
        problems.error(path.field("grpc_service"), "is required");
        return None;
    };
    let Service::Grpc {
        cluster,
        authority,
        timeout,
    } = grpc_service(g, &path.field("grpc_service"), problems)?
    else {
        problems.error(
            path.field("grpc_service"),
            "must name a cluster (envoy_grpc)",
        );
        return None;
    };
    let known = ctx.clusters.get(cluster.as_str()).cloned();
    if known.is_none() {
        problems.warning(
            path,
            format!("cluster {cluster:?} of the authorization service is not known: checks fail until the listener is updated"),
        );
    }
    let stat = |name: &str| format!("ext_authz.{}.{name}", config.stat_prefix);
    let stats = Stats {
        total: ctx.stats.counter(&stat("total")),
        ok: ctx.stats.counter(&stat("ok")),
        denied: ctx.stats.counter(&stat("denied")),
        error: ctx.stats.counter(&stat("error")),
        failure_mode_allowed: ctx.stats.counter(&stat("failure_mode_allowed")),
        cx_closed: ctx.stats.counter(&stat("cx_closed")),
        active: ctx.stats.gauge(&stat("active")),
    };
    ctx.stats.counter(&stat("disabled"));
    Some(Arc::new(Shared(Arc::new(Config {
        cluster_name: cluster,
        cluster: known,
        authority,
        timeout,
        failure_mode_allow: config.failure_mode_allow,
        stats: Arc::new(stats),
    }))))
}

#[derive(Debug)]
struct Shared(Arc<Config>);

impl NetworkFilterConfig for Shared {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(NetworkExtAuthz(self.0.clone()))
    }
}

struct NetworkExtAuthz(Arc<Config>);

fn socket(addr: std::net::SocketAddr) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: addr.ip().to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                addr.port(),
            ))),
            ..Default::default()
        })),
    }
}

/// Envoy's `createTcpCheck`: the peers and their principals, the SNI; no request.
fn tcp_check(connection: &Connection) -> CheckRequest {
    let tls = connection.tls.as_deref();
    let principal = connection.peer_principals().next().unwrap_or_default();
    let local_principal = tls
        .and_then(|t| t.local_uri_sans.first())
        .map(String::as_str)
        .unwrap_or_default();
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    CheckRequest {
        attributes: Some(AttributeContext {
            source: Some(attribute_context::Peer {
                address: Some(socket(connection.remote)),
                principal: principal.to_owned(),
                ..Default::default()
            }),
            destination: Some(attribute_context::Peer {
                address: Some(socket(connection.local)),
                principal: local_principal.to_owned(),
                ..Default::default()
            }),
            request: Some(attribute_context::Request {
                time: Some(Timestamp {
                    seconds: i64::try_from(now.as_secs()).unwrap_or(i64::MAX),
                    nanos: i32::try_from(now.subsec_nanos()).unwrap_or(0),
                }),
                http: None,
            }),
            tls_session: connection
                .requested_server_name
                .as_ref()
                .map(|sni| attribute_context::TlsSession { sni: sni.clone() }),
            ..Default::default()
        }),
    }
}

impl NetworkFilter for NetworkExtAuthz {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        let config = self.0.clone();
        NetworkFlow::Pending(Box::pin(async move {
            // Envoy checks on the first bytes, when the connection has said something.
            while ctx.buffered().is_empty() {
                match ctx.read_more().await {
                    Ok(0) | Err(_) => return NetworkStatus::Close,
                    Ok(_) => {}
                }
            }
            let stats = &config.stats;
            stats.total.inc();
            stats.active.inc();
            let verdict = match &config.cluster {
                None => Verdict::Error(format!("cluster {:?} is not known", config.cluster_name)),
                Some(cluster) => {
                    let secrets = shunt_tls::Secrets::default();
                    let request = tcp_check(ctx.connection);
                    grpc::check(
                        cluster,
                        &secrets,
                        &config.authority,
                        config.timeout,
                        &request,
                    )
                    .await
                }
            };
            stats.active.dec();
            let close = match &verdict {
                Verdict::Allow(_) => {
                    stats.ok.inc();
                    false
                }
                Verdict::Deny(_) => {
                    stats.denied.inc();
                    true
                }
                Verdict::Error(err) => {
                    tracing::debug!(%err, "network ext_authz check failed");
                    stats.error.inc();
                    if config.failure_mode_allow {
                        stats.failure_mode_allowed.inc();
                    }
                    !config.failure_mode_allow
                }
            };
            if close {
                stats.cx_closed.inc();
                // Envoy flags a connection it closes, denied or for a failed check.
                ctx.connection
                    .response_flags
                    .push(ResponseFlag::UnauthorizedExternalService);
                NetworkStatus::Close
            } else {
                NetworkStatus::Continue
            }
        }))
    }
}
