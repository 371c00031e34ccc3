//! Where shunt must be no laxer than Envoy 1.40 (issue 41), differential: the same
//! bootstrap (but ports) served by `shunt proxy -c` and by Envoy in pod `proxy`, the same
//! requests from pod `client` through each, the outcomes compared.
//!
//! - YAML: deep flow nesting spelled behind tags and anchors is refused by both, shunt
//!   with its depth limit named (before parsing, not after a quadratic parse).
//! - HTTP/2 cookies: one `cookie` field per cookie (as browsers send them over h2) reach
//!   an HTTP/1.1 upstream as one line joined with "; " (RFC 9113 §8.2.3).
//! - The HTTP/1 codec's rules: unknown, lowercase and 10 KB methods (400), HTTP/1.0
//!   (426 unless `accept_http_10`), `transfer-encoding: gzip, chunked` (501).
//! - An upstream response head cut off mid-way: 502 (a 503 could trigger retries).
//! - The HCM's `http2_protocol_options`: the SETTINGS a client is sent.
//! - The byte and error stats of that traffic (`downstream_cx_protocol_error`,
//!   `downstream_cx_rx_bytes_total`, the cut cluster's `upstream_cx_protocol_error`,
//!   `upstream_cx_destroy_remote`, `upstream_cx_rx_bytes_total`).
//!
//! Needs root, nghttp and Envoy (`cargo xtask setup`).

mod support;

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
const ECHO_PORT: u16 = 8081;
const CUT_PORT: u16 = 8082;

/// Answers each request with its raw head as the body (`echo`), or with a response head
/// cut off mid-way and a close (`cut`).
const BACKEND: &str = r#"
import socket, sys, threading
def serve(conn, mode):
    with conn:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head = data.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        # The body, read whole before answering (closing with it unread is a reset).
        if b"transfer-encoding: chunked" in head.lower():
            while not data.endswith(b"0\r\n\r\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
        if mode == "cut":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-le")
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(head) + head)
def listen(port, mode):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(64)
    while True:
        conn, _ = s.accept()
        threading.Thread(target=serve, args=(conn, mode), daemon=True).start()
threading.Thread(target=listen, args=(int(sys.argv[2]), "cut"), daemon=True).start()
listen(int(sys.argv[1]), "echo")
"#;

/// Sends the bytes (hex, argv[3]) to argv[1]:argv[2] and prints the response's status
/// line (or `closed` when none came).
const RAW_CLIENT: &str = r#"
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(bytes.fromhex(sys.argv[3]))
data = b""
while b"\r\n" not in data:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(data.split(b"\r\n", 1)[0].decode("latin-1") if data else "closed")
"#;

fn cluster(name: &str, at: SocketAddr) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(at.ip(), at.port())}}
        ]}]}
    })
}

/// Listeners at `base` (Envoy's defaults but `http2_protocol_options`) and `base + 1`
/// (`accept_http_10`).
fn bootstrap(base: u16, admin: u16, backends: Ipv4Addr) -> Value {
    let hcm = |stat_prefix: &str, extra: Value| {
        let routes = json!({"name": stat_prefix, "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/cut"}, "route": {"cluster": "cut"}},
            {"match": {"prefix": "/"}, "route": {"cluster": "echo"}}
        ]}]});
        let mut fields = json!({"route_config": routes});
        for (k, v) in extra.as_object().unwrap() {
            fields[k] = v.clone();
        }
        support::envoy::http_connection_manager(stat_prefix, fields)
    };
    let listener = |name: &str, port: u16, filter: Value| {
        json!({"name": name, "address": socket_address("0.0.0.0", port),
               "filter_chains": [{"filters": [filter]}]})
    };
    let main = hcm(
        "main",
        json!({"http2_protocol_options": {
            "max_concurrent_streams": 7,
            "initial_stream_window_size": 131072,
            "initial_connection_window_size": 262144
        }}),
    );
    let http10 = hcm(
        "http10",
        json!({"http_protocol_options": {"accept_http_10": true}}),
    );
    json!({
        "node": {"id": "hardening-test", "cluster": "hardening-test"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [listener("main", base, main), listener("http10", base + 1, http10)],
            "clusters": [
                cluster("echo", SocketAddr::new(backends.into(), ECHO_PORT)),
                cluster("cut", SocketAddr::new(backends.into(), CUT_PORT))
            ]
        }
    })
}

struct Scene {
    _node: Node,
    proxy_pod: Pod,
    client: Pod,
    shunt: PodProcess,
    _envoy: PodProcess,
    _backend: PodProcess,
    _dir: TempDir,
}

impl Scene {
    fn new(tag: &str) -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new(tag);
        let backend = backends
            .command("/usr/bin/python3")
            .args(["-c", BACKEND, &ECHO_PORT.to_string(), &CUT_PORT.to_string()])
            .spawn()
            .expect("start the backend");
        for port in [ECHO_PORT, CUT_PORT] {
            wait_for_port(
                &backends,
                SocketAddr::from(([127, 0, 0, 1], port)),
                Duration::from_secs(20),
            )
            .unwrap_or_else(|e| panic!("backend port {port}: {e}\n{}", backend.stderr_text()));
        }
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
            [SHUNT_PORT + 1, ENVOY_PORT + 1],
        );
        Scene {
            _node: node,
            proxy_pod,
            client,
            shunt,
            _envoy: envoy,
            _backend: backend,
            _dir: dir,
        }
    }

    /// The status line the proxy at `port` answers `bytes` with.
    fn raw(&self, port: u16, bytes: &[u8]) -> String {
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        let out = self
            .client
            .command("/usr/bin/python3")
            .args(["-c", RAW_CLIENT, &self.proxy_pod.ipv4().to_string()])
            .arg(port.to_string())
            .arg(hex)
            .output()
            .expect("run the raw client");
        assert!(
            out.status.success(),
            "raw client: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The counters and gauges of the admin at `port` in pod `proxy`.
    fn stats(&self, port: u16) -> std::collections::BTreeMap<String, u64> {
        let (status, body) = admin_at(
            &self.proxy_pod,
            &format!("127.0.0.1:{port}"),
            "/stats?format=json",
        );
        assert_eq!(status, 200, "{body}");
        let stats: Value = serde_json::from_str(&body).unwrap();
        stats["stats"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
            .collect()
    }

    /// `nghttp -v` (HTTP/2 with prior knowledge) to `path` at `port`, with `headers`.
    fn nghttp(&self, port: u16, path: &str, headers: &[&str]) -> String {
        let url = format!("http://{}:{port}{path}", self.proxy_pod.ipv4());
        let mut command = self.client.command("nghttp").args(["-v", "-t", "10"]);
        for header in headers {
            command = command.args(["-H", header]);
        }
        let out = command.arg(&url).output().expect("run nghttp");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "nghttp {url}: {text}{}\nshunt: {}",
            String::from_utf8_lossy(&out.stderr),
            self.shunt.stderr_text()
        );
        text
    }
}

/// One request to `/echo` as bytes: `extra` header lines (and a body after them).
fn request(method: &str, version: &str, extra: &str) -> Vec<u8> {
    to("/echo", method, version, extra)
}

fn to(path: &str, method: &str, version: &str, extra: &str) -> Vec<u8> {
    format!("{method} {path} {version}\r\nhost: svc\r\n{extra}\r\n").into_bytes()
}

#[test]
fn the_http1_codecs_rules_and_a_cut_upstream_head_are_answered_as_envoy_does() {
    let scene = Scene::new("codec");
    let long_method = "A".repeat(10 * 1024);
    let cases: Vec<(&str, u16, Vec<u8>)> = vec![
        ("GET", 0, request("GET", "HTTP/1.1", "")),
        ("custom method", 0, request("FOO", "HTTP/1.1", "")),
        ("lowercase method", 0, request("get", "HTTP/1.1", "")),
        ("10 KB method", 0, request(&long_method, "HTTP/1.1", "")),
        ("HTTP/1.0", 0, request("GET", "HTTP/1.0", "")),
        (
            "HTTP/1.0, accept_http_10",
            1,
            request("GET", "HTTP/1.0", ""),
        ),
        (
            "gzip, chunked",
            0,
            request(
                "POST",
                "HTTP/1.1",
                "transfer-encoding: gzip, chunked\r\n\r\n1\r\nx\r\n0\r\n",
            ),
        ),
        (
            "chunked",
            0,
            request(
                "POST",
                "HTTP/1.1",
                "transfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n",
            ),
        ),
        ("cut upstream head", 0, to("/cut", "GET", "HTTP/1.1", "")),
    ];
    let mut differ = Vec::new();
    for (name, offset, bytes) in &cases {
        // The status code (the status line's version is the codec's own: hyper answers
        // an HTTP/1.0 request in HTTP/1.0, Envoy in HTTP/1.1).
        let code = |line: String| line.split(' ').nth(1).unwrap_or(&line).to_owned();
        let shunt = code(scene.raw(SHUNT_PORT + offset, bytes));
        let envoy = code(scene.raw(ENVOY_PORT + offset, bytes));
        eprintln!("{name}: shunt {shunt:?}, envoy {envoy:?}");
        if shunt != envoy {
            differ.push(format!("{name}: shunt {shunt:?}, envoy {envoy:?}"));
        }
    }
    assert!(differ.is_empty(), "shunt answers differently: {differ:#?}");
    // The same bytes in, the same errors: the same stats.
    let (shunt, envoy) = (scene.stats(SHUNT_ADMIN), scene.stats(ENVOY_ADMIN));
    let mut differ = Vec::new();
    for name in [
        "http.main.downstream_cx_protocol_error",
        "http.main.downstream_cx_rx_bytes_total",
        "http.http10.downstream_cx_rx_bytes_total",
        "cluster.cut.upstream_cx_protocol_error",
        "cluster.cut.upstream_cx_destroy_remote",
        "cluster.cut.upstream_cx_rx_bytes_total",
    ] {
        eprintln!(
            "{name}: shunt {:?}, envoy {:?}",
            shunt.get(name),
            envoy.get(name)
        );
        if shunt.get(name) != envoy.get(name) {
            differ.push(format!(
                "{name}: shunt {:?}, envoy {:?}",
                shunt.get(name),
                envoy.get(name)
            ));
        }
    }
    // What went out differs by the headers each adds; it is counted all the same.
    for name in [
        "http.main.downstream_cx_tx_bytes_total",
        "cluster.echo.upstream_cx_tx_bytes_total",
        "cluster.echo.upstream_cx_rx_bytes_total",
    ] {
        let counted = |stats: &std::collections::BTreeMap<String, u64>| {
            stats.get(name).copied().unwrap_or(0) > 0
        };
        if counted(&shunt) != counted(&envoy) {
            differ.push(format!(
                "{name}: shunt {:?}, envoy {:?}",
                shunt.get(name),
                envoy.get(name)
            ));
        }
    }
    assert!(differ.is_empty(), "stats differ: {differ:#?}");
}

#[test]
fn http2_cookies_reach_an_http1_upstream_joined_and_settings_follow_the_hcm() {
    let scene = Scene::new("h2");
    let cookie_lines = |port| {
        let text = scene.nghttp(
            port,
            "/echo",
            &["cookie: a=1", "cookie: b=2", "cookie: c=3"],
        );
        text.lines()
            .filter(|l| l.to_ascii_lowercase().starts_with("cookie:"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let (shunt, envoy) = (cookie_lines(SHUNT_PORT), cookie_lines(ENVOY_PORT));
    assert_eq!(envoy, ["cookie: a=1; b=2; c=3"], "Envoy's upstream saw");
    assert_eq!(shunt, envoy, "the upstream's cookie lines");
    // What the server's SETTINGS and connection WINDOW_UPDATE say.
    let settings = |port| {
        let text = scene.nghttp(port, "/echo", &[]);
        let mut seen: Vec<String> = text
            .lines()
            .filter(|l| {
                l.contains("SETTINGS_MAX_CONCURRENT_STREAMS")
                    || l.contains("SETTINGS_INITIAL_WINDOW_SIZE")
            })
            .map(|l| l.trim().to_owned())
            .collect();
        // The first WINDOW_UPDATE received on stream 0: the connection's window.
        let lines: Vec<&str> = text.lines().collect();
        if let Some(i) = lines
            .iter()
            .position(|l| l.contains("recv WINDOW_UPDATE frame") && l.contains("stream_id=0"))
            && let Some(next) = lines.get(i + 1)
        {
            seen.push(next.trim().to_owned());
        }
        seen
    };
    let (shunt, envoy) = (settings(SHUNT_PORT), settings(ENVOY_PORT));
    assert!(
        envoy
            .iter()
            .any(|l| l.contains("SETTINGS_MAX_CONCURRENT_STREAMS(0x03):7")),
        "{envoy:?}"
    );
    assert_eq!(shunt, envoy, "the HTTP/2 settings a client is sent");
}

#[test]
fn deep_yaml_nesting_behind_tags_and_anchors_is_refused_like_envoy() {
    let dir = TempDir::new("yaml");
    for prefix in ["!t ", "&a ", "!t &b "] {
        let levels = 20_000;
        let text = format!(
            "node:\n  id: x\n  metadata:\n    k: {}1{}\n",
            format!("{prefix}[").repeat(levels),
            "]".repeat(levels)
        );
        let file = dir.0.join("deep.yaml");
        std::fs::write(&file, &text).unwrap();
        let shunt = std::process::Command::new(harness::shunt_bin())
            .args(["proxy", "--mode", "validate", "-c"])
            .arg(&file)
            .output()
            .expect("run shunt");
        let envoy = std::process::Command::new(support::envoy::bin())
            .args(["--mode", "validate", "--use-dynamic-base-id", "-c"])
            .arg(&file)
            .output()
            .expect("run envoy");
        assert!(!envoy.status.success(), "Envoy took {prefix:?}");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&shunt.stdout),
            String::from_utf8_lossy(&shunt.stderr)
        );
        assert!(!shunt.status.success(), "shunt took {prefix:?}: {said}");
        assert!(
            said.contains("nested deeper than 128 levels at line 4"),
            "{prefix:?}: refused, but not by the depth check before parsing: {said}"
        );
    }
}

/// Clusters, listeners and routes that come and go over ADS under fresh names (as
/// Services and DestinationRule subsets do): once they are gone, so are their stats,
/// while those of what stays are kept.
#[test]
fn stats_of_removed_clusters_listeners_and_routes_are_freed() {
    use harness::ads::resources::{http_listener, load_assignment, named, route_config};
    use harness::ads::type_urls;
    let mut node = Node::new().expect("node");
    let pod = node.add_pod("proxy").expect("pod proxy");
    let (dir, socket, server) = support::xds::unix_server("stats-lifetime");
    let shunt = support::xds::start_shunt(
        &pod,
        &dir.0.join("bootstrap.json"),
        &support::xds::bootstrap(&socket, false),
        // A removed listener drains this long (its stats with it), as in Envoy.
        &["--drain-time-s", "1"],
    );
    let stats = || -> std::collections::BTreeMap<String, u64> {
        let (status, body) = admin_at(&pod, support::xds::ADMIN, "/stats?format=json");
        if status != 200 {
            return Default::default();
        }
        let stats: Value = serde_json::from_str(&body).unwrap();
        stats["stats"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| {
                Some((
                    s["name"].as_str()?.to_owned(),
                    s["value"].as_u64().unwrap_or(0),
                ))
            })
            .collect()
    };
    let acked = |type_url: &str, version: &str| {
        server
            .requests()
            .iter()
            .any(|r| r.type_url == type_url && r.is_ack() && r.version_info == version)
    };
    let wait = |what: &str, mut check: Box<dyn FnMut() -> bool + '_>| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !check() {
            assert!(
                shunt.try_wait().is_none(),
                "shunt exited: {}",
                shunt.stderr_text()
            );
            assert!(
                std::time::Instant::now() < deadline,
                "timed out: {what}\n{}{}",
                shunt.stderr_text(),
                support::xds::describe(&server.requests())
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let keep = support::xds::eds_cluster("keep", 1);
    for round in 0..4 {
        let version = format!("churn-{round}");
        let mut clusters = vec![keep.clone()];
        let mut endpoints = vec![named("keep", &load_assignment("keep", &[]))];
        let (mut listeners, mut routes) = (Vec::new(), Vec::new());
        for i in 0..25 {
            let cluster = format!("churn-c-{round}-{i}");
            clusters.push(support::xds::eds_cluster(&cluster, 1));
            endpoints.push(named(&cluster, &load_assignment(&cluster, &[])));
            let name = format!("churn-l-{round}-{i}");
            let route = format!("churn-r-{round}-{i}");
            let at = SocketAddr::from(([127, 0, 0, 1], 20000 + i));
            listeners.push(named(&name, &http_listener(&name, at, &route)));
            routes.push(named(&route, &route_config(&route, &[("/", "keep")])));
        }
        server.set(type_urls::ENDPOINT, &version, endpoints);
        server.set(type_urls::CLUSTER, &version, clusters);
        server.set(type_urls::ROUTE, &version, routes);
        server.set(type_urls::LISTENER, &version, listeners);
        wait(
            "the churned resources acked",
            Box::new(|| {
                acked(type_urls::CLUSTER, &version) && acked(type_urls::LISTENER, &version)
            }),
        );
        wait(
            "the churned stats present",
            Box::new(|| {
                stats()
                    .keys()
                    .any(|n| n.starts_with(&format!("cluster.churn-c-{round}-")))
            }),
        );
    }
    let churned = stats().keys().filter(|n| n.contains("churn-")).count();
    assert!(churned > 0);
    server.set(type_urls::CLUSTER, "base", vec![keep.clone()]);
    server.set(type_urls::LISTENER, "base", vec![]);
    server.set(type_urls::ROUTE, "base", vec![]);
    wait(
        "the base config acked",
        Box::new(|| acked(type_urls::CLUSTER, "base") && acked(type_urls::LISTENER, "base")),
    );
    // Listeners drain (1 s) before they go: give them that long and some.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut left: Vec<String>;
    loop {
        left = stats()
            .into_keys()
            .filter(|n| n.contains("churn-") || n.starts_with("listener.127.0.0.1_200"))
            .collect();
        if left.is_empty() || std::time::Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for name in &left {
        let kind: Vec<&str> = name.split('.').collect();
        *kinds
            .entry(format!("{}.*.{}", kind[0], kind[kind.len() - 1]))
            .or_default() += 1;
    }
    assert!(
        left.is_empty(),
        "{} of {churned} stats of removed resources left: {kinds:?}",
        left.len(),
    );
    assert!(
        stats().contains_key("cluster.keep.upstream_cx_total"),
        "the kept cluster's stats stay"
    );
}
