//! The passthrough proxy (no bootstrap): an Istio pod's listeners 15001 and 15006, each
//! on 0.0.0.0 and [::], served by a [`ProxyInstance`] without configuration: the
//! original destination is read (Envoy's `original_dst` listener filter) and the
//! connection handed to [`shunt_filters::tcp`] (PassthroughCluster outbound,
//! InboundPassthroughClusterIpv4 inbound). With DNS on (`--dns-listen`,
//! `ISTIO_META_DNS_CAPTURE`) the DNS proxy serves too, forwarding every query: there
//! is no name table without xDS.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::signal::unix::{SignalKind, signal};

use super::{ProxyArgs, bind, data_plane_runtime, drop_privileges};
use shunt_core::access_log::Direction;
use shunt_filters::tcp;
use shunt_instance::{InstanceConfig, ProxyInputs, ProxyInstance, Serves, Socket};

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
    let sockets = listeners
        .into_iter()
        .map(|bound| Socket {
            addr: bound.addr,
            listener: bound.listener,
            serves: Serves::Passthrough(bound.direction),
        })
        .collect();
    let inputs = ProxyInputs {
        config: InstanceConfig::Passthrough(settings),
        sockets,
        scope: Default::default(),
        drain_time,
        ready: Default::default(),
        flows: None,
    };
    // This thread is the first worker (`memory`: it caches its frees).
    shunt_memory::cache_this_thread();
    let instance = ProxyInstance::start(runtime.handle(), inputs)?;
    let result = runtime.block_on(serve(&instance, drain_time));
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

/// Serves until SIGTERM or SIGINT, then drains: the listeners close and open
/// connections run on until they end or `drain_time` is over. SIGHUP is ignored and
/// SIGUSR1 reopens access log files, as in Envoy.
async fn serve(instance: &ProxyInstance, drain_time: Duration) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut housekeeping = super::HousekeepingSignals::install()?;
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
        }
    }
    instance.stop(true);
    instance.drain(drain_time).await;
    Ok(())
}
