//! `envoy.filters.network.ext_authz`, differential against Envoy 1.40: the same
//! bootstrap (but ports) in `shunt proxy -c` and Envoy in pod `proxy`, the grpcio
//! authorization server (tests/support/ext_authz_server.py, which decides a TCP
//! check by the last digit of the destination port) and a speak-second TCP backend in
//! pod `backends`, the same connections from pod `client` to six listeners: allowed,
//! denied, a failing check, a failing check with `failure_mode_allow`, and a dead
//! authorization server without and with `failure_mode_allow`. What each connection
//! reads (the backend's answer, or nothing when closed), the `ext_authz.*` counters
//! and each connection's `%RESPONSE_FLAGS%` in tcp_proxy's access log (`UAEX` when
//! ext_authz closed it) must be equal.
//!
//! Needs root, Envoy and grpcio (`cargo xtask setup`).

mod support;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use harness::{Node, Pod, PodProcess, wait_for_port};
use serde_json::{Value, json};
use support::TempDir;
use support::envoy::socket_address;
use support::xds::admin_at;

const SHUNT_PORT: u16 = 10000;
const ENVOY_PORT: u16 = 11000;
const SHUNT_ADMIN: u16 = 15000;
const ENVOY_ADMIN: u16 = 15100;
const BACKEND_PORT: u16 = 9001;
const AUTHZ_PORT: u16 = 9191;
/// Nothing listens there: checks to it fail.
const AUTHZ_DOWN_PORT: u16 = 9199;

/// Answers a connection's first bytes with "A" and closes it.
const TCP_SERVER: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(64)
while True:
    c, _ = s.accept()
    c.recv(100)
    c.sendall(b"A")
    c.close()
"#;

fn cluster(name: &str, ip: Ipv4Addr, port: u16, http2: bool) -> Value {
    let mut c = json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(ip, port)}}
        ]}]}
    });
    if http2 {
        c["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        });
    }
    c
}

/// A listener at `port`: network ext_authz (to `authz`) in front of `tcp_proxy`.
fn listener(name: &str, port: u16, authz: &str, failure_mode_allow: bool, log: &str) -> Value {
    json!({
        "name": name,
        "address": socket_address("0.0.0.0", port),
        "filter_chains": [{"filters": [
            {"name": "envoy.filters.network.ext_authz", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.ext_authz.v3.ExtAuthz",
                "stat_prefix": name,
                "grpc_service": {"envoy_grpc": {"cluster_name": authz}, "timeout": "2s"},
                "transport_api_version": "V3",
                "failure_mode_allow": failure_mode_allow
            }},
            {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                "stat_prefix": name, "cluster": "backend",
                "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": log,
                    // shunt writes these two fields in its own JSON line.
                    "log_format": {"json_format": {
                        "downstream_local_address": "%DOWNSTREAM_LOCAL_ADDRESS%",
                        "response_flags": "%RESPONSE_FLAGS%"
                    }}
                }}]
            }}
        ]}]
    })
}

/// The listeners, by offset from `base` (the server decides by the port's last digit).
const LISTENERS: &[(u16, &str, &str, bool)] = &[
    (0, "allowed", "authz", false),
    (1, "denied", "authz", false),
    (2, "failing", "authz", false),
    (3, "failing_allowed", "authz", true),
    (4, "down", "authz_down", false),
    (5, "down_allowed", "authz_down", true),
];

fn bootstrap(base: u16, admin: u16, backends: Ipv4Addr, log: &str) -> Value {
    // Offsets 2 and 3 both fail at the server: 3's last digit is not 2, so it gets a
    // listener whose port ends in 2 as well (base + 12).
    let listeners: Vec<Value> = LISTENERS
        .iter()
        .map(|(offset, name, authz, allow)| {
            let port = if *offset == 3 {
                base + 12
            } else {
                base + offset
            };
            listener(name, port, authz, *allow, log)
        })
        .collect();
    json!({
        "admin": {"address": socket_address("127.0.0.1", admin)},
        "static_resources": {
            "listeners": listeners,
            "clusters": [
                cluster("backend", backends, BACKEND_PORT, false),
                cluster("authz", backends, AUTHZ_PORT, true),
                cluster("authz_down", backends, AUTHZ_DOWN_PORT, true),
            ]
        }
    })
}

fn port_of(base: u16, offset: u16) -> u16 {
    if offset == 3 {
        base + 12
    } else {
        base + offset
    }
}

struct Scene {
    _node: Node,
    proxy_pod: Pod,
    client: Pod,
    shunt: PodProcess,
    envoy: PodProcess,
    _backends: Vec<PodProcess>,
    dir: TempDir,
}

impl Scene {
    fn new() -> Scene {
        let mut node = Node::new().expect("node");
        let proxy_pod = node.add_pod("proxy").expect("pod proxy");
        let backends = node.add_pod("backends").expect("pod backends");
        let client = node.add_pod("client").expect("pod client");
        let dir = TempDir::new("network-ext-authz");
        let backend = backends
            .command("/usr/bin/python3")
            .args(["-c", TCP_SERVER, &BACKEND_PORT.to_string()])
            .spawn()
            .expect("start the backend");
        let (python, path) = support::python_grpc();
        let authz = backends
            .command(&python)
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/support/ext_authz_server.py"
            ))
            .arg(AUTHZ_PORT.to_string())
            .env("PYTHONPATH", &path)
            .spawn()
            .expect("start the ext_authz server");
        let any6 = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, AUTHZ_PORT));
        for (at, process) in [
            (SocketAddr::from(([127, 0, 0, 1], BACKEND_PORT)), &backend),
            (any6, &authz),
        ] {
            wait_for_port(&backends, at, Duration::from_secs(20))
                .unwrap_or_else(|e| panic!("backend {at}: {e}\n{}", process.stderr_text()));
        }
        let write = |name: &str, config: Value| {
            let file = dir.0.join(name);
            std::fs::write(&file, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
            file
        };
        let b = backends.ipv4();
        // shunt writes its log after dropping to the proxy's uid.
        std::os::unix::fs::chown(&dir.0, Some(1337), Some(1337)).unwrap();
        let log = |side: &str| dir.0.join(format!("{side}.log")).display().to_string();
        let shunt_config = write(
            "shunt.json",
            bootstrap(SHUNT_PORT, SHUNT_ADMIN, b, &log("shunt")),
        );
        let envoy_config = write(
            "envoy.json",
            bootstrap(ENVOY_PORT, ENVOY_ADMIN, b, &log("envoy")),
        );
        let (shunt, envoy) = support::envoy::start_side_by_side(
            &proxy_pod,
            &shunt_config,
            &envoy_config,
            [SHUNT_PORT + 12, ENVOY_PORT + 12],
        );
        Scene {
            _node: node,
            proxy_pod,
            client,
            shunt,
            envoy,
            _backends: vec![backend, authz],
            dir,
        }
    }

    /// What a connection from the client pod reads after sending "hello".
    fn tcp(&self, port: u16) -> String {
        let at = SocketAddr::new(self.proxy_pod.ipv4().into(), port);
        self.client
            .run_in_netns(move || {
                let mut stream = TcpStream::connect_timeout(&at, Duration::from_secs(5))?;
                stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                let _ = stream.write_all(b"hello");
                let mut got = Vec::new();
                // A closed (denied) connection reads as nothing.
                let _ = stream.read_to_end(&mut got);
                Ok::<_, std::io::Error>(String::from_utf8_lossy(&got).into_owned())
            })
            .expect("enter the client pod")
            .expect("connect through the proxy")
    }
}

/// The `ext_authz.*` counters that are not zero.
fn ext_authz_stats(pod: &Pod, admin: u16) -> BTreeMap<String, u64> {
    let (status, body) = admin_at(pod, &format!("127.0.0.1:{admin}"), "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| Some((s["name"].as_str()?.to_owned(), s["value"].as_u64()?)))
        .filter(|(name, value)| *value > 0 && name.starts_with("ext_authz."))
        .collect()
}

#[test]
fn connections_are_checked_and_closed_as_envoy_does() {
    let s = Scene::new();
    let expected = ["A", "", "", "A", "", "A"];
    let mut differences = Vec::new();
    for ((offset, name, _, _), expected) in LISTENERS.iter().zip(expected) {
        let envoy = s.tcp(port_of(ENVOY_PORT, *offset));
        let shunt = s.tcp(port_of(SHUNT_PORT, *offset));
        assert_eq!(envoy, expected, "{name}: what Envoy's connection read");
        if envoy != shunt {
            differences.push(format!("{name}: envoy {envoy:?}, shunt {shunt:?}"));
        }
    }
    let envoy = ext_authz_stats(&s.proxy_pod, ENVOY_ADMIN);
    let shunt = ext_authz_stats(&s.proxy_pod, SHUNT_ADMIN);
    for name in [
        "ext_authz.allowed.ok",
        "ext_authz.denied.denied",
        "ext_authz.failing.cx_closed",
        "ext_authz.down_allowed.failure_mode_allowed",
    ] {
        assert_eq!(envoy.get(name), Some(&1), "Envoy's {name}: {envoy:#?}");
    }
    if envoy != shunt {
        differences.push(format!("stats:\n  envoy {envoy:?}\n  shunt {shunt:?}"));
    }
    // Each listener's access log line; Envoy flushes its file on a timer.
    let flags = |side: &str| -> BTreeMap<String, String> {
        let base = if side == "envoy" {
            ENVOY_PORT
        } else {
            SHUNT_PORT
        };
        std::fs::read_to_string(s.dir.0.join(format!("{side}.log")))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let line: Value = serde_json::from_str(l).ok()?;
                let local: SocketAddr = line["downstream_local_address"].as_str()?.parse().ok()?;
                let (_, name, _, _) = LISTENERS
                    .iter()
                    .find(|(offset, ..)| port_of(base, *offset) == local.port())?;
                Some((
                    name.to_string(),
                    line["response_flags"].as_str()?.to_owned(),
                ))
            })
            .collect()
    };
    let logged = |side: &str| flags(side).len() == LISTENERS.len();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !(logged("envoy") && logged("shunt")) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (envoy, shunt) = (flags("envoy"), flags("shunt"));
    assert_eq!(
        envoy.get("denied").map(String::as_str),
        Some("UAEX"),
        "Envoy's flags: {envoy:?}"
    );
    if envoy != shunt {
        differences.push(format!(
            "response flags:\n  envoy {envoy:?}\n  shunt {shunt:?}"
        ));
    }
    assert!(
        differences.is_empty(),
        "{} differences from Envoy:\n{}\nshunt stderr:\n{}\nenvoy stderr:\n{}",
        differences.len(),
        differences.join("\n"),
        s.shunt.stderr_text(),
        s.envoy.stderr_text()
    );
}
