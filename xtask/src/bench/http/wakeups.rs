//! `--wakeups`: what each proxy asks of the kernel per request, counted by `perf stat`
//! over a fixed number of requests after a warm-up: the tasks it wakes (the client,
//! the upstream; `sched:sched_waking` in the proxy's context), its sends, receives and
//! `epoll_wait` calls. Two proxies can make the same system calls and yet wake their
//! peers at different rates: a wake-up is paid by the waker (`try_to_wake_up` under
//! the socket's lock) and by the woken one (a context switch), and on a small machine
//! the peers share the proxy's CPUs. Unlike instruction counts these depend on timing
//! (how often a peer is asleep when data reaches it), so compare them within one run.

use std::{os::unix::process::ExitStatusExt, process::Command, time::Duration};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};

use super::{Load, Scenario, Setup, each_load_and_scenario, instructions::load_fixed};

/// Requests counted per proxy and load, after [`WARM_UP`] uncounted ones.
const REQUESTS: u64 = 50_000;
const WARM_UP: u64 = 5_000;

/// The tracepoints counted, and the column each one adds to.
pub(crate) const EVENTS: &[(&str, Column)] = &[
    ("sched:sched_waking", Column::Wakeups),
    ("syscalls:sys_enter_sendto", Column::Sends),
    ("syscalls:sys_enter_sendmsg", Column::Sends),
    ("syscalls:sys_enter_writev", Column::Sends),
    ("syscalls:sys_enter_write", Column::Sends),
    ("syscalls:sys_enter_recvfrom", Column::Receives),
    ("syscalls:sys_enter_recvmsg", Column::Receives),
    ("syscalls:sys_enter_readv", Column::Receives),
    ("syscalls:sys_enter_read", Column::Receives),
    ("syscalls:sys_enter_epoll_wait", Column::EpollWaits),
    ("syscalls:sys_enter_epoll_pwait", Column::EpollWaits),
];

#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Column {
    Wakeups,
    Sends,
    Receives,
    EpollWaits,
}

/// One proxy's counts per request for one load.
pub(super) struct Count {
    scenario: Scenario,
    load: Load,
    wakeups: f64,
    sends: f64,
    receives: f64,
    epoll_waits: f64,
}

/// Counts each of `scenarios` (those with one proxy process) under both loads.
pub(super) fn run(setup: &Setup, scenarios: &[Scenario]) -> Result<Vec<Count>> {
    each_load_and_scenario(scenarios, "wake-ups", |scenario, load| {
        let c = count(setup, scenario, load)?;
        println!(
            "  wake-ups {:<8} {:<3} {:.3} per request ({:.3} sends, {:.3} receives)",
            scenario.name(),
            load.name(),
            c.wakeups,
            c.sends,
            c.receives,
        );
        Ok(c)
    })
}

fn count(setup: &Setup, scenario: Scenario, load: Load) -> Result<Count> {
    let mut proxies = setup.start_proxy(scenario)?;
    ensure!(proxies.len() == 1, "one process per scenario");
    let proxy = proxies.remove(0);
    let target = setup.target(scenario, load);
    load_fixed(setup, load, target, WARM_UP)?;
    let out = setup
        .dir
        .join(format!("perf-stat-{}-{}.csv", scenario.name(), load.name()));
    let events: Vec<&str> = EVENTS.iter().map(|(e, _)| *e).collect();
    let mut perf = Command::new("perf")
        .args(["stat", "-x", ",", "-e", &events.join(","), "-o"])
        .arg(&out)
        .args(["-p", &proxy.pid().to_string()])
        .spawn()
        .context("starting perf stat")?;
    // perf stat attaches to the process's threads before it counts anything.
    std::thread::sleep(Duration::from_millis(300));
    let result = load_fixed(setup, load, target, REQUESTS);
    // perf stat -p stops and writes its counts on SIGINT.
    let pid = i32::try_from(perf.id()).context("perf's pid")?;
    // SAFETY: kill(2) with a pid we spawned and have not yet waited for.
    let stopped = unsafe { libc::kill(pid, libc::SIGINT) } == 0;
    let status = perf.wait()?;
    drop(proxy);
    result?;
    ensure!(stopped, "could not stop perf stat");
    // It writes its counts and then ends by the SIGINT it was sent.
    ensure!(
        status.success() || status.signal() == Some(libc::SIGINT),
        "perf stat failed ({status})"
    );
    let text = std::fs::read_to_string(&out)
        .with_context(|| format!("perf stat's output {}", out.display()))?;
    let totals = parse(&text).with_context(|| format!("in {}", out.display()))?;
    let per_request = |column| {
        EVENTS
            .iter()
            .zip(&totals)
            .filter(|((_, c), _)| *c == column)
            .map(|(_, n)| *n as f64)
            .sum::<f64>()
            / REQUESTS as f64
    };
    Ok(Count {
        scenario,
        load,
        wakeups: per_request(Column::Wakeups),
        sends: per_request(Column::Sends),
        receives: per_request(Column::Receives),
        epoll_waits: per_request(Column::EpollWaits),
    })
}

/// Each of [`EVENTS`]' totals, in order, from `perf stat -x,`'s lines
/// (`COUNT,UNIT,EVENT,...`); an event the kernel does not have is an error.
pub(crate) fn parse(csv: &str) -> Result<Vec<u64>> {
    EVENTS
        .iter()
        .map(|(event, _)| {
            let line = csv
                .lines()
                .find(|l| l.split(',').nth(2) == Some(event))
                .with_context(|| format!("perf stat printed no line for {event}"))?;
            let count = line.split(',').next().unwrap_or_default();
            count.parse().with_context(|| {
                format!("perf stat could not count {event}: {count:?} (is tracefs there?)")
            })
        })
        .collect()
}

/// The table: each proxy's counts per load, and shunt's wake-ups against each other.
pub(super) fn table(counts: &[Count]) -> String {
    let mut t = format!(
        "kernel work per request (perf stat, {REQUESTS} requests after a warm-up; \
         h1: h2load --h1 -c50)\n       {:<11} {:>8} {:>8} {:>8} {:>8}\n",
        "", "wake-ups", "sends", "receives", "epoll"
    );
    for load in [Load::H1, Load::H2] {
        let shunt = counts
            .iter()
            .find(|c| c.scenario == Scenario::Shunt && c.load == load);
        for c in counts.iter().filter(|c| c.load == load) {
            let ratio = match shunt {
                Some(s) if c.scenario != Scenario::Shunt => {
                    format!(
                        "  shunt/{} wake-ups {:.2}x",
                        c.scenario.name(),
                        s.wakeups / c.wakeups
                    )
                }
                _ => String::new(),
            };
            t.push_str(&format!(
                "  {:<3} {:<11} {:>8.3} {:>8.3} {:>8.3} {:>8.3}{ratio}\n",
                load.name(),
                c.scenario.name(),
                c.wakeups,
                c.sends,
                c.receives,
                c.epoll_waits,
            ));
        }
    }
    t
}

pub(super) fn json(counts: &[Count]) -> Value {
    counts
        .iter()
        .map(|c| {
            json!({
                "scenario": c.scenario.name(),
                "load": c.load.name(),
                "wakeups_per_request": c.wakeups,
                "sends_per_request": c.sends,
                "receives_per_request": c.receives,
                "epoll_waits_per_request": c.epoll_waits,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csv(waking: &str) -> String {
        let mut s = String::from("# started on Wed Nov 25 03:00:00 2026\n\n");
        for (i, (event, _)) in EVENTS.iter().enumerate() {
            let count = if i == 0 {
                waking.to_string()
            } else {
                (i * 10).to_string()
            };
            s.push_str(&format!("{count},,{event},2000000000,100.00,,\n"));
        }
        s
    }

    #[test]
    fn perf_stat_csv_gives_each_event_in_order() {
        let totals = parse(&csv("13005")).unwrap();
        assert_eq!(totals.len(), EVENTS.len());
        assert_eq!(totals[0], 13005);
        assert_eq!(totals[1], 10);
    }

    #[test]
    fn an_event_perf_could_not_count_or_did_not_print_is_an_error() {
        let err = parse(&csv("<not supported>")).unwrap_err().to_string();
        assert!(err.contains("sched:sched_waking"), "{err}");
        let missing = csv("1").replace("syscalls:sys_enter_readv", "other");
        let err = parse(&missing).unwrap_err().to_string();
        assert!(
            err.contains("no line for syscalls:sys_enter_readv"),
            "{err}"
        );
    }

    #[test]
    fn the_table_gives_shunt_wakeups_against_each_other_proxy() {
        let count = |scenario, wakeups| Count {
            scenario,
            load: Load::H2,
            wakeups,
            sends: 1.13,
            receives: 1.11,
            epoll_waits: 0.03,
        };
        let t = table(&[
            count(Scenario::Shunt, 0.065),
            count(Scenario::Haproxy, 0.05),
        ]);
        assert!(t.contains("h2  shunt          0.065    1.130"), "{t}");
        assert!(t.contains("shunt/haproxy wake-ups 1.30x"), "{t}");
    }
}
