//! Envoy's external authorization filter (`envoy.filters.http.ext_authz`), as Istio's
//! CUSTOM AuthorizationPolicy uses it: the config compiled (`ExtAuthz`,
//! `ExtAuthzPerRoute`) and the filter on a stream ([`filter`]). The client it shares
//! with the network filter is [`crate::common::ext_authz`]: the `CheckRequest` built
//! from a request, the call to the authorization service over the cluster's own HTTP/2
//! pool, so every check of a filter config shares the connections to that cluster, and
//! what its answer means for the request.

use std::collections::HashMap;

use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::{
    BufferSettings, ExtAuthz, ExtAuthzPerRoute, ext_authz::Services, ext_authz_per_route::Override,
};
use envoy_types::pb::envoy::r#type::matcher::v3::MetadataMatcher;

use crate::common::ext_authz::{DEFAULT_TIMEOUT, Service, grpc_service};
use crate::common::percent::Percent;
use shunt_config::{Diagnostics, JsonPath, convert};

pub mod filter;
#[cfg(test)]
mod tests;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz";
pub const PER_ROUTE_TYPE_NAME: &str = "envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute";

/// Added to the upstream request when a failed check was let through.
pub const FAILURE_MODE_ALLOWED_HEADER: &str = "x-envoy-auth-failure-mode-allowed";
/// Tells the authorization service whether the body it got is the whole body.
pub const PARTIAL_BODY_HEADER: &str = "x-envoy-auth-partial-body";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodySettings {
    pub max_request_bytes: usize,
    pub allow_partial_message: bool,
    pub pack_as_bytes: bool,
}

fn body_settings(b: &BufferSettings) -> BodySettings {
    BodySettings {
        max_request_bytes: b.max_request_bytes as usize,
        allow_partial_message: b.allow_partial_message,
        pack_as_bytes: b.pack_as_bytes,
    }
}

/// `filter_enabled_metadata`: checks only run when the request's dynamic metadata
/// (another filter's, e.g. Istio's shadow RBAC policy id) matches.
#[derive(Debug)]
pub struct EnabledMetadata {
    pub filter: String,
    pub path: Vec<String>,
    pub value: crate::common::matcher::StringMatcher,
    pub invert: bool,
}

/// One compiled `ExtAuthz`.
#[derive(Debug)]
pub struct ExtAuthzConfig {
    pub service: Service,
    pub failure_mode_allow: bool,
    pub failure_mode_allow_header_add: bool,
    pub with_request_body: Option<BodySettings>,
    /// The status of the local reply when the check fails (default 403).
    pub status_on_error: u16,
    pub include_peer_certificate: bool,
    /// `None`: always enabled.
    pub filter_enabled: Option<Percent>,
    pub filter_enabled_metadata: Option<EnabledMetadata>,
    /// Deny (status_on_error... as Envoy: 403) when `filter_enabled` says off.
    pub deny_at_disable: bool,
    /// `ext_authz.<stat_prefix>.` when set.
    pub stat_prefix: String,
}

/// A route's `ExtAuthzPerRoute`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PerRoute {
    pub disabled: bool,
    pub context_extensions: HashMap<String, String>,
    pub disable_request_body_buffering: bool,
    pub with_request_body: Option<BodySettings>,
}

/// Compiles an `ExtAuthz`. `path`: its JSON path.
pub fn compile(
    config: &ExtAuthz,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ExtAuthzConfig> {
    let service = match &config.services {
        Some(Services::GrpcService(g)) => grpc_service(g, &path.field("grpc_service"), problems)?,
        Some(Services::HttpService(h)) => {
            let h_path = path.field("http_service");
            let Some(uri) = &h.server_uri else {
                problems.error(h_path.field("server_uri"), "is required");
                return None;
            };
            let timeout = match &uri.timeout {
                Some(t) => {
                    convert::duration(t, &h_path.field("server_uri").field("timeout"), problems)?
                }
                None => DEFAULT_TIMEOUT,
            };
            let cluster = match &uri.http_upstream_type {
                Some(
                    envoy_types::pb::envoy::config::core::v3::http_uri::HttpUpstreamType::Cluster(
                        c,
                    ),
                ) => c.clone(),
                None => {
                    problems.error(h_path.field("server_uri").field("cluster"), "is required");
                    return None;
                }
            };
            let authority = uri
                .uri
                .split_once("://")
                .map_or(uri.uri.as_str(), |(_, rest)| rest)
                .split('/')
                .next()
                .unwrap_or("")
                .to_owned();
            if h.authorization_request.is_some() || h.authorization_response.is_some() {
                problems.warning(
                    h_path.field("authorization_request"),
                    "the HTTP service's header allow lists are not implemented: every request header goes to the service, none of an allowing answer's headers go upstream, every header of a denying answer goes downstream",
                );
            }
            Service::Http {
                cluster,
                authority,
                path_prefix: h.path_prefix.clone(),
                timeout,
            }
        }
        None => {
            problems.error(path, "ext_authz needs grpc_service or http_service");
            return None;
        }
    };
    let status_on_error = match config.status_on_error.as_ref().map(|s| s.code) {
        None | Some(0) => 403,
        Some(code) if (200..600).contains(&code) => code as u16,
        Some(code) => {
            problems.error(
                path.field("status_on_error").field("code"),
                format!("{code} is not an HTTP status"),
            );
            return None;
        }
    };
    let filter_enabled_metadata = match &config.filter_enabled_metadata {
        Some(m) => Some(enabled_metadata(
            m,
            &path.field("filter_enabled_metadata"),
            problems,
        )?),
        None => None,
    };
    Some(ExtAuthzConfig {
        service,
        failure_mode_allow: config.failure_mode_allow,
        failure_mode_allow_header_add: config.failure_mode_allow_header_add,
        with_request_body: config.with_request_body.as_ref().map(body_settings),
        status_on_error,
        include_peer_certificate: config.include_peer_certificate,
        filter_enabled: config
            .filter_enabled
            .as_ref()
            .map(|f| Percent::from_proto(f.default_value.as_ref())),
        filter_enabled_metadata,
        deny_at_disable: config
            .deny_at_disable
            .as_ref()
            .and_then(|d| d.default_value)
            .is_some_and(|b| b.value),
        stat_prefix: config.stat_prefix.clone(),
    })
}

fn enabled_metadata(
    m: &MetadataMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<EnabledMetadata> {
    use envoy_types::pb::envoy::r#type::matcher::v3::{
        metadata_matcher::path_segment::Segment, value_matcher::MatchPattern,
    };
    let keys = m
        .path
        .iter()
        .map(|s| match &s.segment {
            Some(Segment::Key(k)) => k.clone(),
            None => String::new(),
        })
        .collect();
    let value = match m.value.as_ref().and_then(|v| v.match_pattern.as_ref()) {
        Some(MatchPattern::StringMatch(s)) => crate::common::matcher::string_matcher(
            s,
            &path.field("value").field("string_match"),
            problems,
        )?,
        _ => {
            problems.error(
                path.field("value"),
                "only string_match values are implemented for filter_enabled_metadata",
            );
            return None;
        }
    };
    Some(EnabledMetadata {
        filter: m.filter.clone(),
        path: keys,
        value,
        invert: m.invert,
    })
}

/// Compiles an `ExtAuthzPerRoute`.
pub fn compile_per_route(
    config: &ExtAuthzPerRoute,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<PerRoute> {
    match &config.r#override {
        Some(Override::Disabled(true)) => Some(PerRoute {
            disabled: true,
            ..PerRoute::default()
        }),
        Some(Override::Disabled(false)) => {
            problems.error(path.field("disabled"), "may only be true");
            None
        }
        Some(Override::CheckSettings(c)) => {
            if c.service_override.is_some() {
                problems.error(
                    path.field("check_settings").field("service_override"),
                    "per-route service overrides are not implemented",
                );
                return None;
            }
            Some(PerRoute {
                disabled: false,
                context_extensions: c.context_extensions.clone(),
                disable_request_body_buffering: c.disable_request_body_buffering,
                with_request_body: c.with_request_body.as_ref().map(body_settings),
            })
        }
        None => {
            problems.error(path, "ExtAuthzPerRoute needs disabled or check_settings");
            None
        }
    }
}
