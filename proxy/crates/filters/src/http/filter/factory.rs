//! What an HTTP filter gives the [`super::registry`]: the type names of its configs
//! and their compilers ([`Factory`]), and what compiling may read besides the config
//! ([`CompileCtx`]). Each filter defines its `FACTORY` with these types; only the
//! registry lists the filters.

use std::sync::Arc;

use envoy_types::pb::google::protobuf::Any;

use super::{HttpFilterConfig, RouteSpecificConfig};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::peer::LocalNode;
use shunt_core::stats::Store;
use shunt_upstream::Clusters;

/// What compiling a filter may need besides its config.
pub struct CompileCtx<'a> {
    /// The filter's `name` in `http_filters` (keys `typed_per_filter_config`).
    pub name: &'a str,
    /// The connection manager's `stat_prefix`: filter stats are
    /// `http.<stat_prefix>.<filter's prefix>...`.
    pub stat_prefix: &'a str,
    pub stats: &'a Store,
    /// The clusters known when the listener is compiled.
    pub clusters: &'a Clusters,
    /// The proxy instance's node (what peer metadata sends, what Istio's stats label
    /// with).
    pub node: &'a Arc<LocalNode>,
    /// The listener's `traffic_direction`: `Some(true)` INBOUND, `Some(false)` OUTBOUND.
    pub inbound: Option<bool>,
}

pub type CompileFn =
    fn(&Any, &CompileCtx<'_>, &JsonPath, &mut Diagnostics) -> Option<Arc<dyn HttpFilterConfig>>;

pub type CompilePerRouteFn =
    fn(&Any, &JsonPath, &mut Diagnostics) -> Option<Arc<dyn RouteSpecificConfig>>;

/// One HTTP filter shunt implements.
pub struct Factory {
    /// The type name of its `typed_config` (`envoy.extensions.filters.http.rbac.v3.RBAC`).
    pub type_name: &'static str,
    /// Compiles `typed_config` (already unwrapped from a `TypedStruct`) at the path.
    pub compile: CompileFn,
    /// The type names its per-route configs come as (`...RBACPerRoute`), and their
    /// compiler.
    pub per_route_types: &'static [&'static str],
    pub compile_per_route: Option<CompilePerRouteFn>,
}
