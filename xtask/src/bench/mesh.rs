//! `cargo xtask bench mesh`: Istio's own method, side by side in one run. A client pod
//! and a server pod on one node, the same traffic through each data plane of
//! [`super::mesh_planes`] (direct, Envoy sidecars, shunt sidecars, node mode L7 with
//! the fast path on and off, node mode L4, ztunnel), alternating between them point by
//! point: HTTP/1.1 POSTs of 1 KB echoed back and the TCP echo of 1 KB, over 4, 16 and
//! 64 connections, kept alive or one per request, from `testapp bench-rate` (a
//! fixed-rate generator that counts each request's latency from its scheduled time, so
//! coordinated omission is corrected).
//!
//! At each point every plane runs first at its maximum rate (closed loop), then at
//! 1000 requests/s and at 80% of its own maximum. Reported: latency added over direct
//! at p50/p90/p99/p99.9 (at a fixed rate), CPU of the mesh processes per 1000
//! requests/s (both sidecars, or the node process: utime + stime from /proc), their
//! RSS, the maximum rate, and ratios against each peer with the goals. A run
//! with errors is refused. `--wakeups` counts, at 1000 requests/s, the wake-ups and
//! system calls per request of each plane's mesh processes (`perf stat`). Results in
//! `target/bench/mesh.{txt,json}`.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use super::measure::{
    KIB_PER_MIB, TICK_US, app_testapp, cpus, kernel, median, proxy_cpu_ticks, rss, save,
};
use super::mesh_planes::{self, HTTP_PORT, Plane, Programs, Running, TCP_PORT};
use crate::pods::Bins;

#[derive(clap::Args)]
pub struct MeshArgs {
    /// Data planes to run (direct is always run: latency is added over it).
    #[arg(long, value_enum, value_delimiter = ',')]
    planes: Vec<Plane>,
    /// Traffic kinds.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "http,tcp")]
    protocols: Vec<Proto>,
    /// Connections (client threads).
    #[arg(long, value_delimiter = ',', default_value = "4,16,64")]
    connections: Vec<usize>,
    /// Keep-alive, a new connection per request, or both.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "keepalive,new"
    )]
    modes: Vec<ConnMode>,
    /// Fixed rates (requests/s), each run at every point.
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    rates: Vec<f64>,
    /// Also run each plane at this fraction of its own maximum (0: not at all).
    #[arg(long, default_value_t = 0.8)]
    fraction: f64,
    /// Length of each fixed-rate run (the first 500 ms are not counted).
    #[arg(long, default_value_t = 5000)]
    duration_ms: u64,
    /// Length of each maximum-rate run.
    #[arg(long, default_value_t = 3000)]
    max_duration_ms: u64,
    /// Rounds over every point (medians are reported).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// A quick check: HTTP and TCP keep-alive over 16 connections, 2 s runs.
    #[arg(long)]
    quick: bool,
    /// Count wake-ups and system calls per request at 1000 requests/s (perf stat).
    #[arg(long)]
    wakeups: bool,
    /// The shunt binary the sidecars run (default: the release build; `cargo xtask
    /// dist`'s is target/dist/shunt). A `<binary>.build.json` beside it says what it is.
    #[arg(long)]
    shunt_bin: Option<PathBuf>,
    /// ztunnel's binary (default: $ZTUNNEL_BIN, else `cargo xtask ztunnel`'s cached build).
    #[arg(long)]
    ztunnel_bin: Option<PathBuf>,
    /// A checkout of istio/ztunnel to build from when there is no binary (default:
    /// $ZTUNNEL_SRC).
    #[arg(long)]
    ztunnel_src: Option<PathBuf>,
    /// Use the debug build (a quick check of the bench itself; numbers mean little).
    #[arg(long)]
    pub debug: bool,
    /// Run the release binaries already in target/release (no `cargo build` first).
    #[arg(long)]
    pub no_build: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Proto {
    Http,
    Tcp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Http => "http",
            Proto::Tcp => "tcp",
        }
    }

    fn port(self) -> u16 {
        match self {
            Proto::Http => HTTP_PORT,
            Proto::Tcp => TCP_PORT,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum ConnMode {
    Keepalive,
    New,
}

impl ConnMode {
    fn name(self) -> &'static str {
        match self {
            ConnMode::Keepalive => "keepalive",
            ConnMode::New => "new",
        }
    }
}

/// One traffic shape: what, how connected, how many connections.
#[derive(Clone, Copy, PartialEq)]
struct Point {
    proto: Proto,
    mode: ConnMode,
    connections: usize,
}

impl Point {
    fn label(&self) -> String {
        format!(
            "{} {} c{}",
            self.proto.name(),
            self.mode.name(),
            self.connections
        )
    }
}

/// The load of one run.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Load {
    Max,
    Rate(f64),
    /// A fraction of the plane's own maximum.
    OfMax(f64),
}

impl Load {
    fn label(&self) -> String {
        match self {
            Load::Max => "max".into(),
            Load::Rate(r) => format!("{r:.0}/s"),
            Load::OfMax(f) => format!("{:.0}% max", f * 100.0),
        }
    }
}

/// What one run measured.
#[derive(Clone)]
struct Sample {
    plane: Plane,
    point: Point,
    load: Load,
    rate: f64,
    per_sec: f64,
    p50: f64,
    p90: f64,
    p99: f64,
    p999: f64,
    /// Cores busy in the mesh processes.
    cpu: f64,
    rss_kib: u64,
}

impl Sample {
    fn cpu_per_1000(&self) -> f64 {
        if self.per_sec > 0.0 {
            self.cpu * 1000.0 / self.per_sec
        } else {
            f64::NAN
        }
    }
}

pub fn run(bins: Bins, args: &MeshArgs) -> Result<()> {
    let args = Settings::from(args);
    let build = shunt_build(&bins, args.shunt_bin.as_deref())?;
    let ztunnel = crate::ztunnel::binary(args.ztunnel_bin.as_deref(), args.ztunnel_src.as_deref())?;
    let mut planes = args.planes.clone();
    if ztunnel.is_none() && planes.contains(&Plane::Ztunnel) {
        eprintln!(
            "xtask bench mesh: no ztunnel (no --ztunnel-bin, $ZTUNNEL_BIN, cached build, \
             --ztunnel-src or $ZTUNNEL_SRC): its row is left out"
        );
        planes.retain(|p| *p != Plane::Ztunnel);
    }
    let programs = Programs {
        nodeserve: bins
            .testapp
            .with_file_name("nodeserve")
            .canonicalize()
            .context("the nodeserve binary (built with the tests crate's bins)")?,
        envoy: super::node_mesh::envoy_for_sidecars(&crate::setup::envoy()?)?,
        bins: Bins {
            shunt: build.path.clone(),
            testapp: bins.testapp.clone(),
        },
        ztunnel,
    };
    let mut running = Vec::new();
    for &plane in &planes {
        eprintln!("  setting up {}", plane.name());
        let r = mesh_planes::start(&programs, plane)
            .with_context(|| format!("setting up {}", plane.name()))?;
        tune(&r)?;
        running.push(r);
    }
    let idle_rss: Vec<(Plane, u64)> = running
        .iter()
        .map(|r| Ok((r.plane, rss_of(r)?)))
        .collect::<Result<_>>()?;
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut refused = Vec::new();
    for round in 0..args.rounds {
        for point in args.points() {
            measure_point(
                &programs.bins,
                &running,
                &args,
                point,
                round,
                &mut samples,
                &mut refused,
            )?;
        }
    }
    let wakeups = if args.wakeups {
        wakeup_counts(&programs.bins, &running, &args)?
    } else {
        Vec::new()
    };
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    let mut text = report(
        &args, &build, &planes, &samples, &idle_rss, &wakeups, minutes,
    )?;
    for r in &refused {
        writeln!(text, "REFUSED {r}")?;
    }
    print!("{text}");
    let mut json = json_report(&args, &build, &planes, &samples, &idle_rss, &wakeups);
    json["refused"] = json!(refused);
    save("mesh", &text, &json)?;
    ensure!(
        refused.is_empty(),
        "{} run(s) refused for errors (listed above); their numbers are left out",
        refused.len()
    );
    Ok(())
}

/// The settings after `--quick`.
struct Settings {
    planes: Vec<Plane>,
    protocols: Vec<Proto>,
    connections: Vec<usize>,
    modes: Vec<ConnMode>,
    rates: Vec<f64>,
    fraction: f64,
    duration_ms: u64,
    max_duration_ms: u64,
    rounds: usize,
    wakeups: bool,
    shunt_bin: Option<PathBuf>,
    ztunnel_bin: Option<PathBuf>,
    ztunnel_src: Option<PathBuf>,
}

impl Settings {
    fn from(a: &MeshArgs) -> Settings {
        let mut planes = if a.planes.is_empty() {
            Plane::ALL.to_vec()
        } else {
            a.planes.clone()
        };
        if !planes.contains(&Plane::Direct) {
            planes.insert(0, Plane::Direct);
        }
        let mut s = Settings {
            planes,
            protocols: a.protocols.clone(),
            connections: a.connections.clone(),
            modes: a.modes.clone(),
            rates: a.rates.clone(),
            fraction: a.fraction,
            duration_ms: a.duration_ms,
            max_duration_ms: a.max_duration_ms,
            rounds: a.rounds.max(1),
            wakeups: a.wakeups,
            shunt_bin: a.shunt_bin.clone(),
            ztunnel_bin: a.ztunnel_bin.clone(),
            ztunnel_src: a.ztunnel_src.clone(),
        };
        if a.quick {
            s.connections = vec![16];
            s.modes = vec![ConnMode::Keepalive];
            s.duration_ms = 2000;
            s.max_duration_ms = 1500;
        }
        s
    }

    fn points(&self) -> Vec<Point> {
        let mut points = Vec::new();
        for &proto in &self.protocols {
            for &mode in &self.modes {
                for &connections in &self.connections {
                    points.push(Point {
                        proto,
                        mode,
                        connections,
                    });
                }
            }
        }
        points
    }

    fn loads(&self) -> Vec<Load> {
        let mut loads = vec![Load::Max];
        loads.extend(self.rates.iter().map(|&r| Load::Rate(r)));
        if self.fraction > 0.0 {
            loads.push(Load::OfMax(self.fraction));
        }
        loads
    }
}

/// Every plane at every load of `point`, the planes' order reversed at every other load
/// so no plane always runs first.
fn measure_point(
    bins: &Bins,
    running: &[Running],
    args: &Settings,
    point: Point,
    round: usize,
    samples: &mut Vec<Sample>,
    refused: &mut Vec<String>,
) -> Result<()> {
    for (turn, load) in (round..).zip(args.loads()) {
        let mut order: Vec<&Running> = running.iter().collect();
        if turn % 2 == 1 {
            order.reverse();
        }
        for r in order {
            let rate = match load {
                Load::Max => 0.0,
                Load::Rate(rate) => rate,
                Load::OfMax(f) => {
                    let max = samples
                        .iter()
                        .rev()
                        .find(|s| s.plane == r.plane && s.point == point && s.load == Load::Max)
                        .map(|s| s.per_sec);
                    match max {
                        Some(max) => (max * f).floor(),
                        // Its maximum-rate run was refused: there is no rate to take a fraction of.
                        None => continue,
                    }
                }
            };
            let duration = if load == Load::Max {
                args.max_duration_ms
            } else {
                args.duration_ms
            };
            let what = format!("{} at {} {}", r.plane.name(), point.label(), load.label());
            let s = match one_run(bins, r, point, load, rate, duration) {
                Ok(s) => s,
                Err(e) if e.downcast_ref::<Refused>().is_some() => {
                    eprintln!("  {what}: {e:#}");
                    refused.push(format!("{what}: {e:#}"));
                    continue;
                }
                Err(e) => return Err(e.context(what)),
            };
            eprintln!(
                "  {:<15} {:<16} {:>9} {:>9.0}/s  p50 {:>6.0}  p99 {:>7.0}  p99.9 {:>7.0} us  {:.3} vCPU/1000",
                r.plane.name(),
                point.label(),
                load.label(),
                s.per_sec,
                s.p50,
                s.p99,
                s.p999,
                s.cpu_per_1000()
            );
            samples.push(s);
        }
    }
    Ok(())
}

/// One `bench-rate` run from the client pod's app, with the mesh's CPU time around it.
fn one_run(
    bins: &Bins,
    r: &Running,
    point: Point,
    load: Load,
    rate: f64,
    duration_ms: u64,
) -> Result<Sample> {
    let target = r.target(point.proto.port()).to_string();
    let (connections, rate_arg, duration) = (
        point.connections.to_string(),
        rate.to_string(),
        duration_ms.to_string(),
    );
    let new = if point.mode == ConnMode::New {
        "yes"
    } else {
        "no"
    };
    let cpu_before = mesh_ticks(r)?;
    let wall = Instant::now();
    let report = app_testapp(
        bins,
        &r.client,
        &[
            "bench-rate",
            &target,
            "--proto",
            point.proto.name(),
            "--rate",
            &rate_arg,
            "--connections",
            &connections,
            "--new-connection",
            new,
            "--duration-ms",
            &duration,
            "--payload",
            "1024",
        ],
        duration_ms,
    )?;
    let seconds = wall.elapsed().as_secs_f64();
    let ticks = mesh_ticks(r)? - cpu_before;
    refuse_errors(&report)?;
    let num = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
    Ok(Sample {
        plane: r.plane,
        point,
        load,
        rate,
        per_sec: num("per_sec"),
        p50: num("p50_us"),
        p90: num("p90_us"),
        p99: num("p99_us"),
        p999: num("p999_us"),
        cpu: ticks as f64 * TICK_US / 1e6 / seconds,
        rss_kib: rss_of(r)?,
    })
}

/// A run whose numbers are not the plane's: it had errors or completed nothing.
#[derive(Debug, thiserror::Error)]
#[error("refused: {0}")]
struct Refused(String);

/// A run with errors, or one that measured nothing, is refused: its numbers are left
/// out, the bench goes on and fails at the end naming it.
fn refuse_errors(report: &Value) -> Result<(), Refused> {
    let errors = report["errors"].as_u64().unwrap_or(u64::MAX);
    if errors > 0 {
        return Err(Refused(format!(
            "{errors} errors (first: {})",
            report["first_error"]
        )));
    }
    if report["requests"].as_u64().unwrap_or(0) == 0 {
        return Err(Refused(format!("no request completed: {report}")));
    }
    Ok(())
}

fn mesh_ticks(r: &Running) -> Result<u64> {
    r.mesh_pids().iter().map(|&pid| proxy_cpu_ticks(pid)).sum()
}

fn rss_of(r: &Running) -> Result<u64> {
    r.mesh_pids().iter().map(|&pid| Ok(rss(pid)?.0)).sum()
}

/// Connection-per-request runs open tens of thousands of connections: the client pod
/// reuses TIME_WAIT ports and has the whole port range, as a load generator's host.
fn tune(r: &Running) -> Result<()> {
    for pod in [&r.client, &r.server] {
        crate::pods::run(pod.command("sysctl").args([
            "-qw",
            "net.ipv4.tcp_tw_reuse=1",
            "net.ipv4.ip_local_port_range=1024 65000",
        ]))?;
    }
    Ok(())
}

/// Which shunt the sidecars run, as the report names it.
struct Build {
    path: PathBuf,
    /// `release` (plain), or what `<binary>.build.json` says (`cargo xtask dist`).
    kind: String,
    bytes: u64,
}

fn shunt_build(bins: &Bins, explicit: Option<&std::path::Path>) -> Result<Build> {
    let path = explicit.map_or_else(|| bins.shunt.clone(), std::path::Path::to_owned);
    let bytes = std::fs::metadata(&path)
        .with_context(|| format!("the shunt binary {}", path.display()))?
        .len();
    let stamp = PathBuf::from(format!("{}.build.json", path.display()));
    let kind = match std::fs::read_to_string(&stamp) {
        Ok(text) => {
            let v: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not JSON", stamp.display()))?;
            v["build"].as_str().unwrap_or("unknown").to_owned()
        }
        Err(_)
            if explicit.is_none()
                && bins
                    .shunt
                    .starts_with(crate::pods::target_dir().join("debug")) =>
        {
            "debug (numbers mean little)".into()
        }
        Err(_) if explicit.is_none() => "release (plain, not profile-guided)".into(),
        Err(_) => "given by --shunt-bin (no build.json beside it)".into(),
    };
    Ok(Build { path, kind, bytes })
}

/// Wake-ups and system calls of each plane's mesh processes per request.
struct Wakeups {
    plane: Plane,
    point: Point,
    values: [f64; 6],
}

const WAKEUP_COLUMNS: [&str; 6] = [
    "wake-ups",
    "sends",
    "receives",
    "epoll_waits",
    "syscalls",
    "switches",
];

/// Counted beside `bench http --wakeups`' events: every system call, and the context
/// switches of the mesh's threads.
const MORE_EVENTS: [&str; 2] = ["raw_syscalls:sys_enter", "context-switches"];

/// An event's count from `perf stat -x,`'s lines.
fn perf_count(csv: &str, event: &str) -> Result<u64> {
    let line = csv
        .lines()
        .find(|l| l.split(',').nth(2) == Some(event))
        .with_context(|| format!("perf stat printed no line for {event}"))?;
    let count = line.split(',').next().unwrap_or_default();
    count
        .parse()
        .with_context(|| format!("perf stat could not count {event}: {count:?}"))
}

/// `perf stat` on each plane's mesh processes over a 1000/s run of HTTP and TCP
/// keep-alive over 16 connections.
fn wakeup_counts(bins: &Bins, running: &[Running], args: &Settings) -> Result<Vec<Wakeups>> {
    use super::http::wakeups::{Column, EVENTS, parse};
    let mut counts = Vec::new();
    for &proto in &args.protocols {
        let point = Point {
            proto,
            mode: ConnMode::Keepalive,
            connections: 16,
        };
        for r in running.iter().filter(|r| r.plane != Plane::Direct) {
            let out = std::env::temp_dir().join(format!(
                "shunt-mesh-perf-{}-{}.csv",
                std::process::id(),
                r.plane.name()
            ));
            let mut events: Vec<&str> = EVENTS.iter().map(|(e, _)| *e).collect();
            events.extend(MORE_EVENTS);
            let pids: Vec<String> = r.mesh_pids().iter().map(u32::to_string).collect();
            let mut perf = Command::new("perf")
                .args(["stat", "-x", ",", "-e", &events.join(","), "-o"])
                .arg(&out)
                .args(["-p", &pids.join(",")])
                .spawn()
                .context("starting perf stat")?;
            std::thread::sleep(Duration::from_millis(300));
            let result = one_run(bins, r, point, Load::Rate(1000.0), 1000.0, args.duration_ms);
            // SAFETY: kill(2) with a pid we spawned and have not yet waited for.
            unsafe { libc::kill(perf.id() as i32, libc::SIGINT) };
            let _ = perf.wait()?;
            let sample = result?;
            let text = std::fs::read_to_string(&out)
                .with_context(|| format!("perf stat's output {}", out.display()))?;
            let _ = std::fs::remove_file(&out);
            let totals = parse(&text)?;
            // perf counts the whole run, warm-up included: 1000/s for its duration.
            let requests = sample.rate * args.duration_ms as f64 / 1000.0;
            let per = |column: Column| {
                EVENTS
                    .iter()
                    .zip(&totals)
                    .filter(|((_, c), _)| *c == column)
                    .map(|(_, n)| *n as f64)
                    .sum::<f64>()
                    / requests
            };
            let values = [
                per(Column::Wakeups),
                per(Column::Sends),
                per(Column::Receives),
                per(Column::EpollWaits),
                perf_count(&text, MORE_EVENTS[0])? as f64 / requests,
                perf_count(&text, MORE_EVENTS[1])? as f64 / requests,
            ];
            eprintln!(
                "  wake-ups {:<15} {:<16} {:.2} wake-ups, {:.2} sends, {:.2} receives, {:.2} epoll_waits, {:.1} syscalls, {:.2} switches per request",
                r.plane.name(),
                point.label(),
                values[0],
                values[1],
                values[2],
                values[3],
                values[4],
                values[5]
            );
            counts.push(Wakeups {
                plane: r.plane,
                point,
                values,
            });
        }
    }
    Ok(counts)
}

/// The medians of `f` over the rounds of one plane, point and load.
fn med(samples: &[Sample], plane: Plane, point: Point, load: Load, f: fn(&Sample) -> f64) -> f64 {
    median(
        samples
            .iter()
            .filter(|s| s.plane == plane && s.point == point && s.load == load)
            .map(f),
    )
}

/// A column: its name and how to read it from a sample.
type Percentile = (&'static str, fn(&Sample) -> f64);

const PERCENTILES: [Percentile; 4] = [
    ("p50", |s| s.p50),
    ("p90", |s| s.p90),
    ("p99", |s| s.p99),
    ("p99.9", |s| s.p999),
];

/// The goals, each a ratio of two planes' numbers at 1000/s.
struct Goal {
    what: &'static str,
    plane: Plane,
    peer: Plane,
    metric: Metric,
    at_most: Option<f64>,
    at_least: Option<f64>,
}

#[derive(Clone, Copy)]
enum Metric {
    AddedP99,
    CpuPer1000,
    MaxRate,
}

const GOALS: [Goal; 6] = [
    Goal {
        what: "node L7 fast / ztunnel: added p99 <= 0.5x",
        plane: Plane::NodeL7,
        peer: Plane::Ztunnel,
        metric: Metric::AddedP99,
        at_most: Some(0.5),
        at_least: None,
    },
    Goal {
        what: "node L7 fast / ztunnel: CPU per 1000/s <= 1x",
        plane: Plane::NodeL7,
        peer: Plane::Ztunnel,
        metric: Metric::CpuPer1000,
        at_most: Some(1.0),
        at_least: None,
    },
    Goal {
        what: "shunt / Envoy sidecars: added p99 <= 0.3x",
        plane: Plane::Shunt,
        peer: Plane::Envoy,
        metric: Metric::AddedP99,
        at_most: Some(0.3),
        at_least: None,
    },
    Goal {
        what: "shunt / Envoy sidecars: CPU per 1000/s <= 0.3x",
        plane: Plane::Shunt,
        peer: Plane::Envoy,
        metric: Metric::CpuPer1000,
        at_most: Some(0.3),
        at_least: None,
    },
    Goal {
        what: "node L4 / ztunnel: maximum rate >= 1.5x",
        plane: Plane::NodeL4,
        peer: Plane::Ztunnel,
        metric: Metric::MaxRate,
        at_most: None,
        at_least: Some(1.5),
    },
    Goal {
        what: "node L4 / ztunnel: CPU per 1000/s <= 1x",
        plane: Plane::NodeL4,
        peer: Plane::Ztunnel,
        metric: Metric::CpuPer1000,
        at_most: Some(1.0),
        at_least: None,
    },
];

/// `a / b`, when both are above zero: an added latency at or below zero means direct's
/// own tail was the higher one in that run (noise), and a ratio of it means nothing.
fn goal_ratio(a: f64, b: f64) -> Option<f64> {
    (a > 0.0 && b > 0.0).then(|| a / b)
}

/// A goal's two values at `point` (the fixed rate `rate`).
fn goal_values(samples: &[Sample], g: &Goal, point: Point, rate: f64) -> (f64, f64) {
    let at = Load::Rate(rate);
    let value = |plane: Plane| match g.metric {
        Metric::AddedP99 => {
            med(samples, plane, point, at, |s| s.p99)
                - med(samples, Plane::Direct, point, at, |s| s.p99)
        }
        Metric::CpuPer1000 => med(samples, plane, point, at, Sample::cpu_per_1000),
        Metric::MaxRate => med(samples, plane, point, Load::Max, |s| s.per_sec),
    };
    (value(g.plane), value(g.peer))
}

fn report(
    args: &Settings,
    build: &Build,
    planes: &[Plane],
    samples: &[Sample],
    idle_rss: &[(Plane, u64)],
    wakeups: &[Wakeups],
    minutes: f64,
) -> Result<String> {
    let mut t = String::new();
    writeln!(
        t,
        "bench mesh: a client pod and a server pod on one node, 1 KB requests (HTTP/1.1 POST \
         echoed; TCP echo), fixed-rate load corrected for coordinated omission"
    )?;
    writeln!(
        t,
        "shunt: {} ({}, {:.1} MB); kernel {}, {} CPUs; {} round(s), {:.0} s per fixed-rate run, {:.1} minutes",
        build.kind,
        build.path.display(),
        build.bytes as f64 / 1e6,
        kernel(),
        cpus(),
        args.rounds,
        args.duration_ms as f64 / 1000.0,
        minutes
    )?;
    for p in planes {
        writeln!(t, "  {:<15} {}", p.name(), p.describe())?;
    }
    let rate = args.rates.first().copied().unwrap_or(1000.0);
    for point in args.points() {
        writeln!(
            t,
            "\n{} — at {rate:.0}/s: latency added over direct (us), mesh CPU per 1000/s, RSS; \
             maximum rate; at {:.0}% of each one's maximum",
            point.label(),
            args.fraction * 100.0
        )?;
        let pct = format!("{:.0}%", args.fraction * 100.0);
        writeln!(
            t,
            "{:<15}{:>8}{:>8}{:>8}{:>8}{:>10}{:>9}{:>10}{:>10}{:>10}",
            "",
            "+p50",
            "+p90",
            "+p99",
            "+p99.9",
            "vCPU/1k",
            "RSS MiB",
            "max/s",
            format!("p50@{pct}"),
            format!("p99@{pct}")
        )?;
        for &plane in planes {
            let at = Load::Rate(rate);
            write!(t, "{:<15}", plane.name())?;
            for (_, f) in PERCENTILES {
                let added =
                    med(samples, plane, point, at, f) - med(samples, Plane::Direct, point, at, f);
                write!(t, "{added:>8.0}")?;
            }
            let of_max = Load::OfMax(args.fraction);
            writeln!(
                t,
                "{:>10.3}{:>9.1}{:>10.0}{:>10.0}{:>10.0}",
                med(samples, plane, point, at, Sample::cpu_per_1000),
                med(samples, plane, point, at, |s| s.rss_kib as f64) / KIB_PER_MIB,
                med(samples, plane, point, Load::Max, |s| s.per_sec),
                med(samples, plane, point, of_max, |s| s.p50),
                med(samples, plane, point, of_max, |s| s.p99),
            )?;
        }
        write!(t, "direct absolute at {rate:.0}/s (us):")?;
        for (name, f) in PERCENTILES {
            write!(
                t,
                " {name} {:.0}",
                med(samples, Plane::Direct, point, Load::Rate(rate), f)
            )?;
        }
        writeln!(t)?;
    }
    writeln!(t, "\nidle RSS of the mesh processes (MiB):")?;
    for (plane, kib) in idle_rss.iter().filter(|(p, _)| *p != Plane::Direct) {
        writeln!(
            t,
            "  {:<15}{:>8.1}",
            plane.name(),
            *kib as f64 / KIB_PER_MIB
        )?;
    }
    writeln!(
        t,
        "\ngoals (issue 39), ratio plane/peer at {rate:.0}/s per point:"
    )?;
    for g in &GOALS {
        if !planes.contains(&g.plane) || !planes.contains(&g.peer) {
            writeln!(t, "  {:<48} (not run)", g.what)?;
            continue;
        }
        write!(t, "  {:<48}", g.what)?;
        for point in args.points() {
            let (a, b) = goal_values(samples, g, point, rate);
            let Some(ratio) = goal_ratio(a, b) else {
                write!(t, " {} -", point.label())?;
                continue;
            };
            let met = g.at_most.is_none_or(|m| ratio <= m) && g.at_least.is_none_or(|m| ratio >= m);
            write!(
                t,
                " {} {ratio:.2}x{}",
                point.label(),
                if met { "" } else { "!" }
            )?;
        }
        writeln!(t)?;
    }
    writeln!(
        t,
        "  (! : not met; - : an added latency at or below zero, direct's own tail was higher)"
    )?;
    if !wakeups.is_empty() {
        writeln!(
            t,
            "\nkernel work per request of the mesh processes at 1000/s, 16 keep-alive connections (perf stat):"
        )?;
        write!(t, "{:<15}{:<8}", "", "")?;
        for c in WAKEUP_COLUMNS {
            write!(t, "{c:>12}")?;
        }
        writeln!(t)?;
        for w in wakeups {
            write!(t, "{:<15}{:<8}", w.plane.name(), w.point.proto.name())?;
            for v in w.values {
                write!(t, "{v:>12.2}")?;
            }
            writeln!(t)?;
        }
    }
    Ok(t)
}

fn json_report(
    args: &Settings,
    build: &Build,
    planes: &[Plane],
    samples: &[Sample],
    idle_rss: &[(Plane, u64)],
    wakeups: &[Wakeups],
) -> Value {
    let runs: Vec<Value> = samples
        .iter()
        .map(|s| {
            json!({
                "plane": s.plane.name(), "protocol": s.point.proto.name(),
                "connections_mode": s.point.mode.name(), "connections": s.point.connections,
                "load": s.load.label(), "rate": s.rate, "per_sec": s.per_sec,
                "p50_us": s.p50, "p90_us": s.p90, "p99_us": s.p99, "p999_us": s.p999,
                "mesh_cpu_cores": s.cpu, "cpu_per_1000_rps": s.cpu_per_1000(),
                "rss_kib": s.rss_kib,
            })
        })
        .collect();
    let rate = args.rates.first().copied().unwrap_or(1000.0);
    let goals: Vec<Value> = GOALS
        .iter()
        .filter(|g| planes.contains(&g.plane) && planes.contains(&g.peer))
        .flat_map(|g| {
            args.points().into_iter().map(move |point| {
                let (a, b) = goal_values(samples, g, point, rate);
                json!({"goal": g.what, "point": point.label(), "plane": a, "peer": b, "ratio": goal_ratio(a, b)})
            })
        })
        .collect();
    json!({
        "bench": "mesh",
        "shunt_build": {"kind": build.kind, "path": build.path.display().to_string(), "bytes": build.bytes},
        "kernel": kernel(), "cpus": cpus(),
        "rounds": args.rounds, "duration_ms": args.duration_ms, "max_duration_ms": args.max_duration_ms,
        "planes": planes.iter().map(|p| json!({"name": p.name(), "what": p.describe()})).collect::<Vec<_>>(),
        "idle_rss_kib": idle_rss.iter().map(|(p, k)| json!({"plane": p.name(), "kib": k})).collect::<Vec<_>>(),
        "runs": runs,
        "goals": goals,
        "wakeups_per_request": wakeups.iter().map(|w| json!({
            "plane": w.plane.name(), "protocol": w.point.proto.name(),
            "wakeups": w.values[0], "sends": w.values[1], "receives": w.values[2], "epoll_waits": w.values[3],
            "syscalls": w.values[4], "context_switches": w.values[5],
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_with_errors_or_without_requests_is_refused() {
        assert!(refuse_errors(&json!({"requests": 10, "errors": 0})).is_ok());
        assert!(refuse_errors(&json!({"requests": 10, "errors": 1, "first_error": "x"})).is_err());
        assert!(refuse_errors(&json!({"requests": 0, "errors": 0})).is_err());
        assert!(refuse_errors(&json!({"requests": 10})).is_err());
    }

    #[test]
    fn added_latency_and_goals_come_from_the_medians_at_the_fixed_rate() {
        let point = Point {
            proto: Proto::Http,
            mode: ConnMode::Keepalive,
            connections: 16,
        };
        let sample = |plane, load, p99, per_sec, cpu| Sample {
            plane,
            point,
            load,
            rate: 1000.0,
            per_sec,
            p50: 0.0,
            p90: 0.0,
            p99,
            p999: 0.0,
            cpu,
            rss_kib: 0,
        };
        let at = Load::Rate(1000.0);
        let samples = vec![
            sample(Plane::Direct, at, 100.0, 1000.0, 0.0),
            sample(Plane::NodeL7, at, 140.0, 1000.0, 0.05),
            sample(Plane::NodeL7, at, 160.0, 1000.0, 0.07),
            sample(Plane::Ztunnel, at, 300.0, 1000.0, 0.06),
            sample(Plane::NodeL4, Load::Max, 0.0, 30000.0, 0.0),
            sample(Plane::Ztunnel, Load::Max, 0.0, 20000.0, 0.0),
        ];
        // Added p99: node (median 150) - direct 100 = 50; ztunnel 300 - 100 = 200.
        assert_eq!(
            goal_values(&samples, &GOALS[0], point, 1000.0),
            (50.0, 200.0)
        );
        // CPU per 1000/s: the median of 0.05 and 0.07, against 0.06.
        let (a, b) = goal_values(&samples, &GOALS[1], point, 1000.0);
        assert!((a - 0.06).abs() < 1e-9 && (b - 0.06).abs() < 1e-9);
        assert_eq!(
            goal_values(&samples, &GOALS[4], point, 1000.0),
            (30000.0, 20000.0)
        );
        // An added latency at or below zero (direct's tail was higher) gives no ratio.
        assert_eq!(goal_ratio(50.0, 200.0), Some(0.25));
        assert_eq!(goal_ratio(-50.0, 200.0), None);
        assert_eq!(goal_ratio(50.0, 0.0), None);
    }
}
