//! The serving proxy as the admin API sees it: [`Live`] implements
//! [`ProxyState`] over the snapshot store ([`Current`]) and the stats the data plane updates.
//!
//! Every answer is read from the snapshot current at the time of the request: its
//! resources (`/config_dump`), its clusters' hosts with their counters and health
//! (`/clusters`), and the addresses its listeners were actually bound to (`/listeners`).
//! `/drain_listeners` and `/quitquitquit` are handed to the serve loop, which owns the
//! accept loops (see [`shunt_listener`]'s bootstrap serving).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use envoy_types::pb::envoy::admin::v3::{
    ClusterStatus, HostHealthStatus, HostStatus, ListenerStatus, SimpleMetric, simple_metric,
};
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{Address, HealthStatus, SocketAddress};
use tokio::sync::{mpsc, watch};

use super::state::{HOST_STATS, cluster_statuses};
use super::{Drain, ProxyState};
use shunt_config::{Resources, socket_addr};
use shunt_core::stats::{Stat, Store as StatsStore};
use shunt_upstream::host::{self, Host};
use shunt_xds::snapshot::Current;

/// A serving proxy: its bootstrap, the current snapshot, its stats and where its
/// listeners are bound.
pub struct Live {
    bootstrap: Bootstrap,
    store: Arc<Current>,
    stats: StatsStore,
    ready: AtomicBool,
    /// `(listener name, bound addresses)`, in binding order.
    bound: Mutex<Vec<(String, Vec<SocketAddr>)>>,
    drains: mpsc::UnboundedSender<Drain>,
    shutdown: watch::Sender<bool>,
    /// The DNS proxy's name table, when DNS is on.
    name_tables: std::sync::OnceLock<Arc<shunt_dns::Tables>>,
}

/// What the serve loop receives from the admin API.
pub struct Requests {
    /// `/drain_listeners`, one message per request.
    pub drains: mpsc::UnboundedReceiver<Drain>,
    /// Becomes `true` on `/quitquitquit`.
    pub shutdown: watch::Receiver<bool>,
}

impl Live {
    /// The state of a proxy serving `store`'s snapshots (compiled from `bootstrap`, with
    /// their stats in `stats`). Not ready until [`Live::set_ready`].
    pub fn new(bootstrap: Bootstrap, store: Arc<Current>, stats: StatsStore) -> (Self, Requests) {
        let (drains, drain_requests) = mpsc::unbounded_channel();
        let (shutdown, shutdown_requested) = watch::channel(false);
        let snapshot = store.load();
        stats
            .gauge("cluster_manager.active_clusters")
            .set(snapshot.resources().clusters.len() as u64);
        stats
            .gauge("listener_manager.total_listeners_active")
            .set(snapshot.resources().listeners.len() as u64);
        let live = Live {
            bootstrap,
            store,
            stats,
            ready: AtomicBool::new(false),
            bound: Mutex::new(Vec::new()),
            drains,
            shutdown,
            name_tables: std::sync::OnceLock::new(),
        };
        let requests = Requests {
            drains: drain_requests,
            shutdown: shutdown_requested,
        };
        (live, requests)
    }

    /// Initialization is over (listeners bound, clusters warmed): `/ready` says LIVE.
    pub fn set_ready(&self) {
        self.ready.store(true, Ordering::Relaxed);
    }

    /// Records where listener `name` is bound, for `/listeners`.
    pub fn set_bound(&self, name: &str, addresses: Vec<SocketAddr>) {
        let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        match bound.iter_mut().find(|(n, _)| n == name) {
            Some((_, existing)) => existing.extend(addresses),
            None => bound.push((name.to_owned(), addresses)),
        }
    }

    /// The DNS proxy's name tables, shown by `/config_dump`.
    pub fn set_name_tables(&self, tables: Arc<shunt_dns::Tables>) {
        let _ = self.name_tables.set(tables);
    }

    /// The stats store the data plane counts in.
    pub fn stats_store(&self) -> &StatsStore {
        &self.stats
    }

    /// Forgets that listener `name` is bound to `addr` (an xDS update removed it).
    pub fn remove_bound(&self, name: &str, addr: SocketAddr) {
        let mut bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        for (n, addresses) in bound.iter_mut() {
            if n == name {
                addresses.retain(|a| *a != addr);
            }
        }
        bound.retain(|(_, addresses)| !addresses.is_empty());
    }

    /// Sends a drain to the serve loop as if `/drain_listeners` had asked for it.
    pub fn request_drain(&self, drain: Drain) {
        // The serve loop gone means nothing is accepting any more: nothing to drain.
        let _ = self.drains.send(drain);
    }

    fn bound_addresses(&self, name: &str) -> Option<Vec<SocketAddr>> {
        let bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        bound
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, addresses)| addresses.clone())
    }
}

impl ProxyState for Live {
    fn bootstrap(&self) -> Bootstrap {
        self.bootstrap.clone()
    }

    fn resources(&self) -> Resources {
        self.store.load().resources()
    }

    fn name_table(&self) -> Option<envoy_types::pb::google::protobuf::Any> {
        self.name_tables.get()?.to_any()
    }

    /// The configured clusters, each with the hosts its load balancer has now (DNS
    /// answers included), their connection counters and health flags.
    fn clusters(&self) -> Vec<ClusterStatus> {
        let snapshot = self.store.load();
        let mut statuses = cluster_statuses(&snapshot.resources());
        for status in &mut statuses {
            // A cluster not made yet (deferred, unused) has its configured hosts.
            let Some(cluster) = snapshot.clusters.made(status.name.as_str()) else {
                continue;
            };
            let configured = std::mem::take(&mut status.host_statuses);
            status.host_statuses = cluster
                .hosts()
                .iter()
                .map(|host| host_status(host, &configured))
                .collect();
        }
        statuses
    }

    /// Each listener with the addresses it is bound to; a listener that binds no socket
    /// of its own (`bind_to_port: false`) with its configured address.
    fn listeners(&self) -> Vec<ListenerStatus> {
        let resources = self.store.load().resources();
        resources
            .listeners
            .iter()
            .map(|tracked| {
                let listener = &tracked.resource;
                let configured = || {
                    (
                        listener
                            .address
                            .clone()
                            .or_else(|| internal_address_of(listener)),
                        listener
                            .additional_addresses
                            .iter()
                            .filter_map(|a| a.address.clone())
                            .collect(),
                    )
                };
                let (local_address, additional_local_addresses) =
                    match self.bound_addresses(&listener.name) {
                        Some(addresses) if !addresses.is_empty() => (
                            Some(address_of(addresses[0])),
                            addresses[1..].iter().copied().map(address_of).collect(),
                        ),
                        _ => configured(),
                    };
                ListenerStatus {
                    name: listener.name.clone(),
                    local_address,
                    additional_local_addresses,
                }
            })
            .collect()
    }

    fn stats(&self) -> Vec<Stat> {
        self.stats.snapshot()
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    fn drain_listeners(&self, drain: Drain) {
        self.request_drain(drain);
    }

    fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }
}

/// A live host as `/clusters` shows it: its configured status (locality, weight, EDS
/// health) if the config names its address, with the host's counters and health flags.
fn host_status(host: &Host, configured: &[HostStatus]) -> HostStatus {
    let mut status = configured
        .iter()
        .find(|s| s.address.as_ref().and_then(socket_addr) == Some(host.address))
        .cloned()
        .unwrap_or_else(|| HostStatus {
            address: Some(address_of(host.address)),
            hostname: host.hostname.clone(),
            weight: host.weight,
            priority: host.priority,
            health_status: Some(HostHealthStatus {
                eds_health_status: HealthStatus::Healthy as i32,
                ..Default::default()
            }),
            ..Default::default()
        });
    status.stats = HOST_STATS
        .iter()
        .map(|&(name, gauge)| SimpleMetric {
            r#type: if gauge {
                simple_metric::Type::Gauge as i32
            } else {
                simple_metric::Type::Counter as i32
            },
            value: match name {
                "cx_active" => u64::from(host.active_connections()),
                "cx_total" => host.total_connections(),
                "cx_connect_fail" => host.connect_failures(),
                _ => 0,
            },
            name: name.into(),
        })
        .collect();
    let flags = host.health_flags();
    let health = status.health_status.get_or_insert_with(Default::default);
    health.failed_active_health_check = flags & host::FAILED_ACTIVE_HC != 0;
    health.failed_outlier_check = flags & host::FAILED_OUTLIER_CHECK != 0;
    status
}

/// A socket address as Envoy's `Address`.
/// An internal listener's address as Envoy's `/listeners` shows it:
/// `envoy_internal_address { server_listener_name }`.
fn internal_address_of(
    listener: &envoy_types::pb::envoy::config::listener::v3::Listener,
) -> Option<Address> {
    use envoy_types::pb::envoy::config::core::v3::{
        EnvoyInternalAddress, envoy_internal_address::AddressNameSpecifier,
    };
    use envoy_types::pb::envoy::config::listener::v3::listener::ListenerSpecifier;
    matches!(
        listener.listener_specifier,
        Some(ListenerSpecifier::InternalListener(_))
    )
    .then(|| Address {
        address: Some(AddressKind::EnvoyInternalAddress(EnvoyInternalAddress {
            address_name_specifier: Some(AddressNameSpecifier::ServerListenerName(
                listener.name.clone(),
            )),
            ..Default::default()
        })),
    })
}

fn address_of(addr: SocketAddr) -> Address {
    Address {
        address: Some(AddressKind::SocketAddress(SocketAddress {
            address: addr.ip().to_string(),
            port_specifier: Some(PortSpecifier::PortValue(u32::from(addr.port()))),
            ..Default::default()
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOOTSTRAP: &str = r#"
static_resources:
  listeners:
  - name: front
    address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains: [{filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: front, cluster: backends}}]}]
  - name: 10.96.0.10_80
    address: {socket_address: {address: 10.96.0.10, port_value: 80}}
    bind_to_port: false
    filter_chains: [{filters: [{name: t, typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy, stat_prefix: svc, cluster: backends}}]}]
  clusters:
  - name: backends
    load_assignment:
      cluster_name: backends
      endpoints:
      - locality: {zone: z1}
        lb_endpoints:
        - endpoint: {address: {socket_address: {address: 10.0.0.1, port_value: 80}}}
        - endpoint: {address: {socket_address: {address: 10.0.0.2, port_value: 80}}}
"#;

    fn live() -> Live {
        let options = shunt_config::Options {
            config_yaml: Some(BOOTSTRAP.to_owned()),
            ..Default::default()
        };
        let bootstrap =
            shunt_config::check(&options, &shunt_xds::snapshot::extensions::IMPLEMENTED)
                .unwrap()
                .0
                .bootstrap;
        let stats = StatsStore::new();
        let compiled = shunt_xds::snapshot::compile(&bootstrap, &stats).unwrap();
        Live::new(bootstrap, Arc::new(Current::new(compiled.snapshot)), stats).0
    }

    fn stat(status: &HostStatus, name: &str) -> u64 {
        status.stats.iter().find(|s| s.name == name).unwrap().value
    }

    #[test]
    fn clusters_show_each_hosts_counters_and_health() {
        let live = live();
        let cluster = live.store.load().clusters["backends"].clone();
        let hosts = cluster.hosts();
        let _open = hosts[0].track_connection();
        drop(hosts[0].track_connection());
        hosts[1].set_flag(host::FAILED_OUTLIER_CHECK, true);

        let statuses = live.clusters();
        assert_eq!(statuses.len(), 1);
        let [first, second] = &statuses[0].host_statuses[..] else {
            panic!("{:?}", statuses[0].host_statuses);
        };
        assert_eq!(stat(first, "cx_total"), 2);
        assert_eq!(stat(first, "cx_active"), 1);
        // The configured locality is kept.
        assert_eq!(first.locality.as_ref().unwrap().zone, "z1");
        assert!(!first.health_status.unwrap().failed_outlier_check);
        assert!(second.health_status.unwrap().failed_outlier_check);
    }

    #[test]
    fn listeners_show_where_they_are_bound() {
        let live = live();
        live.set_bound("front", vec!["127.0.0.1:40123".parse().unwrap()]);
        let listeners: Vec<(String, Option<SocketAddr>)> = live
            .listeners()
            .into_iter()
            .map(|l| (l.name, l.local_address.as_ref().and_then(socket_addr)))
            .collect();
        assert_eq!(
            listeners,
            [
                ("front".into(), Some("127.0.0.1:40123".parse().unwrap())),
                (
                    "10.96.0.10_80".into(),
                    Some("10.96.0.10:80".parse().unwrap())
                ),
            ]
        );
    }

    #[test]
    fn readiness_waits_for_set_ready_and_quit_reaches_the_serve_loop() {
        let options = shunt_config::Options {
            config_yaml: Some(BOOTSTRAP.to_owned()),
            ..Default::default()
        };
        let bootstrap =
            shunt_config::check(&options, &shunt_xds::snapshot::extensions::IMPLEMENTED)
                .unwrap()
                .0
                .bootstrap;
        let stats = StatsStore::new();
        let compiled = shunt_xds::snapshot::compile(&bootstrap, &stats).unwrap();
        let (live, mut requests) =
            Live::new(bootstrap, Arc::new(Current::new(compiled.snapshot)), stats);
        assert!(!live.is_ready());
        live.set_ready();
        assert!(live.is_ready());
        live.drain_listeners(Drain {
            inbound_only: true,
            ..Default::default()
        });
        assert!(requests.drains.try_recv().unwrap().inbound_only);
        assert!(!*requests.shutdown.borrow());
        live.shutdown();
        assert!(*requests.shutdown.borrow_and_update());
    }
}
