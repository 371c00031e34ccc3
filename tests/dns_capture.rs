//! DNS capture in eBPF (issue 13): with `--redirect-dns` the app's queries to its
//! resolvers go to the DNS proxy on the pod's 127.0.0.1/[::1]:15053, and the replies
//! reach the app as if the resolver had sent them, through the real resolver paths:
//! `dig` (UDP and TCP), glibc's `getent` and Python's `getaddrinfo` (connected UDP),
//! musl's `getaddrinfo` (one unconnected socket for every nameserver, checking each
//! reply's source), and `testapp dns-query` (connected and unconnected sockets, v4, v6,
//! v4-mapped). TCP queries keep their original destination for the proxy
//! (`SO_ORIGINAL_DST`), a node-local resolver on 127.0.0.53 is captured too, and the
//! proxy's own queries, and other resolvers without `--capture-all-dns`, are not.
//!
//! The node: pod `app` is captured; its stand-in DNS proxy is dnsmasq on 15053, run as
//! the proxy's uid 1337, answering `only.mesh.test` itself and forwarding the rest to
//! pod `resolver` (the resolver the app's resolv.conf names, dnsmasq on port 53). Pod
//! `other` runs a resolver the app's resolv.conf does not name. Every server answers
//! `whoami.test` with its own address, so each answer says who gave it.

mod support;

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use harness::{Node, Pod, PodProcess, testapp_bin, wait_for_port};
use serde_json::Value;
use support::*;

/// The stand-in DNS proxy's answers (Istio's auto-allocated ranges).
const PROXY_V4: &str = "240.240.0.1";
const PROXY_V6: &str = "2001:2::1";
/// `whoami.test` at the pod's resolver and at the other one.
const RESOLVER_WHOAMI: &str = "10.99.0.2";
const OTHER_WHOAMI: &str = "10.99.0.3";
/// A name only the pod's resolver knows: the proxy must forward it.
const UPSTREAM_ONLY: &str = "10.99.0.4";

struct World {
    _node: Node,
    app: Pod,
    resolver: Pod,
    other: Pod,
    dir: TempDir,
    capture: Capture,
    _servers: Vec<PodProcess>,
}

/// dnsmasq on `port` of `listen`, answering `records` (name, address) itself.
fn dnsmasq(
    pod: &Pod,
    listen: &[IpAddr],
    port: u16,
    records: &[(&str, &str)],
) -> harness::PodCommand {
    let mut cmd = pod.command("dnsmasq").args([
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-hosts",
        "--bind-interfaces",
        "--log-facility=-",
        "--log-queries",
        "--pid-file=",
    ]);
    cmd = cmd.arg(format!("--port={port}"));
    for ip in listen {
        cmd = cmd.arg(format!("--listen-address={ip}"));
    }
    for (name, addr) in records {
        cmd = cmd.arg(format!("--address=/{name}/{addr}"));
    }
    cmd
}

fn start(cmd: harness::PodCommand, pod: &Pod, at: SocketAddr) -> PodProcess {
    let server = cmd.spawn().expect("start dnsmasq");
    // dnsmasq listens on TCP beside UDP: its TCP listener says it is ready.
    wait_for_port(pod, at, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}\ndnsmasq: {}", server.stderr_text()));
    server
}

impl World {
    /// The node, with capture installed in `app` with `flags` (its resolv.conf names
    /// the resolver's IPv4 and IPv6 addresses).
    fn new(tag: &'static str, flags: &[&str]) -> World {
        let mut node = Node::new().expect("node");
        let app = node.add_pod("app").expect("pod app");
        let resolver = node.add_pod("resolver").expect("pod resolver");
        let other = node.add_pod("other").expect("pod other");
        let dir = TempDir::new(tag);
        let conf = |name: &str, servers: &[IpAddr]| {
            let text: String = servers
                .iter()
                .map(|s| format!("nameserver {s}\n"))
                .collect();
            std::fs::write(dir.0.join(name), text + "options timeout:5 attempts:1\n").unwrap();
        };
        let (r4, r6) = (IpAddr::V4(resolver.ipv4()), IpAddr::V6(resolver.ipv6()));
        conf("resolv.conf", &[r4, r6]);
        conf("resolv-v4.conf", &[r4]);
        conf("resolv-v6.conf", &[r6]);
        // A node-local resolver, as systemd-resolved's stub.
        conf("resolv-local.conf", &["127.0.0.53".parse().unwrap()]);

        let mut servers = Vec::new();
        for (pod, whoami) in [(&resolver, RESOLVER_WHOAMI), (&other, OTHER_WHOAMI)] {
            let listen = [IpAddr::V4(pod.ipv4()), IpAddr::V6(pod.ipv6())];
            let cmd = dnsmasq(
                pod,
                &listen,
                53,
                &[("whoami.test", whoami), ("upstream.test", UPSTREAM_ONLY)],
            )
            .arg("--no-resolv");
            servers.push(start(cmd, pod, SocketAddr::new(listen[0], 53)));
        }
        // The stand-in proxy: as uid/gid 1337, so its forwarded queries must leave.
        let loopback = [IpAddr::from(Ipv4Addr::LOCALHOST), "::1".parse().unwrap()];
        let cmd = dnsmasq(
            &app,
            &loopback,
            15053,
            &[
                ("only.mesh.test", PROXY_V4),
                ("only.mesh.test", PROXY_V6),
                ("whoami.test", PROXY_V4),
            ],
        )
        .args(["--no-resolv", "--user=", "--group="])
        .arg(format!("--server={}", resolver.ipv4()))
        .uid(PROXY_UID)
        .gid(PROXY_UID);
        servers.push(start(cmd, &app, SocketAddr::new(loopback[0], 15053)));

        let capture = Capture::new("ebpf", tag);
        let w = World {
            _node: node,
            app,
            resolver,
            other,
            dir,
            capture,
            _servers: servers,
        };
        w.install(flags, "resolv.conf");
        w
    }

    /// `shunt capture` in `app`, reading `resolv` as the app's resolv.conf, as
    /// istio-init reads the pod's.
    fn install(&self, flags: &[&str], resolv: &str) {
        let out = self
            .capture
            .command(&self.app, flags)
            .resolv_conf(self.resolv(resolv))
            .output()
            .expect("run shunt capture");
        assert!(
            out.status.success(),
            "shunt capture {flags:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn resolv(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }

    fn counters(&self) -> Counters {
        Counters(self.capture.pod_counters(&self.app))
    }
}

#[derive(Clone)]
struct Counters(std::collections::HashMap<String, u64>);

impl Counters {
    fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }
    /// How much `name` moved since `before`.
    fn since(&self, before: &Counters, name: &str) -> u64 {
        self.get(name) - before.get(name)
    }
}

/// A command in `app` as the app (uid 1000) with `resolv` as its resolv.conf.
fn as_app(w: &World, resolv: &str, program: &str) -> harness::PodCommand {
    w.app
        .command(program)
        .uid(APP_UID)
        .gid(APP_UID)
        .resolv_conf(w.resolv(resolv))
}

/// Runs a lookup tool and returns what it printed, failing the test with its stderr when
/// it could not run (a failed lookup is not an error: the assertion says what was wanted).
fn output_of(cmd: harness::PodCommand) -> String {
    let what = cmd.description();
    let out = cmd
        .timeout(Duration::from_secs(20))
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if stdout.trim().is_empty() {
        return format!(
            "(nothing; {}; stderr {:?})",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    stdout
}

/// `dig +short` with the given arguments: the answers, one a line.
fn dig(cmd: harness::PodCommand, args: &[&str]) -> String {
    output_of(cmd.args(["+short", "+time=5", "+tries=1"]).args(args))
}

fn answers(text: &str) -> Vec<String> {
    text.split_whitespace()
        .filter(|w| w.parse::<IpAddr>().is_ok())
        .map(String::from)
        .collect()
}

/// `testapp dns-query`: (the reply's source as the app saw it, the answers).
fn dns_query(
    w: &World,
    server: SocketAddr,
    name: &str,
    qtype: &str,
    connect: bool,
) -> (String, Vec<String>) {
    let out = output_of(
        w.app
            .command(testapp_bin())
            .uid(APP_UID)
            .gid(APP_UID)
            .arg("dns-query")
            .arg(server.to_string())
            .args(["--name", name, "--type", qtype])
            .args(["--connect", if connect { "yes" } else { "no" }]),
    );
    let v: Value = serde_json::from_str(out.trim())
        .unwrap_or_else(|_| panic!("testapp dns-query {server}: {out}"));
    assert_eq!(v["ok"], true, "testapp dns-query {server} {name}: {v}");
    let answers = v["answers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    (v["from"].as_str().unwrap().to_string(), answers)
}

#[test]
fn the_apps_queries_reach_the_dns_proxy_over_udp_and_tcp_v4_and_v6() {
    let w = World::new("dns-udp-tcp", &["--redirect-dns"]);
    let before = w.counters();
    let r6 = w.resolver.ipv6().to_string();
    let at_r6 = format!("@{r6}");

    // dig reads resolv.conf (the resolver's IPv4 address) or is told the IPv6 one.
    let udp = dig(as_app(&w, "resolv-v4.conf", "dig"), &["only.mesh.test"]);
    assert_eq!(answers(&udp), [PROXY_V4], "dig over UDP: {udp}");
    let tcp = dig(
        as_app(&w, "resolv-v4.conf", "dig"),
        &["+tcp", "only.mesh.test"],
    );
    assert_eq!(answers(&tcp), [PROXY_V4], "dig +tcp: {tcp}");
    let udp6 = dig(
        as_app(&w, "resolv-v4.conf", "dig"),
        &[&at_r6, "AAAA", "only.mesh.test"],
    );
    assert_eq!(answers(&udp6), [PROXY_V6], "dig @{r6} over UDP: {udp6}");
    let tcp6 = dig(
        as_app(&w, "resolv-v4.conf", "dig"),
        &["+tcp", &at_r6, "AAAA", "only.mesh.test"],
    );
    assert_eq!(answers(&tcp6), [PROXY_V6], "dig +tcp @{r6}: {tcp6}");

    // A name only the resolver knows: the proxy forwards it as uid 1337, and that query
    // leaves the pod (were it captured, it would loop back to the proxy).
    let forwarded = dig(as_app(&w, "resolv-v4.conf", "dig"), &["upstream.test"]);
    assert_eq!(
        answers(&forwarded),
        [UPSTREAM_ONLY],
        "forwarded by the proxy: {forwarded}"
    );

    let after = w.counters();
    assert!(
        after.since(&before, "dns_captured_udp") >= 3,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "dns_captured_tcp") >= 2,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "dns_reply_restored") >= 3,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "dns_skip_proxy_uid") >= 1,
        "the proxy's forward: {:?}",
        after.0
    );
}

#[test]
fn glibc_and_python_resolvers_accept_the_proxys_replies() {
    let w = World::new("dns-libc", &["--redirect-dns"]);
    let before = w.counters();
    for resolv in ["resolv-v4.conf", "resolv-v6.conf"] {
        // getent: glibc's getaddrinfo, A and AAAA over one connected UDP socket.
        let getent = output_of(as_app(&w, resolv, "getent").args(["ahosts", "only.mesh.test"]));
        let mut got = answers(&getent);
        got.sort();
        got.dedup();
        assert_eq!(
            got,
            [PROXY_V6, PROXY_V4],
            "getent ahosts with {resolv}: {getent}"
        );
        let python = output_of(as_app(&w, resolv, "python3").args([
            "-c",
            "import socket; print(' '.join(sorted({a[4][0] for a in socket.getaddrinfo('only.mesh.test', 80)})))",
        ]));
        assert_eq!(
            answers(&python),
            [PROXY_V6, PROXY_V4],
            "python getaddrinfo with {resolv}: {python}"
        );
    }
    let after = w.counters();
    assert!(
        after.since(&before, "dns_captured_udp") >= 4,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "dns_reply_restored") >= 8,
        "{:?}",
        after.0
    );
}

/// `tests/dnsclient/musl_lookup.c`, built statically against musl into `dir`.
fn musl_lookup(dir: &std::path::Path) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("dnsclient/musl_lookup.c");
    let bin = dir.join("musl_lookup");
    let out = std::process::Command::new("musl-gcc")
        .args(["-static", "-O1", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("musl-gcc: {e} (Debian's musl-tools: run `cargo xtask setup`)"));
    assert!(
        out.status.success(),
        "musl-gcc {}: {}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

#[test]
fn musls_resolver_accepts_the_proxys_replies() {
    let w = World::new("dns-musl", &["--redirect-dns"]);
    let lookup = musl_lookup(&w.dir.0);
    let before = w.counters();
    // v4 only: an IPv4 socket; v6 only; both: one IPv6 socket asking both at once, the
    // IPv4 resolver as ::ffff:a.b.c.d.
    for resolv in ["resolv-v4.conf", "resolv-v6.conf", "resolv.conf"] {
        let got = output_of(as_app(&w, resolv, lookup.to_str().unwrap()).arg("only.mesh.test"));
        let mut got = answers(&got);
        got.sort();
        got.dedup();
        assert_eq!(got, [PROXY_V6, PROXY_V4], "musl getaddrinfo with {resolv}");
    }
    let after = w.counters();
    assert!(
        after.since(&before, "dns_reply_restored") >= 6,
        "{:?}",
        after.0
    );
}

#[test]
fn replies_show_the_resolvers_address_to_connected_and_unconnected_sockets() {
    let w = World::new("dns-sockets", &["--redirect-dns"]);
    let r4 = SocketAddr::new(IpAddr::V4(w.resolver.ipv4()), 53);
    let r6 = SocketAddr::new(IpAddr::V6(w.resolver.ipv6()), 53);
    let mapped = SocketAddr::new(IpAddr::V6(w.resolver.ipv4().to_ipv6_mapped()), 53);
    for server in [r4, r6, mapped] {
        for connect in [false, true] {
            let (from, got) = dns_query(&w, server, "only.mesh.test", "A", connect);
            assert_eq!(
                (from.as_str(), got.as_slice()),
                (
                    server.to_string().as_str(),
                    [PROXY_V4.to_string()].as_slice()
                ),
                "to {server}, connected: {connect}"
            );
        }
    }
}

#[test]
fn the_proxys_own_queries_reach_the_upstream_resolver() {
    let w = World::new("dns-proxy-uid", &["--redirect-dns"]);
    let before = w.counters();
    let as_proxy = |uid: u32, gid: u32| {
        w.app
            .command("dig")
            .uid(uid)
            .gid(gid)
            .resolv_conf(w.resolv("resolv-v4.conf"))
    };
    let by_uid = dig(as_proxy(PROXY_UID, PROXY_UID), &["whoami.test"]);
    assert_eq!(answers(&by_uid), [RESOLVER_WHOAMI], "uid 1337: {by_uid}");
    let by_gid = dig(as_proxy(APP_UID, PROXY_UID), &["whoami.test"]);
    assert_eq!(answers(&by_gid), [RESOLVER_WHOAMI], "gid 1337: {by_gid}");
    let tcp = dig(as_proxy(PROXY_UID, PROXY_UID), &["+tcp", "whoami.test"]);
    assert_eq!(answers(&tcp), [RESOLVER_WHOAMI], "uid 1337 over TCP: {tcp}");
    // The resolver does not know the proxy's name: nothing answered it on the way.
    let mesh = dig(as_proxy(PROXY_UID, PROXY_UID), &["only.mesh.test"]);
    assert!(answers(&mesh).is_empty(), "uid 1337 got {mesh}");
    // And the app, the same query: the proxy.
    let app = dig(as_app(&w, "resolv-v4.conf", "dig"), &["whoami.test"]);
    assert_eq!(answers(&app), [PROXY_V4], "the app: {app}");

    let after = w.counters();
    assert!(
        after.since(&before, "dns_skip_proxy_uid") >= 2,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "dns_skip_proxy_gid") >= 1,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "skip_proxy_uid") >= 1,
        "TCP: {:?}",
        after.0
    );
    assert_eq!(after.since(&before, "dns_captured_tcp"), 0, "{:?}", after.0);
}

#[test]
fn another_resolver_is_captured_only_with_capture_all_dns() {
    let w = World::new("dns-capture-all", &["--redirect-dns"]);
    let at_other = format!("@{}", w.other.ipv4());
    let at_other6 = format!("@{}", w.other.ipv6());
    let before = w.counters();
    for at in [&at_other, &at_other6] {
        let direct = dig(as_app(&w, "resolv-v4.conf", "dig"), &[at, "whoami.test"]);
        assert_eq!(
            answers(&direct),
            [OTHER_WHOAMI],
            "{at} without --capture-all-dns: {direct}"
        );
    }
    let after = w.counters();
    assert!(
        after.since(&before, "dns_skip_not_resolver") >= 2,
        "{:?}",
        after.0
    );
    assert_eq!(after.since(&before, "dns_captured_udp"), 0, "{:?}", after.0);

    w.capture.cleanup(&w.app);
    w.install(&["--redirect-dns", "--capture-all-dns"], "resolv.conf");
    for at in [&at_other, &at_other6] {
        let captured = dig(as_app(&w, "resolv-v4.conf", "dig"), &[at, "whoami.test"]);
        assert_eq!(
            answers(&captured),
            [PROXY_V4],
            "{at} with --capture-all-dns: {captured}"
        );
        let tcp = dig(
            as_app(&w, "resolv-v4.conf", "dig"),
            &["+tcp", at, "whoami.test"],
        );
        assert_eq!(
            answers(&tcp),
            [PROXY_V4],
            "{at} +tcp with --capture-all-dns: {tcp}"
        );
    }
    let counters = w.counters();
    assert!(counters.get("dns_captured_udp") >= 2, "{:?}", counters.0);
    assert!(counters.get("dns_captured_tcp") >= 2, "{:?}", counters.0);
}

#[test]
fn a_node_local_resolver_on_loopback_is_captured_over_udp_and_tcp() {
    // Nothing listens on 127.0.0.53:53: only the proxy can answer.
    let w = World::new("dns-local", &[]);
    w.capture.cleanup(&w.app);
    w.install(&["--redirect-dns"], "resolv-local.conf");
    let before = w.counters();
    let udp = dig(as_app(&w, "resolv-local.conf", "dig"), &["only.mesh.test"]);
    assert_eq!(answers(&udp), [PROXY_V4], "dig via 127.0.0.53: {udp}");
    // Rule 17 (`-o lo ! --dport 53 -j RETURN`) lets TCP to a local resolver through.
    let tcp = dig(
        as_app(&w, "resolv-local.conf", "dig"),
        &["+tcp", "only.mesh.test"],
    );
    assert_eq!(answers(&tcp), [PROXY_V4], "dig +tcp via 127.0.0.53: {tcp}");
    let after = w.counters();
    assert!(
        after.since(&before, "dns_captured_udp") >= 1,
        "{:?}",
        after.0
    );
    assert!(
        after.since(&before, "dns_captured_tcp") >= 1,
        "{:?}",
        after.0
    );
}

#[test]
fn without_redirect_dns_queries_go_to_the_resolver() {
    let w = World::new("dns-off", &[]);
    let direct = dig(as_app(&w, "resolv-v4.conf", "dig"), &["whoami.test"]);
    assert_eq!(answers(&direct), [RESOLVER_WHOAMI], "{direct}");
    let counters = w.counters();
    assert_eq!(counters.get("dns_captured_udp"), 0, "{:?}", counters.0);
}

/// A stand-in DNS proxy on TCP: accepts one connection on `[ADDR]:15053` and prints the
/// original destination `getsockopt(SO_ORIGINAL_DST)` gives it, as the proxy asks.
const ORIGINAL_DST_SERVER: &str = r#"
import socket, struct, sys
fam = socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET
s = socket.socket(fam)
s.bind((sys.argv[1], 15053))
s.listen()
print('listening', flush=True)
c, _ = s.accept()
if fam == socket.AF_INET:
    d = c.getsockopt(socket.SOL_IP, 80, 16)
    print('%s:%d' % (socket.inet_ntop(fam, d[4:8]), struct.unpack('!H', d[2:4])[0]), flush=True)
else:
    d = c.getsockopt(socket.IPPROTO_IPV6, 80, 28)
    print('[%s]:%d' % (socket.inet_ntop(fam, d[8:24]), struct.unpack('!H', d[2:4])[0]), flush=True)
"#;

#[test]
fn tcp_dns_keeps_its_original_destination_for_the_proxy() {
    let mut node = Node::new().expect("node");
    let app = node.add_pod("app").expect("pod app");
    let resolver = node.add_pod("resolver").expect("pod resolver");
    let dir = TempDir::new("dns-orig-dst");
    let resolv = dir.0.join("resolv.conf");
    let text = format!(
        "nameserver {}\nnameserver {}\n",
        resolver.ipv4(),
        resolver.ipv6()
    );
    std::fs::write(&resolv, text).unwrap();
    let capture = Capture::new("ebpf", "dns-orig-dst");
    let out = capture
        .command(&app, &["--redirect-dns"])
        .resolv_conf(&resolv)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let targets = [
        (
            "127.0.0.1",
            SocketAddr::new(IpAddr::V4(resolver.ipv4()), 53),
        ),
        ("::1", SocketAddr::new(IpAddr::V6(resolver.ipv6()), 53)),
    ];
    for (listen, target) in targets {
        let mut server = app
            .command("python3")
            .args(["-c", ORIGINAL_DST_SERVER, listen])
            .uid(PROXY_UID)
            .gid(PROXY_UID)
            .spawn()
            .unwrap();
        server
            .wait_for_stdout(|l| l == "listening", Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{e:#}: {}", server.stderr_text()));
        let client = format!(
            "import socket; socket.create_connection(('{}', 53), timeout=5).close()",
            target.ip()
        );
        let out = app
            .command("python3")
            .args(["-c", &client])
            .uid(APP_UID)
            .gid(APP_UID)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        server.wait_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(
            server.stdout_text().lines().nth(1),
            Some(target.to_string().as_str()),
            "SO_ORIGINAL_DST of a TCP query to {target}: {}",
            server.stderr_text()
        );
    }
}
