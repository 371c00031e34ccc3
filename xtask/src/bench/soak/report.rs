//! The soak's samples, their growth after warm-up, the failures sorted into expected
//! and unexpected, the verdict, and the files under `target/bench/`.

use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{Value, json};

use super::traffic::{Failure, KINDS};

/// One reading of the proxy, every `--sample-s`.
#[derive(Clone, Serialize)]
pub(crate) struct Sample {
    pub(crate) t_s: f64,
    /// Since the previous sample (the counts below are over it).
    pub(crate) interval_s: f64,
    pub(crate) rss_kib: u64,
    pub(crate) rss_anon_kib: u64,
    pub(crate) fds: u64,
    pub(crate) threads: u64,
    /// Sum of the listeners' `downstream_cx_active` and the clusters'
    /// `upstream_cx_active` (admin API).
    pub(crate) downstream_cx: u64,
    pub(crate) upstream_cx: u64,
    /// Stats in the admin API's `/stats` (counters and gauges): with names churned,
    /// flat only if the stats of what went go too.
    pub(crate) stats: u64,
    /// The proxy's CPU since the previous sample, percent of one core.
    pub(crate) cpu_pct: f64,
    /// Successes and failures of each kind since the previous sample, in [`KINDS`] order.
    pub(crate) ok: Vec<u64>,
    pub(crate) failed: Vec<u64>,
    /// xDS updates ACKed so far.
    pub(crate) xds_acked: u64,
}

impl Sample {
    pub(crate) fn rss_mib(&self) -> f64 {
        self.rss_kib as f64 / 1024.0
    }

    /// Open fds that are not connections: what leaks show in, free of the traffic's ups
    /// and downs (each downstream and upstream connection holds one fd).
    pub(crate) fn fds_net(&self) -> f64 {
        self.fds as f64 - (self.downstream_cx + self.upstream_cx) as f64
    }

    fn stats_count(&self) -> f64 {
        self.stats as f64
    }

    fn per_s(&self) -> f64 {
        self.ok.iter().sum::<u64>() as f64 / self.interval_s
    }
}

/// A window in which an upstream endpoint was down, seconds since the start (`up`:
/// when its replacement listened again, or the end).
#[derive(Clone, Copy, Serialize)]
pub(crate) struct Window {
    pub(crate) down_s: f64,
    pub(crate) up_s: f64,
}

/// How long before an endpoint is stopped and after it listens again a failure still
/// counts as caused by it: a request already on its way to it, a connection the proxy
/// pooled to it before it went.
pub(crate) const WINDOW_MARGIN_S: f64 = 1.0;

/// Expected: overlaps a window in which an endpoint was down (plus the margin). The
/// retries make most of these succeed; what is left is a transfer cut by the kill.
pub(crate) fn expected(failure: &Failure, windows: &[Window]) -> bool {
    windows.iter().any(|w| {
        failure.from_s <= w.up_s + WINDOW_MARGIN_S && failure.to_s >= w.down_s - WINDOW_MARGIN_S
    })
}

/// Theil-Sen slope of y over x, per unit of x: the median of the slopes between every
/// two points, which a few noisy samples (connections opening between reading the
/// admin API and /proc) do not tilt the way they tilt least squares. NaN with fewer
/// than 2 points.
fn slope(points: &[(f64, f64)]) -> f64 {
    let mut slopes = Vec::new();
    for (i, a) in points.iter().enumerate() {
        for b in &points[i + 1..] {
            if b.0 != a.0 {
                slopes.push((b.1 - a.1) / (b.0 - a.0));
            }
        }
    }
    median(slopes)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Growth of one quantity after warm-up.
#[derive(Serialize)]
pub(crate) struct Growth {
    /// Slope of a linear (Theil-Sen) fit over the second half of the run, per minute.
    pub(crate) slope_per_min: f64,
    /// That slope over the second half's length: what it would add in that time.
    pub(crate) fit_over_second_half: f64,
    /// Median of the last 3 samples minus median of the first 3 after warm-up.
    pub(crate) last_minus_first: f64,
    pub(crate) tolerance: f64,
    pub(crate) within: bool,
}

fn growth(samples: &[Sample], warmup_s: f64, value: fn(&Sample) -> f64, tolerance: f64) -> Growth {
    let after: Vec<&Sample> = samples.iter().filter(|s| s.t_s >= warmup_s).collect();
    let end = samples.last().map_or(0.0, |s| s.t_s);
    let half = end / 2.0;
    let second: Vec<(f64, f64)> = samples
        .iter()
        .filter(|s| s.t_s >= half)
        .map(|s| (s.t_s / 60.0, value(s)))
        .collect();
    let slope_per_min = slope(&second);
    let fit_over_second_half = slope_per_min * (end - half) / 60.0;
    let ends = |v: &[&Sample]| median(v.iter().map(|s| value(s)).collect());
    let k = after.len().min(3);
    let last_minus_first = ends(&after[after.len() - k..]) - ends(&after[..k]);
    Growth {
        slope_per_min,
        fit_over_second_half,
        last_minus_first,
        tolerance,
        // NaN (too few samples) is not within.
        within: last_minus_first <= tolerance && fit_over_second_half <= tolerance,
    }
}

/// Everything the bench found.
pub(crate) struct Report {
    pub(crate) description: String,
    pub(crate) warmup_s: f64,
    pub(crate) samples: Vec<Sample>,
    pub(crate) windows: Vec<Window>,
    pub(crate) failures: Vec<Failure>,
    /// (kind, successes, failures) over the whole run.
    pub(crate) totals: Vec<(&'static str, u64, u64)>,
    pub(crate) xds_updates: u64,
    /// xDS updates NACKed or not answered, and why.
    pub(crate) xds_problems: Vec<String>,
    /// Why the run ended early (Ctrl-C, the proxy exited, ...), if it did.
    pub(crate) cut_short: Option<String>,
    /// Some of the proxy's own counters at the end (name pattern, sum).
    pub(crate) counters: Vec<(String, u64)>,
    pub(crate) rss_tolerance_mib: f64,
    pub(crate) fd_tolerance: f64,
    pub(crate) stats_tolerance: f64,
}

impl Report {
    fn stats(&self) -> Growth {
        growth(
            &self.samples,
            self.warmup_s,
            Sample::stats_count,
            self.stats_tolerance,
        )
    }

    fn rss(&self) -> Growth {
        growth(
            &self.samples,
            self.warmup_s,
            Sample::rss_mib,
            self.rss_tolerance_mib,
        )
    }

    fn fds(&self) -> Growth {
        growth(
            &self.samples,
            self.warmup_s,
            Sample::fds_net,
            self.fd_tolerance,
        )
    }

    /// (expected, unexpected) failure counts per kind, in [`KINDS`] order.
    fn classified(&self) -> Vec<(u64, u64)> {
        KINDS
            .iter()
            .map(|k| {
                let of_kind = self.failures.iter().filter(|f| f.kind == k.name());
                of_kind.fold((0, 0), |(e, u), f| {
                    if expected(f, &self.windows) {
                        (e + f.count, u)
                    } else {
                        (e, u + f.count)
                    }
                })
            })
            .collect()
    }

    /// Failures counted but not kept (beyond the cap) count as unexpected.
    fn unexpected(&self) -> u64 {
        let kept: u64 = self.failures.iter().map(|f| f.count).sum();
        let all: u64 = self.totals.iter().map(|t| t.2).sum();
        self.classified().iter().map(|c| c.1).sum::<u64>()
            + all.saturating_sub(kept)
            + self.xds_problems.len() as u64
    }

    /// The verdict's reasons to fail (none: pass).
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(why) = &self.cut_short {
            problems.push(format!("the run was cut short: {why}"));
        }
        let unexpected = self.unexpected();
        if unexpected > 0 {
            problems.push(format!("{unexpected} unexpected errors"));
        }
        let (rss, fds) = (self.rss(), self.fds());
        if !rss.within {
            problems.push(format!(
                "RSS grew after warm-up: {:+.1} MiB last-minus-first, fit {:+.1} MiB over the second half (tolerance {} MiB)",
                rss.last_minus_first, rss.fit_over_second_half, rss.tolerance
            ));
        }
        let stats = self.stats();
        if !stats.within {
            problems.push(format!(
                "/stats grew after warm-up: {:+.0} stats last-minus-first, fit {:+.0} over the second half (tolerance {})",
                stats.last_minus_first, stats.fit_over_second_half, stats.tolerance
            ));
        }
        if !fds.within {
            problems.push(format!(
                "fds (not counting connections) grew after warm-up: {:+.1} last-minus-first, fit {:+.1} over the second half (tolerance {})",
                fds.last_minus_first, fds.fit_over_second_half, fds.tolerance
            ));
        }
        problems
    }

    pub(crate) fn table(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "{}", self.description);
        let _ = writeln!(
            t,
            "{:>7} {:>8} {:>5} {:>8} {:>6} {:>6} {:>8} {:>6} {:>6}",
            "time s", "RSS MiB", "fds", "fds-net", "conns", "thr", "req/s", "CPU%", "errors"
        );
        // At most ~30 rows: every k-th sample, and the last.
        let k = self.samples.len().div_ceil(30).max(1);
        for (i, s) in self.samples.iter().enumerate() {
            if i % k != 0 && i + 1 != self.samples.len() {
                continue;
            }
            let _ = writeln!(
                t,
                "{:>7.0} {:>8.1} {:>5} {:>8.0} {:>6} {:>6} {:>8.0} {:>6.0} {:>6}{}",
                s.t_s,
                s.rss_mib(),
                s.fds,
                s.fds_net(),
                s.downstream_cx + s.upstream_cx,
                s.threads,
                s.per_s(),
                s.cpu_pct,
                s.failed.iter().sum::<u64>(),
                if s.t_s < self.warmup_s {
                    "  (warm-up)"
                } else {
                    ""
                }
            );
        }
        let _ = writeln!(
            t,
            "\n{:<14}{:>10}{:>10}{:>10}{:>12}",
            "traffic", "ok", "failed", "expected", "unexpected"
        );
        for ((kind, ok, failed), (e, u)) in self.totals.iter().zip(self.classified()) {
            let _ = writeln!(t, "{kind:<14}{ok:>10}{failed:>10}{e:>10}{u:>12}");
        }
        let _ = writeln!(
            t,
            "xDS updates ACKed: {} ({} NACKed or unanswered); upstream crash rounds (one endpoint of each cluster): {}",
            self.xds_updates,
            self.xds_problems.len(),
            self.windows.len()
        );
        let _ = writeln!(
            t,
            "proxy counters at the end: {}",
            self.counters
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for p in self.xds_problems.iter().take(5) {
            let _ = writeln!(t, "  xDS: {p}");
        }
        let shown: Vec<&Failure> = self.failures.iter().take(10).collect();
        if !shown.is_empty() {
            let _ = writeln!(t, "first failures:");
            for f in shown {
                let _ = writeln!(
                    t,
                    "  {:>6.1}-{:<6.1} s {:<12} x{} {}: {}",
                    f.from_s,
                    f.to_s,
                    f.kind,
                    f.count,
                    if expected(f, &self.windows) {
                        "expected"
                    } else {
                        "UNEXPECTED"
                    },
                    f.what
                );
            }
        }
        let (rss, fds) = (self.rss(), self.fds());
        let _ = writeln!(
            t,
            "growth after warm-up ({:.0} s): RSS {:+.2} MiB last-minus-first, fit {:+.3} MiB/min ({:+.2} MiB over the second half), tolerance {} MiB",
            self.warmup_s,
            rss.last_minus_first,
            rss.slope_per_min,
            rss.fit_over_second_half,
            rss.tolerance
        );
        let _ = writeln!(
            t,
            "  fds net of connections {:+.1} last-minus-first, fit {:+.2}/min ({:+.1} over the second half), tolerance {}",
            fds.last_minus_first, fds.slope_per_min, fds.fit_over_second_half, fds.tolerance
        );
        let problems = self.problems();
        if problems.is_empty() {
            let _ = writeln!(
                t,
                "verdict: PASS (0 unexpected errors, no fd or RSS growth beyond tolerance)"
            );
        } else {
            let _ = writeln!(t, "verdict: FAIL: {}", problems.join("; "));
        }
        t
    }

    pub(crate) fn csv(&self) -> String {
        let mut t = String::from(
            "t_s,rss_kib,rss_anon_kib,fds,fds_net,threads,downstream_cx,upstream_cx,stats,cpu_pct,xds_acked",
        );
        for k in KINDS {
            let _ = write!(t, ",{0}_ok,{0}_failed", k.name());
        }
        t.push('\n');
        for s in &self.samples {
            let _ = write!(
                t,
                "{:.1},{},{},{},{},{},{},{},{},{:.1},{}",
                s.t_s,
                s.rss_kib,
                s.rss_anon_kib,
                s.fds,
                s.fds_net(),
                s.threads,
                s.downstream_cx,
                s.upstream_cx,
                s.stats,
                s.cpu_pct,
                s.xds_acked
            );
            for (ok, failed) in s.ok.iter().zip(&s.failed) {
                let _ = write!(t, ",{ok},{failed}");
            }
            t.push('\n');
        }
        t
    }

    pub(crate) fn json(&self, config: Value) -> Value {
        json!({
            "bench": "soak",
            "config": config,
            "pass": self.problems().is_empty(),
            "problems": self.problems(),
            "rss_growth_mib": self.rss(),
            "fds_net_growth": self.fds(),
            "stats_growth": self.stats(),
            "totals": self.totals.iter().zip(self.classified()).map(|((kind, ok, failed), (e, u))| json!({"kind": kind, "ok": ok, "failed": failed, "expected": e, "unexpected": u})).collect::<Vec<_>>(),
            "xds_updates_acked": self.xds_updates,
            "xds_problems": self.xds_problems,
            "proxy_counters": self.counters.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "flap_windows": self.windows,
            "failures": self.failures.iter().map(|f| json!({"failure": f, "expected": expected(f, &self.windows)})).collect::<Vec<_>>(),
            "samples": self.samples,
        })
    }
}

/// The proxies' growth after warm-up side by side (`--with-envoy`): RSS and the number
/// of stats at the first and last samples after warm-up (medians of 3), and the ratio
/// of the first proxy's to each other's.
pub(crate) fn side_by_side(reports: &[(&str, Report)]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<6} {:>13} {:>12} {:>10} {:>10} {:>10} {:>9} {:>10} {:>10}",
        "proxy",
        "RSS MiB first",
        "RSS MiB last",
        "RSS fit",
        "stats first",
        "stats last",
        "stats fit",
        "requests",
        "unexpected"
    );
    let mut rows = Vec::new();
    for (name, r) in reports {
        let (rss, stats) = (r.rss(), r.stats());
        let after: Vec<&Sample> = r.samples.iter().filter(|s| s.t_s >= r.warmup_s).collect();
        let k = after.len().min(3);
        let ends = |v: &[&Sample], f: fn(&Sample) -> f64| median(v.iter().map(|s| f(s)).collect());
        let first = |f| ends(&after[..k], f);
        let last = |f| ends(&after[after.len() - k..], f);
        let ok: u64 = r.totals.iter().map(|t| t.1).sum();
        let row = (
            first(Sample::rss_mib),
            last(Sample::rss_mib),
            first(Sample::stats_count),
            last(Sample::stats_count),
        );
        let _ = writeln!(
            t,
            "{:<6} {:>13.1} {:>12.1} {:>+10.1} {:>10.0} {:>10.0} {:>+9.0} {:>10} {:>10}",
            name,
            row.0,
            row.1,
            rss.fit_over_second_half,
            row.2,
            row.3,
            stats.fit_over_second_half,
            ok,
            r.unexpected()
        );
        rows.push((name, row));
    }
    let (first_name, base) = rows[0];
    for (name, row) in &rows[1..] {
        let _ = writeln!(
            t,
            "{first_name}/{name}: RSS at the end {:.2}x, stats at the end {:.2}x",
            base.1 / row.1,
            base.3 / row.3
        );
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(from_s: f64, to_s: f64) -> Failure {
        Failure {
            kind: "h1-new",
            from_s,
            to_s,
            count: 1,
            what: "status 503".into(),
        }
    }

    #[test]
    fn failures_near_a_crash_are_expected() {
        let windows = [Window {
            down_s: 15.0,
            up_s: 17.5,
        }];
        assert!(expected(&failure(16.0, 16.1), &windows));
        assert!(expected(&failure(14.5, 14.6), &windows));
        assert!(expected(&failure(18.0, 18.2), &windows));
        assert!(!expected(&failure(13.0, 13.9), &windows));
        assert!(!expected(&failure(19.0, 19.1), &windows));
        assert!(!expected(&failure(16.0, 16.1), &[]));
    }

    fn samples(rss_mib: impl Fn(f64) -> f64, fds: impl Fn(f64) -> u64) -> Vec<Sample> {
        (1..=120)
            .map(|i| {
                let t = i as f64 * 5.0;
                Sample {
                    t_s: t,
                    interval_s: 5.0,
                    rss_kib: (rss_mib(t) * 1024.0) as u64,
                    rss_anon_kib: 0,
                    fds: fds(t) + 30,
                    threads: 4,
                    // Connections come and go; fds net of them stay put.
                    downstream_cx: 10 + i % 7,
                    upstream_cx: 20,
                    stats: 500,
                    cpu_pct: 50.0,
                    ok: vec![0; KINDS.len()],
                    failed: vec![0; KINDS.len()],
                    xds_acked: i,
                }
            })
            .map(|mut s| {
                s.fds += s.downstream_cx;
                s
            })
            .collect()
    }

    fn report(samples: Vec<Sample>) -> Report {
        Report {
            description: String::new(),
            warmup_s: 60.0,
            samples,
            windows: Vec::new(),
            failures: Vec::new(),
            totals: vec![("h1-new", 10, 0)],
            xds_updates: 600,
            xds_problems: Vec::new(),
            cut_short: None,
            counters: Vec::new(),
            rss_tolerance_mib: 4.0,
            fd_tolerance: 4.0,
            stats_tolerance: 200.0,
        }
    }

    #[test]
    fn slopes() {
        let line: Vec<(f64, f64)> = (0..10).map(|x| (x as f64, 3.0 * x as f64 + 1.0)).collect();
        assert_eq!(slope(&line), 3.0);
        // One outlier does not tilt it.
        let mut noisy: Vec<(f64, f64)> = (0..10).map(|x| (x as f64, 21.0)).collect();
        noisy[9].1 = 30.0;
        assert_eq!(slope(&noisy), 0.0);
        assert!(slope(&line[..1]).is_nan());
    }

    #[test]
    fn flat_after_warm_up_passes() {
        // Grows during warm-up, then stays.
        let r = report(samples(|t| 20.0 + (t.min(60.0) / 10.0), |_| 0));
        assert_eq!(r.problems(), Vec::<String>::new());
        assert!(r.table().contains("verdict: PASS"));
    }

    #[test]
    fn a_slow_leak_fails() {
        // 1 MiB a minute and an fd every 30 s: 10 MiB and 20 fds over the run.
        let r = report(samples(|t| 20.0 + t / 60.0, |t| (t / 30.0) as u64));
        let problems = r.problems();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].starts_with("RSS grew"), "{problems:?}");
        assert!(problems[1].starts_with("fds"), "{problems:?}");
    }

    #[test]
    fn failures_outside_crashes_fail() {
        let mut r = report(samples(|_| 20.0, |_| 0));
        r.failures = vec![failure(100.0, 100.1)];
        r.totals = vec![("h1-new", 10, 1)];
        assert_eq!(r.problems(), vec!["1 unexpected errors".to_owned()]);
        r.windows = vec![Window {
            down_s: 99.0,
            up_s: 101.0,
        }];
        assert_eq!(r.problems(), Vec::<String>::new());
        // Counted but not kept (beyond the cap): unexpected.
        r.totals = vec![("h1-new", 10, 2)];
        assert_eq!(r.problems(), vec!["1 unexpected errors".to_owned()]);
    }
}
