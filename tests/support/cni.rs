//! A node whose pods are built by the real CNI plugins (Debian's
//! containernetworking-plugins: `bridge` + `host-local`) with `shunt-cni` chained after
//! them, each invoked as a container runtime invokes plugins (env + stdin, `prevResult`
//! passed along the chain, DEL in reverse order), and a `shunt node` serving them. The
//! plugins run inside the harness node's namespace (the "host" of this node), so
//! nothing touches the test machine's.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use harness::{Node, shunt_bin};
use serde_json::{Value, json};

/// Where Debian installs the reference plugins.
pub const CNI_PLUGINS: &str = "/usr/lib/cni";

/// A bare network namespace, as a runtime creates for a pod sandbox (named after this
/// process, so the harness sweeps it if the test dies).
pub struct Sandbox {
    pub name: String,
}

impl Sandbox {
    pub fn new(tag: &str) -> Sandbox {
        let name = format!("sh{}-cni-{tag}", std::process::id());
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap();
        assert!(ok.success(), "ip netns add {name}");
        Sandbox { name }
    }
    pub fn path(&self) -> PathBuf {
        Path::new("/var/run/netns").join(&self.name)
    }
    /// The IPv4 addresses on `eth0` inside the sandbox.
    pub fn eth0_ipv4(&self) -> Vec<String> {
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
pub struct Runtime {
    pub host_netns: PathBuf,
    pub cni_path: String,
    pub conflist: Value,
}

pub struct Invocation<'a> {
    pub container_id: &'a str,
    pub netns: &'a Path,
    pub args: String,
}

impl Runtime {
    pub fn exec(&self, command: &str, inv: &Invocation, conf: &Value) -> (bool, Value) {
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

    pub fn plugin_conf(&self, i: usize, prev: Option<&Value>) -> Value {
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
    pub fn add(&self, inv: &Invocation) -> Result<Value, Value> {
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

    pub fn del(&self, inv: &Invocation, result: Option<&Value>) {
        let n = self.conflist["plugins"].as_array().unwrap().len();
        for i in (0..n).rev() {
            let (ok, out) = self.exec("DEL", inv, &self.plugin_conf(i, result));
            assert!(ok, "DEL of plugin {i} failed: {out}");
        }
    }
}

pub fn pod_args(name: &str) -> String {
    format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={name};K8S_POD_UID=uid-{name}")
}

/// A running `shunt node` (no capture: this test is about enrollment reaching serving)
/// in the node's namespace, the DaemonSet's "host network". Killed on drop.
pub struct NodeAgent {
    pub child: std::process::Child,
    pub log: PathBuf,
}

impl NodeAgent {
    pub fn start(node: &Node, socket: &Path, state: &Path, log: &Path) -> NodeAgent {
        Self::start_with(node, socket, state, log, None)
    }

    /// With `capture` (the bpffs root): eBPF capture attached at the node's cgroup, the
    /// process in a cgroup under it (as the DaemonSet's pod is under the pods' parent).
    pub fn start_with(
        node: &Node,
        socket: &Path,
        state: &Path,
        log: &Path,
        capture: Option<&Path>,
    ) -> NodeAgent {
        let _ = std::fs::remove_file(socket);
        let mut agent = Self::spawn(node, socket, state, log, capture, &[]);
        // The socket opens once the state directory's pods are served again.
        agent.wait_for_file(socket);
        agent
    }

    /// Starts `shunt node` with `extra` arguments, without waiting for anything.
    pub fn spawn(
        node: &Node,
        socket: &Path,
        state: &Path,
        log: &Path,
        capture: Option<&Path>,
        extra: &[&str],
    ) -> NodeAgent {
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
        let log_file = || {
            std::fs::File::options()
                .create(true)
                .append(true)
                .open(log)
                .unwrap()
        };
        let child = command
            .arg("--cni-socket")
            .arg(socket)
            .arg("--state-dir")
            .arg(state)
            .args(extra)
            // Access log lines (JSON) and logs, in one file.
            .stdout(log_file())
            .stderr(log_file())
            .spawn()
            .unwrap();
        NodeAgent {
            child,
            log: log.to_owned(),
        }
    }

    /// Waits up to 30 s for `path` to exist, failing with the log if the process exits.
    pub fn wait_for_file(&mut self, path: &Path) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !path.exists() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("shunt node exited ({status}): {}", self.log());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {}: {}",
                path.display(),
                self.log()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: std::time::Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    /// The access log line matching `pred`, waiting for it up to 5 s (a line is
    /// written when its connection ends).
    pub fn entry(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
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
    pub fn kill(&mut self) {
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
pub fn in_cgroup(cgroup: &Path) -> Command {
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
pub fn app_command(node: &Node, netns: &Path, testapp_args: &[&str]) -> Command {
    let mut c = in_cgroup(&node.cgroup_path().join("apps"));
    c.arg("nsenter")
        .arg(format!("--net={}", netns.display()))
        .args(["-S", "1000", "-G", "1000"])
        .arg(harness::testapp_bin())
        .args(testapp_args);
    c
}

/// A process killed (and reaped) on drop.
pub struct Running(pub std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `testapp serve` on `port` in `netns`, once it listens.
pub fn serve(node: &Node, netns: &Path, port: u16) -> Running {
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
pub fn call(node: &Node, netns: &Path, target: &str) -> Value {
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

pub fn peer_ip(call: &Value) -> String {
    let peer: std::net::SocketAddr = call["server_peer"].as_str().unwrap().parse().unwrap();
    peer.ip().to_string()
}

/// `GET /healthz/ready` on the pod's 15021 (the pod's own proxy instance), from the node.
pub fn pod_health(node: &Node, ip: &str) -> String {
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
pub fn listening_ports(sandbox: &Sandbox) -> Vec<u16> {
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

pub fn address(result: &Value) -> String {
    result["ips"][0]["address"]
        .as_str()
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned()
}

/// Removes the bpffs root (every pin: links detach, maps go) even when a test fails.
pub struct Pins(pub PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = Command::new("rm").arg("-rf").arg(&self.0).status();
    }
}

/// The plugin's name, the agent's socket and state, host-local's leases; removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
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
