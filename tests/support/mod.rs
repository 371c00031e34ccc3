//! Test-side plumbing shared by the integration tests: starting `shunt capture`,
//! `shunt proxy` and `testapp` in pods, and reading what they report. The assertions
//! stay in the tests.
#![allow(dead_code)]

pub mod cni;
pub mod curl;
pub mod envoy;
pub mod http_client;
pub mod nds;
pub mod pki;
pub mod xds;

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

use harness::{Pod, PodProcess, shunt_bin, testapp_bin, wait_for_port};
use serde_json::Value;

pub const APP_UID: u32 = 1000;
pub const PROXY_UID: u32 = 1337;

/// A scratch folder (certificates, bootstraps, sockets, nginx), removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!("shunt-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A bpffs root of this test's own, so tests never share pins.
pub fn bpffs_root(tag: &str) -> PathBuf {
    PathBuf::from(format!(
        "/sys/fs/bpf/shunt-test-{}-{tag}",
        std::process::id()
    ))
}

pub struct Capture {
    pub backend: &'static str,
    pub bpffs: PathBuf,
}

impl Capture {
    pub fn new(backend: &'static str, tag: &str) -> Self {
        Capture {
            backend,
            bpffs: bpffs_root(tag),
        }
    }

    pub fn command(&self, pod: &Pod, flags: &[&str]) -> harness::PodCommand {
        let mut cmd = pod.command(shunt_bin());
        cmd = cmd
            .arg("capture")
            .arg("--backend")
            .arg(self.backend)
            .arg("--bpffs")
            .arg(&self.bpffs)
            .arg("--cgroup")
            .arg(pod.cgroup_path());
        cmd.args(flags)
    }

    /// Installs capture in `pod`; fails the test with shunt's own message if it fails.
    pub fn install(&self, pod: &Pod, flags: &[&str]) {
        let out = self
            .command(pod, flags)
            .output()
            .expect("run shunt capture");
        assert!(
            out.status.success(),
            "shunt capture --backend {} failed: {}{}",
            self.backend,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `shunt inspect --json`'s decision counters for `pod` (named after its netns
    /// inode); inspect lists the counters that are not zero. Fails the test if inspect
    /// fails or does not list the pod.
    pub fn pod_counters(&self, pod: &Pod) -> std::collections::HashMap<String, u64> {
        use std::os::unix::fs::MetadataExt;
        let name = format!("pod_{}", std::fs::metadata(pod.netns_path()).unwrap().ino());
        let out = std::process::Command::new(shunt_bin())
            .args(["inspect", "--json", "--bpffs"])
            .arg(&self.bpffs)
            .output()
            .expect("run shunt inspect");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let state: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
            panic!(
                "shunt inspect --json ({}) printed no JSON ({e}): {stdout:?} {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let pods = state["pods"].as_array().expect("inspect: pods");
        let entry = pods
            .iter()
            .find(|p| p["pod"] == name.as_str())
            .unwrap_or_else(|| panic!("pod {name} not in shunt inspect: {state}"));
        entry["counters"]
            .as_array()
            .unwrap_or_else(|| panic!("inspect: no counters for {name}: {entry}"))
            .iter()
            .map(|c| (c[0].as_str().unwrap().to_string(), c[1].as_u64().unwrap()))
            .collect()
    }

    pub fn cleanup(&self, pod: &Pod) {
        let out = self
            .command(pod, &["--cleanup"])
            .output()
            .expect("run shunt capture --cleanup");
        assert!(
            out.status.success(),
            "cleanup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        // Pins outlive processes: make sure a failed test leaves none (links detach with them).
        let _ = std::process::Command::new("rm")
            .arg("-rf")
            .arg(&self.bpffs)
            .status();
    }
}

/// Polls `check` until it holds (20 s at most); fails the test if `proxy` exits first or
/// time runs out, with the proxy's log and then `context()`.
pub fn wait_until(
    what: &str,
    proxy: &PodProcess,
    mut check: impl FnMut() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(
            proxy.try_wait().is_none(),
            "shunt proxy exited: {}",
            proxy.stderr_text()
        );
        assert!(
            Instant::now() < deadline,
            "timed out waiting: {what}\nproxy stderr:\n{}{}",
            proxy.stderr_text(),
            context()
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

pub fn start_proxy(pod: &Pod) -> PodProcess {
    let proxy = pod
        .command(shunt_bin())
        .args(["proxy", "--concurrency", "2"])
        .spawn()
        .expect("start shunt proxy");
    for port in [15001, 15006] {
        wait_for_port(
            pod,
            SocketAddr::new("127.0.0.1".parse().unwrap(), port),
            Duration::from_secs(10),
        )
        .unwrap_or_else(|e| {
            panic!(
                "shunt proxy did not listen on {port}: {e}\n{}",
                proxy.stderr_text()
            )
        });
    }
    proxy
}

/// `testapp serve` on 0.0.0.0 and [::] for each port.
pub fn start_app(pod: &Pod, ports: &[u16]) -> PodProcess {
    let mut cmd = pod.command(testapp_bin()).arg("serve");
    for p in ports {
        cmd = cmd
            .arg("--listen")
            .arg(format!("0.0.0.0:{p}"))
            .arg("--listen")
            .arg(format!("[::]:{p}"));
    }
    let app = cmd.spawn().expect("start testapp serve");
    for p in ports {
        wait_for_port(
            pod,
            SocketAddr::new("127.0.0.1".parse().unwrap(), *p),
            Duration::from_secs(10),
        )
        .expect("app listening");
    }
    app
}

pub use harness::{Call, access_log};

pub struct Caller<'a> {
    pub pod: &'a Pod,
    pub uid: u32,
    pub gid: u32,
    pub bind: Option<IpAddr>,
    pub bytes: usize,
}

impl<'a> Caller<'a> {
    pub fn app(pod: &'a Pod) -> Self {
        Caller {
            pod,
            uid: APP_UID,
            gid: APP_UID,
            bind: None,
            bytes: 4096,
        }
    }

    /// `testapp call target` as this caller, in its pod.
    fn command(&self, target: SocketAddr) -> harness::PodCommand {
        let cmd = self
            .pod
            .command(testapp_bin())
            .uid(self.uid)
            .gid(self.gid)
            .arg("call")
            .arg(target.to_string())
            .arg("--bytes")
            .arg(self.bytes.to_string());
        match self.bind {
            Some(bind) => cmd.arg("--bind").arg(bind.to_string()),
            None => cmd,
        }
    }

    pub fn call(&self, target: SocketAddr) -> anyhow::Result<Call> {
        let cmd = self.command(target);
        let what = cmd.description();
        let out = cmd.output()?;
        Call::parse(&String::from_utf8_lossy(&out.stdout), &what)
    }

    /// What `testapp call` printed: `{"ok":true,...}` or `{"ok":false,"error":...}`.
    /// Panics when testapp could not be run or printed something else, so a broken
    /// helper is never mistaken for a refused connection.
    pub fn call_json(&self, target: SocketAddr) -> Value {
        let cmd = self.command(target);
        let what = cmd.description();
        let out = cmd
            .output()
            .unwrap_or_else(|e| panic!("could not run {what}: {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        match serde_json::from_str::<Value>(stdout.trim()) {
            Ok(v) if v["ok"].is_boolean() => v,
            _ => panic!(
                "{what} did not run as a call ({}): stdout {stdout:?}, stderr {:?}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }
}

/// The entry for the connection whose downstream end is `client`, waiting up to 5 s.
pub fn log_entry_for(proxy: &PodProcess, client: SocketAddr) -> Option<Value> {
    harness::access_log_entry(proxy, client, Duration::from_secs(5))
}

/// Asserts that no entry names `client` (after giving a late one time to appear).
pub fn no_log_entry_for(proxy: &PodProcess, client: SocketAddr) -> bool {
    std::thread::sleep(Duration::from_millis(300));
    let key = client.to_string();
    !access_log(proxy)
        .iter()
        .any(|v| v["downstream_remote_address"] == key.as_str())
}

pub fn run_ok(cmd: harness::PodCommand) -> String {
    let out = cmd.output().expect("run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `127.0.0.1:port`: inside a pod, its own loopback.
pub fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// grpcio as `cargo xtask setup` installed it: the interpreter and the PYTHONPATH
/// (grpcio is a binary wheel: the test must run the interpreter it was installed for).
pub fn python_grpc() -> (String, String) {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let dir = format!("{home}/.cache/shunt/python-grpc");
    let python = std::fs::read_to_string(format!("{dir}/PYTHON")).unwrap_or_else(|e| {
        panic!("{dir}/PYTHON: {e}: run `cargo xtask setup` (pip install grpcio, xds-protos)")
    });
    (python.trim().to_owned(), dir)
}

/// A grpcio server in `pod` relaying every stream to `backend` (`support/grpcio_relay.py`):
/// a control plane with grpc-go's (istiod's) header behaviour in front of the tests'
/// ADS server, which keeps the resources and records the requests.
pub struct GrpcioRelay {
    pub address: SocketAddr,
    pub process: PodProcess,
}

impl GrpcioRelay {
    pub fn start(pod: &Pod, backend: &str) -> GrpcioRelay {
        let (python, path) = python_grpc();
        let process = pod
            .command(&python)
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/support/grpcio_relay.py"
            ))
            .args(["0", backend])
            .env("PYTHONPATH", &path)
            .spawn()
            .expect("start the grpcio relay");
        let line = process
            .wait_for_stdout(|l| l.starts_with("listening "), Duration::from_secs(30))
            .expect("the grpcio relay listens");
        let port: u16 = line["listening ".len()..].trim().parse().unwrap();
        GrpcioRelay {
            address: local(port),
            process,
        }
    }
}

impl Drop for GrpcioRelay {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("grpcio relay's log:\n{}", self.process.stderr_text());
        }
    }
}
