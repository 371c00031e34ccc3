//! A pod's DNS proxy (Istio's 15053), as `shunt agent` runs it in a sidecar but one per
//! enrolled pod: UDP and TCP on the pod's own 127.0.0.1 and [::1] (where the capture
//! sends the app's queries), the mesh's names from the pod's own name table (NDS on the
//! pod's xDS stream), the rest forwarded to the pod's resolvers from inside the pod.
//!
//! The pod's resolvers are the enroller's (`PodInfo::dns`: the CNI `dns` capability,
//! what the runtime wrote into the pod's resolv.conf); when it gave none, the node's
//! `resolv.conf` (`DnsOptions::resolv_conf`; with the DaemonSet's `ClusterFirstWithHostNet`
//! that is the cluster DNS, which is also what the capture is told to capture), with
//! Kubernetes' search domains for the pod's namespace. The node process cannot read the
//! pod's own /etc/resolv.conf: at CNI ADD no container of the pod has started yet.
//!
//! In an upgrade the pod's DNS sockets are handed to the new process with its listening
//! sockets ([`PodDnsProxy::sockets`], [`super::handover`]): the same sockets, so a query
//! queued on them is answered by whichever process reads it, none is lost.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use tokio::task::JoinHandle;

use crate::PodInfo;
use shunt_dns::name_table::Scope;
use shunt_dns::server::Sockets;
use shunt_dns::upstream::{ResolvConf, Upstreams};
use shunt_dns::{DEFAULT_PORT, DnsStats, Resolver, Tables};

/// How the node serves its pods' DNS.
#[derive(Debug, Clone)]
pub struct DnsOptions {
    /// The port on the pod's loopback (Istio's 15053, where the capture sends queries).
    pub port: u16,
    /// The resolvers of a pod whose enroller did not say (the node's resolv.conf).
    pub resolv_conf: PathBuf,
    pub upstream_timeout: Duration,
    pub cache_capacity: usize,
}

impl Default for DnsOptions {
    fn default() -> Self {
        DnsOptions {
            port: DEFAULT_PORT,
            resolv_conf: "/etc/resolv.conf".into(),
            upstream_timeout: Duration::from_secs(5),
            cache_capacity: 1024,
        }
    }
}

/// A DNS socket as handed over: its protocol, address and descriptor.
#[derive(Debug)]
pub struct DnsSocket {
    pub protocol: Protocol,
    pub addr: SocketAddr,
    pub fd: OwnedFd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    Udp,
    Tcp,
}

/// A pod's running DNS proxy; [`PodDnsProxy::stop`] closes its sockets.
pub struct PodDnsProxy {
    /// The pod's name table, set by the pod's xDS stream.
    pub tables: Arc<Tables>,
    pub addrs: Vec<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
    /// Second handles on the sockets being served, to hand over; emptied by `stop`.
    handles: Mutex<Vec<DnsSocket>>,
}

impl PodDnsProxy {
    /// Binds the pod's DNS sockets inside `netns` (or serves `handed`, the sockets
    /// of the process this one replaces) on `runtime`, with counters in `stats` (the
    /// pod's store).
    pub fn start(
        runtime: &tokio::runtime::Handle,
        options: &DnsOptions,
        pod: &PodInfo,
        netns: Arc<OwnedFd>,
        stats: &shunt_core::stats::Store,
        handed: Vec<DnsSocket>,
    ) -> anyhow::Result<PodDnsProxy> {
        let resolv = resolvers(options, pod)?;
        let domain = format!("{}.svc.cluster.local", pod.namespace);
        let tables = Arc::new(Tables::new(Scope::new(
            &pod.namespace,
            &domain,
            resolv.search,
        )));
        let upstreams = Upstreams {
            servers: resolv.servers,
            timeout: options.upstream_timeout,
            netns: Some(netns.clone()),
        };
        let resolver = Arc::new(Resolver::new(
            tables.clone(),
            upstreams,
            options.cache_capacity,
            DnsStats::new(stats),
        ));
        let listen = [
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), options.port),
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), options.port),
        ];
        let sockets = if handed.is_empty() {
            shunt_dns::server::bind_in(&netns, &listen, true)?
        } else {
            adopt(handed)
        };
        let mut addrs: Vec<SocketAddr> = Vec::new();
        let mut handles = Vec::new();
        for udp in &sockets.udp {
            let addr = udp.local_addr()?;
            addrs.push(addr);
            handles.push(DnsSocket {
                protocol: Protocol::Udp,
                addr,
                fd: OwnedFd::from(udp.try_clone()?),
            });
        }
        for tcp in &sockets.tcp {
            handles.push(DnsSocket {
                protocol: Protocol::Tcp,
                addr: tcp.local_addr()?,
                fd: OwnedFd::from(tcp.try_clone()?),
            });
        }
        let _entered = runtime.enter();
        let tasks = shunt_dns::server::serve(sockets, resolver)?;
        Ok(PodDnsProxy {
            tables,
            addrs,
            tasks,
            handles: Mutex::new(handles),
        })
    }

    /// Duplicates of the sockets being served, for the process taking over.
    pub fn sockets(&self) -> std::io::Result<Vec<DnsSocket>> {
        let handles = self.handles.lock().unwrap_or_else(|e| e.into_inner());
        handles
            .iter()
            .map(|s| {
                Ok(DnsSocket {
                    protocol: s.protocol,
                    addr: s.addr,
                    fd: s.fd.try_clone()?,
                })
            })
            .collect()
    }

    /// Stops reading the pod's DNS sockets and closes this process's handles on them
    /// (a query being forwarded still gets its answer).
    pub fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
        self.handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

/// Handed-over descriptors as the sockets they are.
fn adopt(handed: Vec<DnsSocket>) -> Sockets {
    let mut sockets = Sockets {
        udp: Vec::new(),
        tcp: Vec::new(),
    };
    for socket in handed {
        match socket.protocol {
            Protocol::Udp => sockets.udp.push(socket.fd.into()),
            Protocol::Tcp => sockets.tcp.push(socket.fd.into()),
        }
    }
    sockets
}

/// The pod's resolvers: the enroller's, else the node's resolv.conf with Kubernetes'
/// search domains for the pod's namespace.
fn resolvers(options: &DnsOptions, pod: &PodInfo) -> anyhow::Result<ResolvConf> {
    let k8s_search = || {
        vec![
            format!("{}.svc.cluster.local", pod.namespace),
            "svc.cluster.local".to_owned(),
            "cluster.local".to_owned(),
        ]
    };
    if let Some(dns) = pod.dns.as_ref().filter(|d| !d.servers.is_empty()) {
        return Ok(ResolvConf {
            servers: dns
                .servers
                .iter()
                .map(|ip| SocketAddr::new(*ip, 53))
                .collect(),
            search: if dns.searches.is_empty() {
                k8s_search()
            } else {
                dns.searches.clone()
            },
        });
    }
    let node = ResolvConf::load(&options.resolv_conf)
        .context("the pod's DNS proxy forwards to the node's resolv.conf servers")?;
    Ok(ResolvConf {
        servers: node.servers,
        search: k8s_search(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PodDns;

    fn pod(dns: Option<PodDns>) -> PodInfo {
        PodInfo {
            uid: "u".into(),
            name: "p".into(),
            namespace: "shop".into(),
            container_id: String::new(),
            netns_path: None,
            ips: Vec::new(),
            service_account: None,
            dns,
            token_path: None,
        }
    }

    #[test]
    fn the_enrollers_resolvers_win_over_the_nodes() {
        let options = DnsOptions {
            resolv_conf: "/nonexistent/resolv.conf".into(),
            ..Default::default()
        };
        let given = PodDns {
            servers: vec!["10.96.0.10".parse().unwrap()],
            searches: Vec::new(),
        };
        let conf = resolvers(&options, &pod(Some(given))).unwrap();
        assert_eq!(conf.servers, ["10.96.0.10:53".parse().unwrap()]);
        assert_eq!(conf.search[0], "shop.svc.cluster.local");
        // Without them the node's resolv.conf is read, and its absence named.
        let err = resolvers(&options, &pod(None)).unwrap_err();
        assert!(
            format!("{err:#}").contains("/nonexistent/resolv.conf"),
            "{err:#}"
        );
    }
}
