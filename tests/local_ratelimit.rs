//! The local rate limit an EnvoyFilter adds (`envoy.filters.http.local_ratelimit`),
//! differential against Envoy 1.40: the same bootstrap (but ports) served by `shunt
//! proxy -c` and by Envoy in pod `proxy`, the same sequence of requests from pod
//! `client`, and the same 200s and 429s, `x-local-rate-limit` and `x-ratelimit-*`
//! headers, request headers added when not enforced, and stats; a route's
//! `rate_limits` actions make descriptors that a `LocalRateLimit`'s `descriptors`
//! limit with buckets of their own. Then
//! `envoy.filters.network.local_ratelimit` in front of a `tcp_proxy`: the same
//! connections served and closed. The buckets refill once a minute, so the outcome
//! does not depend on timing.
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
use support::envoy::socket_address;
use support::xds::admin_at;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const ECHO_PORT: u16 = 8081;

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
    do_OPTIONS = do_GET
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"#;

fn cluster(name: &str, at: SocketAddr) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(at.ip(), at.port())}}
        ]}]}
    })
}

/// Istio's local rate limit task's filter config (a TypedStruct), with `max` tokens a
/// minute.
fn local_ratelimit(max: u32, enforced: u32) -> Value {
    let percent = |n: u32| json!({"runtime_key": "rl", "default_value": {"numerator": n, "denominator": "HUNDRED"}});
    json!({"@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
    "type_url": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
    "value": {
        "stat_prefix": format!("rl_{max}_{enforced}"),
        "token_bucket": {"max_tokens": max, "tokens_per_fill": max, "fill_interval": "60s"},
        "filter_enabled": percent(100),
        "filter_enforced": percent(enforced),
        "response_headers_to_add": [{"append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            "header": {"key": "x-local-rate-limit", "value": "true"}}],
        "request_headers_to_add_when_not_enforced": [{"append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            "header": {"key": "x-would-limit", "value": "yes"}}],
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03"
    }})
}

/// A route's limit by descriptor: `user=alice` one a minute, the rest from the
/// filter's own bucket (ten).
fn local_ratelimit_descriptors() -> Value {
    let mut config = local_ratelimit(10, 100);
    config["value"]["stat_prefix"] = json!("rl_descriptors");
    config["value"]["descriptors"] = json!([
        {"entries": [{"key": "user", "value": "alice"}],
         "token_bucket": {"max_tokens": 1, "tokens_per_fill": 1, "fill_interval": "60s"}}
    ]);
    config
}

fn bootstrap(port: u16, admin: u16, backends: Ipv4Addr) -> Value {
    let route = |prefix: &str, per_route: Option<Value>| {
        let mut r = json!({"match": {"prefix": prefix}, "route": {"cluster": "backend"}});
        if let Some(config) = per_route {
            r["typed_per_filter_config"] = json!({"envoy.filters.http.local_ratelimit": config});
        }
        r
    };
    let mut descriptors = route("/descriptors", Some(local_ratelimit_descriptors()));
    descriptors["route"]["rate_limits"] = json!([{"actions": [
        {"request_headers": {"header_name": "x-user", "descriptor_key": "user"}}]}]);
    let hcm = json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "rl",
        "codec_type": "AUTO",
        "http_filters": [
            {"name": "envoy.filters.http.local_ratelimit", "typed_config": local_ratelimit(3, 100)},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": {"name": "rl", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            route("/route", Some(local_ratelimit(2, 100))),
            route("/shadow", Some(local_ratelimit(1, 0))),
            descriptors,
            route("/", None)
        ]}]}
    }});
    let tcp = json!([
        {"name": "envoy.filters.network.local_ratelimit", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "tcp_rl",
            "token_bucket": {"max_tokens": 2, "fill_interval": "60s"}}},
        {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": "tcp", "cluster": "backend"}}
    ]);
    json!({
        "node": {"id": "rl-test", "cluster": "rl-test"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                {"name": "main", "address": socket_address("0.0.0.0", port),
                 "filter_chains": [{"filters": [hcm]}]},
                {"name": "tcp", "address": socket_address("0.0.0.0", port + 1),
                 "filter_chains": [{"filters": tcp}]}
            ],
            "clusters": [cluster("backend", SocketAddr::new(backends.into(), ECHO_PORT))]
        }
    })
}

/// What is compared of a response.
fn outcome(r: &Response) -> Value {
    let headers: BTreeMap<_, _> = [
        "x-local-rate-limit",
        "x-ratelimit-limit",
        "x-ratelimit-remaining",
        "x-ratelimit-reset",
        "content-type",
    ]
    .iter()
    .filter_map(|h| Some((*h, r.headers.get(*h)?.clone())))
    .collect();
    let body = match serde_json::from_str::<Value>(&r.body) {
        Ok(echo) if echo.get("headers").is_some() => {
            json!({"upstream_would_limit": echo["headers"].get("x-would-limit")})
        }
        _ => json!(r.body),
    };
    json!({"status": r.status, "headers": headers, "body": body})
}

/// The rate limit counters.
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
                && (name.contains(".http_local_rate_limit.")
                    || name.starts_with("local_rate_limit."))
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

#[test]
fn local_rate_limits_answer_as_envoy_does() {
    let mut node = Node::new().expect("node");
    let proxy = node.add_pod("proxy").expect("pod proxy");
    let backends = node.add_pod("backends").expect("pod backends");
    let client = node.add_pod("client").expect("pod client");
    let dir = TempDir::new("local-ratelimit");
    let echo = backends
        .command("/usr/bin/python3")
        .args(["-c", ECHO_SERVER, &ECHO_PORT.to_string()])
        .spawn()
        .expect("start the echo server");
    wait_for_port(
        &backends,
        SocketAddr::from(([127, 0, 0, 1], ECHO_PORT)),
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("echo server: {e}\n{}", echo.stderr_text()));
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
    let (shunt, envoy): (PodProcess, PodProcess) = support::envoy::start_side_by_side(
        &proxy,
        &shunt_config,
        &envoy_config,
        [SHUNT_PORT, ENVOY_PORT],
    );
    // (path, headers, what Envoy answers): the listener's bucket (3), a route's (2), a
    // route's unenforced one (1), a route's descriptor's (1, alice's) and the rest
    // from its own (10).
    let sequence: &[(&str, &[&str], u16)] = &[
        ("/", &[], 200),
        ("/", &[], 200),
        ("/", &[], 200),
        ("/", &[], 429),
        ("/", &[], 429),
        ("/route", &[], 200),
        ("/route", &[], 200),
        ("/route", &[], 429),
        ("/shadow", &[], 200),
        ("/shadow", &[], 200),
        ("/shadow", &[], 200),
        ("/descriptors", &["x-user: alice"], 200),
        ("/descriptors", &["x-user: alice"], 429),
        ("/descriptors", &["x-user: bob"], 200),
        ("/descriptors", &[], 200),
    ];
    let mut differences = Vec::new();
    for (i, (path, headers, status)) in sequence.iter().enumerate() {
        let theirs = curl(&client, &proxy, ENVOY_PORT, path, headers);
        let ours = curl(&client, &proxy, SHUNT_PORT, path, headers);
        assert_eq!(
            theirs.status, *status,
            "request {i} {path}: Envoy answered {theirs:?}"
        );
        let (theirs, ours) = (outcome(&theirs), outcome(&ours));
        if theirs != ours {
            differences.push(format!(
                "request {i} {path}:\n  envoy {theirs}\n  shunt {ours}"
            ));
        }
    }
    // Through the TCP listener: two connections a minute, the third closed at once.
    for i in 0..3 {
        let served = |port: u16| {
            let url = format!("http://{}:{}/", proxy.ipv4(), port + 1);
            let out = client
                .command("curl")
                .args(["-s", "--max-time", "10", &url])
                .output()
                .expect("run curl");
            // Refused connections are reset: curl's exit code (7 or 56) depends on
            // whether its request left before the reset, so only "served" is compared.
            out.status.success()
        };
        let (theirs, ours) = (served(ENVOY_PORT), served(SHUNT_PORT));
        assert_eq!(
            theirs,
            i < 2,
            "tcp connection {i}: served by Envoy: {theirs}"
        );
        if theirs != ours {
            differences.push(format!(
                "tcp connection {i}: served by envoy {theirs}, by shunt {ours}"
            ));
        }
    }
    let envoy_stats = filter_stats(&proxy, ENVOY_ADMIN);
    let shunt_stats = filter_stats(&proxy, SHUNT_ADMIN);
    assert!(
        envoy_stats.contains_key("rl_3_100.http_local_rate_limit.rate_limited"),
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
