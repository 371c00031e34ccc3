//! Applying an update: an edit is tried on a candidate set, compiled with everything
//! else into a new snapshot, and kept (ACK) or undone (NACK); listener sockets are
//! bound before the ACK, and the serve loop is told what changed.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::net::TcpListener as StdListener;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use envoy_types::pb::google::protobuf::Any;

use super::Manager;
use super::resources::{Edit, Resource, Undo};
use crate::access_log::Direction;
use crate::config::UpdateFailure;
use crate::listener::Listener;
use crate::snapshot::{DynamicResources, Snapshot};
use crate::xds::TypeUrl;

/// What the serve loop must do after an update: accept on new sockets, stop accepting on
/// removed ones, and close the connections of replaced listeners once drained.
#[derive(Debug, Default)]
pub struct ListenerChange {
    pub bound: Vec<BoundSocket>,
    pub unbound: Vec<(Arc<str>, SocketAddr)>,
    /// Listeners an update removed or replaced: their connections close after the drain
    /// time.
    pub retired: Vec<Arc<Listener>>,
}

/// A listening socket bound for a listener.
#[derive(Debug)]
pub struct BoundSocket {
    pub listener: Arc<str>,
    pub direction: Direction,
    pub addr: SocketAddr,
    pub socket: StdListener,
}

/// Binds a listener's address: the serve loop's binder, shared with the bootstrap's.
pub type Binder = fn(&Listener, SocketAddr) -> std::io::Result<StdListener>;

/// The resource a compile error is about: `Cluster "name"...`, `Listener "name"...`,
/// `RouteConfiguration "name"...` or `Secret "name"...`.
pub(super) fn resource_name(path: &str) -> String {
    let quoted = ["Cluster ", "Listener ", "RouteConfiguration ", "Secret "]
        .iter()
        .find_map(|prefix| path.strip_prefix(prefix));
    quoted
        .and_then(|rest| {
            let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
            de.next().and_then(Result::ok)
        })
        .unwrap_or_default()
}

impl Manager {
    /// Applies `change` to the set of `kind` in place: compiles, swaps, binds. On failure
    /// the change is undone and the errors (resource name, message) are returned for the
    /// NACK.
    pub(super) fn apply(
        &mut self,
        kind: TypeUrl,
        change: Edit,
        version: &str,
    ) -> Result<(), Vec<(String, String)>> {
        if kind == TypeUrl::NameTable {
            return self.apply_name_table(change, version);
        }
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        let mut removed_any = false;
        let (undo, touched): (Undo, Vec<String>) = match change {
            Edit::Replace(set) => {
                let touched = set.keys().cloned().collect();
                (
                    Undo::Replace(std::mem::replace(&mut state.resources, set)),
                    touched,
                )
            }
            Edit::Patch { upserts, removals } => {
                let mut undo = Vec::new();
                let mut touched = Vec::new();
                for (name, entry) in upserts {
                    touched.push(name.clone());
                    undo.push((name.clone(), state.resources.insert(name, entry)));
                }
                for name in removals {
                    if let Some(old) = state.resources.remove(&name) {
                        removed_any = true;
                        undo.push((name, Some(old)));
                    }
                }
                (Undo::Patch(undo), touched)
            }
        };
        // New endpoints (none removed) change only the clusters they are for.
        let endpoints_changed =
            (kind == TypeUrl::ClusterLoadAssignment && !removed_any).then_some(touched.as_slice());
        let result = self.rebuild(endpoints_changed);
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        match result {
            Ok(()) => {
                state.applied = true;
                state.version_info = version.to_owned();
                let resources = state.resources.len();
                let touched: BTreeSet<&String> = touched.iter().collect();
                self.errors
                    .retain(|e| !(e.type_url == kind.as_str() && touched.contains(&e.name)));
                self.count(kind, "update_success");
                tracing::info!(
                    kind = kind.short(),
                    version,
                    resources,
                    changed = touched.len(),
                    "xDS update applied"
                );
                self.check_progress();
                Ok(())
            }
            Err(errors) => {
                let rejected: HashMap<String, Any> = errors
                    .iter()
                    .filter_map(|(name, _)| {
                        let entry = state.resources.get(name)?;
                        Some((name.clone(), entry.resource.to_any(kind)))
                    })
                    .collect();
                match undo {
                    Undo::Replace(set) => state.resources = set,
                    Undo::Patch(undo) => {
                        // In reverse, so a name touched twice ends as it began.
                        for (name, old) in undo.into_iter().rev() {
                            match old {
                                Some(old) => state.resources.insert(name, old),
                                None => state.resources.remove(&name),
                            };
                        }
                    }
                }
                let now = SystemTime::now();
                for (name, details) in &errors {
                    self.errors
                        .retain(|e| !(e.type_url == kind.as_str() && &e.name == name));
                    self.errors.push(UpdateFailure {
                        type_url: kind.as_str().into(),
                        name: name.clone(),
                        failed_configuration: rejected.get(name).cloned(),
                        details: details.clone(),
                        version_info: version.to_owned(),
                        last_update_attempt: now,
                    });
                }
                // Show the error state in /config_dump.
                let _ = self.rebuild(endpoints_changed);
                self.count(kind, "update_rejected");
                tracing::warn!(
                    kind = kind.short(),
                    version,
                    "xDS update rejected: {}",
                    errors
                        .iter()
                        .map(|(n, e)| format!("{n}: {e}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                );
                Err(errors)
            }
        }
    }

    /// Istio's name table: one unnamed resource, which replaces the DNS proxy's table
    /// when it builds (else NACK, and the last good table keeps answering). A response
    /// without one, or a Delta removal, changes nothing: istio-agent keeps its table.
    fn apply_name_table(
        &mut self,
        change: Edit,
        version: &str,
    ) -> Result<(), Vec<(String, String)>> {
        let entry = match change {
            Edit::Replace(set) => set.into_iter().next_back(),
            Edit::Patch { upserts, .. } => upserts.into_iter().next_back(),
        };
        let Some((name, entry)) = entry else {
            let state = self
                .types
                .get_mut(&TypeUrl::NameTable)
                .expect("a subscribed type");
            state.version_info = version.to_owned();
            return Ok(());
        };
        let Resource::NameTable(table) = &entry.resource else {
            return Err(vec![(name, "not a NameTable".into())]);
        };
        let result = match &self.dns {
            Some(dns) => dns.apply((**table).clone(), version),
            None => Ok(()),
        };
        match result {
            Ok(()) => {
                let state = self
                    .types
                    .get_mut(&TypeUrl::NameTable)
                    .expect("a subscribed type");
                state.resources.clear();
                state.resources.insert(name, entry);
                state.applied = true;
                state.version_info = version.to_owned();
                self.count(TypeUrl::NameTable, "update_success");
                Ok(())
            }
            Err(err) => {
                self.count(TypeUrl::NameTable, "update_rejected");
                tracing::warn!(version, "xDS update rejected: {err}");
                Err(vec![(name, err.to_string())])
            }
        }
    }

    pub(super) fn count(&self, kind: TypeUrl, what: &str) {
        let prefix = match kind {
            TypeUrl::Cluster => "cluster_manager.cds",
            TypeUrl::Listener => "listener_manager.lds",
            TypeUrl::ClusterLoadAssignment => "cluster_manager.eds",
            TypeUrl::RouteConfiguration => "http.rds",
            TypeUrl::Secret => "sds",
            TypeUrl::NameTable => "nds",
        };
        self.stats.counter(&format!("{prefix}.{what}")).inc();
    }

    /// Recompiles once warming clusters waited `initial_fetch_timeout` in vain: they are
    /// served without endpoints.
    pub(super) fn reapply(&mut self) {
        let now = Instant::now();
        for (name, deadline) in &self.warming {
            if deadline.is_some_and(|d| d <= now) {
                self.timed_out.insert(name.clone());
            }
        }
        for (name, deadline) in &self.warming_listeners {
            if deadline.is_some_and(|d| d <= now) {
                self.listeners_timed_out.insert(name.clone());
            }
        }
        if let Err(errors) = self.rebuild(None) {
            tracing::warn!(?errors, "recompiling after warming timed out failed");
        }
        self.check_progress();
        self.resubscribe(None);
    }

    /// Compiles the bootstrap with every accepted resource; on success swaps the snapshot
    /// in, binds new listener sockets and tells the serve loop. `endpoints_changed`: the
    /// update only upserted these endpoints (`None`: anything may have changed).
    pub(super) fn rebuild(
        &mut self,
        endpoints_changed: Option<&[String]>,
    ) -> Result<(), Vec<(String, String)>> {
        let dynamic = Arc::new(self.dynamic_resources(endpoints_changed));
        let previous = self.store.load();
        let compiled = crate::snapshot::compile_with(
            &self.bootstrap,
            dynamic.clone(),
            Some(&previous),
            &self.stats,
        )
        .map_err(|err| {
            err.errors
                .iter()
                .map(|p| (resource_name(&p.path), p.to_string()))
                .collect::<Vec<_>>()
        })?;
        for warning in &compiled.warnings {
            tracing::debug!("{warning}");
        }
        let snapshot = compiled.snapshot;
        let change = self.bind(&previous, &snapshot)?;
        let snapshot = Arc::new(snapshot);
        self.store.swap(snapshot.clone());
        for cluster in compiled.fresh_clusters {
            tokio::spawn(async move { cluster.start().await });
        }
        self.stats
            .gauge("cluster_manager.active_clusters")
            .set(snapshot.clusters.len() as u64);
        self.stats
            .gauge("cluster_manager.warming_clusters")
            .set(dynamic.warming_clusters.len() as u64);
        self.stats
            .gauge("listener_manager.total_listeners_active")
            .set(snapshot.listeners.len() as u64);
        let _ = self.changes.send(change);
        self.warming_count = dynamic.warming_clusters.len();
        Ok(())
    }

    /// Binds the addresses of new listeners (a failure refuses the update) and lists
    /// what stops being listened on and which listeners retire.
    pub(super) fn bind(
        &mut self,
        previous: &Snapshot,
        next: &Snapshot,
    ) -> Result<ListenerChange, Vec<(String, String)>> {
        let mut change = ListenerChange::default();
        // The very listeners (an update of clusters or endpoints): the sockets are bound.
        if next.shares_listeners_with(previous) {
            return Ok(change);
        }
        let mut wanted = BTreeSet::new();
        for listener in next.listeners.iter().filter(|l| l.bind_to_port) {
            for addr in &listener.addresses {
                wanted.insert((listener.name.clone(), *addr));
            }
        }
        let mut errors = Vec::new();
        for (name, addr) in wanted.difference(&self.bound) {
            let listener = next.listener(name).expect("a listener of the snapshot");
            match (self.binder)(listener, *addr) {
                Ok(socket) => change.bound.push(BoundSocket {
                    listener: name.clone(),
                    direction: listener.direction,
                    addr: *addr,
                    socket,
                }),
                Err(err) => errors.push((
                    name.to_string(),
                    format!("Listener {name:?}: cannot listen on {addr}: {err}"),
                )),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let static_names: BTreeSet<&str> = self
            .bootstrap
            .static_resources
            .iter()
            .flat_map(|r| &r.listeners)
            .map(|l| l.name.as_str())
            .collect();
        change.unbound = self
            .bound
            .difference(&wanted)
            .filter(|(name, _)| !static_names.contains(&**name))
            .cloned()
            .collect();
        for bound in &change.bound {
            self.bound.insert((bound.listener.clone(), bound.addr));
        }
        for gone in &change.unbound {
            self.bound.remove(gone);
        }
        change.retired = previous
            .listeners
            .iter()
            .filter(|old| {
                next.listener(&old.name)
                    .is_none_or(|new| !Arc::ptr_eq(new, old))
            })
            .cloned()
            .collect();
        Ok(change)
    }

    /// Everything accepted, as the snapshot compiler takes it: the clusters as served
    /// ([`Manager::serve_clusters`], or patched for `endpoints_changed`: see
    /// [`Manager::rebuild`]), the listeners as served ([`Manager::serve_listeners`],
    /// which new endpoints do not change).
    pub(super) fn dynamic_resources(
        &mut self,
        endpoints_changed: Option<&[String]>,
    ) -> DynamicResources {
        let only_endpoints =
            endpoints_changed.is_some_and(|services| self.patch_served_clusters(services));
        if !only_endpoints {
            self.serve_clusters();
        }
        if !only_endpoints || self.served_listeners.is_none() {
            self.serve_listeners();
        }
        let clusters = self.served.as_ref().expect("clusters served");
        let listeners = self.served_listeners.as_ref().expect("listeners served");
        let mut dynamic = DynamicResources {
            errors: self.errors.clone(),
            clusters: clusters.active.clone(),
            warming_clusters: clusters.warming.clone(),
            listeners: listeners.active.clone(),
            warming_listeners: listeners.warming.clone(),
            listeners_version: listeners.version.clone(),
            ..Default::default()
        };
        if let Some(clusters) = self.types.get(&TypeUrl::Cluster) {
            dynamic.clusters_version = clusters.version_info.clone();
        }
        if let Some(endpoints) = self.types.get(&TypeUrl::ClusterLoadAssignment) {
            for entry in endpoints.resources.values() {
                if let Resource::Endpoints(cla) = &entry.resource {
                    dynamic.endpoints.push(entry.tracked(cla));
                }
            }
        }
        if let Some(routes) = self.types.get(&TypeUrl::RouteConfiguration) {
            for entry in routes.resources.values() {
                if let Resource::Route(r) = &entry.resource {
                    dynamic.route_configs.push(entry.tracked(r));
                }
            }
        }
        if let Some(secrets) = self.types.get(&TypeUrl::Secret) {
            for entry in secrets.resources.values() {
                if let Resource::Secret(s) = &entry.resource {
                    dynamic.secrets.push(entry.tracked(s));
                }
            }
        }
        dynamic
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_errors_name_their_resource() {
        assert_eq!(
            resource_name(r#"Cluster "outbound|80||a.b".connect_timeout"#),
            "outbound|80||a.b"
        );
        assert_eq!(resource_name(r#"Listener "x\"y".address"#), "x\"y");
        assert_eq!(
            resource_name(r#"RouteConfiguration "80".virtual_hosts[0]"#),
            "80"
        );
        assert_eq!(
            resource_name(r#"Secret "default".tls_certificate"#),
            "default"
        );
        assert_eq!(resource_name("static_resources.clusters[0]"), "");
    }
}
