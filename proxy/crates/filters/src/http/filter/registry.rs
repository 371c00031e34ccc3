//! The HTTP filters shunt implements, by the type of their config, as Envoy finds its
//! filter factories. To add a filter: write its module under `http/filter/`, give it a
//! `pub const FACTORY: Factory`, list it in [`FACTORIES`], and add its type name to
//! `config::extensions::HTTP_FILTERS` (a test checks the two agree).

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

/// Every HTTP filter but the router (which the connection manager runs itself).
pub static FACTORIES: &[&Factory] = &[
    &super::rbac::FACTORY,
    &crate::http::fault::filter::FACTORY,
    &crate::http::cors::filter::FACTORY,
    &crate::http::ext_authz::filter::FACTORY,
    &super::peer_metadata::FACTORY,
    &super::istio_stats::FACTORY,
    &crate::http::grpc_stats::filter::FACTORY,
    &crate::http::set_filter_state::FACTORY,
    &crate::http::connect_authority::FACTORY,
    &crate::http::connect_baggage::FACTORY,
    &crate::http::alpn::FACTORY,
];

pub fn find(type_name: &str) -> Option<&'static Factory> {
    FACTORIES.iter().copied().find(|f| f.type_name == type_name)
}

pub fn find_per_route(type_name: &str) -> Option<CompilePerRouteFn> {
    FACTORIES
        .iter()
        .find(|f| f.per_route_types.contains(&type_name))
        .and_then(|f| f.compile_per_route)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_factory_is_listed_as_implemented() {
        for factory in FACTORIES {
            assert!(
                shunt_config::extensions::HTTP_FILTERS.contains(&factory.type_name),
                "{} is missing from config::extensions::HTTP_FILTERS",
                factory.type_name
            );
        }
    }
}
