//! The HTTP filters shunt implements, by the type of their config, as Envoy finds its
//! filter factories. To add a filter: write its module under `http/filter/<name>`, give
//! it a `pub const FACTORY: Factory` ([`super::factory`]) and list it in [`FACTORIES`].
//! This list is the one list: config validation's set of implemented HTTP filters is
//! read from it ([`type_names`], [`per_route_type_names`]).

/// What the registry holds, for the compilers that look a filter up.
pub use super::factory::{CompileCtx, CompileFn, CompilePerRouteFn, Factory};

/// Every HTTP filter but the router (which the connection manager runs itself).
pub static FACTORIES: &[&Factory] = &[
    &super::rbac::FACTORY,
    &super::fault::filter::FACTORY,
    &super::cors::filter::FACTORY,
    &super::ext_authz::filter::FACTORY,
    &super::peer_metadata::FACTORY,
    &super::istio_stats::FACTORY,
    &super::grpc_stats::filter::FACTORY,
    &super::set_filter_state::FACTORY,
    &super::connect_authority::FACTORY,
    &super::connect_baggage::FACTORY,
    &super::alpn::FACTORY,
    &super::compressor::filter::FACTORY,
    &super::decompressor::FACTORY,
    &super::jwt_authn::filter::FACTORY,
    &super::local_ratelimit::FACTORY,
    &super::ratelimit::filter::FACTORY,
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

/// The config types of every filter here (the router, which the connection manager
/// runs itself, is not one of them).
pub fn type_names() -> impl Iterator<Item = &'static str> {
    FACTORIES.iter().map(|f| f.type_name)
}

/// The per-route config types the filters here compile.
pub fn per_route_type_names() -> impl Iterator<Item = &'static str> {
    FACTORIES
        .iter()
        .flat_map(|f| f.per_route_types.iter().copied())
}
