//! `shunt proxy -c bootstrap.yaml`: serving a bootstrap's static listeners and clusters.
//!
//! The order is the passthrough's: load, validate and compile the bootstrap (so a bad
//! config fails before anything is bound), start the admin API (its address and Istio's
//! health ports, which the data plane leaves to it), bind every other `bind_to_port`
//! listener address while still root, drop privileges, then start the runtime: resolve
//! DNS clusters once and start health checks (Envoy's cluster warming, so the first
//! connections find hosts), become ready (`/ready`, 15021) and accept. Each accepted
//! connection runs in its own task through [`super::connection_handler`].
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
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::{AbortHandle, JoinSet};

use super::ProxyArgs;
use shunt_admin::live::{Live, Requests};
use shunt_admin::{self as admin, Drain};
use shunt_core::access_log::Direction;
use shunt_listener::Listener;
use shunt_listener::connection_handler::{self, Context};
use shunt_xds::manager::ListenerChange;
use shunt_xds::snapshot::{self, Current};

/// One bound socket of a listener.
struct Bound {
    listener: Arc<str>,
    direction: Direction,
    addr: SocketAddr,
    socket: StdListener,
}

pub fn run(args: &ProxyArgs, options: &shunt_config::Options) -> anyhow::Result<()> {
    let (loaded, report) = shunt_config::check(options)?;
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
    // Istio's 15090 and 15021: the admin API answers them, the data plane binds neither.
    let health = shunt_config::health_ports::find(&bootstrap);
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

    let mut bound = Vec::new();
    let snapshot = store.load();
    for listener in snapshot.listeners.iter().filter(|l| l.bind_to_port) {
        // Compiling already left them out; never bind one twice.
        if health.iter().any(|h| *h.name == *listener.name) {
            continue;
        }
        let mut addresses = Vec::new();
        for addr in &listener.addresses {
            let socket = bind(listener, *addr).with_context(|| {
                format!("listener {:?}: cannot listen on {addr}", listener.name)
            })?;
            let addr = socket.local_addr().context("reading a bound address")?;
            addresses.push(addr);
            bound.push(Bound {
                listener: listener.name.clone(),
                direction: listener.direction,
                addr,
                socket,
            });
        }
        live.set_bound(&listener.name, addresses);
    }
    drop(snapshot);
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
    let mut own_ports: Vec<u16> = bound.iter().map(|b| b.addr.port()).collect();
    own_ports.sort_unstable();
    own_ports.dedup();

    super::drop_privileges(args)?;
    let runtime = super::data_plane_runtime(args.concurrency)?;
    let main_thread = super::main_thread_runtime()?;
    let dns_tables = dns.as_ref().map(|d| d.tables.clone());
    if let Some(mut dns) = dns {
        let _entered = runtime.enter();
        let sockets = dns.bind()?;
        shunt_dns::server::serve(sockets, dns.resolver).context("starting the DNS proxy")?;
    }
    let context = Arc::new(Context {
        config: store.clone(),
        own_ports: std::sync::RwLock::new(own_ports.into()),
        shutdown: Default::default(),
    });
    // Internal listeners: upstream connections to them are served in this process.
    shunt_upstream::internal::set_acceptor(Arc::new(connection_handler::InternalListeners(
        context.clone(),
    )));
    let drain_time = options.drain_time;
    let xds = xds.map(|mut plan| {
        // Under `shunt agent`: its SDS server and xDS proxy, by call.
        if let Some(embedded) = &args.embedded {
            plan.local = embedded.local_xds.clone();
        }
        plan
    });
    let xds = xds.map(|plan| Xds {
        main_thread: main_thread.handle().clone(),
        plan,
        bootstrap,
        stats: live.stats_store().clone(),
        dns: dns_tables,
    });
    // With one worker this thread is the worker (`memory`: it caches its frees).
    shunt_memory::cache_this_thread();
    let result = runtime.block_on(serve(
        bound,
        store,
        context,
        live,
        requests,
        drain_time,
        xds,
        args.embedded.clone(),
    ));
    runtime.shutdown_background();
    main_thread.shutdown_background();
    // After /quitquitquit the admin API has stopped by itself once it answered.
    admin.stop();
    result
}

/// What the serve loop needs to start the xDS manager.
struct Xds {
    /// Where the xDS manager runs: off the workers.
    main_thread: tokio::runtime::Handle,
    plan: shunt_xds::source::Plan,
    bootstrap: envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap,
    stats: shunt_core::stats::Store,
    /// The DNS proxy's name table, set from NDS.
    dns: Option<Arc<shunt_dns::Tables>>,
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

/// A listening socket's accept loop, for `/drain_listeners`.
struct AcceptLoop {
    listener: Arc<str>,
    direction: Direction,
    addr: SocketAddr,
    handle: AbortHandle,
}

#[allow(clippy::too_many_arguments)]
async fn serve(
    bound: Vec<Bound>,
    store: Arc<Current>,
    context: Arc<Context>,
    live: Arc<Live>,
    mut requests: Requests,
    drain_time: Duration,
    xds: Option<Xds>,
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
    let connections = Arc::new(super::Connections::default());
    if let Some(embedded) = &embedded {
        embedded.started(connections.clone());
    }

    // Cluster warming: first DNS answers before the first connection.
    let snapshot = store.load();
    let mut warming = JoinSet::new();
    for cluster in snapshot.clusters.values() {
        let cluster = cluster.clone();
        warming.spawn(async move { cluster.start().await });
    }
    while warming.join_next().await.is_some() {}
    drop(snapshot);

    let mut accepting = JoinSet::new();
    let mut loops = Vec::new();
    for b in bound {
        let listener = TcpListener::from_std(b.socket)
            .with_context(|| format!("registering listener {:?} on {}", b.listener, b.addr))?;
        tracing::info!(listener = %b.listener, addr = %b.addr, "listening");
        let handle = accepting.spawn(accept_loop(
            listener,
            b.listener.clone(),
            b.addr,
            context.clone(),
            connections.clone(),
        ));
        loops.push(AcceptLoop {
            listener: b.listener,
            direction: b.direction,
            addr: b.addr,
            handle,
        });
    }
    // With xDS, ready comes once the first listeners and clusters are applied.
    let mut changes = match xds {
        Some(xds) => {
            let bound = loops.iter().map(|l| (l.listener.clone(), l.addr));
            let _on_main_thread = xds.main_thread.enter();
            Some(shunt_xds::Manager::start(
                xds.bootstrap,
                xds.plan,
                store.clone(),
                xds.stats,
                {
                    let live = live.clone();
                    Box::new(move || live.set_ready())
                },
                Arc::new(bind),
                bound,
                xds.dns,
            ))
        }
        None => {
            live.set_ready();
            None
        }
    };
    // Start-up was the pool's last planned use.
    shunt_config::release_idle_pool(Duration::ZERO);
    let mut pool_check = tokio::time::interval(POOL_IDLE);
    let drain = loop {
        tokio::select! {
            _ = pool_check.tick() => {
                if shunt_config::release_idle_pool(POOL_IDLE) {
                    tracing::debug!("descriptor pool released while idle");
                }
                if let Some(free) = shunt_config::trim_free_heap(HEAP_TRIM_FREE) {
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
                    &mut loops,
                    &live,
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
                drain_listeners(drain, &mut loops, &live, drain_time);
            }
            Some(change) = recv_change(&mut changes) => {
                apply_listener_change(change, &mut loops, &mut accepting, &context, &connections, &live, drain_time);
            }
            Some(ended) = accepting.join_next() => match ended {
                // Closed by /drain_listeners.
                Err(err) if err.is_cancelled() => {}
                ended => anyhow::bail!("an accept loop ended unexpectedly: {ended:?}"),
            },
        }
    };
    // Dropping the accept loops closes the listening sockets: no new connections.
    accepting.abort_all();
    while accepting.join_next().await.is_some() {}
    if drain {
        // HTTP connections finish what is in flight and close; the rest run to their
        // end, within the drain time.
        context.shutdown.close_connections();
        super::drain(&connections, drain_time).await;
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

async fn recv_change(
    changes: &mut Option<tokio::sync::mpsc::UnboundedReceiver<ListenerChange>>,
) -> Option<ListenerChange> {
    match changes {
        Some(changes) => changes.recv().await,
        None => std::future::pending().await,
    }
}

/// An xDS update's listener changes: accept on the new sockets, close the removed ones,
/// and close the connections of replaced or removed listeners after the drain time.
fn apply_listener_change(
    change: ListenerChange,
    loops: &mut Vec<AcceptLoop>,
    accepting: &mut JoinSet<()>,
    context: &Arc<Context>,
    connections: &Arc<super::Connections>,
    live: &Arc<Live>,
    drain_time: Duration,
) {
    for (name, addr) in &change.unbound {
        loops.retain(|l| {
            let gone = l.listener == *name && l.addr == *addr;
            if gone {
                l.handle.abort();
                tracing::info!(listener = %name, %addr, "listener removed: no longer accepting");
            }
            !gone
        });
        live.remove_bound(name, *addr);
    }
    let mut ports: Vec<u16> = context
        .own_ports
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .to_vec();
    for b in change.bound {
        let listener = match TcpListener::from_std(b.socket) {
            Ok(listener) => listener,
            Err(err) => {
                tracing::error!(listener = %b.listener, addr = %b.addr, %err, "registering a listener failed");
                continue;
            }
        };
        let addr = listener.local_addr().unwrap_or(b.addr);
        tracing::info!(listener = %b.listener, %addr, "listening");
        live.set_bound(&b.listener, vec![addr]);
        ports.push(addr.port());
        let handle = accepting.spawn(accept_loop(
            listener,
            b.listener.clone(),
            addr,
            context.clone(),
            connections.clone(),
        ));
        loops.push(AcceptLoop {
            listener: b.listener,
            direction: b.direction,
            addr: b.addr,
            handle,
        });
    }
    ports.sort_unstable();
    ports.dedup();
    *context.own_ports.write().unwrap_or_else(|e| e.into_inner()) = ports.into();
    if !change.retired.is_empty() {
        let retired = change.retired;
        tokio::spawn(async move {
            tokio::time::sleep(drain_time).await;
            for listener in retired {
                listener.draining.close_connections();
            }
        });
    }
}

/// Envoy's `/drain_listeners`: close the listening sockets (every one, or those of
/// INBOUND listeners) now, or with `graceful` once the drain time is over (and not at
/// all with `skip_exit`). Connections already accepted carry on either way.
fn drain_listeners(
    drain: Drain,
    loops: &mut Vec<AcceptLoop>,
    live: &Arc<Live>,
    drain_time: Duration,
) {
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
    loops.retain(|accept| {
        let close = !drain.inbound_only || accept.direction == Direction::Inbound;
        if close {
            accept.handle.abort();
            tracing::info!(listener = %accept.listener, addr = %accept.addr, "drained: no longer accepting");
        }
        !close
    });
}

async fn accept_loop(
    listener: TcpListener,
    name: Arc<str>,
    addr: SocketAddr,
    context: Arc<Context>,
    connections: Arc<super::Connections>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let open = connections.open();
                let handled =
                    connection_handler::handle(stream, peer, name.clone(), addr, context.clone());
                tokio::spawn(async move {
                    handled.await;
                    drop(open);
                });
            }
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
            Err(err) => {
                tracing::warn!(listener = %name, %addr, %err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}
