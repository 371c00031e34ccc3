//! Applying an update: an edit is tried on a candidate set, compiled with everything
//! else into a new snapshot, and kept (ACK) or undone (NACK); listener sockets are
//! bound before the ACK, and the serve loop is told what changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::net::TcpListener as StdListener;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use envoy_types::pb::google::protobuf::Any;

use super::Manager;
use super::resources::{Accepted, Edit, Resource};
use crate::snapshot::{DynamicResources, Snapshot};
use crate::type_url::TypeUrl;

use shunt_config::UpdateFailure;
use shunt_core::access_log::Direction;
use shunt_listener::Listener;

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

/// Binds a listener's address: the serve loop's binder, shared with the bootstrap's (in
/// node mode, one that binds inside the pod's network namespace).
pub type Binder =
    std::sync::Arc<dyn Fn(&Listener, SocketAddr) -> std::io::Result<StdListener> + Send + Sync>;

/// The resource a compile error is about: `Cluster "name"...`, `Listener "name"...`,
/// `RouteConfiguration "name"...` or `Secret "name"...`; no type for anything else.
pub(super) fn resource_name(path: &str) -> (Option<TypeUrl>, String) {
    let quoted = [
        ("Cluster ", TypeUrl::Cluster),
        ("Listener ", TypeUrl::Listener),
        ("RouteConfiguration ", TypeUrl::RouteConfiguration),
        ("Secret ", TypeUrl::Secret),
    ]
    .into_iter()
    .find_map(|(prefix, kind)| Some((kind, path.strip_prefix(prefix)?)));
    quoted
        .and_then(|(kind, rest)| {
            let mut de = serde_json::Deserializer::from_str(rest).into_iter::<String>();
            de.next()
                .and_then(Result::ok)
                .map(|name| (Some(kind), name))
        })
        .unwrap_or_default()
}

/// Whether a type's `resources` differ from what they were (`before`, by name).
fn changes_anything(before: &Before, resources: &BTreeMap<Arc<str>, Accepted>) -> bool {
    before
        .iter()
        .any(|(name, old)| match (old, resources.get(name)) {
            (Some(old), Some(new)) => old.digest != new.digest,
            (None, None) => false,
            _ => true,
        })
}

/// A compile error: the resource it is about, and the message.
pub(super) type CompileError = ((Option<TypeUrl>, String), String);

/// A resource refused before compiling (a duplicate name): why, and what came.
pub(super) struct Refusal {
    pub(super) name: String,
    pub(super) details: String,
    pub(super) config: Any,
}

/// One update of a type being applied: what its change touched, and what it refused.
struct Update<'a> {
    kind: TypeUrl,
    version: &'a str,
    /// The last good version of each resource the change adds, replaces or removes.
    before: Before,
    /// The resources the change adds or replaces.
    touched: Vec<Arc<str>>,
    /// New endpoints (none removed) change only the clusters they are for.
    endpoints_changed: Option<Vec<Arc<str>>>,
    /// The version a refused resource's error state records.
    failed_version: String,
    now: SystemTime,
    /// Each refused resource's errors.
    refusals: BTreeMap<String, Vec<String>>,
}

/// What changed since the last rebuild, so that one works out again only what depends
/// on it: clusters wait on endpoints and secrets, listeners on routes and secrets.
#[derive(Clone, Copy, Debug)]
pub(super) enum Changed<'a> {
    /// Anything may have (a warming wait ended).
    Anything,
    /// Resources of this type.
    Type(TypeUrl),
    /// Only these endpoints, upserted (none removed): only the clusters they are for.
    Endpoints(&'a [Arc<str>]),
}

impl Update<'_> {
    fn changed(&self) -> Changed<'_> {
        match &self.endpoints_changed {
            Some(services) => Changed::Endpoints(services),
            None => Changed::Type(self.kind),
        }
    }
}

/// Each resource a change touched, as it was before (`None`: it was not there).
type Before = BTreeMap<Arc<str>, Option<Accepted>>;

/// Makes `change` to a type's resources: the last good version of each resource it
/// adds, replaces or removes (by name), the names it adds or replaces, and whether it
/// removed any.
fn edit(
    resources: &mut BTreeMap<Arc<str>, Accepted>,
    change: Edit,
) -> (Before, Vec<Arc<str>>, bool) {
    let mut before = Before::new();
    let mut removed_any = false;
    let mut touched = Vec::new();
    match change {
        Edit::Replace(set) => {
            let old = std::mem::replace(resources, set);
            touched = resources.keys().cloned().collect();
            for name in &touched {
                before.insert(name.clone(), old.get(name).cloned());
            }
            for (name, entry) in old {
                if !resources.contains_key(&name) {
                    removed_any = true;
                    before.insert(name, Some(entry));
                }
            }
        }
        // A first response of a named type (EDS) into an empty set: built in one go,
        // its nodes full, where inserts in name order leave them half empty.
        Edit::Patch { upserts, removals } if resources.is_empty() && removals.is_empty() => {
            for (name, _) in &upserts {
                touched.push(name.clone());
                before.insert(name.clone(), None);
            }
            *resources = upserts.into_iter().collect();
        }
        Edit::Patch { upserts, removals } => {
            for (name, entry) in upserts {
                touched.push(name.clone());
                let old = resources.insert(name.clone(), entry);
                before.entry(name).or_insert(old);
            }
            for name in removals {
                if let Some(old) = resources.remove(&name) {
                    removed_any = true;
                    before.entry(name).or_insert(Some(old));
                }
            }
        }
    }
    (before, touched, removed_any)
}

impl Manager {
    /// Applies `change` to the set of `kind` resource by resource, as Envoy does: the
    /// candidate set is compiled with everything else; each resource of the change the
    /// compile (or binding its socket) refuses goes back to its last good version (or
    /// out, if it had none) and the rest is compiled again, until it compiles. What was
    /// refused keeps its error state in `/config_dump` and is returned for the NACK
    /// (name, details); `refused` are resources refused before compiling (duplicates).
    /// Only when an error names nothing of the change (a cluster removal breaking a
    /// listener) is the whole change undone.
    pub(super) fn apply(
        &mut self,
        kind: TypeUrl,
        change: Edit,
        version: &str,
        refused: Vec<Refusal>,
    ) -> Result<(), Vec<(String, String)>> {
        if kind == TypeUrl::NameTable {
            return self.apply_name_table(change, version);
        }
        if kind == TypeUrl::Workload {
            return self.apply_workloads(change, version, refused);
        }
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        let (before, touched, removed_any) = edit(&mut state.resources, change);
        // The version `/config_dump` shows is the last one that changed anything, refused
        // in part or not; the one a request carries, the last one accepted whole.
        let old_system_version = state.system_version.clone();
        let changes = changes_anything(&before, &state.resources);
        if changes {
            state.system_version = version.to_owned();
        }
        // The errors of what this change touches are its own now (Envoy's listener
        // manager keeps only the last update's); kept to put back if the whole change
        // is undone.
        let (stale, kept): (Vec<UpdateFailure>, Vec<UpdateFailure>) =
            std::mem::take(&mut self.errors).into_iter().partition(|e| {
                e.type_url == kind.as_str()
                    && (kind == TypeUrl::Listener || before.contains_key(e.name.as_str()))
            });
        self.errors = kept;
        let mut update = Update {
            kind,
            version,
            endpoints_changed: (kind == TypeUrl::ClusterLoadAssignment && !removed_any)
                .then(|| touched.clone()),
            before,
            touched,
            // Envoy's listener manager records no version with a listener's error state.
            failed_version: if kind == TypeUrl::Listener {
                String::new()
            } else {
                version.to_owned()
            },
            now: SystemTime::now(),
            refusals: BTreeMap::new(),
        };
        self.refuse(&mut update, refused);
        self.validating = matches!(kind, TypeUrl::Cluster | TypeUrl::Listener);
        let result = self.compile_reverting_culprits(&mut update);
        self.validating = false;
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        // Envoy's init goes on after a refused update too.
        state.applied = true;
        match result {
            Ok(()) => self.accept(update, changes, old_system_version),
            Err(errors) => self.undo(update, errors, old_system_version, stale),
        }
    }

    /// Records the resources refused before compiling (duplicates) as refused.
    fn refuse(&mut self, update: &mut Update<'_>, refused: Vec<Refusal>) {
        for refusal in refused {
            self.errors.push(UpdateFailure {
                type_url: update.kind.as_str().into(),
                name: refusal.name.clone(),
                failed_configuration: Some(refusal.config),
                details: refusal.details.clone(),
                version_info: update.failed_version.clone(),
                last_update_attempt: update.now,
            });
            update
                .refusals
                .entry(refusal.name)
                .or_default()
                .push(refusal.details);
        }
    }

    /// Compiles the candidate set; each resource of the change an error names goes back
    /// to its last good version (or out), refused with its errors, and the rest is
    /// compiled again, until it compiles. Fails with the errors when they name nothing
    /// of the change.
    fn compile_reverting_culprits(
        &mut self,
        update: &mut Update<'_>,
    ) -> Result<(), Vec<CompileError>> {
        let kind = update.kind;
        // What went back to its last good version.
        let mut reverted = BTreeSet::new();
        loop {
            let errors = match self.rebuild(update.changed()) {
                Ok(()) => return Ok(()),
                Err(errors) => errors,
            };
            // Each resource of the change an error names: its errors, joined.
            let mut culprits: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for (resource, details) in &errors {
                if let Some(name) = self.culprit(kind, resource)
                    && update.before.contains_key(name.as_str())
                    && !reverted.contains(&name)
                {
                    culprits.entry(name).or_default().push(details.clone());
                }
            }
            if culprits.is_empty() {
                return Err(errors);
            }
            let state = self.types.get_mut(&kind).expect("a subscribed type");
            for (name, details) in culprits {
                let failed = (state.resources.get(name.as_str())).map(|e| e.resource.to_any(kind));
                match update.before.get(name.as_str()).cloned().flatten() {
                    Some(old) => state.resources.insert(name.as_str().into(), old),
                    None => state.resources.remove(name.as_str()),
                };
                let all = update.refusals.entry(name.clone()).or_default();
                all.extend(details);
                self.errors
                    .retain(|e| !(e.type_url == kind.as_str() && e.name == name));
                self.errors.push(UpdateFailure {
                    type_url: kind.as_str().into(),
                    name: name.clone(),
                    failed_configuration: failed,
                    details: all.join("; "),
                    version_info: update.failed_version.clone(),
                    last_update_attempt: update.now,
                });
                reverted.insert(name);
            }
        }
    }

    /// What compiled is kept: ACK when nothing of the change was refused, else NACK with
    /// what was (the rest stays applied).
    fn accept(
        &mut self,
        update: Update<'_>,
        changes: bool,
        old_system_version: String,
    ) -> Result<(), Vec<(String, String)>> {
        let (kind, version) = (update.kind, update.version);
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        if changes && !changes_anything(&update.before, &state.resources) {
            // Everything that would have changed was refused.
            state.system_version = old_system_version;
            let _ = self.rebuild(update.changed());
        }
        let state = &self.types[&kind];
        let resources = state.resources.len();
        if update.refusals.is_empty() {
            if let Some(state) = self.types.get_mut(&kind) {
                state.version_info = version.to_owned();
            }
            self.count(kind, "update_success");
            tracing::info!(
                kind = kind.short(),
                version,
                resources,
                changed = update.touched.len(),
                "xDS update applied"
            );
            self.check_progress();
            return Ok(());
        }
        self.count(kind, "update_rejected");
        let errors: Vec<(String, String)> = update
            .refusals
            .into_iter()
            .map(|(name, details)| (name, details.join("; ")))
            .collect();
        tracing::warn!(
            kind = kind.short(),
            version,
            resources,
            "xDS update applied in part; refused: {}",
            errors
                .iter()
                .map(|(n, e)| format!("{n}: {e}"))
                .collect::<Vec<_>>()
                .join("; ")
        );
        self.check_progress();
        Err(errors)
    }

    /// Nothing of the change is to blame for `errors`: all of it is undone, NACKed with
    /// them, and the errors it had replaced (`stale`) come back.
    fn undo(
        &mut self,
        mut update: Update<'_>,
        errors: Vec<CompileError>,
        old_system_version: String,
        stale: Vec<UpdateFailure>,
    ) -> Result<(), Vec<(String, String)>> {
        let (kind, version) = (update.kind, update.version);
        let rejected: HashMap<String, Any> = errors
            .iter()
            .filter_map(|(resource, _)| {
                let name = self.culprit(kind, resource)?;
                let entry = self.types[&kind].resources.get(name.as_str())?;
                Some((name, entry.resource.to_any(kind)))
            })
            .collect();
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        state.system_version = old_system_version;
        for (name, old) in std::mem::take(&mut update.before) {
            match old {
                Some(old) => state.resources.insert(name, old),
                None => state.resources.remove(&name),
            };
        }
        self.errors
            .retain(|e| !(e.type_url == kind.as_str() && update.refusals.contains_key(&e.name)));
        self.errors.extend(stale);
        let errors: Vec<(String, String)> = errors
            .into_iter()
            .map(|(resource, details)| (resource.1, details))
            .collect();
        for (name, details) in &errors {
            self.errors
                .retain(|e| !(e.type_url == kind.as_str() && &e.name == name));
            self.errors.push(UpdateFailure {
                type_url: kind.as_str().into(),
                name: name.clone(),
                failed_configuration: rejected.get(name).cloned(),
                details: details.clone(),
                version_info: update.failed_version.clone(),
                last_update_attempt: update.now,
            });
        }
        // Show the error state in /config_dump.
        let _ = self.rebuild(update.changed());
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
        self.check_progress();
        Err(errors)
    }

    /// The resource of `kind` a compile error about `resource` is to blame on: itself,
    /// or for endpoints, the EDS service of the cluster it names.
    fn culprit(&self, kind: TypeUrl, (of, name): &(Option<TypeUrl>, String)) -> Option<String> {
        match (*of)? {
            TypeUrl::Cluster if kind == TypeUrl::ClusterLoadAssignment => {
                let entry = (self.types.get(&TypeUrl::Cluster)?.resources).get(name.as_str())?;
                match &entry.resource {
                    Resource::Cluster(c) => c.eds_service_name().map(str::to_owned),
                    _ => None,
                }
            }
            of if of == kind => Some(name.clone()),
            _ => None,
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
            return Err(vec![(name.to_string(), "not a NameTable".into())]);
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
                Err(vec![(name.to_string(), err.to_string())])
            }
        }
    }

    /// Istio's workloads: into this instance's workload index, resource by resource (a
    /// workload with a bad address is NACKed by name and keeps its last good version);
    /// the index is not part of the snapshot, so nothing is compiled.
    fn apply_workloads(
        &mut self,
        change: Edit,
        version: &str,
        refused: Vec<Refusal>,
    ) -> Result<(), Vec<(String, String)>> {
        use shunt_core::peer::workload_discovery::{Change, WorkloadResource};
        fn resources(entries: &[(Arc<str>, Accepted)]) -> Vec<(&str, &WorkloadResource)> {
            entries
                .iter()
                .filter_map(|(name, entry)| match &entry.resource {
                    Resource::Workload(w) => Some((&**name, &**w)),
                    _ => None,
                })
                .collect()
        }
        let (entries, removals, replace) = match change {
            Edit::Replace(set) => (set.into_iter().collect::<Vec<_>>(), Vec::new(), true),
            Edit::Patch { upserts, removals } => (upserts, removals, false),
        };
        let wds = self.store.load().node.workloads.clone();
        let bad = if replace {
            wds.apply(Change::Replace(resources(&entries)))
        } else {
            wds.apply(Change::Patch {
                upserts: resources(&entries),
                removals: removals.iter().map(|r| &**r).collect(),
            })
        };
        let state = self
            .types
            .get_mut(&TypeUrl::Workload)
            .expect("a subscribed type");
        if replace {
            state
                .resources
                .retain(|name, _| entries.iter().any(|(n, _)| n == name));
        }
        for name in &removals {
            state.resources.remove(name);
        }
        for (name, entry) in entries {
            if !bad.iter().any(|(n, _)| **n == *name) {
                state.resources.insert(name, entry);
            }
        }
        state.applied = true;
        let total = wds.load().len();
        self.stats
            .gauge("workload_discovery.total")
            .set(total as u64);
        let errors: Vec<(String, String)> = refused
            .into_iter()
            .map(|r| (r.name, r.details))
            .chain(bad.into_iter().map(|(name, err)| (name, err.to_string())))
            .collect();
        if errors.is_empty() {
            let state = self.types.get_mut(&TypeUrl::Workload).expect("subscribed");
            state.version_info = version.to_owned();
            state.system_version = version.to_owned();
            self.count(TypeUrl::Workload, "update_success");
            Ok(())
        } else {
            self.count(TypeUrl::Workload, "update_rejected");
            tracing::warn!(version, "workload update rejected in part: {errors:?}");
            Err(errors)
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
            TypeUrl::Workload => "workload_discovery",
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
        if let Err(errors) = self.rebuild(Changed::Anything) {
            tracing::warn!(?errors, "recompiling after warming timed out failed");
        }
        self.check_progress();
        self.resubscribe(None);
    }

    /// Compiles the bootstrap with every accepted resource; on success swaps the snapshot
    /// in, binds new listener sockets and tells the serve loop.
    pub(super) fn rebuild(&mut self, changed: Changed<'_>) -> Result<(), Vec<CompileError>> {
        let dynamic = Arc::new(self.dynamic_resources(changed));
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
        if self.warming_count == 0
            && let Some(request) = self.paused_cds.take()
        {
            self.send(TypeUrl::Cluster, request);
        }
        // A compile frees what it decoded and the replaced snapshot's config: the
        // process's periodic trim returns it, however many proxies rebuilt meanwhile.
        drop(previous);
        shunt_config::trim_soon();
        Ok(())
    }

    /// Binds the addresses of new listeners (a failure refuses the update) and lists
    /// what stops being listened on and which listeners retire.
    pub(super) fn bind(
        &mut self,
        previous: &Snapshot,
        next: &Snapshot,
    ) -> Result<ListenerChange, Vec<CompileError>> {
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
                    (Some(TypeUrl::Listener), name.to_string()),
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
    /// ([`Manager::serve_clusters`], patched for new endpoints, or as they were when
    /// nothing they wait on changed), the listeners as served
    /// ([`Manager::serve_listeners`], or as they were).
    pub(super) fn dynamic_resources(&mut self, changed: Changed<'_>) -> DynamicResources {
        let clusters_served = match changed {
            Changed::Endpoints(services) => self.patch_served_clusters(services),
            Changed::Type(TypeUrl::Listener | TypeUrl::RouteConfiguration) => self.served.is_some(),
            _ => false,
        };
        if !clusters_served {
            self.serve_clusters();
        }
        let listeners_served = self.served_listeners.is_some()
            && matches!(
                changed,
                Changed::Endpoints(_)
                    | Changed::Type(TypeUrl::Cluster | TypeUrl::ClusterLoadAssignment)
            );
        if !listeners_served {
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
            validate_warming: self.validating,
            ..Default::default()
        };
        if let Some(clusters) = self.types.get(&TypeUrl::Cluster) {
            dynamic.clusters_version = clusters.system_version.clone();
        }
        dynamic.endpoints = self.listed_endpoints();
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

    /// The accepted endpoints, as `/config_dump` lists them: the last rebuild's list
    /// while it still names the very entries accepted. Checking that compares pointers
    /// in this manager's own map; making the list touches (counts a reference to) every
    /// endpoints resource, each shared with the other pods of a node: a cache miss per
    /// service per rebuild, and a pod's start rebuilds for every type it gets.
    fn listed_endpoints(&mut self) -> super::ListedEndpoints {
        let Some(state) = self.types.get(&TypeUrl::ClusterLoadAssignment) else {
            return Arc::default();
        };
        let accepted = || {
            state
                .resources
                .values()
                .filter_map(|entry| match &entry.resource {
                    Resource::Endpoints(cla) => Some((entry, cla)),
                    _ => None,
                })
        };
        let listed = &self.endpoints_listed;
        let same = listed.len() == state.resources.len()
            && accepted()
                .zip(listed.iter())
                .all(|((entry, cla), tracked)| {
                    Arc::ptr_eq(cla, &tracked.resource)
                        && (tracked.version_info.as_ref())
                            .is_some_and(|v| Arc::ptr_eq(v, &entry.version))
                        && tracked.last_updated == entry.last_updated
                });
        if !same {
            self.endpoints_listed = accepted().map(|(entry, cla)| entry.tracked(cla)).collect();
        }
        self.endpoints_listed.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_errors_name_their_resource() {
        assert_eq!(
            resource_name(r#"Cluster "outbound|80||a.b".connect_timeout"#),
            (Some(TypeUrl::Cluster), "outbound|80||a.b".into())
        );
        assert_eq!(
            resource_name(r#"Listener "x\"y".address"#),
            (Some(TypeUrl::Listener), "x\"y".into())
        );
        assert_eq!(
            resource_name(r#"RouteConfiguration "80".virtual_hosts[0]"#),
            (Some(TypeUrl::RouteConfiguration), "80".into())
        );
        assert_eq!(
            resource_name(r#"Secret "default".tls_certificate"#),
            (Some(TypeUrl::Secret), "default".into())
        );
        assert_eq!(
            resource_name("static_resources.clusters[0]"),
            (None, String::new())
        );
    }
}
