//! Istio's listeners from a static bootstrap, in a captured pod: pod a runs `shunt capture
//! --backend ebpf` and `shunt proxy -c` with the listeners an Istio sidecar gets over
//! xDS, written by hand: `virtualOutbound` (15001, `use_original_dst`) handing each
//! connection to the listener of its original destination, else to a catch-all
//! `tcp_proxy`; one outbound service listener that binds nothing (`bind_to_port: false`);
//! `virtualInbound` (15006) passing inbound connections to the app from 127.0.0.6.
//!
//! Pods b and c are plain (no capture, no proxy). The service listener for b:8080 routes
//! to a STATIC cluster whose only endpoint is c:8080, so an answer from c to a call to b
//! proves the hand-off chose that listener. Counters on a's admin API must agree.
//!
//! ALLOW_ANY sends unknown destinations to `PassthroughCluster` (ORIGINAL_DST);
//! REGISTRY_ONLY sends them to `BlackHoleCluster`, which has no endpoints (flag UH).
//! Needs root.

mod support;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use harness::{Node, Pod, PodProcess, shunt_bin};
use serde_json::Value;
use support::*;

/// The admin API inside pod a (each pod has its own loopback).
const ADMIN: &str = "127.0.0.1:15000";

#[derive(Clone, Copy, PartialEq, Eq)]
enum OutboundPolicy {
    AllowAny,
    RegistryOnly,
}

/// A tcp_proxy filter to `cluster`, its access log on stdout.
fn tcp_proxy(stat_prefix: &str, cluster: &str) -> Value {
    serde_json::json!({
        "name": "envoy.filters.network.tcp_proxy",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
            "stat_prefix": stat_prefix,
            "cluster": cluster,
            "access_log": [{
                "name": "envoy.access_loggers.stdout",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"}
            }]
        }
    })
}

fn socket_address(ip: impl ToString, port: u16) -> Value {
    serde_json::json!({"socket_address": {"address": ip.to_string(), "port_value": port}})
}

/// The bootstrap of pod a: Istio's virtualOutbound / virtualInbound, the listener for
/// service b's address, and Istio's passthrough and black-hole clusters.
fn istio_bootstrap(b: Ipv4Addr, c: Ipv4Addr, policy: OutboundPolicy) -> Value {
    let catch_all = match policy {
        OutboundPolicy::AllowAny => "PassthroughCluster",
        OutboundPolicy::RegistryOnly => "BlackHoleCluster",
    };
    serde_json::json!({
        "node": {"id": "sidecar~10.77.0.10~a.default~default.svc.cluster.local", "cluster": "a.default"},
        "admin": {"address": socket_address("127.0.0.1", 15000)},
        "static_resources": {
            "listeners": [
                {
                    "name": "virtualOutbound",
                    "address": socket_address("0.0.0.0", 15001),
                    "use_original_dst": true,
                    "traffic_direction": "OUTBOUND",
                    "filter_chains": [
                        {
                            "name": "virtualOutbound-blackhole",
                            "filter_chain_match": {"destination_port": 15001},
                            "filters": [tcp_proxy("BlackHoleCluster", "BlackHoleCluster")]
                        },
                        {
                            "name": "virtualOutbound-catchall-tcp",
                            "filters": [tcp_proxy(catch_all, catch_all)]
                        }
                    ]
                },
                {
                    "name": format!("{b}_8080"),
                    "address": socket_address(b, 8080),
                    "bind_to_port": false,
                    "traffic_direction": "OUTBOUND",
                    "filter_chains": [{"filters": [tcp_proxy("outbound|8080||b", "outbound|8080||b")]}]
                },
                {
                    "name": "virtualInbound",
                    "address": socket_address("0.0.0.0", 15006),
                    "traffic_direction": "INBOUND",
                    "listener_filters": [{
                        "name": "envoy.filters.listener.original_dst",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}
                    }],
                    "filter_chains": [
                        {
                            "name": "virtualInbound-blackhole",
                            "filter_chain_match": {"destination_port": 15006},
                            "filters": [tcp_proxy("BlackHoleCluster", "BlackHoleCluster")]
                        },
                        {
                            "name": "virtualInbound",
                            "filter_chain_match": {"prefix_ranges": [{"address_prefix": "0.0.0.0", "prefix_len": 0}]},
                            "filters": [tcp_proxy("InboundPassthroughClusterIpv4", "InboundPassthroughClusterIpv4")]
                        }
                    ]
                }
            ],
            "clusters": [
                {"name": "PassthroughCluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "10s"},
                {
                    "name": "InboundPassthroughClusterIpv4",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "10s",
                    "upstream_bind_config": {"source_address": {"address": "127.0.0.6", "port_value": 0}}
                },
                {"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"},
                {
                    "name": "outbound|8080||b",
                    "type": "STATIC",
                    "connect_timeout": "10s",
                    "load_assignment": {
                        "cluster_name": "outbound|8080||b",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": socket_address(c, 8080)}}]}]
                    }
                }
            ]
        }
    })
}

/// The bootstrap in a file of its own, removed when dropped.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn new(tag: &str, bootstrap: &Value) -> Self {
        let path = std::env::temp_dir().join(format!(
            "shunt-istio-static-{}-{tag}.json",
            std::process::id()
        ));
        std::fs::write(&path, serde_json::to_vec_pretty(bootstrap).unwrap()).unwrap();
        ConfigFile(path)
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One HTTP/1.1 request to a's admin API, from inside a's network namespace (the test
/// thread is not in a's cgroup, so capture leaves it alone).
fn admin(pod: &Pod, method: &str, path: &str) -> (u16, String) {
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    pod.run_in_netns(move || -> std::io::Result<(u16, String)> {
        let mut stream = TcpStream::connect(ADMIN)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
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
    .expect("entering pod a")
    .unwrap_or((0, String::new()))
}

/// Waits for `/ready` to say LIVE: listeners bound, clusters warmed.
fn wait_ready(pod: &Pod, proxy: &PodProcess) {
    wait_until(
        "ready",
        proxy,
        || admin(pod, "GET", "/ready") == (200, "LIVE\n".to_owned()),
        String::new,
    );
}

/// Counters and gauges from `/stats?format=json`.
fn stat(pod: &Pod, name: &str) -> Option<u64> {
    xds::stat_at(pod, ADMIN, name)
}

/// The uids (real, effective, saved, filesystem) of every thread of a process: the
/// admin API's thread starts before privileges are dropped, and must lose them too.
fn thread_uids(pid: u32) -> Vec<u32> {
    let mut uids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        let ids = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
        uids.extend(ids.split_whitespace().map(|id| id.parse::<u32>().unwrap()));
    }
    uids
}

struct Scene {
    _node: Node,
    a: Pod,
    b: Pod,
    c: Pod,
    capture: Capture,
    proxy: PodProcess,
    _apps: Vec<PodProcess>,
    _config: ConfigFile,
}

/// Pods a (captured, shunt proxy -c with Istio's listeners, an app on 8080), b (plain)
/// and c (plain, an app on 8080).
fn scene(policy: OutboundPolicy, tag: &str) -> Scene {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let c = node.add_pod("c").expect("pod c");
    let capture = Capture::new("ebpf", &format!("istio-static-{tag}"));
    capture.install(&a, &[]);
    let config = ConfigFile::new(tag, &istio_bootstrap(b.ipv4(), c.ipv4(), policy));
    // As root: shunt binds, then drops to 1337 (its defaults, --uid and --gid).
    let proxy = a
        .command(shunt_bin())
        .args(["proxy", "--concurrency", "2", "-c"])
        .arg(&config.0)
        .spawn()
        .expect("start shunt proxy -c");
    wait_ready(&a, &proxy);
    let uids = thread_uids(proxy.pid());
    assert!(
        uids.len() > 4 && uids.iter().all(|&uid| uid == PROXY_UID),
        "every thread of shunt proxy runs as 1337: {uids:?}"
    );
    let apps = vec![start_app(&a, &[8080]), start_app(&c, &[8080])];
    Scene {
        _node: node,
        a,
        b,
        c,
        capture,
        proxy,
        _apps: apps,
        _config: config,
    }
}

fn v4(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

/// a's app calls b:8080; the connection is handed to b's listener, whose only endpoint
/// is c: c's app answers.
fn a_calling_b_reaches_c_through_the_hand_off(s: &Scene) {
    let target = v4(s.b.ipv4(), 8080);
    let call = Caller::app(&s.a)
        .call(target)
        .unwrap_or_else(|e| panic!("a -> b:8080: {e:#}\n{}", s.proxy.stderr_text()));
    assert_eq!(
        call.server_local,
        v4(s.c.ipv4(), 8080),
        "the call to b should be answered by c"
    );
    assert_eq!(call.server_peer.ip(), IpAddr::V4(s.a.ipv4()));
    let log = log_entry_for(&s.proxy, call.client_local).expect("a's proxy logged the call");
    assert_eq!(log["upstream_cluster"], "outbound|8080||b");
    assert_eq!(
        log["upstream_host"],
        v4(s.c.ipv4(), 8080).to_string().as_str()
    );
    assert_eq!(log["original_dst"], target.to_string().as_str());
    assert_eq!(log["direction"], "outbound");
    assert_eq!(log["response_flags"], "-");
    let listener = format!("listener.{}_8080.downstream_cx_total", s.b.ipv4());
    assert_eq!(stat(&s.a, &listener), Some(1), "{listener}");
    assert_eq!(
        stat(&s.a, "cluster.outbound|8080||b.upstream_cx_total"),
        Some(1)
    );
}

/// b (not captured) calls a:8080: a's virtualInbound takes it and a's app sees it come
/// from 127.0.0.6.
fn b_calling_a_arrives_from_127_0_0_6(s: &Scene) {
    let target = v4(s.a.ipv4(), 8080);
    let call = Caller::app(&s.b)
        .call(target)
        .unwrap_or_else(|e| panic!("b -> a:8080: {e:#}\n{}", s.proxy.stderr_text()));
    assert_eq!(
        call.server_peer.ip(),
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6))
    );
    assert_eq!(call.server_local, target);
    let log = harness::access_log(&s.proxy)
        .into_iter()
        .find(|v| v["downstream_remote_address"] == call.client_local.to_string().as_str())
        .or_else(|| log_entry_for(&s.proxy, call.client_local))
        .expect("a's proxy logged the inbound call");
    assert_eq!(log["direction"], "inbound");
    assert_eq!(log["upstream_cluster"], "InboundPassthroughClusterIpv4");
    assert_eq!(log["upstream_host"], target.to_string().as_str());
    assert_eq!(
        stat(&s.a, "listener.0.0.0.0_15006.downstream_cx_total"),
        Some(1)
    );
    assert_eq!(
        stat(
            &s.a,
            "cluster.InboundPassthroughClusterIpv4.upstream_cx_total"
        ),
        Some(1)
    );
}

#[test]
fn allow_any_hands_off_by_destination_and_passes_the_rest_through() {
    let s = scene(OutboundPolicy::AllowAny, "allow-any");
    a_calling_b_reaches_c_through_the_hand_off(&s);

    // No listener for c:8080: virtualOutbound's catch-all passes it through.
    let target = v4(s.c.ipv4(), 8080);
    let call = Caller::app(&s.a)
        .call(target)
        .unwrap_or_else(|e| panic!("a -> c:8080: {e:#}\n{}", s.proxy.stderr_text()));
    assert_eq!(call.server_local, target);
    let log = log_entry_for(&s.proxy, call.client_local).expect("a's proxy logged the call");
    assert_eq!(log["upstream_cluster"], "PassthroughCluster");
    assert_eq!(log["upstream_host"], target.to_string().as_str());
    assert_eq!(
        stat(&s.a, "listener.0.0.0.0_15001.downstream_cx_total"),
        Some(1),
        "the handed-off call counts on b's listener, not on virtualOutbound"
    );
    assert_eq!(
        stat(&s.a, "cluster.PassthroughCluster.upstream_cx_total"),
        Some(1)
    );

    b_calling_a_arrives_from_127_0_0_6(&s);
    s.capture.cleanup(&s.a);
}

#[test]
fn registry_only_closes_unknown_destinations_and_still_serves_services() {
    let s = scene(OutboundPolicy::RegistryOnly, "registry-only");

    let target = v4(s.c.ipv4(), 8080);
    let refused = Caller::app(&s.a).call(target);
    assert!(
        refused.is_err(),
        "a -> c:8080 should be closed: {refused:?}"
    );
    let log = harness::access_log(&s.proxy)
        .into_iter()
        .find(|v| v["original_dst"] == target.to_string().as_str())
        .or_else(|| {
            std::thread::sleep(Duration::from_secs(1));
            harness::access_log(&s.proxy)
                .into_iter()
                .find(|v| v["original_dst"] == target.to_string().as_str())
        })
        .unwrap_or_else(|| panic!("no log line for c:8080: {}", s.proxy.stdout_text()));
    assert_eq!(log["upstream_cluster"], "BlackHoleCluster");
    assert_eq!(log["response_flags"], "UH");
    assert!(log["upstream_host"].is_null());
    assert_eq!(
        stat(&s.a, "cluster.BlackHoleCluster.upstream_cx_none_healthy"),
        Some(1)
    );
    assert_eq!(
        stat(&s.a, "cluster.BlackHoleCluster.upstream_cx_total"),
        Some(0)
    );

    // A service the mesh knows still works.
    a_calling_b_reaches_c_through_the_hand_off(&s);
    b_calling_a_arrives_from_127_0_0_6(&s);
    s.capture.cleanup(&s.a);
}
