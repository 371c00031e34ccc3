//! The xDS manager: the one owner of the resources accepted from the control plane.
//!
//! Every response, state of the world or Delta, is judged resource by resource, as
//! Envoy does: its resources are decoded, merged into a candidate of their type's set,
//! and compiled together with the bootstrap and every other type into a new snapshot
//! ([`crate::snapshot::compile_with`], which keeps unchanged clusters and listeners as
//! they are). A resource the compile refuses (each error is at its `Cluster "name"`
//! path) goes back to its last good version and the rest is compiled again: the valid
//! ones are served, the response is ACKed if nothing was refused, else NACKed naming the
//! refused ones (Envoy's `Error adding/updating listener(s) ...`), which keep their
//! `error_state` in `/config_dump`. A NACK carries the version last accepted whole.
//!
//! Envoy's order is kept: clusters are asked for first; an EDS cluster is left out of the
//! snapshot (warming) until its endpoints arrive or `initial_fetch_timeout` passes;
//! listeners are asked for once the first clusters are warm; the proxy is ready once the
//! first listeners are in. Endpoints and routes are subscribed by the names the accepted
//! clusters and listeners use.
//!
//! Listener sockets are bound here, before the ACK, so a listener that cannot bind is
//! NACKed; the serve loop gets the sockets to accept on ([`ListenerChange`]).

mod apply;
mod interned;
mod protocol;
mod resources;
mod warming;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::listener::v3::Listener as EnvoyListener;
use tokio::sync::mpsc;

use super::source::Plan;
use super::stream::{self, Event, Outbound};
use crate::snapshot::Current;
use crate::type_url::TypeUrl;
use protocol::StreamState;
use resources::Accepted;
use shunt_config::{Tracked, UpdateFailure};
use shunt_core::stats::Store as StatsStore;
use warming::{ServedClusters, ServedListeners, sleep_until};

pub use apply::{Binder, BoundSocket, ListenerChange};
pub use interned::count as interned_resources;

/// gRPC INTERNAL, the code Envoy NACKs with.
const INTERNAL: i32 = 13;

/// One type's subscription and accepted resources.
#[derive(Debug, Default)]
struct TypeState {
    /// Named subscriptions (not for wildcard types).
    names: BTreeSet<Arc<str>>,
    /// Keyed by the resource's own (shared) name.
    resources: BTreeMap<Arc<str>, Accepted>,
    /// The version of the last response accepted whole (SotW `version_info`, Delta
    /// `system_version_info`): what the next request carries.
    version_info: String,
    /// The version of the last response that changed anything, even if it was refused in
    /// part: what `/config_dump` shows (Envoy's `system_version_info`).
    system_version: String,
    /// The nonce of the last response, echoed by the next request.
    nonce: String,
    /// Whether a request went out on the current stream.
    subscribed: bool,
    /// Whether a response was ever applied.
    applied: bool,
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
    warming: warming::NameMap<Option<Instant>>,
    /// How many clusters the current snapshot leaves warming.
    warming_count: usize,
    /// The latest CDS request (ACK or NACK) held while clusters warm: see
    /// [`Manager::send`].
    paused_cds: Option<Outbound>,
    /// The clusters the last rebuild served: an update of endpoints patches them.
    served: Option<ServedClusters>,
    /// The listeners the last rebuild served, active and warming: an update of
    /// endpoints keeps them.
    served_listeners: Option<ServedListeners>,
    /// Clusters whose wait ended without endpoints or secrets.
    timed_out: HashSet<Arc<str>>,
    /// Listeners waiting for their routes or secrets, with when they stop waiting.
    warming_listeners: HashMap<String, Option<Instant>>,
    /// Listeners whose wait ended without them: served as they are.
    listeners_timed_out: HashSet<String>,
    /// The version of each listener last served: it keeps serving while a newer
    /// version warms, as in Envoy.
    active_listeners: HashMap<String, Tracked<Arc<crate::snapshot::Encoded<EnvoyListener>>>>,
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
    /// An update of clusters or listeners is being compiled: the warming ones are
    /// checked too.
    validating: bool,
    /// Where an accepted name table goes (the DNS proxy), when it is on.
    dns: Option<Arc<shunt_dns::Tables>>,
    /// The accepted endpoints as the last rebuild listed them (see
    /// [`Manager::listed_endpoints`]).
    endpoints_listed: ListedEndpoints,
}

/// The accepted endpoints, as a snapshot lists them for `/config_dump`.
type ListedEndpoints = Arc<
    [Tracked<
        Arc<
            crate::snapshot::Encoded<
                envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment,
            >,
        >,
    >],
>;

impl Manager {
    /// Starts the streams of `plan` and the manager on the current runtime. Listener
    /// changes reach the serve loop through the returned channel; dropping it stops
    /// the manager and its streams. Name tables (when
    /// `plan` asks for them) are applied to `dns`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        bootstrap: Bootstrap,
        plan: Plan,
        store: Arc<Current>,
        stats: StatsStore,
        on_ready: Box<dyn FnOnce() + Send>,
        binder: Binder,
        bound: impl IntoIterator<Item = (Arc<str>, SocketAddr)>,
        dns: Option<Arc<shunt_dns::Tables>>,
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
            tokio::spawn(stream::run(
                index,
                config.clone(),
                events_tx.clone(),
                plan.local.clone(),
                plan.channels.clone(),
            ));
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
            warming: Default::default(),
            timed_out: Default::default(),
            served: None,
            served_listeners: None,
            warming_count: 0,
            paused_cds: None,
            errors: Vec::new(),
            bound: bound.into_iter().collect(),
            listeners_requested: false,
            ready: false,
            validating: false,
            dns,
            endpoints_listed: Arc::default(),
        };
        tokio::spawn(manager.run(events));
        changes_rx
    }

    pub(super) async fn run(mut self, mut events: mpsc::UnboundedReceiver<Event>) {
        // Without clusters over xDS, listeners are asked for at once.
        self.listeners_requested = !self.types.contains_key(&TypeUrl::Cluster);
        // Without listeners or clusters over xDS (workload discovery only) the proxy is
        // ready at once: Envoy's init does not wait for a bootstrap extension's data.
        self.check_progress();
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
                // Nobody serves the listeners any more (a node's pod was removed): stop,
                // and the streams end with the manager.
                () = self.changes.closed() => return,
                () = sleep_until(deadline), if deadline.is_some() => {
                    // Clusters and listeners whose endpoints, routes or secrets did not
                    // come in time are served without.
                    tracing::warn!("initial_fetch_timeout passed for warming clusters or listeners");
                    self.reapply();
                }
            }
        }
    }

    pub(super) fn on_event(&mut self, event: Event) {
        match event {
            Event::Connected { stream, requests } => {
                let config = &self.streams[stream].config;
                let types: Vec<&str> = config.types.iter().map(|t| t.short()).collect();
                tracing::info!(target = %config.target, types = %types.join(","), "xDS stream connected");
                self.stats.gauge("control_plane.connected_state").set(1);
                if config.types.contains(&TypeUrl::Cluster) {
                    // The new stream subscribes afresh; the old one's ACK is moot.
                    self.paused_cds = None;
                }
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

    /// After an update: ask for listeners once the first clusters are warm, and be
    /// ready once the first listeners are in.
    pub(super) fn check_progress(&mut self) {
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
}
