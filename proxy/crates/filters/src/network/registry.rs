//! The network filters shunt implements before a terminal filter, by the type of their
//! config. To add one: write its module under `network/`, give it a
//! `pub const FACTORY: Factory`, list it in [`FACTORIES`], and add its type name to
//! `config::extensions::NETWORK_FILTERS` (a test checks the two agree). `tcp_proxy` and
//! the HTTP connection manager are the terminal filters; the listener compiles them.

/// What the registry holds, for the listener's compiler that looks a filter up.
pub use super::factory::{CompileCtx, CompileFn, Factory};

/// Every non-terminal network filter.
pub static FACTORIES: &[&Factory] = &[
    &super::filter::rbac::FACTORY,
    &super::filter::istio_authn::FACTORY,
    &super::filter::metadata_exchange::FACTORY,
    &super::filter::istio_stats::FACTORY,
    &super::filter::set_filter_state::FACTORY,
    &super::filter::ext_authz::FACTORY,
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
