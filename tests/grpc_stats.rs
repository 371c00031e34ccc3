//! `envoy.filters.http.grpc_stats`, differential against Envoy 1.40: the same
//! bootstrap (but ports) in `shunt proxy -c` and Envoy in pod `proxy`, a grpcio
//! service (tests/support/grpc_echo.py) in pod `backends`, and the same table of
//! calls (unary, failing with a trailers-only answer, server, client and
//! bidirectional streams, an unknown method) from pod `client` through three
//! listeners: default stat names (`grpc.<stat>`), `stats_for_all_methods`
//! (`grpc.<service>.<method>.<stat>`), an `individual_method_stats_allowlist`, and
//! every method to a cluster with an `alt_stat_name` (its stats are under that name).
//! The calls' outcomes and every `cluster.*.grpc.*` counter must be equal.
//!
//! Needs root, Envoy and grpcio (`cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::socket_address;
use support::xds::admin_at;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const GRPC_PORT: u16 = 9300;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/support/grpc_echo.py");

fn h2_cluster(name: &str, at: SocketAddr) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(at.ip(), at.port())}}
        ]}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        }
    })
}

/// A listener at `port` with `grpc_stats` (`config`) in front of a route to `cluster`.
fn listener(port: u16, cluster: &str, config: Value) -> Value {
    let mut grpc_stats = config;
    grpc_stats["@type"] =
        json!("type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig");
    json!({
        "name": cluster,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": cluster,
                "codec_type": "AUTO",
                "http_filters": [
                    {"name": "envoy.filters.http.grpc_stats", "typed_config": grpc_stats},
                    {"name": "envoy.filters.http.router", "typed_config":
                        {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
                ],
                "route_config": {"name": cluster, "virtual_hosts": [{
                    "name": cluster, "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]
                }]}
            }
        }]}]
    })
}

/// Listeners at `base` (defaults), `base + 1` (every method), `base + 2` (an
/// allowlist: Unary and Chat), `base + 3` (every method, to a cluster with an
/// `alt_stat_name`), each to its own cluster of the one backend.
fn bootstrap(base: u16, admin: u16, backends: Ipv4Addr) -> Value {
    let at = SocketAddr::new(backends.into(), GRPC_PORT);
    let mut renamed = h2_cluster("renamed", at);
    renamed["alt_stat_name"] = json!("renamed_alt");
    json!({
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                listener(base, "plain", json!({"emit_filter_state": true})),
                listener(base + 1, "all", json!({"stats_for_all_methods": true})),
                listener(base + 2, "allow", json!({"individual_method_stats_allowlist":
                    {"services": [{"name": "test.Echo", "method_names": ["Unary", "Chat"]}]}})),
                listener(base + 3, "renamed", json!({"stats_for_all_methods": true})),
            ],
            "clusters": [h2_cluster("plain", at), h2_cluster("all", at), h2_cluster("allow", at),
                renamed]
        }
    })
}

struct Scene {
    _node: Node,
    proxy_pod: Pod,
    client: Pod,
    shunt: PodProcess,
    envoy: PodProcess,
    _backend: PodProcess,
    _dir: TempDir,
}

impl Scene {
    fn new() -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new("grpc-stats");
        let (python, path) = support::python_grpc();
        let backend = backends
            .command(&python)
            .args([SCRIPT, "serve", &GRPC_PORT.to_string()])
            .env("PYTHONPATH", &path)
            .spawn()
            .expect("start the gRPC service");
        let any6 = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, GRPC_PORT));
        wait_for_port(&backends, any6, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("gRPC service: {e}\n{}", backend.stderr_text()));
        let write = |name: &str, config: Value| {
            let file = dir.0.join(name);
            std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
            file
        };
        let shunt_config = write(
            "shunt.json",
            bootstrap(SHUNT_PORT, SHUNT_ADMIN, backends.ipv4()),
        );
        let envoy_config = write(
            "envoy.json",
            bootstrap(ENVOY_PORT, ENVOY_ADMIN, backends.ipv4()),
        );
        let (shunt, envoy) = support::envoy::start_side_by_side(
            &proxy_pod,
            &shunt_config,
            &envoy_config,
            [SHUNT_PORT + 3, ENVOY_PORT + 3],
        );
        Scene {
            _node: node,
            proxy_pod,
            client,
            shunt,
            envoy,
            _backend: backend,
            _dir: dir,
        }
    }

    /// The table of calls through the proxy at `port`: one JSON line each.
    fn calls(&self, port: u16) -> Vec<Value> {
        let (python, path) = support::python_grpc();
        let target = format!("{}:{port}", self.proxy_pod.ipv4());
        let out = self
            .client
            .command(&python)
            .args([SCRIPT, "call", &target])
            .env("PYTHONPATH", &path)
            .output()
            .expect("run the gRPC client");
        assert!(
            out.status.success(),
            "the gRPC client through {target} failed: {}\nshunt: {}",
            String::from_utf8_lossy(&out.stderr),
            self.shunt.stderr_text()
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

/// Every `cluster.*.grpc.*` counter that is not zero.
fn grpc_stats(pod: &Pod, admin: u16) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, &format!("127.0.0.1:{admin}"), "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .filter(|(name, value)| {
            *value > 0 && name.starts_with("cluster.") && name.contains(".grpc.")
        })
        .collect()
}

#[test]
fn grpc_calls_and_messages_are_counted_as_envoy_counts_them() {
    let s = Scene::new();
    for listener in 0..4 {
        let envoy = s.calls(ENVOY_PORT + listener);
        let shunt = s.calls(SHUNT_PORT + listener);
        assert_eq!(envoy.len(), 9, "{envoy:?}");
        assert_eq!(
            shunt,
            envoy,
            "listener {listener}: the calls' outcomes differ\nshunt stderr:\n{}",
            s.shunt.stderr_text()
        );
    }
    let envoy = grpc_stats(&s.proxy_pod, ENVOY_ADMIN);
    let shunt = grpc_stats(&s.proxy_pod, SHUNT_ADMIN);
    // What Envoy counts, so that a table that counts nothing cannot pass.
    for (name, value) in [
        ("cluster.plain.grpc.total", 9),
        ("cluster.plain.grpc.success", 6),
        ("cluster.plain.grpc.14", 1),
        ("cluster.all.grpc.test.Echo.Unary.total", 4),
        (
            "cluster.all.grpc.test.Echo.ServerStream.response_message_count",
            3,
        ),
        (
            "cluster.all.grpc.test.Echo.ClientStream.request_message_count",
            4,
        ),
        (
            "cluster.allow.grpc.test.Echo.Chat.response_message_count",
            2,
        ),
        ("cluster.renamed_alt.grpc.test.Echo.Unary.total", 4),
    ] {
        assert_eq!(envoy.get(name), Some(&value), "Envoy's {name}: {envoy:#?}");
    }
    assert_eq!(
        shunt,
        envoy,
        "gRPC stats differ\nshunt stderr:\n{}\nenvoy stderr:\n{}",
        s.shunt.stderr_text(),
        s.envoy.stderr_text()
    );
}
