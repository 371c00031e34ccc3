//! `shunt proxy -c bootstrap.yaml` serving a bootstrap's static tcp_proxy listeners, run
//! as a user would: the built binary, real sockets on 127.0.0.1, echo servers as
//! upstreams, and the JSON access log on its stdout. Needs no privileges.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn bytes_arrive_and_round_robin_alternates() {
    let (a, b) = (echo("A"), echo("B"));
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: backends")],
        &[cluster(
            "backends",
            "lb_policy: ROUND_ROBIN, ",
            &[a.addr, b.addr],
        )],
    ));
    let front = shunt.listening("front");
    let served: Vec<String> = (0..6).map(|_| call(front).0.expect("proxied")).collect();
    assert!(served.windows(2).all(|w| w[0] != w[1]), "{served:?}");
    assert_eq!(served.iter().filter(|s| *s == "A").count(), 3);

    let (_, client) = call(front);
    let log = shunt.access_log(client);
    assert_eq!(log["upstream_cluster"], "backends");
    assert_eq!(log["response_flags"], "-");
    assert_eq!(log["direction"], "unspecified");
    assert_eq!(log["bytes_received"], 19);
    assert_eq!(log["bytes_sent"], 2 + 19);
    let upstream: SocketAddr = log["upstream_host"].as_str().unwrap().parse().unwrap();
    assert!(upstream == a.addr || upstream == b.addr);
}

#[test]
fn weighted_clusters_split_by_weight() {
    let (a, b, never) = (echo("A"), echo("B"), echo("never"));
    let weighted = "weighted_clusters: {clusters: [{name: a, weight: 1}, {name: b, weight: 1}, {name: never, weight: 0}]}";
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("split", weighted)],
        &[
            cluster("a", "", &[a.addr]),
            cluster("b", "", &[b.addr]),
            cluster("never", "", &[never.addr]),
        ],
    ));
    let split = shunt.listening("split");
    let mut seen: HashMap<String, u32> = HashMap::new();
    for _ in 0..200 {
        *seen.entry(call(split).0.expect("proxied")).or_default() += 1;
    }
    assert_eq!(seen.get("never"), None, "{seen:?}");
    // Expected 100 each; 50 is over 7 standard deviations away.
    assert!(seen["A"] > 50 && seen["B"] > 50, "{seen:?}");
}

#[test]
fn a_refused_connect_fails_over_to_the_next_host() {
    let a = echo("A");
    let refused = closed_port();
    let mut shunt = Shunt::start(&bootstrap(
        &[
            listener("retrying", "cluster: flaky, max_connect_attempts: 2"),
            listener("once", "cluster: flaky"),
        ],
        &[cluster("flaky", "", &[refused, a.addr])],
    ));
    let retrying = shunt.listening("retrying");
    let once = shunt.listening("once");
    // Round robin offers the refusing host every other time; a second attempt saves it.
    for _ in 0..4 {
        assert_eq!(call(retrying).0.as_deref(), Some("A"));
    }
    // With one attempt, exactly one of two consecutive connections fails (UF).
    let results: Vec<_> = (0..2).map(|_| call(once)).collect();
    let failed: Vec<_> = results
        .iter()
        .filter(|(greeting, _)| greeting.is_none())
        .collect();
    assert_eq!(failed.len(), 1, "{results:?}");
    let log = shunt.access_log(failed[0].1);
    assert_eq!(log["response_flags"], "UF");
    assert_eq!(log["upstream_host"], refused.to_string());
}

#[test]
fn a_connect_timeout_fails_over_to_the_next_host() {
    // A host whose connects hang until the cluster's connect_timeout.
    let (stalled, _filling, _socket) = stalled_upstream();
    let a = echo("A");
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: slow, max_connect_attempts: 2")],
        &[cluster("slow", "", &[stalled, a.addr])
            .replace("connect_timeout: 1s", "connect_timeout: 0.25s")],
    ));
    let front = shunt.listening("front");
    for _ in 0..2 {
        assert_eq!(call(front).0.as_deref(), Some("A"));
    }
}

#[test]
fn the_connection_over_max_connections_is_closed_with_uo() {
    let a = echo("A");
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: small")],
        &[cluster(
            "small",
            "circuit_breakers: {thresholds: [{max_connections: 1}]}, ",
            &[a.addr],
        )],
    ));
    let front = shunt.listening("front");
    let mut first = TcpStream::connect(front).unwrap();
    let mut greeting = [0u8; 2];
    first.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting, b"A\n");

    let (second, client) = call(front);
    assert_eq!(second, None);
    let log = shunt.access_log(client);
    assert_eq!(log["response_flags"], "UO");
    assert_eq!(log["upstream_cluster"], "small");
    assert!(log["upstream_host"].is_null());

    // Once the first closes, there is room again.
    drop(first);
    let deadline = Instant::now() + PATIENCE;
    while call(front).0.is_none() {
        assert!(Instant::now() < deadline, "the slot never came back");
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_black_hole_cluster_closes_at_once_with_uh() {
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: BlackHoleCluster")],
        &["  - {name: BlackHoleCluster, type: STATIC}\n".to_owned()],
    ));
    let front = shunt.listening("front");
    let (greeting, client) = call(front);
    assert_eq!(greeting, None);
    let log = shunt.access_log(client);
    assert_eq!(log["response_flags"], "UH");
    assert_eq!(log["upstream_cluster"], "BlackHoleCluster");
}

#[test]
fn an_idle_connection_is_closed_after_idle_timeout() {
    let a = echo("A");
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: a, idle_timeout: 0.2s")],
        &[cluster("a", "", &[a.addr])],
    ));
    let front = shunt.listening("front");
    let mut stream = TcpStream::connect(front).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut got = Vec::new();
    // The greeting, then EOF once nothing has moved for the idle timeout.
    stream.read_to_end(&mut got).unwrap();
    assert_eq!(got, b"A\n");
    let log = shunt.access_log(stream.local_addr().unwrap());
    assert_eq!(log["bytes_sent"], 2);
}

/// The ClientHello of a real TLS client (rustls) asking for `server_name`.
fn client_hello(server_name: &str) -> Vec<u8> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = rustls::pki_types::ServerName::try_from(server_name.to_owned()).unwrap();
    let mut client = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
    let mut bytes = Vec::new();
    client.write_tls(&mut bytes).unwrap();
    bytes
}

#[test]
fn inspectors_choose_the_chain_and_leave_the_bytes_for_it() {
    let (tls, http, plain) = (echo("tls"), echo("http"), echo("plain"));
    let inspectors = "    listener_filters:\n    \
         - {name: tls, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector}}\n    \
         - {name: http, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.listener.http_inspector.v3.HttpInspector}}\n";
    let chain = |m: &str, cluster: &str| {
        format!(
            "    - filter_chain_match: {m}\n      filters: [{{name: t, typed_config: {{'@type': {TCP_PROXY}, stat_prefix: s, cluster: {cluster}, access_log: [{STDOUT_LOG}]}}}}]\n"
        )
    };
    let listener = format!(
        "  - name: sniffing\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n{inspectors}    filter_chains:\n{}{}{}",
        chain(
            "{server_names: [api.example.com], transport_protocol: tls}",
            "tls"
        ),
        chain("{application_protocols: [http/1.1, h2c]}", "http"),
        chain("{}", "plain"),
    );
    let mut shunt = Shunt::start(&bootstrap(
        &[listener],
        &[
            cluster("tls", "", &[tls.addr]),
            cluster("http", "", &[http.addr]),
            cluster("plain", "", &[plain.addr]),
        ],
    ));
    let front = shunt.listening("sniffing");

    // Each client speaks first; the chain's upstream greets, then echoes what the
    // inspector only peeked at, byte for byte.
    let hello = client_hello("api.example.com");
    let cases: [(&[u8], &str); 3] = [
        (&hello, "tls"),
        (b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n", "http"),
        (b"\x00\x01binary protocol\n", "plain"),
    ];
    for (first_bytes, upstream) in cases {
        let mut stream = TcpStream::connect(front).unwrap();
        stream.set_read_timeout(Some(PATIENCE)).unwrap();
        stream.write_all(first_bytes).unwrap();
        stream.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        stream.read_to_end(&mut got).unwrap();
        let greeting = format!("{upstream}\n");
        assert!(
            got.starts_with(greeting.as_bytes()),
            "{upstream}: {:?}",
            String::from_utf8_lossy(&got)
        );
        assert_eq!(&got[greeting.len()..], first_bytes, "{upstream}");
    }
    // Another SNI is TLS but matches no TLS chain: the catch-all takes it.
    let mut stream = TcpStream::connect(front).unwrap();
    stream
        .write_all(&client_hello("other.example.com"))
        .unwrap();
    let mut greeting = [0u8; 6];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting, b"plain\n");
}

#[test]
fn a_bootstrap_shunt_cannot_serve_fails_at_start_naming_the_path() {
    let mut shunt = Shunt::start(
        "static_resources:\n  listeners:\n  - name: web\n    address: {socket_address: {address: 127.0.0.1, port_value: 0}}\n    \
         filter_chains: [{filters: [{name: hcm, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager, stat_prefix: h, route_config: {}, http_filters: [{name: lua, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua}}, {name: r, typed_config: {'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}]}}]}]\n",
    );
    let status = shunt.wait_exit();
    assert!(!status.success());
    let stderr = shunt.stderr.wait_for("the error", |l| {
        l.contains("HTTP filter \"lua\" (envoy.extensions.filters.http.lua.v3.Lua) is not implemented by shunt")
            .then(|| l.to_owned())
    });
    assert!(
        stderr.contains(
            "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0]"
        ),
        "{stderr}\n{:?}",
        shunt.stderr.snapshot()
    );
}
