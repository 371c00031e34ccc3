//! xDS end to end: `shunt proxy` in a pod takes its listeners, clusters and endpoints from
//! the in-process ADS test server ([`harness::ads`]) over a Unix socket, as Istio's
//! sidecar reaches its agent, once with state of the world and once with Delta.
//!
//! Each run checks, with real connections through the proxy to two echo servers:
//! the initial config serves; an endpoint update moves new connections while a
//! connection opened before it keeps its bytes intact; a bad cluster is NACKed (the
//! server sees `error_detail`, `/config_dump` shows the error state) and the last good
//! config keeps serving; a cluster whose endpoints have not come is warming (no
//! traffic reaches it) until they do; the control plane restarting makes the client
//! reconnect (Delta says what it holds in `initial_resource_versions`); removing the
//! listener closes its port. Needs root.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use harness::ads::resources::{self, ads_source, load_assignment, named, tcp_proxy_listener};
use harness::ads::{AdsServer, Any, Listen, type_urls};
use harness::{Node, Pod, shunt_bin};
use serde_json::Value;
use support::xds::{
    self, Reach, TempDir, admin_at, bootstrap, dump_section, eds_cluster, eventually,
    open_to_the_proxy, start_shunt, unix_server,
};
use support::*;

const LISTEN_PORT: u16 = 10000;
/// istio/istio pkg/bootstrap/testdata/*_golden.json: every one must validate and serve.
const ISTIO_GOLDEN_BOOTSTRAPS: usize = 30;
const ECHO_A: u16 = 9001;
const ECHO_B: u16 = 9002;

fn endpoints(name: &str, port: u16) -> (String, Any) {
    named(name, &load_assignment(name, &[local(port)]))
}

fn listener(name: &str, port: u16, cluster: &str) -> (String, Any) {
    named(name, &tcp_proxy_listener(name, local(port), cluster))
}

/// Which echo server a new connection through the listener reaches, if any.
fn reaches(pod: &Pod) -> Option<u16> {
    xds::reaches(pod, local(LISTEN_PORT))
}

fn acked(server: &AdsServer, type_url: &str, version: &str, delta: bool) -> bool {
    xds::acked(server, type_url, version, delta, None)
}

fn admin(pod: &Pod, path: &str) -> (u16, String) {
    admin_at(pod, xds::ADMIN, path)
}

fn config_dump(pod: &Pod) -> Value {
    xds::config_dump_at(pod, xds::ADMIN)
}

/// `/config_dump?include_eds`'s endpoints: (cluster, version) of each.
fn listed_endpoints(pod: &Pod) -> Vec<(String, String)> {
    let (_, body) = admin(pod, "/config_dump?include_eds");
    let dump: Value = serde_json::from_str(&body).expect("config_dump is JSON");
    let eds = dump_section(&dump, "EndpointsConfigDump");
    let configs = eds["dynamic_endpoint_configs"].as_array().cloned();
    (configs.unwrap_or_default().iter())
        .map(|c| {
            let field = |v: &Value| v.as_str().unwrap_or_default().to_string();
            (
                field(&c["endpoint_config"]["cluster_name"]),
                field(&c["version_info"]),
            )
        })
        .collect()
}

fn drives_the_proxy(delta: bool) {
    let (dir, socket, server) = unix_server(if delta { "delta" } else { "sotw" });
    xds::serve_backend(&server, eds_cluster("backend", 1), ECHO_A, LISTEN_PORT);

    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    let _echo = start_app(&pod, &[ECHO_A, ECHO_B]);
    let config = dir.0.join("bootstrap.json");
    let proxy = start_shunt(
        &pod,
        &config,
        &bootstrap(&socket, delta),
        &["--concurrency", "2", "--drain-time-s", "1"],
    );

    // Initial config: node and metadata on the stream, everything ACKed, traffic served.
    eventually("ready", &proxy, &server, || admin(&pod, "/ready").0 == 200);
    let first = server.requests().into_iter().next().expect("a request");
    assert_eq!(first.delta, delta);
    assert_eq!(
        first.node_id.as_deref(),
        Some("sidecar~10.0.0.1~p.default~default.svc.cluster.local")
    );
    assert_eq!(first.metadata("x-shunt-test"), Some("yes"));
    assert_eq!(
        first.type_url,
        type_urls::CLUSTER,
        "clusters are asked for first"
    );
    for (t, v) in [
        (type_urls::CLUSTER, "c1"),
        (type_urls::ENDPOINT, "e1"),
        (type_urls::LISTENER, "l1"),
    ] {
        // Ready comes when the listeners are applied; their ACK is on its way.
        eventually(&format!("{t} {v} ACKed"), &proxy, &server, || {
            acked(&server, t, v, delta)
        });
    }
    let eds = server
        .requests()
        .into_iter()
        .find(|r| r.type_url == type_urls::ENDPOINT)
        .unwrap();
    assert_eq!(
        eds.resource_names,
        ["backend"],
        "EDS asks for the EDS cluster's endpoints"
    );
    assert_eq!(reaches(&pod), Some(ECHO_A));
    let dump = config_dump(&pod);
    let clusters = dump_section(&dump, "ClustersConfigDump");
    assert_eq!(clusters["version_info"], "c1");
    assert_eq!(
        clusters["dynamic_active_clusters"][0]["cluster"]["name"],
        "backend"
    );
    let listeners = dump_section(&dump, "ListenersConfigDump");
    assert_eq!(
        listeners["dynamic_listeners"][0]["active_state"]["version_info"],
        "l1"
    );
    let (_, body) = admin(&pod, "/config_dump?include_eds");
    let with_eds: Value = serde_json::from_str(&body).expect("config_dump is JSON");
    let eds = dump_section(&with_eds, "EndpointsConfigDump");
    let backend = &eds["dynamic_endpoint_configs"][0];
    assert_eq!(backend["version_info"], "e1", "{eds}");
    assert_eq!(backend["endpoint_config"]["cluster_name"], "backend");
    assert!(backend["last_updated"].is_string(), "{eds}");

    // An open connection, then an endpoint update: new connections move, the old one's
    // bytes stay intact.
    let target: SocketAddr = format!("127.0.0.1:{LISTEN_PORT}").parse().unwrap();
    let mut held = pod
        .run_in_netns(|| TcpStream::connect(target))
        .unwrap()
        .unwrap();
    held.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    // testapp's greeting line comes first.
    let mut byte = [0u8; 1];
    while held.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {}
    let echo = |stream: &mut TcpStream, payload: &[u8]| {
        stream.write_all(payload).unwrap();
        let mut back = vec![0u8; payload.len()];
        stream.read_exact(&mut back).unwrap();
        assert_eq!(back, payload);
    };
    echo(&mut held, b"before the update");
    server.set(
        type_urls::ENDPOINT,
        "e2",
        vec![endpoints("backend", ECHO_B)],
    );
    eventually("EDS e2 applied", &proxy, &server, || {
        acked(&server, type_urls::ENDPOINT, "e2", delta)
    });
    assert_eq!(reaches(&pod), Some(ECHO_B));
    echo(&mut held, &vec![7u8; 256 * 1024]);

    // A bad cluster: NACKed with the reason, the last good config keeps serving.
    server.set(type_urls::CLUSTER, "c2", vec![eds_cluster("backend", -1)]);
    let nack = server
        .wait_for(Duration::from_secs(10), |r| {
            r.type_url == type_urls::CLUSTER && r.is_nack()
        })
        .expect("the bad cluster is NACKed");
    let (_, message) = nack.error_detail.clone().unwrap();
    assert!(
        message.contains("Cluster \"backend\".connect_timeout"),
        "{message}"
    );
    if !delta {
        assert_eq!(
            nack.version_info, "c1",
            "a NACK names the last good version"
        );
    }
    assert_eq!(reaches(&pod), Some(ECHO_B));
    let dump = config_dump(&pod);
    let clusters = dump_section(&dump, "ClustersConfigDump");
    assert_eq!(clusters["version_info"], "c1");
    let error = &clusters["dynamic_active_clusters"][0]["error_state"];
    assert_eq!(error["version_info"], "c2", "{clusters}");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("connect_timeout")
    );

    // A cluster whose endpoints have not come is warming: its listener gets nothing.
    server.set(
        type_urls::CLUSTER,
        "c3",
        vec![eds_cluster("backend", 1), eds_cluster("late", 1)],
    );
    server.set(
        type_urls::LISTENER,
        "l2",
        vec![listener("l1", LISTEN_PORT, "late")],
    );
    eventually("LDS l2 applied", &proxy, &server, || {
        acked(&server, type_urls::LISTENER, "l2", delta)
    });
    let dump = config_dump(&pod);
    let warming = &dump_section(&dump, "ClustersConfigDump")["dynamic_warming_clusters"];
    assert_eq!(warming[0]["cluster"]["name"], "late", "{warming}");
    // Rebuilt for clusters and listeners since: the endpoints are still EDS's last.
    assert_eq!(
        listed_endpoints(&pod),
        [("backend".to_string(), "e2".to_string())]
    );
    assert_eq!(
        xds::reach(&pod, local(LISTEN_PORT)),
        Reach::ClosedByProxy,
        "no traffic to a warming cluster"
    );
    // The replaced listener's old connection closes after the drain time (1 s).
    let mut buf = [0u8; 1];
    held.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let closed = held.read(&mut buf);
    assert!(
        matches!(&closed, Ok(0))
            || matches!(&closed, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
        "the drained connection must be closed, got {closed:?}"
    );
    server.set(
        type_urls::ENDPOINT,
        "e3",
        vec![endpoints("backend", ECHO_B), endpoints("late", ECHO_A)],
    );
    eventually("late warmed", &proxy, &server, || {
        reaches(&pod) == Some(ECHO_A)
    });
    let listed = listed_endpoints(&pod);
    assert!(listed.contains(&("late".into(), "e3".into())), "{listed:?}");

    // The control plane restarts: the client reconnects and resubscribes.
    let streams_before = server.requests().iter().map(|r| r.stream).max().unwrap();
    server.restart().unwrap();
    open_to_the_proxy(&dir.0, &socket);
    let again = server
        .wait_for(Duration::from_secs(40), |r| {
            r.stream > streams_before && r.type_url == type_urls::CLUSTER
        })
        .expect("the client reconnects");
    if delta {
        assert_eq!(
            again.initial_resource_versions.len(),
            2,
            "Delta resumes with what it holds: {:?}",
            again.initial_resource_versions
        );
    } else {
        assert_eq!(again.version_info, "c3", "SotW resumes from its version");
    }
    assert_eq!(reaches(&pod), Some(ECHO_A), "serving through the restart");

    // Removal: the listener goes, its port closes.
    server.set(type_urls::LISTENER, "l3", vec![]);
    eventually("listener removed", &proxy, &server, || {
        pod.run_in_netns(|| TcpStream::connect(target).is_err())
            .unwrap()
    });
    let dump = config_dump(&pod);
    assert!(dump_section(&dump, "ListenersConfigDump")["dynamic_listeners"].is_null());
    drop(proxy);
}

#[test]
fn state_of_the_world_drives_the_proxy() {
    drives_the_proxy(false);
}

#[test]
fn delta_drives_the_proxy() {
    drives_the_proxy(true);
}

/// The dynamic listeners or clusters of a `/config_dump`, by name, with their versions.
fn dynamic_resources(
    dump: &Value,
    section: &str,
) -> std::collections::BTreeMap<String, (Value, Value)> {
    let (list, state, resource) = match section {
        "ListenersConfigDump" => ("dynamic_listeners", "active_state", "listener"),
        "RoutesConfigDump" => ("dynamic_route_configs", "", "route_config"),
        "SecretsConfigDump" => ("dynamic_active_secrets", "", "secret"),
        _ => ("dynamic_active_clusters", "", "cluster"),
    };
    dump_section(dump, section)[list]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|entry| {
            let active = if state.is_empty() {
                entry.clone()
            } else {
                entry[state].clone()
            };
            let mut config = active[resource].clone();
            // Not part of the resource: where it was sent from.
            config.as_object_mut().map(|o| o.remove("@type"));
            let name = config["name"].as_str().unwrap_or_default().to_owned();
            (name, (active["version_info"].clone(), config))
        })
        .collect()
}

/// Envoy and shunt on the same ADS stream end with the same listeners, clusters, routes
/// (RDS) and secrets (SDS, keys redacted alike), and the same connection reaches the
/// same endpoint through either.
#[test]
fn envoy_and_shunt_reach_the_same_config() {
    let (dir, socket, server) = unix_server("interop");
    let pki = support::pki::Pki::new("interop-pki");
    let (chain, key) = pki.server("interop");
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("backend", 1), eds_cluster("other", 2)],
    );
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![endpoints("backend", ECHO_A), endpoints("other", ECHO_B)],
    );
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![
            listener("l1", LISTEN_PORT, "backend"),
            listener("l2", LISTEN_PORT + 1, "other"),
            named(
                "h1",
                &resources::http_listener("h1", local(LISTEN_PORT + 2), "routes"),
            ),
            named(
                "t1",
                &resources::tls_tcp_proxy_listener(
                    "t1",
                    local(LISTEN_PORT + 3),
                    "backend",
                    ads_source(),
                    "default",
                    None,
                ),
            ),
        ],
    );
    server.set(
        type_urls::ROUTE,
        "r1",
        vec![named(
            "routes",
            &resources::route_config("routes", &[("/other", "other"), ("/", "backend")]),
        )],
    );
    server.set(
        type_urls::SECRET,
        "s1",
        vec![named(
            "default",
            &resources::certificate_secret("default", &chain, &key),
        )],
    );
    let config = dir.0.join("bootstrap.json");

    let mut node = Node::new().unwrap();
    let shunt_pod = node.add_pod("s").unwrap();
    let envoy_pod = node.add_pod("e").unwrap();
    let _echo_s = start_app(&shunt_pod, &[ECHO_A, ECHO_B]);
    let _echo_e = start_app(&envoy_pod, &[ECHO_A, ECHO_B]);
    let shunt = start_shunt(
        &shunt_pod,
        &config,
        &bootstrap(&socket, true),
        &["--concurrency", "1"],
    );
    let envoy = envoy_pod
        .command(support::envoy::bin())
        .args([
            "--concurrency",
            "1",
            "-l",
            "warning",
            "--base-id",
            "31",
            "-c",
        ])
        .arg(&config)
        .spawn()
        .expect("start envoy");
    eventually("shunt ready", &shunt, &server, || {
        admin(&shunt_pod, "/ready").0 == 200
    });
    eventually("envoy ready", &envoy, &server, || {
        admin(&envoy_pod, "/ready").0 == 200
    });
    // Both ACKed the listeners before they are compared.
    eventually("both ACK l1", &shunt, &server, || {
        server
            .requests()
            .iter()
            .filter(|r| r.type_url == type_urls::LISTENER && r.is_ack())
            .map(|r| r.stream)
            .collect::<std::collections::HashSet<_>>()
            .len()
            == 2
    });

    let shunt_dump = config_dump(&shunt_pod);
    let envoy_dump = config_dump(&envoy_pod);
    for (section, count) in [
        ("ListenersConfigDump", 4),
        ("ClustersConfigDump", 2),
        ("RoutesConfigDump", 1),
        ("SecretsConfigDump", 1),
    ] {
        let ours = dynamic_resources(&shunt_dump, section);
        let theirs = dynamic_resources(&envoy_dump, section);
        assert_eq!(ours.len(), count, "{section}: {ours:?}");
        assert_eq!(ours, theirs, "{section} differ");
    }
    assert_eq!(
        dump_section(&shunt_dump, "ClustersConfigDump")["version_info"],
        dump_section(&envoy_dump, "ClustersConfigDump")["version_info"]
    );
    for pod in [&shunt_pod, &envoy_pod] {
        assert_eq!(reaches(pod), Some(ECHO_A), "through {}", pod.name());
    }
}

/// A protobuf `Struct` as JSON, to compare node metadata with the bootstrap's.
fn struct_json(s: &envoy_types::pb::google::protobuf::Struct) -> Value {
    use envoy_types::pb::google::protobuf::value::Kind;
    fn value(v: &envoy_types::pb::google::protobuf::Value) -> Value {
        match &v.kind {
            Some(Kind::StringValue(s)) => Value::from(s.clone()),
            Some(Kind::NumberValue(n)) => Value::from(*n),
            Some(Kind::BoolValue(b)) => Value::from(*b),
            Some(Kind::StructValue(s)) => struct_json(s),
            Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value).collect()),
            Some(Kind::NullValue(_)) | None => Value::Null,
        }
    }
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value(v)))
            .collect(),
    )
}

/// Numbers as the JSON of a protobuf `Struct` carries them (doubles).
fn as_doubles(v: &Value) -> Value {
    match v {
        Value::Number(n) => Value::from(n.as_f64().unwrap_or_default()),
        Value::Array(items) => Value::Array(items.iter().map(as_doubles).collect()),
        Value::Object(o) => {
            Value::Object(o.iter().map(|(k, v)| (k.clone(), as_doubles(v))).collect())
        }
        other => other.clone(),
    }
}

/// Istio's own bootstraps (the corpus's golden files) drive the client: it dials the Unix
/// socket the bootstrap names, speaks Delta as `ads_config` says, sends the node (id and
/// metadata) on the first message only, and serves what comes back.
#[test]
fn istio_bootstraps_drive_the_client() {
    // Copied from the shared corpus (tests/fixtures/SOURCES.md): Istio's 30 goldens.
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/istio/bootstrap");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&corpus)
        .unwrap_or_else(|e| {
            panic!(
                "the golden bootstraps are missing at {}: {e}",
                corpus.display()
            )
        })
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with("_golden.json"))
        .collect();
    files.sort();
    assert_eq!(
        files.len(),
        ISTIO_GOLDEN_BOOTSTRAPS,
        "Istio's golden bootstraps in {}: {files:?}",
        corpus.display()
    );
    let mut node = Node::new().unwrap();
    let pod = node.add_pod("istio").unwrap();
    let _echo = start_app(&pod, &[ECHO_A]);
    let dir = TempDir::new("istio");
    let mut served = Vec::new();
    for file in &files {
        // Every one must validate; if one did not, `--mode validate` says why.
        let check = std::process::Command::new(shunt_bin())
            .args(["proxy", "--mode", "validate", "-c"])
            .arg(file)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "{}: not servable: {}",
            file.display(),
            String::from_utf8_lossy(&check.stderr).trim()
        );
        let bootstrap: Value = serde_json::from_slice(&std::fs::read(file).unwrap()).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let pipe = bootstrap["static_resources"]["clusters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "xds-grpc")
            .and_then(|c| c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]["path"].as_str())
            .unwrap_or_else(|| panic!("{name}: no xds-grpc pipe"))
            .to_owned();
        let socket = PathBuf::from(&pipe);
        let server = AdsServer::start(Listen::Unix(socket.clone())).expect("ADS server");
        open_to_the_proxy(socket.parent().unwrap(), &socket);
        let mut cluster = eds_cluster("echo", 1);
        cluster.0 = "echo".into();
        server.set(type_urls::CLUSTER, "1", vec![cluster]);
        server.set(type_urls::ENDPOINT, "1", vec![endpoints("echo", ECHO_A)]);
        server.set(
            type_urls::LISTENER,
            "1",
            vec![listener("echo", LISTEN_PORT, "echo")],
        );

        let admin_address = format!(
            "{}:{}",
            bootstrap["admin"]["address"]["socket_address"]["address"]
                .as_str()
                .unwrap(),
            bootstrap["admin"]["address"]["socket_address"]["port_value"]
        );
        let proxy = pod
            .command(shunt_bin())
            .args(["proxy", "--concurrency", "1", "-c"])
            .arg(file)
            .spawn()
            .expect("start shunt proxy");
        eventually(&format!("{name}: ready"), &proxy, &server, || {
            admin_at(&pod, &admin_address, "/ready").0 == 200
                && acked(&server, type_urls::LISTENER, "1", true)
        });
        let requests = server.requests();
        let first = &requests[0];
        assert!(first.delta, "{name}: DELTA_GRPC");
        let node = first
            .node
            .as_ref()
            .unwrap_or_else(|| panic!("{name}: no node on the first message"));
        assert_eq!(node.id, bootstrap["node"]["id"].as_str().unwrap(), "{name}");
        assert_eq!(
            node.cluster,
            bootstrap["node"]["cluster"].as_str().unwrap_or(""),
            "{name}"
        );
        assert_eq!(
            struct_json(node.metadata.as_ref().unwrap()),
            as_doubles(&bootstrap["node"]["metadata"]),
            "{name}: node metadata"
        );
        assert!(
            requests[1..].iter().all(|r| r.node.is_none()),
            "{name}: set_node_on_first_message_only"
        );
        assert_eq!(
            reaches(&pod),
            Some(ECHO_A),
            "{name}: serving what came over xDS"
        );
        drop(proxy);
        server.stop();
        served.push(name);
        // The next proxy binds the same ports.
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(dir);
    assert_eq!(
        served.len(),
        ISTIO_GOLDEN_BOOTSTRAPS,
        "only {} of Istio's {ISTIO_GOLDEN_BOOTSTRAPS} golden bootstraps validated and served: {served:?}",
        served.len()
    );
}

/// The edges of applying updates: a cluster whose endpoints never come stops warming
/// after `initial_fetch_timeout` and is served without hosts; a listener whose port is
/// taken is NACKed by name while the rest of its update applies; a removed cluster lets its open
/// connections finish while new ones find no cluster.
#[test]
fn fetch_timeouts_unbindable_ports_and_removed_clusters() {
    let (dir, socket, server) = unix_server("edges");
    server.set(
        type_urls::CLUSTER,
        "c1",
        vec![eds_cluster("backend", 1), eds_cluster("silent", 1)],
    );
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![endpoints("backend", ECHO_A)],
    );
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![
            listener("l1", LISTEN_PORT, "backend"),
            listener("silent", LISTEN_PORT + 1, "silent"),
        ],
    );
    let mut bootstrap = bootstrap(&socket, false);
    bootstrap["dynamic_resources"]["cds_config"]["initial_fetch_timeout"] = "1s".into();
    let config = dir.0.join("bootstrap.json");

    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    // ECHO_B's port doubles as the port a listener will find taken.
    let _echo = start_app(&pod, &[ECHO_A, ECHO_B]);
    let started = std::time::Instant::now();
    let proxy = start_shunt(&pod, &config, &bootstrap, &["--concurrency", "1"]);

    // "silent" never gets endpoints: ready once its 1 s wait is over, served without hosts.
    eventually("ready", &proxy, &server, || admin(&pod, "/ready").0 == 200);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "ready before initial_fetch_timeout passed"
    );
    let dump = config_dump(&pod);
    let clusters = dump_section(&dump, "ClustersConfigDump");
    assert!(clusters["dynamic_warming_clusters"].is_null(), "{clusters}");
    let active: Vec<&str> = clusters["dynamic_active_clusters"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["cluster"]["name"].as_str())
        .collect();
    assert_eq!(active, ["backend", "silent"]);
    assert_eq!(reaches(&pod), Some(ECHO_A));
    assert_eq!(
        xds::reach(&pod, local(LISTEN_PORT + 1)),
        Reach::ClosedByProxy,
        "no hosts: accepted and closed (UH)"
    );

    // A listener on a taken port: NACKed, the others as the update says (judged listener
    // by listener, as Envoy does: l1 stays, silent goes).
    server.set(
        type_urls::LISTENER,
        "l2",
        vec![
            listener("l1", LISTEN_PORT, "backend"),
            listener("taken", ECHO_B, "backend"),
        ],
    );
    let nack = server
        .wait_for(Duration::from_secs(10), |r| {
            r.type_url == type_urls::LISTENER && r.is_nack()
        })
        .expect("the unbindable listener is NACKed");
    let (_, message) = nack.error_detail.clone().unwrap();
    assert!(
        message.contains(&format!("cannot listen on 127.0.0.1:{ECHO_B}")),
        "{message}"
    );
    assert!(
        message.starts_with("Error adding/updating listener(s) taken: "),
        "{message}"
    );
    assert_eq!(
        nack.version_info, "l1",
        "a NACK names the last version accepted whole"
    );
    assert_eq!(reaches(&pod), Some(ECHO_A));
    eventually("silent removed", &proxy, &server, || {
        pod.run_in_netns(|| TcpStream::connect(local(LISTEN_PORT + 1)).is_err())
            .unwrap()
    });
    let dump = config_dump(&pod);
    let listeners = dump_section(&dump, "ListenersConfigDump");
    assert_eq!(
        listeners["version_info"], "l2",
        "l2 changed listeners: {listeners}"
    );
    let taken = listeners["dynamic_listeners"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "taken")
        .unwrap_or_else(|| panic!("no error state for taken: {listeners}"));
    assert!(taken["active_state"].is_null(), "{taken}");
    assert!(
        taken["error_state"]["details"]
            .as_str()
            .is_some_and(|d| d.contains("cannot listen on")),
        "{taken}"
    );

    // The cluster goes while a connection through it is open: that one finishes, new
    // ones find no cluster.
    let mut held = pod
        .run_in_netns(|| TcpStream::connect(local(LISTEN_PORT)))
        .unwrap()
        .unwrap();
    held.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut byte = [0u8; 1];
    while held.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {}
    server.set(type_urls::CLUSTER, "c3", vec![eds_cluster("silent", 1)]);
    eventually("CDS c3 applied", &proxy, &server, || {
        acked(&server, type_urls::CLUSTER, "c3", false)
    });
    assert_eq!(
        xds::reach(&pod, local(LISTEN_PORT)),
        Reach::ClosedByProxy,
        "backend is gone: accepted and closed (NC)"
    );
    held.write_all(b"still here").unwrap();
    let mut back = [0u8; 10];
    held.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"still here");
}

/// ADS over TCP in TLS, as the xDS cluster's `UpstreamTlsContext` says: the server's
/// certificate is verified against `trusted_ca` (and the IP it is reached at), gRPC runs
/// over h2 inside it; a proxy trusting another CA never gets a request through.
#[test]
fn tls_to_the_xds_server() {
    let pki = support::pki::Pki::new("tls");
    pki.issue("xds", "ca", "IP:127.0.0.1");
    // A second CA that did not sign the server's certificate.
    pki.ca("other");

    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    let _echo = start_app(&pod, &[ECHO_A]);
    let listen = Listen::TcpTls {
        addr: local(0),
        cert: pki.dir.0.join("xds.pem"),
        key: pki.dir.0.join("xds.key"),
        client_ca: None,
    };
    // The server lives in the pod, where the proxy reaches it on 127.0.0.1.
    let server = pod
        .run_in_netns(move || AdsServer::start(listen))
        .unwrap()
        .expect("TLS ADS server");
    let port = server.local_addr().unwrap().port();
    xds::serve_backend(&server, eds_cluster("backend", 1), ECHO_A, LISTEN_PORT);
    let tls_bootstrap = |ca: std::path::PathBuf| {
        let mut b = bootstrap(std::path::Path::new("/unused"), true);
        b["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
            [0]["endpoint"]["address"] =
            serde_json::json!({"socket_address": {"address": "127.0.0.1", "port_value": port}});
        b["static_resources"]["clusters"][0]["transport_socket"] = serde_json::json!({
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {"trusted_ca": {"filename": ca.display().to_string()}}}
            }
        });
        b
    };

    // Trusting the CA that signed the server: configured over TLS, and serving.
    let config = pki.dir.0.join("bootstrap.json");
    let proxy = start_shunt(
        &pod,
        &config,
        &tls_bootstrap(pki.dir.0.join("ca.pem")),
        &["--concurrency", "1"],
    );
    eventually("ready over TLS", &proxy, &server, || {
        admin(&pod, "/ready").0 == 200
    });
    eventually("LDS ACKed over TLS", &proxy, &server, || {
        acked(&server, type_urls::LISTENER, "l1", true)
    });
    assert_eq!(reaches(&pod), Some(ECHO_A));
    drop(proxy);
    let streams_before = server.requests().iter().map(|r| r.stream).max().unwrap();

    // Trusting another CA: the handshake fails, nothing reaches the server.
    let config = pki.dir.0.join("bootstrap-other.json");
    let proxy = start_shunt(
        &pod,
        &config,
        &tls_bootstrap(pki.dir.0.join("other.pem")),
        &["--concurrency", "1"],
    );
    eventually("a refused handshake", &proxy, &server, || {
        proxy.stderr_text().contains("xDS stream ended")
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        server.requests().iter().all(|r| r.stream <= streams_before),
        "an unverified server got a request"
    );
    let stderr = proxy.stderr_text();
    assert!(stderr.to_lowercase().contains("certificate"), "{stderr}");
    assert_ne!(admin(&pod, "/ready").0, 200, "not ready without config");
}
