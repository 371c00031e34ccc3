//! `cargo xtask bench <which>`: benchmarks on a node of pods, with release builds.
//!
//! `bench capture` puts the three ways a client pod's connection can leave side by
//! side: `direct` (no capture, no proxy), `iptables` and `ebpf` (the client pod captured
//! with that backend, `shunt proxy` in it). Scenarios run in rounds, in alternating
//! order, and the medians are reported. `bench sockmap` (bench_sockmap.rs) puts the
//! proxy-to-proxy short-circuit side by side, `bench l4` (bench_l4.rs) shunt and Envoy,
//! `bench xds` (bench_xds.rs) shunt and Envoy taking a large config over ADS.

use std::{fmt::Write as _, net::SocketAddr, time::Duration};

use anyhow::{Context, Result, bail, ensure};
use clap::Subcommand;
use harness::{Node, Pod};
use serde::Serialize;
use serde_json::{Value, json};

use crate::pods::{
    APP_UID, Backend, Bins, Capture, access_log, call, start_app, start_proxy, target_dir,
};

#[derive(Subcommand)]
pub enum Which {
    /// direct vs iptables vs eBPF capture (with shunt proxy): connections/s, latency, CPU.
    Capture(CaptureArgs),
    /// Pod-to-pod through both proxies: iptables vs eBPF without and with the sockmap.
    Sockmap(crate::bench_sockmap::SockmapArgs),
    /// shunt vs Envoy on one static tcp_proxy bootstrap: throughput, connections/s,
    /// latency, RSS idle and with connections open.
    L4(crate::bench_l4::L4Args),
    /// shunt vs Envoy as xDS clients: a push of 10,000 EDS clusters and 1,000 listeners,
    /// then incremental EDS updates; send-to-ACK times and RSS.
    Xds(crate::bench_xds::XdsArgs),
}

#[derive(clap::Args)]
pub struct CaptureArgs {
    /// Length of each bench-connect and each bench-rr run.
    #[arg(long, default_value_t = 3000)]
    duration_ms: u64,
    /// Rounds of all three scenarios (the order alternates); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

pub fn run(which: Which) -> Result<()> {
    let bins = Bins::build(true)?;
    match which {
        Which::Capture(args) => capture(&bins, &args),
        Which::Sockmap(args) => crate::bench_sockmap::run(&bins, &args),
        Which::L4(args) => crate::bench_l4::run(bins, &args),
        Which::Xds(args) => crate::bench_xds::run(bins, &args),
    }
}

const PIN_ROOT: &str = "/sys/fs/bpf/shunt-bench";
const PORT: u16 = 8080;
const CONCURRENCY: &str = "2";
const PAYLOAD: &str = "64";
/// USER_HZ: /proc/stat counts in 1/100 s on every Linux architecture.
const TICK_US: f64 = 10_000.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scenario {
    Direct,
    Iptables,
    Ebpf,
}

const SCENARIOS: [Scenario; 3] = [Scenario::Direct, Scenario::Iptables, Scenario::Ebpf];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Direct => "direct",
            Scenario::Iptables => "iptables",
            Scenario::Ebpf => "ebpf",
        }
    }

    fn backend(self) -> Option<Backend> {
        match self {
            Scenario::Direct => None,
            Scenario::Iptables => Some(Backend::Iptables),
            Scenario::Ebpf => Some(Backend::Ebpf),
        }
    }
}

/// One scenario, once.
#[derive(Serialize)]
struct Run {
    round: usize,
    scenario: Scenario,
    /// testapp bench-connect's report, as printed.
    connect: Value,
    /// testapp bench-rr's report, as printed.
    rr: Value,
    /// Machine-wide CPU during bench-connect, in microseconds per connection.
    cpu_busy_us_per_conn: f64,
    cpu_sys_softirq_us_per_conn: f64,
    /// Lines in the client pod's proxy access log (0: no proxy).
    proxy_log_lines: usize,
    /// TIME_WAIT sockets in the client pod when bench-connect started (earlier runs').
    time_wait_before: u64,
}

/// A row of the table: how to read it from a run.
struct Metric {
    key: &'static str,
    label: &'static str,
    get: fn(&Run) -> f64,
}

const METRICS: &[Metric] = &[
    Metric {
        key: "conn_per_sec",
        label: "new connections/s (connect + 64 B echo)",
        get: |r| num(&r.connect, "conn_per_sec"),
    },
    Metric {
        key: "connect_only_p50_us",
        label: "  connect() alone p50 (us)",
        get: |r| num(&r.connect, "connect_p50_us"),
    },
    Metric {
        key: "connect_only_p99_us",
        label: "  connect() alone p99 (us)",
        get: |r| num(&r.connect, "connect_p99_us"),
    },
    Metric {
        key: "connect_p50_us",
        label: "  connect + echo p50 (us)",
        get: |r| num(&r.connect, "p50_us"),
    },
    Metric {
        key: "connect_p99_us",
        label: "  connect + echo p99 (us)",
        get: |r| num(&r.connect, "p99_us"),
    },
    Metric {
        key: "cpu_busy_us_per_conn",
        label: "  CPU busy per connection (us)",
        get: |r| r.cpu_busy_us_per_conn,
    },
    Metric {
        key: "cpu_sys_softirq_us_per_conn",
        label: "  CPU system+softirq per connection (us)",
        get: |r| r.cpu_sys_softirq_us_per_conn,
    },
    Metric {
        key: "rr_per_sec",
        label: "64 B round trips/s (one connection)",
        get: |r| num(&r.rr, "rtt_per_sec"),
    },
    Metric {
        key: "rr_p50_us",
        label: "  round trip p50 (us)",
        get: |r| num(&r.rr, "p50_us"),
    },
    Metric {
        key: "rr_p99_us",
        label: "  round trip p99 (us)",
        get: |r| num(&r.rr, "p99_us"),
    },
    Metric {
        key: "proxy_log_lines",
        label: "proxy access-log lines per run",
        get: |r| r.proxy_log_lines as f64,
    },
];

fn num(report: &Value, key: &str) -> f64 {
    report[key].as_f64().unwrap_or(f64::NAN)
}

fn capture(bins: &Bins, args: &CaptureArgs) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _app = start_app(bins, &server, PORT)?;
    let target = SocketAddr::new(server.ipv4().into(), PORT);
    let busy = background_busy()?;
    println!(
        "bench capture: client {} -> server {target}, {} ms per run, rounds: {}, concurrency {CONCURRENCY}, payload {PAYLOAD} B; machine busy {busy:.0}% before starting",
        client.ipv4(),
        args.duration_ms,
        args.rounds
    );
    if busy > 10.0 {
        println!("  warning: something else is using the CPU; numbers will be noisy");
    }

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        let mut order = SCENARIOS;
        if round % 2 == 0 {
            order.reverse();
        }
        for scenario in order {
            let run = measure(bins, &client, target, scenario, round, args.duration_ms)
                .with_context(|| format!("round {round}, scenario {}", scenario.name()))?;
            println!(
                "  round {round} {:<8} {:>7.0} conn/s  p50 {:>5} us  p99 {:>5} us  cpu {:>5.1} us/conn  | rr p50 {:>4} us  p99 {:>5} us  | proxy log {} lines | TIME_WAIT before {}",
                scenario.name(),
                num(&run.connect, "conn_per_sec"),
                run.connect["p50_us"],
                run.connect["p99_us"],
                run.cpu_busy_us_per_conn,
                run.rr["p50_us"],
                run.rr["p99_us"],
                run.proxy_log_lines,
                run.time_wait_before
            );
            runs.push(run);
        }
    }
    drop(node);

    let report = Report::new(args, busy, runs);
    let text = report.table();
    print!("\n{text}");
    save("capture", &text, &report.json())
}

/// Writes a bench's table and JSON report to `target/bench/NAME.txt` and `NAME.json`.
pub(crate) fn save(name: &str, text: &str, json: &Value) -> Result<()> {
    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let table = dir.join(format!("{name}.txt"));
    std::fs::write(&table, text)?;
    std::fs::write(
        dir.join(format!("{name}.json")),
        serde_json::to_string_pretty(json)? + "\n",
    )?;
    println!("saved {} and {name}.json", table.display());
    Ok(())
}

/// Set up the scenario in the client pod, check which path traffic takes, measure,
/// check the proxy saw it, tear down.
fn measure(
    bins: &Bins,
    client: &Pod,
    target: SocketAddr,
    scenario: Scenario,
    round: usize,
    duration_ms: u64,
) -> Result<Run> {
    let mut capture = scenario
        .backend()
        .map(|backend| Capture::new(bins, backend, PIN_ROOT));
    if let Some(capture) = &mut capture {
        capture.install(client)?;
    }
    let proxy = match capture {
        Some(_) => Some(start_proxy(bins, client)?),
        None => None,
    };

    // The path: without a proxy the server sees the client's own socket.
    let c = call(bins, client, APP_UID, target, 64)?;
    let proxied = c.server_peer != c.client_local;
    if proxied != proxy.is_some() {
        bail!(
            "{}: the client's socket is {} and the server saw {}: traffic {} the proxy",
            scenario.name(),
            c.client_local,
            c.server_peer,
            if proxied {
                "went through something, but there is no"
            } else {
                "did NOT go through"
            }
        );
    }

    let duration = duration_ms.to_string();
    let time_wait_before = time_wait(client)?;
    let before = CpuTimes::now()?;
    let connect = testapp(
        bins,
        client,
        &[
            "bench-connect",
            &target.to_string(),
            "--duration-ms",
            &duration,
            "--concurrency",
            CONCURRENCY,
            "--payload",
            PAYLOAD,
        ],
        duration_ms,
    )?;
    let cpu = CpuTimes::now()?.since(&before);
    let rr = testapp(
        bins,
        client,
        &[
            "bench-rr",
            &target.to_string(),
            "--duration-ms",
            &duration,
            "--payload",
            PAYLOAD,
        ],
        duration_ms,
    )?;
    let conns = connect["connections"].as_u64().unwrap_or(0);
    ensure!(conns > 0, "bench-connect made no connection: {connect}");
    ensure!(
        rr["round_trips"].as_u64().unwrap_or(0) > 0,
        "bench-rr made no round trip: {rr}"
    );

    let proxy_log_lines = proxy.as_ref().map_or(0, |p| access_log(p).len());
    if let Some(proxy) = &proxy {
        ensure!(
            proxy_log_lines > 0,
            "{}: the proxy in the client pod logged no connection: traffic did NOT go through it\n{}",
            scenario.name(),
            proxy.stderr_text()
        );
    }
    drop(proxy);
    if let Some(mut capture) = capture {
        capture.cleanup()?;
    }
    Ok(Run {
        round,
        scenario,
        cpu_busy_us_per_conn: cpu.busy as f64 * TICK_US / conns as f64,
        cpu_sys_softirq_us_per_conn: cpu.sys_softirq as f64 * TICK_US / conns as f64,
        connect,
        rr,
        proxy_log_lines,
        time_wait_before,
    })
}

/// TIME_WAIT sockets in the pod's network namespace (the `tw` of its sockstat).
pub(crate) fn time_wait(pod: &Pod) -> Result<u64> {
    let stat = pod.run_in_netns(|| std::fs::read_to_string("/proc/thread-self/net/sockstat"))??;
    stat.lines()
        .find_map(|l| l.strip_prefix("TCP: "))
        .and_then(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.windows(2)
                .find(|w| w[0] == "tw")
                .and_then(|w| w[1].parse().ok())
        })
        .with_context(|| format!("no TCP tw count in sockstat: {stat}"))
}

/// A testapp bench command as the app (uid/gid 1000) in `pod`; its JSON report.
pub(crate) fn testapp(bins: &Bins, pod: &Pod, args: &[&str], duration_ms: u64) -> Result<Value> {
    let out = crate::pods::run(
        pod.command(&bins.testapp)
            .uid(APP_UID)
            .gid(APP_UID)
            .args(args)
            .timeout(Duration::from_millis(duration_ms) + Duration::from_secs(60)),
    )?;
    let report: Value = serde_json::from_str(out.lines().next().unwrap_or_default())
        .with_context(|| format!("testapp {} printed {out:?}", args[0]))?;
    if report["errors"].as_u64().unwrap_or(0) > 0 {
        eprintln!(
            "  warning: testapp {}: {} errors, first: {}",
            args[0], report["errors"], report["first_error"]
        );
    }
    Ok(report)
}

/// The aggregate `cpu` line of /proc/stat, in ticks.
struct CpuTimes {
    busy: u64,
    sys_softirq: u64,
}

impl CpuTimes {
    fn now() -> Result<CpuTimes> {
        let stat = std::fs::read_to_string("/proc/stat")?;
        let line = stat
            .lines()
            .find(|l| l.starts_with("cpu "))
            .context("no cpu line in /proc/stat")?;
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        ensure!(f.len() == 8, "short cpu line in /proc/stat: {line}");
        Ok(CpuTimes {
            busy: f[0] + f[1] + f[2] + f[5] + f[6] + f[7],
            sys_softirq: f[2] + f[6],
        })
    }

    fn since(&self, before: &CpuTimes) -> CpuTimes {
        CpuTimes {
            busy: self.busy - before.busy,
            sys_softirq: self.sys_softirq - before.sys_softirq,
        }
    }
}

/// How busy the machine is with nothing of ours running, in percent (over one second).
pub(crate) fn background_busy() -> Result<f64> {
    let before = CpuTimes::now()?;
    std::thread::sleep(Duration::from_secs(1));
    let busy = CpuTimes::now()?.since(&before).busy as f64;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    Ok(busy * TICK_US / 1e6 / cpus * 100.0)
}

struct Report {
    duration_ms: u64,
    rounds: usize,
    background_busy_pct: f64,
    runs: Vec<Run>,
}

const RATIOS: [(Scenario, Scenario); 3] = [
    (Scenario::Iptables, Scenario::Direct),
    (Scenario::Ebpf, Scenario::Direct),
    (Scenario::Ebpf, Scenario::Iptables),
];

impl Report {
    fn new(args: &CaptureArgs, background_busy_pct: f64, runs: Vec<Run>) -> Report {
        Report {
            duration_ms: args.duration_ms,
            rounds: args.rounds,
            background_busy_pct,
            runs,
        }
    }

    fn median(&self, scenario: Scenario, metric: &Metric) -> f64 {
        let mut v: Vec<f64> = self
            .runs
            .iter()
            .filter(|r| r.scenario == scenario)
            .map(metric.get)
            .collect();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "bench capture: medians over rounds: {}, {} ms per run, concurrency {CONCURRENCY}, payload {PAYLOAD} B; kernel {}, {} CPUs",
            self.rounds,
            self.duration_ms,
            kernel(),
            cpus()
        );
        let _ = writeln!(
            t,
            "{:<42}{:>10}{:>10}{:>10}{:>17}{:>13}{:>15}",
            "", "direct", "iptables", "ebpf", "iptables/direct", "ebpf/direct", "ebpf/iptables"
        );
        for m in METRICS {
            let _ = write!(t, "{:<42}", m.label);
            for s in SCENARIOS {
                let _ = write!(t, "{:>10}", fmt_value(self.median(s, m)));
            }
            for ((a, b), width) in RATIOS.iter().zip([17, 13, 15]) {
                let ratio = self.median(*a, m) / self.median(*b, m);
                let cell = if ratio.is_finite() {
                    format!("{ratio:.2}x")
                } else {
                    "-".into()
                };
                let _ = write!(t, "{cell:>width$}");
            }
            t.push('\n');
        }
        t
    }

    fn json(&self) -> Value {
        let per = |s: Scenario| -> Value {
            METRICS
                .iter()
                .map(|m| (m.key.to_owned(), json!(self.median(s, m))))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let ratio = |a: Scenario, b: Scenario| -> Value {
            METRICS
                .iter()
                .map(|m| {
                    (
                        m.key.to_owned(),
                        json!(self.median(a, m) / self.median(b, m)),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        json!({
            "bench": "capture",
            "config": {
                "duration_ms": self.duration_ms,
                "rounds": self.rounds,
                "concurrency": CONCURRENCY.parse::<u32>().unwrap_or(0),
                "payload_bytes": PAYLOAD.parse::<u32>().unwrap_or(0),
                "kernel": kernel(),
                "cpus": cpus(),
                "background_busy_pct": self.background_busy_pct,
            },
            "median": SCENARIOS.iter().map(|s| (s.name().to_owned(), per(*s))).collect::<serde_json::Map<_, _>>(),
            "ratios": RATIOS.iter().map(|(a, b)| (format!("{}/{}", a.name(), b.name()), ratio(*a, *b))).collect::<serde_json::Map<_, _>>(),
            "runs": self.runs,
        })
    }
}

/// The median of the values that are numbers (NaN when none is).
pub(crate) fn median(values: impl IntoIterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.into_iter().filter(|v| !v.is_nan()).collect();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

pub(crate) fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

pub(crate) fn kernel() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

pub(crate) fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
