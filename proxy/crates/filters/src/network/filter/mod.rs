//! The network filters shunt implements, one module each, named as Envoy's
//! (`envoy.filters.network.<name>`) or Istio's (`istio_authn`, `metadata_exchange`,
//! `istio_stats`). Each gives [`super::registry`] its `FACTORY`.

pub mod ext_authz;
pub mod istio_authn;
pub mod istio_stats;
pub mod local_ratelimit;
pub mod metadata_exchange;
pub mod ratelimit;
pub mod rbac;
pub mod set_filter_state;
