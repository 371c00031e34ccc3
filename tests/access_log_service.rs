//! Access-log services (Telemetry accessLogging with meshConfig's `envoyHttpAls`,
//! `envoyTcpAls` and `envoyOtelAls` providers), differential against Envoy 1.40: the
//! same bootstrap (but ports) served by `shunt proxy -c` and by Envoy in pod `proxy`,
//! the same requests from pod `client`, and the entries a gRPC access log service and
//! an OTLP logs receiver (`support/log_receiver.py`, grpcio, one port per proxy)
//! receive, compared field by field:
//! - `envoy.access_loggers.http_grpc` behind a CEL filter (`response.code < 400 ||
//!   request.headers['x-log'] == 'always'`: a 404 without the header is an evaluation
//!   error, so not logged), with additional request and response headers;
//! - `envoy.access_loggers.open_telemetry` as istiod writes it (`common_config`,
//!   `disable_builtin_labels`), whose body and attributes are format strings using the
//!   formatter commands Istio's default format and Telemetry labels use;
//! - `envoy.access_loggers.tcp_grpc` on a `tcp_proxy` listener.
//!
//! Ignored, as they differ between any two runs or proxies: times and durations,
//! ports of the downstream side (each proxy listens on its own), the upstream local
//! address, request ids, stream ids, header and wire byte counts (each proxy's own
//! response headers differ: `date`, `x-envoy-upstream-service-time`).
//! Then an unreachable log service: requests still succeed, and shunt counts the
//! entries it drops (`access_logs.grpc_access_log.logs_dropped`).
//!
//! Needs root and Envoy (`cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::{socket_address, static_cluster};
use support::xds::admin_at;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const ECHO_PORT: u16 = 8081;
/// The receiver's port for Envoy's entries and for shunt's.
const ENVOY_ALS: u16 = 9901;
const SHUNT_ALS: u16 = 9902;
/// Where nothing listens.
const DOWN_ALS: u16 = 9909;

const ECHO_SERVER: &str = r#"
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        status = 404 if self.path.startswith("/missing") else 200
        out = b"hello " + self.path.encode()
        self.send_response(status)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), Echo).serve_forever()
"#;

/// The body of the OpenTelemetry entries: Istio's default text format without its
/// per-run fields (times, durations, downstream addresses).
const OTEL_BODY: &str = "%REQ(:METHOD)% %REQ(X-ENVOY-ORIGINAL-PATH?:PATH)% %PROTOCOL% \
%RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %CONNECTION_TERMINATION_DETAILS% \
\"%UPSTREAM_TRANSPORT_FAILURE_REASON%\" %BYTES_RECEIVED% %BYTES_SENT% \"%REQ(X-FORWARDED-FOR)%\" \
\"%REQ(USER-AGENT)%\" \"%REQ(:AUTHORITY)%\" \"%UPSTREAM_HOST%\" %UPSTREAM_CLUSTER_RAW% \
%REQUESTED_SERVER_NAME% %ROUTE_NAME%\n";

fn grpc_common(log_name: &str, cluster: &str, extra: Value) -> Value {
    let mut common = json!({
        "log_name": log_name,
        "grpc_service": {"envoy_grpc": {"cluster_name": cluster, "authority": "als.test"}},
        "transport_api_version": "V3",
        "buffer_flush_interval": "0.2s",
        "filter_state_objects_to_log": ["upstream_peer", "downstream_peer"]
    });
    for (key, value) in extra.as_object().expect("an object") {
        common[key] = value.clone();
    }
    common
}

fn http_als(cluster: &str, extra: Value) -> Value {
    json!({
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": "response.code < 400 || request.headers['x-log'] == 'always'"
            }}},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": grpc_common("http_envoy_accesslog", cluster, extra),
            "additional_request_headers_to_log": ["x-test", "x-log"],
            "additional_response_headers_to_log": ["content-type"]
        }
    })
}

/// As istiod's `buildOpenTelemetryAccessLogConfig` writes it, with labels.
fn otel_als() -> Value {
    let labels = [
        ("method", "%REQ(:METHOD)%"),
        ("code", "%RESPONSE_CODE%"),
        ("day", "%START_TIME(%Y-%m-%d)%"),
        ("env", "%ENVIRONMENT(ALS_TEST_ENV)%"),
        ("missing_env", "%ENVIRONMENT(ALS_TEST_UNSET)%"),
        ("peer_san", "%DOWNSTREAM_PEER_URI_SAN%"),
        ("local_san", "%DOWNSTREAM_LOCAL_URI_SAN%"),
        ("peer_subject", "%DOWNSTREAM_PEER_SUBJECT%"),
        ("tls_version", "%DOWNSTREAM_TLS_VERSION%"),
        ("upstream_peer_san", "%UPSTREAM_PEER_URI_SAN%"),
        ("content_type", "%RESP(CONTENT-TYPE)%"),
        ("upstream_address", "%UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%"),
        ("route", "%ROUTE_NAME%"),
        ("host_trunc", "%REQ(:AUTHORITY):4%"),
    ];
    let attributes: Vec<Value> = labels
        .iter()
        .map(|(k, v)| json!({"key": k, "value": {"string_value": v}}))
        .collect();
    json!({
        "name": "envoy.access_loggers.open_telemetry",
        "filter": {"extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": "request.url_path.startsWith('/otel')"
            }}},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig",
            "common_config": grpc_common("otel_envoy_accesslog", "als", json!({
                "filter_state_objects_to_log": ["upstream_peer", "downstream_peer",
                    "wasm.upstream_peer", "wasm.upstream_peer_id", "wasm.downstream_peer", "wasm.downstream_peer_id"]
            })),
            "disable_builtin_labels": true,
            "body": {"string_value": OTEL_BODY},
            "attributes": {"values": attributes}
        }
    })
}

fn tcp_als() -> Value {
    json!({
        "name": "envoy.tcp_grpc_access_log",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.TcpGrpcAccessLogConfig",
            "common_config": grpc_common("tcp_envoy_accesslog", "als", json!({}))
        }
    })
}

fn bootstrap(port: u16, admin: u16, backends: Ipv4Addr, als_port: u16) -> Value {
    let hcm = |access_log: Value| {
        json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "als",
            "codec_type": "AUTO",
            "access_log": access_log,
            "http_filters": [{"name": "envoy.filters.http.router",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            "route_config": {"name": "als", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                {"name": "everything", "match": {"prefix": "/"}, "route": {"cluster": "backend"}}
            ]}]}
        }})
    };
    let tcp = json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": "tcp", "cluster": "backend", "access_log": [tcp_als()]}});
    let down = http_als("als_down", json!({"buffer_size_bytes": 1}));
    json!({
        "node": {"id": "als-test", "cluster": "als-test"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": [
                {"name": "http", "address": socket_address("0.0.0.0", port),
                 "filter_chains": [{"filters": [hcm(json!([http_als("als", json!({})), otel_als()]))]}]},
                {"name": "tcp", "address": socket_address("0.0.0.0", port + 1),
                 "filter_chains": [{"filters": [tcp]}]},
                {"name": "down", "address": socket_address("0.0.0.0", port + 2),
                 "filter_chains": [{"filters": [hcm(json!([down]))]}]}
            ],
            "clusters": [
                static_cluster("backend", SocketAddr::new(backends.into(), ECHO_PORT), false),
                static_cluster("als", SocketAddr::new(backends.into(), als_port), true),
                static_cluster("als_down", SocketAddr::new(backends.into(), DOWN_ALS), true)
            ]
        }
    })
}

/// Removes what naturally differs between the two proxies' entries (see the module
/// doc), so the rest compares as is.
fn normalize(entry: &mut Value) {
    const IGNORED: &[&str] = &[
        "start_time",
        "duration",
        "time_to_last_rx_byte",
        "time_to_first_upstream_tx_byte",
        "time_to_last_upstream_tx_byte",
        "time_to_first_upstream_rx_byte",
        "time_to_last_upstream_rx_byte",
        "time_to_first_downstream_tx_byte",
        "time_to_last_downstream_tx_byte",
        "time_unix_nano",
        "observed_time_unix_nano",
        "upstream_local_address",
        "request_id",
        "stream_id",
        "request_headers_bytes",
        "response_headers_bytes",
        "downstream_wire_bytes_sent",
        "downstream_wire_bytes_received",
        "upstream_wire_bytes_sent",
        "upstream_wire_bytes_received",
        "upstream_header_bytes_sent",
        "upstream_header_bytes_received",
        "downstream_header_bytes_sent",
        "downstream_header_bytes_received",
    ];
    match entry {
        Value::Object(map) => {
            for key in IGNORED {
                map.remove(*key);
            }
            // The downstream side's ports are each proxy's own listener's.
            for key in [
                "downstream_local_address",
                "downstream_remote_address",
                "downstream_direct_remote_address",
            ] {
                if let Some(port) = map
                    .get_mut(key)
                    .and_then(|a| a.get_mut("socket_address"))
                    .and_then(|s| s.as_object_mut())
                {
                    port.remove("port_value");
                }
            }
            for value in map.values_mut() {
                normalize(value);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalize),
        _ => {}
    }
}

/// The entries received for one proxy, by kind, in a stable order.
fn received(receiver: &PodProcess, port: u16) -> BTreeMap<String, Vec<Value>> {
    let mut out: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for line in receiver.stdout_text().lines() {
        let Ok(mut record) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if record["port"] != port {
            continue;
        }
        record.as_object_mut().expect("an object").remove("port");
        normalize(&mut record);
        let kind = record["kind"].as_str().unwrap_or_default().to_owned();
        out.entry(kind).or_default().push(record);
    }
    for entries in out.values_mut() {
        entries.sort_by_key(|e| e.to_string());
    }
    out
}

fn counters(pod: &Pod, admin: u16) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, &format!("127.0.0.1:{admin}"), "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .filter(|(name, _)| name.starts_with("access_logs."))
        .collect()
}

fn curl(client: &Pod, proxy: &Pod, port: u16, path: &str, headers: &[&str]) -> u16 {
    let url = format!("http://{}:{port}{path}", proxy.ipv4());
    let mut command = client.command("curl");
    command = command.args([
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        "--max-time",
        "10",
    ]);
    command = command.args(["-H", "host: svc.test", "-A", "als-test/1"]);
    for header in headers {
        command = command.args(["-H", header]);
    }
    let out = command.arg(&url).output().expect("run curl");
    String::from_utf8_lossy(&out.stdout).parse().unwrap_or(0)
}

#[test]
fn access_log_services_receive_what_envoy_sends() {
    let mut node = Node::new().expect("node");
    let proxy = node.add_pod("proxy").expect("pod proxy");
    let backends = node.add_pod("backends").expect("pod backends");
    let client = node.add_pod("client").expect("pod client");
    let dir = TempDir::new("access-log-service");
    let echo = backends
        .command("/usr/bin/python3")
        .args(["-c", ECHO_SERVER, &ECHO_PORT.to_string()])
        .spawn()
        .expect("start the echo server");
    let (python, pythonpath) = support::python_grpc();
    let receiver = backends
        .command(&python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/support/log_receiver.py"
        ))
        .args([ENVOY_ALS.to_string(), SHUNT_ALS.to_string()])
        .env("PYTHONPATH", &pythonpath)
        .spawn()
        .expect("start the log receiver");
    receiver
        .wait_for_stdout(|l| l.starts_with("listening"), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("log receiver: {e}\n{}", receiver.stderr_text()));
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
        bootstrap(SHUNT_PORT, SHUNT_ADMIN, backends.ipv4(), SHUNT_ALS),
    );
    let envoy_config = write(
        "envoy.json",
        bootstrap(ENVOY_PORT, ENVOY_ADMIN, backends.ipv4(), ENVOY_ALS),
    );
    // SAFETY: set before the proxies start, read by them (%ENVIRONMENT(...)%).
    unsafe { std::env::set_var("ALS_TEST_ENV", "from-env") };
    let (shunt, envoy): (PodProcess, PodProcess) = support::envoy::start_side_by_side(
        &proxy,
        &shunt_config,
        &envoy_config,
        [SHUNT_PORT, ENVOY_PORT],
    );

    // (path, headers, status): the CEL filter drops the plain 404.
    let requests: [(&str, &[&str], u16); 5] = [
        ("/ok?q=1", &["x-test: one"], 200),
        ("/missing", &[], 404),
        ("/missing/logged", &["x-log: always"], 404),
        ("/otel/a", &[], 200),
        ("/otel/missing", &["x-test: two"], 200),
    ];
    for (path, headers, status) in requests {
        for port in [ENVOY_PORT, SHUNT_PORT] {
            let got = curl(&client, &proxy, port, path, headers);
            assert_eq!(got, status, "{path} through port {port}");
        }
    }
    // One connection through each tcp_proxy.
    for port in [ENVOY_PORT, SHUNT_PORT] {
        assert_eq!(curl(&client, &proxy, port + 1, "/tcp", &[]), 200);
    }
    // The unreachable service: every request still answered.
    for _ in 0..5 {
        for port in [ENVOY_PORT, SHUNT_PORT] {
            assert_eq!(curl(&client, &proxy, port + 2, "/down", &[]), 200);
        }
    }

    // 4 HTTP ALS entries (not the plain 404), 2 OpenTelemetry ones (/otel) and 1 TCP
    // one from each.
    let expected_kinds = |entries: &BTreeMap<String, Vec<Value>>| {
        ["http", "otel", "tcp"].map(|k| entries.get(k).map_or(0, Vec::len)) == [4, 2, 1]
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while !(expected_kinds(&received(&receiver, ENVOY_ALS))
        && expected_kinds(&received(&receiver, SHUNT_ALS)))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let theirs = received(&receiver, ENVOY_ALS);
    let ours = received(&receiver, SHUNT_ALS);
    let mut differences = Vec::new();
    assert!(
        expected_kinds(&theirs),
        "Envoy's entries: {theirs:#?}\n{}\nreceiver: {}\nEnvoy's counters: {:?}",
        envoy.stderr_text(),
        receiver.stderr_text(),
        counters(&proxy, ENVOY_ADMIN)
    );
    for kind in ["http", "otel", "tcp"] {
        let (a, b) = (&theirs[kind], ours.get(kind).cloned().unwrap_or_default());
        if a.len() != b.len() {
            differences.push(format!(
                "{kind}: envoy sent {} entries, shunt {}",
                a.len(),
                b.len()
            ));
            continue;
        }
        for (envoy_entry, shunt_entry) in a.iter().zip(&b) {
            if *envoy_entry != *shunt_entry {
                differences.push(format!(
                    "{kind}:\n  envoy {envoy_entry}\n  shunt {shunt_entry}"
                ));
            }
        }
    }

    // Requests went on while the service was down; shunt counted what it dropped.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut shunt_counters = counters(&proxy, SHUNT_ADMIN);
    while shunt_counters
        .get("access_logs.grpc_access_log.logs_dropped")
        .is_none_or(|n| *n == 0)
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(200));
        shunt_counters = counters(&proxy, SHUNT_ADMIN);
    }
    let envoy_counters = counters(&proxy, ENVOY_ADMIN);
    assert!(
        shunt_counters["access_logs.grpc_access_log.logs_dropped"] > 0,
        "shunt: {shunt_counters:?} (envoy: {envoy_counters:?})"
    );
    assert!(
        shunt_counters["access_logs.grpc_access_log.logs_written"] >= 4,
        "shunt: {shunt_counters:?}"
    );
    assert!(
        differences.is_empty(),
        "{} differences from Envoy:\n{}\nshunt stderr:\n{}\nenvoy stderr:\n{}",
        differences.len(),
        differences.join("\n"),
        shunt.stderr_text(),
        envoy.stderr_text()
    );
}

/// istiod's listener for a Telemetry with `envoyOtelAls` and a CEL filter
/// (tests/fixtures/istio38_telemetry_access_log.json, see SOURCES.md), in Istio's own
/// bootstrap: `shunt proxy --mode validate` accepts it, with no word about its access
/// loggers, filters or formats (only the collector cluster istiod pushes separately is
/// missing).
#[test]
fn istiod_telemetry_access_log_listener_validates() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let dump: Value = serde_json::from_slice(
        &std::fs::read(fixtures.join("istio38_telemetry_access_log.json")).unwrap(),
    )
    .unwrap();
    let mut listener =
        dump["configs"][0]["dynamic_listeners"][0]["active_state"]["listener"].clone();
    listener.as_object_mut().unwrap().remove("@type");
    let mut bootstrap: Value = serde_json::from_slice(
        &std::fs::read(fixtures.join("istio/bootstrap/default_golden.json")).unwrap(),
    )
    .unwrap();
    bootstrap["static_resources"]["listeners"] = json!([listener]);
    let dir = TempDir::new("als-validate");
    let file = dir.0.join("bootstrap.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&bootstrap).unwrap()).unwrap();
    let out = std::process::Command::new(harness::shunt_bin())
        .args(["proxy", "--mode", "validate", "-c"])
        .arg(&file)
        .output()
        .expect("run shunt proxy --mode validate");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let about_logs: Vec<&str> = report
        .lines()
        .filter(|l| l.contains("access_log") && !l.contains("no cluster named \"outbound|4317||"))
        .collect();
    assert!(about_logs.is_empty(), "{}", about_logs.join("\n"));
    // The OpenTelemetry logger and its CEL filter were compiled on every HTTP and TCP
    // filter (the missing cluster is reported for each).
    let compiled = report
        .lines()
        .filter(|l| l.contains("no cluster named \"outbound|4317||"))
        .count();
    assert_eq!(compiled, 8, "{report}");
}
