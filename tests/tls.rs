//! Data-plane TLS with real peers: `shunt proxy -c` in pod p terminates TLS in front of
//! `tcp_proxy` and originates it to upstreams in pod b, with certificates made by the
//! `openssl` CLI for this run (a CA, a server certificate with DNS and SPIFFE URI SANs,
//! a client certificate, and a client certificate from a second CA nobody trusts).
//!
//! Pod b runs `testapp serve` (echo, on 9000) and nginx: plain HTTP on 8080, HTTPS with a
//! required client certificate on 8443. p's listeners:
//! - 8443: TLS from inline files, then `tcp_proxy` to b's echo;
//! - 9443: mTLS required, the certificate and CA named static `secrets`, clients must
//!   carry the SPIFFE identity `.../sa/client`; then `tcp_proxy` to b's plain nginx;
//! - 7000: plain in, TLS with a client certificate out to b's nginx 8443, the server's
//!   SPIFFE URI checked;
//! - 7001: as 7000, but asking for another identity: refused (`UF`, with the reason).
//!
//! Needs root (pods), `openssl`, `curl` and `/usr/sbin/nginx`.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{Node, Pod, PodProcess, testapp_bin, wait_for_port};
use serde_json::{Value, json};
use support::envoy::{http_connection_manager, socket_address, stdout_access_log};
use support::pki::{Pki, SERVER_ID};
use support::xds::{admin_at, stat_at};

const ADMIN: &str = "127.0.0.1:15000";
const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/client";

/// The run's certificates: CAs `ca` and `other-ca`, and `server`, `client` and
/// `stranger` (signed by `other-ca`), readable by the proxy.
fn make_pki(tag: &str) -> Pki {
    let pki = Pki::new(&format!("tls-{tag}"));
    pki.ca("other-ca");
    pki.server("server");
    pki.issue("client", "ca", &format!("URI:{CLIENT_ID}"));
    pki.issue("stranger", "other-ca", &format!("URI:{CLIENT_ID}"));
    pki.open_to_the_proxy();
    pki
}

fn tcp_proxy(stat_prefix: &str, cluster: &str) -> Value {
    json!({
        "name": "envoy.filters.network.tcp_proxy",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": stat_prefix,
            "cluster": cluster,
            "access_log": [stdout_access_log()]
        }
    })
}

/// An `http_connection_manager` routing everything to `cluster`.
fn http_to(stat_prefix: &str, cluster: &str) -> Value {
    http_connection_manager(
        stat_prefix,
        json!({"route_config": {"name": "all", "virtual_hosts": [{"name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster}}]}]}}),
    )
}

fn cluster(name: &str, endpoint: SocketAddr, tls: Option<Value>) -> Value {
    let mut cluster = json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(endpoint.ip(), endpoint.port())}}]}]}
    });
    if let Some(tls) = tls {
        cluster["transport_socket"] =
            json!({"name": "envoy.transport_sockets.tls", "typed_config": tls});
    }
    cluster
}

/// A cluster as Istio writes them: `transport_socket_matches` choose mTLS for endpoints
/// labelled `tlsMode: istio` (`labelled`), raw TCP for the others.
fn istio_cluster(name: &str, endpoint: SocketAddr, labelled: bool, pki: &Pki) -> Value {
    let mut cluster = cluster(name, endpoint, None);
    if labelled {
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["metadata"] =
            json!({"filter_metadata": {"envoy.transport_socket_match": {"tlsMode": "istio"}}});
    }
    cluster["transport_socket_matches"] = json!([
        {"name": "tlsMode-istio", "match": {"tlsMode": "istio"},
         "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": upstream_tls(pki, SERVER_ID)}},
        {"name": "tlsMode-disabled", "match": {},
         "transport_socket": {"name": "envoy.transport_sockets.raw_buffer",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer"}}}
    ]);
    cluster
}

/// As Istio's inbound listener: `tls_inspector` reads the ClientHello and the chain
/// matches TLS for `server.test` before it is terminated.
fn matching_tls_by_sni(mut listener: Value) -> Value {
    listener["listener_filters"] = json!([{
        "name": "envoy.filters.listener.tls_inspector",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}
    }]);
    listener["filter_chains"][0]["filter_chain_match"] =
        json!({"transport_protocol": "tls", "server_names": ["server.test"]});
    listener
}

fn with_handshake_timeout(mut listener: Value, timeout: &str) -> Value {
    listener["filter_chains"][0]["transport_socket_connect_timeout"] = json!(timeout);
    listener
}

fn listener(name: &str, port: u16, tls: Option<Value>, filter: Value) -> Value {
    let mut chain = json!({"filters": [filter]});
    if let Some(tls) = tls {
        chain["transport_socket"] =
            json!({"name": "envoy.transport_sockets.tls", "typed_config": tls});
    }
    json!({
        "name": name,
        "stat_prefix": name,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [chain]
    })
}

/// An `UpstreamTlsContext` to b's nginx: a client certificate, the CA, the server's
/// identity as `server_id`.
fn upstream_tls(pki: &Pki, server_id: &str) -> Value {
    json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "sni": "server.test",
        "common_tls_context": {
            "tls_certificate_sds_secret_configs": [{"name": "client-cert"}],
            "validation_context": {
                "trusted_ca": {"filename": pki.file("ca.pem")},
                "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": {"exact": server_id}}]
            }
        }
    })
}

fn bootstrap(pki: &Pki, b: &Pod) -> Value {
    let tls_from_files = json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["http/1.1"],
            "tls_certificates": [{
                "certificate_chain": {"filename": pki.file("server.pem")},
                "private_key": {"filename": pki.file("server.key")}
            }]
        }
    });
    // Istio's shape: the certificate and the root CA by name, the identity in the
    // combined context's default part.
    let mtls_by_name = json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "require_client_certificate": true,
        "common_tls_context": {
            "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
            "tls_certificate_sds_secret_configs": [{"name": "server-cert"}],
            "combined_validation_context": {
                "default_validation_context": {"match_typed_subject_alt_names": [
                    {"san_type": "URI", "matcher": {"prefix": "spiffe://cluster.local/ns/default/sa/client"}}]},
                "validation_context_sds_secret_config": {"name": "ROOTCA"}
            }
        }
    });
    let https_in = json!({
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificate_sds_secret_configs": [{"name": "server-cert"}]
        }
    });
    let b_at = |port: u16| SocketAddr::new(b.ipv4().into(), port);
    json!({
        "node": {"id": "tls-test", "cluster": "tls-test"},
        "admin": {"address": socket_address("127.0.0.1", 15000)},
        "static_resources": {
            "secrets": [
                {"name": "server-cert", "tls_certificate": {
                    "certificate_chain": {"filename": pki.file("server.pem")},
                    "private_key": {"inline_string": pki.read("server.key")}}},
                {"name": "client-cert", "tls_certificate": {
                    "certificate_chain": {"inline_string": pki.read("client.pem")},
                    "private_key": {"filename": pki.file("client.key")}}},
                {"name": "ROOTCA", "validation_context": {"trusted_ca": {"inline_string": pki.read("ca.pem")}}}
            ],
            "listeners": [
                with_handshake_timeout(
                    listener("tls_echo", 8443, Some(tls_from_files), tcp_proxy("tls_echo", "echo")),
                    "1s",
                ),
                matching_tls_by_sni(listener(
                    "mtls_http",
                    9443,
                    Some(mtls_by_name),
                    tcp_proxy("mtls_http", "nginx_plain"),
                )),
                listener("originate", 7000, None, tcp_proxy("originate", "nginx_tls")),
                listener("wrong_san", 7001, None, tcp_proxy("wrong_san", "nginx_tls_other_id")),
                listener("https", 8444, Some(https_in), http_to("https", "nginx_tls")),
                listener("istio_mtls", 7002, None, tcp_proxy("istio_mtls", "istio_mtls")),
                listener("istio_plain", 7003, None, tcp_proxy("istio_plain", "istio_plain")),
            ],
            "clusters": [
                cluster("echo", b_at(9000), None),
                cluster("nginx_plain", b_at(8080), None),
                cluster("nginx_tls", b_at(8443), Some(upstream_tls(pki, SERVER_ID))),
                cluster("nginx_tls_other_id", b_at(8443),
                    Some(upstream_tls(pki, "spiffe://cluster.local/ns/default/sa/other"))),
                istio_cluster("istio_mtls", b_at(8443), true, pki),
                istio_cluster("istio_plain", b_at(8080), false, pki),
            ]
        }
    })
}

/// nginx in pod b: plain HTTP on 8080; HTTPS on 8443 that requires a client certificate
/// from the CA and names it in the body.
fn start_nginx(b: &Pod, dir: &Path) -> PodProcess {
    let conf = format!(
        "user root;\nworker_processes 1;\npid {dir}/nginx.pid;\nerror_log stderr info;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {dir}/body;\n  proxy_temp_path {dir}/proxy;\n\
           fastcgi_temp_path {dir}/fastcgi;\n  uwsgi_temp_path {dir}/uwsgi;\n  scgi_temp_path {dir}/scgi;\n\
           server {{ listen 8080; location / {{ return 200 \"plain\\n\"; }} }}\n\
           server {{\n    listen 8443 ssl;\n    ssl_certificate {dir}/server.pem;\n    ssl_certificate_key {dir}/server.key;\n\
             ssl_client_certificate {dir}/ca.pem;\n    ssl_verify_client on;\n\
             location / {{ return 200 \"client $ssl_client_s_dn\\n\"; }}\n  }}\n}}\n",
        dir = dir.display()
    );
    std::fs::write(dir.join("nginx.conf"), conf).unwrap();
    let nginx = b
        .command("/usr/sbin/nginx")
        .arg("-p")
        .arg(dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .args(["-g", "daemon off;"])
        .spawn()
        .expect("start nginx");
    for port in [8080, 8443] {
        wait_for_port(
            b,
            SocketAddr::new("127.0.0.1".parse().unwrap(), port),
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| {
            panic!(
                "nginx did not listen on {port}: {e}\n{}",
                nginx.stderr_text()
            )
        });
    }
    nginx
}

struct Scene {
    _node: Node,
    p: Pod,
    pki: Pki,
    proxy: PodProcess,
    _backends: Vec<PodProcess>,
}

fn scene(tag: &str) -> Scene {
    let pki = make_pki(tag);
    let mut node = Node::new().expect("node");
    let p = node.add_pod("p").expect("pod p");
    let b = node.add_pod("b").expect("pod b");
    let echo = b
        .command(testapp_bin())
        .args(["serve", "--listen", "0.0.0.0:9000"])
        .spawn()
        .expect("start testapp");
    wait_for_port(
        &b,
        "127.0.0.1:9000".parse().unwrap(),
        Duration::from_secs(10),
    )
    .unwrap();
    let nginx = start_nginx(&b, &pki.dir.0);
    let proxy = support::xds::start_shunt(
        &p,
        &pki.dir.0.join("bootstrap.json"),
        &bootstrap(&pki, &b),
        &["--concurrency", "2"],
    );
    support::wait_until(
        "ready",
        &proxy,
        || admin_at(&p, ADMIN, "/ready") == (200, "LIVE\n".to_owned()),
        String::new,
    );
    Scene {
        _node: node,
        p,
        pki,
        proxy,
        _backends: vec![echo, nginx],
    }
}

fn stat(pod: &Pod, name: &str) -> Option<u64> {
    stat_at(pod, ADMIN, name)
}

/// A stat once it reaches `want`, or as it is after 5 s.
fn stat_reaching(pod: &Pod, name: &str, want: u64) -> Option<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let value = stat(pod, name);
        if value == Some(want) || Instant::now() > deadline {
            return value;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A rustls client trusting the CA: connects to `port` in pod p, sends `data`,
/// half-closes (close_notify, then FIN) and reads to the end.
fn tls_echo(s: &Scene, port: u16, data: &'static [u8]) -> std::io::Result<Vec<u8>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let mut roots = rustls::RootCertStore::empty();
    let ca = s.pki.read("ca.pem");
    for cert in CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    s.p.run_in_netns(move || {
        let mut tcp = TcpStream::connect(("127.0.0.1", port))?;
        tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
        let name = ServerName::try_from("server.test").unwrap();
        let mut conn = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut tls = rustls::Stream::new(&mut conn, &mut tcp);
        tls.write_all(data)?;
        tls.flush()?;
        tls.conn.send_close_notify();
        tls.flush()?;
        tls.sock.shutdown(std::net::Shutdown::Write)?;
        let mut back = Vec::new();
        tls.read_to_end(&mut back)?;
        Ok(back)
    })
    .expect("entering pod p")
}

/// `curl` in pod p: the HTTP status (0 when no response) and body.
fn curl(s: &Scene, args: &[&str]) -> (u16, String) {
    let out =
        s.p.command("curl")
            .args(["-sS", "--max-time", "10", "-o", "-", "-w", "\n%{http_code}"])
            .args(args)
            .output()
            .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

fn https(s: &Scene, client: Option<&str>) -> (u16, String) {
    let ca = s.pki.file("ca.pem");
    let mut args = vec![
        "--cacert".to_owned(),
        ca,
        "--resolve".to_owned(),
        "server.test:9443:127.0.0.1".to_owned(),
    ];
    if let Some(name) = client {
        args.extend([
            "--cert".to_owned(),
            s.pki.file(&format!("{name}.pem")),
            "--key".to_owned(),
            s.pki.file(&format!("{name}.key")),
        ]);
    }
    args.push("https://server.test:9443/".to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    curl(s, &args)
}

/// Waits for the access log line of a connection through `cluster`.
fn log_line(s: &Scene, cluster: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(line) = harness::access_log(&s.proxy)
            .into_iter()
            .find(|v| v["upstream_cluster"] == cluster)
        {
            return line;
        }
        assert!(
            Instant::now() < deadline,
            "no access log line for {cluster}:\n{}\n{}",
            s.proxy.stdout_text(),
            s.proxy.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn tls_is_terminated_in_front_of_tcp_proxy_and_half_close_passes_through() {
    let s = scene("terminate");
    let back = tls_echo(&s, 8443, b"ping over TLS")
        .unwrap_or_else(|e| panic!("TLS to 8443: {e}\n{}", s.proxy.stderr_text()));
    let text = String::from_utf8_lossy(&back);
    // testapp greets, echoes, and closes only after our half-close reached it.
    assert!(text.starts_with("HELLO peer="), "{text}");
    assert!(text.ends_with("ping over TLS"), "{text}");
    let line = log_line(&s, "echo");
    assert_eq!(line["response_flags"], "-");
    assert_eq!(line["bytes_received"], 13);
    assert_eq!(line["bytes_sent"], back.len() as u64);
    assert_eq!(stat(&s.p, "listener.tls_echo.ssl.handshake"), Some(1));
    assert_eq!(
        stat(&s.p, "listener.tls_echo.ssl.connection_error"),
        Some(0)
    );

    // A client that never starts its handshake is closed after the chain's
    // transport_socket_connect_timeout (1s), not held forever.
    let started = Instant::now();
    let read =
        s.p.run_in_netns(|| -> std::io::Result<usize> {
            let mut tcp = TcpStream::connect("127.0.0.1:8443")?;
            tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
            tcp.read(&mut [0u8; 1])
        })
        .unwrap();
    assert!(
        matches!(read, Ok(0))
            || read
                .as_ref()
                .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "{read:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    // The proxy counts a failed handshake as it closes: the client may look first.
    assert_eq!(
        stat_reaching(&s.p, "listener.tls_echo.ssl.connection_error", 1),
        Some(1)
    );
}

#[test]
fn mutual_tls_needs_a_client_certificate_from_the_trusted_ca() {
    let s = scene("mtls");
    let (status, body) = https(&s, Some("client"));
    assert_eq!(
        (status, body.as_str()),
        (200, "plain\n"),
        "{}",
        s.proxy.stderr_text()
    );

    let (status, _) = https(&s, None);
    assert_eq!(status, 0, "no client certificate must be refused");
    let (status, _) = https(&s, Some("stranger"));
    assert_eq!(status, 0, "a certificate from another CA must be refused");

    assert_eq!(stat(&s.p, "listener.mtls_http.ssl.handshake"), Some(1));
    // The proxy counts a failed handshake as it closes: the client may look first.
    assert_eq!(
        stat_reaching(&s.p, "listener.mtls_http.ssl.connection_error", 2),
        Some(2)
    );
}

/// Plain HTTP to p's `port`; the proxy speaks TLS to nginx. The status and body.
fn http_via(s: &Scene, port: u16) -> (u16, String) {
    curl(
        s,
        &[
            "-H",
            "Connection: close",
            &format!("http://127.0.0.1:{port}/"),
        ],
    )
}

#[test]
fn upstream_tls_presents_the_client_certificate_and_checks_the_servers_identity() {
    let s = scene("originate");
    let (status, body) = http_via(&s, 7000);
    assert_eq!(status, 200, "{body}\n{}", s.proxy.stderr_text());
    // nginx saw the certificate of secret "client-cert".
    assert_eq!(body, "client CN=client\n");
    assert_eq!(stat(&s.p, "cluster.nginx_tls.ssl.handshake"), Some(1));

    // The same server, but the cluster expects another identity: refused.
    let (status, _) = http_via(&s, 7001);
    assert_eq!(status, 0);
    let line = log_line(&s, "nginx_tls_other_id");
    assert_eq!(line["response_flags"], "UF");
    let reason = line["upstream_transport_failure_reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason.contains("no subject alternative name matches") && reason.contains(SERVER_ID),
        "{line}"
    );
    assert_eq!(
        stat(&s.p, "cluster.nginx_tls_other_id.ssl.connection_error"),
        Some(1)
    );

    // Istio's transport socket matches: the labelled endpoint gets mTLS, the other raw.
    assert_eq!(http_via(&s, 7002), (200, "client CN=client\n".to_owned()));
    assert_eq!(http_via(&s, 7003), (200, "plain\n".to_owned()));
    assert_eq!(stat(&s.p, "cluster.istio_mtls.ssl.handshake"), Some(1));
    assert_eq!(stat(&s.p, "cluster.istio_plain.ssl.handshake"), Some(0));
}

#[test]
fn http_is_served_over_tls_both_ways() {
    let s = scene("https");
    // curl speaks HTTP/2 (ALPN h2) to the proxy, which speaks HTTP/1.1 over TLS with the
    // client certificate to nginx.
    let ca = s.pki.file("ca.pem");
    let (status, body) = curl(
        &s,
        &[
            "--cacert",
            &ca,
            "--resolve",
            "server.test:8444:127.0.0.1",
            "https://server.test:8444/",
        ],
    );
    assert_eq!(
        (status, body.as_str()),
        (200, "client CN=client\n"),
        "{}",
        s.proxy.stderr_text()
    );
    assert_eq!(stat(&s.p, "listener.https.ssl.handshake"), Some(1));
    assert_eq!(stat(&s.p, "cluster.nginx_tls.ssl.handshake"), Some(1));
}
