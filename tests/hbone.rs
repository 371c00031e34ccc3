//! HBONE as Istio configures it, against real Envoy 1.40: HTTP/2 CONNECT over mTLS to
//! port 15008, in each direction and between two shunts.
//!
//! Pod a runs the originating proxy: a listener on 10000 whose `tcp_proxy` goes to a
//! cluster with one `envoy_internal_address` endpoint (`connect_originate`, endpoint id
//! and `envoy.filters.listener.original_dst` metadata naming the app in pod b, passed
//! by the `internal_upstream` socket, as istiod writes an ambient workload's endpoint);
//! the internal listener `connect_originate` restores that destination (`original_dst`)
//! and tunnels with `tunneling_config { hostname: "%DOWNSTREAM_LOCAL_ADDRESS%" }` to
//! the ORIGINAL_DST cluster `connect_originate` (`upstream_port_override: 15008`,
//! HTTP/2, mTLS with SPIFFE identities).
//!
//! Pod b runs the terminating proxy (istiod's `connect_terminate`): mTLS on 15008 and
//! an HTTP connection manager whose `connect_matcher` route terminates the CONNECT into
//! the internal listener `main_internal`, where `original_dst` restores the CONNECT's
//! authority (shared by Istio's `connect_authority` filter) and `tcp_proxy` passes
//! through to it: the app, `testapp serve` on 9000.
//!
//! Each case checks the bytes (echoed), where the app saw the connection come to, and
//! the terminator's access log: a CONNECT whose authority is the app's address.
//!
//! Needs root (pods), `openssl`, and Envoy 1.40.

#![recursion_limit = "256"]

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use harness::{Node, Pod, PodProcess, shunt_bin, testapp_bin, wait_for_port};
use serde_json::{Value, json};
use support::envoy::socket_address;
use support::pki::Pki;

const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/client";
const SERVER_ID: &str = "spiffe://cluster.local/ns/default/sa/server";
const APP_PORT: u16 = 9000;
const OUTBOUND_PORT: u16 = 10000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proxy {
    Shunt,
    /// shunt with the originator's listeners and clusters pushed over ADS, as istiod
    /// pushes them.
    ShuntOverAds,
    Envoy,
}

fn internal_listener_extension() -> Value {
    json!([{
        "name": "envoy.bootstrap.internal_listener",
        "typed_config": {
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener"
        }
    }])
}

fn file_access_log(path: &Path) -> Value {
    json!([{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path.display().to_string(),
            "log_format": {"json_format": {
                "method": "%REQ(:METHOD)%",
                "authority": "%REQ(:AUTHORITY)%",
                "response_code": "%RESPONSE_CODE%"
            }}
        }
    }])
}

fn tcp_proxy(stat_prefix: &str, cluster: &str, extra: Value) -> Value {
    let mut config = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": stat_prefix,
        "cluster": cluster
    });
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": config})
}

fn original_dst_filter() -> Value {
    json!([{
        "name": "envoy.filters.listener.original_dst",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}
    }])
}

fn internal_upstream(passthrough: Value) -> Value {
    json!({
        "name": "internal_upstream",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport",
            "passthrough_metadata": passthrough,
            "transport_socket": {
                "name": "raw_buffer",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}
            }
        }
    })
}

/// Istio's common CONNECT TLS context: the workload certificate, the mesh root, h2.
fn common_tls(pki: &Pki, cert: &str, peer_id: &str) -> Value {
    json!({
        "alpn_protocols": ["h2"],
        "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
        "tls_certificates": [{
            "certificate_chain": {"filename": pki.file(&format!("{cert}.pem"))},
            "private_key": {"filename": pki.file(&format!("{cert}.key"))}
        }],
        "validation_context": {
            "trusted_ca": {"filename": pki.file("ca.pem")},
            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": peer_id}}]
        }
    })
}

/// Pod a: the outbound listener and Istio's sidecar `connect_originate` pieces.
fn originator(pki: &Pki, app: SocketAddr, admin: u16) -> Value {
    json!({
        "node": {"id": "sidecar~10.0.0.1~client.default~default.svc.cluster.local", "cluster": "client"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "bootstrap_extensions": internal_listener_extension(),
        "static_resources": {
            "listeners": [{
                "name": "outbound",
                "address": socket_address("0.0.0.0", OUTBOUND_PORT),
                "traffic_direction": "OUTBOUND",
                "filter_chains": [{"filters": [tcp_proxy(
                    "outbound|9000||app.default.svc.cluster.local",
                    "outbound|9000||app.default.svc.cluster.local",
                    json!({}),
                )]}]
            }, {
                "name": "connect_originate",
                "use_original_dst": false,
                "internal_listener": {},
                "listener_filters": original_dst_filter(),
                "filter_chains": [{"filters": [tcp_proxy("connect_originate", "connect_originate", json!({
                    "tunneling_config": {
                        "hostname": "%DOWNSTREAM_LOCAL_ADDRESS%",
                        "headers_to_add": [{
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            "header": {"key": "baggage", "value": "%FILTER_STATE(io.istio.baggage:PLAIN)%"}
                        }]
                    }
                }))]}]
            }],
            "clusters": [{
                "name": "outbound|9000||app.default.svc.cluster.local",
                "type": "STATIC",
                "connect_timeout": "5s",
                "transport_socket_matches": [{
                    "name": "hbone",
                    "match": {"tunnel": "http"},
                    "transport_socket": internal_upstream(json!([
                        {"kind": {"host": {}}, "name": "envoy.filters.listener.original_dst"},
                        {"kind": {"cluster": {}}, "name": "istio"},
                        {"kind": {"host": {}}, "name": "istio"}
                    ]))
                }],
                "load_assignment": {
                    "cluster_name": "outbound|9000||app.default.svc.cluster.local",
                    "endpoints": [{"lb_endpoints": [{
                        "endpoint": {"address": {"envoy_internal_address": {
                            "server_listener_name": "connect_originate",
                            "endpoint_id": app.to_string()
                        }}},
                        "metadata": {"filter_metadata": {
                            "envoy.transport_socket_match": {"tunnel": "http"},
                            "envoy.filters.listener.original_dst": {"local": app.to_string()},
                            "istio": {"workload": "app;default;app;v1;Kubernetes"}
                        }}
                    }]}]
                }
            }, {
                "name": "connect_originate",
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "5s",
                "cleanup_interval": "60s",
                "original_dst_lb_config": {"upstream_port_override": 15008},
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {"allow_connect": true}}
                    }
                },
                "transport_socket": {
                    "name": "tls",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                        "common_tls_context": common_tls(pki, "client", SERVER_ID)
                    }
                }
            }]
        }
    })
}

/// Pod b: istiod's sidecar `connect_terminate` on 15008 and `main_internal`.
fn terminator(pki: &Pki, admin: u16, log: &Path) -> Value {
    let mut config = terminate_tls(pki, admin, log);
    // The same connection manager without TLS on 15009, for HTTP/1.1 CONNECT.
    let mut plain = config["static_resources"]["listeners"][0].clone();
    plain["name"] = json!("connect_plain");
    plain["address"] = socket_address("0.0.0.0", 15009);
    plain["filter_chains"][0]
        .as_object_mut()
        .unwrap()
        .remove("transport_socket");
    plain["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefix"] = json!("connect_plain");
    config["static_resources"]["listeners"]
        .as_array_mut()
        .unwrap()
        .push(plain);
    config
}

fn terminate_tls(pki: &Pki, admin: u16, log: &Path) -> Value {
    json!({
        "node": {"id": "sidecar~10.0.0.2~app.default~default.svc.cluster.local", "cluster": "app"},
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "bootstrap_extensions": internal_listener_extension(),
        "static_resources": {
            "listeners": [{
                "name": "connect_terminate",
                "address": socket_address("0.0.0.0", 15008),
                "filter_chains": [{
                    "name": "default",
                    "transport_socket": {
                        "name": "tls",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                            "require_client_certificate": true,
                            "common_tls_context": common_tls(pki, "server", CLIENT_ID)
                        }
                    },
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "connect_terminate",
                            "use_remote_address": false,
                            "stream_idle_timeout": "0s",
                            "upgrade_configs": [{"upgrade_type": "CONNECT"}],
                            "http2_protocol_options": {"allow_connect": true, "max_concurrent_streams": 100},
                            "access_log": file_access_log(log),
                            "route_config": {"name": "default", "virtual_hosts": [{
                                "name": "default",
                                "domains": ["*"],
                                "routes": [{
                                    "match": {"connect_matcher": {}},
                                    "route": {
                                        "cluster": "main_internal",
                                        "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}]
                                    }
                                }]
                            }]},
                            "http_filters": [{
                                // Istio's connect_authority: the authority becomes
                                // main_internal's destination.
                                "name": "connect_authority",
                                "is_optional": true,
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters.http.set_filter_state.v3.Config",
                                    "on_request_headers": [{
                                        "object_key": "envoy.filters.listener.original_dst.local_ip",
                                        "format_string": {"text_format_source": {"inline_string": "%REQ(:AUTHORITY)%"}},
                                        "shared_with_upstream": "ONCE"
                                    }]
                                }
                            }, {
                                "name": "envoy.filters.http.router",
                                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
                            }]
                        }
                    }]
                }]
            }, {
                "name": "main_internal",
                "internal_listener": {},
                "traffic_direction": "INBOUND",
                "continue_on_listener_filters_timeout": true,
                "listener_filters": original_dst_filter(),
                "filter_chains": [{"filters": [tcp_proxy("inbound", "inbound_passthrough", json!({}))]}]
            }],
            "clusters": [{
                "name": "main_internal",
                "type": "STATIC",
                "connect_timeout": "5s",
                "load_assignment": {"cluster_name": "main_internal", "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"envoy_internal_address": {"server_listener_name": "main_internal"}}}
                }]}]},
                "transport_socket": internal_upstream(json!([]))
            }, {
                "name": "inbound_passthrough",
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "5s"
            }]
        }
    })
}

fn start(proxy: Proxy, pod: &Pod, dir: &Path, name: &str, config: &Value) -> PodProcess {
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(config).unwrap()).unwrap();
    match proxy {
        Proxy::Shunt | Proxy::ShuntOverAds => pod
            .command(shunt_bin())
            .args(["proxy", "--concurrency", "1", "-c"])
            .arg(&path)
            .spawn(),
        Proxy::Envoy => pod
            .command(support::envoy::bin())
            .args([
                "--concurrency",
                "1",
                "--use-dynamic-base-id",
                "-l",
                "warning",
                "-c",
            ])
            .arg(&path)
            .spawn(),
    }
    .unwrap_or_else(|e| panic!("start {proxy:?} {name}: {e}"))
}

/// `{"method","authority"}` of each line the terminator logged, waiting up to 5 s
/// for `want` of them.
fn logged(log: &Path, want: usize) -> Vec<(String, String)> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<(String, String)> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .map(|v| {
                (
                    v["method"].as_str().unwrap_or_default().to_owned(),
                    v["authority"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect();
        if lines.len() >= want || std::time::Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Pods a (originator) and b (terminator and app), running.
struct Scene {
    a: Pod,
    b: Pod,
    app_addr: SocketAddr,
    log: std::path::PathBuf,
    orig: PodProcess,
    term: PodProcess,
    app: Option<PodProcess>,
    _ads: Option<(support::TempDir, harness::ads::AdsServer)>,
    _node: Node,
    _pki: Pki,
}

/// The originator's bootstrap as ADS serves it: the static resources of `config` go to
/// CDS and LDS (versions c1 and l1), the bootstrap keeps the ADS source.
fn over_ads(config: &Value, tag: &str) -> (Value, support::TempDir, harness::ads::AdsServer) {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::listener::v3::Listener;
    use prost::{Message, Name};
    fn any<M: Message + Name + Default>(value: &Value) -> (String, harness::ads::Any) {
        let message: M = shunt::config::message_from_json(value.clone()).expect("valid resource");
        (
            value["name"].as_str().unwrap().to_owned(),
            harness::ads::Any {
                type_url: M::type_url(),
                value: message.encode_to_vec(),
            },
        )
    }
    let (dir, socket, server) = support::xds::unix_server(tag);
    let resources = &config["static_resources"];
    server.set(
        harness::ads::type_urls::CLUSTER,
        "c1",
        resources["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .map(any::<Cluster>)
            .collect(),
    );
    server.set(
        harness::ads::type_urls::LISTENER,
        "l1",
        resources["listeners"]
            .as_array()
            .unwrap()
            .iter()
            .map(any::<Listener>)
            .collect(),
    );
    let mut bootstrap = support::xds::bootstrap(&socket, false);
    bootstrap["bootstrap_extensions"] = internal_listener_extension();
    (bootstrap, dir, server)
}

/// `name` keeps the scratch folders of tests running at the same time apart.
fn scene(name: &str, originating: Proxy, terminating: Proxy) -> Scene {
    let tag = format!("hbone-{name}-{originating:?}-{terminating:?}").to_lowercase();
    let pki = Pki::new(&tag);
    pki.issue("client", "ca", &format!("URI:{CLIENT_ID}"));
    pki.issue("server", "ca", &format!("URI:{SERVER_ID}"));
    let log = pki.dir.0.join("terminate.log");
    std::fs::write(&log, "").unwrap();
    pki.open_to_the_proxy();
    std::fs::set_permissions(&log, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();

    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let app_addr = SocketAddr::new(b.ipv4().into(), APP_PORT);
    let _app = b
        .command(testapp_bin())
        .args(["serve", "--listen", &format!("0.0.0.0:{APP_PORT}")])
        .spawn()
        .expect("start testapp");
    wait_for_port(&b, support::local(APP_PORT), Duration::from_secs(10)).unwrap();

    let dir = &pki.dir.0;
    let term = start(
        terminating,
        &b,
        dir,
        "terminator",
        &terminator(&pki, 15000, &log),
    );
    let mut originator = originator(&pki, app_addr, 15000);
    let mut ads = None;
    if originating == Proxy::ShuntOverAds {
        let (bootstrap, ads_dir, server) = over_ads(&originator, &format!("{tag}-ads"));
        originator = bootstrap;
        ads = Some((ads_dir, server));
    }
    let orig = start(originating, &a, dir, "originator", &originator);
    if let Some((_, server)) = &ads {
        support::xds::eventually("LDS l1 ACKed", &orig, server, || {
            support::xds::acked(server, harness::ads::type_urls::LISTENER, "l1", false, None)
        });
    }
    let waited = |pod: &Pod, port: u16, p: &PodProcess, what: &str| {
        wait_for_port(pod, support::local(port), Duration::from_secs(30)).unwrap_or_else(|e| {
            panic!(
                "{what} did not listen on {port}: {e}\nstdout:\n{}\nstderr:\n{}",
                p.stdout_text(),
                p.stderr_text()
            )
        })
    };
    waited(&b, 15008, &term, "the terminator");
    waited(&a, OUTBOUND_PORT, &orig, "the originator");
    Scene {
        a,
        b,
        app_addr,
        log,
        orig,
        term,
        app: Some(_app),
        _ads: ads,
        _node: node,
        _pki: pki,
    }
}

fn hbone(originating: Proxy, terminating: Proxy) {
    let mut s = scene("tunnel", originating, terminating);
    let (a, b, app_addr, log, orig, term) = (&s.a, &s.b, s.app_addr, &s.log, &s.orig, &s.term);

    // /listeners names the internal listener by its internal address, as Envoy does.
    let (_, listeners) = support::xds::admin_at(a, "127.0.0.1:15000", "/listeners?format=json");
    let listeners: Value = serde_json::from_str(&listeners).expect("/listeners JSON");
    let internal = listeners["listener_statuses"]
        .as_array()
        .and_then(|l| l.iter().find(|l| l["name"] == "connect_originate"))
        .unwrap_or_else(|| panic!("{listeners}"));
    assert_eq!(
        internal["local_address"]["envoy_internal_address"]["server_listener_name"],
        "connect_originate",
        "{listeners}"
    );
    let caller = support::Caller::app(a);
    // Two connections, one after the other: two tunnels.
    for _ in 0..2 {
        let call = caller
            .call(support::local(OUTBOUND_PORT))
            .unwrap_or_else(|e| {
                panic!(
                    "{e}\noriginator stderr:\n{}\nterminator stderr:\n{}",
                    orig.stderr_text(),
                    term.stderr_text()
                )
            });
        assert_eq!(
            call.bytes, caller.bytes as u64,
            "every byte echoed through the tunnel"
        );
        // The app saw the connection come to its own address: the tunnel's destination.
        assert_eq!(call.server_local, app_addr);
        // The terminator passed it through from its own pod.
        assert_eq!(call.server_peer.ip(), std::net::IpAddr::from(b.ipv4()));
    }
    // Envoy writes a CONNECT's line once its stream ends, and in this run it had
    // written only the first one after seconds: every line there is must be a CONNECT
    // to the app, and shunt writes both.
    let want = if terminating == Proxy::Envoy { 1 } else { 2 };
    let lines = logged(log, want);
    let connect = ("CONNECT".to_owned(), app_addr.to_string());
    assert!(
        lines.len() >= want && lines.iter().all(|l| *l == connect),
        "{lines:?}\nterminator stderr:\n{}",
        term.stderr_text()
    );
    // Both tunnels were streams of one pooled HTTP/2 connection over mTLS (Envoy pools
    // per worker: one worker here).
    let connections = support::xds::stat_at(
        b,
        "127.0.0.1:15000",
        "listener.0.0.0.0_15008.downstream_cx_total",
    );
    assert_eq!(connections, Some(1));
    let upgrades = support::xds::stat_at(
        b,
        "127.0.0.1:15000",
        "http.connect_terminate.downstream_cx_upgrades_total",
    );
    assert_eq!(upgrades, Some(2));

    // The app gone, the terminator cannot connect the tunnel, and the originator
    // closes the client's connection: the call fails.
    drop(s.app.take());
    let refused = caller.call_json(support::local(OUTBOUND_PORT));
    assert_eq!(refused["ok"], false, "{refused}");
}

#[test]
fn shunt_originates_hbone_to_envoy() {
    hbone(Proxy::Shunt, Proxy::Envoy);
}

#[test]
fn envoy_originates_hbone_to_shunt() {
    hbone(Proxy::Envoy, Proxy::Shunt);
}

#[test]
fn shunt_gets_its_hbone_config_over_ads() {
    hbone(Proxy::ShuntOverAds, Proxy::Envoy);
}

#[test]
fn shunt_to_shunt_over_hbone() {
    hbone(Proxy::Shunt, Proxy::Shunt);
}

/// The configs themselves, checked against Envoy at both ends.
#[test]
fn envoy_to_envoy_over_hbone() {
    hbone(Proxy::Envoy, Proxy::Envoy);
}

/// Rates through the tunnel, shunt at both ends and Envoy at both ends (numbers for
/// docs/proxy.md; `--ignored --nocapture` prints them).
#[test]
#[ignore]
fn hbone_rates() {
    for proxy in [Proxy::Shunt, Proxy::Envoy] {
        let s = scene("rates", proxy, proxy);
        let target = support::local(OUTBOUND_PORT).to_string();
        for (bench, extra) in [
            ("bench-rr", &["--duration-ms", "3000"][..]),
            (
                "bench-connect",
                &["--duration-ms", "3000", "--concurrency", "4"][..],
            ),
        ] {
            let out =
                s.a.command(testapp_bin())
                    .arg(bench)
                    .arg(&target)
                    .args(extra)
                    .output()
                    .expect("bench");
            println!(
                "{proxy:?} -> {proxy:?} {bench}: {}",
                String::from_utf8_lossy(&out.stdout).trim()
            );
        }
    }
}

/// HTTP/1.1 CONNECT to the same connection manager without TLS: a 200, then the
/// tunnel, from shunt as from Envoy.
#[test]
fn http1_connect_is_terminated_as_envoy_does() {
    use std::io::{Read, Write};
    for terminating in [Proxy::Shunt, Proxy::Envoy] {
        let s = scene("http1", Proxy::Envoy, terminating);
        let app = s.app_addr;
        let (head, tunnel) =
            s.b.run_in_netns(move || {
                let mut stream = std::net::TcpStream::connect(support::local(15009)).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                write!(stream, "CONNECT {app} HTTP/1.1\r\nHost: {app}\r\n\r\n").unwrap();
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    assert_eq!(stream.read(&mut byte).unwrap(), 1, "{head:?}");
                    head.push(byte[0]);
                }
                // The app's greeting, then an echo. (No half-close: Envoy ends an
                // HTTP/1.1 tunnel at the client's FIN.)
                let mut tunnel = Vec::new();
                while !tunnel.ends_with(b"\n") {
                    if stream.read(&mut byte).unwrap_or(0) == 0 {
                        break;
                    }
                    tunnel.push(byte[0]);
                }
                stream.write_all(b"ping").unwrap();
                let mut echo = [0u8; 4];
                let echoed = stream.read_exact(&mut echo).map(|()| echo.to_vec());
                tunnel.extend(echoed.unwrap_or_default());
                (
                    String::from_utf8(head).unwrap(),
                    String::from_utf8_lossy(&tunnel).into_owned(),
                )
            })
            .unwrap();
        assert!(
            head.starts_with("HTTP/1.1 200 "),
            "{terminating:?}: {head:?}\n{}",
            s.term.stderr_text()
        );
        // testapp's greeting names where the connection came: the app's own address.
        assert!(
            tunnel.starts_with("HELLO ") && tunnel.contains(&format!("local={app}")),
            "{terminating:?}: {tunnel:?}"
        );
        assert!(tunnel.ends_with("ping"), "{terminating:?}: {tunnel:?}");
    }
}
