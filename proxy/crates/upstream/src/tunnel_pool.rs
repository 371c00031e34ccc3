//! The HTTP/2 connections a cluster's CONNECT tunnels (`tcp_proxy` `tunneling_config`)
//! are streams of, per host. A connection takes new tunnels until it carries
//! [`MAX_STREAMS`]; then the next tunnel opens another connection, as Envoy's pool
//! does when a connection is at its peer's `max_concurrent_streams` (hyper does not
//! show the peer's setting, and would queue the stream: a tunnel lasts as long as its
//! TCP connection, so a queued one could wait for ever). 100 is what Istio's
//! `connect_terminate` and ztunnel allow.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hyper::client::conn::http2;

use super::Cluster;
use super::host::Host;
use super::http_pool::{CheckoutError, RequestBody};

/// Tunnels one connection carries at most.
pub const MAX_STREAMS: usize = 100;

#[derive(Debug, Default)]
pub struct TunnelPools {
    hosts: Mutex<HashMap<SocketAddr, Vec<Shared>>>,
}

#[derive(Debug, Clone)]
struct Shared {
    sender: http2::SendRequest<RequestBody>,
    /// Tunnels open on it now.
    tunnels: Arc<AtomicUsize>,
}

/// One tunnel counted on its connection until dropped.
#[derive(Debug)]
pub struct TunnelSlot(Arc<AtomicUsize>);

impl Drop for TunnelSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl TunnelPools {
    /// A connection to `host` with room for one more tunnel (below `max_streams`), made
    /// if none has room, with the tunnel's slot on it.
    pub async fn checkout(
        &self,
        cluster: &Arc<Cluster>,
        host: &Arc<Host>,
        secrets: &shunt_tls::Secrets,
        max_streams: usize,
    ) -> Result<(http2::SendRequest<RequestBody>, TunnelSlot), CheckoutError> {
        if let Some(found) = self.with_room(host.address, max_streams) {
            return Ok(found);
        }
        let (sender, _) = super::http_pool::connect_http2(cluster, host, secrets, None).await?;
        let shared = Shared {
            sender: sender.clone(),
            tunnels: Arc::new(AtomicUsize::new(1)),
        };
        let slot = TunnelSlot(shared.tunnels.clone());
        self.hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(host.address)
            .or_default()
            .push(shared);
        Ok((sender, slot))
    }

    /// An open connection to `address` below `max_streams`, its count taken.
    fn with_room(
        &self,
        address: SocketAddr,
        max_streams: usize,
    ) -> Option<(http2::SendRequest<RequestBody>, TunnelSlot)> {
        let mut hosts = self.hosts.lock().unwrap_or_else(|e| e.into_inner());
        let connections = hosts.get_mut(&address)?;
        connections.retain(|c| !c.sender.is_closed());
        connections.iter().find_map(|c| {
            c.tunnels
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max_streams).then_some(n + 1)
                })
                .ok()
                .map(|_| (c.sender.clone(), TunnelSlot(c.tunnels.clone())))
        })
    }

    /// How many connections to `address` are open.
    pub fn connections(&self, address: SocketAddr) -> usize {
        let mut hosts = self.hosts.lock().unwrap_or_else(|e| e.into_inner());
        hosts.get_mut(&address).map_or(0, |c| {
            c.retain(|c| !c.sender.is_closed());
            c.len()
        })
    }

    /// Keeps the connections of the hosts `keep` says yes to.
    pub fn retain(&self, keep: impl Fn(&SocketAddr) -> bool) {
        self.hosts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|address, _| keep(address));
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::AtomicU64;

    use bytes::Bytes;
    use http_body_util::Empty;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    use super::*;
    use crate::ClusterConfig;

    /// An HTTP/2 server on loopback that counts its connections.
    async fn h2_server() -> (SocketAddr, Arc<AtomicU64>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::AcqRel);
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(
                            TokioIo::new(stream),
                            hyper::service::service_fn(|_| async {
                                Ok::<_, Infallible>(hyper::Response::new(Empty::<Bytes>::new()))
                            }),
                        ),
                );
            }
        });
        (addr, accepted)
    }

    #[tokio::test]
    async fn a_connection_takes_tunnels_up_to_the_limit_then_another_opens() {
        let (addr, accepted) = h2_server().await;
        let cluster = Cluster::new(
            ClusterConfig::new("connect_originate"),
            vec![Host::new(addr)],
        );
        let host = cluster.hosts()[0].clone();
        let secrets = Default::default();
        let pools = &cluster.tunnel_pools;
        let (_, first) = pools.checkout(&cluster, &host, &secrets, 2).await.unwrap();
        let (_, second) = pools.checkout(&cluster, &host, &secrets, 2).await.unwrap();
        assert_eq!(pools.connections(addr), 1);
        // At the limit: the third tunnel gets a connection of its own.
        let (_, third) = pools.checkout(&cluster, &host, &secrets, 2).await.unwrap();
        assert_eq!(pools.connections(addr), 2);
        assert_eq!(accepted.load(Ordering::Acquire), 2);
        // A tunnel that ended makes room again on the first.
        drop(first);
        let (_, fourth) = pools.checkout(&cluster, &host, &secrets, 2).await.unwrap();
        assert_eq!(accepted.load(Ordering::Acquire), 2);
        drop((second, third, fourth));
    }
}
