//! What a network filter gives the [`super::registry`]: the type name of its config
//! and its compiler ([`Factory`]), and what compiling may read besides the config
//! ([`CompileCtx`]). Each filter defines its `FACTORY` with these types; only the
//! registry lists the filters.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use super::NetworkFilterConfig;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::peer::LocalNode;
use shunt_core::stats::Store;
use shunt_upstream::Clusters;

/// What compiling a network filter may need besides its config.
pub struct CompileCtx<'a> {
    /// The filter's `name` in the chain.
    pub name: &'a str,
    pub stats: &'a Store,
    pub clusters: &'a Clusters,
    /// The proxy instance's node (what metadata exchange sends, what Istio's stats
    /// label with).
    pub node: &'a Arc<LocalNode>,
    /// The listener's `traffic_direction`: `Some(true)` INBOUND, `Some(false)` OUTBOUND.
    pub inbound: Option<bool>,
}

pub type CompileFn =
    fn(&Any, &CompileCtx<'_>, &JsonPath, &mut Diagnostics) -> Option<Arc<dyn NetworkFilterConfig>>;

pub struct Factory {
    /// The type name of its `typed_config`.
    pub type_name: &'static str,
    /// Compiles `typed_config` (already unwrapped from a `TypedStruct`) at the path.
    pub compile: CompileFn,
}
