//! `shunt proxy -c bootstrap.yaml`: serving a bootstrap's static listeners and clusters.
//!
//! The order is the passthrough's: load, validate and compile the bootstrap (so a bad
//! config fails before anything is bound), start the admin API (its address and Istio's
//! health ports, which the data plane leaves to it), bind every other `bind_to_port`
//! listener address while still root, drop privileges, then start the runtime: resolve
//! DNS clusters once and start health checks (Envoy's cluster warming, so the first
//! connections find hosts), become ready (`/ready`, 15021) and accept. The serving is a
//! [`ProxyInstance`]; this module is the program around it (signals, the admin API's
//! requests, the drain). Under `shunt agent`, a listener at a capture port takes the
//! socket the agent bound there before anything else ([`super::capture_sockets`]).
//!
//! Serving ends on SIGTERM or SIGINT with a drain: the listening sockets close (new
//! connects are refused), HTTP connections finish their requests in flight and close,
//! and the process exits once every connection is done or `--drain-time-s` is over.
//! `/quitquitquit` stops at once. SIGHUP is ignored and SIGUSR1 reopens the access log
//! files, as in Envoy. `/drain_listeners` closes listening sockets (all, or the INBOUND
//! ones) while open connections carry on.

use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::signal::unix::{SignalKind, signal};

use super::ProxyArgs;
use super::capture_sockets::CaptureSockets;
use shunt_admin::live::{Live, Requests};
use shunt_admin::{self as admin, Drain};
use shunt_instance::{
    BoundEvent, Configured, InstanceConfig, ProxyInputs, ProxyInstance, Serves, XdsInputs,
};
use shunt_listener::Listener;
use shunt_xds::manager::Binder;
use shunt_xds::snapshot::{self, Current};

pub fn run(args: &ProxyArgs, options: &shunt_config::Options) -> anyhow::Result<()> {
    let (loaded, report) =
        shunt_config::check(options, &shunt_xds::snapshot::extensions::IMPLEMENTED)?;
    for warning in report.warnings() {
        tracing::warn!("{warning}");
    }
    if !report.is_valid() {
        for error in report.errors() {
            tracing::error!("{error}");
        }
        anyhow::bail!(
            "{}: invalid bootstrap ({} errors); run with --mode validate for the report",
            options.origin(),
            report.errors().count()
        );
    }
    let bootstrap = loaded.bootstrap;
    let mut xds = shunt_xds::source::plan(&bootstrap)
        .map_err(|err| anyhow::anyhow!("{}: {err:#}", options.origin()))?;
    let stats = shunt_core::stats::Store::new();
    let compiled = snapshot::compile(&bootstrap, &stats)
        .map_err(|err| anyhow::anyhow!("{}: {err}", options.origin()))?;
    for warning in &compiled.warnings {
        tracing::warn!("{warning}");
    }
    let store = Arc::new(Current::new(compiled.snapshot));
    let (live, requests) = Live::new(bootstrap.clone(), store.clone(), stats);
    let live = Arc::new(live);
    let mut settings =
        admin::AdminSettings::from_command_line(options, &args.log_level, args.concurrency);
    if let Some(embedded) = &args.embedded {
        settings.terminating = embedded.terminating.clone();
    }
    let admin = admin::start_with(&bootstrap, live.clone(), settings)?;
    if let Some(address) = admin.admin_address() {
        tracing::info!(addr = %address, "admin API listening");
    }
    for port in admin.health_listeners() {
        live.set_bound(&port.listener.name, vec![port.local_address]);
    }
    // Under `shunt agent`: the capture ports it bound at start, for the listeners that
    // claim them.
    let capture = args.embedded.as_ref().and_then(|e| e.capture.clone());
    let binder = binder(capture.clone());
    // Bound while still root; Istio's 15090 and 15021 are the admin API's.
    let sockets = bind_static_listeners(&store, &binder)?;
    // The DNS proxy: its sockets are bound after the privilege drop.
    let dns = super::dns::prepare(args, &bootstrap, live.stats_store())?;
    if let Some(dns) = &dns {
        live.set_name_tables(dns.tables.clone());
        let over_xds = xds.as_mut().is_some_and(|plan| plan.add_name_table());
        if !over_xds {
            // No ADS to bring a table: every name is forwarded.
            tracing::warn!(
                "DNS proxy without an ADS stream: no name table, forwarding every query"
            );
            let _ = dns.tables.apply(Default::default(), "");
        }
    }

    super::drop_privileges(args)?;
    let runtime = super::data_plane_runtime(args.concurrency)?;
    let main_thread = super::main_thread_runtime()?;
    let dns_tables = dns.as_ref().map(|d| d.tables.clone());
    if let Some(mut dns) = dns {
        let _entered = runtime.enter();
        let sockets = dns.bind()?;
        shunt_dns::server::serve(sockets, dns.resolver).context("starting the DNS proxy")?;
    }
    let xds = xds.map(|mut plan| {
        // Under `shunt agent`: its SDS server and xDS proxy, by call.
        if let Some(embedded) = &args.embedded {
            plan.local = embedded.local_xds.clone();
        }
        XdsInputs {
            plan,
            main_thread: main_thread.handle().clone(),
            dns: dns_tables,
        }
    });
    let ready_live = live.clone();
    let bound_live = live.clone();
    let configured = Configured {
        bootstrap,
        store,
        stats: live.stats_store().clone(),
        xds,
        binder,
        own_ports: Vec::new(),
        on_ready: Some(Box::new(move || {
            ready_live.set_ready();
            if let Some(capture) = &capture {
                close_unclaimed(capture);
            }
        })),
        on_bound: Some(Arc::new(move |event: BoundEvent<'_>| match event {
            BoundEvent::Bound(name, addr) => bound_live.set_bound(name, vec![addr]),
            BoundEvent::Unbound(name, addr) => bound_live.remove_bound(name, addr),
        })),
    };
    let inputs = ProxyInputs {
        config: InstanceConfig::Configured(Box::new(configured)),
        sockets,
        scope: Default::default(),
        drain_time: options.drain_time,
        ready: Default::default(),
        flows: None,
    };
    // This thread is the first worker (`memory`: it caches its frees).
    shunt_memory::cache_this_thread();
    let instance = ProxyInstance::start(runtime.handle(), inputs)?;
    if let Some(embedded) = &args.embedded {
        embedded.started(instance.connections().clone());
    }
    let result = runtime.block_on(serve(
        &instance,
        &live,
        requests,
        options.drain_time,
        args.embedded.clone(),
    ));
    runtime.shutdown_background();
    main_thread.shutdown_background();
    // After /quitquitquit the admin API has stopped by itself once it answered.
    admin.stop();
    result
}

/// Binds the snapshot's `bind_to_port` listener addresses (compiling left out the
/// health ports the admin API serves).
fn bind_static_listeners(
    store: &Current,
    binder: &Binder,
) -> anyhow::Result<Vec<shunt_instance::Socket>> {
    let snapshot = store.load();
    let mut sockets = Vec::new();
    for listener in snapshot.listeners.iter().filter(|l| l.bind_to_port) {
        for addr in &listener.addresses {
            let socket = binder(listener, *addr).with_context(|| {
                format!("listener {:?}: cannot listen on {addr}", listener.name)
            })?;
            let addr = socket.local_addr().context("reading a bound address")?;
            sockets.push(shunt_instance::Socket {
                addr,
                listener: socket,
                serves: Serves::Listener {
                    name: listener.name.clone(),
                    direction: listener.direction,
                },
            });
        }
    }
    Ok(sockets)
}

/// How the instance binds a listener's address: with the agent's capture sockets, the
/// one bound at start for that address (its backlog with it), else a fresh socket.
fn binder(capture: Option<Arc<CaptureSockets>>) -> Binder {
    match capture {
        Some(capture) => Arc::new(move |listener, addr| claim_or_bind(&capture, listener, addr)),
        None => Arc::new(bind),
    }
}

fn claim_or_bind(
    capture: &CaptureSockets,
    listener: &Listener,
    addr: SocketAddr,
) -> std::io::Result<StdListener> {
    let Some(socket) = capture.take(addr) else {
        // A listener at a specific address of a held port (127.0.0.1:15001) could not
        // bind beside the wildcard socket held there: that socket gives way.
        for released in capture.release_same_port(addr) {
            tracing::info!(listener = %listener.name, %addr, %released,
                "the capture socket bound at start-up gives way to the listener");
        }
        return bind(listener, addr);
    };
    // TPROXY's inbound listener: IP_TRANSPARENT counts when connections are looked up,
    // so the socket bound at start can take it now; `freebind` only matters at bind,
    // which a wildcard address never needs.
    if listener.transparent {
        let set = match addr {
            SocketAddr::V4(_) => socket2::SockRef::from(&socket).set_ip_transparent_v4(true),
            SocketAddr::V6(_) => socket2::SockRef::from(&socket).set_ip_transparent_v6(true),
        };
        if let Err(err) = set {
            tracing::warn!(listener = %listener.name, %addr, %err,
                "the socket bound at start cannot be made transparent: binding a new one");
            drop(socket);
            return bind(listener, addr);
        }
    }
    tracing::info!(listener = %listener.name, %addr,
        "listener takes the capture socket bound at start-up");
    Ok(socket)
}

/// Once the proxy is ready: the capture sockets its configuration did not claim close
/// (what queued there is reset, as it would have been refused).
fn close_unclaimed(capture: &CaptureSockets) {
    let closed = capture.close_unclaimed();
    if !closed.is_empty() {
        tracing::info!(?closed, "no listener claimed these capture sockets: closed");
    }
}

/// Binds one listener address as Envoy does: SO_REUSEADDR, IPV6_V6ONLY on IPv6, and
/// `transparent` / `freebind` when asked.
fn bind(listener: &Listener, addr: SocketAddr) -> std::io::Result<StdListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    if listener.transparent {
        match addr {
            SocketAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
            SocketAddr::V6(_) => socket.set_ip_transparent_v6(true)?,
        }
    }
    if listener.freebind {
        match addr {
            SocketAddr::V4(_) => socket.set_freebind_v4(true)?,
            SocketAddr::V6(_) => socket.set_freebind_v6(true)?,
        }
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// How long the configuration's descriptor pool is kept unused before it is dropped:
/// after start-up it serves only `/config_dump` (and xDS JSON), and costs ~15 MiB.
const POOL_IDLE: Duration = Duration::from_secs(5);

/// Free heap glibc may keep (checked as often as the pool) before it is trimmed: a
/// burst of connections (each with its read buffer, up to ~80 KiB while headers
/// arrive) otherwise leaves RSS at its peak for good.
const HEAP_TRIM_FREE: usize = 8 << 20;

/// The program around the instance until it stops: signals, the admin API's requests,
/// the agent's, housekeeping.
async fn serve(
    instance: &ProxyInstance,
    live: &Arc<Live>,
    mut requests: Requests,
    drain_time: Duration,
    embedded: Option<Arc<super::agent::Embedded>>,
) -> anyhow::Result<()> {
    // In `shunt agent` the agent owns SIGTERM and SIGINT (its drain is Istio's).
    let mut stop_signals = match embedded {
        None => Some((
            signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
            signal(SignalKind::interrupt()).context("installing a SIGINT handler")?,
        )),
        Some(_) => None,
    };
    let mut housekeeping = super::HousekeepingSignals::install()?;
    // Start-up was the pool's last planned use.
    shunt_config::release_idle_pool(Duration::ZERO);
    let mut pool_check = tokio::time::interval(POOL_IDLE);
    let drain = loop {
        tokio::select! {
            _ = pool_check.tick() => {
                if shunt_config::release_idle_pool(POOL_IDLE) {
                    tracing::debug!("descriptor pool released while idle");
                }
                if let Some(free) = shunt_config::periodic_trim(HEAP_TRIM_FREE) {
                    tracing::debug!(free, "free heap returned to the kernel");
                }
            }
            Some(name) = stop_signal(&mut stop_signals) => {
                tracing::info!("{name}: draining and stopping");
                break true;
            }
            () = super::agent::Embedded::close_inbound_requested(embedded.as_deref()) => {
                drain_listeners(
                    Drain { graceful: false, inbound_only: true, skip_exit: true },
                    instance,
                    live,
                    drain_time,
                );
            }
            () = super::agent::Embedded::exit_requested(embedded.as_deref()) => {
                tracing::info!("the agent's drain is over: stopping");
                break false;
            }
            () = housekeeping.handle_next() => {}
            _ = requests.shutdown.wait_for(|quit| *quit) => {
                tracing::info!("/quitquitquit: stopping");
                break false;
            }
            Some(drain) = requests.drains.recv() => {
                drain_listeners(drain, instance, live, drain_time);
            }
        }
    };
    // Closing the accept loops closes the listening sockets: no new connections.
    instance.stop(true);
    if drain {
        // HTTP connections finish what is in flight and close; the rest run to their
        // end, within the drain time.
        instance.drain(drain_time).await;
    }
    Ok(())
}

/// The next SIGTERM or SIGINT, by name; never without the handlers.
async fn stop_signal(
    signals: &mut Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
) -> Option<&'static str> {
    match signals {
        Some((term, int)) => tokio::select! {
            _ = term.recv() => Some("SIGTERM"),
            _ = int.recv() => Some("SIGINT"),
        },
        None => std::future::pending().await,
    }
}

/// Envoy's `/drain_listeners`: close the listening sockets (every one, or those of
/// INBOUND listeners) now, or with `graceful` once the drain time is over (and not at
/// all with `skip_exit`). Connections already accepted carry on either way.
fn drain_listeners(drain: Drain, instance: &ProxyInstance, live: &Arc<Live>, drain_time: Duration) {
    if drain.graceful {
        tracing::info!(
            drain_time_s = drain_time.as_secs(),
            inbound_only = drain.inbound_only,
            skip_exit = drain.skip_exit,
            "draining listeners"
        );
        if !drain.skip_exit {
            let live = live.clone();
            tokio::spawn(async move {
                tokio::time::sleep(drain_time).await;
                live.request_drain(Drain {
                    graceful: false,
                    ..drain
                });
            });
        }
        return;
    }
    instance.close_listeners(drain.inbound_only);
}
