//! Global rate limits against a rate limit service, differential against Envoy 1.40:
//! `envoy.filters.http.ratelimit` with the routes' and virtual host's `rate_limits`
//! actions, and `envoy.filters.network.ratelimit` in front of a `tcp_proxy`. The same
//! bootstrap (but ports) is served by `shunt proxy -c` and by Envoy in pod `proxy`; each
//! calls its own instance of the test rate limit service (grpcio,
//! `support/ratelimit_server.py`) in pod `backends`, and pod `client` sends both the
//! same requests. Compared: statuses, `x-envoy-ratelimited`, `x-ratelimit-*`, the
//! service's headers (downstream, and upstream as the echo server saw them), bodies,
//! the descriptors each service received, the connections served, and the stats. The
//! service's failure modes (UNAVAILABLE, an answer after the timeout) go through a
//! listener with `failure_mode_deny` false and one with it true, HTTP and TCP.
//!
//! Needs root and Envoy (`cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::curl::Response;
use support::envoy::{socket_address, static_cluster};
use support::xds::admin_at;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const ECHO_PORT: u16 = 8081;
/// shunt's rate limit service; Envoy's is the next port.
const RLS_PORT: u16 = 8090;

/// Echoes each request as JSON: its path and headers (lowercase names, every value).
const ECHO_SERVER: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        seen = {}
        for k, v in self.headers.items():
            seen.setdefault(k.lower(), []).append(v)
        out = json.dumps({"path": self.path, "headers": seen}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"#;

fn rate_limit_service() -> Value {
    json!({"grpc_service": {"envoy_grpc": {"cluster_name": "rls"}}, "transport_api_version": "V3"})
}

/// The filter as Istio's "Enabling Rate Limits using Envoy" adds it, with a timeout
/// the test's service meets even on a busy machine.
fn ratelimit_filter(failure_mode_deny: bool) -> Value {
    json!({"name": "envoy.filters.http.ratelimit", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
        "domain": "shunt-test",
        "timeout": "0.5s",
        "failure_mode_deny": failure_mode_deny,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
        "rate_limit_service": rate_limit_service()
    }})
}

fn generic(key: &str, value: &str) -> Value {
    json!({"generic_key": {"descriptor_key": key, "descriptor_value": value}})
}

fn route_config() -> Value {
    let route = |prefix: &str, action: Value| {
        let mut r = json!({"match": {"prefix": prefix}, "route": {"cluster": "backend"}});
        for (k, v) in action.as_object().unwrap() {
            r["route"][k] = v.clone();
        }
        r
    };
    let limited = json!({"rate_limits": [
        {"actions": [generic("limit", "2"),
            {"request_headers": {"header_name": "x-user", "descriptor_key": "user", "skip_if_absent": true}}]},
        {"actions": [{"remote_address": {}}]},
        {"actions": [{"destination_cluster": {}}, {"source_cluster": {}}]},
        {"actions": [{"request_headers": {"header_name": "x-mode", "descriptor_key": "mode"}}]},
        {"actions": [{"masked_remote_address": {"v4_prefix_mask_len": 16}}]},
        {"actions": [{"header_value_match": {"descriptor_value": "get",
            "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]}}]},
        {"actions": [{"header_value_match": {"descriptor_value": "not-post", "expect_match": false,
            "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}}]},
        {"actions": [{"request_headers": {"header_name": ":path", "descriptor_key": "path"}}]}
    ]});
    let mut ignore = route("/ignore", json!({}));
    ignore["typed_per_filter_config"] = json!({"envoy.filters.http.ratelimit": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
        "vh_rate_limits": "IGNORE"}});
    json!({"name": "rl", "virtual_hosts": [{"name": "all", "domains": ["*"],
    "rate_limits": [{"actions": [generic("vh", "all")]}],
    "routes": [
        route("/limited", limited),
        route("/include", json!({"include_vh_rate_limits": true,
            "rate_limits": [{"actions": [generic("route", "include")]}]})),
        route("/stage1", json!({"rate_limits": [{"stage": 1, "actions": [generic("route", "stage1")]}]})),
        ignore,
        route("/", json!({}))
    ]}]})
}

fn hcm(stat_prefix: &str, failure_mode_deny: bool) -> Value {
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": "AUTO",
        "http_filters": [
            ratelimit_filter(failure_mode_deny),
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": route_config()
    }})
}

/// The network filter in front of a `tcp_proxy`, with one static descriptor.
fn tcp_chain(stat_prefix: &str, entries: Value, failure_mode_deny: bool) -> Value {
    json!([
        {"name": "envoy.filters.network.ratelimit", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.ratelimit.v3.RateLimit",
            "stat_prefix": stat_prefix,
            "domain": "shunt-tcp",
            "descriptors": [{"entries": entries}],
            "timeout": "0.5s",
            "failure_mode_deny": failure_mode_deny,
            "rate_limit_service": rate_limit_service()}},
        {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": "tcp", "cluster": "backend"}}
    ])
}

/// Listeners: `port` (failure_mode_deny false), `port + 1` (TCP, two connections
/// allowed), `port + 2` (failure_mode_deny true), `port + 3` and `port + 4` (TCP, the
/// service fails; failure_mode_deny false, then true).
fn bootstrap(port: u16, admin: u16, backends: Ipv4Addr, rls_port: u16) -> Value {
    let tcp = tcp_chain(
        "tcp_rl",
        json!([{"key": "limit", "value": "2"}, {"key": "listener", "value": "tcp"}]),
        false,
    );
    let failing = json!([{"key": "mode", "value": "fail"}]);
    let tcp_allow = tcp_chain("tcp_fail_allow", failing.clone(), false);
    let tcp_deny = tcp_chain("tcp_fail_deny", failing, true);
    let listener = |name: &str, port: u16, filters: Value| {
        json!({"name": name, "address": socket_address("0.0.0.0", port),
            "filter_chains": [{"filters": filters}]})
    };
    json!({
        "node": {"id": "rl-test", "cluster": "rl-test-cluster"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                listener("allow", port, json!([hcm("allow", false)])),
                listener("tcp", port + 1, tcp),
                listener("deny", port + 2, json!([hcm("deny", true)])),
                listener("tcp_fail_allow", port + 3, tcp_allow),
                listener("tcp_fail_deny", port + 4, tcp_deny)
            ],
            "clusters": [
                static_cluster("backend", SocketAddr::new(backends.into(), ECHO_PORT), false),
                static_cluster("rls", SocketAddr::new(backends.into(), rls_port), true)
            ]
        }
    })
}

/// What is compared of a response.
fn outcome(r: &Response) -> Value {
    let headers: BTreeMap<_, _> = [
        "x-envoy-ratelimited",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "x-rls-descriptors",
        "content-type",
    ]
    .iter()
    .filter_map(|h| Some((*h, r.headers.get(*h)?.clone())))
    .collect();
    let body = match serde_json::from_str::<Value>(&r.body) {
        Ok(echo) if echo.get("headers").is_some() => {
            json!({"upstream_saw": echo["headers"].get("x-rls-request")})
        }
        _ => json!(r.body),
    };
    json!({"status": r.status, "headers": headers, "body": body})
}

/// The rate limit counters, and what Envoy charges the route's cluster with for the
/// 429s it answers in its place (as internal requests). shunt does not keep Envoy's
/// `external.` request counters, so the rest of the cluster's are left out.
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
                && (name.contains("ratelimit.")
                    || (name.starts_with("cluster.backend.")
                        && (name.contains("upstream_rq_4") || name.contains(".internal."))))
        })
        .collect()
}

fn curl(client: &Pod, proxy: &Pod, port: u16, path: &str, headers: &[&str]) -> Response {
    let url = format!("http://{}:{port}{path}", proxy.ipv4());
    let mut command = client
        .command("curl")
        .args(["-s", "-S", "-i", "--max-time", "10"]);
    for h in headers {
        command = command.args(["-H", h]);
    }
    let out = command.arg(&url).output().expect("run curl");
    assert!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Response::parse(&String::from_utf8_lossy(&out.stdout))
}

/// The requests each service received, in order.
fn service_log(file: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

#[test]
fn global_rate_limits_answer_as_envoy_does() {
    let mut node = Node::new().expect("node");
    let proxy = node.add_pod("proxy").expect("pod proxy");
    let backends = node.add_pod("backends").expect("pod backends");
    let client = node.add_pod("client").expect("pod client");
    let dir = TempDir::new("ratelimit");
    let echo = backends
        .command("/usr/bin/python3")
        .args(["-c", ECHO_SERVER, &ECHO_PORT.to_string()])
        .spawn()
        .expect("start the echo server");
    let (python, path) = support::python_grpc();
    let logs = [dir.0.join("rls-shunt.jsonl"), dir.0.join("rls-envoy.jsonl")];
    let services: Vec<PodProcess> = [RLS_PORT, RLS_PORT + 1]
        .iter()
        .zip(&logs)
        .map(|(port, log)| {
            backends
                .command(&python)
                .arg(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/support/ratelimit_server.py"
                ))
                .arg(port.to_string())
                .arg(log)
                .env("PYTHONPATH", &path)
                .spawn()
                .expect("start the rate limit service")
        })
        .collect();
    // grpcio listens dual-stack on [::].
    let any6 = |port| SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
    for (at, process) in [
        (SocketAddr::from(([127, 0, 0, 1], ECHO_PORT)), &echo),
        (any6(RLS_PORT), &services[0]),
        (any6(RLS_PORT + 1), &services[1]),
    ] {
        let port = at.port();
        wait_for_port(&backends, at, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("backend port {port}: {e}\n{}", process.stderr_text()));
    }
    let write = |name: &str, config: Value| {
        let file = dir.0.join(name);
        std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        file
    };
    let shunt_config = write(
        "shunt.json",
        bootstrap(SHUNT_PORT, SHUNT_ADMIN, backends.ipv4(), RLS_PORT),
    );
    let envoy_config = write(
        "envoy.json",
        bootstrap(ENVOY_PORT, ENVOY_ADMIN, backends.ipv4(), RLS_PORT + 1),
    );
    let (shunt, envoy) = support::envoy::start_side_by_side(
        &proxy,
        &shunt_config,
        &envoy_config,
        [SHUNT_PORT, ENVOY_PORT],
    );
    // (listener offset, path, headers, what Envoy answers). `/limited`'s first
    // descriptor allows two a minute (x-user makes it another descriptor).
    let sequence: &[(u16, &str, &[&str], u16)] = &[
        (0, "/limited", &[], 200),
        (0, "/limited", &["x-user: alice"], 200),
        (0, "/limited", &[], 200),
        (0, "/limited", &[], 429),
        (0, "/", &[], 200),
        (0, "/include", &[], 200),
        (0, "/stage1", &[], 200),
        (0, "/ignore", &[], 200),
        // The service fails, then answers too late: let through.
        (0, "/", &["x-mode: x"], 200),
        (0, "/limited", &["x-mode: fail", "x-user: bob"], 200),
        (0, "/limited", &["x-mode: slow", "x-user: bob"], 200),
        // The same through the listener that denies when the service fails.
        (2, "/limited", &["x-mode: fail", "x-user: bob"], 500),
        (2, "/limited", &["x-mode: slow", "x-user: bob"], 500),
        (2, "/limited", &[], 429),
        (2, "/", &[], 200),
    ];
    let mut differences = Vec::new();
    for (i, (offset, path, headers, status)) in sequence.iter().enumerate() {
        let theirs = curl(&client, &proxy, ENVOY_PORT + offset, path, headers);
        let ours = curl(&client, &proxy, SHUNT_PORT + offset, path, headers);
        assert_eq!(
            theirs.status, *status,
            "request {i} {path}: Envoy answered {theirs:?}"
        );
        let (theirs, ours) = (outcome(&theirs), outcome(&ours));
        if theirs != ours {
            differences.push(format!(
                "request {i} {path} {headers:?}:\n  envoy {theirs}\n  shunt {ours}"
            ));
        }
    }
    // Through the TCP listeners: two connections a minute, the third closed at once;
    // then with the service failing, let through, then closed.
    for (i, (offset, expected)) in [(1, true), (1, true), (1, false), (3, true), (4, false)]
        .into_iter()
        .enumerate()
    {
        let served = |port: u16| {
            let url = format!("http://{}:{}/", proxy.ipv4(), port + offset);
            let out = client
                .command("curl")
                .args(["-s", "--max-time", "10", &url])
                .output()
                .expect("run curl");
            // Closed connections are reset: curl's exit code depends on whether its
            // request left first, so only "served" is compared.
            out.status.success()
        };
        let (theirs, ours) = (served(ENVOY_PORT), served(SHUNT_PORT));
        assert_eq!(
            theirs, expected,
            "tcp connection {i}: served by Envoy: {theirs}"
        );
        if theirs != ours {
            differences.push(format!(
                "tcp connection {i}: served by envoy {theirs}, by shunt {ours}"
            ));
        }
    }
    // Both services saw the same calls: the slow ones have been answered by now.
    std::thread::sleep(Duration::from_millis(1600));
    let (ours, theirs) = (service_log(&logs[0]), service_log(&logs[1]));
    assert!(theirs.len() > 10, "Envoy's calls: {theirs:?}");
    if ours != theirs {
        differences.push(format!(
            "the rate limit services saw:\n  envoy {}\n  shunt {}",
            serde_json::to_string_pretty(&theirs).unwrap(),
            serde_json::to_string_pretty(&ours).unwrap()
        ));
    }
    let envoy_stats = filter_stats(&proxy, ENVOY_ADMIN);
    let shunt_stats = filter_stats(&proxy, SHUNT_ADMIN);
    assert!(
        envoy_stats.contains_key("cluster.backend.ratelimit.over_limit"),
        "{envoy_stats:?}"
    );
    if envoy_stats != shunt_stats {
        differences.push(format!(
            "stats:\n  envoy {envoy_stats:?}\n  shunt {shunt_stats:?}"
        ));
    }
    assert!(
        differences.is_empty(),
        "{} differences from Envoy:\n{}\nshunt stderr:\n{}\nenvoy stderr:\n{}",
        differences.len(),
        differences.join("\n"),
        shunt.stderr_text(),
        envoy.stderr_text()
    );
}
