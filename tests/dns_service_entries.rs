//! Seed 004 end to end (ServiceEntry and DNS capture): two MESH_EXTERNAL TCP
//! ServiceEntries on the same port, `a.external.test` and `b.external.test`, with no
//! address of their own. istiod auto-allocates each an address from 240.240.0.0/16,
//! sends the names in the NameTable, and writes one outbound listener per address. The
//! app, in a pod captured by eBPF with `--redirect-dns`, connects to each by name:
//! its resolver query is captured to shunt's DNS proxy, answered from the name table,
//! its connect to the allocated address is captured to 15001, and `virtualOutbound`
//! hands it to that address's listener, so each name reaches its own upstream although
//! both use port 9000. A name outside the mesh is forwarded by the proxy to the pod's
//! real resolver: the proxy's own query is not captured. State of the world and Delta,
//! and the iptables fallback.
//! Needs root, eBPF, dnsmasq.

mod support;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use harness::ads::{AdsServer, Any};
use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::nds::{NameTable, push, service_entry};
use support::xds::{self, bootstrap, eventually, unix_server};
use support::*;

const NDS: &str = support::nds::TYPE_URL;
const CDS: &str = harness::ads::type_urls::CLUSTER;
const LDS: &str = harness::ads::type_urls::LISTENER;
/// The ServiceEntries' port, and where their upstreams really listen.
const SERVICE_PORT: u16 = 9000;
const A_PORT: u16 = 9001;
const B_PORT: u16 = 9002;
/// istiod's auto-allocated addresses for the two hosts.
const A_VIP: &str = "240.240.0.1";
const B_VIP: &str = "240.240.0.2";
/// What the pod's real resolver answers for a name outside the mesh.
const UPSTREAM_ONLY: &str = "192.0.2.10";

fn any<M: prost::Message + prost::Name + Default>(value: Value) -> Any {
    let message: M = shunt::config::message_from_json(value).expect("valid resource");
    Any {
        type_url: M::type_url(),
        value: message.encode_to_vec(),
    }
}

fn tcp_proxy(cluster: &str) -> Value {
    json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": cluster, "cluster": cluster}})
}

fn socket_address(ip: impl ToString, port: u16) -> Value {
    json!({"socket_address": {"address": ip.to_string(), "port_value": port}})
}

/// What istiod pushes for the two ServiceEntries: clusters, listeners and the names.
fn push_mesh(server: &AdsServer, a: SocketAddr, b: SocketAddr) {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    let cluster = |name: &str, at: SocketAddr| {
        (
            name.to_owned(),
            any::<Cluster>(
                json!({"name": name, "type": "STATIC", "connect_timeout": "5s",
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": socket_address(at.ip(), at.port())}}]}]}}),
            ),
        )
    };
    let a_cluster = format!("outbound|{SERVICE_PORT}||a.external.test");
    let b_cluster = format!("outbound|{SERVICE_PORT}||b.external.test");
    server.set(
        CDS,
        "c1",
        vec![
            cluster(&a_cluster, a),
            cluster(&b_cluster, b),
            (
                "BlackHoleCluster".into(),
                any::<Cluster>(json!({"name": "BlackHoleCluster", "type": "STATIC",
                                      "connect_timeout": "1s"})),
            ),
        ],
    );
    let service_listener = |vip: &str, cluster: &str| {
        let name = format!("{vip}_{SERVICE_PORT}");
        (
            name.clone(),
            any::<Listener>(
                json!({"name": name, "address": socket_address(vip, SERVICE_PORT),
                "bind_to_port": false, "traffic_direction": "OUTBOUND",
                "filter_chains": [{"filters": [tcp_proxy(cluster)]}]}),
            ),
        )
    };
    server.set(
        LDS,
        "l1",
        vec![
            (
                "virtualOutbound".into(),
                any::<Listener>(json!({"name": "virtualOutbound",
                    "address": socket_address("0.0.0.0", 15001), "use_original_dst": true,
                    "traffic_direction": "OUTBOUND",
                    // REGISTRY_ONLY: a destination without a listener goes nowhere.
                    "filter_chains": [{"filters": [tcp_proxy("BlackHoleCluster")]}]})),
            ),
            service_listener(A_VIP, &a_cluster),
            service_listener(B_VIP, &b_cluster),
        ],
    );
    let table = NameTable {
        table: HashMap::from([
            ("a.external.test".to_owned(), service_entry(&[A_VIP])),
            ("b.external.test".to_owned(), service_entry(&[B_VIP])),
        ]),
    };
    push(server, "n1", &table);
}

/// dnsmasq as the pod's real resolver: `upstream-only.test`, nothing else.
fn start_resolver(pod: &Pod) -> PodProcess {
    let server = pod
        .command("dnsmasq")
        .args([
            "--keep-in-foreground",
            "--conf-file=/dev/null",
            "--no-resolv",
            "--no-hosts",
            "--bind-interfaces",
            "--port=53",
            "--log-queries",
            "--log-facility=-",
            "--pid-file=",
        ])
        .arg(format!("--listen-address={}", pod.ipv4()))
        .arg(format!("--address=/upstream-only.test/{UPSTREAM_ONLY}"))
        .spawn()
        .expect("start dnsmasq");
    wait_for_port(
        pod,
        SocketAddr::new(IpAddr::V4(pod.ipv4()), 53),
        Duration::from_secs(10),
    )
    .unwrap_or_else(|e| panic!("{e:#}\ndnsmasq: {}", server.stderr_text()));
    server
}

/// As the app: resolve each name with the C library and connect to it on the service
/// port; print, per name, the address it resolved to and the server's HELLO line.
const CLIENT: &str = r#"
import json, socket, sys
out = {}
for name in sys.argv[1:]:
    try:
        ip = socket.getaddrinfo(name, 9000, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as e:
        out[name] = {"error": "resolve: %s" % e}
        continue
    entry = {"ip": ip}
    if name != "upstream-only.test":
        try:
            s = socket.create_connection((name, 9000), timeout=10)
            entry["hello"] = s.makefile().readline().strip()
            s.close()
        except OSError as e:
            entry["error"] = "connect: %s" % e
    out[name] = entry
print(json.dumps(out))
"#;

fn run(backend: &'static str, delta: bool) {
    let tag = format!("seed004-{backend}-{}", if delta { "delta" } else { "sotw" });
    let tag = tag.as_str();
    let (dir, socket, server) = unix_server(tag);
    let mut node = Node::new().expect("node");
    let app = node.add_pod("app").expect("pod app");
    let resolver = node.add_pod("resolver").expect("pod resolver");
    let ext = node.add_pod("ext").expect("pod ext");
    let _upstreams = start_app(&ext, &[A_PORT, B_PORT]);
    let _dnsmasq = start_resolver(&resolver);
    let resolv_conf = dir.0.join("resolv.conf");
    std::fs::write(
        &resolv_conf,
        format!(
            "nameserver {}\noptions timeout:5 attempts:1\n",
            resolver.ipv4()
        ),
    )
    .unwrap();

    push_mesh(
        &server,
        SocketAddr::new(IpAddr::V4(ext.ipv4()), A_PORT),
        SocketAddr::new(IpAddr::V4(ext.ipv4()), B_PORT),
    );
    let capture = Capture::new(backend, tag);
    let out = capture
        .command(&app, &["--redirect-dns"])
        .resolv_conf(&resolv_conf)
        .output()
        .expect("run shunt capture");
    assert!(
        out.status.success(),
        "shunt capture --redirect-dns: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // The sidecar: as root it binds (15001, 15053), then runs as 1337, which capture
    // exempts, so its forwarded queries and upstream connections leave the pod.
    let config = bootstrap(&socket, delta);
    let path = dir.0.join("bootstrap.json");
    std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    let resolv = resolv_conf.display().to_string();
    let proxy = app
        .command(harness::shunt_bin())
        .env("ISTIO_META_DNS_CAPTURE", "true")
        .args(["proxy", "--dns-resolv-conf", &resolv, "-c"])
        .arg(&path)
        .spawn()
        .expect("start shunt proxy");
    for (type_url, version) in [(CDS, "c1"), (LDS, "l1"), (NDS, "n1")] {
        eventually(
            &format!("{type_url} {version} ACKed"),
            &proxy,
            &server,
            || xds::acked(&server, type_url, version, delta, None),
        );
    }

    let names = ["a.external.test", "b.external.test", "upstream-only.test"];
    let out = app
        .command("python3")
        .uid(APP_UID)
        .gid(APP_UID)
        .resolv_conf(&resolv_conf)
        .arg("-c")
        .arg(CLIENT)
        .args(names)
        .timeout(Duration::from_secs(60))
        .output()
        .expect("run the app's client");
    let text = String::from_utf8_lossy(&out.stdout);
    let seen: Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| {
        panic!(
            "client output {text:?} ({e}); stderr: {}\nshunt: {}",
            String::from_utf8_lossy(&out.stderr),
            proxy.stderr_text()
        )
    });
    let local_port = |name: &str| -> Option<u16> {
        let hello = seen[name]["hello"].as_str()?;
        let local = hello.split("local=").nth(1)?;
        local.parse::<SocketAddr>().ok().map(|a| a.port())
    };
    assert_eq!(
        seen["a.external.test"]["ip"],
        A_VIP,
        "{seen}\nshunt: {}",
        proxy.stderr_text()
    );
    assert_eq!(seen["b.external.test"]["ip"], B_VIP, "{seen}");
    assert_eq!(
        local_port("a.external.test"),
        Some(A_PORT),
        "a reaches its own upstream: {seen}\n{}",
        proxy.stderr_text()
    );
    assert_eq!(
        local_port("b.external.test"),
        Some(B_PORT),
        "b reaches its own upstream: {seen}\n{}",
        proxy.stderr_text()
    );
    // Outside the mesh: forwarded by the proxy to the pod's resolver.
    assert_eq!(seen["upstream-only.test"]["ip"], UPSTREAM_ONLY, "{seen}");

    // The kernel and the proxy agree on what happened.
    if backend == "ebpf" {
        let counters = capture.pod_counters(&app);
        assert!(
            counters.get("dns_captured_udp").copied().unwrap_or(0) >= 3,
            "{counters:?}"
        );
    }
    let stat = |name: &str| xds::stat_at(&app, xds::ADMIN, name).unwrap_or(0);
    assert!(stat("dns.answered_locally_total") >= 2);
    assert!(stat("dns.upstream_requests_total") >= 1);
    for cluster in ["a", "b"] {
        let name =
            format!("cluster.outbound|{SERVICE_PORT}||{cluster}.external.test.upstream_cx_total");
        assert_eq!(stat(&name), 1, "{name}");
    }
}

#[test]
fn service_entries_on_one_port_resolve_to_their_own_addresses_and_upstreams() {
    run("ebpf", false);
}

#[test]
fn service_entries_resolve_and_route_over_delta_xds_too() {
    run("ebpf", true);
}

/// The fallback: istio-iptables' DNS rules (REDIRECT to 15053, conntrack zones) and
/// its nat rules instead of the eBPF programs; the same outcome.
#[test]
fn service_entries_resolve_and_route_with_the_iptables_backend() {
    run("iptables", false);
}
