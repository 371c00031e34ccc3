//! The ALPN an upstream TLS connection offers, overridden per request: Istio's
//! `istio.alpn` HTTP filter and a `set_filter_state` of
//! `envoy.network.application_protocols`. The backend (pod `backends`) is a TLS
//! server that answers every request with the ALPN protocol it negotiated
//! (`none` without one; Envoy's HTTP/1.1 pool offers `http/1.1` when nothing else
//! is asked for); it prefers Istio's protocols, so what it answers is what
//! the proxy offered first of them.
//!
//! The same bootstrap (but ports) runs in `shunt proxy -c` and Envoy 1.40. Envoy has
//! no `istio.alpn` (an istio-proxy extension): the filter is `is_optional`, so
//! Envoy leaves it out and those listeners say what a proxy without it does, while
//! shunt's must show the override. The `set_filter_state` and plain listeners are
//! compared with Envoy.
//!
//! Needs root and Envoy (`cargo xtask setup`).

mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::socket_address;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const TLS_PORT: u16 = 8443;

/// Answers each HTTP/1.1 request on a TLS connection with the ALPN negotiated.
const TLS_SERVER: &str = r#"
import socket, ssl, sys, threading
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[2], sys.argv[3])
ctx.set_alpn_protocols(["istio-http/1.0", "istio-http/1.1", "istio-h2", "istio", "http/1.1"])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
def serve(raw):
    try:
        c = ctx.wrap_socket(raw, server_side=True)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                return
            data += chunk
        body = (c.selected_alpn_protocol() or "none").encode()
        c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        c.close()
    except Exception as e:
        print("tls server:", e, file=sys.stderr, flush=True)
while True:
    raw, _ = s.accept()
    threading.Thread(target=serve, args=(raw,), daemon=True).start()
"#;

const ISTIO_ALPN: &str = "istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig";

fn tls_cluster(name: &str, ip: Ipv4Addr, istio_alpn_off: bool) -> Value {
    let mut c = json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(ip, TLS_PORT)}}
        ]}]},
        "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {}
        }}
    });
    if istio_alpn_off {
        c["metadata"] = json!({"filter_metadata": {"istio": {"alpn_override": "false"}}});
    }
    c
}

/// A listener at `port` with `filters` in front of a route to `cluster`.
fn listener(port: u16, cluster: &str, filters: Vec<Value>) -> Value {
    let mut http_filters = filters;
    http_filters.push(json!({"name": "envoy.filters.http.router", "typed_config":
        {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}));
    json!({
        "name": format!("l{port}"),
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": format!("l{port}"),
                "codec_type": "AUTO",
                // One case asks over HTTP/1.0, which Envoy's codec otherwise refuses.
                "http_protocol_options": {"accept_http_10": true},
                "http_filters": http_filters,
                "route_config": {"name": "r", "virtual_hosts": [{
                    "name": "r", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]
                }]}
            }
        }]}]
    })
}

/// Istio's `istio.alpn` as istiod writes it, optional so that Envoy may skip it.
fn istio_alpn() -> Value {
    json!({"name": "istio.alpn", "is_optional": true, "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": format!("type.googleapis.com/{ISTIO_ALPN}"),
        "value": {"alpn_override": [
            {"alpn_override": ["istio-http/1.0", "istio", "http/1.0"]},
            {"upstream_protocol": "HTTP11", "alpn_override": ["istio-http/1.1", "istio", "http/1.1"]},
            {"upstream_protocol": "HTTP2", "alpn_override": ["istio-h2", "istio", "h2"]}
        ]}
    }})
}

fn set_application_protocols(list: &str) -> Value {
    json!({"name": "envoy.filters.http.set_filter_state", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
        "on_request_headers": [{
            "object_key": "envoy.network.application_protocols",
            "format_string": {"text_format_source": {"inline_string": list}}
        }]
    }})
}

/// Listeners: `base` none, `base + 1` set_filter_state, `base + 2` istio.alpn,
/// `base + 3` istio.alpn to a cluster whose metadata turns it off.
fn bootstrap(base: u16, admin: u16, backends: Ipv4Addr) -> Value {
    json!({
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                listener(base, "tls", vec![]),
                listener(base + 1, "tls", vec![set_application_protocols("istio,istio-h2")]),
                listener(base + 2, "tls", vec![istio_alpn()]),
                listener(base + 3, "tls_off", vec![istio_alpn()]),
            ],
            "clusters": [tls_cluster("tls", backends, false), tls_cluster("tls_off", backends, true)]
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
        let dir = TempDir::new("upstream-alpn");
        let (cert, key) = (dir.0.join("cert.pem"), dir.0.join("key.pem"));
        let made = std::process::Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            ])
            .args(["-subj", "/CN=backend", "-keyout"])
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("run openssl");
        assert!(
            made.status.success(),
            "{}",
            String::from_utf8_lossy(&made.stderr)
        );
        let backend = backends
            .command("/usr/bin/python3")
            .args(["-c", TLS_SERVER, &TLS_PORT.to_string()])
            .arg(&cert)
            .arg(&key)
            .spawn()
            .expect("start the TLS backend");
        wait_for_port(
            &backends,
            SocketAddr::from(([127, 0, 0, 1], TLS_PORT)),
            Duration::from_secs(20),
        )
        .unwrap_or_else(|e| panic!("TLS backend: {e}\n{}", backend.stderr_text()));
        let write = |name: &str, config: Value| {
            let file = dir.0.join(name);
            std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
            file
        };
        let b = backends.ipv4();
        let shunt_config = write("shunt.json", bootstrap(SHUNT_PORT, SHUNT_ADMIN, b));
        let envoy_config = write("envoy.json", bootstrap(ENVOY_PORT, ENVOY_ADMIN, b));
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

    /// The body of a GET through the proxy at `port`: the ALPN the backend negotiated.
    fn alpn(&self, port: u16, http10: bool) -> String {
        let url = format!("http://{}:{port}/", self.proxy_pod.ipv4());
        let version = if http10 { "--http1.0" } else { "--http1.1" };
        let out = self
            .client
            .command("curl")
            .args(["-s", "-S", "--max-time", "10", version, &url])
            .output()
            .expect("run curl");
        assert!(
            out.status.success(),
            "curl {url}: {}\nshunt: {}\nenvoy: {}",
            String::from_utf8_lossy(&out.stderr),
            self.shunt.stderr_text(),
            self.envoy.stderr_text()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

#[test]
fn upstream_tls_offers_the_alpn_the_filters_ask_for() {
    let s = Scene::new();
    // Compared with Envoy: no override (the HTTP/1.1 pool offers its own protocol
    // when the TLS context has no ALPN), and set_filter_state's list.
    for (offset, expected) in [(0, "http/1.1"), (1, "istio-h2")] {
        let envoy = s.alpn(ENVOY_PORT + offset, false);
        assert_eq!(envoy, expected, "Envoy's listener {offset}");
        assert_eq!(
            s.alpn(SHUNT_PORT + offset, false),
            envoy,
            "listener {offset}: shunt offered other ALPN than Envoy\n{}",
            s.shunt.stderr_text()
        );
    }
    // Envoy has no istio.alpn: it skips the optional filter.
    assert_eq!(s.alpn(ENVOY_PORT + 2, false), "http/1.1");
    // shunt applies it: the HTTP/1.1 cluster gets Istio's HTTP/1.1 list, whatever
    // the downstream's version (the cluster, not the downstream, speaks HTTP/1.1).
    assert_eq!(s.alpn(SHUNT_PORT + 2, false), "istio-http/1.1");
    assert_eq!(s.alpn(SHUNT_PORT + 2, true), "istio-http/1.1");
    // The cluster's istio.alpn_override "false" turns it off.
    assert_eq!(s.alpn(SHUNT_PORT + 3, false), "http/1.1");
    // The pool keeps overridden connections apart: the plain listener's are its own.
    assert_eq!(s.alpn(SHUNT_PORT, false), "http/1.1");
}
