//! The admin API of a serving `shunt proxy -c`, asked as curl, Prometheus and pilot-agent
//! would ask: the built binary on ephemeral ports, real connections through its
//! listeners, and every JSON answer read back as its Envoy type through the config
//! module's own descriptors. Counters must move by exactly the connections made.
//! Needs no privileges.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::admin::v3::{
    BootstrapConfigDump, Clusters, ClustersConfigDump, ConfigDump, HostStatus, Listeners,
    ListenersConfigDump,
};
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress};
use envoy_types::pb::envoy::config::listener::v3::Listener;
use prost::{Message, Name};
use prost_reflect::{DescriptorPool, DynamicMessage};
use serde_json::Value;

use common::*;

/// The config module's descriptors: envoy-types' set and the `TypedStruct` Istio's
/// bootstrap carries.
fn pool() -> DescriptorPool {
    let mut pool = DescriptorPool::decode(
        include_bytes!("../crates/config/src/descriptors/envoy-types.desc").as_slice(),
    )
    .unwrap();
    let typed_struct = protox_parse::parse(
        "udpa/type/v1/typed_struct.proto",
        include_str!("../crates/config/src/protos/udpa/type/v1/typed_struct.proto"),
    )
    .unwrap();
    pool.add_file_descriptor_proto(typed_struct).unwrap();
    pool
}

/// Proto3 JSON read strictly as `M`.
fn parse<M: Message + Name + Default>(json: &Value) -> M {
    let pool = pool();
    let descriptor = pool
        .get_message_by_name(&M::full_name())
        .unwrap_or_else(|| panic!("{} not in the pool", M::full_name()));
    let dynamic = DynamicMessage::deserialize(descriptor, json)
        .unwrap_or_else(|err| panic!("not a {}: {err}\n{json:#}", M::full_name()));
    M::decode(dynamic.encode_to_vec().as_slice()).unwrap()
}

fn unpack<M: Message + Name + Default>(any: &envoy_types::pb::google::protobuf::Any) -> M {
    assert_eq!(any.type_url, M::type_url());
    M::decode(any.value.as_slice()).unwrap()
}

fn socket_addr(address: Option<&Address>) -> Option<SocketAddr> {
    let Some(AddressKind::SocketAddress(SocketAddress {
        address,
        port_specifier: Some(PortSpecifier::PortValue(port)),
        ..
    })) = address.and_then(|a| a.address.as_ref())
    else {
        return None;
    };
    Some(SocketAddr::new(
        address.parse().ok()?,
        u16::try_from(*port).ok()?,
    ))
}

/// `/stats?format=json` as name → value (counters and gauges), with the names of the
/// histograms.
fn stats(admin: SocketAddr) -> (BTreeMap<String, u64>, Vec<String>) {
    let json = http(admin, "GET", "/stats?format=json").json();
    let mut values = BTreeMap::new();
    let mut histograms = Vec::new();
    for entry in json["stats"].as_array().unwrap() {
        if let Some(value) = entry["value"].as_u64() {
            values.insert(entry["name"].as_str().unwrap().to_owned(), value);
        }
        for computed in entry["histograms"]["computed_quantiles"]
            .as_array()
            .into_iter()
            .flatten()
        {
            histograms.push(computed["name"].as_str().unwrap().to_owned());
        }
    }
    (values, histograms)
}

/// Waits until the stat `name` reads `value` (gauges settle once connections close).
fn settles(admin: SocketAddr, name: &str, value: u64) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let (stats, _) = stats(admin);
        if stats.get(name) == Some(&value) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{name} stayed at {:?}, not {value}",
            stats.get(name)
        );
        thread::sleep(Duration::from_millis(20));
    }
}

/// A listener on 127.0.0.1:0 with its own listener `stat_prefix` (none if empty), one
/// tcp_proxy chain (`stat_prefix` = name) with `tcp_proxy` (YAML flow mapping body).
fn prefixed_listener(name: &str, stat_prefix: &str, direction: &str, tcp_proxy: &str) -> String {
    let prefix = if stat_prefix.is_empty() {
        String::new()
    } else {
        format!("    stat_prefix: {stat_prefix}\n")
    };
    format!(
        "  - name: {name}\n{prefix}    traffic_direction: {direction}\n    \
         address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
         filter_chains:\n    - filters:\n      - name: envoy.filters.network.tcp_proxy\n        \
         typed_config: {{'@type': {TCP_PROXY}, stat_prefix: {name}, access_log: [{STDOUT_LOG}], {tcp_proxy}}}\n"
    )
}

const ADMIN: &str = "admin: {address: {socket_address: {address: 127.0.0.1, port_value: 0}}}\n";

fn host_stat(host: &HostStatus, name: &str) -> u64 {
    host.stats.iter().find(|s| s.name == name).unwrap().value
}

#[test]
fn counters_move_by_exactly_the_connections_made() {
    let (a, b, c) = (echo("A"), echo("B"), echo("C"));
    let refused = closed_port();
    let (stalled, _filling, _stalled_socket) = stalled_upstream();
    let config = format!(
        "{ADMIN}{}",
        bootstrap(
            &[
                prefixed_listener("front", "front", "OUTBOUND", "cluster: backends"),
                prefixed_listener("plain", "", "OUTBOUND", "cluster: backends"),
                prefixed_listener("broken", "broken", "OUTBOUND", "cluster: refused"),
                prefixed_listener("slow", "slow", "OUTBOUND", "cluster: stalled"),
                prefixed_listener("full", "full", "OUTBOUND", "cluster: small"),
                prefixed_listener("hole", "hole", "OUTBOUND", "cluster: BlackHoleCluster"),
                prefixed_listener(
                    "flaky",
                    "flaky",
                    "OUTBOUND",
                    "cluster: flaky, max_connect_attempts: 2"
                ),
            ],
            &[
                cluster("backends", "", &[a.addr, b.addr]),
                cluster("refused", "", &[refused]),
                cluster("stalled", "", &[stalled])
                    .replace("connect_timeout: 1s", "connect_timeout: 0.25s"),
                cluster(
                    "small",
                    "circuit_breakers: {thresholds: [{max_connections: 0}]}, ",
                    &[a.addr]
                ),
                "  - {name: BlackHoleCluster, type: STATIC}\n".to_owned(),
                cluster(
                    "flaky",
                    "outlier_detection: {consecutive_5xx: 1, base_ejection_time: 300s}, ",
                    &[refused, c.addr]
                ),
            ],
        )
    );
    let mut shunt = Shunt::start(&config);
    let admin = shunt.admin();
    let front = shunt.listening("front");
    let plain = shunt.listening("plain");
    let broken = shunt.listening("broken");
    let slow = shunt.listening("slow");
    let full = shunt.listening("full");
    let hole = shunt.listening("hole");
    let flaky = shunt.listening("flaky");
    wait_ready(admin);

    // One connection held open, then 3 + 2 complete ones to the backends.
    let mut held = TcpStream::connect(front).unwrap();
    let mut greeting = [0u8; 2];
    held.read_exact(&mut greeting).unwrap();
    for _ in 0..3 {
        assert!(call(front).0.is_some());
    }
    for _ in 0..2 {
        assert!(call(plain).0.is_some());
    }
    for proxy in [broken, broken, slow, full, hole] {
        assert_eq!(call(proxy).0, None, "{proxy} should close");
    }
    for _ in 0..2 {
        assert_eq!(call(flaky).0.as_deref(), Some("C"));
    }

    // Byte counts are added as each connection ends, just after the client saw it end.
    // Each flaky call: "C\n" and the 19-byte ping back from C, the ping to it.
    let deadline = Instant::now() + PATIENCE;
    while stats(admin)
        .0
        .get("cluster.flaky.upstream_cx_rx_bytes_total")
        != Some(&42)
    {
        assert!(Instant::now() < deadline, "{:#?}", stats(admin).0);
        std::thread::sleep(Duration::from_millis(20));
    }
    let (stats, histograms) = stats(admin);
    let expected: &[(&str, u64)] = &[
        ("cluster.flaky.upstream_cx_tx_bytes_total", 38),
        ("cluster.flaky.upstream_cx_rx_bytes_total", 42),
        ("listener.front.downstream_cx_total", 4),
        ("listener.front.downstream_cx_active", 1),
        // A listener without stat_prefix is named by its configured address.
        ("listener.127.0.0.1_0.downstream_cx_total", 2),
        ("listener.broken.downstream_cx_total", 2),
        ("tcp.front.downstream_cx_total", 4),
        ("tcp.plain.downstream_cx_total", 2),
        ("cluster.backends.upstream_cx_total", 6),
        ("cluster.backends.upstream_cx_active", 1),
        ("cluster.backends.upstream_cx_connect_fail", 0),
        ("cluster.backends.membership_total", 2),
        ("cluster.backends.membership_healthy", 2),
        ("cluster.refused.upstream_cx_total", 2),
        ("cluster.refused.upstream_cx_connect_fail", 2),
        ("cluster.refused.upstream_cx_connect_timeout", 0),
        ("cluster.stalled.upstream_cx_connect_fail", 1),
        ("cluster.stalled.upstream_cx_connect_timeout", 1),
        ("cluster.small.upstream_cx_overflow", 1),
        ("cluster.small.upstream_cx_total", 0),
        ("cluster.BlackHoleCluster.upstream_cx_none_healthy", 1),
        ("cluster.BlackHoleCluster.upstream_cx_total", 0),
        // The refused host failed once and was ejected; C took both connections.
        ("cluster.flaky.upstream_cx_total", 3),
        ("cluster.flaky.upstream_cx_connect_fail", 1),
        ("cluster.flaky.membership_healthy", 1),
        ("cluster_manager.active_clusters", 6),
        ("listener_manager.total_listeners_active", 7),
        ("server.live", 1),
    ];
    for (name, value) in expected {
        assert_eq!(stats.get(*name), Some(value), "{name}: {stats:#?}");
    }
    for name in [
        "cluster.backends.upstream_cx_connect_ms",
        "cluster.backends.upstream_cx_length_ms",
        "listener.front.downstream_cx_length_ms",
    ] {
        assert!(
            histograms.iter().any(|h| h == name),
            "{name}: {histograms:?}"
        );
    }

    // Per host: the backends' connections add up, the ejected host shows it.
    let clusters: Clusters = parse(&http(admin, "GET", "/clusters?format=json").json());
    let status = |name: &str| {
        clusters
            .cluster_statuses
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no cluster {name}"))
            .clone()
    };
    let backends = status("backends");
    let hosts: Vec<SocketAddr> = backends
        .host_statuses
        .iter()
        .map(|h| socket_addr(h.address.as_ref()).unwrap())
        .collect();
    assert_eq!(hosts, [a.addr, b.addr]);
    let total: u64 = backends
        .host_statuses
        .iter()
        .map(|h| host_stat(h, "cx_total"))
        .sum();
    assert_eq!(total, 6);
    let active: u64 = backends
        .host_statuses
        .iter()
        .map(|h| host_stat(h, "cx_active"))
        .sum();
    assert_eq!(active, 1);
    let flaky_hosts = status("flaky").host_statuses;
    let ejected = flaky_hosts
        .iter()
        .find(|h| socket_addr(h.address.as_ref()) == Some(refused))
        .unwrap();
    assert!(ejected.health_status.unwrap().failed_outlier_check);
    assert_eq!(host_stat(ejected, "cx_connect_fail"), 1);
    assert_eq!(host_stat(ejected, "cx_total"), 1);
    let healthy = flaky_hosts
        .iter()
        .find(|h| socket_addr(h.address.as_ref()) == Some(c.addr))
        .unwrap();
    assert!(!healthy.health_status.unwrap().failed_outlier_check);
    assert_eq!(host_stat(healthy, "cx_total"), 2);
    let text = http(admin, "GET", "/clusters").body;
    assert!(
        text.contains(&format!(
            "flaky::{refused}::health_flags::/failed_outlier_check\n"
        )),
        "{text}"
    );

    // Closing the held connection brings the gauges back to zero.
    held.write_all(b"bye\n").unwrap();
    held.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    held.read_to_end(&mut rest).unwrap();
    drop(held);
    settles(admin, "listener.front.downstream_cx_active", 0);
    settles(admin, "cluster.backends.upstream_cx_active", 0);

    // /listeners shows where each listener really listens.
    let listeners: Listeners = parse(&http(admin, "GET", "/listeners?format=json").json());
    let bound: BTreeMap<String, SocketAddr> = listeners
        .listener_statuses
        .iter()
        .map(|l| {
            (
                l.name.clone(),
                socket_addr(l.local_address.as_ref()).unwrap(),
            )
        })
        .collect();
    assert_eq!(bound["front"], front);
    assert_eq!(bound["flaky"], flaky);
    assert_eq!(bound.len(), 7);

    // /config_dump: the bootstrap and its static listeners and clusters.
    let dump: ConfigDump = parse(&http(admin, "GET", "/config_dump").json());
    let bootstrap: BootstrapConfigDump = unpack(&dump.configs[0]);
    assert_eq!(
        bootstrap
            .bootstrap
            .unwrap()
            .static_resources
            .unwrap()
            .listeners
            .len(),
        7
    );
    let listeners: ListenersConfigDump = dump
        .configs
        .iter()
        .find(|c| c.type_url == ListenersConfigDump::type_url())
        .map(unpack)
        .unwrap();
    let names: Vec<String> = listeners
        .static_listeners
        .iter()
        .map(|l| unpack::<Listener>(l.listener.as_ref().unwrap()).name)
        .collect();
    assert_eq!(
        names,
        ["front", "plain", "broken", "slow", "full", "hole", "flaky"]
    );
    let clusters: ClustersConfigDump = dump
        .configs
        .iter()
        .find(|c| c.type_url == ClustersConfigDump::type_url())
        .map(unpack)
        .unwrap();
    assert_eq!(clusters.static_clusters.len(), 6);

    // /quitquitquit ends the process, successfully.
    let quit = http(admin, "POST", "/quitquitquit");
    assert_eq!((quit.status, quit.body.as_str()), (200, "OK\n"));
    let status = shunt.wait_exit();
    assert!(status.success(), "{status}");
    assert!(TcpStream::connect(front).is_err(), "front still listening");
}

#[test]
fn a_log_level_change_takes_effect() {
    let a = echo("A");
    let mut shunt = Shunt::start(&format!(
        "{ADMIN}{}",
        bootstrap(
            &[listener("front", "cluster: a")],
            &[cluster("a", "", &[a.addr])]
        )
    ));
    let admin = shunt.admin();
    let front = shunt.listening("front");
    let listing = http(admin, "POST", "/logging?level=debug");
    assert_eq!(listing.status, 200, "{}", listing.body);
    assert!(listing.body.contains("default: debug"), "{}", listing.body);
    let (_, client) = call(front);
    // At info, shunt logs nothing per connection; at debug, the chain it chose.
    shunt
        .stderr
        .wait_for("a debug line for the connection", |line| {
            (line.contains("DEBUG") && line.contains("filter chain selected")).then_some(())
        });
    let _ = shunt.access_log(client);
}

#[test]
fn drained_listeners_stop_accepting_and_open_connections_carry_on() {
    let a = echo("A");
    let mut shunt = Shunt::start(&format!(
        "{ADMIN}{}",
        bootstrap(
            &[
                prefixed_listener("in", "in", "INBOUND", "cluster: a"),
                prefixed_listener("out", "out", "OUTBOUND", "cluster: a"),
            ],
            &[cluster("a", "", &[a.addr])]
        )
    ));
    let admin = shunt.admin();
    wait_ready(admin);
    let inbound = shunt.listening("in");
    let outbound = shunt.listening("out");
    let mut open = TcpStream::connect(inbound).unwrap();
    let mut greeting = [0u8; 2];
    open.read_exact(&mut greeting).unwrap();

    let refuses = |addr: SocketAddr| {
        let deadline = Instant::now() + PATIENCE;
        while TcpStream::connect(addr).is_ok() {
            assert!(Instant::now() < deadline, "{addr} still accepts");
            thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(http(admin, "GET", "/drain_listeners").status, 405);
    assert_eq!(
        http(admin, "POST", "/drain_listeners?inboundonly").body,
        "OK\n"
    );
    refuses(inbound);
    assert_eq!(call(outbound).0.as_deref(), Some("A"));
    // The connection accepted before the drain still flows.
    open.write_all(b"still here\n").unwrap();
    let mut echoed = [0u8; 11];
    open.read_exact(&mut echoed).unwrap();
    assert_eq!(&echoed, b"still here\n");

    assert_eq!(http(admin, "POST", "/drain_listeners").body, "OK\n");
    refuses(outbound);
    // The admin API still answers, and the proxy is still running.
    assert_eq!(http(admin, "GET", "/ready").status, 200);
    assert!(shunt.child.try_wait().unwrap().is_none());
}

/// Istio's `default_golden` bootstrap without its `dynamic_resources`, every address on
/// 127.0.0.1:0.
fn istio_static_bootstrap() -> String {
    let golden = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("crates/config/src/testdata/istio-default_golden.json"),
    )
    .unwrap();
    let mut bootstrap: Value = serde_json::from_str(&golden).unwrap();
    bootstrap
        .as_object_mut()
        .unwrap()
        .remove("dynamic_resources");
    let ephemeral = |address: &mut Value| {
        address["socket_address"]["address"] = "127.0.0.1".into();
        address["socket_address"]["port_value"] = 0.into();
    };
    ephemeral(&mut bootstrap["admin"]["address"]);
    for listener in bootstrap["static_resources"]["listeners"]
        .as_array_mut()
        .unwrap()
    {
        ephemeral(&mut listener["address"]);
    }
    bootstrap.to_string()
}

#[test]
fn istios_bootstrap_serves_its_health_ports() {
    let mut shunt = Shunt::start_with(
        "json",
        &istio_static_bootstrap(),
        &[
            "--service-node",
            "sidecar~10.1.1.1~app-1.default~default.svc.cluster.local",
        ],
    );
    let admin = shunt.admin();
    wait_ready(admin);
    let listeners: Listeners = parse(&http(admin, "GET", "/listeners?format=json").json());
    let port = |name: &str| {
        let status = listeners
            .listener_statuses
            .iter()
            .find(|l| l.name == name)
            .unwrap_or_else(|| panic!("no listener {name}: {listeners:?}"));
        let addr = socket_addr(status.local_address.as_ref()).unwrap();
        assert_ne!(addr.port(), 0, "{name} is shown as bound");
        addr
    };
    let (prometheus, health) = (port("0.0.0.0_15090"), port("0.0.0.0_15021"));

    let ready = http(health, "GET", "/healthz/ready");
    assert_eq!(ready.status, 200, "{}", ready.body);
    let scrape = http(prometheus, "GET", "/stats/prometheus");
    assert_eq!(scrape.status, 200);
    assert!(
        scrape
            .body
            .lines()
            .any(|line| line == "envoy_server_live{} 1"),
        "{}",
        scrape.body
    );

    let dump: ConfigDump = parse(&http(admin, "GET", "/config_dump").json());
    let bootstrap: BootstrapConfigDump = unpack(&dump.configs[0]);
    let node = bootstrap.bootstrap.unwrap().node.unwrap();
    assert_eq!(
        node.id,
        "sidecar~10.1.1.1~app-1.default~default.svc.cluster.local"
    );

    // Failing health checks turns the readiness port to 503, as pilot-agent would.
    assert_eq!(http(admin, "POST", "/healthcheck/fail").status, 200);
    assert_eq!(http(health, "GET", "/healthz/ready").status, 503);
    assert_eq!(http(admin, "POST", "/healthcheck/ok").status, 200);
    assert_eq!(http(health, "GET", "/healthz/ready").status, 200);

    assert_eq!(http(admin, "POST", "/quitquitquit").status, 200);
    let status = shunt.wait_exit();
    assert!(status.success(), "{status}");
}
