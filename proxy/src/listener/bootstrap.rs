//! `shunt proxy -c bootstrap.yaml`: serving a bootstrap's static listeners and clusters.
//!
//! The order is the passthrough's: load, validate and compile the bootstrap (so a bad
//! config fails before anything is bound), bind every `bind_to_port` listener address
//! while still root, drop privileges, then start the runtime: resolve DNS clusters once
//! and start health checks (Envoy's cluster warming, so the first connections find
//! hosts), and accept. Each accepted connection runs in its own task through
//! [`super::connection_handler`].

use std::net::{SocketAddr, TcpListener as StdListener};
use std::sync::Arc;

use anyhow::Context as _;
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;

use super::ProxyArgs;
use super::config::Listener;
use super::connection_handler::{self, Context};
use crate::snapshot::{self, Store};

/// One bound socket of a listener.
struct Bound {
    listener: Arc<str>,
    addr: SocketAddr,
    socket: StdListener,
}

pub fn run(args: &ProxyArgs, options: &crate::config::Options) -> anyhow::Result<()> {
    let (loaded, report) = crate::config::check(options)?;
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
    let compiled = snapshot::compile(&loaded.bootstrap)
        .map_err(|err| anyhow::anyhow!("{}: {err}", options.origin()))?;
    for warning in &compiled.warnings {
        tracing::warn!("{warning}");
    }
    let mut bound = Vec::new();
    for listener in compiled
        .snapshot
        .listeners
        .iter()
        .filter(|l| l.bind_to_port)
    {
        for addr in &listener.addresses {
            let socket = bind(listener, *addr).with_context(|| {
                format!("listener {:?}: cannot listen on {addr}", listener.name)
            })?;
            let addr = socket.local_addr().context("reading a bound address")?;
            bound.push(Bound {
                listener: listener.name.clone(),
                addr,
                socket,
            });
        }
    }
    let mut own_ports: Vec<u16> = bound.iter().map(|b| b.addr.port()).collect();
    own_ports.sort_unstable();
    own_ports.dedup();

    super::drop_privileges(args)?;
    let runtime = super::data_plane_runtime(args.concurrency)?;
    let context = Arc::new(Context {
        store: Arc::new(Store::new(compiled.snapshot)),
        own_ports,
    });
    let result = runtime.block_on(serve(bound, context));
    runtime.shutdown_background();
    result
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
            SocketAddr::V4(_) => socket.set_ip_transparent(true)?,
            SocketAddr::V6(_) => set_ipv6_transparent(&socket)?,
        }
    }
    if listener.freebind {
        match addr {
            SocketAddr::V4(_) => socket.set_freebind(true)?,
            SocketAddr::V6(_) => socket.set_freebind_ipv6(true)?,
        }
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// IPV6_TRANSPARENT, which socket2 does not wrap.
fn set_ipv6_transparent(socket: &Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let one: libc::c_int = 1;
    // SAFETY: a valid fd, and an option value of the size we pass.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_IPV6,
            libc::IPV6_TRANSPARENT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

async fn serve(bound: Vec<Bound>, context: Arc<Context>) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;

    // Cluster warming: first DNS answers before the first connection.
    let snapshot = context.store.load();
    let mut warming = JoinSet::new();
    for cluster in snapshot.clusters.values() {
        let cluster = cluster.clone();
        warming.spawn(async move { cluster.start().await });
    }
    while warming.join_next().await.is_some() {}
    drop(snapshot);

    let mut accepting = JoinSet::new();
    for b in bound {
        let listener = TcpListener::from_std(b.socket)
            .with_context(|| format!("registering listener {:?} on {}", b.listener, b.addr))?;
        tracing::info!(listener = %b.listener, addr = %b.addr, "listening");
        accepting.spawn(accept_loop(listener, b.listener, b.addr, context.clone()));
    }
    tokio::select! {
        _ = sigterm.recv() => tracing::info!("SIGTERM: stopping"),
        _ = sigint.recv() => tracing::info!("SIGINT: stopping"),
        Some(ended) = accepting.join_next() => {
            anyhow::bail!("an accept loop ended unexpectedly: {ended:?}");
        }
    }
    accepting.abort_all();
    Ok(())
}

async fn accept_loop(
    listener: TcpListener,
    name: Arc<str>,
    addr: SocketAddr,
    context: Arc<Context>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tokio::spawn(connection_handler::handle(
                    stream,
                    peer,
                    name.clone(),
                    addr,
                    context.clone(),
                ));
            }
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
            Err(err) => {
                tracing::warn!(listener = %name, %addr, %err, "accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}
