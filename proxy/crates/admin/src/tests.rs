//! The admin API over real sockets: Istio's bootstrap served on ephemeral ports, asked
//! as curl, Prometheus and pilot-agent would ask, every answer parsed (JSON through the
//! config module's descriptor pool, Prometheus text through a small parser below).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use envoy_types::pb::envoy::admin::v3::{
    BootstrapConfigDump, Clusters, ClustersConfigDump, ConfigDump, EndpointsConfigDump, Listeners,
    ServerInfo, clusters_config_dump,
};
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use prost::{Message, Name};
use serde_json::{Value, json};

use super::*;

const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/src/testdata");

/// Istio's `default_golden` bootstrap, as loaded by the config module.
pub fn istio_bootstrap() -> Bootstrap {
    load(None)
}

/// Istio's bootstrap with `yaml` merged over it, as `--config-yaml` does.
fn load(yaml: Option<&str>) -> Bootstrap {
    let options = shunt_config::Options {
        config_path: Some(std::path::Path::new(TESTDATA).join("istio-default_golden.json")),
        config_yaml: yaml.map(str::to_owned),
        ..Default::default()
    };
    shunt_config::check(&options, &shunt_xds::snapshot::extensions::IMPLEMENTED)
        .expect("the Istio bootstrap loads")
        .0
        .bootstrap
}

/// The bootstrap with the admin address and every static listener on 127.0.0.1:0.
fn on_ephemeral_ports(mut bootstrap: Bootstrap) -> Bootstrap {
    let loopback = |address: &mut Option<envoy_types::pb::envoy::config::core::v3::Address>| {
        if let Some(AddressKind::SocketAddress(socket)) =
            address.as_mut().and_then(|a| a.address.as_mut())
        {
            socket.address = "127.0.0.1".into();
            socket.port_specifier = Some(PortSpecifier::PortValue(0));
        }
    };
    loopback(&mut bootstrap.admin.as_mut().unwrap().address);
    for listener in &mut bootstrap.static_resources.as_mut().unwrap().listeners {
        loopback(&mut listener.address);
    }
    bootstrap
}

/// An admin API running for a [`BootstrapOnly`] proxy, with log reloads recorded.
struct Harness {
    handle: AdminHandle,
    proxy: Arc<BootstrapOnly>,
    reloads: Arc<Mutex<Vec<String>>>,
    terminating: Arc<std::sync::atomic::AtomicBool>,
}

impl Harness {
    fn start(bootstrap: Bootstrap) -> Self {
        let bootstrap = on_ephemeral_ports(bootstrap);
        let proxy = Arc::new(BootstrapOnly::new(bootstrap.clone()));
        let reloads = Arc::new(Mutex::new(Vec::new()));
        let recorded = reloads.clone();
        let options = AdminSettings {
            command_line: CommandLineOptions {
                log_level: "info".into(),
                ..Default::default()
            },
            log: LogControl::new(
                "info",
                Some(Arc::new(move |filter: &str| {
                    recorded.lock().unwrap().push(filter.to_owned());
                    Ok(())
                })),
            ),
            terminating: Arc::default(),
        };
        let terminating = options.terminating.clone();
        let handle = start_with(&bootstrap, proxy.clone(), options).expect("admin starts");
        Harness {
            handle,
            proxy,
            reloads,
            terminating,
        }
    }

    fn istio() -> Self {
        Harness::start(istio_bootstrap())
    }

    fn admin(&self) -> SocketAddr {
        self.handle.admin_address().expect("an admin address")
    }

    fn health_port(&self, name: &str) -> SocketAddr {
        self.handle
            .health_listeners()
            .iter()
            .find(|bound| bound.listener.name == name)
            .unwrap_or_else(|| panic!("no health listener {name}"))
            .local_address
    }

    fn get(&self, path: &str) -> Answer {
        request(self.admin(), "GET", path)
    }

    fn post(&self, path: &str) -> Answer {
        request(self.admin(), "POST", path)
    }

    fn get_json(&self, path: &str) -> Value {
        let answer = self.get(path);
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
        assert_eq!(answer.content_type, "application/json", "{path}");
        serde_json::from_str(&answer.body).unwrap_or_else(|err| panic!("{path}: {err}"))
    }
}

#[derive(Debug)]
struct Answer {
    status: u16,
    content_type: String,
    body: String,
}

/// One HTTP/1.1 request on its own connection.
fn request(address: SocketAddr, method: &str, path: &str) -> Answer {
    let mut stream = TcpStream::connect(address).unwrap_or_else(|err| panic!("{address}: {err}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).expect("UTF-8 answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: BTreeMap<String, String> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    assert!(
        !headers.contains_key("transfer-encoding"),
        "the admin answers with a length"
    );
    Answer {
        status,
        content_type: headers.get("content-type").cloned().unwrap_or_default(),
        body: body.to_owned(),
    }
}

fn type_url<M: Name>() -> String {
    M::type_url()
}

/// The `@type` of each config in a dump.
fn config_types(dump: &Value) -> Vec<String> {
    dump["configs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|config| config["@type"].as_str().unwrap().to_owned())
        .collect()
}

/// Reads a dump back as `ConfigDump` through the config module's pool.
fn parse_dump(dump: &Value) -> ConfigDump {
    shunt_config::message_from_json::<ConfigDump>(dump.clone())
        .unwrap_or_else(|err| panic!("not a ConfigDump: {err}\n{dump:#}"))
}

fn unpack<M: Message + Default>(any: &envoy_types::pb::google::protobuf::Any) -> M {
    M::decode(any.value.as_slice()).unwrap()
}

#[test]
fn config_dump_of_the_istio_bootstrap_parses_as_a_config_dump() {
    let harness = Harness::istio();
    let dump = harness.get_json("/config_dump");
    assert_eq!(
        config_types(&dump),
        [
            "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump",
            "type.googleapis.com/envoy.admin.v3.ClustersConfigDump",
            "type.googleapis.com/envoy.admin.v3.ListenersConfigDump",
            "type.googleapis.com/envoy.admin.v3.ScopedRoutesConfigDump",
            "type.googleapis.com/envoy.admin.v3.RoutesConfigDump",
            "type.googleapis.com/envoy.admin.v3.SecretsConfigDump",
        ]
    );
    let parsed = parse_dump(&dump);
    let bootstrap: BootstrapConfigDump = unpack(&parsed.configs[0]);
    assert_eq!(
        bootstrap.bootstrap.unwrap(),
        on_ephemeral_ports(istio_bootstrap())
    );
    let clusters: ClustersConfigDump = unpack(&parsed.configs[1]);
    let names: Vec<String> = clusters
        .static_clusters
        .iter()
        .map(|c| {
            unpack::<envoy_types::pb::envoy::config::cluster::v3::Cluster>(
                c.cluster.as_ref().unwrap(),
            )
            .name
        })
        .collect();
    assert_eq!(names, ["agent", "prometheus_stats", "sds-grpc", "xds-grpc"]);
    assert!(
        clusters
            .static_clusters
            .iter()
            .all(|c| c.last_updated.is_some())
    );
    assert_eq!(
        dump["configs"][2]["static_listeners"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        dump["configs"][4]["static_route_configs"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

/// Envoy 1.40's own `/config_dump` of the same bootstrap, from the corpus: ours has the
/// same config types and the same static clusters, listeners and routes.
#[test]
fn config_dump_matches_envoys_for_the_same_bootstrap() {
    let corpus = shunt_config::testing::corpus()
        .join("envoy-1.40-generated/istio-default_golden__config_dump.json");
    let envoys: Value = serde_json::from_str(&std::fs::read_to_string(&corpus).unwrap()).unwrap();
    let proxy = BootstrapOnly::new(istio_bootstrap());
    let ours = config_dump::config_dump(&proxy, SystemTime::now(), &Default::default()).unwrap();
    assert_eq!(config_types(&ours), config_types(&envoys));
    let without_times = |items: &Value| -> Vec<Value> {
        items
            .as_array()
            .unwrap()
            .iter()
            .map(|item| {
                let mut item = item.clone();
                item.as_object_mut().unwrap().remove("last_updated");
                item
            })
            .collect()
    };
    for (index, field) in [
        (1, "static_clusters"),
        (2, "static_listeners"),
        (4, "static_route_configs"),
    ] {
        assert_eq!(
            without_times(&ours["configs"][index][field]),
            without_times(&envoys["configs"][index][field]),
            "{field}"
        );
    }
}

/// A secret with a private key, and a cluster whose TLS context has one inline: both come
/// out `[redacted]`, in the secrets dump, in the cluster and in the bootstrap.
#[test]
fn config_dump_redacts_secrets_as_envoy_does() {
    let harness = Harness::start(load(Some(
        r#"
static_resources:
  secrets:
  - name: default
    tls_certificate:
      certificate_chain: {inline_string: "CERT"}
      private_key: {inline_string: "KEY"}
  clusters:
  - name: tls
    type: STATIC
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          tls_certificates:
          - certificate_chain: {inline_string: "CERT"}
            private_key: {inline_bytes: "S0VZ"}
"#,
    )));
    let dump = harness.get_json("/config_dump");
    parse_dump(&dump);
    let secret = &dump["configs"][5]["static_secrets"][0];
    assert_eq!(secret["name"], "default");
    assert_eq!(
        secret["secret"]["tls_certificate"],
        json!({
            "certificate_chain": {"inline_string": "CERT"},
            "private_key": {"inline_string": "[redacted]"},
        })
    );
    let clusters = dump["configs"][1]["static_clusters"].as_array().unwrap();
    let tls = clusters
        .iter()
        .find(|c| c["cluster"]["name"] == "tls")
        .unwrap();
    assert_eq!(
        tls["cluster"]["transport_socket"]["typed_config"]["common_tls_context"]["tls_certificates"]
            [0]["private_key"],
        // base64 of "[redacted]", as in Istio's captured Envoy dumps.
        json!({"inline_bytes": "W3JlZGFjdGVkXQ=="})
    );
    let bootstrap_secret = &dump["configs"][0]["bootstrap"]["static_resources"]["secrets"][0];
    assert_eq!(
        bootstrap_secret["tls_certificate"]["private_key"]["inline_string"],
        "[redacted]"
    );
    assert!(!harness.get("/config_dump").body.contains("KEY"));
}

#[test]
fn config_dump_resource_and_mask() {
    let harness = Harness::istio();

    let dump = harness.get_json("/config_dump?resource=static_clusters");
    let static_cluster = type_url::<clusters_config_dump::StaticCluster>();
    assert_eq!(config_types(&dump), vec![static_cluster.clone(); 4]);
    parse_dump(&dump);

    let dump = harness.get_json("/config_dump?resource=static_clusters&mask=cluster.name");
    parse_dump(&dump);
    let configs = dump["configs"].as_array().unwrap();
    assert_eq!(
        configs[0],
        json!({
            "@type": static_cluster,
            "cluster": {
                "@type": "type.googleapis.com/envoy.config.cluster.v3.Cluster",
                "name": "agent",
            },
        })
    );

    let dump = harness.get_json("/config_dump?mask=bootstrap.node.id");
    assert_eq!(
        config_types(&dump),
        [type_url::<BootstrapConfigDump>()],
        "only the bootstrap has the masked path"
    );
    assert_eq!(
        dump["configs"][0]["bootstrap"],
        json!({"node": {"id": "sidecar~1.2.3.4~foo~bar"}})
    );

    let dump = harness.get_json("/config_dump?resource=static_listeners&name_regex=.*15021");
    assert_eq!(dump["configs"].as_array().unwrap().len(), 1);
    assert_eq!(dump["configs"][0]["listener"]["name"], "0.0.0.0_15021");

    for (path, status, words) in [
        (
            "/config_dump?resource=nothing",
            404,
            "nothing not found in config dump",
        ),
        (
            "/config_dump?resource=version_info",
            400,
            "is not a repeated field",
        ),
        (
            "/config_dump?mask=no_such_field",
            400,
            "could not be successfully applied",
        ),
        (
            "/config_dump?resource=static_clusters&mask=cluster.no_such_field",
            400,
            "could not be successfully used",
        ),
    ] {
        let answer = harness.get(path);
        assert_eq!(answer.status, status, "{path}: {}", answer.body);
        assert!(answer.body.contains(words), "{path}: {}", answer.body);
    }
}

#[test]
fn config_dump_include_eds_adds_the_endpoints() {
    let harness = Harness::istio();
    let dump = harness.get_json("/config_dump?include_eds");
    let types = config_types(&dump);
    assert_eq!(types[2], type_url::<EndpointsConfigDump>(), "{types:?}");
    let parsed = parse_dump(&dump);
    let endpoints: EndpointsConfigDump = unpack(&parsed.configs[2]);
    assert_eq!(endpoints.static_endpoint_configs.len(), 4);
    let agent = &dump["configs"][2]["static_endpoint_configs"][0]["endpoint_config"];
    assert_eq!(agent["cluster_name"], "agent");
    let host = &agent["endpoints"][0]["lb_endpoints"][0];
    assert_eq!(host["health_status"], "HEALTHY");
    assert_eq!(
        host["endpoint"]["address"]["socket_address"],
        json!({"address": "127.0.0.1", "port_value": 15020})
    );
    assert_eq!(agent["policy"]["overprovisioning_factor"], 140);
}

/// `/stats` as `name: value` lines.
fn stats_text(body: &str) -> BTreeMap<String, u64> {
    body.lines()
        .map(|line| {
            let (name, value) = line.rsplit_once(": ").unwrap_or_else(|| panic!("{line:?}"));
            (
                name.to_owned(),
                value.parse().unwrap_or_else(|_| panic!("{line:?}")),
            )
        })
        .collect()
}

#[test]
fn stats_text_and_json_agree() {
    let harness = Harness::istio();
    harness
        .proxy
        .store()
        .counter("cluster.xds-grpc;.upstream_cx_total")
        .add(3);
    let text = harness.get("/stats");
    assert_eq!(text.status, 200);
    let from_text = stats_text(&text.body);
    let json = harness.get_json("/stats?format=json");
    let from_json: BTreeMap<String, u64> = json["stats"]
        .as_array()
        .unwrap()
        .iter()
        .map(|stat| {
            (
                stat["name"].as_str().unwrap().to_owned(),
                stat["value"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(from_text, from_json);
    assert_eq!(from_text["cluster.xds-grpc;.upstream_cx_total"], 3);
    assert_eq!(from_text["server.live"], 1);
    assert_eq!(from_text["server.state"], 0);
    // Istio's stats_matcher: other clusters' stats do not exist.
    assert!(
        !from_text
            .keys()
            .any(|name| name.starts_with("cluster.agent"))
    );

    let filtered = stats_text(&harness.get("/stats?filter=%5Eserver%5C.").body);
    assert_eq!(
        filtered.keys().collect::<Vec<_>>(),
        ["server.live", "server.state", "server.uptime"]
    );
    let used = stats_text(&harness.get("/stats?usedonly&filter=upstream_cx").body);
    assert_eq!(
        used.keys().collect::<Vec<_>>(),
        ["cluster.xds-grpc;.upstream_cx_total"]
    );
    assert_eq!(harness.get("/stats?filter=(").status, 400);
}

#[test]
fn stats_show_histograms_in_each_format() {
    let harness = Harness::start(Bootstrap {
        stats_config: None,
        ..istio_bootstrap()
    });
    let histogram = harness
        .proxy
        .store()
        .histogram("cluster.agent;.upstream_cx_length_ms");
    for value in [1.0, 2.0, 30.0] {
        histogram.record(value);
    }
    harness
        .proxy
        .store()
        .histogram("listener.admin.downstream_cx_length_ms");
    let text = harness.get("/stats?type=Histograms").body;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("cluster.agent;.upstream_cx_length_ms: P0(nan,"),
        "{text}"
    );
    assert!(lines[0].ends_with(" P100(nan,50)"), "{text}");
    assert_eq!(
        lines[1],
        "listener.admin.downstream_cx_length_ms: No recorded values"
    );

    let json = harness.get_json("/stats?format=json&filter=length_ms");
    let histograms = &json["stats"][0]["histograms"];
    assert_eq!(
        histograms["supported_quantiles"],
        json!([0, 25, 50, 75, 90, 95, 99, 99.5, 99.9, 100])
    );
    assert_eq!(
        histograms["computed_quantiles"][0]["values"][9]["cumulative"],
        50.0
    );

    let exposition = parse_prometheus(&harness.get("/stats/prometheus").body);
    assert_eq!(
        exposition.types["envoy_cluster_upstream_cx_length_ms"],
        "histogram"
    );
    let count = exposition
        .sample(
            "envoy_cluster_upstream_cx_length_ms_count",
            &[("envoy_cluster_name", "agent;")],
        )
        .expect("a _count sample");
    assert_eq!(count, 3.0);
    let inf = exposition.sample(
        "envoy_cluster_upstream_cx_length_ms_bucket",
        &[("envoy_cluster_name", "agent;"), ("le", "+Inf")],
    );
    assert_eq!(inf, Some(3.0));
}

/// A parsed Prometheus text exposition.
struct Exposition {
    types: BTreeMap<String, String>,
    samples: Vec<(String, BTreeMap<String, String>, f64)>,
}

impl Exposition {
    fn sample(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.samples
            .iter()
            .find(|(n, l, _)| n == name && *l == labels)
            .map(|(_, _, v)| *v)
    }
}

/// The text exposition format (version 0.0.4), strictly: every sample belongs to the
/// metric of the `# TYPE` line before it, each metric's samples are together, names and
/// labels are well formed, values are numbers.
fn parse_prometheus(text: &str) -> Exposition {
    let valid_name = |name: &str| {
        !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    let mut types = BTreeMap::new();
    let mut samples = Vec::new();
    let mut current: Option<(String, String)> = None;
    for (number, line) in text.lines().enumerate() {
        let at = format!("line {}: {line:?}", number + 1);
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect(&at);
            assert!(valid_name(name), "{at}");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{at}"
            );
            assert!(
                types.insert(name.to_owned(), kind.to_owned()).is_none(),
                "{at}: TYPE twice"
            );
            current = Some((name.to_owned(), kind.to_owned()));
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ']).expect(&at);
        let name = &line[..name_end];
        assert!(valid_name(name), "{at}");
        let mut rest = &line[name_end..];
        let mut labels = BTreeMap::new();
        if let Some(inner) = rest.strip_prefix('{') {
            let mut chars = inner.char_indices().peekable();
            let end = loop {
                let (start, c) = chars.next().expect(&at);
                if c == '}' {
                    break start;
                }
                let key_start = start;
                let mut key_end = start;
                for (i, c) in chars.by_ref() {
                    if c == '=' {
                        key_end = i;
                        break;
                    }
                }
                let key = &inner[key_start..key_end];
                assert!(valid_name(key), "{at}: label {key:?}");
                assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "{at}");
                let mut value = String::new();
                loop {
                    let (_, c) = chars.next().expect(&at);
                    match c {
                        '"' => break,
                        '\\' => match chars.next().expect(&at).1 {
                            'n' => value.push('\n'),
                            other => value.push(other),
                        },
                        other => value.push(other),
                    }
                }
                assert!(labels.insert(key.to_owned(), value).is_none(), "{at}");
                match chars.peek() {
                    Some((_, ',')) => {
                        chars.next();
                    }
                    Some((_, '}')) => {}
                    _ => panic!("{at}: expected , or }}"),
                }
            };
            rest = &inner[end + 1..];
        }
        let value = rest.strip_prefix(' ').expect(&at);
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            other => other.parse().expect(&at),
        };
        let (metric, kind) = current.as_ref().expect(&at);
        let belongs = name == metric
            || (kind == "histogram"
                && ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|suffix| name == format!("{metric}{suffix}")));
        assert!(belongs, "{at}: not part of {metric}");
        samples.push((name.to_owned(), labels, value));
    }
    Exposition { types, samples }
}

#[test]
fn stats_prometheus_parses_and_carries_istios_tags() {
    let harness = Harness::istio();
    harness
        .proxy
        .store()
        .counter("cluster.xds-grpc;.upstream_cx_total")
        .add(5);
    let answer = harness.get("/stats/prometheus");
    assert_eq!(answer.status, 200);
    assert!(answer.content_type.starts_with("text/plain"));
    let exposition = parse_prometheus(&answer.body);
    assert_eq!(
        exposition.types["envoy_cluster_upstream_cx_total"],
        "counter"
    );
    assert_eq!(
        exposition.sample(
            "envoy_cluster_upstream_cx_total",
            &[("cluster_name", "xds-grpc")]
        ),
        Some(5.0)
    );
    assert_eq!(exposition.types["envoy_server_live"], "gauge");
    assert_eq!(exposition.sample("envoy_server_live", &[]), Some(1.0));
    assert_eq!(
        harness.get("/stats?format=prometheus").body,
        answer.body,
        "?format=prometheus is the same"
    );
}

#[test]
fn stats_prometheus_uses_envoys_default_tags_without_stats_config() {
    let harness = Harness::start(Bootstrap {
        stats_config: None,
        ..istio_bootstrap()
    });
    let exposition = parse_prometheus(&harness.get("/stats/prometheus").body);
    assert_eq!(
        exposition.sample(
            "envoy_cluster_upstream_cx_total",
            &[("envoy_cluster_name", "agent;")]
        ),
        Some(0.0)
    );
    assert_eq!(
        exposition.sample(
            "envoy_listener_downstream_cx_total",
            &[("envoy_listener_address", "127.0.0.1_0")]
        ),
        Some(0.0)
    );
}

#[test]
fn readiness_follows_health_checks_and_initialization() {
    let harness = Harness::istio();
    let readiness = |harness: &Harness| {
        let ready = harness.get("/ready");
        let port = request(
            harness.health_port("0.0.0.0_15021"),
            "GET",
            "/healthz/ready",
        );
        let info: Value = harness.get_json("/server_info");
        (
            ready.status,
            ready.body,
            port.status,
            info["state"].as_str().unwrap().to_owned(),
        )
    };
    assert_eq!(
        readiness(&harness),
        (200, "LIVE\n".into(), 200, "LIVE".into())
    );

    assert_eq!(harness.post("/healthcheck/fail").status, 200);
    assert_eq!(
        readiness(&harness),
        (503, "DRAINING\n".into(), 503, "DRAINING".into())
    );
    let stats = stats_text(&harness.get("/stats?filter=server").body);
    assert_eq!((stats["server.live"], stats["server.state"]), (0, 1));

    assert_eq!(harness.post("/healthcheck/ok").status, 200);
    assert_eq!(
        readiness(&harness),
        (200, "LIVE\n".into(), 200, "LIVE".into())
    );

    harness.proxy.set_ready(false);
    assert_eq!(
        readiness(&harness),
        (503, "INITIALIZING\n".into(), 503, "INITIALIZING".into())
    );
}

#[test]
fn mutating_endpoints_refuse_get() {
    let harness = Harness::istio();
    for path in [
        "/healthcheck/fail",
        "/healthcheck/ok",
        "/drain_listeners",
        "/quitquitquit",
        "/logging?level=debug",
    ] {
        let answer = harness.get(path);
        assert_eq!(answer.status, 405, "{path}");
        assert_eq!(
            answer.body, "Method GET not allowed, POST required.",
            "{path}"
        );
    }
    assert_eq!(harness.get("/ready").status, 200);
    assert!(harness.proxy.drains().is_empty());
    assert!(!*harness.proxy.shutdown_requested().borrow());
    assert!(harness.reloads.lock().unwrap().is_empty());
}

#[test]
fn drain_listeners_reaches_the_proxy() {
    let harness = Harness::istio();
    assert_eq!(
        harness.post("/drain_listeners?graceful&inboundonly").body,
        "OK\n"
    );
    assert_eq!(harness.post("/drain_listeners?skip_exit").status, 400);
    assert_eq!(
        harness.proxy.drains(),
        [Drain {
            graceful: true,
            inbound_only: true,
            skip_exit: false
        }]
    );
}

#[test]
fn logging_lists_and_changes_levels() {
    let harness = Harness::istio();
    let listing = harness.get("/logging");
    assert_eq!(
        (listing.status, listing.body.as_str()),
        (200, "active loggers:\n  default: info\n")
    );

    let changed = harness.post("/logging?level=debug");
    assert_eq!(changed.status, 200);
    assert_eq!(changed.body, "active loggers:\n  default: debug\n");
    let changed = harness.post("/logging?paths=shunt::tcp:trace");
    assert_eq!(
        changed.body,
        "active loggers:\n  default: debug\n  shunt::tcp: trace\n"
    );
    assert_eq!(harness.post("/logging?level=loud").status, 400);
    assert_eq!(
        *harness.reloads.lock().unwrap(),
        ["debug", "debug,shunt::tcp=trace"]
    );
    // Envoy's names for the levels.
    harness.post("/logging?level=warning");
    assert_eq!(harness.reloads.lock().unwrap().last().unwrap(), "warn");
}

/// The reload closure `logging::init` registers really changes a tracing filter.
#[test]
fn a_level_change_reloads_the_tracing_filter() {
    let (layer, handle) = tracing_subscriber::reload::Layer::<_, tracing_subscriber::Registry>::new(
        tracing_subscriber::EnvFilter::new("info"),
    );
    let control = LogControl::new("info", Some(Arc::new(logging::reload_with(handle.clone()))));
    control.set_all("debug").unwrap();
    assert_eq!(handle.with_current(|f| f.to_string()).unwrap(), "debug");
    control.set_paths("shunt::admin:trace").unwrap();
    assert_eq!(
        handle.with_current(|f| f.to_string()).unwrap(),
        "shunt::admin=trace,debug"
    );
    drop(layer);
}

#[test]
fn quitquitquit_stops_the_server() {
    let harness = Harness::istio();
    let admin = harness.admin();
    let health = harness.health_port("0.0.0.0_15090");
    let answer = harness.post("/quitquitquit");
    assert_eq!((answer.status, answer.body.as_str()), (200, "OK\n"));
    assert!(*harness.proxy.shutdown_requested().borrow());

    let (done, waited) = std::sync::mpsc::channel();
    let Harness { handle, .. } = harness;
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = finished.clone();
    std::thread::spawn(move || {
        while !handle.is_finished() {
            std::thread::sleep(Duration::from_millis(10));
        }
        seen.store(true, std::sync::atomic::Ordering::Relaxed);
        handle.wait();
        let _ = done.send(());
    });
    waited
        .recv_timeout(Duration::from_secs(10))
        .expect("the admin server stops");
    assert!(finished.load(std::sync::atomic::Ordering::Relaxed));
    assert!(TcpStream::connect(admin).is_err(), "admin still listening");
    assert!(TcpStream::connect(health).is_err(), "15090 still listening");
}

#[test]
fn istios_health_ports_are_served() {
    let harness = Harness::istio();
    let stats_port = harness.health_port("0.0.0.0_15090");
    let answer = request(stats_port, "GET", "/stats/prometheus");
    assert_eq!(answer.status, 200);
    let exposition = parse_prometheus(&answer.body);
    assert_eq!(exposition.sample("envoy_server_live", &[]), Some(1.0));
    assert_eq!(request(stats_port, "GET", "/config_dump").status, 404);

    let ready_port = harness.health_port("0.0.0.0_15021");
    assert_eq!(request(ready_port, "GET", "/healthz/ready").status, 200);
    assert_eq!(request(ready_port, "GET", "/stats/prometheus").status, 404);
}

/// Istio's 15021 routes to pilot-agent, whose readiness fails once the pod terminates:
/// the kubelet must take the pod out of its Services while it drains. Envoy's own
/// `/ready` is not about termination and stays 200.
#[test]
fn the_15021_health_port_fails_once_the_pod_terminates() {
    let harness = Harness::istio();
    let ready_port = harness.health_port("0.0.0.0_15021");
    assert_eq!(request(ready_port, "GET", "/healthz/ready").status, 200);
    harness
        .terminating
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(request(ready_port, "GET", "/healthz/ready").status, 503);
    assert_eq!(harness.get("/ready").status, 200);
}

#[test]
fn an_unknown_path_gets_404_with_the_help() {
    let harness = Harness::istio();
    let answer = harness.get("/nope");
    assert_eq!(answer.status, 404);
    assert!(
        answer
            .body
            .starts_with("invalid path. admin commands are:\n"),
        "{}",
        answer.body
    );
    for line in [
        "  /config_dump: dump current Envoy configs (experimental)\n",
        "  /healthcheck/fail (POST): cause the server to fail health checks\n",
        "  /stats/prometheus: print server stats in prometheus format\n",
    ] {
        assert!(answer.body.contains(line), "{line}");
    }
    let help = harness.get("/help");
    assert_eq!(help.status, 200);
    assert_eq!(format!("invalid path. {}", help.body), answer.body);
}

#[test]
fn clusters_in_text_and_json() {
    let harness = Harness::istio();
    let text = harness.get("/clusters").body;
    for line in [
        "agent::observability_name::agent;",
        "agent::default_priority::max_connections::1024",
        "agent::high_priority::max_retries::3",
        "agent::added_via_api::false",
        "agent::127.0.0.1:15020::cx_active::0",
        "agent::127.0.0.1:15020::health_flags::healthy",
        "agent::127.0.0.1:15020::weight::1",
        "agent::127.0.0.1:15020::success_rate::-1",
        "xds-grpc::default_priority::max_connections::100000",
        "sds-grpc::./var/run/secrets/workload-spiffe-uds/test.sock::hostname::",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    let json = harness.get_json("/clusters?format=json");
    let clusters: Clusters = shunt_config::message_from_json(json).unwrap();
    let names: Vec<&str> = clusters
        .cluster_statuses
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, ["agent", "prometheus_stats", "sds-grpc", "xds-grpc"]);
    assert_eq!(clusters.cluster_statuses[0].host_statuses[0].stats.len(), 8);
}

#[test]
fn listeners_in_text_and_json() {
    let harness = Harness::istio();
    assert_eq!(
        harness.get("/listeners").body,
        "0.0.0.0_15090::127.0.0.1:0\n0.0.0.0_15021::127.0.0.1:0\n"
    );
    let json = harness.get_json("/listeners?format=json");
    let listeners: Listeners = shunt_config::message_from_json(json).unwrap();
    assert_eq!(listeners.listener_statuses.len(), 2);
    assert_eq!(listeners.listener_statuses[1].name, "0.0.0.0_15021");
}

#[test]
fn server_info_shows_the_command_line() {
    let config = shunt_config::Options {
        config_path: Some("/etc/istio/proxy/envoy-rev.json".into()),
        service_cluster: Some("foo.bar".into()),
        drain_time: Duration::from_secs(45),
        ..Default::default()
    };
    let options = AdminSettings::from_command_line(&config, "warning", 2);
    let bootstrap = on_ephemeral_ports(istio_bootstrap());
    let handle = start_with(
        &bootstrap,
        Arc::new(BootstrapOnly::new(bootstrap.clone())),
        options,
    )
    .unwrap();
    let answer = request(handle.admin_address().unwrap(), "GET", "/server_info");
    let info: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(
        info["command_line_options"],
        json!({
            "concurrency": 2,
            "config_path": "/etc/istio/proxy/envoy-rev.json",
            "log_level": "warning",
            "service_cluster": "foo.bar",
            "drain_time": "45s",
            "parent_shutdown_time": "0s",
            "disable_hot_restart": true,
        })
    );
    handle.stop();
}

/// `logging::init` installs the process's logger and hands `/logging` its reload; the
/// only test that installs a global subscriber.
#[test]
fn the_installed_logger_is_reloadable() {
    logging::init("info").unwrap();
    let global = LogControl::global();
    if !global.can_change() {
        // Another test installed the process's logger first; nothing to check here.
        eprintln!("skipped: the global logger was installed elsewhere");
        return;
    }
    global.set_all("debug").unwrap();
    assert!(tracing::enabled!(target: "shunt::admin", tracing::Level::DEBUG));
    global.set_all("info").unwrap();
    assert!(!tracing::enabled!(target: "shunt::admin", tracing::Level::DEBUG));
}

#[test]
fn server_info_parses_as_server_info() {
    let harness = Harness::istio();
    let json = harness.get_json("/server_info");
    assert_eq!(json["state"], "LIVE");
    let info: ServerInfo = shunt_config::message_from_json(json).unwrap();
    assert!(
        info.version.contains(env!("CARGO_PKG_VERSION")),
        "{}",
        info.version
    );
    assert_eq!(info.node.unwrap().id, "sidecar~1.2.3.4~foo~bar");
    assert_eq!(info.command_line_options.unwrap().log_level, "info");
    assert!(info.uptime_current_epoch.is_some());
}

#[test]
fn a_bootstrap_without_admin_serves_only_its_health_ports() {
    let mut bootstrap = on_ephemeral_ports(istio_bootstrap());
    bootstrap.admin = None;
    let proxy = Arc::new(BootstrapOnly::new(bootstrap.clone()));
    let handle = start_with(&bootstrap, proxy, AdminSettings::default()).unwrap();
    assert_eq!(handle.admin_address(), None);
    assert_eq!(handle.health_listeners().len(), 2);
    handle.stop();
}

#[test]
fn a_taken_port_is_an_error_naming_it() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let mut bootstrap = on_ephemeral_ports(istio_bootstrap());
    if let Some(AddressKind::SocketAddress(socket)) = bootstrap
        .admin
        .as_mut()
        .and_then(|a| a.address.as_mut())
        .and_then(|a| a.address.as_mut())
    {
        socket.port_specifier = Some(PortSpecifier::PortValue(port.into()));
    }
    let proxy = Arc::new(BootstrapOnly::new(bootstrap.clone()));
    let err = start_with(&bootstrap, proxy, AdminSettings::default())
        .err()
        .expect("the port is taken");
    assert!(
        format!("{err:#}").starts_with(&format!("binding the admin address 127.0.0.1:{port}")),
        "{err:#}"
    );
}
