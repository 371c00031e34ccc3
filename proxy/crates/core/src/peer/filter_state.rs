//! Where a discovered peer lives for the filters after the one that found it: the filter
//! state objects istio-proxy's metadata exchange filters (TCP and HTTP) write and its
//! stats filter reads, under the same names (`wasm.downstream_peer`, `..._id`,
//! `wasm.upstream_peer`, `..._id`).

use std::any::Any;
use std::sync::Arc;

use super::Workload;
use crate::stream_info::{FilterState, FilterStateObject, LifeSpan, StringAccessor};

pub const DOWNSTREAM_PEER: &str = "wasm.downstream_peer";
pub const DOWNSTREAM_PEER_ID: &str = "wasm.downstream_peer_id";
pub const UPSTREAM_PEER: &str = "wasm.upstream_peer";
pub const UPSTREAM_PEER_ID: &str = "wasm.upstream_peer_id";
/// The peer id istio-proxy records when the peer had no exchange to offer (wrong ALPN,
/// bad magic): the stats then report at once with the peer unknown.
pub const PEER_UNKNOWN: &str = "envoy.wasm.metadata_exchange.peer_unknown";

/// Which side of the proxy a peer is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Downstream,
    Upstream,
}

impl Side {
    pub fn peer_key(self) -> &'static str {
        match self {
            Side::Downstream => DOWNSTREAM_PEER,
            Side::Upstream => UPSTREAM_PEER,
        }
    }

    pub fn id_key(self) -> &'static str {
        match self {
            Side::Downstream => DOWNSTREAM_PEER_ID,
            Side::Upstream => UPSTREAM_PEER_ID,
        }
    }
}

/// A peer workload as a filter state object. Its string form is its baggage, which is
/// what a `filter_state` matcher or access log reading it gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerInfo(pub Workload);

impl FilterStateObject for PeerInfo {
    fn serialize_as_string(&self) -> Option<String> {
        Some(self.0.baggage())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Records a discovered peer (and its id) on `side`, unless one is there already: the
/// first discovery wins, as in istio-proxy.
pub fn set_peer(
    state: &mut FilterState,
    side: Side,
    peer: Workload,
    id: &str,
    life_span: LifeSpan,
) {
    if state.get(side.peer_key()).is_none() {
        let _ = state.set(side.peer_key(), Arc::new(PeerInfo(peer)), false, life_span);
    }
    if state.get(side.id_key()).is_none() {
        let _ = state.set(
            side.id_key(),
            Arc::new(StringAccessor(id.to_owned())),
            false,
            life_span,
        );
    }
}

/// Records that the peer on `side` offered no metadata.
pub fn set_unknown(state: &mut FilterState, side: Side, life_span: LifeSpan) {
    if state.get(side.id_key()).is_none() {
        let _ = state.set(
            side.id_key(),
            Arc::new(StringAccessor(PEER_UNKNOWN.to_owned())),
            false,
            life_span,
        );
    }
}

/// The peer on `side`, if one was discovered.
pub fn peer(state: &FilterState, side: Side) -> Option<&Workload> {
    state.get_as::<PeerInfo>(side.peer_key()).map(|p| &p.0)
}

/// Whether discovery on `side` is over (a peer, or the knowledge that there is none).
pub fn peer_read(state: &FilterState, side: Side) -> bool {
    state.get(side.id_key()).is_some() || state.get(PEER_UNKNOWN).is_some()
}
