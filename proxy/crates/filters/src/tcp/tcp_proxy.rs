//! Envoy's `tcp_proxy` network filter as a bootstrap configures it: pick the cluster
//! (`cluster`, or `weighted_clusters` at random by weight), take a slot from its circuit
//! breaker, let its load balancer choose a host, connect (up to `max_connect_attempts`
//! times, each to a host not tried yet), then copy bytes until both sides close or
//! nothing moves for `idle_timeout`. The connection's access log line goes to the
//! filter's own `access_log` sinks.
//!
//! Each failure closes the downstream and raises Envoy's flag: `NC` no such cluster,
//! `UO` circuit breaker overflow, `UH` no host (BlackHoleCluster), `UF` every connect
//! attempt failed (the downstream gets a reset, as the passthrough gives one).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use super::copy;
use shunt_core::access_log::{Entry, ResponseFlag, Sink};
use shunt_core::peer::filter_state::{self, Side};
use shunt_core::set_filter_state::{
    ORIGINAL_DST_LOCAL, ORIGINAL_DST_REMOTE, TCP_PROXY_CLUSTER, shared_address,
};
use shunt_core::stats::{Counter, Store};
use shunt_core::stream_info::{Connection, LifeSpan, UpstreamInfo, UpstreamSlot};
use shunt_tls::TransportStream;
use shunt_upstream::internal::SharedFilterState;
use shunt_upstream::load_balancer::hash_key;
use shunt_upstream::transport_socket;
use shunt_upstream::{Clusters, LbContext};

/// Envoy's default `idle_timeout`: one hour.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

#[derive(Debug)]
pub struct TcpProxy {
    pub stat_prefix: String,
    pub clusters: ClusterSpecifier,
    /// `None` when configured as 0s: no idle timeout.
    pub idle_timeout: Option<Duration>,
    pub max_connect_attempts: u32,
    pub access_log: Vec<Sink>,
    pub stats: TcpProxyStats,
    /// `tunneling_config`: the bytes go through an HTTP CONNECT tunnel.
    pub tunneling: Option<super::tunnel::Tunneling>,
    /// The node an upstream metadata exchange sends (the listener sets it).
    pub node: Arc<shunt_core::peer::LocalNode>,
}

/// The filter's `tcp.<stat_prefix>.*` stats.
#[derive(Debug, Clone, Default)]
pub struct TcpProxyStats {
    pub downstream_cx_total: Counter,
    /// Connections whose cluster does not exist (flag NC).
    pub downstream_cx_no_route: Counter,
}

impl TcpProxyStats {
    pub fn new(store: &Store, stat_prefix: &str) -> Self {
        TcpProxyStats {
            downstream_cx_total: store.counter(&format!("tcp.{stat_prefix}.downstream_cx_total")),
            downstream_cx_no_route: store
                .counter(&format!("tcp.{stat_prefix}.downstream_cx_no_route")),
        }
    }
}

#[derive(Debug)]
pub enum ClusterSpecifier {
    Cluster(Arc<str>),
    /// Names and weights; at least one weight is positive.
    Weighted(Vec<(Arc<str>, u32)>),
}

impl ClusterSpecifier {
    /// The cluster for one connection.
    pub fn pick(&self) -> &Arc<str> {
        match self {
            ClusterSpecifier::Cluster(name) => name,
            ClusterSpecifier::Weighted(clusters) => {
                let total: u64 = clusters.iter().map(|(_, w)| u64::from(*w)).sum();
                let mut point = fastrand::u64(..total.max(1));
                for (name, weight) in clusters {
                    if point < u64::from(*weight) {
                        return name;
                    }
                    point -= u64::from(*weight);
                }
                &clusters[0].0
            }
        }
    }
}

/// What the filter needs from its surroundings.
pub struct Upstreams<'a> {
    pub clusters: &'a Clusters,
    /// The ports the proxy listens on: an ORIGINAL_DST host on one of them is a loop.
    pub own_ports: &'a [u16],
    /// The secrets upstream TLS contexts name (the current snapshot's).
    pub secrets: &'a shunt_tls::Secrets,
}

/// Sets `flag` in the access log entry and in the connection's [`UpstreamSlot`], if a
/// network filter (Istio's TCP stats) asked for one.
fn report(entry: &mut Entry, connection: &Option<Arc<Connection>>, flag: ResponseFlag) {
    entry.flag(flag);
    if let Some(slot) = connection
        .as_deref()
        .and_then(|c| c.filter_state.get_as::<UpstreamSlot>(UpstreamSlot::NAME))
    {
        slot.flag(flag);
    }
}

/// An upstream connection made: the stream, what keeps the host's connection (or the
/// pooled tunnel's stream) counted while it lives, and what the access log and the
/// upstream's stream info say about the host.
struct Connected {
    stream: TransportStream,
    active: Box<dyn Send>,
    host_metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
    tls: Option<shunt_core::stream_info::Tls>,
}

impl TcpProxy {
    /// Proxies one connection whose destination (original or local) is `destination`,
    /// filling `entry`; the caller writes the access log. Envoy's `TcpProxy::Filter`
    /// steps: the cluster, a circuit breaker slot, the upstream connection (and its
    /// metadata exchange and tunnel), then the bytes both ways.
    pub async fn serve(
        &self,
        upstreams: &Upstreams<'_>,
        downstream: super::Downstream,
        connection: &Connection,
        destination: SocketAddr,
        entry: &mut Entry,
    ) {
        self.stats.downstream_cx_total.inc();
        // A network filter may name the cluster (`set_filter_state` of
        // `envoy.tcp_proxy.cluster`), as Envoy's per-connection cluster.
        let name = match connection.filter_state.get_string(TCP_PROXY_CLUSTER) {
            Some(name) => &Arc::from(name),
            None => self.clusters.pick(),
        };
        // Flags set before the downstream closes are told to its network filters too.
        let reported = downstream.io().connection().cloned();
        entry.upstream_cluster = Some(name.clone());
        let Some(cluster) = upstreams.clusters.get(name) else {
            tracing::debug!(cluster = %name, "tcp_proxy names an unknown cluster");
            self.stats.downstream_cx_no_route.inc();
            report(entry, &reported, ResponseFlag::NoClusterFound);
            return;
        };
        let Some(_slot) = cluster.circuit_breaker.try_acquire() else {
            tracing::debug!(cluster = %name, max_connections = cluster.circuit_breaker.max_connections(), "circuit breaker open");
            report(entry, &reported, ResponseFlag::UpstreamOverflow);
            return;
        };
        let tunnel_downstream = super::tunnel::Downstream {
            local: entry.downstream_local_address,
            remote: entry.downstream_remote_address,
            filter_state: connection.filter_state.clone(),
        };
        let connecting = self.connect(
            upstreams,
            cluster,
            connection,
            destination,
            &tunnel_downstream,
            entry,
        );
        let connected = match connecting.await {
            Ok(connected) => connected,
            Err(flag) => {
                report(entry, &reported, flag);
                // Every attempt failed: the downstream gets a reset, as the passthrough
                // gives one.
                if flag == ResponseFlag::UpstreamConnectionFailure {
                    downstream.abort();
                }
                return;
            }
        };
        let _active = connected.active;
        entry.upstream_local_address = connected.stream.local_addr().ok();
        let upstream = match self
            .upstream_info(
                cluster,
                connected.host_metadata,
                connected.tls,
                connected.stream,
                reported.clone(),
            )
            .await
        {
            Ok(upstream) => upstream,
            Err(err) => {
                tracing::info!(stat_prefix = %self.stat_prefix, downstream = %entry.downstream_remote_address, cluster = %name, %err, "upstream metadata exchange failed");
                report(entry, &reported, ResponseFlag::UpstreamConnectionFailure);
                downstream.abort();
                return;
            }
        };
        let upstream = match &self.tunneling {
            Some(tunneling) if self.pooled_tunnel(cluster).is_none() => {
                match tunneling.open(upstream, false, &tunnel_downstream).await {
                    Ok(tunnel) => tunnel,
                    Err(err) => {
                        tracing::info!(stat_prefix = %self.stat_prefix, downstream = %entry.downstream_remote_address, cluster = %name, %err, "tunnel not established");
                        entry.upstream_transport_failure_reason = Some(err.to_string());
                        report(entry, &reported, ResponseFlag::UpstreamConnectionFailure);
                        downstream.abort();
                        return;
                    }
                }
            }
            _ => upstream,
        };
        self.copy(downstream, upstream, cluster, entry).await;
    }

    /// The tunnel settings when the tunnel is a stream of the cluster's pooled HTTP/2
    /// connection to the host (an HTTP/1.1 tunnel is a connection of its own).
    fn pooled_tunnel(
        &self,
        cluster: &shunt_upstream::Cluster,
    ) -> Option<&super::tunnel::Tunneling> {
        self.tunneling
            .as_ref()
            .filter(|_| cluster.http_protocol == shunt_upstream::cluster::UpstreamProtocol::Http2)
    }

    /// Envoy's connect attempts: up to `max_connect_attempts`, each to a host the load
    /// balancer chooses among those not tried yet. Fails with the flag to raise: no host
    /// (`UH`, also for a host that is the proxy itself) or every attempt failed (`UF`).
    async fn connect(
        &self,
        upstreams: &Upstreams<'_>,
        cluster: &Arc<shunt_upstream::Cluster>,
        connection: &Connection,
        destination: SocketAddr,
        tunnel_downstream: &super::tunnel::Downstream,
        entry: &mut Entry,
    ) -> Result<Connected, ResponseFlag> {
        // The original destination and source shared with an internal listener upstream.
        let shared = SharedFilterState {
            local: shared_address(&connection.filter_state, ORIGINAL_DST_LOCAL),
            remote: shared_address(&connection.filter_state, ORIGINAL_DST_REMOTE),
            objects: connection.filter_state.shared_with_upstream(),
        };
        // Without a hash policy, hash the downstream IP (Envoy's `source_ip` policy), so a
        // client sticks to one host under RING_HASH and MAGLEV.
        let hash = Some(hash_key(
            entry.downstream_remote_address.ip().to_string().as_bytes(),
        ));
        let pooled_tunnel = self.pooled_tunnel(cluster);
        let mut tried = Vec::new();
        for _ in 0..self.max_connect_attempts.max(1) {
            let ctx = LbContext {
                hash,
                tried: &tried,
            };
            let Some(host) = cluster.choose_host(&ctx, Some(destination)) else {
                return Err(ResponseFlag::NoHealthyUpstream);
            };
            if super::loops_back(
                host.address,
                entry.downstream_local_address,
                upstreams.own_ports,
            ) {
                tracing::warn!(downstream = %entry.downstream_remote_address, upstream = %host.address, "refusing a connection whose destination is the proxy itself");
                return Err(ResponseFlag::NoHealthyUpstream);
            }
            entry.upstream_host = Some(host.address);
            if let Some(tunneling) = pooled_tunnel {
                let opened = tunneling
                    .open_pooled(cluster, &host, upstreams.secrets, tunnel_downstream)
                    .await;
                match opened {
                    Ok((tunnel, slot)) => {
                        return Ok(Connected {
                            stream: tunnel,
                            active: Box::new(slot),
                            host_metadata: host.metadata.clone(),
                            tls: None,
                        });
                    }
                    Err(err) => {
                        tracing::info!(stat_prefix = %self.stat_prefix, downstream = %entry.downstream_remote_address, upstream = %host.address, cluster = %cluster.name, %err, "tunnel not established");
                        entry.upstream_transport_failure_reason = Some(err.to_string());
                        tried.push(host.address);
                        continue;
                    }
                }
            }
            match transport_socket::connect_sharing(
                cluster,
                &host,
                upstreams.secrets,
                shared.clone(),
            )
            .await
            {
                Ok((stream, guard)) => {
                    let tls = transport_socket::session(cluster, &host, &stream, upstreams.secrets);
                    return Ok(Connected {
                        stream,
                        active: Box::new(guard),
                        host_metadata: host.metadata.clone(),
                        tls,
                    });
                }
                Err(err) => {
                    tracing::info!(stat_prefix = %self.stat_prefix, downstream = %entry.downstream_remote_address, upstream = %host.address, cluster = %cluster.name, %err, "upstream connection failed");
                    if let transport_socket::ConnectError::Tls(err) = &err {
                        entry.upstream_transport_failure_reason = Some(err.to_string());
                    }
                    tried.push(host.address);
                }
            }
        }
        Err(ResponseFlag::UpstreamConnectionFailure)
    }

    /// The bytes both ways until both sides close or nothing moves for `idle_timeout`;
    /// their counts and how the connection ended go into `entry` and the cluster's stats.
    async fn copy(
        &self,
        downstream: super::Downstream,
        upstream: TransportStream,
        cluster: &shunt_upstream::Cluster,
        entry: &mut Entry,
    ) {
        downstream.set_nodelay();
        let outcome = match (downstream, upstream) {
            // Plain TCP both ways keeps the socket fast path.
            (
                super::Downstream::Transport(TransportStream::Raw(downstream)),
                TransportStream::Raw(upstream),
            ) => copy::copy_with_idle_timeout(downstream, upstream, self.idle_timeout).await,
            (super::Downstream::Transport(downstream), upstream) => {
                super::copy_io::copy(downstream, upstream, self.idle_timeout).await
            }
            (super::Downstream::Filtered(downstream), upstream) => {
                super::copy_io::copy(downstream, upstream, self.idle_timeout).await
            }
        };
        entry.bytes_received = outcome.bytes_received;
        entry.bytes_sent = outcome.bytes_sent;
        cluster
            .stats
            .upstream_cx_tx_bytes_total
            .add(outcome.upstream_bytes_sent);
        cluster
            .stats
            .upstream_cx_rx_bytes_total
            .add(outcome.upstream_bytes_received);
        match outcome.end {
            copy::End::Failed { side, error } => {
                tracing::debug!(downstream = %entry.downstream_remote_address, ?side, %error, "connection ended abnormally");
                entry.flag(match side {
                    copy::Side::Upstream => ResponseFlag::UpstreamRemoteReset,
                    copy::Side::Downstream => ResponseFlag::DownstreamRemoteReset,
                });
            }
            copy::End::IdleTimeout => {
                tracing::debug!(downstream = %entry.downstream_remote_address, "tcp_proxy idle timeout");
            }
            copy::End::HandedOver => {
                tracing::debug!(downstream = %entry.downstream_remote_address, "flow handed to the next process");
            }
            copy::End::Closed => {}
        }
    }
}

impl TcpProxy {
    /// Runs the cluster's upstream metadata exchange, if it has one, and hands what the
    /// upstream side learned to the downstream's network filters when one asked
    /// ([`UpstreamSlot`]).
    async fn upstream_info(
        &self,
        cluster: &Arc<shunt_upstream::Cluster>,
        host_metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
        tls: Option<shunt_core::stream_info::Tls>,
        upstream: TransportStream,
        connection: Option<Arc<shunt_core::stream_info::Connection>>,
    ) -> std::io::Result<TransportStream> {
        let mut info = UpstreamInfo {
            cluster_name: Some(cluster.name.clone()),
            cluster_metadata: cluster.metadata.clone(),
            host_metadata,
            tls,
            ..UpstreamInfo::default()
        };
        let upstream = match &cluster.metadata_exchange {
            Some(protocol) => {
                let exchanged =
                    super::metadata_exchange::upstream(upstream, protocol, &self.node).await?;
                match exchanged.peer {
                    Some(peer) => {
                        let workload = peer.metadata.unwrap_or_default().workload();
                        filter_state::set_peer(
                            &mut info.filter_state,
                            Side::Upstream,
                            workload,
                            peer.id.as_deref().unwrap_or_default(),
                            LifeSpan::Connection,
                        );
                    }
                    None => filter_state::set_unknown(
                        &mut info.filter_state,
                        Side::Upstream,
                        LifeSpan::Connection,
                    ),
                }
                exchanged.stream
            }
            None => upstream,
        };
        if let Some(slot) = connection
            .as_deref()
            .and_then(|c| c.filter_state.get_as::<UpstreamSlot>(UpstreamSlot::NAME))
        {
            slot.fill(info);
        }
        Ok(upstream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_clusters_split_by_weight() {
        let spec =
            ClusterSpecifier::Weighted(vec![("a".into(), 1), ("b".into(), 3), ("never".into(), 0)]);
        let mut a = 0;
        for _ in 0..4000 {
            match &**spec.pick() {
                "a" => a += 1,
                "b" => {}
                other => panic!("picked {other}"),
            }
        }
        // Expected 1000; 800 and 1200 are over 7 standard deviations away.
        assert!((800..1200).contains(&a), "{a}");
    }
}
