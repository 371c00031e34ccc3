//! `cargo xtask bench http`: shunt, Envoy, haproxy and nginx as HTTP reverse proxies
//! side by side, one worker each, in front of the same 64-byte nginx answer (issue 15).
//!
//! A node with pods `client` and `server`. The server pod runs the upstream: nginx
//! answering `200` with 64 bytes on :8080 (HTTP/1.1). The proxy under test runs in the
//! client pod (a sidecar's place) on 127.0.0.1:10000, with a route table of six virtual
//! hosts (`svc0.bench.local` .. `svc5.bench.local`, two routes each); the load asks for
//! the last host, so every lookup walks the table. shunt and Envoy run one bootstrap
//! file; haproxy (`nbthread 1`) and nginx (`worker_processes 1`) get the same host
//! routing in their own words, with upstream keep-alive. Scenarios: `direct` (the load
//! at the upstream itself), `shunt`, `envoy`, `haproxy`, `nginx`, in rounds whose order
//! alternates; medians are reported.
//!
//! Loads: HTTP/1.1 keep-alive (`wrk -t1 -c50 --latency`) and h2 downstream to the h1
//! upstream (`h2load -c10 -m10`, prior knowledge; haproxy and nginx take it on a second
//! port, :10001, since neither sniffs the preface on a cleartext HTTP/1.1 port). Every
//! run must be clean: wrk's non-2xx/3xx and socket error counts zero, every h2load
//! request logged with status 200, or the bench stops rather than print the figures.
//!
//! `--mtls` adds the sidecar pair (`http_mtls.rs`): shunt's and Envoy's client sidecar
//! (this route table) -> mTLS, h2 -> server sidecar -> nginx, the same two bootstraps
//! for both; a pair's CPU and RSS are the two sidecars' summed.
//!
//! `--tracing` adds shunt and Envoy tracing every request's span (OpenTelemetry, OTLP
//! over gRPC, as istiod writes a Telemetry provider) at 1 % and 100 % random sampling,
//! exported to a sink the upstream nginx serves (every export answered grpc-status 0).
//!
//! `--flamegraph` records shunt under each load (`perf record --call-graph dwarf`) and
//! writes `target/bench/http-shunt-h1.svg` and `-h2.svg` (folded with `inferno`).
//!
//! `--instructions` counts the user-space instructions per request of shunt, haproxy,
//! nginx and `--before` under callgrind (`instructions.rs`): figures that do not drift
//! with the machine. `--wakeups` counts, for the same proxies, the wake-ups they cause
//! and their sends, receives and `epoll_wait`s per request (`perf stat`, `wakeups.rs`).

mod instructions;
pub(super) mod wakeups;

use std::{
    fmt::Write as _,
    io::BufReader,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};
use harness::{Node, Pod, PodProcess, tcp_listeners, wait_for_port};
use inferno::collapse::Collapse as _;
use serde::Serialize;
use serde_json::{Value, json};

use super::http_mtls;
use super::l4::{admin_counter, envoy_version, validate};
use super::measure::{
    KIB_PER_MIB, TICK_US, background_busy, cpus, fmt_value, kernel, median, proxy_cpu_ticks, rss,
    save,
};
use crate::pods::{Bins, secs, target_dir};

#[derive(clap::Args)]
pub struct HttpArgs {
    /// Length of each measured load run, in seconds (after a 1 s warm-up run).
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Rounds of all scenarios (the order alternates); medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// wrk's connections (HTTP/1.1 keep-alive, one thread).
    #[arg(long, default_value_t = 50)]
    connections: u32,
    /// Also record shunt under each load and write target/bench/http-shunt-{h1,h2}.svg.
    #[arg(long)]
    flamegraph: bool,
    /// Also count the user-space instructions per request (callgrind) of shunt,
    /// haproxy, nginx and `--before`: the same for the same build on any machine.
    #[arg(long)]
    instructions: bool,
    /// Also count the tasks each of those proxies wakes and its sends, receives and
    /// epoll waits per request (perf stat on the kernel's tracepoints).
    #[arg(long)]
    wakeups: bool,
    /// Only these scenarios (comma-separated: direct,shunt,envoy,haproxy,nginx).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Another shunt binary (an earlier build) run as scenario `before` in the same
    /// rounds: a change's gain, side by side.
    #[arg(long)]
    before: Option<PathBuf>,
    /// Also run shunt and Envoy with an HTTP RBAC filter of 20 policies in front of
    /// the route (the request matches only the last): scenarios `shunt-rbac`,
    /// `envoy-rbac`, and the overhead per request against `shunt` / `envoy`.
    #[arg(long)]
    rbac: bool,
    /// Also run the mTLS sidecar pair (client sidecar -> mTLS, h2 -> server sidecar ->
    /// nginx), shunt's pair and Envoy's on the same two bootstraps: scenarios
    /// `shunt-mtls`, `envoy-mtls`; CPU and RSS are summed over the two sidecars.
    #[arg(long)]
    mtls: bool,
    /// Also run shunt and Envoy tracing every request's span to an OTLP/gRPC sink (the
    /// upstream nginx, answering every export with grpc-status 0), at 1 % and 100 %
    /// random sampling: scenarios `shunt-tr1`, `envoy-tr1`, `shunt-tr100`,
    /// `envoy-tr100`, and their ratios to the untraced `shunt` / `envoy`.
    #[arg(long)]
    tracing: bool,
    /// Measure shunt as a profile-guided build (`pgo.rs`): an instrumented build runs
    /// a short training load first (h1 and h2 through the plain, RBAC and mTLS
    /// bootstraps). The plain release build runs beside it as `shunt-plain`.
    #[arg(long)]
    pgo: bool,
    /// Measure the debug build (a quick check that the bench runs; its figures are not
    /// shunt's).
    #[arg(long)]
    pub debug: bool,
    /// `cargo xtask pgo`: stop after the profile-guided build, measuring nothing.
    #[arg(skip)]
    pgo_only: bool,
}

/// `cargo xtask pgo`: the profile-guided build alone, trained as `bench http --pgo`
/// trains it (the same pods, upstream and bootstraps); returns the binary.
pub fn pgo(bins: Bins) -> Result<PathBuf> {
    // Parsed, not written out: the training load takes the bench's own defaults.
    #[derive(clap::Parser)]
    struct Bench {
        #[command(flatten)]
        http: HttpArgs,
    }
    let mut args = <Bench as clap::Parser>::try_parse_from(["http", "--pgo", "--only=shunt"])?.http;
    args.pgo_only = true;
    run(bins, &args)?.context("the PGO build returned no binary")
}

/// How many RBAC policies the `--rbac` scenarios evaluate per request.
const RBAC_POLICIES: usize = 20;

const H1_PORT: u16 = 10000;
/// haproxy's and nginx's h2 (prior knowledge) listener; shunt and Envoy take h2 on
/// H1_PORT (`codec_type: AUTO`).
const H2_PORT: u16 = 10001;
const ADMIN_PORT: u16 = 15000;
const UPSTREAM_PORT: u16 = 8080;
const UPSTREAM_H2_PORT: u16 = 8081;
/// The upstream nginx's OTLP/gRPC sink (`--tracing`): every export answered OK.
const OTLP_SINK_PORT: u16 = 4317;
const VIRTUAL_HOSTS: usize = 6;
/// The host every request names: the last virtual host.
const HOST: &str = "svc5.bench.local";
const BODY: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcde\n";
const H2_CLIENTS: &str = "10";
const H2_STREAMS: &str = "10";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Scenario {
    Direct,
    Shunt,
    Envoy,
    Haproxy,
    Nginx,
    /// `--before`'s shunt binary.
    Before,
    /// The plain release build, when `--pgo` makes `shunt` the profile-guided one.
    ShuntPlain,
    /// shunt and Envoy with 20 RBAC policies in front of the route (`--rbac`).
    ShuntRbac,
    EnvoyRbac,
    /// The sidecar pair over mTLS (`--mtls`).
    ShuntMtls,
    EnvoyMtls,
    /// shunt and Envoy reporting spans at 1 % and 100 % random sampling (`--tracing`).
    ShuntTrace1,
    EnvoyTrace1,
    ShuntTrace100,
    EnvoyTrace100,
}

const SCENARIOS: [Scenario; 5] = [
    Scenario::Direct,
    Scenario::Shunt,
    Scenario::Envoy,
    Scenario::Haproxy,
    Scenario::Nginx,
];

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Direct => "direct",
            Scenario::Shunt => "shunt",
            Scenario::Envoy => "envoy",
            Scenario::Haproxy => "haproxy",
            Scenario::Nginx => "nginx",
            Scenario::Before => "before",
            Scenario::ShuntPlain => "shunt-plain",
            Scenario::ShuntRbac => "shunt-rbac",
            Scenario::EnvoyRbac => "envoy-rbac",
            Scenario::ShuntMtls => "shunt-mtls",
            Scenario::EnvoyMtls => "envoy-mtls",
            Scenario::ShuntTrace1 => "shunt-tr1",
            Scenario::EnvoyTrace1 => "envoy-tr1",
            Scenario::ShuntTrace100 => "shunt-tr100",
            Scenario::EnvoyTrace100 => "envoy-tr100",
        }
    }

    fn is_mtls_pair(self) -> bool {
        matches!(self, Scenario::ShuntMtls | Scenario::EnvoyMtls)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Load {
    H1,
    H2,
}

impl Load {
    fn name(self) -> &'static str {
        match self {
            Load::H1 => "h1",
            Load::H2 => "h2",
        }
    }
}

/// What is fixed for the whole bench.
struct Setup {
    /// `bins.shunt` is the shunt measured: the profile-guided build under `--pgo`.
    bins: Bins,
    before: Option<PathBuf>,
    /// The plain release build under `--pgo` (scenario `shunt-plain`).
    plain: Option<PathBuf>,
    envoy: PathBuf,
    envoy_version: String,
    haproxy_version: String,
    nginx_version: String,
    client: Pod,
    server: Pod,
    dir: PathBuf,
    /// shunt's and Envoy's bootstrap.
    bootstrap: PathBuf,
    /// The same with [`RBAC_POLICIES`] RBAC policies (`--rbac`).
    bootstrap_rbac: PathBuf,
    /// The same tracing at 1 % and 100 % (`--tracing`).
    bootstrap_trace1: PathBuf,
    bootstrap_trace100: PathBuf,
    /// The mTLS pair's client and server sidecars (`--mtls`).
    bootstrap_mtls_client: PathBuf,
    bootstrap_mtls_server: PathBuf,
    haproxy_config: PathBuf,
    nginx_config: PathBuf,
}

impl Setup {
    fn upstream(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.server.ipv4().into(), port)
    }

    /// The server sidecar's listener (`--mtls`).
    fn mtls_server(&self) -> SocketAddr {
        SocketAddr::new(self.server.ipv4().into(), http_mtls::MTLS_PORT)
    }

    /// Where the load goes for `scenario` and `load`.
    fn target(&self, scenario: Scenario, load: Load) -> SocketAddr {
        let local = |port| SocketAddr::from(([127, 0, 0, 1], port));
        match (scenario, load) {
            (Scenario::Direct, Load::H1) => self.upstream(UPSTREAM_PORT),
            (Scenario::Direct, Load::H2) => self.upstream(UPSTREAM_H2_PORT),
            (
                Scenario::Shunt
                | Scenario::Envoy
                | Scenario::Before
                | Scenario::ShuntPlain
                | Scenario::ShuntRbac
                | Scenario::EnvoyRbac
                | Scenario::ShuntMtls
                | Scenario::EnvoyMtls
                | Scenario::ShuntTrace1
                | Scenario::EnvoyTrace1
                | Scenario::ShuntTrace100
                | Scenario::EnvoyTrace100,
                _,
            )
            | (_, Load::H1) => local(H1_PORT),
            (_, Load::H2) => local(H2_PORT),
        }
    }

    /// The processes `scenario` runs, in start order: each with its pod, command line
    /// and the addresses it must listen on before the next starts. A pair's server
    /// sidecar comes first, so the client sidecar's first request finds it.
    fn launches(&self, scenario: Scenario) -> Result<Vec<Launch<'_>>> {
        let file = |p: &Path| p.display().to_string();
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let shunt = |bootstrap: &Path| {
            args(&[
                "proxy",
                "-c",
                &file(bootstrap),
                "--concurrency",
                "1",
                "--keep-user",
                "--log-level",
                "warn",
            ])
        };
        let envoy = |bootstrap: &Path| {
            args(&[
                "-c",
                &file(bootstrap),
                "--concurrency",
                "1",
                "-l",
                "warning",
                "--disable-hot-restart",
            ])
        };
        let front = |program: PathBuf, args: Vec<String>| {
            let mut listens = vec![
                self.target(scenario, Load::H1),
                self.target(scenario, Load::H2),
            ];
            listens.dedup();
            Launch {
                pod: &self.client,
                program,
                args,
                listens,
            }
        };
        Ok(match scenario {
            Scenario::Direct => vec![],
            Scenario::Shunt => vec![front(self.bins.shunt.clone(), shunt(&self.bootstrap))],
            Scenario::Before => vec![front(
                self.before.clone().context("--before has no binary")?,
                shunt(&self.bootstrap),
            )],
            Scenario::ShuntPlain => vec![front(
                self.plain
                    .clone()
                    .context("shunt-plain runs only with --pgo")?,
                shunt(&self.bootstrap),
            )],
            Scenario::ShuntRbac => {
                vec![front(self.bins.shunt.clone(), shunt(&self.bootstrap_rbac))]
            }
            Scenario::Envoy => vec![front(self.envoy.clone(), envoy(&self.bootstrap))],
            Scenario::EnvoyRbac => vec![front(self.envoy.clone(), envoy(&self.bootstrap_rbac))],
            Scenario::ShuntTrace1 => {
                vec![front(
                    self.bins.shunt.clone(),
                    shunt(&self.bootstrap_trace1),
                )]
            }
            Scenario::EnvoyTrace1 => vec![front(self.envoy.clone(), envoy(&self.bootstrap_trace1))],
            Scenario::ShuntTrace100 => {
                vec![front(
                    self.bins.shunt.clone(),
                    shunt(&self.bootstrap_trace100),
                )]
            }
            Scenario::EnvoyTrace100 => {
                vec![front(self.envoy.clone(), envoy(&self.bootstrap_trace100))]
            }
            Scenario::ShuntMtls | Scenario::EnvoyMtls => {
                let (program, server_args, client_args) = if scenario == Scenario::ShuntMtls {
                    (
                        &self.bins.shunt,
                        shunt(&self.bootstrap_mtls_server),
                        shunt(&self.bootstrap_mtls_client),
                    )
                } else {
                    (
                        &self.envoy,
                        envoy(&self.bootstrap_mtls_server),
                        envoy(&self.bootstrap_mtls_client),
                    )
                };
                vec![
                    Launch {
                        pod: &self.server,
                        program: program.clone(),
                        args: server_args,
                        listens: vec![self.mtls_server()],
                    },
                    front(program.clone(), client_args),
                ]
            }
            Scenario::Haproxy => vec![front(
                "/usr/sbin/haproxy".into(),
                args(&["-db", "-f", &file(&self.haproxy_config)]),
            )],
            Scenario::Nginx => vec![front(
                "/usr/sbin/nginx".into(),
                args(&["-p", &file(&self.dir), "-c", &file(&self.nginx_config)]),
            )],
        })
    }

    /// The proxies of `scenario` (none for direct), each once it listens.
    fn start_proxy(&self, scenario: Scenario) -> Result<Vec<PodProcess>> {
        let mut started = Vec::new();
        for launch in self.launches(scenario)? {
            let stale = tcp_listeners(launch.pod)?;
            ensure!(
                !stale
                    .iter()
                    .any(|a| launch.listens.iter().any(|l| l.port() == a.port())),
                "before starting {}: something already listens on {:?} in pod {}: {stale:?}",
                scenario.name(),
                launch.listens,
                launch.pod.name(),
            );
            let proxy = launch
                .pod
                .command(launch.program)
                .args(launch.args)
                .spawn()?;
            for &address in &launch.listens {
                wait_for_port(launch.pod, address, secs(30)).with_context(|| {
                    format!(
                        "{} did not listen on {address}:\n{}",
                        proxy.description(),
                        proxy.stderr_text()
                    )
                })?;
            }
            started.push(proxy);
        }
        Ok(started)
    }
}

/// One proxy process of a scenario.
struct Launch<'a> {
    pod: &'a Pod,
    program: PathBuf,
    args: Vec<String>,
    listens: Vec<SocketAddr>,
}

/// One load against one scenario, once.
#[derive(Serialize)]
struct Run {
    round: usize,
    scenario: Scenario,
    load: Load,
    requests: u64,
    req_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    proxy_cpu_us_per_req: Option<f64>,
    /// The proxy's VmRSS right after the run.
    rss_kib: Option<u64>,
}

struct Metric {
    key: &'static str,
    label: &'static str,
    get: fn(&Run) -> f64,
}

const METRICS: &[Metric] = &[
    Metric {
        key: "req_per_sec",
        label: "requests/s",
        get: |r| r.req_per_sec,
    },
    Metric {
        key: "p50_us",
        label: "  latency p50 (us)",
        get: |r| r.p50_us,
    },
    Metric {
        key: "p99_us",
        label: "  latency p99 (us)",
        get: |r| r.p99_us,
    },
    Metric {
        key: "proxy_cpu_us_per_req",
        label: "  proxy CPU per request (us)",
        get: |r| r.proxy_cpu_us_per_req.unwrap_or(f64::NAN),
    },
    Metric {
        key: "rss_mib",
        label: "  proxy RSS after the run (MiB)",
        get: |r| r.rss_kib.map_or(f64::NAN, |k| k as f64 / KIB_PER_MIB),
    },
];

/// Bench-only Debian packages, installed on first use (not by `cargo xtask setup`).
const TOOLS: &[(&str, &str)] = &[("haproxy", "haproxy"), ("wrk", "wrk")];
const PERF: &[(&str, &str)] = &[("linux-perf", "perf")];

/// Returns the profile-guided build under `pgo_only`, else measures and returns `None`.
pub fn run(bins: Bins, args: &HttpArgs) -> Result<Option<PathBuf>> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(args.seconds > 0, "--seconds must be at least 1");
    let mut scenarios: Vec<Scenario> = if args.only.is_empty() {
        SCENARIOS.to_vec()
    } else {
        args.only
            .iter()
            .map(|name| {
                SCENARIOS
                    .into_iter()
                    .find(|s| s.name() == name)
                    .with_context(|| {
                        format!(
                            "--only: no scenario {name:?} (direct, shunt, envoy, haproxy, nginx)"
                        )
                    })
            })
            .collect::<Result<_>>()?
    };
    if let Some(before) = &args.before {
        ensure!(before.is_file(), "--before: no file {}", before.display());
        scenarios.insert(scenarios.len().min(2), Scenario::Before);
    }
    if args.rbac {
        scenarios.extend([Scenario::ShuntRbac, Scenario::EnvoyRbac]);
    }
    if args.mtls {
        scenarios.extend([Scenario::ShuntMtls, Scenario::EnvoyMtls]);
    }
    if args.tracing {
        scenarios.extend([
            Scenario::ShuntTrace1,
            Scenario::EnvoyTrace1,
            Scenario::ShuntTrace100,
            Scenario::EnvoyTrace100,
        ]);
    }
    if args.pgo {
        let at = scenarios.iter().position(|s| *s == Scenario::Shunt);
        scenarios.insert(at.map_or(0, |i| i + 1), Scenario::ShuntPlain);
    }
    crate::setup::ensure_packages(TOOLS)?;
    if args.flamegraph || args.wakeups {
        crate::setup::ensure_packages(PERF)?;
    }
    if args.instructions {
        crate::setup::ensure_packages(instructions::VALGRIND)?;
    }
    let envoy = crate::setup::envoy()?;
    let envoy_version = envoy_version(&envoy)?;
    let haproxy_version = first_line("/usr/sbin/haproxy", &["-v"])?;
    let nginx_version = first_line("/usr/sbin/nginx", &["-v"])?;
    harness::raise_open_files_limit();

    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let dir = target_dir().join("bench/http");
    std::fs::create_dir_all(&dir)?;
    let mut setup = Setup {
        bins,
        before: args.before.clone(),
        plain: None,
        envoy,
        envoy_version,
        haproxy_version,
        nginx_version,
        bootstrap: dir.join("bootstrap.yaml"),
        bootstrap_rbac: dir.join("bootstrap-rbac.yaml"),
        bootstrap_trace1: dir.join("bootstrap-trace1.yaml"),
        bootstrap_trace100: dir.join("bootstrap-trace100.yaml"),
        bootstrap_mtls_client: dir.join("bootstrap-mtls-client.yaml"),
        bootstrap_mtls_server: dir.join("bootstrap-mtls-server.yaml"),
        haproxy_config: dir.join("haproxy.cfg"),
        nginx_config: dir.join("nginx-proxy.conf"),
        dir: dir.clone(),
        client,
        server,
    };
    let upstream = setup.upstream(UPSTREAM_PORT);
    std::fs::write(&setup.bootstrap, bootstrap(upstream))?;
    validate(&setup.bins.shunt, &setup.envoy, &setup.bootstrap)?;
    // The training load (`--pgo`) runs through every bootstrap.
    if args.rbac || args.pgo {
        std::fs::write(&setup.bootstrap_rbac, bootstrap_rbac(upstream))?;
        validate(&setup.bins.shunt, &setup.envoy, &setup.bootstrap_rbac)?;
    }
    if args.tracing {
        let sink = setup.upstream(OTLP_SINK_PORT);
        for (file, percent) in [
            (&setup.bootstrap_trace1, 1.0),
            (&setup.bootstrap_trace100, 100.0),
        ] {
            std::fs::write(file, bootstrap_tracing(upstream, sink, percent))?;
            validate(&setup.bins.shunt, &setup.envoy, file)?;
        }
    }
    let pki = if args.mtls || args.pgo {
        let pki = http_mtls::pki(&dir.join("pki")).context("the mTLS pair's certificates")?;
        std::fs::write(
            &setup.bootstrap_mtls_client,
            http_mtls::client_bootstrap(&bootstrap(setup.mtls_server()), &pki),
        )?;
        std::fs::write(
            &setup.bootstrap_mtls_server,
            http_mtls::server_bootstrap(setup.mtls_server(), UPSTREAM_PORT, ADMIN_PORT, &pki),
        )?;
        for file in [&setup.bootstrap_mtls_client, &setup.bootstrap_mtls_server] {
            validate(&setup.bins.shunt, &setup.envoy, file)?;
        }
        Some(pki)
    } else {
        None
    };
    std::fs::write(&setup.haproxy_config, haproxy_config(upstream))?;
    std::fs::write(&setup.nginx_config, nginx_proxy_config(&dir, upstream))?;
    let upstream_dir = dir.join("upstream");
    std::fs::create_dir_all(&upstream_dir)?;
    std::fs::write(
        upstream_dir.join("nginx.conf"),
        nginx_upstream_config(&upstream_dir),
    )?;
    let app = setup
        .server
        .command("/usr/sbin/nginx")
        .args(["-p"])
        .arg(&upstream_dir)
        .arg("-c")
        .arg(upstream_dir.join("nginx.conf"))
        .spawn()?;
    for port in [UPSTREAM_PORT, UPSTREAM_H2_PORT, OTLP_SINK_PORT] {
        wait_for_port(&setup.server, setup.upstream(port), secs(10))
            .with_context(|| format!("upstream nginx:\n{}", app.stderr_text()))?;
    }

    if args.pgo {
        let instrumented = crate::pgo::instrumented()?;
        let plain = std::mem::replace(&mut setup.bins.shunt, instrumented.shunt.clone());
        train(&setup, args).context("the PGO training load")?;
        setup.bins.shunt = instrumented.optimize()?;
        setup.plain = Some(plain);
        if args.pgo_only {
            return Ok(Some(setup.bins.shunt));
        }
    }

    let busy = background_busy()?;
    println!(
        "bench http: client pod {} -> [127.0.0.1:{H1_PORT} shunt | envoy {} | {} | {}] -> nginx in server pod {upstream}; one worker each; {VIRTUAL_HOSTS} virtual hosts, Host: {HOST}; rounds {}, {} s per run; machine busy {busy:.0}% before starting",
        setup.client.ipv4(),
        setup.envoy_version,
        setup.haproxy_version,
        setup.nginx_version,
        args.rounds,
        args.seconds,
    );
    println!("  configs in {}", dir.display());
    if busy > 10.0 {
        println!("  warning: something else is using the CPU; numbers will be noisy");
    }

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        let mut order = scenarios.clone();
        if round % 2 == 0 {
            order.reverse();
        }
        for &scenario in &order {
            let pair = measure(&setup, scenario, round, args)
                .with_context(|| format!("round {round}, scenario {}", scenario.name()))?;
            for run in pair {
                println!(
                    "  round {round} {:<8} {:<3} {:>8.0} req/s p50 {:>6} us p99 {:>6} us | CPU {:>5} us/req | RSS {}",
                    scenario.name(),
                    if run.load == Load::H1 { "h1" } else { "h2" },
                    run.req_per_sec,
                    fmt_value(run.p50_us),
                    fmt_value(run.p99_us),
                    run.proxy_cpu_us_per_req
                        .map_or("-".into(), |v| format!("{v:.1}")),
                    run.rss_kib
                        .map_or("-".into(), |k| format!("{:.1} MiB", k as f64 / KIB_PER_MIB)),
                );
                runs.push(run);
            }
        }
    }

    if args.flamegraph {
        flamegraph(&setup, args)?;
    }
    let counted: Vec<Scenario> = scenarios
        .iter()
        .copied()
        .filter(|s| {
            matches!(
                s,
                Scenario::Shunt
                    | Scenario::ShuntPlain
                    | Scenario::Before
                    | Scenario::Haproxy
                    | Scenario::Nginx
            )
        })
        .collect();
    let counts = if args.instructions {
        instructions::run(&setup, &counted)?
    } else {
        Vec::new()
    };
    let wakeup_counts = if args.wakeups {
        wakeups::run(&setup, &counted)?
    } else {
        Vec::new()
    };
    drop(app);
    drop(pki);
    drop(node);

    let report = Report {
        args,
        busy,
        scenarios,
        runs,
    };
    let mut text = report.table(&setup);
    let mut json = report.json(&setup);
    if !counts.is_empty() {
        text.push_str(&instructions::table(&counts));
        json["instructions"] = instructions::json(&counts);
    }
    if !wakeup_counts.is_empty() {
        text.push_str(&wakeups::table(&wakeup_counts));
        json["wakeups"] = wakeups::json(&wakeup_counts);
    }
    print!("\n{text}");
    save("http", &text, &json)?;
    Ok(None)
}

fn first_line(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text.lines().next().unwrap_or_default();
    // "HAProxy version 2.6.12-1 ..." / "nginx version: nginx/1.22.1"
    Ok(line
        .replace("HAProxy version ", "haproxy ")
        .replace("nginx version: nginx/", "nginx ")
        .split(" - ")
        .next()
        .unwrap_or_default()
        .to_owned())
}

/// [`bootstrap`] to a fixed upstream, for other modules' tests.
#[cfg(test)]
pub(crate) fn bootstrap_for_tests() -> String {
    bootstrap(SocketAddr::from(([10, 0, 0, 3], UPSTREAM_PORT)))
}

/// Six virtual hosts, two routes each, to one STATIC cluster; h1 and h2 downstream
/// (`codec_type: AUTO`), no access log: shunt and Envoy both run this file.
fn bootstrap(upstream: SocketAddr) -> String {
    let mut hosts = String::new();
    for i in 0..VIRTUAL_HOSTS {
        let _ = write!(
            hosts,
            r#"
            - name: svc{i}
              domains: ["svc{i}.bench.local", "svc{i}.bench.local:*"]
              routes:
              - match: {{ prefix: "/api/" }}
                route: {{ cluster: upstream, timeout: 5s }}
              - match: {{ prefix: "/" }}
                route: {{ cluster: upstream }}"#
        );
    }
    let (ip, port) = (upstream.ip(), upstream.port());
    format!(
        r#"# Written by `cargo xtask bench http`; shunt and Envoy both run this file.
admin:
  address:
    socket_address: {{ address: 127.0.0.1, port_value: {ADMIN_PORT} }}
static_resources:
  listeners:
  - name: http
    address:
      socket_address: {{ address: 127.0.0.1, port_value: {H1_PORT} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: bench
          codec_type: AUTO
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
          route_config:
            name: bench
            virtual_hosts:{hosts}
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

/// [`bootstrap`] with the HCM tracing every request to the OTLP sink at `sink`, as
/// istiod writes a Telemetry resource's OpenTelemetry provider (Istio's custom tags,
/// the UUID request id extension), at `percent` random sampling.
fn bootstrap_tracing(upstream: SocketAddr, sink: SocketAddr, percent: f64) -> String {
    let tracing = format!(
        r#"          codec_type: AUTO
          request_id_extension:
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig
              use_request_id_for_trace_sampling: true
          tracing:
            client_sampling: {{ value: 100 }}
            random_sampling: {{ value: {percent} }}
            overall_sampling: {{ value: 100 }}
            custom_tags:
            - {{ tag: istio.canonical_revision, literal: {{ value: latest }} }}
            - {{ tag: istio.canonical_service, literal: {{ value: bench }} }}
            - {{ tag: istio.mesh_id, literal: {{ value: cluster.local }} }}
            - {{ tag: istio.namespace, literal: {{ value: default }} }}
            provider:
              name: envoy.tracers.opentelemetry
              typed_config:
                "@type": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig
                service_name: bench.default
                grpc_service:
                  envoy_grpc: {{ cluster_name: otlp }}
"#
    );
    let (ip, port) = (sink.ip(), sink.port());
    let sink_cluster = format!(
        r#"  - name: otlp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: otlp
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              socket_address: {{ address: {ip}, port_value: {port} }}
"#
    );
    bootstrap(upstream)
        .replace("          codec_type: AUTO\n", &tracing)
        .replace("  clusters:\n", &format!("  clusters:\n{sink_cluster}"))
}

/// [`bootstrap`] with an HTTP RBAC filter before the router: [`RBAC_POLICIES`] ALLOW
/// policies, each a header and a path prefix the load never sends but the last,
/// which allows every path; policies are tried in name order, so each request
/// evaluates all of them.
fn bootstrap_rbac(upstream: SocketAddr) -> String {
    let mut policies = String::new();
    for i in 0..RBAC_POLICIES {
        let last = i + 1 == RBAC_POLICIES;
        let (prefix, principal) = if last {
            ("/".to_owned(), "{ any: true }".to_owned())
        } else {
            (
                format!("/tenant-{i}/"),
                format!(
                    "{{ header: {{ name: x-tenant, string_match: {{ exact: tenant-{i} }} }} }}"
                ),
            )
        };
        let _ = write!(
            policies,
            r#"
                  p{i:02}:
                    permissions:
                    - and_rules:
                        rules:
                        - url_path: {{ path: {{ prefix: "{prefix}" }} }}
                        - header: {{ name: ":method", string_match: {{ exact: GET }} }}
                    principals:
                    - {principal}"#
        );
    }
    bootstrap(upstream).replace(
        "          http_filters:\n",
        &format!(
            r#"          http_filters:
          - name: envoy.filters.http.rbac
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC
              rules:
                action: ALLOW
                policies:{policies}
"#
        ),
    )
}

/// The same host routing for haproxy: one thread, h1 on H1_PORT, h2 on H2_PORT, upstream
/// connections kept alive and shared.
fn haproxy_config(upstream: SocketAddr) -> String {
    let mut rules = String::new();
    for i in 0..VIRTUAL_HOSTS {
        let _ = writeln!(
            rules,
            "  use_backend upstream if {{ req.hdr(host),field(1,:) -m str svc{i}.bench.local }}"
        );
    }
    format!(
        "# Written by `cargo xtask bench http`: the bootstrap's routes for haproxy.\n\
         global\n  nbthread 1\n  maxconn 4096\n\
         defaults\n  mode http\n  timeout connect 1s\n  timeout client 30s\n  timeout server 30s\n  http-reuse always\n\
         frontend http\n  bind 127.0.0.1:{H1_PORT}\n  bind 127.0.0.1:{H2_PORT} proto h2\n{rules}\
         backend upstream\n  server nginx {upstream}\n"
    )
}

/// The same host routing for nginx as a reverse proxy: one worker, h2 on H2_PORT.
fn nginx_proxy_config(dir: &Path, upstream: SocketAddr) -> String {
    let mut servers = String::new();
    for i in 0..VIRTUAL_HOSTS {
        let _ = writeln!(
            servers,
            " server {{ listen 127.0.0.1:{H1_PORT}; listen 127.0.0.1:{H2_PORT} http2; server_name svc{i}.bench.local;\n  \
             location /api/ {{ proxy_pass http://upstream; proxy_http_version 1.1; proxy_set_header Connection \"\"; }}\n  \
             location / {{ proxy_pass http://upstream; proxy_http_version 1.1; proxy_set_header Connection \"\"; }} }}"
        );
    }
    // A host outside the table gets 404, as from Envoy (nginx would use the first server).
    format!(
        "# Written by `cargo xtask bench http`: the bootstrap's routes for nginx.\n{}\
         http {{\n{}\
         server {{ listen 127.0.0.1:{H1_PORT} default_server; listen 127.0.0.1:{H2_PORT} http2 default_server; return 404; }}\n\
         upstream upstream {{ server {upstream}; keepalive 64; keepalive_requests 1000000; }}\n{servers}}}\n",
        nginx_common(dir, "proxy"),
        nginx_http_common(dir),
    )
}

/// The upstream: 200 and 64 bytes, h1 on UPSTREAM_PORT, h2c on UPSTREAM_H2_PORT.
fn nginx_upstream_config(dir: &Path) -> String {
    format!(
        "{}http {{\n{}\
         server {{ listen {UPSTREAM_PORT} reuseport backlog=4096; listen {UPSTREAM_H2_PORT} http2; location / {{ default_type text/plain; return 200 \"{}\"; }} }}\n\
         server {{ listen {OTLP_SINK_PORT} http2; location / {{ default_type application/grpc; add_header grpc-status 0 always; return 200; }} }}\n}}\n",
        nginx_common(dir, "upstream"),
        nginx_http_common(dir),
        BODY.escape_default(),
    )
}

fn nginx_common(dir: &Path, name: &str) -> String {
    let d = dir.display();
    format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\nworker_rlimit_nofile 65536;\n\
         pid {d}/{name}.pid;\nerror_log {d}/{name}-error.log;\n\
         events {{ worker_connections 16384; }}\n"
    )
}

fn nginx_http_common(dir: &Path) -> String {
    let d = dir.display();
    format!(
        " access_log off;\n keepalive_requests 1000000;\n http2_max_requests 1000000;\n\
         client_body_temp_path {d}/body;\n proxy_temp_path {d}/proxy;\n fastcgi_temp_path {d}/fastcgi;\n\
         uwsgi_temp_path {d}/uwsgi;\n scgi_temp_path {d}/scgi;\n"
    )
}

/// How long each load of the PGO training runs, per bootstrap.
const TRAIN_SECONDS: u64 = 3;

/// The PGO training load (`--pgo`): the measured loads, shorter, through each of
/// shunt's bootstraps (plain, RBAC, the mTLS pair), with `setup.bins.shunt` the
/// instrumented build. Each proxy is then stopped with SIGTERM: the counters are written
/// when it exits.
fn train(setup: &Setup, args: &HttpArgs) -> Result<()> {
    for scenario in [Scenario::Shunt, Scenario::ShuntRbac, Scenario::ShuntMtls] {
        println!("  PGO training: {}", scenario.name());
        let mut proxies = setup.start_proxy(scenario)?;
        check_answer(setup, scenario, &proxies)?;
        for load in [Load::H1, Load::H2] {
            load_run(
                setup,
                load,
                setup.target(scenario, load),
                TRAIN_SECONDS,
                args,
            )
            .with_context(|| format!("{} {}", scenario.name(), load.name()))?;
        }
        for proxy in &mut proxies {
            stop(proxy)?;
        }
    }
    Ok(())
}

/// SIGTERM, then the exit: shunt drains and returns from main, which runs the exit
/// handlers (the profile's among them). Killing it would lose the counters.
fn stop(proxy: &mut PodProcess) -> Result<()> {
    let pid = libc::pid_t::try_from(proxy.pid())?;
    // SAFETY: kill(2) on the child we spawned and have not reaped.
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    ensure!(
        sent == 0,
        "SIGTERM to {}: {}",
        proxy.description(),
        std::io::Error::last_os_error()
    );
    let status = proxy.wait_timeout(secs(30))?;
    ensure!(
        status.success(),
        "{} exited with {status} on SIGTERM:\n{}",
        proxy.description(),
        proxy.stderr_text()
    );
    Ok(())
}

/// One scenario: a fresh proxy, the path checked with curl, then for each load a warm-up
/// and a measured run with the proxy's CPU and RSS read around it.
fn measure(setup: &Setup, scenario: Scenario, round: usize, args: &HttpArgs) -> Result<Vec<Run>> {
    let proxies = setup.start_proxy(scenario)?;
    check_answer(setup, scenario, &proxies)?;
    if scenario.is_mtls_pair() {
        check_mtls_required(setup, scenario, &proxies)?;
    }
    // CPU ticks summed over the scenario's proxies (both sidecars of a pair).
    let ticks = || -> Result<Option<u64>> {
        if proxies.is_empty() {
            return Ok(None);
        }
        proxies
            .iter()
            .map(|p| proxy_cpu_ticks(p.pid()))
            .sum::<Result<u64>>()
            .map(Some)
    };
    let mut runs = Vec::new();
    for load in [Load::H1, Load::H2] {
        let target = setup.target(scenario, load);
        load_run(setup, load, target, 1, args).with_context(|| format!("{load:?} warm-up"))?;
        let before = ticks()?;
        let result = load_run(setup, load, target, args.seconds, args)
            .with_context(|| format!("{load:?} load"))?;
        let after = ticks()?;
        for p in &proxies {
            ensure!(
                p.try_wait().is_none(),
                "{} exited during the run:\n{}",
                p.description(),
                p.stderr_text()
            );
        }
        runs.push(Run {
            round,
            scenario,
            load,
            requests: result.requests,
            req_per_sec: result.req_per_sec,
            p50_us: result.p50_us,
            p99_us: result.p99_us,
            proxy_cpu_us_per_req: before
                .zip(after)
                .map(|(b, a)| (a - b) as f64 * TICK_US / result.requests as f64),
            rss_kib: if proxies.is_empty() {
                None
            } else {
                Some(
                    proxies
                        .iter()
                        .map(|p| rss(p.pid()).map(|r| r.0))
                        .sum::<Result<u64>>()?,
                )
            },
        });
    }
    if scenario.is_mtls_pair() {
        check_pair_spoke_h2_over_tls(setup, scenario)?;
    }
    Ok(runs)
}

/// After a pair's runs: the client sidecar's upstream cluster counted TLS handshakes and
/// HTTP/2 connections (its stats, Envoy's names), so the figures are of mTLS with h2.
fn check_pair_spoke_h2_over_tls(setup: &Setup, scenario: Scenario) -> Result<()> {
    for stat in [
        "cluster.upstream.ssl.handshake",
        "cluster.upstream.upstream_cx_http2_total",
    ] {
        let count = admin_counter(&setup.client, stat);
        ensure!(
            count.is_some_and(|c| c > 0),
            "{}: the client sidecar's {stat} is {count:?} after the runs, not above 0",
            scenario.name()
        );
    }
    Ok(())
}

/// curl through the path: 200, the upstream's 64 bytes, and (through a proxy) the
/// upstream nginx's `Server` header passed on. A host outside the table must not reach
/// the upstream.
fn check_answer(setup: &Setup, scenario: Scenario, proxies: &[PodProcess]) -> Result<()> {
    let target = setup.target(scenario, Load::H1);
    let curl = |host: &str| -> Result<(String, String)> {
        let out = setup
            .client
            .command("curl")
            .args(["-s", "-m", "5", "-o", "-", "-w", "\n%{http_code}", "-H"])
            .arg(format!("host: {host}"))
            .arg(format!("http://{target}/api/x"))
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        Ok((body.to_owned(), code.to_owned()))
    };
    let stderr = || {
        proxies
            .iter()
            .map(PodProcess::stderr_text)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (body, code) = curl(HOST)?;
    ensure!(
        code == "200" && body == BODY,
        "{}: GET http://{target}/api/x with Host {HOST} answered {code} {body:?}, not 200 with the upstream's 64 bytes\n{}",
        scenario.name(),
        stderr()
    );
    if scenario != Scenario::Direct {
        let (body, code) = curl("unknown.bench.local")?;
        ensure!(
            code != "200" && body != BODY,
            "{}: a host outside the route table reached the upstream ({code})",
            scenario.name()
        );
    }
    Ok(())
}

/// The server sidecar of a pair, asked directly by curl from the client pod: with the
/// client's certificate it answers 200 and the app's bytes; without one the handshake
/// must fail (`require_client_certificate`), so the pair's traffic is really mTLS.
fn check_mtls_required(setup: &Setup, scenario: Scenario, proxies: &[PodProcess]) -> Result<()> {
    let server = setup.mtls_server();
    let pki = setup.dir.join("pki");
    let file = |name: &str| pki.join(name).display().to_string();
    let name = super::soak::config::SERVER_NAME;
    let curl = |with_certificate: bool| -> Result<(String, String)> {
        let mut cmd = setup.client.command("curl");
        cmd = cmd
            .args(["-s", "-m", "5", "-o", "-", "-w", "\n%{http_code}"])
            .args(["--cacert", &file("ca.pem"), "--resolve"])
            .arg(format!("{name}:{}:{}", server.port(), server.ip()));
        if with_certificate {
            cmd = cmd.args(["--cert", &file("client.pem"), "--key", &file("client.key")]);
        }
        let out = cmd
            .arg(format!("https://{name}:{}/api/x", server.port()))
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
        Ok((body.to_owned(), code.to_owned()))
    };
    let stderr = || {
        proxies
            .iter()
            .map(PodProcess::stderr_text)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let (body, code) = curl(true)?;
    ensure!(
        code == "200" && body == BODY,
        "{}: the server sidecar {server} answered a client with the mesh certificate {code} {body:?}, not 200 with the app's 64 bytes\n{}",
        scenario.name(),
        stderr()
    );
    let (body, code) = curl(false)?;
    ensure!(
        code != "200" && body != BODY,
        "{}: the server sidecar {server} answered a client without a certificate ({code}): mTLS is not required",
        scenario.name()
    );
    Ok(())
}

#[derive(Debug)]
struct LoadResult {
    requests: u64,
    req_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
}

/// `count` for each load and each of `scenarios`, in that order, an error naming `what`
/// and the pair: the loop `--instructions` and `--wakeups` share.
fn each_load_and_scenario<T>(
    scenarios: &[Scenario],
    what: &str,
    mut count: impl FnMut(Scenario, Load) -> Result<T>,
) -> Result<Vec<T>> {
    let mut counts = Vec::new();
    for load in [Load::H1, Load::H2] {
        for &scenario in scenarios {
            counts.push(
                count(scenario, load)
                    .with_context(|| format!("counting {what}: {} {load:?}", scenario.name()))?,
            );
        }
    }
    Ok(counts)
}

fn load_run(
    setup: &Setup,
    load: Load,
    target: SocketAddr,
    seconds: u64,
    args: &HttpArgs,
) -> Result<LoadResult> {
    match load {
        Load::H1 => wrk(setup, target, seconds, args.connections),
        Load::H2 => h2load(setup, target, seconds),
    }
}

/// `wrk -t1 -cN --latency`, refusing any non-2xx/3xx answer or socket error.
fn wrk(setup: &Setup, target: SocketAddr, seconds: u64, connections: u32) -> Result<LoadResult> {
    let out = crate::pods::run(
        setup
            .client
            .command("wrk")
            .args(["-t1", "-c", &connections.to_string(), "--latency"])
            .args(["-d", &format!("{seconds}s"), "-H"])
            .arg(format!("Host: {HOST}"))
            .arg(format!("http://{target}/api/x"))
            .timeout(Duration::from_secs(seconds + 60)),
    )?;
    parse_wrk(&out).with_context(|| format!("wrk printed:\n{out}"))
}

fn parse_wrk(out: &str) -> Result<LoadResult> {
    let mut requests = None;
    let mut rate = None;
    let (mut p50, mut p99) = (f64::NAN, f64::NAN);
    for line in out.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("Non-2xx or 3xx responses:") {
            bail!("{} answers were not 2xx/3xx", rest.trim());
        }
        if line.starts_with("Socket errors:") {
            bail!("wrk saw {line}");
        }
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            rate = v.trim().parse::<f64>().ok();
        } else if let Some(v) = line.strip_prefix("50%") {
            p50 = duration_us(v.trim())?;
        } else if let Some(v) = line.strip_prefix("99%") {
            p99 = duration_us(v.trim())?;
        } else if line.contains(" requests in ") {
            requests = line.split_whitespace().next().and_then(|n| n.parse().ok());
        }
    }
    let requests: u64 = requests.context("no \"N requests in\" line")?;
    ensure!(requests > 0, "no request was answered");
    Ok(LoadResult {
        requests,
        req_per_sec: rate.context("no Requests/sec line")?,
        p50_us: p50,
        p99_us: p99,
    })
}

/// wrk's durations: `812.00us`, `1.23ms`, `2.00s`.
fn duration_us(v: &str) -> Result<f64> {
    let (num, scale) = if let Some(n) = v.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = v.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = v.strip_suffix('s') {
        (n, 1e6)
    } else {
        bail!("unknown duration {v:?}")
    };
    Ok(num
        .parse::<f64>()
        .with_context(|| format!("duration {v:?}"))?
        * scale)
}

/// `h2load -c10 -m10` (h2 prior knowledge) with a per-request log: every request must be
/// logged with status 200; the latencies come from the log.
fn h2load(setup: &Setup, target: SocketAddr, seconds: u64) -> Result<LoadResult> {
    let log = setup.dir.join("h2load.log");
    let _ = std::fs::remove_file(&log);
    let out = crate::pods::run(
        setup
            .client
            .command("h2load")
            .args(["-t1", "-c", H2_CLIENTS, "-m", H2_STREAMS])
            .args(["-D", &seconds.to_string(), "-H"])
            .arg(format!(":authority: {HOST}"))
            .arg("--log-file")
            .arg(&log)
            .arg(format!("http://{target}/api/x"))
            .timeout(Duration::from_secs(seconds + 60)),
    )?;
    let text =
        std::fs::read_to_string(&log).with_context(|| format!("h2load log {}", log.display()))?;
    parse_h2load(&out, &text).with_context(|| format!("h2load printed:\n{out}"))
}

fn parse_h2load(out: &str, log: &str) -> Result<LoadResult> {
    let field = |prefix: &str| out.lines().find_map(|l| l.trim().strip_prefix(prefix));
    // "requests: 100 total, 100 started, 100 done, 100 succeeded, 0 failed, 0 errored, 0 timeout"
    let counts = field("requests:").context("no requests: line")?;
    let count = |name: &str| -> u64 {
        counts
            .split(',')
            .find_map(|c| {
                c.trim()
                    .strip_suffix(name)
                    .map(|n| n.trim().parse().unwrap_or(0))
            })
            .unwrap_or(0)
    };
    let (done, succeeded) = (count("done"), count("succeeded"));
    for bad in ["failed", "errored", "timeout"] {
        ensure!(count(bad) == 0, "{} requests {bad}", count(bad));
    }
    // "finished in 5.00s, 41234.20 req/s, 2.95MB/s"
    let rate = field("finished in")
        .and_then(|l| l.split(',').nth(1))
        .and_then(|r| r.trim().strip_suffix(" req/s"))
        .and_then(|r| r.parse::<f64>().ok())
        .context("no req/s in the finished line")?;
    // The log: start time (us since epoch), status, elapsed (us), one line a request.
    let mut elapsed = Vec::new();
    for line in log.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        ensure!(f.len() >= 3, "malformed h2load log line {line:?}");
        ensure!(f[1] == "200", "a request was answered {}: {line:?}", f[1]);
        elapsed.push(
            f[2].parse::<f64>()
                .with_context(|| format!("log line {line:?}"))?,
        );
    }
    ensure!(
        done > 0 && succeeded == done && elapsed.len() as u64 == done,
        "{done} requests done, {succeeded} succeeded (2xx/3xx), {} logged",
        elapsed.len()
    );
    elapsed.sort_by(f64::total_cmp);
    let pct = |p: f64| elapsed[((elapsed.len() - 1) as f64 * p).round() as usize];
    Ok(LoadResult {
        requests: done,
        req_per_sec: rate,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    })
}

/// A ratio as the tables print it: `1.04x`, or `-` when a side is missing.
fn ratio_cell(r: f64) -> String {
    if r.is_finite() {
        format!("{r:.2}x")
    } else {
        "-".into()
    }
}

/// shunt under each load, recorded with DWARF call graphs; folded and drawn with
/// inferno into target/bench/http-shunt-h1.svg and http-shunt-h2.svg.
fn flamegraph(setup: &Setup, args: &HttpArgs) -> Result<()> {
    for load in [Load::H1, Load::H2] {
        flamegraph_of(setup, args, load)?;
    }
    Ok(())
}

fn flamegraph_of(setup: &Setup, args: &HttpArgs, load: Load) -> Result<()> {
    let proxy = setup
        .start_proxy(Scenario::Shunt)?
        .pop()
        .context("shunt has a process")?;
    let target = setup.target(Scenario::Shunt, load);
    let name = match load {
        Load::H1 => "http-shunt-h1",
        Load::H2 => "http-shunt-h2",
    };
    let data = target_dir().join(format!("bench/{name}.perf.data"));
    let seconds = args.seconds.max(3);
    let mut perf = Command::new("perf")
        .args([
            "record",
            "-q",
            "-F",
            "499",
            "--call-graph",
            "dwarf,16384",
            "-o",
        ])
        .arg(&data)
        .args([
            "-p",
            &proxy.pid().to_string(),
            "--",
            "sleep",
            &seconds.to_string(),
        ])
        .spawn()
        .context("starting perf record")?;
    let result = load_run(setup, load, target, seconds, args);
    let status = perf.wait()?;
    result?;
    ensure!(status.success(), "perf record failed ({status})");
    let script = Command::new("perf")
        .args(["script", "-i"])
        .arg(&data)
        .output()
        .context("perf script")?;
    ensure!(
        script.status.success(),
        "perf script failed: {}",
        String::from_utf8_lossy(&script.stderr)
    );
    let mut folded = Vec::new();
    inferno::collapse::perf::Folder::default()
        .collapse(BufReader::new(&script.stdout[..]), &mut folded)
        .context("folding perf script's stacks")?;
    let folded_path = target_dir().join(format!("bench/{name}.folded"));
    std::fs::write(&folded_path, &folded)?;
    let svg = target_dir().join(format!("bench/{name}.svg"));
    let mut options = inferno::flamegraph::Options::default();
    options.title = match load {
        Load::H1 => format!(
            "shunt under wrk -t1 -c{} (HTTP/1.1, 6 virtual hosts)",
            args.connections
        ),
        Load::H2 => format!("shunt under h2load -c{H2_CLIENTS} -m{H2_STREAMS} (h2 down, h1 up)"),
    };
    inferno::flamegraph::from_reader(
        &mut options,
        BufReader::new(&folded[..]),
        std::fs::File::create(&svg)?,
    )
    .context("drawing the flamegraph")?;
    println!(
        "flamegraph: {} (stacks in {})",
        svg.display(),
        folded_path.display()
    );
    print!("{}", top_frames(&String::from_utf8_lossy(&folded), 15));
    Ok(())
}

/// The leaf functions that took the most samples, for the terminal.
fn top_frames(folded: &str, n: usize) -> String {
    let mut by_leaf: std::collections::HashMap<&str, u64> = Default::default();
    let mut total = 0;
    for line in folded.lines() {
        let Some((stack, count)) = line.rsplit_once(' ') else {
            continue;
        };
        let count: u64 = count.parse().unwrap_or(0);
        total += count;
        *by_leaf
            .entry(stack.rsplit(';').next().unwrap_or(stack))
            .or_default() += count;
    }
    let mut leaves: Vec<_> = by_leaf.into_iter().collect();
    leaves.sort_by_key(|leaf| std::cmp::Reverse(leaf.1));
    let mut t = format!("  top leaf functions of {total} samples:\n");
    for (leaf, count) in leaves.into_iter().take(n) {
        let _ = writeln!(
            t,
            "  {:>5.1}%  {leaf}",
            count as f64 * 100.0 / total.max(1) as f64
        );
    }
    t
}

struct Report<'a> {
    args: &'a HttpArgs,
    busy: f64,
    scenarios: Vec<Scenario>,
    runs: Vec<Run>,
}

/// Ratio columns (those whose scenarios both ran).
const RATIOS: [(Scenario, Scenario); 15] = [
    (Scenario::Shunt, Scenario::Haproxy),
    (Scenario::Shunt, Scenario::Envoy),
    (Scenario::Shunt, Scenario::Nginx),
    (Scenario::Shunt, Scenario::Before),
    (Scenario::Shunt, Scenario::ShuntPlain),
    (Scenario::ShuntRbac, Scenario::Shunt),
    (Scenario::EnvoyRbac, Scenario::Envoy),
    (Scenario::ShuntRbac, Scenario::EnvoyRbac),
    (Scenario::ShuntMtls, Scenario::EnvoyMtls),
    (Scenario::ShuntTrace1, Scenario::Shunt),
    (Scenario::ShuntTrace100, Scenario::Shunt),
    (Scenario::EnvoyTrace1, Scenario::Envoy),
    (Scenario::EnvoyTrace100, Scenario::Envoy),
    (Scenario::ShuntTrace1, Scenario::EnvoyTrace1),
    (Scenario::ShuntTrace100, Scenario::EnvoyTrace100),
];

/// What the RBAC filter adds to a request: (with, without).
const RBAC_OVERHEAD: [(Scenario, Scenario); 2] = [
    (Scenario::ShuntRbac, Scenario::Shunt),
    (Scenario::EnvoyRbac, Scenario::Envoy),
];

impl Report<'_> {
    fn ratios(&self) -> impl Iterator<Item = (Scenario, Scenario)> + '_ {
        RATIOS
            .into_iter()
            .filter(|(a, b)| self.scenarios.contains(a) && self.scenarios.contains(b))
    }

    fn median(&self, scenario: Scenario, load: Load, metric: &Metric) -> f64 {
        median(
            self.runs
                .iter()
                .filter(|r| r.scenario == scenario && r.load == load)
                .map(metric.get),
        )
    }

    /// The median over rounds of `a`'s `metric` against `b`'s in the same round. The
    /// scenarios of one round run minutes apart at most, while this machine's speed
    /// drifts by 10-20% between rounds, for every proxy alike: a ratio taken round by
    /// round leaves that drift out, where the ratio of the two medians keeps it.
    fn paired_ratio(&self, a: Scenario, b: Scenario, load: Load, metric: &Metric) -> f64 {
        median((1..=self.args.rounds).filter_map(|round| {
            let of = |scenario| {
                self.runs
                    .iter()
                    .find(|r| r.round == round && r.scenario == scenario && r.load == load)
                    .map(metric.get)
            };
            Some(of(a)? / of(b)?)
        }))
    }

    fn table(&self, setup: &Setup) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "bench http: shunt vs Envoy {}, {}, {} as reverse proxies, one worker each, {VIRTUAL_HOSTS} virtual hosts, 64 B nginx answer; medians over {} rounds of {} s; kernel {}, {} CPUs, machine {:.0}% busy before starting",
            setup.envoy_version,
            setup.haproxy_version,
            setup.nginx_version,
            self.args.rounds,
            self.args.seconds,
            kernel(),
            cpus(),
            self.busy
        );
        if self.args.pgo {
            let _ = writeln!(
                t,
                "shunt: profile-guided release build (trained {TRAIN_SECONDS} s per load on h1 and h2 through the plain, RBAC and mTLS bootstraps); shunt-plain: the same source, plain release build"
            );
        }
        if self.scenarios.iter().any(|s| s.is_mtls_pair()) {
            let _ = writeln!(
                t,
                "shunt-mtls, envoy-mtls: client sidecar (this route table) -> mTLS, h2 (ALPN), SPIFFE SANs checked -> server sidecar :{} -> nginx; proxy CPU and RSS summed over both sidecars",
                http_mtls::MTLS_PORT
            );
        }
        for (load, title) in [
            (
                Load::H1,
                format!("HTTP/1.1 keep-alive, wrk -t1 -c{}", self.args.connections),
            ),
            (
                Load::H2,
                format!("h2 down / h1 up, h2load -c{H2_CLIENTS} -m{H2_STREAMS}"),
            ),
        ] {
            let _ = write!(t, "{title:<36}");
            for s in &self.scenarios {
                let _ = write!(t, "{:>12}", s.name());
            }
            for (a, b) in self.ratios() {
                let _ = write!(t, "{:>24}", format!("{}/{}", a.name(), b.name()));
            }
            t.push('\n');
            for m in METRICS {
                let _ = write!(t, "{:<36}", m.label);
                for s in &self.scenarios {
                    let _ = write!(t, "{:>12}", fmt_value(self.median(*s, load, m)));
                }
                for (a, b) in self.ratios() {
                    let r = self.median(a, load, m) / self.median(b, load, m);
                    let _ = write!(t, "{:>24}", ratio_cell(r));
                }
                t.push('\n');
            }
            // Only the ratio columns: the same requests/s, compared round by round.
            let _ = write!(t, "{:<36}", "  requests/s, median of round ratios");
            t.push_str(&" ".repeat(12 * self.scenarios.len()));
            for (a, b) in self.ratios() {
                let r = self.paired_ratio(a, b, load, &METRICS[0]);
                let _ = write!(t, "{:>24}", ratio_cell(r));
            }
            t.push('\n');
            for (with, without) in RBAC_OVERHEAD {
                if !(self.scenarios.contains(&with) && self.scenarios.contains(&without)) {
                    continue;
                }
                let rate = |s| self.median(s, load, &METRICS[0]);
                let cpu = |s| {
                    METRICS
                        .iter()
                        .find(|m| m.key == "proxy_cpu_us_per_req")
                        .map_or(f64::NAN, |m| self.median(s, load, m))
                };
                // Latency per request at the measured rates, and the proxy's own CPU.
                let per_request_us = 1e6 / rate(with) - 1e6 / rate(without);
                let _ = writeln!(
                    t,
                    "  {RBAC_POLICIES} RBAC policies, {}: {:+.2} us/request wall at one worker's rate, {:+.2} us/request proxy CPU",
                    without.name(),
                    per_request_us,
                    cpu(with) - cpu(without),
                );
            }
        }
        t
    }

    fn json(&self, setup: &Setup) -> Value {
        let per = |s: Scenario, load: Load| -> Value {
            METRICS
                .iter()
                .map(|m| (m.key.to_owned(), json!(self.median(s, load, m))))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let medians = |load: Load| -> Value {
            self.scenarios
                .iter()
                .map(|s| (s.name().to_owned(), per(*s, load)))
                .collect::<serde_json::Map<_, _>>()
                .into()
        };
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        json!({
            "bench": "http",
            "config": {
                "envoy_version": setup.envoy_version,
                "haproxy_version": setup.haproxy_version,
                "nginx_version": setup.nginx_version,
                "bootstrap": read(&setup.bootstrap),
                "bootstrap_mtls_client": read(&setup.bootstrap_mtls_client),
                "bootstrap_mtls_server": read(&setup.bootstrap_mtls_server),
                "haproxy_config": read(&setup.haproxy_config),
                "nginx_config": read(&setup.nginx_config),
                "pgo": self.args.pgo,
                "rounds": self.args.rounds,
                "seconds": self.args.seconds,
                "wrk_connections": self.args.connections,
                "h2load": format!("-c{H2_CLIENTS} -m{H2_STREAMS}"),
                "kernel": kernel(),
                "cpus": cpus(),
                "background_busy_pct": self.busy,
            },
            "median": {"h1": medians(Load::H1), "h2": medians(Load::H2)},
            "ratios": self.ratios().map(|(a, b)| {
                let of = |load| METRICS.iter().map(|m| (m.key.to_owned(), json!(self.median(a, load, m) / self.median(b, load, m)))).collect::<serde_json::Map<_, _>>();
                (format!("{}/{}", a.name(), b.name()), json!({"h1": of(Load::H1), "h2": of(Load::H2)}))
            }).collect::<serde_json::Map<_, _>>(),
            "req_per_sec_round_ratio_medians": self.ratios().map(|(a, b)| {
                let of = |load| json!(self.paired_ratio(a, b, load, &METRICS[0]));
                (format!("{}/{}", a.name(), b.name()), json!({"h1": of(Load::H1), "h2": of(Load::H2)}))
            }).collect::<serde_json::Map<_, _>>(),
            "runs": self.runs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRK: &str = "Running 3s test @ http://127.0.0.1:10000/api/x
  1 threads and 50 connections
  Latency Distribution
     50%  812.00us
     75%    1.10ms
     90%    1.50ms
     99%    2.00s
  90210 requests in 3.00s, 20.00MB read
Requests/sec:  30070.00
Transfer/sec:      6.67MB
";

    #[test]
    fn a_clean_wrk_run_gives_its_rate_and_percentiles() {
        let r = parse_wrk(WRK).unwrap();
        assert_eq!(r.requests, 90210);
        assert_eq!(r.req_per_sec, 30070.0);
        assert_eq!(r.p50_us, 812.0);
        assert_eq!(r.p99_us, 2_000_000.0);
    }

    #[test]
    fn a_wrk_run_with_errors_or_non_2xx_answers_is_refused() {
        let errors = WRK.replace(
            "Requests/sec",
            "  Socket errors: connect 0, read 3, write 0, timeout 0\nRequests/sec",
        );
        assert!(parse_wrk(&errors).is_err());
        let non_2xx = WRK.replace(
            "Requests/sec",
            "  Non-2xx or 3xx responses: 7\nRequests/sec",
        );
        let err = parse_wrk(&non_2xx).unwrap_err().to_string();
        assert!(err.contains("7 answers"), "{err}");
    }

    const H2LOAD: &str = "finished in 3.00s, 3.00 req/s, 1KB/s
requests: 3 total, 3 started, 3 done, 3 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 3 2xx, 0 3xx, 0 4xx, 0 5xx
";

    #[test]
    fn h2load_latencies_come_from_its_log_and_every_request_must_be_200() {
        let log = "1\t200\t300\n2\t200\t100\n3\t200\t200\n";
        let r = parse_h2load(H2LOAD, log).unwrap();
        assert_eq!(
            (r.requests, r.req_per_sec, r.p50_us, r.p99_us),
            (3, 3.0, 200.0, 300.0)
        );
        assert!(parse_h2load(H2LOAD, "1\t200\t300\n2\t503\t100\n3\t200\t200\n").is_err());
        // A request the log misses is not counted as a success.
        assert!(parse_h2load(H2LOAD, "1\t200\t300\n").is_err());
    }

    #[test]
    fn shunt_and_envoy_share_one_bootstrap_of_six_virtual_hosts() {
        let yaml = bootstrap(SocketAddr::from(([10, 0, 0, 2], UPSTREAM_PORT)));
        assert_eq!(yaml.matches("- name: svc").count(), VIRTUAL_HOSTS);
        assert!(yaml.contains(HOST));
        let haproxy = haproxy_config(SocketAddr::from(([10, 0, 0, 2], UPSTREAM_PORT)));
        assert_eq!(haproxy.matches("use_backend").count(), VIRTUAL_HOSTS);
    }

    #[test]
    fn the_rbac_bootstrap_puts_twenty_policies_before_the_router() {
        let yaml = bootstrap_rbac(SocketAddr::from(([10, 0, 0, 2], UPSTREAM_PORT)));
        let rbac = yaml
            .find("envoy.filters.http.rbac")
            .expect("the RBAC filter");
        let router = yaml.find("envoy.filters.http.router").expect("the router");
        assert!(rbac < router);
        assert_eq!(yaml.matches("permissions:").count(), RBAC_POLICIES);
        assert_eq!(yaml.matches("any: true").count(), 1);
    }

    #[test]
    fn round_by_round_ratios_leave_out_the_machines_drift_between_rounds() {
        #[derive(clap::Parser)]
        struct Bench {
            #[command(flatten)]
            http: HttpArgs,
        }
        let args = <Bench as clap::Parser>::try_parse_from(["http", "--rounds", "3"])
            .unwrap()
            .http;
        let run = |round, scenario, req_per_sec| Run {
            round,
            scenario,
            load: Load::H1,
            requests: 1,
            req_per_sec,
            p50_us: 1.0,
            p99_us: 1.0,
            proxy_cpu_us_per_req: None,
            rss_kib: None,
        };
        // shunt is 1.1x haproxy in rounds 1 and 2 (the machine ran at half speed in
        // round 2) and 0.66x in round 3: the ratio of the medians is round 3's, the
        // median of the round ratios the two rounds' that agree.
        let report = Report {
            args: &args,
            busy: 0.0,
            scenarios: vec![Scenario::Shunt, Scenario::Haproxy],
            runs: vec![
                run(1, Scenario::Shunt, 110.0),
                run(1, Scenario::Haproxy, 100.0),
                run(2, Scenario::Shunt, 55.0),
                run(2, Scenario::Haproxy, 50.0),
                run(3, Scenario::Shunt, 66.0),
                run(3, Scenario::Haproxy, 100.0),
            ],
        };
        let rate = &METRICS[0];
        assert_eq!(rate.key, "req_per_sec");
        let medians = report.median(Scenario::Shunt, Load::H1, rate)
            / report.median(Scenario::Haproxy, Load::H1, rate);
        assert!((medians - 0.66).abs() < 1e-9, "{medians}");
        let paired = report.paired_ratio(Scenario::Shunt, Scenario::Haproxy, Load::H1, rate);
        assert!((paired - 1.1).abs() < 1e-9, "{paired}");
        // A load with no runs has no ratio.
        assert!(
            report
                .paired_ratio(Scenario::Shunt, Scenario::Haproxy, Load::H2, rate)
                .is_nan()
        );
    }
}
