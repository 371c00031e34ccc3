//! Node mode's serving: one process (`nodeserve`, NodePods with the node's eBPF
//! capture) serves every pod of a node, its listeners opened inside each pod's network
//! namespace and its upstream connections made from inside the pod. Real kernel, real
//! namespaces, cgroups and eBPF; the apps are testapp.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::{Node, Pod, testapp_bin};
use serde_json::Value;
use support::*;

/// A running `nodeserve` in the node's bridge namespace (the node's "host network"),
/// in a cgroup under the node's, where the capture programs are attached.
/// What the node process holds once for every pod that has it: decoded xDS
/// resources, compiled clusters and compiled route configurations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Interned {
    decoded: usize,
    clusters: usize,
    route_configs: usize,
}

struct NodeAgent {
    child: Child,
    stdin: ChildStdin,
    stdout: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
    cgroup: PathBuf,
}

impl NodeAgent {
    fn start(node: &Node, bpffs: &std::path::Path, extra: &[&str]) -> NodeAgent {
        let cgroup = node.cgroup_path().join(format!("agent{}", next_agent()));
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", node.bridge_netns_path().display()))
            .arg(env!("CARGO_BIN_EXE_nodeserve"))
            .arg("--join-cgroup")
            .arg(&cgroup)
            .arg("--cgroup")
            .arg(node.cgroup_path())
            .arg("--bpffs")
            .arg(bpffs)
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start nodeserve");
        let stdin = child.stdin.take().unwrap();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (out, err) = (stdout.clone(), stderr.clone());
        let child_out = child.stdout.take().unwrap();
        let child_err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(child_out).lines().map_while(Result::ok) {
                out.lock().unwrap().push(line);
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(child_err).lines().map_while(Result::ok) {
                let mut e = err.lock().unwrap();
                e.push_str(&line);
                e.push('\n');
            }
        });
        let mut agent = NodeAgent {
            child,
            stdin,
            stdout,
            stderr,
            cgroup,
        };
        agent.wait_reply("@ready");
        agent
    }

    /// Waits for a reply line starting with `prefix` and returns it.
    fn wait_reply(&mut self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(line) = self
                .stdout
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|l| l.starts_with(prefix) || l.starts_with("@error"))
            {
                return line.clone();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("nodeserve exited ({status}):\n{}", self.stderr());
            }
            assert!(
                Instant::now() < deadline,
                "no {prefix} from nodeserve:\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn send(&mut self, line: &str) {
        self.stdout.lock().unwrap().retain(|l| !l.starts_with('@'));
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    /// Enrolls `pod` and returns once `add` returned (its listeners bound).
    fn add(&mut self, pod: &Pod) -> Duration {
        let uid = pod.name().to_owned();
        self.send(&format!(
            "add {uid} {} default {} {} {}",
            pod.name(),
            pod.netns_path().display(),
            pod.ipv4(),
            pod.ipv6()
        ));
        let reply = self.wait_reply(&format!("@added {uid} "));
        let micros: u64 = reply
            .rsplit(' ')
            .next()
            .and_then(|m| m.parse().ok())
            .unwrap_or_else(|| panic!("add {uid}: {reply}\n{}", self.stderr()));
        Duration::from_micros(micros)
    }

    /// Enrolls `pod` as service account `sa` (per-pod proxies from the control plane).
    fn add_as(&mut self, pod: &Pod, sa: &str) {
        self.add_with(pod, &format!("sa={sa}"));
    }

    /// Enrolls `pod` with `extra` enrollment words (`sa=`, `token=`, `dns=`).
    fn add_with(&mut self, pod: &Pod, extra: &str) {
        let uid = pod.name().to_owned();
        self.send(&format!(
            "add {uid} {} default {} {} {} {extra}",
            pod.name(),
            pod.netns_path().display(),
            pod.ipv4(),
            pod.ipv6()
        ));
        let reply = self.wait_reply(&format!("@added {uid} "));
        assert!(reply.starts_with("@added"), "{reply}\n{}", self.stderr());
    }

    /// Waits until the pod's proxy has its first configuration (its health port's
    /// `/healthz/ready` answers 200 from then on).
    fn wait_ready(&mut self, pod: &Pod) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.send(&format!("ready {}", pod.name()));
            let reply = self.wait_reply(&format!("@ready {} ", pod.name()));
            if reply.ends_with(" true") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} never ready\n{}",
                pod.name(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A counter of the pod's own proxy.
    fn stat(&mut self, pod: &Pod, name: &str) -> u64 {
        self.pod_number(pod, "stat", name)
    }

    /// How many of the pod's stats there are under `prefix` (asking for one by name
    /// would make it).
    fn stats_under(&mut self, pod: &Pod, prefix: &str) -> u64 {
        self.pod_number(pod, "stats-under", prefix)
    }

    /// The number `nodeserve` answers to `command <pod> <arg>`.
    fn pod_number(&mut self, pod: &Pod, command: &str, arg: &str) -> u64 {
        self.send(&format!("{command} {} {arg}", pod.name()));
        let reply = self.wait_reply(&format!("@{command} {} ", pod.name()));
        reply
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{command} {arg}: {reply}"))
    }

    /// What the process holds once for every pod that has it.
    fn interned(&mut self) -> Interned {
        self.send("interned");
        let reply = self.wait_reply("@interned ");
        let counts: Vec<usize> = reply["@interned ".len()..]
            .split(' ')
            .map(|n| n.parse().unwrap_or_else(|_| panic!("interned: {reply}")))
            .collect();
        let [decoded, clusters, route_configs] = counts[..] else {
            panic!("interned: {reply}");
        };
        Interned {
            decoded,
            clusters,
            route_configs,
        }
    }

    /// The pod's config_dump clusters: `NAME=VERSION:DIGEST` each.
    fn clusters(&mut self, pod: &Pod) -> String {
        self.send(&format!("clusters {}", pod.name()));
        let reply = self.wait_reply(&format!("@clusters {} ", pod.name()));
        reply.rsplit(' ').next().unwrap_or_default().to_owned()
    }

    /// Waits up to 10 s for `until` to hold of the interned counts; returns the last.
    fn interned_until(&mut self, until: impl Fn(Interned) -> bool) -> Interned {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = self.interned();
            if until(n) || Instant::now() > deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn remove(&mut self, pod: &Pod) {
        self.send(&format!("remove {}", pod.name()));
        self.wait_reply(&format!("@removed {}", pod.name()));
    }

    fn rss_kib(&mut self) -> u64 {
        self.send("rss");
        let reply = self.wait_reply("@rss ");
        reply[5..].parse().unwrap()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    fn access_log(&self) -> Vec<Value> {
        self.stdout
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v.get("direction").is_some())
            .collect()
    }

    /// The entry matching `pred`, waiting for it up to 5 s (lines come at close).
    fn entry(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(v) = self.access_log().into_iter().find(&pred) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "no access log entry for {what}; log: {:?}\n{}",
                self.access_log(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL: nothing is cleaned up, the kernel side stays as it was.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir(&self.cgroup);
    }
}

fn next_agent() -> u32 {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Removes the bpffs root (every pin: links detach, maps go) even when a test fails.
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = Command::new("rm").arg("-rf").arg(&self.0).status();
    }
}

fn v4(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(pod.ipv4()), port)
}

fn v6(pod: &Pod, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(pod.ipv6()), port)
}

fn passthrough_source(target: SocketAddr) -> IpAddr {
    if target.is_ipv4() { "127.0.0.6" } else { "::6" }
        .parse()
        .unwrap()
}

/// `testapp serve` in the node's bridge namespace: a destination outside every pod.
fn start_outside_app(node: &Node, port: u16) -> Child {
    let child = Command::new("nsenter")
        .arg(format!("--net={}", node.bridge_netns_path().display()))
        .arg(testapp_bin())
        .args(["serve", "--listen", &format!("0.0.0.0:{port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("testapp in the bridge netns");
    // Wait until it accepts (probing from the bridge namespace itself).
    let gateway = SocketAddr::new(IpAddr::V4(node.gateway_ipv4()), port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Command::new("nsenter")
        .arg(format!("--net={}", node.bridge_netns_path().display()))
        .args([
            "bash",
            "-c",
            &format!("exec 3<>/dev/tcp/{}/{}", gateway.ip(), port),
        ])
        .status()
        .map(|s| !s.success())
        .unwrap_or(true)
    {
        assert!(Instant::now() < deadline, "outside app never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn one_process_serves_three_pods_with_their_own_addresses() {
    let mut node = Node::new().expect("node");
    let pods: Vec<Pod> = ["a", "b", "c"]
        .iter()
        .map(|n| node.add_pod(n).expect("pod"))
        .collect();
    let (a, b, c) = (&pods[0], &pods[1], &pods[2]);
    let _apps: Vec<_> = pods.iter().map(|p| start_app(p, &[8080])).collect();
    let mut outside = start_outside_app(&node, 9090);
    let pins = Pins(bpffs_root("node-serve"));
    let mut agent = NodeAgent::start(&node, &pins.0, &[]);

    agent.add(a);
    agent.add(c);
    agent.add(b);
    // The instant b's add returned: its first inbound connection must find its proxy.
    for target in [v4(b, 8080), v6(b, 8080)] {
        let call = Caller {
            bytes: 1 << 20,
            ..Caller::app(a)
        }
        .call(target)
        .unwrap_or_else(|e| panic!("a -> {target}: {e:#}\n{}", agent.stderr()));
        assert_eq!(call.bytes, 1 << 20);
        // b's app sees the inbound passthrough source, as behind an Istio sidecar.
        assert_eq!(call.server_peer.ip(), passthrough_source(target));

        let out = agent.entry("a's outbound", |v| {
            v["direction"] == "outbound"
                && v["downstream_remote_address"] == call.client_local.to_string().as_str()
        });
        assert_eq!(out["original_dst"], target.to_string().as_str());
        assert_eq!(out["upstream_cluster"], "PassthroughCluster");
        assert_eq!(out["bytes_received"], 1 << 20);
        // a's upstream left from a's own namespace: a's address is the source b sees.
        let upstream_local: SocketAddr = out["upstream_local_address"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let a_ip = if target.is_ipv4() {
            IpAddr::V4(a.ipv4())
        } else {
            IpAddr::V6(a.ipv6())
        };
        assert_eq!(upstream_local.ip(), a_ip, "{out}");

        let inbound = agent.entry("b's inbound", |v| {
            v["direction"] == "inbound"
                && v["downstream_remote_address"] == upstream_local.to_string().as_str()
        });
        assert_eq!(inbound["original_dst"], target.to_string().as_str());
        assert!(
            inbound["upstream_cluster"]
                .as_str()
                .unwrap()
                .starts_with("InboundPassthroughCluster"),
            "{inbound}"
        );
        assert_eq!(inbound["bytes_received"], 1 << 20);
    }

    // Pod to the outside: the original destination kept, the pod's address as source.
    let gateway = SocketAddr::new(IpAddr::V4(node.gateway_ipv4()), 9090);
    let call = Caller::app(c).call(gateway).expect("c -> outside");
    assert_eq!(call.server_peer.ip(), IpAddr::V4(c.ipv4()));
    let out = agent.entry("c's outbound", |v| {
        v["downstream_remote_address"] == call.client_local.to_string().as_str()
    });
    assert_eq!(out["direction"], "outbound");
    assert_eq!(out["original_dst"], gateway.to_string().as_str());

    // The app's own loopback stays the app's (rule 17/22: not captured).
    let call = Caller::app(b)
        .call(local(8080))
        .expect("b -> its own 127.0.0.1");
    assert_eq!(call.server_peer.ip(), IpAddr::from([127, 0, 0, 1]));

    // Removed: b is no longer captured; a's proxy still takes a's call, b's app now
    // sees a's address straight.
    agent.remove(b);
    let call = Caller::app(a)
        .call(v4(b, 8080))
        .expect("a -> b after remove");
    assert_eq!(call.server_peer.ip(), IpAddr::V4(a.ipv4()));
    // The line comes when the proxy closes its side, which can be after the app's
    // call returns: wait for it.
    agent.entry("a's proxy still serves a", |v| {
        v["downstream_remote_address"] == call.client_local.to_string().as_str()
    });
    let _ = outside.kill();
    let _ = outside.wait();
}

#[test]
fn with_the_node_process_killed_fail_closed_refuses_and_fail_open_passes() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let _app_b = start_app(&b, &[8080]);
    let pins = Pins(bpffs_root("node-fail"));

    // fail-closed (the default): served, then the process dies.
    let mut agent = NodeAgent::start(&node, &pins.0, &[]);
    agent.add(&a);
    agent.add(&b);
    Caller::app(&a).call(v4(&b, 8080)).expect("served call");
    agent.kill();
    let refused = Caller::app(&a).call_json(v4(&b, 8080));
    assert_eq!(refused["ok"], false, "{refused}");
    assert!(
        refused["error"].as_str().unwrap_or("").contains("refused"),
        "{refused}"
    );
    drop(agent);

    // fail-open: a new process re-enrolls the pods with the other policy, then dies.
    let mut agent = NodeAgent::start(&node, &pins.0, &["--failure-policy", "fail-open"]);
    agent.add(&a);
    agent.add(&b);
    let served = Caller::app(&a).call(v4(&b, 8080)).expect("served call");
    assert_eq!(served.server_peer.ip(), passthrough_source(v4(&b, 8080)));
    agent.kill();
    for target in [v4(&b, 8080), v6(&b, 8080)] {
        let call = Caller::app(&a)
            .call(target)
            .unwrap_or_else(|e| panic!("fail-open a -> {target}: {e:#}"));
        // Straight through, around the dead proxy: b's app sees a itself.
        let a_ip = if target.is_ipv4() {
            IpAddr::V4(a.ipv4())
        } else {
            IpAddr::V6(a.ipv6())
        };
        assert_eq!(call.server_peer.ip(), a_ip);
    }
}

fn rss_kib_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// 50 pods: what one node process costs against 50 sidecar `shunt proxy` processes,
/// and what enrolling a pod takes. Printed for the report; the assertions are that
/// every pod is served and that the one process is smaller than the 50.
#[test]
fn fifty_pods_cost_one_process() {
    const PODS: usize = 50;
    let mut node = Node::new().expect("node");
    let pods: Vec<Pod> = (0..PODS)
        .map(|i| node.add_pod(&format!("p{i}")).expect("pod"))
        .collect();
    let _app = start_app(&pods[PODS - 1], &[8080]);
    let pins = Pins(bpffs_root("node-fifty"));
    let mut agent = NodeAgent::start(&node, &pins.0, &[]);
    let rss_empty = agent.rss_kib();
    let mut enroll: Vec<Duration> = pods.iter().map(|p| agent.add(p)).collect();
    // Served: the first pod reaches the last one through the node process.
    let call = Caller::app(&pods[0])
        .call(v4(&pods[PODS - 1], 8080))
        .expect("p0 -> p49");
    assert_eq!(call.server_peer.ip(), passthrough_source(v4(&pods[0], 1)));
    let rss_node = agent.rss_kib();
    enroll.sort();

    // The sidecar shape: one `shunt proxy` per pod (listeners only, no capture needed
    // to measure what each costs idle), on the ports the node process gives back.
    agent.kill();
    let proxies: Vec<_> = pods.iter().map(start_proxy).collect();
    let rss_sidecars: u64 = proxies.iter().map(|p| rss_kib_of(p.pid())).sum();
    println!(
        "node mode, {PODS} pods: one process {rss_node} KiB ({rss_empty} KiB before any \
         pod, {:.0} KiB per pod) vs {PODS} shunt proxy processes {rss_sidecars} KiB ({} \
         KiB each); enrollment per pod: median {:?}, p90 {:?}, max {:?}",
        (rss_node.saturating_sub(rss_empty)) as f64 / PODS as f64,
        rss_sidecars / PODS as u64,
        enroll[PODS / 2],
        enroll[PODS * 9 / 10],
        enroll[PODS - 1],
    );
    assert!(proxies.iter().all(|p| rss_kib_of(p.pid()) > 0));
    assert!(
        rss_node < rss_sidecars,
        "one node process ({rss_node} KiB) should cost less than {PODS} sidecars ({rss_sidecars} KiB)"
    );
}

/// Upgrade: a new process takes the pods' listening sockets and DNS sockets from the
/// old one while a client keeps calling through them and another keeps resolving a
/// name through a's DNS proxy: not one call refused or reset, not one query lost.
#[test]
fn a_new_process_takes_over_without_dropping_a_connection() {
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let resolver = node.add_pod("resolver").expect("pod resolver");
    let _dnsmasq = dnsmasq_resolver(&resolver, &[("outside.test", "10.99.0.4")]);
    let _app_b = start_app(&b, &[8080]);
    let pins = Pins(bpffs_root("node-handover"));
    let tmp = TempDir::new("node-handover");
    let socket = tmp.0.join("handover.sock");
    let resolv = tmp.0.join("resolv.conf");
    std::fs::write(
        &resolv,
        format!(
            "nameserver {}\noptions timeout:5 attempts:1\n",
            resolver.ipv4()
        ),
    )
    .unwrap();
    let (resolv_arg, resolver_ip) = (resolv.display().to_string(), resolver.ipv4().to_string());
    let dns_args = [
        "--dns-resolv-conf",
        &resolv_arg,
        "--redirect-dns",
        "--dns-servers-v4",
        &resolver_ip,
    ];

    let mut old = NodeAgent::start(&node, &pins.0, &dns_args);
    old.add(&a);
    old.add(&b);
    assert_eq!(dig_in(&a, &resolv, &["outside.test"]), "10.99.0.4");
    assert_eq!(old.stat(&a, "dns.requests_total"), 1);

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let results = Arc::new(Mutex::new(Vec::<Value>::new()));
    let client = {
        let (stop, results, a, target) = (stop.clone(), results.clone(), a.clone(), v4(&b, 8080));
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = Caller::app(&a).call_json(target);
                results.lock().unwrap().push(r);
            }
        })
    };
    // a's app resolves a forwarded name over and over (UDP, one try each).
    let answers = Arc::new(Mutex::new(Vec::<String>::new()));
    let resolving = {
        let (stop, answers, a, resolv) = (stop.clone(), answers.clone(), a.clone(), resolv.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let answer = dig_in(&a, &resolv, &["outside.test"]);
                answers.lock().unwrap().push(answer);
            }
        })
    };
    let progress = |len: &dyn Fn() -> usize, n: usize, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(30);
        let start = len();
        while len() < start + n {
            assert!(Instant::now() < deadline, "the {what} stalled");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let calls = |n: usize| {
        progress(&|| results.lock().unwrap().len(), n, "client");
        progress(&|| answers.lock().unwrap().len(), n, "resolving client");
    };
    // The pod's DNS sockets (UDP and TCP on 127.0.0.1 and ::1), by the kernel's inode
    // numbers: a socket handed over keeps its number, one bound anew has another.
    let dns_sockets = || {
        let out = a
            .command("ss")
            .args(["-Hlnute", "sport = :15053"])
            .output()
            .expect("ss");
        let mut inodes: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .filter(|f| f.starts_with("ino:"))
            .map(str::to_owned)
            .collect();
        inodes.sort();
        inodes
    };
    let before = dns_sockets();
    assert_eq!(before.len(), 4, "UDP and TCP on 127.0.0.1 and [::1]");
    calls(5);

    old.send(&format!("handover {}", socket.display()));
    let take_over = socket.display().to_string();
    let new_args: Vec<&str> = ["--take-over", take_over.as_str()]
        .into_iter()
        .chain(dns_args)
        .collect();
    let mut new = NodeAgent::start(&node, &pins.0, &new_args);
    assert_eq!(new.wait_reply("@took "), "@took 2");
    assert_eq!(old.wait_reply("@handed-over "), "@handed-over 2");
    calls(5);
    // The new process serves the very sockets the old one opened, none bound beside.
    assert_eq!(dns_sockets(), before);
    // The old process is gone for good: the new one alone serves.
    old.kill();
    let before_kill = results.lock().unwrap().len();
    calls(10);
    assert_eq!(dns_sockets(), before);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    client.join().unwrap();
    resolving.join().unwrap();

    // Every query answered, the ones after the kill by the new process's DNS proxy on
    // the sockets it was handed (none of its own bound beside them).
    let answers = answers.lock().unwrap();
    let lost = answers.iter().filter(|a| *a != "10.99.0.4").count();
    assert_eq!(
        lost,
        0,
        "{lost} of {} queries failed: {answers:?}",
        answers.len()
    );
    assert!(new.stat(&a, "dns.requests_total") >= 10);

    let results = results.lock().unwrap();
    let failed: Vec<_> = results.iter().filter(|r| r["ok"] != true).collect();
    assert!(
        failed.is_empty(),
        "{} of {} calls failed during the hand-over: {failed:?}",
        failed.len(),
        results.len()
    );
    // Every call after the old process died went through the new one's proxy.
    for r in &results[before_kill..] {
        assert_eq!(
            r["server_peer"].as_str().unwrap().split(':').next(),
            Some("127.0.0.6"),
            "{r}"
        );
    }
    new.entry("an inbound call served by the new process", |v| {
        v["direction"] == "inbound"
    });
    println!(
        "hand-over: {} calls, 0 failed; {} DNS queries, 0 lost",
        results.len(),
        answers.len()
    );
}

/// How many connections to the Unix socket `path` process `pid` holds. The server's
/// end of each carries the path and belongs to the client's network namespace (the
/// kernel makes it there), so it is listed in the client's `/proc/PID/net/unix`,
/// connected (state 03).
fn connections_to(pid: u32, path: &std::path::Path) -> usize {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).expect("net/unix");
    let path = path.display().to_string();
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.len() == 8 && f[7] == path && f[5] == "03")
        .count()
}

/// The template bootstrap every pod's proxy starts from: ADS over `socket` (a static
/// `xds-grpc` cluster with a `pipe` endpoint, as Istio's) and the `sds-grpc` cluster
/// Istio's configs name for certificates (served in the node process, per pod).
fn pod_template(dir: &std::path::Path, socket: &std::path::Path) -> PathBuf {
    let mut bootstrap = support::xds::bootstrap(socket, false);
    let object = bootstrap.as_object_mut().unwrap();
    object.remove("admin");
    object["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .push(support::xds::pipe_cluster(
            "sds-grpc",
            std::path::Path::new("./var/run/secrets/workload-spiffe-uds/socket"),
        ));
    let path = dir.join("pods.json");
    std::fs::write(&path, bootstrap.to_string()).unwrap();
    path
}

/// b's inbound: TLS with b's own certificate (`default` over SDS), a client
/// certificate required, chaining to `ROOTCA` and naming `client` as its SPIFFE id.
fn mtls_inbound(
    name: &str,
    port: u16,
    cluster: &str,
    client: &str,
) -> envoy_types::pb::envoy::config::listener::v3::Listener {
    use envoy_types::pb::envoy::config::core::v3::{TransportSocket, transport_socket};
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::subject_alt_name_matcher::SanType;
    use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
        CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig,
        SubjectAltNameMatcher, common_tls_context,
    };
    use envoy_types::pb::envoy::r#type::matcher::v3::{StringMatcher, string_matcher};
    let sds = |name: &str| SdsSecretConfig {
        name: name.into(),
        sds_config: Some(harness::ads::resources::grpc_source("sds-grpc")),
    };
    let tls = DownstreamTlsContext {
        common_tls_context: Some(CommonTlsContext {
            tls_certificate_sds_secret_configs: vec![sds("default")],
            validation_context_type: Some(
                common_tls_context::ValidationContextType::CombinedValidationContext(
                    common_tls_context::CombinedCertificateValidationContext {
                        default_validation_context: Some(CertificateValidationContext {
                            match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                                san_type: SanType::Uri as i32,
                                matcher: Some(StringMatcher {
                                    match_pattern: Some(string_matcher::MatchPattern::Exact(
                                        client.into(),
                                    )),
                                    ..Default::default()
                                }),
                                ..Default::default()
                            }],
                            ..Default::default()
                        }),
                        validation_context_sds_secret_config: Some(sds("ROOTCA")),
                        ..Default::default()
                    },
                ),
            ),
            ..Default::default()
        }),
        require_client_certificate: Some(envoy_types::pb::google::protobuf::BoolValue {
            value: true,
        }),
        ..Default::default()
    };
    let mut listener = harness::ads::resources::tcp_proxy_listener(
        name,
        SocketAddr::from(([0, 0, 0, 0], port)),
        cluster,
    );
    listener.filter_chains[0].transport_socket = Some(TransportSocket {
        name: "envoy.transport_sockets.tls".into(),
        config_type: Some(transport_socket::ConfigType::TypedConfig(
            harness::ads::AdsServer::any(&tls),
        )),
    });
    listener.traffic_direction =
        envoy_types::pb::envoy::config::core::v3::TrafficDirection::Inbound as i32;
    // tcp_proxy's access log on the node process's stdout.
    use envoy_types::pb::envoy::config::accesslog::v3::{AccessLog, access_log};
    use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
    use envoy_types::pb::envoy::extensions::access_loggers::file::v3::FileAccessLog;
    use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
    use prost::Message;
    let filter = &mut listener.filter_chains[0].filters[0];
    if let Some(ConfigType::TypedConfig(any)) = &mut filter.config_type {
        let mut proxy = TcpProxy::decode(any.value.as_slice()).unwrap();
        proxy.access_log = vec![AccessLog {
            name: "envoy.access_loggers.file".into(),
            config_type: Some(access_log::ConfigType::TypedConfig(
                harness::ads::AdsServer::any(&FileAccessLog {
                    path: "/dev/stdout".into(),
                    ..Default::default()
                }),
            )),
            ..Default::default()
        }];
        *any = harness::ads::AdsServer::any(&proxy);
    }
    listener
}

const TOKEN: &str = "node-token";

fn spiffe(sa: &str) -> String {
    format!("spiffe://cluster.local/ns/default/sa/{sa}")
}

fn xds_id(pod: &Pod) -> String {
    format!(
        "sidecar~{}~{}.default~default.svc.cluster.local",
        pod.ipv4(),
        pod.name()
    )
}

/// A pod's outbound push (a's in [`Mesh`]): 15001 proxies to b's app over mTLS,
/// requiring b's identity, through the EDS cluster `to-b` (connecting within
/// `connect_timeout_s`), all at `version`.
fn outbound_push(
    ads: &harness::ads::AdsServer,
    node_id: &str,
    b: &Pod,
    version: &str,
    connect_timeout_s: i64,
) {
    use harness::ads::resources::{
        ads_source, eds_cluster, grpc_source, load_assignment, named, tcp_proxy_listener,
        with_upstream_mtls,
    };
    use harness::ads::type_urls;
    let to_b = with_upstream_mtls(
        eds_cluster("to-b", ads_source(), connect_timeout_s),
        grpc_source("sds-grpc"),
        "default",
        "ROOTCA",
        &spiffe("sb"),
    );
    ads.set_for_node(
        node_id,
        type_urls::CLUSTER,
        version,
        vec![named("to-b", &to_b)],
    );
    ads.set_for_node(
        node_id,
        type_urls::ENDPOINT,
        version,
        vec![named("to-b", &load_assignment("to-b", &[v4(b, 8080)]))],
    );
    let listener = tcp_proxy_listener(
        "virtualOutbound",
        SocketAddr::from(([0, 0, 0, 0], 15001)),
        "to-b",
    );
    ads.set_for_node(
        node_id,
        type_urls::LISTENER,
        version,
        vec![named("virtualOutbound", &listener)],
    );
}

/// A node of two pods served by one node process with per-pod proxies from a test
/// control plane and certificates from a test CA: a (service account `sa`) calls b
/// (`sb`) over mTLS; a's outbound requires b's SPIFFE id, b's inbound requires
/// `b_requires`. Fields drop in order: the node process first, the node last.
struct Mesh {
    agent: NodeAgent,
    _app: harness::PodProcess,
    ads: harness::ads::AdsServer,
    _ads_dir: TempDir,
    socket: PathBuf,
    ca: harness::ca::TestCa,
    a: Pod,
    b: Pod,
    node: Node,
    _pins: Pins,
    _tmp: TempDir,
}

impl Mesh {
    fn start(tag: &str, b_requires: &str, flags: &[&str]) -> Mesh {
        use harness::ads::resources::named;
        use harness::ads::type_urls;
        let mut node = Node::new().expect("node");
        let a = node.add_pod("a").expect("pod a");
        let b = node.add_pod("b").expect("pod b");
        let app = start_app(&b, &[8080]);
        let pins = Pins(bpffs_root(tag));
        let tmp = TempDir::new(tag);
        let gateway = IpAddr::V4(node.gateway_ipv4());
        let ca = harness::run_in_netns(&node.bridge_netns_path(), || {
            harness::ca::TestCa::start_on(&tmp.0, TOKEN, Duration::from_secs(3600), gateway)
        })
        .unwrap()
        .unwrap();
        let token = tmp.0.join("token");
        std::fs::write(&token, TOKEN).unwrap();
        let (ads_dir, socket, ads) = support::xds::unix_server(&format!("{tag}-ads"));
        let template = pod_template(&tmp.0, &socket);

        // a: 15001 proxies to b's app over mTLS, requiring b's identity.
        outbound_push(&ads, &xds_id(&a), &b, "a1", 2);
        // b: 15006 terminates mTLS, requiring `b_requires`, to its app on loopback.
        ads.set_for_node(
            &xds_id(&b),
            type_urls::CLUSTER,
            "b1",
            vec![support::xds::eds_cluster("inbound-app", 2)],
        );
        ads.set_for_node(
            &xds_id(&b),
            type_urls::ENDPOINT,
            "b1",
            vec![named(
                "inbound-app",
                &harness::ads::resources::load_assignment("inbound-app", &[local(8080)]),
            )],
        );
        ads.set_for_node(
            &xds_id(&b),
            type_urls::LISTENER,
            "b1",
            vec![named(
                "virtualInbound",
                &mtls_inbound("virtualInbound", 15006, "inbound-app", &spiffe(b_requires)),
            )],
        );

        let config = template.display().to_string();
        let ca_root = ca.root_file.display().to_string();
        let ca_token = token.display().to_string();
        let ca_addr = ca.address();
        let mut args = vec![
            "--config",
            &config,
            "--ca-addr",
            &ca_addr,
            "--ca-root",
            &ca_root,
            "--ca-token",
            &ca_token,
        ];
        args.extend_from_slice(flags);
        let mut agent = NodeAgent::start(&node, &pins.0, &args);
        agent.add_as(&a, "sa");
        agent.add_as(&b, "sb");
        Mesh {
            agent,
            _app: app,
            ads,
            _ads_dir: ads_dir,
            socket,
            ca,
            a,
            b,
            node,
            _pins: pins,
            _tmp: tmp,
        }
    }

    /// a's app calls b's app through both pods' proxies.
    fn call(&self) -> anyhow::Result<harness::Call> {
        Caller {
            bytes: 1 << 16,
            ..Caller::app(&self.a)
        }
        .call(v4(&self.b, 8080))
    }

    /// b's inbound access log line of a connection from a (tcp_proxy's log).
    fn inbound_entry(&self) -> Value {
        self.agent.entry("b's inbound", |v| {
            v["direction"] == "inbound" && v["upstream_cluster"] == "inbound-app"
        })
    }
}

/// Per-pod identity and config: two pods of one node process are two xDS nodes (each
/// with Istio's sidecar id and its own metadata), get different listeners and clusters
/// from the control plane, and certificates of their own service accounts from the CA.
/// a's outbound originates mTLS requiring b's SPIFFE id; b's inbound requires a's: the
/// call only goes through if each pod's proxy has its own config and certificate.
#[test]
fn each_pod_is_its_own_xds_node_with_its_own_config_and_certificate() {
    // Over the network, with real TLS between the two pods' proxies.
    let mut mesh = Mesh::start("node-xds", "sa", &["--no-fast-path"]);
    // The instant enrollment returned, before either pod has its config: the call
    // waits in the pods' backlogs and goes through once they have it.
    let call = mesh.call().unwrap_or_else(|e| {
        panic!(
            "a -> b through both pods' proxies: {e:#}\n{}",
            mesh.agent.stderr()
        )
    });
    let Mesh {
        agent,
        ads,
        ca,
        a,
        b,
        node,
        socket,
        ..
    } = &mut mesh;
    let (a, b) = (&*a, &*b);
    let id = xds_id;
    assert_eq!(call.bytes, 1 << 16);
    // b's app is reached from b's own loopback (b's proxy, inside b).
    assert_eq!(call.server_peer.ip(), IpAddr::from([127, 0, 0, 1]));

    // Each pod's stream carried its own node: Istio's id and the pod's metadata.
    for (pod, sa) in [(a, "sa"), (b, "sb")] {
        let first = ads
            .requests()
            .into_iter()
            .find(|r| r.node_id.as_deref() == Some(id(pod).as_str()) && r.node.is_some())
            .unwrap_or_else(|| panic!("no ADS stream from {}", id(pod)));
        let node = first.node.unwrap();
        assert_eq!(node.cluster, format!("{}.default", pod.name()));
        let meta = |key: &str| match node
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get(key))
            .and_then(|v| v.kind.clone())
        {
            Some(envoy_types::pb::google::protobuf::value::Kind::StringValue(s)) => s,
            other => panic!("{key} of {}: {other:?}", id(pod)),
        };
        assert_eq!(meta("SERVICE_ACCOUNT"), sa);
        assert_eq!(meta("NAMESPACE"), "default");
        assert_eq!(meta("NAME"), pod.name());
        assert_eq!(
            meta("INSTANCE_IPS"),
            format!("{},{}", pod.ipv4(), pod.ipv6())
        );
        // The template's metadata is kept under the pod's.
        assert_eq!(meta("ISTIO_VERSION"), "1.24.0");
    }
    // Two streams (an xDS stream carries one node), one connection to the control plane.
    assert_eq!(ads.streams(), 2);
    assert_eq!(
        connections_to(agent.child.id(), socket),
        1,
        "pods share the control plane connection"
    );
    // One CA client per service account: each identity asked for (and signed) once.
    let mut asked: Vec<String> = ca
        .calls()
        .iter()
        .filter(|c| c.refused.is_none())
        .flat_map(|c| c.uris.clone())
        .collect();
    asked.sort();
    assert_eq!(asked, vec![spiffe("sa"), spiffe("sb")]);

    // Each pod's stats are its own: a counted the outbound connection, b the inbound.
    assert_eq!(agent.stat(a, "tcp.virtualOutbound.downstream_cx_total"), 1);
    assert_eq!(agent.stat(b, "tcp.virtualOutbound.downstream_cx_total"), 0);
    assert_eq!(agent.stat(b, "tcp.virtualInbound.downstream_cx_total"), 1);
    assert_eq!(agent.stat(a, "tcp.virtualInbound.downstream_cx_total"), 0);
    // Over the network: a real handshake on each side.
    assert_eq!(agent.stat(a, "cluster.to-b.ssl.handshake"), 1);
    assert_eq!(agent.stat(b, "listener.0.0.0.0_15006.ssl.handshake"), 1);

    // A third pod of a's service account shares a's CA client: no new certificate.
    let c = node.add_pod("c").expect("pod c");
    agent.add_as(&c, "sa");
    let signed = ca.calls().iter().filter(|c| c.refused.is_none()).count();
    assert_eq!(signed, 2, "{:?}", ca.calls());
}

/// The same-node fast path: a's mTLS connection to b, both pods of this process, is
/// handed to b's inbound side in process: no TLS handshake on either side, yet b's
/// inbound still checks a's certificate (its required SPIFFE id), counts the
/// connection, logs a's address as the client's, and connects to b's app from inside
/// b. With b requiring another identity the handed connection is refused as the
/// handshake would have been.
#[test]
fn same_node_mtls_is_handed_over_in_process_with_the_destination_policy_applied() {
    let mut mesh = Mesh::start("node-fast", "sa", &[]);
    let (a, b) = (mesh.a.clone(), mesh.b.clone());
    // Until b has its inbound listener a connection to it waits in its backlog, over
    // the network; from then on it is handed over.
    mesh.agent.wait_ready(&a);
    mesh.agent.wait_ready(&b);
    let call = mesh
        .call()
        .unwrap_or_else(|e| panic!("a -> b over the fast path: {e:#}\n{}", mesh.agent.stderr()));
    assert_eq!(call.bytes, 1 << 16);
    assert_eq!(call.server_peer.ip(), IpAddr::from([127, 0, 0, 1]));
    let inbound = mesh.inbound_entry();
    let remote: SocketAddr = inbound["downstream_remote_address"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(remote.ip(), IpAddr::V4(mesh.a.ipv4()), "{inbound}");
    assert_eq!(inbound["bytes_received"], 1 << 16, "{inbound}");
    let agent = &mut mesh.agent;
    assert_eq!(agent.stat(&b, "tcp.virtualInbound.downstream_cx_total"), 1);
    assert_eq!(agent.stat(&a, "cluster.to-b.upstream_cx_total"), 1);
    // No handshake on either side.
    assert_eq!(agent.stat(&a, "cluster.to-b.ssl.handshake"), 0);
    assert_eq!(agent.stat(&b, "listener.0.0.0.0_15006.ssl.handshake"), 0);
    assert_eq!(
        agent.stat(&b, "listener.0.0.0.0_15006.ssl.connection_error"),
        0
    );
    drop(mesh);

    // b requires an identity a does not have: refused on the fast path too.
    let mut mesh = Mesh::start("node-fast-deny", "sx", &[]);
    let (a, b) = (mesh.a.clone(), mesh.b.clone());
    mesh.agent.wait_ready(&a);
    mesh.agent.wait_ready(&b);
    let refused = Caller::app(&mesh.a).call_json(v4(&mesh.b, 8080));
    assert_eq!(refused["ok"], false, "{refused}");
    let agent = &mut mesh.agent;
    assert_eq!(
        agent.stat(&b, "listener.0.0.0.0_15006.ssl.connection_error"),
        1
    );
    assert_eq!(agent.stat(&a, "cluster.to-b.ssl.connection_error"), 1);
    assert_eq!(agent.stat(&b, "tcp.virtualInbound.downstream_cx_total"), 0);
}

/// dnsmasq on port 53 of `pod`'s IPv4 address, answering `records` itself and nothing
/// else (no upstream): the resolver the pods' resolv.conf names.
fn dnsmasq_resolver(pod: &Pod, records: &[(&str, &str)]) -> harness::PodProcess {
    let mut cmd = pod.command("dnsmasq").args([
        "--keep-in-foreground",
        "--conf-file=/dev/null",
        "--no-hosts",
        "--no-resolv",
        "--bind-interfaces",
        "--log-facility=-",
        "--pid-file=",
        "--port=53",
    ]);
    cmd = cmd.arg(format!("--listen-address={}", pod.ipv4()));
    for (name, addr) in records {
        cmd = cmd.arg(format!("--address=/{name}/{addr}"));
    }
    let server = cmd.spawn().expect("start dnsmasq");
    harness::wait_for_port(pod, v4(pod, 53), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}\ndnsmasq: {}", server.stderr_text()));
    server
}

/// `dig +short NAME` run in `pod` as its app (uid 1000), reading `resolv` as its
/// resolv.conf (no explicit server): the answers, one a line.
fn dig_in(pod: &Pod, resolv: &std::path::Path, args: &[&str]) -> String {
    let out = pod
        .command("dig")
        .uid(1000)
        .gid(1000)
        .resolv_conf(resolv)
        .args(["+short", "+time=5", "+tries=1"])
        .args(args)
        .timeout(Duration::from_secs(20))
        .output()
        .expect("dig");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Per-pod DNS: with DNS capture on, each enrolled pod's queries reach a DNS proxy the
/// node process opened on that pod's own loopback 15053. A mesh name is answered from
/// the pod's own name table (the NDS its xDS stream got: a and b get different
/// answers), anything else is forwarded from inside the pod to its resolver (dnsmasq in
/// pod `resolver`), over UDP and TCP. Removing a pod closes its DNS proxy.
#[test]
fn each_pod_resolves_mesh_names_from_its_own_name_table_and_forwards_the_rest() {
    use harness::ads::type_urls;
    use support::nds::{NameTable, TYPE_URL as NDS, service_entry};
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let resolver = node.add_pod("resolver").expect("pod resolver");
    let _dnsmasq = dnsmasq_resolver(&resolver, &[("outside.test", "10.99.0.4")]);
    let pins = Pins(bpffs_root("node-dns"));
    let tmp = TempDir::new("node-dns");
    let resolv = tmp.0.join("resolv.conf");
    std::fs::write(
        &resolv,
        format!(
            "nameserver {}\noptions timeout:5 attempts:1\n",
            resolver.ipv4()
        ),
    )
    .unwrap();
    let (_ads_dir, socket, ads) = support::xds::unix_server("node-dns-ads");
    let template = pod_template(&tmp.0, &socket);
    let table = |ip: &str| {
        let table = NameTable {
            table: [("shop.mesh.test".to_owned(), service_entry(&[ip]))].into(),
        };
        use prost::Message;
        vec![(
            String::new(),
            harness::ads::Any {
                type_url: NDS.into(),
                value: table.encode_to_vec(),
            },
        )]
    };
    // No listeners or clusters (a node's own resources replace the shared ones): the
    // name table alone differs.
    for (pod, ip) in [(&a, "240.240.0.1"), (&b, "240.240.0.2")] {
        ads.set_for_node(&xds_id(pod), type_urls::CLUSTER, "1", Vec::new());
        ads.set_for_node(&xds_id(pod), type_urls::LISTENER, "1", Vec::new());
        ads.set_for_node(&xds_id(pod), NDS, "1", table(ip));
    }

    let config = template.display().to_string();
    let resolv_arg = resolv.display().to_string();
    let resolver_ip = resolver.ipv4().to_string();
    let mut agent = NodeAgent::start(
        &node,
        &pins.0,
        &[
            "--config",
            &config,
            "--dns-resolv-conf",
            &resolv_arg,
            "--redirect-dns",
            "--dns-servers-v4",
            &resolver_ip,
        ],
    );
    agent.add(&a);
    agent.add(&b);
    for pod in [&a, &b] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while agent.stat(pod, "nds.update_success") == 0 {
            assert!(
                Instant::now() < deadline,
                "{} never got its name table\n{}",
                pod.name(),
                agent.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // Each pod its own table; over UDP and TCP.
    assert_eq!(dig_in(&a, &resolv, &["shop.mesh.test"]), "240.240.0.1");
    assert_eq!(dig_in(&b, &resolv, &["shop.mesh.test"]), "240.240.0.2");
    assert_eq!(
        dig_in(&a, &resolv, &["+tcp", "shop.mesh.test"]),
        "240.240.0.1"
    );
    // Not in the table: forwarded to the pod's resolver, from inside the pod.
    assert_eq!(dig_in(&a, &resolv, &["outside.test"]), "10.99.0.4");
    assert_eq!(dig_in(&b, &resolv, &["+tcp", "outside.test"]), "10.99.0.4");
    // The answers came from each pod's own DNS proxy, by its counters.
    assert_eq!(agent.stat(&a, "dns.answered_locally_total"), 2);
    assert_eq!(agent.stat(&a, "dns.upstream_requests_total"), 1);
    assert_eq!(agent.stat(&b, "dns.answered_locally_total"), 1);
    assert_eq!(agent.stat(&b, "dns.upstream_requests_total"), 1);
    assert_eq!(agent.stat(&a, "dns.upstream_failures_total"), 0);

    // Removed: a's DNS proxy is gone (its loopback 15053 answers nothing) and, no longer
    // captured, a's queries go to its resolver, which knows no mesh name.
    agent.remove(&a);
    let direct = a
        .command("dig")
        .args(["+short", "+time=2", "+tries=1", "-p", "15053", "@127.0.0.1"])
        .arg("shop.mesh.test")
        .timeout(Duration::from_secs(20))
        .output()
        .expect("dig");
    assert!(!direct.status.success(), "a's 15053 still answers");
    assert_eq!(dig_in(&a, &resolv, &["shop.mesh.test"]), "");
    assert_eq!(dig_in(&a, &resolv, &["outside.test"]), "10.99.0.4");
    // b is still served.
    assert_eq!(dig_in(&b, &resolv, &["shop.mesh.test"]), "240.240.0.2");
}

/// Per-service-account CA clients: pods enrolled without a token of their own are
/// certified with the node's token (as Istio's node agents do, naming the identity as
/// ztunnel does in the request's `ImpersonatedIdentity`), a pod enrolled with its
/// account's token presents that one; pods of one account share one client, and the
/// client stops (no further CSRs at rotation) once its account's last pod has left.
#[test]
fn ca_clients_are_per_service_account_with_its_token_and_stop_with_the_last_pod() {
    use harness::ads::type_urls;
    let mut node = Node::new().expect("node");
    let a1 = node.add_pod("a1").expect("pod a1");
    let a2 = node.add_pod("a2").expect("pod a2");
    let c = node.add_pod("c").expect("pod c");
    let d = node.add_pod("d").expect("pod d");
    let pins = Pins(bpffs_root("node-sa"));
    let tmp = TempDir::new("node-sa");
    let gateway = IpAddr::V4(node.gateway_ipv4());
    // Short-lived certificates: each client rotates every second or so.
    let ca = harness::run_in_netns(&node.bridge_netns_path(), || {
        harness::ca::TestCa::start_on(&tmp.0, TOKEN, Duration::from_secs(3), gateway)
    })
    .unwrap()
    .unwrap();
    ca.accept_token("sc-token");
    let node_token = tmp.0.join("token");
    std::fs::write(&node_token, TOKEN).unwrap();
    let sc_token = tmp.0.join("sc-token");
    std::fs::write(&sc_token, "sc-token").unwrap();
    let (_ads_dir, socket, ads) = support::xds::unix_server("node-sa-ads");
    let template = pod_template(&tmp.0, &socket);
    for pod in [&a1, &a2, &c, &d] {
        ads.set_for_node(&xds_id(pod), type_urls::CLUSTER, "1", Vec::new());
        ads.set_for_node(&xds_id(pod), type_urls::LISTENER, "1", Vec::new());
    }
    let (config, ca_root, ca_token, ca_addr) = (
        template.display().to_string(),
        ca.root_file.display().to_string(),
        node_token.display().to_string(),
        ca.address(),
    );
    let mut agent = NodeAgent::start(
        &node,
        &pins.0,
        &[
            "--config",
            &config,
            "--ca-addr",
            &ca_addr,
            "--ca-root",
            &ca_root,
            "--ca-token",
            &ca_token,
            "--no-capture",
        ],
    );
    agent.add_as(&a1, "sa");
    agent.add_as(&a2, "sa");
    agent.add_with(&c, &format!("sa=sc token={}", sc_token.display()));

    // Signed CSRs by identity, with the tokens they were presented with and the
    // identity they impersonated.
    let signed = |sa: &str| -> Vec<(Option<String>, Option<String>)> {
        ca.calls()
            .into_iter()
            .filter(|call| call.refused.is_none() && call.uris == [spiffe(sa)])
            .map(|call| (call.authorization, call.impersonated_identity))
            .collect()
    };
    let log = agent.stderr.clone();
    let wait_for = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(
                Instant::now() < deadline,
                "{what}: {:?}\n{}",
                ca.calls(),
                log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait_for("both accounts certified", &|| {
        !signed("sa").is_empty() && !signed("sc").is_empty()
    });
    assert!(
        ca.calls().iter().all(|call| call.refused.is_none()),
        "{:?}",
        ca.calls()
    );
    let node_bearer = Some(format!("Bearer {TOKEN}"));
    assert!(
        signed("sa")
            .iter()
            .all(|t| *t == (node_bearer.clone(), Some(spiffe("sa")))),
        "{:?}",
        signed("sa")
    );
    // Its own token: no one impersonated.
    let sc_bearer = Some("Bearer sc-token".to_owned());
    assert!(
        signed("sc").iter().all(|t| *t == (sc_bearer.clone(), None)),
        "{:?}",
        signed("sc")
    );
    let stderr = agent.stderr();
    assert_eq!(stderr.matches("CA client stopped").count(), 0, "{stderr}");

    // c, sc's only pod, leaves, and so does a1 (a2 keeps sa's client): sc's client
    // stops, sa's rotates on.
    agent.remove(&c);
    agent.remove(&a1);
    let sc_then = signed("sc").len();
    let sa_then = signed("sa").len();
    wait_for("two rotations of sa's client", &|| {
        signed("sa").len() >= sa_then + 2
    });
    assert_eq!(
        signed("sc").len(),
        sc_then,
        "sc's client went on after its last pod left"
    );

    // The other way round: a2, sa's last pod, leaves; d brings a new client for sc.
    agent.remove(&a2);
    agent.add_with(&d, &format!("sa=sc token={}", sc_token.display()));
    let sa_then = signed("sa").len();
    let sc_then = signed("sc").len();
    wait_for("two rotations of sc's new client", &|| {
        signed("sc").len() >= sc_then + 2
    });
    assert_eq!(
        signed("sa").len(),
        sa_then,
        "sa's client went on after its last pod left"
    );
    assert_eq!(agent.stderr().matches("CA client stopped").count(), 2);
}

/// GET `path` on `port` of the pod's own loopback, from inside the pod: (status, body).
fn http_get_in(pod: &Pod, port: u16, path: &str) -> (String, String) {
    let out = pod
        .command("curl")
        .args(["-s", "-w", "\n%{http_code}"])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .timeout(Duration::from_secs(20))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').unwrap_or(("", &text));
    (status.to_owned(), body.to_owned())
}

/// The value of the Prometheus sample whose line starts with `metric{` and holds `label`.
fn sample(text: &str, metric: &str, label: &str) -> Option<u64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) && l.contains(label))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Per-pod health and Prometheus ports, as an Istio sidecar has them inside its pod:
/// each pod's 15021 says ready, and its 15090 `/stats/prometheus` shows that pod's own
/// stats only: a counted the outbound connection, b the inbound one, and neither
/// scrape carries the other pod's listener.
#[test]
fn each_pods_prometheus_port_shows_its_own_stats_only() {
    let mesh = Mesh::start("node-prom", "sa", &["--no-fast-path"]);
    let call = mesh
        .call()
        .unwrap_or_else(|e| panic!("a -> b: {e:#}\n{}", mesh.agent.stderr()));
    assert_eq!(call.bytes, 1 << 16);
    for pod in [&mesh.a, &mesh.b] {
        assert_eq!(http_get_in(pod, 15021, "/healthz/ready").0, "200");
    }
    let (status, a) = http_get_in(&mesh.a, 15090, "/stats/prometheus");
    assert_eq!(status, "200", "{a}");
    let (status, b) = http_get_in(&mesh.b, 15090, "/stats/prometheus");
    assert_eq!(status, "200", "{b}");
    let cx = "envoy_tcp_downstream_cx_total";
    assert_eq!(sample(&a, cx, "\"virtualOutbound\""), Some(1), "{a}");
    assert_eq!(sample(&b, cx, "\"virtualInbound\""), Some(1), "{b}");
    assert!(
        !a.contains("virtualInbound"),
        "a's scrape shows b's listener:\n{a}"
    );
    assert!(
        !b.contains("virtualOutbound"),
        "b's scrape shows a's listener:\n{b}"
    );
    // a's upstream TLS (to b) is a's alone.
    let handshakes = "envoy_cluster_ssl_handshake";
    assert_eq!(sample(&a, handshakes, "\"to-b\""), Some(1), "{a}");
    assert!(!b.contains("to-b"), "{b}");
    // Not a stats path: 404.
    assert_eq!(http_get_in(&mesh.a, 15090, "/quitquitquit").0, "404");
}

/// Workload discovery per pod: each pod's xDS stream (state of the world) gives its own
/// `istio.workload.Workload` set, and each pod's inbound peer_metadata
/// (`workload_discovery`) names the same client by its pod's own set: one pod's update
/// does not replace what another pod's stream gave.
#[test]
fn each_pod_finds_peers_in_the_workloads_its_own_stream_gave() {
    use prost::Message;
    use serde_json::json;
    use shunt::peer::workload_discovery::{TYPE_URL as WDS, WorkloadResource};
    let mut node = Node::new().expect("node");
    let a = node.add_pod("a").expect("pod a");
    let b = node.add_pod("b").expect("pod b");
    let client = node.add_pod("client").expect("pod client");
    let http_app = |pod: &Pod| {
        let app = pod
            .command(testapp_bin())
            .args(["serve", "--mode", "http", "--listen", "0.0.0.0:8081"])
            .spawn()
            .expect("start testapp serve");
        harness::wait_for_port(pod, v4(pod, 8081), Duration::from_secs(10)).expect("app");
        app
    };
    let _apps = [http_app(&a), http_app(&b)];
    let pins = Pins(bpffs_root("node-wds"));
    let tmp = TempDir::new("node-wds");
    let (_ads_dir, socket, ads) = support::xds::unix_server("node-wds-ads");

    // The template: Istio's bootstrap extension (WDS over ADS) and an inbound listener
    // whose peer_metadata finds the downstream by its address, counted by istio.stats.
    let mut bootstrap = support::xds::bootstrap(&socket, false);
    bootstrap.as_object_mut().unwrap().remove("admin");
    bootstrap["bootstrap_extensions"] = json!([{"name": "metadata_discovery", "typed_config": {
        "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
        "type_url": "type.googleapis.com/istio.workload.BootstrapExtension",
        "value": {"config_source": {"ads": {}}}}}]);
    bootstrap["static_resources"]["listeners"] = json!([{
        "name": "virtualInbound", "traffic_direction": "INBOUND",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15006}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "inbound",
            "http_filters": [
                {"name": "istio.metadata_exchange", "typed_config": {
                    "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
                    "type_url": "type.googleapis.com/io.istio.http.peer_metadata.Config",
                    "value": {"downstream_discovery": [{"workload_discovery": {}}]}}},
                {"name": "istio.stats", "typed_config": {"@type": "type.googleapis.com/stats.PluginConfig"}},
                {"name": "envoy.filters.http.router", "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
            "route_config": {"name": "inbound", "virtual_hosts": [{"name": "all", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "inbound|8081||"}}]}]}}}]}]
    }]);
    bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "inbound|8081||", "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": "inbound|8081||", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8081}}}}]}]}}));
    let template = tmp.0.join("pods.json");
    std::fs::write(&template, bootstrap.to_string()).unwrap();

    // The client's address, named differently on each pod's stream.
    let named = |workload: &str| {
        let resource = WorkloadResource {
            uid: "Kubernetes//Pod/default/client".into(),
            name: "client".into(),
            namespace: "default".into(),
            addresses: vec![client.ipv4().octets().to_vec()],
            service_account: workload.into(),
            canonical_name: workload.into(),
            workload_name: workload.into(),
            ..Default::default()
        };
        vec![(
            resource.uid.clone(),
            harness::ads::Any {
                type_url: WDS.into(),
                value: resource.encode_to_vec(),
            },
        )]
    };
    for (pod, workload) in [(&a, "client-as-a-knows-it"), (&b, "client-as-b-knows-it")] {
        ads.set_for_node(
            &xds_id(pod),
            harness::ads::type_urls::CLUSTER,
            "1",
            Vec::new(),
        );
        ads.set_for_node(
            &xds_id(pod),
            harness::ads::type_urls::LISTENER,
            "1",
            Vec::new(),
        );
        ads.set_for_node(&xds_id(pod), WDS, "1", named(workload));
    }

    let config = template.display().to_string();
    let mut agent = NodeAgent::start(&node, &pins.0, &["--config", &config, "--no-capture"]);
    agent.add(&a);
    agent.add(&b);
    for pod in [&a, &b] {
        let deadline = Instant::now() + Duration::from_secs(30);
        while agent.stat(pod, "workload_discovery.update_success") == 0 {
            assert!(
                Instant::now() < deadline,
                "{} never got its workloads\n{}",
                pod.name(),
                agent.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // Plain HTTP (no peer metadata headers) from the client to each pod's inbound.
    for pod in [&a, &b] {
        let out = client
            .command("curl")
            .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
            .arg(format!("http://{}:15006/", pod.ipv4()))
            .timeout(Duration::from_secs(20))
            .output()
            .expect("curl");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "200",
            "{}",
            agent.stderr()
        );
    }
    let source_of = |pod: &Pod| -> Vec<String> {
        let (status, text) = http_get_in(pod, 15090, "/stats/prometheus");
        assert_eq!(status, "200", "{text}");
        text.lines()
            .filter(|l| l.starts_with("istio_requests_total{"))
            .filter_map(|l| {
                let at = l.find("source_workload=\"")? + "source_workload=\"".len();
                Some(l[at..].split('"').next()?.to_owned())
            })
            .collect()
    };
    assert_eq!(source_of(&a), ["client-as-a-knows-it"]);
    assert_eq!(source_of(&b), ["client-as-b-knows-it"]);
}

/// Pods of one process that get the same push share it: a third pod given a's push
/// (its own xDS stream, its own node id) adds no decoded copy of any resource and no
/// compiled cluster, and makes its own cluster (stats, hosts) only when first used; a push changing its copy of a's cluster adds that cluster for it
/// alone, while a's config_dump and traffic stay as they were; each pod counts its own
/// connections; and once every pod is gone nothing is interned any more.
#[test]
fn pods_with_the_same_push_share_it_and_keep_their_own_state() {
    let mut mesh = Mesh::start("node-intern", "sa", &["--no-fast-path"]);
    mesh.call()
        .unwrap_or_else(|e| panic!("a -> b: {e:#}\n{}", mesh.agent.stderr()));
    let Mesh {
        agent,
        ads,
        a,
        b,
        node,
        ..
    } = &mut mesh;
    let (a, b) = (&*a, &*b);
    let two_pods = agent.interned();
    assert!(two_pods.decoded > 0, "a's and b's pushes are interned");
    assert!(two_pods.clusters > 0, "a's and b's clusters are shared");
    let a_clusters = agent.clusters(a);
    assert!(a_clusters.contains("to-b=a1:"), "{a_clusters}");

    // c: another pod of a's service account with a's push.
    let c = node.add_pod("c").expect("pod c");
    outbound_push(ads, &xds_id(&c), b, "a1", 2);
    agent.add_as(&c, "sa");
    agent.wait_ready(&c);
    // Ready without a cluster of its own: c's `to-b` is made by its first use.
    assert_eq!(agent.stats_under(&c, "cluster.to-b."), 0);
    let caller = |pod: &Pod| {
        Caller {
            bytes: 1 << 12,
            ..Caller::app(pod)
        }
        .call(v4(b, 8080))
    };
    let call = caller(&c).unwrap_or_else(|e| panic!("c -> b: {e:#}\n{}", agent.stderr()));
    assert_eq!(call.bytes, 1 << 12);
    assert!(agent.stats_under(&c, "cluster.to-b.") > 0);
    assert_eq!(agent.clusters(&c), a_clusters, "c has a's config");
    assert_eq!(
        agent.interned(),
        two_pods,
        "c shares a's push and its compiled clusters"
    );

    // c's copy of `to-b` changes (another connect timeout): a new cluster for c alone
    // (compiled with the endpoints a has too: no copy of them).
    outbound_push(ads, &xds_id(&c), b, "c2", 3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !agent.clusters(&c).contains("to-b=c2:") {
        assert!(
            Instant::now() < deadline,
            "c never got c2\n{}",
            agent.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_ne!(agent.clusters(&c), a_clusters);
    let c_own = Interned {
        decoded: two_pods.decoded + 1,
        clusters: two_pods.clusters + 1,
        ..two_pods
    };
    assert_eq!(agent.interned_until(|n| n == c_own), c_own);
    assert_eq!(
        agent.clusters(a),
        a_clusters,
        "c's update left a's config as it was"
    );
    let call = caller(a).unwrap_or_else(|e| panic!("a -> b after c's update: {e:#}"));
    assert_eq!(call.bytes, 1 << 12);
    let call = caller(&c).unwrap_or_else(|e| panic!("c -> b after its update: {e:#}"));
    assert_eq!(call.bytes, 1 << 12);
    // Each pod counts its own: a made two outbound connections, c two; the cluster a
    // shared with c until c's update counts a's alone.
    assert_eq!(agent.stat(a, "tcp.virtualOutbound.downstream_cx_total"), 2);
    assert_eq!(agent.stat(&c, "tcp.virtualOutbound.downstream_cx_total"), 2);
    assert_eq!(agent.stat(b, "tcp.virtualOutbound.downstream_cx_total"), 0);
    assert_eq!(agent.stat(a, "cluster.to-b.upstream_cx_total"), 2);

    // c gone: its own copies go with it, a's stay; every pod gone: nothing interned.
    agent.remove(&c);
    assert_eq!(agent.interned_until(|n| n == two_pods), two_pods);
    agent.remove(a);
    agent.remove(b);
    let none = Interned {
        decoded: 0,
        clusters: 0,
        route_configs: 0,
    };
    assert_eq!(
        agent.interned_until(|n| n == none),
        none,
        "{}",
        agent.stderr()
    );
}
