//! The compressor and decompressor HTTP filters, differential against Envoy 1.40: the
//! same bootstrap (but ports) served by `shunt proxy -c` and by Envoy in pod `proxy`,
//! the same requests from pod `client` through each (curl, which decodes gzip, br and
//! zstd), and compared: status, the headers the filters set or keep (`content-encoding`,
//! `vary`, `etag`, `content-length`), the decoded body, what the backend saw, and the
//! filters' stats.
//!
//! - listener 0: compressors for gzip, br and zstd (Envoy's default content types and
//!   `min_content_length`); `accept-encoding` negotiation (q-values, `*`, `identity`,
//!   `q=0`), short bodies, other content types, `no-transform`, ETags, chunked bodies,
//!   an existing `vary`, already encoded responses, HEAD;
//! - listener 1: a gzip decompressor: gzip responses and request bodies decoded, the
//!   `accept-encoding` it advertises upstream.
//!
//! Needs root and Envoy (`cargo xtask setup`).

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
const BACKEND_PORT: u16 = 8081;

/// Answers by path: `/type/<a>/<b>?n=<length>` a body of that media type and length,
/// `/chunked` a chunked text body, `/etag`, `/weak-etag`, `/no-transform`, `/vary`,
/// `/encoded` (already `br`), `/gzip` (a gzip body with `content-encoding: gzip`),
/// `/echo` the request body (read by length or chunked) with the request's
/// `accept-encoding` and `content-encoding` in `x-seen-*` headers (not its length:
/// shunt sends a decompressed request body with one, Envoy chunked).
const BACKEND: &str = r#"
import gzip, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse, parse_qs
TEXT = b"shunt compresses as Envoy does. " * 400
class Backend(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def body_in(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("content-length") or 0)
        return self.rfile.read(n) if n else b""
    def send(self, status, headers, body, chunked=False):
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        if chunked:
            self.send_header("transfer-encoding", "chunked")
        else:
            self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if chunked:
            for i in range(0, len(body), 1000):
                part = body[i:i + 1000]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(body)
    def answer(self):
        url = urlparse(self.path)
        q = parse_qs(url.query)
        n = int(q.get("n", ["4000"])[0])
        text = TEXT[:n]
        path = url.path
        if path.startswith("/type/"):
            self.send(200, [("content-type", path[len("/type/"):])], text)
        elif path == "/chunked":
            self.send(200, [("content-type", "text/plain")], text, chunked=True)
        elif path == "/etag":
            self.send(200, [("content-type", "text/plain"), ("etag", '"v1"')], text)
        elif path == "/weak-etag":
            self.send(200, [("content-type", "text/plain"), ("etag", 'W/"v1"')], text)
        elif path == "/no-transform":
            self.send(200, [("content-type", "text/plain"), ("cache-control", "public, no-transform")], text)
        elif path == "/vary":
            self.send(200, [("content-type", "text/plain"), ("vary", "Origin")], text)
        elif path == "/gzip":
            self.send(200, [("content-type", "text/plain"), ("content-encoding", "gzip")], gzip.compress(text))
        elif path == "/gzip-no-transform":
            self.send(200, [("content-type", "text/plain"), ("content-encoding", "gzip"), ("cache-control", "no-transform")], gzip.compress(text))
        elif path == "/echo":
            body = self.body_in()
            seen = [("x-seen-" + h, self.headers.get(h, "-")) for h in ("accept-encoding", "content-encoding")]
            self.send(200, [("content-type", "application/octet-stream")] + seen, body)
        else:
            self.send(404, [], b"")
    do_GET = do_POST = do_HEAD = answer
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Backend).serve_forever()
"#;

fn typed(type_name: &str, mut config: Value) -> Value {
    config["@type"] = json!(format!("type.googleapis.com/{type_name}"));
    config
}

fn compressor(name: &str, library: &str) -> Value {
    json!({"name": format!("envoy.filters.http.compressor.{name}"), "typed_config": typed(
    "envoy.extensions.filters.http.compressor.v3.Compressor",
    json!({
        "response_direction_config": {},
        "compressor_library": {"name": name, "typed_config": typed(library, json!({}))}
    }))})
}

fn hcm(stat_prefix: &str, mut filters: Vec<Value>) -> Value {
    filters.push(json!({"name": "envoy.filters.http.router",
        "typed_config": typed("envoy.extensions.filters.http.router.v3.Router", json!({}))}));
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": typed(
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
    json!({
        "stat_prefix": stat_prefix,
        "http_filters": filters,
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "backend"}}]}]}
    }))})
}

fn bootstrap(base: u16, admin: u16, backend: Ipv4Addr) -> Value {
    let compress = hcm(
        "compress",
        vec![
            compressor(
                "gzip",
                "envoy.extensions.compression.gzip.compressor.v3.Gzip",
            ),
            compressor(
                "brotli",
                "envoy.extensions.compression.brotli.compressor.v3.Brotli",
            ),
            compressor(
                "zstd",
                "envoy.extensions.compression.zstd.compressor.v3.Zstd",
            ),
        ],
    );
    let decompress = hcm(
        "decompress",
        vec![
            json!({"name": "envoy.filters.http.decompressor", "typed_config": typed(
            "envoy.extensions.filters.http.decompressor.v3.Decompressor",
            json!({"decompressor_library": {"name": "gzip", "typed_config": typed(
                "envoy.extensions.compression.gzip.decompressor.v3.Gzip", json!({}))}}))}),
        ],
    );
    let listener = |name: &str, port: u16, filter: Value| {
        json!({"name": name, "address": socket_address("0.0.0.0", port),
               "filter_chains": [{"filters": [filter]}]})
    };
    json!({
        "node": {"id": "compression-test", "cluster": "compression-test"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                listener("compress", base, compress),
                listener("decompress", base + 1, decompress)
            ],
            "clusters": [{
                "name": "backend", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "backend", "endpoints": [{"lb_endpoints": [
                    {"endpoint": {"address": socket_address(backend, BACKEND_PORT)}}
                ]}]}
            }]
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
    dir: TempDir,
}

impl Scene {
    fn new() -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new("compression");
        let backend = backends
            .command("/usr/bin/python3")
            .args(["-c", BACKEND, &BACKEND_PORT.to_string()])
            .spawn()
            .expect("start the backend");
        wait_for_port(
            &backends,
            SocketAddr::from(([127, 0, 0, 1], BACKEND_PORT)),
            Duration::from_secs(20),
        )
        .unwrap_or_else(|e| panic!("backend: {e}\n{}", backend.stderr_text()));
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
            envoy,
            _backend: backend,
            dir,
        }
    }

    /// curl from the client pod, decoding what it gets: the outcome compared.
    fn outcome(&self, port: u16, path: &str, args: &[&str]) -> Value {
        let url = format!("http://{}:{port}{path}", self.proxy_pod.ipv4());
        let head = self.dir.0.join("head");
        let out = self
            .client
            .command("curl")
            .args(["-s", "-S", "--compressed", "--max-time", "10", "-D"])
            .arg(&head)
            .args(args)
            .arg(&url)
            .output()
            .expect("run curl");
        assert!(
            out.status.success(),
            "curl {args:?} {url} failed: {}\nshunt: {}",
            String::from_utf8_lossy(&out.stderr),
            self.shunt.stderr_text()
        );
        let head = std::fs::read_to_string(&head).unwrap();
        let mut lines = head.lines();
        let status = lines
            .next()
            .unwrap_or("")
            .split_whitespace()
            .nth(1)
            .map(str::to_owned);
        let headers: BTreeMap<String, String> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .filter(|(k, _)| COMPARED.contains(&k.as_str()) || k.starts_with("x-seen-"))
            .collect();
        // `-I` prints the head as the body: its `date` changes with the second.
        let body: String = String::from_utf8_lossy(&out.stdout)
            .split_inclusive('\n')
            .filter(|l| !l.to_ascii_lowercase().starts_with("date:"))
            .collect();
        json!({"status": status, "headers": headers, "body_len": out.stdout.len(),
               "body": body.chars().take(64).collect::<String>()})
    }
}

/// The response headers compared (besides the backend's `x-seen-*`).
const COMPARED: &[&str] = &[
    "content-encoding",
    "vary",
    "etag",
    "content-length",
    "transfer-encoding",
    "content-type",
    "cache-control",
];

/// The compressor's and decompressor's counters that are not zero.
fn filter_stats(pod: &Pod, admin: u16) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, &format!("127.0.0.1:{admin}"), "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .filter(|(name, value)| {
            *value > 0
                && (name.contains(".compressor.") || name.contains(".decompressor."))
                && !name.contains("total_compressed_bytes")
        })
        .collect()
}

/// Stands for the gzip request body's file in a case's curl arguments.
const REQUEST_BODY: &str = "@request.gz";

/// (listener, path, curl arguments).
const CASES: &[(u16, &str, &[&str])] = &[
    (0, "/type/text/plain", &["-H", "accept-encoding: gzip"]),
    (0, "/type/text/plain", &["-H", "accept-encoding: br"]),
    (0, "/type/text/plain", &["-H", "accept-encoding: zstd"]),
    (
        0,
        "/type/application/json",
        &["-H", "accept-encoding: gzip;q=0.5, br;q=0.8, zstd;q=0.1"],
    ),
    (0, "/type/text/html", &["-H", "accept-encoding: *"]),
    (
        0,
        "/type/text/html",
        &["-H", "accept-encoding: gzip;q=0, *"],
    ),
    (
        0,
        "/type/text/html",
        &["-H", "accept-encoding: identity, gzip;q=0.5"],
    ),
    (0, "/type/text/html", &["-H", "accept-encoding: deflate"]),
    (0, "/type/text/html", &["-H", "accept-encoding: GZIP"]),
    (0, "/type/text/html", &[]),
    (0, "/type/text/plain?n=29", &["-H", "accept-encoding: gzip"]),
    (0, "/type/text/plain?n=30", &["-H", "accept-encoding: gzip"]),
    (0, "/type/image/png", &["-H", "accept-encoding: gzip"]),
    (0, "/chunked", &["-H", "accept-encoding: br"]),
    (0, "/etag", &["-H", "accept-encoding: gzip"]),
    (0, "/weak-etag", &["-H", "accept-encoding: gzip"]),
    (0, "/no-transform", &["-H", "accept-encoding: gzip"]),
    (0, "/vary", &["-H", "accept-encoding: gzip"]),
    (0, "/gzip", &["-H", "accept-encoding: br"]),
    (
        0,
        "/type/text/plain",
        &["-I", "-H", "accept-encoding: gzip"],
    ),
    (
        0,
        "/type/text/plain",
        &["--http2-prior-knowledge", "-H", "accept-encoding: zstd"],
    ),
    (1, "/gzip", &["-H", "accept-encoding: identity"]),
    (
        1,
        "/gzip-no-transform",
        &["-H", "accept-encoding: identity"],
    ),
    (1, "/echo", &[]),
    (
        1,
        "/echo",
        &["-H", "accept-encoding: br", "--data-binary", "plain body"],
    ),
    (
        1,
        "/echo",
        &[
            "-H",
            "content-encoding: gzip",
            "--data-binary",
            REQUEST_BODY,
        ],
    ),
];

#[test]
fn compressor_and_decompressor_answer_as_envoy_does() {
    let s = Scene::new();
    // A gzip request body for the decompressor (curl reads it in the client pod, which
    // shares this filesystem).
    let body = "a gzip request body, decompressed before the upstream. ".repeat(50);
    let gz = std::process::Command::new("gzip")
        .arg("-c")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child.stdin.take().unwrap().write_all(body.as_bytes())?;
            child.wait_with_output()
        })
        .expect("gzip a request body");
    let gz_path = s.dir.0.join("request.gz");
    std::fs::write(&gz_path, &gz.stdout).unwrap();
    let gz_arg = format!("@{}", gz_path.display());
    let mut differences = Vec::new();
    let mut compressed = 0;
    for (listener, path, args) in CASES {
        let args: Vec<&str> = args
            .iter()
            .map(|a| {
                if *a == REQUEST_BODY {
                    gz_arg.as_str()
                } else {
                    a
                }
            })
            .collect();
        let args = args.as_slice();
        let envoy = s.outcome(ENVOY_PORT + listener, path, args);
        let shunt = s.outcome(SHUNT_PORT + listener, path, args);
        if envoy["headers"]["content-encoding"].is_string() {
            compressed += 1;
        }
        if envoy != shunt {
            differences.push(format!(
                "{listener} {path} {args:?}:\n  envoy {envoy}\n  shunt {shunt}"
            ));
        }
    }
    assert!(
        compressed >= 6,
        "Envoy compressed only {compressed} responses"
    );
    let envoy_stats = filter_stats(&s.proxy_pod, ENVOY_ADMIN);
    let shunt_stats = filter_stats(&s.proxy_pod, SHUNT_ADMIN);
    if envoy_stats != shunt_stats {
        differences.push(format!(
            "filter stats:\n  envoy {envoy_stats:?}\n  shunt {shunt_stats:?}"
        ));
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
