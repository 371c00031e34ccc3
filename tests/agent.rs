//! `shunt agent` in a pod, as the istio-proxy container's PID 1: readiness on 15021 and
//! 15020 follows the proxy (503 before the first xDS push, 200 after) and `shunt agent
//! wait` blocks until then; the kubelet's rewritten probes reach an app's HTTP, TCP and
//! gRPC health endpoints with pilot-agent's answers; the merged Prometheus endpoint has
//! the agent's, the proxy's and the app's metrics; SIGTERM keeps an in-flight transfer
//! alive while new inbound connections are refused; `/quitquitquit` exits; `--proxy
//! envoy` supervises a real Envoy 1.40 (killed: restarted; SIGTERM: drained and
//! stopped); and `shunt proxy` runs with exactly pilot-agent's Envoy command line.
//! Needs root.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{Node, Pod, PodProcess, shunt_bin};
use serde_json::{Value, json};
use support::TempDir;
use support::xds::{self, bootstrap, eds_cluster, unix_server};

const STATUS: u16 = 15020;
const READINESS: u16 = 15021;
const ADMIN: &str = "127.0.0.1:15000";
const APP_HTTP: u16 = 8080;
const APP_TCP: u16 = 8081;
const APP_TCP_DOWN: u16 = 8082;
const APP_GRPC: u16 = 8083;
const APP_HTTPS: u16 = 8443;
const INBOUND: u16 = 15006;
const OUTBOUND: u16 = 15001;
const SLOW_APP: u16 = 9090;
const ECHO: u16 = 9001;

/// One HTTP/1.1 request in the pod: status and body (0 if nothing answered).
fn http(pod: &Pod, to: SocketAddr, method: &str, path: &str, host: &str) -> (u16, String) {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    pod.run_in_netns(move || -> std::io::Result<(u16, String)> {
        let mut stream = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(15)))?;
        stream.write_all(request.as_bytes())?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        Ok((status, body.to_owned()))
    })
    .expect("entering the pod")
    .unwrap_or((0, String::new()))
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn status(pod: &Pod, path: &str) -> (u16, String) {
    http(pod, local(STATUS), "GET", path, "localhost")
}

fn wait_for(what: &str, agent: &PodProcess, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !check() {
        assert!(
            agent.try_wait().is_none(),
            "agent exited while waiting for {what}:\n{}",
            agent.stderr_text()
        );
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{}",
            agent.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn start_agent(pod: &Pod, config: &Path, env: &[(&str, String)], flags: &[&str]) -> PodProcess {
    let mut command = pod
        .command(shunt_bin())
        .arg("agent")
        .arg("-c")
        .arg(config)
        .args(flags)
        .env("INSTANCE_IP", pod.ipv4().to_string());
    for (key, value) in env {
        command = command.env(key, value);
    }
    command.spawn().expect("start shunt agent")
}

/// A bootstrap with the admin API on 15000 and these static listeners.
fn static_bootstrap(listeners: Vec<Value>, clusters: Vec<Value>) -> Value {
    json!({
        "node": {"id": "sidecar~10.0.0.1~p.default~default.svc.cluster.local", "cluster": "p.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {"listeners": listeners, "clusters": clusters}
    })
}

fn tcp_listener_json(name: &str, port: u16, cluster: &str, direction: &str) -> Value {
    json!({
        "name": name,
        "traffic_direction": direction,
        "address": support::envoy::socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.tcp_proxy", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": name, "cluster": cluster}}]}]
    })
}

fn static_cluster(name: &str, port: u16) -> Value {
    json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": support::envoy::socket_address("127.0.0.1", port)}}]}]}
    })
}

fn write_json(path: &Path, value: &Value) {
    std::fs::write(path, serde_json::to_vec_pretty(value).unwrap()).unwrap();
}

#[test]
fn readiness_follows_the_first_xds_push_and_wait_blocks_until_then() {
    let (dir, socket, server) = unix_server("agent-ready");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("ready").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    let config = dir.0.join("bootstrap.json");
    write_json(&config, &bootstrap(&socket, false));
    let agent = start_agent(&pod, &config, &[], &[]);
    let waiter = pod
        .command(shunt_bin())
        .args([
            "agent",
            "wait",
            "--timeout-seconds",
            "60",
            "--period-millis",
            "100",
        ])
        .spawn()
        .expect("start shunt agent wait");

    // Before any config: both readiness ports answer 503, and `wait` keeps waiting.
    wait_for("the status server", &agent, || {
        status(&pod, "/healthz/ready").0 != 0
    });
    assert_eq!(status(&pod, "/healthz/ready").0, 503);
    assert_eq!(
        http(&pod, local(READINESS), "GET", "/healthz/ready", "localhost").0,
        503
    );
    let short = pod
        .command(shunt_bin())
        .args([
            "agent",
            "wait",
            "--timeout-seconds",
            "1",
            "--period-millis",
            "100",
        ])
        .output()
        .unwrap();
    assert!(
        !short.status.success(),
        "wait must fail on timeout while not ready"
    );
    assert!(
        String::from_utf8_lossy(&short.stderr).contains("503"),
        "{short:?}"
    );
    assert!(
        waiter.try_wait().is_none(),
        "wait returned before the proxy was ready"
    );

    // The first push: listeners and clusters applied and bound, so ready.
    xds::serve_backend(&server, eds_cluster("backend", 1), ECHO, 10000);
    wait_for("readiness", &agent, || {
        http(&pod, local(READINESS), "GET", "/healthz/ready", "localhost").0 == 200
    });
    assert_eq!(status(&pod, "/healthz/ready").0, 200);
    assert!(
        xds::reaches(&pod, local(10000)).is_some(),
        "the pushed listener serves"
    );
    let mut waiter = waiter;
    let exit = waiter.wait_timeout(Duration::from_secs(10)).unwrap();
    assert!(exit.success(), "wait: {}", waiter.stderr_text());
    // The status server listens on IPv6 too, as pilot-agent's `:15020`.
    let v6 = pod
        .command(shunt_bin())
        .args(["agent", "wait", "--timeout-seconds", "5"])
        .args(["--url", "http://[::1]:15020/healthz/ready"])
        .output()
        .unwrap();
    assert!(v6.status.success(), "{v6:?}");
    drop(server);
}

/// A small HTTP app: `/healthz` (200 or 503 as `healthy` says), `/metrics`, `/moved`
/// (a redirect off the pod), `/loop` (a redirect to itself), `/slow` (3 s); it records
/// each request's Host header and peer address.
struct HttpApp {
    healthy: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(String, SocketAddr)>>>,
}

fn start_http_app(pod: &Pod, port: u16) -> HttpApp {
    let listener = pod
        .run_in_netns(move || TcpListener::bind(("0.0.0.0", port)))
        .unwrap()
        .unwrap();
    let healthy = Arc::new(AtomicBool::new(true));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = HttpApp {
        healthy: healthy.clone(),
        seen: seen.clone(),
    };
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let healthy = healthy.clone();
            let seen = seen.clone();
            std::thread::spawn(move || {
                let peer = stream.peer_addr().unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap_or_default();
                let path = line.split(' ').nth(1).unwrap_or("").to_owned();
                let mut host = String::new();
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                        break;
                    }
                    if let Some((name, value)) = header.split_once(':')
                        && name.eq_ignore_ascii_case("host")
                    {
                        host = value.trim().to_owned();
                    }
                }
                seen.lock().unwrap().push((host, peer));
                let (status, extra, body) = match path.as_str() {
                    "/healthz" if healthy.load(Ordering::SeqCst) => ("200 OK", "", "ok"),
                    "/healthz" => ("503 Service Unavailable", "", "app is sick"),
                    "/metrics" => (
                        "200 OK",
                        "",
                        "# TYPE app_requests_total counter\napp_requests_total 7\n",
                    ),
                    "/moved" => ("302 Found", "Location: http://example.com/\r\n", ""),
                    "/loop" => ("302 Found", "Location: /loop\r\n", ""),
                    "/slow" => {
                        std::thread::sleep(Duration::from_secs(3));
                        ("200 OK", "", "late")
                    }
                    _ => ("404 Not Found", "", ""),
                };
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    app
}

/// A gRPC health server (grpc.health.v1) with service "web" SERVING and "down" NOT_SERVING.
fn start_grpc_health(pod: &Pod, port: u16) -> tokio::runtime::Runtime {
    let listener = pod
        .run_in_netns(move || TcpListener::bind(("0.0.0.0", port)))
        .unwrap()
        .unwrap();
    listener.set_nonblocking(true).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.spawn(async move {
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("web", tonic_health::ServingStatus::Serving)
            .await;
        reporter
            .set_service_status("down", tonic_health::ServingStatus::NotServing)
            .await;
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(
            tokio::net::TcpListener::from_std(listener).unwrap(),
        );
        tonic::transport::Server::builder()
            .serve_with_incoming(service, incoming)
            .await
            .unwrap();
    });
    runtime
}

#[test]
fn rewritten_probes_reach_the_apps_http_tcp_and_grpc_health() {
    let dir = TempDir::new("agent-probes");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("probes").unwrap();
    let app = start_http_app(&pod, APP_HTTP);
    let _tcp = pod
        .run_in_netns(|| TcpListener::bind(("0.0.0.0", APP_TCP)))
        .unwrap()
        .unwrap();
    let _grpc = start_grpc_health(&pod, APP_GRPC);
    // HTTPS: openssl's test server, whose certificate no probe could verify.
    let pki = support::pki::Pki::new("agent-probes-pki");
    pki.server("app");
    let _https = pod
        .command("openssl")
        .args([
            "s_server",
            "-4",
            "-quiet",
            "-www",
            "-accept",
            &APP_HTTPS.to_string(),
        ])
        .args(["-cert", &pki.file("app.pem"), "-key", &pki.file("app.key")])
        .spawn()
        .unwrap();
    harness::wait_for_port(&pod, local(APP_HTTPS), Duration::from_secs(10)).unwrap();
    let probers = json!({
        "/app-health/web/livez": {"httpGet": {"path": "/healthz", "port": APP_HTTP, "scheme": "HTTP"}, "timeoutSeconds": 2},
        "/app-health/web/startupz": {"httpGet": {"path": "/moved", "port": APP_HTTP}},
        "/app-health/loop/livez": {"httpGet": {"path": "/loop", "port": APP_HTTP}, "timeoutSeconds": 5},
        "/app-health/slow/livez": {"httpGet": {"path": "/slow", "port": APP_HTTP}, "timeoutSeconds": 1},
        "/app-health/tls/livez": {"httpGet": {"path": "/", "port": APP_HTTPS, "scheme": "HTTPS"}, "timeoutSeconds": 3},
        "/app-health/web/readyz": {"tcpSocket": {"port": APP_TCP}, "timeoutSeconds": 1},
        "/app-health/down/readyz": {"tcpSocket": {"port": APP_TCP_DOWN}, "timeoutSeconds": 1},
        "/app-health/grpc/livez": {"grpc": {"port": APP_GRPC, "service": "web"}, "timeoutSeconds": 2},
        "/app-health/grpc/readyz": {"grpc": {"port": APP_GRPC, "service": "down"}, "timeoutSeconds": 2},
        "/app-health/nogrpc/livez": {"grpc": {"port": APP_TCP_DOWN}, "timeoutSeconds": 1},
    });
    let config = dir.0.join("bootstrap.json");
    // Not Istio's 15000: the agent finds the admin API where the bootstrap puts it.
    let mut bootstrap = static_bootstrap(vec![], vec![]);
    bootstrap["admin"]["address"]["socket_address"]["port_value"] = json!(15100);
    write_json(&config, &bootstrap);
    let agent = start_agent(
        &pod,
        &config,
        &[
            ("ISTIO_KUBE_APP_PROBERS", probers.to_string()),
            (
                "ISTIO_PROMETHEUS_ANNOTATIONS",
                json!({"scrape": "true", "port": APP_HTTP.to_string(), "path": "/metrics"})
                    .to_string(),
            ),
        ],
        &[],
    );
    wait_for("ready", &agent, || status(&pod, "/healthz/ready").0 == 200);
    let pod_status = SocketAddr::new(pod.ipv4().into(), STATUS);
    let kubelet = |path: &str| {
        http(
            &pod,
            pod_status,
            "GET",
            path,
            &format!("{}:{STATUS}", pod.ipv4()),
        )
    };

    // httpGet: the app's status and body; the kubelet's Host with the app's port; from 127.0.0.6.
    assert_eq!(kubelet("/app-health/web/livez"), (200, "ok".into()));
    let (host, peer) = app.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(host, format!("{}:{APP_HTTP}", pod.ipv4()));
    assert_eq!(peer.ip().to_string(), "127.0.0.6");
    app.healthy.store(false, Ordering::SeqCst);
    assert_eq!(
        kubelet("/app-health/web/livez"),
        (503, "app is sick".into())
    );
    app.healthy.store(true, Ordering::SeqCst);
    // A redirect off the app's host is success; one that never ends, or no answer in time, is 500.
    assert_eq!(kubelet("/app-health/web/startupz").0, 200);
    assert_eq!(kubelet("/app-health/loop/livez").0, 500);
    assert_eq!(kubelet("/app-health/slow/livez").0, 500);
    // HTTPS without verification (openssl's -www page), as the kubelet probes.
    let (code, body) = kubelet("/app-health/tls/livez");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("s_server"), "{body}");
    // tcpSocket: a connection or 500.
    assert_eq!(kubelet("/app-health/web/readyz").0, 200);
    assert_eq!(kubelet("/app-health/down/readyz").0, 500);
    // grpc: SERVING is 200; NOT_SERVING or nothing listening is 500.
    assert_eq!(kubelet("/app-health/grpc/livez").0, 200);
    assert_eq!(kubelet("/app-health/grpc/readyz").0, 500);
    assert_eq!(kubelet("/app-health/nogrpc/livez").0, 500);
    // A probe the injector did not write.
    let (code, body) = kubelet("/app-health/other/livez");
    assert_eq!(code, 400);
    assert!(body.contains("/app-health/other/livez"), "{body}");

    // Merged Prometheus: the agent's, the proxy's and the app's metrics in one answer.
    let (code, metrics) = status(&pod, "/stats/prometheus");
    assert_eq!(code, 200);
    assert!(
        metrics.contains("\nistio_agent_scrapes_total 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains("envoy_server_live"), "{metrics}");
    assert!(metrics.contains("\napp_requests_total 7\n"), "{metrics}");

    // /quitquitquit: POST from localhost only; the agent exits 0.
    assert_eq!(status(&pod, "/quitquitquit").0, 405);
    assert_eq!(kubelet_post(&pod, pod_status, "/quitquitquit"), 403);
    assert_eq!(
        http(&pod, local(STATUS), "POST", "/quitquitquit", "localhost").0,
        200
    );
    let mut agent = agent;
    let exit = agent.wait_timeout(Duration::from_secs(10)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
}

/// A POST from the pod's own address (not loopback).
fn kubelet_post(pod: &Pod, to: SocketAddr, path: &str) -> u16 {
    http(pod, to, "POST", path, "x").0
}

/// A server that sends 50 chunks of 1 KiB over 5 s to each connection, then closes.
fn start_slow_app(pod: &Pod, port: u16) {
    let listener = pod
        .run_in_netns(move || TcpListener::bind(("127.0.0.1", port)))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut stream = stream;
                for _ in 0..50 {
                    if stream.write_all(&[b'x'; 1024]).is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
    });
}

#[test]
fn sigterm_keeps_an_in_flight_transfer_and_refuses_new_inbound() {
    let dir = TempDir::new("agent-drain");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("drain").unwrap();
    start_slow_app(&pod, SLOW_APP);
    let _echo = support::start_app(&pod, &[ECHO]);
    let config = dir.0.join("bootstrap.json");
    write_json(
        &config,
        &static_bootstrap(
            vec![
                tcp_listener_json("virtualInbound", INBOUND, "slow", "INBOUND"),
                tcp_listener_json("virtualOutbound", OUTBOUND, "echo", "OUTBOUND"),
            ],
            vec![
                static_cluster("slow", SLOW_APP),
                static_cluster("echo", ECHO),
            ],
        ),
    );
    let mut agent = start_agent(
        &pod,
        &config,
        &[
            ("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "true".into()),
            ("MINIMUM_DRAIN_DURATION", "1s".into()),
        ],
        &[],
    );
    wait_for("ready", &agent, || status(&pod, "/healthz/ready").0 == 200);

    // A 5 s transfer through the inbound listener, read on its own thread.
    let transfer = {
        let stream = pod
            .run_in_netns(|| TcpStream::connect(local(INBOUND)))
            .unwrap()
            .unwrap();
        std::thread::spawn(move || {
            let mut stream = stream;
            let mut got = Vec::new();
            let result = stream.read_to_end(&mut got);
            (result.is_ok(), got.len())
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    agent.signal(libc::SIGTERM).unwrap();

    // Draining: not ready, inbound refused, outbound still served, the agent still up.
    wait_for("readiness to drop", &agent, || {
        status(&pod, "/healthz/ready").0 == 503
    });
    wait_for("inbound to close", &agent, || {
        pod.run_in_netns(|| TcpStream::connect(local(INBOUND)))
            .unwrap()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
    });
    let outbound = support::Caller::app(&pod).call(local(OUTBOUND));
    assert!(
        outbound.is_ok(),
        "outbound still served while draining: {outbound:?}"
    );
    assert!(
        agent.try_wait().is_none(),
        "the agent left before the transfer ended"
    );

    // The transfer completes intact; then, no connection left, the agent exits 0.
    let (clean, bytes) = transfer.join().unwrap();
    assert!(clean, "the in-flight transfer was cut");
    assert_eq!(bytes, 50 * 1024);
    let exit = agent.wait_timeout(Duration::from_secs(15)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
}

/// The children of `pid` (its threads' `children` files).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| !stat.contains(") Z "))
        .unwrap_or(false)
}

#[test]
fn supervises_envoy_restarting_it_and_draining_it_on_sigterm() {
    let envoy = support::envoy::bin();
    let dir = TempDir::new("agent-envoy");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("envoy").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    let config = dir.0.join("envoy.json");
    write_json(
        &config,
        &static_bootstrap(
            vec![tcp_listener_json(
                "virtualInbound",
                INBOUND,
                "echo",
                "INBOUND",
            )],
            vec![static_cluster("echo", ECHO)],
        ),
    );
    let mut agent = start_agent(
        &pod,
        &config,
        &[("TERMINATION_DRAIN_DURATION_SECONDS", "4".into())],
        &[
            "--proxy",
            "envoy",
            "--envoy-binary",
            envoy.to_str().unwrap(),
            "--drain-time-s",
            "1",
        ],
    );
    let ready =
        |pod: &Pod| http(pod, local(READINESS), "GET", "/healthz/ready", "localhost").0 == 200;
    wait_for("Envoy ready", &agent, || ready(&pod));
    let first = children(agent.pid());
    assert_eq!(first.len(), 1, "one Envoy under the agent: {first:?}");
    let cmdline = std::fs::read_to_string(format!("/proc/{}/cmdline", first[0])).unwrap();
    let argv: Vec<&str> = cmdline.split('\0').filter(|a| !a.is_empty()).collect();
    for flag in [
        "--drain-time-s",
        "--parent-shutdown-time-s",
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
        "--component-log-level",
    ] {
        assert!(argv.contains(&flag), "Envoy's argv lacks {flag}: {argv:?}");
    }

    // Killed: the agent starts a new Envoy, which becomes ready; the restart is counted.
    nix_kill(first[0], libc::SIGKILL);
    wait_for("a new Envoy", &agent, || {
        let now = children(agent.pid());
        now.len() == 1 && now[0] != first[0] && xds::admin_at(&pod, ADMIN, "/ready").0 == 200
    });
    let (_, metrics) = status(&pod, "/stats/prometheus");
    assert!(
        metrics.contains("\nistio_agent_proxy_restarts_total 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains("envoy_server_live"),
        "Envoy's own metrics merged: {metrics}"
    );
    let second = children(agent.pid())[0];

    // SIGTERM: Envoy's inbound listeners drain (closed after its --drain-time-s) while
    // the agent waits out the termination period; then Envoy is stopped, the agent exits 0.
    assert!(
        inbound_accepts(&pod),
        "Envoy's inbound listener serves before SIGTERM"
    );
    agent.signal(libc::SIGTERM).unwrap();
    wait_for("Envoy's inbound listener to close", &agent, || {
        !inbound_accepts(&pod)
    });
    assert!(
        alive(second),
        "Envoy stopped before the termination period ended"
    );
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    assert!(!alive(second), "Envoy outlived its agent");
}

fn inbound_accepts(pod: &Pod) -> bool {
    pod.run_in_netns(|| TcpStream::connect(local(INBOUND)).is_ok())
        .unwrap()
}

fn nix_kill(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) with a pid this test read from /proc.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, signal) }, 0);
}

#[test]
fn shunt_proxy_runs_with_pilot_agents_envoy_command_line() {
    let dir = TempDir::new("agent-argv");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("argv").unwrap();
    let config = dir.0.join("envoy-rev.json");
    write_json(&config, &static_bootstrap(vec![], vec![]));
    let config = config.to_str().unwrap().to_owned();
    // pkg/envoy/proxy.go's args(), with the injector's extra args and the node flags.
    let argv = [
        "proxy",
        "-c",
        &config,
        "--drain-time-s",
        "45",
        "--drain-strategy",
        "immediate",
        "--local-address-ip-version",
        "v4",
        "--file-flush-interval-msec",
        "1000",
        "--disable-hot-restart",
        "--allow-unknown-static-fields",
        "--log-format",
        "%Y-%m-%dT%T.%fZ\t%l\tenvoy %n %g:%#\t%v\tthread=%t",
        "-l",
        "warning",
        "--component-log-level",
        "misc:error",
        "--concurrency",
        "2",
        "--parent-shutdown-time-s",
        "60",
        "--restart-epoch",
        "0",
        "--service-cluster",
        "sleep.default",
        "--service-node",
        "sidecar~10.80.3.109~sleep-xxx.default~default.svc.cluster.local",
    ];
    let proxy = pod.command(shunt_bin()).args(argv).spawn().unwrap();
    wait_for("ready", &proxy, || {
        xds::admin_at(&pod, ADMIN, "/ready").0 == 200
    });
    let (_, info) = xds::admin_at(&pod, ADMIN, "/server_info");
    let info: Value = serde_json::from_str(&info).unwrap();
    assert_eq!(
        info["node"]["id"],
        "sidecar~10.80.3.109~sleep-xxx.default~default.svc.cluster.local"
    );
    assert_eq!(info["node"]["cluster"], "sleep.default");
    assert_eq!(info["command_line_options"]["drain_time"], "45s");
    drop(proxy);

    // What shunt cannot honour is a clear error naming the flag.
    let out = pod
        .command(shunt_bin())
        .args(["proxy", "-c", &config, "--restart-epoch", "1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--restart-epoch 1"),
        "{out:?}"
    );
    let out = pod
        .command(shunt_bin())
        .args(["proxy", "-c", &config, "--component-log-level", "misc:loud"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("misc:loud"),
        "{out:?}"
    );
}

#[test]
fn bad_probe_or_scrape_settings_are_refused_with_what_is_wrong() {
    let dir = TempDir::new("agent-bad");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("bad").unwrap();
    let config = dir.0.join("bootstrap.json");
    write_json(&config, &static_bootstrap(vec![], vec![]));
    let run = |key: &str, value: &str| {
        let out = pod
            .command(shunt_bin())
            .args(["agent", "-c", config.to_str().unwrap()])
            .env(key, value)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{key}={value} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(
        "ISTIO_KUBE_APP_PROBERS",
        r#"{"/app-health/web/livez": {"httpGet": {"path": "/", "port": "http"}}}"#,
    );
    assert!(
        err.contains("/app-health/web/livez") && err.contains("\"http\""),
        "{err}"
    );
    let err = run(
        "ISTIO_PROMETHEUS_ANNOTATIONS",
        r#"{"scrape": "true", "port": "15020"}"#,
    );
    assert!(
        err.contains("15020") && err.contains("status port"),
        "{err}"
    );
    let err = run("EXIT_ON_ZERO_ACTIVE_CONNECTIONS", "maybe");
    assert!(err.contains("maybe"), "{err}");
}

#[test]
fn drain_closes_inbound_keeps_outbound_and_a_later_sigterm_exits_at_once() {
    let dir = TempDir::new("agent-drain-now");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("drainnow").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    let config = dir.0.join("bootstrap.json");
    write_json(
        &config,
        &static_bootstrap(
            vec![
                tcp_listener_json("virtualInbound", INBOUND, "echo", "INBOUND"),
                tcp_listener_json("virtualOutbound", OUTBOUND, "echo", "OUTBOUND"),
            ],
            vec![static_cluster("echo", ECHO)],
        ),
    );
    // A termination drain far longer than the test: only skipping it ends the agent.
    let mut agent = start_agent(
        &pod,
        &config,
        &[("TERMINATION_DRAIN_DURATION_SECONDS", "600".into())],
        &[],
    );
    wait_for("ready", &agent, || status(&pod, "/healthz/ready").0 == 200);
    assert!(inbound_accepts(&pod));

    assert_eq!(status(&pod, "/drain").0, 405, "/drain is POST only");
    assert_eq!(
        http(&pod, local(STATUS), "POST", "/drain", "localhost").0,
        200
    );
    wait_for("inbound to close", &agent, || !inbound_accepts(&pod));
    let outbound = support::Caller::app(&pod).call(local(OUTBOUND));
    assert!(outbound.is_ok(), "outbound still served: {outbound:?}");
    assert!(agent.try_wait().is_none(), "/drain is not an exit");

    agent.signal(libc::SIGTERM).unwrap();
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
}

/// Istio's bootstrap (the corpus's `default_golden.json`, its sockets moved into a
/// scratch folder): its own 15021 listener answers readiness, routed (for Envoy) to the
/// agent's 15020, which asks the proxy's admin API. Not ready before the first xDS push,
/// ready after, for the in-process proxy and for Envoy.
#[test]
fn istios_bootstrap_is_ready_through_its_own_15021_after_the_first_push() {
    let golden =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/istio/bootstrap/default_golden.json");
    let golden = std::fs::read_to_string(&golden).unwrap();
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("istio").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    let envoy = support::envoy::bin();
    for proxy in ["shunt", "envoy"] {
        let dir = TempDir::new(&format!("agent-istio-{proxy}"));
        let socket = dir.0.join("XDS");
        let bootstrap = golden
            .replace("/tmp/XDS", socket.to_str().unwrap())
            .replace(
                "./var/run/secrets/workload-spiffe-uds/test.sock",
                dir.0.join("SDS").to_str().unwrap(),
            );
        let config = dir.0.join("envoy-rev.json");
        std::fs::write(&config, bootstrap).unwrap();
        let server =
            harness::ads::AdsServer::start(harness::ads::Listen::Unix(socket.clone())).unwrap();
        xds::open_to_the_proxy(&dir.0, &socket);
        let mut agent = start_agent(
            &pod,
            &config,
            &[],
            &["--proxy", proxy, "--envoy-binary", envoy.to_str().unwrap()],
        );
        let readiness =
            |pod: &Pod| http(pod, local(READINESS), "GET", "/healthz/ready", "localhost").0;
        wait_for("the status server", &agent, || {
            status(&pod, "/healthz/ready").0 == 503
        });
        assert_ne!(readiness(&pod), 200, "{proxy}: ready before any config");

        xds::serve_backend(&server, eds_cluster("backend", 1), ECHO, 10000);
        wait_for(&format!("{proxy}: 15021 ready"), &agent, || {
            readiness(&pod) == 200
        });
        assert_eq!(status(&pod, "/healthz/ready").0, 200, "{proxy}");
        assert!(
            xds::reaches(&pod, local(10000)).is_some(),
            "{proxy}: the pushed listener serves"
        );

        assert_eq!(
            http(&pod, local(STATUS), "POST", "/quitquitquit", "localhost").0,
            200
        );
        let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
        assert!(exit.success(), "{proxy}: {}", agent.stderr_text());
        server.stop();
    }
}

/// Without `-c` the agent is pilot-agent: it writes `etc/istio/proxy/envoy-rev.json`
/// from the pod's environment (Istio's bootstrap: its node id, its `xds-grpc` cluster
/// on the Unix socket `./etc/istio/proxy/XDS`), relays the proxy's ADS stream to the
/// control plane (a grpcio server in front of the test's ADS server, with istiod's
/// header behaviour) by call, with no socket, and the in-process proxy gets its
/// listeners through it: ready on 15021, traffic flows.
#[test]
fn without_a_bootstrap_the_agent_writes_pilot_agents_and_proxies_xds_for_it() {
    let (_dir, socket, server) = unix_server("agent-generated");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("gen").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    let work = TempDir::new("agent-generated-cwd");
    // The control plane is a grpcio server, which (as istiod's grpc-go) sends its
    // response headers only with its first response: nothing is pushed until the
    // proxy's first request has reached it through the agent.
    let relay = support::GrpcioRelay::start(&pod, &format!("unix:{}", socket.display()));
    let upstream = relay.address.to_string();
    let mut agent = pod
        .command(shunt_bin())
        .current_dir(&work.0)
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .env("POD_NAME", "gen-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("SERVICE_ACCOUNT", "gen")
        .env("ISTIO_META_CLUSTER_ID", "Kubernetes")
        .env("TERMINATION_DRAIN_DURATION_SECONDS", "3")
        .spawn()
        .expect("start shunt agent");
    let written = work.0.join("etc/istio/proxy/envoy-rev.json");
    wait_for("the generated bootstrap", &agent, || written.exists());
    let bootstrap: Value = serde_json::from_slice(&std::fs::read(&written).unwrap()).unwrap();
    let node_id = format!(
        "sidecar~{}~gen-1.default~default.svc.cluster.local",
        pod.ipv4()
    );
    assert_eq!(bootstrap["node"]["id"], node_id.as_str());
    assert_eq!(bootstrap["node"]["metadata"]["CLUSTER_ID"], "Kubernetes");

    // The proxy's stream reaches the control plane through the agent, with its node.
    wait_for("the proxy's request through the xDS proxy", &agent, || {
        server
            .requests()
            .iter()
            .any(|r| r.node_id.as_deref() == Some(node_id.as_str()))
    });
    // With the agent's own metadata on the upstream stream.
    assert!(
        server
            .requests()
            .iter()
            .all(|r| r.metadata("clusterid") == Some("Kubernetes")),
        "{:?}",
        server.requests().first().map(|r| r.metadata.clone())
    );
    let readiness = |pod: &Pod| http(pod, local(READINESS), "GET", "/healthz/ready", "localhost").0;
    assert_ne!(readiness(&pod), 200, "ready before any config");
    xds::serve_backend(&server, eds_cluster("backend", 1), ECHO, 10000);
    wait_for("15021 ready", &agent, || readiness(&pod) == 200);
    assert!(
        xds::reaches(&pod, local(10000)).is_some(),
        "the listener pushed through the xDS proxy serves"
    );
    // SIGTERM: Istio's 15021, which the proxy serves, follows the agent's readiness
    // and fails while the pod drains (the proxy's own /ready does not change).
    agent.signal(libc::SIGTERM).unwrap();
    wait_for("15021 to fail while the pod drains", &agent, || {
        readiness(&pod) == 503
    });
    assert_eq!(status(&pod, "/healthz/ready").0, 503);
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}

/// A push over gRPC's usual 4 MiB limit (a large mesh's full CDS) comes through the
/// agent's xDS proxy whole, as Envoy takes it from istiod: the upstream stream has no
/// cap on a response (tonic's default client refused it as "decoded message length
/// too large", and the proxy never got its config).
#[test]
fn a_push_over_4_mib_comes_through_the_xds_proxy() {
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use envoy_types::pb::envoy::config::core::v3::Metadata;
    use envoy_types::pb::google::protobuf::{Struct, Value as ProtoValue, value::Kind};
    use prost::Message;

    let (_dir, socket, server) = unix_server("agent-big-push");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("bigpush").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    let (name, mut any) = eds_cluster("backend", 1);
    let mut cluster = Cluster::decode(any.value.as_slice()).unwrap();
    let blob = ProtoValue {
        kind: Some(Kind::StringValue("x".repeat(5 << 20))),
    };
    let bulk = Struct {
        fields: [("blob".to_owned(), blob)].into(),
    };
    cluster.metadata = Some(Metadata {
        filter_metadata: [("test.bulk".to_owned(), bulk)].into(),
        ..Default::default()
    });
    any.value = cluster.encode_to_vec();
    assert!(any.value.len() > 5 << 20);
    xds::serve_backend(&server, (name, any), ECHO, 10000);
    let work = TempDir::new("agent-big-push-cwd");
    let upstream = format!("unix:{}", socket.display());
    let mut agent = pod
        .command(shunt_bin())
        .current_dir(&work.0)
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .env("POD_NAME", "bigpush-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .spawn()
        .expect("start shunt agent");
    let readiness = |pod: &Pod| http(pod, local(READINESS), "GET", "/healthz/ready", "localhost").0;
    wait_for("15021 ready", &agent, || readiness(&pod) == 200);
    assert!(
        xds::reaches(&pod, local(10000)).is_some(),
        "the listener to the cluster of the big push serves"
    );
    assert_eq!(
        http(&pod, local(STATUS), "POST", "/quitquitquit", "localhost").0,
        200
    );
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}

/// pilot-agent keeps the bootstrap and the xDS proxy's socket in the ProxyConfig's
/// `configPath`, which the bootstrap's `xds-grpc` pipe names: with a configPath of its
/// own (from `PROXY_CONFIG`) the three still agree, so the proxy's config arrives.
#[test]
fn a_custom_config_path_holds_the_bootstrap_and_the_xds_socket() {
    let (_dir, socket, server) = unix_server("agent-config-path");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("cfgpath").unwrap();
    let _echo = support::start_app(&pod, &[ECHO]);
    xds::serve_backend(&server, eds_cluster("backend", 1), ECHO, 10000);
    let work = TempDir::new("agent-config-path-cwd");
    let upstream = format!("unix:{}", socket.display());
    let mut agent = pod
        .command(shunt_bin())
        .current_dir(&work.0)
        .args(["agent", "--keep-user", "--serve-proxy-sockets"])
        .args(["--xds-address", &upstream])
        .env("POD_NAME", "cfgpath-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("PROXY_CONFIG", r#"{"configPath": "./custom/proxy"}"#)
        .spawn()
        .expect("start shunt agent");
    let written = work.0.join("custom/proxy/envoy-rev.json");
    wait_for("the bootstrap in configPath", &agent, || written.exists());
    let bootstrap: Value = serde_json::from_slice(&std::fs::read(&written).unwrap()).unwrap();
    let xds_grpc = bootstrap["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "xds-grpc")
        .expect("the xds-grpc cluster");
    assert_eq!(
        xds_grpc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
            ["path"],
        "./custom/proxy/XDS"
    );
    let readiness = |pod: &Pod| http(pod, local(READINESS), "GET", "/healthz/ready", "localhost").0;
    wait_for("15021 ready", &agent, || readiness(&pod) == 200);
    assert!(
        work.0.join("custom/proxy/XDS").exists(),
        "the xDS proxy's socket is where the bootstrap points"
    );
    assert!(!work.0.join("etc/istio/proxy").exists());
    assert_eq!(
        http(&pod, local(STATUS), "POST", "/quitquitquit", "localhost").0,
        200
    );
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}

/// A malformed `PROXY_CONFIG` or mesh config stops the agent at start, naming where
/// the bad value is (the layer and the field), before anything is written or bound.
#[test]
fn a_malformed_proxy_config_or_mesh_config_is_refused_at_start_naming_the_field() {
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("badcfg").unwrap();
    let cases: [(&str, Option<&str>, &str, &str); 3] = [
        (
            "PROXY_CONFIG",
            None,
            "drainDuration: forever",
            "drainDuration",
        ),
        (
            "PROXY_CONFIG",
            None,
            "controlPlaneAuthPolicy: SOMETIMES",
            "controlPlaneAuthPolicy",
        ),
        (
            "the mesh config",
            Some("defaultConfig:\n  proxyAdminPort: lots\n"),
            "",
            "proxyAdminPort",
        ),
    ];
    for (source, mesh, proxy_config, field) in cases {
        let work = TempDir::new("agent-bad-config");
        let mut command = pod
            .command(shunt_bin())
            .current_dir(&work.0)
            .args(["agent", "--keep-user", "--xds-address", "127.0.0.1:1"])
            .env("POD_NAMESPACE", "default")
            .timeout(Duration::from_secs(20));
        if let Some(mesh) = mesh {
            let file = work.0.join("etc/istio/config/mesh");
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(&file, mesh).unwrap();
        }
        if !proxy_config.is_empty() {
            command = command.env("PROXY_CONFIG", proxy_config);
        }
        let out = command.output().expect("run shunt agent");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{source} {field}: started:\n{stderr}"
        );
        assert!(
            stderr.contains(source) && stderr.contains(field),
            "{source} {field}: the error does not name it:\n{stderr}"
        );
        assert!(
            !work.0.join("etc/istio/proxy/envoy-rev.json").exists(),
            "a bootstrap was written"
        );
    }
}

/// A control plane that takes the stream but never answers (istiod overloaded, or a
/// wrong address that accepts) leaves the agent unready, and 15020 says why: the proxy
/// waits for its first config, and the control plane at its address has not answered.
#[test]
fn a_control_plane_that_never_answers_leaves_the_agent_unready_with_the_reason() {
    let (_dir, socket, server) = unix_server("agent-silent");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("silent").unwrap();
    let work = TempDir::new("agent-silent-cwd");
    // The test server has nothing to push, so it never answers (as grpc-go, it sends
    // no headers either).
    let relay = support::GrpcioRelay::start(&pod, &format!("unix:{}", socket.display()));
    let upstream = relay.address.to_string();
    let mut agent = pod
        .command(shunt_bin())
        .current_dir(&work.0)
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .env("POD_NAME", "silent-1")
        .env("POD_NAMESPACE", "default")
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .spawn()
        .expect("start shunt agent");
    wait_for("the proxy's request at the control plane", &agent, || {
        !server.requests().is_empty()
    });
    let mut answer = (0, String::new());
    wait_for("15020's reason", &agent, || {
        answer = status(&pod, "/healthz/ready");
        answer.1.contains("no response from the control plane")
    });
    assert_eq!(answer.0, 503);
    assert!(answer.1.contains(&upstream), "{}", answer.1);
    assert_eq!(
        http(&pod, local(READINESS), "GET", "/healthz/ready", "localhost").0,
        503
    );
    assert_eq!(
        http(&pod, local(STATUS), "POST", "/quitquitquit", "localhost").0,
        200
    );
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}
