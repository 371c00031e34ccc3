//! Compiling a `RouteConfiguration` (inline in an HTTP connection manager, or an RDS
//! resource) into a [`RouteConfig`]. What shunt cannot honour is an error when it would
//! send a request somewhere else than Envoy would, a warning when it only changes how.
//! Route actions are compiled in [`super::route_action`], matchers in
//! [`crate::common::matcher`] (query parameters here), header rules in
//! [`super::header_rules`].

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{DataSource, data_source};
use envoy_types::pb::envoy::config::route::v3::{
    QueryParameterMatcher as EnvoyQueryMatcher, Route as EnvoyRoute, RouteConfiguration,
    RouteMatch as EnvoyMatch, VirtualHost as EnvoyVirtualHost,
    query_parameter_matcher::QueryParameterMatchSpecifier, route::Action as EnvoyActionKind,
    route_match::PathSpecifier,
};
use hyper::StatusCode;

use super::route::{
    Action, Domains, PathMatch, QueryParameterMatcher, Route, RouteConfig, RouteMatch,
    RouteRateLimits, VirtualHost,
};
use super::{header_rules, route_action};
use crate::common::matcher::{self, string_matcher};
use shunt_config::{Diagnostics, JsonPath};

/// Compiles `config`, found at JSON path `path`; `None` if it has errors (in `problems`).
pub fn compile(
    config: &RouteConfiguration,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<RouteConfig> {
    let errors_before = problems.errors.len();
    if config.vhds.is_some() {
        problems.error(path.field("vhds"), "VHDS is not implemented yet");
    }
    if !config.cluster_specifier_plugins.is_empty() {
        problems.error(
            path.field("cluster_specifier_plugins"),
            "cluster specifier plugins are not implemented yet",
        );
    }
    if !config.vhost_header.is_empty() {
        problems.error(
            path.field("vhost_header"),
            "choosing virtual hosts by another header is not implemented yet",
        );
    }
    if !config.request_mirror_policies.is_empty() {
        problems.warning(
            path.field("request_mirror_policies"),
            "request mirroring is not implemented; nothing is mirrored",
        );
    }
    if !config.internal_only_headers.is_empty() {
        problems.warning(
            path.field("internal_only_headers"),
            "not implemented: these headers are not removed from external requests",
        );
    }
    let mut compiled = RouteConfig {
        name: config.name.clone(),
        request_headers: header_rules::compile(
            &config.request_headers_to_add,
            &config.request_headers_to_remove,
            path,
            "request",
            problems,
        ),
        response_headers: header_rules::compile(
            &config.response_headers_to_add,
            &config.response_headers_to_remove,
            path,
            "response",
            problems,
        ),
        most_specific_header_mutations_wins: config.most_specific_header_mutations_wins,
        ignore_port_in_host_matching: config.ignore_port_in_host_matching,
        per_filter_configs: super::filter::per_route::compile(
            &config.typed_per_filter_config,
            &path.field("typed_per_filter_config"),
            problems,
        ),
        ..Default::default()
    };
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, vhost) in config.virtual_hosts.iter().enumerate() {
        let v_path = path.field("virtual_hosts").index(i);
        let compiled_vhost = virtual_host(vhost, &v_path, problems);
        // A virtual host with errors fails the whole config, so its domains are still
        // checked (for duplicates) but its index does not matter.
        let index = compiled.virtual_hosts.len();
        for (j, domain) in vhost.domains.iter().enumerate() {
            let d_path = v_path.field("domains").index(j);
            let domain = domain.to_ascii_lowercase();
            if let Some(other) = seen.insert(domain.clone(), i) {
                problems.error(
                    &d_path,
                    format!(
                        "only unique values for domains are permitted: {domain:?} is also a domain of virtual_hosts[{other}]"
                    ),
                );
                continue;
            }
            add_domain(&mut compiled.domains, &domain, index, &d_path, problems);
        }
        if let Some(compiled_vhost) = compiled_vhost {
            compiled.virtual_hosts.push(compiled_vhost);
        }
    }
    // Longest first: the most specific wildcard wins.
    compiled
        .domains
        .suffix
        .sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
    compiled
        .domains
        .prefix
        .sort_by_key(|(s, _)| std::cmp::Reverse(s.len()));
    (problems.errors.len() == errors_before).then_some(compiled)
}

fn add_domain(
    domains: &mut Domains,
    domain: &str,
    index: usize,
    path: &JsonPath,
    problems: &mut Diagnostics,
) {
    if domain == "*" {
        domains.any = Some(index);
    } else if let Some(suffix) = domain.strip_prefix('*') {
        if suffix.contains('*') {
            problems.error(
                path,
                format!("{domain:?}: only one leading or trailing * is allowed"),
            );
        } else {
            domains.suffix.push((suffix.to_owned(), index));
        }
    } else if let Some(prefix) = domain.strip_suffix('*') {
        if prefix.contains('*') {
            problems.error(
                path,
                format!("{domain:?}: only one leading or trailing * is allowed"),
            );
        } else {
            domains.prefix.push((prefix.to_owned(), index));
        }
    } else if domain.contains('*') {
        problems.error(path, format!("{domain:?}: a wildcard must lead or trail"));
    } else if domain.is_empty() {
        problems.error(path, "a domain cannot be empty");
    } else {
        domains.exact.insert(domain.to_owned(), index);
    }
}

#[allow(
    deprecated,
    reason = "`cors` moved to a filter config; still warned about"
)]
fn virtual_host(
    vhost: &EnvoyVirtualHost,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<VirtualHost> {
    let errors_before = problems.errors.len();
    if vhost.domains.is_empty() {
        problems.error(
            path.field("domains"),
            "a virtual host needs at least one domain",
        );
    }
    if vhost.matcher.is_some() {
        problems.error(
            path.field("matcher"),
            "the matcher API for routes is not implemented yet; use routes",
        );
    }
    if vhost.require_tls != 0 {
        problems.error(
            path.field("require_tls"),
            "require_tls is not implemented yet",
        );
    }
    if vhost.cors.is_some() {
        problems.warning(
            path.field("cors"),
            "CORS policies are not implemented; ignored",
        );
    }
    if vhost.hedge_policy.is_some() {
        problems.warning(
            path.field("hedge_policy"),
            "request hedging is not implemented; ignored",
        );
    }
    let retry_policy = vhost.retry_policy.as_ref().map(|p| {
        Arc::new(route_action::retry_policy(
            p,
            &path.field("retry_policy"),
            problems,
        ))
    });
    let routes = vhost
        .routes
        .iter()
        .enumerate()
        .filter_map(|(k, r)| route(r, &path.field("routes").index(k), problems))
        .collect();
    let compiled = VirtualHost {
        name: vhost.name.clone(),
        routes,
        request_headers: header_rules::compile(
            &vhost.request_headers_to_add,
            &vhost.request_headers_to_remove,
            path,
            "request",
            problems,
        ),
        response_headers: header_rules::compile(
            &vhost.response_headers_to_add,
            &vhost.response_headers_to_remove,
            path,
            "response",
            problems,
        ),
        retry_policy,
        per_filter_configs: super::filter::per_route::compile(
            &vhost.typed_per_filter_config,
            &path.field("typed_per_filter_config"),
            problems,
        ),
        rate_limits: super::rate_limit_policy::compile(
            &vhost.rate_limits,
            &path.field("rate_limits"),
            problems,
        ),
    };
    (problems.errors.len() == errors_before).then_some(compiled)
}

fn route(route: &EnvoyRoute, path: &JsonPath, problems: &mut Diagnostics) -> Option<Route> {
    let errors_before = problems.errors.len();
    let matcher = route_match(route.r#match.as_ref(), &path.field("match"), problems);
    let action = match &route.action {
        Some(EnvoyActionKind::Route(action)) => {
            route_action::route_action(action, matcher.as_ref(), &path.field("route"), problems)
                .map(Action::Route)
        }
        Some(EnvoyActionKind::Redirect(redirect)) => {
            route_action::redirect_action(redirect, &path.field("redirect"), problems)
                .map(Action::Redirect)
        }
        Some(EnvoyActionKind::DirectResponse(direct)) => {
            let d_path = path.field("direct_response");
            let status = StatusCode::from_u16(direct.status as u16)
                .ok()
                .filter(|_| (200..600).contains(&direct.status));
            if status.is_none() {
                problems.error(
                    d_path.field("status"),
                    format!("{} is not an HTTP status from 200 to 599", direct.status),
                );
            }
            let body = direct
                .body
                .as_ref()
                .map(|b| data_source(b, &d_path.field("body"), problems))
                .unwrap_or_default();
            if direct.body_format.is_some() {
                problems.warning(
                    d_path.field("body_format"),
                    "body formats are not implemented; the body is sent as written",
                );
            }
            status.map(|status| Action::DirectResponse { status, body })
        }
        Some(EnvoyActionKind::FilterAction(_)) => {
            problems.error(
                path.field("filter_action"),
                "filter actions are not implemented yet",
            );
            None
        }
        Some(EnvoyActionKind::NonForwardingAction(_)) => {
            problems.error(
                path.field("non_forwarding_action"),
                "non-forwarding actions are not implemented yet",
            );
            None
        }
        None => {
            problems.error(path, "a route needs route, redirect or direct_response");
            None
        }
    };
    if route.tracing.is_some() {
        problems.warning(
            path.field("tracing"),
            "per-route tracing is not implemented; the connection manager's sampling applies",
        );
    }
    let request_headers = header_rules::compile(
        &route.request_headers_to_add,
        &route.request_headers_to_remove,
        path,
        "request",
        problems,
    );
    let response_headers = header_rules::compile(
        &route.response_headers_to_add,
        &route.response_headers_to_remove,
        path,
        "response",
        problems,
    );
    if problems.errors.len() > errors_before {
        return None;
    }
    let rate_limits = match &route.action {
        Some(EnvoyActionKind::Route(a)) => {
            route_action::rate_limits(a, &path.field("route"), problems)
        }
        _ => RouteRateLimits::default(),
    };
    Some(Route {
        name: route.name.clone(),
        matcher: matcher?,
        action: action?,
        rate_limits,
        request_headers,
        response_headers,
        per_filter_configs: super::filter::per_route::compile(
            &route.typed_per_filter_config,
            &path.field("typed_per_filter_config"),
            problems,
        ),
        decorator: route.decorator.as_ref().and_then(|d| {
            if d.operation.is_empty() {
                problems.error(path.field("decorator").field("operation"), "is required");
                return None;
            }
            Some(super::route::Decorator {
                operation: d.operation.clone(),
                propagate: d.propagate.is_none_or(|b| b.value),
            })
        }),
    })
}

pub(crate) fn route_match(
    m: Option<&EnvoyMatch>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<RouteMatch> {
    let Some(m) = m else {
        problems.error(path, "a route needs a match");
        return None;
    };
    let errors_before = problems.errors.len();
    let path_match = match &m.path_specifier {
        Some(PathSpecifier::Prefix(prefix)) => Some(PathMatch::Prefix(prefix.clone())),
        Some(PathSpecifier::Path(exact)) => Some(PathMatch::Path(exact.clone())),
        Some(PathSpecifier::SafeRegex(re)) => {
            matcher::regex(re, &path.field("safe_regex"), problems).map(PathMatch::Regex)
        }
        Some(PathSpecifier::PathSeparatedPrefix(prefix)) => {
            if prefix.ends_with('/') || prefix.contains(['?', '#']) {
                problems.error(
                    path.field("path_separated_prefix"),
                    format!("{prefix:?} may not end with / nor hold ? or #"),
                );
            }
            Some(PathMatch::SeparatedPrefix(prefix.clone()))
        }
        Some(PathSpecifier::ConnectMatcher(_)) => Some(PathMatch::Connect),
        Some(PathSpecifier::PathMatchPolicy(_)) => {
            problems.error(
                path.field("path_match_policy"),
                "path match policies are not implemented yet",
            );
            None
        }
        None => {
            problems.error(
                path,
                "a route match needs prefix, path, safe_regex or path_separated_prefix",
            );
            None
        }
    };
    if m.runtime_fraction.is_some() {
        problems.error(
            path.field("runtime_fraction"),
            "runtime fractions are not implemented yet",
        );
    }
    if !m.cookies.is_empty() {
        problems.error(
            path.field("cookies"),
            "cookie matching is not implemented yet",
        );
    }
    if m.tls_context.is_some() {
        problems.error(
            path.field("tls_context"),
            "TLS context matching is not implemented yet",
        );
    }
    if !m.dynamic_metadata.is_empty() {
        problems.error(
            path.field("dynamic_metadata"),
            "dynamic metadata matching is not implemented yet",
        );
    }
    if !m.filter_state.is_empty() {
        problems.error(
            path.field("filter_state"),
            "filter state matching is not implemented yet",
        );
    }
    let headers = m
        .headers
        .iter()
        .enumerate()
        .filter_map(|(i, h)| matcher::header_matcher(h, &path.field("headers").index(i), problems))
        .collect();
    let query_parameters = m
        .query_parameters
        .iter()
        .enumerate()
        .filter_map(|(i, q)| query_matcher(q, &path.field("query_parameters").index(i), problems))
        .collect();
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(RouteMatch {
        path: path_match?,
        case_sensitive: m.case_sensitive.is_none_or(|b| b.value),
        headers,
        query_parameters,
        grpc: m.grpc.is_some(),
    })
}

/// A `QueryParameterMatcher`: `string_match`, or `present_match: true`.
pub fn query_matcher(
    q: &EnvoyQueryMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<QueryParameterMatcher> {
    let matcher = match &q.query_parameter_match_specifier {
        Some(QueryParameterMatchSpecifier::StringMatch(m)) => {
            Some(string_matcher(m, &path.field("string_match"), problems)?)
        }
        Some(QueryParameterMatchSpecifier::PresentMatch(true)) => None,
        _ => {
            problems.error(
                path,
                "a query parameter matcher needs string_match or present_match: true",
            );
            return None;
        }
    };
    Some(QueryParameterMatcher {
        name: q.name.clone(),
        matcher,
    })
}

pub(crate) fn data_source(
    source: &DataSource,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Bytes {
    match &source.specifier {
        Some(data_source::Specifier::InlineString(s)) => Bytes::from(s.clone()),
        Some(data_source::Specifier::InlineBytes(b)) => Bytes::from(b.clone()),
        Some(data_source::Specifier::Filename(file)) => match std::fs::read(file) {
            Ok(body) => Bytes::from(body),
            Err(err) => {
                problems.error(
                    path.field("filename"),
                    format!("cannot read {file:?}: {err}"),
                );
                Bytes::new()
            }
        },
        Some(data_source::Specifier::EnvironmentVariable(var)) => match std::env::var(var) {
            Ok(body) => Bytes::from(body),
            Err(_) => {
                problems.error(
                    path.field("environment_variable"),
                    format!("{var} is not set"),
                );
                Bytes::new()
            }
        },
        None => Bytes::new(),
    }
}
