//! TCP proxying, Envoy's `tcp_proxy` network filter: choose the passthrough cluster and
//! upstream for a captured connection, connect to it, and hand both sockets to
//! [`copy`] (or through an HTTP CONNECT tunnel, [`tunnel`]). Every connection ends in
//! exactly one access log line. A filter chain's configured `tcp_proxy` is
//! [`tcp_proxy::TcpProxy`], compiled by [`compile`].

pub mod compile;
pub mod copy;
pub mod copy_io;
pub mod handover;
pub mod metadata_exchange;
pub mod tcp_proxy;
pub mod tunnel;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::net::TcpStream;

use shunt_core::access_log::{Direction, Entry, ResponseFlag};

/// Envoy's inbound passthrough binds its upstream connections to this source, which
/// istio-iptables' rule 15 (`-o lo -s 127.0.0.6 -j RETURN`) leaves uncaptured.
pub const INBOUND_PASSTHROUGH_SOURCE_V4: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 6);
/// The IPv6 counterpart, `::6`.
pub const INBOUND_PASSTHROUGH_SOURCE_V6: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);

/// A downstream byte stream `tcp_proxy` can serve: a transport stream, or one wrapped
/// by network filters (`network::Filtered`).
pub trait DownstreamIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {
    /// The TCP socket underneath; `None` in process.
    fn tcp(&self) -> Option<&TcpStream>;
    /// Makes the coming close send RST instead of FIN.
    fn abort(&self);
    /// The connection's facts, when network filters run on it (they may ask for the
    /// upstream's, [`shunt_core::stream_info::UpstreamSlot`]).
    fn connection(&self) -> Option<&std::sync::Arc<shunt_core::stream_info::Connection>> {
        None
    }
}

impl DownstreamIo for shunt_tls::TransportStream {
    fn tcp(&self) -> Option<&TcpStream> {
        shunt_tls::TransportStream::tcp(self)
    }

    fn abort(&self) {
        shunt_tls::TransportStream::abort(self);
    }
}

impl DownstreamIo for Box<dyn DownstreamIo> {
    fn tcp(&self) -> Option<&TcpStream> {
        (**self).tcp()
    }

    fn abort(&self) {
        (**self).abort();
    }

    fn connection(&self) -> Option<&std::sync::Arc<shunt_core::stream_info::Connection>> {
        (**self).connection()
    }
}

/// What `tcp_proxy` serves: a transport stream (raw TCP keeps the socket fast path),
/// or a stream network filters read first.
pub enum Downstream {
    Transport(shunt_tls::TransportStream),
    Filtered(Box<dyn DownstreamIo>),
}

impl Downstream {
    fn io(&self) -> &dyn DownstreamIo {
        match self {
            Downstream::Transport(stream) => stream,
            Downstream::Filtered(stream) => stream,
        }
    }

    /// TCP_NODELAY on the socket underneath, if there is one.
    pub fn set_nodelay(&self) {
        if let Some(tcp) = self.io().tcp()
            && let Err(err) = tcp.set_nodelay(true)
        {
            tracing::debug!(%err, "TCP_NODELAY on the downstream failed");
        }
    }

    /// Makes the coming close send RST instead of FIN.
    pub fn abort(&self) {
        self.io().abort();
    }
}

/// Settings shared by every connection, fixed at start-up.
#[derive(Clone, Debug)]
pub struct Settings {
    pub connect_timeout: Duration,
    /// The proxy's own listener ports: a destination on one of them loops back into us.
    pub own_ports: Vec<u16>,
}

/// Where a connection is passed through to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub cluster: &'static str,
    pub host: SocketAddr,
    /// The source address to bind before connecting, if any.
    pub bind: Option<IpAddr>,
}

/// Envoy's passthrough clusters: outbound goes to the original destination
/// (`PassthroughCluster`, type ORIGINAL_DST); inbound goes to the app on loopback at the
/// original port, from 127.0.0.6 / ::6 (`InboundPassthroughClusterIpv4` / `Ipv6`).
pub fn route(direction: Direction, original_dst: SocketAddr) -> Route {
    match direction {
        Direction::Outbound | Direction::Unspecified => Route {
            cluster: "PassthroughCluster",
            host: original_dst,
            bind: None,
        },
        Direction::Inbound => match original_dst {
            SocketAddr::V4(dst) => Route {
                cluster: "InboundPassthroughClusterIpv4",
                host: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), dst.port()),
                bind: Some(INBOUND_PASSTHROUGH_SOURCE_V4.into()),
            },
            SocketAddr::V6(dst) => Route {
                cluster: "InboundPassthroughClusterIpv6",
                host: SocketAddr::new(Ipv6Addr::LOCALHOST.into(), dst.port()),
                bind: Some(INBOUND_PASSTHROUGH_SOURCE_V6.into()),
            },
        },
    }
}

/// Would connecting to `host` land back in one of our own listeners?
///
/// That is a connection made straight to a proxy port (no capture, so the original
/// destination is the listener itself, i.e. the accepted socket's local address) or to
/// a proxy port on loopback. Passing it through would connect to ourselves, forever.
pub fn loops_back(host: SocketAddr, local: SocketAddr, own_ports: &[u16]) -> bool {
    let ip = host.ip().to_canonical();
    let ours = ip.is_loopback() || ip.is_unspecified() || ip == local.ip().to_canonical();
    (own_ports.contains(&host.port()) && ours)
        || (host == local && own_ports.contains(&local.port()))
}

/// Proxies one accepted connection to its upstream and writes its access log line.
pub async fn proxy(
    downstream: TcpStream,
    mut entry: Entry,
    original_dst: Option<SocketAddr>,
    settings: &Settings,
) {
    serve(downstream, &mut entry, original_dst, settings).await;
    entry.emit();
}

async fn serve(
    downstream: TcpStream,
    entry: &mut Entry,
    original_dst: Option<SocketAddr>,
    settings: &Settings,
) {
    let Some(original_dst) = original_dst else {
        entry.flag(ResponseFlag::NoRouteFound);
        return;
    };
    entry.original_dst = Some(original_dst);
    let local = entry.downstream_local_address;
    let route = route(entry.direction, original_dst);
    if loops_back(route.host, local, &settings.own_ports) {
        // Istio's listeners send these to BlackHoleCluster, which has no endpoints.
        tracing::warn!(
            downstream = %entry.downstream_remote_address,
            %original_dst,
            upstream = %route.host,
            "refusing a connection whose destination is the proxy itself"
        );
        entry.upstream_cluster = Some("BlackHoleCluster".into());
        entry.flag(ResponseFlag::NoHealthyUpstream);
        return;
    }
    entry.upstream_cluster = Some(route.cluster.into());
    entry.upstream_host = Some(route.host);

    let upstream = match connect(route, settings.connect_timeout).await {
        Ok(upstream) => upstream,
        Err(err) => {
            tracing::info!(
                downstream = %entry.downstream_remote_address,
                upstream = %route.host,
                cluster = route.cluster,
                %err,
                "upstream connection failed"
            );
            entry.flag(ResponseFlag::UpstreamConnectionFailure);
            copy::abort(&downstream);
            return;
        }
    };
    entry.upstream_local_address = upstream.local_addr().ok();
    if let Err(err) = downstream.set_nodelay(true) {
        tracing::debug!(%err, "TCP_NODELAY on the downstream failed");
    }

    let outcome = copy::copy_bidirectional(downstream, upstream).await;
    entry.bytes_received = outcome.bytes_received;
    entry.bytes_sent = outcome.bytes_sent;
    if let copy::End::Failed { side, error } = outcome.end {
        tracing::debug!(
            downstream = %entry.downstream_remote_address,
            upstream = %route.host,
            ?side,
            %error,
            "connection ended abnormally"
        );
        entry.flag(match side {
            copy::Side::Upstream => ResponseFlag::UpstreamRemoteReset,
            copy::Side::Downstream => ResponseFlag::DownstreamRemoteReset,
        });
    }
}

/// Connects to `route.host`, from `route.bind` if set, within `timeout`.
async fn connect(route: Route, timeout: Duration) -> io::Result<TcpStream> {
    let source = route.bind.map(|ip| SocketAddr::new(ip, 0));
    shunt_upstream::connect::connect(route.host, source, timeout).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    const OWN: &[u16] = &[15001, 15006];

    #[test]
    fn outbound_passes_through_to_the_original_destination() {
        let r = route(Direction::Outbound, addr("10.96.0.10:80"));
        assert_eq!(r.cluster, "PassthroughCluster");
        assert_eq!(r.host, addr("10.96.0.10:80"));
        assert_eq!(r.bind, None);
    }

    #[test]
    fn inbound_goes_to_the_app_on_loopback_from_127_0_0_6() {
        let r = route(Direction::Inbound, addr("10.0.0.5:8080"));
        assert_eq!(r.cluster, "InboundPassthroughClusterIpv4");
        assert_eq!(r.host, addr("127.0.0.1:8080"));
        assert_eq!(r.bind, Some("127.0.0.6".parse().unwrap()));

        let r = route(Direction::Inbound, addr("[fd00::5]:8080"));
        assert_eq!(r.cluster, "InboundPassthroughClusterIpv6");
        assert_eq!(r.host, addr("[::1]:8080"));
        assert_eq!(r.bind, Some("::6".parse().unwrap()));
    }

    #[test]
    fn a_destination_that_is_the_listener_itself_loops() {
        let local = addr("10.0.0.5:15001");
        assert!(loops_back(local, local, OWN));
        assert!(loops_back(addr("10.0.0.5:15006"), local, OWN));
    }

    #[test]
    fn our_ports_on_loopback_loop() {
        let local = addr("10.0.0.5:15001");
        assert!(loops_back(addr("127.0.0.1:15001"), local, OWN));
        assert!(loops_back(addr("127.0.0.53:15006"), local, OWN));
        assert!(loops_back(
            addr("[::1]:15001"),
            addr("[fd00::5]:15001"),
            OWN
        ));
        assert!(loops_back(addr("0.0.0.0:15006"), local, OWN));
        // Inbound to an app port that happens to be ours: 127.0.0.1:15006 is us.
        let inbound = route(Direction::Inbound, addr("10.0.0.5:15006"));
        assert!(loops_back(inbound.host, addr("10.0.0.5:15006"), OWN));
    }

    #[test]
    fn ordinary_destinations_do_not_loop() {
        let local = addr("10.0.0.5:15001");
        assert!(!loops_back(addr("10.96.0.10:80"), local, OWN));
        assert!(!loops_back(addr("127.0.0.1:8080"), local, OWN));
        // Another pod's proxy port is not ours.
        assert!(!loops_back(addr("10.0.0.9:15001"), local, OWN));
        // sk_lookup / TPROXY: the socket kept its destination, which is not our port.
        let kept = addr("10.96.0.10:443");
        assert!(!loops_back(kept, kept, OWN));
    }
}
