//! Routing as Envoy does it: which virtual host a request's authority picks, which route
//! matches, which header rules apply in which order, and how a config shunt cannot serve
//! is refused at its JSON path.

use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use hyper::HeaderMap;
use serde_json::json;

use super::connection_manager::redirect_location;
use super::route::{Action, ClusterChoice, RouteConfig};
use super::route_config::compile;
use crate::common::matcher::RequestView;
use shunt_config::{Diagnostics, JsonPath};

fn route_config(config: serde_json::Value) -> RouteConfig {
    let config: RouteConfiguration = shunt_config::message_from_json(config).unwrap();
    let mut problems = Diagnostics::default();
    let compiled = compile(&config, &JsonPath::new("rc"), &mut problems);
    assert!(problems.errors.is_empty(), "{:?}", problems.errors);
    compiled.unwrap()
}

fn errors(config: serde_json::Value) -> Vec<String> {
    let config: RouteConfiguration = shunt_config::message_from_json(config).unwrap();
    let mut problems = Diagnostics::default();
    assert!(compile(&config, &JsonPath::new("rc"), &mut problems).is_none());
    problems.errors.iter().map(ToString::to_string).collect()
}

fn vhost(name: &str, domains: &[&str]) -> serde_json::Value {
    json!({"name": name, "domains": domains, "routes": [{"match": {"prefix": "/"}, "route": {"cluster": name}}]})
}

fn request<'a>(authority: &'a str, path: &'a str, headers: &'a HeaderMap) -> RequestView<'a> {
    RequestView {
        method: "GET",
        authority,
        path,
        scheme: "http",
        headers,
    }
}

/// The cluster a request is routed to, if any.
fn cluster(
    config: &RouteConfig,
    authority: &str,
    path: &str,
    headers: &HeaderMap,
) -> Option<String> {
    let (_, route) = config.route(&request(authority, path, headers))?;
    match &route.action {
        Action::Route(action) => match &action.cluster {
            ClusterChoice::Cluster(name) => Some(name.to_string()),
            other => panic!("{other:?}"),
        },
        Action::DirectResponse { status, .. } => Some(format!("direct {}", status.as_u16())),
        Action::Redirect(_) => Some("redirect".to_owned()),
    }
}

#[test]
fn domains_match_exact_then_longest_suffix_then_longest_prefix_then_any() {
    let config = route_config(json!({"virtual_hosts": [
        vhost("any", &["*"]),
        vhost("prefix", &["foo.*"]),
        vhost("long-prefix", &["foo.bar.*"]),
        vhost("suffix", &["*.example.com"]),
        vhost("long-suffix", &["*.api.example.com"]),
        vhost("exact", &["www.example.com", "www.example.com:8080"]),
        vhost("no-dot", &["*-svc.local"]),
    ]}));
    let name = |authority: &str| config.virtual_host(authority).map(|v| v.name.clone());
    assert_eq!(name("www.example.com").as_deref(), Some("exact"));
    assert_eq!(
        name("WWW.Example.COM").as_deref(),
        Some("exact"),
        "case-insensitive"
    );
    assert_eq!(name("a.api.example.com").as_deref(), Some("long-suffix"));
    assert_eq!(name("a.example.com").as_deref(), Some("suffix"));
    // A suffix wildcard beats a prefix wildcard.
    assert_eq!(name("foo.example.com").as_deref(), Some("suffix"));
    assert_eq!(name("foo.bar.baz").as_deref(), Some("long-prefix"));
    assert_eq!(name("foo.baz").as_deref(), Some("prefix"));
    assert_eq!(name("my-svc.local").as_deref(), Some("no-dot"));
    // A wildcard never matches an empty part.
    assert_eq!(name(".example.com").as_deref(), Some("any"));
    assert_eq!(name("other").as_deref(), Some("any"));
    // The port is part of the authority matched (Envoy's findVirtualHost): a port no
    // domain names falls to `*`, not to the port-less domain.
    assert_eq!(name("www.example.com:8080").as_deref(), Some("exact"));
    assert_eq!(name("www.example.com:9999").as_deref(), Some("any"));
    assert_eq!(name("a.example.com:80").as_deref(), Some("any"));
    assert_eq!(name("foo.baz:80").as_deref(), Some("prefix"));

    let ignoring_port = route_config(
        json!({"ignore_port_in_host_matching": true, "virtual_hosts": [
            vhost("any", &["*"]),
            vhost("exact", &["www.example.com"]),
        ]}),
    );
    let name = |authority: &str| {
        ignoring_port
            .virtual_host(authority)
            .map(|v| v.name.clone())
    };
    assert_eq!(name("www.example.com:9999").as_deref(), Some("exact"));
    assert_eq!(name("[::1]:80").as_deref(), Some("any"));

    let no_default = route_config(json!({"virtual_hosts": [vhost("exact", &["a"])]}));
    assert!(no_default.virtual_host("b").is_none());
}

#[test]
fn routes_match_in_order_by_path_headers_and_query() {
    let config = route_config(json!({"virtual_hosts": [{
        "name": "v", "domains": ["*"],
        "routes": [
            {"match": {"path": "/exact"}, "route": {"cluster": "exact"}},
            {"match": {"safe_regex": {"regex": "/items/[0-9]+"}}, "route": {"cluster": "regex"}},
            {"match": {"path_separated_prefix": "/api"}, "route": {"cluster": "api"}},
            {"match": {"prefix": "/CI/", "case_sensitive": false}, "route": {"cluster": "ci"}},
            {"match": {"path": "/Exact-CI", "case_sensitive": false}, "route": {"cluster": "exact-ci"}},
            {"match": {"safe_regex": {"regex": "/Rx"}, "case_sensitive": false}, "route": {"cluster": "rx"}},
            {"match": {"prefix": "/h", "headers": [
                {"name": "x-version", "string_match": {"exact": "v2"}},
                {"name": "x-debug", "present_match": true, "invert_match": true}
            ]}, "route": {"cluster": "v2"}},
            {"match": {"prefix": "/h", "headers": [
                {"name": "user-agent", "string_match": {"contains": "CURL", "ignore_case": true}}
            ]}, "route": {"cluster": "curl"}},
            {"match": {"prefix": "/q", "query_parameters": [
                {"name": "debug", "present_match": true},
                {"name": "user", "string_match": {"prefix": "adm"}}
            ]}, "route": {"cluster": "query"}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 418}}
        ]
    }]}));
    let none = HeaderMap::new();
    let to = |path: &str, headers: &HeaderMap| cluster(&config, "host", path, headers);
    assert_eq!(to("/exact", &none).as_deref(), Some("exact"));
    assert_eq!(
        to("/exact?x=1", &none).as_deref(),
        Some("exact"),
        "the query is not part of the path"
    );
    assert_eq!(to("/exact/more", &none).as_deref(), Some("direct 418"));
    assert_eq!(to("/items/42", &none).as_deref(), Some("regex"));
    assert_eq!(
        to("/items/42x", &none).as_deref(),
        Some("direct 418"),
        "regexes match the whole path"
    );
    assert_eq!(to("/api", &none).as_deref(), Some("api"));
    assert_eq!(to("/api/x", &none).as_deref(), Some("api"));
    assert_eq!(to("/apix", &none).as_deref(), Some("direct 418"));
    assert_eq!(to("/ci/build", &none).as_deref(), Some("ci"));
    assert_eq!(to("/CI/build", &none).as_deref(), Some("ci"));
    assert_eq!(to("/ci", &none).as_deref(), Some("direct 418"));
    assert_eq!(to("/exact-ci", &none).as_deref(), Some("exact-ci"));
    assert_eq!(to("/EXACT-CI/x", &none).as_deref(), Some("direct 418"));
    assert_eq!(to("/Rx", &none).as_deref(), Some("rx"));
    assert_eq!(
        to("/rx", &none).as_deref(),
        Some("direct 418"),
        "case_sensitive does not apply to regexes (Envoy ignores it there)"
    );

    let mut v2 = HeaderMap::new();
    v2.insert("x-version", "v2".parse().unwrap());
    assert_eq!(to("/h", &v2).as_deref(), Some("v2"));
    v2.insert("x-debug", "1".parse().unwrap());
    assert_eq!(
        to("/h", &v2).as_deref(),
        Some("direct 418"),
        "inverted presence"
    );
    let mut curl = HeaderMap::new();
    curl.insert("user-agent", "curl/8.5".parse().unwrap());
    assert_eq!(to("/h", &curl).as_deref(), Some("curl"));

    assert_eq!(to("/q?debug&user=admin", &none).as_deref(), Some("query"));
    assert_eq!(to("/q?user=admin", &none).as_deref(), Some("direct 418"));
    assert_eq!(
        to("/q?debug=1&user=bob", &none).as_deref(),
        Some("direct 418")
    );
}

#[test]
fn header_rules_apply_route_then_vhost_then_config_unless_the_most_specific_wins() {
    let add = |value: &str| json!([{"header": {"key": "x-level", "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]);
    let rc = |most_specific: bool| {
        route_config(json!({
            "most_specific_header_mutations_wins": most_specific,
            "request_headers_to_add": add("config"),
            "request_headers_to_remove": ["x-secret"],
            "virtual_hosts": [{
                "name": "v", "domains": ["*"],
                "request_headers_to_add": add("vhost"),
                "routes": [{
                    "match": {"prefix": "/"}, "route": {"cluster": "c"},
                    "request_headers_to_add": [
                        {"header": {"key": "x-level", "value": "route"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
                        {"header": {"key": "x-added", "value": "a"}},
                        {"header": {"key": "x-added", "value": "b"}},
                        {"header": {"key": "x-kept", "value": "new"}, "append_action": "ADD_IF_ABSENT"},
                        {"header": {"key": "x-only-if-there", "value": "new"}, "append_action": "OVERWRITE_IF_EXISTS"}
                    ]
                }]
            }]
        }))
    };
    let apply = |config: &RouteConfig| {
        let mut headers = HeaderMap::new();
        headers.insert("x-secret", "s".parse().unwrap());
        headers.insert("x-kept", "old".parse().unwrap());
        let (vhost, route) = config.route(&request("h", "/", &HeaderMap::new())).unwrap();
        for rules in config.header_rules(vhost, route, false) {
            rules.apply(&mut headers);
        }
        headers
    };
    let headers = apply(&rc(false));
    assert_eq!(headers["x-level"], "config");
    assert!(!headers.contains_key("x-secret"));
    let added: Vec<_> = headers.get_all("x-added").iter().collect();
    assert_eq!(added, ["a", "b"]);
    assert_eq!(headers["x-kept"], "old");
    assert!(!headers.contains_key("x-only-if-there"));
    assert_eq!(apply(&rc(true))["x-level"], "route");
}

#[test]
fn config_errors_name_their_json_paths() {
    assert_eq!(
        errors(json!({"virtual_hosts": [
            vhost("a", &["a.com", "*"]),
            {"name": "b", "domains": ["A.com", "x*y"], "routes": [
                {"match": {"safe_regex": {"regex": "("}}, "route": {"cluster": "c"}},
                {"match": {"prefix": "/"}, "route": {"weighted_clusters": {"clusters": [{"name": "c", "weight": 0}]}}},
                {"match": {"safe_regex": {"regex": "/x"}}, "route": {"cluster": "c", "prefix_rewrite": "/y"}},
                {"match": {"prefix": "/"}, "direct_response": {"status": 99}},
                {"match": {"prefix": "/"}, "route": {"cluster": "c"}, "request_headers_to_remove": [":path"]}
            ]}
        ]})),
        [
            "rc.virtual_hosts[1].routes[0].match.safe_regex.regex: \"(\" is not a valid regex: unclosed group",
            "rc.virtual_hosts[1].routes[1].route.weighted_clusters: needs at least one cluster with a positive weight",
            "rc.virtual_hosts[1].routes[2].route.prefix_rewrite: cannot be used with a safe_regex match; use regex_rewrite",
            "rc.virtual_hosts[1].routes[3].direct_response.status: 99 is not an HTTP status from 200 to 599",
            "rc.virtual_hosts[1].routes[4].request_headers_to_remove[0]: \":path\" cannot be removed",
            "rc.virtual_hosts[1].domains[0]: only unique values for domains are permitted: \"a.com\" is also a domain of virtual_hosts[0]",
            "rc.virtual_hosts[1].domains[1]: \"x*y\": a wildcard must lead or trail",
        ]
    );
}

#[test]
fn a_redirect_replaces_the_parts_it_names() {
    let config = route_config(
        json!({"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"match": {"prefix": "/old/"}, "redirect": {"prefix_rewrite": "/new/", "response_code": "FOUND"}},
            {"match": {"prefix": "/"}, "redirect": {"https_redirect": true, "host_redirect": "secure.example.com"}}
        ]}]}),
    );
    let location = |path: &str| {
        let (_, route) = config
            .route(&request("example.com:8080", path, &HeaderMap::new()))
            .unwrap();
        let Action::Redirect(redirect) = &route.action else {
            panic!()
        };
        (
            redirect.status.as_u16(),
            redirect_location(
                redirect,
                route.matcher.matched_prefix_len(),
                "http",
                "example.com:8080",
                path,
            ),
        )
    };
    assert_eq!(
        location("/old/a?q=1"),
        (302, "http://example.com:8080/new/a?q=1".to_owned())
    );
    assert_eq!(
        location("/x"),
        (301, "https://secure.example.com/x".to_owned())
    );
}

#[test]
fn request_ids_are_version_4_uuids() {
    let id = super::connection_manager::uuid4();
    assert_eq!(id.len(), 36);
    assert_eq!(&id[14..15], "4");
    assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"), "{id}");
    for (at, c) in id.char_indices() {
        if [8, 13, 18, 23].contains(&at) {
            assert_eq!(c, '-', "{id}");
        } else {
            assert!(matches!(c, '0'..='9' | 'a'..='f'), "{id}");
        }
    }
    assert_ne!(id, super::connection_manager::uuid4());
}

mod serving {
    //! The connection manager over an in-memory connection: route configurations from
    //! RDS are looked up per request in the snapshot current then.

    use std::collections::HashMap;
    use std::sync::Arc;

    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager as EnvoyHcm;
    use http_body_util::{BodyExt as _, Empty};
    use hyper::body::Bytes;
    use hyper_util::rt::TokioIo;
    use serde_json::json;

    use super::route_config;
    use crate::http::connection_manager::{Downstream, serve};
    use crate::http::{ConfigProvider, RequestConfig, RouteConfig};
    use shunt_config::{Diagnostics, JsonPath};
    use shunt_core::access_log::Direction;
    use shunt_tls::Secrets;
    use shunt_upstream::Clusters;

    /// RDS route configurations that a test swaps, as xDS swaps snapshots.
    #[derive(Default)]
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

    #[derive(Default)]
    struct CurrentRoutes(std::sync::RwLock<Arc<Routes>>);

    impl ConfigProvider for CurrentRoutes {
        fn request_config(&self) -> Arc<dyn RequestConfig> {
            self.0.read().unwrap().clone()
        }
    }

    impl CurrentRoutes {
        fn swap(&self, routes: Arc<Routes>) {
            *self.0.write().unwrap() = routes;
        }
    }

    fn snapshot_with(routes: &[(&str, serde_json::Value)]) -> Arc<Routes> {
        let mut snapshot = Routes::default();
        for (name, config) in routes {
            snapshot
                .route_configs
                .insert((*name).to_owned(), Arc::new(route_config(config.clone())));
        }
        Arc::new(snapshot)
    }

    fn answering(body: &str) -> serde_json::Value {
        json!({"name": "r", "virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"match": {"prefix": "/gone"}, "route": {"cluster": "removed"}},
            {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": body}}}
        ]}]})
    }

    #[tokio::test]
    async fn an_rds_update_applies_to_the_next_request_on_a_live_connection() {
        let hcm: EnvoyHcm = shunt_config::message_from_json(json!({
            "stat_prefix": "rds",
            "rds": {"route_config_name": "r", "config_source": {"ads": {}}},
            "http_filters": [{"name": "router", "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
        }))
        .unwrap();
        let mut problems = Diagnostics::default();
        let stats = shunt_core::stats::Store::new();
        let hcm = Arc::new(
            crate::http::compile::compile(
                &hcm,
                &Default::default(),
                &stats,
                &JsonPath::new("hcm"),
                &mut problems,
            )
            .unwrap(),
        );
        let store = Arc::new(CurrentRoutes::default());

        let (client_io, server_io) = tokio::io::duplex(64 * 1024);
        let downstream = Downstream {
            remote: "10.0.0.1:40000".parse().unwrap(),
            local: "10.0.0.2:80".parse().unwrap(),
            original_dst: None,
            direction: Direction::Inbound,
            secure: false,
            own_ports: Arc::from(Vec::new()),
            connection: Arc::new(shunt_core::stream_info::Connection::new(
                "10.0.0.2:80".parse().unwrap(),
                "10.0.0.1:1234".parse().unwrap(),
            )),
        };
        tokio::spawn(serve(
            hcm.clone(),
            store.clone(),
            server_io,
            downstream,
            std::future::pending(),
        ));
        let (mut client, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(client_io))
                .await
                .unwrap();
        tokio::spawn(connection);
        let mut get = async |path: &str| {
            let request = hyper::Request::get(path)
                .header("host", "example.com")
                .body(Empty::<Bytes>::new())
                .unwrap();
            let response = client.send_request(request).await.unwrap();
            let status = response.status().as_u16();
            let server = response.headers()["server"].to_str().unwrap().to_owned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned(), server)
        };

        // Not delivered yet: no route (Envoy's empty route table).
        assert_eq!(get("/").await, (404, String::new(), "envoy".to_owned()));
        store.swap(snapshot_with(&[("r", answering("v1"))]));
        assert_eq!(get("/").await.1, "v1");
        store.swap(snapshot_with(&[("r", answering("v2"))]));
        assert_eq!(get("/").await.1, "v2");
        // The route's cluster is not in the current snapshot: 503, flag NC.
        assert_eq!(get("/gone").await.0, 503);

        assert_eq!(
            hcm.stats.downstream_cx_total.value(),
            1,
            "one connection throughout"
        );
        assert_eq!(hcm.stats.downstream_rq_total.value(), 4);
        assert_eq!(hcm.stats.no_route.value(), 1);
        assert_eq!(hcm.stats.no_cluster.value(), 1);
        assert_eq!(hcm.stats.rq_direct_response.value(), 2);
        assert_eq!(hcm.stats.downstream_rq_class[1].value(), 2);
        assert_eq!(hcm.stats.downstream_rq_class[4].value(), 1);
    }
}

#[test]
fn a_hash_policy_hashes_what_the_request_has() {
    use super::route::{HashKey, HashPolicy, request_hash};
    let policies = [
        HashPolicy {
            key: HashKey::Header(hyper::header::HeaderName::from_static("x-user")),
            terminal: true,
        },
        HashPolicy {
            key: HashKey::SourceIp,
            terminal: false,
        },
    ];
    let source = "10.0.0.1".parse().unwrap();
    let with_user = |user: &str| {
        let mut headers = HeaderMap::new();
        headers.insert("x-user", user.parse().unwrap());
        request_hash(&policies, &request("h", "/", &headers), source)
    };
    assert_eq!(with_user("alice"), with_user("alice"));
    assert_ne!(with_user("alice"), with_user("bob"));
    // Terminal: the source IP does not change a header hash.
    assert_eq!(
        with_user("alice"),
        request_hash(
            &policies[..1],
            &request("h", "/", &{
                let mut h = HeaderMap::new();
                h.insert("x-user", "alice".parse().unwrap());
                h
            }),
            "10.9.9.9".parse().unwrap()
        )
    );
    // No header: the source IP decides.
    let none = HeaderMap::new();
    assert!(request_hash(&policies, &request("h", "/", &none), source).is_some());
    assert_eq!(
        request_hash(&policies[..1], &request("h", "/", &none), source),
        None
    );
}

/// The connection manager over an in-memory connection: limits on what a downstream
/// sends, checked as Envoy checks them.
mod limits {
    use std::sync::Arc;

    use bytes::Bytes;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager as EnvoyHcm;
    use http_body_util::BodyExt as _;
    use serde_json::{Value, json};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use crate::http::connection_manager::{Downstream, serve};
    use crate::http::{ConfigProvider, RequestConfig, RouteConfig};
    use shunt_config::{Diagnostics, JsonPath};
    use shunt_core::access_log::Direction;
    use shunt_core::stats::{ScopeGuard, Store};

    #[derive(Default, Clone)]
    struct Empty {
        clusters: shunt_upstream::Clusters,
        secrets: shunt_tls::Secrets,
    }

    impl RequestConfig for Empty {
        fn route_config(&self, _: &str) -> Option<&Arc<RouteConfig>> {
            None
        }
        fn clusters(&self) -> &shunt_upstream::Clusters {
            &self.clusters
        }
        fn secrets(&self) -> &shunt_tls::Secrets {
            &self.secrets
        }
    }

    impl ConfigProvider for Empty {
        fn request_config(&self) -> Arc<dyn RequestConfig> {
            Arc::new(self.clone())
        }
    }

    /// An HCM answering every request with 200 `ok`, with `extra` merged into its config.
    fn hcm(extra: Value, store: &Store) -> Arc<crate::http::HttpConnectionManager> {
        let mut config = json!({
            "stat_prefix": "limits",
            "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
            ]}]},
            "http_filters": [{"name": "router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
        });
        for (key, value) in extra.as_object().unwrap() {
            config[key] = value.clone();
        }
        let config: EnvoyHcm = shunt_config::message_from_json(config).unwrap();
        let mut problems = Diagnostics::default();
        let compiled = crate::http::compile::compile(
            &config,
            &Default::default(),
            store,
            &JsonPath::new("hcm"),
            &mut problems,
        );
        assert!(problems.errors.is_empty(), "{:?}", problems.errors);
        Arc::new(compiled.unwrap())
    }

    /// Writes `request` on a new connection and reads until the connection closes.
    async fn exchange(hcm: Arc<crate::http::HttpConnectionManager>, request: Vec<u8>) -> String {
        exchange_with(hcm, Empty::default(), request).await
    }

    async fn exchange_with(
        hcm: Arc<crate::http::HttpConnectionManager>,
        config: Empty,
        request: Vec<u8>,
    ) -> String {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let downstream = Downstream {
            remote: "10.0.0.1:1234".parse().unwrap(),
            local: "10.0.0.2:80".parse().unwrap(),
            original_dst: None,
            direction: Direction::Inbound,
            secure: false,
            own_ports: Arc::from(Vec::new()),
            connection: Arc::new(shunt_core::stream_info::Connection::new(
                "10.0.0.2:80".parse().unwrap(),
                "10.0.0.1:1234".parse().unwrap(),
            )),
        };
        let served = tokio::spawn(serve(
            hcm,
            Arc::new(config),
            server,
            downstream,
            std::future::pending(),
        ));
        // The server may answer and close before all is written.
        let _ = client.write_all(&request).await;
        let mut response = Vec::new();
        // A bound so that a connection left open fails the test instead of hanging it.
        let read = client.read_to_end(&mut response);
        if tokio::time::timeout(std::time::Duration::from_secs(10), read)
            .await
            .is_ok()
        {
            served.await.unwrap();
        } else {
            served.abort();
        }
        String::from_utf8_lossy(&response).into_owned()
    }

    fn get(headers: &[(String, String)]) -> Vec<u8> {
        let mut request = String::from("GET / HTTP/1.1\r\nhost: a\r\n");
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("connection: close\r\n\r\n");
        request.into_bytes()
    }

    fn status(response: &str) -> &str {
        response.get(9..12).unwrap_or(response)
    }

    #[tokio::test]
    async fn headers_over_max_request_headers_kb_get_431() {
        let store = Store::new();
        let limited = hcm(json!({"max_request_headers_kb": 8}), &store);
        // Under the limit.
        let small = get(&[("x-pad".into(), "a".repeat(7000))]);
        assert_eq!(status(&exchange(limited.clone(), small).await), "200");
        // Just over Envoy's count (names and values): Envoy's reply and body.
        let over = get(&[("x-pad".into(), "a".repeat(8 * 1024))]);
        let response = exchange(limited.clone(), over).await;
        assert_eq!(status(&response), "431", "{response}");
        assert!(
            response.ends_with("Request Header Fields Too Large"),
            "{response}"
        );
        // Far over: the codec refuses it before it is all read.
        let huge = get(&[("x-pad".into(), "a".repeat(30 * 1024))]);
        assert_eq!(status(&exchange(limited, huge).await), "431");
        // Envoy's default is 60 KiB.
        let default = hcm(json!({}), &store);
        let k59 = get(&[("x-pad".into(), "a".repeat(59 * 1024))]);
        assert_eq!(status(&exchange(default.clone(), k59).await), "200");
        let k61 = get(&[("x-pad".into(), "a".repeat(61 * 1024))]);
        assert_eq!(status(&exchange(default.clone(), k61).await), "431");
        let k400 = get(&[("x-pad".into(), "a".repeat(400 * 1024))]);
        assert_eq!(status(&exchange(default, k400).await), "431");
    }

    /// Over real TCP: the client is still sending when the 431 goes out. Without the
    /// delayed close the unread bytes turn the close into a reset, which fails the
    /// client's write and can drop the response.
    #[tokio::test]
    async fn an_oversized_head_still_gets_its_431_over_tcp() {
        let store = Store::new();
        let hcm = hcm(json!({}), &store);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (socket, remote) = listener.accept().await.unwrap();
            let downstream = Downstream {
                remote,
                local: addr,
                original_dst: None,
                direction: Direction::Inbound,
                secure: false,
                own_ports: Arc::from(Vec::new()),
                connection: Arc::new(shunt_core::stream_info::Connection::new(
                    "10.0.0.2:80".parse().unwrap(),
                    "10.0.0.1:1234".parse().unwrap(),
                )),
            };
            serve(
                hcm,
                Arc::new(Empty::default()),
                socket,
                downstream,
                std::future::pending(),
            )
            .await;
        });
        let (written, read, response) = tokio::task::spawn_blocking(move || {
            use std::io::{Read, Write};
            let mut socket = std::net::TcpStream::connect(addr).unwrap();
            // 8 MiB: more than the socket buffers hold, so the client is mid-write.
            let written = (|| {
                socket.write_all(b"GET / HTTP/1.1\r\nhost: a\r\nx-pad: ")?;
                for _ in 0..128 {
                    socket.write_all(&[b'a'; 64 * 1024])?;
                }
                socket.write_all(b"\r\n\r\n")
            })();
            let mut response = Vec::new();
            let read = socket.read_to_end(&mut response);
            (
                written.map_err(|e| e.kind()),
                read.map_err(|e| e.kind()),
                String::from_utf8_lossy(&response).into_owned(),
            )
        })
        .await
        .unwrap();
        assert_eq!(written, Ok(()), "the client's write was reset");
        assert!(read.is_ok(), "{read:?}");
        assert_eq!(status(&response), "431", "{response}");
        server.await.unwrap();
    }

    #[tokio::test]
    async fn more_headers_than_max_headers_count_get_431() {
        let store = Store::new();
        let headers = |n: usize| -> Vec<(String, String)> {
            (0..n).map(|i| (format!("x-h{i}"), "v".into())).collect()
        };
        // host and connection count too.
        let default = hcm(json!({}), &store);
        assert_eq!(
            status(&exchange(default.clone(), get(&headers(98))).await),
            "200"
        );
        assert_eq!(status(&exchange(default, get(&headers(99))).await), "431");
        let ten = hcm(
            json!({"common_http_protocol_options": {"max_headers_count": 10}}),
            &store,
        );
        assert_eq!(
            status(&exchange(ten.clone(), get(&headers(8))).await),
            "200"
        );
        assert_eq!(status(&exchange(ten, get(&headers(9))).await), "431");
    }

    #[tokio::test]
    async fn headers_with_underscores_are_allowed_rejected_or_dropped() {
        let store = Store::new();
        let underscored = || get(&[("x_user".into(), "a".into())]);
        let allow = hcm(json!({}), &store);
        assert_eq!(status(&exchange(allow, underscored()).await), "200");
        let reject = hcm(
            json!({"common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"}}),
            &store,
        );
        let response = exchange(reject, underscored()).await;
        assert_eq!(status(&response), "400", "{response}");
        let drop = hcm(
            json!({"common_http_protocol_options": {"headers_with_underscores_action": "DROP_HEADER"}}),
            &store,
        );
        assert_eq!(status(&exchange(drop, underscored()).await), "200");
        let value = |name: &str| store.counter(name).value();
        assert_eq!(
            value("http1.requests_rejected_with_underscores_in_headers"),
            1
        );
        assert_eq!(value("http1.dropped_headers_with_underscores"), 1);
    }

    #[tokio::test]
    async fn request_headers_timeout_closes_a_connection_whose_headers_stall() {
        let store = Store::new();
        let hcm = hcm(json!({"request_headers_timeout": "0.2s"}), &store);
        // Never finished: the connection closes, no response, as Envoy ends the stream.
        let response = exchange(
            hcm.clone(),
            b"GET / HTTP/1.1\r\nhost: a\r\nx-slow: 1\r\n".to_vec(),
        )
        .await;
        assert_eq!(response, "");
        assert_eq!(hcm.stats.downstream_rq_header_timeout.value(), 1);
    }

    #[tokio::test]
    async fn the_last_request_of_max_requests_per_connection_closes_it() {
        let store = Store::new();
        let hcm = hcm(
            json!({"common_http_protocol_options": {"max_requests_per_connection": 2}}),
            &store,
        );
        // Three keep-alive requests pipelined: two answered, the second with
        // `connection: close`, then the connection closes.
        let one = "GET / HTTP/1.1\r\nhost: a\r\n\r\n";
        let response = exchange(hcm.clone(), one.repeat(3).into_bytes()).await;
        assert_eq!(response.matches("HTTP/1.1 200").count(), 2, "{response}");
        assert_eq!(
            response.matches("connection: close").count(),
            1,
            "{response}"
        );
        assert_eq!(hcm.stats.downstream_cx_max_requests_reached.value(), 1);
    }

    /// An HTTP/1.1 upstream on loopback answering 200 to everything.
    async fn upstream() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|_request| async {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(bytes::Bytes::from_static(b"up")),
                        ))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        address
    }

    /// A config with one STATIC cluster `up` whose host is `at`.
    fn with_upstream(store: &Store, at: std::net::SocketAddr, connect_timeout: &str) -> Empty {
        with_cluster(store, at, json!({"connect_timeout": connect_timeout}))
    }

    /// [`with_upstream`] with `extra` merged into the cluster's config.
    fn with_cluster(store: &Store, at: std::net::SocketAddr, extra: Value) -> Empty {
        let mut cluster = json!({
            "name": "up", "type": "STATIC",
            "load_assignment": {"cluster_name": "up", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": at.port()}}}}
            ]}]}
        });
        for (key, value) in extra.as_object().unwrap() {
            cluster[key] = value.clone();
        }
        let cluster: envoy_types::pb::envoy::config::cluster::v3::Cluster =
            shunt_config::message_from_json(cluster).unwrap();
        let mut problems = Diagnostics::default();
        let compiled = shunt_upstream::compile::compile(
            shunt_upstream::compile::Source::new(None, &cluster, 0),
            &JsonPath::new("c"),
            store,
            &mut Vec::new(),
            &mut problems,
        )
        .unwrap();
        let mut config = Empty::default();
        config.clusters.insert("up".into(), compiled);
        config
    }

    /// An HCM routing everything to cluster `up` of `config`.
    fn proxying_hcm(config: &Empty, store: &Store) -> Arc<crate::http::HttpConnectionManager> {
        proxying_hcm_with(config, store, json!({"cluster": "up"}))
    }

    /// An HCM routing everything with the route action `route`.
    fn proxying_hcm_with(
        config: &Empty,
        store: &Store,
        route: Value,
    ) -> Arc<crate::http::HttpConnectionManager> {
        let mut problems = Diagnostics::default();
        let hcm_config: EnvoyHcm = shunt_config::message_from_json(json!({
            "stat_prefix": "proxied",
            "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": route}
            ]}]},
            "http_filters": [{"name": "router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
        }))
        .unwrap();
        let hcm = crate::http::compile::compile(
            &hcm_config,
            &config.clusters,
            store,
            &JsonPath::new("hcm"),
            &mut problems,
        )
        .unwrap();
        assert!(problems.errors.is_empty(), "{:?}", problems.errors);
        Arc::new(hcm)
    }

    #[tokio::test]
    async fn proxied_requests_count_in_the_cluster_and_connection_manager_stats() {
        let store = Store::new();
        // The stats outlive the exchange's config, as a live cluster's and HCM's do.
        let _scopes = (store.scope("cluster.up."), store.scope("http.proxied."));
        let at = upstream().await;
        let config = with_upstream(&store, at, "1s");
        let hcm = proxying_hcm(&config, &store);
        let one = "GET / HTTP/1.1\r\nhost: a\r\n\r\n";
        let last = "GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n";
        let response = exchange_with(hcm, config, format!("{one}{one}{last}").into_bytes()).await;
        assert_eq!(response.matches("HTTP/1.1 200").count(), 3, "{response}");
        let counter = |name: &str| store.counter(name).value();
        for (stat, value) in [
            ("cluster.up.upstream_rq_total", 3),
            ("cluster.up.upstream_rq_200", 3),
            ("cluster.up.upstream_rq_2xx", 3),
            ("cluster.up.upstream_rq_completed", 3),
            ("http.proxied.downstream_rq_total", 3),
            ("http.proxied.downstream_rq_2xx", 3),
            ("http.proxied.downstream_cx_total", 1),
        ] {
            assert_eq!(counter(stat), value, "{stat}");
        }
        assert_eq!(
            store
                .histogram("cluster.up.upstream_rq_time")
                .summary()
                .count,
            3
        );
    }

    /// An HTTP/1.1 upstream that reads the request on its first `stalled` connections and
    /// never answers, then answers 200 `late` on the next ones. Counts the connections.
    async fn stalling_upstream(
        stalled: usize,
    ) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let n = count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") {
                        if stream.read(&mut byte).await.unwrap_or(0) == 0 {
                            return;
                        }
                        head.push(byte[0]);
                    }
                    if n < stalled {
                        // Holds the connection open, silent, until the proxy gives up.
                        let _ = stream.read(&mut byte).await;
                        return;
                    }
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")
                        .await;
                    let _ = stream.read(&mut byte).await;
                });
            }
        });
        (address, accepted)
    }

    /// One request through a route with a 0.2 s per-try timeout and one retry on reset,
    /// to [`stalling_upstream`]: the response, the connections the upstream took, the
    /// stats.
    async fn per_try_timeout_exchange(stalled: usize) -> (String, usize, Store, ScopeGuard) {
        let store = Store::new();
        // The cluster's stats outlive the exchange's config, as a live cluster's do.
        let scope = store.scope("cluster.up.");
        let (at, accepted) = stalling_upstream(stalled).await;
        let config = with_upstream(&store, at, "1s");
        let hcm = proxying_hcm_with(
            &config,
            &store,
            json!({"cluster": "up", "timeout": "10s", "retry_policy": {
                "retry_on": "reset", "num_retries": 1, "per_try_timeout": "0.2s"}}),
        );
        let request = "GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n";
        let response = exchange_with(hcm, config, request.as_bytes().to_vec()).await;
        let accepted = accepted.load(std::sync::atomic::Ordering::SeqCst);
        (response, accepted, store, scope)
    }

    #[tokio::test]
    async fn a_per_try_timeout_retries_on_a_new_connection_and_the_retry_answers() {
        let (response, accepted, store, _scope) = per_try_timeout_exchange(1).await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.ends_with("late"), "{response}");
        assert_eq!(accepted, 2);
        assert_eq!(store.counter("cluster.up.upstream_rq_retry").value(), 1);
        assert_eq!(store.counter("cluster.up.upstream_rq_timeout").value(), 0);
    }

    #[tokio::test]
    async fn a_per_try_timeout_without_a_retry_left_is_a_504() {
        let (response, accepted, store, _scope) = per_try_timeout_exchange(usize::MAX).await;
        assert!(response.starts_with("HTTP/1.1 504"), "{response}");
        assert!(response.ends_with("upstream request timeout"), "{response}");
        // Two tries, each cut by its own timer: the route's 10 s would have ended the
        // first.
        assert_eq!(accepted, 2);
        assert_eq!(store.counter("cluster.up.upstream_rq_timeout").value(), 1);
    }

    #[tokio::test]
    async fn a_generated_request_id_is_not_added_to_an_http2_upstreams_hpack_table() {
        let one = "GET / HTTP/1.1\r\nhost: a\r\n\r\n";
        let last = "GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n";
        let (first, second) = two_requests_to_an_http2_upstream(one, last).await;
        // The fields that repeat (authority, x-forwarded-proto, the expected timeout)
        // enter the table with the first request; the id, new each time, never does.
        assert!(first.contains(&"incremental"), "{first:?}");
        assert_eq!(count(&second, "never indexed"), 1, "{second:?}");
        assert!(
            !second.contains(&"incremental"),
            "the second request added to the table: {second:?}"
        );
    }

    #[tokio::test]
    async fn credentials_go_to_an_http2_upstream_as_never_indexed_literals() {
        // The same request twice, the second with credentials and a long cookie, which
        // nghttp2's policy does not count as one.
        let plain = "GET / HTTP/1.1\r\nhost: a\r\n\r\n";
        let credentials = "GET / HTTP/1.1\r\nhost: a\r\nauthorization: Bearer abc\r\n\
                           proxy-authorization: Basic eDp5\r\ncookie: s=1\r\n\
                           cookie: long=0123456789abcdefghij\r\nconnection: close\r\n\r\n";
        let (first, second) = two_requests_to_an_http2_upstream(plain, credentials).await;
        assert_eq!(
            count(&second, "never indexed"),
            count(&first, "never indexed") + 3,
            "{first:?} then {second:?}"
        );
        // The long cookie is kept out of the table too (h2's own choice for `cookie`),
        // but as a literal the next hop may index.
        assert!(!second.contains(&"incremental"), "{second:?}");
        assert_eq!(count(&second, "without indexing"), 1, "{second:?}");
    }

    /// `one` then `last` (which closes) on one downstream connection, proxied to
    /// [`h2_header_block_upstream`]: both answered 200; the [`representations`] of the
    /// two HPACK blocks the upstream received.
    async fn two_requests_to_an_http2_upstream(
        one: &str,
        last: &str,
    ) -> (Vec<&'static str>, Vec<&'static str>) {
        let store = Store::new();
        let (at, mut blocks) = h2_header_block_upstream().await;
        let config = with_cluster(
            &store,
            at,
            json!({"connect_timeout": "1s", "http2_protocol_options": {}}),
        );
        let hcm = proxying_hcm(&config, &store);
        let response = exchange_with(hcm, config, format!("{one}{last}").into_bytes()).await;
        assert_eq!(response.matches("HTTP/1.1 200").count(), 2, "{response}");
        let first = representations(&blocks.recv().await.unwrap());
        let second = representations(&blocks.recv().await.unwrap());
        (first, second)
    }

    /// How many fields of a block are represented as `kind`.
    fn count(found: &[&str], kind: &str) -> usize {
        found.iter().filter(|r| **r == kind).count()
    }

    /// A raw HTTP/2 upstream (one connection) answering each request `:status 200` with
    /// no body, and passing on each request's HPACK header block as it came.
    async fn h2_header_block_upstream() -> (
        std::net::SocketAddr,
        tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>,
    ) {
        fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
            let length = u32::try_from(payload.len()).unwrap().to_be_bytes();
            let mut frame = length[1..].to_vec();
            frame.extend([kind, flags]);
            frame.extend(stream.to_be_bytes());
            frame.extend(payload);
            frame
        }
        const HEADERS: u8 = 0x1;
        const SETTINGS: u8 = 0x4;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (blocks, received) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let mut preface = [0u8; 24];
            if stream.read_exact(&mut preface).await.is_err()
                || stream.write_all(&frame(SETTINGS, 0, 0, &[])).await.is_err()
            {
                return;
            }
            loop {
                let mut head = [0u8; 9];
                if stream.read_exact(&mut head).await.is_err() {
                    return;
                }
                let length = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let (kind, flags) = (head[3], head[4]);
                let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
                let mut payload = vec![0u8; length];
                if stream.read_exact(&mut payload).await.is_err() {
                    return;
                }
                let answer = match kind {
                    SETTINGS if flags & 0x1 == 0 => frame(SETTINGS, 0x1, 0, &[]),
                    HEADERS => {
                        // One frame per head (END_HEADERS), no padding or priority.
                        let _ = blocks.send(payload);
                        // `:status: 200` (static index 8); END_STREAM | END_HEADERS.
                        frame(HEADERS, 0x5, id, &[0x88])
                    }
                    _ => continue,
                };
                if stream.write_all(&answer).await.is_err() {
                    return;
                }
            }
        });
        (address, received)
    }

    /// What each field of an HPACK block is (RFC 7541 6), by its first byte, walked
    /// without decoding a string: `indexed`, `incremental` (added to the table),
    /// `without indexing`, `never indexed`, `size update`.
    fn representations(mut block: &[u8]) -> Vec<&'static str> {
        fn int(block: &mut &[u8], prefix: u32) -> usize {
            let max = (1usize << prefix) - 1;
            let mut value = usize::from(block[0]) & max;
            *block = &block[1..];
            if value == max {
                let mut shift = 0;
                loop {
                    let byte = block[0];
                    *block = &block[1..];
                    value += usize::from(byte & 0x7f) << shift;
                    shift += 7;
                    if byte & 0x80 == 0 {
                        break;
                    }
                }
            }
            value
        }
        fn skip_string(block: &mut &[u8]) {
            let length = int(block, 7);
            *block = &block[length..];
        }
        let mut found = Vec::new();
        while let Some(&first) = block.first() {
            let (kind, prefix) = match first {
                b if b & 0x80 != 0 => ("indexed", 7),
                b if b & 0xc0 == 0x40 => ("incremental", 6),
                b if b & 0xe0 == 0x20 => ("size update", 5),
                b if b & 0xf0 == 0x10 => ("never indexed", 4),
                _ => ("without indexing", 4),
            };
            let name_index = int(&mut block, prefix);
            if !matches!(kind, "indexed" | "size update") {
                if name_index == 0 {
                    skip_string(&mut block);
                }
                skip_string(&mut block);
            }
            found.push(kind);
        }
        found
    }

    /// An upstream that reads what it is sent and answers `answer` (then keeps the
    /// connection open); `trickle`: then one more byte every `every`, `n` times.
    async fn raw_upstream(answer: &'static [u8], trickle: usize) -> std::net::SocketAddr {
        trickling_upstream(answer, trickle, std::time::Duration::from_secs(2)).await
    }

    async fn trickling_upstream(
        answer: &'static [u8],
        trickle: usize,
        every: std::time::Duration,
    ) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = stream.read(&mut buf).await;
                    if !answer.is_empty() {
                        let _ = stream.write_all(answer).await;
                    }
                    for _ in 0..trickle {
                        tokio::time::sleep(every).await;
                        let _ = stream.write_all(b"x").await;
                    }
                    // Held open, read until the proxy lets go.
                    while matches!(stream.read(&mut buf).await, Ok(n) if n > 0) {}
                });
            }
        });
        address
    }

    /// An upstream that answers each request with the head it received, as its body.
    async fn echoing_head_upstream() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(n) if n > 0 => head.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                    }
                    let answer =
                        format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", head.len());
                    let _ = stream.write_all(answer.as_bytes()).await;
                    let _ = stream.write_all(&head).await;
                });
            }
        });
        address
    }

    /// An upstream (hyper's server) answering each request with its method, path and
    /// body, streamed in two frames: chunked, so the proxy cannot know its length.
    async fn streaming_upstream() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        |request: hyper::Request<hyper::body::Incoming>| async move {
                            let first = format!("{} {}", request.method(), request.uri());
                            let body = request.into_body().collect().await?.to_bytes();
                            let frames = [Bytes::from(first), Bytes::from(format!("|{body:?}"))];
                            Ok::<_, hyper::Error>(hyper::Response::new(Frames(frames.into())))
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        address
    }

    /// A body of data frames of unknown length, each sent on its own poll.
    struct Frames(std::collections::VecDeque<Bytes>);

    impl hyper::body::Body for Frames {
        type Data = Bytes;
        type Error = hyper::Error;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
            std::task::Poll::Ready(self.0.pop_front().map(|f| Ok(hyper::body::Frame::data(f))))
        }
    }

    /// Four pipelined requests on one keep-alive connection (a GET, a HEAD, one with a
    /// body, a last one that closes) are all answered, in order, each streamed answer
    /// chunked as it came, the HEAD's without a body.
    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order_and_framed() {
        let store = Store::new();
        let (hcm, config) = proxying(json!({}), &store, streaming_upstream().await);
        let requests = concat!(
            "GET /a HTTP/1.1\r\nhost: a\r\n\r\n",
            "HEAD /b HTTP/1.1\r\nhost: a\r\n\r\n",
            "POST /c HTTP/1.1\r\nhost: a\r\ncontent-length: 4\r\n\r\nbody",
            "GET /d HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n",
        );
        let response = exchange_with(hcm.clone(), config, requests.into()).await;
        let heads: Vec<_> = response
            .match_indices("HTTP/1.1 ")
            .map(|(i, _)| i)
            .collect();
        assert_eq!(heads.len(), 4, "{response}");
        let answer =
            |n: usize| &response[heads[n]..heads.get(n + 1).copied().unwrap_or(response.len())];
        // Streamed: chunked, each frame its own chunk, then the last chunk.
        assert!(
            answer(0).contains("\r\ntransfer-encoding: chunked\r\n"),
            "{response}"
        );
        assert!(
            answer(0).ends_with("\r\n\r\n6\r\nGET /a\r\n4\r\n|b\"\"\r\n0\r\n\r\n"),
            "{response}"
        );
        // HEAD: the head a GET would have, and no body.
        assert!(answer(1).ends_with("\r\n\r\n"), "{response}");
        assert!(!answer(1).contains("HEAD /b"), "{response}");
        // The body reached the upstream.
        assert!(
            answer(2).contains("\r\n7\r\nPOST /c\r\n8\r\n|b\"body\"\r\n0\r\n\r\n"),
            "{response}"
        );
        assert!(
            answer(3).contains("\r\nconnection: close\r\n"),
            "{response}"
        );
        assert!(
            answer(3).ends_with("6\r\nGET /d\r\n4\r\n|b\"\"\r\n0\r\n\r\n"),
            "{response}"
        );
        for n in 0..4 {
            assert!(answer(n).starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
            assert!(answer(n).contains("\r\ndate: "), "{response}");
        }
        assert_eq!(hcm.stats.downstream_cx_protocol_total[0].value(), 1);
    }

    #[tokio::test]
    async fn the_route_timeout_is_announced_upstream_unless_it_is_off() {
        let at = echoing_head_upstream().await;
        let store = Store::new();
        let (hcm, config) = proxying(json!({}), &store, at);
        let response = exchange_with(hcm, config, GET.to_vec()).await;
        assert_eq!(status(&response), "200", "{response}");
        let announced = "x-envoy-expected-rq-timeout-ms: 8000\r\n";
        assert!(
            response.to_ascii_lowercase().contains(announced),
            "{response}"
        );
        // `timeout: 0s` turns the route's timeout off: nothing to announce.
        let store = Store::new();
        let off = json!({"route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "up", "timeout": "0s"}}]}]}});
        let (hcm, config) = proxying(off, &store, at);
        let response = exchange_with(hcm, config, GET.to_vec()).await;
        assert_eq!(status(&response), "200", "{response}");
        assert!(
            !response
                .to_ascii_lowercase()
                .contains("x-envoy-expected-rq-timeout-ms"),
            "{response}"
        );
    }

    /// A connection manager routing everything to an upstream at `at`, `extra` merged
    /// into its config; the route's timeout is 8 s.
    fn proxying(
        extra: Value,
        store: &Store,
        at: std::net::SocketAddr,
    ) -> (Arc<crate::http::HttpConnectionManager>, Empty) {
        let config = with_upstream(store, at, "100s");
        let mut problems = Diagnostics::default();
        let mut hcm_config = json!({
            "stat_prefix": "timeouts",
            "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
                {"match": {"prefix": "/"}, "route": {"cluster": "up", "timeout": "8s"}}
            ]}]},
            "http_filters": [{"name": "router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
        });
        for (key, value) in extra.as_object().unwrap() {
            hcm_config[key] = value.clone();
        }
        let hcm_config: EnvoyHcm = shunt_config::message_from_json(hcm_config).unwrap();
        let hcm = crate::http::compile::compile(
            &hcm_config,
            &config.clusters,
            store,
            &JsonPath::new("hcm"),
            &mut problems,
        )
        .unwrap();
        assert!(problems.errors.is_empty(), "{:?}", problems.errors);
        (Arc::new(hcm), config)
    }

    const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n";
    /// A request whose body (10 bytes announced) never all arrives.
    const UNFINISHED_POST: &[u8] = b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\nabc";

    #[tokio::test(start_paused = true)]
    async fn request_timeout_answers_408_until_the_request_is_complete() {
        let store = Store::new();
        let at = raw_upstream(b"", 0).await;
        let (hcm, config) = proxying(json!({"request_timeout": "2s"}), &store, at);
        let response = exchange_with(hcm.clone(), config.clone(), UNFINISHED_POST.to_vec()).await;
        assert_eq!(status(&response), "408", "{response}");
        assert!(response.ends_with("request timeout"), "{response}");
        assert_eq!(hcm.stats.downstream_rq_timeout.value(), 1);
        // A complete request is past it (its body read): the route's timeout answers.
        let response = exchange_with(hcm.clone(), config.clone(), GET.to_vec()).await;
        assert_eq!(status(&response), "504", "{response}");
        let post = b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\n0123456789";
        let response = exchange_with(hcm.clone(), config, post.to_vec()).await;
        assert_eq!(status(&response), "504", "{response}");
        assert_eq!(hcm.stats.downstream_rq_timeout.value(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn stream_idle_timeout_answers_504_or_408_before_the_response() {
        let store = Store::new();
        let silent = raw_upstream(b"", 0).await;
        let (hcm, config) = proxying(json!({"stream_idle_timeout": "3s"}), &store, silent);
        // The request all in: the answer is late, 504 (as Envoy 1.40).
        let response = exchange_with(hcm.clone(), config.clone(), GET.to_vec()).await;
        assert_eq!(status(&response), "504", "{response}");
        assert!(response.ends_with("stream timeout"), "{response}");
        assert_eq!(hcm.stats.downstream_rq_idle_timeout.value(), 1);
        // Still arriving: 408.
        let response = exchange_with(hcm.clone(), config, UNFINISHED_POST.to_vec()).await;
        assert_eq!(status(&response), "408", "{response}");
        assert!(response.ends_with("stream timeout"), "{response}");
        assert_eq!(hcm.stats.downstream_rq_idle_timeout.value(), 2);
    }

    /// Its own runtime: with the clock paused, tasks left by another exchange can let
    /// the clock skip past the timer while the upstream's bytes are on loopback.
    #[tokio::test(start_paused = true)]
    async fn stream_idle_timeout_resets_a_stream_once_the_response_started() {
        // Headers then part of the body, then nothing: the response is cut short.
        let store = Store::new();
        let stalled = raw_upstream(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc", 0).await;
        let (hcm, config) = proxying(json!({"stream_idle_timeout": "3s"}), &store, stalled);
        let response = exchange_with(hcm.clone(), config, GET.to_vec()).await;
        assert_eq!(status(&response), "200", "{response}");
        assert!(response.ends_with("abc"), "{response}");
        assert_eq!(hcm.stats.downstream_rq_idle_timeout.value(), 1);
    }

    /// Real time: with the clock paused, the runtime may skip ahead while a byte is on
    /// its way through loopback.
    #[tokio::test]
    async fn stream_idle_timeout_restarts_with_each_byte() {
        let store = Store::new();
        let every = std::time::Duration::from_millis(100);
        let trickling =
            trickling_upstream(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\na", 5, every).await;
        // Longer in all than the idle timeout, but never idle for it.
        let (hcm, config) = proxying(json!({"stream_idle_timeout": "0.4s"}), &store, trickling);
        let response = exchange_with(hcm.clone(), config, GET.to_vec()).await;
        assert!(response.ends_with("\r\n\r\naxxxxx"), "{response}");
        assert_eq!(hcm.stats.downstream_rq_idle_timeout.value(), 0);
    }

    #[test]
    fn stream_idle_timeout_defaults_to_5_minutes_and_0_disables_it() {
        let store = Store::new();
        let idle = |extra| hcm(extra, &store).limits.stream.idle;
        assert_eq!(idle(json!({})), Some(std::time::Duration::from_secs(300)));
        assert_eq!(idle(json!({"stream_idle_timeout": "0s"})), None);
    }

    #[tokio::test(start_paused = true)]
    async fn max_stream_duration_answers_504_or_408_before_the_response() {
        let store = Store::new();
        let limit = json!({"common_http_protocol_options": {"max_stream_duration": "3s"}});
        let silent = raw_upstream(b"", 0).await;
        let (hcm, config) = proxying(limit.clone(), &store, silent);
        let response = exchange_with(hcm.clone(), config.clone(), GET.to_vec()).await;
        assert_eq!(status(&response), "504", "{response}");
        assert!(
            response.ends_with("downstream duration timeout"),
            "{response}"
        );
        let response = exchange_with(hcm.clone(), config, UNFINISHED_POST.to_vec()).await;
        assert_eq!(status(&response), "408", "{response}");
        assert_eq!(hcm.stats.downstream_rq_max_duration_reached.value(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn max_stream_duration_resets_a_stream_however_active() {
        let limit = json!({"common_http_protocol_options": {"max_stream_duration": "3s"}});
        // Active, but longer than that: reset after the response started.
        let store = Store::new();
        let trickling = raw_upstream(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\na", 9).await;
        let (hcm, config) = proxying(limit, &store, trickling);
        let response = exchange_with(hcm.clone(), config, GET.to_vec()).await;
        assert_eq!(status(&response), "200", "{response}");
        // Cut short: some of `axxxxxxxxx`.
        let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
        assert!(body.starts_with('a') && body.len() < 10, "{response}");
        assert_eq!(hcm.stats.downstream_rq_max_duration_reached.value(), 1);
    }

    /// Each case in a runtime of its own with the clock paused (see
    /// `stream_idle_timeout_resets_a_stream_once_the_response_started`).
    #[test]
    fn a_route_max_stream_duration_overrides_the_connection_managers() {
        // A silent upstream; the route's timeout is 8s and the stream idle timeout 9s.
        // Which timer answered is in the body (Envoy 1.40 gives the same outcomes).
        let ended = |hcm_limit: Option<&'static str>,
                     route_limit: Option<Value>,
                     request: &[u8]| {
            let request = request.to_vec();
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(async move {
                let mut route = json!({"cluster": "up", "timeout": "8s"});
                if let Some(limit) = route_limit {
                    route["max_stream_duration"] = limit;
                }
                let mut extra = json!({"stream_idle_timeout": "9s",
                    "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}]}]}});
                if let Some(limit) = hcm_limit {
                    extra["common_http_protocol_options"] = json!({"max_stream_duration": limit});
                }
                let store = Store::new();
                let silent = raw_upstream(b"", 0).await;
                let (hcm, config) = proxying(extra, &store, silent);
                let response = exchange_with(hcm, config, request).await;
                assert_eq!(status(&response), "504", "{response}");
                response
                    .split("\r\n\r\n")
                    .nth(1)
                    .unwrap_or_default()
                    .to_owned()
            })
        };
        const ROUTE: &str = "upstream request timeout";
        const DURATION: &str = "downstream duration timeout";
        const IDLE: &str = "stream timeout";
        let grpc = |timeout: &str| {
            format!(
                "GET / HTTP/1.1\r\nhost: a\r\ngrpc-timeout: {timeout}\r\nconnection: close\r\n\r\n"
            )
            .into_bytes()
        };
        assert_eq!(ended(None, None, GET), ROUTE);
        // The route's own limit.
        let route_2s = json!({"max_stream_duration": "2s"});
        assert_eq!(ended(None, Some(route_2s), GET), DURATION);
        // A block turns the route's `timeout` off ("new timeouts").
        let route_30s = json!({"max_stream_duration": "30s"});
        assert_eq!(ended(None, Some(route_30s.clone()), GET), IDLE);
        // 0 turns the connection manager's off; an empty block keeps it.
        let route_off = json!({"max_stream_duration": "0s"});
        assert_eq!(ended(Some("3s"), Some(route_off), GET), IDLE);
        assert_eq!(ended(Some("3s"), Some(json!({})), GET), DURATION);
        assert_eq!(ended(Some("3s"), Some(route_30s), GET), IDLE);
        // grpc-timeout sets it, capped by grpc_timeout_header_max (0: not capped)...
        let capped = json!({"grpc_timeout_header_max": "2s"});
        assert_eq!(ended(None, Some(capped), &grpc("20S")), DURATION);
        let uncapped = json!({"grpc_timeout_header_max": "0s"});
        assert_eq!(ended(None, Some(uncapped.clone()), &grpc("20S")), IDLE);
        assert_eq!(ended(None, Some(uncapped), &grpc("1500m")), DURATION);
        // ...less grpc_timeout_header_offset; without the header, max_stream_duration.
        let offset = json!({"grpc_timeout_header_max": "0s", "grpc_timeout_header_offset": "15s",
                            "max_stream_duration": "30s"});
        assert_eq!(ended(None, Some(offset.clone()), &grpc("20S")), DURATION);
        assert_eq!(ended(None, Some(offset), GET), IDLE);
    }

    #[test]
    fn grpc_timeout_values_parse_as_grpc_defines_them() {
        use crate::http::route::grpc_timeout;
        use std::time::Duration;
        assert_eq!(grpc_timeout(b"1H"), Some(Duration::from_secs(3600)));
        assert_eq!(grpc_timeout(b"2M"), Some(Duration::from_secs(120)));
        assert_eq!(grpc_timeout(b"30S"), Some(Duration::from_secs(30)));
        assert_eq!(grpc_timeout(b"1500m"), Some(Duration::from_millis(1500)));
        assert_eq!(grpc_timeout(b"7u"), Some(Duration::from_micros(7)));
        assert_eq!(
            grpc_timeout(b"99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in [&b""[..], b"S", b"123456789S", b"10s", b"-1S", b"1.5S"] {
            assert_eq!(
                grpc_timeout(bad),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn max_connection_duration_drains_the_connection() {
        let store = Store::new();
        let hcm = hcm(
            json!({"common_http_protocol_options": {"max_connection_duration": "5s"}}),
            &store,
        );
        // Keep-alive: without the limit the connection would stay open.
        let response = exchange(hcm.clone(), b"GET / HTTP/1.1\r\nhost: a\r\n\r\n".to_vec()).await;
        assert_eq!(status(&response), "200", "{response}");
        assert_eq!(hcm.stats.downstream_cx_max_duration_reached.value(), 1);
    }

    #[tokio::test]
    async fn http2_sends_goaway_after_max_requests_per_connection() {
        let store = Store::new();
        let hcm = hcm(
            json!({"common_http_protocol_options": {"max_requests_per_connection": 2}}),
            &store,
        );
        let (client, server) = tokio::io::duplex(1 << 20);
        let downstream = Downstream {
            remote: "10.0.0.1:1234".parse().unwrap(),
            local: "10.0.0.2:80".parse().unwrap(),
            original_dst: None,
            direction: Direction::Inbound,
            secure: false,
            own_ports: Arc::from(Vec::new()),
            connection: Arc::new(shunt_core::stream_info::Connection::new(
                "10.0.0.2:80".parse().unwrap(),
                "10.0.0.1:1234".parse().unwrap(),
            )),
        };
        let served = tokio::spawn(serve(
            hcm.clone(),
            Arc::new(Empty::default()),
            server,
            downstream,
            std::future::pending(),
        ));
        let (mut sender, connection) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(client),
        )
        .await
        .unwrap();
        let connection = tokio::spawn(connection);
        for _ in 0..2 {
            let request = hyper::Request::get("http://a/")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            let response = sender.send_request(request).await.unwrap();
            assert_eq!(response.status(), 200);
        }
        // GOAWAY: the connection ends without the client closing it.
        let bound = std::time::Duration::from_secs(10);
        tokio::time::timeout(bound, served).await.unwrap().unwrap();
        let _ = tokio::time::timeout(bound, connection).await.unwrap();
        assert_eq!(hcm.stats.downstream_cx_max_requests_reached.value(), 1);
    }
}

#[test]
fn hop_by_hop_headers_and_those_connection_names_are_stripped() {
    use crate::http::router::strip_hop_by_hop;
    use hyper::header::{self, HeaderName, HeaderValue};
    let mut headers = HeaderMap::new();
    for (name, value) in [
        ("connection", "keep-alive, X-Hop"),
        ("keep-alive", "timeout=5"),
        ("x-hop", "1"),
        ("transfer-encoding", "chunked"),
        ("te", "gzip"),
        ("x-kept", "1"),
    ] {
        headers.append(
            HeaderName::from_static(name),
            HeaderValue::from_static(value),
        );
    }
    strip_hop_by_hop(&mut headers);
    let left: Vec<&str> = headers.keys().map(|n| n.as_str()).collect();
    assert_eq!(left, ["x-kept"]);
    // gRPC's `te: trailers` stays; a message with none of them is left as it is.
    let mut headers = HeaderMap::new();
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    headers.insert(header::HOST, HeaderValue::from_static("a"));
    strip_hop_by_hop(&mut headers);
    assert_eq!(headers.len(), 2);
    // Each of RFC 9110's names alone, in any case it arrives in: the scan's length
    // filter must let every one through.
    for name in [
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "Transfer-Encoding",
        "Upgrade",
        "HTTP2-Settings",
    ] {
        let mut headers = HeaderMap::new();
        headers.insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_static("x"),
        );
        headers.insert(header::ACCEPT, HeaderValue::from_static("*/*"));
        strip_hop_by_hop(&mut headers);
        let left: Vec<&str> = headers.keys().map(|n| n.as_str()).collect();
        assert_eq!(left, ["accept"], "{name} was kept");
    }
}

#[test]
fn millisecond_header_values_read_the_same_from_the_table_and_beyond_it() {
    use crate::http::router::millis_header;
    for ms in [0, 1, 9, 10, 127, 128, 15_000, u64::MAX] {
        assert_eq!(millis_header(ms).to_str().unwrap(), ms.to_string());
    }
}
