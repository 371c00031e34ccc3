//! Compiling bootstraps: what a served config becomes, and how a config shunt cannot
//! serve is refused, with every error at its JSON path.

use std::sync::Arc;

use super::*;
use shunt_config::Options;
use shunt_filters::tcp::tcp_proxy::ClusterSpecifier;
use shunt_listener::config::NetworkFilter;
use shunt_upstream::Discovery;
use shunt_upstream::load_balancer::LbPolicy;

fn bootstrap(yaml: &str) -> Bootstrap {
    let options = Options {
        config_yaml: Some(yaml.to_owned()),
        ..Default::default()
    };
    shunt_config::check(&options, &extensions::IMPLEMENTED)
        .expect("a loadable bootstrap")
        .0
        .bootstrap
}

fn compiled(yaml: &str) -> Compiled {
    compile(&bootstrap(yaml), &Default::default()).unwrap_or_else(|err| panic!("{err}"))
}

fn errors(yaml: &str) -> Vec<String> {
    compile(&bootstrap(yaml), &Default::default())
        .expect_err("the bootstrap should not compile")
        .errors
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// Istio's outbound shape: virtualOutbound hands off by original destination to a
/// per-service listener that is not bound, else passes through.
const ISTIO_LIKE: &str = r#"
static_resources:
  listeners:
  - name: virtualOutbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15001}}
    use_original_dst: true
    traffic_direction: OUTBOUND
    listener_filters:
    - name: envoy.filters.listener.original_dst
      typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst}
    filter_chains:
    - name: PassthroughFilterChain
      filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: PassthroughCluster
          cluster: PassthroughCluster
  - name: 10.84.30.227_9092
    address: {socket_address: {address: 10.84.30.227, port_value: 9092}}
    bind_to_port: false
    traffic_direction: OUTBOUND
    listener_filters:
    - name: envoy.filters.listener.tls_inspector
      typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector}
    - name: envoy.filters.listener.http_inspector
      typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.listener.http_inspector.v3.HttpInspector}
    listener_filters_timeout: 0.1s
    continue_on_listener_filters_timeout: true
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: outbound|9092||kafka.default.svc.cluster.local
          cluster: kafka
          idle_timeout: 0s
          max_connect_attempts: 3
  - name: 0.0.0.0_8080
    address: {socket_address: {address: 0.0.0.0, port_value: 8080}}
    bind_to_port: false
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: blackhole
          cluster: BlackHoleCluster
  clusters:
  - name: PassthroughCluster
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 10s
  - name: InboundPassthroughClusterIpv4
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    upstream_bind_config: {source_address: {address: 127.0.0.6, port_value: 0}}
  - name: BlackHoleCluster
    type: STATIC
  - name: kafka
    type: STRICT_DNS
    dns_lookup_family: V4_ONLY
    lb_policy: MAGLEV
    circuit_breakers: {thresholds: [{max_connections: 7}, {priority: HIGH, max_connections: 9}]}
    outlier_detection: {consecutive_local_origin_failure: 2, split_external_local_origin_errors: true, base_ejection_time: 1s}
    health_checks:
    - timeout: 1s
      interval: 5s
      unhealthy_threshold: 3
      healthy_threshold: 2
      http_health_check: {path: /healthz}
    load_assignment:
      cluster_name: kafka
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: localhost, port_value: 9092}}}
"#;

#[test]
fn an_istio_shaped_bootstrap_compiles_to_listeners_and_clusters() {
    let Compiled {
        snapshot, warnings, ..
    } = compiled(ISTIO_LIKE);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(snapshot.listeners.len(), 3);

    let outbound = snapshot.listener("virtualOutbound").unwrap();
    assert!(outbound.use_original_dst && outbound.bind_to_port);
    assert!(outbound.listener_filters.original_dst);
    assert_eq!(
        outbound.direction,
        shunt_core::access_log::Direction::Outbound
    );

    let kafka = snapshot.listener("10.84.30.227_9092").unwrap();
    assert!(!kafka.bind_to_port);
    let filters = &kafka.listener_filters;
    assert!(filters.tls_inspector && filters.http_inspector && filters.continue_on_timeout);
    assert_eq!(filters.timeout, Some(std::time::Duration::from_millis(100)));

    let passthrough = &snapshot.clusters["PassthroughCluster"];
    assert_eq!(passthrough.discovery, Discovery::OriginalDst);
    assert_eq!(
        passthrough.connect_timeout,
        std::time::Duration::from_secs(10)
    );
    let inbound = &snapshot.clusters["InboundPassthroughClusterIpv4"];
    assert_eq!(inbound.source_address, Some("127.0.0.6:0".parse().unwrap()));
    assert_eq!(inbound.connect_timeout, std::time::Duration::from_secs(5));
    assert!(snapshot.clusters["BlackHoleCluster"].hosts().is_empty());

    let kafka = &snapshot.clusters["kafka"];
    assert!(
        matches!(&kafka.discovery, Discovery::StrictDns { targets, .. } if targets[0].name == "localhost")
    );
    assert_eq!(kafka.lb_policy, LbPolicy::Maglev { table_size: 65_537 });
    assert_eq!(kafka.circuit_breaker.max_connections(), 7);
    let outlier = kafka.outlier_detection.as_ref().unwrap();
    assert_eq!(
        (outlier.consecutive, outlier.base_ejection_time),
        (2, std::time::Duration::from_secs(1))
    );
    assert_eq!(kafka.health_checks.len(), 1);
}

#[test]
fn tcp_proxy_settings_carry_envoys_defaults() {
    let snapshot = compiled(ISTIO_LIKE).snapshot;
    let chain_of = |listener: &str| {
        let listener = snapshot.listener(listener).unwrap();
        let info = shunt_listener::filter_chain::ConnectionInfo {
            destination: "10.84.30.227:9092".parse().unwrap(),
            source: "10.0.0.1:1".parse().unwrap(),
            direct_source: "10.0.0.1:1".parse().unwrap(),
            server_name: None,
            transport_protocol: "raw_buffer",
            application_protocols: &[],
        };
        let NetworkFilter::TcpProxy(proxy) = &listener.filter_chains.select(&info).unwrap().network
        else {
            panic!("a tcp_proxy chain")
        };
        let ClusterSpecifier::Cluster(cluster) = &proxy.clusters else {
            panic!()
        };
        (
            cluster.to_string(),
            proxy.idle_timeout,
            proxy.max_connect_attempts,
        )
    };
    assert_eq!(
        chain_of("virtualOutbound"),
        (
            "PassthroughCluster".into(),
            Some(std::time::Duration::from_secs(3600)),
            1
        )
    );
    // idle_timeout: 0s turns the timeout off.
    assert_eq!(chain_of("10.84.30.227_9092"), ("kafka".into(), None, 3));
}

#[test]
fn hand_off_finds_the_exact_address_then_the_wildcard_port() {
    let snapshot = compiled(ISTIO_LIKE).snapshot;
    let name = |addr: &str| {
        snapshot
            .listener_for_address(addr.parse().unwrap())
            .map(|l| l.name.to_string())
    };
    assert_eq!(
        name("10.84.30.227:9092").as_deref(),
        Some("10.84.30.227_9092")
    );
    assert_eq!(name("10.1.1.1:8080").as_deref(), Some("0.0.0.0_8080"));
    assert_eq!(name("10.84.30.227:9093"), None);
    // An IPv6 destination does not match an IPv4 wildcard.
    assert_eq!(name("[fd00::1]:8080"), None);
}

#[test]
fn a_connection_keeps_the_snapshot_it_started_with() {
    let store = Current::new(compiled(ISTIO_LIKE).snapshot);
    let in_flight = store.load();
    let old = store.swap(Arc::new(Snapshot::default()));
    assert!(Arc::ptr_eq(&old, &in_flight));
    assert!(store.load().listeners.is_empty());
    assert_eq!(in_flight.listeners.len(), 3);
}

const LISTENER_HEAD: &str = r#"
static_resources:
  clusters: [{name: c, load_assignment: {cluster_name: c, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 1}}}}]}]}}]
  listeners:
  - name: l
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
"#;

const TCP_PROXY_TO_C: &str = r#"{name: envoy.filters.network.tcp_proxy, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: s, cluster: c}}"#;

/// An `http_connection_manager` chain: `{filters}` are its HTTP filters, `{routes}` its
/// route specifier.
fn hcm_listener(filters: &str, routes: &str) -> String {
    format!(
        "{LISTENER_HEAD}    filter_chains:\n    - filters: [{{name: hcm, typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager, stat_prefix: h, {routes}, http_filters: [{filters}]}}}}]\n"
    )
}

const ROUTER: &str = "{name: r, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}";

#[test]
fn an_http_connection_manager_chain_serves_http_with_its_routes() {
    let yaml = hcm_listener(
        ROUTER,
        "route_config: {name: local, virtual_hosts: [{name: v, domains: ['*'], routes: [{match: {prefix: /}, route: {cluster: c}}]}]}",
    );
    let compiled = compiled(&yaml);
    let chain = only_chain(&compiled.snapshot);
    let NetworkFilter::Http(hcm) = &chain.network else {
        panic!("an HTTP chain, got {:?}", chain.network);
    };
    assert_eq!(hcm.stat_prefix, "h");
    let shunt_filters::http::config::RouteSource::Static(routes) = &hcm.routes else {
        panic!("inline routes");
    };
    assert_eq!(routes.name, "local");

    let rds = compiled_rds(&hcm_listener(
        ROUTER,
        "rds: {route_config_name: r80, config_source: {ads: {}}}",
    ));
    assert_eq!(rds, "r80");
}

/// The chain listener `l` serves a connection from 10.0.0.1 to 127.0.0.1:80 with.
fn only_chain(snapshot: &Snapshot) -> Arc<shunt_listener::config::FilterChain> {
    let info = shunt_listener::filter_chain::ConnectionInfo {
        destination: "127.0.0.1:80".parse().unwrap(),
        source: "10.0.0.1:1".parse().unwrap(),
        direct_source: "10.0.0.1:1".parse().unwrap(),
        server_name: None,
        transport_protocol: "raw_buffer",
        application_protocols: &[],
    };
    let listener = snapshot.listener("l").unwrap();
    listener.filter_chains.select(&info).unwrap().clone()
}

fn compiled_rds(yaml: &str) -> String {
    let compiled = compiled(yaml);
    let chain = only_chain(&compiled.snapshot);
    match &chain.network {
        NetworkFilter::Http(hcm) => match &hcm.routes {
            shunt_filters::http::config::RouteSource::Rds(name) => name.clone(),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_inline_route_configuration_may_name_only_known_clusters() {
    let routes = |validate: &str| {
        format!(
            "route_config: {{{validate}virtual_hosts: [{{name: v, domains: ['*'], routes: [{{match: {{prefix: /}}, route: {{weighted_clusters: {{clusters: [{{name: c, weight: 1}}, {{name: nope, weight: 1}}]}}}}}}]}}]}}"
        )
    };
    assert_eq!(
        errors(&hcm_listener(ROUTER, &routes(""))),
        [
            "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.route_config.virtual_hosts[0].routes[0].route.weighted_clusters.clusters[1].name: no cluster named \"nope\" (validate_clusters is on for an inline route_config)"
        ]
    );
    // As in Envoy, validate_clusters: false lets it through (503 NC per request).
    compiled(&hcm_listener(ROUTER, &routes("validate_clusters: false, ")));
}

#[test]
fn http_filters_must_end_in_the_router_and_unknown_ones_are_refused_unless_optional() {
    let unknown = "{name: x, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer, max_request_bytes: 10}}";
    let optional = "{name: y, is_optional: true, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer, max_request_bytes: 10}}";
    let routes = "route_config: {virtual_hosts: [{name: v, domains: ['*', '*'], routes: [{match: {prefix: /}, route: {cluster: c}}]}]}";
    let yaml = hcm_listener(&format!("{unknown}, {optional}"), routes);
    let hcm = "static_resources.listeners[0].filter_chains[0].filters[0].typed_config";
    assert_eq!(
        errors(&yaml),
        [
            format!(
                "{hcm}.route_config.virtual_hosts[0].domains[1]: only unique values for domains are permitted: \"*\" is also a domain of virtual_hosts[0]"
            ),
            format!(
                "{hcm}.http_filters[0].typed_config: HTTP filter envoy.extensions.filters.http.buffer.v3.Buffer is not implemented yet"
            ),
            format!(
                "{hcm}.http_filters: the last HTTP filter must be the router (envoy.extensions.filters.http.router.v3.Router)"
            ),
        ]
    );
    // Optional: skipped with a warning.
    let yaml = hcm_listener(
        &format!("{optional}, {ROUTER}"),
        "rds: {route_config_name: r}",
    );
    let warnings = compile(&bootstrap(&yaml), &Default::default())
        .unwrap()
        .warnings;
    assert!(
        warnings
            .iter()
            .any(|w| w.path == format!("{hcm}.http_filters[0].typed_config")
                && w.message.contains("optional filter is skipped")),
        "{warnings:?}"
    );
    // Nothing may follow the router.
    let yaml = hcm_listener(
        &format!("{ROUTER}, {unknown}"),
        "rds: {route_config_name: r}",
    );
    assert_eq!(
        errors(&yaml),
        [format!(
            "{hcm}.http_filters[1]: comes after the terminal HTTP filter, the router"
        )]
    );
}

#[test]
fn every_error_is_reported_at_its_path() {
    let yaml = format!(
        "{LISTENER_HEAD}    filter_chains:\n    - filters: [{TCP_PROXY_TO_C}]\n    - filters: [{TCP_PROXY_TO_C}]\n      transport_socket: {{name: tls, typed_config: {{'@type': type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext}}}}\n    - filter_chain_match: {{prefix_ranges: [{{address_prefix: 10.0.0.0, prefix_len: 40}}]}}\n      filters: [{TCP_PROXY_TO_C}]\n    - filters: [{TCP_PROXY_TO_C}]\n"
    );
    let yaml = yaml.replace(
        "  clusters: [",
        "  clusters: [{name: m, lb_policy: MAGLEV, maglev_lb_config: {table_size: 100}}, {name: s, type: STATIC, load_assignment: {cluster_name: s, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: db.local, port_value: 5432}}}}]}]}}, ",
    );
    assert_eq!(
        errors(&yaml),
        [
            "static_resources.clusters[0].maglev_lb_config.table_size: 100 must be a prime no larger than 5000011",
            "static_resources.clusters[1].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address.address: \"db.local\" is not an IP address; a STATIC cluster needs IP endpoints (use STRICT_DNS or LOGICAL_DNS for names)",
            "static_resources.listeners[0].filter_chains[1].transport_socket.typed_config.common_tls_context.tls_certificates: terminating TLS needs a certificate (tls_certificates or tls_certificate_sds_secret_configs)",
            "static_resources.listeners[0].filter_chains[2].filter_chain_match.prefix_ranges[0].prefix_len: 40 is too long for 10.0.0.0",
            "static_resources.listeners[0].filter_chains[3].filter_chain_match: matches the same connections as filter_chains[0]; Envoy rejects such listeners",
        ]
    );
}

fn dynamic_cluster(name: &str, port: u32, timeout: &str) -> Arc<super::DynamicCluster> {
    let cluster: envoy_types::pb::envoy::config::cluster::v3::Cluster =
        shunt_config::message_from_json(serde_json::json!({
        "name": name, "type": "STATIC", "connect_timeout": timeout,
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}
    }))
    .unwrap();
    let cluster = Arc::new(super::Encoded::of(&cluster));
    Arc::new(super::DynamicCluster {
        digest: cluster.digest(),
        endpoints: None,
        tracked: shunt_config::Tracked {
            resource: cluster,
            version_info: Some("1".into()),
            last_updated: std::time::SystemTime::now(),
        },
    })
}

#[test]
fn dynamic_resources_compile_with_the_static_ones_and_unchanged_clusters_are_kept() {
    let bootstrap = bootstrap("static_resources: {clusters: [{name: s}]}");
    let stats = Default::default();
    let mut dynamic = super::DynamicResources {
        clusters: vec![dynamic_cluster("a", 1, "1s"), dynamic_cluster("b", 2, "1s")],
        ..Default::default()
    };
    let first = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), None, &stats)
        .unwrap()
        .snapshot;
    assert_eq!(first.clusters.len(), 3);
    dynamic.clusters[1] = dynamic_cluster("b", 3, "1s");
    let second = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), Some(&first), &stats)
        .unwrap()
        .snapshot;
    assert!(
        Arc::ptr_eq(&first.clusters["a"], &second.clusters["a"]),
        "unchanged: kept"
    );
    assert!(
        !Arc::ptr_eq(&first.clusters["b"], &second.clusters["b"]),
        "changed: rebuilt"
    );
    assert!(Arc::ptr_eq(&first.clusters["s"], &second.clusters["s"]));
    // An update of something else (listeners, routes) keeps the very map.
    let same = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), Some(&second), &stats)
        .unwrap()
        .snapshot;
    assert!(Arc::ptr_eq(&second.clusters, &same.clusters));
    assert!(!Arc::ptr_eq(&first.clusters, &second.clusters));
    let dump = second.resources();
    assert_eq!(
        dump.clusters
            .iter()
            .filter(|c| c.version_info.is_some())
            .count(),
        2
    );

    dynamic.clusters[0] = dynamic_cluster("a", 1, "-1s");
    let err = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), Some(&second), &stats)
        .unwrap_err();
    let errors: Vec<String> = err.errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].starts_with("Cluster \"a\".connect_timeout"),
        "{errors:?}"
    );
}

fn dynamic_route_config(
    name: &str,
    local_rate_limit: bool,
) -> shunt_config::Tracked<Arc<super::Encoded<RouteConfiguration>>> {
    let mut json = serde_json::json!({"name": name, "virtual_hosts": [{
        "name": "v", "domains": ["*"],
        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "shared-a"}}]}]});
    if local_rate_limit {
        json["virtual_hosts"][0]["typed_per_filter_config"] = serde_json::json!({
            "envoy.filters.http.local_ratelimit": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                "stat_prefix": "rl",
                "token_bucket": {"max_tokens": 1, "fill_interval": "1s"}}});
    }
    shunt_config::Tracked {
        resource: Arc::new(super::Encoded::of(
            &shunt_config::message_from_json::<RouteConfiguration>(json).unwrap(),
        )),
        version_info: Some("1".into()),
        last_updated: std::time::SystemTime::now(),
    }
}

/// Node mode's pods are proxies of one process: given the same resources they share
/// what compiling them made (one compiled route configuration, one compile of a
/// cluster), and each keeps its own state (its cluster's hosts and stats, a route
/// configuration with token buckets).
#[test]
fn proxies_of_one_process_share_what_the_same_resources_compile_to() {
    // As node mode does; the other tests of this binary compile the same either way.
    shunt_core::interned::share_compiled();
    let bootstrap = bootstrap("static_resources: {clusters: [{name: s}]}");
    let dynamic = Arc::new(super::DynamicResources {
        clusters: vec![dynamic_cluster("shared-a", 1, "1s")],
        route_configs: vec![
            dynamic_route_config("shared-r", false),
            dynamic_route_config("limited-r", true),
        ],
        warming_clusters: vec![dynamic_cluster("warming-w", 9, "1s").tracked.clone()],
        validate_warming: true,
        ..Default::default()
    });
    let (one, two) = (StatsStore::default(), StatsStore::default());
    let first = super::compile_with(&bootstrap, dynamic.clone(), None, &one)
        .unwrap()
        .snapshot;
    let second = super::compile_with(&bootstrap, dynamic, None, &two)
        .unwrap()
        .snapshot;
    let (a1, a2) = (&first.clusters["shared-a"], &second.clusters["shared-a"]);
    assert!(!Arc::ptr_eq(a1, a2), "each proxy has its own cluster");
    assert!(
        Arc::ptr_eq(&a1.transport_socket_matches, &a2.transport_socket_matches),
        "compiled once"
    );
    assert!(
        !Arc::ptr_eq(&a1.hosts()[0], &a2.hosts()[0]),
        "hosts of its own"
    );
    a1.stats.upstream_cx_total.inc();
    assert_eq!(one.counter("cluster.shared-a.upstream_cx_total").value(), 1);
    assert_eq!(two.counter("cluster.shared-a.upstream_cx_total").value(), 0);
    assert!(Arc::ptr_eq(
        &first.route_configs["shared-r"],
        &second.route_configs["shared-r"]
    ));
    assert!(
        !Arc::ptr_eq(
            &first.route_configs["limited-r"],
            &second.route_configs["limited-r"]
        ),
        "token buckets are each proxy's own"
    );
    assert!(
        Arc::ptr_eq(&first.warming[0], &second.warming[0]),
        "a warming cluster is checked once"
    );
}

/// `cluster_manager.enable_deferred_cluster_creation` (node mode's pod bootstraps, and
/// Istio's when they have a `cluster_manager`): a cluster is made, with its stats and
/// hosts, when first looked up; one whose making starts something (DNS) at once. A
/// made cluster is kept by the next snapshot as an eager one is.
#[test]
fn deferred_creation_makes_a_cluster_when_first_used() {
    let dns = "{name: dns, type: STRICT_DNS, load_assignment: {cluster_name: dns, endpoints: \
               [{lb_endpoints: [{endpoint: {address: {socket_address: \
               {address: localhost, port_value: 1}}}}]}]}}";
    let yaml = format!(
        "cluster_manager: {{enable_deferred_cluster_creation: true}}\n\
         static_resources: {{clusters: [{{name: s}}, {dns}]}}"
    );
    let deferred = bootstrap(&yaml);
    let stats = StatsStore::default();
    let stat_names = || -> Vec<String> { stats.snapshot().into_iter().map(|s| s.name).collect() };
    let mut dynamic = super::DynamicResources {
        clusters: vec![dynamic_cluster("a", 1, "1s"), dynamic_cluster("b", 2, "1s")],
        ..Default::default()
    };
    let first = super::compile_with(&deferred, Arc::new(dynamic.clone()), None, &stats).unwrap();
    let fresh: Vec<&str> = first.fresh_clusters.iter().map(|c| &*c.name).collect();
    assert_eq!(
        fresh,
        ["dns"],
        "DNS resolution cannot wait for the first use"
    );
    let first = first.snapshot;
    assert_eq!((first.clusters.len(), first.clusters.deferred()), (4, 3));
    assert!(first.clusters.made("a").is_none());
    assert!(
        !stat_names().iter().any(|n| n.starts_with("cluster.a.")),
        "no stats before the first use: {:?}",
        stat_names()
    );

    let a = first.clusters.get("a").unwrap().clone();
    assert_eq!(a.hosts()[0].address.port(), 1);
    assert!(Arc::ptr_eq(&a, &first.clusters["a"]), "made once");
    assert!(
        stat_names()
            .iter()
            .any(|n| n == "cluster.a.upstream_cx_total")
    );
    assert!(!stat_names().iter().any(|n| n.starts_with("cluster.b.")));

    dynamic.clusters[1] = dynamic_cluster("b", 3, "1s");
    let second = super::compile_with(&deferred, Arc::new(dynamic), Some(&first), &stats)
        .unwrap()
        .snapshot;
    assert!(
        Arc::ptr_eq(&a, second.clusters.made("a").unwrap()),
        "unchanged: the made cluster is kept"
    );
    assert_eq!(
        second.clusters.deferred(),
        2,
        "b changed and is made when used"
    );
    assert_eq!(second.clusters["b"].hosts()[0].address.port(), 3);

    let eager = bootstrap(&yaml.replace("true", "false"));
    let snapshot = super::compile_with(&eager, Default::default(), None, &stats)
        .unwrap()
        .snapshot;
    assert_eq!(snapshot.clusters.deferred(), 0);
}

#[test]
fn an_unknown_cluster_is_a_warning_as_it_may_come_later() {
    let yaml = format!(
        "{LISTENER_HEAD}    filter_chains:\n    - filters: [{}]\n",
        TCP_PROXY_TO_C.replace("cluster: c", "cluster: nope")
    );
    let warnings: Vec<_> = compiled(&yaml)
        .warnings
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        warnings,
        [
            "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.cluster: no cluster named \"nope\": its connections will be closed (NC)"
        ]
    );
}

#[test]
fn use_original_dst_restores_the_destination_without_a_listed_filter() {
    // Istio's virtualOutbound lists no listener filters: Envoy adds original_dst itself.
    let yaml = format!(
        "{}    use_original_dst: true\n    filter_chains:\n    - filters: [{TCP_PROXY_TO_C}]\n",
        LISTENER_HEAD
    );
    let snapshot = compiled(&yaml).snapshot;
    assert!(
        snapshot
            .listener("l")
            .unwrap()
            .listener_filters
            .original_dst
    );
}

const PIPE_CLUSTER: &str = "{name: p, load_assignment: {cluster_name: p, endpoints: [{lb_endpoints: [{endpoint: {address: {pipe: {path: /tmp/p.sock}}}}]}]}}";

#[test]
fn unix_socket_endpoints_are_left_out_unless_a_listener_routes_there() {
    let unrouted = format!(
        "{}    filter_chains:\n    - filters: [{TCP_PROXY_TO_C}]\n",
        LISTENER_HEAD.replace(
            "clusters: [{name: c,",
            &format!("clusters: [{PIPE_CLUSTER}, {{name: c,")
        )
    );
    let Compiled {
        snapshot, warnings, ..
    } = compiled(&unrouted);
    assert!(snapshot.clusters["p"].hosts().is_empty());
    let warnings: Vec<String> = warnings.iter().map(ToString::to_string).collect();
    assert_eq!(
        warnings,
        [
            "static_resources.clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.pipe: \
          Unix domain socket endpoints are not implemented yet; no listener routes to cluster \"p\", \
          which is kept without this endpoint"
        ]
    );

    let routed = unrouted.replace("cluster: c}", "cluster: p}");
    assert_eq!(
        errors(&routed),
        [
            "static_resources.clusters[0].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.pipe: \
          Unix domain socket endpoints are not implemented yet, and listener \"l\" routes to cluster \"p\""
        ]
    );
}

#[test]
fn istios_health_listeners_are_left_to_the_admin_api() {
    let options = Options {
        config_path: Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../config/src/testdata/istio-default_golden.json"),
        ),
        ..Default::default()
    };
    let mut bootstrap = shunt_config::check(&options, &extensions::IMPLEMENTED)
        .unwrap()
        .0
        .bootstrap;
    bootstrap.dynamic_resources = None;
    let compiled = compile(&bootstrap, &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    // 15090 and 15021 are HTTP listeners shunt answers in the admin API.
    assert!(compiled.snapshot.listeners.is_empty());
    assert_eq!(compiled.snapshot.clusters.len(), 4);
    // The config dump still shows them.
    assert_eq!(compiled.snapshot.resources().listeners.len(), 2);
}

#[test]
fn stats_are_created_under_envoys_names() {
    let yaml = format!(
        "{}    stat_prefix: front\n    filter_chains:\n    - filters: [{TCP_PROXY_TO_C}]\n  - name: m\n    \
         address: {{socket_address: {{address: 127.0.0.1, port_value: 7000}}}}\n    \
         filter_chains:\n    - filters: [{}]\n",
        LISTENER_HEAD.replace("{name: c,", "{name: c, alt_stat_name: c_alt,"),
        TCP_PROXY_TO_C.replace("stat_prefix: s", "stat_prefix: t"),
    );
    let stats = shunt_core::stats::Store::new();
    let snapshot = compile(&bootstrap(&yaml), &stats)
        .unwrap_or_else(|e| panic!("{e}"))
        .snapshot;
    let names: Vec<String> = stats.snapshot().into_iter().map(|s| s.name).collect();
    for name in [
        "cluster.c_alt.upstream_cx_total",
        "cluster.c_alt.upstream_cx_overflow",
        "cluster.c_alt.membership_total",
        "listener.front.downstream_cx_total",
        "listener.127.0.0.1_7000.downstream_cx_active",
        "tcp.s.downstream_cx_total",
        "tcp.t.downstream_cx_total",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} not in {names:#?}");
    }
    let front = snapshot.listener("l").unwrap();
    let guard = snapshot.listener_stats(front).unwrap().connection();
    let value = |name: &str| {
        stats
            .snapshot()
            .into_iter()
            .find(|s| s.name == name)
            .map(|s| s.value)
    };
    use shunt_core::stats::StatValue;
    assert_eq!(
        value("listener.front.downstream_cx_active"),
        Some(StatValue::Gauge(1))
    );
    drop(guard);
    assert_eq!(
        value("listener.front.downstream_cx_active"),
        Some(StatValue::Gauge(0))
    );
    assert_eq!(
        value("listener.front.downstream_cx_total"),
        Some(StatValue::Counter(1))
    );
}

#[test]
fn a_transport_socket_naming_an_unknown_static_secret_is_refused() {
    let yaml = r#"
static_resources:
  clusters:
  - name: tls
    type: STATIC
    load_assignment: {cluster_name: tls, endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 443}}}}]}]}
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context: {tls_certificate_sds_secret_configs: [{name: client-cert}]}
"#;
    assert_eq!(
        errors(yaml),
        vec![
            "static_resources.clusters[0].transport_socket: names secret \"client-cert\" without an sds_config, and static_resources.secrets has no such secret"
        ]
    );
}

fn dynamic_listener(
    name: &str,
    port: u32,
    cluster: &str,
) -> shunt_config::Tracked<Arc<super::Encoded<EnvoyListener>>> {
    let listener: EnvoyListener = shunt_config::message_from_json(serde_json::json!({
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "tcp", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": name, "cluster": cluster}}]}]
    }))
    .unwrap();
    shunt_config::Tracked {
        resource: Arc::new(super::Encoded::of(&listener)),
        version_info: Some("1".into()),
        last_updated: std::time::SystemTime::now(),
    }
}

/// Each cluster's name and config digest, and each listener's name: what a snapshot
/// serves, to compare a patched snapshot with one compiled from scratch.
fn contents(snapshot: &Snapshot) -> (Vec<(String, u64)>, Vec<String>) {
    let mut clusters: Vec<(String, u64)> = snapshot
        .clusters
        .names()
        .map(|name| {
            let c = &snapshot.clusters[name];
            assert_eq!(**name, *c.name, "a cluster under its own name");
            (name.to_string(), c.config_digest)
        })
        .collect();
    clusters.sort();
    let listeners = snapshot
        .listeners
        .iter()
        .map(|l| l.name.to_string())
        .collect();
    (clusters, listeners)
}

#[test]
fn an_update_patches_the_previous_snapshot_as_compiling_from_scratch_would() {
    let bootstrap = bootstrap("static_resources: {clusters: [{name: s}]}");
    let stats = Default::default();
    let mut dynamic = super::DynamicResources {
        clusters: vec![
            dynamic_cluster("a", 1, "1s"),
            dynamic_cluster("b", 2, "1s"),
            dynamic_cluster("c", 3, "1s"),
        ],
        listeners: vec![dynamic_listener("l", 7001, "a")],
        ..Default::default()
    };
    let first = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), None, &stats)
        .unwrap()
        .snapshot;

    // One cluster changed, one removed, one added; the listener is the same resource.
    dynamic.clusters = vec![
        dynamic.clusters[0].clone(),
        dynamic_cluster("b", 4, "1s"),
        dynamic_cluster("d", 5, "1s"),
    ];
    let changes = super::cluster_changes(&first.dynamic.clusters, &dynamic.clusters, &[]).unwrap();
    let changed: Vec<String> = changes
        .iter()
        .map(|change| match change {
            super::ClusterChange::Upserted(c) => format!("+{}", c.name()),
            super::ClusterChange::Removed(name) => format!("-{name}"),
        })
        .collect();
    assert_eq!(changed, ["+b", "-c", "+d"]);
    // Out of name order, or a name twice: compiled whole, which checks what a patch cannot.
    let a = dynamic.clusters[0].clone();
    let unordered = [dynamic_cluster("b", 4, "1s"), a.clone()];
    assert!(super::cluster_changes(&first.dynamic.clusters, &unordered, &[]).is_none());
    let twice = [a.clone(), dynamic_cluster("a", 4, "1s")];
    assert!(super::cluster_changes(&first.dynamic.clusters, &twice, &[]).is_none());
    let dynamic = Arc::new(dynamic);
    let patched = super::compile_with(&bootstrap, dynamic.clone(), Some(&first), &stats).unwrap();
    let scratch = super::compile_with(&bootstrap, dynamic.clone(), None, &stats).unwrap();
    assert_eq!(contents(&patched.snapshot), contents(&scratch.snapshot));
    let second = patched.snapshot;
    assert_eq!(contents(&second).0.len(), 4, "s, a, b and d");
    for name in ["s", "a"] {
        assert!(
            Arc::ptr_eq(&first.clusters[name], &second.clusters[name]),
            "{name} kept"
        );
    }
    let mut fresh: Vec<&str> = patched.fresh_clusters.iter().map(|c| &*c.name).collect();
    fresh.sort_unstable();
    assert_eq!(fresh, ["b", "d"]);
    assert!(second.shares_listeners_with(&first), "no listener changed");

    // A changed listener is compiled again; the snapshot is still the one from scratch.
    let mut third = (*dynamic).clone();
    third.listeners = vec![dynamic_listener("l", 7002, "b")];
    let third = Arc::new(third);
    let patched = super::compile_with(&bootstrap, third.clone(), Some(&second), &stats)
        .unwrap()
        .snapshot;
    let scratch = super::compile_with(&bootstrap, third, None, &stats)
        .unwrap()
        .snapshot;
    assert!(!patched.shares_listeners_with(&second));
    assert_eq!(contents(&patched), contents(&scratch));
    let at = |s: &Snapshot| {
        s.listener_for_address("127.0.0.1:7002".parse().unwrap())
            .map(|l| l.name.clone())
    };
    assert_eq!(at(&patched).as_deref(), Some("l"));
    assert_eq!(at(&patched), at(&scratch));

    // A dynamic cluster named as a static one is an error from the patch as from scratch.
    let mut clash = (*dynamic).clone();
    clash.clusters.push(dynamic_cluster("s", 6, "1s"));
    let errors = |previous: Option<&Snapshot>| -> Vec<String> {
        super::compile_with(&bootstrap, Arc::new(clash.clone()), previous, &stats)
            .unwrap_err()
            .errors
            .iter()
            .map(ToString::to_string)
            .collect()
    };
    assert_eq!(errors(Some(&second)), errors(None));
    assert_eq!(
        errors(None),
        ["Cluster \"s\".name: a second cluster named \"s\""]
    );
}

#[test]
fn a_cluster_says_which_http_version_its_hosts_speak() {
    use shunt_upstream::cluster::UpstreamProtocol;
    let yaml = r#"
static_resources:
  clusters:
  - {name: plain}
  - {name: deprecated_h2, http2_protocol_options: {}}
  - name: explicit_h2
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
  - name: downstream
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        use_downstream_protocol_config: {}
"#;
    let options = shunt_config::Options {
        config_yaml: Some(yaml.to_owned()),
        ..Default::default()
    };
    let bootstrap = shunt_config::check(&options, &extensions::IMPLEMENTED)
        .unwrap()
        .0
        .bootstrap;
    let snapshot = crate::snapshot::compile(&bootstrap, &Default::default())
        .unwrap()
        .snapshot;
    let protocol = |name: &str| snapshot.clusters[name].http_protocol;
    assert_eq!(protocol("plain"), UpstreamProtocol::Http1);
    assert_eq!(protocol("deprecated_h2"), UpstreamProtocol::Http2);
    assert_eq!(protocol("explicit_h2"), UpstreamProtocol::Http2);
    assert_eq!(protocol("downstream"), UpstreamProtocol::UseDownstream);
}

/// Hand-offs between listeners (`use_original_dst`), on a compiled snapshot.
mod hand_off {
    use crate::snapshot::Snapshot;
    use shunt_listener::connection_handler::{Facts, hand_off_target};

    const LISTENERS: &str = r#"
static_resources:
  listeners:
  - name: virtualOutbound
    address: {socket_address: {address: 0.0.0.0, port_value: 15001}}
    use_original_dst: true
    filter_chains: [{filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: p, cluster: PassthroughCluster}}]}]
  - name: plain
    address: {socket_address: {address: 0.0.0.0, port_value: 15002}}
    filter_chains: [{filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: p, cluster: PassthroughCluster}}]}]
  - name: 10.96.0.10_80
    address: {socket_address: {address: 10.96.0.10, port_value: 80}}
    bind_to_port: false
    filter_chains: [{filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: p, cluster: PassthroughCluster}}]}]
  clusters: [{name: PassthroughCluster, type: ORIGINAL_DST, lb_policy: CLUSTER_PROVIDED}]
"#;

    fn snapshot() -> Snapshot {
        let options = shunt_config::Options {
            config_yaml: Some(LISTENERS.to_owned()),
            ..Default::default()
        };
        let bootstrap = shunt_config::check(&options, &crate::snapshot::extensions::IMPLEMENTED)
            .unwrap()
            .0
            .bootstrap;
        crate::snapshot::compile(&bootstrap, &Default::default())
            .unwrap()
            .snapshot
    }

    fn restored(destination: &str) -> Facts {
        Facts {
            restored: true,
            ..Facts::new(destination.parse().unwrap())
        }
    }

    #[test]
    fn a_restored_destination_is_handed_to_its_listener_else_stays() {
        let snapshot = snapshot();
        let outbound = snapshot.listener("virtualOutbound").unwrap();
        let target =
            |facts: &Facts| hand_off_target(&snapshot, outbound, facts).map(|l| l.name.to_string());
        assert_eq!(
            target(&restored("10.96.0.10:80")).as_deref(),
            Some("10.96.0.10_80")
        );
        // No listener for it: stays on virtualOutbound's own (passthrough) chains.
        assert_eq!(target(&restored("10.96.0.11:80")), None);
        // A destination on the listener's own port is not handed to itself.
        assert_eq!(target(&restored("10.0.0.5:15001")), None);
        // Without a restored destination, nothing moves.
        assert_eq!(target(&Facts::new("10.96.0.10:80".parse().unwrap())), None);
    }

    #[test]
    fn only_use_original_dst_listeners_hand_off() {
        let snapshot = snapshot();
        let plain = snapshot.listener("plain").unwrap();
        assert!(hand_off_target(&snapshot, plain, &restored("10.96.0.10:80")).is_none());
    }
}

#[test]
fn warming_resources_are_checked_when_asked_and_never_served() {
    let bootstrap = bootstrap("static_resources: {clusters: [{name: s}]}");
    let stats = Default::default();
    let mut dynamic = super::DynamicResources {
        clusters: vec![dynamic_cluster("a", 1, "1s")],
        warming_clusters: vec![dynamic_cluster("w", 2, "-1s").tracked.clone()],
        ..Default::default()
    };
    // Not asked: a warming cluster is not compiled.
    let snapshot = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), None, &stats)
        .unwrap()
        .snapshot;
    assert!(!snapshot.clusters.contains_key("w"));
    // Asked: its errors come out at its path, as Envoy refuses it on arrival.
    dynamic.validate_warming = true;
    let err = super::compile_with(&bootstrap, Arc::new(dynamic.clone()), None, &stats)
        .expect_err("the warming cluster's error");
    assert_eq!(err.errors.len(), 1, "{:?}", err.errors);
    assert!(
        err.errors[0]
            .path
            .starts_with(r#"Cluster "w".connect_timeout"#),
        "{:?}",
        err.errors
    );
    // A good warming cluster is checked and still not served.
    dynamic.warming_clusters = vec![dynamic_cluster("w", 2, "1s").tracked.clone()];
    let snapshot = super::compile_with(&bootstrap, Arc::new(dynamic), None, &stats)
        .unwrap()
        .snapshot;
    assert!(!snapshot.clusters.contains_key("w"));
    assert!(snapshot.clusters.contains_key("a"));
}

/// A CDS cluster of type EDS gets its endpoints over EDS: its check while it warms
/// (before they come) warns of nothing, while a static EDS cluster without a
/// `load_assignment` is warned of, as it never gets any.
#[test]
fn a_warming_eds_cluster_is_not_warned_of_missing_endpoints() {
    let cluster: envoy_types::pb::envoy::config::cluster::v3::Cluster =
        shunt_config::message_from_json(serde_json::json!({
            "name": "w", "type": "EDS", "connect_timeout": "1s",
            "eds_cluster_config": {"eds_config": {"ads": {}}, "service_name": "w"}
        }))
        .unwrap();
    let warnings = |index: Option<usize>| {
        let mut problems = Diagnostics::default();
        let path = JsonPath::resource("clusters", "Cluster", index, "w");
        let checked = cluster::validate(
            cluster::Source::new(index, &cluster, 1),
            &path,
            &mut problems,
        );
        assert!(checked.is_some(), "{:?}", problems.errors);
        problems
            .warnings
            .iter()
            .map(|w| w.path.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(warnings(None), Vec::<String>::new(), "from CDS");
    assert_eq!(
        warnings(Some(0)),
        ["static_resources.clusters[0].eds_cluster_config"],
        "static"
    );
}

/// A listener whose chains a `filter_chain_matcher` picks: chains without matches of
/// their own are no overlap, and each connection runs the chain the matcher names.
#[test]
fn filter_chain_matcher_picks_the_chain() {
    let snapshot = compiled(
        r#"
static_resources:
  clusters: [{name: a}, {name: b}]
  listeners:
  - name: l
    address: {socket_address: {address: 0.0.0.0, port_value: 15010}}
    filter_chains:
    - name: to-a
      filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: a, cluster: a}}]
    - name: to-b
      filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: b, cluster: b}}]
    filter_chain_matcher:
      matcher_tree:
        input: {name: port, typed_config: {"@type": type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.DestinationPortInput}}
        exact_match_map:
          map:
            "80": {action: {name: a, typed_config: {"@type": type.googleapis.com/google.protobuf.StringValue, value: to-a}}}
      on_no_match: {action: {name: b, typed_config: {"@type": type.googleapis.com/google.protobuf.StringValue, value: to-b}}}
"#,
    )
    .snapshot;
    let listener = snapshot.listener("l").unwrap();
    let cluster_for = |destination: &str| {
        let info = shunt_listener::filter_chain::ConnectionInfo {
            destination: destination.parse().unwrap(),
            source: "10.0.0.1:1".parse().unwrap(),
            direct_source: "10.0.0.1:1".parse().unwrap(),
            server_name: None,
            transport_protocol: "raw_buffer",
            application_protocols: &[],
        };
        let NetworkFilter::TcpProxy(proxy) = &listener.filter_chains.select(&info).unwrap().network
        else {
            panic!("a tcp_proxy chain")
        };
        let ClusterSpecifier::Cluster(cluster) = &proxy.clusters else {
            panic!()
        };
        cluster.to_string()
    };
    assert_eq!(cluster_for("10.1.2.3:80"), "a");
    assert_eq!(cluster_for("10.1.2.3:81"), "b");
}

/// Node mode serves many pods from one process, each with its own xDS stream: a pod's
/// state-of-the-world workload update replaces its own index, never another pod's, and
/// the index outlives each of the pod's snapshots.
#[test]
fn each_proxy_instance_has_its_own_workload_index_carried_across_its_snapshots() {
    use shunt_core::peer::workload_discovery::{Change, WorkloadResource};
    let stats = Default::default();
    let pod = |id: &str| bootstrap(&format!("node: {{id: '{id}'}}"));
    let (a, b) = (
        pod("sidecar~10.0.0.1~a.ns~ns.svc.cluster.local"),
        pod("sidecar~10.0.0.2~b.ns~ns.svc.cluster.local"),
    );
    let a1 = super::compile(&a, &stats).unwrap().snapshot;
    let b1 = super::compile(&b, &stats).unwrap().snapshot;
    assert!(!Arc::ptr_eq(&a1.node.workloads, &b1.node.workloads));

    let workload = |uid: &str, ip: [u8; 4]| WorkloadResource {
        uid: uid.into(),
        workload_name: uid.into(),
        addresses: vec![ip.to_vec()],
        ..Default::default()
    };
    let (ratings, reviews) = (
        workload("ratings", [10, 1, 0, 1]),
        workload("reviews", [10, 1, 0, 2]),
    );
    assert!(
        a1.node
            .workloads
            .apply(Change::Replace(vec![("ratings", &ratings)]))
            .is_empty()
    );
    assert!(
        b1.node
            .workloads
            .apply(Change::Replace(vec![("reviews", &reviews)]))
            .is_empty()
    );
    let ratings_ip = "10.1.0.1".parse().unwrap();
    let reviews_ip = "10.1.0.2".parse().unwrap();
    assert_eq!(
        a1.node.workloads.get(ratings_ip).unwrap().workload_name,
        "ratings"
    );
    assert!(
        a1.node.workloads.get(reviews_ip).is_none(),
        "b's update reached a"
    );
    assert!(
        b1.node.workloads.get(ratings_ip).is_none(),
        "a's update reached b"
    );

    // The next snapshot (an xDS update) reads and writes the same index.
    let a2 = super::compile_with(&a, Arc::default(), Some(&a1), &stats)
        .unwrap()
        .snapshot;
    assert!(Arc::ptr_eq(&a1.node.workloads, &a2.node.workloads));
    assert!(a2.node.workloads.get(ratings_ip).is_some());
}
