//! What several filters share, network and HTTP alike (Envoy's `filters/common/`): the
//! RBAC engine ([`rbac`]), the request matchers ([`matcher`]), the external
//! authorization client ([`ext_authz`]), the rate limit service client and descriptors
//! ([`ratelimit`]), the fractional percentages filters are enabled by ([`percent`]),
//! the compression libraries and the streaming body transform they make
//! ([`compression`]). Nothing here imports `http` or `network`.

pub mod access_log;
pub mod compression;
pub mod ext_authz;
pub mod matcher;
pub mod percent;
pub mod ratelimit;
pub mod rbac;
pub mod token_bucket;
