//! The local short-circuit under stress. Pods a and b are both captured with the
//! sockmap on; a's app calls b's app, so every byte crosses the short-circuited pair
//! a's proxy ↔ b's proxy (the app-facing hops stay on TCP, see ebpf/src/shortcircuit.rs)
//! and comes back. Each test checks the bytes, the app-visible semantics (half-close,
//! reset), that the short-circuit really carried them (counters), and that once the
//! connections are gone no socket, send state or original destination is left.

mod support;

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use harness::{Node, Pod, PodProcess, shunt_bin, testapp_bin};
use serde_json::Value;
use support::*;

struct Mesh {
    _node: Node,
    a: Pod,
    b: Pod,
    capture: Capture,
    _proxies: Vec<PodProcess>,
    echo_b: PodProcess,
    half_close_b: PodProcess,
}

const ECHO: u16 = 8080;
const HALF_CLOSE: u16 = 9090;

fn mesh(tag: &str) -> Mesh {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let capture = Capture::new("ebpf", tag);
    capture.install(&a, &[]);
    capture.install(&b, &[]);
    let proxies = vec![start_proxy(&a), start_proxy(&b)];
    let echo_b = start_app(&b, &[ECHO]);
    let half_close_b = b
        .command(testapp_bin())
        .args([
            "serve",
            "--mode",
            "half-close",
            "--listen",
            "0.0.0.0:9090",
            "--listen",
            "[::]:9090",
        ])
        .spawn()
        .expect("half-close server");
    harness::wait_for_port(
        &b,
        "127.0.0.1:9090".parse().unwrap(),
        Duration::from_secs(10),
    )
    .unwrap();
    Mesh {
        _node: node,
        a,
        b,
        capture,
        _proxies: proxies,
        echo_b,
        half_close_b,
    }
}

impl Mesh {
    fn b4(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.b.ipv4()), port)
    }

    fn state(&self) -> Value {
        let out = std::process::Command::new(shunt_bin())
            .args(["inspect", "--json", "--bpffs"])
            .arg(&self.capture.bpffs)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn counters(&self) -> HashMap<String, u64> {
        self.state()["counters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c[0].as_str().unwrap().to_string(), c[1].as_u64().unwrap()))
            .collect()
    }

    /// Once every connection has closed: no socket left in SOCK_PAIRS, no send state,
    /// no original destination (waits for the closes, asserts on what remains).
    fn assert_nothing_left(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut state = self.state();
        while Instant::now() < deadline && !drained(&state) {
            std::thread::sleep(Duration::from_millis(200));
            state = self.state();
        }
        assert_eq!(
            state["sockmap_sockets"], 0,
            "sockets left in SOCK_PAIRS: {state:#}"
        );
        assert_eq!(
            state["short_circuited"].as_array().unwrap().len(),
            0,
            "stale pair state: {state:#}"
        );
        assert_eq!(
            state["connections"].as_array().unwrap().len(),
            0,
            "stale original destinations: {state:#}"
        );
    }

    fn app(&self) -> Caller<'_> {
        Caller::app(&self.a)
    }

    /// Runs testapp as a's app (uid 1000) and parses the JSON line it prints.
    fn testapp(&self, args: &[&str]) -> Value {
        let out = self
            .a
            .command(testapp_bin())
            .uid(APP_UID)
            .gid(APP_UID)
            .timeout(Duration::from_secs(120))
            .args(args)
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "testapp {args:?}: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            )
        })
    }
}

fn drained(state: &Value) -> bool {
    state["sockmap_sockets"] == 0
        && state["short_circuited"]
            .as_array()
            .is_some_and(Vec::is_empty)
        && state["connections"].as_array().is_some_and(Vec::is_empty)
}

fn grew(before: &HashMap<String, u64>, after: &HashMap<String, u64>, name: &str) -> u64 {
    after.get(name).copied().unwrap_or(0) - before.get(name).copied().unwrap_or(0)
}

#[test]
fn payloads_from_one_byte_to_64_mib_arrive_intact() {
    let m = mesh("sockmap-payloads");
    let before = m.counters();
    let sizes = [
        1usize,
        2,
        1000,
        65_535,
        65_536,
        65_537,
        (1 << 20) + 7,
        16 << 20,
        64 << 20,
    ];
    for &bytes in &sizes {
        let caller = Caller { bytes, ..m.app() };
        let call = caller
            .call(m.b4(ECHO))
            .unwrap_or_else(|e| panic!("{bytes} bytes: {e:#}"));
        assert_eq!(call.bytes as usize, bytes);
        assert_eq!(
            call.server_peer.ip(),
            "127.0.0.6".parse::<IpAddr>().unwrap(),
            "through both proxies"
        );
    }
    let v6 = Caller {
        bytes: 3 << 20,
        ..m.app()
    }
    .call(SocketAddr::new(IpAddr::V6(m.b.ipv6()), ECHO))
    .expect("IPv6 call");
    assert_eq!(v6.bytes, 3 << 20);
    let after = m.counters();
    let total: u64 = sizes.iter().map(|&s| s as u64).sum::<u64>() + (3 << 20);
    // Each payload byte crosses the proxy-to-proxy pair once each way.
    assert!(
        grew(&before, &after, "sockmap_bytes_redirected") >= 2 * total,
        "{after:?}"
    );
    assert!(
        grew(&before, &after, "sockmap_pair_added") >= 2 * (sizes.len() as u64 + 1),
        "{after:?}"
    );
    m.assert_nothing_left();
}

#[test]
fn half_close_works_in_each_direction() {
    let m = mesh("sockmap-halfclose");
    // Client closes first: it sends 8 MiB, shuts its side, and still reads the echo.
    let call = Caller {
        bytes: 8 << 20,
        ..m.app()
    }
    .call(m.b4(ECHO))
    .expect("client half-close");
    assert_eq!(call.bytes, 8 << 20);

    // Server closes first: it sends 1 MiB and shuts its side; the client then sends 3 MiB.
    let v = m.testapp(&[
        "half-close",
        &m.b4(HALF_CLOSE).to_string(),
        "--bytes",
        &(3 << 20).to_string(),
    ]);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["received"], 1 << 20);
    let peer = v["server_peer"].as_str().unwrap().to_string();
    let end = m
        .half_close_b
        .wait_for_stdout(
            |l| l.starts_with(&format!("END peer={peer} ")),
            Duration::from_secs(10),
        )
        .expect("server's end of the connection");
    assert_eq!(
        end,
        format!("END peer={peer} received={} result=eof", 3 << 20)
    );
    m.assert_nothing_left();
}

#[test]
fn a_reset_mid_stream_reaches_the_other_app() {
    let m = mesh("sockmap-reset");
    // 10 MiB to send, but reset after the first 300 000 bytes.
    let v = m.testapp(&[
        "call",
        &m.b4(ECHO).to_string(),
        "--bytes",
        "10485760",
        "--abort-after",
        "300000",
    ]);
    assert_eq!(v["ok"], true, "{v}");
    let peer = v["server_peer"].as_str().unwrap().to_string();
    let end = m
        .echo_b
        .wait_for_stdout(
            |l| l.starts_with(&format!("END peer={peer} ")),
            Duration::from_secs(10),
        )
        .expect("server's end of the connection");
    assert!(
        end.ends_with("result=reset"),
        "the app must see a reset, not a clean close: {end}"
    );
    m.assert_nothing_left();
}

#[test]
fn a_thousand_concurrent_connections() {
    let m = mesh("sockmap-many");
    let before = m.counters();
    let v = m.testapp(&[
        "many",
        &m.b4(ECHO).to_string(),
        "--connections",
        "1000",
        "--bytes",
        "4096",
    ]);
    assert_eq!(v["ok"], true, "{v}");
    let after = m.counters();
    assert!(
        grew(&before, &after, "sockmap_pair_added") >= 2000,
        "{after:?}"
    );
    m.assert_nothing_left();
}

#[test]
fn a_slow_reader_behind_a_fast_writer_loses_nothing() {
    let m = mesh("sockmap-slow");
    // The echo comes back faster than a's app reads it (2 ms pause per read): the bytes
    // pile up on a's side of the short-circuit, and must neither be lost nor fail a write.
    let bytes = (32 << 20).to_string();
    let v = m.testapp(&[
        "call",
        &m.b4(ECHO).to_string(),
        "--bytes",
        &bytes,
        "--read-delay-ms",
        "2",
    ]);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["bytes"], 32 << 20);
    m.assert_nothing_left();
}

#[test]
fn the_runtime_switch_sends_new_connections_through_tcp() {
    let m = mesh("sockmap-switch");
    let run = |args: &[&str]| {
        let out = m.capture.command(&m.a, args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&["--set-sockmap", "off"]);
    run_ok_on(&m.b, &m.capture, &["--set-sockmap", "off"]);
    let before = m.counters();
    Caller {
        bytes: 1 << 20,
        ..m.app()
    }
    .call(m.b4(ECHO))
    .expect("call with the switch off");
    let after = m.counters();
    assert_eq!(
        grew(&before, &after, "sockmap_pair_added"),
        0,
        "no pair joins while off"
    );
    assert_eq!(grew(&before, &after, "sockmap_bytes_redirected"), 0);

    run(&["--set-sockmap", "on"]);
    run_ok_on(&m.b, &m.capture, &["--set-sockmap", "on"]);
    Caller {
        bytes: 1 << 20,
        ..m.app()
    }
    .call(m.b4(ECHO))
    .expect("call with the switch on");
    assert!(grew(&after, &m.counters(), "sockmap_bytes_redirected") >= 2 << 20);
    m.assert_nothing_left();
}

fn run_ok_on(pod: &Pod, capture: &Capture, args: &[&str]) {
    let out = capture.command(pod, args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
