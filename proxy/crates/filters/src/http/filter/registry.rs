//! The HTTP filters shunt implements, by the type of their config, as Envoy finds its
//! filter factories. To add a filter: write its module under `http/filter/`, give it a
//! `pub const FACTORY: Factory`, list it in [`FACTORIES`], and add its type name to
//! `config::extensions::HTTP_FILTERS` (a test checks the two agree).

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
