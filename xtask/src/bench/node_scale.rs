//! `bench node --services S --pods P`: node mode at mesh scale. Every pod of one
//! namespace gets the same Istio push of S services ([`super::node_push`]) over its own
//! ADS stream, as istiod sends pods without a `Sidecar` resource. For each S and P: the
//! node process's RSS and anonymous memory with no pod and with P pods ready, per pod
//! and per service, the ratio to one pod's, and each pod's time and CPU from enrollment
//! to ready (every type ACKed, its 15021 ready); beside it, in the same run, one
//! `shunt proxy` sidecar and one Envoy sidecar taking the same push (and, for the
//! per-service figures, the push of no service).

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use harness::ads::{AdsServer, Listen, type_urls};
use harness::{Node, Pod, PodProcess};
use serde_json::{Value, json};

use super::measure::{Goal, KIB_PER_MIB, median, rss};
use super::node::Agent;
use super::node_mesh::{self, ControlPlane, Scratch};
use super::node_push::{NAMESPACE, Push};
use super::xds::{Api, admin_status};
use crate::pods::Bins;

/// The goals of the issue this bench was written for (reported, never asserted).
const SHARED_GOAL: f64 = 1.5;
const KIB_PER_SERVICE_GOAL: f64 = 16.0;
const NEXT_POD_CPU_MS_GOAL: f64 = 10.0;

/// One node process with P pods, all ready.
#[derive(Debug, Clone)]
pub struct NodeRun {
    pub services: usize,
    pub pods: usize,
    pub rss_empty_kib: u64,
    pub anon_empty_kib: u64,
    pub rss_kib: u64,
    pub anon_kib: u64,
    /// Per pod, in enrollment order: (wall ms, CPU ms) from `add` to ready.
    pub ready: Vec<(f64, f64)>,
}

impl NodeRun {
    fn per_pod_kib(&self) -> f64 {
        self.rss_kib.saturating_sub(self.rss_empty_kib) as f64 / self.pods as f64
    }

    /// The anonymous memory one pod adds, per service of its push.
    fn anon_per_service_kib(&self) -> f64 {
        self.anon_kib.saturating_sub(self.anon_empty_kib) as f64
            / self.pods as f64
            / self.services.max(1) as f64
    }

    /// Median (wall, CPU) ms to ready of the pods after the first.
    fn next_pods(&self) -> (f64, f64) {
        let rest = self.ready.iter().skip(1);
        (median(rest.clone().map(|r| r.0)), median(rest.map(|r| r.1)))
    }

    /// The worst CPU ms to ready of the pods after the first.
    fn next_pods_worst_cpu(&self) -> f64 {
        self.ready
            .iter()
            .skip(1)
            .map(|r| r.1)
            .fold(f64::NAN, f64::max)
    }
}

/// One sidecar that took the push.
#[derive(Debug, Clone)]
pub struct SidecarRun {
    pub ready_ms: f64,
    pub cpu_ms: f64,
    pub rss_kib: u64,
    pub anon_kib: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Sidecar {
    Shunt,
    Envoy,
    /// With `cluster_manager.enable_deferred_cluster_creation` (clusters made when
    /// first used, as node mode's pods): what a sidecar whose bootstrap asks for it
    /// pays, beside Envoy with the same.
    ShuntDeferred,
    EnvoyDeferred,
}

impl Sidecar {
    const ALL: [Sidecar; 4] = [
        Sidecar::Shunt,
        Sidecar::Envoy,
        Sidecar::ShuntDeferred,
        Sidecar::EnvoyDeferred,
    ];

    fn name(self) -> &'static str {
        match self {
            Sidecar::Shunt => "shunt proxy",
            Sidecar::Envoy => "Envoy",
            Sidecar::ShuntDeferred => "shunt proxy, deferred",
            Sidecar::EnvoyDeferred => "Envoy, deferred",
        }
    }

    fn deferred(self) -> bool {
        matches!(self, Sidecar::ShuntDeferred | Sidecar::EnvoyDeferred)
    }
}

/// Runs the matrix: every `services` count with every `pods` count, and the sidecars.
pub fn run(
    bins: &Bins,
    nodeserve: &Path,
    envoy: &Path,
    services: &[usize],
    pods: &[usize],
) -> Result<(String, Value)> {
    let mut node_runs = Vec::new();
    let mut sidecar_runs: Vec<(usize, Sidecar, SidecarRun)> = Vec::new();
    let mut wire = Vec::new();
    // The sidecars with no service: what a service adds is measured from there.
    let empty = Push::new(0)?;
    for proxy in Sidecar::ALL {
        let run = sidecar(bins, envoy, proxy, &empty)
            .with_context(|| format!("{} with no service", proxy.name()))?;
        eprintln!(
            "  {} with no service: anon {} KiB",
            proxy.name(),
            run.anon_kib
        );
        sidecar_runs.push((0, proxy, run));
    }
    for &s in services {
        let push = Push::new(s)?;
        wire.push((s, push.wire_bytes()));
        for proxy in Sidecar::ALL {
            let run = sidecar(bins, envoy, proxy, &push)
                .with_context(|| format!("{} with {s} services", proxy.name()))?;
            eprintln!(
                "  {s} services, {}: ready in {:.0} ms ({:.0} ms CPU), anon {:.1} MiB",
                proxy.name(),
                run.ready_ms,
                run.cpu_ms,
                run.anon_kib as f64 / KIB_PER_MIB
            );
            sidecar_runs.push((s, proxy, run));
        }
        for &p in pods {
            let run =
                node(nodeserve, &push, p).with_context(|| format!("{s} services, {p} pods"))?;
            let (next_ms, next_cpu) = run.next_pods();
            eprintln!(
                "  {s} services, {p} pods: node RSS {:.1} MiB, {:.0} KiB per pod; first pod {:.0} ms ({:.1} ms CPU), next {:.0} ms ({:.1} ms CPU)",
                run.rss_kib as f64 / KIB_PER_MIB,
                run.per_pod_kib(),
                run.ready[0].0,
                run.ready[0].1,
                next_ms,
                next_cpu
            );
            node_runs.push(run);
        }
    }
    let text = table(&node_runs, &sidecar_runs, &wire)?;
    let json = json!({
        "wire_bytes": wire.iter().map(|(s, b)| json!({"services": s, "bytes": b})).collect::<Vec<_>>(),
        "node": node_runs.iter().map(|r| json!({
            "services": r.services, "pods": r.pods,
            "rss_empty_kib": r.rss_empty_kib, "anon_empty_kib": r.anon_empty_kib,
            "rss_kib": r.rss_kib, "anon_kib": r.anon_kib,
            "ready_ms": r.ready.iter().map(|x| x.0).collect::<Vec<_>>(),
            "ready_cpu_ms": r.ready.iter().map(|x| x.1).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "sidecars": sidecar_runs.iter().map(|(s, proxy, r)| json!({
            "services": s, "proxy": proxy.name(), "ready_ms": r.ready_ms, "cpu_ms": r.cpu_ms,
            "rss_kib": r.rss_kib, "anon_kib": r.anon_kib,
        })).collect::<Vec<_>>(),
    });
    Ok((text, json))
}

/// P pods of one namespace enrolled one after the other into a fresh node process,
/// each waited for until ready.
fn node(nodeserve: &Path, push: &Push, pods: usize) -> Result<NodeRun> {
    let mut node = Node::new()?;
    let all: Vec<Pod> = (0..pods)
        .map(|i| node.add_pod(&format!("s{i}")))
        .collect::<Result<_>>()?;
    let scratch = Scratch::new("scale")?;
    let cp = ControlPlane::start_push(&node, &scratch.0, push)?;
    let mut flags = cp.node_flags();
    // Memory and time of the proxies alone: no capture to install per pod.
    flags.push("--no-capture".into());
    let mut agent = Agent::start_with(&node, nodeserve, "scale", &flags)?;
    settle();
    let (rss_empty_kib, anon_empty_kib) = rss(agent.pid())?;
    let mut ready = Vec::new();
    for pod in &all {
        // The pods of a namespace's deployment: one service account.
        agent.add_in(pod, NAMESPACE, "sa=bench")?;
        ready.push(agent.await_ready(pod)?);
    }
    settle();
    let (rss_kib, anon_kib) = rss(agent.pid())?;
    Ok(NodeRun {
        services: push.services,
        pods,
        rss_empty_kib,
        anon_empty_kib,
        rss_kib,
        anon_kib,
        ready,
    })
}

/// Lets what a step left to do (freed memory returned, tasks finishing) happen before
/// memory is read: past the 5 s after which node mode and `shunt proxy` hand free heap
/// back to the kernel.
fn settle() {
    std::thread::sleep(Duration::from_secs(6));
}

/// One sidecar in a pod of its own taking `push` from an ADS server, its certificate
/// over SDS: time and CPU from its start to ready (its admin `/ready` 200 with every
/// type of the push ACKed), then its memory.
fn sidecar(bins: &Bins, envoy: &Path, proxy: Sidecar, push: &Push) -> Result<SidecarRun> {
    let mut node = Node::new()?;
    let pod = node.add_pod("side")?;
    let scratch = Scratch::new("sidecar")?;
    let ads_socket = scratch.0.join("XDS");
    let ads = AdsServer::start(Listen::Unix(ads_socket.clone()))?;
    push.serve(&ads, "1");
    let sds_socket = scratch.0.join("SDS");
    let sds = AdsServer::start(Listen::Unix(sds_socket.clone()))?;
    let ca = node_mesh::TestCaHandle::start(&scratch.0)?;
    let identity = format!("spiffe://cluster.local/ns/{NAMESPACE}/sa/bench");
    let (chain, key) = ca.0.issue(&identity, Duration::from_secs(3600))?;
    use harness::ads::resources::{certificate_secret, named, validation_secret};
    sds.set(
        type_urls::SECRET,
        "1",
        vec![
            named("default", &certificate_secret("default", &chain, &key)),
            named("ROOTCA", &validation_secret("ROOTCA", &ca.0.root_pem)),
        ],
    );
    let mut bootstrap = super::xds::bootstrap(&ads_socket, Api::Sotw);
    bootstrap["node"] = json!({
        "id": format!("sidecar~{}~side-0.{NAMESPACE}~{NAMESPACE}.svc.cluster.local", pod.ipv4()),
        "cluster": format!("side.{NAMESPACE}"),
        "metadata": {"NAMESPACE": NAMESPACE, "NAME": "side-0", "SERVICE_ACCOUNT": "bench",
                     "ISTIO_VERSION": "1.24.0"}
    });
    let sds_cluster = {
        let mut c = bootstrap["static_resources"]["clusters"][0].clone();
        c["name"] = json!("sds-grpc");
        c["load_assignment"] = json!({"cluster_name": "sds-grpc", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"pipe": {"path": sds_socket.display().to_string()}}}}]}]});
        c
    };
    bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .context("clusters")?
        .push(sds_cluster);
    if proxy.deferred() {
        bootstrap["cluster_manager"] = json!({"enable_deferred_cluster_creation": true});
    }
    let file = scratch.0.join("sidecar.json");
    std::fs::write(&file, bootstrap.to_string())?;
    let (program, args) = match proxy {
        Sidecar::Shunt | Sidecar::ShuntDeferred => {
            (bins.shunt.clone(), super::l4::shunt_args(&file))
        }
        Sidecar::Envoy | Sidecar::EnvoyDeferred => {
            (envoy.to_path_buf(), super::l4::envoy_args(&file))
        }
    };
    // `SHUNT_BENCH_SIDECAR_WRAPPER="heaptrack -o FILE"` runs the shunt sidecars under a
    // profiler (its words go before the program; the numbers are then the wrapper's).
    let wrapper = match proxy {
        Sidecar::Shunt | Sidecar::ShuntDeferred => {
            std::env::var("SHUNT_BENCH_SIDECAR_WRAPPER").unwrap_or_default()
        }
        Sidecar::Envoy | Sidecar::EnvoyDeferred => String::new(),
    };
    let mut words = wrapper.split_whitespace();
    let started = Instant::now();
    let process = match words.next() {
        Some(first) => pod
            .command(first)
            .args(words)
            .arg(&program)
            .args(&args)
            .spawn()?,
        None => pod.command(&program).args(&args).spawn()?,
    };
    wait_ready(&pod, &ads, &process, push)?;
    let ready_ms = started.elapsed().as_secs_f64() * 1000.0;
    let cpu_ms = super::measure::cpu_ns(process.pid())? as f64 / 1e6;
    settle();
    let (rss_kib, anon_kib) = rss(process.pid())?;
    drop(process);
    Ok(SidecarRun {
        ready_ms,
        cpu_ms,
        rss_kib,
        anon_kib,
    })
}

/// Waits until the sidecar ACKed version `1` of every type the push has resources of
/// (with no service there are no endpoints to subscribe to) and its admin says ready.
fn wait_ready(pod: &Pod, ads: &AdsServer, process: &PodProcess, push: &Push) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let types: Vec<&str> = push
        .types
        .iter()
        .filter(|t| !t.resources.is_empty())
        .map(|t| t.type_url)
        .collect();
    loop {
        let requests = ads.requests();
        if let Some(nack) = requests.iter().find(|r| r.is_nack()) {
            bail!("{} NACKed: {:?}", process.description(), nack.error_detail);
        }
        let acked = types.iter().all(|t| {
            requests
                .iter()
                .any(|r| r.type_url == *t && r.is_ack() && r.version_info == "1")
        });
        if acked && admin_status(pod, "/ready") == 200 {
            return Ok(());
        }
        if let Some(status) = process.try_wait() {
            bail!(
                "{} exited ({status}):\n{}",
                process.description(),
                super::xds::tail(&process.stderr_text())
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{} not ready in time:\n{}",
                process.description(),
                super::xds::tail(&process.stderr_text())
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn mib(kib: u64) -> f64 {
    kib as f64 / KIB_PER_MIB
}

fn table(
    nodes: &[NodeRun],
    sidecars: &[(usize, Sidecar, SidecarRun)],
    wire: &[(usize, usize)],
) -> Result<String> {
    let mut text = String::new();
    writeln!(
        text,
        "bench node: Istio's push of S services (EDS cluster, 3 endpoints, virtual host each) \
         to P pods of one namespace\n"
    )?;
    for (s, bytes) in wire {
        writeln!(
            text,
            "xDS per pod at S={s}: {:.0} KiB",
            *bytes as f64 / 1024.0
        )?;
    }
    writeln!(
        text,
        "\n| S | P | node RSS MiB | anon MiB | per pod MiB | P pods / 1 pod | anon KiB per service per pod | 1st pod ready ms (CPU ms) | next pods ready ms (CPU ms), median | next pods worst CPU ms |"
    )?;
    writeln!(text, "|---|---|---|---|---|---|---|---|---|---|")?;
    for r in nodes {
        let one = nodes
            .iter()
            .find(|o| o.services == r.services && o.pods == 1)
            .map_or(f64::NAN, |o| r.rss_kib as f64 / o.rss_kib as f64);
        let (next_ms, next_cpu) = r.next_pods();
        writeln!(
            text,
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.2}x | {:.1} | {:.0} ({:.1}) | {:.1} ({:.1}) | {:.1} |",
            r.services,
            r.pods,
            mib(r.rss_kib),
            mib(r.anon_kib),
            r.per_pod_kib() / KIB_PER_MIB,
            one,
            r.anon_per_service_kib(),
            r.ready[0].0,
            r.ready[0].1,
            next_ms,
            next_cpu,
            r.next_pods_worst_cpu()
        )?;
    }
    writeln!(
        text,
        "\n| S | sidecar | RSS MiB | anon MiB | anon KiB per service | ready ms | CPU ms to ready |"
    )?;
    writeln!(text, "|---|---|---|---|---|---|---|")?;
    let base = |proxy: Sidecar| {
        sidecars
            .iter()
            .find(|(s, p, _)| *s == 0 && *p == proxy)
            .map(|(_, _, r)| r.anon_kib)
    };
    for (s, proxy, r) in sidecars {
        let per_service = match (base(*proxy), *s) {
            (Some(b), s) if s > 0 => r.anon_kib.saturating_sub(b) as f64 / s as f64,
            _ => f64::NAN,
        };
        writeln!(
            text,
            "| {s} | {} | {:.1} | {:.1} | {per_service:.1} | {:.0} | {:.0} |",
            proxy.name(),
            mib(r.rss_kib),
            mib(r.anon_kib),
            r.ready_ms,
            r.cpu_ms
        )?;
    }
    writeln!(text, "\ngoals")?;
    for r in nodes.iter().filter(|r| r.pods > 1) {
        if let Some(one) = nodes
            .iter()
            .find(|o| o.services == r.services && o.pods == 1)
        {
            let ratio = r.rss_kib as f64 / one.rss_kib as f64;
            let met = Goal::RatioAtMost(SHARED_GOAL).met(ratio, ratio);
            writeln!(
                text,
                "  {} pods at S={} cost {ratio:.2}x one pod's node RSS (goal <= {SHARED_GOAL}x): {}",
                r.pods,
                r.services,
                if met { "met" } else { "not met" }
            )?;
        }
        let (_, cpu) = r.next_pods();
        let met = Goal::Under(NEXT_POD_CPU_MS_GOAL).met(cpu, cpu);
        writeln!(
            text,
            "  next pods at S={} ready in {cpu:.1} ms of CPU, median (goal <= {NEXT_POD_CPU_MS_GOAL} ms): {}",
            r.services,
            if met { "met" } else { "not met" }
        )?;
    }
    for (s, proxy, r) in sidecars
        .iter()
        .filter(|(s, p, _)| *s > 0 && *p == Sidecar::Shunt)
    {
        if let Some(b) = base(*proxy) {
            let per = r.anon_kib.saturating_sub(b) as f64 / *s as f64;
            let met = Goal::Under(KIB_PER_SERVICE_GOAL).met(per, per);
            writeln!(
                text,
                "  {} at S={s}: {per:.1} KiB anon per service (goal <= {KIB_PER_SERVICE_GOAL}): {}",
                proxy.name(),
                if met { "met" } else { "not met" }
            )?;
        }
    }
    Ok(text)
}
