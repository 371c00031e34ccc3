//! `shunt proxy`: the listeners captured traffic lands in, outbound on 15001 and inbound
//! on 15006, each on 0.0.0.0 and [::].
//!
//! Start-up order matters: bind the listeners while still root, drop to the proxy's
//! uid/gid (which is what keeps its own upstream connections out of capture), and only
//! then start the data-plane runtime's worker threads. Every accepted connection gets
//! its own task: the original destination is read (Envoy's `original_dst` listener
//! filter) and the connection is handed to [`crate::tcp`].
//!
//! With a bootstrap (`-c`, `--config-yaml`) the listeners are the bootstrap's instead
//! ([`bootstrap`]): compiled into a snapshot, matched by filter chain
//! ([`filter_chain`]), inspected ([`inspector`]) and served per connection
//! ([`connection_handler`]).

mod bind;
mod bootstrap;
pub mod config;
mod connection_handler;
pub mod filter_chain;
mod inspector;
mod original_dst;
mod user;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;

use crate::access_log::{Direction, Entry};
use crate::tcp;

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
    /// Log filter for stderr logs: a level (error, warn, info, debug, trace) or
    /// tracing directives. The access log always goes to stdout.
    #[arg(long, default_value = "info", value_name = "FILTER")]
    pub log_level: String,
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
    /// serve: run the proxy; validate: check the bootstrap, print a summary and exit
    /// (non-zero if it is invalid).
    #[arg(long, value_enum, default_value_t = crate::config::Mode::Serve)]
    pub mode: crate::config::Mode,
}

pub fn run(args: ProxyArgs) -> anyhow::Result<()> {
    init_logging(&args.log_level)?;
    user::raise_open_files_limit();
    let bootstrap = crate::config::Options {
        config_path: args.config_path.clone(),
        config_yaml: args.config_yaml.clone(),
        service_node: args.service_node.clone(),
        service_cluster: args.service_cluster.clone(),
        drain_time: Duration::from_secs(args.drain_time_s),
        parent_shutdown_time: Duration::from_secs(args.parent_shutdown_time_s),
    };
    match args.mode {
        crate::config::Mode::Validate => return crate::config::validate_mode(&bootstrap),
        crate::config::Mode::Serve if bootstrap.has_bootstrap() => {
            return bootstrap::run(&args, &bootstrap);
        }
        crate::config::Mode::Serve => {}
    }
    if args.outbound_port != 0 && args.outbound_port == args.inbound_port {
        anyhow::bail!(
            "--outbound-port and --inbound-port are both {}",
            args.outbound_port
        );
    }

    let mut listeners = bind::bind_listener(Direction::Outbound, args.outbound_port)?;
    listeners.extend(bind::bind_listener(Direction::Inbound, args.inbound_port)?);
    let mut own_ports: Vec<u16> = listeners.iter().map(|b| b.addr.port()).collect();
    own_ports.dedup();
    if listeners.iter().any(|b| b.addr.is_ipv6()) {
        warn_if_inbound_source_v6_missing();
    }

    drop_privileges(&args)?;
    let runtime = data_plane_runtime(args.concurrency)?;
    let settings = Arc::new(tcp::Settings {
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        own_ports,
    });
    let result = runtime.block_on(serve(listeners, settings));
    // Connections still open are dropped with the runtime: shutdown is prompt, not a drain.
    runtime.shutdown_background();
    result
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

/// The multi-threaded runtime connections run on; 0 workers means one per CPU.
fn data_plane_runtime(concurrency: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let workers = match concurrency {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name("shunt-worker")
        .enable_all()
        .build()
        .context("starting the data-plane runtime")
}

/// Inbound IPv6 passthrough connects from ::6, which FREEBIND lets us bind but only an
/// address on lo makes routable: without it the app's SYN-ACK has nowhere to go and
/// every inbound IPv6 connection ends in UF. istio-iptables adds it
/// (`ip -6 addr add ::6/128 dev lo`); say so at start-up rather than per connection.
fn warn_if_inbound_source_v6_missing() {
    let source = SocketAddr::new(tcp::INBOUND_PASSTHROUGH_SOURCE_V6.into(), 0);
    if let Err(err) = std::net::TcpListener::bind(source)
        && err.raw_os_error() == Some(libc::EADDRNOTAVAIL)
    {
        tracing::warn!(
            "{} is not configured on this host, so inbound IPv6 connections cannot reach \
             the app; capture should run `ip -6 addr add ::6/128 dev lo`",
            tcp::INBOUND_PASSTHROUGH_SOURCE_V6
        );
    }
}

/// Installs the stderr logger, reloadable from the admin API's `/logging`.
fn init_logging(filter: &str) -> anyhow::Result<()> {
    // The parse error repeats its cause in its own message: show it once.
    tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|err| anyhow::anyhow!("invalid --log-level {filter:?}: {err}"))?;
    crate::admin::logging::init(filter)
}

/// Accepts on every listener until SIGTERM or SIGINT.
async fn serve(listeners: Vec<bind::Bound>, settings: Arc<tcp::Settings>) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;

    let mut accepting = JoinSet::new();
    for bound in listeners {
        let listener = TcpListener::from_std(bound.listener)
            .with_context(|| format!("registering the listener on {}", bound.addr))?;
        tracing::info!(direction = %bound.direction, addr = %bound.addr, "listening");
        accepting.spawn(accept_loop(
            listener,
            bound.direction,
            bound.addr,
            settings.clone(),
        ));
    }

    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: stopping"),
        _ = sigint.recv() => tracing::info!("SIGINT: stopping"),
        Some(ended) = accepting.join_next() => {
            anyhow::bail!("an accept loop ended unexpectedly: {ended:?}");
        }
    }
    // Dropping the accept loops closes the listening sockets: no new connections.
    accepting.abort_all();
    Ok(())
}

async fn accept_loop(
    listener: TcpListener,
    direction: Direction,
    addr: SocketAddr,
    settings: Arc<tcp::Settings>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tokio::spawn(handle(
                    stream,
                    peer,
                    direction,
                    addr.port(),
                    settings.clone(),
                ));
            }
            // The client gave up while queued; nothing to back off from.
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
            Err(err) => {
                // Out of file descriptors or memory: back off instead of spinning, the
                // pending connections stay queued in the backlog.
                tracing::warn!(%addr, %err, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    direction: Direction,
    listener_port: u16,
    settings: Arc<tcp::Settings>,
) {
    let local = match stream.local_addr() {
        Ok(local) => local,
        Err(err) => {
            tracing::warn!(%peer, %err, "accepted connection has no local address; closing");
            return;
        }
    };
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let entry = Entry::start(direction, canonical(peer), canonical(local));
    let original_dst = match original_dst::original_dst(&stream, local, listener_port) {
        Ok(dst) => Some(dst),
        Err(err) => {
            tracing::warn!(%peer, %err, "closing connection");
            None
        }
    };
    tcp::proxy(stream, entry, original_dst, &settings).await;
}
