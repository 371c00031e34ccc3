//! The same-node fast path's directory: the pods of this process by address, each with
//! what serving a handed connection on its inbound side takes (its config, its network
//! namespace for the connection to its app, its counters). A pod is in it while its
//! proxy has an inbound listener; a connection to a pod not (or not yet) in it goes
//! over the network as usual.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, RwLock};

use shunt_upstream::same_node::{Client, Directory, Handoff};

/// One pod's inbound side, as the directory hands connections to it.
pub struct Inbound {
    pub proxy: Arc<shunt_instance::ProxyInstance>,
    /// The port its inbound listener is bound at (15006).
    pub inbound_port: u16,
}

/// The pods of this process by address.
#[derive(Default)]
pub struct Registry {
    by_ip: RwLock<HashMap<IpAddr, Arc<Inbound>>>,
}

impl Registry {
    pub fn insert(&self, ips: &[IpAddr], inbound: Arc<Inbound>) {
        let mut all = self.by_ip.write().unwrap_or_else(|e| e.into_inner());
        for ip in ips {
            all.insert(*ip, inbound.clone());
        }
    }

    /// Unlists the pod served by `proxy` (not a newer one at the same addresses).
    pub fn remove(&self, ips: &[IpAddr], proxy: &Arc<shunt_instance::ProxyInstance>) {
        let mut all = self.by_ip.write().unwrap_or_else(|e| e.into_inner());
        for ip in ips {
            if all.get(ip).is_some_and(|i| Arc::ptr_eq(&i.proxy, proxy)) {
                all.remove(ip);
            }
        }
    }

    /// A client for the pod at `ips`.
    pub fn client(self: &Arc<Self>, ips: &[IpAddr]) -> Arc<Client> {
        Arc::new(Client {
            directory: self.clone(),
            ips: ips.to_vec(),
        })
    }
}

impl Directory for Registry {
    fn offer(&self, handoff: Box<Handoff>) -> Result<(), Box<Handoff>> {
        let inbound = {
            let all = self.by_ip.read().unwrap_or_else(|e| e.into_inner());
            all.get(&handoff.destination.ip().to_canonical()).cloned()
        };
        let Some(inbound) = inbound else {
            return Err(handoff);
        };
        let bound = match handoff.destination {
            SocketAddr::V4(_) => {
                SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), inbound.inbound_port)
            }
            SocketAddr::V6(_) => {
                SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), inbound.inbound_port)
            }
        };
        let Some(listener) = inbound.proxy.listener_at(bound) else {
            // No inbound listener from its control plane yet: over the network, where
            // the connection waits in the listener's backlog.
            return Err(handoff);
        };
        inbound
            .proxy
            .serve_handed(*handoff, listener, inbound.inbound_port);
        Ok(())
    }
}
