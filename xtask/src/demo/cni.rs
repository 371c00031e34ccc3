//! The container runtime's side of CNI, as the demo plays it: a bare network namespace
//! per pod sandbox, the `loopback` plugin, then the node's chain (Debian's
//! containernetworking-plugins `bridge` + `host-local`, `shunt-cni` last) for ADD with
//! each plugin's result passed on as the next one's `prevResult`, and DEL in reverse
//! when the pod goes. The plugins run in the harness node's namespace (this node's
//! "host"), so nothing touches the machine's own network.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// Where Debian installs the reference plugins.
pub const CNI_PLUGINS: &str = "/usr/lib/cni";

/// The node's network configuration and where its plugins are.
#[derive(Clone)]
pub struct Runtime {
    host_netns: PathBuf,
    cni_path: String,
    pub conflist: Value,
}

impl Runtime {
    /// `bridge` (cni0, the pods' gateway) with `host-local` addresses from `subnet`,
    /// then `shunt-cni` (a link to `shunt` in `dir/bin`) asking the agent at `socket`.
    pub fn new(
        host_netns: &Path,
        dir: &Path,
        shunt: &Path,
        socket: &Path,
        subnet: &str,
    ) -> Result<Runtime> {
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin)?;
        std::os::unix::fs::symlink(shunt, bin.join("shunt-cni"))
            .context("linking shunt as shunt-cni")?;
        anyhow::ensure!(
            Path::new(CNI_PLUGINS).join("bridge").exists(),
            "no CNI plugins in {CNI_PLUGINS}: `cargo xtask setup` installs containernetworking-plugins"
        );
        Ok(Runtime {
            host_netns: host_netns.to_owned(),
            cni_path: format!("{CNI_PLUGINS}:{}", bin.display()),
            conflist: json!({
                "cniVersion": "1.0.0",
                "name": "k8s-pod-network",
                "plugins": [
                    {"type": "bridge", "bridge": "cni0", "isGateway": true,
                     "ipam": {"type": "host-local", "dataDir": dir.join("ipam"),
                              "ranges": [[{"subnet": subnet}]]}},
                    {"type": "shunt-cni", "agent_socket": socket, "agent_unavailable": "fail"}
                ]
            }),
        })
    }

    /// A pod sandbox in `namespace`, ADDed through the chain: its address from host-local.
    pub fn add(&self, name: &str, namespace: &str) -> Result<CniPod> {
        let netns_name = format!("sh{}-mesh-{name}", std::process::id());
        crate::run_checked(Command::new("ip").args(["netns", "add", &netns_name]))?;
        let mut pod = CniPod {
            runtime: self.clone(),
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            netns: Path::new("/var/run/netns").join(&netns_name),
            netns_name,
            ip: Ipv4Addr::UNSPECIFIED,
            result: None,
        };
        let lo = json!({"cniVersion": "1.0.0", "name": "cni-loopback", "type": "loopback"});
        self.exec("ADD", &pod, &lo)?;
        let mut prev: Option<Value> = None;
        for i in 0..self.plugins() {
            let conf = self.plugin_conf(i, prev.as_ref());
            let out = self
                .exec("ADD", &pod, &conf)
                .with_context(|| format!("CNI ADD of pod {name}"))?;
            prev = Some(out);
        }
        let result = prev.context("an empty plugin chain")?;
        pod.ip = result["ips"][0]["address"]
            .as_str()
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse().ok())
            .with_context(|| format!("no IPv4 address in the chain's result {result}"))?;
        pod.result = Some(result);
        Ok(pod)
    }

    fn plugins(&self) -> usize {
        self.conflist["plugins"].as_array().map_or(0, Vec::len)
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

    /// One plugin, invoked as a runtime invokes it (environment and stdin).
    fn exec(&self, command: &str, pod: &CniPod, conf: &Value) -> Result<Value> {
        let kind = conf["type"].as_str().unwrap_or_default();
        let binary = self
            .cni_path
            .split(':')
            .map(|d| Path::new(d).join(kind))
            .find(|p| p.exists())
            .with_context(|| format!("CNI plugin {kind} not in {}", self.cni_path))?;
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", self.host_netns.display()))
            .arg(&binary)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &pod.name)
            .env("CNI_NETNS", &pod.netns)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_ARGS", pod.cni_args())
            .env("CNI_PATH", &self.cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        child
            .stdin
            .take()
            .context("plugin stdin")?
            .write_all(conf.to_string().as_bytes())?;
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "{kind} {command} failed ({}): {stdout}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        if stdout.trim().is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&stdout)
            .with_context(|| format!("{kind} {command} printed {stdout:?}"))
    }
}

/// A pod sandbox the chain ADDed; dropping it DELs it through the chain (reverse order)
/// and removes its namespace.
pub struct CniPod {
    runtime: Runtime,
    pub name: String,
    pub namespace: String,
    pub netns: PathBuf,
    netns_name: String,
    pub ip: Ipv4Addr,
    result: Option<Value>,
}

impl CniPod {
    /// What kubelet passes: the pod's namespace, name and uid.
    fn cni_args(&self) -> String {
        format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_UID=uid-{}",
            self.namespace, self.name, self.name
        )
    }

    /// The SPIFFE identity its proxy's certificate carries (the namespace's `default`
    /// service account: CNI names no account).
    pub fn identity(&self) -> String {
        format!("spiffe://cluster.local/ns/{}/sa/default", self.namespace)
    }

    /// `command` in this pod's network namespace, in `cgroup` (under the node's, where
    /// the capture is attached), as `uid`.
    pub fn command(&self, cgroup: &Path, uid: u32, program: &Path) -> Command {
        let _ = std::fs::create_dir_all(cgroup);
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec \"$@\"",
                cgroup.display()
            ))
            .arg("sh")
            .arg("nsenter")
            .arg(format!("--net={}", self.netns.display()))
            .args(["-S", &uid.to_string(), "-G", &uid.to_string()])
            .arg(program);
        c
    }
}

impl Drop for CniPod {
    fn drop(&mut self) {
        if self.result.is_some() {
            for i in (0..self.runtime.plugins()).rev() {
                let conf = self.runtime.plugin_conf(i, self.result.as_ref());
                if let Err(e) = self.runtime.exec("DEL", self, &conf) {
                    eprintln!("xtask demo: {e:#}");
                }
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns_name])
            .status();
    }
}
