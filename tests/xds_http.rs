//! RDS and SDS end to end: `shunt proxy` in a pod takes HTTP listeners whose routes come
//! over RDS, and TLS listeners whose certificates come over SDS, from the in-process
//! ADS test server ([`harness::ads`]), as an Istio sidecar takes them from istiod and
//! its agent.
//!
//! With real connections: a listener warms (not listening, not ready, shown as
//! `warming_state`) until its routes or secrets arrive; a route update applies to the
//! next request on a keep-alive connection opened before it; a bad route configuration
//! is NACKed and the last good one keeps serving; a certificate rotation applies to new
//! handshakes; secrets can come from their own SDS server (Istio's `sds-grpc` pipe to
//! the agent) while the rest comes over ADS. Needs root.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use harness::ads::resources::{
    self, ads_source, certificate_secret, grpc_source, http_listener, load_assignment, named,
    route_config, tls_tcp_proxy_listener, validation_secret,
};
use harness::ads::{AdsServer, Any, Listen, type_urls};
use harness::{Node, Pod, PodProcess};
use serde_json::Value;
use support::http_client::HttpClient;
use support::pki::Pki;
use support::xds::{
    self, TempDir, admin_at, dump_section, eventually, open_to_the_proxy, pipe_cluster,
    start_shunt, unix_server,
};
use support::*;

const LISTEN_PORT: u16 = 10000;
const BACKEND_A: u16 = 9001;
const BACKEND_B: u16 = 9002;

fn eds_cluster(name: &str) -> (String, Any) {
    named(name, &resources::eds_cluster(name, ads_source(), 1))
}

fn endpoints(name: &str, port: u16) -> (String, Any) {
    named(name, &load_assignment(name, &[local(port)]))
}

fn routes(name: &str, cluster: &str) -> (String, Any) {
    named(name, &route_config(name, &[("/", cluster)]))
}

/// The xDS tests' ADS bootstrap with `extra_clusters` among its static clusters.
fn bootstrap(socket: &Path, delta: bool, extra_clusters: Vec<Value>) -> Value {
    let mut bootstrap = xds::bootstrap(socket, delta);
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .expect("static clusters");
    clusters.extend(extra_clusters);
    bootstrap
}

fn admin(pod: &Pod, path: &str) -> (u16, String) {
    admin_at(pod, xds::ADMIN, path)
}

fn config_dump(pod: &Pod) -> Value {
    xds::config_dump_at(pod, xds::ADMIN)
}

fn acked(server: &AdsServer, type_url: &str, version: &str, delta: bool) -> bool {
    xds::acked(server, type_url, version, delta, None)
}

/// The listener's entry in `dynamic_listeners`.
fn dynamic_listener(pod: &Pod, name: &str) -> Value {
    let listeners = dump_section(&config_dump(pod), "ListenersConfigDump");
    listeners["dynamic_listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["name"] == name)
        .cloned()
        .unwrap_or(Value::Null)
}

fn listens(pod: &Pod, port: u16) -> bool {
    pod.run_in_netns(move || TcpStream::connect(local(port)).is_ok())
        .expect("entering the pod")
}

/// An HTTP/1.1 server in `pod` answering every request with 200 and body `name`,
/// keeping connections open; served from a thread of the test.
fn http_backend(pod: &Pod, port: u16, name: &'static str) {
    let listener = pod
        .run_in_netns(move || TcpListener::bind(local(port)))
        .expect("entering the pod")
        .expect("binding the backend");
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve_http(stream, name));
        }
    });
}

fn serve_http(stream: TcpStream, name: &str) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    loop {
        let mut length = 0usize;
        let mut line = String::new();
        // Request line and headers.
        loop {
            line.clear();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{name}",
            name.len()
        );
        if writer.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
}

/// A pod with the two HTTP backends and shunt taking `bootstrap`.
fn start(tag: &str, bootstrap: &Value) -> (TempDir, Node, Pod, PodProcess) {
    let dir = TempDir::new(tag);
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    http_backend(&pod, BACKEND_A, "a");
    http_backend(&pod, BACKEND_B, "b");
    let proxy = start_shunt(
        &pod,
        &dir.0.join("bootstrap.json"),
        bootstrap,
        &["--concurrency", "2", "--drain-time-s", "1"],
    );
    (dir, node, pod, proxy)
}

fn rds_drives_http_listeners(delta: bool) {
    let (_dir, socket, server) = unix_server(if delta { "rds-delta" } else { "rds-sotw" });
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("a"), eds_cluster("b")],
    );
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![endpoints("a", BACKEND_A), endpoints("b", BACKEND_B)],
    );
    let http = http_listener("http", local(LISTEN_PORT), "routes");
    server.set(type_urls::LISTENER, "l1", vec![named("http", &http)]);
    let (_scratch, _node, pod, proxy) = start(
        if delta {
            "rds-delta-pod"
        } else {
            "rds-sotw-pod"
        },
        &bootstrap(&socket, delta, vec![]),
    );

    // The listener is in, and asks for its routes by name; until they come it warms.
    eventually("the listener ACKed", &proxy, &server, || {
        acked(&server, type_urls::LISTENER, "l1", delta)
    });
    eventually("routes asked for by name", &proxy, &server, || {
        server
            .requests()
            .iter()
            .any(|r| r.type_url == type_urls::ROUTE && r.resource_names == ["routes"])
    });
    let warming = dynamic_listener(&pod, "http");
    assert!(
        warming["warming_state"]["listener"].is_object() && warming["active_state"].is_null(),
        "{warming}"
    );
    assert!(!listens(&pod, LISTEN_PORT), "a warming listener listens");
    assert_ne!(admin(&pod, "/ready").0, 200, "ready while a listener warms");

    // The routes arrive: the listener is active and routes to `a`.
    server.set(type_urls::ROUTE, "r1", vec![routes("routes", "a")]);
    eventually("ready", &proxy, &server, || admin(&pod, "/ready").0 == 200);
    eventually("the routes ACKed", &proxy, &server, || {
        acked(&server, type_urls::ROUTE, "r1", delta)
    });
    let active = dynamic_listener(&pod, "http");
    assert!(
        active["active_state"]["listener"].is_object() && active["warming_state"].is_null(),
        "{active}"
    );
    let mut client = HttpClient::connect(&pod, LISTEN_PORT);
    assert_eq!(client.get("/"), (200, "a".into()));

    // A route update applies to the next request on the same connection.
    server.set(type_urls::ROUTE, "r2", vec![routes("routes", "b")]);
    eventually("r2 ACKed", &proxy, &server, || {
        acked(&server, type_urls::ROUTE, "r2", delta)
    });
    assert_eq!(client.get("/"), (200, "b".into()));
    let dump = dump_section(&config_dump(&pod), "RoutesConfigDump");
    let dynamic = &dump["dynamic_route_configs"][0];
    assert_eq!(dynamic["version_info"], "r2", "{dump}");
    assert_eq!(dynamic["route_config"]["name"], "routes", "{dump}");

    // A route configuration that does not compile is NACKed; the last good one serves.
    let mut bad = route_config("routes", &[("/", "a")]);
    bad.virtual_hosts[0].domains = vec!["*".into(), "*".into()];
    server.set(type_urls::ROUTE, "r3", vec![named("routes", &bad)]);
    let nack = server
        .wait_for(Duration::from_secs(10), |r| {
            r.type_url == type_urls::ROUTE && r.is_nack()
        })
        .unwrap_or_else(|e| panic!("{e}\n{}", proxy.stderr_text()));
    let (_, message) = nack.error_detail.unwrap();
    assert!(
        message.contains("RouteConfiguration \"routes\""),
        "{message}"
    );
    assert_eq!(client.get("/"), (200, "b".into()));
    let dump = dump_section(&config_dump(&pod), "RoutesConfigDump");
    assert!(
        dump["dynamic_route_configs"][0]["error_state"]["details"]
            .as_str()
            .is_some_and(|d| d.contains("routes")),
        "{dump}"
    );
    drop(proxy);
}

#[test]
fn rds_drives_http_listeners_sotw() {
    rds_drives_http_listeners(false);
}

#[test]
fn rds_drives_http_listeners_delta() {
    rds_drives_http_listeners(true);
}

/// A TLS handshake with the listener from inside `pod`, trusting the test CA, sending
/// `hello`: the subject of the certificate the proxy showed, and what came back.
fn tls_call(pod: &Pod, pki: &Pki, client: Option<&str>) -> (String, String) {
    let ca = pki.dir.0.join("ca.pem");
    let client = client.map_or(String::new(), |name| {
        let file = |ext: &str| {
            pki.dir
                .0
                .join(format!("{name}.{ext}"))
                .display()
                .to_string()
        };
        format!("-cert {} -key {}", file("pem"), file("key"))
    });
    let script = format!(
        "(echo hello; sleep 1) | timeout 10 openssl s_client -connect 127.0.0.1:{LISTEN_PORT} \
         -servername server.test -CAfile {ca} -verify_return_error -verify_hostname server.test \
         {client} -showcerts 2>/dev/null",
        ca = ca.display()
    );
    let out = pod
        .command("sh")
        .arg("-c")
        .arg(script)
        .output()
        .expect("openssl s_client");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let subject = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("0 s:"))
        .unwrap_or("")
        .to_owned();
    (subject, text)
}

fn sds_secrets(
    pod: &Pod,
    proxy: &PodProcess,
    server: &AdsServer,
    secrets: &AdsServer,
    pki: &Pki,
    delta: bool,
    mtls: bool,
) {
    // Until `default` (and with mTLS `ROOTCA`) arrive the TLS listener warms.
    let names: &[&str] = if mtls {
        &["ROOTCA", "default"]
    } else {
        &["default"]
    };
    eventually("the secrets asked for by name", proxy, server, || {
        secrets
            .requests()
            .iter()
            .any(|r| r.type_url == type_urls::SECRET && r.resource_names == names)
    });
    let warming = || {
        let listener = dynamic_listener(pod, "tls");
        listener["warming_state"]["listener"].is_object() && listener["active_state"].is_null()
    };
    assert!(warming(), "{}", dynamic_listener(pod, "tls"));
    assert!(!listens(pod, LISTEN_PORT), "a warming listener listens");

    let (chain, key) = pki.server("first");
    let default = named("default", &certificate_secret("default", &chain, &key));
    let mut first = vec![default.clone()];
    let client = mtls.then_some("client");
    if mtls {
        // One of the two is not enough.
        secrets.set(type_urls::SECRET, "s0", first.clone());
        eventually("s0 ACKed", proxy, server, || {
            acked(secrets, type_urls::SECRET, "s0", delta)
        });
        assert!(warming(), "{}", dynamic_listener(pod, "tls"));
        pki.server("client");
        first.push(named(
            "ROOTCA",
            &validation_secret("ROOTCA", &pki.read("ca.pem")),
        ));
    }
    secrets.set(type_urls::SECRET, "s1", first);
    eventually("ready", proxy, server, || admin(pod, "/ready").0 == 200);
    eventually("the secret ACKed", proxy, server, || {
        acked(secrets, type_urls::SECRET, "s1", delta)
    });
    let (subject, text) = tls_call(pod, pki, client);
    assert!(
        subject.contains("CN = first") || subject.contains("CN=first"),
        "{text}\n{}",
        proxy.stderr_text()
    );
    assert!(
        text.contains("HELLO peer="),
        "the echo server's greeting came back: {text}"
    );

    if mtls {
        let (_, text) = tls_call(pod, pki, None);
        assert!(
            !text.contains("HELLO peer="),
            "a client without a certificate got through: {text}"
        );
    }

    // A rotated certificate is shown by the next handshake.
    let (chain, key) = pki.server("second");
    let mut second = vec![named(
        "default",
        &certificate_secret("default", &chain, &key),
    )];
    if mtls {
        second.push(named(
            "ROOTCA",
            &validation_secret("ROOTCA", &pki.read("ca.pem")),
        ));
    }
    secrets.set(type_urls::SECRET, "s2", second);
    eventually("the rotation ACKed", proxy, server, || {
        acked(secrets, type_urls::SECRET, "s2", delta)
    });
    let (subject, text) = tls_call(pod, pki, client);
    assert!(subject.contains("second"), "{text}");
    let dump = dump_section(&config_dump(pod), "SecretsConfigDump");
    let shown: Vec<&Value> = dump["dynamic_active_secrets"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| &s["name"])
        .collect();
    assert_eq!(shown.len(), names.len(), "{dump}");
    assert!(shown.iter().any(|n| **n == "default"), "{dump}");
    // Private keys are never shown.
    assert!(!dump.to_string().contains("PRIVATE KEY"), "{dump}");
}

/// Serves a TLS `tcp_proxy` listener on LISTEN_PORT to an echo server (cluster `echo`),
/// with certificate `default` (and client CA `validation`) from SDS `source`, and starts
/// shunt with `bootstrap` in a fresh pod: the node, the pod, the echo server, shunt.
fn serve_tls(
    server: &AdsServer,
    source: envoy_types::pb::envoy::config::core::v3::ConfigSource,
    validation: Option<&str>,
    config: &Path,
    bootstrap: &Value,
) -> (Node, Pod, PodProcess, PodProcess) {
    server.set(type_urls::CLUSTER, "c1", vec![eds_cluster("echo")]);
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![endpoints("echo", BACKEND_A)],
    );
    let tls = tls_tcp_proxy_listener(
        "tls",
        local(LISTEN_PORT),
        "echo",
        source,
        "default",
        validation,
    );
    server.set(type_urls::LISTENER, "l1", vec![named("tls", &tls)]);
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    let echo = start_app(&pod, &[BACKEND_A]);
    let proxy = start_shunt(&pod, config, bootstrap, &["--concurrency", "2"]);
    (node, pod, echo, proxy)
}

/// Secrets over ADS, as a control plane that serves them itself (`sds_config: ads`).
fn sds_over_ads(delta: bool) {
    let pki = Pki::new(if delta { "pki-delta" } else { "pki-sotw" });
    let (_dir, socket, server) = unix_server(if delta { "sds-delta" } else { "sds-sotw" });
    let (_node, pod, _echo, proxy) = serve_tls(
        &server,
        ads_source(),
        None,
        &_dir.0.join("bootstrap.json"),
        &bootstrap(&socket, delta, vec![]),
    );
    sds_secrets(&pod, &proxy, &server, &server, &pki, delta, false);
}

#[test]
fn sds_over_ads_sotw() {
    sds_over_ads(false);
}

#[test]
fn sds_over_ads_delta() {
    sds_over_ads(true);
}

/// Istio's layout: listeners and clusters from istiod over ADS, secrets (`default` and
/// the `ROOTCA` client certificates are checked against) from the agent's own SDS
/// server through the `sds-grpc` static cluster.
#[test]
fn sds_from_its_own_server_as_istio_agent_serves_it() {
    let pki = Pki::new("pki-istio");
    let (dir, socket, server) = unix_server("sds-istio");
    let sds_socket = dir.0.join("SDS");
    let secrets = AdsServer::start(Listen::Unix(sds_socket.clone())).expect("SDS server");
    open_to_the_proxy(&dir.0, &sds_socket);
    let source = grpc_source("sds-grpc");
    let (_node, pod, _echo, proxy) = serve_tls(
        &server,
        source,
        Some("ROOTCA"),
        &dir.0.join("bootstrap.json"),
        &bootstrap(&socket, true, vec![pipe_cluster("sds-grpc", &sds_socket)]),
    );
    sds_secrets(&pod, &proxy, &server, &secrets, &pki, false, true);
    // The secret came on the agent's stream, not on ADS.
    assert!(secrets.requests().iter().all(|r| !r.is_ads()));
    assert!(
        server
            .requests()
            .iter()
            .all(|r| r.type_url != type_urls::SECRET || r.resource_names.is_empty()),
        "{}",
        xds::describe(&server.requests())
    );
}

/// One proxy of the churn test: its ADS server, listener port and process.
struct Churned {
    server: AdsServer,
    port: u16,
    process: PodProcess,
    delta: bool,
}

impl Churned {
    fn push(&self, type_url: &str, version: &str, resources: Vec<(String, Any)>) {
        self.server.set(type_url, version, resources);
    }

    fn acked(&self, type_url: &str, version: &str) -> bool {
        acked(&self.server, type_url, version, self.delta)
    }

    fn wait_acked(&self, type_url: &str, version: &str) {
        eventually(version, &self.process, &self.server, || {
            self.acked(type_url, version)
        });
    }

    /// The proxy asked for endpoints `name` (its cluster is in, warming).
    fn wait_eds_asked(&self, name: &str) {
        eventually(name, &self.process, &self.server, || {
            self.server.requests().iter().any(|r| {
                r.type_url == type_urls::ENDPOINT && r.resource_names.iter().any(|n| n == name)
            })
        });
    }

    fn get(&self, pod: &Pod) -> (u16, String) {
        HttpClient::connect(pod, self.port).get("/")
    }
}

/// An EDS cluster that waits `wait_s` for its endpoints (`initial_fetch_timeout`).
fn eds_cluster_waiting(name: &str, wait_s: i64) -> (String, Any) {
    let mut cluster = resources::eds_cluster(name, ads_source(), 1);
    if let Some(eds) = cluster
        .eds_cluster_config
        .as_mut()
        .and_then(|c| c.eds_config.as_mut())
    {
        eds.initial_fetch_timeout = Some(envoy_types::pb::google::protobuf::Duration {
            seconds: wait_s,
            nanos: 0,
        });
    }
    named(name, &cluster)
}

#[test]
fn fresh_cluster_names_warm_before_their_ack_as_envoy_sotw() {
    fresh_cluster_names_warm_before_their_ack_as_envoy(false);
}

#[test]
fn fresh_cluster_names_warm_before_their_ack_as_envoy_delta() {
    fresh_cluster_names_warm_before_their_ack_as_envoy(true);
}

/// Clusters under fresh names, as a mesh's Services and subsets come and go, pushed as a
/// control plane does (make before break: the cluster, its CDS ACK, then routes to it).
/// A cluster added over ADS warms until its endpoints come, and the CDS ACK waits for
/// it (Envoy pauses CDS while clusters warm), so routes pushed after the ACK never meet
/// a cluster not yet served; one whose endpoints never come is served empty once its
/// `initial_fetch_timeout` passes, then ACKed. Checked against Envoy 1.40 fed the same
/// pushes: the ACKs and every answer.
fn fresh_cluster_names_warm_before_their_ack_as_envoy(delta: bool) {
    let mode = if delta { "delta" } else { "sotw" };
    let dir = TempDir::new(&format!("churn-{mode}"));
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    http_backend(&pod, BACKEND_A, "a");
    http_backend(&pod, BACKEND_B, "b");
    let start = |tag: &str, port: u16, admin: u16| {
        let (scratch, socket, server) = unix_server(&format!("{tag}-{mode}"));
        let mut bootstrap = bootstrap(&socket, delta, vec![]);
        bootstrap["admin"]["address"]["socket_address"]["port_value"] = admin.into();
        server.set(type_urls::CLUSTER, "c0", vec![eds_cluster("a")]);
        server.set(type_urls::ENDPOINT, "e0", vec![endpoints("a", BACKEND_A)]);
        let http = http_listener("http", local(port), "routes");
        server.set(type_urls::LISTENER, "l0", vec![named("http", &http)]);
        server.set(type_urls::ROUTE, "r0", vec![routes("routes", "a")]);
        let path = dir.0.join(format!("{tag}.json"));
        std::fs::write(&path, serde_json::to_vec(&bootstrap).unwrap()).unwrap();
        (scratch, path, server)
    };
    let (_s1, shunt_config, shunt_server) = start("churn-shunt", LISTEN_PORT, 15000);
    let (_s2, envoy_config, envoy_server) = start("churn-envoy", LISTEN_PORT + 1, 15001);
    // Istio's drain time is 45 s; removed listeners drain for 1 s here.
    let (shunt, envoy) = envoy::start_side_by_side_with(
        &pod,
        &shunt_config,
        &envoy_config,
        [LISTEN_PORT, LISTEN_PORT + 1],
        &["--drain-time-s", "1"],
    );
    let proxies = [
        Churned {
            server: shunt_server,
            port: LISTEN_PORT,
            process: shunt,
            delta,
        },
        Churned {
            server: envoy_server,
            port: LISTEN_PORT + 1,
            process: envoy,
            delta,
        },
    ];
    let answers = |what: &str| {
        let [s, e] = [proxies[0].get(&pod), proxies[1].get(&pod)];
        assert_eq!(s, e, "{what}: shunt answered {s:?}, Envoy {e:?}");
        s
    };
    for n in 1..=3 {
        let c = format!("c-{n}");
        let v = |t: &str| format!("{t}{n}");
        for p in &proxies {
            p.push(
                type_urls::CLUSTER,
                &v("c"),
                vec![eds_cluster("a"), eds_cluster(&c)],
            );
        }
        for p in &proxies {
            p.wait_eds_asked(&c);
        }
        // Asked for its endpoints, the cluster warms: no ACK yet from either.
        std::thread::sleep(Duration::from_millis(500));
        let held: Vec<bool> = proxies
            .iter()
            .map(|p| !p.acked(type_urls::CLUSTER, &v("c")))
            .collect();
        assert_eq!(
            held,
            [true, true],
            "round {n}: CDS ACK held while {c} warms (shunt, Envoy)"
        );
        assert_eq!(answers("while it warms"), (200, "a".into()));
        for p in &proxies {
            p.push(
                type_urls::ENDPOINT,
                &v("e"),
                vec![endpoints("a", BACKEND_A), endpoints(&c, BACKEND_B)],
            );
        }
        for p in &proxies {
            p.wait_acked(type_urls::CLUSTER, &v("c"));
            p.push(type_urls::ROUTE, &v("r"), vec![routes("routes", &c)]);
        }
        for p in &proxies {
            p.wait_acked(type_urls::ROUTE, &v("r"));
        }
        assert_eq!(answers("routed to it"), (200, "b".into()), "round {n}");
        // A listener and its route config under fresh names come and go too.
        let churn = format!("churn-{n}");
        for p in &proxies {
            let at = local(p.port + 10);
            p.push(
                type_urls::ROUTE,
                &v("rl"),
                vec![routes("routes", &c), routes(&churn, &c)],
            );
            p.push(
                type_urls::LISTENER,
                &v("l"),
                vec![
                    named("http", &http_listener("http", local(p.port), "routes")),
                    named(&churn, &http_listener(&churn, at, &churn)),
                ],
            );
        }
        for p in &proxies {
            p.wait_acked(type_urls::LISTENER, &v("l"));
            p.wait_acked(type_urls::ROUTE, &v("rl"));
        }
        for p in &proxies {
            let got = HttpClient::connect(&pod, p.port + 10).get("/");
            assert_eq!(got, (200, "b".into()), "round {n}: through {churn}");
        }
        for p in &proxies {
            p.push(
                type_urls::LISTENER,
                &v("lr"),
                vec![named(
                    "http",
                    &http_listener("http", local(p.port), "routes"),
                )],
            );
        }
        for p in &proxies {
            p.wait_acked(type_urls::LISTENER, &v("lr"));
        }
        for p in &proxies {
            p.push(type_urls::ROUTE, &v("ra"), vec![routes("routes", "a")]);
        }
        for p in &proxies {
            p.wait_acked(type_urls::ROUTE, &v("ra"));
            p.push(type_urls::CLUSTER, &v("cr"), vec![eds_cluster("a")]);
        }
        for p in &proxies {
            p.wait_acked(type_urls::CLUSTER, &v("cr"));
        }
        assert_eq!(
            answers("routed away, removed"),
            (200, "a".into()),
            "round {n}"
        );
    }
    // What the removed clusters and listeners counted went with them (once drained), in
    // both.
    for (p, admin) in proxies.iter().zip([15000, 15001]) {
        let left = || {
            let (_, stats) = xds::admin_at(&pod, &format!("127.0.0.1:{admin}"), "/stats");
            stats
                .lines()
                .filter(|l| {
                    l.contains("churn")
                        || ["c-1", "c-2", "c-3"]
                            .iter()
                            .any(|c| l.contains(&format!("cluster.{c}.")))
                })
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        eventually(
            "the removed clusters' stats freed",
            &p.process,
            &p.server,
            || left().is_empty(),
        );
    }
    // Endpoints that never come: served empty after its wait, then ACKed.
    for p in &proxies {
        p.push(
            type_urls::CLUSTER,
            "c-empty",
            vec![eds_cluster("a"), eds_cluster_waiting("empty", 1)],
        );
    }
    for p in &proxies {
        p.wait_acked(type_urls::CLUSTER, "c-empty");
        p.push(type_urls::ROUTE, "r-empty", vec![routes("routes", "empty")]);
    }
    for p in &proxies {
        p.wait_acked(type_urls::ROUTE, "r-empty");
    }
    let (status, body) = answers("routed to a cluster without endpoints");
    assert_eq!((status, body.as_str()), (503, "no healthy upstream"));
}
