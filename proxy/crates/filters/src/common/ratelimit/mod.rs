//! What the HTTP and network rate limit filters share (Envoy's
//! `filters/common/ratelimit/`): the descriptors they send ([`Descriptor`]), where the
//! rate limit service is ([`Service`], from a `RateLimitServiceConfig`), the
//! `RateLimitService/ShouldRateLimit` call and what its answer means ([`client`]).

pub mod client;

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::ApiVersion;
use envoy_types::pb::envoy::config::ratelimit::v3::RateLimitServiceConfig;
use shunt_config::{Diagnostics, JsonPath, convert};

use super::ext_authz;

/// Envoy's default timeout of the rate limit call (the filters' `timeout` unset).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(20);

/// One descriptor: its entries in the order the actions (or the config) gave them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: String,
}

impl Entry {
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Entry {
        Entry {
            key: key.into(),
            value: value.into(),
        }
    }
}

/// Where `ShouldRateLimit` calls go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub cluster: String,
    /// `:authority` of the calls (`envoy_grpc.authority`, else the cluster name).
    pub authority: String,
    /// `None`: no timeout (configured as 0).
    pub timeout: Option<Duration>,
}

/// A filter's `rate_limit_service` and `timeout`. Envoy requires the V3 transport.
pub fn service(
    config: Option<&RateLimitServiceConfig>,
    timeout: Option<&envoy_types::pb::google::protobuf::Duration>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Service> {
    let s_path = path.field("rate_limit_service");
    let Some(config) = config else {
        problems.error(s_path, "is required");
        return None;
    };
    if config.transport_api_version != ApiVersion::V3 as i32 {
        problems.error(
            s_path.field("transport_api_version"),
            "must be V3 (the V2 and AUTO transports are gone from Envoy)",
        );
        return None;
    }
    let Some(grpc) = &config.grpc_service else {
        problems.error(s_path.field("grpc_service"), "is required");
        return None;
    };
    let ext_authz::Service::Grpc {
        cluster, authority, ..
    } = ext_authz::grpc_service(grpc, &s_path.field("grpc_service"), problems)?
    else {
        problems.error(s_path.field("grpc_service"), "must name a cluster");
        return None;
    };
    let timeout = match timeout {
        None => Some(DEFAULT_TIMEOUT),
        Some(t) => {
            let t = convert::duration(t, &path.field("timeout"), problems)?;
            (!t.is_zero()).then_some(t)
        }
    };
    Some(Service {
        cluster,
        authority,
        timeout,
    })
}
