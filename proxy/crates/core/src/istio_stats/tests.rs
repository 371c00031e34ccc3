//! Labels checked against istio-proxy's own expectations (its `testdata/metric/*.yaml.tmpl`
//! for the client and server node metadata of its end-to-end tests, copied into
//! tests/fixtures/istio-proxy/).

use std::path::Path;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::Node;
use serde_json::json;

use super::expr::{Attributes, NoAttributes, Segment};
use super::labels::{self, ClusterService, HttpOutcome, Observation, Tags};
use super::*;
use crate::peer::{LocalNode, NodeMetadata};

fn fixture(path: &str) -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../tests/fixtures/istio-proxy");
    std::fs::read_to_string(dir.join(path)).unwrap()
}

/// istio-proxy's Go templates with every variable unset: each `if` keeps its `else`
/// branch (or nothing), `{{ .Vars.X }}` is empty, except `RequestCount`.
fn render(template: &str) -> String {
    let mut out = String::new();
    // Stack of "is this branch kept".
    let mut keep: Vec<bool> = Vec::new();
    let action = regex::Regex::new(r"\{\{[^}]*\}\}").unwrap();
    for line in template.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("{{- if") || trimmed.starts_with("{{ if") {
            keep.push(false);
        } else if trimmed.starts_with("{{- else if") {
            // Still false.
        } else if trimmed.starts_with("{{- else") {
            *keep.last_mut().unwrap() = true;
        } else if trimmed.starts_with("{{- end") {
            keep.pop();
        } else if keep.iter().all(|k| *k) {
            let line = line.replace("{{ .Vars.RequestCount }}", "1");
            let line = action.replace_all(&line, "");
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

fn node_metadata(file: &str) -> envoy_types::pb::google::protobuf::Struct {
    let text = render(&fixture(file));
    let json: serde_json::Value = serde_json::from_str(&format!("{{{text}}}")).unwrap();
    crate::peer::struct_from_json(&json)
}

fn local(file: &str, id: &str) -> LocalNode {
    LocalNode::from_node(&Node {
        id: id.into(),
        metadata: Some(node_metadata(file)),
        ..Node::default()
    })
}

/// The labels istio-proxy's template expects, in order.
fn expected(file: &str) -> Tags {
    let yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&render(&fixture(file))).unwrap();
    let labels = yaml["metric"][0]["label"].as_sequence().unwrap();
    Tags(
        labels
            .iter()
            .map(|l| {
                (
                    l["name"].as_str().unwrap().to_owned(),
                    l["value"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect(),
    )
}

const SERVICE: ClusterService = ClusterService {
    host: Some("server.default.svc.cluster.local"),
    name: Some("server"),
};

fn config(inbound: bool) -> PluginConfig {
    PluginConfig::from_json(&json!({}), Some(inbound)).unwrap()
}

#[test]
fn server_http_labels_match_istio_proxys() {
    let server = local("server_node_metadata.json.tmpl", "server");
    let client = local("client_node_metadata.json.tmpl", "client").workload();
    let obs = Observation {
        peer: Some(&client),
        host: Some("127.0.0.1:20000"),
        cluster_name: Some("inbound|9080||"),
        cluster_service: Some(SERVICE),
        ..Observation::default()
    };
    let outcome = HttpOutcome {
        response_code: 200,
        response_flags: "-",
        ..HttpOutcome::default()
    };
    let tags = labels::http(&config(true), &server, &obs, &outcome);
    assert_eq!(tags, expected("metric/server_request_total.yaml.tmpl"));
}

#[test]
fn client_http_labels_match_istio_proxys() {
    let client = local("client_node_metadata.json.tmpl", "client");
    let server = local("server_node_metadata.json.tmpl", "server").workload();
    let obs = Observation {
        peer: Some(&server),
        host: Some("127.0.0.1:20000"),
        cluster_name: Some("server-outbound-cluster"),
        cluster_service: Some(SERVICE),
        ..Observation::default()
    };
    let outcome = HttpOutcome {
        response_code: 200,
        response_flags: "-",
        ..HttpOutcome::default()
    };
    let tags = labels::http(&config(false), &client, &obs, &outcome);
    assert_eq!(tags, expected("metric/client_request_total.yaml.tmpl"));
}

#[test]
fn tcp_labels_with_mtls_principals_match_istio_proxys_on_both_sides() {
    let client_node = local("client_node_metadata.json.tmpl", "client");
    let server_node = local("server_node_metadata.json.tmpl", "server");
    let client_sa = "spiffe://cluster.local/ns/default/sa/client";
    let server_sa = "spiffe://cluster.local/ns/default/sa/server";

    let client_peer = client_node.workload();
    let inbound = Observation {
        peer: Some(&client_peer),
        cluster_service: Some(SERVICE),
        peer_principal: Some(client_sa),
        local_principal: Some(server_sa),
        ..Observation::default()
    };
    assert_eq!(
        labels::tcp(&config(true), &server_node, &inbound, "-"),
        expected("metric/tcp_server_connection_open.yaml.tmpl")
    );

    let server_peer = server_node.workload();
    let outbound = Observation {
        peer: Some(&server_peer),
        cluster_service: Some(SERVICE),
        peer_principal: Some(server_sa),
        local_principal: Some(client_sa),
        ..Observation::default()
    };
    assert_eq!(
        labels::tcp(&config(false), &client_node, &outbound, "-"),
        expected("metric/tcp_client_connection_open.yaml.tmpl")
    );
}

#[test]
fn an_unknown_peer_reads_unknown_and_latest_and_the_namespace_comes_from_the_san() {
    let server = local("server_node_metadata.json.tmpl", "server");
    let obs = Observation {
        peer_principal: Some("spiffe://td/ns/other/sa/x"),
        local_principal: None,
        ..Observation::default()
    };
    let tags = labels::tcp(&config(true), &server, &obs, "");
    assert_eq!(tags.get("source_workload"), Some("unknown"));
    assert_eq!(tags.get("source_canonical_revision"), Some("latest"));
    assert_eq!(tags.get("source_workload_namespace"), Some("other"));
    assert_eq!(tags.get("response_flags"), Some("-"));
    // No local certificate: not mutual TLS.
    assert_eq!(tags.get("connection_security_policy"), Some("none"));
    // Without the cluster's service, the local canonical service names the destination.
    assert_eq!(tags.get("destination_service"), Some("ratings"));
}

#[test]
fn the_host_header_fallback_can_be_disabled_and_passthrough_is_named() {
    let client = local("client_node_metadata.json.tmpl", "client");
    let obs = Observation {
        host: Some("example.com"),
        cluster_name: Some("PassthroughCluster"),
        ..Observation::default()
    };
    let outcome = HttpOutcome {
        response_code: 503,
        response_flags: "UF",
        ..HttpOutcome::default()
    };
    let tags = labels::http(&config(false), &client, &obs, &outcome);
    assert_eq!(tags.get("destination_service"), Some("example.com"));
    assert_eq!(
        tags.get("destination_service_name"),
        Some("PassthroughCluster")
    );
    assert_eq!(tags.get("response_flags"), Some("UF"));
    let disabled =
        PluginConfig::from_json(&json!({"disable_host_header_fallback": true}), Some(false))
            .unwrap();
    let tags = labels::http(&disabled, &client, &obs, &outcome);
    assert_eq!(tags.get("destination_service"), Some("unknown"));
}

struct UserAgent;
impl Attributes for UserAgent {
    fn attribute(&self, path: &[Segment]) -> Option<String> {
        matches!(path.last(), Some(Segment::Index(h)) if h == "user-agent")
            .then(|| "curl/8".to_owned())
    }
}

#[test]
fn the_plugin_config_drops_removes_overrides_and_adds_tags() {
    let config = PluginConfig::from_json(
        &json!({
            "reporter": "SERVER_GATEWAY",
            "tcp_reporting_duration": "0.5s",
            "definitions": [{"name": "custom_total", "value": "1", "type": "COUNTER"}],
            "metrics": [
                {"name": "request_bytes", "drop": true},
                {"tags_to_remove": ["source_principal"]},
                {"name": "requests_total", "dimensions": {
                    "response_code": "'xxx'",
                    "agent": "request.headers['user-agent']",
                }},
            ],
        }),
        Some(true),
    )
    .unwrap();
    assert_eq!(config.reporter, Reporter::ServerGateway);
    assert_eq!(config.tcp_reporting_duration.as_millis(), 500);
    assert!(config.drops(Metric::RequestBytes));
    let tags = Tags(vec![
        ("reporter".into(), "destination".into()),
        ("source_principal".into(), "spiffe://x".into()),
        ("response_code".into(), "200".into()),
    ]);
    assert_eq!(
        config.override_tags(Metric::RequestsTotal, &tags, &UserAgent),
        Tags(vec![
            ("reporter".into(), "destination".into()),
            ("response_code".into(), "xxx".into()),
            ("agent".into(), "curl/8".into()),
        ])
    );
    assert_eq!(
        config.override_tags(Metric::TcpSentBytesTotal, &tags, &NoAttributes),
        Tags(vec![
            ("reporter".into(), "destination".into()),
            ("response_code".into(), "200".into()),
        ])
    );

    let store = crate::stats::Store::new();
    let node = Arc::new(LocalNode::default());
    let recorder = Recorder::new(store.clone(), node, Arc::new(config));
    recorder.add(Metric::RequestsTotal, &tags, &UserAgent, 2);
    recorder.record(Metric::RequestBytes, &tags, &UserAgent, 10.0);
    recorder.record_custom(&NoAttributes);
    let names: Vec<String> = store.snapshot().into_iter().map(|s| s.name).collect();
    assert_eq!(
        names,
        vec![
            "istiocustom.istio_build.component.proxy.tag.unknown",
            "istiocustom.istio_custom_total",
            "istiocustom.istio_requests_total.reporter.destination.response_code.xxx.agent.curl/8",
        ]
    );
}

#[test]
fn bad_plugin_configs_name_the_field() {
    for (config, path) in [
        (json!({"reporter": "SIDEWAYS"}), "reporter"),
        (
            json!({"metrics": [{"tags_to_remove": [3]}]}),
            "metrics[0].tags_to_remove[0]",
        ),
        (
            json!({"tcp_reporting_duration": "soon"}),
            "tcp_reporting_duration",
        ),
        (
            json!({"metrics": [{"dimensions": {"a": 1}}]}),
            "metrics[0].dimensions.a",
        ),
        (json!({"stat_prefix": "x"}), "stat_prefix"),
    ] {
        let err = PluginConfig::from_json(&config, None).unwrap_err();
        assert_eq!(err.path, path, "{err}");
    }
    // An expression outside the supported subset is a warning, as istio-proxy only logs it.
    let config = PluginConfig::from_json(
        &json!({"metrics": [{"dimensions": {"x": "a ? b : c"}}]}),
        None,
    )
    .unwrap();
    assert_eq!(config.warnings.len(), 1, "{:?}", config.warnings);
}

#[test]
fn node_metadata_reads_what_the_exchange_carries() {
    let metadata = NodeMetadata::from_struct(&node_metadata("client_node_metadata.json.tmpl"));
    assert_eq!(metadata.workload_name, "productpage-v1");
    assert_eq!(metadata.app_containers, vec!["test", "bonzai"]);
    assert_eq!(metadata.labels["role"], "client");
}
