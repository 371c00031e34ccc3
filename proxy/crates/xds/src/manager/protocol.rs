//! The protocol side: which streams carry which types, the requests the manager sends
//! (subscriptions, ACKs, NACKs), state-of-the-world and Delta responses turned into
//! edits, and the SDS streams opened for secrets named by transport sockets.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::google::rpc::Status;
use tokio::sync::mpsc;

use super::apply::Refusal;
use super::resources::{Accepted, Edit, Resource};
use super::{INTERNAL, Manager};
use crate::source::Stream;
use crate::stream::{self, Outbound};
use crate::type_url::TypeUrl;
use crate::wire;
use envoy_types::pb::envoy::config::core::v3::ConfigSource;
use shunt_config::references::{SecretRef, SecretSource};

#[derive(Debug)]
pub(super) struct StreamState {
    pub(super) config: Stream,
    pub(super) requests: Option<mpsc::UnboundedSender<Outbound>>,
    pub(super) node_sent: bool,
}

/// The NACK's status, in Envoy's words for listeners and clusters: `Error
/// adding/updating listener(s) NAME: DETAILS\n...`, `Error adding/updating cluster(s)
/// NAME: DETAILS, ...`.
pub(super) fn nack_status(kind: TypeUrl, errors: &[(String, String)]) -> Status {
    let each = errors
        .iter()
        .map(|(name, details)| format!("{name}: {details}"));
    let message = match kind {
        TypeUrl::Listener => format!(
            "Error adding/updating listener(s) {}",
            each.map(|e| e + "\n").collect::<String>()
        ),
        TypeUrl::Cluster => format!(
            "Error adding/updating cluster(s) {}",
            each.collect::<Vec<_>>().join(", ")
        ),
        _ => format!(
            "{} update rejected: {}",
            kind.short().to_uppercase(),
            errors
                .iter()
                .map(|(_, e)| e.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        ),
    };
    Status {
        code: INTERNAL,
        message,
        details: Vec::new(),
    }
}

impl Manager {
    /// The stream carrying `kind`.
    pub(super) fn stream_of(&self, kind: TypeUrl) -> Option<usize> {
        self.streams
            .iter()
            .position(|s| s.config.types.contains(&kind))
    }

    /// Sends `request` on the stream carrying `kind`. CDS requests on an ADS stream
    /// wait while clusters warm, as Envoy's cluster manager pauses CDS on the ADS mux
    /// until no cluster is warming: the CDS ACK tells the control plane the clusters are
    /// ready, so the routes it pushes next never name a cluster not yet served.
    pub(super) fn send(&mut self, kind: TypeUrl, request: Outbound) {
        let Some(index) = self.stream_of(kind) else {
            return;
        };
        let ads = self.streams[index].config.types.len() > 1;
        if kind == TypeUrl::Cluster && ads && self.warming_count > 0 {
            // Only the latest matters: it echoes the latest nonce.
            self.paused_cds = Some(request);
            return;
        }
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

    pub(super) fn is_delta(&self, kind: TypeUrl) -> bool {
        self.stream_of(kind)
            .is_some_and(|i| self.streams[i].config.delta)
    }

    /// Whether `kind` should be asked for now.
    pub(super) fn wanted(&self, kind: TypeUrl) -> bool {
        match kind {
            // istio-proxy subscribes to workloads as soon as the server starts.
            TypeUrl::Cluster | TypeUrl::Workload => true,
            // istio-agent asks for the name table once Envoy asked for listeners.
            TypeUrl::Listener | TypeUrl::NameTable => self.listeners_requested,
            _ => self.types.get(&kind).is_some_and(|t| !t.names.is_empty()),
        }
    }

    /// Sends the first request of each wanted type not yet asked for on its stream:
    /// with what is held (SotW's version, Delta's `initial_resource_versions`) so that
    /// a reconnect does not make the server resend what did not change.
    pub(super) fn subscribe_all(&mut self) {
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
                state.names.iter().map(|n| n.to_string()).collect()
            };
            let request = if self.is_delta(kind) {
                Outbound::Delta(DeltaDiscoveryRequest {
                    type_url: kind.as_str().into(),
                    resource_names_subscribe: names,
                    initial_resource_versions: state
                        .resources
                        .iter()
                        .map(|(name, entry)| (name.to_string(), entry.version.to_string()))
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
    pub(super) fn received(&mut self, type_url: &str, nonce: &str) -> Option<TypeUrl> {
        let Some(kind) = TypeUrl::parse(type_url) else {
            tracing::warn!(%type_url, "response of a type not asked for");
            return None;
        };
        let state = self.types.get_mut(&kind)?;
        state.nonce = nonce.to_owned();
        Some(kind)
    }

    pub(super) fn on_sotw(&mut self, _stream: usize, response: wire::DiscoveryResponse) {
        let Some(kind) = self.received(&response.type_url, &response.nonce) else {
            return;
        };
        let version = response.version_info.clone();
        // One version for every resource of the response.
        let shared: Arc<str> = version.as_str().into();
        let decoded: Result<Vec<Accepted>, (String, String)> = response
            .resources
            .into_iter()
            .map(|any| Accepted::new(kind, any, shared.clone()).map_err(|e| (String::new(), e)))
            .collect();
        let result = decoded.map_err(|e| vec![e]).and_then(|entries| {
            let state = &self.types[&kind];
            // A resource resent unchanged is not updated: it keeps its version and
            // `last_updated`, as in Envoy. A name given twice: the first counts, the
            // others are refused (Envoy's "duplicate listener NAME found").
            let mut refused = Vec::new();
            let mut seen = std::collections::HashSet::new();
            let mut unique = Vec::new();
            for entry in entries {
                // The resource's own name, shared: no copy per pod.
                let name = entry.resource.key();
                if kind.is_wildcard() && !seen.insert(name.clone()) {
                    refused.push(Refusal {
                        details: format!("duplicate {} {name} found", kind.noun()),
                        config: entry.resource.to_any(kind),
                        name: name.to_string(),
                    });
                    continue;
                }
                let entry = match state.resources.get(&name) {
                    Some(old) if old.digest == entry.digest => old.clone(),
                    _ => entry,
                };
                unique.push((name, entry));
            }
            let change = if kind.is_wildcard() {
                Edit::Replace(unique.into_iter().collect())
            } else {
                Edit::Patch {
                    upserts: unique,
                    removals: Vec::new(),
                }
            };
            self.apply(kind, change, &version, refused)
        });
        let state = &self.types[&kind];
        let mut request = DiscoveryRequest {
            type_url: kind.as_str().into(),
            response_nonce: response.nonce,
            resource_names: if kind.is_wildcard() {
                Vec::new()
            } else {
                state.names.iter().map(|n| n.to_string()).collect()
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

    pub(super) fn on_delta(&mut self, _stream: usize, response: wire::DeltaDiscoveryResponse) {
        let Some(kind) = self.received(&response.type_url, &response.nonce) else {
            return;
        };
        let version = response.system_version_info.clone();
        let mut upserts = Vec::new();
        let mut errors = Vec::new();
        for mut resource in response.resources {
            let Some(any) = resource.resource.take() else {
                continue;
            };
            match Accepted::new(kind, any, resource.version.as_str().into()) {
                Ok(entry) => {
                    let name = if resource.name.is_empty() || resource.name == entry.resource.name()
                    {
                        entry.resource.key()
                    } else {
                        resource.name.as_str().into()
                    };
                    upserts.push((name, entry));
                }
                Err(e) => errors.push((resource.name.clone(), e)),
            }
        }
        let change = Edit::Patch {
            upserts,
            removals: (response.removed_resources.iter())
                .map(|name| name.as_str().into())
                .collect(),
        };
        let result = if errors.is_empty() {
            self.apply(kind, change, &version, Vec::new())
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

    /// Updates named subscriptions (endpoints of EDS clusters, routes of listeners) and
    /// sends first requests of types that became wanted.
    /// `changed`: the type just updated (`None`: any); only clusters and listeners name
    /// what others subscribe to.
    pub(super) fn resubscribe(&mut self, changed: Option<TypeUrl>) {
        let mut wanted: HashMap<TypeUrl, BTreeSet<Arc<str>>> = HashMap::new();
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
                        Resource::Cluster(c) => c.eds_service().cloned(),
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
                        Resource::Listener(l) => {
                            Some(l.facts.rds_names.iter().map(|n| n.as_str().into()))
                        }
                        _ => None,
                    })
                    .flatten()
                    .collect(),
            );
        }
        if recompute(TypeUrl::Cluster) || recompute(TypeUrl::Listener) {
            let names = self.secret_names();
            wanted.insert(TypeUrl::Secret, names.into_iter().map(Into::into).collect());
        }
        for (kind, names) in wanted {
            let delta = self.is_delta(kind);
            let Some(state) = self.types.get_mut(&kind) else {
                continue;
            };
            if state.names == names {
                continue;
            }
            let added: Vec<String> = (names.difference(&state.names))
                .map(|n| n.to_string())
                .collect();
            let removed: Vec<String> = (state.names.difference(&names))
                .map(|n| n.to_string())
                .collect();
            state.names = names;
            // Unsubscribed resources are forgotten (Envoy drops them too).
            for name in &removed {
                state.resources.remove(name.as_str());
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
                    resource_names: state.names.iter().map(|n| n.to_string()).collect(),
                    ..Default::default()
                })
            };
            self.send(kind, request);
        }
        self.subscribe_all();
    }

    /// The secrets the accepted listeners and clusters name (but static ones). The first
    /// SDS source other than ADS gets a stream of its own.
    pub(super) fn secret_names(&mut self) -> BTreeSet<String> {
        let mut names = BTreeSet::new();
        let mut api_source: Option<&ConfigSource> = None;
        // Equal lists are one list process-wide (see `snapshot::Encoded`'s facts): Istio
        // names the same two secrets in every cluster, read once rather than per cluster.
        let mut read: HashSet<*const Vec<SecretRef>, foldhash::fast::FixedState> =
            HashSet::with_hasher(foldhash::fast::FixedState::with_seed(0));
        for kind in [TypeUrl::Listener, TypeUrl::Cluster] {
            let Some(state) = self.types.get(&kind) else {
                continue;
            };
            for entry in state.resources.values() {
                let refs = match &entry.resource {
                    Resource::Listener(l) => &l.facts.secrets,
                    Resource::Cluster(c) => &c.facts.secrets,
                    _ => continue,
                };
                if !read.insert(Arc::as_ptr(refs)) {
                    continue;
                }
                for secret in refs.iter() {
                    match &secret.source {
                        SecretSource::Static => continue,
                        SecretSource::Ads => {}
                        SecretSource::Api(source) => match api_source {
                            None => api_source = Some(source),
                            Some(first) if first != &**source => {
                                tracing::warn!(secret = %secret.name, "secrets from a second SDS source are not implemented: asking the first one");
                            }
                            Some(_) => {}
                        },
                    }
                    if !names.contains(&secret.name) {
                        names.insert(secret.name.clone());
                    }
                }
            }
        }
        let api_source = api_source.cloned();
        if let Some(source) = api_source {
            self.open_secret_stream(source);
        }
        names
    }

    /// Starts the stream of an SDS `api_config_source` (Istio's `sds-grpc` to the agent)
    /// and moves the secret subscription onto it.
    pub(super) fn open_secret_stream(
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
        let config = match crate::source::secret_stream(&source, &self.bootstrap) {
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
        tokio::spawn(stream::run(
            index,
            config,
            self.events_tx.clone(),
            self.plan.local.clone(),
            self.plan.channels.clone(),
        ));
    }
}
