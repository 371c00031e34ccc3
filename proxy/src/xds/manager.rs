//! The xDS manager: the one owner of the resources accepted from the control plane.
//!
//! Every response, state of the world or Delta, is applied whole: its resources are
//! decoded, merged into a candidate of their type's set, and compiled together with the
//! bootstrap and every other type into a new snapshot ([`crate::snapshot::compile_with`],
//! which keeps unchanged clusters and listeners as they are). Only if that compiles is
//! the candidate kept, the snapshot swapped in and the response ACKed; otherwise it is
//! NACKed with the errors (each at its `Cluster "name"` path) and nothing changes.
//!
//! Envoy's order is kept: clusters are asked for first; an EDS cluster is left out of the
//! snapshot (warming) until its endpoints arrive or `initial_fetch_timeout` passes;
//! listeners are asked for once the first clusters are warm; the proxy is ready once the
//! first listeners are in. Endpoints and routes are subscribed by the names the accepted
//! clusters and listeners use.
//!
//! Listener sockets are bound here, before the ACK, so a listener that cannot bind is
//! NACKed; the serve loop gets the sockets to accept on ([`ListenerChange`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::net::TcpListener as StdListener;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::cluster::v3::Cluster as EnvoyCluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;
use envoy_types::pb::envoy::config::route::v3::RouteConfiguration;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc::Status;
use prost::Message;
use tokio::sync::mpsc;

use super::TypeUrl;
use super::source::{Plan, Stream};
use super::stream::{self, Event, Outbound};
use crate::access_log::Direction;
use crate::config::references::{self, SecretSource};
use crate::config::{Tracked, UpdateFailure};
use crate::listener::Listener;
use crate::snapshot::{Current, DynamicCluster, DynamicResources, Snapshot};
use crate::stats::Store as StatsStore;

/// gRPC INVALID_ARGUMENT, the code Envoy NACKs with.
const INVALID_ARGUMENT: i32 = 3;

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

/// A decoded resource, shared with the snapshots built from it.
#[derive(Debug, Clone)]
enum Resource {
    Listener(Arc<EnvoyListener>),
    Cluster(Arc<EnvoyCluster>),
    Endpoints(Arc<ClusterLoadAssignment>),
    Route(Arc<RouteConfiguration>),
    Secret(Arc<Secret>),
}

impl Resource {
    fn decode(kind: TypeUrl, any: &Any) -> Result<Resource, String> {
        if any.type_url != kind.as_str() {
            return Err(format!(
                "a {} response carries a resource of type {}",
                kind.short().to_uppercase(),
                any.type_url
            ));
        }
        let bytes = any.value.as_slice();
        let decoded = match kind {
            TypeUrl::Listener => {
                EnvoyListener::decode(bytes).map(|r| Resource::Listener(Arc::new(r)))
            }
            TypeUrl::Cluster => EnvoyCluster::decode(bytes).map(|r| Resource::Cluster(Arc::new(r))),
            TypeUrl::ClusterLoadAssignment => {
                ClusterLoadAssignment::decode(bytes).map(|r| Resource::Endpoints(Arc::new(r)))
            }
            TypeUrl::RouteConfiguration => {
                RouteConfiguration::decode(bytes).map(|r| Resource::Route(Arc::new(r)))
            }
            TypeUrl::Secret => Secret::decode(bytes).map(|r| Resource::Secret(Arc::new(r))),
        };
        decoded.map_err(|e| format!("decoding {}: {e}", any.type_url))
    }

    fn name(&self) -> &str {
        match self {
            Resource::Listener(r) => &r.name,
            Resource::Cluster(r) => &r.name,
            Resource::Endpoints(r) => &r.cluster_name,
            Resource::Route(r) => &r.name,
            Resource::Secret(r) => &r.name,
        }
    }

    fn to_any(&self, kind: TypeUrl) -> Any {
        let value = match self {
            Resource::Listener(r) => r.encode_to_vec(),
            Resource::Cluster(r) => r.encode_to_vec(),
            Resource::Endpoints(r) => r.encode_to_vec(),
            Resource::Route(r) => r.encode_to_vec(),
            Resource::Secret(r) => r.encode_to_vec(),
        };
        Any {
            type_url: kind.as_str().to_owned(),
            value,
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    resource: Resource,
    /// Digest of the resource as it came on the wire: tells a changed one from a resent one.
    digest: u64,
    /// The resource's version: Delta's own, or the SotW response's.
    version: Arc<str>,
    last_updated: SystemTime,
}

impl Entry {
    fn new(kind: TypeUrl, any: &Any, version: Arc<str>) -> Result<Entry, String> {
        Ok(Entry {
            resource: Resource::decode(kind, any)?,
            digest: xxhash_rust::xxh64::xxh64(&any.value, 0),
            version,
            last_updated: SystemTime::now(),
        })
    }

    fn tracked<T>(&self, resource: &Arc<T>) -> Tracked<Arc<T>> {
        Tracked {
            resource: resource.clone(),
            version_info: Some(self.version.clone()),
            last_updated: self.last_updated,
        }
    }
}

/// How a response changes a type's accepted set.
enum Change {
    /// State of the world for a wildcard type: this is the whole set.
    Replace(BTreeMap<String, Entry>),
    /// These entries added or replaced, these names removed.
    Patch {
        upserts: Vec<(String, Entry)>,
        removals: Vec<String>,
    },
}

/// What undoes a [`Change`] applied in place.
enum Undo {
    Replace(BTreeMap<String, Entry>),
    Patch(Vec<(String, Option<Entry>)>),
}

/// One type's subscription and accepted resources.
#[derive(Debug, Default)]
struct TypeState {
    /// Named subscriptions (not for wildcard types).
    names: BTreeSet<String>,
    resources: BTreeMap<String, Entry>,
    /// The last accepted version (SotW `version_info`, Delta `system_version_info`).
    version_info: String,
    /// The nonce of the last response, echoed by the next request.
    nonce: String,
    /// Whether a request went out on the current stream.
    subscribed: bool,
    /// Whether a response was ever applied.
    applied: bool,
}

#[derive(Debug)]
struct StreamState {
    config: Stream,
    requests: Option<mpsc::UnboundedSender<Outbound>>,
    node_sent: bool,
}

/// An EDS cluster with its endpoints filled in: the digests of the cluster and the
/// endpoints it was made from, the result, and the result's digest.
type Effective = ((u64, u64), Arc<EnvoyCluster>, u64);

/// The CDS clusters a rebuild served, with what an update of endpoints needs to redo
/// only the clusters those endpoints are for.
#[derive(Debug, Default)]
struct ServedClusters {
    /// Active, in name order (as [`DynamicResources::clusters`]).
    active: Vec<Arc<DynamicCluster>>,
    /// Waiting for their endpoints or secrets.
    warming: Vec<Tracked<Arc<EnvoyCluster>>>,
    /// The active EDS clusters by the service their endpoints come under: each one's
    /// place in `active` and the digest of its CDS config.
    by_service: HashMap<String, Vec<(usize, u64)>>,
    /// The EDS services of warming clusters: their endpoints may end the warming,
    /// which takes a full rebuild.
    awaited: HashSet<String>,
}

/// The LDS listeners a rebuild served.
#[derive(Debug, Default)]
struct ServedListeners {
    /// Served: the accepted version, or the last one served while a newer one warms.
    active: Vec<Tracked<Arc<EnvoyListener>>>,
    /// Waiting for their routes or secrets.
    warming: Vec<Tracked<Arc<EnvoyListener>>>,
    version: String,
}

pub struct Manager {
    bootstrap: Bootstrap,
    node: Node,
    plan: Plan,
    store: Arc<Current>,
    stats: StatsStore,
    /// Called once, when the first configuration is in and warm (`/ready` says LIVE).
    on_ready: Option<Box<dyn FnOnce() + Send>>,
    binder: Binder,
    changes: mpsc::UnboundedSender<ListenerChange>,
    types: BTreeMap<TypeUrl, TypeState>,
    streams: Vec<StreamState>,
    /// EDS clusters waiting for endpoints, with when they stop waiting (`None`: never).
    warming: HashMap<String, Option<Instant>>,
    /// How many clusters the current snapshot leaves warming.
    warming_count: usize,
    /// Each active EDS cluster with its endpoints filled in, by name, with the digests
    /// of the cluster and endpoints it was made from and its own digest.
    effective: HashMap<String, Effective>,
    /// The clusters the last rebuild served: an update of endpoints patches them.
    served: Option<ServedClusters>,
    /// The listeners the last rebuild served, active and warming: an update of
    /// endpoints keeps them.
    served_listeners: Option<ServedListeners>,
    /// Clusters whose wait ended without endpoints or secrets.
    timed_out: HashSet<String>,
    /// Listeners waiting for their routes or secrets, with when they stop waiting.
    warming_listeners: HashMap<String, Option<Instant>>,
    /// Listeners whose wait ended without them: served as they are.
    listeners_timed_out: HashSet<String>,
    /// The version of each listener last served: it keeps serving while a newer
    /// version warms, as in Envoy.
    active_listeners: HashMap<String, Tracked<Arc<EnvoyListener>>>,
    /// The bootstrap's `static_resources.secrets`, which need no subscription.
    static_secrets: HashSet<String>,
    /// The SDS source of secrets not over ADS (Istio's `sds-grpc`), once one is named.
    secret_source: Option<envoy_types::pb::envoy::config::core::v3::ConfigSource>,
    /// Starts further streams (an SDS source named by a transport socket).
    events_tx: mpsc::UnboundedSender<Event>,
    errors: Vec<UpdateFailure>,
    /// Sockets bound for dynamic listeners, by listener and address.
    bound: BTreeSet<(Arc<str>, SocketAddr)>,
    listeners_requested: bool,
    ready: bool,
}

impl Manager {
    /// Starts the streams of `plan` and the manager on the current runtime. Listener
    /// changes reach the serve loop through the returned channel.
    pub fn start(
        bootstrap: Bootstrap,
        plan: Plan,
        store: Arc<Current>,
        stats: StatsStore,
        on_ready: Box<dyn FnOnce() + Send>,
        binder: Binder,
        bound: impl IntoIterator<Item = (Arc<str>, SocketAddr)>,
    ) -> mpsc::UnboundedReceiver<ListenerChange> {
        let (events_tx, events) = mpsc::unbounded_channel();
        let (changes, changes_rx) = mpsc::unbounded_channel();
        let mut node = bootstrap.node.clone().unwrap_or_default();
        node.user_agent_name = "shunt".into();
        node.user_agent_version_type = Some(
            envoy_types::pb::envoy::config::core::v3::node::UserAgentVersionType::UserAgentVersion(
                env!("CARGO_PKG_VERSION").into(),
            ),
        );
        let streams = plan
            .streams
            .iter()
            .map(|config| StreamState {
                config: config.clone(),
                requests: None,
                node_sent: false,
            })
            .collect();
        for (index, config) in plan.streams.iter().enumerate() {
            tokio::spawn(stream::run(index, config.clone(), events_tx.clone()));
        }
        let types = plan
            .streams
            .iter()
            .flat_map(|s| s.types.iter().copied())
            .map(|t| (t, TypeState::default()))
            .collect();
        let static_secrets = bootstrap
            .static_resources
            .iter()
            .flat_map(|r| &r.secrets)
            .map(|s| s.name.clone())
            .collect();
        let manager = Manager {
            static_secrets,
            secret_source: None,
            events_tx,
            warming_listeners: HashMap::new(),
            listeners_timed_out: HashSet::new(),
            active_listeners: HashMap::new(),
            bootstrap,
            node,
            plan,
            store,
            stats,
            on_ready: Some(on_ready),
            binder,
            changes,
            types,
            streams,
            warming: HashMap::new(),
            timed_out: Default::default(),
            effective: HashMap::new(),
            served: None,
            served_listeners: None,
            warming_count: 0,
            errors: Vec::new(),
            bound: bound.into_iter().collect(),
            listeners_requested: false,
            ready: false,
        };
        tokio::spawn(manager.run(events));
        changes_rx
    }

    async fn run(mut self, mut events: mpsc::UnboundedReceiver<Event>) {
        // Without clusters over xDS, listeners are asked for at once.
        self.listeners_requested = !self.types.contains_key(&TypeUrl::Cluster);
        loop {
            let deadline = self
                .warming
                .values()
                .chain(self.warming_listeners.values())
                .flatten()
                .min()
                .copied();
            tokio::select! {
                event = events.recv() => match event {
                    Some(event) => self.on_event(event),
                    None => return,
                },
                () = sleep_until(deadline), if deadline.is_some() => {
                    // Clusters and listeners whose endpoints, routes or secrets did not
                    // come in time are served without.
                    tracing::warn!("initial_fetch_timeout passed for warming clusters or listeners");
                    self.reapply();
                }
            }
        }
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected { stream, requests } => {
                let config = &self.streams[stream].config;
                let types: Vec<&str> = config.types.iter().map(|t| t.short()).collect();
                tracing::info!(target = %config.target, types = %types.join(","), "xDS stream connected");
                self.stats.gauge("control_plane.connected_state").set(1);
                let state = &mut self.streams[stream];
                state.requests = Some(requests);
                state.node_sent = false;
                for kind in state.config.types.clone() {
                    if let Some(t) = self.types.get_mut(&kind) {
                        t.subscribed = false;
                    }
                }
                self.subscribe_all();
            }
            Event::Disconnected { stream, error } => {
                tracing::debug!(%error, "xDS stream disconnected");
                self.stats.gauge("control_plane.connected_state").set(0);
                self.streams[stream].requests = None;
            }
            Event::Sotw { stream, response } => self.on_sotw(stream, response),
            Event::Delta { stream, response } => self.on_delta(stream, response),
        }
    }

    /// The stream carrying `kind`.
    fn stream_of(&self, kind: TypeUrl) -> Option<usize> {
        self.streams
            .iter()
            .position(|s| s.config.types.contains(&kind))
    }

    fn send(&mut self, kind: TypeUrl, request: Outbound) {
        let Some(index) = self.stream_of(kind) else {
            return;
        };
        let state = &mut self.streams[index];
        let Some(requests) = &state.requests else {
            return;
        };
        let node = (!state.node_sent || !state.config.set_node_on_first_message_only)
            .then(|| self.node.clone());
        state.node_sent = true;
        let request = match request {
            Outbound::Sotw(mut r) => {
                r.node = node;
                Outbound::Sotw(r)
            }
            Outbound::Delta(mut r) => {
                r.node = node;
                Outbound::Delta(r)
            }
        };
        // A closed stream reconnects and subscribes afresh.
        let _ = requests.send(request);
    }

    fn is_delta(&self, kind: TypeUrl) -> bool {
        self.stream_of(kind)
            .is_some_and(|i| self.streams[i].config.delta)
    }

    /// Whether `kind` should be asked for now.
    fn wanted(&self, kind: TypeUrl) -> bool {
        match kind {
            TypeUrl::Cluster => true,
            TypeUrl::Listener => self.listeners_requested,
            _ => self.types.get(&kind).is_some_and(|t| !t.names.is_empty()),
        }
    }

    /// Sends the first request of each wanted type not yet asked for on its stream:
    /// with what is held (SotW's version, Delta's `initial_resource_versions`) so that
    /// a reconnect does not make the server resend what did not change.
    fn subscribe_all(&mut self) {
        for kind in TypeUrl::ALL {
            let Some(state) = self.types.get(&kind) else {
                continue;
            };
            if state.subscribed || !self.wanted(kind) {
                continue;
            }
            let Some(index) = self.stream_of(kind) else {
                continue;
            };
            if self.streams[index].requests.is_none() {
                continue;
            }
            let names: Vec<String> = if kind.is_wildcard() {
                Vec::new()
            } else {
                state.names.iter().cloned().collect()
            };
            let request = if self.is_delta(kind) {
                Outbound::Delta(DeltaDiscoveryRequest {
                    type_url: kind.as_str().into(),
                    resource_names_subscribe: names,
                    initial_resource_versions: state
                        .resources
                        .iter()
                        .map(|(name, entry)| (name.clone(), entry.version.to_string()))
                        .collect(),
                    ..Default::default()
                })
            } else {
                Outbound::Sotw(DiscoveryRequest {
                    version_info: state.version_info.clone(),
                    type_url: kind.as_str().into(),
                    resource_names: names,
                    ..Default::default()
                })
            };
            tracing::debug!(kind = kind.short(), "subscribing");
            self.send(kind, request);
            if let Some(state) = self.types.get_mut(&kind) {
                state.subscribed = true;
            }
        }
    }

    /// A response of `type_url` arrived with `nonce`: its type, if subscribed, with the
    /// nonce kept for the next request to echo.
    fn received(&mut self, type_url: &str, nonce: &str) -> Option<TypeUrl> {
        let Some(kind) = TypeUrl::parse(type_url) else {
            tracing::warn!(%type_url, "response of a type not asked for");
            return None;
        };
        let state = self.types.get_mut(&kind)?;
        state.nonce = nonce.to_owned();
        Some(kind)
    }

    fn on_sotw(&mut self, _stream: usize, response: DiscoveryResponse) {
        let Some(kind) = self.received(&response.type_url, &response.nonce) else {
            return;
        };
        let version = response.version_info.clone();
        // One version for every resource of the response.
        let shared: Arc<str> = version.as_str().into();
        let decoded: Result<Vec<Entry>, (String, String)> = response
            .resources
            .iter()
            .map(|any| Entry::new(kind, any, shared.clone()).map_err(|e| (String::new(), e)))
            .collect();
        let result = decoded.map_err(|e| vec![e]).and_then(|entries| {
            let state = &self.types[&kind];
            // A resource resent unchanged keeps its `last_updated`.
            let entries = entries.into_iter().map(|entry| {
                let name = entry.resource.name().to_owned();
                let entry = match state.resources.get(&name) {
                    Some(old) if old.digest == entry.digest => Entry {
                        version: shared.clone(),
                        ..old.clone()
                    },
                    _ => entry,
                };
                (name, entry)
            });
            let change = if kind.is_wildcard() {
                Change::Replace(entries.collect())
            } else {
                Change::Patch {
                    upserts: entries.collect(),
                    removals: Vec::new(),
                }
            };
            self.apply(kind, change, &version)
        });
        let state = &self.types[&kind];
        let mut request = DiscoveryRequest {
            type_url: kind.as_str().into(),
            response_nonce: response.nonce,
            resource_names: if kind.is_wildcard() {
                Vec::new()
            } else {
                state.names.iter().cloned().collect()
            },
            ..Default::default()
        };
        match result {
            Ok(()) => request.version_info = version,
            Err(errors) => {
                request.version_info = state.version_info.clone();
                request.error_detail = Some(nack_status(kind, &errors));
            }
        }
        self.send(kind, Outbound::Sotw(request));
        self.resubscribe(Some(kind));
    }

    fn on_delta(&mut self, _stream: usize, response: DeltaDiscoveryResponse) {
        let Some(kind) = self.received(&response.type_url, &response.nonce) else {
            return;
        };
        let version = response.system_version_info.clone();
        let mut upserts = Vec::new();
        let mut errors = Vec::new();
        for resource in &response.resources {
            let Some(any) = &resource.resource else {
                continue;
            };
            match Entry::new(kind, any, resource.version.as_str().into()) {
                Ok(entry) => {
                    let name = if resource.name.is_empty() {
                        entry.resource.name().to_owned()
                    } else {
                        resource.name.clone()
                    };
                    upserts.push((name, entry));
                }
                Err(e) => errors.push((resource.name.clone(), e)),
            }
        }
        let change = Change::Patch {
            upserts,
            removals: response.removed_resources.clone(),
        };
        let result = if errors.is_empty() {
            self.apply(kind, change, &version)
        } else {
            Err(errors)
        };
        let mut request = DeltaDiscoveryRequest {
            type_url: kind.as_str().into(),
            response_nonce: response.nonce,
            ..Default::default()
        };
        if let Err(errors) = result {
            request.error_detail = Some(nack_status(kind, &errors));
        }
        self.send(kind, Outbound::Delta(request));
        self.resubscribe(Some(kind));
    }

    /// Applies `change` to the set of `kind` in place: compiles, swaps, binds. On failure
    /// the change is undone and the errors (resource name, message) are returned for the
    /// NACK.
    fn apply(
        &mut self,
        kind: TypeUrl,
        change: Change,
        version: &str,
    ) -> Result<(), Vec<(String, String)>> {
        let state = self.types.get_mut(&kind).expect("a subscribed type");
        let mut removed_any = false;
        let (undo, touched): (Undo, Vec<String>) = match change {
            Change::Replace(set) => {
                let touched = set.keys().cloned().collect();
                (
                    Undo::Replace(std::mem::replace(&mut state.resources, set)),
                    touched,
                )
            }
            Change::Patch { upserts, removals } => {
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

    fn count(&self, kind: TypeUrl, what: &str) {
        let prefix = match kind {
            TypeUrl::Cluster => "cluster_manager.cds",
            TypeUrl::Listener => "listener_manager.lds",
            TypeUrl::ClusterLoadAssignment => "cluster_manager.eds",
            TypeUrl::RouteConfiguration => "http.rds",
            TypeUrl::Secret => "sds",
        };
        self.stats.counter(&format!("{prefix}.{what}")).inc();
    }

    /// Recompiles once warming clusters waited `initial_fetch_timeout` in vain: they are
    /// served without endpoints.
    fn reapply(&mut self) {
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
    fn rebuild(
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
    fn bind(
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

    /// After an update: ask for listeners once the first clusters are warm, and be
    /// ready once the first listeners are in.
    fn check_progress(&mut self) {
        let clusters_done =
            self.types.get(&TypeUrl::Cluster).is_none_or(|t| t.applied) && self.warming_count == 0;
        if clusters_done && !self.listeners_requested {
            self.listeners_requested = true;
        }
        let listeners_done = self.types.get(&TypeUrl::Listener).is_none_or(|t| t.applied)
            && self.warming_listeners.is_empty();
        if clusters_done && listeners_done && !self.ready {
            self.ready = true;
            if let Some(on_ready) = self.on_ready.take() {
                on_ready();
            }
            tracing::info!("xDS initial configuration applied: ready");
        }
    }

    /// Updates named subscriptions (endpoints of EDS clusters, routes of listeners) and
    /// sends first requests of types that became wanted.
    /// `changed`: the type just updated (`None`: any); only clusters and listeners name
    /// what others subscribe to.
    fn resubscribe(&mut self, changed: Option<TypeUrl>) {
        let mut wanted: HashMap<TypeUrl, BTreeSet<String>> = HashMap::new();
        let recompute = |kind: TypeUrl| changed.is_none_or(|c| c == kind);
        if let Some(clusters) = self
            .types
            .get(&TypeUrl::Cluster)
            .filter(|_| recompute(TypeUrl::Cluster))
        {
            wanted.insert(
                TypeUrl::ClusterLoadAssignment,
                clusters
                    .resources
                    .values()
                    .filter_map(|e| match &e.resource {
                        Resource::Cluster(c) => eds_service_name(c).map(str::to_owned),
                        _ => None,
                    })
                    .collect(),
            );
        }
        if let Some(listeners) = self
            .types
            .get(&TypeUrl::Listener)
            .filter(|_| recompute(TypeUrl::Listener))
        {
            wanted.insert(
                TypeUrl::RouteConfiguration,
                listeners
                    .resources
                    .values()
                    .filter_map(|e| match &e.resource {
                        Resource::Listener(l) => Some(references::rds_names(l)),
                        _ => None,
                    })
                    .flatten()
                    .collect(),
            );
        }
        if recompute(TypeUrl::Cluster) || recompute(TypeUrl::Listener) {
            let names = self.secret_names();
            wanted.insert(TypeUrl::Secret, names);
        }
        for (kind, names) in wanted {
            let delta = self.is_delta(kind);
            let Some(state) = self.types.get_mut(&kind) else {
                continue;
            };
            if state.names == names {
                continue;
            }
            let added: Vec<String> = names.difference(&state.names).cloned().collect();
            let removed: Vec<String> = state.names.difference(&names).cloned().collect();
            state.names = names;
            // Unsubscribed resources are forgotten (Envoy drops them too).
            for name in &removed {
                state.resources.remove(name);
            }
            if !state.subscribed {
                continue;
            }
            let request = if delta {
                Outbound::Delta(DeltaDiscoveryRequest {
                    type_url: kind.as_str().into(),
                    resource_names_subscribe: added,
                    resource_names_unsubscribe: removed,
                    ..Default::default()
                })
            } else if state.names.is_empty() {
                // An empty SotW request would read as a wildcard subscription.
                continue;
            } else {
                Outbound::Sotw(DiscoveryRequest {
                    version_info: state.version_info.clone(),
                    response_nonce: state.nonce.clone(),
                    type_url: kind.as_str().into(),
                    resource_names: state.names.iter().cloned().collect(),
                    ..Default::default()
                })
            };
            self.send(kind, request);
        }
        self.subscribe_all();
    }

    /// The secrets the accepted listeners and clusters name (but static ones). The first
    /// SDS source other than ADS gets a stream of its own.
    fn secret_names(&mut self) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        let mut api_source = None;
        for kind in [TypeUrl::Listener, TypeUrl::Cluster] {
            let Some(state) = self.types.get(&kind) else {
                continue;
            };
            for entry in state.resources.values() {
                let refs = match &entry.resource {
                    Resource::Listener(l) => references::listener_secrets(l),
                    Resource::Cluster(c) => references::cluster_secrets(c),
                    _ => continue,
                };
                for secret in refs {
                    match secret.source {
                        SecretSource::Static => continue,
                        SecretSource::Ads => {}
                        SecretSource::Api(source) => {
                            if api_source.is_none() {
                                api_source = Some(source);
                            } else if api_source.as_ref() != Some(&source) {
                                tracing::warn!(secret = %secret.name, "secrets from a second SDS source are not implemented: asking the first one");
                            }
                        }
                    }
                    names.insert(secret.name);
                }
            }
        }
        if let Some(source) = api_source {
            self.open_secret_stream(*source);
        }
        names
    }

    /// Starts the stream of an SDS `api_config_source` (Istio's `sds-grpc` to the agent)
    /// and moves the secret subscription onto it.
    fn open_secret_stream(
        &mut self,
        source: envoy_types::pb::envoy::config::core::v3::ConfigSource,
    ) {
        if self.secret_source.is_some() {
            if self.secret_source.as_ref() != Some(&source) {
                tracing::warn!(
                    "secrets from a second SDS source are not implemented: asking the first one"
                );
            }
            return;
        }
        let config = match super::source::secret_stream(&source, &self.bootstrap) {
            Ok(config) => config,
            Err(err) => {
                tracing::warn!("cannot open the SDS stream: {err:#}");
                return;
            }
        };
        tracing::info!(target = %config.target, "opening the SDS stream");
        self.secret_source = Some(source);
        for stream in &mut self.streams {
            stream.config.types.retain(|t| *t != TypeUrl::Secret);
        }
        let state = self.types.entry(TypeUrl::Secret).or_default();
        state.subscribed = false;
        let index = self.streams.len();
        self.streams.push(StreamState {
            config: config.clone(),
            requests: None,
            node_sent: false,
        });
        tokio::spawn(stream::run(index, config, self.events_tx.clone()));
    }

    /// Works out every CDS cluster afresh: active (EDS ones with their endpoints filled
    /// in) or warming, and until when.
    fn serve_clusters(&mut self) {
        let mut served = ServedClusters::default();
        let endpoints = self
            .types
            .get(&TypeUrl::ClusterLoadAssignment)
            .map(|t| &t.resources);
        let has_secret = |name: &str| has_secret(&self.types, &self.static_secrets, name);
        let deadline = |since| warm_until(self.plan.initial_fetch_timeout, since);
        let mut still_warming = HashMap::new();
        if let Some(clusters) = self.types.get(&TypeUrl::Cluster) {
            for entry in clusters.resources.values() {
                let Resource::Cluster(cluster) = &entry.resource else {
                    continue;
                };
                let tracked = entry.tracked(cluster);
                let service = eds_service_name(cluster);
                let secrets_missing = references::cluster_secrets(cluster)
                    .iter()
                    .any(|s| s.source != SecretSource::Static && !has_secret(&s.name));
                let eds = service.and_then(|s| endpoints.and_then(|e| e.get(s)));
                let waiting = secrets_missing || (service.is_some() && eds.is_none());
                if waiting && !self.timed_out.contains(&cluster.name) {
                    let deadline = deadline(self.warming.get(&cluster.name));
                    still_warming.insert(cluster.name.clone(), deadline);
                    served.awaited.extend(service.map(str::to_owned));
                    served.warming.push(tracked);
                    continue;
                }
                let Some(service) = service else {
                    served.active.push(Arc::new(DynamicCluster {
                        tracked,
                        effective: cluster.clone(),
                        digest: entry.digest,
                    }));
                    continue;
                };
                let (effective, digest) =
                    with_endpoints_of(&mut self.effective, entry.digest, cluster, eds);
                served
                    .by_service
                    .entry(service.to_owned())
                    .or_default()
                    .push((served.active.len(), entry.digest));
                served.active.push(Arc::new(DynamicCluster {
                    tracked,
                    effective,
                    digest,
                }));
            }
            // Forget the clusters made for EDS clusters no longer served with endpoints
            // (removed, warming, or no longer EDS), if there are any.
            let with_endpoints: usize = served.by_service.values().map(Vec::len).sum();
            if self.effective.len() != with_endpoints {
                self.effective.retain(|name, _| {
                    !still_warming.contains_key(name)
                        && clusters.resources.get(name).is_some_and(|e| {
                            matches!(&e.resource, Resource::Cluster(c) if eds_service_name(c).is_some())
                        })
                });
            }
        }
        self.warming = still_warming;
        if !self.timed_out.is_empty()
            && let Some(clusters) = self.types.get(&TypeUrl::Cluster)
        {
            self.timed_out
                .retain(|name| clusters.resources.contains_key(name));
        }
        self.served = Some(served);
    }

    /// Redoes the served clusters whose endpoints (`services`) an update upserted, the
    /// others staying as they are: an update of one cluster's endpoints costs that
    /// cluster. False, with nothing done, when that is not all the update changes: no
    /// clusters were served yet, a warming cluster waits for one of these endpoints.
    fn patch_served_clusters(&mut self, services: &[String]) -> bool {
        let Some(served) = &mut self.served else {
            return false;
        };
        let Some(endpoints) = self
            .types
            .get(&TypeUrl::ClusterLoadAssignment)
            .map(|t| &t.resources)
        else {
            return false;
        };
        let patchable = services
            .iter()
            .all(|s| !served.awaited.contains(s) && endpoints.contains_key(s));
        if !patchable {
            return false;
        }
        for service in services {
            let Some(users) = served.by_service.get(service) else {
                continue;
            };
            let eds = endpoints.get(service);
            for &(i, cluster_digest) in users {
                let old = &served.active[i];
                let (effective, digest) = with_endpoints_of(
                    &mut self.effective,
                    cluster_digest,
                    &old.tracked.resource,
                    eds,
                );
                if !Arc::ptr_eq(&effective, &old.effective) {
                    served.active[i] = Arc::new(DynamicCluster {
                        tracked: old.tracked.clone(),
                        effective,
                        digest,
                    });
                }
            }
        }
        true
    }

    /// Everything accepted, as the snapshot compiler takes it: the clusters as served
    /// ([`Manager::serve_clusters`], or patched for `endpoints_changed`: see
    /// [`Manager::rebuild`]), the listeners as served ([`Manager::serve_listeners`],
    /// which new endpoints do not change).
    fn dynamic_resources(&mut self, endpoints_changed: Option<&[String]>) -> DynamicResources {
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

    /// Works out every LDS listener afresh: a listener warms until its routes and
    /// secrets are in (or its wait is over); a version already served keeps serving
    /// meanwhile.
    fn serve_listeners(&mut self) {
        let mut served = ServedListeners::default();
        let routes = self
            .types
            .get(&TypeUrl::RouteConfiguration)
            .map(|t| &t.resources);
        let has_secret = |name: &str| has_secret(&self.types, &self.static_secrets, name);
        let deadline = |since| warm_until(self.plan.initial_fetch_timeout, since);
        let mut warming_listeners = HashMap::new();
        let mut active_listeners = HashMap::new();
        if let Some(listeners) = self.types.get(&TypeUrl::Listener) {
            served.version = listeners.version_info.clone();
            for entry in listeners.resources.values() {
                let Resource::Listener(l) = &entry.resource else {
                    continue;
                };
                let waiting = references::rds_names(l)
                    .iter()
                    .any(|name| !routes.is_some_and(|r| r.contains_key(name)))
                    || references::listener_secrets(l)
                        .iter()
                        .any(|s| s.source != SecretSource::Static && !has_secret(&s.name));
                let tracked = entry.tracked(l);
                if waiting && !self.listeners_timed_out.contains(&l.name) {
                    warming_listeners.insert(
                        l.name.clone(),
                        deadline(self.warming_listeners.get(&l.name)),
                    );
                    served.warming.push(tracked);
                    if let Some(active) = self.active_listeners.get(&l.name) {
                        served.active.push(active.clone());
                        active_listeners.insert(l.name.clone(), active.clone());
                    }
                    continue;
                }
                served.active.push(tracked.clone());
                active_listeners.insert(l.name.clone(), tracked);
            }
            self.listeners_timed_out
                .retain(|name| listeners.resources.contains_key(name));
        }
        self.warming_listeners = warming_listeners;
        self.active_listeners = active_listeners;
        self.served_listeners = Some(served);
    }
}

/// Whether secret `name` is there: SDS sent it or the bootstrap has it.
fn has_secret(
    types: &BTreeMap<TypeUrl, TypeState>,
    static_secrets: &HashSet<String>,
    name: &str,
) -> bool {
    static_secrets.contains(name)
        || types
            .get(&TypeUrl::Secret)
            .is_some_and(|t| t.resources.contains_key(name))
}

/// Until when a resource warming since `since` (`None`: starting now) waits:
/// `initial_fetch_timeout` from its start, or for ever when that is 0.
fn warm_until(timeout: std::time::Duration, since: Option<&Option<Instant>>) -> Option<Instant> {
    since
        .copied()
        .unwrap_or_else(|| (!timeout.is_zero()).then(|| Instant::now() + timeout))
}

/// The EDS service an EDS cluster's endpoints come under: `service_name`, else its name.
fn eds_service_name(cluster: &EnvoyCluster) -> Option<&str> {
    let is_eds = matches!(
        cluster.cluster_discovery_type,
        Some(ClusterDiscoveryType::Type(t)) if t == DiscoveryType::Eds as i32
    );
    if !is_eds {
        return None;
    }
    let service = cluster
        .eds_cluster_config
        .as_ref()
        .map_or("", |eds| eds.service_name.as_str());
    Some(if service.is_empty() {
        &cluster.name
    } else {
        service
    })
}

/// An EDS cluster (`cluster`, whose CDS config has `cluster_digest`) with its endpoints
/// (`eds`, if they came) in its `load_assignment`, and the result's digest: made again
/// only when the cluster or its endpoints changed since the last time (`made`, by
/// cluster name), else shared.
fn with_endpoints_of(
    made: &mut HashMap<String, Effective>,
    cluster_digest: u64,
    cluster: &EnvoyCluster,
    eds: Option<&Entry>,
) -> (Arc<EnvoyCluster>, u64) {
    let key = (cluster_digest, eds.map_or(0, |e| e.digest));
    if let Some((k, effective, digest)) = made.get(cluster.name.as_str())
        && *k == key
    {
        return (effective.clone(), *digest);
    }
    let mut with_endpoints = cluster.clone();
    if let Some(Resource::Endpoints(cla)) = eds.map(|e| &e.resource) {
        with_endpoints.load_assignment = Some((**cla).clone());
    }
    let digest = xxhash_rust::xxh64::xxh64(&[key.0.to_le_bytes(), key.1.to_le_bytes()].concat(), 0);
    let effective = Arc::new(with_endpoints);
    made.insert(cluster.name.clone(), (key, effective.clone(), digest));
    (effective, digest)
}

/// The resource a compile error is about: `Cluster "name"...`, `Listener "name"...`,
/// `RouteConfiguration "name"...` or `Secret "name"...`.
fn resource_name(path: &str) -> String {
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

fn nack_status(kind: TypeUrl, errors: &[(String, String)]) -> Status {
    Status {
        code: INVALID_ARGUMENT,
        message: format!(
            "{} update rejected: {}",
            kind.short().to_uppercase(),
            errors
                .iter()
                .map(|(_, e)| e.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        ),
        details: Vec::new(),
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
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
