//! The network filters shunt implements before a terminal filter, by the type of their
//! config. To add one: write its module under `network/filter/<name>`, give it a
//! `pub const FACTORY: Factory` ([`super::factory`]) and list it in [`FACTORIES`]. This
//! list is the one list: config validation's set of implemented network filters is
//! read from it ([`type_names`]). `tcp_proxy` and the HTTP connection manager are the
//! terminal filters; the listener compiles them.

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
    &super::filter::local_ratelimit::FACTORY,
    &super::filter::ratelimit::FACTORY,
];

pub fn find(type_name: &str) -> Option<&'static Factory> {
    FACTORIES.iter().copied().find(|f| f.type_name == type_name)
}

/// The config types of every filter here (not the terminal ones).
pub fn type_names() -> impl Iterator<Item = &'static str> {
    FACTORIES.iter().map(|f| f.type_name)
}
