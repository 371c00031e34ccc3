//! State-of-the-world subscriptions of one StreamAggregatedResources stream.

use super::state::Nonces;
use super::store::Store;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use std::collections::{BTreeSet, HashMap};

#[derive(Debug, Default)]
pub(crate) struct SotwStream {
    subs: HashMap<String, Sub>,
}

#[derive(Debug)]
struct Sub {
    /// The first request named nothing: later empty requests keep the wildcard (the
    /// legacy wildcard of the xDS spec), while for a named subscription an empty list
    /// means "nothing".
    legacy_wildcard: bool,
    wildcard: bool,
    names: BTreeSet<String>,
    /// The latest nonce sent for this type; a request carrying an older one is stale.
    nonce: Option<String>,
}

/// A response to send, with the names of its resources (an `Any` carries none).
pub(crate) type Reply = (DiscoveryResponse, Vec<String>);

impl SotwStream {
    pub fn on_request(
        &mut self,
        store: &Store,
        nonces: &mut Nonces,
        req: &DiscoveryRequest,
    ) -> Option<Reply> {
        let mut names: BTreeSet<String> = req.resource_names.iter().cloned().collect();
        let star = names.remove("*");
        let sub = match self.subs.get_mut(&req.type_url) {
            // The first request of a type opens the subscription whatever nonce it
            // carries (a client reconnecting may still send the old server's).
            None => {
                let legacy_wildcard = names.is_empty() && !star;
                self.subs.entry(req.type_url.clone()).or_insert(Sub {
                    legacy_wildcard,
                    wildcard: legacy_wildcard || star,
                    names,
                    nonce: None,
                })
            }
            Some(sub) => {
                if !req.response_nonce.is_empty()
                    && sub.nonce.as_deref() != Some(req.response_nonce.as_str())
                {
                    // Stale: the client has not seen our latest response yet and
                    // will answer it; acting now would answer twice.
                    return None;
                }
                let wildcard = star || (names.is_empty() && sub.legacy_wildcard);
                if wildcard == sub.wildcard && names == sub.names {
                    // ACK or NACK of the current subscription.
                    return None;
                }
                sub.wildcard = wildcard;
                sub.names = names;
                sub
            }
        };
        respond(sub, store, nonces, &req.type_url)
    }

    /// The push after `type_url` was replaced in the store.
    pub fn on_set(&mut self, store: &Store, nonces: &mut Nonces, type_url: &str) -> Option<Reply> {
        let sub = self.subs.get_mut(type_url)?;
        respond(sub, store, nonces, type_url)
    }
}

/// The current state for a subscription: all resources for a wildcard, even none (the
/// client waits for a first response to finish initialising); for named ones only
/// those that exist, and nothing when none do (absence in SotW does not mean deletion
/// for named types, so an empty response would tell the client nothing).
fn respond(sub: &mut Sub, store: &Store, nonces: &mut Nonces, type_url: &str) -> Option<Reply> {
    let ts = store.get(type_url)?;
    let (names, resources): (Vec<String>, Vec<_>) = ts
        .resources
        .iter()
        .filter(|(name, _)| sub.wildcard || sub.names.contains(*name))
        .map(|(name, r)| (name.clone(), r.any.clone()))
        .unzip();
    if !sub.wildcard && names.is_empty() {
        return None;
    }
    let nonce = nonces.next();
    sub.nonce = Some(nonce.clone());
    let response = DiscoveryResponse {
        version_info: ts.version.clone(),
        resources,
        type_url: type_url.to_owned(),
        nonce,
        ..Default::default()
    };
    Some((response, names))
}
