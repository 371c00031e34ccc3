//! `--instructions`: the user-space instructions each proxy spends per request, counted
//! by callgrind (valgrind) over a fixed number of requests after a warm-up. A count is
//! the same for the same binary and load whatever else the machine does, so it shows a
//! change's effect where the machine's drift (10-25% between rounds) hides it in req/s.
//! It counts instructions, not time: cache misses, system calls and the kernel's work
//! are not in it.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, ensure};
use harness::wait_for_port;
use serde_json::{Value, json};

use super::{H2_CLIENTS, H2_STREAMS, HOST, Load, Scenario, Setup, each_load_and_scenario};
use crate::pods::{secs, target_dir};

/// Requests counted per proxy and load, after [`WARM_UP`] uncounted ones.
const REQUESTS: u64 = 20_000;
const WARM_UP: u64 = 3_000;
/// HTTP/1.1 connections (h2 uses the main bench's clients and streams).
const H1_CLIENTS: &str = "50";

pub(super) const VALGRIND: &[(&str, &str)] = &[("valgrind", "callgrind_control")];

/// One proxy's count for one load.
pub(super) struct Count {
    scenario: Scenario,
    load: Load,
    per_request: f64,
}

/// Counts each of `scenarios` (those with one proxy process) under both loads.
pub(super) fn run(setup: &Setup, scenarios: &[Scenario]) -> Result<Vec<Count>> {
    each_load_and_scenario(scenarios, "instructions", |scenario, load| {
        let per_request = count(setup, scenario, load)?;
        println!(
            "  instructions {:<8} {:<3} {per_request:>8.0} per request",
            scenario.name(),
            load.name(),
        );
        Ok(Count {
            scenario,
            load,
            per_request,
        })
    })
}

fn count(setup: &Setup, scenario: Scenario, load: Load) -> Result<f64> {
    let mut launches = setup.launches(scenario)?;
    ensure!(launches.len() == 1, "one process per scenario");
    let launch = launches.remove(0);
    let out = setup
        .dir
        .join(format!("callgrind-{}-{}", scenario.name(), load.name()));
    let proxy = launch
        .pod
        .command("valgrind")
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}.%p", out.display()))
        .arg(&launch.program)
        .args(&launch.args)
        .spawn()?;
    for &address in &launch.listens {
        // Under valgrind, start-up is tens of times slower.
        wait_for_port(launch.pod, address, secs(120)).with_context(|| {
            format!(
                "{} did not listen on {address}:\n{}",
                proxy.description(),
                proxy.stderr_text()
            )
        })?;
    }
    let pid = proxy.pid().to_string();
    let target = setup.target(scenario, load);
    load_fixed(setup, load, target, WARM_UP)?;
    callgrind_control(&["-z", &pid])?;
    load_fixed(setup, load, target, REQUESTS)?;
    callgrind_control(&["-d", &pid])?;
    drop(proxy);
    // `-d` writes the instructions since `-z` to `OUT.PID.1`.
    let dump = PathBuf::from(format!("{}.{pid}.1", out.display()));
    let text = std::fs::read_to_string(&dump)
        .with_context(|| format!("callgrind's dump {}", dump.display()))?;
    let total = summary(&text).with_context(|| format!("no summary in {}", dump.display()))?;
    // Kept for `callgrind_annotate`: where a difference in the count comes from.
    let kept = target_dir().join("bench").join(format!(
        "callgrind-{}-{}.out",
        scenario.name(),
        load.name()
    ));
    std::fs::copy(&dump, &kept).with_context(|| format!("keeping {}", kept.display()))?;
    Ok(total as f64 / REQUESTS as f64)
}

/// `requests` requests with h2load, every one of them answered 2xx.
pub(super) fn load_fixed(
    setup: &Setup,
    load: Load,
    target: std::net::SocketAddr,
    requests: u64,
) -> Result<()> {
    let shape: &[&str] = match load {
        Load::H1 => &["--h1", "-c", H1_CLIENTS, "-m", "1"],
        Load::H2 => &["-c", H2_CLIENTS, "-m", H2_STREAMS],
    };
    let out = crate::pods::run(
        setup
            .client
            .command("h2load")
            .args(["-t1", "-n", &requests.to_string()])
            .args(shape)
            .arg("-H")
            .arg(format!(":authority: {HOST}"))
            .arg(format!("http://{target}/api/x"))
            .timeout(Duration::from_secs(600)),
    )?;
    let ok = out
        .lines()
        .find_map(|l| l.strip_prefix("status codes: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok());
    ensure!(
        ok == Some(requests),
        "h2load: not every request was answered 2xx:\n{out}"
    );
    Ok(())
}

fn callgrind_control(args: &[&str]) -> Result<()> {
    let status = std::process::Command::new("callgrind_control")
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .context("running callgrind_control")?;
    ensure!(
        status.success(),
        "callgrind_control {args:?} failed ({status})"
    );
    Ok(())
}

/// The event total of a callgrind dump (`summary: N`).
fn summary(dump: &str) -> Option<u64> {
    dump.lines()
        .find_map(|l| l.strip_prefix("summary: "))
        .and_then(|n| n.trim().parse().ok())
}

/// The table: each proxy's count per load, and shunt's ratio to each other one.
pub(super) fn table(counts: &[Count]) -> String {
    let mut t = String::from(
        "user-space instructions per request (callgrind, 20,000 requests after a warm-up)\n",
    );
    for load in [Load::H1, Load::H2] {
        let of = |s: Scenario| {
            counts
                .iter()
                .find(|c| c.scenario == s && c.load == load)
                .map(|c| c.per_request)
        };
        let Some(shunt) = of(Scenario::Shunt) else {
            continue;
        };
        for c in counts.iter().filter(|c| c.load == load) {
            let ratio = if c.scenario == Scenario::Shunt {
                String::new()
            } else {
                format!(
                    "  shunt/{} {:.2}x",
                    c.scenario.name(),
                    shunt / c.per_request
                )
            };
            t.push_str(&format!(
                "  {:<3} {:<8} {:>8.0}{ratio}\n",
                load.name(),
                c.scenario.name(),
                c.per_request
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
                "instructions_per_request": c.per_request,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dump_gives_its_summary_line() {
        let dump = "version: 1\ncreator: callgrind-3.19.0\npid: 1230\nevents: Ir\nsummary: 748689915\n\nfn=(1) main\n";
        assert_eq!(summary(dump), Some(748_689_915));
        assert_eq!(summary("events: Ir\n"), None);
    }

    #[test]
    fn the_table_gives_shunt_against_each_other_proxy() {
        let counts = [
            Count {
                scenario: Scenario::Shunt,
                load: Load::H1,
                per_request: 37_434.0,
            },
            Count {
                scenario: Scenario::Haproxy,
                load: Load::H1,
                per_request: 39_974.0,
            },
        ];
        let t = table(&counts);
        assert!(t.contains("h1  shunt       37434"), "{t}");
        assert!(t.contains("shunt/haproxy 0.94x"), "{t}");
    }
}
