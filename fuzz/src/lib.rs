//! What the fuzz targets share: fixed configs, and the steps each target drives. Every
//! function here takes untrusted bytes and must neither panic nor hang on any of them.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager as EnvoyHcm;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use prost::Message;
use serde_json::json;
use shunt::config::{Diagnostics, JsonPath, Tracked};
use shunt::filters::common::matcher::RequestView;
use shunt::http::route::Action;
use shunt::http::{ConfigProvider, RequestConfig, RouteConfig};
use shunt::snapshot::{DynamicCluster, DynamicResources, Encoded};
use shunt::tls::Secrets;
use shunt::upstream::Clusters;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// A runtime of its own for one input: whatever an input leaves spawned is dropped
/// with it, so nothing accumulates across inputs.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
}

/// Compiles a bootstrap into a snapshot, as `--mode validate` and start-up do.
pub fn compile_bootstrap(bootstrap: &Bootstrap) {
    let rt = runtime();
    let _guard = rt.enter();
    let stats = shunt::stats::Store::new();
    let _ = shunt::snapshot::compile(bootstrap, &stats);
}

fn tracked<T>(resource: T) -> Tracked<Arc<T>> {
    Tracked {
        resource: Arc::new(resource),
        version_info: Some(Arc::from("fuzz")),
        last_updated: SystemTime::UNIX_EPOCH,
    }
}

/// `bytes` decoded as the xDS resource `selector` picks, as the xDS client decodes an
/// `Any`'s value, then compiled with the bootstrap into a snapshot as an accepted
/// update is (`snapshot::compile_with`, the xDS client's `rebuild`).
pub fn compile_resource(selector: u8, bytes: &[u8]) {
    let mut dynamic = DynamicResources {
        listeners_version: "fuzz".into(),
        clusters_version: "fuzz".into(),
        ..Default::default()
    };
    // As the xDS client keeps them: the bytes as they came, checked to decode.
    match selector % 5 {
        0 => {
            let Ok(listener) = Encoded::<Listener>::new(bytes) else {
                return;
            };
            dynamic.listeners.push(tracked(listener));
        }
        1 => {
            let Ok(cluster) = Encoded::<Cluster>::new(bytes) else {
                return;
            };
            let digest = shunt::config::digest(&cluster.decode());
            dynamic.clusters.push(Arc::new(DynamicCluster {
                tracked: tracked(cluster),
                endpoints: None,
                digest,
            }));
        }
        2 => {
            let Ok(routes) = RouteConfiguration::decode(bytes) else {
                return;
            };
            // RDS compiles each route configuration by itself too.
            let mut problems = Diagnostics::default();
            let _ =
                shunt::http::route_config::compile(&routes, &JsonPath::new("fuzz"), &mut problems);
            dynamic.route_configs.push(tracked(Encoded::of(&routes)));
        }
        3 => {
            // An EDS cluster served with these endpoints, as warming hands it over (the
            // endpoints stay as their wire bytes, decoded when the cluster compiles).
            let Ok(endpoints) = Encoded::<ClusterLoadAssignment>::new(bytes) else {
                return;
            };
            let cds = Cluster {
                name: endpoints.name.to_string(),
                ..Default::default()
            };
            let digest = shunt::config::digest(&cds);
            let endpoints = Arc::new(endpoints);
            dynamic.clusters.push(Arc::new(DynamicCluster {
                tracked: tracked(Encoded::of(&cds)),
                endpoints: Some(endpoints.clone()),
                digest,
            }));
            dynamic.endpoints = Arc::new([Tracked {
                resource: endpoints,
                version_info: Some(Arc::from("fuzz")),
                last_updated: SystemTime::UNIX_EPOCH,
            }]);
        }
        _ => {
            let Ok(secret) = Encoded::<Secret>::new(bytes) else {
                return;
            };
            dynamic.secrets.push(tracked(secret));
        }
    }
    let rt = runtime();
    let _guard = rt.enter();
    let stats = shunt::stats::Store::new();
    let bootstrap = Bootstrap::default();
    let _ = shunt::snapshot::compile_with(&bootstrap, Arc::new(dynamic), None, &stats);
}

/// The route configuration the routing targets serve: every kind of match and action.
fn fixed_routes() -> serde_json::Value {
    json!({"name": "r", "virtual_hosts": [
        {"name": "exact", "domains": ["www.example.com", "www.example.com:8080"], "routes": [
            {"match": {"path": "/exact"}, "route": {"cluster": "exact"}},
            {"match": {"safe_regex": {"regex": "/items/[0-9]+"}}, "route": {"cluster": "regex",
                "regex_rewrite": {"pattern": {"regex": "^/items/([0-9]+)"}, "substitution": "/i/\\1"}}},
            {"match": {"path_separated_prefix": "/api"}, "route": {"cluster": "api", "prefix_rewrite": "/v1"}},
            {"match": {"prefix": "/CI/", "case_sensitive": false}, "route": {"cluster": "ci"}},
            {"match": {"prefix": "/h", "headers": [
                {"name": "x-version", "string_match": {"exact": "v2"}},
                {"name": "x-debug", "present_match": true, "invert_match": true},
                {"name": "x-re", "string_match": {"safe_regex": {"regex": "a+b*"}}}
            ]}, "route": {"cluster": "v2"}},
            {"match": {"prefix": "/h", "headers": [
                {"name": "user-agent", "string_match": {"contains": "CURL", "ignore_case": true}},
                {"name": ":method", "string_match": {"exact": "POST"}}
            ]}, "route": {"cluster_header": "x-cluster"}},
            {"match": {"prefix": "/q", "query_parameters": [
                {"name": "debug", "present_match": true},
                {"name": "user", "string_match": {"prefix": "adm"}}
            ]}, "route": {"cluster": "query"}},
            {"match": {"prefix": "/w"}, "route": {
                "weighted_clusters": {"clusters": [
                    {"name": "a", "weight": 30}, {"name": "b", "weight": 70,
                     "request_headers_to_add": [{"header": {"key": "x-b", "value": "1"}}]}
                ]},
                "hash_policy": [
                    {"header": {"header_name": "x-user"}},
                    {"cookie": {"name": "session"}},
                    {"query_parameter": {"name": "u"}},
                    {"connection_properties": {"source_ip": true}}
                ]}},
            {"match": {"prefix": "/r"}, "redirect": {"https_redirect": true, "prefix_rewrite": "/new",
                "response_code": "PERMANENT_REDIRECT"}},
            {"match": {"prefix": "/d"}, "direct_response": {"status": 200, "body": {"inline_string": "direct"}}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 418}}
        ]},
        {"name": "suffix", "domains": ["*.example.com"], "routes": [
            {"match": {"prefix": "/"}, "route": {"cluster": "suffix"}}]},
        {"name": "prefix", "domains": ["foo.*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 204}}]},
        {"name": "any", "domains": ["*"],
         "request_headers_to_add": [{"header": {"key": "x-vh", "value": "%DOWNSTREAM_REMOTE_ADDRESS%"}}],
         "routes": [
            {"match": {"prefix": "/gone"}, "route": {"cluster": "removed"}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
        ]}
    ]})
}

fn route_config() -> &'static Arc<RouteConfig> {
    static CONFIG: OnceLock<Arc<RouteConfig>> = OnceLock::new();
    CONFIG.get_or_init(|| {
        let config: RouteConfiguration =
            shunt::config::message_from_json(fixed_routes()).expect("the fixed routes parse");
        let mut problems = Diagnostics::default();
        let compiled =
            shunt::http::route_config::compile(&config, &JsonPath::new("r"), &mut problems);
        assert!(problems.errors.is_empty(), "{:?}", problems.errors);
        Arc::new(compiled.expect("the fixed routes compile"))
    })
}

/// The input as a request: authority, path, method, then header name and value pairs,
/// separated by NUL bytes; routed through the fixed route configuration.
pub fn route_request(data: &[u8]) {
    let config = route_config();
    let mut parts = data.split(|&b| b == 0).map(String::from_utf8_lossy);
    let authority = parts.next().unwrap_or_default();
    let path = parts.next().unwrap_or_default();
    let method = parts.next().unwrap_or_default();
    let mut headers = HeaderMap::new();
    while let (Some(name), Some(value)) = (parts.next(), parts.next()) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value.as_bytes()),
        ) {
            headers.append(name, value);
        }
    }
    let request = RequestView {
        method: &method,
        authority: &authority,
        path: &path,
        scheme: "http",
        headers: &headers,
    };
    let _ = request.path_only();
    let _ = request.query_parameters().count();
    let _ = config.virtual_host(&authority);
    if let Some((_, route)) = config.route(&request) {
        let _ = route.matcher.matched_prefix_len();
        if let Action::Route(action) = &route.action {
            let _ = action.cluster.pick(&request);
        }
    }
}

/// Route configurations as an RDS snapshot holds them.
struct Routes {
    route_configs: HashMap<String, Arc<RouteConfig>>,
    clusters: Clusters,
    secrets: Secrets,
}

impl RequestConfig for Routes {
    fn route_config(&self, name: &str) -> Option<&Arc<RouteConfig>> {
        self.route_configs.get(name)
    }
    fn clusters(&self) -> &Clusters {
        &self.clusters
    }
    fn secrets(&self) -> &Secrets {
        &self.secrets
    }
}

struct Current(Arc<Routes>);

impl ConfigProvider for Current {
    fn request_config(&self) -> Arc<dyn RequestConfig> {
        self.0.clone()
    }
}

fn connection_manager() -> &'static (Arc<shunt::http::HttpConnectionManager>, Arc<Current>) {
    static HCM: OnceLock<(Arc<shunt::http::HttpConnectionManager>, Arc<Current>)> = OnceLock::new();
    HCM.get_or_init(|| {
        let hcm: EnvoyHcm = shunt::config::message_from_json(json!({
            "stat_prefix": "fuzz",
            "codec_type": "AUTO",
            "rds": {"route_config_name": "r", "config_source": {"ads": {}}},
            "request_headers_timeout": "1s",
            "http_filters": [{"name": "router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            "upgrade_configs": [{"upgrade_type": "websocket"}]
        }))
        .expect("the fixed connection manager parses");
        let mut problems = Diagnostics::default();
        let stats = shunt::stats::Store::new();
        let hcm = shunt::http::compile::compile(
            &hcm,
            &Clusters::default(),
            &stats,
            &JsonPath::new("hcm"),
            &mut problems,
        )
        .expect("the fixed connection manager compiles");
        let routes = Routes {
            route_configs: HashMap::from([("r".to_owned(), route_config().clone())]),
            clusters: Clusters::default(),
            secrets: Secrets::default(),
        };
        (Arc::new(hcm), Arc::new(Current(Arc::new(routes))))
    })
}

/// How long one input may keep a connection busy. Everything the connection manager
/// does here is in memory (direct responses, 404s, 503s for unknown clusters), so a
/// well-behaved input ends in microseconds.
const HTTP_BUDGET: Duration = Duration::from_secs(2);

/// The input as the bytes a downstream client sends on one connection (then half-closes),
/// served by the connection manager over an in-memory duplex; what it answers is read
/// to the end.
pub fn serve_http(data: &[u8]) {
    let (hcm, provider) = connection_manager();
    let rt = runtime();
    rt.block_on(async {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let remote = "10.0.0.1:40000".parse().unwrap();
        let local = "10.0.0.2:80".parse().unwrap();
        let downstream = shunt::http::connection_manager::Downstream {
            remote,
            local,
            original_dst: None,
            direction: shunt::access_log::Direction::Inbound,
            secure: false,
            own_ports: Arc::from(vec![15001, 15006]),
            connection: Arc::new(shunt::stream_info::Connection::new(local, remote)),
        };
        let provider: Arc<dyn ConfigProvider> = provider.clone();
        let served = tokio::spawn(shunt::http::connection_manager::serve(
            hcm.clone(),
            provider,
            server,
            downstream,
            std::future::pending(),
        ));
        // Write and read at once: a large input must not block on a full duplex while
        // the server waits for its answer to be read.
        let (mut reader, mut writer) = tokio::io::split(client);
        let exchange = async {
            let write = async {
                let _ = writer.write_all(data).await;
                let _ = writer.shutdown().await;
            };
            let mut answer = Vec::new();
            let read = reader.read_to_end(&mut answer);
            let _ = tokio::join!(write, read);
            answer
        };
        let _ = tokio::time::timeout(HTTP_BUDGET, exchange).await;
        served.abort();
    });
}

/// `shunt capture`'s arguments, as its command line holds them.
#[derive(clap::Parser, Debug)]
struct Capture {
    #[command(flatten)]
    args: shunt_capture::CaptureArgs,
}

/// The input as a command line (arguments split at NUL bytes or newlines) through
/// `shunt capture`'s flag parsing; an accepted config rendered as iptables' rules.
pub fn capture_flags(data: &[u8]) {
    use clap::Parser as _;
    use shunt_capture::iptables::{Family, restore_text, rules};
    let args = std::iter::once("shunt-capture".to_owned()).chain(
        data.split(|&b| b == 0 || b == b'\n')
            .map(|arg| String::from_utf8_lossy(arg).into_owned()),
    );
    let Ok(capture) = Capture::try_parse_from(args) else {
        return;
    };
    let Ok(config) = capture.args.config() else {
        return;
    };
    let _ = config.inbound_exclusions();
    for family in [Family::V4, Family::V6] {
        let rules = rules(&config, family);
        let text = restore_text(&config, family);
        assert!(rules.iter().all(|rule| text.contains(rule.as_str())));
        assert!(rules.iter().all(|rule| !rule.contains('\n')), "{rules:?}");
    }
}

/// A YAML document spelled from `data`, one token a byte: the low five bits pick the
/// token, the high three bits how many times it repeats (1 to 8), so a short input can
/// nest deep. The tokens are the ones that matter to flow-depth counting: brackets,
/// tags, anchors, aliases and merge keys, quotes, comments, block indicators, breaks.
pub fn yaml_from_tokens(data: &[u8]) -> String {
    const TOKENS: [&str; 32] = [
        "[",
        "]",
        "{",
        "}",
        ", ",
        ": ",
        "!t ",
        "!!seq ",
        "&a ",
        "*a",
        "<<: ",
        "!ignore ",
        "\"[{\"",
        "'[{'",
        "x",
        "x[",
        " ",
        "\n",
        "\n  ",
        "# [{\n",
        "- ",
        "? ",
        "|\n  [",
        ">\n  {",
        "--- ",
        "!<tag:yaml.org,2002:map> ",
        "&b\t",
        "!t,",
        "a: ",
        "[x]",
        "{k: v}",
        "\t",
    ];
    let mut text = String::new();
    for &byte in data {
        let token = TOKENS[usize::from(byte & 31)];
        for _ in 0..=(byte >> 5) {
            text.push_str(token);
        }
    }
    text
}
