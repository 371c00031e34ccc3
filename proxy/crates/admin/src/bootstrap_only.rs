//! A proxy that has only its bootstrap, for the admin API's own tests: what the admin
//! API serves without a data plane behind it.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use tokio::sync::watch;

use super::state::{Drain, ProxyState, observability_name};
use shunt_config::{Resources, endpoints_of, socket_addr};
use shunt_core::stats::{self, Stat, Store};

/// A proxy that has only its bootstrap: static listeners and clusters, and a stats store
/// holding the per-cluster and per-listener stats at zero. The admin API's own tests
/// serve it; a running proxy serves [`super::live::Live`].
pub struct BootstrapOnly {
    bootstrap: Bootstrap,
    resources: Resources,
    store: Store,
    ready: AtomicBool,
    drains: Mutex<Vec<Drain>>,
    shutdown: watch::Sender<bool>,
}

impl BootstrapOnly {
    pub fn new(bootstrap: Bootstrap) -> Self {
        let resources = Resources::from_bootstrap(&bootstrap, SystemTime::now());
        let store = Store::new();
        for tracked in &resources.clusters {
            let name = observability_name(&tracked.resource);
            store.counter(&stats::cluster_stat(name, "upstream_cx_total"));
            store.gauge(&stats::cluster_stat(name, "upstream_cx_active"));
            let hosts: usize = endpoints_of(&tracked.resource)
                .endpoints
                .iter()
                .map(|locality| locality.lb_endpoints.len())
                .sum();
            for membership in ["membership_total", "membership_healthy"] {
                store
                    .gauge(&stats::cluster_stat(name, membership))
                    .set(hosts as u64);
            }
        }
        for tracked in &resources.listeners {
            let listener = &tracked.resource;
            let prefix = if !listener.stat_prefix.is_empty() {
                listener.stat_prefix.clone()
            } else if let Some(addr) = listener.address.as_ref().and_then(socket_addr) {
                stats::listener_stat_prefix(&addr)
            } else {
                continue;
            };
            store.counter(&format!("listener.{prefix}.downstream_cx_total"));
            store.gauge(&format!("listener.{prefix}.downstream_cx_active"));
        }
        store
            .gauge("cluster_manager.active_clusters")
            .set(resources.clusters.len() as u64);
        store
            .gauge("listener_manager.total_listeners_active")
            .set(resources.listeners.len() as u64);
        BootstrapOnly {
            bootstrap,
            resources,
            store,
            ready: AtomicBool::new(true),
            drains: Mutex::new(Vec::new()),
            shutdown: watch::channel(false).0,
        }
    }

    /// The stats store: the data plane's counters go here.
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// The `/drain_listeners` requests received so far.
    pub fn drains(&self) -> Vec<Drain> {
        self.drains
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Becomes `true` on `/quitquitquit`.
    pub fn shutdown_requested(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }
}

impl ProxyState for BootstrapOnly {
    fn bootstrap(&self) -> Bootstrap {
        self.bootstrap.clone()
    }

    fn resources(&self) -> Resources {
        self.resources.clone()
    }

    fn stats(&self) -> Vec<Stat> {
        self.store.snapshot()
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    fn drain_listeners(&self, drain: Drain) {
        self.drains
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(drain);
    }

    fn shutdown(&self) {
        self.shutdown.send_replace(true);
    }
}
