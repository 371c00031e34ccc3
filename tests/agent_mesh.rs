//! `shunt agent` as pilot-agent in a mesh (issue 12), every part a real process in a
//! pod: the agent writes Istio's bootstrap, gets the workload certificate from a test
//! mesh CA (gRPC over TLS, the token checked) and rotates it, and holds the one xDS
//! connection to a test control plane. The in-process proxy gets its certificates and
//! its configuration from the agent by call: no SDS or XDS socket exists.
//! Needs root.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harness::ads::resources::{grpc_source, load_assignment, named, tls_tcp_proxy_listener};
use harness::ads::{AdsServer, type_urls};
use harness::ca::TestCa;
use harness::{Node, Pod, PodProcess, shunt_bin};
use support::TempDir;
use support::pki::{leaf, uris};
use support::xds::{eds_cluster, unix_server};

const TOKEN: &str = "the-service-account-token";
const IDENTITY: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const CLIENT_IDENTITY: &str = "spiffe://cluster.local/ns/default/sa/client";
const READINESS: u16 = 15021;
const STATUS: u16 = 15020;
const ECHO: u16 = 9001;
const MTLS: u16 = 15443;

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Waits up to 60 s for `check`, failing with the agent's log if it exits or time runs out.
fn wait_for(what: &str, agent: &PodProcess, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
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
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// GET on 127.0.0.1:`port` in the pod: the status code (0 if nothing answered).
fn get(pod: &Pod, port: u16, path: &str) -> u16 {
    use std::io::{Read, Write};
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    pod.run_in_netns(move || -> std::io::Result<u16> {
        let mut stream =
            std::net::TcpStream::connect_timeout(&local(port), Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(15)))?;
        stream.write_all(request.as_bytes())?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        Ok(raw
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0))
    })
    .expect("entering the pod")
    .unwrap_or(0)
}

fn post(pod: &Pod, port: u16, path: &str) -> u16 {
    use std::io::{Read, Write};
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    );
    pod.run_in_netns(move || -> std::io::Result<u16> {
        let mut stream =
            std::net::TcpStream::connect_timeout(&local(port), Duration::from_secs(5))?;
        stream.write_all(request.as_bytes())?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        Ok(raw
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0))
    })
    .expect("entering the pod")
    .unwrap_or(0)
}

/// A client certificate from `ca` for [`CLIENT_IDENTITY`]: (cert, key) files in `dir`.
fn client_certificate(ca: &TestCa, dir: &Path) -> (PathBuf, PathBuf) {
    let (chain, key) = ca
        .issue(CLIENT_IDENTITY, Duration::from_secs(3600))
        .unwrap();
    let (cert_file, key_file) = (dir.join("client.pem"), dir.join("client.key"));
    std::fs::write(&cert_file, chain).unwrap();
    std::fs::write(&key_file, key).unwrap();
    (cert_file, key_file)
}

/// An mTLS exchange with 127.0.0.1:`port` in the pod (`openssl s_client` with the
/// client certificate, verifying the server against `root`): the server's leaf (DER),
/// once the chain verified and the app behind the listener answered (its `HELLO`
/// line), which also proves the server took the client's certificate.
fn mtls(pod: &Pod, port: u16, root: &Path, client: &(PathBuf, PathBuf)) -> Result<Vec<u8>, String> {
    // s_client quits at the end of its input: a second for the app's line to arrive.
    let script = format!(
        "sleep 1 | openssl s_client -connect 127.0.0.1:{port} -CAfile {} -cert {} -key {} \
         -verify_return_error -showcerts",
        root.display(),
        client.0.display(),
        client.1.display()
    );
    let out = pod
        .command("sh")
        .args(["-c", &script])
        .timeout(Duration::from_secs(15))
        .output()
        .map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !stdout.contains("HELLO peer=") || !stdout.contains("Verify return code: 0 (ok)") {
        return Err(format!(
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(leaf(&stdout))
}

/// The control plane's config: cluster `backend` (EDS, to the echo app) and an mTLS
/// `tcp_proxy` listener on [`MTLS`] whose certificate (`default`) and trust (`ROOTCA`)
/// come over SDS from the bootstrap's `sds-grpc`, as istiod writes sidecar listeners.
fn serve_mtls_backend(server: &AdsServer) {
    serve_mtls_backend_waiting(server, None);
}

/// As [`serve_mtls_backend`]; with `initial_fetch_timeout` (Istio's is 0 s: forever),
/// the listener warms that long for its secrets.
fn serve_mtls_backend_waiting(server: &AdsServer, initial_fetch_timeout: Option<Duration>) {
    let mut source = grpc_source("sds-grpc");
    source.initial_fetch_timeout =
        initial_fetch_timeout.map(|t| envoy_types::pb::google::protobuf::Duration {
            seconds: t.as_secs() as i64,
            nanos: t.subsec_nanos() as i32,
        });
    server.set(type_urls::CLUSTER, "c1", vec![eds_cluster("backend", 1)]);
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![named(
            "backend",
            &load_assignment("backend", &[local(ECHO)]),
        )],
    );
    let listener = tls_tcp_proxy_listener(
        "mtls",
        local(MTLS),
        "backend",
        source,
        "default",
        Some("ROOTCA"),
    );
    server.set(type_urls::LISTENER, "l1", vec![named("mtls", &listener)]);
}

/// The pod's environment as the injector sets it, with the CA at `ca`.
fn agent_command(pod: &Pod, work: &Path, ca: &TestCa) -> harness::PodCommand {
    pod.command(shunt_bin())
        .current_dir(work)
        .env("POD_NAME", "sleep-1")
        .env("POD_NAMESPACE", "default")
        .env("SERVICE_ACCOUNT", "sleep")
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("ISTIO_META_CLUSTER_ID", "Kubernetes")
        .env("CA_ADDR", ca.address())
        .env("ISTIO_META_TLS_CLIENT_ROOT_CERT", &ca.root_file)
}

/// The service-account token where pilot-agent reads it, under `work`.
fn write_token(work: &Path, token: &str) {
    let path = work.join("var/run/secrets/tokens/istio-token");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, token).unwrap();
}

/// The in-process proxy takes `default`/`ROOTCA` and their rotations straight from the
/// agent's certificate provider and its xDS through the agent's connection: the mTLS
/// listener pushed by the control plane serves the CA-issued identity, a rotation is
/// seen by the next handshake, and neither the SDS socket nor the XDS socket exists.
#[test]
fn the_in_process_proxy_takes_certificates_and_xds_from_the_agent_without_sockets() {
    let work = TempDir::new("mesh-inproc");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("m").unwrap();
    // Certificates live 8 s: rotated after about 4.
    let ca = pod
        .run_in_netns(|| TestCa::start(&work.0, TOKEN, Duration::from_secs(8)))
        .unwrap()
        .unwrap();
    write_token(&work.0, TOKEN);
    let client = client_certificate(&ca, &work.0);
    let (_ads_dir, socket, server) = unix_server("mesh-inproc-ads");
    let _echo = support::start_app(&pod, &[ECHO]);
    serve_mtls_backend(&server);

    let upstream = format!("unix:{}", socket.display());
    let agent = agent_command(&pod, &work.0, &ca)
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .spawn()
        .expect("start shunt agent");
    wait_for("15021 ready", &agent, || {
        get(&pod, READINESS, "/healthz/ready") == 200
    });

    let mut served = Err(String::new());
    wait_for("an mTLS exchange with the pushed listener", &agent, || {
        served = mtls(&pod, MTLS, &ca.root_file, &client);
        served.is_ok()
    });
    let first = served.clone().unwrap();
    assert_eq!(uris(&first), [IDENTITY], "the CA-issued workload identity");
    let issued = ca.calls().iter().filter(|c| c.refused.is_none()).count();
    assert!(issued >= 1);

    // A rotation: the CA signs again, and a later handshake serves a new leaf.
    wait_for("a rotation at the CA", &agent, || {
        ca.calls().iter().filter(|c| c.refused.is_none()).count() > issued
    });
    wait_for("the rotated certificate in a handshake", &agent, || {
        served = mtls(&pod, MTLS, &ca.root_file, &client);
        served.as_ref().is_ok_and(|der| *der != first)
    });
    assert_eq!(uris(served.as_ref().unwrap()), [IDENTITY]);

    for path in [
        "var/run/secrets/workload-spiffe-uds/socket",
        "etc/istio/proxy/XDS",
    ] {
        assert!(
            !work.0.join(path).exists(),
            "{path} exists: the in-process proxy needs no socket"
        );
    }
    // The proxy's requests reached the control plane through the agent: one stream.
    let streams: std::collections::BTreeSet<u64> =
        server.requests().iter().map(|r| r.stream).collect();
    assert_eq!(streams.len(), 1, "one upstream stream: {streams:?}");

    assert_eq!(post(&pod, STATUS, "/quitquitquit"), 200);
    let mut agent = agent;
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}

/// The agent dials the control plane as pilot-agent dials istiod: TLS verifying the
/// server against the mesh root (`./var/run/secrets/istio/root-cert.pem`), the
/// CA-issued workload certificate as client certificate (the server here requires
/// one), the service-account token as bearer, the `ClusterID` header and each
/// `XDS_HEADER_*` of the environment; the proxy gets its config over that connection.
#[test]
fn xds_to_the_control_plane_is_mtls_with_the_workload_certificate_and_pilot_agents_headers() {
    let work = TempDir::new("mesh-xds-mtls");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("x").unwrap();
    let ca = pod
        .run_in_netns(|| TestCa::start(&work.0, TOKEN, Duration::from_secs(3600)))
        .unwrap()
        .unwrap();
    write_token(&work.0, TOKEN);
    let mesh_root = work.0.join("var/run/secrets/istio/root-cert.pem");
    std::fs::create_dir_all(mesh_root.parent().unwrap()).unwrap();
    std::fs::write(&mesh_root, &ca.root_pem).unwrap();
    let (chain, key) = ca
        .issue_for_ip("127.0.0.1".parse().unwrap(), Duration::from_secs(3600))
        .unwrap();
    let (cert_file, key_file) = (work.0.join("istiod.pem"), work.0.join("istiod.key"));
    std::fs::write(&cert_file, chain).unwrap();
    std::fs::write(&key_file, key).unwrap();
    let listen = harness::ads::Listen::TcpTls {
        addr: local(0),
        cert: cert_file,
        key: key_file,
        client_ca: Some(ca.root_file.clone()),
    };
    let server = pod
        .run_in_netns(move || AdsServer::start(listen))
        .unwrap()
        .expect("TLS ADS server");
    let port = server.local_addr().unwrap().port();
    let _echo = support::start_app(&pod, &[ECHO]);
    support::xds::serve_backend(&server, eds_cluster("backend", 1), ECHO, 10000);

    let upstream = format!("127.0.0.1:{port}");
    let agent = agent_command(&pod, &work.0, &ca)
        .env("XDS_HEADER_TENANT", "blue")
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .spawn()
        .expect("start shunt agent");
    wait_for("15021 ready", &agent, || {
        get(&pod, READINESS, "/healthz/ready") == 200
    });
    assert!(
        support::xds::reaches(&pod, local(10000)).is_some(),
        "the listener pushed over the mTLS connection serves"
    );

    let requests = server.requests();
    assert!(!requests.is_empty());
    for request in &requests {
        let client = request
            .peer_certificate()
            .expect("every stream is mTLS: the server saw a client certificate");
        assert_eq!(uris(&client), [IDENTITY], "the workload certificate");
        assert_eq!(
            request.metadata("authorization"),
            Some(format!("Bearer {TOKEN}").as_str())
        );
        assert_eq!(request.metadata("clusterid"), Some("Kubernetes"));
        assert_eq!(request.metadata("tenant"), Some("blue"));
    }
    assert_eq!(post(&pod, STATUS, "/quitquitquit"), 200);
    let mut agent = agent;
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}

/// The CA path end to end: a token the CA rejects leaves the agent unready (the
/// listener waits for its certificate, as Istio's `initial_fetch_timeout: 0s` makes
/// Envoy wait) with the rejection logged; the token file is re-read on each retry, so
/// the right token recovers it. A CA outage is logged and retried with back-off, the
/// proxy keeps serving, and once the CA is back the next certificate is issued and
/// served by the next handshake.
#[test]
fn a_rejected_token_keeps_the_agent_unready_and_a_ca_outage_is_ridden_out() {
    let work = TempDir::new("mesh-ca");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("c").unwrap();
    let mut ca = pod
        .run_in_netns(|| TestCa::start(&work.0, TOKEN, Duration::from_secs(6)))
        .unwrap()
        .unwrap();
    write_token(&work.0, "a-stale-token");
    let client = client_certificate(&ca, &work.0);
    let (_ads_dir, socket, server) = unix_server("mesh-ca-ads");
    let _echo = support::start_app(&pod, &[ECHO]);
    serve_mtls_backend_waiting(&server, Some(Duration::ZERO));

    let upstream = format!("unix:{}", socket.display());
    let agent = agent_command(&pod, &work.0, &ca)
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .spawn()
        .expect("start shunt agent");
    wait_for("the CA to refuse the token", &agent, || {
        ca.calls().iter().any(|c| c.refused.is_some())
    });
    wait_for("the rejection in the agent's log", &agent, || {
        agent.stderr_text().contains("workload certificate:")
    });
    // The config is in, but the mTLS listener waits for its certificate.
    wait_for("the listener pushed", &agent, || {
        server
            .requests()
            .iter()
            .any(|r| r.type_url == type_urls::LISTENER && r.is_ack())
    });
    assert_ne!(
        get(&pod, READINESS, "/healthz/ready"),
        200,
        "ready without a workload certificate:\n{}",
        agent.stderr_text()
    );
    assert!(ca.calls().iter().all(|c| c.refused.is_some()));

    // The right token: read again on the next attempt.
    write_token(&work.0, TOKEN);
    wait_for("15021 ready", &agent, || {
        get(&pod, READINESS, "/healthz/ready") == 200
    });
    let mut served = Err(String::new());
    wait_for("an mTLS exchange", &agent, || {
        served = mtls(&pod, MTLS, &ca.root_file, &client);
        served.is_ok()
    });
    assert_eq!(uris(served.as_ref().unwrap()), [IDENTITY]);

    // The outage: the next rotation fails, is logged and retried.
    let failures_before = agent.stderr_text().matches("workload certificate:").count();
    ca.stop();
    let issued = ca.calls().iter().filter(|c| c.refused.is_none()).count();
    wait_for("failed rotations logged", &agent, || {
        agent.stderr_text().matches("workload certificate:").count() >= failures_before + 2
    });
    let before_recovery = mtls(&pod, MTLS, &ca.root_file, &client).ok();
    pod.run_in_netns(|| ca.restart()).unwrap().unwrap();
    wait_for("a certificate issued after the outage", &agent, || {
        ca.calls().iter().filter(|c| c.refused.is_none()).count() > issued
    });
    wait_for("the new certificate in a handshake", &agent, || {
        served = mtls(&pod, MTLS, &ca.root_file, &client);
        served
            .as_ref()
            .is_ok_and(|der| Some(der) != before_recovery.as_ref())
    });
    assert_eq!(uris(served.as_ref().unwrap()), [IDENTITY]);
    assert_eq!(get(&pod, READINESS, "/healthz/ready"), 200);

    assert_eq!(post(&pod, STATUS, "/quitquitquit"), 200);
    let mut agent = agent;
    let exit = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}

const APP_OF_ENVOY: u16 = 9001;
const APP_OF_SHUNT: u16 = 9002;
const OUTBOUND: u16 = 10000;

/// One sidecar's config from its control plane, as istiod shapes it: an inbound mTLS
/// listener on [`MTLS`] (certificate `default`, trust `ROOTCA`, a client certificate
/// required) to the pod's app on `app`, and an outbound listener on
/// 127.0.0.1:[`OUTBOUND`] to cluster `peer`, which originates mTLS to the other pod's
/// [`MTLS`] and requires its SPIFFE identity; secrets over SDS from `sds-grpc`.
fn serve_sidecar(server: &AdsServer, app: u16, peer: std::net::IpAddr, peer_identity: &str) {
    use harness::ads::resources::{self, ads_source, tcp_proxy_listener, with_upstream_mtls};
    let sds = grpc_source("sds-grpc");
    let peer_cluster = with_upstream_mtls(
        resources::eds_cluster("peer", ads_source(), 2),
        sds.clone(),
        "default",
        "ROOTCA",
        peer_identity,
    );
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("app", 1), named("peer", &peer_cluster)],
    );
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![
            named("app", &load_assignment("app", &[local(app)])),
            named(
                "peer",
                &load_assignment("peer", &[SocketAddr::new(peer, MTLS)]),
            ),
        ],
    );
    let inbound = tls_tcp_proxy_listener(
        "inbound",
        SocketAddr::from(([0, 0, 0, 0], MTLS)),
        "app",
        sds,
        "default",
        Some("ROOTCA"),
    );
    let outbound = tcp_proxy_listener("outbound", local(OUTBOUND), "peer");
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![named("inbound", &inbound), named("outbound", &outbound)],
    );
}

/// The first line an app behind 127.0.0.1:[`OUTBOUND`] in `pod` sends (its `HELLO`).
fn hello_through_outbound(pod: &Pod) -> Option<String> {
    use std::io::BufRead;
    pod.run_in_netns(|| -> std::io::Result<String> {
        let stream =
            std::net::TcpStream::connect_timeout(&local(OUTBOUND), Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut line = String::new();
        std::io::BufReader::new(stream).read_line(&mut line)?;
        Ok(line)
    })
    .ok()?
    .ok()
    .filter(|l| l.starts_with("HELLO"))
}

/// pilot-agent's job for a real Envoy: `shunt agent --proxy envoy` writes Istio's
/// bootstrap, and Envoy 1.40 started from it gets `default`/`ROOTCA` over SDS from shunt
/// (the CA-issued certificate) and its listeners and clusters through shunt's xDS proxy
/// from the test control plane. It does mTLS with a shunt sidecar (`shunt agent`, the
/// proxy in process) in another pod, both ways: each side's outbound connection
/// reaches the other pod's app through the other side's inbound mTLS listener, each
/// side checking the other's SPIFFE identity. On SIGTERM both pods' 15021 fail while
/// they drain.
#[test]
fn envoy_under_shunt_agent_and_a_shunt_sidecar_do_mtls_both_ways() {
    let work_envoy = TempDir::new("mesh-envoy");
    let work_shunt = TempDir::new("mesh-shunt");
    let mut node = Node::new().unwrap();
    let envoy_pod = node.add_pod("ev").unwrap();
    let shunt_pod = node.add_pod("sh").unwrap();
    // One CA for the mesh, on the node's gateway address, which both pods reach.
    let gateway = std::net::IpAddr::V4(node.gateway_ipv4());
    let ca = harness::run_in_netns(&node.bridge_netns_path(), || {
        TestCa::start_on(&work_envoy.0, TOKEN, Duration::from_secs(3600), gateway)
    })
    .unwrap()
    .unwrap();
    let envoy_identity = "spiffe://cluster.local/ns/default/sa/envoy-sa";
    let shunt_identity = "spiffe://cluster.local/ns/default/sa/shunt-sa";
    let (_envoy_ads_dir, envoy_socket, envoy_ads) = unix_server("mesh-envoy-ads");
    let (_shunt_ads_dir, shunt_socket, shunt_ads) = unix_server("mesh-shunt-ads");
    serve_sidecar(
        &envoy_ads,
        APP_OF_ENVOY,
        shunt_pod.ipv4().into(),
        shunt_identity,
    );
    serve_sidecar(
        &shunt_ads,
        APP_OF_SHUNT,
        envoy_pod.ipv4().into(),
        envoy_identity,
    );
    let _envoy_app = support::start_app(&envoy_pod, &[APP_OF_ENVOY]);
    let _shunt_app = support::start_app(&shunt_pod, &[APP_OF_SHUNT]);

    let start = |pod: &Pod, work: &Path, account: &str, upstream: &str, flags: &[&str]| {
        write_token(work, TOKEN);
        agent_command(pod, work, &ca)
            .env("SERVICE_ACCOUNT", account)
            .env("POD_NAME", format!("{account}-1"))
            .env("TERMINATION_DRAIN_DURATION_SECONDS", "3")
            .args(["agent", "--keep-user", "--xds-address", upstream])
            .args(flags)
            .spawn()
            .expect("start shunt agent")
    };
    // Envoy's control plane is a grpcio server (istiod's header behaviour, as grpc-go);
    // shunt's is the test server itself.
    let envoy_relay =
        support::GrpcioRelay::start(&envoy_pod, &format!("unix:{}", envoy_socket.display()));
    let envoy_bin = support::envoy::bin();
    let envoy_agent = start(
        &envoy_pod,
        &work_envoy.0,
        "envoy-sa",
        &envoy_relay.address.to_string(),
        &[
            "--proxy",
            "envoy",
            "--envoy-binary",
            envoy_bin.to_str().unwrap(),
        ],
    );
    let shunt_agent = start(
        &shunt_pod,
        &work_shunt.0,
        "shunt-sa",
        &format!("unix:{}", shunt_socket.display()),
        &[],
    );
    for (pod, agent) in [(&envoy_pod, &envoy_agent), (&shunt_pod, &shunt_agent)] {
        wait_for("15021 ready", agent, || {
            get(pod, READINESS, "/healthz/ready") == 200
        });
    }
    // Envoy's SDS and xDS went through the agent's sockets; shunt's by call.
    assert!(
        work_envoy
            .0
            .join("var/run/secrets/workload-spiffe-uds/socket")
            .exists()
    );
    assert!(work_envoy.0.join("etc/istio/proxy/XDS").exists());
    assert!(!work_shunt.0.join("etc/istio/proxy/XDS").exists());

    // Envoy -> shunt's inbound -> the shunt pod's app, and back the other way.
    let mut line = None;
    wait_for(
        "Envoy's outbound mTLS to the shunt sidecar",
        &envoy_agent,
        || {
            line = hello_through_outbound(&envoy_pod);
            line.is_some()
        },
    );
    assert!(
        line.as_deref()
            .unwrap()
            .contains(&format!("local=127.0.0.1:{APP_OF_SHUNT}")),
        "{line:?}"
    );
    wait_for("shunt's outbound mTLS to Envoy", &shunt_agent, || {
        line = hello_through_outbound(&shunt_pod);
        line.is_some()
    });
    assert!(
        line.as_deref()
            .unwrap()
            .contains(&format!("local=127.0.0.1:{APP_OF_ENVOY}")),
        "{line:?}"
    );
    // Both agents' certificates came from the CA with each pod's token and identity.
    let signed: Vec<Vec<String>> = ca
        .calls()
        .into_iter()
        .filter(|c| c.refused.is_none())
        .map(|c| c.uris)
        .collect();
    assert!(
        signed.contains(&vec![envoy_identity.to_owned()]),
        "{signed:?}"
    );
    assert!(
        signed.contains(&vec![shunt_identity.to_owned()]),
        "{signed:?}"
    );

    // SIGTERM: while each agent drains, Istio's 15021 (a listener of the proxy routed
    // to the agent) fails, so the kubelet takes the pod out of its Services, for the
    // supervised Envoy and for the in-process proxy alike; then each exits 0.
    for (pod, mut agent) in [(&envoy_pod, envoy_agent), (&shunt_pod, shunt_agent)] {
        agent.signal(libc::SIGTERM).unwrap();
        wait_for("15021 to fail while the pod drains", &agent, || {
            get(pod, READINESS, "/healthz/ready") == 503
        });
        let exit = agent.wait_timeout(Duration::from_secs(30)).unwrap();
        assert!(exit.success(), "{}", agent.stderr_text());
    }
    envoy_ads.stop();
    shunt_ads.stop();
}

/// pilot-agent's DNS proxy beside Envoy: with `ISTIO_META_DNS_CAPTURE=true`,
/// `shunt agent --proxy envoy` serves DNS on 127.0.0.1:15053 from the name table it
/// takes off the xDS stream (NDS), which Envoy never sees; a new table replaces it.
#[test]
fn beside_envoy_the_agent_serves_dns_from_the_name_table() {
    use support::nds::{NameTable, push, service_entry};
    let work = TempDir::new("mesh-dns");
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("d").unwrap();
    let (_ads_dir, socket, server) = unix_server("mesh-dns-ads");
    let _echo = support::start_app(&pod, &[ECHO]);
    support::xds::serve_backend(&server, eds_cluster("backend", 1), ECHO, 10000);
    let table = |ip: &str| NameTable {
        table: [("shop.example.com".to_owned(), service_entry(&[ip]))].into(),
    };
    push(&server, "n1", &table("240.0.0.10"));

    let upstream = format!("unix:{}", socket.display());
    let envoy_bin = support::envoy::bin();
    let agent = pod
        .command(shunt_bin())
        .current_dir(&work.0)
        .env("POD_NAME", "d-1")
        .env("POD_NAMESPACE", "default")
        .env("SERVICE_ACCOUNT", "d")
        .env("INSTANCE_IP", pod.ipv4().to_string())
        .env("ISTIO_META_DNS_CAPTURE", "true")
        .args(["agent", "--keep-user", "--xds-address", &upstream])
        .args(["--proxy", "envoy", "--envoy-binary"])
        .arg(&envoy_bin)
        .spawn()
        .expect("start shunt agent");
    wait_for("15021 ready", &agent, || {
        get(&pod, READINESS, "/healthz/ready") == 200
    });
    let dig = |name: &str| -> String {
        pod.command("dig")
            .args([
                "@127.0.0.1",
                "-p",
                "15053",
                "+tries=1",
                "+time=3",
                "+short",
                name,
            ])
            .timeout(Duration::from_secs(10))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    wait_for("the name table's answer", &agent, || {
        dig("shop.example.com") == "240.0.0.10"
    });
    push(&server, "n2", &table("240.0.0.11"));
    wait_for("the new table's answer", &agent, || {
        dig("shop.example.com") == "240.0.0.11"
    });
    // The agent ACKed both tables (Istio's bootstrap speaks Delta: an ACK is the
    // nonce back without an error; Envoy, which knows no NameTable, would NACK it).
    let requests = server.requests();
    let table_acks = requests
        .iter()
        .filter(|r| r.type_url == support::nds::TYPE_URL && !r.response_nonce.is_empty())
        .inspect(|r| assert!(!r.is_nack(), "{}", support::xds::describe(&requests)))
        .count();
    assert!(table_acks >= 2, "{}", support::xds::describe(&requests));
    assert_eq!(post(&pod, STATUS, "/quitquitquit"), 200);
    let mut agent = agent;
    let exit = agent.wait_timeout(Duration::from_secs(30)).unwrap();
    assert!(exit.success(), "{}", agent.stderr_text());
    server.stop();
}
