//! What the demo's control plane pushes to every pod, in Envoy's JSON as istiod would
//! write it for the demo's Istio objects:
//!
//! - a VirtualService on `reviews`: `end-user: jason` goes to subset v2, the rest to v1
//!   (HTTP routing in `virtualOutbound`'s port-8080 chain);
//! - a ServiceEntry `ratings.external.test` (no address: the control plane allocates
//!   240.240.0.1 and sends the name in the NameTable), routed by its Host;
//! - PeerAuthentication STRICT: every cluster to a pod is mTLS with the SPIFFE identity
//!   of the peer checked, `virtualInbound` requires a client certificate;
//! - an AuthorizationPolicy DENY on the shop's workloads: `/admin` from the frontend's
//!   identity (`envoy.filters.http.rbac` before the router);
//! - Istio's telemetry: `istio.stats` on the inbound HTTP chain (`istio_requests_total`
//!   on each pod's 15090).

use std::net::Ipv4Addr;

use serde_json::{Value, json};

pub const PORT: u16 = 8080;
pub const SERVICE_ENTRY: &str = "ratings.external.test";
pub const SERVICE_ENTRY_VIP: Ipv4Addr = Ipv4Addr::new(240, 240, 0, 1);
pub const DENIED_PATH: &str = "/admin";
pub const V2_HEADER: (&str, &str) = ("end-user", "jason");

/// The upstream pods: reviews v1 and v2, and what the ServiceEntry's name reaches.
pub struct Upstreams {
    pub reviews_v1: Ipv4Addr,
    pub reviews_v2: Ipv4Addr,
    pub ratings: Ipv4Addr,
    /// The identity the shop's pods present (peers check it).
    pub shop_identity: String,
    /// The identity the AuthorizationPolicy denies `/admin` to.
    pub denied_identity: String,
}

/// `{"listeners": [...], "clusters": [...]}`, TLS from SDS (`default`, `ROOTCA`).
pub fn resources(up: &Upstreams) -> Value {
    json!({
        "listeners": [outbound(), inbound(&up.denied_identity)],
        "clusters": [
            mtls_cluster("outbound|8080|v1|reviews.shop.svc.cluster.local", up.reviews_v1, &up.shop_identity),
            mtls_cluster("outbound|8080|v2|reviews.shop.svc.cluster.local", up.reviews_v2, &up.shop_identity),
            mtls_cluster(&format!("outbound|8080||{SERVICE_ENTRY}"), up.ratings, &up.shop_identity),
            plain_cluster("inbound|8080||", Ipv4Addr::LOCALHOST),
        ]
    })
}

fn original_dst() -> Value {
    json!([{"name": "envoy.filters.listener.original_dst", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}}])
}

/// 15001: port 8080 through HTTP routing (the VirtualService and the ServiceEntry's host).
fn outbound() -> Value {
    let (header, value) = V2_HEADER;
    let routes = json!([
        {"name": "ratings", "domains": [SERVICE_ENTRY, format!("{SERVICE_ENTRY}:{PORT}")],
         "routes": [{"match": {"prefix": "/"},
                     "route": {"cluster": format!("outbound|8080||{SERVICE_ENTRY}"), "timeout": "5s"}}]},
        {"name": "reviews", "domains": ["*"], "routes": [
            {"match": {"prefix": "/", "headers": [{"name": header, "string_match": {"exact": value}}]},
             "route": {"cluster": "outbound|8080|v2|reviews.shop.svc.cluster.local", "timeout": "5s"}},
            {"match": {"prefix": "/"},
             "route": {"cluster": "outbound|8080|v1|reviews.shop.svc.cluster.local", "timeout": "5s"}}]}
    ]);
    json!({
        "name": "virtualOutbound",
        "traffic_direction": "OUTBOUND",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15001}},
        "listener_filters": original_dst(),
        "filter_chains": [{
            "filter_chain_match": {"destination_port": PORT},
            "filters": [hcm("outbound_0.0.0.0_8080", vec![], routes)]
        }]
    })
}

/// 15006: mTLS required, then the AuthorizationPolicy and Istio's stats.
fn inbound(denied_identity: &str) -> Value {
    let tls = json!({"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "require_client_certificate": true,
        "common_tls_context": sds_context(json!({"prefix": "spiffe://cluster.local/"}))}});
    let authn = json!({"name": "istio_authn", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/io.istio.network.authn.Config"}});
    let routes = json!([{"name": "inbound|http|8080", "domains": ["*"], "routes": [
        {"match": {"prefix": "/"}, "route": {"cluster": "inbound|8080||", "timeout": "5s"}}]}]);
    json!({
        "name": "virtualInbound",
        "traffic_direction": "INBOUND",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15006}},
        "listener_filters": original_dst(),
        "filter_chains": [{
            "filter_chain_match": {"destination_port": PORT},
            "transport_socket": tls,
            "filters": [authn, hcm("inbound_0.0.0.0_8080",
                vec![deny_admin(denied_identity), stats()], routes)]
        }]
    })
}

/// The AuthorizationPolicy as istiod translates it (policy `ns[shop]-policy[deny-admin]-rule[0]`).
fn deny_admin(identity: &str) -> Value {
    json!({"name": "envoy.filters.http.rbac", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
    "rules": {"action": "DENY", "policies": {"ns[shop]-policy[deny-admin]-rule[0]": {
        "permissions": [{"and_rules": {"rules": [{"or_rules": {"rules": [
            {"url_path": {"path": {"prefix": DENIED_PATH}}}]}}]}}],
        "principals": [{"and_ids": {"ids": [{"or_ids": {"ids": [
            {"authenticated": {"principal_name": {"exact": identity}}}]}}]}}]
    }}}}})
}

fn stats() -> Value {
    json!({"name": "istio.stats", "typed_config": {"@type": "type.googleapis.com/stats.PluginConfig"}})
}

fn hcm(prefix: &str, mut filters: Vec<Value>, virtual_hosts: Value) -> Value {
    filters.push(
        json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}),
    );
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": prefix,
        "codec_type": "AUTO",
        "http_filters": filters,
        "route_config": {"name": prefix, "virtual_hosts": virtual_hosts}}})
}

/// The pod's certificate and the mesh root over SDS; the peer must present `san`.
fn sds_context(san: Value) -> Value {
    let sds = json!({"api_config_source": {"api_type": "GRPC", "transport_api_version": "V3",
        "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]},
        "resource_api_version": "V3"});
    json!({
        "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": sds}],
        "combined_validation_context": {
            "default_validation_context": {
                "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": san}]},
            "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": sds}}
    })
}

fn plain_cluster(name: &str, ip: Ipv4Addr) -> Value {
    json!({"name": name, "type": "STATIC", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint":
            {"address": {"socket_address": {"address": ip.to_string(), "port_value": PORT}}}}]}]}})
}

/// A cluster to a pod over mTLS: its certificate must carry `identity`.
fn mtls_cluster(name: &str, ip: Ipv4Addr, identity: &str) -> Value {
    let mut c = plain_cluster(name, ip);
    c["transport_socket"] = json!({"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": sds_context(json!({"exact": identity}))}});
    c
}
