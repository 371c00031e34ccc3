//! Turning the DNS proxy on, as pilot-agent does: with `ISTIO_META_DNS_CAPTURE=true` in
//! the environment, `DNS_CAPTURE: "true"` in the bootstrap's node metadata (where
//! pilot-agent copies every `ISTIO_META_*`), or `--dns-listen`. Its sockets are bound
//! after privileges drop (only a privileged port is bound before, as root): a socket
//! belongs to the uid that made it, and istio-iptables' DNS rules find the DNS proxy's
//! replies by that owner (`--sport 15053 -m owner --uid-owner 1337 -j CT --zone 2`); a
//! root-owned socket's replies miss the app's conntrack zone and never reach it. Its
//! upstream queries leave as the proxy's own uid too, which the capture lets through.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::google::protobuf::value::Kind;

use super::ProxyArgs;
use shunt_dns::name_table::Scope;
use shunt_dns::server::{self, Sockets};
use shunt_dns::upstream::{ResolvConf, Upstreams};
use shunt_dns::{DEFAULT_PORT, DnsStats, Resolver, Tables};

/// The DNS proxy, ready to serve once bound ([`Dns::bind`]).
pub struct Dns {
    listen: Vec<SocketAddr>,
    default_listen: bool,
    /// Bound already: a privileged port, which only root may bind.
    early: Option<Sockets>,
    pub resolver: Arc<Resolver>,
    pub tables: Arc<Tables>,
}

impl Dns {
    /// The listening sockets: bound now, as the user the proxy runs as (see the module
    /// doc), unless a privileged port had them bound as root already.
    pub fn bind(&mut self) -> anyhow::Result<Sockets> {
        if let Some(sockets) = self.early.take() {
            return Ok(sockets);
        }
        Ok(server::bind(&self.listen, self.default_listen)?)
    }
}

/// Whether DNS is on, and then its sockets (bound now) and resolver.
pub fn prepare(
    args: &ProxyArgs,
    bootstrap: &Bootstrap,
    stats: &shunt_core::stats::Store,
) -> anyhow::Result<Option<Dns>> {
    let env_on = std::env::var("ISTIO_META_DNS_CAPTURE").is_ok_and(|v| truthy(&v));
    let metadata_on = node_metadata(bootstrap, "DNS_CAPTURE").is_some_and(|v| truthy(&v));
    if !env_on && !metadata_on && args.dns_listen.is_empty() {
        return Ok(None);
    }
    let default_listen = args.dns_listen.is_empty();
    let listen = if default_listen {
        vec![
            SocketAddr::new(Ipv4Addr::LOCALHOST.into(), DEFAULT_PORT),
            SocketAddr::new(Ipv6Addr::LOCALHOST.into(), DEFAULT_PORT),
        ]
    } else {
        args.dns_listen.clone()
    };
    let resolv = ResolvConf::load(&args.dns_resolv_conf)
        .context("the DNS proxy forwards to the resolv.conf servers")?;
    let (namespace, domain) = namespace_and_domain(bootstrap);
    tracing::info!(
        servers = ?resolv.servers,
        search = ?resolv.search,
        %namespace,
        %domain,
        "DNS proxy on"
    );
    let early = if listen.iter().any(|a| a.port() < 1024) {
        tracing::warn!(
            ?listen,
            "a privileged DNS port is bound as root: istio-iptables' conntrack zones will not match its replies"
        );
        Some(server::bind(&listen, default_listen)?)
    } else {
        None
    };
    let tables = Arc::new(Tables::new(Scope::new(&namespace, &domain, resolv.search)));
    let upstreams = Upstreams {
        servers: resolv.servers,
        timeout: Duration::from_millis(args.dns_upstream_timeout_ms),
        netns: None,
    };
    let resolver = Arc::new(Resolver::new(
        tables.clone(),
        upstreams,
        args.dns_cache_size,
        DnsStats::new(stats),
    ));
    Ok(Some(Dns {
        listen,
        default_listen,
        early,
        resolver,
        tables,
    }))
}

fn truthy(value: &str) -> bool {
    value.eq_ignore_ascii_case("true") || value == "1"
}

/// A node metadata value as text (a string, or a bool as pilot-agent may write it).
fn node_metadata(bootstrap: &Bootstrap, key: &str) -> Option<String> {
    let value = bootstrap
        .node
        .as_ref()?
        .metadata
        .as_ref()?
        .fields
        .get(key)?;
    match value.kind.as_ref()? {
        Kind::StringValue(s) => Some(s.clone()),
        Kind::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The pod's namespace and Istio's proxy DNS domain: from the node id
/// (`sidecar~10.0.0.1~pod.ns~ns.svc.cluster.local`), the metadata's `NAMESPACE`, or
/// `POD_NAMESPACE`; the domain defaults to `ns.svc.cluster.local`.
fn namespace_and_domain(bootstrap: &Bootstrap) -> (String, String) {
    let id = bootstrap.node.as_ref().map_or("", |n| n.id.as_str());
    let fields: Vec<&str> = id.split('~').collect();
    let namespace = node_metadata(bootstrap, "NAMESPACE")
        .or_else(|| {
            fields
                .get(2)
                .and_then(|pod| pod.split_once('.'))
                .map(|(_, ns)| ns.to_owned())
        })
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .filter(|ns| !ns.is_empty())
        .unwrap_or_else(|| "default".to_owned());
    let domain = fields
        .get(3)
        .filter(|d| !d.is_empty())
        .map(|d| d.to_string())
        .unwrap_or_else(|| format!("{namespace}.svc.cluster.local"));
    (namespace, domain)
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::google::protobuf::{Struct, Value};

    use super::*;

    fn with_node(id: &str, metadata: &[(&str, Kind)]) -> Bootstrap {
        Bootstrap {
            node: Some(Node {
                id: id.into(),
                metadata: Some(Struct {
                    fields: metadata
                        .iter()
                        .map(|(k, v)| {
                            (
                                k.to_string(),
                                Value {
                                    kind: Some(v.clone()),
                                },
                            )
                        })
                        .collect(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_namespace_and_domain_come_from_the_node_as_pilot_agent_writes_it() {
        let b = with_node("sidecar~10.0.0.1~p.shop~shop.svc.cluster.local", &[]);
        assert_eq!(
            namespace_and_domain(&b),
            ("shop".into(), "shop.svc.cluster.local".into())
        );
        let b = with_node(
            "router~10.0.0.1~gw~",
            &[("NAMESPACE", Kind::StringValue("istio-system".into()))],
        );
        assert_eq!(
            namespace_and_domain(&b),
            (
                "istio-system".into(),
                "istio-system.svc.cluster.local".into()
            )
        );
    }

    #[test]
    fn dns_capture_in_the_node_metadata_is_read_as_text_or_bool() {
        let b = with_node("x", &[("DNS_CAPTURE", Kind::StringValue("true".into()))]);
        assert_eq!(node_metadata(&b, "DNS_CAPTURE").as_deref(), Some("true"));
        let b = with_node("x", &[("DNS_CAPTURE", Kind::BoolValue(true))]);
        assert!(node_metadata(&b, "DNS_CAPTURE").is_some_and(|v| truthy(&v)));
        assert_eq!(node_metadata(&with_node("x", &[]), "DNS_CAPTURE"), None);
    }
}
