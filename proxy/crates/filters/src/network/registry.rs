//! The network filters shunt implements before a terminal filter, by the type of their
//! config. To add one: write its module under `network/`, give it a
//! `pub const FACTORY: Factory`, list it in [`FACTORIES`], and add its type name to
//! `config::extensions::NETWORK_FILTERS` (a test checks the two agree). `tcp_proxy` and
//! the HTTP connection manager are the terminal filters; the listener compiles them.

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

/// Every non-terminal network filter.
pub static FACTORIES: &[&Factory] = &[
    &super::rbac::FACTORY,
    &super::istio_authn::FACTORY,
    &super::metadata_exchange::FACTORY,
    &super::istio_stats::FACTORY,
    &super::set_filter_state::FACTORY,
    &super::ext_authz::FACTORY,
];

pub fn find(type_name: &str) -> Option<&'static Factory> {
    FACTORIES.iter().copied().find(|f| f.type_name == type_name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_factory_is_listed_as_implemented() {
        for factory in FACTORIES {
            assert!(
                shunt_config::extensions::NETWORK_FILTERS.contains(&factory.type_name),
                "{} is missing from config::extensions::NETWORK_FILTERS",
                factory.type_name
            );
        }
    }
}
