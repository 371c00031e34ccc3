//! DNS discovery for STRICT_DNS and LOGICAL_DNS clusters, through the system resolver
//! (tokio's `lookup_host`, i.e. getaddrinfo, which honours /etc/hosts as Envoy's
//! c-ares resolver does with its defaults).
//!
//! STRICT_DNS makes every resolved address of every endpoint a host; LOGICAL_DNS keeps
//! one host, the first address of its one endpoint, for connections made after each
//! resolution. Both re-resolve every `dns_refresh_rate`. A failed resolution keeps the
//! hosts of the last good one: a resolver hiccup must not empty the cluster.

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::cluster::{Cluster, Discovery};
use super::host::Host;

/// How long one resolution may take before it counts as failed.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);

/// One endpoint named by DNS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DnsTarget {
    pub name: String,
    pub port: u16,
    pub weight: u32,
    pub priority: u32,
}

/// Envoy's `dns_lookup_family`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LookupFamily {
    /// IPv6 if the name has any, else IPv4 (Envoy's AUTO).
    #[default]
    Auto,
    V4Only,
    V6Only,
    /// IPv4 if the name has any, else IPv6.
    V4Preferred,
    /// Both.
    All,
}

impl LookupFamily {
    /// Keeps the addresses the family asks for, in resolver order.
    pub fn filter(self, addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
        let (v4, v6): (Vec<_>, Vec<_>) = addrs.into_iter().partition(SocketAddr::is_ipv4);
        match self {
            LookupFamily::All => v4.into_iter().chain(v6).collect(),
            LookupFamily::V4Only => v4,
            LookupFamily::V6Only => v6,
            LookupFamily::Auto if v6.is_empty() => v4,
            LookupFamily::Auto => v6,
            LookupFamily::V4Preferred if v4.is_empty() => v6,
            LookupFamily::V4Preferred => v4,
        }
    }
}

/// Resolves one target to the addresses `family` keeps, without duplicates.
pub async fn resolve(target: &DnsTarget, family: LookupFamily) -> io::Result<Vec<SocketAddr>> {
    let lookup = tokio::net::lookup_host((target.name.as_str(), target.port));
    let addrs: Vec<SocketAddr> = match tokio::time::timeout(RESOLVE_TIMEOUT, lookup).await {
        Ok(addrs) => addrs?.collect(),
        Err(_) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "DNS resolution timed out",
            ));
        }
    };
    let mut addrs = family.filter(addrs);
    let mut seen = std::collections::HashSet::new();
    addrs.retain(|a| seen.insert(*a));
    if addrs.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} has no address of the requested family", target.name),
        ));
    }
    Ok(addrs)
}

/// Resolves the cluster's targets once and installs the hosts; on failure the old
/// hosts stay.
pub async fn resolve_into(cluster: &Arc<Cluster>, family: LookupFamily) {
    let mut hosts = Vec::new();
    match &cluster.discovery {
        Discovery::StrictDns { targets, .. } => {
            for target in targets {
                match resolve(target, family).await {
                    Ok(addrs) => hosts.extend(addrs.into_iter().map(|addr| host_for(target, addr))),
                    Err(err) => {
                        tracing::warn!(cluster = %cluster.name, name = %target.name, %err, "DNS resolution failed; keeping the last hosts");
                        return;
                    }
                }
            }
        }
        Discovery::LogicalDns { target, .. } => match resolve(target, family).await {
            Ok(addrs) => hosts.push(host_for(target, addrs[0])),
            Err(err) => {
                tracing::warn!(cluster = %cluster.name, name = %target.name, %err, "DNS resolution failed; keeping the last host");
                return;
            }
        },
        _ => return,
    }
    tracing::debug!(cluster = %cluster.name, hosts = hosts.len(), "DNS resolved");
    cluster.set_hosts(hosts);
}

fn host_for(target: &DnsTarget, addr: SocketAddr) -> Host {
    Host::new(addr)
        .with_hostname(target.name.clone())
        .with_weight(target.weight)
        .with_priority(target.priority)
}

/// Re-resolves every `refresh` until the cluster is gone.
pub async fn refresh_loop(cluster: Weak<Cluster>, refresh: Duration, family: LookupFamily) {
    loop {
        tokio::time::sleep(refresh).await;
        let Some(cluster) = cluster.upgrade() else {
            return;
        };
        resolve_into(&cluster, family).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ClusterConfig;

    fn addrs(list: &[&str]) -> Vec<SocketAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn lookup_family_keeps_what_it_asks_for() {
        let both = addrs(&["10.0.0.1:80", "[fd00::1]:80", "10.0.0.2:80"]);
        let v4 = addrs(&["10.0.0.1:80"]);
        assert_eq!(
            LookupFamily::V4Only.filter(both.clone()),
            addrs(&["10.0.0.1:80", "10.0.0.2:80"])
        );
        assert_eq!(
            LookupFamily::V6Only.filter(both.clone()),
            addrs(&["[fd00::1]:80"])
        );
        assert_eq!(
            LookupFamily::Auto.filter(both.clone()),
            addrs(&["[fd00::1]:80"])
        );
        assert_eq!(LookupFamily::Auto.filter(v4.clone()), v4);
        assert_eq!(LookupFamily::V4Preferred.filter(both.clone()).len(), 2);
        assert_eq!(LookupFamily::All.filter(both).len(), 3);
    }

    fn target(name: &str, port: u16) -> DnsTarget {
        DnsTarget {
            name: name.into(),
            port,
            weight: 1,
            priority: 0,
        }
    }

    #[tokio::test]
    async fn strict_dns_makes_every_address_a_host_and_logical_dns_one() {
        let family = LookupFamily::V4Only;
        let mut config = ClusterConfig::new("strict");
        config.discovery = Discovery::StrictDns {
            targets: vec![target("localhost", 7001), target("127.0.0.2", 7002)],
            refresh: Duration::from_secs(60),
            family,
        };
        let strict = Cluster::new(config, Vec::new());
        resolve_into(&strict, family).await;
        let hosts: Vec<_> = strict.hosts().iter().map(|h| h.address).collect();
        assert!(
            hosts.contains(&"127.0.0.1:7001".parse().unwrap()),
            "{hosts:?}"
        );
        assert!(
            hosts.contains(&"127.0.0.2:7002".parse().unwrap()),
            "{hosts:?}"
        );

        let mut config = ClusterConfig::new("logical");
        config.discovery = Discovery::LogicalDns {
            target: target("localhost", 7003),
            refresh: Duration::from_secs(60),
            family,
        };
        let logical = Cluster::new(config, Vec::new());
        resolve_into(&logical, family).await;
        let hosts: Vec<_> = logical.hosts().iter().map(|h| h.address).collect();
        assert_eq!(hosts, addrs(&["127.0.0.1:7003"]));
        assert_eq!(logical.hosts()[0].hostname, "localhost");
    }

    #[tokio::test]
    async fn a_failed_resolution_keeps_the_last_hosts() {
        let family = LookupFamily::V4Only;
        let mut config = ClusterConfig::new("strict");
        config.discovery = Discovery::StrictDns {
            targets: vec![target("name.invalid", 80)],
            refresh: Duration::from_secs(60),
            family,
        };
        let cluster = Cluster::new(config, vec![Host::new("10.0.0.9:80".parse().unwrap())]);
        resolve_into(&cluster, family).await;
        assert_eq!(cluster.hosts()[0].address, "10.0.0.9:80".parse().unwrap());
    }
}
