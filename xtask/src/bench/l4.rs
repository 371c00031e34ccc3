//! `cargo xtask bench l4`: shunt and a real Envoy side by side as plain L4 proxies, on
//! the same static bootstrap with the same worker threads (issue 4's benchmark).
//!
//! A node with pods `client` and `server`. The server pod runs `testapp serve` (echo) on
//! :8080 and, per throughput run, `iperf3 -s -1`. The proxy under test runs in the client
//! pod as a plain process (a sidecar's place): one listener 127.0.0.1:10000 with
//! `tcp_proxy` to a STATIC cluster of one endpoint (the echo server, or iperf3 for
//! throughput). Scenarios: `direct` (the client talks to the server itself), `shunt`
//! (`shunt proxy -c FILE --concurrency 2`) and `envoy` (`envoy -c FILE --concurrency 2`),
//! in rounds whose order alternates; medians are reported.
//!
//! Every run checks that the proxy carried the traffic: the echo server and the iperf3
//! server must see each connection come from another socket than the client's own (the
//! proxy's upstream one, from the client pod's address), the echo server must have
//! accepted at least as many connections as the clients made, the proxy must still be
//! running at the end, and where its admin API answers, `cluster.upstream.upstream_cx_total`
//! must count them too.

use std::{
    collections::HashMap,
    fmt::Write as _,
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use harness::{Node, Pod, PodProcess, tcp_listeners, wait_for_port};
use serde::Serialize;
use serde_json::{Value, json};

use super::measure::{
    Goal, KIB_PER_MIB, TICK_US, background_busy, cpus, fmt_value, kernel, median, num,
    proxy_cpu_ticks, rss, save, testapp, time_wait,
};
use crate::pods::{Bins, call, secs, start_app, target_dir};

#[derive(clap::Args)]
pub struct L4Args {
    /// Length of each bench-connect and each bench-rr run.
    #[arg(long, default_value_t = 3000)]
    duration_ms: u64,
    /// Length of each iperf3 run, in seconds.
    #[arg(long, default_value_t = 5)]
    iperf_seconds: u64,
    /// Parallel iperf3 streams (`iperf3 -P`).
    #[arg(long, default_value_t = 1)]
    iperf_streams: u32,
    /// Connections held open through the proxy while its RSS is read.
    #[arg(long, default_value_t = 1000)]
    connections: usize,
    /// Rounds of all three scenarios (the order alternates); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// The proxies' listener, in the client pod.
const LISTEN: ([u8; 4], u16) = ([127, 0, 0, 1], 10000);
const ADMIN_PORT: u16 = 15000;
const ECHO_PORT: u16 = 8080;
const IPERF_PORT: u16 = 5201;
/// Worker threads of both proxies, and bench-connect's concurrency.
pub(crate) const CONCURRENCY: &str = "2";
const PAYLOAD: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scenario {
    Direct,
    Shunt,
    Envoy,
}

const SCENARIOS: [Scenario; 3] = [Scenario::Direct, Scenario::Shunt, Scenario::Envoy];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Direct => "direct",
            Scenario::Shunt => "shunt",
            Scenario::Envoy => "envoy",
        }
    }
}

/// The binaries, and what is fixed for the whole bench.
struct Setup {
    bins: Bins,
    envoy: PathBuf,
    envoy_version: String,
    client: Pod,
    server: Pod,
    /// Bootstraps: to the echo server, and to the iperf3 server.
    echo_bootstrap: PathBuf,
    iperf_bootstrap: PathBuf,
}

impl Setup {
    fn listen() -> SocketAddr {
        SocketAddr::from(LISTEN)
    }

    fn server_addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.server.ipv4().into(), port)
    }

    /// Where the client connects: the server itself, or the proxy's listener.
    fn target(&self, scenario: Scenario, port: u16) -> SocketAddr {
        match scenario {
            Scenario::Direct => self.server_addr(port),
            _ => Setup::listen(),
        }
    }

    fn proxy_command(
        &self,
        scenario: Scenario,
        bootstrap: &Path,
    ) -> Option<(PathBuf, Vec<String>)> {
        match scenario {
            Scenario::Direct => None,
            Scenario::Shunt => Some((self.bins.shunt.clone(), shunt_args(bootstrap))),
            Scenario::Envoy => Some((self.envoy.clone(), envoy_args(bootstrap))),
        }
    }

    /// The proxy for `scenario` (none for direct) in the client pod, once it listens.
    fn start_proxy(&self, scenario: Scenario, bootstrap: &Path) -> Result<Option<PodProcess>> {
        let Some((program, args)) = self.proxy_command(scenario, bootstrap) else {
            return Ok(None);
        };
        // Whatever answers on the listener must be the process started here.
        let stale = tcp_listeners(&self.client)?;
        ensure!(
            !stale.iter().any(|a| a.port() == LISTEN.1),
            "before starting {}: something already listens on port {} in the client pod: {stale:?}",
            scenario.name(),
            LISTEN.1
        );
        let proxy = self.client.command(program).args(args).spawn()?;
        wait_for_port(&self.client, Setup::listen(), secs(30)).with_context(|| {
            format!(
                "{} did not listen:\n{}",
                proxy.description(),
                proxy.stderr_text()
            )
        })?;
        Ok(Some(proxy))
    }
}

/// One scenario, once.
#[derive(Serialize)]
struct Run {
    round: usize,
    scenario: Scenario,
    /// iperf3's receiver-side rate, bits per second.
    throughput_bps: f64,
    throughput_bytes: f64,
    retransmits: u64,
    /// The proxy's own CPU (user + system) per GiB iperf3 moved.
    proxy_cpu_ms_per_gib: Option<f64>,
    /// testapp bench-connect's report, as printed.
    connect: Value,
    /// The proxy's own CPU per bench-connect connection.
    proxy_cpu_us_per_conn: Option<f64>,
    /// testapp bench-rr's report, as printed.
    rr: Value,
    /// The proxy's VmRSS / RssAnon after start and a warm-up.
    idle_rss_kib: Option<u64>,
    idle_rss_anon_kib: Option<u64>,
    /// VmRSS with `held_connections` open through it.
    held_rss_kib: Option<u64>,
    held_connections: usize,
    /// Connections the clients made in the echo phase, and the echo server accepted.
    client_connections: u64,
    server_accepts: u64,
    /// `cluster.upstream.upstream_cx_total` from the admin API, where it answers.
    admin_upstream_cx_total: Option<u64>,
    /// TIME_WAIT sockets in the client pod when bench-connect started.
    time_wait_before: u64,
}

/// A row of the table: how to read it from a run.
struct Metric {
    key: &'static str,
    label: &'static str,
    get: fn(&Run) -> f64,
}

fn opt<T: Into<f64>>(v: Option<T>) -> f64 {
    v.map_or(f64::NAN, Into::into)
}

const METRICS: &[Metric] = &[
    Metric {
        key: "throughput_gbit_s",
        label: "TCP throughput, iperf3 (Gbit/s)",
        get: |r| r.throughput_bps / 1e9,
    },
    Metric {
        key: "proxy_cpu_ms_per_gib",
        label: "  proxy CPU per GiB moved (ms)",
        get: |r| opt(r.proxy_cpu_ms_per_gib),
    },
    Metric {
        key: "conn_per_sec",
        label: "new connections/s (connect + 64 B echo)",
        get: |r| num(&r.connect, "conn_per_sec"),
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
        key: "proxy_cpu_us_per_conn",
        label: "  proxy CPU per connection (us)",
        get: |r| opt(r.proxy_cpu_us_per_conn),
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
        key: "idle_rss_mib",
        label: "proxy RSS idle, after warm-up (MiB)",
        get: |r| opt(r.idle_rss_kib.map(|k| k as f64 / KIB_PER_MIB)),
    },
    Metric {
        key: "idle_rss_anon_mib",
        label: "  of it anonymous (MiB)",
        get: |r| opt(r.idle_rss_anon_kib.map(|k| k as f64 / KIB_PER_MIB)),
    },
    Metric {
        key: "held_rss_mib",
        label: "proxy RSS, connections held open (MiB)",
        get: |r| opt(r.held_rss_kib.map(|k| k as f64 / KIB_PER_MIB)),
    },
    Metric {
        key: "rss_per_held_conn_kib",
        label: "  RSS per open connection (KiB)",
        get: |r| match (r.held_rss_kib, r.idle_rss_kib) {
            (Some(h), Some(i)) if r.held_connections > 0 => {
                (h as f64 - i as f64) / r.held_connections as f64
            }
            _ => f64::NAN,
        },
    },
];

fn metric(key: &str) -> &'static Metric {
    METRICS
        .iter()
        .find(|m| m.key == key)
        .expect("a metric of the table")
}

pub fn run(bins: Bins, args: &L4Args) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(args.iperf_seconds > 0, "--iperf-seconds must be at least 1");
    let envoy = crate::setup::envoy()?;
    let envoy_version = envoy_version(&envoy)?;
    // The held connections are file descriptors of this process.
    harness::raise_open_files_limit();

    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    // bench-connect makes thousands of connections a second from the client pod (the
    // client's own, or the proxy's upstream ones), each leaving a TIME_WAIT there: let
    // connect() reuse them and widen the port range, or ports run out across runs.
    tune_client_pod(&client)?;
    let app = start_app(&bins, &server, ECHO_PORT)?;

    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    let setup = Setup {
        bins,
        envoy,
        envoy_version,
        echo_bootstrap: dir.join("l4-echo.yaml"),
        iperf_bootstrap: dir.join("l4-iperf.yaml"),
        client,
        server,
    };
    // One file per upstream, read by both proxies.
    for (path, port) in [
        (&setup.echo_bootstrap, ECHO_PORT),
        (&setup.iperf_bootstrap, IPERF_PORT),
    ] {
        std::fs::write(path, bootstrap(setup.server_addr(port)))?;
        validate(&setup.bins.shunt, &setup.envoy, path)?;
    }

    let busy = background_busy()?;
    println!(
        "bench l4: client pod {} -> [127.0.0.1:{} shunt | envoy {}] -> server pod {}; both --concurrency {CONCURRENCY}; rounds {}, {} ms per bench-connect/bench-rr, iperf3 {} s x {} stream(s), {} connections held; machine busy {busy:.0}% before starting",
        setup.client.ipv4(),
        LISTEN.1,
        setup.envoy_version,
        setup.server.ipv4(),
        args.rounds,
        args.duration_ms,
        args.iperf_seconds,
        args.iperf_streams,
        args.connections
    );
    println!(
        "  bootstraps: {} and {}",
        setup.echo_bootstrap.display(),
        setup.iperf_bootstrap.display()
    );
    for s in [Scenario::Shunt, Scenario::Envoy] {
        if let Some((program, args)) = setup.proxy_command(s, &setup.echo_bootstrap) {
            println!("  {:<6} {} {}", s.name(), program.display(), args.join(" "));
        }
    }
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
            let run = measure(&setup, &app, scenario, round, args)
                .with_context(|| format!("round {round}, scenario {}", scenario.name()))?;
            println!(
                "  round {round} {:<6} {:>6.2} Gbit/s | {:>6.0} conn/s p50 {:>5} us p99 {:>5} us | rr p50 {:>4} us p99 {:>5} us | RSS idle {} held {} | server accepted {} of {} | TIME_WAIT before {}",
                scenario.name(),
                run.throughput_bps / 1e9,
                num(&run.connect, "conn_per_sec"),
                run.connect["p50_us"],
                run.connect["p99_us"],
                run.rr["p50_us"],
                run.rr["p99_us"],
                kib_text(run.idle_rss_kib),
                kib_text(run.held_rss_kib),
                run.server_accepts,
                run.client_connections,
                run.time_wait_before
            );
            runs.push(run);
        }
    }
    drop(app);
    drop(node);

    let report = Report {
        args,
        busy,
        envoy_version: &setup.envoy_version,
        runs,
    };
    let text = report.table();
    print!("\n{text}");
    save("l4", &text, &report.json(&setup))
}

/// `shunt proxy` on `bootstrap` with the bench's workers and log level. Started as root
/// in the pod, shunt would drop to uid 1337: keep it a plain process like Envoy.
pub(crate) fn shunt_args(bootstrap: &Path) -> Vec<String> {
    let file = bootstrap.display().to_string();
    let args = [
        "proxy",
        "-c",
        &file,
        "--concurrency",
        CONCURRENCY,
        "--keep-user",
        "--log-level",
        "warn",
    ];
    args.map(str::to_owned).to_vec()
}

/// `envoy` on `bootstrap` with the same workers (no hot restart: no shared memory).
pub(crate) fn envoy_args(bootstrap: &Path) -> Vec<String> {
    let file = bootstrap.display().to_string();
    let args = [
        "-c",
        &file,
        "--concurrency",
        CONCURRENCY,
        "-l",
        "warning",
        "--disable-hot-restart",
    ];
    args.map(str::to_owned).to_vec()
}

/// The static bootstrap both proxies run: one listener, `tcp_proxy` to one STATIC host.
fn bootstrap(upstream: SocketAddr) -> String {
    let (ip, port) = (upstream.ip(), upstream.port());
    let (listen_ip, listen_port) = (IpAddr::from(LISTEN.0), LISTEN.1);
    format!(
        r#"# Written by `cargo xtask bench l4`; shunt and Envoy both run this file.
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {ADMIN_PORT} }}
static_resources:
  listeners:
  - name: l4
    address:
      socket_address: {{ address: {listen_ip}, port_value: {listen_port} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: l4
          cluster: upstream
  clusters:
  - name: upstream
    type: STATIC
    connect_timeout: 1s
    lb_policy: ROUND_ROBIN
    load_assignment:
      cluster_name: upstream
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {ip}, port_value: {port} }}
"#
    )
}

/// Both proxies' own check of the file (`--mode validate`).
pub(crate) fn validate(shunt: &Path, envoy: &Path, bootstrap: &Path) -> Result<()> {
    let file = bootstrap.display().to_string();
    let checks: [(&Path, Vec<&str>); 2] = [
        (shunt, vec!["proxy", "--mode", "validate", "-c", &file]),
        (
            envoy,
            vec!["--mode", "validate", "-c", &file, "-l", "warning"],
        ),
    ];
    for (program, args) in checks {
        let out = std::process::Command::new(program)
            .args(&args)
            .output()
            .with_context(|| format!("running {}", program.display()))?;
        ensure!(
            out.status.success(),
            "{} {} rejects the bootstrap ({}):\n{}{}",
            program.display(),
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `envoy --version`'s release number (`.../1.40.0/Clean/RELEASE/BoringSSL`).
pub(crate) fn envoy_version(envoy: &Path) -> Result<String> {
    let out = std::process::Command::new(envoy)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", envoy.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_once("version: ")
        .and_then(|(_, v)| v.split('/').nth(1))
        .filter(|v| v.starts_with(|c: char| c.is_ascii_digit()))
        .map(str::to_owned)
        .with_context(|| format!("{} --version printed {text:?}", envoy.display()))
}

fn tune_client_pod(client: &Pod) -> Result<()> {
    client.run_in_netns(|| -> Result<()> {
        for (key, value) in [
            ("net/ipv4/tcp_tw_reuse", "1"),
            ("net/ipv4/ip_local_port_range", "16000 65000"),
        ] {
            std::fs::write(format!("/proc/sys/{key}"), value)
                .with_context(|| format!("setting {key} in the client pod"))?;
        }
        Ok(())
    })?
}

/// One scenario: the echo phase (path, warm-up, idle RSS, bench-connect, bench-rr,
/// connections held), then the throughput phase (iperf3), each with a fresh proxy.
fn measure(
    setup: &Setup,
    app: &PodProcess,
    scenario: Scenario,
    round: usize,
    args: &L4Args,
) -> Result<Run> {
    let echo = setup.target(scenario, ECHO_PORT);
    let accepts_before = accepts(app);
    let proxy = setup.start_proxy(scenario, &setup.echo_bootstrap)?;
    let proxied = proxy.is_some();
    let stderr = || {
        proxy
            .as_ref()
            .map(PodProcess::stderr_text)
            .unwrap_or_default()
    };

    // The path: through a proxy the server sees the proxy's upstream socket.
    let c = call(&setup.bins, &setup.client, 0, echo, PAYLOAD as u64)?;
    check_path(
        scenario,
        c.client_local,
        c.server_peer,
        setup.client.ipv4().into(),
    )?;
    let mut client_connections = 1;

    // Warm-up, then the proxy at rest.
    let warm = testapp(
        setup.client.command(&setup.bins.testapp),
        &[
            "bench-connect",
            &echo.to_string(),
            "--duration-ms",
            "500",
            "--concurrency",
            CONCURRENCY,
        ],
        500,
    )?;
    client_connections += warm["connections"].as_u64().unwrap_or(0);
    std::thread::sleep(Duration::from_secs(1));
    let (idle_rss_kib, idle_rss_anon_kib) = match &proxy {
        Some(p) => {
            let (rss, anon) = rss(p.pid())?;
            (Some(rss), Some(anon))
        }
        None => (None, None),
    };

    let duration = args.duration_ms.to_string();
    let payload = PAYLOAD.to_string();
    let time_wait_before = time_wait(&setup.client)?;
    let cpu_before = proxy
        .as_ref()
        .map(|p| proxy_cpu_ticks(p.pid()))
        .transpose()?;
    let connect = testapp(
        setup.client.command(&setup.bins.testapp),
        &[
            "bench-connect",
            &echo.to_string(),
            "--duration-ms",
            &duration,
            "--concurrency",
            CONCURRENCY,
            "--payload",
            &payload,
        ],
        args.duration_ms,
    )?;
    let cpu_after = proxy
        .as_ref()
        .map(|p| proxy_cpu_ticks(p.pid()))
        .transpose()?;
    let conns = connect["connections"].as_u64().unwrap_or(0);
    ensure!(conns > 0, "bench-connect made no connection: {connect}");
    client_connections += conns;
    let proxy_cpu_us_per_conn = cpu_before
        .zip(cpu_after)
        .map(|(b, a)| (a - b) as f64 * TICK_US / conns as f64);

    let rr = testapp(
        setup.client.command(&setup.bins.testapp),
        &[
            "bench-rr",
            &echo.to_string(),
            "--duration-ms",
            &duration,
            "--payload",
            &payload,
        ],
        args.duration_ms,
    )?;
    ensure!(
        rr["round_trips"].as_u64().unwrap_or(0) > 0,
        "bench-rr made no round trip: {rr}"
    );
    client_connections += 1;

    let mut held_rss_kib = None;
    if let Some(p) = &proxy
        && args.connections > 0
    {
        let held = hold(&setup.client, echo, args.connections)?;
        // Let the proxy settle (its buffers, its bookkeeping) before reading.
        std::thread::sleep(Duration::from_millis(300));
        held_rss_kib = Some(rss(p.pid())?.0);
        for (local, peer) in held.iter().map(|s| (s.local, s.peer)) {
            check_path(scenario, local, peer, setup.client.ipv4().into())?;
        }
        client_connections += held.len() as u64;
        drop(held);
    }

    // Give the server's ACCEPT lines (and the proxy's counters) time to arrive.
    std::thread::sleep(Duration::from_millis(300));
    let server_accepts = accepts(app) - accepts_before;
    ensure!(
        server_accepts >= client_connections,
        "{}: the clients made {client_connections} connections but the echo server accepted only {server_accepts}: traffic did not all go through the path under test\n{}",
        scenario.name(),
        stderr()
    );
    let admin_upstream_cx_total = if proxied {
        admin_counter(&setup.client, "cluster.upstream.upstream_cx_total")
    } else {
        None
    };
    if let Some(n) = admin_upstream_cx_total {
        ensure!(
            n >= client_connections,
            "{}: the clients made {client_connections} connections through it but its admin API counts {n} upstream connections",
            scenario.name()
        );
    }
    if let Some(p) = &proxy {
        ensure!(
            p.try_wait().is_none(),
            "{} exited during the run:\n{}",
            p.description(),
            p.stderr_text()
        );
    }
    drop(proxy);

    let iperf = throughput(setup, scenario, args)?;
    Ok(Run {
        round,
        scenario,
        throughput_bps: iperf.bps,
        throughput_bytes: iperf.bytes,
        retransmits: iperf.retransmits,
        proxy_cpu_ms_per_gib: iperf.proxy_cpu_ms_per_gib,
        connect,
        proxy_cpu_us_per_conn,
        rr,
        idle_rss_kib,
        idle_rss_anon_kib,
        held_rss_kib,
        held_connections: if proxied { args.connections } else { 0 },
        client_connections,
        server_accepts,
        admin_upstream_cx_total,
        time_wait_before,
    })
}

/// Direct: the server sees the client's own socket. Proxied: the client talked to the
/// listener on loopback, and the server saw another socket from the client pod's address
/// (the proxy's upstream connection).
fn check_path(
    scenario: Scenario,
    client_local: SocketAddr,
    server_peer: SocketAddr,
    pod_ip: IpAddr,
) -> Result<()> {
    let ok = match scenario {
        Scenario::Direct => server_peer == client_local,
        Scenario::Shunt | Scenario::Envoy => {
            client_local.ip().is_loopback()
                && server_peer.ip() == pod_ip
                && server_peer != client_local
        }
    };
    if !ok {
        bail!(
            "{}: the client's socket is {client_local} and the server saw {server_peer}: the traffic did not take the path under test",
            scenario.name()
        );
    }
    Ok(())
}

/// `ACCEPT` lines the echo server has printed so far (one per connection).
fn accepts(app: &PodProcess) -> u64 {
    app.stdout_text()
        .lines()
        .filter(|l| l.starts_with("ACCEPT "))
        .count() as u64
}

/// A connection held open: both ends as the client and the server saw them.
struct Held {
    _stream: TcpStream,
    local: SocketAddr,
    peer: SocketAddr,
}

/// `n` connections from the client pod to `target`, each through to the server (its
/// `HELLO` read) and with a 64-byte echo done, all left open.
fn hold(client: &Pod, target: SocketAddr, n: usize) -> Result<Vec<Held>> {
    client.run_in_netns(|| -> Result<Vec<Held>> {
        let payload = [0x5a_u8; PAYLOAD];
        let mut held = Vec::with_capacity(n);
        for i in 0..n {
            let context = || format!("held connection {i} to {target}");
            let mut s = TcpStream::connect_timeout(&target, secs(5)).with_context(context)?;
            s.set_read_timeout(Some(secs(10)))?;
            s.set_nodelay(true)?;
            let hello = read_line(&mut s).with_context(context)?;
            let peer = hello
                .split_whitespace()
                .find_map(|f| f.strip_prefix("peer="))
                .and_then(|p| p.parse().ok())
                .with_context(|| format!("{}: malformed HELLO line {hello:?}", context()))?;
            s.write_all(&payload).with_context(context)?;
            let mut echoed = [0u8; PAYLOAD];
            s.read_exact(&mut echoed).with_context(context)?;
            ensure!(echoed == payload, "{}: the echo differs", context());
            held.push(Held {
                local: s.local_addr()?,
                _stream: s,
                peer,
            });
        }
        Ok(held)
    })?
}

fn read_line(s: &mut TcpStream) -> Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 512 {
        match s.read(&mut byte)? {
            0 => bail!(
                "closed before a full line: {:?}",
                String::from_utf8_lossy(&line)
            ),
            _ if byte[0] == b'\n' => return Ok(String::from_utf8_lossy(&line).into_owned()),
            _ => line.push(byte[0]),
        }
    }
    bail!("line longer than 512 bytes")
}

/// A counter from the proxy's admin API (`GET /stats`), if it answers.
pub(crate) fn admin_counter(client: &Pod, name: &str) -> Option<u64> {
    let out = client
        .command("curl")
        .args(["-sf", "-m", "5"])
        .arg(format!("http://127.0.0.1:{ADMIN_PORT}/stats"))
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let stats: HashMap<String, String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect();
    stats.get(name)?.parse().ok()
}

struct Throughput {
    bps: f64,
    bytes: f64,
    retransmits: u64,
    proxy_cpu_ms_per_gib: Option<f64>,
}

/// iperf3 from the client pod to a one-off `iperf3 -s` in the server pod, directly or
/// through a fresh proxy on the iperf3 bootstrap; both ends' JSON reports are checked.
fn throughput(setup: &Setup, scenario: Scenario, args: &L4Args) -> Result<Throughput> {
    let server_addr = setup.server_addr(IPERF_PORT);
    let server = setup
        .server
        .command("iperf3")
        .args(["-s", "-1", "-J", "-p", &IPERF_PORT.to_string(), "-B"])
        .arg(server_addr.ip().to_string())
        .spawn()?;
    wait_for_port(&setup.server, server_addr, secs(10))
        .with_context(|| format!("iperf3 -s:\n{}", server.stderr_text()))?;
    let proxy = setup.start_proxy(scenario, &setup.iperf_bootstrap)?;
    let target = setup.target(scenario, IPERF_PORT);
    let cpu_before = proxy
        .as_ref()
        .map(|p| proxy_cpu_ticks(p.pid()))
        .transpose()?;
    let out = setup
        .client
        .command("iperf3")
        .args([
            "-c",
            &target.ip().to_string(),
            "-p",
            &target.port().to_string(),
        ])
        .args(["-t", &args.iperf_seconds.to_string()])
        .args(["-P", &args.iperf_streams.to_string(), "-J"])
        .timeout(Duration::from_secs(args.iperf_seconds + 60))
        .output()?;
    let cpu_after = proxy
        .as_ref()
        .map(|p| proxy_cpu_ticks(p.pid()))
        .transpose()?;
    let report: Value = serde_json::from_slice(&out.stdout).with_context(|| {
        format!(
            "iperf3 -c printed {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if let Some(err) = report.get("error") {
        bail!("iperf3 -c {target}: {err}");
    }
    // The server's view, printed when its one test ends.
    let mut server = server;
    server.wait_timeout(secs(15))?;
    let server_text = server
        .wait_for_stdout(|l| l == "}", secs(5))
        .map(|_| server.stdout_text())?;
    let server_report: Value = serde_json::from_str(&server_text)
        .with_context(|| format!("iperf3 -s printed {server_text}"))?;
    let ends = |r: &Value, host: &str, port: &str| -> Vec<SocketAddr> {
        r["start"]["connected"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| {
                let ip: IpAddr = c[host].as_str()?.parse().ok()?;
                Some(SocketAddr::new(ip, c[port].as_u64()? as u16))
            })
            .collect()
    };
    let mut client_locals = ends(&report, "local_host", "local_port");
    let mut server_peers = ends(&server_report, "remote_host", "remote_port");
    client_locals.sort();
    server_peers.sort();
    ensure!(
        !client_locals.is_empty() && client_locals.len() == server_peers.len(),
        "iperf3 streams: the client reports {client_locals:?}, the server {server_peers:?}"
    );
    for (local, peer) in client_locals.iter().zip(&server_peers) {
        // Sorted, a direct stream pairs with itself; through a proxy every pair must
        // show a loopback client and a server that saw the client pod's address.
        check_path(scenario, *local, *peer, setup.client.ipv4().into())
            .context("iperf3 data stream")?;
    }
    let received = &report["end"]["sum_received"];
    let bytes = received["bytes"].as_f64().unwrap_or(0.0);
    ensure!(bytes > 0.0, "iperf3 moved nothing: {}", report["end"]);
    if let Some(p) = &proxy {
        ensure!(
            p.try_wait().is_none(),
            "{} exited during iperf3:\n{}",
            p.description(),
            p.stderr_text()
        );
    }
    let gib = bytes / (1u64 << 30) as f64;
    Ok(Throughput {
        bps: received["bits_per_second"].as_f64().unwrap_or(f64::NAN),
        bytes,
        retransmits: report["end"]["sum_sent"]["retransmits"]
            .as_u64()
            .unwrap_or(0),
        proxy_cpu_ms_per_gib: cpu_before
            .zip(cpu_after)
            .map(|(b, a)| (a - b) as f64 * TICK_US / 1000.0 / gib),
    })
}

fn kib_text(kib: Option<u64>) -> String {
    kib.map_or("-".into(), |k| format!("{:.1} MiB", k as f64 / KIB_PER_MIB))
}

struct Report<'a> {
    args: &'a L4Args,
    busy: f64,
    envoy_version: &'a str,
    runs: Vec<Run>,
}

/// Ratio columns: shunt/envoy, then each proxy against direct.
const RATIOS: [(Scenario, Scenario); 3] = [
    (Scenario::Shunt, Scenario::Envoy),
    (Scenario::Shunt, Scenario::Direct),
    (Scenario::Envoy, Scenario::Direct),
];

/// Issue 4's targets, reported (never asserted): metric, label, goal on shunt/envoy.
const GOALS: [(&str, &str, Goal); 5] = [
    (
        "throughput_gbit_s",
        "throughput: shunt >= envoy",
        Goal::RatioAtLeast(1.0),
    ),
    (
        "conn_per_sec",
        "new connections/s: shunt >= envoy",
        Goal::RatioAtLeast(1.0),
    ),
    (
        "connect_p99_us",
        "connect + echo p99: shunt <= envoy",
        Goal::RatioAtMost(1.0),
    ),
    (
        "rr_p99_us",
        "round trip p99: shunt <= envoy",
        Goal::RatioAtMost(1.0),
    ),
    (
        "idle_rss_mib",
        "idle RSS: shunt <= envoy / 4",
        Goal::RatioAtMost(0.25),
    ),
];

impl Report<'_> {
    fn median(&self, scenario: Scenario, metric: &Metric) -> f64 {
        median(
            self.runs
                .iter()
                .filter(|r| r.scenario == scenario)
                .map(metric.get),
        )
    }

    fn ratio(&self, (a, b): (Scenario, Scenario), metric: &Metric) -> f64 {
        self.median(a, metric) / self.median(b, metric)
    }

    /// (label, ratio, met) per goal.
    fn goals(&self) -> Vec<(&'static str, f64, bool)> {
        GOALS
            .iter()
            .map(|(key, label, goal)| {
                let r = self.ratio((Scenario::Shunt, Scenario::Envoy), metric(key));
                let met = goal.met(f64::NAN, r);
                (*label, r, met)
            })
            .collect()
    }

    fn table(&self) -> String {
        let a = self.args;
        let mut t = String::new();
        let _ = writeln!(
            t,
            "bench l4: shunt vs Envoy {} (tcp_proxy to a STATIC cluster of 1, both --concurrency {CONCURRENCY}), medians over rounds: {}; iperf3 {} s x {} stream(s), {} ms per bench-connect (concurrency {CONCURRENCY}) and bench-rr, payload {PAYLOAD} B, {} connections held; kernel {}, {} CPUs",
            self.envoy_version,
            a.rounds,
            a.iperf_seconds,
            a.iperf_streams,
            a.duration_ms,
            a.connections,
            kernel(),
            cpus()
        );
        let _ = writeln!(
            t,
            "{:<42}{:>10}{:>10}{:>10}{:>13}{:>14}{:>14}",
            "", "direct", "shunt", "envoy", "shunt/envoy", "shunt/direct", "envoy/direct"
        );
        for m in METRICS {
            let _ = write!(t, "{:<42}", m.label);
            for s in SCENARIOS {
                let _ = write!(t, "{:>10}", fmt_value(self.median(s, m)));
            }
            for (pair, width) in RATIOS.iter().zip([13, 14, 14]) {
                let ratio = self.ratio(*pair, m);
                let cell = if ratio.is_finite() {
                    format!("{ratio:.2}x")
                } else {
                    "-".into()
                };
                let _ = write!(t, "{cell:>width$}");
            }
            t.push('\n');
        }
        let _ = writeln!(t, "goals (issue 4; reported, not asserted):");
        for (label, ratio, met) in self.goals() {
            let _ = writeln!(
                t,
                "  {label:<40} shunt/envoy {ratio:>5.2}x  {}",
                if met { "met" } else { "NOT met" }
            );
        }
        t
    }

    fn json(&self, setup: &Setup) -> Value {
        let per = |s: Scenario| -> Value {
            METRICS
                .iter()
                .map(|m| (m.key.to_owned(), json!(self.median(s, m))))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let ratio = |pair: (Scenario, Scenario)| -> Value {
            METRICS
                .iter()
                .map(|m| (m.key.to_owned(), json!(self.ratio(pair, m))))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let command = |s: Scenario| {
            setup
                .proxy_command(s, &setup.echo_bootstrap)
                .map(|(p, a)| format!("{} {}", p.display(), a.join(" ")))
        };
        let a = self.args;
        json!({
            "bench": "l4",
            "config": {
                "envoy_version": self.envoy_version,
                "shunt_command": command(Scenario::Shunt),
                "envoy_command": command(Scenario::Envoy),
                "bootstrap_echo": std::fs::read_to_string(&setup.echo_bootstrap).unwrap_or_default(),
                "bootstrap_iperf": std::fs::read_to_string(&setup.iperf_bootstrap).unwrap_or_default(),
                "rounds": a.rounds,
                "duration_ms": a.duration_ms,
                "iperf_seconds": a.iperf_seconds,
                "iperf_streams": a.iperf_streams,
                "connections_held": a.connections,
                "concurrency": CONCURRENCY.parse::<u32>().unwrap_or(0),
                "payload_bytes": PAYLOAD,
                "kernel": kernel(),
                "cpus": cpus(),
                "background_busy_pct": self.busy,
            },
            "median": SCENARIOS.iter().map(|s| (s.name().to_owned(), per(*s))).collect::<serde_json::Map<_, _>>(),
            "ratios": RATIOS.iter().map(|p| (format!("{}/{}", p.0.name(), p.1.name()), ratio(*p))).collect::<serde_json::Map<_, _>>(),
            "goals": self.goals().iter().map(|(label, ratio, met)| json!({"goal": label, "shunt_over_envoy": ratio, "met": met})).collect::<Vec<_>>(),
            "runs": self.runs,
        })
    }
}
