//! Compiling a route's `route` and `redirect` actions: cluster choice, rewrites,
//! timeout, retry policy and hash policy; redirect targets.

use std::sync::Arc;

use envoy_types::pb::envoy::config::route::v3::weighted_cluster::cluster_weight::HostRewriteSpecifier as WeightedHostRewrite;
use envoy_types::pb::envoy::config::route::v3::{
    RedirectAction, RetryPolicy as EnvoyRetryPolicy, RouteAction as EnvoyAction,
    redirect_action::{self, RedirectResponseCode},
    route_action::{self, ClusterNotFoundResponseCode},
};
use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};

use super::header_rules;
use super::route::{
    ClusterChoice, DEFAULT_ROUTE_TIMEOUT, HashKey, HashPolicy, PathRedirect, Redirect, RetryPolicy,
    RouteAction, RouteMatch, StreamDuration, WeightedCluster, retry_on,
};
use shunt_config::convert::duration_or;
use shunt_config::{Diagnostics, JsonPath};

/// A route's `route` action; `matcher` is its route's match (for `prefix_rewrite`). The
/// stages follow the `RouteAction` message: cluster specifier, path and host rewrites,
/// timeout and retries, upgrades, hash policy.
pub fn route_action(
    a: &EnvoyAction,
    matcher: Option<&RouteMatch>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<RouteAction> {
    let errors_before = problems.errors.len();
    let cluster = cluster_specifier(a, path, problems);
    let (prefix_rewrite, regex_rewrite) = path_rewrite(a, matcher, path, problems);
    let host_rewrite = host_rewrite(a, path, problems);
    let timeout = duration_or(
        a.timeout.as_ref(),
        DEFAULT_ROUTE_TIMEOUT,
        &path.field("timeout"),
        problems,
    );
    let retry_policy = a
        .retry_policy
        .as_ref()
        .map(|p| Arc::new(retry_policy(p, &path.field("retry_policy"), problems)));
    warn_unimplemented(a, path, problems);
    let connect = upgrade_configs(a, path, problems);
    let stream_duration = a
        .max_stream_duration
        .as_ref()
        .map(|d| stream_duration(d, &path.field("max_stream_duration"), problems));
    let hash_policy = hash_policy(a, path, problems);
    if a.metadata_match.is_some() {
        problems.warning(
            path.field("metadata_match"),
            "subset load balancing is not implemented; ignored",
        );
    }
    let cluster_not_found =
        match ClusterNotFoundResponseCode::try_from(a.cluster_not_found_response_code) {
            Ok(ClusterNotFoundResponseCode::NotFound) => StatusCode::NOT_FOUND,
            Ok(ClusterNotFoundResponseCode::InternalServerError) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
    if problems.errors.len() > errors_before {
        return None;
    }
    // Envoy's "new timeouts": a route with a max_stream_duration block bounds the
    // stream with it alone, and its `timeout` no longer applies.
    let timeout = (!timeout.is_zero() && stream_duration.is_none()).then_some(timeout);
    Some(RouteAction {
        cluster: cluster?,
        prefix_rewrite,
        regex_rewrite,
        host_rewrite,
        timeout,
        timeout_header: timeout.map(|t| HeaderValue::from(t.as_millis() as u64)),
        retry_policy,
        cluster_not_found,
        hash_policy,
        stream_duration,
        connect,
    })
}

/// `cluster_specifier`: one cluster, a header naming it, or weighted clusters.
fn cluster_specifier(
    a: &EnvoyAction,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ClusterChoice> {
    match &a.cluster_specifier {
        Some(route_action::ClusterSpecifier::Cluster(name)) if !name.is_empty() => {
            Some(ClusterChoice::Cluster(name.as_str().into()))
        }
        Some(route_action::ClusterSpecifier::ClusterHeader(header)) => {
            match HeaderName::from_bytes(header.as_bytes()) {
                Ok(name) => Some(ClusterChoice::Header(name)),
                Err(_) => {
                    problems.error(
                        path.field("cluster_header"),
                        format!("{header:?} is not a header name"),
                    );
                    None
                }
            }
        }
        Some(route_action::ClusterSpecifier::WeightedClusters(weighted)) => {
            weighted_clusters(weighted, &path.field("weighted_clusters"), problems)
        }
        Some(route_action::ClusterSpecifier::ClusterSpecifierPlugin(_))
        | Some(route_action::ClusterSpecifier::InlineClusterSpecifierPlugin(_)) => {
            problems.error(path, "cluster specifier plugins are not implemented yet");
            None
        }
        _ => {
            problems.error(
                path,
                "a route action needs cluster, cluster_header or weighted_clusters",
            );
            None
        }
    }
}

/// `weighted_clusters` at `w_path`: each cluster with its weight, header rules, host
/// rewrite and per-filter configs; at least one weight must be positive.
fn weighted_clusters(
    weighted: &envoy_types::pb::envoy::config::route::v3::WeightedCluster,
    w_path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ClusterChoice> {
    let mut clusters = Vec::new();
    for (i, c) in weighted.clusters.iter().enumerate() {
        let c_path = w_path.field("clusters").index(i);
        if c.name.is_empty() {
            problems.error(
                c_path.field("name"),
                "is required (cluster_header in weighted clusters is not implemented yet)",
            );
            continue;
        }
        if c.metadata_match.is_some() {
            problems.warning(
                c_path.field("metadata_match"),
                "subset load balancing is not implemented; ignored",
            );
        }
        let host_rewrite = c
            .host_rewrite_specifier
            .as_ref()
            .map(|WeightedHostRewrite::HostRewriteLiteral(h)| h.clone());
        clusters.push(WeightedCluster {
            name: c.name.as_str().into(),
            weight: c.weight.map_or(0, |w| w.value),
            request_headers: header_rules::compile(
                &c.request_headers_to_add,
                &c.request_headers_to_remove,
                &c_path,
                "request",
                problems,
            ),
            response_headers: header_rules::compile(
                &c.response_headers_to_add,
                &c.response_headers_to_remove,
                &c_path,
                "response",
                problems,
            ),
            host_rewrite,
            per_filter_configs: super::filter::per_route::compile(
                &c.typed_per_filter_config,
                &c_path.field("typed_per_filter_config"),
                problems,
            ),
        });
    }
    if clusters.iter().all(|c| c.weight == 0) {
        problems.error(w_path, "needs at least one cluster with a positive weight");
        None
    } else {
        Some(ClusterChoice::Weighted(clusters))
    }
}

/// A regex rewrite: the pattern, and the substitution in the regex crate's syntax.
type RegexRewrite = (regex::Regex, String);

/// `prefix_rewrite` and `regex_rewrite` (one or the other); `path_rewrite_policy` is
/// not implemented.
fn path_rewrite(
    a: &EnvoyAction,
    matcher: Option<&RouteMatch>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> (Option<String>, Option<RegexRewrite>) {
    let prefix_rewrite = (!a.prefix_rewrite.is_empty()).then(|| a.prefix_rewrite.clone());
    if prefix_rewrite.is_some() && matcher.is_some_and(|m| m.matched_prefix_len().is_none()) {
        problems.error(
            path.field("prefix_rewrite"),
            "cannot be used with a safe_regex match; use regex_rewrite",
        );
    }
    let regex_rewrite = a.regex_rewrite.as_ref().and_then(|r| {
        let r_path = path.field("regex_rewrite");
        let pattern = r
            .pattern
            .as_ref()
            .and_then(|p| match regex::Regex::new(&p.regex) {
                Ok(re) => Some(re),
                Err(err) => {
                    problems.error(
                        r_path.field("pattern").field("regex"),
                        format!("{:?} is not a valid regex: {err}", p.regex),
                    );
                    None
                }
            });
        // RE2 writes groups as \1; the regex crate as ${1}.
        let substitution = regex::Regex::new(r"\\(\d)")
            .map(|re| re.replace_all(&r.substitution, "$${$1}").into_owned())
            .unwrap_or_default();
        pattern.map(|p| (p, substitution))
    });
    if prefix_rewrite.is_some() && regex_rewrite.is_some() {
        problems.error(
            path.field("regex_rewrite"),
            "cannot be used together with prefix_rewrite",
        );
    }
    if a.path_rewrite_policy.is_some() {
        problems.error(
            path.field("path_rewrite_policy"),
            "path rewrite policies are not implemented yet",
        );
    }
    (prefix_rewrite, regex_rewrite)
}

/// `host_rewrite_specifier`: only a literal host is implemented.
fn host_rewrite(a: &EnvoyAction, path: &JsonPath, problems: &mut Diagnostics) -> Option<String> {
    match &a.host_rewrite_specifier {
        Some(route_action::HostRewriteSpecifier::HostRewriteLiteral(h)) => Some(h.clone()),
        Some(route_action::HostRewriteSpecifier::AutoHostRewrite(b)) if b.value => {
            problems.warning(
                path.field("auto_host_rewrite"),
                "not implemented; the authority is sent as received",
            );
            None
        }
        Some(route_action::HostRewriteSpecifier::AutoHostRewrite(_)) | None => None,
        Some(_) => {
            problems.error(
                path.field("host_rewrite_specifier"),
                "only host_rewrite_literal is implemented",
            );
            None
        }
    }
}

/// Warns about the set fields that are not implemented and change only how well a
/// request is served.
#[allow(
    deprecated,
    reason = "`cors` moved to a filter config; still warned about"
)]
fn warn_unimplemented(a: &EnvoyAction, path: &JsonPath, problems: &mut Diagnostics) {
    if a.retry_policy_typed_config.is_some() {
        problems.warning(
            path.field("retry_policy_typed_config"),
            "not implemented; ignored",
        );
    }
    for (field, set) in [
        (
            "request_mirror_policies",
            !a.request_mirror_policies.is_empty(),
        ),
        ("hedge_policy", a.hedge_policy.is_some()),
        ("cors", a.cors.is_some()),
        ("idle_timeout", a.idle_timeout.is_some()),
        (
            "internal_redirect_policy",
            a.internal_redirect_policy.is_some(),
        ),
    ] {
        if set {
            problems.warning(path.field(field), "not implemented; ignored");
        }
    }
}

/// The action's `rate_limits` and `include_vh_rate_limits`.
#[allow(
    deprecated,
    reason = "`include_vh_rate_limits` is deprecated but still served by Envoy"
)]
pub fn rate_limits(
    a: &EnvoyAction,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> super::route::RouteRateLimits {
    super::route::RouteRateLimits {
        policy: super::rate_limit_policy::compile(
            &a.rate_limits,
            &path.field("rate_limits"),
            problems,
        ),
        include_vh_rate_limits: a.include_vh_rate_limits.is_some_and(|b| b.value),
    }
}

/// `upgrade_configs`: only CONNECT, terminated here, is implemented per route.
fn upgrade_configs(
    a: &EnvoyAction,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<super::connect::ConnectUpgrade> {
    let mut connect = None;
    for (i, upgrade) in a.upgrade_configs.iter().enumerate() {
        let u_path = path.field("upgrade_configs").index(i);
        if !upgrade.upgrade_type.eq_ignore_ascii_case("CONNECT") {
            problems.warning(&u_path, "per-route upgrades other than CONNECT are not implemented; the connection manager's upgrade_configs apply");
            continue;
        }
        if upgrade.enabled.is_some_and(|b| !b.value) {
            continue;
        }
        if let Some(config) = &upgrade.connect_config {
            if config.proxy_protocol_config.is_some() {
                problems.error(
                    u_path
                        .field("connect_config")
                        .field("proxy_protocol_config"),
                    "PROXY protocol on terminated CONNECT is not implemented",
                );
            }
            if config.allow_post {
                problems.warning(
                    u_path.field("connect_config").field("allow_post"),
                    "not implemented; only CONNECT is terminated",
                );
            }
        } else {
            problems.error(
                u_path.field("connect_config"),
                "proxying CONNECT on to the upstream is not implemented; only terminating it (connect_config)",
            );
        }
        connect = Some(super::connect::ConnectUpgrade {
            terminate: upgrade.connect_config.is_some(),
        });
    }
    connect
}

/// `hash_policy`: the keys a hashing load balancer hashes, in order.
fn hash_policy(a: &EnvoyAction, path: &JsonPath, problems: &mut Diagnostics) -> Vec<HashPolicy> {
    use route_action::hash_policy::PolicySpecifier;
    let mut hash_policy = Vec::new();
    for (i, policy) in a.hash_policy.iter().enumerate() {
        let h_path = path.field("hash_policy").index(i);
        let key = match &policy.policy_specifier {
            Some(PolicySpecifier::Header(h)) => {
                match HeaderName::from_bytes(h.header_name.as_bytes()) {
                    Ok(name) => Some(HashKey::Header(name)),
                    Err(_) => {
                        problems.error(
                            h_path.field("header").field("header_name"),
                            format!("{:?} is not a header name", h.header_name),
                        );
                        None
                    }
                }
            }
            Some(PolicySpecifier::Cookie(c)) => {
                if c.ttl.is_some() {
                    problems.warning(h_path.field("cookie").field("ttl"), "generating cookies is not implemented; only a cookie the request has is hashed");
                }
                Some(HashKey::Cookie(c.name.clone()))
            }
            Some(PolicySpecifier::ConnectionProperties(p)) if p.source_ip => {
                Some(HashKey::SourceIp)
            }
            Some(PolicySpecifier::QueryParameter(q)) => {
                Some(HashKey::QueryParameter(q.name.clone()))
            }
            _ => {
                problems.warning(&h_path, "this hash policy is not implemented; ignored");
                None
            }
        };
        if let Some(key) = key {
            hash_policy.push(HashPolicy {
                key,
                terminal: policy.terminal,
            });
        }
    }
    hash_policy
}

/// A route's `max_stream_duration` block; a value of 0 is kept (it means "off").
fn stream_duration(
    d: &route_action::MaxStreamDuration,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> StreamDuration {
    let field = |value: &Option<envoy_types::pb::google::protobuf::Duration>,
                 name: &str,
                 problems: &mut Diagnostics| {
        value
            .as_ref()
            .and_then(|v| shunt_config::convert::duration(v, &path.field(name), problems))
    };
    StreamDuration {
        max: field(&d.max_stream_duration, "max_stream_duration", problems)
            .map(|v| (!v.is_zero()).then_some(v)),
        grpc_header_max: field(
            &d.grpc_timeout_header_max,
            "grpc_timeout_header_max",
            problems,
        ),
        grpc_header_offset: field(
            &d.grpc_timeout_header_offset,
            "grpc_timeout_header_offset",
            problems,
        ),
    }
}

/// A route's or virtual host's `retry_policy`.
pub fn retry_policy(
    p: &EnvoyRetryPolicy,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> RetryPolicy {
    let mut on = 0;
    for condition in p
        .retry_on
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
    {
        match condition {
            "5xx" => on |= retry_on::FIVE_XX,
            "gateway-error" => on |= retry_on::GATEWAY_ERROR,
            "connect-failure" => on |= retry_on::CONNECT_FAILURE,
            "reset" | "reset-before-request" | "refused-stream" => on |= retry_on::RESET,
            "retriable-status-codes" => on |= retry_on::RETRIABLE_STATUS_CODES,
            other => problems.warning(
                path.field("retry_on"),
                format!("retry condition {other:?} is not implemented; it never retries"),
            ),
        }
    }
    if !p.retry_host_predicate.is_empty() {
        // Retries already avoid the hosts tried, which is what Istio's
        // previous_hosts predicate asks for.
        problems.warning(
            path.field("retry_host_predicate"),
            "retries always prefer hosts not tried yet; other predicates are ignored",
        );
    }
    RetryPolicy {
        retry_on: on,
        num_retries: p.num_retries.map_or(1, |n| n.value),
        per_try_timeout: p
            .per_try_timeout
            .as_ref()
            .map(|t| {
                duration_or(
                    Some(t),
                    DEFAULT_ROUTE_TIMEOUT,
                    &path.field("per_try_timeout"),
                    problems,
                )
            })
            .filter(|t| !t.is_zero()),
        retriable_status_codes: p
            .retriable_status_codes
            .iter()
            .filter_map(|c| u16::try_from(*c).ok())
            .collect(),
    }
}

/// A route's `redirect` action.
pub fn redirect_action(
    r: &RedirectAction,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Redirect> {
    let scheme = match &r.scheme_rewrite_specifier {
        Some(redirect_action::SchemeRewriteSpecifier::HttpsRedirect(true)) => {
            Some("https".to_owned())
        }
        Some(redirect_action::SchemeRewriteSpecifier::SchemeRedirect(s)) if !s.is_empty() => {
            Some(s.to_ascii_lowercase())
        }
        _ => None,
    };
    let path_redirect = match &r.path_rewrite_specifier {
        Some(redirect_action::PathRewriteSpecifier::PathRedirect(p)) => {
            PathRedirect::Path(p.clone())
        }
        Some(redirect_action::PathRewriteSpecifier::PrefixRewrite(p)) => {
            PathRedirect::Prefix(p.clone())
        }
        Some(_) => {
            problems.error(
                path,
                "only path_redirect and prefix_rewrite are implemented for redirects",
            );
            return None;
        }
        None => PathRedirect::Keep,
    };
    let port = match u16::try_from(r.port_redirect) {
        Ok(0) => None,
        Ok(port) => Some(port),
        Err(_) => {
            problems.error(
                path.field("port_redirect"),
                format!("{} is not a port", r.port_redirect),
            );
            return None;
        }
    };
    let status = match RedirectResponseCode::try_from(r.response_code) {
        Ok(RedirectResponseCode::Found) => StatusCode::FOUND,
        Ok(RedirectResponseCode::SeeOther) => StatusCode::SEE_OTHER,
        Ok(RedirectResponseCode::TemporaryRedirect) => StatusCode::TEMPORARY_REDIRECT,
        Ok(RedirectResponseCode::PermanentRedirect) => StatusCode::PERMANENT_REDIRECT,
        _ => StatusCode::MOVED_PERMANENTLY,
    };
    Some(Redirect {
        scheme,
        host: (!r.host_redirect.is_empty()).then(|| r.host_redirect.clone()),
        port,
        path: path_redirect,
        status,
        strip_query: r.strip_query,
    })
}
