//! The standard labels of one report, computed as istio-proxy's stats filter computes
//! them: from the local node (the reporter's own side), the peer (learned by metadata
//! exchange, peer metadata headers, or the endpoint's `istio.workload` metadata), the
//! principals of the mTLS connection, and the destination service (the `Host` header
//! unless disabled, then the cluster's `istio.services` metadata). Missing values are
//! `unknown`, a missing canonical revision `latest`.

use super::config::{PluginConfig, Reporter};
use crate::peer::{LocalNode, Workload};

/// Labels in order, as written to Prometheus.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tags(pub Vec<(String, String)>);

impl Tags {
    pub fn push(&mut self, name: &str, value: &str) {
        self.0.push((name.to_owned(), value.to_owned()));
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn as_pairs(&self) -> Vec<(&str, &str)> {
        self.0
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect()
    }
}

/// The first service of a cluster's `filter_metadata.istio.services`, as istiod writes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClusterService<'a> {
    pub host: Option<&'a str>,
    pub name: Option<&'a str>,
}

/// What one stream or connection knows when it reports.
#[derive(Debug, Clone, Copy, Default)]
pub struct Observation<'a> {
    /// The peer as exchanged (downstream peer when inbound, upstream peer when outbound).
    pub peer: Option<&'a Workload>,
    /// The upstream endpoint's `istio.workload` metadata: the outbound fallback when the
    /// peer sent nothing, and the destination of a gateway.
    pub endpoint: Option<&'a Workload>,
    /// The request's `Host` (`:authority`); `None` on TCP.
    pub host: Option<&'a str>,
    pub route_name: Option<&'a str>,
    pub cluster_name: Option<&'a str>,
    pub cluster_service: Option<ClusterService<'a>>,
    /// The peer's certificate URI SAN (inbound: the downstream client's; outbound: the
    /// upstream server's), or istio_authn's peer principal.
    pub peer_principal: Option<&'a str>,
    /// The local certificate's URI SAN on the same connection.
    pub local_principal: Option<&'a str>,
}

const UNKNOWN: &str = "unknown";
const LATEST: &str = "latest";

/// The namespace in a SPIFFE id: `spiffe://td/ns/<namespace>/sa/<account>`.
pub fn spiffe_namespace(principal: &str) -> Option<&str> {
    let rest = principal.strip_prefix("spiffe://")?;
    let mut parts = rest.split('/');
    let _trust_domain = parts.next()?;
    (parts.next()? == "ns").then_some(())?;
    let namespace = parts.next()?;
    (parts.next()? == "sa").then_some(())?;
    parts.next()?;
    (!namespace.is_empty()).then_some(namespace)
}

fn or<'a>(value: &'a str, fallback: &'a str) -> &'a str {
    if value.is_empty() { fallback } else { value }
}

/// The peer and destination labels, with whether the connection is mutual TLS (known on
/// the inbound side only, as istio-proxy knows it).
fn peer_tags(config: &PluginConfig, node: &LocalNode, obs: &Observation) -> (Tags, Option<bool>) {
    let reporter = config.reporter;
    let mut tags = Tags::default();
    tags.push(
        "reporter",
        match reporter {
            Reporter::ClientSidecar => "source",
            Reporter::ServerSidecar | Reporter::ServerGateway => "destination",
        },
    );
    let peer = match (obs.peer, reporter) {
        (Some(peer), _) => Some(peer),
        (None, Reporter::ClientSidecar) => obs.endpoint,
        (None, _) => None,
    };
    let (service_host, service_name) = destination_service(config, obs);
    let tls_peer_san = obs.peer_principal.unwrap_or_default();
    let local_san = obs.local_principal.unwrap_or_default();
    let mutual_tls = match reporter {
        Reporter::ClientSidecar => None,
        _ => Some(!tls_peer_san.is_empty() && !local_san.is_empty()),
    };
    // Without a certificate, the identity workload discovery knows for the peer.
    let peer_san = or(tls_peer_san, peer.map_or("", |p| p.identity.as_str()));
    let sides = Sides {
        peer,
        peer_san,
        peer_namespace: spiffe_namespace(peer_san)
            .or_else(|| peer.map(|p| p.namespace_name.as_str()))
            .unwrap_or_default(),
        local: &node.workload(),
        local_san,
        service_host,
        service_name,
    };
    match reporter {
        Reporter::ServerSidecar => inbound_tags(&mut tags, &sides),
        Reporter::ServerGateway => gateway_tags(&mut tags, &sides, obs.endpoint),
        Reporter::ClientSidecar => outbound_tags(&mut tags, &sides),
    }
    (tags, mutual_tls)
}

/// The destination service's host and name: the Host header unless disabled, then the
/// special clusters, then the cluster's `istio.services`.
fn destination_service<'a>(config: &PluginConfig, obs: &Observation<'a>) -> (&'a str, &'a str) {
    let mut service_host: &str = "";
    let mut service_name: &str = "";
    if !config.disable_host_header_fallback
        && let Some(host) = obs.host
    {
        service_host = host;
        service_name = host;
    }
    match obs.route_name {
        Some("block_all") => service_name = "BlackHoleCluster",
        Some("allow_any") => service_name = "PassthroughCluster",
        _ => match obs.cluster_name {
            Some(
                name @ ("BlackHoleCluster"
                | "PassthroughCluster"
                | "InboundPassthroughClusterIpv4"
                | "InboundPassthroughClusterIpv6"),
            ) => service_name = name,
            _ => {
                if let Some(service) = obs.cluster_service {
                    if let Some(host) = service.host {
                        service_host = host;
                    }
                    match service.name {
                        Some(name) => service_name = name,
                        None => service_name = service_host.split('.').next().unwrap_or_default(),
                    }
                }
            }
        },
    }
    (service_host, service_name)
}

/// The two sides of a report: the peer (the other side) and the local workload, each
/// with its identity, and the destination service.
struct Sides<'a> {
    peer: Option<&'a Workload>,
    peer_san: &'a str,
    peer_namespace: &'a str,
    local: &'a Workload,
    local_san: &'a str,
    service_host: &'a str,
    service_name: &'a str,
}

impl Sides<'_> {
    /// A field of the peer's workload, `fallback` when it is unknown or empty.
    fn peer_field(&self, get: fn(&Workload) -> &str, fallback: &'static str) -> String {
        self.peer
            .map(get)
            .filter(|v| !v.is_empty())
            .unwrap_or(fallback)
            .to_owned()
    }

    /// The source labels of an inbound report: the peer's.
    fn peer_source_tags(&self, tags: &mut Tags) {
        tags.push(
            "source_workload",
            &self.peer_field(|p| &p.workload_name, UNKNOWN),
        );
        tags.push(
            "source_canonical_service",
            &self.peer_field(|p| &p.canonical_name, UNKNOWN),
        );
        tags.push(
            "source_canonical_revision",
            &self.peer_field(|p| &p.canonical_revision, LATEST),
        );
        tags.push(
            "source_workload_namespace",
            or(self.peer_namespace, UNKNOWN),
        );
        tags.push("source_principal", or(self.peer_san, UNKNOWN));
        tags.push("source_app", &self.peer_field(|p| &p.app_name, UNKNOWN));
        tags.push(
            "source_version",
            &self.peer_field(|p| &p.app_version, UNKNOWN),
        );
        tags.push(
            "source_cluster",
            &self.peer_field(|p| &p.cluster_name, UNKNOWN),
        );
    }
}

/// A sidecar's inbound report: the peer is the source, the local workload the
/// destination.
fn inbound_tags(tags: &mut Tags, s: &Sides) {
    let local = s.local;
    s.peer_source_tags(tags);
    tags.push("destination_workload", &local.workload_name);
    tags.push("destination_workload_namespace", &local.namespace_name);
    tags.push("destination_principal", or(s.local_san, UNKNOWN));
    tags.push("destination_app", &local.app_name);
    tags.push("destination_version", &local.app_version);
    tags.push(
        "destination_service",
        or(s.service_host, &local.canonical_name),
    );
    tags.push("destination_canonical_service", &local.canonical_name);
    tags.push("destination_canonical_revision", &local.canonical_revision);
    tags.push(
        "destination_service_name",
        or(s.service_name, &local.canonical_name),
    );
    tags.push("destination_service_namespace", &local.namespace_name);
    tags.push("destination_cluster", &local.cluster_name);
}

/// A gateway's report: the peer is the source, the upstream endpoint the destination
/// (in the gateway's namespace and with its principal).
fn gateway_tags(tags: &mut Tags, s: &Sides, endpoint: Option<&Workload>) {
    let local = s.local;
    s.peer_source_tags(tags);
    let canonical = endpoint.map_or(UNKNOWN, |e| e.canonical_name.as_str());
    tags.push(
        "destination_workload",
        endpoint.map_or(UNKNOWN, |e| e.workload_name.as_str()),
    );
    tags.push("destination_workload_namespace", &local.namespace_name);
    tags.push("destination_principal", or(s.local_san, UNKNOWN));
    tags.push("destination_app", UNKNOWN);
    tags.push("destination_version", UNKNOWN);
    tags.push("destination_service", or(s.service_host, canonical));
    tags.push("destination_canonical_service", canonical);
    tags.push(
        "destination_canonical_revision",
        endpoint.map_or(UNKNOWN, |e| e.canonical_revision.as_str()),
    );
    tags.push("destination_service_name", or(s.service_name, canonical));
    tags.push("destination_service_namespace", &local.namespace_name);
    tags.push("destination_cluster", &local.cluster_name);
}

/// A sidecar's outbound report: the local workload is the source, the peer the
/// destination.
fn outbound_tags(tags: &mut Tags, s: &Sides) {
    let local = s.local;
    tags.push("source_workload", &local.workload_name);
    tags.push("source_canonical_service", &local.canonical_name);
    tags.push("source_canonical_revision", &local.canonical_revision);
    tags.push("source_workload_namespace", &local.namespace_name);
    tags.push("source_principal", or(s.local_san, UNKNOWN));
    tags.push("source_app", &local.app_name);
    tags.push("source_version", &local.app_version);
    tags.push("source_cluster", &local.cluster_name);
    tags.push(
        "destination_workload",
        &s.peer_field(|p| &p.workload_name, UNKNOWN),
    );
    tags.push(
        "destination_workload_namespace",
        or(s.peer_namespace, UNKNOWN),
    );
    tags.push("destination_principal", or(s.peer_san, UNKNOWN));
    tags.push("destination_app", &s.peer_field(|p| &p.app_name, UNKNOWN));
    tags.push(
        "destination_version",
        &s.peer_field(|p| &p.app_version, UNKNOWN),
    );
    tags.push("destination_service", or(s.service_host, UNKNOWN));
    tags.push(
        "destination_canonical_service",
        &s.peer_field(|p| &p.canonical_name, UNKNOWN),
    );
    tags.push(
        "destination_canonical_revision",
        &s.peer_field(|p| &p.canonical_revision, LATEST),
    );
    tags.push("destination_service_name", or(s.service_name, UNKNOWN));
    tags.push(
        "destination_service_namespace",
        or(s.peer_namespace, UNKNOWN),
    );
    tags.push(
        "destination_cluster",
        &s.peer_field(|p| &p.cluster_name, UNKNOWN),
    );
}

fn security_policy(mutual_tls: Option<bool>) -> &'static str {
    match mutual_tls {
        Some(true) => "mutual_tls",
        Some(false) => "none",
        None => UNKNOWN,
    }
}

/// What an HTTP stream adds to the peer labels at its end.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpOutcome<'a> {
    pub grpc: bool,
    /// 0 when no response was sent.
    pub response_code: u16,
    /// The `grpc-status` of a gRPC response, if it had one.
    pub grpc_status: Option<u32>,
    /// Envoy's short response flags (`-` for none, `UH`, `NR,URX`...).
    pub response_flags: &'a str,
}

/// The labels of an HTTP report.
pub fn http(
    config: &PluginConfig,
    node: &LocalNode,
    obs: &Observation,
    outcome: &HttpOutcome,
) -> Tags {
    let (mut tags, mutual_tls) = peer_tags(config, node, obs);
    tags.push(
        "request_protocol",
        if outcome.grpc { "grpc" } else { "http" },
    );
    tags.push("response_code", &outcome.response_code.to_string());
    let grpc_status = match (outcome.grpc, outcome.grpc_status) {
        (true, Some(status)) => status.to_string(),
        _ => String::new(),
    };
    tags.push("grpc_response_status", &grpc_status);
    tags.push("response_flags", or(outcome.response_flags, "-"));
    tags.push("connection_security_policy", security_policy(mutual_tls));
    tags
}

/// The labels of a TCP report (fixed when the connection opened: its later byte and
/// close reports use the same ones).
pub fn tcp(
    config: &PluginConfig,
    node: &LocalNode,
    obs: &Observation,
    response_flags: &str,
) -> Tags {
    let (mut tags, mutual_tls) = peer_tags(config, node, obs);
    tags.push("request_protocol", "tcp");
    tags.push("response_flags", or(response_flags, "-"));
    tags.push("connection_security_policy", security_policy(mutual_tls));
    tags
}
