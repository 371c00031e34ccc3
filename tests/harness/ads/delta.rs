//! Incremental (Delta) subscriptions of one DeltaAggregatedResources stream.

use super::state::Nonces;
use super::store::Store;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Default)]
pub(crate) struct DeltaStream {
    subs: HashMap<String, Sub>,
}

#[derive(Debug, Default)]
struct Sub {
    wildcard: bool,
    names: BTreeSet<String>,
    /// What the client holds, name to version: its initial_resource_versions, then
    /// updated with every response. Diffing against it is what makes this Delta.
    known: HashMap<String, String>,
    /// A wildcard client waits for a first response, even an empty one, to finish
    /// initialising.
    responded: bool,
}

impl DeltaStream {
    pub fn on_request(
        &mut self,
        store: &Store,
        nonces: &mut Nonces,
        req: &DeltaDiscoveryRequest,
    ) -> Option<DeltaDiscoveryResponse> {
        let sub = self
            .subs
            .entry(req.type_url.clone())
            .or_insert_with(|| Sub {
                wildcard: req.resource_names_subscribe.is_empty(),
                // Only the first request of a type carries them (the spec says later
                // ones are ignored).
                known: req.initial_resource_versions.clone(),
                ..Default::default()
            });
        // Subscription changes are diffs, so apply them even when the request's nonce
        // is stale (unlike SotW, where the next request repeats the whole set).
        for name in &req.resource_names_subscribe {
            if name == "*" {
                sub.wildcard = true;
            } else {
                sub.names.insert(name.clone());
            }
        }
        for name in &req.resource_names_unsubscribe {
            if name == "*" {
                sub.wildcard = false;
            } else {
                sub.names.remove(name);
                // The client drops it; under a wildcard it still wants it, though.
                if !sub.wildcard {
                    sub.known.remove(name);
                }
            }
        }
        respond(sub, store, nonces, &req.type_url)
    }

    pub fn on_set(
        &mut self,
        store: &Store,
        nonces: &mut Nonces,
        type_url: &str,
    ) -> Option<DeltaDiscoveryResponse> {
        let sub = self.subs.get_mut(type_url)?;
        respond(sub, store, nonces, type_url)
    }
}

/// What the client lacks: subscribed resources whose version differs from what it
/// holds, and subscribed names it holds that no longer exist. Nothing to send means no
/// response, except a wildcard's first.
fn respond(
    sub: &mut Sub,
    store: &Store,
    nonces: &mut Nonces,
    type_url: &str,
) -> Option<DeltaDiscoveryResponse> {
    let ts = store.get(type_url)?;
    let in_scope = |name: &str| sub.wildcard || sub.names.contains(name);
    let resources: Vec<Resource> = ts
        .resources
        .iter()
        .filter(|(name, r)| in_scope(name) && sub.known.get(*name) != Some(&r.version))
        .map(|(name, r)| Resource {
            name: name.clone(),
            version: r.version.clone(),
            resource: Some(r.any.clone()),
            ..Default::default()
        })
        .collect();
    let mut removed: Vec<String> = sub
        .known
        .keys()
        .filter(|name| in_scope(name) && !ts.resources.contains_key(*name))
        .cloned()
        .collect();
    removed.sort();
    if resources.is_empty() && removed.is_empty() && (sub.responded || !sub.wildcard) {
        return None;
    }
    for r in &resources {
        sub.known.insert(r.name.clone(), r.version.clone());
    }
    for name in &removed {
        sub.known.remove(name);
    }
    sub.responded = true;
    Some(DeltaDiscoveryResponse {
        system_version_info: ts.version.clone(),
        resources,
        type_url: type_url.to_owned(),
        removed_resources: removed,
        nonce: nonces.next(),
        ..Default::default()
    })
}
