//! The program: `shunt proxy`'s start-up, runtimes, privilege drop and serve loops.
//!
//! Start-up order matters: bind the listeners while still root, drop to the proxy's
//! uid/gid (which is what keeps its own upstream connections out of capture), and only
//! then start the data-plane runtime's worker threads. Without a bootstrap the proxy is
//! an Istio pod's passthrough ([`passthrough`]); with one (`-c`, `--config-yaml`) it
//! serves the bootstrap's listeners and clusters, static or from xDS ([`bootstrap`]);
//! `--mode validate` only reports on the bootstrap ([`validate`]).

pub mod agent;
mod agent_client;
mod agent_jobs;
mod app_watch;
mod bind;
mod bootstrap;
mod capture_sockets;
mod dns;
mod envoy_flags;
pub mod node;
mod passthrough;
mod user;
mod validate;

use std::time::Duration;

use anyhow::Context;
use shunt_core::event::workers;

#[derive(clap::Args, Debug)]
pub struct ProxyArgs {
    /// Port of the outbound listener, where captured outbound traffic lands
    /// (istio-iptables -p).
    #[arg(long, default_value_t = 15001, value_name = "PORT")]
    pub outbound_port: u16,
    /// Port of the inbound listener, where captured inbound traffic lands
    /// (istio-iptables -z).
    #[arg(long, default_value_t = 15006, value_name = "PORT")]
    pub inbound_port: u16,
    /// Worker threads of the data-plane runtime; 0 means one per CPU.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub concurrency: usize,
    /// User to run as after binding, when started as root (istio-iptables -u).
    #[arg(long, default_value_t = 1337)]
    pub uid: u32,
    /// Group to run as after binding, when started as root (istio-iptables -g).
    #[arg(long, default_value_t = 1337)]
    pub gid: u32,
    /// Keep running as the starting user instead of dropping to --uid/--gid.
    #[arg(long)]
    pub keep_user: bool,
    /// Time allowed for an upstream connect before the downstream is reset (flag UF).
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    pub connect_timeout_ms: u64,
    /// Log level for stderr logs: Envoy's names (trace, debug, info, warning/warn,
    /// error, critical, off) or tracing directives. The access log always goes to stdout.
    #[arg(short = 'l', long, default_value = "info", value_name = "LEVEL")]
    pub log_level: String,
    /// Envoy's per-component levels (`misc:error,upstream:debug`): components shunt has
    /// a module for get that module's level, the others are accepted and have no logs.
    #[arg(long, value_name = "COMPONENT:LEVEL,...")]
    pub component_log_level: Option<String>,
    /// Envoy's log line format: accepted; shunt's stderr log has its own format.
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<String>,
    /// Envoy v3 bootstrap file, JSON or YAML (by extension, else by content).
    #[arg(short = 'c', long, value_name = "FILE")]
    pub config_path: Option<std::path::PathBuf>,
    /// Bootstrap as YAML, merged over --config-path as Envoy merges it.
    #[arg(long, value_name = "YAML")]
    pub config_yaml: Option<String>,
    /// Sets the bootstrap's node.id.
    #[arg(long, value_name = "ID")]
    pub service_node: Option<String>,
    /// Sets the bootstrap's node.cluster.
    #[arg(long, value_name = "CLUSTER")]
    pub service_cluster: Option<String>,
    /// Time to drain connections on shutdown or listener removal.
    #[arg(long, default_value_t = 600, value_name = "SECONDS")]
    pub drain_time_s: u64,
    /// Time before a hot-restarted parent is shut down.
    #[arg(long, default_value_t = 900, value_name = "SECONDS")]
    pub parent_shutdown_time_s: u64,
    /// Envoy's drain strategy: shunt drains `immediate`ly (HTTP connections are told to
    /// close as soon as the drain starts); `gradual` is accepted and drains the same way.
    #[arg(long, value_enum, default_value_t = envoy_flags::DrainStrategy::Gradual)]
    pub drain_strategy: envoy_flags::DrainStrategy,
    /// Envoy's address family for the local address (node metadata): accepted.
    #[arg(long, value_enum, default_value_t = envoy_flags::IpVersion::V4)]
    pub local_address_ip_version: envoy_flags::IpVersion,
    /// Envoy's access log flush interval: accepted; shunt writes each entry at once.
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    pub file_flush_interval_msec: u64,
    /// Envoy's access log buffer size before a flush: accepted, as above.
    #[arg(long, value_name = "KB")]
    pub file_flush_min_size_kb: Option<u64>,
    /// shunt has no hot restart: accepted.
    #[arg(long)]
    pub disable_hot_restart: bool,
    /// Hot restart epoch: only 0 (a first start), as shunt has no hot restart.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub restart_epoch: u32,
    /// Envoy's leniency for unknown fields in the bootstrap: accepted; shunt reports
    /// unknown fields as warnings and serves what it knows either way.
    #[arg(long)]
    pub allow_unknown_static_fields: bool,
    /// serve: run the proxy; validate: check the bootstrap, print a summary and exit
    /// (non-zero if it is invalid).
    #[arg(long, value_enum, default_value_t = shunt_config::Mode::Serve)]
    pub mode: shunt_config::Mode,
    /// Serve Istio's DNS proxy on ADDR, UDP and TCP (repeatable). Without it the DNS
    /// proxy is on when ISTIO_META_DNS_CAPTURE=true or the node metadata has
    /// DNS_CAPTURE=true, on 127.0.0.1:15053 and [::1]:15053.
    #[arg(long = "dns-listen", value_name = "ADDR")]
    pub dns_listen: Vec<std::net::SocketAddr>,
    /// The resolv.conf whose nameservers get the queries not for the mesh, and whose
    /// first search domain the name table expands names with.
    #[arg(long, default_value = "/etc/resolv.conf", value_name = "PATH")]
    pub dns_resolv_conf: std::path::PathBuf,
    /// Time an upstream DNS server has to answer before the next one is asked.
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    pub dns_upstream_timeout_ms: u64,
    /// Forwarded answers kept for their TTL; 0 turns the cache off.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub dns_cache_size: usize,
    /// Set by `shunt agent` when it runs the proxy in its own process: the agent then
    /// owns SIGTERM/SIGINT and the drain.
    #[arg(skip)]
    pub embedded: Option<std::sync::Arc<agent::Embedded>>,
}

impl ProxyArgs {
    /// `shunt proxy`'s settings when no flag is given (the flags' own defaults).
    pub fn defaults() -> ProxyArgs {
        #[derive(clap::Parser)]
        struct NoFlags {
            #[command(flatten)]
            args: ProxyArgs,
        }
        <NoFlags as clap::Parser>::parse_from(["shunt-proxy"]).args
    }
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    HousekeepingSignals::ignore_until_installed()?;
    init_logging(&envoy_flags::log_filter(
        &args.log_level,
        args.component_log_level.as_deref(),
    )?)?;
    run_initialized(args)
}

/// `shunt proxy` once logging is up (`shunt agent` sets it up itself).
fn run_initialized(args: ProxyArgs) -> anyhow::Result<()> {
    envoy_flags::check(&args)?;
    user::raise_open_files_limit();
    let bootstrap = shunt_config::Options {
        config_path: args.config_path.clone(),
        config_yaml: args.config_yaml.clone(),
        service_node: args.service_node.clone(),
        service_cluster: args.service_cluster.clone(),
        drain_time: Duration::from_secs(args.drain_time_s),
        parent_shutdown_time: Duration::from_secs(args.parent_shutdown_time_s),
    };
    if args.mode == shunt_config::Mode::Validate {
        return validate::run(&bootstrap);
    }
    // Opened while still root; it logs for as long as the proxy runs.
    let _kernel_log = kernel_log();
    if bootstrap.has_bootstrap() {
        bootstrap::run(&args, &bootstrap)
    } else {
        passthrough::run(&args)
    }
}

/// In a pod captured by `shunt capture` (eBPF), its programs' aya-log records join this
/// log (`shunt::ebpf`); the bpffs root is `SHUNT_BPFFS`, as for `shunt capture`.
fn kernel_log() -> Option<shunt_capture::kernel_log::KernelLog> {
    let root = std::env::var_os("SHUNT_BPFFS").unwrap_or_else(|| "/sys/fs/bpf/shunt".into());
    match shunt_capture::kernel_log::KernelLog::for_this_pod(std::path::Path::new(&root)) {
        Ok(log) => log,
        Err(err) => {
            tracing::warn!("the capture programs' log is not readable: {err:#}");
            None
        }
    }
}

/// The signals that do not stop the proxy, as Envoy treats them: SIGHUP is ignored, and
/// SIGUSR1 reopens the access log files (logrotate's `postrotate`). Installed before
/// the first connection is accepted, so neither takes the process down.
struct HousekeepingSignals {
    hangup: tokio::signal::unix::Signal,
    user1: tokio::signal::unix::Signal,
}

impl HousekeepingSignals {
    /// Loading a bootstrap can take a while (a large file, a slow volume): a logrotate
    /// SIGUSR1 or a SIGHUP in that time must not kill the process either. Ignored until
    /// [`HousekeepingSignals::install`] replaces the disposition with its handler.
    fn ignore_until_installed() -> anyhow::Result<()> {
        use nix::sys::signal::{SigHandler, Signal, signal};
        for sig in [Signal::SIGHUP, Signal::SIGUSR1] {
            // SAFETY: SIG_IGN runs no code in the handler, and no other signal handler
            // is installed yet that this could race with.
            unsafe { signal(sig, SigHandler::SigIgn) }
                .with_context(|| format!("ignoring {sig} while starting"))?;
        }
        Ok(())
    }

    fn install() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(HousekeepingSignals {
            hangup: signal(SignalKind::hangup()).context("installing a SIGHUP handler")?,
            user1: signal(SignalKind::user_defined1()).context("installing a SIGUSR1 handler")?,
        })
    }

    /// Handles the next one of them; never returns otherwise.
    async fn handle_next(&mut self) {
        tokio::select! {
            _ = self.hangup.recv() => tracing::info!("SIGHUP: ignored"),
            _ = self.user1.recv() => {
                let reopened = shunt_core::access_log::reopen_files();
                tracing::info!(files = reopened, "SIGUSR1: access logs reopened");
            }
        }
    }
}

/// Drops to --uid/--gid once the listeners are bound (unless --keep-user).
fn drop_privileges(args: &ProxyArgs) -> anyhow::Result<()> {
    if args.keep_user {
        tracing::info!("--keep-user: not changing user");
    } else if user::is_root() {
        user::drop_to(args.uid, args.gid)
            .with_context(|| format!("dropping privileges to {}:{}", args.uid, args.gid))?;
        tracing::info!(uid = args.uid, gid = args.gid, "dropped root");
    } else {
        tracing::warn!(
            "not started as root, so not switching to {}:{}; capture will only skip this \
             proxy's own connections if it already runs as that user",
            args.uid,
            args.gid
        );
    }
    Ok(())
}

/// The data plane's workers (Envoy's; `event::workers`), 0 meaning one per CPU: the
/// first is the runtime returned, which the calling thread drives with `block_on`, the
/// others run on threads of their own. Every listener accepts on each worker.
fn data_plane_runtime(concurrency: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let workers = match concurrency {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let runtime = workers::runtime().context("starting the data-plane runtime")?;
    workers::start(Some(&runtime), workers - 1, shunt_memory::cache_this_thread)
        .context("starting the data plane's workers")?;
    Ok(runtime)
}

/// Envoy's main thread: the xDS streams, the compiles of their updates and the
/// clusters they bring start here, so a push never stalls the workers' event loops.
fn main_thread_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("shunt-main")
        .enable_all()
        .build()
        .context("starting the main-thread runtime")
}

/// Installs the stderr logger, reloadable from the admin API's `/logging`.
fn init_logging(filter: &str) -> anyhow::Result<()> {
    // The parse error repeats its cause in its own message: show it once.
    tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|err| anyhow::anyhow!("invalid --log-level {filter:?}: {err}"))?;
    shunt_admin::logging::init(filter)
}
