//! Node mode's lifecycle with real processes on a node built by the real CNI plugins
//! (bridge + host-local, `shunt-cni` chained) and eBPF capture, fail-closed: a second
//! `shunt node` leaves the node as it found it; an upgrade (`--take-over`) passes the
//! node to a new process with traffic looping through it all; a crash on either side
//! of a hand-over leaves no pod reachable around a proxy; `shunt node uninstall` leaves
//! nothing attached or pinned (checked with bpftool). Needs root.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use harness::{Node, shunt_bin};
use serde_json::{Value, json};
use support::cni::*;

/// A node with a CNI runtime whose chain ends in `shunt-cni`, its scratch and its pins.
struct Scene {
    node: Node,
    scratch: Scratch,
    pins: Pins,
    runtime: Runtime,
}

impl Scene {
    fn new(tag: &str, subnet: &str) -> Scene {
        let node = Node::new().unwrap();
        let scratch = Scratch::new(&format!("life-{tag}"));
        std::os::unix::fs::symlink(shunt_bin(), scratch.0.join("bin/shunt-cni")).unwrap();
        let pins = Pins(PathBuf::from(format!(
            "/sys/fs/bpf/shunt-test-{}-life-{tag}",
            std::process::id()
        )));
        let runtime = Runtime {
            host_netns: node.bridge_netns_path(),
            cni_path: format!("{CNI_PLUGINS}:{}", scratch.0.join("bin").display()),
            conflist: json!({
                "cniVersion": "1.0.0",
                "name": "k8s-pod-network",
                "plugins": [
                    {"type": "bridge", "bridge": "cni0", "isGateway": true,
                     "ipam": {"type": "host-local", "dataDir": scratch.0.join("ipam"),
                              "ranges": [[{"subnet": subnet}]]}},
                    {"type": "shunt-cni", "agent_socket": scratch.0.join("cni.sock"),
                     "agent_unavailable": "fail"}
                ]
            }),
        };
        Scene {
            node,
            scratch,
            pins,
            runtime,
        }
    }

    fn socket(&self) -> PathBuf {
        self.scratch.0.join("cni.sock")
    }

    fn state(&self) -> PathBuf {
        self.scratch.0.join("state")
    }

    /// A `shunt node` with capture, its log in `name.log`.
    fn agent(&self, name: &str, extra: &[&str]) -> NodeAgent {
        NodeAgent::spawn(
            &self.node,
            &self.socket(),
            &self.state(),
            &self.scratch.0.join(format!("{name}.log")),
            Some(&self.pins.0),
            extra,
        )
    }

    fn ready_file(&self, name: &str) -> PathBuf {
        self.scratch.0.join(format!("{name}.ready"))
    }
}

/// A pod sandbox ADDed through the chain, with its result.
struct Sandboxed {
    sandbox: Sandbox,
    path: PathBuf,
    name: String,
    result: Value,
}

impl Sandboxed {
    fn ip(&self) -> String {
        address(&self.result)
    }

    fn invocation(&self) -> Invocation<'_> {
        Invocation {
            container_id: &self.name,
            netns: &self.path,
            args: pod_args(&self.name),
        }
    }
}

/// Builds a pod: the runtime's loopback, then the chain's ADD.
fn add_pod(scene: &Scene, name: &str, agent: &NodeAgent) -> Sandboxed {
    let sandbox = Sandbox::new(name);
    let path = sandbox.path();
    let invocation = Invocation {
        container_id: name,
        netns: &path,
        args: pod_args(name),
    };
    let lo = json!({"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"});
    let (ok, out) = scene.runtime.exec("ADD", &invocation, &lo);
    assert!(ok, "loopback ADD: {out}");
    let result = scene
        .runtime
        .add(&invocation)
        .unwrap_or_else(|e| panic!("ADD {name}: {e}\n{}", agent.log()));
    Sandboxed {
        sandbox,
        path,
        name: name.to_owned(),
        result,
    }
}

/// `testapp call` from `from` to `to`:8080: through both pods' proxies (the app sees
/// the inbound passthrough's 127.0.0.6), refused, or, what must never happen with
/// fail-closed pods, straight to the app (it sees the caller's own address).
#[derive(Debug, PartialEq, Eq)]
enum Reached {
    ThroughProxies,
    Refused,
    AroundTheProxies,
}

fn reach(scene: &Scene, from: &Sandboxed, to: &Sandboxed) -> Reached {
    let result = call(
        &scene.node,
        &from.sandbox.path(),
        &format!("{}:8080", to.ip()),
    );
    if result["ok"] != true {
        return Reached::Refused;
    }
    match peer_ip(&result).as_str() {
        "127.0.0.6" => Reached::ThroughProxies,
        _ => Reached::AroundTheProxies,
    }
}

/// Pins under the bpffs root, by relative path.
fn pins(root: &Path) -> Vec<String> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, root, out);
            } else {
                out.push(path.strip_prefix(root).unwrap().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// A second `shunt node` on the same paths, without --take-over, exits non-zero naming
/// the owner and changes nothing: every pod stays captured and served, the records and
/// pins stay, and the first keeps the CNI socket (an ADD after it still works).
#[test]
fn a_second_node_process_leaves_every_pod_captured_and_served() {
    let scene = Scene::new("second", "10.90.0.0/24");
    let mut first = scene.agent("first", &[]);
    first.wait_for_file(&scene.socket());
    let a = add_pod(&scene, "la", &first);
    let b = add_pod(&scene, "lb", &first);
    let _app = serve(&scene.node, &b.sandbox.path(), 8080);
    assert_eq!(
        reach(&scene, &a, &b),
        Reached::ThroughProxies,
        "{}",
        first.log()
    );
    let pins_before = pins(&scene.pins.0);
    let records_before = std::fs::read_dir(scene.state()).unwrap().count();

    let mut second = scene.agent("second", &[]);
    let status = second
        .wait_exit(Duration::from_secs(30))
        .expect("the second process exits by itself");
    assert!(!status.success(), "{}", second.log());
    let first_pid = first.child.id();
    assert!(
        second.log().contains(&format!("pid {first_pid}")),
        "it names the owner: {}",
        second.log()
    );

    for _ in 0..20 {
        assert_eq!(
            reach(&scene, &a, &b),
            Reached::ThroughProxies,
            "{}",
            first.log()
        );
    }
    assert_eq!(pins(&scene.pins.0), pins_before, "the capture is as it was");
    let records_after = std::fs::read_dir(scene.state()).unwrap().count();
    assert_eq!(
        records_after, records_before,
        "the records are as they were"
    );
    assert!(
        first.wait_exit(Duration::ZERO).is_none(),
        "the first still runs"
    );
    // The CNI socket is still the first's: a new pod is enrolled and served.
    let c = add_pod(&scene, "lc", &first);
    assert_eq!(
        reach(&scene, &c, &b),
        Reached::ThroughProxies,
        "{}",
        first.log()
    );
    for pod in [&a, &b, &c] {
        scene.runtime.del(&pod.invocation(), Some(&pod.result));
    }
}

/// A pod created while the node agent is down (between a stop and its restart): its
/// ADD waits for the agent (`agent_wait_seconds`) instead of failing or passing it
/// uncaptured, and once the agent is back the pod is enrolled and served.
#[test]
fn a_pod_added_while_the_agent_restarts_waits_for_it() {
    let scene = Scene::new("restart", "10.93.0.0/24");
    let mut first = scene.agent("first", &[]);
    first.wait_for_file(&scene.socket());
    let a = add_pod(&scene, "ra", &first);
    let _app = serve(&scene.node, &a.sandbox.path(), 8080);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(
        unsafe { libc::kill(first.child.id() as i32, libc::SIGTERM) },
        0
    );
    assert!(first.wait_exit(Duration::from_secs(30)).is_some());

    let adding = std::thread::scope(|threads| {
        let adding = threads.spawn(|| {
            let sandbox = Sandbox::new("rb");
            let path = sandbox.path();
            let invocation = Invocation {
                container_id: "rb",
                netns: &path,
                args: pod_args("rb"),
            };
            let lo = json!({"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"});
            let (ok, out) = scene.runtime.exec("ADD", &invocation, &lo);
            assert!(ok, "loopback ADD: {out}");
            let result = scene.runtime.add(&invocation);
            (sandbox, path, result)
        });
        // The ADD is waiting when the agent comes back.
        std::thread::sleep(Duration::from_millis(1500));
        let mut second = scene.agent("second", &[]);
        let (sandbox, path, result) = adding.join().unwrap();
        let result =
            result.unwrap_or_else(|e| panic!("ADD during the restart: {e}\n{}", second.log()));
        second.wait_for_file(&scene.socket());
        (
            second,
            Sandboxed {
                sandbox,
                path,
                name: "rb".into(),
                result,
            },
        )
    });
    let (second, b) = adding;
    assert!(
        second.log().contains("enrolled pod shop/rb"),
        "{}",
        second.log()
    );
    assert_eq!(
        reach(&scene, &b, &a),
        Reached::ThroughProxies,
        "{}",
        second.log()
    );
    for pod in [&a, &b] {
        scene.runtime.del(&pod.invocation(), Some(&pod.result));
    }
}

/// An upgrade: a new process started with --take-over while the old one serves takes
/// the node over. A client looping new connections between two pods through it all
/// sees none refused or reset; the old process exits by itself, leaving the CNI socket
/// to the new one, which answers ADD and DEL.
#[test]
fn an_upgrade_takes_the_node_over_with_no_connection_refused() {
    let scene = Scene::new("upgrade", "10.91.0.0/24");
    let old_ready = scene.ready_file("old");
    let old_ready_arg = old_ready.display().to_string();
    // A drain shorter than the long-lived stream below: it survives only if handed over.
    let mut old = scene.agent(
        "old",
        &[
            "--take-over",
            "--ready-file",
            &old_ready_arg,
            "--drain-time-s",
            "1",
        ],
    );
    old.wait_for_file(&old_ready);
    let a = add_pod(&scene, "ua", &old);
    let b = add_pod(&scene, "ub", &old);
    let _app = serve(&scene.node, &b.sandbox.path(), 8080);
    assert_eq!(
        reach(&scene, &a, &b),
        Reached::ThroughProxies,
        "{}",
        old.log()
    );

    // New connections in a loop from a to b for the whole upgrade.
    let looping = app_command(
        &scene.node,
        &a.sandbox.path(),
        &[
            "bench-connect",
            &format!("{}:8080", b.ip()),
            "--duration-ms",
            "6000",
            "--concurrency",
            "2",
            "--payload",
            "512",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // And one long-lived stream from a to b: round trips on one connection, which
    // reconnects (and counts an error) if the stream breaks.
    let streaming = app_command(
        &scene.node,
        &a.sandbox.path(),
        &[
            "bench-rr",
            &format!("{}:8080", b.ip()),
            "--duration-ms",
            "6000",
            "--payload",
            "4096",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let new_ready = scene.ready_file("new");
    let new_ready_arg = new_ready.display().to_string();
    let mut new = scene.agent("new", &["--take-over", "--ready-file", &new_ready_arg]);
    new.wait_for_file(&new_ready);
    let exited = old.wait_exit(Duration::from_secs(30));
    assert!(
        exited.is_some_and(|s| s.success()),
        "the old process hands over and exits 0: {exited:?}\n{}",
        old.log()
    );
    assert!(!old_ready.exists(), "the old process is no longer ready");
    let out = looping.wait_with_output().unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "bench-connect: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(
        report["errors"],
        0,
        "refused or reset during the upgrade: {report}\nold:\n{}\nnew:\n{}",
        old.log(),
        new.log()
    );
    assert!(report["connections"].as_u64().unwrap() > 50, "{report}");
    let out = streaming.wait_with_output().unwrap();
    let stream: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "bench-rr: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(
        stream["errors"],
        0,
        "the long-lived stream broke during the upgrade: {stream}\nold:\n{}\nnew:\n{}",
        old.log(),
        new.log()
    );
    assert!(stream["round_trips"].as_u64().unwrap() > 100, "{stream}");
    // Its two copies (a's outbound, b's inbound) moved to the new process.
    assert!(
        new.log()
            .contains("resumed the old process's established flows"),
        "{}",
        new.log()
    );

    // The new process has the CNI socket: ADD and DEL reach it.
    assert!(scene.socket().exists());
    let c = add_pod(&scene, "uc", &new);
    assert_eq!(
        reach(&scene, &c, &b),
        Reached::ThroughProxies,
        "{}",
        new.log()
    );
    assert!(new.log().contains("enrolled pod shop/uc"), "{}", new.log());
    scene.runtime.del(&c.invocation(), Some(&c.result));
    assert!(new.log().contains("withdrew pod"), "{}", new.log());
    assert_eq!(
        reach(&scene, &a, &b),
        Reached::ThroughProxies,
        "{}",
        new.log()
    );
    for pod in [&a, &b] {
        scene.runtime.del(&pod.invocation(), Some(&pod.result));
    }
}

/// A crash on either side of a hand-over: the new process killed after it took the
/// node but before serving it, then the old one killed while a new successor is about
/// to serve. Throughout, fail-closed pods are reached through proxies or refused, never
/// around them; the survivor serves every pod.
#[test]
fn a_crash_during_a_hand_over_never_leaves_a_pod_reachable_around_its_proxy() {
    let scene = Scene::new("crash", "10.92.0.0/24");
    let mut old = scene.agent("old", &["--take-over"]);
    old.wait_for_file(&scene.socket());
    let a = add_pod(&scene, "ca", &old);
    let b = add_pod(&scene, "cb", &old);
    let _app = serve(&scene.node, &b.sandbox.path(), 8080);
    assert_eq!(
        reach(&scene, &a, &b),
        Reached::ThroughProxies,
        "{}",
        old.log()
    );

    // The successor dies holding the node: the old one carries on, CNI included.
    let mut doomed = scene.agent("doomed", &["--take-over", "--handover-pause-ms", "3000"]);
    std::thread::sleep(Duration::from_millis(1000));
    assert_ne!(reach(&scene, &a, &b), Reached::AroundTheProxies);
    doomed.kill();
    std::thread::sleep(Duration::from_millis(500));
    for _ in 0..10 {
        assert_eq!(
            reach(&scene, &a, &b),
            Reached::ThroughProxies,
            "{}",
            old.log()
        );
    }
    let c = add_pod(&scene, "cc", &old);
    assert_eq!(
        reach(&scene, &c, &b),
        Reached::ThroughProxies,
        "{}",
        old.log()
    );

    // The old one dies while a successor holds the node it was handed: the successor
    // serves every pod.
    let new_ready = scene.ready_file("new");
    let new_ready_arg = new_ready.display().to_string();
    let mut new = scene.agent(
        "new",
        &[
            "--take-over",
            "--ready-file",
            &new_ready_arg,
            "--handover-pause-ms",
            "2000",
        ],
    );
    std::thread::sleep(Duration::from_millis(1000));
    old.kill();
    for _ in 0..5 {
        assert_ne!(reach(&scene, &a, &b), Reached::AroundTheProxies);
    }
    new.wait_for_file(&new_ready);
    for _ in 0..10 {
        assert_eq!(
            reach(&scene, &a, &b),
            Reached::ThroughProxies,
            "{}",
            new.log()
        );
    }
    assert_eq!(
        reach(&scene, &c, &b),
        Reached::ThroughProxies,
        "{}",
        new.log()
    );
    for pod in [&a, &b, &c] {
        scene.runtime.del(&pod.invocation(), Some(&pod.result));
    }
}

/// `shunt node uninstall` is refused while a node process owns the node; once it is
/// stopped, uninstall detaches every program and removes every pin, map and record:
/// bpftool finds nothing on the pods' cgroup and no pod's `sk_lookup` link, and
/// `shunt inspect` finds no capture.
#[test]
fn uninstall_leaves_no_program_attached_and_nothing_pinned() {
    let scene = Scene::new("uninstall", "10.93.0.0/24");
    let mut agent = scene.agent("agent", &[]);
    agent.wait_for_file(&scene.socket());
    let a = add_pod(&scene, "xa", &agent);
    let b = add_pod(&scene, "xb", &agent);
    let uninstall = || {
        Command::new(shunt_bin())
            .args(["node", "uninstall", "--bpffs"])
            .arg(&scene.pins.0)
            .arg("--state-dir")
            .arg(scene.state())
            .arg("--cni-socket")
            .arg(scene.socket())
            .output()
            .unwrap()
    };
    let refused = uninstall();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("owned by another shunt node"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    assert!(!cgroup_programs(&scene.node.cgroup_path()).is_empty());
    assert_eq!(sk_lookup_links(&[&a, &b]), 2);

    agent.child.kill().unwrap();
    let _ = agent.child.wait();
    let done = uninstall();
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert_eq!(
        cgroup_programs(&scene.node.cgroup_path()),
        Vec::<Value>::new()
    );
    assert_eq!(sk_lookup_links(&[&a, &b]), 0);
    assert!(!scene.pins.0.exists(), "{:?}", pins(&scene.pins.0));
    assert!(!scene.socket().exists());
    let inspect = Command::new(shunt_bin())
        .args(["inspect", "--bpffs"])
        .arg(&scene.pins.0)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&inspect.stdout).contains("no eBPF capture installed"),
        "{}",
        String::from_utf8_lossy(&inspect.stdout)
    );
    // The pods still run, uncaptured now: the runtime's DEL still succeeds.
    for pod in [&a, &b] {
        scene.runtime.del(&pod.invocation(), Some(&pod.result));
    }
}

/// The programs attached to `cgroup`, as bpftool lists them.
fn cgroup_programs(cgroup: &Path) -> Vec<Value> {
    let out = Command::new("bpftool")
        .args(["-j", "cgroup", "show"])
        .arg(cgroup)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    if text.trim().is_empty() {
        return Vec::new();
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bpftool: {e}: {text}"))
}

/// The `sk_lookup` links bpftool finds in the pods' network namespaces.
fn sk_lookup_links(pods: &[&Sandboxed]) -> usize {
    use std::os::unix::fs::MetadataExt;
    let inodes: Vec<u64> = pods
        .iter()
        .map(|p| std::fs::metadata(p.sandbox.path()).unwrap().ino())
        .collect();
    for _ in 0..5 {
        let out = Command::new("bpftool")
            .args(["-j", "link", "show"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        // Another process's link vanishing mid-listing: list again.
        if !out.status.success() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let links: Vec<Value> = serde_json::from_str(&text).unwrap_or_default();
        return links
            .iter()
            .filter(|l| {
                l["netns_ino"]
                    .as_u64()
                    .is_some_and(|ino| inodes.contains(&ino))
            })
            .count();
    }
    panic!("bpftool link show kept failing");
}
