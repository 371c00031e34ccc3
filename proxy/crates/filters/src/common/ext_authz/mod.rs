//! The external authorization client the HTTP and network ext_authz filters share
//! (Envoy's `filters/common/ext_authz/`): where checks go ([`Service`], from a
//! `GrpcService`), the `CheckRequest` built from a connection or a request and what an
//! answer means ([`check`]), and the calls to the authorization service over the
//! service cluster's own connection pools ([`grpc`]).

pub mod check;
pub mod grpc;

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::grpc_service::TargetSpecifier;
use shunt_config::{Diagnostics, JsonPath, convert};

/// Envoy's default check timeout (`GrpcService.timeout` / `server_uri.timeout` unset).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(200);

/// Where checks go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Service {
    /// `envoy.service.auth.v3.Authorization/Check` on `cluster`.
    Grpc {
        cluster: String,
        /// `:authority` of the calls (`envoy_grpc.authority`, else the cluster name).
        authority: String,
        timeout: Duration,
    },
    /// Envoy's raw HTTP mode: the request's headers (no body) to `cluster`,
    /// `path_prefix` + the request's path; 200 allows.
    Http {
        cluster: String,
        /// `server_uri.uri`'s authority.
        authority: String,
        path_prefix: String,
        timeout: Duration,
    },
}

impl Service {
    pub fn cluster(&self) -> &str {
        match self {
            Service::Grpc { cluster, .. } | Service::Http { cluster, .. } => cluster,
        }
    }
}

pub fn grpc_service(
    g: &envoy_types::pb::envoy::config::core::v3::GrpcService,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Service> {
    let timeout = match &g.timeout {
        Some(t) => convert::duration(t, &path.field("timeout"), problems)?,
        None => DEFAULT_TIMEOUT,
    };
    match &g.target_specifier {
        Some(TargetSpecifier::EnvoyGrpc(e)) if !e.cluster_name.is_empty() => Some(Service::Grpc {
            cluster: e.cluster_name.clone(),
            authority: if e.authority.is_empty() {
                e.cluster_name.clone()
            } else {
                e.authority.clone()
            },
            timeout,
        }),
        Some(TargetSpecifier::EnvoyGrpc(_)) => {
            problems.error(format!("{path}.envoy_grpc.cluster_name"), "is required");
            None
        }
        Some(TargetSpecifier::GoogleGrpc(_)) => {
            problems.error(
                path.field("google_grpc"),
                "google_grpc is not implemented; use envoy_grpc with a cluster",
            );
            None
        }
        None => {
            problems.error(path, "a gRPC service needs envoy_grpc");
            None
        }
    }
}
