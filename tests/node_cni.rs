//! A node whose pods are built by the real CNI plugins (Debian's
//! containernetworking-plugins: `bridge` + `host-local`) with `shunt-cni` chained after
//! them, each invoked as a container runtime invokes plugins (env + stdin, `prevResult`
//! passed along the chain, DEL in reverse order). The plugins run inside the harness
//! node's namespace (the "host" of this node), so nothing touches the test machine's.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use harness::{Node, shunt_bin};
use serde_json::{Value, json};
use shunt::node::enroll::Enrollment;
use shunt::node::enroll::cni_server::CniServer;
use shunt::node::{EnrollError, PodInfo, Pods};

/// Where Debian installs the reference plugins.
const CNI_PLUGINS: &str = "/usr/lib/cni";

/// A [`Pods`] that records each pod with the inode of the netns it was handed.
#[derive(Default)]
struct Recorder {
    pods: Mutex<BTreeMap<String, (PodInfo, u64)>>,
}

impl Pods for Recorder {
    fn add(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        let inode = std::fs::File::from(netns).metadata().unwrap().ino();
        self.pods
            .lock()
            .unwrap()
            .insert(pod.uid.clone(), (pod, inode));
        Ok(())
    }
    fn remove(&self, uid: &str) {
        self.pods.lock().unwrap().remove(uid);
    }
    fn served(&self) -> Vec<PodInfo> {
        self.pods
            .lock()
            .unwrap()
            .values()
            .map(|(p, _)| p.clone())
            .collect()
    }
}

/// A bare network namespace, as a runtime creates for a pod sandbox (named after this
/// process, so the harness sweeps it if the test dies).
struct Sandbox {
    name: String,
}

impl Sandbox {
    fn new(tag: &str) -> Sandbox {
        let name = format!("sh{}-cni-{tag}", std::process::id());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name}");
        Sandbox { name }
    }
    fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }
    /// The IPv4 addresses on `eth0` inside the sandbox.
    fn eth0_ipv4(&self) -> Vec<String> {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.path().display()))
            .args(["ip", "-j", "-4", "addr", "show", "dev", "eth0"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(json!([]));
        v.as_array()
            .into_iter()
            .flatten()
            .flat_map(|l| l["addr_info"].as_array().cloned().unwrap_or_default())
            .filter_map(|a| a["local"].as_str().map(str::to_owned))
            .collect()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// The runtime's side of CNI: runs a conflist's plugins in order for ADD (each one's
/// result is the next one's `prevResult`) and in reverse for DEL.
struct Runtime {
    host_netns: PathBuf,
    cni_path: String,
    conflist: Value,
}

struct Invocation<'a> {
    container_id: &'a str,
    netns: &'a Path,
    args: String,
}

impl Runtime {
    fn exec(&self, command: &str, inv: &Invocation, conf: &Value) -> (bool, Value) {
        let kind = conf["type"].as_str().unwrap();
        let binary = self
            .cni_path
            .split(':')
            .map(|d| Path::new(d).join(kind))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("plugin {kind} not found in {}", self.cni_path));
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", self.host_netns.display()))
            .arg(&binary)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", inv.container_id)
            .env("CNI_NETNS", inv.netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_ARGS", &inv.args)
            .env("CNI_PATH", &self.cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let value = if stdout.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&stdout)
                .unwrap_or_else(|e| panic!("{kind} {command} printed {stdout:?}: {e}"))
        };
        (out.status.success(), value)
    }

    fn plugin_conf(&self, i: usize, prev: Option<&Value>) -> Value {
        let mut conf = self.conflist["plugins"][i].clone();
        conf["cniVersion"] = self.conflist["cniVersion"].clone();
        conf["name"] = self.conflist["name"].clone();
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf
    }

    /// ADD through the chain: the final result, or the failing plugin's error. On a
    /// failure the runtime cleans up with a DEL, as the spec asks.
    fn add(&self, inv: &Invocation) -> Result<Value, Value> {
        let mut prev: Option<Value> = None;
        for i in 0..self.conflist["plugins"].as_array().unwrap().len() {
            let (ok, out) = self.exec("ADD", inv, &self.plugin_conf(i, prev.as_ref()));
            if !ok {
                self.del(inv, prev.as_ref());
                return Err(out);
            }
            prev = Some(out);
        }
        Ok(prev.unwrap())
    }

    fn del(&self, inv: &Invocation, result: Option<&Value>) {
        let n = self.conflist["plugins"].as_array().unwrap().len();
        for i in (0..n).rev() {
            let (ok, out) = self.exec("DEL", inv, &self.plugin_conf(i, result));
            assert!(ok, "DEL of plugin {i} failed: {out}");
        }
    }
}

fn pod_args(name: &str) -> String {
    format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={name};K8S_POD_UID=uid-{name}")
}

#[test]
fn pods_built_by_bridge_and_host_local_are_enrolled_with_the_addresses_host_local_gave() {
    assert!(
        Path::new(CNI_PLUGINS).join("bridge").exists(),
        "no {CNI_PLUGINS}/bridge: run `cargo xtask setup` (containernetworking-plugins)"
    );
    let node = Node::new().unwrap();
    let scratch = Scratch::new("recorder");
    let scratch = &scratch.0;
    std::os::unix::fs::symlink(shunt_bin(), scratch.join("bin/shunt-cni")).unwrap();
    let socket = scratch.join("cni.sock");
    let runtime = Runtime {
        host_netns: node.bridge_netns_path(),
        cni_path: format!("{CNI_PLUGINS}:{}", scratch.join("bin").display()),
        conflist: json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false,
                 "ipam": {"type": "host-local", "dataDir": scratch.join("ipam"),
                          "ranges": [[{"subnet": "10.88.0.0/24"}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
            ]
        }),
    };

    let recorder = Arc::new(Recorder::default());
    let state = scratch.join("state");
    let start = |recorder: &Arc<Recorder>| {
        let (enrollment, _) = Enrollment::open(recorder.clone(), &state).unwrap();
        CniServer::start(&socket, Arc::new(enrollment)).unwrap()
    };
    let mut agent = start(&recorder);

    let sandboxes: Vec<Sandbox> = ["a", "b", "c"].iter().map(|t| Sandbox::new(t)).collect();
    let paths: Vec<PathBuf> = sandboxes.iter().map(Sandbox::path).collect();
    let invocation = |i: usize| Invocation {
        container_id: ["ctr-a", "ctr-b", "ctr-c"][i],
        netns: &paths[i],
        args: pod_args(["a", "b", "c"][i]),
    };
    let mut results = Vec::new();
    for (i, sandbox) in sandboxes.iter().enumerate() {
        let result = runtime
            .add(&invocation(i))
            .unwrap_or_else(|e| panic!("ADD {i}: {e}"));
        let ip = result["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        assert_eq!(
            sandbox.eth0_ipv4(),
            std::slice::from_ref(&ip),
            "bridge put host-local's address on eth0"
        );
        let (pod, inode) =
            recorder.pods.lock().unwrap()[&format!("uid-{}", ["a", "b", "c"][i])].clone();
        assert_eq!(pod.ips, vec![ip.parse::<std::net::IpAddr>().unwrap()]);
        assert_eq!(inode, std::fs::metadata(sandbox.path()).unwrap().ino());
        results.push(result);
    }
    assert_eq!(recorder.pods.lock().unwrap().len(), 3);

    // DEL runs the chain backwards: shunt-cni withdraws, bridge/host-local release.
    runtime.del(&invocation(1), Some(&results[1]));
    assert!(!recorder.pods.lock().unwrap().contains_key("uid-b"));
    assert!(sandboxes[1].eth0_ipv4().is_empty(), "bridge removed eth0");

    // The agent restarts in the middle: an ADD while it is down fails (and the runtime
    // cleans up), the retry once it is back succeeds; the pods enrolled before are
    // rebuilt from the state directory.
    agent.stop();
    let down = runtime.add(&invocation(1)).unwrap_err();
    assert_eq!(down["code"], 11, "{down}");
    assert!(
        sandboxes[1].eth0_ipv4().is_empty(),
        "the failed ADD was cleaned up"
    );
    let recorder = Arc::new(Recorder::default());
    let _agent = start(&recorder);
    assert_eq!(
        recorder
            .pods
            .lock()
            .unwrap()
            .keys()
            .cloned()
            .collect::<Vec<_>>(),
        ["uid-a", "uid-c"],
        "rebuilt from the state directory"
    );
    let again = runtime.add(&invocation(1)).unwrap();
    assert!(
        recorder.pods.lock().unwrap().contains_key("uid-b"),
        "re-ADD enrolled: {again}"
    );

    results[1] = again;
    for (i, result) in results.iter().enumerate() {
        runtime.del(&invocation(i), Some(result));
    }
    assert!(recorder.pods.lock().unwrap().is_empty());
}

/// A running `shunt node` (no capture: this test is about enrollment reaching serving)
/// in the node's namespace, the DaemonSet's "host network". Killed on drop.
struct NodeAgent {
    child: std::process::Child,
    log: PathBuf,
}

impl NodeAgent {
    fn start(node: &Node, socket: &Path, state: &Path, log: &Path) -> NodeAgent {
        Self::start_with(node, socket, state, log, None)
    }

    /// With `capture` (the bpffs root): eBPF capture attached at the node's cgroup, the
    /// process in a cgroup under it (as the DaemonSet's pod is under the pods' parent).
    fn start_with(
        node: &Node,
        socket: &Path,
        state: &Path,
        log: &Path,
        capture: Option<&Path>,
    ) -> NodeAgent {
        let _ = std::fs::remove_file(socket);
        let mut command = match capture {
            None => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", node.bridge_netns_path().display()))
                    .arg(shunt_bin())
                    .args(["node", "--no-capture"]);
                c
            }
            Some(bpffs) => {
                let mut c = in_cgroup(&node.cgroup_path().join("agent"));
                c.arg("nsenter")
                    .arg(format!("--net={}", node.bridge_netns_path().display()))
                    .arg(shunt_bin())
                    .arg("node")
                    .arg("--cgroup")
                    .arg(node.cgroup_path())
                    .arg("--bpffs")
                    .arg(bpffs);
                c
            }
        };
        let child = command
            .arg("--cni-socket")
            .arg(socket)
            .arg("--state-dir")
            .arg(state)
            // Access log lines (JSON) and logs, in one file.
            .stdout(
                std::fs::File::options()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            )
            .stderr(
                std::fs::File::options()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        let mut agent = NodeAgent {
            child,
            log: log.to_owned(),
        };
        // The socket opens once the state directory's pods are served again.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !socket.exists() {
            if let Ok(Some(status)) = agent.child.try_wait() {
                panic!("shunt node exited ({status}): {}", agent.log());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no socket: {}",
                agent.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        agent
    }
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    /// The access log line matching `pred`, waiting for it up to 5 s (a line is
    /// written when its connection ends).
    fn entry(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let log = self.log();
            let found = log
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v.get("direction").is_some() && pred(v));
            if let Some(v) = found {
                return v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no access log line for {what}:\n{log}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A command that joins `cgroup` (made if missing), then execs its arguments.
fn in_cgroup(cgroup: &Path) -> Command {
    std::fs::create_dir_all(cgroup).unwrap();
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && exec \"$@\"",
            cgroup.display()
        ))
        .arg("sh");
    c
}

/// An app process of a sandbox: in the node's apps cgroup (under the one the capture
/// programs are attached to), in the sandbox's namespace, as uid 1000.
fn app_command(node: &Node, netns: &Path, testapp_args: &[&str]) -> Command {
    let mut c = in_cgroup(&node.cgroup_path().join("apps"));
    c.arg("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["-S", "1000", "-G", "1000"])
        .arg(harness::testapp_bin())
        .args(testapp_args);
    c
}

/// A process killed (and reaped) on drop.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `testapp serve` on `port` in `netns`, once it listens.
fn serve(node: &Node, netns: &Path, port: u16) -> Running {
    let child = app_command(
        node,
        netns,
        &["serve", "--listen", &format!("0.0.0.0:{port}")],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let running = Running(child);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", netns.display()))
            .args(["ss", "-Htln", &format!("sport = :{port}")])
            .output()
            .unwrap();
        if !out.stdout.is_empty() {
            return running;
        }
        assert!(std::time::Instant::now() < deadline, "no app on {port}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// `testapp call` from `netns` to `target`: what it printed (`{"ok":...}`).
fn call(node: &Node, netns: &Path, target: &str) -> Value {
    let out = app_command(node, netns, &["call", target, "--bytes", "65536"])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "testapp call {target}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn peer_ip(call: &Value) -> String {
    let peer: std::net::SocketAddr = call["server_peer"].as_str().unwrap().parse().unwrap();
    peer.ip().to_string()
}

/// `GET /healthz/ready` on the pod's 15021 (the pod's own proxy instance), from the node.
fn pod_health(node: &Node, ip: &str) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", node.bridge_netns_path().display()))
        .args([
            "curl",
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--max-time",
            "5",
        ])
        .arg(format!("http://{ip}:15021/healthz/ready"))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// TCP ports listening inside a sandbox.
fn listening_ports(sandbox: &Sandbox) -> Vec<u16> {
    let out = Command::new("nsenter")
        .arg(format!("--net={}", sandbox.path().display()))
        .args(["ss", "-Htln"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            l.split_whitespace()
                .nth(3)?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

fn address(result: &Value) -> String {
    result["ips"][0]["address"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned()
}

#[test]
fn a_running_shunt_node_serves_each_pod_the_instant_its_add_returns() {
    let node = Node::new().unwrap();
    let scratch = Scratch::new("agent");
    let scratch = &scratch.0;
    std::os::unix::fs::symlink(shunt_bin(), scratch.join("bin/shunt-cni")).unwrap();
    let socket = scratch.join("cni.sock");
    let state = scratch.join("state");
    let log = scratch.join("node.log");
    let runtime = Runtime {
        host_netns: node.bridge_netns_path(),
        cni_path: format!("{CNI_PLUGINS}:{}", scratch.join("bin").display()),
        conflist: json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true,
                 "ipam": {"type": "host-local", "dataDir": scratch.join("ipam"),
                          "ranges": [[{"subnet": "10.88.0.0/24"}]]}},
                {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
            ]
        }),
    };
    let mut agent = NodeAgent::start(&node, &socket, &state, &log);
    let sandboxes: Vec<Sandbox> = ["a", "b", "c"]
        .iter()
        .map(|t| Sandbox::new(&format!("s{t}")))
        .collect();
    let paths: Vec<PathBuf> = sandboxes.iter().map(Sandbox::path).collect();
    let invocation = |i: usize| Invocation {
        container_id: ["ctr-a", "ctr-b", "ctr-c"][i],
        netns: &paths[i],
        args: pod_args(["a", "b", "c"][i]),
    };
    let mut ips = Vec::new();
    for (i, sandbox) in sandboxes.iter().enumerate() {
        let result = runtime
            .add(&invocation(i))
            .unwrap_or_else(|e| panic!("ADD {i}: {e}\n{}", agent.log()));
        let ip = address(&result);
        // The first request, the instant ADD returned, finds the pod's proxy.
        assert_eq!(pod_health(&node, &ip), "200", "pod {i}: {}", agent.log());
        for port in [15001, 15006, 15021] {
            assert!(
                listening_ports(sandbox).contains(&port),
                "{port} in pod {i}"
            );
        }
        ips.push((ip, result));
    }

    // DEL: the pod's listeners close.
    runtime.del(&invocation(1), Some(&ips[1].1));
    assert!(
        listening_ports(&sandboxes[1]).is_empty(),
        "{:?}",
        listening_ports(&sandboxes[1])
    );

    // The agent dies: an ADD fails (the runtime will retry); a new agent serves the
    // pods of its state directory again before it takes requests, then the retry.
    agent.kill();
    assert_eq!(
        pod_health(&node, &ips[0].0),
        "000",
        "nothing serves while it is down"
    );
    let down = runtime.add(&invocation(1)).unwrap_err();
    assert_eq!(down["code"], 11, "{down}");
    let agent = NodeAgent::start(&node, &socket, &state, &log);
    assert_eq!(pod_health(&node, &ips[0].0), "200", "{}", agent.log());
    assert_eq!(pod_health(&node, &ips[2].0), "200", "{}", agent.log());
    let again = runtime.add(&invocation(1)).unwrap();
    assert_eq!(
        pod_health(&node, &address(&again)),
        "200",
        "{}",
        agent.log()
    );

    ips[1].1 = again;
    for (i, (_, result)) in ips.iter().enumerate() {
        runtime.del(&invocation(i), Some(result));
    }
    assert!(listening_ports(&sandboxes[0]).is_empty());
}

/// With capture on (eBPF attached at the node's cgroup, fail-closed): pods built by
/// bridge + host-local with shunt-cni chained reach each other and the outside through
/// the node process, original destinations kept, the inbound side seeing 127.0.0.6 as
/// behind a sidecar; a pod's first call, made the instant its ADD returned, goes
/// through; DEL releases a pod; with the agent killed calls are refused, and the next
/// agent serves the recorded pods again; a pod ADDed again is served.
#[test]
fn with_capture_cni_pods_talk_through_the_node_process_across_del_re_add_and_restart() {
    let node = Node::new().unwrap();
    let scratch = Scratch::new("capture");
    let scratch = &scratch.0;
    std::os::unix::fs::symlink(shunt_bin(), scratch.join("bin/shunt-cni")).unwrap();
    let socket = scratch.join("cni.sock");
    let state = scratch.join("state");
    let log = scratch.join("node.log");
    let pins = Pins(PathBuf::from(format!(
        "/sys/fs/bpf/shunt-test-{}-cni-capture",
        std::process::id()
    )));
    let runtime = Runtime {
        host_netns: node.bridge_netns_path(),
        cni_path: format!("{CNI_PLUGINS}:{}", scratch.join("bin").display()),
        conflist: json!({
            "cniVersion": "1.0.0",
            "name": "k8s-pod-network",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": true,
                 "ipam": {"type": "host-local", "dataDir": scratch.join("ipam"),
                          "ranges": [[{"subnet": "10.89.0.0/24"}]]}},
                {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
            ]
        }),
    };
    let mut agent = NodeAgent::start_with(&node, &socket, &state, &log, Some(&pins.0));
    let sandboxes: Vec<Sandbox> = ["a", "b", "c"]
        .iter()
        .map(|t| Sandbox::new(&format!("k{t}")))
        .collect();
    let paths: Vec<PathBuf> = sandboxes.iter().map(Sandbox::path).collect();
    let invocation = |i: usize| Invocation {
        container_id: ["ktr-a", "ktr-b", "ktr-c"][i],
        netns: &paths[i],
        args: pod_args(["ka", "kb", "kc"][i]),
    };
    // The runtime's own loopback network first (containerd runs the `loopback` plugin
    // apart from the conflist): capture redirects to the pod's 127.0.0.1.
    for i in 0..3 {
        let lo = json!({"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"});
        let (ok, out) = runtime.exec("ADD", &invocation(i), &lo);
        assert!(ok, "loopback ADD: {out}");
    }
    let add = |i: usize, agent: &NodeAgent| {
        runtime
            .add(&invocation(i))
            .unwrap_or_else(|e| panic!("ADD {i}: {e}\n{}", agent.log()))
    };
    let a = add(0, &agent);
    let b = add(1, &agent);
    let (a_ip, b_ip) = (address(&a), address(&b));
    let _app_b = serve(&node, &paths[1], 8080);
    // The outside: an app in the node's namespace, at the bridge's gateway.
    let gateway = "10.89.0.1";
    let _outside = serve(&node, &node.bridge_netns_path(), 9090);

    // c's first call, the instant its ADD returned: captured and served.
    let c = add(2, &agent);
    let first = call(&node, &paths[2], &format!("{b_ip}:8080"));
    assert_eq!(first["ok"], true, "{first}\n{}", agent.log());
    assert_eq!(
        peer_ip(&first),
        "127.0.0.6",
        "b's app sees the inbound passthrough"
    );
    assert_eq!(first["bytes"], 65536);

    // a to b: through a's outbound and b's inbound, original destination kept.
    let ab = call(&node, &paths[0], &format!("{b_ip}:8080"));
    assert_eq!(ab["ok"], true, "{ab}\n{}", agent.log());
    assert_eq!(peer_ip(&ab), "127.0.0.6");
    // Both proxies saw the original destination (their access log lines).
    let target = format!("{b_ip}:8080");
    let client_local = ab["client_local"].as_str().unwrap().to_owned();
    let outbound = agent.entry("a's outbound", |v| {
        v["direction"] == "outbound" && v["downstream_remote_address"] == client_local.as_str()
    });
    assert_eq!(outbound["original_dst"], target.as_str(), "{outbound}");
    let upstream_local = outbound["upstream_local_address"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        upstream_local.starts_with(&format!("{a_ip}:")),
        "{outbound}"
    );
    let inbound = agent.entry("b's inbound", |v| {
        v["direction"] == "inbound" && v["downstream_remote_address"] == upstream_local.as_str()
    });
    assert_eq!(inbound["original_dst"], target.as_str(), "{inbound}");
    // a to the outside: the outside sees a's own address (a's upstream left from a).
    let out = call(&node, &paths[0], &format!("{gateway}:9090"));
    assert_eq!(out["ok"], true, "{out}\n{}", agent.log());
    assert_eq!(peer_ip(&out), a_ip);

    // DEL c: released, its listeners closed.
    runtime.del(&invocation(2), Some(&c));
    assert!(listening_ports(&sandboxes[2]).is_empty());

    // The agent dies: fail-closed, a's calls are refused in the kernel.
    agent.kill();
    let refused = call(&node, &paths[0], &format!("{b_ip}:8080"));
    assert_eq!(refused["ok"], false, "{refused}");
    // A new agent serves the recorded pods again before it takes requests.
    let agent = NodeAgent::start_with(&node, &socket, &state, &log, Some(&pins.0));
    let again = call(&node, &paths[0], &format!("{b_ip}:8080"));
    assert_eq!(again["ok"], true, "{again}\n{}", agent.log());
    assert_eq!(peer_ip(&again), "127.0.0.6");

    // c ADDed again: served at once.
    let c = add(2, &agent);
    let back = call(&node, &paths[2], &format!("{b_ip}:8080"));
    assert_eq!(back["ok"], true, "{back}\n{}", agent.log());
    assert_eq!(peer_ip(&back), "127.0.0.6");

    for (i, result) in [(0, &a), (1, &b), (2, &c)] {
        runtime.del(&invocation(i), Some(result));
    }
    drop(agent);
    let _ = std::fs::remove_dir(node.cgroup_path().join("agent"));
}

/// Removes the bpffs root (every pin: links detach, maps go) even when a test fails.
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = Command::new("rm").arg("-rf").arg(&self.0).status();
    }
}

/// The plugin's name, the agent's socket and state, host-local's leases; removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("shunt-node-cni-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
