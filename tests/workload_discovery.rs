//! Istio's workload discovery (WDS) feeding peer metadata and Istio's metrics: a shunt
//! whose bootstrap has `istio.workload.BootstrapExtension` (ADS, Delta, as pilot-agent
//! writes it) learns `istio.workload.Workload` resources for two pods' addresses from
//! the test ADS server (Delta and state of the world). Its inbound listener (peer_metadata `downstream_discovery:
//! [workload_discovery]`, `istio.stats`) gets plain HTTP with no metadata headers from
//! the `sleep` pod, and its outbound listener (`upstream_discovery:
//! [workload_discovery]`) sends to the `ratings` pod: `istio_requests_total` must carry
//! the source and destination workloads, apps, versions and principals WDS gave for
//! those addresses. Then the server changes one workload and removes the other, and the
//! next requests' labels follow (unknown once removed); a workload with a 3-byte address
//! is NACKed by name while the rest of its response applies. Needs root.

mod support;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use harness::ads::{AdsServer, Any};
use harness::{Node, Pod, PodProcess, testapp_bin, wait_for_port};
use prost::Message;
use serde_json::{Value, json};
use shunt::peer::workload_discovery::{TYPE_URL, WorkloadResource};
use support::envoy::socket_address;
use support::xds::{acked, admin_at, eventually, pipe_cluster, start_shunt, unix_server};

const ADMIN: &str = "127.0.0.1:15000";
const OUTBOUND: u16 = 15001;
const INBOUND: u16 = 15006;
/// The app behind the inbound listener, in the proxy's pod.
const LOCAL_APP: u16 = 8081;
/// The app in the ratings pod, the outbound listener's upstream.
const RATINGS_APP: u16 = 8080;

fn peer_metadata(fields: Value) -> Value {
    json!({"name": "istio.metadata_exchange", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/io.istio.http.peer_metadata.Config",
        "value": fields
    }})
}

fn http_listener(
    name: &str,
    direction: &str,
    address: Value,
    metadata: Value,
    cluster: &str,
) -> Value {
    json!({
        "name": name,
        "traffic_direction": direction,
        "address": address,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": name,
            "http_filters": [
                peer_metadata(metadata),
                {"name": "istio.stats", "typed_config": {"@type": "type.googleapis.com/stats.PluginConfig"}},
                {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
            ],
            "route_config": {"name": name, "virtual_hosts": [{"name": "all", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]}]}
        }}]}]
    })
}

fn static_cluster(name: &str, address: SocketAddr) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": socket_address(address.ip(), address.port())}}]}]}
    })
}

/// The proxy pod's sidecar: Istio-shaped static listeners, ADS (Delta) over a Unix
/// socket for workloads only, and the bootstrap extension as pilot-agent writes it.
fn bootstrap(socket: &std::path::Path, ratings: IpAddr, delta: bool) -> Value {
    json!({
        "node": {"id": "sidecar~10.0.0.3~productpage-0.web~web.svc.cluster.local", "cluster": "productpage.web",
                 "metadata": {"NAME": "productpage-0", "NAMESPACE": "web", "WORKLOAD_NAME": "productpage",
                              "CLUSTER_ID": "Kubernetes",
                              "LABELS": {"app": "productpage", "version": "v1"}}},
        "admin": {"address": socket_address("127.0.0.1", 15000)},
        "dynamic_resources": {"ads_config": {
            "api_type": if delta { "DELTA_GRPC" } else { "GRPC" }, "transport_api_version": "V3",
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
        }},
        "bootstrap_extensions": [{"name": "metadata_discovery", "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
            "value": {"config_source": {"ads": {}}}
        }}],
        "static_resources": {
            "listeners": [
                http_listener("virtualInbound", "INBOUND", socket_address("0.0.0.0", INBOUND),
                    json!({"downstream_discovery": [{"workload_discovery": {}}]}), "inbound|8081||"),
                http_listener("virtualOutbound", "OUTBOUND", socket_address("127.0.0.1", OUTBOUND),
                    json!({"upstream_discovery": [{"workload_discovery": {}}]}), "outbound|8080||ratings")
            ],
            "clusters": [
                static_cluster("inbound|8081||", SocketAddr::from(([127, 0, 0, 1], LOCAL_APP))),
                static_cluster("outbound|8080||ratings", SocketAddr::new(ratings, RATINGS_APP)),
                pipe_cluster("xds-grpc", socket)
            ]
        }
    })
}

fn workload(uid: &str, address: &[u8], fields: WorkloadResource) -> (String, Any) {
    let resource = WorkloadResource {
        uid: uid.into(),
        addresses: vec![address.to_vec()],
        ..fields
    };
    (
        uid.to_owned(),
        Any {
            type_url: TYPE_URL.into(),
            value: resource.encode_to_vec(),
        },
    )
}

fn sleep_pod(pod: &Pod, version: &str) -> (String, Any) {
    let ip = pod.ipv4();
    workload(
        "Kubernetes//Pod/foo/sleep-7d9c",
        &ip.octets(),
        WorkloadResource {
            name: "sleep-7d9c".into(),
            namespace: "foo".into(),
            service_account: "sleep".into(),
            canonical_name: "sleep".into(),
            canonical_revision: version.into(),
            workload_name: "sleep".into(),
            cluster_id: "Kubernetes".into(),
            ..Default::default()
        },
    )
}

fn ratings_pod(pod: &Pod) -> (String, Any) {
    let ip = pod.ipv4();
    workload(
        "Kubernetes//Pod/bar/ratings-v2-5f",
        &ip.octets(),
        WorkloadResource {
            name: "ratings-v2-5f".into(),
            namespace: "bar".into(),
            trust_domain: "td.example".into(),
            service_account: "ratings".into(),
            canonical_name: "ratings".into(),
            canonical_revision: "v2".into(),
            workload_name: "ratings-v2".into(),
            cluster_id: "Kubernetes".into(),
            workload_type: 0,
            ..Default::default()
        },
    )
}

/// A plain GET (no peer metadata headers) from inside `pod` to `target`: the status.
fn get(pod: &Pod, target: SocketAddr) -> u16 {
    pod.run_in_netns(move || {
        let mut s = TcpStream::connect(target).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: svc\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        String::from_utf8_lossy(&raw)
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    })
    .unwrap()
}

/// `istio_requests_total` summed over the samples carrying every one of `labels`.
fn requests(pod: &Pod, labels: &[(&str, &str)]) -> u64 {
    let (status, text) = admin_at(pod, ADMIN, "/stats/prometheus");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .filter(|l| l.starts_with("istio_requests_total{"))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn push(server: &AdsServer, version: &str, workloads: Vec<(String, Any)>) {
    server.set(TYPE_URL, version, workloads);
}

fn wait_acked(proxy: &PodProcess, server: &AdsServer, version: &str, delta: bool) {
    eventually(&format!("workloads {version} ACKed"), proxy, server, || {
        acked(server, TYPE_URL, version, delta, None)
    });
}

#[test]
fn workload_discovery_over_delta_ads_names_the_peers_of_plain_http_and_follows_updates() {
    peers_of_plain_http_follow_workload_discovery(true);
}

#[test]
fn workload_discovery_over_state_of_the_world_ads_does_the_same() {
    peers_of_plain_http_follow_workload_discovery(false);
}

fn peers_of_plain_http_follow_workload_discovery(delta: bool) {
    let mut net = Node::new().expect("node");
    let sleep = net.add_pod("sleep").expect("pod sleep");
    let proxy_pod = net.add_pod("productpage").expect("pod productpage");
    let ratings = net.add_pod("ratings").expect("pod ratings");
    let _local_app = proxy_pod
        .command(testapp_bin())
        .args([
            "serve",
            "--mode",
            "http",
            "--listen",
            &format!("127.0.0.1:{LOCAL_APP}"),
        ])
        .spawn()
        .expect("local app");
    let _ratings_app = ratings
        .command(testapp_bin())
        .args([
            "serve",
            "--mode",
            "http",
            "--listen",
            &format!("0.0.0.0:{RATINGS_APP}"),
        ])
        .spawn()
        .expect("ratings app");
    let (dir, socket, server) = unix_server(if delta { "wds-delta" } else { "wds-sotw" });
    push(
        &server,
        "v1",
        vec![sleep_pod(&sleep, "v1"), ratings_pod(&ratings)],
    );
    let config = bootstrap(&socket, IpAddr::from(ratings.ipv4()), delta);
    let proxy = start_shunt(
        &proxy_pod,
        &dir.0.join("bootstrap.json"),
        &config,
        &["--concurrency", "1"],
    );
    for port in [INBOUND, OUTBOUND] {
        wait_for_port(&proxy_pod, support::local(port), Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("port {port}: {e}\n{}", proxy.stderr_text()));
    }
    wait_for_port(
        &ratings,
        support::local(RATINGS_APP),
        Duration::from_secs(10),
    )
    .unwrap();
    wait_acked(&proxy, &server, "v1", delta);
    assert_eq!(
        support::xds::stat_at(&proxy_pod, ADMIN, "workload_discovery.total"),
        Some(2)
    );

    let inbound = SocketAddr::new(IpAddr::from(proxy_pod.ipv4()), INBOUND);
    let outbound = support::local(OUTBOUND);
    assert_eq!(get(&sleep, inbound), 200, "{}", proxy.stderr_text());
    assert_eq!(get(&proxy_pod, outbound), 200, "{}", proxy.stderr_text());
    let source_v1 = [
        ("reporter", "destination"),
        ("source_workload", "sleep"),
        ("source_workload_namespace", "foo"),
        ("source_canonical_service", "sleep"),
        ("source_canonical_revision", "v1"),
        ("source_app", "sleep"),
        ("source_version", "v1"),
        ("source_cluster", "Kubernetes"),
        ("source_principal", "spiffe://cluster.local/ns/foo/sa/sleep"),
        ("destination_workload", "productpage"),
        ("connection_security_policy", "none"),
        ("response_code", "200"),
    ];
    assert_eq!(
        requests(&proxy_pod, &source_v1),
        1,
        "{}",
        admin_at(&proxy_pod, ADMIN, "/stats/prometheus").1
    );
    let destination_ratings = [
        ("reporter", "source"),
        ("source_workload", "productpage"),
        ("destination_workload", "ratings-v2"),
        ("destination_workload_namespace", "bar"),
        ("destination_canonical_service", "ratings"),
        ("destination_app", "ratings"),
        ("destination_version", "v2"),
        (
            "destination_principal",
            "spiffe://td.example/ns/bar/sa/ratings",
        ),
        ("response_code", "200"),
    ];
    assert_eq!(
        requests(&proxy_pod, &destination_ratings),
        1,
        "{}",
        admin_at(&proxy_pod, ADMIN, "/stats/prometheus").1
    );

    // sleep moves to v2; ratings goes away (a Delta removal by uid, or left out of the
    // state of the world).
    push(&server, "v2", vec![sleep_pod(&sleep, "v2")]);
    wait_acked(&proxy, &server, "v2", delta);
    assert_eq!(get(&sleep, inbound), 200);
    assert_eq!(get(&proxy_pod, outbound), 200);
    let mut source_v2 = source_v1;
    source_v2[4] = ("source_canonical_revision", "v2");
    source_v2[6] = ("source_version", "v2");
    assert_eq!(requests(&proxy_pod, &source_v2), 1);
    assert_eq!(
        requests(&proxy_pod, &source_v1),
        1,
        "the first request keeps its labels"
    );
    let unknown_destination = [
        ("reporter", "source"),
        ("destination_workload", "unknown"),
        ("destination_app", "unknown"),
        ("destination_principal", "unknown"),
        ("response_code", "200"),
    ];
    assert_eq!(requests(&proxy_pod, &unknown_destination), 1);
    assert_eq!(requests(&proxy_pod, &destination_ratings), 1);

    // A workload whose address is 3 bytes is NACKed by name; ratings in the same
    // response is applied.
    push(
        &server,
        "v3",
        vec![
            sleep_pod(&sleep, "v2"),
            ratings_pod(&ratings),
            workload(
                "Kubernetes//Pod/foo/broken",
                &[10, 0, 0],
                WorkloadResource::default(),
            ),
        ],
    );
    eventually("the bad workload NACKed", &proxy, &server, || {
        server.requests().iter().any(|r| {
            r.type_url == TYPE_URL
                && r.error_detail.as_ref().is_some_and(|(_, message)| {
                    message.contains(
                        "Workload \"Kubernetes//Pod/foo/broken\": addresses[0] is 3 bytes",
                    )
                })
        })
    });
    assert_eq!(get(&proxy_pod, outbound), 200);
    assert_eq!(requests(&proxy_pod, &destination_ratings), 2);

    // With the workload stream in, /config_dump still answers.
    let (status, dump) = admin_at(&proxy_pod, ADMIN, "/config_dump");
    assert_eq!(status, 200, "{dump}");
    assert!(serde_json::from_str::<Value>(&dump).is_ok(), "{dump}");
}
