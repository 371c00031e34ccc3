//! `cargo xtask bench sockmap`: the app → proxy → proxy → app path between two pods of
//! one node, side by side: `direct` (no capture, no proxy), `iptables`, `ebpf` with the
//! short-circuit off (`--no-sockmap`) and on. 64-byte ping-pong round trips (p50/p99)
//! and bulk echo throughput; rounds in alternating order, medians reported.

use std::{fmt::Write as _, net::SocketAddr};

use anyhow::{Context, Result, bail};
use harness::{Node, Pod};
use serde_json::{Value, json};

use super::measure::{app_testapp, median};
use crate::pods::{APP_UID, Backend, Bins, Capture, call, start_app, start_proxy, target_dir};

#[derive(clap::Args)]
pub struct SockmapArgs {
    /// Length of each round-trip run.
    #[arg(long, default_value_t = 3000)]
    duration_ms: u64,
    /// Bytes echoed in each bulk run.
    #[arg(long, default_value_t = 128 << 20)]
    bulk_bytes: u64,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

const PIN_ROOT: &str = "/sys/fs/bpf/shunt-bench-sockmap";
const PORT: u16 = 8080;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Direct,
    Iptables,
    EbpfNoSockmap,
    EbpfSockmap,
}

const SCENARIOS: [Scenario; 4] = [
    Scenario::Direct,
    Scenario::Iptables,
    Scenario::EbpfNoSockmap,
    Scenario::EbpfSockmap,
];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Direct => "direct",
            Scenario::Iptables => "iptables",
            Scenario::EbpfNoSockmap => "ebpf",
            Scenario::EbpfSockmap => "ebpf+sockmap",
        }
    }
}

struct Sample {
    rtt_p50: f64,
    rtt_p99: f64,
    rtt_per_sec: f64,
    bulk_mib_s: f64,
    redirected_bytes: u64,
}

pub fn run(bins: &Bins, args: &SockmapArgs) -> Result<()> {
    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let _app = start_app(bins, &server, PORT)?;
    let target = SocketAddr::new(server.ipv4().into(), PORT);
    let mut samples: Vec<(Scenario, Sample)> = Vec::new();
    for round in 0..args.rounds {
        let mut order = SCENARIOS.to_vec();
        if round % 2 == 1 {
            order.reverse();
        }
        for scenario in order {
            let s = measure(bins, &client, &server, target, scenario, args)
                .with_context(|| format!("round {} {}", round + 1, scenario.name()))?;
            eprintln!(
                "  round {} {:<13} rtt p50 {:>5.0} us p99 {:>5.0} us  bulk {:>7.1} MiB/s  short-circuited {} B",
                round + 1,
                scenario.name(),
                s.rtt_p50,
                s.rtt_p99,
                s.bulk_mib_s,
                s.redirected_bytes
            );
            samples.push((scenario, s));
        }
    }
    report(&samples, args)
}

fn measure(
    bins: &Bins,
    client: &Pod,
    server: &Pod,
    target: SocketAddr,
    scenario: Scenario,
    args: &SockmapArgs,
) -> Result<Sample> {
    let backend = match scenario {
        Scenario::Direct => None,
        Scenario::Iptables => Some(Backend::Iptables),
        Scenario::EbpfNoSockmap | Scenario::EbpfSockmap => Some(Backend::Ebpf),
    };
    let mut capture = backend.map(|b| Capture::new(bins, b, PIN_ROOT));
    let mut proxies = Vec::new();
    if let Some(capture) = &mut capture {
        let extra: &[&str] = if scenario == Scenario::EbpfNoSockmap {
            &["--no-sockmap"]
        } else {
            &[]
        };
        for pod in [client, server] {
            capture.install_with(pod, extra)?;
            proxies.push(start_proxy(bins, pod)?);
        }
    }
    // The path: through both proxies (the app sees the passthrough source) or not.
    let c = call(bins, client, APP_UID, target, 64)?;
    let proxied = c.server_peer.ip().is_loopback();
    if proxied != backend.is_some() {
        bail!(
            "{}: server saw {}; the traffic did not take the path under test",
            scenario.name(),
            c.server_peer
        );
    }
    let before = redirected(bins, scenario)?;
    let rr = testapp(
        bins,
        client,
        &[
            "bench-rr",
            &target.to_string(),
            "--duration-ms",
            &args.duration_ms.to_string(),
            "--payload",
            "64",
        ],
        args.duration_ms,
    )?;
    let bulk = testapp(
        bins,
        client,
        &[
            "call",
            &target.to_string(),
            "--bytes",
            &args.bulk_bytes.to_string(),
            "--timeout-ms",
            "60000",
        ],
        60_000,
    )?;
    let redirected_bytes = redirected(bins, scenario)? - before;
    if (scenario == Scenario::EbpfSockmap) != (redirected_bytes > 0) {
        bail!(
            "{}: {redirected_bytes} bytes short-circuited",
            scenario.name()
        );
    }
    let elapsed = bulk["elapsed_us"]
        .as_f64()
        .context("bulk elapsed_us")?
        .max(1.0);
    Ok(Sample {
        rtt_p50: rr["p50_us"].as_f64().unwrap_or(0.0),
        rtt_p99: rr["p99_us"].as_f64().unwrap_or(0.0),
        rtt_per_sec: rr["rtt_per_sec"].as_f64().unwrap_or(0.0),
        bulk_mib_s: args.bulk_bytes as f64 / (1 << 20) as f64 / (elapsed / 1e6),
        redirected_bytes,
    })
}

/// `sockmap_bytes_redirected` so far (0 without eBPF capture).
fn redirected(bins: &Bins, scenario: Scenario) -> Result<u64> {
    if !matches!(scenario, Scenario::EbpfNoSockmap | Scenario::EbpfSockmap) {
        return Ok(0);
    }
    let out = std::process::Command::new(&bins.shunt)
        .args(["inspect", "--json", "--bpffs", PIN_ROOT])
        .output()?;
    let v: Value = serde_json::from_slice(&out.stdout).context("shunt inspect --json")?;
    Ok(v["counters"]
        .as_array()
        .and_then(|c| c.iter().find(|e| e[0] == "sockmap_bytes_redirected"))
        .and_then(|e| e[1].as_u64())
        .unwrap_or(0))
}

/// The benches' testapp runner; here any error voids the run.
fn testapp(bins: &Bins, pod: &Pod, args: &[&str], duration_ms: u64) -> Result<Value> {
    let v = app_testapp(bins, pod, args, duration_ms)?;
    if v["errors"].as_u64().unwrap_or(0) > 0 {
        bail!("testapp {args:?}: {v}");
    }
    Ok(v)
}

/// A table row: its label and how to read it from a sample.
type Metric = (&'static str, fn(&Sample) -> f64);

fn report(samples: &[(Scenario, Sample)], args: &SockmapArgs) -> Result<()> {
    let med = |s: Scenario, f: fn(&Sample) -> f64| {
        median(samples.iter().filter(|(x, _)| *x == s).map(|(_, v)| f(v)))
    };
    let metrics: [Metric; 4] = [
        ("64 B round trip p50 (us)", |s| s.rtt_p50),
        ("64 B round trip p99 (us)", |s| s.rtt_p99),
        ("64 B round trips/s", |s| s.rtt_per_sec),
        ("bulk echo throughput (MiB/s each way)", |s| s.bulk_mib_s),
    ];
    let mut text = String::new();
    writeln!(
        text,
        "bench sockmap: client pod -> server pod on one node, medians of {} rounds",
        args.rounds
    )?;
    writeln!(
        text,
        "{:<40}{:>10}{:>10}{:>10}{:>14}{:>19}{:>15}",
        "", "direct", "iptables", "ebpf", "ebpf+sockmap", "sockmap/iptables", "sockmap/ebpf"
    )?;
    let mut json_rows = Vec::new();
    for (label, f) in metrics {
        let [d, i, e, s] = SCENARIOS.map(|sc| med(sc, f));
        writeln!(
            text,
            "{label:<40}{d:>10.1}{i:>10.1}{e:>10.1}{s:>14.1}{:>18.2}x{:>14.2}x",
            s / i,
            s / e
        )?;
        json_rows.push(
            json!({"metric": label, "direct": d, "iptables": i, "ebpf": e, "ebpf_sockmap": s}),
        );
    }
    print!("{text}");
    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("sockmap.txt"), &text)?;
    std::fs::write(
        dir.join("sockmap.json"),
        serde_json::to_string_pretty(&json_rows)?,
    )?;
    println!("saved {}", dir.join("sockmap.txt").display());
    Ok(())
}
