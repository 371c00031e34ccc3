//! `cargo xtask bench soak`: shunt under mixed traffic for a bounded time (10 minutes by
//! default) while its configuration changes every second and its upstreams crash and
//! come back; passes only with 0 unexpected errors and no fd or memory growth after
//! warm-up.
//!
//! `--with-envoy` runs the same soak again through Envoy 1.40 and sets the two side by
//! side (RSS and `/stats` after warm-up); the verdict stays shunt's.
//!
//! Two pods: `proxy` (shunt, configured over ADS by the in-process server `bench xds`
//! uses, through the same bootstrap; the clients run here too, on 127.0.0.1) and
//! `server` (`testapp serve` endpoints). What is served and how it changes is in
//! `soak/config.rs`, the traffic in `soak/traffic.rs`, the verdict in `soak/report.rs`.
//!
//! Three threads besides the traffic's: the xDS updater (one step of the cycle each
//! `--xds-interval-ms`, each waited for to its ACK; a NACK or no answer is an
//! unexpected error), the flapper (every `--flap-s`, one endpoint of each upstream
//! cluster is SIGKILLed and restarted `--down-s` later), and this one, which samples
//! the proxy every `--sample-s`. Ctrl-C (or SIGTERM) ends the run early; either way
//! every process, namespace and cgroup is removed and the report is written.

pub(crate) mod config;
mod report;
mod traffic;

use std::{
    collections::HashMap,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use harness::ads::{AdsServer, Listen, type_urls};
use harness::{Node, Pod, PodProcess, tcp_listeners};
use serde_json::json;

use self::config::{CYCLE, Config, ENDPOINTS, Endpoint, LISTEN_PORTS, MTLS_OUT_PORT, State, Tls};
use self::report::{Report, Sample, Window};
use self::traffic::{KINDS, Kind, Traffic};
use super::l4::{envoy_args, shunt_args};
use super::measure::{TICK_US, cpus, kernel, proxy_cpu_ticks, rss, save};
use super::xds::{ADMIN_PORT, Api, admin_status, bootstrap, open_to_the_proxy, tail, type_name};
use crate::pods::{Bins, start_app_mode, target_dir};

#[derive(clap::Args)]
pub struct SoakArgs {
    /// How long the traffic runs: `10m`, `90s`, `1h` (a bare number is seconds).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    duration: Duration,
    /// Seconds between two readings of the proxy (RSS, fds, threads, connections).
    #[arg(long, default_value_t = 5)]
    sample_s: u64,
    /// Seconds of warm-up the growth checks leave out (at most half the duration).
    #[arg(long, default_value_t = 60)]
    warmup_s: u64,
    /// Milliseconds between two xDS updates.
    #[arg(long, default_value_t = 1000)]
    xds_interval_ms: u64,
    /// Seconds between two upstream crashes (one endpoint of each cluster each time).
    #[arg(long, default_value_t = 15)]
    flap_s: u64,
    /// Seconds a crashed endpoint stays down.
    #[arg(long, default_value_t = 2)]
    down_s: u64,
    /// Scales every kind of traffic's rate (1: ~6,700 requests/s, 125 echo connections/s).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    /// RSS growth after warm-up that still passes, MiB.
    #[arg(long, default_value_t = 4.0)]
    rss_tolerance_mib: f64,
    /// Growth of fds (not counting connections) after warm-up that still passes.
    #[arg(long, default_value_t = 4.0)]
    fd_tolerance: f64,
    /// Growth of the number of stats in `/stats` after warm-up that still passes (one
    /// cycle's churned cluster and listener come and go: ~150 stats up and down).
    #[arg(long, default_value_t = 200.0)]
    stats_tolerance: f64,
    /// Then the same soak through Envoy 1.40 (same bootstrap, pushes, traffic and
    /// crashes), for its RSS and `/stats` beside shunt's: its errors are reported, the
    /// verdict is shunt's.
    #[arg(long)]
    with_envoy: bool,
}

/// The proxy a soak runs through.
#[derive(Clone)]
enum Proxy {
    Shunt,
    Envoy(std::path::PathBuf),
}

impl Proxy {
    fn name(&self) -> &'static str {
        match self {
            Proxy::Shunt => "shunt",
            Proxy::Envoy(_) => "envoy",
        }
    }

    fn command(
        &self,
        bins: &Bins,
        bootstrap: &std::path::Path,
    ) -> (std::path::PathBuf, Vec<String>) {
        let (program, mut args) = match self {
            Proxy::Shunt => (bins.shunt.clone(), shunt_args(bootstrap)),
            Proxy::Envoy(envoy) => (envoy.clone(), envoy_args(bootstrap)),
        };
        // pilot-agent's drain time: a removed listener (and its stats) stays that long.
        // Envoy's default, 600 s, would outlast the run.
        args.extend(["--drain-time-s".into(), DRAIN_TIME_S.into()]);
        (program, args)
    }
}

/// Istio's `--drain-time-s` (its `drainDuration`, 45 s): under the 60 s warm-up, so the
/// churned listeners that drain are gone by the time growth is measured.
const DRAIN_TIME_S: &str = "45";

/// `10m`, `90s`, `1h`, `600`.
fn parse_duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: a number of seconds, or one followed by s, m or h"))?;
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        other => return Err(format!("{text:?}: unit {other:?} is not s, m or h")),
    };
    Ok(Duration::from_secs(n * scale))
}

/// Per kind at `--rate 1` (about 40% of one core for the proxy on the shared 2-vCPU VM;
/// the clients and upstreams take more): requests (or connections, or curl batches) a
/// second, per client.
const H1_KEEPALIVE_PER_S: f64 = 500.0;
const H1_KEEPALIVE_CONNECTIONS: usize = 4;
const H1_NEW_PER_S: f64 = 375.0;
const H2_PER_S: f64 = 1500.0;
const H2_BATCH_S: u64 = 5;
const TCP_PER_S: f64 = 125.0;
const TCP_BYTES: usize = 64 * 1024;
const TCP_BULK_EVERY_S: f64 = 2.0;
const TCP_BULK_BYTES: usize = 8 << 20;
const MTLS_PER_S: f64 = 375.0;
const MTLS_CONNECTIONS: usize = 2;
const MTLS_CURL_BATCHES_PER_S: f64 = 5.0;
const MTLS_CURL_PER_BATCH: usize = 10;

/// How long the proxy may take to answer an update or become ready.
const XDS_TIMEOUT: Duration = Duration::from_secs(10);

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// First Ctrl-C: finish early, cleaning up. Second: leave now (the harness sweeps what
/// a dead run left on its next start).
extern "C" fn on_interrupt(signal: libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::SeqCst) {
        // SAFETY: _exit(2) is async-signal-safe.
        unsafe { libc::_exit(128 + signal) };
    }
}

fn catch_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only touches an atomic and calls _exit.
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

/// One upstream endpoint and its process while it runs.
struct Upstream {
    endpoint: &'static Endpoint,
    process: Option<PodProcess>,
}

pub fn run(bins: Bins, args: &SoakArgs) -> Result<()> {
    ensure!(args.sample_s > 0, "--sample-s must be at least 1");
    ensure!(args.rate > 0.0, "--rate must be above 0");
    ensure!(
        args.down_s < args.flap_s,
        "--down-s must be shorter than --flap-s"
    );
    ensure!(
        args.duration >= Duration::from_secs(4 * args.sample_s),
        "--duration must hold at least 4 samples of --sample-s"
    );
    let warmup_s = (args.warmup_s as f64).min(args.duration.as_secs_f64() / 2.0);
    catch_interrupts();
    harness::raise_open_files_limit();
    let mut proxies = vec![Proxy::Shunt];
    if args.with_envoy {
        proxies.push(Proxy::Envoy(crate::setup::envoy()?));
    }

    let mut reports = Vec::new();
    for proxy in &proxies {
        if INTERRUPTED.load(Ordering::Relaxed) {
            break;
        }
        let report = soak_in_new_node(&bins, args, warmup_s, proxy)?;
        print!("\n{}", report.table());
        reports.push((proxy.name(), report));
    }

    let mut text: String = reports.iter().map(|(_, r)| r.table() + "\n").collect();
    if reports.len() > 1 {
        text += &report::side_by_side(&reports);
        print!("\n{}", report::side_by_side(&reports));
    }
    let dir = target_dir().join("bench");
    std::fs::write(dir.join("soak.csv"), reports[0].1.csv())?;
    println!("saved {}", dir.join("soak.csv").display());
    let config = json!({
        "duration_s": args.duration.as_secs(),
        "sample_s": args.sample_s,
        "warmup_s": warmup_s,
        "xds_interval_ms": args.xds_interval_ms,
        "flap_s": args.flap_s,
        "down_s": args.down_s,
        "rate": args.rate,
        "kernel": kernel(),
        "cpus": cpus(),
    });
    let json: serde_json::Map<String, serde_json::Value> = reports
        .iter()
        .map(|(name, r)| ((*name).to_owned(), r.json(config.clone())))
        .collect();
    save("soak", &text, &json.into())?;
    let problems = reports[0].1.problems();
    if !problems.is_empty() {
        bail!("soak failed: {}", problems.join("; "));
    }
    for (name, report) in &reports[1..] {
        for problem in report.problems() {
            println!("bench soak: {name} (not judged): {problem}");
        }
    }
    Ok(())
}

/// One soak through `proxy` in pods of its own, removed afterwards.
fn soak_in_new_node(bins: &Bins, args: &SoakArgs, warmup_s: f64, proxy: &Proxy) -> Result<Report> {
    let mut node = Node::new()?;
    let proxy_pod = node.add_pod("proxy")?;
    let server = node.add_pod("server")?;
    sweep_scratch();
    let scratch = std::env::temp_dir().join(format!("{SCRATCH_PREFIX}{}", std::process::id()));
    let result = soak(bins, args, warmup_s, proxy, &proxy_pod, &server, &scratch);
    drop(node);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

/// The scratch folder of a run (certificates, the ADS socket, h2load's log) is
/// `<tmp>/shunt-bench-soak-<pid>`.
const SCRATCH_PREFIX: &str = "shunt-bench-soak-";

/// Removes the scratch folders of runs whose process is gone (a second Ctrl-C leaves
/// without cleaning up; the harness sweeps its namespaces and cgroups, this the rest).
fn sweep_scratch() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(SCRATCH_PREFIX) else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Sets up, runs the traffic, the updates and the flapping for `--duration`, samples.
fn soak(
    bins: &Bins,
    args: &SoakArgs,
    warmup_s: f64,
    which: &Proxy,
    proxy_pod: &Pod,
    server: &Pod,
    scratch: &std::path::Path,
) -> Result<Report> {
    let mut upstreams = Vec::new();
    for endpoint in &ENDPOINTS {
        upstreams.push(Upstream {
            endpoint,
            process: Some(start_app_mode(bins, server, endpoint.port, endpoint.mode)?),
        });
    }
    let tls = Tls::new(&scratch.join("pki"))?;
    let config = Config {
        server: server.ipv4(),
        proxy: proxy_pod.ipv4(),
        tls: &tls,
    };

    // Istio's shape, as bench xds runs it: ADS over a Unix socket, state of the world.
    let socket = scratch.join("ads.sock");
    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let bootstrap_file = dir.join("soak-bootstrap.json");
    std::fs::write(
        &bootstrap_file,
        serde_json::to_string_pretty(&bootstrap(&socket, Api::Sotw))? + "\n",
    )?;
    crate::run_checked(
        std::process::Command::new(&bins.shunt)
            .args(["proxy", "--mode", "validate", "-c"])
            .arg(&bootstrap_file),
    )?;
    let ads = AdsServer::start(Listen::Unix(socket.clone()))?;
    open_to_the_proxy(&socket)?;
    let mut state = State::default();
    for t in [
        type_urls::CLUSTER,
        type_urls::ENDPOINT,
        type_urls::LISTENER,
        type_urls::ROUTE,
    ] {
        ads.set(t, "1", config.resources(&state, t));
    }

    let (program, proxy_args) = which.command(bins, &bootstrap_file);
    let mut proxy = proxy_pod.command(&program).args(&proxy_args).spawn()?;
    let pid = proxy.pid();
    wait_ready(proxy_pod, &proxy, &ads, which)?;
    proxy_pod.run_in_netns(traffic::check)?.map_err(|e| {
        anyhow::anyhow!(
            "before the soak: {e}\nclusters: {}\n{} said:\n{}",
            admin_get(proxy_pod, "/clusters").unwrap_or_else(|e| format!("{e:#}")),
            which.name(),
            tail(&proxy.stderr_text())
        )
    })?;
    println!(
        "bench soak: {} (pid {pid}, {}) in pod {} over ADS (Unix socket {}); {} upstream endpoints in pod {}; {:?} of traffic at --rate {}, an xDS update every {} ms, one endpoint of each cluster SIGKILLed every {} s for {} s; a sample every {} s, warm-up {warmup_s:.0} s; kernel {}, {} CPUs",
        which.name(),
        proxy_args.join(" "),
        proxy_pod.name(),
        socket.display(),
        ENDPOINTS.len(),
        server.name(),
        args.duration,
        args.rate,
        args.xds_interval_ms,
        args.flap_s,
        args.down_s,
        args.sample_s,
        kernel(),
        cpus()
    );

    let traffic = Traffic::new(args.rate);
    let windows = Mutex::new(Vec::<Window>::new());
    let flap_problem = Mutex::new(None::<String>);
    let xds_acked = AtomicU64::new(0);
    let xds_problems = Mutex::new(Vec::<String>::new());
    let mut samples = Vec::new();
    let mut cut_short = None;

    std::thread::scope(|s| {
        let t = &traffic;
        let in_pod = |f| in_netns(s, proxy_pod, f);
        for _ in 0..H1_KEEPALIVE_CONNECTIONS {
            in_pod(Box::new(move || {
                traffic::h1_keepalive(t, Kind::H1KeepAlive, config::HTTP_PORT, H1_KEEPALIVE_PER_S)
            }));
        }
        in_pod(Box::new(move || traffic::h1_new(t, H1_NEW_PER_S)));
        in_pod(Box::new(move || traffic::tcp(t, TCP_PER_S, TCP_BYTES)));
        in_pod(Box::new(move || {
            traffic::tcp(t, 1.0 / TCP_BULK_EVERY_S, TCP_BULK_BYTES)
        }));
        for _ in 0..MTLS_CONNECTIONS {
            in_pod(Box::new(move || {
                traffic::h1_keepalive(t, Kind::Mtls, MTLS_OUT_PORT, MTLS_PER_S)
            }));
        }
        let h2_log = scratch.join("h2load.log");
        s.spawn(move || traffic::h2(t, proxy_pod, H2_PER_S, H2_BATCH_S, &h2_log));
        s.spawn(|| {
            traffic::mtls_curl(
                t,
                proxy_pod,
                &tls,
                MTLS_CURL_BATCHES_PER_S,
                MTLS_CURL_PER_BATCH,
            )
        });
        s.spawn(|| {
            update(
                t,
                &ads,
                &config,
                &mut state,
                Duration::from_millis(args.xds_interval_ms),
                &xds_acked,
                &xds_problems,
            )
        });
        s.spawn(|| {
            if let Err(e) = flap(t, bins, server, &mut upstreams, args, &windows) {
                *flap_problem.lock().unwrap() = Some(format!("{e:#}"));
                t.stop.store(true, Ordering::Relaxed);
            }
        });

        // This thread samples until the end (or an interrupt, or the proxy's exit).
        let sample = Duration::from_secs(args.sample_s);
        let end = t.start + args.duration;
        let mut next = t.start + sample;
        let mut prev = Mark {
            at: t.start,
            cpu: proxy_cpu_ticks(pid).unwrap_or(0),
            counts: counts(t),
        };
        loop {
            while Instant::now() < next.min(end) {
                if INTERRUPTED.load(Ordering::Relaxed) || t.stop.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if INTERRUPTED.load(Ordering::Relaxed) {
                cut_short = Some("interrupted (Ctrl-C or SIGTERM)".to_owned());
                break;
            }
            if let Some(status) = proxy.try_wait() {
                cut_short = Some(format!(
                    "the proxy exited ({status}):\n{}",
                    tail(&proxy.stderr_text())
                ));
                break;
            }
            if let Some(problem) = flap_problem.lock().unwrap().clone() {
                cut_short = Some(format!("restarting an upstream: {problem}"));
                break;
            }
            match read_sample(proxy_pod, pid, t, &xds_acked, &prev) {
                Ok((reading, mark)) => {
                    print_sample(&reading);
                    samples.push(reading);
                    prev = mark;
                }
                Err(e) => {
                    cut_short = Some(format!("sampling the proxy: {e:#}"));
                    break;
                }
            }
            if Instant::now() >= end {
                break;
            }
            next += sample;
        }
        t.stop.store(true, Ordering::Relaxed);
    });

    if cut_short.is_none()
        && let Some(status) = proxy.try_wait()
    {
        cut_short = Some(format!(
            "the proxy exited ({status}):\n{}",
            tail(&proxy.stderr_text())
        ));
    }
    let counters = admin_stats(proxy_pod)
        .map(|stats| proxy_counters(&stats))
        .unwrap_or_default();
    proxy.kill();
    let warnings: Vec<String> = proxy
        .stderr_text()
        .lines()
        .filter(|l| l.contains("ERROR") || l.contains("panick"))
        .take(20)
        .map(str::to_owned)
        .collect();
    if !warnings.is_empty() {
        eprintln!(
            "bench soak: the proxy logged errors:\n{}",
            warnings.join("\n")
        );
    }
    drop(upstreams);
    drop(ads);

    Ok(Report {
        description: format!(
            "bench soak: {} over ADS, {:.0} s of HTTP/1.1 (kept alive and new connections), h2c (h2load), TCP echo and bulk, mTLS (proxy to proxy and curl) at --rate {}; an xDS update every {} ms; one endpoint of each cluster down {} s every {} s; kernel {}, {} CPUs",
            which.name(),
            traffic.start.elapsed().as_secs_f64(),
            args.rate,
            args.xds_interval_ms,
            args.down_s,
            args.flap_s,
            kernel(),
            cpus()
        ),
        warmup_s,
        samples,
        windows: windows.into_inner().unwrap(),
        failures: traffic.failures(),
        totals: KINDS
            .iter()
            .map(|k| (k.name(), traffic.ok(*k), traffic.failed(*k)))
            .collect(),
        xds_updates: xds_acked.load(Ordering::Relaxed),
        xds_problems: xds_problems.into_inner().unwrap(),
        cut_short,
        counters,
        rss_tolerance_mib: args.rss_tolerance_mib,
        fd_tolerance: args.fd_tolerance,
        stats_tolerance: args.stats_tolerance,
    })
}

/// A client thread in the proxy pod's netns (so its sockets are there).
fn in_netns<'scope>(
    s: &'scope std::thread::Scope<'scope, '_>,
    pod: &'scope Pod,
    f: Box<dyn FnOnce() + Send + 'scope>,
) {
    s.spawn(move || {
        if let Err(e) = pod.run_in_netns(f) {
            eprintln!("bench soak: a client could not enter the proxy pod: {e:#}");
        }
    });
}

/// The proxy took the whole configuration (no NACK), answers `/ready` and listens on
/// every port.
fn wait_ready(pod: &Pod, proxy: &PodProcess, ads: &AdsServer, which: &Proxy) -> Result<()> {
    let deadline = Instant::now() + XDS_TIMEOUT * 3;
    loop {
        if let Some(nack) = ads.requests().iter().find(|r| r.is_nack()) {
            bail!(
                "{} NACKed the soak's {}: {:?}",
                which.name(),
                type_name(&nack.type_url),
                nack.error_detail
            );
        }
        // Distinct ports: Envoy listens once per worker on each.
        let mut ports: Vec<u16> = tcp_listeners(pod)?
            .iter()
            .map(|a| a.port())
            .filter(|p| LISTEN_PORTS.contains(p))
            .collect();
        ports.sort_unstable();
        ports.dedup();
        let listening = ports.len();
        if admin_status(pod, "/ready") == 200 && listening == LISTEN_PORTS.len() {
            return Ok(());
        }
        ensure!(
            proxy.try_wait().is_none() && Instant::now() < deadline,
            "{} not ready with {listening} of {} listeners within {:?} (exited: {:?}):\n{}",
            which.name(),
            LISTEN_PORTS.len(),
            XDS_TIMEOUT * 3,
            proxy.try_wait(),
            tail(&proxy.stderr_text())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One step of the cycle every `interval`, each waited for: sent, then ACKed.
fn update(
    traffic: &Traffic,
    ads: &AdsServer,
    config: &Config,
    state: &mut State,
    interval: Duration,
    acked: &AtomicU64,
    problems: &Mutex<Vec<String>>,
) {
    let mut version = 1u64;
    let mut next = Instant::now() + interval;
    for step in CYCLE.iter().cycle() {
        loop {
            if traffic.stop.load(Ordering::Relaxed) {
                return;
            }
            let now = Instant::now();
            if now >= next {
                break;
            }
            std::thread::sleep(Duration::from_millis(20).min(next - now));
        }
        // An update that took longer than the interval delays the next, no catching up.
        next = (next + interval).max(Instant::now());
        version += 1;
        let v = version.to_string();
        let mut all_acked = true;
        for &type_url in state.apply(*step) {
            ads.set(type_url, &v, config.resources(state, type_url));
            let answered = ads
                .wait_for_sent(XDS_TIMEOUT, |s| {
                    s.type_url == type_url && s.version_info == v
                })
                .and_then(|sent| {
                    ads.wait_for(XDS_TIMEOUT, |r| {
                        r.stream == sent.stream
                            && r.type_url == sent.type_url
                            && r.response_nonce == sent.nonce
                    })
                });
            let problem = match answered {
                Ok(r) if r.is_nack() => format!(
                    "{step:?} ({} version {v}) NACKed: {:?}",
                    type_name(type_url),
                    r.error_detail
                ),
                Ok(_) => continue,
                Err(e) => format!(
                    "{step:?} ({} version {v}) not sent or not answered within {XDS_TIMEOUT:?}: {}",
                    type_name(type_url),
                    e.to_string().lines().next().unwrap_or_default()
                ),
            };
            problems.lock().unwrap().push(problem);
            all_acked = false;
        }
        if all_acked {
            acked.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Every `--flap-s`, SIGKILLs one endpoint of each cluster (the first, then the
/// second, ...) and starts it again `--down-s` later; records each window.
fn flap(
    traffic: &Traffic,
    bins: &Bins,
    server: &Pod,
    upstreams: &mut [Upstream],
    args: &SoakArgs,
    windows: &Mutex<Vec<Window>>,
) -> Result<()> {
    let sleep = |d: Duration| {
        let until = Instant::now() + d;
        while Instant::now() < until && !traffic.stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(50));
        }
        !traffic.stop.load(Ordering::Relaxed)
    };
    let since = |at: Instant| (at - traffic.start).as_secs_f64();
    let mut round = 0usize;
    while sleep(Duration::from_secs(args.flap_s - args.down_s)) {
        let down_at = Instant::now();
        let mut stopped = Vec::new();
        let mut clusters: Vec<&str> = upstreams
            .iter()
            .filter(|u| u.endpoint.flaps)
            .map(|u| u.endpoint.cluster)
            .collect();
        clusters.dedup();
        for cluster in clusters {
            let of_cluster: Vec<usize> = (0..upstreams.len())
                .filter(|i| {
                    upstreams[*i].endpoint.cluster == cluster && upstreams[*i].endpoint.flaps
                })
                .collect();
            let i = of_cluster[round % of_cluster.len()];
            if let Some(mut process) = upstreams[i].process.take() {
                process.kill();
            }
            stopped.push(i);
        }
        round += 1;
        let stop_early = !sleep(Duration::from_secs(args.down_s));
        for i in stopped {
            let e = upstreams[i].endpoint;
            upstreams[i].process = Some(
                start_app_mode(bins, server, e.port, e.mode)
                    .with_context(|| format!("restarting {} endpoint :{}", e.cluster, e.port))?,
            );
        }
        windows.lock().unwrap().push(Window {
            down_s: since(down_at),
            up_s: since(Instant::now()),
        });
        if stop_early {
            break;
        }
    }
    Ok(())
}

fn counts(traffic: &Traffic) -> Vec<(u64, u64)> {
    KINDS
        .iter()
        .map(|k| (traffic.ok(*k), traffic.failed(*k)))
        .collect()
}

/// When a reading was taken, the proxy's CPU ticks and the traffic's (ok, failed)
/// counts then: what the next reading subtracts.
struct Mark {
    at: Instant,
    cpu: u64,
    counts: Vec<(u64, u64)>,
}

impl Mark {
    fn now(traffic: &Traffic, pid: u32) -> Result<Mark> {
        Ok(Mark {
            at: Instant::now(),
            cpu: proxy_cpu_ticks(pid)?,
            counts: counts(traffic),
        })
    }
}

/// One reading, and its mark for the next one.
fn read_sample(
    pod: &Pod,
    pid: u32,
    traffic: &Traffic,
    xds_acked: &AtomicU64,
    prev: &Mark,
) -> Result<(Sample, Mark)> {
    let mark = Mark::now(traffic, pid)?;
    // The connections right before the fds, so that fds net of connections is steady.
    let stats = admin_stats(pod)?;
    let (rss_kib, rss_anon_kib) = rss(pid)?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("listing /proc/{pid}/fd"))?
        .count() as u64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no Threads: in /proc/PID/status")?;
    let sum = |prefix: &str, suffix: &str| -> u64 {
        stats
            .iter()
            .filter(|(k, _)| k.starts_with(prefix) && k.ends_with(suffix) && !k.contains("admin"))
            .map(|(_, v)| *v)
            .sum()
    };
    let elapsed = (mark.at - prev.at).as_secs_f64();
    let (now, prev_counts) = (&mark.counts, &prev.counts);
    Ok((
        Sample {
            t_s: (mark.at - traffic.start).as_secs_f64(),
            interval_s: elapsed,
            rss_kib,
            rss_anon_kib,
            fds,
            threads,
            downstream_cx: sum("listener.", ".downstream_cx_active"),
            upstream_cx: sum("cluster.", ".upstream_cx_active"),
            stats: stats.len() as u64,
            cpu_pct: (mark.cpu - prev.cpu) as f64 * TICK_US / 1e6 / elapsed * 100.0,
            ok: now
                .iter()
                .zip(prev_counts)
                .map(|(n, p)| n.0 - p.0)
                .collect(),
            failed: now
                .iter()
                .zip(prev_counts)
                .map(|(n, p)| n.1 - p.1)
                .collect(),
            xds_acked: xds_acked.load(Ordering::Relaxed),
        },
        mark,
    ))
}

fn print_sample(s: &Sample) {
    let interval_s = s.interval_s;
    let per_kind: Vec<String> = KINDS
        .iter()
        .zip(s.ok.iter().zip(&s.failed))
        .map(|(k, (ok, failed))| {
            if *failed > 0 {
                format!(
                    "{} {:.0}/s {failed} FAILED",
                    k.name(),
                    *ok as f64 / interval_s
                )
            } else {
                format!("{} {:.0}/s", k.name(), *ok as f64 / interval_s)
            }
        })
        .collect();
    println!(
        "  {:>5.0} s  RSS {:.1} MiB  fds {} ({} net)  conns {}+{}  threads {}  CPU {:.0}%  xDS {}  | {}",
        s.t_s,
        s.rss_mib(),
        s.fds,
        s.fds_net(),
        s.downstream_cx,
        s.upstream_cx,
        s.threads,
        s.cpu_pct,
        s.xds_acked,
        per_kind.join(", ")
    );
}

/// What shows the flapping was felt and survived: the clusters' (but `xds-grpc`'s)
/// connect failures and retries among their connections and requests, and the TLS
/// handshakes of the listeners and clusters.
fn proxy_counters(stats: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let sum = |prefix: &str, suffix: &str| -> u64 {
        stats
            .iter()
            .filter(|(k, _)| {
                k.starts_with(prefix) && k.ends_with(suffix) && !k.starts_with("cluster.xds-grpc.")
            })
            .map(|(_, v)| *v)
            .sum()
    };
    [
        ("cluster.", ".upstream_cx_total"),
        ("cluster.", ".upstream_cx_connect_fail"),
        ("cluster.", ".upstream_rq_total"),
        ("cluster.", ".upstream_rq_retry"),
        ("listener.", ".ssl.handshake"),
        ("cluster.", ".ssl.handshake"),
    ]
    .iter()
    .map(|(prefix, suffix)| (format!("{prefix}*{suffix}"), sum(prefix, suffix)))
    .collect()
}

/// An admin API page, through curl in the pod.
fn admin_get(pod: &Pod, path: &str) -> Result<String> {
    let out = pod
        .command("curl")
        .args(["-sSf", "-m", "5"])
        .arg(format!("http://127.0.0.1:{ADMIN_PORT}{path}"))
        .output()?;
    ensure!(
        out.status.success(),
        "GET {path} from the admin API: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The admin API's `/stats` (counters and gauges).
fn admin_stats(pod: &Pod) -> Result<HashMap<String, u64>> {
    Ok(admin_get(pod, "/stats")?
        .lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(k, v)| Some((k.to_owned(), v.trim().parse().ok()?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::parse_duration;
    use std::time::Duration;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        let err = parse_duration("10x").unwrap_err();
        assert!(err.contains("unit \"x\""), "{err}");
        assert!(parse_duration("m").is_err());
    }
}
