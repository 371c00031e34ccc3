//! `bench capture` puts the ways a client pod's connection can leave side by side:
//! `direct` (no capture, no proxy), `iptables` and `ebpf` (the client pod captured with
//! that backend, `shunt proxy` in it), `ebpf+events` (eBPF with decision events on
//! node-wide and `shunt inspect --follow` reading them), and with `--baseline SHUNT`
//! `ebpf-base`: the client pod captured by another build's `shunt capture` (its eBPF
//! programs; the proxy stays this build's), to compare a change's programs with the
//! programs without it in one run. Scenarios run in rounds, in alternating order, and
//! the medians are reported.

use std::{
    fmt::Write as _,
    io::Read as _,
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use anyhow::{Context, Result, bail, ensure};
use harness::{Node, Pod};
use serde::Serialize;
use serde_json::{Value, json};

use super::measure::{
    CpuTimes, TICK_US, app_testapp, background_busy, cpus, fmt_value, kernel, median, num, save,
    time_wait,
};
use crate::pods::{APP_UID, Backend, Bins, Capture, access_log, call, start_app, start_proxy};

#[derive(clap::Args)]
pub struct CaptureArgs {
    /// Length of each bench-connect and each bench-rr run.
    #[arg(long, default_value_t = 3000)]
    duration_ms: u64,
    /// Rounds of all scenarios (the order alternates); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Another build's `shunt` (say, main's: `git worktree add ../base main`, then
    /// `cargo build --release -p shunt` there): its `shunt capture` is the `ebpf-base`
    /// scenario.
    #[arg(long, value_name = "SHUNT")]
    baseline: Option<PathBuf>,
}

const PIN_ROOT: &str = "/sys/fs/bpf/shunt-bench";
const PORT: u16 = 8080;
const CONCURRENCY: &str = "2";
const PAYLOAD: &str = "64";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Scenario {
    Direct,
    Iptables,
    Ebpf,
    /// eBPF with decision events on node-wide, read by `shunt inspect --follow`.
    #[serde(rename = "ebpf+events")]
    EbpfEvents,
    /// eBPF as `--baseline`'s `shunt capture` installs it.
    EbpfBase,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Direct => "direct",
            Scenario::Iptables => "iptables",
            Scenario::Ebpf => "ebpf",
            Scenario::EbpfEvents => "ebpf+events",
            Scenario::EbpfBase => "ebpf-base",
        }
    }

    fn backend(self) -> Option<Backend> {
        match self {
            Scenario::Direct => None,
            Scenario::Iptables => Some(Backend::Iptables),
            Scenario::Ebpf | Scenario::EbpfEvents | Scenario::EbpfBase => Some(Backend::Ebpf),
        }
    }
}

/// The scenarios of this run, in the order of odd rounds.
fn scenarios(args: &CaptureArgs) -> Vec<Scenario> {
    let mut all = vec![
        Scenario::Direct,
        Scenario::Iptables,
        Scenario::Ebpf,
        Scenario::EbpfEvents,
    ];
    if args.baseline.is_some() {
        all.push(Scenario::EbpfBase);
    }
    all
}

/// The ratios of the table: (numerator, denominator), as present in this run.
fn ratios(scenarios: &[Scenario]) -> Vec<(Scenario, Scenario)> {
    [
        (Scenario::Iptables, Scenario::Direct),
        (Scenario::Ebpf, Scenario::Direct),
        (Scenario::Ebpf, Scenario::Iptables),
        (Scenario::Ebpf, Scenario::EbpfBase),
        (Scenario::EbpfEvents, Scenario::Ebpf),
    ]
    .into_iter()
    .filter(|(a, b)| scenarios.contains(a) && scenarios.contains(b))
    .collect()
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
    /// Decision events the follower read during bench-connect, and those the ring
    /// dropped (`ebpf+events` only).
    events_read: u64,
    events_dropped: u64,
    /// The kernel's accounting (BPF_ENABLE_STATS) of the client pod's programs during
    /// bench-connect: nanoseconds run and runs (eBPF scenarios only).
    prog_run_ns: u64,
    prog_runs: u64,
    /// The follower's own CPU (user + system) during bench-connect, microseconds.
    follower_cpu_us: f64,
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
    Metric {
        key: "prog_ns_per_conn",
        label: "  in shunt's programs per connection (ns)",
        get: |r| r.prog_run_ns as f64 / num(&r.connect, "connections"),
    },
    Metric {
        key: "prog_runs_per_conn",
        label: "  program runs per connection",
        get: |r| r.prog_runs as f64 / num(&r.connect, "connections"),
    },
    Metric {
        key: "follower_cpu_us_per_conn",
        label: "  the follower's CPU per connection (us)",
        get: |r| r.follower_cpu_us / num(&r.connect, "connections"),
    },
    Metric {
        key: "events_per_conn",
        label: "decision events read per connection",
        get: |r| r.events_read as f64 / num(&r.connect, "connections"),
    },
    Metric {
        key: "events_dropped",
        label: "decision events dropped per run",
        get: |r| r.events_dropped as f64,
    },
];

pub fn run(bins: &Bins, args: &CaptureArgs) -> Result<()> {
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

    let baseline = args.baseline.as_ref().map(|shunt| Bins {
        shunt: shunt.clone(),
        testapp: bins.testapp.clone(),
    });
    if let Some(b) = &baseline {
        ensure!(
            b.shunt.is_file(),
            "--baseline {}: no such file",
            b.shunt.display()
        );
    }
    let scenarios = scenarios(args);
    // Per-program run time in the kernel, for the eBPF scenarios' rows.
    let _stats = BpfStats::enable()?;
    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        let mut order = scenarios.clone();
        if round % 2 == 0 {
            order.reverse();
        }
        for scenario in order {
            // The baseline's capture; every proxy is this build's.
            let capture_bins = match (scenario, &baseline) {
                (Scenario::EbpfBase, Some(b)) => b,
                _ => bins,
            };
            let run = measure(
                (bins, capture_bins),
                &client,
                target,
                scenario,
                round,
                args.duration_ms,
            )
            .with_context(|| format!("round {round}, scenario {}", scenario.name()))?;
            println!(
                "  round {round} {:<11} {:>7.0} conn/s  p50 {:>5} us  p99 {:>5} us  cpu {:>5.1} us/conn  | rr p50 {:>4} us  p99 {:>5} us  | proxy log {} lines | TIME_WAIT before {}",
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

    let report = Report::new(args, busy, scenarios, runs);
    let text = report.table();
    print!("\n{text}");
    save("capture", &text, &report.json())
}

/// Set up the scenario in the client pod, check which path traffic takes, measure,
/// check the proxy saw it, tear down. `bins.1` installs capture.
fn measure(
    (bins, capture_bins): (&Bins, &Bins),
    client: &Pod,
    target: SocketAddr,
    scenario: Scenario,
    round: usize,
    duration_ms: u64,
) -> Result<Run> {
    let mut capture = scenario
        .backend()
        .map(|backend| Capture::new(capture_bins, backend, PIN_ROOT));
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
    let follower = match scenario {
        Scenario::EbpfEvents => Some(Follower::start(bins, PIN_ROOT)?),
        _ => None,
    };
    let programs = match scenario.backend() {
        Some(Backend::Ebpf) => pod_programs(client)?,
        _ => Vec::new(),
    };
    let progs_before = prog_stats(&programs)?;
    let before = CpuTimes::now()?;
    let connect = app_testapp(
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
    let progs_after = prog_stats(&programs)?;
    let (events_read, events_dropped, follower_cpu_us) = match follower {
        Some(f) => f.stop()?,
        None => (0, 0, 0.0),
    };
    let rr = app_testapp(
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
        events_read,
        events_dropped,
        prog_run_ns: progs_after.0 - progs_before.0,
        prog_runs: progs_after.1 - progs_before.1,
        follower_cpu_us,
    })
}

/// The kernel keeps each BPF program's run time and count while this is held
/// (`BPF_ENABLE_STATS`, as `sysctl kernel.bpf_stats_enabled=1` but ending with us).
struct BpfStats(#[allow(dead_code)] std::os::fd::OwnedFd);

impl BpfStats {
    fn enable() -> Result<BpfStats> {
        use std::os::fd::FromRawFd;
        const BPF_ENABLE_STATS: libc::c_long = 32;
        const BPF_STATS_RUN_TIME: u32 = 0;
        let mut attr = [BPF_STATS_RUN_TIME, 0u32];
        // SAFETY: bpf(2) reads a `struct { __u32 type; }` from `attr`, which outlives the
        // call; it returns a new descriptor or -1.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_ENABLE_STATS,
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr),
            )
        };
        ensure!(
            fd >= 0,
            "BPF_ENABLE_STATS: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: a descriptor the kernel just handed us, owned from here on.
        Ok(BpfStats(unsafe {
            std::os::fd::OwnedFd::from_raw_fd(fd as i32)
        }))
    }
}

/// The ids of the programs behind the links `shunt capture` pinned for `pod`.
fn pod_programs(pod: &Pod) -> Result<Vec<u64>> {
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(pod.netns_path())?.ino();
    let dir = PathBuf::from(PIN_ROOT)
        .join("pods")
        .join(format!("pod_{ino}"));
    let mut ids = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.file_name().is_some_and(|n| n == "AYA_LOGS") {
            continue;
        }
        let link = bpftool(&["link", "show", "pinned", &path.display().to_string()])?;
        ids.push(
            link["prog_id"]
                .as_u64()
                .with_context(|| format!("no prog_id for {}: {link}", path.display()))?,
        );
    }
    Ok(ids)
}

/// (run time in ns, runs) summed over `programs`.
fn prog_stats(programs: &[u64]) -> Result<(u64, u64)> {
    let mut sum = (0, 0);
    for id in programs {
        let p = bpftool(&["prog", "show", "id", &id.to_string()])?;
        sum.0 += p["run_time_ns"].as_u64().unwrap_or(0);
        sum.1 += p["run_cnt"].as_u64().unwrap_or(0);
    }
    Ok(sum)
}

fn bpftool(args: &[&str]) -> Result<Value> {
    let out = Command::new("bpftool")
        .arg("-j")
        .args(args)
        .output()
        .context("running bpftool")?;
    ensure!(
        out.status.success(),
        "bpftool {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// `shunt inspect --follow` (events on node-wide while it runs), its output discarded
/// but counted: the reader an operator would run, whose CPU the run pays too.
struct Follower {
    child: Option<Child>,
}

impl Follower {
    fn start(bins: &Bins, root: &str) -> Result<Follower> {
        let mut child = Command::new(&bins.shunt)
            .args(["inspect", "--follow", "--json", "--bpffs", root])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting shunt inspect --follow")?;
        // Its first line says the switch is on.
        let mut stderr = child.stderr.take().context("follower's stderr")?;
        let mut said = Vec::new();
        let mut byte = [0u8; 1];
        while !said.ends_with(b"\n") && stderr.read(&mut byte)? == 1 {
            said.push(byte[0]);
        }
        let said = String::from_utf8_lossy(&said);
        ensure!(
            said.contains("switched on node-wide"),
            "shunt inspect --follow: {said}"
        );
        child.stderr = Some(stderr);
        Ok(Follower { child: Some(child) })
    }

    /// Stops it (SIGINT) and returns (events read, events dropped) from its last line,
    /// and the CPU it had used (microseconds).
    fn stop(mut self) -> Result<(u64, u64, f64)> {
        let child = self.child.take().context("the follower was stopped")?;
        let cpu_us = process_cpu_ticks(child.id())? as f64 * TICK_US;
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        let out = child.wait_with_output()?;
        let said = String::from_utf8_lossy(&out.stderr);
        // "shunt inspect: N events shown; M dropped while following"
        let words: Vec<&str> = said.split_whitespace().collect();
        let before = |w: &str| {
            words
                .windows(2)
                .find(|p| p[1].starts_with(w))
                .and_then(|p| p[0].parse::<u64>().ok())
        };
        match (before("events"), before("dropped")) {
            (Some(read), Some(dropped)) => Ok((read, dropped, cpu_us)),
            _ => bail!("shunt inspect --follow ended with {said:?}"),
        }
    }
}

/// utime + stime of a process, in clock ticks (`/proc/PID/stat` fields 14 and 15).
fn process_cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces: count from the ')' that ends it.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    // After ')', field 3 is at index 0: utime (14) at 11, stime (15) at 12.
    match (tick(11), tick(12)) {
        (Some(u), Some(s)) => Ok(u + s),
        _ => bail!("unreadable /proc/{pid}/stat: {stat}"),
    }
}

impl Drop for Follower {
    /// A bench that failed midway still switches the events back off (the follower
    /// does that when interrupted).
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            let _ = child.wait();
        }
    }
}

struct Report {
    duration_ms: u64,
    rounds: usize,
    background_busy_pct: f64,
    scenarios: Vec<Scenario>,
    baseline: Option<PathBuf>,
    runs: Vec<Run>,
}

impl Report {
    fn new(
        args: &CaptureArgs,
        background_busy_pct: f64,
        scenarios: Vec<Scenario>,
        runs: Vec<Run>,
    ) -> Report {
        Report {
            duration_ms: args.duration_ms,
            rounds: args.rounds,
            background_busy_pct,
            scenarios,
            baseline: args.baseline.clone(),
            runs,
        }
    }

    fn median(&self, scenario: Scenario, metric: &Metric) -> f64 {
        median(
            self.runs
                .iter()
                .filter(|r| r.scenario == scenario)
                .map(metric.get),
        )
    }

    fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "bench capture: medians over rounds: {}, {} ms per run, concurrency {CONCURRENCY}, payload {PAYLOAD} B; kernel {}, {} CPUs{}",
            self.rounds,
            self.duration_ms,
            kernel(),
            cpus(),
            self.baseline
                .as_ref()
                .map(|b| format!("; ebpf-base: {}", b.display()))
                .unwrap_or_default()
        );
        let ratios = ratios(&self.scenarios);
        let _ = write!(t, "{:<42}", "");
        for s in &self.scenarios {
            let _ = write!(t, "{:>12}", s.name());
        }
        for (a, b) in &ratios {
            let _ = write!(t, "{:>24}", format!("{}/{}", a.name(), b.name()));
        }
        t.push('\n');
        for m in METRICS {
            let _ = write!(t, "{:<42}", m.label);
            for s in &self.scenarios {
                let _ = write!(t, "{:>12}", fmt_value(self.median(*s, m)));
            }
            for (a, b) in &ratios {
                let ratio = self.median(*a, m) / self.median(*b, m);
                let cell = if ratio.is_finite() {
                    format!("{ratio:.2}x")
                } else {
                    "-".into()
                };
                let _ = write!(t, "{cell:>24}");
            }
            t.push('\n');
        }
        let per_conn = |s: Scenario, key: &str| {
            METRICS
                .iter()
                .find(|m| m.key == key)
                .map_or(f64::NAN, |m| self.median(s, m))
        };
        if self.scenarios.contains(&Scenario::EbpfBase) {
            let _ = writeln!(
                t,
                "events off against the base build: {:.0} ns vs {:.0} ns in the programs per connection ({:+.0} ns)",
                per_conn(Scenario::Ebpf, "prog_ns_per_conn"),
                per_conn(Scenario::EbpfBase, "prog_ns_per_conn"),
                per_conn(Scenario::Ebpf, "prog_ns_per_conn")
                    - per_conn(Scenario::EbpfBase, "prog_ns_per_conn"),
            );
        }
        if self.scenarios.contains(&Scenario::EbpfEvents) {
            let _ = writeln!(
                t,
                "events on and read, per connection against ebpf: {:+.0} ns in the programs, {:.1} us in the follower, {:+.1} us machine CPU busy",
                per_conn(Scenario::EbpfEvents, "prog_ns_per_conn")
                    - per_conn(Scenario::Ebpf, "prog_ns_per_conn"),
                per_conn(Scenario::EbpfEvents, "follower_cpu_us_per_conn"),
                per_conn(Scenario::EbpfEvents, "cpu_busy_us_per_conn")
                    - per_conn(Scenario::Ebpf, "cpu_busy_us_per_conn"),
            );
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
                "baseline": self.baseline.as_ref().map(|b| b.display().to_string()),
            },
            "median": self.scenarios.iter().map(|s| (s.name().to_owned(), per(*s))).collect::<serde_json::Map<_, _>>(),
            "ratios": ratios(&self.scenarios).iter().map(|(a, b)| (format!("{}/{}", a.name(), b.name()), ratio(*a, *b))).collect::<serde_json::Map<_, _>>(),
            "runs": self.runs,
        })
    }
}
