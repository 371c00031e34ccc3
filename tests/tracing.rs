//! Distributed tracing, differential against Envoy 1.40: the same bootstrap (but ports)
//! served by `shunt proxy -c` and by Envoy in pod `proxy`, each reporting to its own
//! test collector (`support/trace_collector.py`: OTLP/gRPC served by grpcio, Zipkin v2
//! JSON over HTTP) in pod `backends`, beside an app that echoes the headers it got.
//! Each proxy is a sidecar pair: an OUTBOUND listener (the client's sidecar, CLIENT
//! spans) forwarding to an INBOUND one (the server's sidecar, SERVER spans) in front of
//! the app, once with `envoy.tracers.opentelemetry` and once with `envoy.tracers.zipkin`,
//! as istiod writes them (Istio's custom tags, the UUID request id extension, route
//! decorators). The same requests from pod `client` give the same spans (count, kinds,
//! names, parent links, tags), the same trace context at the app (`traceparent`,
//! `tracestate`, B3, the decision in `x-request-id`), and the same stats. Two more
//! listeners report to collectors nobody listens at: their requests are served, and
//! the undelivered reports are counted as Envoy counts them.
//!
//! Needs root, Envoy and grpcio (`cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::{socket_address, static_cluster};
use support::xds::admin_at;

/// Each proxy's client sidecar listens from its base port, its server sidecar from
/// `SERVER`; their admin ports are `admin` and `admin + 1`.
const SHUNT_BASE: u16 = 10000;
const ENVOY_BASE: u16 = 11000;
const SERVER: u16 = 100;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const APP_PORT: u16 = 8081;
/// Each proxy's collector: (OTLP, Zipkin).
const SHUNT_COLLECTOR: (u16, u16) = (4317, 9411);
const ENVOY_COLLECTOR: (u16, u16) = (4327, 9421);
/// Where nobody listens.
const DEAD_COLLECTOR: (u16, u16) = (4999, 9999);

/// Listener offsets from a proxy's base port.
const OTEL_OUT: u16 = 1;
const OTEL_IN: u16 = 2;
const ZIPKIN_OUT: u16 = 3;
const ZIPKIN_IN: u16 = 4;
const OTEL_DEAD: u16 = 5;
const ZIPKIN_DEAD: u16 = 6;

/// Answers each request with its path and headers as JSON, with the status
/// `/status/<code>` asks for.
const APP: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        seen = {}
        for k, v in self.headers.items():
            seen.setdefault(k.lower(), []).append(v)
        code = int(self.path.split("/status/")[1]) if "/status/" in self.path else 200
        out = json.dumps({"path": self.path, "headers": seen}).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"#;

/// The tracer istiod writes for an extension provider (`opentelemetry`, or `zipkin`
/// for a pre-1.29 proxy), to collector cluster `cluster`.
fn provider(kind: &str, cluster: &str, service: &str) -> Value {
    if kind == "otel" {
        json!({"name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster,
                "authority": "otel-collector.observability.svc.cluster.local"}},
            "service_name": service}})
    } else {
        json!({"name": "envoy.tracers.zipkin", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.ZipkinConfig",
            "collector_cluster": cluster, "collector_endpoint": "/api/v2/spans",
            "collector_hostname": "zipkin.istio-system.svc.cluster.local",
            "collector_endpoint_version": "HTTP_JSON", "trace_id_128bit": true,
            "shared_span_context": false}})
    }
}

/// Istio's custom tags (`buildServiceTags`, a dry-run RBAC metadata tag) and the
/// Telemetry API's environment and header tags.
fn custom_tags() -> Value {
    let literal = |k: &str, v: &str| json!({"tag": k, "literal": {"value": v}});
    json!([
        {"tag": "istio.authorization.dry_run.allow_policy.name", "metadata": {
            "kind": {"request": {}},
            "metadata_key": {"key": "envoy.filters.http.rbac",
                "path": [{"key": "istio_dry_run_allow_shadow_effective_policy_id"}]}}},
        literal("istio.canonical_revision", "latest"),
        literal("istio.canonical_service", "productpage"),
        literal("istio.cluster_id", "Kubernetes"),
        literal("istio.mesh_id", "cluster.local"),
        literal("istio.namespace", "default"),
        {"tag": "env_home", "environment": {"name": "HOME", "default_value": "none"}},
        {"tag": "env_unset", "environment": {"name": "SHUNT_TRACING_TEST_UNSET", "default_value": "dflt"}},
        {"tag": "client_header", "request_header": {"name": "x-custom", "default_value": "none"}}
    ])
}

fn hcm(prefix: &str, tracer: Value, cluster: &str) -> Value {
    let decorated = json!({"match": {"prefix": "/"}, "route": {"cluster": cluster},
        "decorator": {"operation": "productpage.default.svc.cluster.local:9080/*"}});
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": prefix,
        "codec_type": "AUTO",
        "http_filters": [{"name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "tracing": {"client_sampling": {"value": 100}, "random_sampling": {"value": 100},
            "overall_sampling": {"value": 100}, "custom_tags": custom_tags(), "provider": tracer},
        "request_id_extension": {"typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
            "use_request_id_for_trace_sampling": true}},
        "route_config": {"name": prefix, "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
            {"match": {"prefix": "/nodeco"}, "route": {"cluster": cluster}},
            decorated
        ]}]}
    }})
}

fn listener(name: &str, direction: &str, port: u16, filter: Value) -> Value {
    json!({"name": name, "traffic_direction": direction,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [filter]}]})
}

/// A client sidecar (`server: false`: OUTBOUND listeners to the server sidecar's
/// INBOUND ones, and two to the app reporting to dead collectors) or a server sidecar
/// (INBOUND listeners to the app) of the proxy at `base`.
fn bootstrap(
    server: bool,
    base: u16,
    admin: u16,
    collector: (u16, u16),
    backends: Ipv4Addr,
) -> Value {
    let at = |port: u16| SocketAddr::new(backends.into(), port);
    let peer = |offset: u16| SocketAddr::from(([127, 0, 0, 1], base + SERVER + offset));
    let app = "inbound|9080||";
    let listeners = if server {
        json!([
            listener(
                "otel_in",
                "INBOUND",
                base + SERVER + OTEL_IN,
                hcm(
                    "inbound_0.0.0.0_9080",
                    provider("otel", "otlp", "reviews.default"),
                    app
                )
            ),
            listener(
                "zipkin_in",
                "INBOUND",
                base + SERVER + ZIPKIN_IN,
                hcm(
                    "inbound_0.0.0.0_9081",
                    provider("zipkin", "zipkin", ""),
                    app
                )
            ),
        ])
    } else {
        json!([
            listener(
                "otel_out",
                "OUTBOUND",
                base + OTEL_OUT,
                hcm(
                    "outbound_0.0.0.0_9080",
                    provider("otel", "otlp", "productpage.default"),
                    "outbound|9080||otel"
                )
            ),
            listener(
                "zipkin_out",
                "OUTBOUND",
                base + ZIPKIN_OUT,
                hcm(
                    "outbound_0.0.0.0_9081",
                    provider("zipkin", "zipkin", ""),
                    "outbound|9081||zipkin"
                )
            ),
            listener(
                "otel_dead",
                "OUTBOUND",
                base + OTEL_DEAD,
                hcm(
                    "outbound_dead_otel",
                    provider("otel", "otlp_dead", "dead"),
                    app
                )
            ),
            listener(
                "zipkin_dead",
                "OUTBOUND",
                base + ZIPKIN_DEAD,
                hcm(
                    "outbound_dead_zipkin",
                    provider("zipkin", "zipkin_dead", ""),
                    app
                )
            ),
        ])
    };
    json!({
        "node": {"id": "sidecar~10.0.0.1~productpage-v1-1.default~default.svc.cluster.local",
            "cluster": if server { "reviews.default" } else { "productpage.default" },
            "locality": {"zone": "zone-a"}},
        "admin": {"address": socket_address("127.0.0.1", admin + u16::from(server))},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                static_cluster("outbound|9080||otel", peer(OTEL_IN), false),
                static_cluster("outbound|9081||zipkin", peer(ZIPKIN_IN), false),
                static_cluster(app, at(APP_PORT), false),
                static_cluster("otlp", at(collector.0), true),
                static_cluster("zipkin", at(collector.1), false),
                static_cluster("otlp_dead", at(DEAD_COLLECTOR.0), true),
                static_cluster("zipkin_dead", at(DEAD_COLLECTOR.1), false),
            ]
        }
    })
}

/// One request of the sequence: the listener, the path, the request's headers.
struct Call {
    listener: u16,
    path: &'static str,
    headers: &'static [&'static str],
}

const GIVEN_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const GIVEN_SPAN: &str = "b7ad6b7169203331";

const CALLS: &[Call] = &[
    Call {
        listener: OTEL_OUT,
        path: "/hello",
        headers: &["x-custom: from-client", "user-agent: tester"],
    },
    Call {
        listener: OTEL_OUT,
        path: "/nodeco",
        headers: &[],
    },
    Call {
        listener: OTEL_OUT,
        path: "/unsampled",
        headers: &["traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"],
    },
    Call {
        listener: OTEL_OUT,
        path: "/child",
        headers: &[
            "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate: k=v",
        ],
    },
    Call {
        listener: OTEL_OUT,
        path: "/status/503",
        headers: &[],
    },
    Call {
        listener: OTEL_OUT,
        path: "/status/404",
        headers: &[],
    },
    Call {
        listener: ZIPKIN_OUT,
        path: "/zhello",
        headers: &["x-custom: from-client"],
    },
    Call {
        listener: ZIPKIN_OUT,
        path: "/zunsampled",
        headers: &["x-b3-sampled: 0"],
    },
    Call {
        listener: ZIPKIN_OUT,
        path: "/zchild",
        headers: &[
            "x-b3-traceid: 0af7651916cd43dd8448eb211c80319c",
            "x-b3-spanid: b7ad6b7169203331",
            "x-b3-sampled: 1",
        ],
    },
    Call {
        listener: ZIPKIN_OUT,
        path: "/zsingle",
        headers: &["b3: 0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1"],
    },
];

/// `curl` from `client` to the proxy's listener: the status and the body (the app's
/// echo of what it got, when it answered).
fn curl(client: &Pod, proxy: &Pod, port: u16, path: &str, headers: &[&str]) -> (u16, Value) {
    let url = format!("http://{}:{port}{path}", proxy.ipv4());
    let mut cmd =
        client
            .command("curl")
            .args(["-s", "-S", "--max-time", "10", "-w", "\n%{http_code}"]);
    for h in headers {
        cmd = cmd.args(["-H", h]);
    }
    let out = cmd.arg(&url).output().expect("run curl");
    assert!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        code.parse().unwrap_or(0),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

/// The spans a collector printed, by their `http.url`'s path.
fn spans(collector: &PodProcess) -> Vec<Value> {
    collector
        .stdout_text()
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a span line"))
        .collect()
}

fn path_of(span: &Value) -> String {
    let url = span["tags"]["http.url"].as_str().unwrap_or("");
    url.splitn(4, '/')
        .nth(3)
        .map(|p| format!("/{p}"))
        .unwrap_or_default()
}

/// Names ids by their order of appearance, so two proxies' random ids compare; the
/// ids the requests gave stay as they are.
#[derive(Default)]
struct Ids(BTreeMap<String, String>);

impl Ids {
    fn name(&mut self, id: &str) -> String {
        if id.is_empty() || id.contains(GIVEN_TRACE) || id == GIVEN_SPAN {
            return id.to_owned();
        }
        let next = format!("id{}", self.0.len());
        self.0.entry(id.to_owned()).or_insert(next).clone()
    }

    /// Every hex id inside a header value (`traceparent`, `b3`), named.
    fn header(&mut self, value: &str) -> String {
        value
            .split('-')
            .map(|part| {
                if part.len() >= 16 && part.bytes().all(|b| b.is_ascii_hexdigit()) {
                    self.name(part)
                } else {
                    part.to_owned()
                }
            })
            .collect::<Vec<_>>()
            .join("-")
    }
}

/// What one request left, proxy-independent: its spans (CLIENT first) with ids named,
/// the volatile tags replaced, and the trace context the app got.
fn outcome(status: u16, echo: &Value, spans: &[&Value], port: u16) -> Value {
    let mut ids = Ids::default();
    let mut ordered: Vec<&&Value> = spans.iter().collect();
    ordered.sort_by_key(|s| {
        (
            s["kind"] != "CLIENT",
            s["format"].as_str().unwrap_or("").to_owned(),
        )
    });
    let spans: Vec<Value> = ordered
        .iter()
        .map(|s| {
            let mut tags = s["tags"].as_object().cloned().unwrap_or_default();
            for volatile in ["guid:x-request-id", "peer.address"] {
                if let Some(v) = tags.get_mut(volatile) {
                    *v = json!("<set>");
                }
            }
            if let Some(url) = tags.get_mut("http.url") {
                *url = json!(
                    url.as_str()
                        .unwrap_or("")
                        .replace(&port.to_string(), "PORT")
                );
            }
            json!({
                "format": s["format"], "service": s["service"], "kind": s["kind"],
                "name": s["name"].as_str().unwrap_or("").replace(&port.to_string(), "PORT"),
                "trace": ids.name(s["trace_id"].as_str().unwrap_or("")),
                "parent": ids.name(s["parent_id"].as_str().unwrap_or("")),
                "span": ids.name(s["span_id"].as_str().unwrap_or("")),
                "status": s.get("status"), "tags": tags,
            })
        })
        .collect();
    let header = |name: &str| echo["headers"][name][0].as_str().map(str::to_owned);
    let mut app = serde_json::Map::new();
    for name in [
        "traceparent",
        "tracestate",
        "b3",
        "x-b3-traceid",
        "x-b3-spanid",
        "x-b3-parentspanid",
        "x-b3-sampled",
        "x-b3-flags",
        "x-envoy-decorator-operation",
    ] {
        if let Some(value) = header(name) {
            app.insert(name.into(), json!(ids.header(&value)));
        }
    }
    // The trace decision packed into the request id (its 15th character).
    if let Some(id) = header("x-request-id") {
        app.insert("x-request-id[14]".into(), json!(id.get(14..15)));
    }
    json!({"status": status, "spans": spans, "app": app})
}

/// The tracing counters of a sidecar pair: the HCMs' decisions and the tracers' reports.
fn tracing_stats(pod: &Pod, admin: u16) -> BTreeMap<String, u64> {
    let mut both = sidecar_stats(pod, admin, "client");
    both.extend(sidecar_stats(pod, admin + 1, "server"));
    both
}

fn sidecar_stats(pod: &Pod, admin: u16, which: &str) -> BTreeMap<String, u64> {
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
                && (name.starts_with("tracing.") || name.contains(".tracing."))
                && !name.ends_with("timer_flushed")
        })
        // How many reports carried the spans depends on how each proxy's workers
        // batched them (Envoy: a buffer per worker); that some were delivered does not.
        .map(|(name, value)| {
            let value = if name.ends_with("reports_sent") {
                1
            } else {
                value
            };
            (format!("{which} {name}"), value)
        })
        .collect()
}

fn start_collector(pod: &Pod, ports: (u16, u16)) -> PodProcess {
    let (python, path) = support::python_grpc();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/support/trace_collector.py");
    let collector = pod
        .command(python)
        .env("PYTHONPATH", path)
        .args([script, &ports.0.to_string(), &ports.1.to_string()])
        .spawn()
        .expect("start the trace collector");
    // The Zipkin port opens after the OTLP one (grpcio's shows as `[::]`).
    let port = ports.1;
    wait_for_port(
        pod,
        SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("collector port {port}: {e}\n{}", collector.stderr_text()));
    collector
}

#[test]
fn spans_and_trace_context_match_envoys() {
    let mut node = Node::new().expect("node");
    let proxy = node.add_pod("proxy").expect("pod proxy");
    let backends = node.add_pod("backends").expect("pod backends");
    let client = node.add_pod("client").expect("pod client");
    let dir = TempDir::new("tracing");
    let app = backends
        .command("/usr/bin/python3")
        .args(["-c", APP, &APP_PORT.to_string()])
        .spawn()
        .expect("start the app");
    wait_for_port(
        &backends,
        SocketAddr::from(([127, 0, 0, 1], APP_PORT)),
        Duration::from_secs(20),
    )
    .unwrap_or_else(|e| panic!("app: {e}\n{}", app.stderr_text()));
    let shunt_collector = start_collector(&backends, SHUNT_COLLECTOR);
    let envoy_collector = start_collector(&backends, ENVOY_COLLECTOR);
    let write = |name: &str, config: Value| {
        let file = dir.0.join(name);
        std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        file
    };
    let mut sidecars = Vec::new();
    for server in [true, false] {
        let shunt = bootstrap(
            server,
            SHUNT_BASE,
            SHUNT_ADMIN,
            SHUNT_COLLECTOR,
            backends.ipv4(),
        );
        let envoy = bootstrap(
            server,
            ENVOY_BASE,
            ENVOY_ADMIN,
            ENVOY_COLLECTOR,
            backends.ipv4(),
        );
        let ready = if server { SERVER + OTEL_IN } else { OTEL_OUT };
        sidecars.push(support::envoy::start_side_by_side(
            &proxy,
            &write(&format!("shunt-{server}.json"), shunt),
            &write(&format!("envoy-{server}.json"), envoy),
            [SHUNT_BASE + ready, ENVOY_BASE + ready],
        ));
    }

    let mut answers = Vec::new();
    for call in CALLS {
        let theirs = curl(
            &client,
            &proxy,
            ENVOY_BASE + call.listener,
            call.path,
            call.headers,
        );
        let ours = curl(
            &client,
            &proxy,
            SHUNT_BASE + call.listener,
            call.path,
            call.headers,
        );
        answers.push((theirs, ours));
    }
    // A collector nobody listens at: every request is still served.
    for listener in [OTEL_DEAD, ZIPKIN_DEAD] {
        for i in 0..6 {
            for base in [ENVOY_BASE, SHUNT_BASE] {
                let (status, _) = curl(&client, &proxy, base + listener, "/dead", &[]);
                assert_eq!(
                    status,
                    200,
                    "request {i} through listener {} with an unreachable collector",
                    base + listener
                );
            }
        }
    }

    // Every span Envoy reports arrives (batches of 5, or the 5 s flush timer).
    let expected: usize = 16;
    let deadline = Instant::now() + Duration::from_secs(20);
    while (spans(&envoy_collector).len() < expected || spans(&shunt_collector).len() < expected)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    // And the reports to the dead collectors have failed (Envoy counts them when the
    // connection is refused).
    let settled = |pod: &Pod, admin: u16| {
        let stats = tracing_stats(pod, admin);
        let sent = |name: &str| {
            ["client", "server"]
                .iter()
                .filter_map(|w| stats.get(&format!("{w} tracing.{name}.spans_sent")))
                .sum::<u64>()
        };
        sent("zipkin") == 12 && sent("opentelemetry") == 16
    };
    while !(settled(&proxy, ENVOY_ADMIN) && settled(&proxy, SHUNT_ADMIN))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));

    let (envoy_spans, shunt_spans) = (spans(&envoy_collector), spans(&shunt_collector));
    assert_eq!(
        envoy_spans.len(),
        expected,
        "Envoy's spans: {envoy_spans:#?}"
    );
    let mut differences = Vec::new();
    for (call, ((t_status, t_echo), (o_status, o_echo))) in CALLS.iter().zip(&answers) {
        let of = |all: &[Value]| -> Vec<Value> {
            all.iter()
                .filter(|s| path_of(s) == call.path)
                .cloned()
                .collect()
        };
        let (t_spans, o_spans) = (of(&envoy_spans), of(&shunt_spans));
        let theirs = outcome(
            *t_status,
            t_echo,
            &t_spans.iter().collect::<Vec<_>>(),
            ENVOY_BASE + call.listener,
        );
        let ours = outcome(
            *o_status,
            o_echo,
            &o_spans.iter().collect::<Vec<_>>(),
            SHUNT_BASE + call.listener,
        );
        if theirs != ours {
            differences.push(format!("{}:\n  envoy {theirs}\n  shunt {ours}", call.path));
        }
    }
    // Envoy's own sanity: the sidecar pair's spans link up, sampling was honoured.
    let pair: Vec<&Value> = envoy_spans
        .iter()
        .filter(|s| path_of(s) == "/child")
        .collect();
    assert_eq!(pair.len(), 2, "{pair:#?}");
    assert!(
        envoy_spans
            .iter()
            .all(|s| path_of(s) != "/unsampled" && path_of(s) != "/zunsampled")
    );

    let (envoy_stats, shunt_stats) = (
        tracing_stats(&proxy, ENVOY_ADMIN),
        tracing_stats(&proxy, SHUNT_ADMIN),
    );
    assert!(
        envoy_stats
            .get("client tracing.zipkin.reports_dropped")
            .is_some_and(|n| *n > 0),
        "{envoy_stats:?}"
    );
    if envoy_stats != shunt_stats {
        differences.push(format!(
            "stats:\n  envoy {envoy_stats:?}\n  shunt {shunt_stats:?}"
        ));
    }
    let stderr: Vec<String> = sidecars
        .iter()
        .map(|(shunt, envoy)| {
            format!(
                "shunt:\n{}\nenvoy:\n{}",
                shunt.stderr_text(),
                envoy.stderr_text()
            )
        })
        .collect();
    assert!(
        differences.is_empty(),
        "{} differences from Envoy:\n{}\n{}",
        differences.len(),
        differences.join("\n"),
        stderr.join("\n")
    );
}

/// The outbound listener istiod writes for a Telemetry resource with an OpenTelemetry
/// extension provider (`fixtures/istio/config_dump/istio38_telemetry_tracing.json`)
/// loads in `--mode validate`, its tracing block with no diagnostic; a tracer shunt
/// does not serve is an error naming its JSON path.
#[test]
fn istiods_telemetry_tracing_listener_validates() {
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/istio/config_dump/istio38_telemetry_tracing.json"
    );
    let dump: Value = serde_json::from_slice(&std::fs::read(fixture).unwrap()).unwrap();
    let mut listener =
        dump["configs"][0]["dynamic_listeners"][0]["active_state"]["listener"].clone();
    listener.as_object_mut().unwrap().remove("@type");
    let dir = TempDir::new("tracing-validate");
    let validate = |listener: &Value| {
        let collector = "outbound|4317||opentelemetry-collector.observability.svc.cluster.local";
        let config = json!({
            "node": {"id": "sidecar~10.0.0.1~httpbin-1.default~default.svc.cluster.local", "cluster": "httpbin.default"},
            "static_resources": {
                "listeners": [listener],
                "clusters": [
                    static_cluster(collector, SocketAddr::from(([10, 0, 0, 9], 4317)), true),
                    {"name": "PassthroughCluster", "type": "ORIGINAL_DST", "connect_timeout": "1s", "lb_policy": "CLUSTER_PROVIDED"}
                ]
            }
        });
        let file = dir.0.join("bootstrap.json");
        std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        let out = std::process::Command::new(harness::shunt_bin())
            .args(["proxy", "--mode", "validate", "-c"])
            .arg(&file)
            .output()
            .expect("run shunt --mode validate");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, text) = validate(&listener);
    assert!(ok, "{text}");
    assert!(text.contains("OK: valid, 0 warnings"), "{text}");

    let mut unknown = listener.clone();
    let tracing = &mut unknown["filter_chains"][0]["filters"][0]["typed_config"]["tracing"];
    tracing["provider"] = json!({"name": "envoy.tracers.datadog", "typed_config": {
        "@type": "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
        "collector_cluster": "PassthroughCluster", "service_name": "httpbin"}});
    let (ok, text) = validate(&unknown);
    assert!(!ok, "a datadog tracer was accepted:\n{text}");
    assert!(
        text.contains("tracing.provider.typed_config") && text.contains("envoy.tracers.datadog"),
        "{text}"
    );
}
