//! The passthrough proxy (no bootstrap): an Istio pod's listeners 15001 and 15006, each
//! on 0.0.0.0 and [::]. Every accepted connection gets its own task: the original
//! destination is read (Envoy's `original_dst` listener filter) and the connection is
//! handed to [`shunt_filters::tcp`] (PassthroughCluster outbound, InboundPassthroughClusterIpv4
//! inbound). With DNS on (`--dns-listen`, `ISTIO_META_DNS_CAPTURE`) the DNS proxy
//! serves too, forwarding every query: there is no name table without xDS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinSet;

use super::{ProxyArgs, bind, data_plane_runtime, drop_privileges};
use shunt_core::access_log::{Direction, Entry};
use shunt_filters::tcp;
use shunt_listener::original_dst;

pub fn run(args: &ProxyArgs) -> anyhow::Result<()> {
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

    // DNS without a bootstrap has no xDS, so no name table: every query is forwarded.
    let dns = super::dns::prepare(args, &Default::default(), &shunt_core::stats::Store::new())?;
    if let Some(dns) = &dns {
        let _ = dns.tables.apply(Default::default(), "");
    }

    drop_privileges(args)?;
    let runtime = data_plane_runtime(args.concurrency)?;
    if let Some(mut dns) = dns {
        let _entered = runtime.enter();
        let sockets = dns.bind()?;
        shunt_dns::server::serve(sockets, dns.resolver).context("starting the DNS proxy")?;
    }
    let settings = Arc::new(tcp::Settings {
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
        own_ports,
    });
    let drain_time = Duration::from_secs(args.drain_time_s);
    // With one worker this thread is the worker (`memory`: it caches its frees).
    shunt_memory::cache_this_thread();
    let result = runtime.block_on(serve(listeners, settings, drain_time));
    // Connections still open after the drain are dropped with the runtime.
    runtime.shutdown_background();
    result
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

/// Accepts on every listener until SIGTERM or SIGINT, then drains: the listeners close
/// and open connections run on until they end or `drain_time` is over. SIGHUP is
/// ignored and SIGUSR1 reopens access log files, as in Envoy.
async fn serve(
    listeners: Vec<bind::Bound>,
    settings: Arc<tcp::Settings>,
    drain_time: Duration,
) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut housekeeping = super::HousekeepingSignals::install()?;
    let connections = Arc::new(super::Connections::default());

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
            connections.clone(),
        ));
    }

    loop {
        tokio::select! {
            _ = sigterm.recv() => {
                tracing::info!("SIGTERM: draining and stopping");
                break;
            }
            _ = sigint.recv() => {
                tracing::info!("SIGINT: draining and stopping");
                break;
            }
            () = housekeeping.handle_next() => {}
            Some(ended) = accepting.join_next() => {
                anyhow::bail!("an accept loop ended unexpectedly: {ended:?}");
            }
        }
    }
    // Dropping the accept loops closes the listening sockets: no new connections.
    accepting.abort_all();
    while accepting.join_next().await.is_some() {}
    super::drain(&connections, drain_time).await;
    Ok(())
}

async fn accept_loop(
    listener: TcpListener,
    direction: Direction,
    addr: SocketAddr,
    settings: Arc<tcp::Settings>,
    connections: Arc<super::Connections>,
) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let open = connections.open();
                let handled = handle(stream, peer, direction, addr.port(), settings.clone());
                tokio::spawn(async move {
                    handled.await;
                    drop(open);
                });
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
