//! The HTTP filters istiod writes besides RBAC, differential against Envoy 1.40: the
//! same bootstrap (but ports) served by `shunt proxy -c` and by Envoy in pod `proxy`,
//! the same table of requests from pod `client` through each, and the outcomes
//! compared: status, the headers that matter, the body (for the echo backend: the
//! headers the upstream received), and the filters' stats.
//!
//! - `envoy.filters.http.fault`: per-route aborts (HTTP and gRPC status, 0 % and
//!   100 %), fixed and header-controlled delays and aborts, header matchers.
//! - `envoy.filters.http.cors`: preflights answered or forwarded, simple requests,
//!   the route's policy over the virtual host's, `forward_not_matching_preflights`.
//! - `envoy.filters.http.ext_authz` (gRPC): an authorization server written with
//!   grpcio (tests/support/ext_authz_server.py) in pod `backends` allows (headers set,
//!   appended, removed upstream, added downstream), denies (its status, headers,
//!   body), fails (status_on_error, failure_mode_allow with its header), sees the
//!   buffered body and the route's context extensions; a body over
//!   `max_request_bytes` is refused.
//!
//! Needs root, Envoy (`cargo xtask setup`) and grpcio (`cargo xtask setup` puts it in
//! `~/.cache/shunt/python-grpc`).

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
const AUTHZ_PORT: u16 = 9191;
/// Nothing listens there: checks to it fail.
const AUTHZ_DOWN_PORT: u16 = 9199;

/// Echoes each request as JSON: its path, headers (lowercase names, every value) and
/// body.
const ECHO_SERVER: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        seen = {}
        for k, v in self.headers.items():
            seen.setdefault(k.lower(), []).append(v)
        out = json.dumps({"path": self.path, "headers": seen, "body": body.decode("latin-1")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = do_PUT = do_OPTIONS = do_DELETE = answer
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"#;

fn typed(type_name: &str, mut config: Value) -> Value {
    config["@type"] = json!(format!("type.googleapis.com/{type_name}"));
    config
}

fn fault(config: Value) -> Value {
    typed("envoy.extensions.filters.http.fault.v3.HTTPFault", config)
}

fn cors_policy(config: Value) -> Value {
    typed("envoy.extensions.filters.http.cors.v3.CorsPolicy", config)
}

fn ext_authz_per_route(config: Value) -> Value {
    typed(
        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
        config,
    )
}

fn ext_authz(cluster: &str, extra: Value) -> Value {
    let mut config = json!({
        "grpc_service": {"envoy_grpc": {"cluster_name": cluster}, "timeout": "2s"},
        "transport_api_version": "V3"
    });
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    json!({"name": "envoy.filters.http.ext_authz",
           "typed_config": typed("envoy.extensions.filters.http.ext_authz.v3.ExtAuthz", config)})
}

fn to_backend(prefix: &str, per_filter: Value) -> Value {
    json!({"match": {"prefix": prefix}, "route": {"cluster": "backend"},
           "typed_per_filter_config": per_filter})
}

fn hcm(stat_prefix: &str, filters: Vec<Value>, virtual_hosts: Value) -> Value {
    let mut http_filters = filters;
    http_filters.push(json!({"name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}));
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": "AUTO",
        "http_filters": http_filters,
        "route_config": {"name": stat_prefix, "virtual_hosts": virtual_hosts}
    }})
}

/// Listeners at `base` (fault, CORS and ext_authz in front of the routes), `base + 1`
/// (ext_authz with failure_mode_allow to a dead server) and `base + 2` (ext_authz to a
/// dead server, status_on_error 503).
fn bootstrap(base: u16, admin: u16, backends: Ipv4Addr) -> Value {
    let at = |port| SocketAddr::new(backends.into(), port);
    let fault_filter =
        json!({"name": "envoy.filters.http.fault", "typed_config": fault(json!({}))});
    let cors_filter = json!({"name": "envoy.filters.http.cors",
        "typed_config": typed("envoy.extensions.filters.http.cors.v3.Cors", json!({}))});
    let hundred = json!({"numerator": 100});
    let main = hcm(
        "l7",
        vec![
            fault_filter,
            cors_filter,
            ext_authz(
                "authz",
                json!({"with_request_body": {"max_request_bytes": 8}}),
            ),
        ],
        json!([
            {
                "name": "cors", "domains": ["cors.example"],
                "typed_per_filter_config": {
                    "envoy.filters.http.cors": cors_policy(json!({
                        "allow_origin_string_match": [{"exact": "https://allowed.example"}],
                        "allow_methods": "GET,PUT",
                        "allow_headers": "x-custom",
                        "max_age": "600",
                        "expose_headers": "x-exposed",
                        "allow_credentials": true
                    })),
                    "envoy.filters.http.ext_authz": ext_authz_per_route(json!({"disabled": true}))
                },
                "routes": [
                    to_backend("/strict", json!({"envoy.filters.http.cors": cors_policy(json!({
                        "allow_origin_string_match": [{"prefix": "https://strict."}],
                        "allow_methods": "*",
                        "allow_headers": "*",
                        "forward_not_matching_preflights": false
                    }))})),
                    to_backend("/", json!({}))
                ]
            },
            {
                "name": "default", "domains": ["*"],
                "routes": [
                    to_backend("/fault/abort", json!({"envoy.filters.http.fault": fault(json!({
                        "abort": {"http_status": 503, "percentage": hundred}}))})),
                    to_backend("/fault/none", json!({"envoy.filters.http.fault": fault(json!({
                        "abort": {"http_status": 503, "percentage": {"numerator": 0}}}))})),
                    to_backend("/fault/grpc", json!({"envoy.filters.http.fault": fault(json!({
                        "abort": {"grpc_status": 14, "percentage": hundred}}))})),
                    to_backend("/fault/delay", json!({"envoy.filters.http.fault": fault(json!({
                        "delay": {"fixed_delay": "0.05s", "percentage": hundred}}))})),
                    to_backend("/fault/header", json!({"envoy.filters.http.fault": fault(json!({
                        "abort": {"header_abort": {}, "percentage": hundred},
                        "delay": {"header_delay": {}, "percentage": hundred}}))})),
                    to_backend("/fault/matched", json!({"envoy.filters.http.fault": fault(json!({
                        "abort": {"http_status": 418, "percentage": hundred},
                        "headers": [{"name": "x-fault", "string_match": {"exact": "yes"}}]}))})),
                    to_backend("/authz/ext", json!({"envoy.filters.http.ext_authz": ext_authz_per_route(json!({
                        "check_settings": {"context_extensions": {"tenant": "a"}}}))})),
                    to_backend("/noauthz", json!({"envoy.filters.http.ext_authz": ext_authz_per_route(json!({
                        "disabled": true}))})),
                    to_backend("/", json!({}))
                ]
            }
        ]),
    );
    let all = json!([{"name": "all", "domains": ["*"], "routes": [to_backend("/", json!({}))]}]);
    let open = hcm(
        "l7_open",
        vec![ext_authz(
            "authz_down",
            json!({"failure_mode_allow": true, "failure_mode_allow_header_add": true}),
        )],
        all.clone(),
    );
    let closed = hcm(
        "l7_closed",
        vec![ext_authz(
            "authz_down",
            json!({"status_on_error": {"code": 503}}),
        )],
        all,
    );
    let listener = |name: &str, port: u16, filter: Value| {
        json!({"name": name, "address": socket_address("0.0.0.0", port),
               "filter_chains": [{"filters": [filter]}]})
    };
    json!({
        "node": {"id": "l7-test", "cluster": "l7-test"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                listener("main", base, main),
                listener("open", base + 1, open),
                listener("closed", base + 2, closed)
            ],
            "clusters": [
                static_cluster("backend", at(ECHO_PORT), false),
                static_cluster("authz", at(AUTHZ_PORT), true),
                static_cluster("authz_down", at(AUTHZ_DOWN_PORT), true)
            ]
        }
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
    fn new(tag: &str) -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new(tag);
        let echo = backends
            .command("/usr/bin/python3")
            .args(["-c", ECHO_SERVER, &ECHO_PORT.to_string()])
            .spawn()
            .expect("start the echo server");
        let (python, path) = support::python_grpc();
        let authz = backends
            .command(&python)
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/support/ext_authz_server.py"
            ))
            .arg(AUTHZ_PORT.to_string())
            .env("PYTHONPATH", &path)
            .spawn()
            .expect("start the ext_authz server");
        // grpcio listens dual-stack on [::].
        let any6 = |port| SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port));
        for (at, process) in [
            (SocketAddr::from(([127, 0, 0, 1], ECHO_PORT)), &echo),
            (any6(AUTHZ_PORT), &authz),
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
            [SHUNT_PORT + 2, ENVOY_PORT + 2],
        );
        Scene {
            _node: node,
            proxy_pod,
            client,
            shunt,
            envoy,
            _backends: vec![echo, authz],
            _dir: dir,
        }
    }

    /// curl from the client pod: the last response's status, headers and body.
    fn curl(&self, port: u16, path: &str, args: &[&str]) -> Response {
        let url = format!("http://{}:{port}{path}", self.proxy_pod.ipv4());
        let out = self
            .client
            .command("curl")
            .args(["-s", "-S", "-i", "--max-time", "10"])
            .args(args)
            .arg(&url)
            .output()
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "curl {args:?} {url} failed: {}{text}\nshunt: {}",
            String::from_utf8_lossy(&out.stderr),
            self.shunt.stderr_text()
        );
        Response::parse(&text)
    }
}

/// The response headers compared (the rest, such as `date` or
/// `x-envoy-upstream-service-time`, differ by nature).
const COMPARED_HEADERS: &[&str] = &[
    "access-control-allow-origin",
    "access-control-allow-credentials",
    "access-control-allow-methods",
    "access-control-allow-headers",
    "access-control-max-age",
    "access-control-expose-headers",
    "access-control-allow-private-network",
    "x-authz-response",
    "x-denied-by",
    "grpc-status",
    "grpc-message",
    "content-type",
];

/// The request headers the backend saw that are compared.
const COMPARED_UPSTREAM: &[&str] = &[
    "x-authz-set",
    "x-authz-append",
    "x-authz-remove",
    "x-authz-saw-method",
    "x-authz-saw-body",
    "x-authz-saw-extensions",
    "x-envoy-auth-failure-mode-allowed",
    "origin",
    "access-control-request-method",
];

/// What is compared of a response: the status, the headers above, and the body (for
/// the echo backend: its path and the request headers above).
fn outcome(r: &Response) -> Value {
    let headers: BTreeMap<_, _> = COMPARED_HEADERS
        .iter()
        .filter_map(|h| Some((*h, r.headers.get(*h)?.clone())))
        .collect();
    let body = match serde_json::from_str::<Value>(&r.body) {
        Ok(echo) if echo.get("headers").is_some() => {
            let seen: BTreeMap<_, _> = COMPARED_UPSTREAM
                .iter()
                .filter_map(|h| Some((*h, echo["headers"].get(*h)?.clone())))
                .collect();
            json!({"upstream_path": echo["path"], "upstream_headers": seen})
        }
        _ => json!(r.body),
    };
    json!({"status": r.status, "headers": headers, "body": body})
}

/// The counters of the filters under test (`fault.`, `cors.`, `ext_authz.`) that are
/// not zero. Envoy makes some of them at start (zero); shunt when first counted.
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
                && [".fault.", ".cors.", ".ext_authz."]
                    .iter()
                    .any(|f| name.contains(f))
        })
        .collect()
}

struct Case {
    name: &'static str,
    /// 0: the main listener, 1: failure_mode_allow, 2: status_on_error 503.
    listener: u16,
    path: &'static str,
    args: &'static [&'static str],
    /// What Envoy is expected to answer, so a table that changes nothing cannot pass.
    status: u16,
}

const fn case(
    name: &'static str,
    listener: u16,
    path: &'static str,
    args: &'static [&'static str],
    status: u16,
) -> Case {
    Case {
        name,
        listener,
        path,
        args,
        status,
    }
}

const PREFLIGHT: &[&str] = &[
    "-X",
    "OPTIONS",
    "-H",
    "host: cors.example",
    "-H",
    "access-control-request-method: PUT",
    "-H",
    "access-control-request-headers: x-custom, x-other",
];

const CASES: &[Case] = &[
    case("fault: abort 100%", 0, "/fault/abort", &[], 503),
    case("fault: abort 0%", 0, "/fault/none", &[], 200),
    case(
        "fault: gRPC abort, not a gRPC request",
        0,
        "/fault/grpc",
        &[],
        200,
    ),
    case(
        "fault: gRPC abort",
        0,
        "/fault/grpc",
        &["-H", "content-type: application/grpc"],
        200,
    ),
    case("fault: fixed delay", 0, "/fault/delay", &[], 200),
    case(
        "fault: header abort",
        0,
        "/fault/header",
        &["-H", "x-envoy-fault-abort-request: 429"],
        429,
    ),
    case(
        "fault: header abort out of range",
        0,
        "/fault/header",
        &["-H", "x-envoy-fault-abort-request: 700"],
        200,
    ),
    case(
        "fault: header gRPC abort",
        0,
        "/fault/header",
        &[
            "-H",
            "x-envoy-fault-abort-grpc-request: 5",
            "-H",
            "content-type: application/grpc",
        ],
        200,
    ),
    case(
        "fault: header delay, abort at 0%",
        0,
        "/fault/header",
        &[
            "-H",
            "x-envoy-fault-delay-request: 20",
            "-H",
            "x-envoy-fault-abort-request: 500",
            "-H",
            "x-envoy-fault-abort-request-percentage: 0",
        ],
        200,
    ),
    case(
        "fault: header matcher matches",
        0,
        "/fault/matched",
        &["-H", "x-fault: yes"],
        418,
    ),
    case(
        "fault: header matcher does not",
        0,
        "/fault/matched",
        &["-H", "x-fault: no"],
        200,
    ),
    case(
        "cors: preflight, allowed origin",
        0,
        "/",
        &[
            "-X",
            "OPTIONS",
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://allowed.example",
            "-H",
            "access-control-request-method: PUT",
        ],
        200,
    ),
    case(
        "cors: preflight, other origin, forwarded",
        0,
        "/",
        &[
            "-X",
            "OPTIONS",
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://other.example",
            "-H",
            "access-control-request-method: PUT",
        ],
        200,
    ),
    case(
        "cors: preflight, route policy, echoes * lists",
        0,
        "/strict",
        &[
            "-X",
            "OPTIONS",
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://strict.example",
            "-H",
            "access-control-request-method: DELETE",
            "-H",
            "access-control-request-headers: x-a,x-b",
        ],
        200,
    ),
    case(
        "cors: preflight, route policy, not matching, not forwarded",
        0,
        "/strict",
        &[
            "-X",
            "OPTIONS",
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://allowed.example",
            "-H",
            "access-control-request-method: PUT",
        ],
        200,
    ),
    case(
        "cors: OPTIONS without request method",
        0,
        "/",
        &[
            "-X",
            "OPTIONS",
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://allowed.example",
        ],
        200,
    ),
    case(
        "cors: simple request, allowed",
        0,
        "/",
        &[
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://allowed.example",
        ],
        200,
    ),
    case(
        "cors: simple request, other origin",
        0,
        "/",
        &[
            "-H",
            "host: cors.example",
            "-H",
            "origin: https://other.example",
        ],
        200,
    ),
    case("cors: preflight without origin", 0, "/", PREFLIGHT, 200),
    case(
        "ext_authz: allowed, headers changed",
        0,
        "/ok",
        &["-H", "x-authz-remove: gone", "-H", "x-authz-append: orig"],
        200,
    ),
    case(
        "ext_authz: denied with status, header, body",
        0,
        "/deny",
        &[],
        401,
    ),
    case("ext_authz: denied bare", 0, "/bare", &[], 403),
    case("ext_authz: server error", 0, "/error", &[], 403),
    case("ext_authz: body sent", 0, "/ok", &["-d", "hi"], 200),
    case(
        "ext_authz: body too large",
        0,
        "/ok",
        &["-d", "more than eight bytes"],
        413,
    ),
    case("ext_authz: context extensions", 0, "/authz/ext", &[], 200),
    case(
        "ext_authz: disabled on the route",
        0,
        "/noauthz/deny",
        &[],
        200,
    ),
    case("ext_authz: failure_mode_allow", 1, "/x", &[], 200),
    case("ext_authz: status_on_error", 2, "/x", &[], 503),
];

#[test]
fn fault_cors_and_ext_authz_answer_as_envoy_does() {
    let s = Scene::new("l7-filters");
    let mut differences = Vec::new();
    for c in CASES {
        let envoy = s.curl(ENVOY_PORT + c.listener, c.path, c.args);
        let shunt = s.curl(SHUNT_PORT + c.listener, c.path, c.args);
        assert_eq!(
            envoy.status, c.status,
            "{}: Envoy answered {envoy:?}; the case expects {}",
            c.name, c.status
        );
        let (theirs, ours) = (outcome(&envoy), outcome(&shunt));
        if theirs != ours {
            differences.push(format!("{}:\n  envoy {theirs}\n  shunt {ours}", c.name));
        }
    }
    let envoy_stats = filter_stats(&s.proxy_pod, ENVOY_ADMIN);
    let shunt_stats = filter_stats(&s.proxy_pod, SHUNT_ADMIN);
    assert!(
        envoy_stats.contains_key("http.l7.fault.aborts_injected")
            && envoy_stats.contains_key("http.l7.cors.origin_valid")
            && envoy_stats.contains_key("http.l7.ext_authz.ok"),
        "Envoy's stats lack the filters': {envoy_stats:?}"
    );
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
