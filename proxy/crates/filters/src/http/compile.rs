//! Compiling an `http_connection_manager` network filter's config into an
//! [`HttpConnectionManager`]: codec, routes (inline `route_config` or `rds`), the HTTP
//! filter chain (which must end in the router) and the settings the connection manager
//! honours. Errors go to `problems` at their JSON path.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager as EnvoyHcm,
    http_connection_manager::{
        CodecType, RouteSpecifier, ServerHeaderTransformation, StripPortMode,
    },
    http_filter::ConfigType,
};
use hyper::header::HeaderValue;

use super::config::{
    Codec, HttpConnectionManager, HttpStats, Limits, RouteSource, ServerHeader, StripHostPort,
    Underscores,
};
use super::filter::chain::{ConfiguredFilter, FilterChain};
use super::filter::registry;
use super::route::{Action, ClusterChoice, RouteConfig};
use shunt_config::convert::{decode, type_name};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::Store;

/// The router's config type: the last HTTP filter, which the connection manager runs.
pub const ROUTER: &str = "envoy.extensions.filters.http.router.v3.Router";

/// Compiles `hcm`; an inline route configuration's clusters must be among `clusters`.
pub fn compile(
    hcm: &EnvoyHcm,
    clusters: &shunt_upstream::Clusters,
    stats: &Store,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<HttpConnectionManager> {
    let env = Env::default();
    compile_in(hcm, clusters, stats, &env, path, problems)
}

/// What a connection manager's filters learn from where it sits: the proxy's node and
/// the listener's direction.
#[derive(Debug, Clone, Default)]
pub struct Env {
    pub node: std::sync::Arc<shunt_core::peer::LocalNode>,
    /// The listener's `traffic_direction`: `Some(true)` INBOUND, `Some(false)` OUTBOUND.
    pub inbound: Option<bool>,
}

impl Env {
    /// The proxy's `node` as a log service's identifier names it (its id).
    pub fn node_proto(&self) -> envoy_types::pb::envoy::config::core::v3::Node {
        envoy_types::pb::envoy::config::core::v3::Node {
            id: self.node.id.clone(),
            ..Default::default()
        }
    }
}

/// [`compile`] in a listener of `env`.
pub fn compile_in(
    hcm: &EnvoyHcm,
    clusters: &shunt_upstream::Clusters,
    stats: &Store,
    env: &Env,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<HttpConnectionManager> {
    let errors_before = problems.errors.len();
    if hcm.stat_prefix.is_empty() {
        problems.error(path.field("stat_prefix"), "is required");
    }
    let codec = match CodecType::try_from(hcm.codec_type) {
        Ok(CodecType::Auto) => Codec::Auto,
        Ok(CodecType::Http1) => Codec::Http1,
        Ok(CodecType::Http2) => Codec::Http2,
        _ => {
            problems.error(
                path.field("codec_type"),
                "only AUTO, HTTP1 and HTTP2 are implemented",
            );
            Codec::Auto
        }
    };
    let routes = match &hcm.route_specifier {
        Some(RouteSpecifier::RouteConfig(config)) => {
            let r_path = path.field("route_config");
            let compiled = super::route_config::compile(config, &r_path, problems);
            if let Some(compiled) = &compiled
                && config.validate_clusters.is_none_or(|b| b.value)
            {
                validate_clusters(compiled, clusters, &r_path, problems);
            }
            compiled.map(|config| RouteSource::Static(Arc::new(config)))
        }
        Some(RouteSpecifier::Rds(rds)) => {
            if rds.route_config_name.is_empty() {
                problems.error(path.field("rds").field("route_config_name"), "is required");
                None
            } else {
                Some(RouteSource::Rds(rds.route_config_name.clone()))
            }
        }
        Some(RouteSpecifier::ScopedRoutes(_)) => {
            problems.error(
                path.field("scoped_routes"),
                "scoped routes are not implemented yet",
            );
            None
        }
        None => {
            problems.error(path, "an http_connection_manager needs route_config or rds");
            None
        }
    };
    let (filters, suppress_envoy_headers) = http_filters(hcm, clusters, stats, env, path, problems);
    let server_name = if hcm.server_name.is_empty() {
        HeaderValue::from_static("envoy")
    } else {
        HeaderValue::from_str(&hcm.server_name).unwrap_or_else(|_| {
            problems.error(path.field("server_name"), "is not a valid header value");
            HeaderValue::from_static("envoy")
        })
    };
    let server_header = match ServerHeaderTransformation::try_from(hcm.server_header_transformation)
    {
        Ok(ServerHeaderTransformation::AppendIfAbsent) => ServerHeader::AppendIfAbsent,
        Ok(ServerHeaderTransformation::PassThrough) => ServerHeader::PassThrough,
        _ => ServerHeader::Overwrite,
    };
    let mut upgrades = Vec::new();
    for (i, upgrade) in hcm.upgrade_configs.iter().enumerate() {
        if !upgrade.filters.is_empty() {
            problems.error(
                path.field("upgrade_configs").index(i).field("filters"),
                "HTTP filters for upgrades are not implemented yet",
            );
        }
        if upgrade.enabled.is_none_or(|b| b.value) {
            upgrades.push(upgrade.upgrade_type.to_ascii_lowercase());
        }
    }
    let tracing = crate::tracers::compile(
        hcm,
        env.inbound == Some(false),
        &env.node,
        stats,
        path,
        problems,
    )
    .map(Arc::new);
    let path_normalization = {
        use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::http_connection_manager::PathWithEscapedSlashesAction as Action;
        use super::path_normalization::{EscapedSlashes, PathNormalization};
        PathNormalization {
            normalize_path: hcm.normalize_path.is_some_and(|b| b.value),
            merge_slashes: hcm.merge_slashes,
            escaped_slashes: match Action::try_from(hcm.path_with_escaped_slashes_action) {
                Ok(Action::RejectRequest) => EscapedSlashes::RejectRequest,
                Ok(Action::UnescapeAndRedirect) => EscapedSlashes::UnescapeAndRedirect,
                Ok(Action::UnescapeAndForward) => EscapedSlashes::UnescapeAndForward,
                _ => EscapedSlashes::KeepUnchanged,
            },
        }
    };
    for (field, set) in [
        ("local_reply_config", hcm.local_reply_config.is_some()),
        ("xff_num_trusted_hops", hcm.xff_num_trusted_hops > 0),
    ] {
        if set {
            problems.warning(path.field(field), "not implemented; ignored");
        }
    }
    let limits = limits(hcm, path, problems);
    let node = env.node_proto();
    let log_env = crate::common::access_log::Env {
        clusters,
        stats,
        node: &node,
    };
    let access_log = crate::common::access_log::compile(
        &hcm.access_log,
        log_env,
        &path.field("access_log"),
        problems,
    );
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(HttpConnectionManager {
        stat_prefix: hcm.stat_prefix.clone(),
        codec,
        routes: routes?,
        server_name,
        server_header,
        use_remote_address: hcm.use_remote_address.is_some_and(|b| b.value),
        strip_host_port: match hcm.strip_port_mode {
            Some(StripPortMode::StripAnyHostPort(true)) => StripHostPort::Any,
            _ if hcm.strip_matching_host_port => StripHostPort::Matching,
            _ => StripHostPort::Keep,
        },
        generate_request_id: hcm.generate_request_id.is_none_or(|b| b.value),
        upgrades,
        suppress_envoy_headers,
        path_normalization,
        filters,
        access_log,
        tracing,
        limits,
        stats: HttpStats::new(stats, &hcm.stat_prefix),
    })
}

/// The limits on what a downstream may send, Envoy's defaults where unset.
fn limits(hcm: &EnvoyHcm, path: &JsonPath, problems: &mut Diagnostics) -> Limits {
    use envoy_types::pb::envoy::config::core::v3::http_protocol_options::HeadersWithUnderscoresAction;
    let mut limits = Limits::default();
    if let Some(kb) = hcm.max_request_headers_kb {
        // Envoy's validation: 0 < kb <= 8192.
        if kb.value == 0 || kb.value > 8192 {
            problems.error(
                path.field("max_request_headers_kb"),
                format!("must be between 1 and 8192, not {}", kb.value),
            );
        } else {
            limits.max_request_headers_bytes = kb.value as usize * 1024;
        }
    }
    if let Some(timeout) = &hcm.request_headers_timeout {
        limits.request_headers_timeout = shunt_config::convert::duration(
            timeout,
            &path.field("request_headers_timeout"),
            problems,
        )
        .filter(|d| !d.is_zero());
    }
    let duration = |value: &Option<envoy_types::pb::google::protobuf::Duration>,
                    field: &str,
                    problems: &mut Diagnostics| {
        value.as_ref().and_then(|d| {
            shunt_config::convert::duration(d, &path.field(field), problems)
                .filter(|d| !d.is_zero())
        })
    };
    if hcm.stream_idle_timeout.is_some() {
        limits.stream.idle = duration(&hcm.stream_idle_timeout, "stream_idle_timeout", problems);
    }
    limits.stream.request = duration(&hcm.request_timeout, "request_timeout", problems);
    if hcm.delayed_close_timeout.is_some() {
        limits.delayed_close_timeout = duration(
            &hcm.delayed_close_timeout,
            "delayed_close_timeout",
            problems,
        );
    }
    limits.accept_http_10 = hcm
        .http_protocol_options
        .as_ref()
        .is_some_and(|o| o.accept_http_10);
    if let Some(h2) = &hcm.http2_protocol_options {
        limits.http2 = http2_settings(h2, &path.field("http2_protocol_options"), problems);
    }
    let Some(common) = &hcm.common_http_protocol_options else {
        return limits;
    };
    let c_path = path.field("common_http_protocol_options");
    if let Some(count) = common.max_headers_count {
        if count.value == 0 {
            problems.error(c_path.field("max_headers_count"), "must be at least 1");
        } else {
            limits.max_headers_count = count.value as usize;
        }
    }
    limits.underscores =
        match HeadersWithUnderscoresAction::try_from(common.headers_with_underscores_action) {
            Ok(HeadersWithUnderscoresAction::RejectRequest) => Underscores::Reject,
            Ok(HeadersWithUnderscoresAction::DropHeader) => Underscores::Drop,
            _ => Underscores::Allow,
        };
    limits.max_requests_per_connection = common
        .max_requests_per_connection
        .map(|n| n.value)
        .filter(|&n| n > 0);
    limits.max_connection_duration = duration(
        &common.max_connection_duration,
        "common_http_protocol_options.max_connection_duration",
        problems,
    );
    limits.stream.max_duration = duration(
        &common.max_stream_duration,
        "common_http_protocol_options.max_stream_duration",
        problems,
    );
    if common.idle_timeout.is_some() {
        problems.warning(c_path.field("idle_timeout"), "not implemented; ignored");
    }
    limits
}

/// The `http2_protocol_options` shunt's HTTP/2 server advertises, in Envoy's ranges.
fn http2_settings(
    h2: &envoy_types::pb::envoy::config::core::v3::Http2ProtocolOptions,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> super::config::Http2Settings {
    let mut settings = super::config::Http2Settings::default();
    let mut ranged = |value: Option<u32>, field: &str, min: u32| {
        let value = value?;
        if (min..=2_147_483_647).contains(&value) {
            Some(value)
        } else {
            problems.error(
                path.field(field),
                format!("must be between {min} and 2147483647, not {value}"),
            );
            None
        }
    };
    if let Some(max) = ranged(
        h2.max_concurrent_streams.map(|v| v.value),
        "max_concurrent_streams",
        1,
    ) {
        settings.max_concurrent_streams = max;
    }
    settings.initial_stream_window_size = ranged(
        h2.initial_stream_window_size.map(|v| v.value),
        "initial_stream_window_size",
        65_535,
    );
    settings.initial_connection_window_size = ranged(
        h2.initial_connection_window_size.map(|v| v.value),
        "initial_connection_window_size",
        65_535,
    );
    settings
}

/// Compiles the HTTP filter chain, which must end in the router. Returns the filters
/// before the router and the router's `suppress_envoy_headers`.
fn http_filters(
    hcm: &EnvoyHcm,
    clusters: &shunt_upstream::Clusters,
    stats: &Store,
    env: &Env,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> (FilterChain, bool) {
    let mut suppress_envoy_headers = false;
    let mut chain = FilterChain::default();
    let mut router_at = None;
    for (i, filter) in hcm.http_filters.iter().enumerate() {
        let f_path = path.field("http_filters").index(i);
        let any = match &filter.config_type {
            Some(ConfigType::TypedConfig(any)) => any,
            Some(ConfigType::ConfigDiscovery(_)) => {
                if filter.is_optional {
                    problems.warning(
                        f_path.field("config_discovery"),
                        "HTTP filters over ECDS are not implemented; this optional filter is skipped",
                    );
                } else {
                    problems.error(
                        f_path.field("config_discovery"),
                        "HTTP filters over ECDS are not implemented yet",
                    );
                }
                continue;
            }
            None => {
                problems.error(
                    &f_path,
                    format!("HTTP filter {:?} has no typed_config", filter.name),
                );
                continue;
            }
        };
        let typed_path = f_path.field("typed_config");
        let Some(any) = shunt_config::typed_struct::unwrap(any, &typed_path, problems) else {
            continue;
        };
        let kind = type_name(&any);
        if let Some(refusal) = shunt_config::convert::wasm_unsupported(kind, &filter.name) {
            problems.error(&typed_path, refusal);
            continue;
        }
        if kind == ROUTER {
            if let Some(router) = decode::<Router>(&any, &typed_path, problems) {
                suppress_envoy_headers = router.suppress_envoy_headers;
            }
            router_at = Some(i);
            continue;
        }
        if router_at.is_some() {
            problems.error(&f_path, "comes after the terminal HTTP filter, the router");
            continue;
        }
        if let Some(factory) = registry::find(kind) {
            let ctx = registry::CompileCtx {
                name: &filter.name,
                stat_prefix: &hcm.stat_prefix,
                stats,
                clusters,
                node: &env.node,
                inbound: env.inbound,
            };
            if let Some(config) = (factory.compile)(&any, &ctx, &typed_path, problems) {
                chain.filters.push(ConfiguredFilter {
                    name: Arc::from(filter.name.as_str()),
                    config,
                    disabled: filter.disabled,
                });
            }
        } else if filter.disabled {
            problems.warning(
                &f_path,
                format!("HTTP filter {kind} is not implemented; it is disabled by default, so shunt leaves it out (also where a route enables it)"),
            );
        } else if let Some((_, lost)) =
            shunt_config::extensions::HTTP_FILTERS_SKIPPED_WITH_A_WARNING
                .iter()
                .find(|(name, _)| *name == kind)
        {
            problems.warning(
                &typed_path,
                format!("HTTP filter {kind} is not implemented; skipped: {lost}"),
            );
        } else if filter.is_optional {
            problems.warning(
                &typed_path,
                format!("HTTP filter {kind} is not implemented; this optional filter is skipped"),
            );
        } else {
            problems.error(
                &typed_path,
                format!("HTTP filter {kind} is not implemented yet"),
            );
        }
    }
    if router_at.is_none() {
        problems.error(
            path.field("http_filters"),
            format!("the last HTTP filter must be the router ({ROUTER})"),
        );
    }
    (chain, suppress_envoy_headers)
}

/// Envoy's `validate_clusters`, on by default for an inline route configuration: every
/// cluster a route names must exist when the listener is loaded.
fn validate_clusters(
    config: &RouteConfig,
    clusters: &shunt_upstream::Clusters,
    path: &JsonPath,
    problems: &mut Diagnostics,
) {
    // The compiled config keeps every virtual host and route, in config order.
    for (i, vhost) in config.virtual_hosts.iter().enumerate() {
        for (k, route) in vhost.routes.iter().enumerate() {
            let Action::Route(action) = &route.action else {
                continue;
            };
            let r_path = path
                .field("virtual_hosts")
                .index(i)
                .field("routes")
                .index(k)
                .field("route");
            let names: Vec<(JsonPath, &str)> = match &action.cluster {
                ClusterChoice::Cluster(name) => vec![(r_path.field("cluster"), name)],
                ClusterChoice::Weighted(weighted) => weighted
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        (
                            r_path
                                .field("weighted_clusters")
                                .field("clusters")
                                .index(j)
                                .field("name"),
                            &*c.name,
                        )
                    })
                    .collect(),
                ClusterChoice::Header(_) => Vec::new(),
            };
            for (c_path, name) in names {
                if !clusters.contains_key(name) {
                    problems.error(
                        c_path,
                        format!("no cluster named {name:?} (validate_clusters is on for an inline route_config)"),
                    );
                }
            }
        }
    }
}
