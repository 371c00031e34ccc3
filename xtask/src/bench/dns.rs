//! `cargo xtask bench dns`: the DNS proxy against dnsmasq answering directly, with one
//! load generator (dnsperf, from the app's pod) for all of them:
//!
//! - `dnsmasq`: dnsmasq in its own pod answering from its local data (its fastest path);
//! - `shunt local`: names of the pushed name table (1,000 services, FQDN and short
//!   forms), answered by shunt itself;
//! - `shunt cached`: dnsmasq's name through shunt, served from shunt's cache;
//! - `shunt uncached`: the same through a second shunt with its cache off, so every
//!   query is forwarded to dnsmasq and back.
//!
//! Rounds run the scenarios in alternating order; medians of queries/s and of each
//! run's p50/p99 (from dnsperf's per-query latencies) are reported, and each as a ratio
//! to dnsmasq's.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use harness::ads::{AdsServer, Any, Listen, type_urls};
use harness::{Node, Pod, PodProcess};
use serde_json::{Value, json};

use super::measure::{fmt_value, median, save};
use crate::pods::Bins;

#[derive(clap::Args)]
pub struct DnsArgs {
    /// Length of each dnsperf run.
    #[arg(long, default_value_t = 3)]
    seconds: u64,
    /// Rounds of every scenario (the order alternates); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Queries dnsperf keeps outstanding.
    #[arg(long, default_value_t = 20)]
    outstanding: u32,
}

const NDS: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";
const SERVICES: usize = 1000;
const UPSTREAM_NAME: &str = "upstream.bench";

/// istio.networking.nds.v1.NameTable.
#[derive(Clone, PartialEq, prost::Message)]
struct NameTable {
    #[prost(map = "string, message", tag = "1")]
    table: std::collections::HashMap<String, NameInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct NameInfo {
    #[prost(string, repeated, tag = "1")]
    ips: Vec<String>,
    #[prost(string, tag = "2")]
    registry: String,
    #[prost(string, tag = "3")]
    shortname: String,
    #[prost(string, tag = "4")]
    namespace: String,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Dnsmasq,
    Local,
    Cached,
    Uncached,
}

const SCENARIOS: [Scenario; 4] = [
    Scenario::Dnsmasq,
    Scenario::Local,
    Scenario::Cached,
    Scenario::Uncached,
];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Dnsmasq => "dnsmasq direct",
            Scenario::Local => "shunt local answers",
            Scenario::Cached => "shunt cached forwards",
            Scenario::Uncached => "shunt uncached forwards",
        }
    }
}

/// One dnsperf run's results.
struct Sample {
    qps: f64,
    p50_us: f64,
    p99_us: f64,
    lost: u64,
}

struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(bins: &Bins, args: &DnsArgs) -> Result<()> {
    for tool in ["dnsperf", "dnsmasq", "dig"] {
        if !crate::setup::on_path(tool) {
            bail!("{tool} is not installed (cargo xtask setup installs it)");
        }
    }
    let scratch =
        Scratch(std::env::temp_dir().join(format!("shunt-bench-dns-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&scratch.0);
    std::fs::create_dir_all(&scratch.0)?;
    let dir = &scratch.0;
    let socket = dir.join("XDS");
    let ads = AdsServer::start(Listen::Unix(socket.clone()))?;
    open_to_all(dir)?;
    open_to_all(&socket)?;
    ads.set(type_urls::CLUSTER, "c1", vec![]);
    ads.set(type_urls::LISTENER, "l1", vec![]);
    ads.set(NDS, "n1", vec![(String::new(), name_table())]);

    let mut node = Node::new()?;
    let app = node.add_pod("app")?;
    let resolver = node.add_pod("resolver")?;
    let _dnsmasq = start_dnsmasq(&resolver)?;
    let resolv_conf = dir.join("resolv.conf");
    std::fs::write(
        &resolv_conf,
        format!(
            "nameserver {}\nsearch default.svc.cluster.local svc.cluster.local cluster.local\n",
            resolver.ipv4()
        ),
    )?;
    let cached = start_shunt(
        bins,
        &app,
        dir,
        &socket,
        &resolv_conf,
        "cached",
        15000,
        15053,
        4096,
    )?;
    let uncached = start_shunt(
        bins,
        &app,
        dir,
        &socket,
        &resolv_conf,
        "uncached",
        15010,
        15054,
        0,
    )?;
    for (proxy, port) in [(&cached, 15053), (&uncached, 15054)] {
        wait_for_answer(&app, proxy, port)?;
    }

    let local = dir.join("local.txt");
    let mut names = String::new();
    for i in 0..SERVICES {
        writeln!(names, "svc{i}.default.svc.cluster.local A")?;
        writeln!(names, "svc{i} A")?;
    }
    std::fs::write(&local, names)?;
    let upstream = dir.join("upstream.txt");
    std::fs::write(&upstream, format!("{UPSTREAM_NAME} A\n"))?;

    let mut samples: Vec<Vec<Sample>> = SCENARIOS.iter().map(|_| Vec::new()).collect();
    for round in 0..args.rounds {
        let mut order: Vec<usize> = (0..SCENARIOS.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let scenario = SCENARIOS[i];
            let (server, port, data): (IpAddr, u16, &Path) = match scenario {
                Scenario::Dnsmasq => (resolver.ipv4().into(), 53, &upstream),
                Scenario::Local => ([127, 0, 0, 1].into(), 15053, &local),
                Scenario::Cached => ([127, 0, 0, 1].into(), 15053, &upstream),
                Scenario::Uncached => ([127, 0, 0, 1].into(), 15054, &upstream),
            };
            let sample = dnsperf(&app, server, port, data, args)
                .with_context(|| format!("dnsperf for {}", scenario.name()))?;
            println!(
                "round {round}: {:<26} {:>9.0} q/s  p50 {:>6.0} us  p99 {:>6.0} us  lost {}",
                scenario.name(),
                sample.qps,
                sample.p50_us,
                sample.p99_us,
                sample.lost
            );
            samples[i].push(sample);
        }
    }
    drop(cached);
    drop(uncached);

    let medians: Vec<(f64, f64, f64)> = samples
        .iter()
        .map(|s| {
            (
                median(s.iter().map(|x| x.qps)),
                median(s.iter().map(|x| x.p50_us)),
                median(s.iter().map(|x| x.p99_us)),
            )
        })
        .collect();
    let base = medians[0];
    let mut text = format!(
        "bench dns: dnsperf from the app pod, {} s runs, {} outstanding, {} rounds (medians)\n\n",
        args.seconds, args.outstanding, args.rounds
    );
    writeln!(
        text,
        "{:<26} {:>10} {:>9} {:>9} {:>12} {:>12}",
        "scenario", "queries/s", "p50 us", "p99 us", "q/s ratio", "p99 ratio"
    )?;
    let mut rows = Vec::new();
    for (i, scenario) in SCENARIOS.iter().enumerate() {
        let (qps, p50, p99) = medians[i];
        writeln!(
            text,
            "{:<26} {:>10} {:>9} {:>9} {:>12} {:>12}",
            scenario.name(),
            fmt_value(qps),
            fmt_value(p50),
            fmt_value(p99),
            format!("{:.2}", qps / base.0),
            format!("{:.2}", p99 / base.2),
        )?;
        rows.push(json!({
            "scenario": scenario.name(),
            "qps": qps, "p50_us": p50, "p99_us": p99,
            "qps_ratio_to_dnsmasq": qps / base.0,
            "p99_ratio_to_dnsmasq": p99 / base.2,
            "lost": samples[i].iter().map(|s| s.lost).sum::<u64>(),
        }));
    }
    text.push_str(
        "\nratios are to dnsmasq answering directly (its own local data, over the pods' \
         bridge); shunt's local answers and cache hits stay on the app pod's loopback.\n",
    );
    print!("\n{text}");
    let report: Value = json!({
        "seconds": args.seconds, "rounds": args.rounds, "outstanding": args.outstanding,
        "services": SERVICES, "scenarios": rows,
    });
    save("dns", &text, &report)
}

fn open_to_all(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777))?;
    Ok(())
}

/// 1,000 Kubernetes services in `default`, as istiod would send them.
fn name_table() -> Any {
    use prost::Message;
    let table = (0..SERVICES)
        .map(|i| {
            (
                format!("svc{i}.default.svc.cluster.local"),
                NameInfo {
                    ips: vec![format!("10.96.{}.{}", i / 250, i % 250 + 1)],
                    registry: "Kubernetes".into(),
                    shortname: format!("svc{i}"),
                    namespace: "default".into(),
                },
            )
        })
        .collect();
    Any {
        type_url: NDS.into(),
        value: NameTable { table }.encode_to_vec(),
    }
}

fn start_dnsmasq(pod: &Pod) -> Result<PodProcess> {
    let dnsmasq = pod
        .command("dnsmasq")
        .args([
            "--keep-in-foreground",
            "--no-resolv",
            "--no-hosts",
            "--no-poll",
            "--bind-interfaces",
            "--port=53",
            "--log-facility=-",
            "--pid-file=",
            "--local=/#/",
            "--local-ttl=300",
            &format!("--address=/{UPSTREAM_NAME}/192.0.2.10"),
            &format!("--listen-address={}", pod.ipv4()),
        ])
        .spawn()?;
    dnsmasq.wait_for_stderr(|l| l.contains("started, version"), Duration::from_secs(10))?;
    Ok(dnsmasq)
}

#[allow(clippy::too_many_arguments)]
fn start_shunt(
    bins: &Bins,
    pod: &Pod,
    dir: &Path,
    socket: &Path,
    resolv_conf: &Path,
    name: &str,
    admin: u16,
    dns: u16,
    cache: usize,
) -> Result<PodProcess> {
    let bootstrap = json!({
        "node": {"id": "sidecar~10.0.0.1~app.default~default.svc.cluster.local", "cluster": "app.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "dynamic_resources": {
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}
        },
        "static_resources": {"clusters": [{
            "name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": socket.display().to_string()}}}}]}]}
        }]}
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec(&bootstrap)?)?;
    let proxy = pod
        .command(&bins.shunt)
        .args(["proxy", "--log-level", "warn", "--concurrency", "2"])
        .args(["--dns-listen", &format!("127.0.0.1:{dns}")])
        .args(["--dns-cache-size", &cache.to_string()])
        .arg("--dns-resolv-conf")
        .arg(resolv_conf)
        .arg("-c")
        .arg(&path)
        .spawn()?;
    Ok(proxy)
}

/// Waits until the proxy on `port` answers a name of the table.
fn wait_for_answer(pod: &Pod, proxy: &PodProcess, port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = pod
            .command("dig")
            .args([
                "@127.0.0.1",
                "-p",
                &port.to_string(),
                "+short",
                "+tries=1",
                "+time=1",
            ])
            .arg("svc1.default.svc.cluster.local")
            .output()?;
        if String::from_utf8_lossy(&out.stdout).contains("10.96.0.2") {
            return Ok(());
        }
        if let Some(status) = proxy.try_wait() {
            bail!("shunt exited ({status}): {}", proxy.stderr_text());
        }
        if Instant::now() > deadline {
            bail!(
                "shunt on {port} never answered from its name table: {}",
                proxy.stderr_text()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn dnsperf(pod: &Pod, server: IpAddr, port: u16, data: &Path, args: &DnsArgs) -> Result<Sample> {
    let out = pod
        .command("dnsperf")
        .args(["-s", &server.to_string(), "-p", &port.to_string()])
        .args(["-c", "1", "-q", &args.outstanding.to_string()])
        .args(["-l", &args.seconds.to_string(), "-v"])
        .arg("-d")
        .arg(data)
        .timeout(Duration::from_secs(args.seconds + 30))
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "dnsperf failed: {}{}",
            text,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut latencies: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("> "))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|s| s * 1e6)
        .collect();
    latencies.sort_by(f64::total_cmp);
    let field = |label: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(label))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let qps = field("Queries per second:").context("no queries/s in dnsperf's output")?;
    let lost = field("Queries lost:").unwrap_or(0.0) as u64;
    let pct = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    Ok(Sample {
        qps,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        lost,
    })
}
