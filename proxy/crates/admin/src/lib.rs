//! The Envoy-compatible admin API (bootstrap `admin.address`, 127.0.0.1:15000 in Istio),
//! and Istio's two health ports (15090 Prometheus, 15021 readiness), which it answers in
//! place of Envoy's admin and pilot-agent ([`shunt_config::health_ports`]).
//!
//! Threading: [`start_with`] binds every socket on the calling thread (errors surface there,
//! and before privileges are dropped), then serves on its own thread with a small
//! current-thread tokio runtime, apart from the data-plane runtime, so that a slow scrape
//! or a large `/config_dump` never holds up a data-plane worker (ztunnel does the same).
//!
//! The proxy is reached through one trait, [`ProxyState`]: the config tracker
//! (`resources()`), stats, readiness, drain and shutdown. The data plane implements it with
//! its live snapshot ([`live::Live`]); the admin API's own tests use
//! `BootstrapOnly`, built from the bootstrap alone. Stats live in a [`shunt_core::stats::Store`] whose
//! handles the data plane updates lock-free.
//!
//! The admin API itself owns the health-check state (`/healthcheck/fail`), the server
//! state (`LIVE`, `DRAINING`, `INITIALIZING`) and the `server.*` stats.

#![forbid(unsafe_code)]

#[cfg(test)]
mod bootstrap_only;
mod config_dump;
mod handlers;
pub mod live;

pub mod logging;
mod prometheus;
mod server;
pub mod state;
mod tags;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use envoy_types::pb::envoy::admin::v3::{CommandLineOptions, command_line_options, server_info};
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use tokio::sync::watch;

#[cfg(test)]
pub use bootstrap_only::BootstrapOnly;
pub use logging::LogControl;
pub use shunt_config::health_ports::HealthListener;
use shunt_core::stats::Stat;
pub use state::{Drain, ProxyState};

/// What the admin API needs besides the bootstrap and the proxy.
#[derive(Clone)]
pub struct AdminSettings {
    /// What `/server_info` shows as `command_line_options`.
    pub command_line: CommandLineOptions,
    /// The log levels `/logging` lists and changes.
    pub log: LogControl,
    /// Set once whoever owns the pod's lifecycle (`shunt agent`, node mode) starts
    /// terminating it: from then on Istio's 15021 health port answers 503, as
    /// pilot-agent's readiness does (the kubelet takes the pod out of its Services
    /// while it drains). Envoy's own `/ready` does not change with a drain.
    pub terminating: Arc<AtomicBool>,
}

impl Default for AdminSettings {
    fn default() -> Self {
        AdminSettings {
            command_line: CommandLineOptions::default(),
            log: LogControl::global(),
            terminating: Arc::default(),
        }
    }
}

impl AdminSettings {
    /// The options of `shunt proxy` as Envoy's `command_line_options`.
    pub fn from_command_line(
        config: &shunt_config::Options,
        log_level: &str,
        concurrency: usize,
    ) -> Self {
        let duration = |d: Duration| envoy_types::pb::google::protobuf::Duration {
            seconds: d.as_secs() as i64,
            nanos: d.subsec_nanos() as i32,
        };
        AdminSettings {
            command_line: CommandLineOptions {
                concurrency: u32::try_from(concurrency).unwrap_or(u32::MAX),
                config_path: config
                    .config_path
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                config_yaml: config.config_yaml.clone().unwrap_or_default(),
                log_level: log_level.into(),
                service_node: config.service_node.clone().unwrap_or_default(),
                service_cluster: config.service_cluster.clone().unwrap_or_default(),
                drain_time: Some(duration(config.drain_time)),
                parent_shutdown_time: Some(duration(config.parent_shutdown_time)),
                mode: command_line_options::Mode::Serve as i32,
                disable_hot_restart: true,
                ..Default::default()
            },
            log: LogControl::global(),
            terminating: Arc::default(),
        }
    }
}

/// Starts the admin API for `bootstrap` (on `admin.address`, if it has one) and the health
/// ports among its static listeners. Sockets are bound before this returns.
pub fn start_with(
    bootstrap: &Bootstrap,
    state: Arc<dyn ProxyState>,
    settings: AdminSettings,
) -> anyhow::Result<AdminHandle> {
    let admin_address = admin_address(bootstrap)?;
    let admin = admin_address
        .map(|address| {
            bind(address).with_context(|| format!("binding the admin address {address}"))
        })
        .transpose()?;
    let mut health = Vec::new();
    for listener in shunt_config::health_ports::find(bootstrap) {
        let socket = bind(listener.address).with_context(|| {
            format!("binding listener {} on {}", listener.name, listener.address)
        })?;
        health.push((listener, socket));
    }
    let bound_admin = admin.as_ref().map(|s| s.local_addr()).transpose()?;
    let bound_health = health
        .iter()
        .map(|(listener, socket)| {
            Ok(BoundHealthListener {
                listener: listener.clone(),
                local_address: socket.local_addr()?,
            })
        })
        .collect::<std::io::Result<Vec<_>>>()?;

    let (stop, stop_rx) = watch::channel(false);
    let stop = Arc::new(stop);
    let shared = Arc::new(Shared {
        state,
        stats_config: tags::StatsConfig::from_bootstrap(bootstrap),
        log: settings.log,
        started: SystemTime::now(),
        started_at: Instant::now(),
        health_check_failed: AtomicBool::new(false),
        terminating: settings.terminating,
        command_line: settings.command_line,
        stop: stop.clone(),
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the admin runtime")?;
    let thread = std::thread::Builder::new()
        .name("shunt-admin".into())
        .spawn(move || runtime.block_on(server::serve(shared, admin, health, stop_rx)))
        .context("starting the admin thread")?;
    Ok(AdminHandle {
        admin_address: bound_admin,
        health: bound_health,
        stop,
        thread: Some(thread),
    })
}

/// `admin.address` as a socket address; `None` without an admin section (no admin API,
/// as in Envoy).
fn admin_address(bootstrap: &Bootstrap) -> anyhow::Result<Option<SocketAddr>> {
    let Some(address) = bootstrap.admin.as_ref().and_then(|a| a.address.as_ref()) else {
        return Ok(None);
    };
    shunt_config::socket_addr(address).map(Some).ok_or_else(|| {
        anyhow::anyhow!(
            "admin.address: {:?} is not an IP socket address with a port_value, the only \
             kind shunt's admin API binds",
            shunt_config::address_text(address)
        )
    })
}

fn bind(address: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    // std sets SO_REUSEADDR, so a restart does not wait out TIME_WAIT.
    let listener = std::net::TcpListener::bind(address)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// A health port as bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundHealthListener {
    pub listener: HealthListener,
    pub local_address: SocketAddr,
}

/// The running admin API. Dropping it stops the server without waiting.
pub struct AdminHandle {
    admin_address: Option<SocketAddr>,
    health: Vec<BoundHealthListener>,
    stop: Arc<watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AdminHandle {
    /// Where the admin API listens (the bound port if the bootstrap said 0).
    pub fn admin_address(&self) -> Option<SocketAddr> {
        self.admin_address
    }

    /// The health ports, as bound.
    pub fn health_listeners(&self) -> &[BoundHealthListener] {
        &self.health
    }

    /// Whether the server has stopped (after `/quitquitquit`, say).
    #[cfg(test)]
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Waits until the server stops by itself (`/quitquitquit`).
    pub fn wait(mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Stops the server, letting answers in flight finish, and waits for it.
    pub fn stop(self) {
        self.stop.send_replace(true);
        self.wait();
    }
}

impl Drop for AdminHandle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// What every admin request and health port reads: the proxy, and the state the admin API
/// owns.
pub(crate) struct Shared {
    state: Arc<dyn ProxyState>,
    stats_config: tags::StatsConfig,
    log: LogControl,
    started: SystemTime,
    started_at: Instant,
    health_check_failed: AtomicBool,
    terminating: Arc<AtomicBool>,
    command_line: CommandLineOptions,
    stop: Arc<watch::Sender<bool>>,
}

impl Shared {
    fn uptime(&self) -> Duration {
        self.started_at.elapsed()
    }

    /// Envoy's server state: DRAINING once health checks are failed, INITIALIZING until
    /// the proxy is ready, else LIVE.
    fn server_state(&self) -> server_info::State {
        if self.health_check_failed.load(Ordering::Relaxed) {
            server_info::State::Draining
        } else if !self.state.is_ready() {
            server_info::State::Initializing
        } else {
            server_info::State::Live
        }
    }

    /// Whether readiness checks pass (`/ready`).
    fn is_live(&self) -> bool {
        self.server_state() == server_info::State::Live
    }

    /// What pilot-agent's `/healthz/ready` answers, which Istio's 15021 routes to: the
    /// proxy is live and the pod is not terminating.
    fn is_ready_for_traffic(&self) -> bool {
        self.is_live() && !self.terminating.load(Ordering::SeqCst)
    }

    fn set_health_check_failed(&self, failed: bool) {
        self.health_check_failed.store(failed, Ordering::Relaxed);
        tracing::info!(
            failed,
            "admin: health checks set to {}",
            if failed { "fail" } else { "pass" }
        );
    }

    fn request_stop(&self) {
        self.stop.send_replace(true);
    }

    /// The proxy's stats and the `server.*` ones, as the bootstrap's `stats_matcher` lets
    /// them exist, sorted by name.
    fn stats(&self) -> Vec<Stat> {
        let state = self.server_state();
        let mut stats = self.state.stats();
        stats.extend([
            Stat::gauge("server.live", u64::from(state == server_info::State::Live)),
            Stat::gauge("server.state", state as u64),
            Stat::gauge("server.uptime", self.uptime().as_secs()),
        ]);
        stats.retain(|stat| self.stats_config.accepts(&stat.name));
        stats.sort_by(|a, b| a.name.cmp(&b.name));
        stats.dedup_by(|later, earlier| later.name == earlier.name);
        stats
    }
}

/// `/server_info`'s version, in Envoy's `<commit>/<version>/<status>/<build>/<TLS>` form.
fn version() -> String {
    format!(
        "shunt/{}/Clean/{}/rustls",
        env!("CARGO_PKG_VERSION"),
        if cfg!(debug_assertions) {
            "DEBUG"
        } else {
            "RELEASE"
        }
    )
}

/// `/stats/prometheus` of one stats store alone, under a bootstrap's `stats_config`:
/// node mode serves each pod's own on the pod's 15090.
pub struct StatsScrape {
    config: tags::StatsConfig,
}

impl StatsScrape {
    pub fn new(bootstrap: &Bootstrap) -> StatsScrape {
        StatsScrape {
            config: tags::StatsConfig::from_bootstrap(bootstrap),
        }
    }

    /// The store's stats in Prometheus' text format, as Envoy writes them.
    pub fn render(&self, store: &shunt_core::stats::Store) -> String {
        let mut stats = store.snapshot();
        stats.retain(|stat| self.config.accepts(&stat.name));
        stats.sort_by(|a, b| a.name.cmp(&b.name));
        prometheus::render(&stats, &self.config, &prometheus::Selection::default())
    }
}
