//! `cargo xtask bench node`: node mode (one process serving every pod, the `nodeserve`
//! test binary around `NodePods`). Three parts, each skipped when its list is empty:
//! - the scale matrix ([`super::node_scale`], `--services S --pods P`): Istio's push of
//!   S services to P pods of one namespace, node memory per pod and per service, time
//!   and CPU to ready per pod, beside one `shunt proxy` and one Envoy sidecar taking
//!   the same push;
//! - passthrough pods (`--passthrough-pods`): per-pod memory and enrollment time of
//!   pods without a control plane, with eBPF capture;
//! - same-node app-to-app 64-byte round trips (`--rounds`; p50/p99, round trips/s), no
//!   sockmap anywhere: plain TCP through node mode's passthrough against two
//!   eBPF-captured `shunt proxy` sidecars and direct; and with mTLS (workload
//!   certificates from a test CA) through node mode with per-pod proxies from a control
//!   plane, the same-node fast path on and off, against two shunt sidecars and two Envoy
//!   sidecars ([`super::node_mesh`]). Ratios against direct.
//!
//! Results in `target/bench/node.{txt,json}`.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use harness::{Node, Pod};
use serde_json::json;

use super::measure::{app_testapp, median};
use crate::pods::{APP_UID, Backend, Bins, Capture, call, start_app, start_proxy};

#[derive(clap::Args)]
pub struct NodeArgs {
    /// Services in Istio's push to every pod (the scale matrix: each with each --pods;
    /// the full matrix is `--services 100,500,1000 --pods 1,10,50`; with no value, no
    /// matrix).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "100,500")]
    services: Vec<usize>,
    /// Pods of one namespace taking the push, each count on a fresh node process.
    #[arg(long, value_delimiter = ',', default_value = "1,10")]
    pods: Vec<usize>,
    /// Passthrough pod counts to enroll (no control plane), each on a fresh node; with
    /// no value, none.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "10,50,100")]
    passthrough_pods: Vec<usize>,
    /// Length of each round-trip run.
    #[arg(long, default_value_t = 3000)]
    duration_ms: u64,
    /// Rounds of app-to-app round trips (0: memory and enrollment only).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Use the debug build (a quick check of the bench itself; numbers mean little).
    #[arg(long)]
    pub debug: bool,
    /// Run the release binaries already in target/release (no `cargo build` first).
    #[arg(long)]
    pub no_build: bool,
    /// Instead: what clients see during an upgrade, by hand-over and by
    /// stop-then-start, with these numbers of long-lived connections.
    #[arg(long, value_delimiter = ',', num_args = 0.., default_missing_value = "100,1000")]
    upgrade: Option<Vec<usize>>,
}

const PIN_ROOT: &str = "/sys/fs/bpf/shunt-bench-node";

use super::node_mesh;
const PORT: u16 = 8080;

pub fn run(bins: &Bins, args: &NodeArgs) -> Result<()> {
    let envoy = node_mesh::envoy_for_sidecars(&crate::setup::envoy()?)?;
    let nodeserve = bins
        .testapp
        .with_file_name("nodeserve")
        .canonicalize()
        .context("the nodeserve binary (built with the tests crate's bins)")?;
    if let Some(connections) = &args.upgrade {
        return super::node_upgrade::run(bins, &nodeserve, connections);
    }
    let mut text = String::new();
    let mut report = serde_json::Map::new();
    if !args.services.is_empty() && !args.pods.is_empty() {
        let (table, json) =
            super::node_scale::run(bins, &nodeserve, &envoy, &args.services, &args.pods)?;
        text.push_str(&table);
        report.insert("scale_mesh".into(), json);
    }
    let mut scale_rows = Vec::new();
    if !args.passthrough_pods.is_empty() {
        writeln!(
            text,
            "\nbench node: one node process serving N passthrough pods"
        )?;
        writeln!(
            text,
            "{:>6}{:>14}{:>14}{:>16}{:>16}{:>16}",
            "pods", "RSS 0 (KiB)", "RSS N (KiB)", "KiB per pod", "enroll p50 ms", "enroll p99 ms"
        )?;
    }
    for &n in &args.passthrough_pods {
        let s = scale(&nodeserve, n).with_context(|| format!("{n} pods"))?;
        writeln!(
            text,
            "{n:>6}{:>14}{:>14}{:>16.1}{:>16.2}{:>16.2}",
            s.rss_empty,
            s.rss_full,
            (s.rss_full.saturating_sub(s.rss_empty)) as f64 / n as f64,
            s.enroll_p50_ms,
            s.enroll_p99_ms
        )?;
        scale_rows.push(
            json!({"pods": n, "rss_empty_kib": s.rss_empty, "rss_kib": s.rss_full,
            "enroll_p50_ms": s.enroll_p50_ms, "enroll_p99_ms": s.enroll_p99_ms}),
        );
        eprintln!(
            "  {n} pods: {:.1} KiB per pod, enroll p50 {:.2} ms",
            (s.rss_full.saturating_sub(s.rss_empty)) as f64 / n as f64,
            s.enroll_p50_ms
        );
    }
    report.insert("scale".into(), json!(scale_rows));
    if args.rounds == 0 {
        print!("{text}");
        return super::measure::save("node", &text, &serde_json::Value::Object(report));
    }

    let mut samples: Vec<(Scenario, Rr)> = Vec::new();
    for round in 0..args.rounds {
        let mut order = SCENARIOS.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for scenario in order {
            let rr = app_to_app(bins, &nodeserve, &envoy, scenario, args.duration_ms)
                .with_context(|| format!("round {} {}", round + 1, scenario.name()))?;
            eprintln!(
                "  round {} {:<10} p50 {:>6.0} us  p99 {:>6.0} us  {:>8.0} rt/s",
                round + 1,
                scenario.name(),
                rr.p50,
                rr.p99,
                rr.per_sec
            );
            samples.push((scenario, rr));
        }
    }
    let med = |s: Scenario, f: fn(&Rr) -> f64| {
        median(samples.iter().filter(|(x, _)| *x == s).map(|(_, v)| f(v)))
    };
    writeln!(
        text,
        "\nsame-node app to app, 64 B round trips, medians of {} rounds",
        args.rounds
    )?;
    write!(text, "{:<16}", "")?;
    for sc in SCENARIOS {
        write!(text, "{:>12}", sc.name())?;
    }
    writeln!(text)?;
    let mut rr_rows = Vec::new();
    let metrics: [Metric; 3] = [
        ("p50 (us)", |r| r.p50),
        ("p99 (us)", |r| r.p99),
        ("round trips/s", |r| r.per_sec),
    ];
    for (label, f) in metrics {
        let values = SCENARIOS.map(|sc| med(sc, f));
        write!(text, "{label:<16}")?;
        let mut row = serde_json::Map::new();
        row.insert("metric".into(), json!(label));
        for (sc, v) in SCENARIOS.iter().zip(values) {
            write!(text, "{v:>12.1}")?;
            row.insert(sc.name().into(), json!(v));
        }
        writeln!(text)?;
        rr_rows.push(serde_json::Value::Object(row));
    }
    let m = |sc: Scenario, f: fn(&Rr) -> f64| med(sc, f);
    writeln!(text, "\nratios (round trips/s; p99)")?;
    for (what, x, y) in [
        (
            "node / sidecars (plain)",
            Scenario::NodeMode,
            Scenario::Sidecars,
        ),
        (
            "node fast / shunt mTLS sidecars",
            Scenario::NodeFast,
            Scenario::ShuntMtls,
        ),
        (
            "node fast / node TLS",
            Scenario::NodeFast,
            Scenario::NodeTls,
        ),
        (
            "node TLS / shunt mTLS sidecars",
            Scenario::NodeTls,
            Scenario::ShuntMtls,
        ),
        (
            "shunt mTLS / Envoy mTLS sidecars",
            Scenario::ShuntMtls,
            Scenario::EnvoyMtls,
        ),
        (
            "node fast / Envoy mTLS sidecars",
            Scenario::NodeFast,
            Scenario::EnvoyMtls,
        ),
        ("node fast / direct", Scenario::NodeFast, Scenario::Direct),
    ] {
        writeln!(
            text,
            "{what:<36}{:>8.2}x{:>8.2}x",
            m(x, |r| r.per_sec) / m(y, |r| r.per_sec),
            m(x, |r| r.p99) / m(y, |r| r.p99)
        )?;
    }
    report.insert("app_to_app".into(), json!(rr_rows));
    print!("{text}");
    super::measure::save("node", &text, &serde_json::Value::Object(report))
}

struct Scale {
    rss_empty: u64,
    rss_full: u64,
    enroll_p50_ms: f64,
    enroll_p99_ms: f64,
}

fn scale(nodeserve: &Path, n: usize) -> Result<Scale> {
    let mut node = Node::new()?;
    let pods: Vec<Pod> = (0..n)
        .map(|i| node.add_pod(&format!("p{i}")))
        .collect::<Result<_>>()?;
    let mut agent = Agent::start(&node, nodeserve, "scale")?;
    let rss_empty = agent.rss()?;
    let mut enroll = Vec::new();
    for p in &pods {
        enroll.push(agent.add(p)?.as_secs_f64() * 1000.0);
    }
    let rss_full = agent.rss()?;
    enroll.sort_by(f64::total_cmp);
    Ok(Scale {
        rss_empty,
        rss_full,
        enroll_p50_ms: enroll[n / 2],
        enroll_p99_ms: enroll[(n * 99 / 100).min(n - 1)],
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Direct,
    /// Two shunt sidecars, plain TCP.
    Sidecars,
    /// Node mode's passthrough, plain TCP.
    NodeMode,
    /// Two shunt sidecars with mTLS between them.
    ShuntMtls,
    /// Two Envoy sidecars with mTLS between them.
    EnvoyMtls,
    /// Node mode, per-pod proxies, mTLS over the network (fast path off).
    NodeTls,
    /// Node mode, per-pod proxies, the same-node fast path.
    NodeFast,
}

const SCENARIOS: [Scenario; 7] = [
    Scenario::Direct,
    Scenario::Sidecars,
    Scenario::NodeMode,
    Scenario::ShuntMtls,
    Scenario::EnvoyMtls,
    Scenario::NodeTls,
    Scenario::NodeFast,
];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Direct => "direct",
            Scenario::Sidecars => "sidecars",
            Scenario::NodeMode => "node",
            Scenario::ShuntMtls => "shunt-mtls",
            Scenario::EnvoyMtls => "envoy-mtls",
            Scenario::NodeTls => "node-tls",
            Scenario::NodeFast => "node-fast",
        }
    }
}

/// A table row: its label and how to read it from a sample.
type Metric = (&'static str, fn(&Rr) -> f64);

struct Rr {
    p50: f64,
    p99: f64,
    per_sec: f64,
}

fn app_to_app(
    bins: &Bins,
    nodeserve: &Path,
    envoy: &Path,
    scenario: Scenario,
    duration_ms: u64,
) -> Result<Rr> {
    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _app = start_app(bins, &server, PORT)?;
    let target = SocketAddr::new(server.ipv4().into(), PORT);
    let mut capture = None;
    let mut proxies = Vec::new();
    let mut agent = None;
    let scratch = node_mesh::Scratch::new(scenario.name())?;
    let mut control_plane = None;
    match scenario {
        Scenario::ShuntMtls | Scenario::EnvoyMtls => {
            let ca = node_mesh::TestCaHandle::start(&scratch.0)?;
            let (chain, key, root) = node_mesh::sidecar_certificates(&ca.0, &scratch.0)?;
            let file = scratch.0.join("sidecar.yaml");
            std::fs::write(
                &file,
                node_mesh::sidecar_bootstrap(server.ipv4().into(), &chain, &key, &root),
            )?;
            let (program, args) = if scenario == Scenario::ShuntMtls {
                (bins.shunt.clone(), super::l4::shunt_args(&file))
            } else {
                (envoy.to_path_buf(), super::l4::envoy_args(&file))
            };
            let mut c = Capture::new(bins, Backend::Ebpf, PIN_ROOT);
            for pod in [&client, &server] {
                c.install_with(pod, &["--no-sockmap"])?;
                proxies.push(node_mesh::start_sidecar(&program, &args, pod)?);
            }
            capture = Some(c);
        }
        Scenario::NodeTls | Scenario::NodeFast => {
            let cp = node_mesh::ControlPlane::start(&node, &scratch.0, server.ipv4().into())?;
            let mut flags = cp.node_flags();
            if scenario == Scenario::NodeTls {
                flags.push("--no-fast-path".into());
            }
            let mut a = Agent::start_with(&node, nodeserve, scenario.name(), &flags)?;
            a.add(&client)?;
            a.add(&server)?;
            a.wait_ready(&client)?;
            a.wait_ready(&server)?;
            agent = Some(a);
            control_plane = Some(cp);
        }
        Scenario::Direct => {}
        Scenario::Sidecars => {
            let mut c = Capture::new(bins, Backend::Ebpf, PIN_ROOT);
            for pod in [&client, &server] {
                c.install_with(pod, &["--no-sockmap"])?;
                proxies.push(start_proxy(bins, pod)?);
            }
            capture = Some(c);
        }
        Scenario::NodeMode => {
            let mut a = Agent::start(&node, nodeserve, "rr")?;
            a.add(&client)?;
            a.add(&server)?;
            agent = Some(a);
        }
    }
    let c = call(bins, &client, APP_UID, target, 64)?;
    if c.server_peer.ip().is_loopback() == (scenario == Scenario::Direct) {
        bail!(
            "{}: the server saw {}: not the path under test",
            scenario.name(),
            c.server_peer
        );
    }
    let rr = app_testapp(
        bins,
        &client,
        &[
            "bench-rr",
            &target.to_string(),
            "--duration-ms",
            &duration_ms.to_string(),
            "--payload",
            "64",
        ],
        duration_ms,
    )?;
    if rr["errors"].as_u64().unwrap_or(0) > 0 {
        bail!("bench-rr: {rr}");
    }
    drop(agent);
    drop(proxies);
    drop(capture);
    drop(control_plane);
    Ok(Rr {
        p50: rr["p50_us"].as_f64().unwrap_or(f64::NAN),
        p99: rr["p99_us"].as_f64().unwrap_or(f64::NAN),
        per_sec: rr["rtt_per_sec"].as_f64().unwrap_or(f64::NAN),
    })
}

/// `nodeserve` in the node's bridge namespace, in a cgroup under the node's (where the
/// capture programs attach); its pins go with it. `bench mesh` runs node mode with it too.
pub(super) struct Agent {
    child: Child,
    stdin: ChildStdin,
    lines: Arc<Mutex<Vec<String>>>,
    cgroup: PathBuf,
    pins: PathBuf,
}

impl Agent {
    pub(super) fn start(node: &Node, nodeserve: &Path, tag: &str) -> Result<Agent> {
        Self::start_with(node, nodeserve, tag, &[])
    }

    pub(super) fn start_with(
        node: &Node,
        nodeserve: &Path,
        tag: &str,
        flags: &[String],
    ) -> Result<Agent> {
        let cgroup = node.cgroup_path().join("agent");
        let pins = PathBuf::from(format!("{PIN_ROOT}-{tag}"));
        // `SHUNT_BENCH_NODE_WRAPPER="heaptrack -o FILE"` runs the node process under a
        // profiler (its words go before the program).
        let wrapper = std::env::var("SHUNT_BENCH_NODE_WRAPPER").unwrap_or_default();
        let mut child = Command::new("nsenter")
            .arg(format!("--net={}", node.bridge_netns_path().display()))
            .args(wrapper.split_whitespace())
            .arg(nodeserve)
            .arg("--join-cgroup")
            .arg(&cgroup)
            .arg("--cgroup")
            .arg(node.cgroup_path())
            .arg("--bpffs")
            .arg(&pins)
            // As the sidecars here: no sockmap short-circuit, so both pay the same TCP hops.
            .arg("--no-sockmap")
            .args(flags)
            // `SHUNT_BENCH_LOG=debug` to see why a pod's traffic is refused.
            .env(
                "RUST_LOG",
                std::env::var("SHUNT_BENCH_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting nodeserve")?;
        let stdin = child.stdin.take().context("stdin")?;
        let stdout = child.stdout.take().context("stdout")?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            // Access log lines are dropped: only replies are kept.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with('@') {
                    sink.lock().unwrap().push(line);
                }
            }
        });
        let mut agent = Agent {
            child,
            stdin,
            lines,
            cgroup,
            pins,
        };
        agent.reply("@ready")?;
        Ok(agent)
    }

    fn reply(&mut self, prefix: &str) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let mut lines = self.lines.lock().unwrap();
            if let Some(i) = lines
                .iter()
                .position(|l| l.starts_with(prefix) || l.starts_with("@error"))
            {
                let line = lines.remove(i);
                if line.starts_with("@error") {
                    bail!("nodeserve: {line}");
                }
                return Ok(line);
            }
            drop(lines);
            if let Some(status) = self.child.try_wait()? {
                bail!("nodeserve exited: {status}");
            }
            if Instant::now() > deadline {
                bail!("no {prefix} from nodeserve");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub(super) fn add(&mut self, pod: &Pod) -> Result<Duration> {
        self.add_in(pod, "default", "")
    }

    /// Enrolls `pod` in `namespace` with `extra` words on its `add` line
    /// (`sa=ACCOUNT`).
    pub(super) fn add_in(&mut self, pod: &Pod, namespace: &str, extra: &str) -> Result<Duration> {
        writeln!(
            self.stdin,
            "add {0} {0} {namespace} {1} {2} {3} {extra}",
            pod.name(),
            pod.netns_path().display(),
            pod.ipv4(),
            pod.ipv6()
        )?;
        let line = self.reply(&format!("@added {} ", pod.name()))?;
        let micros: u64 = line.rsplit(' ').next().unwrap_or("").parse()?;
        Ok(Duration::from_micros(micros))
    }

    /// Waits until the pod's proxy has its first config from the control plane: the
    /// wall time and the node process's CPU time from its `add` to then, in ms.
    pub(super) fn await_ready(&mut self, pod: &Pod) -> Result<(f64, f64)> {
        writeln!(self.stdin, "await-ready {}", pod.name())?;
        let line = self.reply(&format!("@ready {} ", pod.name()))?;
        let words: Vec<&str> = line.split(' ').collect();
        match words.as_slice() {
            [_, _, "true", wall, cpu] => {
                Ok((wall.parse::<f64>()? / 1e3, cpu.parse::<f64>()? / 1e3))
            }
            _ => bail!("{} never got its config: {line}", pod.name()),
        }
    }

    /// Waits until the pod's proxy has its first config from the control plane.
    pub(super) fn wait_ready(&mut self, pod: &Pod) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            writeln!(self.stdin, "ready {}", pod.name())?;
            if self
                .reply(&format!("@ready {} ", pod.name()))?
                .ends_with(" true")
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} never got its config", pod.name());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn rss(&mut self) -> Result<u64> {
        writeln!(self.stdin, "rss")?;
        Ok(self.reply("@rss ")?[5..].parse()?)
    }

    pub(super) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one command line (see `tests/nodeserve`).
    pub(super) fn send(&mut self, line: &str) -> Result<()> {
        writeln!(self.stdin, "{line}")?;
        Ok(())
    }

    /// Waits until a `handover` finished: a successor serves the pods.
    pub(super) fn wait_handed_over(&mut self) -> Result<()> {
        self.reply("@handed-over ").map(drop)
    }

    /// Kills the process, leaving the capture's pins to the process that has (or will
    /// have) the node.
    pub(super) fn stop_leaving_pins(mut self) {
        self.pins = PathBuf::new();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir(&self.cgroup);
        if !self.pins.as_os_str().is_empty() {
            let _ = Command::new("rm").arg("-rf").arg(&self.pins).status();
        }
    }
}
