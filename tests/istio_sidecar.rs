//! Traffic through the listeners istiod generates, between two shunt sidecars (client
//! and server), each in its own pod with capture (eBPF, and iptables in a second test),
//! each fed over ADS and SDS as pilot-agent feeds Envoy. The listeners are a real
//! sidecar's, taken from the corpus dump
//! (tests/fixtures/istio/config_dump/authz_configdump.yaml): `virtualOutbound`
//! (15001, `use_original_dst`), the outbound `0.0.0.0_80` (RDS `80`) and
//! `10.96.0.1_443` (`<ip>_<port>`, `tcp_proxy`), and `virtualInbound` (15006, its eight
//! filter chains, mTLS with `default`/`ROOTCA` from `sds-grpc`). The corpus has no
//! outbound clusters, routes or endpoints for them, so those are written here in
//! istiod's shape: `outbound|port||svc` EDS clusters with the `tlsMode-istio` socket
//! match (ALPN `istio-peer-exchange`, `istio`), the upstream metadata exchange filter
//! and `istio.services` metadata; endpoints with `tlsMode: istio`; the inbound and
//! passthrough `ORIGINAL_DST` clusters bound to 127.0.0.6.
//!
//! Adaptations of the corpus listeners, each the least that makes them serve here:
//! - the `istio.metadata_exchange` HTTP filter is Wasm (null VM) in that dump; istiod
//!   1.22+ writes `io.istio.http.peer_metadata.Config` in its place (upstream discovery
//!   and propagation outbound, downstream inbound), and so do we: Wasm is refused;
//! - the dump's AuthorizationPolicy for its httpbin (HTTP RBAC, `ext_authz`, and the
//!   network RBAC `rules: {}` that denies every passthrough connection) is left out of
//!   `virtualInbound`: the server here has none, and RBAC is tested in tests/rbac.rs;
//! - `10.96.0.1_443` (kubernetes' ClusterIP) becomes [`VIP`]`:`[`TCP_PORT`] for the
//!   server's TCP service, its `tcp_proxy` cluster renamed to that service's.
//!
//! The app in the client pod calls the server: HTTP to the server pod's IP, port 80
//! (`0.0.0.0_80`), and TCP to the service VIP (`<VIP>_9000`). Both must reach the server
//! pod's app through virtualOutbound → mTLS → virtualInbound, the app seeing Istio's
//! inbound source 127.0.0.6 and its own address; both sidecars' `istio_*` metrics must
//! carry the other side's workload (so the metadata exchange happened) and the mTLS
//! principals. Needs root.

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use harness::ads::resources::{certificate_secret, named, validation_secret};
use harness::ads::{AdsServer, Any, type_urls};
use harness::{Node, Pod, PodProcess, testapp_bin, wait_for_port};
use serde_json::{Value, json};
use support::pki::Pki;
use support::xds::{self, pipe_cluster, start_shunt, unix_server};
use support::{Caller, Capture};

const CLIENT_ID: &str = "spiffe://cluster.local/ns/client-ns/sa/client";
const SERVER_ID: &str = "spiffe://cluster.local/ns/server-ns/sa/server";
const SERVICE: &str = "server.server-ns.svc.cluster.local";
/// The server's TCP service address (a ClusterIP: no pod has it).
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const HTTP_PORT: u16 = 80;
const TCP_PORT: u16 = 9000;
const ADMIN: &str = "127.0.0.1:15000";

fn corpus_listener(name: &str) -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/istio/config_dump/authz_configdump.yaml"
    );
    // The .yaml is JSON (istioctl's testdata).
    let dump: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut listener = dump["configs"][0]["dynamic_listeners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no listener {name} in the corpus"))["active_state"]["listener"]
        .clone();
    listener.as_object_mut().unwrap().remove("@type");
    listener
}

/// What istiod 1.22+ writes where the dump has the Wasm metadata exchange HTTP filter.
fn peer_metadata(outbound: bool) -> Value {
    let fields = if outbound {
        json!({"upstream_discovery": [{"istio_headers": {}}, {"workload_discovery": {}}],
               "upstream_propagation": [{"istio_headers": {}}]})
    } else {
        json!({"downstream_discovery": [{"istio_headers": {}}, {"workload_discovery": {}}],
               "downstream_propagation": [{"istio_headers": {}}]})
    };
    json!({"name": "istio.metadata_exchange", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/io.istio.http.peer_metadata.Config",
        "value": fields
    }})
}

/// The HTTP connection managers of `listener`'s filter chains.
fn connection_managers(listener: &mut Value) -> Vec<&mut Value> {
    listener["filter_chains"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .flat_map(|chain| chain["filters"].as_array_mut().unwrap().iter_mut())
        .filter(|f| f["name"] == "envoy.filters.network.http_connection_manager")
        .map(|f| &mut f["typed_config"])
        .collect()
}

/// Replaces the Wasm metadata exchange by peer_metadata; drops the HTTP filters named
/// in `drop`.
fn adapt_http_filters(listener: &mut Value, outbound: bool, drop: &[&str]) {
    for hcm in connection_managers(listener) {
        let filters = hcm["http_filters"].as_array_mut().unwrap();
        filters.retain(|f| !drop.contains(&f["name"].as_str().unwrap_or_default()));
        for filter in filters.iter_mut() {
            let wasm = filter["typed_config"]["@type"]
                == "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm";
            if wasm && filter["name"] == "istio.metadata_exchange" {
                *filter = peer_metadata(outbound);
            }
        }
    }
}

fn virtual_inbound() -> Value {
    let mut listener = corpus_listener("virtualInbound");
    adapt_http_filters(
        &mut listener,
        false,
        &["envoy.filters.http.rbac", "envoy.filters.http.ext_authz"],
    );
    for chain in listener["filter_chains"].as_array_mut().unwrap() {
        for filter in chain["filters"].as_array_mut().unwrap() {
            if filter["name"] == "envoy.filters.network.rbac" {
                filter["typed_config"]
                    .as_object_mut()
                    .unwrap()
                    .remove("rules");
            }
        }
    }
    listener
}

fn outbound_http() -> Value {
    let mut listener = corpus_listener("0.0.0.0_80");
    adapt_http_filters(&mut listener, true, &[]);
    listener
}

fn outbound_tcp() -> Value {
    let cluster = outbound(TCP_PORT);
    let text = corpus_listener("10.96.0.1_443")
        .to_string()
        .replace("10.96.0.1_443", &format!("{VIP}_{TCP_PORT}"))
        .replace(
            "outbound|443||kubernetes.default.svc.cluster.local",
            &cluster,
        );
    let mut listener: Value = serde_json::from_str(&text).unwrap();
    listener["address"] = support::envoy::socket_address(VIP, TCP_PORT);
    listener
}

fn outbound(port: u16) -> String {
    format!("outbound|{port}||{SERVICE}")
}

/// Istio's SDS source: the `sds-grpc` cluster (pilot-agent's socket).
fn sds(name: &str) -> Value {
    json!({"name": name, "sds_config": {
        "api_config_source": {"api_type": "GRPC", "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}],
                              "set_node_on_first_message_only": true, "transport_api_version": "V3"},
        "initial_fetch_timeout": "0s", "resource_api_version": "V3"}})
}

fn ads() -> Value {
    json!({"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"})
}

fn services_metadata(port: u16) -> Value {
    json!({"filter_metadata": {"istio": {
        "services": [{"host": SERVICE, "name": "server", "namespace": "server-ns"}],
        "default_original_port": port}}})
}

/// `outbound|port||svc` as istiod writes it for a mesh service with auto mTLS.
fn outbound_cluster(port: u16) -> Value {
    let name = outbound(port);
    json!({
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": ads(), "service_name": name},
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295u64, "max_pending_requests": 4294967295u64,
            "max_requests": 4294967295u64, "max_retries": 4294967295u64, "track_remaining": true}]},
        "common_lb_config": {"locality_weighted_lb_config": {}},
        "metadata": services_metadata(port),
        "filters": [{"name": "istio.metadata_exchange", "typed_config": {
            "@type": "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange",
            "protocol": "istio-peer-exchange"}}],
        "transport_socket_matches": [
            {"name": "tlsMode-istio", "match": {"tlsMode": "istio"}, "transport_socket": {
                "name": "envoy.transport_sockets.tls", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                    "common_tls_context": {
                        "tls_params": {"tls_minimum_protocol_version": "TLSv1_2", "tls_maximum_protocol_version": "TLSv1_3"},
                        "alpn_protocols": ["istio-peer-exchange", "istio"],
                        "tls_certificate_sds_secret_configs": [sds("default")],
                        "combined_validation_context": {
                            "default_validation_context": {"match_subject_alt_names": [{"exact": SERVER_ID}]},
                            "validation_context_sds_secret_config": sds("ROOTCA")
                        }
                    },
                    "sni": format!("outbound_.{port}_._.{SERVICE}")
                }}},
            {"name": "tlsMode-disabled", "match": {}, "transport_socket": {
                "name": "envoy.transport_sockets.raw_buffer", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}}
        ]
    })
}

/// An `ORIGINAL_DST` cluster as istiod writes `PassthroughCluster`, and (bound to
/// 127.0.0.6) `InboundPassthroughClusterIpv4` and `inbound|port||`.
fn original_dst_cluster(name: &str, inbound_port: Option<u16>) -> Value {
    let mut cluster = json!({
        "name": name,
        "type": "ORIGINAL_DST",
        "connect_timeout": "10s",
        "lb_policy": "CLUSTER_PROVIDED",
        "circuit_breakers": {"thresholds": [{"max_connections": 4294967295u64, "max_pending_requests": 4294967295u64,
            "max_requests": 4294967295u64, "max_retries": 4294967295u64, "track_remaining": true}]}
    });
    if name != "PassthroughCluster" {
        cluster["upstream_bind_config"] =
            json!({"source_address": {"address": "127.0.0.6", "port_value": 0}});
    }
    if let Some(port) = inbound_port {
        cluster["metadata"] = services_metadata(port);
    }
    cluster
}

fn clusters() -> Vec<Value> {
    vec![
        outbound_cluster(HTTP_PORT),
        outbound_cluster(TCP_PORT),
        json!({"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"}),
        original_dst_cluster("PassthroughCluster", None),
        original_dst_cluster("InboundPassthroughClusterIpv4", None),
        original_dst_cluster(&format!("inbound|{HTTP_PORT}||"), Some(HTTP_PORT)),
    ]
}

/// The server pod's endpoint of `outbound|port||svc`, with istiod's endpoint metadata.
fn endpoints(port: u16, server: Ipv4Addr) -> ClusterLoadAssignment {
    let name = outbound(port);
    shunt::config::message_from_json(json!({
        "cluster_name": name,
        "endpoints": [{"locality": {}, "load_balancing_weight": 1, "lb_endpoints": [{
            "endpoint": {"address": support::envoy::socket_address(server, port)},
            "metadata": {"filter_metadata": {
                "envoy.transport_socket_match": {"tlsMode": "istio"},
                "istio": {"workload": "server;server-ns;server;v2;Kubernetes"}}},
            "load_balancing_weight": 1
        }]}]
    }))
    .unwrap()
}

/// RDS `80` as istiod writes it: the service's virtual host, then `allow_any`.
fn route_80(server: Ipv4Addr) -> RouteConfiguration {
    let cluster = outbound(HTTP_PORT);
    shunt::config::message_from_json(json!({
        "name": "80",
        "virtual_hosts": [
            {"name": format!("{SERVICE}:80"),
             "domains": [SERVICE, "server.server-ns.svc", "server.server-ns", server.to_string()],
             "routes": [{"name": "default", "match": {"prefix": "/"},
                "route": {"cluster": cluster, "timeout": "0s",
                    "retry_policy": {"retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
                        "num_retries": 2, "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
                        "host_selection_retry_max_attempts": "5"},
                    "max_grpc_timeout": "0s"},
                "decorator": {"operation": format!("{SERVICE}:80/*")}}],
             "include_request_attempt_count": true},
            {"name": "allow_any", "domains": ["*"],
             "routes": [{"name": "allow_any", "match": {"prefix": "/"},
                "route": {"cluster": "PassthroughCluster", "timeout": "0s", "max_grpc_timeout": "0s"}}],
             "include_request_attempt_count": true}
        ],
        "validate_clusters": false
    }))
    .unwrap()
}

fn any_of<M: prost::Message + prost::Name + Default>(value: Value) -> (String, Any) {
    let name = value["name"].as_str().unwrap().to_owned();
    let message: M =
        shunt::config::message_from_json(value).unwrap_or_else(|e| panic!("{name}: {e}"));
    named(&name, &message)
}

/// The mesh config both sidecars get (istiod sends each the same outbound and inbound
/// listeners for these services).
fn serve_mesh(ads: &AdsServer, server: Ipv4Addr) {
    ads.set(
        type_urls::CLUSTER,
        "c1",
        clusters().into_iter().map(any_of::<Cluster>).collect(),
    );
    ads.set(
        type_urls::ENDPOINT,
        "e1",
        [HTTP_PORT, TCP_PORT]
            .into_iter()
            .map(|p| named(&outbound(p), &endpoints(p, server)))
            .collect(),
    );
    ads.set(type_urls::ROUTE, "r1", vec![named("80", &route_80(server))]);
    ads.set(
        type_urls::LISTENER,
        "l1",
        [
            virtual_outbound(),
            outbound_http(),
            outbound_tcp(),
            virtual_inbound(),
        ]
        .into_iter()
        .map(any_of::<Listener>)
        .collect(),
    );
}

fn virtual_outbound() -> Value {
    corpus_listener("virtualOutbound")
}

/// A pod's node, with the metadata pilot-agent puts there for its workload.
fn node(ip: Ipv4Addr, name: &str, namespace: &str, version: &str) -> Value {
    json!({
        "id": format!("sidecar~{ip}~{name}-0.{namespace}~{namespace}.svc.cluster.local"),
        "cluster": format!("{name}.{namespace}"),
        "metadata": {
            "NAME": format!("{name}-0"),
            "NAMESPACE": namespace,
            "WORKLOAD_NAME": name,
            "OWNER": format!("kubernetes://apis/apps/v1/namespaces/{namespace}/deployments/{name}"),
            "CLUSTER_ID": "Kubernetes",
            "ISTIO_VERSION": "1.27.0",
            "INSTANCE_IPS": ip.to_string(),
            "LABELS": {"app": name, "version": version,
                "service.istio.io/canonical-name": name, "service.istio.io/canonical-revision": version}
        }
    })
}

/// One sidecar: its SDS server (pilot-agent's, with this workload's certificate) and
/// shunt started on the shared ADS server.
struct Sidecar {
    _sds_dir: support::TempDir,
    sds: AdsServer,
    proxy: PodProcess,
}

fn start_sidecar(pod: &Pod, ads_socket: &Path, pki: &Pki, cert: &str, node: Value) -> Sidecar {
    let (sds_dir, sds_socket, sds) = unix_server(&format!("sds-{}", pod.netns_name()));
    sds.set(
        type_urls::SECRET,
        "s1",
        vec![
            named(
                "default",
                &certificate_secret(
                    "default",
                    &pki.read(&format!("{cert}.pem")),
                    &pki.read(&format!("{cert}.key")),
                ),
            ),
            named("ROOTCA", &validation_secret("ROOTCA", &pki.read("ca.pem"))),
        ],
    );
    let mut bootstrap = xds::bootstrap(ads_socket, false);
    bootstrap["node"] = node;
    bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .push(pipe_cluster("sds-grpc", &sds_socket));
    let proxy = start_shunt(
        pod,
        &sds_dir.0.join("bootstrap.json"),
        &bootstrap,
        &["--concurrency", "1"],
    );
    Sidecar {
        _sds_dir: sds_dir,
        sds,
        proxy,
    }
}

/// The value of the Prometheus sample `name` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// `curl` as the app (captured) in `pod`: status and body.
fn http_get(pod: &Pod, target: SocketAddr, path: &str) -> (u16, String) {
    let out = pod
        .command("curl")
        .uid(support::APP_UID)
        .gid(support::APP_UID)
        .args(["-sS", "--max-time", "10", "-H"])
        .arg(format!("Host: {SERVICE}"))
        .args(["-w", "\n%{http_code}"])
        .arg(format!("http://{target}{path}"))
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

#[test]
fn through_istios_virtual_listeners_with_ebpf_capture() {
    http_and_tcp_cross_istios_virtual_listeners_with_mtls_and_metadata_exchange("ebpf");
}

#[test]
fn through_istios_virtual_listeners_with_iptables_capture() {
    http_and_tcp_cross_istios_virtual_listeners_with_mtls_and_metadata_exchange("iptables");
}

fn http_and_tcp_cross_istios_virtual_listeners_with_mtls_and_metadata_exchange(
    backend: &'static str,
) {
    let pki = Pki::new(&format!("istio-sidecar-pki-{backend}"));
    pki.issue("client", "ca", &format!("URI:{CLIENT_ID}"));
    pki.issue("server", "ca", &format!("URI:{SERVER_ID}"));
    let mut net = Node::new().expect("node");
    let client = net.add_pod("client").expect("pod client");
    let server = net.add_pod("server").expect("pod server");
    let capture = Capture::new(backend, &format!("istio-sidecar-{backend}"));
    capture.install(&client, &[]);
    capture.install(&server, &[]);

    let (_ads_dir, ads_socket, ads) = unix_server(&format!("istio-sidecar-ads-{backend}"));
    serve_mesh(&ads, server.ipv4());
    let _tcp_app = support::start_app(&server, &[TCP_PORT]);
    let _http_app = server
        .command(testapp_bin())
        .args(["serve", "--mode", "http", "--listen"])
        .arg(format!("0.0.0.0:{HTTP_PORT}"))
        .spawn()
        .expect("http app");
    wait_for_port(&server, support::local(HTTP_PORT), Duration::from_secs(10)).unwrap();

    let server_side = start_sidecar(
        &server,
        &ads_socket,
        &pki,
        "server",
        node(server.ipv4(), "server", "server-ns", "v2"),
    );
    let client_side = start_sidecar(
        &client,
        &ads_socket,
        &pki,
        "client",
        node(client.ipv4(), "client", "client-ns", "v1"),
    );
    for (pod, side) in [(&server, &server_side), (&client, &client_side)] {
        xds::eventually("listeners ACKed and ready", &side.proxy, &ads, || {
            xds::admin_at(pod, ADMIN, "/ready").0 == 200
                && xds::admin_at(pod, ADMIN, "/listeners")
                    .1
                    .contains("virtualInbound")
        });
    }
    let logs = || {
        format!(
            "\nclient:\n{}\nserver:\n{}",
            client_side.proxy.stderr_text(),
            server_side.proxy.stderr_text()
        )
    };

    // HTTP: the app calls the server pod's IP; 0.0.0.0_80 routes it to the service.
    let http_target = SocketAddr::new(IpAddr::V4(server.ipv4()), HTTP_PORT);
    for path in ["/a", "/b", "/c"] {
        let (status, body) = http_get(&client, http_target, path);
        assert_eq!(status, 200, "{body}{}", logs());
        assert!(
            body.starts_with("HELLO peer=127.0.0.6:")
                && body.contains(&format!(" local={http_target}")),
            "the app sees Istio's inbound source and its own address: {body}"
        );
    }

    // TCP: the app calls the service VIP; <VIP>_9000 takes it to the server pod.
    for bytes in [1000usize, 2500] {
        let caller = Caller {
            bytes,
            ..Caller::app(&client)
        };
        let call = caller
            .call(SocketAddr::new(IpAddr::V4(VIP), TCP_PORT))
            .unwrap_or_else(|e| panic!("TCP to {VIP}:{TCP_PORT}: {e:#}{}", logs()));
        assert_eq!(call.bytes, bytes as u64);
        assert_eq!(
            call.server_peer.ip(),
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6))
        );
        assert_eq!(
            call.server_local,
            SocketAddr::new(IpAddr::V4(server.ipv4()), TCP_PORT)
        );
    }

    let metrics = |pod: &Pod| xds::admin_at(pod, ADMIN, "/stats/prometheus").1;
    let closed = |pod: &Pod, reporter: &str| {
        sample(
            &metrics(pod),
            "istio_tcp_connections_closed_total",
            &[("reporter", reporter), ("request_protocol", "tcp")],
        )
    };
    support::wait_until(
        "both sides report the TCP closes",
        &client_side.proxy,
        || closed(&client, "source") == Some(2.0) && closed(&server, "destination") == Some(2.0),
        || {
            format!(
                "client:\n{}\nserver:\n{}",
                metrics(&client),
                metrics(&server)
            )
        },
    );
    let (c, s) = (metrics(&client), metrics(&server));
    let peers = [
        ("source_workload", "client"),
        ("source_workload_namespace", "client-ns"),
        ("source_app", "client"),
        ("source_version", "v1"),
        ("destination_workload", "server"),
        ("destination_workload_namespace", "server-ns"),
        ("destination_app", "server"),
        ("destination_version", "v2"),
    ];
    let with = |more: &[(&'static str, &'static str)]| {
        let mut all = peers.to_vec();
        all.extend_from_slice(more);
        all
    };
    // HTTP, each side learned the other's workload.
    let http = [
        ("request_protocol", "http"),
        ("response_code", "200"),
        ("destination_service", SERVICE),
    ];
    assert_eq!(
        sample(
            &c,
            "istio_requests_total",
            &with(
                &[
                    &http[..],
                    &[
                        ("reporter", "source"),
                        ("source_principal", CLIENT_ID),
                        ("destination_principal", SERVER_ID),
                    ],
                ]
                .concat()
            )
        ),
        Some(3.0),
        "{c}"
    );
    assert_eq!(
        sample(
            &s,
            "istio_requests_total",
            &with(
                &[
                    &http[..],
                    &[
                        ("reporter", "destination"),
                        ("source_principal", CLIENT_ID),
                        ("destination_principal", SERVER_ID),
                        ("connection_security_policy", "mutual_tls"),
                    ]
                ]
                .concat()
            )
        ),
        Some(3.0),
        "{s}"
    );
    // TCP, through the metadata exchange on both ends of the mTLS connection.
    let tcp = [("request_protocol", "tcp")];
    for (text, labels) in [
        (
            &c,
            with(
                &[
                    &tcp[..],
                    &[
                        ("reporter", "source"),
                        ("source_principal", CLIENT_ID),
                        ("destination_principal", SERVER_ID),
                        ("destination_service", SERVICE),
                    ],
                ]
                .concat(),
            ),
        ),
        (
            &s,
            with(
                &[
                    &tcp[..],
                    &[
                        ("reporter", "destination"),
                        ("source_principal", CLIENT_ID),
                        ("connection_security_policy", "mutual_tls"),
                        // No service on the passthrough cluster: istio-proxy names it.
                        ("destination_service_name", "InboundPassthroughClusterIpv4"),
                    ],
                ]
                .concat(),
            ),
        ),
    ] {
        assert_eq!(
            sample(text, "istio_tcp_connections_opened_total", &labels),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            sample(text, "istio_tcp_received_bytes_total", &labels),
            Some(3500.0),
            "{text}"
        );
    }
    // Certificates came over SDS from each pod's own agent socket.
    for side in [&client_side, &server_side] {
        assert!(
            xds::acked(&side.sds, type_urls::SECRET, "s1", false, None),
            "{}",
            xds::describe(&side.sds.requests())
        );
    }
    capture.cleanup(&client);
    capture.cleanup(&server);
    drop(client_side);
    drop(server_side);
    ads.stop();
}
