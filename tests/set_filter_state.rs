//! `set_filter_state`, network and HTTP, differential against Envoy 1.40: the same
//! bootstrap (but ports) in `shunt proxy -c` and Envoy in pod `proxy`, backends in
//! pod `backends`, the same requests and connections from pod `client`.
//!
//! What the values do is observed through what reads them:
//! - HTTP (`base`): `on_request_headers` renders `%REQ(...)%` into objects an HTTP
//!   RBAC filter's `filter_state` principals match; the status says which matched.
//! - network (`base + 1`): `on_new_connection` sets `envoy.tcp_proxy.cluster`, so
//!   `tcp_proxy` connects to backend B instead of its configured A, and
//!   `%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%` into an object a network RBAC filter
//!   allows; `base + 2` is the same with an RBAC that wants another address, so
//!   the connection is closed before any upstream.
//! - sharing with the upstream (`base + 3..=5`): `x.tag` set with `ONCE` or
//!   `TRANSITIVE`, then one or two internal listener hops (`internal_upstream`) to an
//!   internal listener whose network RBAC wants `x.tag`: `ONCE` reaches the first hop
//!   only, `TRANSITIVE` every hop.
//!
//! Needs root and Envoy (`cargo xtask setup`).

mod support;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::socket_address;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const HTTP_PORT: u16 = 8081;
const TCP_A: u16 = 9001;
const TCP_B: u16 = 9002;

/// Answers every HTTP request 200 "ok".
const HTTP_SERVER: &str = r#"
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self):
        n = int(self.headers.get("content-length") or 0)
        if n:
            self.rfile.read(n)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Ok).serve_forever()
"#;

/// Answers a connection's first bytes with its name (argv[2]) and closes it (it
/// speaks second: network RBAC decides on the client's first bytes).
const TCP_SERVER: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
while True:
    c, _ = s.accept()
    try:
        c.recv(100)
        c.sendall(sys.argv[2].encode())
    except OSError:
        # A proxy that connected before its RBAC closed the downstream resets us.
        pass
    c.close()
"#;

fn cluster(name: &str, ip: Ipv4Addr, port: u16) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(ip, port)}}
        ]}]}
    })
}

/// A `FilterStateValue`: `key` from `format`, made by `factory` (empty: the key's).
fn value(key: &str, format: &str, factory: &str) -> Value {
    let mut v = json!({
        "object_key": key,
        "format_string": {"text_format_source": {"inline_string": format}}
    });
    if !factory.is_empty() {
        v["factory_key"] = json!(factory);
    }
    v
}

fn filter_state_principal(key: &str, exact: &str) -> Value {
    json!({"filter_state": {"key": key, "string_match": {"exact": exact}}})
}

fn rbac_allow(principals: Vec<Value>) -> Value {
    json!({"action": "ALLOW", "policies": {"by-filter-state": {
        "permissions": [{"any": true}],
        "principals": principals
    }}})
}

fn http_listener(port: u16) -> Value {
    let set_filter_state = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
        "on_request_headers": [
            value("x.tenant", "%REQ(x-tenant)%", "envoy.string"),
            value("x.call", "%REQ(:METHOD)% %REQ(:PATH)% %REQ(x-a?x-b):4%", "envoy.string"),
        ]
    });
    let mut rbac = json!({"rules": rbac_allow(vec![
        filter_state_principal("x.tenant", "gold"),
        filter_state_principal("x.call", "POST /admin bron"),
    ])});
    rbac["@type"] = json!("type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC");
    json!({
        "name": "http",
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "sfs",
                "codec_type": "AUTO",
                "http_filters": [
                    {"name": "envoy.filters.http.set_filter_state", "typed_config": set_filter_state},
                    {"name": "envoy.filters.http.rbac", "typed_config": rbac},
                    {"name": "envoy.filters.http.router", "typed_config":
                        {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}
                ],
                "route_config": {"name": "sfs", "virtual_hosts": [{
                    "name": "sfs", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "http"}}]
                }]}
            }
        }]}]
    })
}

/// `tcp_proxy` to A, but `set_filter_state` sends it to B; network RBAC allows the
/// connection when the remote address rendered into `x.src` is `allowed`.
fn tcp_listener(name: &str, port: u16, allowed: Ipv4Addr) -> Value {
    let mut rbac = json!({"stat_prefix": name, "rules": rbac_allow(vec![
        filter_state_principal("x.src", &allowed.to_string()),
    ])});
    rbac["@type"] = json!("type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC");
    json!({
        "name": name,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.set_filter_state", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.set_filter_state.v3.Config",
                "on_new_connection": [
                    value("envoy.tcp_proxy.cluster", "tcp_b", ""),
                    value("x.src", "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%", "envoy.string"),
                ]
            }},
            {"name": "envoy.filters.network.rbac", "typed_config": rbac},
            {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": name, "cluster": "tcp_a"
            }}
        ]}]
    })
}

/// A cluster of one internal listener, reached through the `internal_upstream` socket.
fn internal_cluster(name: &str, listener: &str) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "transport_socket": {"name": "internal_upstream", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport",
            "transport_socket": {"name": "raw_buffer", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}
        }},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": listener}}}}
        ]}]}
    })
}

fn tcp_proxy(name: &str, cluster: &str) -> Value {
    json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": name, "cluster": cluster
    }})
}

/// A listener at `port` that sets `x.tag` shared with the upstream as `sharing`
/// (`ONCE`, `TRANSITIVE`), then goes to `cluster`.
fn sharing_listener(name: &str, port: u16, sharing: &str, cluster: &str) -> Value {
    let mut tag = value("x.tag", "t", "envoy.string");
    tag["shared_with_upstream"] = json!(sharing);
    json!({
        "name": name,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.set_filter_state", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.set_filter_state.v3.Config",
                "on_new_connection": [tag]
            }},
            tcp_proxy(name, cluster)
        ]}]
    })
}

/// The internal listeners: `hop` passes through to `guarded`, whose network RBAC wants
/// `x.tag` before it connects to backend A.
fn internal_listeners() -> Vec<Value> {
    let mut rbac = json!({"stat_prefix": "guarded", "rules": rbac_allow(vec![
        filter_state_principal("x.tag", "t"),
    ])});
    rbac["@type"] = json!("type.googleapis.com/envoy.extensions.filters.network.rbac.v3.RBAC");
    vec![
        json!({"name": "hop", "internal_listener": {},
            "filter_chains": [{"filters": [tcp_proxy("hop", "to_guarded")]}]}),
        json!({"name": "guarded", "internal_listener": {},
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.rbac", "typed_config": rbac},
            tcp_proxy("guarded", "tcp_a")
        ]}]}),
    ]
}

fn bootstrap(base: u16, admin: u16, backends: Ipv4Addr, client: Ipv4Addr) -> Value {
    json!({
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                http_listener(base),
                tcp_listener("tcp_allowed", base + 1, client),
                tcp_listener("tcp_denied", base + 2, Ipv4Addr::new(10, 255, 255, 255)),
                sharing_listener("once_one_hop", base + 3, "ONCE", "to_guarded"),
                sharing_listener("once_two_hops", base + 4, "ONCE", "to_hop"),
                sharing_listener("transitive_two_hops", base + 5, "TRANSITIVE", "to_hop"),
                internal_listeners()[0],
                internal_listeners()[1],
            ],
            "clusters": [
                cluster("http", backends, HTTP_PORT),
                cluster("tcp_a", backends, TCP_A),
                cluster("tcp_b", backends, TCP_B),
                internal_cluster("to_hop", "hop"),
                internal_cluster("to_guarded", "guarded"),
            ]
        },
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"}}]
    })
}

struct Scene {
    _node: Node,
    proxy_pod: Pod,
    client: Pod,
    shunt: PodProcess,
    envoy: PodProcess,
    _backends: Vec<PodProcess>,
    _dir: TempDir,
}

impl Scene {
    fn new() -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new("set-filter-state");
        let python = |args: &[&str]| {
            backends
                .command("/usr/bin/python3")
                .args(args)
                .spawn()
                .expect("start a backend")
        };
        let servers = vec![
            python(&["-c", HTTP_SERVER, &HTTP_PORT.to_string()]),
            python(&["-c", TCP_SERVER, &TCP_A.to_string(), "A"]),
            python(&["-c", TCP_SERVER, &TCP_B.to_string(), "B"]),
        ];
        for (port, process) in [HTTP_PORT, TCP_A, TCP_B].into_iter().zip(&servers) {
            wait_for_port(
                &backends,
                SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_secs(20),
            )
            .unwrap_or_else(|e| panic!("backend {port}: {e}\n{}", process.stderr_text()));
        }
        let write = |name: &str, config: Value| {
            let file = dir.0.join(name);
            std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
            file
        };
        let (b, c) = (backends.ipv4(), client.ipv4());
        let shunt_config = write("shunt.json", bootstrap(SHUNT_PORT, SHUNT_ADMIN, b, c));
        let envoy_config = write("envoy.json", bootstrap(ENVOY_PORT, ENVOY_ADMIN, b, c));
        let (shunt, envoy) = support::envoy::start_side_by_side(
            &proxy_pod,
            &shunt_config,
            &envoy_config,
            [SHUNT_PORT + 5, ENVOY_PORT + 5],
        );
        Scene {
            _node: node,
            proxy_pod,
            client,
            shunt,
            envoy,
            _backends: servers,
            _dir: dir,
        }
    }

    /// The status of a curl from the client pod.
    fn status(&self, port: u16, method: &str, path: &str, headers: &[&str]) -> u16 {
        let url = format!("http://{}:{port}{path}", self.proxy_pod.ipv4());
        let mut args: Vec<&str> = vec!["-s", "-o", "/dev/null", "-w", "%{http_code}"];
        args.extend(["--max-time", "10", "-X", method]);
        for h in headers {
            args.extend(["-H", h]);
        }
        let command = self.client.command("curl").args(args);
        let out = command.arg(&url).output().expect("run curl");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }

    /// What a TCP connection from the client pod reads before it is closed.
    fn tcp(&self, port: u16) -> String {
        let at = SocketAddr::new(self.proxy_pod.ipv4().into(), port);
        self.client
            .run_in_netns(move || {
                let mut stream = TcpStream::connect_timeout(&at, Duration::from_secs(5))?;
                stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                let _ = stream.write_all(b"hello");
                let mut got = Vec::new();
                // A reset (denied) reads as what came before it: nothing.
                let _ = stream.read_to_end(&mut got);
                Ok::<_, std::io::Error>(String::from_utf8_lossy(&got).into_owned())
            })
            .expect("enter the client pod")
            // A reset before anything was read reads as nothing too.
            .unwrap_or_default()
    }
}

#[test]
fn filter_state_values_steer_rbac_and_tcp_proxy_as_in_envoy() {
    let s = Scene::new();
    // (method, path, headers, Envoy's status)
    let requests: &[(&str, &str, &[&str], u16)] = &[
        ("GET", "/", &["x-tenant: gold"], 200),
        ("GET", "/", &["x-tenant: silver"], 403),
        ("GET", "/", &[], 403),
        ("POST", "/admin", &["x-b: bronze"], 200),
        ("POST", "/admin", &["x-a: bronze"], 200),
        ("POST", "/admin", &["x-b: bro"], 403),
        ("POST", "/admin?q", &["x-b: bronze"], 403),
    ];
    let mut differences = Vec::new();
    for (method, path, headers, status) in requests {
        let envoy = s.status(ENVOY_PORT, method, path, headers);
        let shunt = s.status(SHUNT_PORT, method, path, headers);
        assert_eq!(
            envoy, *status,
            "{method} {path} {headers:?}: Envoy answered {envoy}"
        );
        if envoy != shunt {
            differences.push(format!(
                "{method} {path} {headers:?}: envoy {envoy}, shunt {shunt}"
            ));
        }
    }
    for (listener, expected) in [(1, "B"), (2, ""), (3, "A"), (4, ""), (5, "A")] {
        let envoy = s.tcp(ENVOY_PORT + listener);
        let shunt = s.tcp(SHUNT_PORT + listener);
        assert_eq!(envoy, expected, "Envoy's listener {listener}");
        if envoy != shunt {
            differences.push(format!(
                "tcp listener {listener}: envoy {envoy:?}, shunt {shunt:?}"
            ));
        }
    }
    assert!(
        differences.is_empty(),
        "{} differences from Envoy:\n{}\nshunt stderr:\n{}\nenvoy stderr:\n{}",
        differences.len(),
        differences.join("\n"),
        s.shunt.stderr_text(),
        s.envoy.stderr_text()
    );
}
