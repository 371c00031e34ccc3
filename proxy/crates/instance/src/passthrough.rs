//! Istio's passthrough on a capture port, for an instance without configuration: the
//! original destination from the kernel (Envoy's `original_dst` listener filter), then
//! [`shunt_filters::tcp::proxy`] (PassthroughCluster outbound,
//! InboundPassthroughClusterIpv4 inbound).

use std::net::SocketAddr;

use tokio::net::TcpStream;

use shunt_core::access_log::{Direction, Entry};
use shunt_filters::tcp;
use shunt_listener::original_dst;

/// Serves one connection accepted on the capture port `listener_port`.
pub async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    direction: Direction,
    listener_port: u16,
    settings: &tcp::Settings,
) {
    let local = match stream.local_addr() {
        Ok(local) => local,
        Err(err) => {
            tracing::warn!(%peer, %err, "accepted connection has no local address; closing");
            return;
        }
    };
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let entry = Entry::start(direction, canonical(peer), canonical(local));
    let original_dst = match original_dst::original_dst(&stream, local, listener_port) {
        Ok(dst) => Some(dst),
        Err(err) => {
            tracing::warn!(%peer, %err, "closing connection");
            None
        }
    };
    tcp::proxy(stream, entry, original_dst, settings).await;
}
