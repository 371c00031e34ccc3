//! `cargo xtask bench xds`: shunt and a real Envoy side by side as xDS clients, each
//! taking the same large configuration from the same in-process ADS server
//! ([`harness::ads`]) over a Unix socket, on the same kind of stream.
//!
//! The configuration: N EDS clusters (`c00000`...), one ClusterLoadAssignment each with
//! one endpoint (even clusters: the echo server on server:8080) or two (odd ones: :8080
//! and :8081), M HTTP listeners (`l00000` on 127.0.0.1:20000, ...: an
//! `http_connection_manager` whose routes come over RDS as `r00000`, ...) and M
//! RouteConfigurations, each routing to the cluster of its number. The endpoints are
//! `testapp serve --mode http` in the server pod. With `--routes 0` the listeners are
//! `tcp_proxy` to the cluster of their number instead, and the endpoints echo servers.
//!
//! Per proxy and round, with a fresh server and a fresh proxy in the `proxy` pod:
//!
//! - the full push: everything is in the server before the proxy starts; from the first
//!   response the server sends (CDS) to the last ACK of CDS, EDS and LDS (each response
//!   is matched to its answer by nonce on the stream; any NACK fails the run; RDS too
//!   when the listeners take routes, which Envoy and shunt ask for once the listeners
//!   are in and warm on), and on to
//!   `/ready` answering 200 with every listener's port listening. Then the proxy's CPU
//!   (`/proc/PID/stat`) and, a second later, its RSS; the admin API must count at least
//!   N active clusters, and one request (or connection) through listener 0 must reach
//!   the server from the proxy pod's address.
//! - incremental updates: one cluster's endpoints change per update (a new EDS
//!   version), each waited for, send to ACK. In state of the world the server resends
//!   every subscribed ClusterLoadAssignment each time (that is what SotW means); with
//!   `--api delta` only the changed one. A connection through the last updated cluster's
//!   listener must reach the endpoint the last update gave it.
//!
//! Results: a table per API with medians over rounds and shunt/envoy ratios, and
//! `target/bench/xds.txt` / `xds.json` (every run, every update's time).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    io::{Read, Write},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use envoy_types::pb::envoy::config::route::v3::{
    Route, RouteAction, RouteConfiguration, RouteMatch, VirtualHost, route, route_action,
    route_match,
};
use harness::ads::resources::{
    ads_source, eds_cluster, http_listener, load_assignment, named, tcp_proxy_listener,
};
use harness::ads::{AdsServer, Any, Listen, Received, Sent, type_urls};
use harness::{Node, Pod, PodProcess, tcp_listeners};
use serde::Serialize;
use serde_json::{Value, json};

use super::l4::{CONCURRENCY, admin_counter, envoy_args, envoy_version, shunt_args, validate};
use super::measure::{
    Goal, KIB_PER_MIB, TICK_US, background_busy, cpus, fmt_value, kernel, median, proxy_cpu_ticks,
    rss, save,
};
use crate::pods::{Bins, call, http_call, start_app_mode, target_dir};

#[derive(clap::Args)]
pub struct XdsArgs {
    /// EDS clusters (one ClusterLoadAssignment each).
    #[arg(long, default_value_t = 10_000)]
    clusters: usize,
    /// Listeners, on 127.0.0.1:20000 and up, each to the cluster of its number.
    #[arg(long, default_value_t = 1_000)]
    listeners: usize,
    /// RouteConfigurations over RDS, one per listener (so as many as --listeners); 0
    /// makes the listeners tcp_proxy ones instead.
    #[arg(long, default_value_t = 1_000)]
    routes: usize,
    /// Incremental EDS updates after the full push, one cluster's endpoints each.
    #[arg(long, default_value_t = 100)]
    updates: usize,
    /// Rounds of both proxies (the order alternates); medians are reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// The ADS streams to measure: state of the world, Delta, or both (`sotw,delta`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "sotw")]
    api: Vec<Api>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Sotw,
    Delta,
}

impl Api {
    fn name(self) -> &'static str {
        match self {
            Api::Sotw => "sotw",
            Api::Delta => "delta",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Api::Sotw => "state of the world (GRPC)",
            Api::Delta => "Delta (DELTA_GRPC)",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Proxy {
    Shunt,
    Envoy,
}

const PROXIES: [Proxy; 2] = [Proxy::Shunt, Proxy::Envoy];

impl Proxy {
    fn name(self) -> &'static str {
        match self {
            Proxy::Shunt => "shunt",
            Proxy::Envoy => "envoy",
        }
    }
}

const ECHO_PORTS: [u16; 2] = [8080, 8081];
const FIRST_LISTEN_PORT: u16 = 20000;
pub(crate) const ADMIN_PORT: u16 = 15000;
/// For each wait on the proxy: the full push of 10,000 clusters, or one update.
const TIMEOUT: Duration = Duration::from_secs(300);

/// What the server serves: (name, resource) per type, in name order.
struct Resources {
    clusters: Vec<(String, Any)>,
    endpoints: Vec<(String, Any)>,
    listeners: Vec<(String, Any)>,
    routes: Vec<(String, Any)>,
}

impl Resources {
    fn new(args: &XdsArgs, server: Ipv4Addr) -> Resources {
        Resources {
            clusters: (0..args.clusters).map(cluster).collect(),
            endpoints: (0..args.clusters)
                .map(|i| {
                    let ports = if i % 2 == 0 {
                        &ECHO_PORTS[..1]
                    } else {
                        &ECHO_PORTS[..]
                    };
                    assignment(i, server, ports)
                })
                .collect(),
            listeners: (0..args.listeners)
                .map(|i| listener(i, args.routes > 0))
                .collect(),
            routes: (0..args.routes).map(route_config).collect(),
        }
    }

    /// Encoded size of each type's resources, bytes.
    fn sizes(&self) -> BTreeMap<&'static str, usize> {
        let size = |v: &[(String, Any)]| v.iter().map(|(_, a)| a.value.len()).sum();
        BTreeMap::from([
            ("cds", size(&self.clusters)),
            ("eds", size(&self.endpoints)),
            ("lds", size(&self.listeners)),
            ("rds", size(&self.routes)),
        ])
    }
}

fn cluster_name(i: usize) -> String {
    format!("c{i:05}")
}

fn listen_port(i: usize) -> u16 {
    FIRST_LISTEN_PORT + i as u16
}

pub(super) fn cluster(i: usize) -> (String, Any) {
    let name = cluster_name(i);
    named(&name, &eds_cluster(&name, ads_source(), 1))
}

pub(super) fn assignment(i: usize, server: Ipv4Addr, ports: &[u16]) -> (String, Any) {
    let name = cluster_name(i);
    let endpoints: Vec<SocketAddr> = ports
        .iter()
        .map(|port| SocketAddr::new(server.into(), *port))
        .collect();
    named(&name, &load_assignment(&name, &endpoints))
}

/// Listener `i`: HTTP with routes `r<i>` over RDS, else `tcp_proxy` to cluster `i`.
fn listener(i: usize, http: bool) -> (String, Any) {
    let name = format!("l{i:05}");
    let at = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen_port(i));
    if http {
        named(&name, &http_listener(&name, at, &route_name(i)))
    } else {
        named(&name, &tcp_proxy_listener(&name, at, &cluster_name(i)))
    }
}

fn route_name(i: usize) -> String {
    format!("r{i:05}")
}

fn route_config(i: usize) -> (String, Any) {
    let name = route_name(i);
    let config = RouteConfiguration {
        name: name.clone(),
        virtual_hosts: vec![VirtualHost {
            name: name.clone(),
            domains: vec![format!("svc{i}.example"), "*".into()],
            routes: vec![Route {
                r#match: Some(RouteMatch {
                    path_specifier: Some(route_match::PathSpecifier::Prefix("/".into())),
                    ..Default::default()
                }),
                action: Some(route::Action::Route(RouteAction {
                    cluster_specifier: Some(route_action::ClusterSpecifier::Cluster(cluster_name(
                        i,
                    ))),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        }],
        ..Default::default()
    };
    (name, AdsServer::any(&config))
}

/// The bootstrap both proxies run (Istio's shape): ADS over a Unix socket through a
/// static cluster with a `pipe` endpoint, listeners and clusters from ADS.
pub(crate) fn bootstrap(socket: &Path, api: Api) -> Value {
    let api_type = match api {
        Api::Sotw => "GRPC",
        Api::Delta => "DELTA_GRPC",
    };
    json!({
        "node": {"id": "sidecar~10.0.0.1~bench.default~default.svc.cluster.local",
                 "cluster": "bench.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": ADMIN_PORT}}},
        "dynamic_resources": {
            "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "ads_config": {
                "api_type": api_type,
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]
            }
        },
        "static_resources": {"clusters": [{
            "name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": socket.display().to_string()}}}}]}]}
        }]}
    })
}

/// The binaries, the pods, the resources: what is fixed for the whole bench.
struct Setup {
    bins: Bins,
    envoy: PathBuf,
    envoy_version: String,
    proxy: Pod,
    server: Pod,
    /// The ADS server's socket (a fresh server per run binds it again).
    socket: PathBuf,
    bootstraps: BTreeMap<Api, PathBuf>,
    resources: Resources,
    /// HTTP listeners with routes, rather than tcp_proxy ones.
    http: bool,
}

impl Setup {
    /// The same command lines as bench l4's.
    fn command(&self, proxy: Proxy, api: Api) -> (PathBuf, Vec<String>) {
        let file = &self.bootstraps[&api];
        match proxy {
            Proxy::Shunt => (self.bins.shunt.clone(), shunt_args(file)),
            Proxy::Envoy => (self.envoy.clone(), envoy_args(file)),
        }
    }

    fn command_line(&self, proxy: Proxy, api: Api) -> String {
        let (program, args) = self.command(proxy, api);
        format!("{} {}", program.display(), args.join(" "))
    }
}

/// One proxy on one API, once.
#[derive(Serialize)]
struct Run {
    round: usize,
    proxy: Proxy,
    api: Api,
    /// Proxy started to its first xDS request.
    start_ms: f64,
    /// First response sent to the last ACK of CDS, EDS and LDS.
    push_ms: f64,
    /// Send to ACK of the last CDS, EDS and LDS response of the push.
    cds_ms: f64,
    eds_ms: f64,
    lds_ms: f64,
    /// Send to ACK of the last RDS response of the push (NaN without routes).
    rds_ms: f64,
    /// First response sent to `/ready` 200 with every listener listening, and how many
    /// polls that took (the first starts at the last ACK; one poll takes milliseconds).
    ready_ms: f64,
    ready_polls: usize,
    /// The proxy's CPU (user + system) from its start to the push's last ACK.
    push_cpu_ms: f64,
    push_rss_kib: u64,
    push_rss_anon_kib: u64,
    /// `cluster_manager.active_clusters` after the push.
    active_clusters: u64,
    /// Listener ports (of the bench's) listening after the push.
    listening: usize,
    /// Send to ACK of each incremental update, in order.
    update_ms: Vec<f64>,
    update_cpu_ms_each: f64,
    /// VmRSS right after each update's ACK.
    update_rss_kib: Vec<u64>,
    /// VmRSS a second after the last update.
    updates_rss_kib: u64,
    /// Requests the proxy sent and responses it was sent, by type (cds, eds, ...).
    requests: BTreeMap<String, usize>,
    responses: BTreeMap<String, usize>,
    /// Whether the proxy ever asked for RouteConfigurations.
    asked_for_routes: bool,
    /// The end of what the proxy logged (warnings and up).
    stderr_tail: String,
}

impl Run {
    fn update_percentile(&self, p: f64) -> f64 {
        percentile(&self.update_ms, p)
    }
}

/// Nearest rank: the smallest value with at least `p` of them at or below it.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((p * n as f64).ceil() as usize).clamp(1, n) - 1],
    }
}

pub fn run(bins: Bins, args: &XdsArgs) -> Result<()> {
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(
        args.listeners > 0 && args.listeners <= args.clusters,
        "--listeners must be between 1 and --clusters (each goes to the cluster of its number)"
    );
    ensure!(
        args.routes == 0 || args.routes == args.listeners,
        "--routes must be 0 (tcp_proxy listeners) or as many as --listeners (one each)"
    );
    ensure!(
        args.listeners <= usize::from(u16::MAX - FIRST_LISTEN_PORT),
        "--listeners: at most {} ports from {FIRST_LISTEN_PORT}",
        u16::MAX - FIRST_LISTEN_PORT
    );
    let mut apis = args.api.clone();
    apis.sort();
    apis.dedup();
    let envoy = crate::setup::envoy()?;
    let envoy_version = envoy_version(&envoy)?;
    // Envoy opens a socket per listener and worker.
    harness::raise_open_files_limit();

    let mut node = Node::new()?;
    let proxy = node.add_pod("proxy")?;
    let server = node.add_pod("server")?;
    let apps = ECHO_PORTS
        .iter()
        .map(|port| {
            let mode = if args.routes > 0 { "http" } else { "echo" };
            start_app_mode(&bins, &server, *port, mode)
        })
        .collect::<Result<Vec<_>>>()?;

    let dir = target_dir().join("bench");
    std::fs::create_dir_all(&dir)?;
    // A short path: a Unix socket's is limited to 107 bytes.
    let socket = std::env::temp_dir()
        .join(format!("shunt-bench-xds-{}", std::process::id()))
        .join("ads.sock");
    let mut bootstraps = BTreeMap::new();
    for api in &apis {
        let path = dir.join(format!("xds-{}.json", api.name()));
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&bootstrap(&socket, *api))? + "\n",
        )?;
        validate(&bins.shunt, &envoy, &path)?;
        bootstraps.insert(*api, path);
    }
    let resources = Resources::new(args, server.ipv4());
    let setup = Setup {
        bins,
        envoy,
        envoy_version,
        proxy,
        server,
        socket,
        bootstraps,
        resources,
        http: args.routes > 0,
    };

    let busy = background_busy()?;
    let sizes = setup.resources.sizes();
    println!(
        "bench xds: ADS server (in this process, Unix socket {}) -> [shunt | envoy {}] in pod {}, both --concurrency {CONCURRENCY}; {} EDS clusters (CDS {:.0} KiB, EDS {:.0} KiB), {} {} listeners (LDS {:.0} KiB), {} routes (RDS {:.0} KiB), {} EDS updates; APIs {}; rounds {}; machine busy {busy:.0}% before starting",
        setup.socket.display(),
        setup.envoy_version,
        setup.proxy.name(),
        args.clusters,
        sizes["cds"] as f64 / 1024.0,
        sizes["eds"] as f64 / 1024.0,
        args.listeners,
        listener_kind(args),
        sizes["lds"] as f64 / 1024.0,
        args.routes,
        sizes["rds"] as f64 / 1024.0,
        args.updates,
        apis.iter().map(|a| a.name()).collect::<Vec<_>>().join(","),
        args.rounds
    );
    for api in &apis {
        println!("  bootstrap {}", setup.bootstraps[api].display());
        for p in PROXIES {
            println!("  {:<6} {}", p.name(), setup.command_line(p, *api));
        }
    }
    if busy > 10.0 {
        println!("  warning: something else is using the CPU; numbers will be noisy");
    }

    let mut runs = Vec::new();
    for round in 1..=args.rounds {
        for api in &apis {
            let mut order = PROXIES;
            if round % 2 == 0 {
                order.reverse();
            }
            for proxy in order {
                let run = measure(&setup, proxy, *api, round, args).with_context(|| {
                    format!("round {round}, {} over {}", proxy.name(), api.name())
                })?;
                println!(
                    "  round {round} {:<5} {:<6} push {:>6.0} ms (send->ACK CDS {:.0}, EDS {:.0}, LDS {:.0}, RDS {:.0}), ready {:>6.0} ms, CPU {:.0} ms, RSS {:.1} MiB | {} updates p50 {:.1} ms p99 {:.1} ms, RSS {:.1} MiB | {} clusters active, {} listening, routes asked for: {}",
                    api.name(),
                    proxy.name(),
                    run.push_ms,
                    run.cds_ms,
                    run.eds_ms,
                    run.lds_ms,
                    run.rds_ms,
                    run.ready_ms,
                    run.push_cpu_ms,
                    run.push_rss_kib as f64 / KIB_PER_MIB,
                    run.update_ms.len(),
                    run.update_percentile(0.5),
                    run.update_percentile(0.99),
                    run.updates_rss_kib as f64 / KIB_PER_MIB,
                    run.active_clusters,
                    run.listening,
                    if run.asked_for_routes { "yes" } else { "no" }
                );
                runs.push(run);
            }
        }
    }
    drop(apps);
    drop(node);
    let _ = std::fs::remove_dir_all(setup.socket.parent().expect("a folder"));

    let report = Report {
        args,
        apis,
        busy,
        envoy_version: &setup.envoy_version,
        sizes,
        runs,
    };
    let text = report.table();
    print!("\n{text}");
    save("xds", &text, &report.json(&setup))
}

/// The proxy runs as whatever user it is started as; let any reach the socket.
pub(crate) fn open_to_the_proxy(socket: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    for path in [socket.parent().expect("a folder"), socket] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777))
            .with_context(|| format!("chmod 777 {}", path.display()))?;
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(crate) fn type_name(type_url: &str) -> &'static str {
    match type_url {
        type_urls::CLUSTER => "cds",
        type_urls::ENDPOINT => "eds",
        type_urls::LISTENER => "lds",
        type_urls::ROUTE => "rds",
        type_urls::SECRET => "sds",
        _ => "other",
    }
}

/// The proxy's answer to `sent` (same stream and type, its nonce): its ACK, or an
/// error for a NACK or no answer within [`TIMEOUT`].
fn answer(ads: &AdsServer, proxy: &PodProcess, sent: &Sent) -> Result<Received> {
    let answer = ads
        .wait_for(TIMEOUT, |r| {
            r.stream == sent.stream && r.type_url == sent.type_url && r.response_nonce == sent.nonce
        })
        .map_err(|_| {
            anyhow::anyhow!(
                "no answer to the {} response version {:?} (nonce {}) within {TIMEOUT:?}; proxy {}:\n{}",
                type_name(&sent.type_url),
                sent.version_info,
                sent.nonce,
                proxy
                    .try_wait()
                    .map_or("still running".into(), |s| s.to_string()),
                tail(&proxy.stderr_text())
            )
        })?;
    if let Some((code, message)) = &answer.error_detail {
        bail!(
            "{} NACKed the {} response version {:?}: code {code}: {message}",
            proxy.description(),
            type_name(&sent.type_url),
            sent.version_info
        );
    }
    Ok(answer)
}

pub(crate) fn tail(text: &str) -> &str {
    let start = text.len().saturating_sub(4000);
    let start = (start..text.len())
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(text.len());
    &text[start..]
}

/// An admin API answer's status (0 if it does not answer). From this process rather
/// than curl: polled every few milliseconds, it must cost little and answer fast.
pub(crate) fn admin_status(pod: &Pod, path: &str) -> u16 {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let status = pod.run_in_netns(move || -> std::io::Result<u16> {
        let admin = SocketAddr::from((Ipv4Addr::LOCALHOST, ADMIN_PORT));
        let mut stream = TcpStream::connect_timeout(&admin, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        stream.write_all(request.as_bytes())?;
        let mut head = [0u8; 12];
        stream.read_exact(&mut head)?;
        // "HTTP/1.1 200"
        Ok(std::str::from_utf8(&head[9..])
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0))
    });
    status.ok().and_then(Result::ok).unwrap_or(0)
}

/// How many of the bench's listener ports listen in the pod.
fn listening(pod: &Pod, listeners: usize) -> Result<usize> {
    let ports = FIRST_LISTEN_PORT..FIRST_LISTEN_PORT + listeners as u16;
    Ok(tcp_listeners(pod)?
        .into_iter()
        .map(|a| a.port())
        .filter(|p| ports.contains(p))
        .collect::<BTreeSet<_>>()
        .len())
}

/// "HTTP" or "tcp_proxy": what the listeners are.
fn listener_kind(args: &XdsArgs) -> &'static str {
    if args.routes > 0 {
        "HTTP (RDS)"
    } else {
        "tcp_proxy"
    }
}

/// A request (HTTP listeners) or connection (tcp_proxy) through listener `i`, from the
/// proxy pod, reaches the server on `port`, from the proxy pod's address.
fn check_path(setup: &Setup, i: usize, port: u16) -> Result<()> {
    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, listen_port(i)));
    let c = if setup.http {
        http_call(&setup.proxy, target, &format!("svc{i}.example"))
    } else {
        call(&setup.bins, &setup.proxy, 0, target, 64)
    }
    .with_context(|| format!("through listener {i} ({target})"))?;
    ensure!(
        c.server_local.port() == port && c.server_peer.ip() == IpAddr::from(setup.proxy.ipv4()),
        "a connection through listener {i} ({target}) reached {} from {}; wanted the echo server on :{port} from the proxy pod {}",
        c.server_local,
        c.server_peer,
        setup.proxy.ipv4()
    );
    Ok(())
}

/// One proxy on one API: the full push, its checks, then the incremental updates.
fn measure(setup: &Setup, proxy: Proxy, api: Api, round: usize, args: &XdsArgs) -> Result<Run> {
    let ads = AdsServer::start(Listen::Unix(setup.socket.clone()))?;
    open_to_the_proxy(&setup.socket)?;
    let r = &setup.resources;
    ads.set(type_urls::CLUSTER, "1", r.clusters.clone());
    ads.set(type_urls::ENDPOINT, "1", r.endpoints.clone());
    ads.set(type_urls::LISTENER, "1", r.listeners.clone());
    ads.set(type_urls::ROUTE, "1", r.routes.clone());
    let stale = listening(&setup.proxy, args.listeners)?;
    ensure!(
        stale == 0,
        "{stale} of the listener ports already listen in the proxy pod"
    );

    let (program, argv) = setup.command(proxy, api);
    let started = Instant::now();
    let process = setup.proxy.command(program).args(argv).spawn()?;
    let pid = process.pid();

    // The full push: wait for the ACK of the last type asked for (routes follow
    // listeners).
    let last_type = if setup.http {
        type_urls::ROUTE
    } else {
        type_urls::LISTENER
    };
    let lds = ads
        .wait_for_sent(TIMEOUT, |s| s.type_url == last_type)
        .map_err(|_| {
            anyhow::anyhow!(
                "no {} response sent within {TIMEOUT:?}: the proxy did not ask for them; {}:\n{}",
                type_name(last_type),
                process
                    .try_wait()
                    .map_or("still running".into(), |s| s.to_string()),
                tail(&process.stderr_text())
            )
        })?;
    answer(&ads, &process, &lds)?;
    let push_cpu_ms = proxy_cpu_ticks(pid)? as f64 * TICK_US / 1000.0;
    // Serving: ready, and every listener listening (polled at once, the bookkeeping
    // below can wait).
    let mut ready_polls = 0;
    let ready_at = loop {
        ready_polls += 1;
        if admin_status(&setup.proxy, "/ready") == 200
            && listening(&setup.proxy, args.listeners)? == args.listeners
        {
            break Instant::now();
        }
        ensure!(
            process.try_wait().is_none() && started.elapsed() < TIMEOUT,
            "{} not ready with {} listeners listening (exited: {:?}):\n{}",
            proxy.name(),
            args.listeners,
            process.try_wait(),
            tail(&process.stderr_text())
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let sent = ads.responses();
    let first_request = ads.wait_for(TIMEOUT, |_| true)?;
    let first = sent.first().context("no response sent")?;
    let mut acks = BTreeMap::new();
    let mut pushed = vec![type_urls::CLUSTER, type_urls::ENDPOINT, type_urls::LISTENER];
    if setup.http {
        pushed.push(type_urls::ROUTE);
    }
    for type_url in pushed {
        let last = sent
            .iter()
            .rfind(|s| s.type_url == type_url)
            .with_context(|| format!("no {} response in the push", type_name(type_url)))?;
        let ack = answer(&ads, &process, last)?;
        acks.insert(type_name(type_url), (last.at, ack.at));
    }
    if let Some(nack) = ads.requests().iter().find(|r| r.is_nack()) {
        bail!(
            "{} NACKed a {} response during the push: {:?}",
            proxy.name(),
            type_name(&nack.type_url),
            nack.error_detail
        );
    }
    let end = acks
        .values()
        .map(|(_, ack)| *ack)
        .max()
        .expect("three or four types");
    let send_to_ack = |t: &str| ms(acks[t].1 - acks[t].0);

    // Let the proxy settle (freed memory returned, workers idle) before reading.
    std::thread::sleep(Duration::from_secs(1));
    let (push_rss_kib, push_rss_anon_kib) = rss(pid)?;
    let active_clusters = admin_counter(&setup.proxy, "cluster_manager.active_clusters")
        .context("no cluster_manager.active_clusters in the admin API's /stats")?;
    ensure!(
        active_clusters >= args.clusters as u64,
        "{} counts {active_clusters} active clusters after the push of {}",
        proxy.name(),
        args.clusters
    );
    let listening_after = listening(&setup.proxy, args.listeners)?;
    // Cluster 0 has one endpoint, the echo server on the first port.
    check_path(setup, 0, ECHO_PORTS[0])?;

    // Incremental updates: cluster u's endpoints become one echo server, alternating
    // between the two when the updates wrap around the listeners' clusters.
    let mut endpoints = r.endpoints.clone();
    let mut update_ms = Vec::with_capacity(args.updates);
    let mut update_rss_kib = Vec::with_capacity(args.updates);
    let cpu_before = proxy_cpu_ticks(pid)?;
    let mut last = None;
    for u in 0..args.updates {
        let i = u % args.listeners;
        let port = ECHO_PORTS[1 - (u / args.listeners) % 2];
        endpoints[i] = assignment(i, setup.server.ipv4(), &[port]);
        let version = (u + 2).to_string();
        ads.set(type_urls::ENDPOINT, &version, endpoints.clone());
        let sent = ads.wait_for_sent(TIMEOUT, |s| {
            s.type_url == type_urls::ENDPOINT && s.version_info == version
        })?;
        let ack = answer(&ads, &process, &sent)?;
        update_ms.push(ms(ack.at - sent.at));
        update_rss_kib.push(rss(pid)?.0);
        last = Some((i, port));
    }
    let cpu_after = proxy_cpu_ticks(pid)?;
    if let Some((i, port)) = last {
        check_path(setup, i, port).context("after the updates")?;
    }
    std::thread::sleep(Duration::from_secs(1));
    let updates_rss_kib = rss(pid)?.0;
    ensure!(
        process.try_wait().is_none(),
        "{} exited:\n{}",
        process.description(),
        tail(&process.stderr_text())
    );
    let stderr_tail = tail(&process.stderr_text()).to_owned();
    drop(process);

    let count = |type_urls: Vec<&str>| {
        let mut n = BTreeMap::new();
        for t in type_urls {
            *n.entry(type_name(t).to_owned()).or_insert(0) += 1;
        }
        n
    };
    let requests_log = ads.requests();
    let requests = count(requests_log.iter().map(|r| r.type_url.as_str()).collect());
    let responses = count(
        ads.responses()
            .iter()
            .map(|s| s.type_url.as_str())
            .collect(),
    );
    drop(ads);
    Ok(Run {
        round,
        proxy,
        api,
        start_ms: ms(first_request.at - started),
        push_ms: ms(end - first.at),
        cds_ms: send_to_ack("cds"),
        eds_ms: send_to_ack("eds"),
        lds_ms: send_to_ack("lds"),
        rds_ms: if setup.http {
            send_to_ack("rds")
        } else {
            f64::NAN
        },
        ready_ms: ms(ready_at - first.at),
        ready_polls,
        push_cpu_ms,
        push_rss_kib,
        push_rss_anon_kib,
        active_clusters,
        listening: listening_after,
        update_cpu_ms_each: if update_ms.is_empty() {
            f64::NAN
        } else {
            (cpu_after - cpu_before) as f64 * TICK_US / 1000.0 / update_ms.len() as f64
        },
        update_ms,
        update_rss_kib,
        updates_rss_kib,
        requests,
        responses,
        asked_for_routes: requests_log.iter().any(|r| r.type_url == type_urls::ROUTE),
        stderr_tail,
    })
}

/// A row of the table: how to read it from a run.
struct Metric {
    key: &'static str,
    label: &'static str,
    get: fn(&Run) -> f64,
}

fn mib(kib: u64) -> f64 {
    kib as f64 / KIB_PER_MIB
}

const METRICS: &[Metric] = &[
    Metric {
        key: "start_ms",
        label: "proxy start -> first xDS request (ms)",
        get: |r| r.start_ms,
    },
    Metric {
        key: "push_ms",
        label: "full push: first send -> last ACK (ms)",
        get: |r| r.push_ms,
    },
    Metric {
        key: "cds_ms",
        label: "  CDS send -> ACK (ms)",
        get: |r| r.cds_ms,
    },
    Metric {
        key: "eds_ms",
        label: "  EDS send -> ACK (ms)",
        get: |r| r.eds_ms,
    },
    Metric {
        key: "lds_ms",
        label: "  LDS send -> ACK (ms)",
        get: |r| r.lds_ms,
    },
    Metric {
        key: "rds_ms",
        label: "  RDS send -> ACK (ms)",
        get: |r| r.rds_ms,
    },
    Metric {
        key: "ready_ms",
        label: "  first send -> ready, all listening (ms)",
        get: |r| r.ready_ms,
    },
    Metric {
        key: "push_cpu_ms",
        label: "  proxy CPU, start to last ACK (ms)",
        get: |r| r.push_cpu_ms,
    },
    Metric {
        key: "push_rss_mib",
        label: "proxy RSS after the push (MiB)",
        get: |r| mib(r.push_rss_kib),
    },
    Metric {
        key: "push_rss_anon_mib",
        label: "  of it anonymous (MiB)",
        get: |r| mib(r.push_rss_anon_kib),
    },
    Metric {
        key: "update_p50_ms",
        label: "EDS update send -> ACK p50 (ms)",
        get: |r| r.update_percentile(0.5),
    },
    Metric {
        key: "update_p99_ms",
        label: "  p99 (ms)",
        get: |r| r.update_percentile(0.99),
    },
    Metric {
        key: "update_cpu_ms",
        label: "  proxy CPU per update (ms)",
        get: |r| r.update_cpu_ms_each,
    },
    Metric {
        key: "updates_rss_mib",
        label: "proxy RSS after the updates (MiB)",
        get: |r| mib(r.updates_rss_kib),
    },
];

fn metric(key: &str) -> &'static Metric {
    METRICS
        .iter()
        .find(|m| m.key == key)
        .expect("a metric of the table")
}

/// The targets, reported (never asserted): (metric, label, unit, goal).
const GOALS: [(&str, &str, &str, Goal); 3] = [
    (
        "push_ms",
        "full push: shunt < 1 s",
        "ms",
        Goal::Under(1000.0),
    ),
    (
        "push_ms",
        "full push: shunt <= envoy / 2",
        "ms",
        Goal::RatioAtMost(0.5),
    ),
    (
        "push_rss_mib",
        "RSS after the push: shunt <= envoy / 2",
        "MiB",
        Goal::RatioAtMost(0.5),
    ),
];

struct Report<'a> {
    args: &'a XdsArgs,
    apis: Vec<Api>,
    busy: f64,
    envoy_version: &'a str,
    sizes: BTreeMap<&'static str, usize>,
    runs: Vec<Run>,
}

impl Report<'_> {
    fn median(&self, api: Api, proxy: Proxy, metric: &Metric) -> f64 {
        median(
            self.runs
                .iter()
                .filter(|r| r.api == api && r.proxy == proxy)
                .map(metric.get),
        )
    }

    fn ratio(&self, api: Api, metric: &Metric) -> f64 {
        self.median(api, Proxy::Shunt, metric) / self.median(api, Proxy::Envoy, metric)
    }

    /// (label, shunt's value, its unit, shunt/envoy, met) per goal.
    fn goals(&self, api: Api) -> Vec<(&'static str, f64, &'static str, f64, bool)> {
        GOALS
            .iter()
            .map(|(key, label, unit, goal)| {
                let m = metric(key);
                let value = self.median(api, Proxy::Shunt, m);
                let ratio = self.ratio(api, m);
                let met = goal.met(value, ratio);
                (*label, value, *unit, ratio, met)
            })
            .collect()
    }

    fn asked_for_routes(&self, api: Api, proxy: Proxy) -> bool {
        self.runs
            .iter()
            .any(|r| r.api == api && r.proxy == proxy && r.asked_for_routes)
    }

    fn table(&self) -> String {
        let a = self.args;
        let mut t = String::new();
        for api in &self.apis {
            let api = *api;
            let _ = writeln!(
                t,
                "bench xds: shunt vs Envoy {} over one ADS stream, {}, Unix socket; {} EDS clusters ({} KiB) with {} ClusterLoadAssignments of 1-2 endpoints ({} KiB), {} {} listeners ({} KiB), {} RouteConfigurations ({} KiB); {} EDS updates of one cluster each ({}); both --concurrency {CONCURRENCY}; medians over rounds: {}; kernel {}, {} CPUs",
                self.envoy_version,
                api.title(),
                a.clusters,
                self.sizes["cds"] / 1024,
                a.clusters,
                self.sizes["eds"] / 1024,
                a.listeners,
                listener_kind(a),
                self.sizes["lds"] / 1024,
                a.routes,
                self.sizes["rds"] / 1024,
                a.updates,
                match api {
                    Api::Sotw => "SotW: the server resends every ClusterLoadAssignment each time",
                    Api::Delta => "Delta: the server sends the changed one",
                },
                a.rounds,
                kernel(),
                cpus()
            );
            let _ = writeln!(
                t,
                "{:<44}{:>10}{:>10}{:>13}",
                "", "shunt", "envoy", "shunt/envoy"
            );
            for m in METRICS {
                let _ = write!(t, "{:<44}", m.label);
                for p in PROXIES {
                    let _ = write!(t, "{:>10}", fmt_value(self.median(api, p, m)));
                }
                let ratio = self.ratio(api, m);
                let cell = if ratio.is_finite() {
                    format!("{ratio:.2}x")
                } else {
                    "-".into()
                };
                let _ = writeln!(t, "{cell:>13}");
            }
            let _ = writeln!(t, "goals (reported, not asserted):");
            for (label, value, unit, ratio, met) in self.goals(api) {
                let _ = writeln!(
                    t,
                    "  {label:<40} shunt {:>6} {unit:<3}  shunt/envoy {ratio:>5.2}x  {}",
                    fmt_value(value),
                    if met { "met" } else { "NOT met" }
                );
            }
            t.push('\n');
        }
        t
    }

    fn json(&self, setup: &Setup) -> Value {
        let a = self.args;
        let per_api = |api: Api| -> Value {
            let per = |p: Proxy| -> Value {
                METRICS
                    .iter()
                    .map(|m| (m.key.to_owned(), json!(self.median(api, p, m))))
                    .collect::<serde_json::Map<_, _>>()
                    .into()
            };
            json!({
                "bootstrap": std::fs::read_to_string(&setup.bootstraps[&api]).unwrap_or_default(),
                "shunt_command": setup.command_line(Proxy::Shunt, api),
                "envoy_command": setup.command_line(Proxy::Envoy, api),
                "median": {"shunt": per(Proxy::Shunt), "envoy": per(Proxy::Envoy)},
                "ratio_shunt_over_envoy": METRICS.iter().map(|m| (m.key.to_owned(), json!(self.ratio(api, m)))).collect::<serde_json::Map<_, _>>(),
                "goals": self.goals(api).iter().map(|(label, value, unit, ratio, met)| json!({"goal": label, "shunt": value, "unit": unit, "shunt_over_envoy": ratio, "met": met})).collect::<Vec<_>>(),
                "routes_asked_for": {"shunt": self.asked_for_routes(api, Proxy::Shunt), "envoy": self.asked_for_routes(api, Proxy::Envoy)},
            })
        };
        json!({
            "bench": "xds",
            "config": {
                "envoy_version": self.envoy_version,
                "clusters": a.clusters,
                "listeners": a.listeners,
                "routes": a.routes,
                "updates": a.updates,
                "rounds": a.rounds,
                "encoded_bytes": self.sizes,
                "concurrency": CONCURRENCY.parse::<u32>().unwrap_or(0),
                "kernel": kernel(),
                "cpus": cpus(),
                "background_busy_pct": self.busy,
            },
            "apis": self.apis.iter().map(|api| (api.name().to_owned(), per_api(*api))).collect::<serde_json::Map<_, _>>(),
            "runs": self.runs,
        })
    }
}
