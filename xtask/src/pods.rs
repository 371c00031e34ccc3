//! What the demo and the benchmarks share: the binaries, capture that is always removed
//! again (a guard), and starting `shunt proxy` and `testapp` in the harness's pods.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail, ensure};
pub use harness::{Call, access_log};
use harness::{Pod, PodCommand, PodProcess, wait_for_port};
use serde_json::Value;

/// The app's uid and gid: captured.
pub const APP_UID: u32 = 1000;
/// The proxy's uid and gid (istio-iptables `-u`/`-g`): never captured outbound.
pub const PROXY_UID: u32 = 1337;

/// The `shunt` and `testapp` binaries to start in pods.
pub struct Bins {
    pub shunt: PathBuf,
    pub testapp: PathBuf,
}

impl Bins {
    /// Builds `shunt` and `testapp` (release or debug) and returns them.
    pub fn build(release: bool) -> Result<Bins> {
        let mut args = vec!["build", "--bins", "-p", "shunt", "-p", "shunt-tests"];
        if release {
            args.push("--release");
        } else {
            // With xtask in the selection, features resolve as for xtask's own build:
            // the debug build of shunt that xtask already compiled is reused.
            args.extend(["-p", "xtask"]);
        }
        eprintln!(
            "xtask: cargo {} ({}; about 10 minutes on a fresh 2-core machine, seconds once built)",
            args.join(" "),
            if release { "release, fat LTO" } else { "debug" }
        );
        crate::run_checked(crate::cargo().args(args))?;
        if release {
            Bins::release()
        } else {
            Bins::debug()
        }
    }

    /// The debug build next to xtask (or `$SHUNT_BIN` / `$TESTAPP_BIN`), as the harness finds them.
    pub fn debug() -> Result<Bins> {
        Ok(Bins {
            shunt: harness::try_shunt_bin()?,
            testapp: harness::try_testapp_bin()?,
        })
    }

    /// `<target>/release/{shunt,testapp}`.
    pub fn release() -> Result<Bins> {
        let dir = target_dir().join("release");
        let bins = Bins {
            shunt: dir.join("shunt"),
            testapp: dir.join("testapp"),
        };
        for bin in [&bins.shunt, &bins.testapp] {
            ensure!(bin.is_file(), "{} was not built", bin.display());
        }
        Ok(bins)
    }
}

/// The shared target directory: `$CARGO_TARGET_DIR`, else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::workspace_root().join("target"))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Ebpf,
    Iptables,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Ebpf => "ebpf",
            Backend::Iptables => "iptables",
        }
    }

    /// As a person writes it.
    pub fn title(self) -> &'static str {
        match self {
            Backend::Ebpf => "eBPF",
            Backend::Iptables => "iptables",
        }
    }
}

/// `shunt capture` in some pods. Dropping it runs `--cleanup` in every pod still
/// captured and removes the pin directory, so a failing demo or bench leaves nothing.
pub struct Capture {
    shunt: PathBuf,
    pub backend: Backend,
    pub bpffs: PathBuf,
    captured: Vec<Pod>,
}

impl Capture {
    /// `bpffs` must be a pin root of the caller's own: what is left there is removed.
    pub fn new(bins: &Bins, backend: Backend, bpffs: &str) -> Capture {
        let bpffs = PathBuf::from(bpffs);
        // A demo or bench killed before its guards ran may have left pins behind.
        let _ = std::fs::remove_dir_all(&bpffs);
        Capture {
            shunt: bins.shunt.clone(),
            backend,
            bpffs,
            captured: Vec::new(),
        }
    }

    /// `capture --backend B [--bpffs DIR --cgroup POD-CGROUP] [extra]` (the eBPF
    /// backend's pin root and attach point; iptables needs neither).
    pub fn args(&self, pod: &Pod, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["capture", "--backend", self.backend.name()]
            .into_iter()
            .map(str::to_owned)
            .collect::<Vec<_>>();
        if self.backend == Backend::Ebpf {
            args.extend([
                "--bpffs".to_owned(),
                self.bpffs.display().to_string(),
                "--cgroup".to_owned(),
                pod.cgroup_path().display().to_string(),
            ]);
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// Runs `shunt capture ... extra` in the pod; returns what shunt printed.
    pub fn run(&self, pod: &Pod, extra: &[&str]) -> Result<String> {
        run(pod.command(&self.shunt).args(self.args(pod, extra)))
    }

    pub fn install(&mut self, pod: &Pod) -> Result<String> {
        self.install_with(pod, &[])
    }

    /// `install` with extra `shunt capture` flags (e.g. `--no-sockmap`).
    pub fn install_with(&mut self, pod: &Pod, extra: &[&str]) -> Result<String> {
        self.captured.push(pod.clone());
        self.run(pod, extra)
            .with_context(|| format!("capturing pod {}", pod.name()))
    }

    /// `--cleanup` in every captured pod (all of them, even after a failure); returns
    /// (pod, shunt's output) for each.
    pub fn cleanup(&mut self) -> Result<Vec<(Pod, String)>> {
        let mut said = Vec::new();
        let mut failed = None;
        for pod in std::mem::take(&mut self.captured) {
            match self.run(&pod, &["--cleanup"]) {
                Ok(out) => said.push((pod, out)),
                Err(e) => {
                    failed.get_or_insert(e.context(format!("cleaning up pod {}", pod.name())));
                }
            }
        }
        failed.map_or(Ok(said), Err)
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if let Err(e) = self.cleanup() {
            eprintln!("xtask: {e:#}");
        }
        if self.backend == Backend::Ebpf && self.bpffs.exists() {
            let _ = std::fs::remove_dir_all(&self.bpffs);
        }
    }
}

/// Runs to completion; returns stdout followed by stderr, or an error showing both.
pub fn run(cmd: PodCommand) -> Result<String> {
    let desc = cmd.description();
    let out = cmd.output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        bail!("{desc} failed ({}):\n{}", out.status, text.trim_end());
    }
    Ok(text)
}

/// `shunt proxy` (it drops to uid 1337 itself), once both listeners are up.
pub fn start_proxy(bins: &Bins, pod: &Pod) -> Result<PodProcess> {
    let proxy = pod
        .command(&bins.shunt)
        .args(["proxy", "--concurrency", "2"])
        .spawn()?;
    for port in [15001, 15006] {
        wait_for_port(pod, SocketAddr::from(([127, 0, 0, 1], port)), secs(10))
            .with_context(|| format!("shunt proxy in {}:\n{}", pod.name(), proxy.stderr_text()))?;
    }
    Ok(proxy)
}

/// `testapp serve` on 0.0.0.0:port and [::]:port, once both listen.
pub fn start_app(bins: &Bins, pod: &Pod, port: u16) -> Result<PodProcess> {
    start_app_mode(bins, pod, port, "echo")
}

/// `testapp serve --mode MODE` on 0.0.0.0 and [::] at `port` (`http`: answers HTTP/1.1
/// requests with its greeting line as the body).
pub fn start_app_mode(bins: &Bins, pod: &Pod, port: u16, mode: &str) -> Result<PodProcess> {
    let app = pod
        .command(&bins.testapp)
        .args(["serve", "--mode", mode, "--listen"])
        .arg(format!("0.0.0.0:{port}"))
        .arg("--listen")
        .arg(format!("[::]:{port}"))
        .spawn()?;
    for addr in [format!("0.0.0.0:{port}"), format!("[::]:{port}")] {
        wait_for_port(pod, addr.parse()?, secs(10))
            .with_context(|| format!("testapp serve in {}", pod.name()))?;
    }
    Ok(app)
}

/// `testapp call TARGET --bytes N` as `uid` (and the same gid) in `pod`.
pub fn call(bins: &Bins, pod: &Pod, uid: u32, target: SocketAddr, bytes: u64) -> Result<Call> {
    let cmd = pod.command(&bins.testapp).uid(uid).gid(uid).args([
        "call",
        &target.to_string(),
        "--bytes",
        &bytes.to_string(),
    ]);
    let desc = cmd.description();
    let out = cmd.output()?;
    Call::parse(&String::from_utf8_lossy(&out.stdout), &desc)
}

/// One HTTP/1.1 GET with `curl` from `pod` to `target` (Host `host`) answered by
/// `testapp serve --mode http`: where the server saw it come from and arrive.
pub fn http_call(pod: &Pod, target: SocketAddr, host: &str) -> Result<Call> {
    let cmd = pod.command("curl").args([
        "-sS",
        "--fail",
        "--max-time",
        "10",
        "-H",
        &format!("Host: {host}"),
        &format!("http://{target}/"),
    ]);
    let desc = cmd.description();
    let out = cmd.output()?;
    let body = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "{desc}: {}{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |key: &str| -> Result<SocketAddr> {
        body.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .with_context(|| format!("{desc}: no {key} in {body:?}"))?
            .parse()
            .with_context(|| format!("{desc}: {key} in {body:?}"))
    };
    Ok(Call {
        client_local: SocketAddr::from(([0, 0, 0, 0], 0)),
        server_peer: field("peer=")?,
        server_local: field("local=")?,
        bytes: 0,
        cookie: 0,
    })
}

/// The access-log entry whose downstream is `client`, once the proxy has written it.
pub fn log_entry(proxy: &PodProcess, client: SocketAddr) -> Option<Value> {
    harness::access_log_entry(proxy, client, secs(5))
}

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}
