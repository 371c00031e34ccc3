//! What the benches share: medians, goals, the testapp runner, and reading the
//! machine's and a process's CPU and memory.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use harness::{Pod, PodCommand};
use serde_json::Value;

use crate::pods::{APP_UID, Bins, target_dir};

/// A target a bench reports as met or not (never asserted): on shunt's median, or on
/// the ratio shunt/envoy.
pub(crate) enum Goal {
    /// shunt/envoy at least this.
    RatioAtLeast(f64),
    /// shunt/envoy at most this.
    RatioAtMost(f64),
    /// shunt's median below this.
    Under(f64),
}

impl Goal {
    pub(crate) fn met(&self, value: f64, ratio: f64) -> bool {
        match self {
            Goal::RatioAtLeast(x) => ratio >= *x,
            Goal::RatioAtMost(x) => ratio <= *x,
            Goal::Under(x) => value < *x,
        }
    }
}

/// A number of testapp's JSON report (NaN when it has none).
pub(crate) fn num(report: &Value, key: &str) -> f64 {
    report[key].as_f64().unwrap_or(f64::NAN)
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
pub(crate) fn app_testapp(
    bins: &Bins,
    pod: &Pod,
    args: &[&str],
    duration_ms: u64,
) -> Result<Value> {
    testapp(
        pod.command(&bins.testapp).uid(APP_UID).gid(APP_UID),
        args,
        duration_ms,
    )
}

/// A testapp bench command (`cmd` is testapp in a pod, as whichever user), given a
/// minute beyond its duration; its JSON report (the first line), errors warned about.
pub(crate) fn testapp(cmd: PodCommand, args: &[&str], duration_ms: u64) -> Result<Value> {
    let out = crate::pods::run(
        cmd.args(args)
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
pub(crate) struct CpuTimes {
    pub(crate) busy: u64,
    pub(crate) sys_softirq: u64,
}

impl CpuTimes {
    pub(crate) fn now() -> Result<CpuTimes> {
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

    pub(crate) fn since(&self, before: &CpuTimes) -> CpuTimes {
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

/// USER_HZ: /proc/stat and /proc/PID/stat count in 1/100 s on every Linux architecture.
pub(crate) const TICK_US: f64 = 10_000.0;

pub(crate) const KIB_PER_MIB: f64 = 1024.0;

/// (VmRSS, RssAnon) of a process, KiB.
pub(crate) fn rss(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("RssAnon:")?))
}

/// The CPU time of a process's live threads, in nanoseconds (the scheduler's own
/// count, `/proc/PID/task/*/schedstat`: finer than the ticks of `/proc/PID/stat`).
pub(crate) fn cpu_ns(pid: u32) -> Result<u64> {
    let mut total = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let path = task?.path().join("schedstat");
        // A thread may have exited since the listing.
        let Ok(stat) = std::fs::read_to_string(&path) else {
            continue;
        };
        total += stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("malformed {}: {stat}", path.display()))?;
    }
    Ok(total)
}

/// utime + stime of a process (all its threads), in ticks.
pub(crate) fn proxy_cpu_ticks(pid: u32) -> Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After "pid (comm) ": state is field 3; utime and stime are fields 14 and 15.
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, r)| r)
        .with_context(|| format!("malformed /proc/{pid}/stat: {stat}"))?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| -> Result<u64> {
        f.get(i)
            .and_then(|v| v.parse().ok())
            .with_context(|| format!("malformed /proc/{pid}/stat: {stat}"))
    };
    Ok(tick(11)? + tick(12)?)
}
