//! Istio's standard metrics between two shunt sidecars, each in its own pod with an
//! Istio-shaped static config: the client's outbound HTTP listener (peer metadata
//! headers, `istio.stats`) and outbound TCP listener (`istio.stats`, a cluster with the
//! upstream metadata exchange over mTLS with ALPN `istio-peer-exchange`); the server's
//! inbound listeners (istio_authn, the TCP metadata exchange, `istio.stats`). A known set
//! of requests (200, 404 from the server, 503 when the upstream is down) and TCP
//! connections with known byte counts go through; `/stats/prometheus` on each side must
//! show exactly those counts under the labels Istio writes: reporter=source with the
//! server's workload learned from the peer on the client, reporter=destination with the
//! client's workload and mutual_tls on the server; the client's principals from the
//! upstream mTLS session; request and response sizes as the exact wire bytes the client
//! sent and got; tcp_proxy's UF flag on a TCP connection with no upstream; and a TCP
//! upstream that negotiates `istio-peer-exchange` but never sends the exchange header
//! still carries the payload. Needs root.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use harness::{Node, Pod, shunt_bin, testapp_bin, wait_for_port};
use serde_json::{Value, json};
use support::envoy::socket_address;
use support::pki::Pki;
use support::xds::admin_at;

const CLIENT_ID: &str = "spiffe://cluster.local/ns/client-ns/sa/client";
const SERVER_ID: &str = "spiffe://cluster.local/ns/server-ns/sa/server";
const ADMIN: u16 = 15000;
const HTTP_OUT: u16 = 15001;
const TCP_OUT: u16 = 15002;
const HTTP_IN: u16 = 15006;
const TCP_IN: u16 = 15007;
/// The client's outbound TCP listener to a cluster with no one listening (flag UF).
const TCP_DOWN: u16 = 15003;
/// The client's outbound TCP listener whose upstream negotiates `istio-peer-exchange`
/// but never sends a metadata exchange header: the server's [`SILENT_IN`].
const TCP_SILENT: u16 = 15004;
/// A server listener that offers `istio-peer-exchange` but has no metadata exchange
/// filter, in front of [`SILENT_APP`].
const SILENT_IN: u16 = 15008;
/// An app that says nothing until it has read `PING\n`, then answers `PONG\n`.
const SILENT_APP: u16 = 8082;
const APP_HTTP: u16 = 8080;
const APP_TCP: u16 = 9000;
const SERVICE: &str = "server.server-ns.svc.cluster.local";

fn node(id: &str, name: &str, namespace: &str, app: &str, version: &str) -> Value {
    json!({
        "id": id,
        "cluster": app,
        "metadata": {
            "NAME": format!("{name}-0"),
            "NAMESPACE": namespace,
            "WORKLOAD_NAME": name,
            "OWNER": format!("kubernetes://apis/apps/v1/namespaces/{namespace}/deployments/{name}"),
            "CLUSTER_ID": "Kubernetes",
            "ISTIO_VERSION": "1.27.0",
            "LABELS": {
                "app": app,
                "version": version,
                "service.istio.io/canonical-name": app,
                "service.istio.io/canonical-revision": version
            }
        }
    })
}

fn tls_certificates(pki: &Pki, cert: &str) -> Value {
    json!([{
        "certificate_chain": {"filename": pki.file(&format!("{cert}.pem"))},
        "private_key": {"filename": pki.file(&format!("{cert}.key"))}
    }])
}

fn validation(pki: &Pki, peer: &str) -> Value {
    json!({
        "trusted_ca": {"filename": pki.file("ca.pem")},
        "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": peer}}]
    })
}

fn stats_filter(extra: Value) -> Value {
    let mut config = json!({"@type": "type.googleapis.com/stats.PluginConfig"});
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    json!({"name": "istio.stats", "typed_config": config})
}

fn mx_filter() -> Value {
    json!({"name": "istio.metadata_exchange", "typed_config": {
        "@type": "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange",
        "protocol": "istio-peer-exchange"
    }})
}

fn peer_metadata(fields: Value) -> Value {
    json!({"name": "istio.metadata_exchange", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/io.istio.http.peer_metadata.Config",
        "value": fields
    }})
}

fn hcm(stat_prefix: &str, filters: Vec<Value>, routes: Value) -> Value {
    let mut http_filters = filters;
    http_filters.push(
        json!({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}),
    );
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "http_filters": http_filters,
        "route_config": {"name": stat_prefix, "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]}
    }})
}

fn cluster(name: &str, address: SocketAddr, tls: Option<Value>, extra: Value) -> Value {
    let mut c = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": socket_address(address.ip(), address.port())}}]}]}
    });
    if let Some(tls) = tls {
        c["transport_socket"] = json!({"name": "tls", "typed_config": tls});
    }
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    c
}

/// An outbound TCP listener on 127.0.0.1:`port` with `istio.stats` before `tcp_proxy`.
fn tcp_outbound(name: &str, port: u16, cluster: &str) -> Value {
    json!({
        "name": name,
        "traffic_direction": "OUTBOUND",
        "address": socket_address("127.0.0.1", port),
        "filter_chains": [{"filters": [
            stats_filter(json!({})),
            {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": cluster, "cluster": cluster}}
        ]}]
    })
}

fn client_config(pki: &Pki, server: &Pod) -> Value {
    let upstream_tls = |alpn: Value| {
        json!({
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": alpn,
                "tls_certificates": tls_certificates(pki, "client"),
                "validation_context": validation(pki, SERVER_ID)
            }
        })
    };
    let services = json!({"filter_metadata": {"istio": {"services": [
        {"host": SERVICE, "name": "server", "namespace": "server-ns"}]}}});
    let server_ip = server.ipv4();
    json!({
        "node": node("sidecar~10.0.0.1~client-0.client-ns~client-ns.svc.cluster.local", "client", "client-ns", "client", "v1"),
        "admin": {"address": socket_address("127.0.0.1", ADMIN)},
        "static_resources": {
            "listeners": [
                {
                    "name": "outbound_http",
                    "traffic_direction": "OUTBOUND",
                    "address": socket_address("127.0.0.1", HTTP_OUT),
                    "filter_chains": [{"filters": [hcm("outbound_0.0.0.0_8080", vec![
                        peer_metadata(json!({
                            "upstream_discovery": [{"istio_headers": {}}, {"workload_discovery": {}}],
                            "upstream_propagation": [{"istio_headers": {}}]
                        })),
                        stats_filter(json!({})),
                    ], json!([
                        {"match": {"prefix": "/down"}, "route": {"cluster": "outbound|8080||down"}},
                        {"match": {"prefix": "/"}, "route": {"cluster": "outbound|8080||server"}}
                    ]))]}]
                },
                {
                    "name": "outbound_tcp",
                    "traffic_direction": "OUTBOUND",
                    "address": socket_address("127.0.0.1", TCP_OUT),
                    "filter_chains": [{"filters": [
                        stats_filter(json!({})),
                        {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                            "stat_prefix": "outbound|9000||server", "cluster": "outbound|9000||server"}}
                    ]}]
                },
                tcp_outbound("outbound_tcp_down", TCP_DOWN, "outbound|9000||down"),
                tcp_outbound("outbound_tcp_silent", TCP_SILENT, "outbound|8081||silent")
            ],
            "clusters": [
                cluster("outbound|8080||server", SocketAddr::new(server_ip.into(), HTTP_IN),
                    Some(upstream_tls(json!(["istio-http/1.1"]))), json!({"metadata": services.clone()})),
                cluster("outbound|9000||server", SocketAddr::new(server_ip.into(), TCP_IN),
                    Some(upstream_tls(json!(["istio-peer-exchange", "istio"]))), json!({
                        "metadata": services,
                        "filters": [{"name": "istio.metadata_exchange", "typed_config": {
                            "@type": "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange",
                            "protocol": "istio-peer-exchange"}}]
                    })),
                cluster("outbound|8080||down", SocketAddr::from(([127, 0, 0, 1], 1)), None, json!({})),
                cluster("outbound|9000||down", SocketAddr::from(([127, 0, 0, 1], 1)), None, json!({})),
                cluster("outbound|8081||silent", SocketAddr::new(server_ip.into(), SILENT_IN),
                    Some(upstream_tls(json!(["istio-peer-exchange", "istio"]))), json!({
                        "filters": [{"name": "istio.metadata_exchange", "typed_config": {
                            "@type": "type.googleapis.com/envoy.tcp.metadataexchange.config.MetadataExchange",
                            "protocol": "istio-peer-exchange"}}]
                    }))
            ]
        }
    })
}

fn server_config(pki: &Pki) -> Value {
    let downstream_tls = |alpn: Value| {
        json!({"name": "tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "require_client_certificate": true,
            "common_tls_context": {
                "alpn_protocols": alpn,
                "tls_certificates": tls_certificates(pki, "server"),
                "validation_context": validation(pki, CLIENT_ID)
            }
        }})
    };
    let authn = json!({"name": "istio_authn", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/io.istio.network.authn.Config"}});
    let inbound = |name: &str, port: u16| {
        cluster(
            name,
            SocketAddr::from(([127, 0, 0, 1], port)),
            None,
            json!({
                "metadata": {"filter_metadata": {"istio": {"services": [
                    {"host": SERVICE, "name": "server", "namespace": "server-ns"}]}}}
            }),
        )
    };
    json!({
        "node": node("sidecar~10.0.0.2~server-0.server-ns~server-ns.svc.cluster.local", "server", "server-ns", "server", "v2"),
        "admin": {"address": socket_address("127.0.0.1", ADMIN)},
        "static_resources": {
            "listeners": [
                {
                    "name": "inbound_http",
                    "traffic_direction": "INBOUND",
                    "address": socket_address("0.0.0.0", HTTP_IN),
                    "filter_chains": [{
                        "transport_socket": downstream_tls(json!(["istio-http/1.1", "http/1.1"])),
                        "filters": [authn.clone(), mx_filter(), hcm("inbound_0.0.0.0_8080", vec![
                            peer_metadata(json!({
                                "downstream_discovery": [{"istio_headers": {}}, {"workload_discovery": {}}],
                                "downstream_propagation": [{"istio_headers": {}}]
                            })),
                            stats_filter(json!({})),
                        ], json!([
                            {"match": {"prefix": "/missing"}, "direct_response": {"status": 404}},
                            {"match": {"prefix": "/"}, "route": {"cluster": "inbound|8080||"}}
                        ]))]
                    }]
                },
                {
                    "name": "inbound_tcp",
                    "traffic_direction": "INBOUND",
                    "address": socket_address("0.0.0.0", TCP_IN),
                    "filter_chains": [{
                        "transport_socket": downstream_tls(json!(["istio-peer-exchange", "istio"])),
                        "filters": [authn, mx_filter(), stats_filter(json!({})),
                            {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                                "stat_prefix": "inbound|9000||", "cluster": "inbound|9000||"}}]
                    }]
                },
                {
                    "name": "inbound_silent",
                    "address": socket_address("0.0.0.0", SILENT_IN),
                    "filter_chains": [{
                        "transport_socket": downstream_tls(json!(["istio-peer-exchange", "istio"])),
                        "filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                            "stat_prefix": "inbound|8082||", "cluster": "inbound|8082||"}}]
                    }]
                }
            ],
            "clusters": [inbound("inbound|8080||", APP_HTTP), inbound("inbound|9000||", APP_TCP),
                inbound("inbound|8082||", SILENT_APP)]
        }
    })
}

/// The value of the Prometheus sample `name` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The sum of the Prometheus samples `name` whose labels include every one of `labels`.
fn total(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// What one raw HTTP/1.1 request from inside `pod` carried on the wire.
struct Exchange {
    status: u16,
    /// The request's bytes, head included, and the response's as they arrived.
    sent: usize,
    received: usize,
}

fn exchange(pod: &Pod, port: u16, path: &str) -> Exchange {
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {SERVICE}\r\nUser-Agent: raw\r\nConnection: close\r\n\r\n"
    );
    pod.run_in_netns(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let status = String::from_utf8_lossy(&raw)
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        Exchange {
            status,
            sent: request.len(),
            received: raw.len(),
        }
    })
    .unwrap()
}

/// Sends `n` bytes over a TCP connection from inside `pod`, closes its side, reads all:
/// the bytes received.
fn tcp_exchange(pod: &Pod, port: u16, n: usize) -> u64 {
    pod.run_in_netns(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&vec![b'x'; n]).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        got.len() as u64
    })
    .unwrap()
}

#[test]
fn istio_metrics_between_two_shunt_sidecars_carry_both_workloads() {
    let pki = Pki::new("istio-metrics");
    pki.issue("client", "ca", &format!("URI:{CLIENT_ID}"));
    pki.issue("server", "ca", &format!("URI:{SERVER_ID}"));
    pki.open_to_the_proxy();
    let mut net = Node::new().expect("node");
    let client = net.add_pod("client").expect("pod client");
    let server = net.add_pod("server").expect("pod server");
    let _http_app = server
        .command(testapp_bin())
        .args([
            "serve",
            "--mode",
            "http",
            "--listen",
            &format!("127.0.0.1:{APP_HTTP}"),
        ])
        .spawn()
        .expect("http app");
    let _tcp_app = server
        .command(testapp_bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{APP_TCP}")])
        .spawn()
        .expect("tcp app");
    let start = |pod: &Pod, config: Value, name: &str| {
        let path = pki.dir.0.join(format!("{name}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        pod.command(shunt_bin())
            .args(["proxy", "--concurrency", "1", "-c"])
            .arg(&path)
            .spawn()
            .expect("start shunt")
    };
    // The silent app: reads until `PING\n` (ignoring what comes before), answers, closes.
    let silent = server
        .run_in_netns(|| std::net::TcpListener::bind(("127.0.0.1", SILENT_APP)))
        .unwrap()
        .expect("bind the silent app");
    std::thread::spawn(move || {
        for mut conn in silent.incoming().flatten() {
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            while !seen.windows(5).any(|w| w == b"PING\n") {
                match conn.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            let _ = conn.write_all(b"PONG\n");
        }
    });
    let server_proxy = start(&server, server_config(&pki), "server");
    let client_proxy = start(&client, client_config(&pki, &server), "client");
    for (pod, port, proxy) in [
        (&server, HTTP_IN, &server_proxy),
        (&server, TCP_IN, &server_proxy),
        (&client, HTTP_OUT, &client_proxy),
        (&client, TCP_OUT, &client_proxy),
        (&client, TCP_DOWN, &client_proxy),
        (&client, TCP_SILENT, &client_proxy),
        (&server, SILENT_IN, &server_proxy),
        (&server, APP_TCP, &server_proxy),
    ] {
        wait_for_port(pod, support::local(port), Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("port {port}: {e}\n{}", proxy.stderr_text()));
    }

    let mut statuses = Vec::new();
    // The wire bytes of the 200s, both ways.
    let (mut ok_sent, mut ok_received) = (0, 0);
    for path in ["/a", "/b", "/c", "/missing", "/missing", "/down"] {
        let done = exchange(&client, HTTP_OUT, path);
        if done.status == 200 {
            ok_sent += done.sent;
            ok_received += done.received;
        }
        statuses.push(done.status);
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 404, 404, 503],
        "client: {}\nserver: {}",
        client_proxy.stderr_text(),
        server_proxy.stderr_text()
    );
    let mut received = 0;
    for n in [1000, 2500] {
        let got = tcp_exchange(&client, TCP_OUT, n);
        assert!(got > n as u64, "the echo of {n} bytes came back: {got}");
        received += got;
    }
    // No upstream: the connection is accepted, then closed (reset) without a byte.
    let from_down = client
        .run_in_netns(|| {
            let mut s = TcpStream::connect(("127.0.0.1", TCP_DOWN))?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut got = Vec::new();
            match s.read_to_end(&mut got) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(got.len()),
                other => other.map(|_| got.len()),
            }
        })
        .unwrap();
    assert_eq!(from_down.ok(), Some(0));
    // An upstream that negotiated the exchange but sends no header: the payload goes
    // on without it once the exchange gives up waiting.
    let pong = client
        .run_in_netns(|| {
            let mut s = TcpStream::connect(("127.0.0.1", TCP_SILENT))?;
            s.set_read_timeout(Some(Duration::from_secs(20)))?;
            s.write_all(b"PING\n")?;
            let mut got = String::new();
            s.read_to_string(&mut got).map(|_| got)
        })
        .unwrap();
    assert_eq!(
        pong.ok().as_deref(),
        Some("PONG\n"),
        "client: {}\nserver: {}",
        client_proxy.stderr_text(),
        server_proxy.stderr_text()
    );

    let metrics = |pod: &Pod| admin_at(pod, &format!("127.0.0.1:{ADMIN}"), "/stats/prometheus").1;
    // Connections close after the test's reads: wait for both sides' close reports.
    let closed = |pod: &Pod, reporter: &str| {
        total(
            &metrics(pod),
            "istio_tcp_connections_closed_total",
            &[("reporter", reporter)],
        )
    };
    support::wait_until(
        "both sides report the TCP closes",
        &client_proxy,
        || closed(&client, "source") == 4.0 && closed(&server, "destination") == 2.0,
        || {
            format!(
                "client:\n{}\nserver:\n{}",
                metrics(&client),
                metrics(&server)
            )
        },
    );
    let (c, s) = (metrics(&client), metrics(&server));

    let source = [
        ("reporter", "source"),
        ("source_workload", "client"),
        ("source_workload_namespace", "client-ns"),
        ("source_app", "client"),
        ("source_version", "v1"),
        ("destination_workload", "server"),
        ("destination_workload_namespace", "server-ns"),
        ("destination_app", "server"),
        ("destination_version", "v2"),
        ("destination_service", SERVICE),
        ("destination_service_name", "server"),
    ];
    let destination = [
        ("reporter", "destination"),
        ("source_workload", "client"),
        ("source_workload_namespace", "client-ns"),
        ("source_principal", CLIENT_ID),
        ("source_app", "client"),
        ("source_version", "v1"),
        ("destination_workload", "server"),
        ("destination_workload_namespace", "server-ns"),
        ("destination_principal", SERVER_ID),
        ("destination_app", "server"),
        ("destination_version", "v2"),
        ("destination_service", SERVICE),
        ("connection_security_policy", "mutual_tls"),
    ];
    let with = |base: &[(&'static str, &'static str)], more: &[(&'static str, &'static str)]| {
        let mut all = base.to_vec();
        all.extend_from_slice(more);
        all
    };
    let http = |code| [("request_protocol", "http"), ("response_code", code)];
    // The client's principals come from the upstream mTLS session the request went over.
    let principals = [
        ("source_principal", CLIENT_ID),
        ("destination_principal", SERVER_ID),
    ];
    let source = with(&source, &principals);
    let requests = "istio_requests_total";
    assert_eq!(
        sample(&c, requests, &with(&source, &http("200"))),
        Some(3.0),
        "{c}"
    );
    assert_eq!(
        sample(&c, requests, &with(&source, &http("404"))),
        Some(2.0),
        "{c}"
    );
    // Sizes as istio-proxy counts them: the downstream's wire bytes, heads included.
    assert_eq!(
        sample(&c, "istio_request_bytes_sum", &with(&source, &http("200"))),
        Some(ok_sent as f64),
        "{c}"
    );
    assert_eq!(
        sample(&c, "istio_response_bytes_sum", &with(&source, &http("200"))),
        Some(ok_received as f64),
        "{c}"
    );
    // The down upstream never answered: no peer, the flag UF.
    let down = [
        ("reporter", "source"),
        ("source_workload", "client"),
        ("destination_workload", "unknown"),
        ("response_code", "503"),
        ("response_flags", "UF"),
    ];
    assert_eq!(sample(&c, requests, &down), Some(1.0), "{c}");
    assert_eq!(
        sample(&s, requests, &with(&destination, &http("200"))),
        Some(3.0),
        "{s}"
    );
    assert_eq!(
        sample(&s, requests, &with(&destination, &http("404"))),
        Some(2.0),
        "{s}"
    );
    assert_eq!(
        sample(&s, requests, &[("response_code", "503")]),
        None,
        "{s}"
    );
    assert_eq!(
        sample(
            &s,
            "istio_request_duration_milliseconds_count",
            &with(&destination, &http("200"))
        ),
        Some(3.0),
        "{s}"
    );

    let tcp = [("request_protocol", "tcp")];
    let source_tcp = with(
        &with(&source, &tcp),
        &[("destination_service", SERVICE), ("response_flags", "-")],
    );
    let destination_tcp = with(&with(&destination, &tcp), &[("response_flags", "-")]);
    for (text, labels) in [(&c, &source_tcp), (&s, &destination_tcp)] {
        assert_eq!(
            sample(text, "istio_tcp_connections_opened_total", labels),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            sample(text, "istio_tcp_connections_closed_total", labels),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            sample(text, "istio_tcp_received_bytes_total", labels),
            Some(3500.0),
            "{text}"
        );
        assert_eq!(
            sample(text, "istio_tcp_sent_bytes_total", labels),
            Some(received as f64),
            "{text}"
        );
    }

    // The connection that found no upstream: reported at close, with tcp_proxy's flag.
    let down = [
        ("reporter", "source"),
        ("request_protocol", "tcp"),
        ("destination_workload", "unknown"),
        ("response_flags", "UF"),
    ];
    for metric in [
        "istio_tcp_connections_opened_total",
        "istio_tcp_connections_closed_total",
    ] {
        assert_eq!(sample(&c, metric, &down), Some(1.0), "{metric}\n{c}");
    }
    // The silent upstream: mTLS (its principal is known), but no peer metadata.
    let silent = [
        ("reporter", "source"),
        ("request_protocol", "tcp"),
        ("destination_workload", "unknown"),
        ("destination_principal", SERVER_ID),
        ("source_principal", CLIENT_ID),
        ("response_flags", "-"),
    ];
    assert_eq!(
        sample(&c, "istio_tcp_connections_opened_total", &silent),
        Some(1.0),
        "{c}"
    );
}
