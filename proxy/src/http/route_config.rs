//! Compiling a `RouteConfiguration` (inline in an HTTP connection manager, or an RDS
//! resource) into a [`RouteConfig`]. What shunt cannot honour is an error when it would
//! send a request somewhere else than Envoy would, a warning when it only changes how.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{
    DataSource, HeaderValueOption, data_source, header_value_option::HeaderAppendAction,
};
use envoy_types::pb::envoy::config::route::v3::weighted_cluster::cluster_weight::HostRewriteSpecifier as WeightedHostRewrite;
use envoy_types::pb::envoy::config::route::v3::{
    HeaderMatcher as EnvoyHeaderMatcher, QueryParameterMatcher as EnvoyQueryMatcher,
    RedirectAction, RetryPolicy as EnvoyRetryPolicy, Route as EnvoyRoute,
    RouteAction as EnvoyAction, RouteConfiguration, RouteMatch as EnvoyMatch,
    VirtualHost as EnvoyVirtualHost,
    header_matcher::HeaderMatchSpecifier,
    query_parameter_matcher::QueryParameterMatchSpecifier,
    redirect_action::{self, RedirectResponseCode},
    route::Action as EnvoyActionKind,
    route_action::{self, ClusterNotFoundResponseCode},
    route_match::PathSpecifier,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    RegexMatcher, StringMatcher as EnvoyStringMatcher, string_matcher::MatchPattern,
};
use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};

use super::header_rules::{AppendAction, HeaderAdd, HeaderRules};
use super::matcher::{
    HeaderMatch, HeaderMatcher, QueryParameterMatcher, StringMatcher, StringPattern,
    full_match_regex,
};
use super::route::{
    Action, ClusterChoice, DEFAULT_ROUTE_TIMEOUT, Domains, HashKey, HashPolicy, PathMatch,
    PathRedirect, Redirect, RetryPolicy, Route, RouteAction, RouteConfig, RouteMatch, VirtualHost,
    WeightedCluster, retry_on,
};
use crate::snapshot::Problems;
use crate::snapshot::convert::duration_or;

/// Compiles `config`, found at JSON path `path`; `None` if it has errors (in `problems`).
pub fn compile(
    config: &RouteConfiguration,
    path: &str,
    problems: &mut Problems,
) -> Option<RouteConfig> {
    let errors_before = problems.errors.len();
    if config.vhds.is_some() {
        problems.error(format!("{path}.vhds"), "VHDS is not implemented yet");
    }
    if !config.cluster_specifier_plugins.is_empty() {
        problems.error(
            format!("{path}.cluster_specifier_plugins"),
            "cluster specifier plugins are not implemented yet",
        );
    }
    if !config.vhost_header.is_empty() {
        problems.error(
            format!("{path}.vhost_header"),
            "choosing virtual hosts by another header is not implemented yet",
        );
    }
    if !config.request_mirror_policies.is_empty() {
        problems.warning(
            format!("{path}.request_mirror_policies"),
            "request mirroring is not implemented; nothing is mirrored",
        );
    }
    if !config.internal_only_headers.is_empty() {
        problems.warning(
            format!("{path}.internal_only_headers"),
            "not implemented: these headers are not removed from external requests",
        );
    }
    let mut compiled = RouteConfig {
        name: config.name.clone(),
        request_headers: header_rules(
            &config.request_headers_to_add,
            &config.request_headers_to_remove,
            path,
            "request",
            problems,
        ),
        response_headers: header_rules(
            &config.response_headers_to_add,
            &config.response_headers_to_remove,
            path,
            "response",
            problems,
        ),
        most_specific_header_mutations_wins: config.most_specific_header_mutations_wins,
        ignore_port_in_host_matching: config.ignore_port_in_host_matching,
        ..Default::default()
    };
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (i, vhost) in config.virtual_hosts.iter().enumerate() {
        let v_path = format!("{path}.virtual_hosts[{i}]");
        let compiled_vhost = virtual_host(vhost, &v_path, problems);
        // A virtual host with errors fails the whole config, so its domains are still
        // checked (for duplicates) but its index does not matter.
        let index = compiled.virtual_hosts.len();
        for (j, domain) in vhost.domains.iter().enumerate() {
            let d_path = format!("{v_path}.domains[{j}]");
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
    path: &str,
    problems: &mut Problems,
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
    path: &str,
    problems: &mut Problems,
) -> Option<VirtualHost> {
    let errors_before = problems.errors.len();
    if vhost.domains.is_empty() {
        problems.error(
            format!("{path}.domains"),
            "a virtual host needs at least one domain",
        );
    }
    if vhost.matcher.is_some() {
        problems.error(
            format!("{path}.matcher"),
            "the matcher API for routes is not implemented yet; use routes",
        );
    }
    if vhost.require_tls != 0 {
        problems.error(
            format!("{path}.require_tls"),
            "require_tls is not implemented yet",
        );
    }
    if !vhost.typed_per_filter_config.is_empty() {
        problems.warning(
            format!("{path}.typed_per_filter_config"),
            "per-route HTTP filter configs are not implemented; ignored",
        );
    }
    if vhost.cors.is_some() {
        problems.warning(
            format!("{path}.cors"),
            "CORS policies are not implemented; ignored",
        );
    }
    if !vhost.rate_limits.is_empty() {
        problems.warning(
            format!("{path}.rate_limits"),
            "rate limits are not implemented; ignored",
        );
    }
    if vhost.hedge_policy.is_some() {
        problems.warning(
            format!("{path}.hedge_policy"),
            "request hedging is not implemented; ignored",
        );
    }
    let retry_policy = vhost
        .retry_policy
        .as_ref()
        .map(|p| Arc::new(retry_policy(p, &format!("{path}.retry_policy"), problems)));
    let routes = vhost
        .routes
        .iter()
        .enumerate()
        .filter_map(|(k, r)| route(r, &format!("{path}.routes[{k}]"), problems))
        .collect();
    let compiled = VirtualHost {
        name: vhost.name.clone(),
        routes,
        request_headers: header_rules(
            &vhost.request_headers_to_add,
            &vhost.request_headers_to_remove,
            path,
            "request",
            problems,
        ),
        response_headers: header_rules(
            &vhost.response_headers_to_add,
            &vhost.response_headers_to_remove,
            path,
            "response",
            problems,
        ),
        retry_policy,
    };
    (problems.errors.len() == errors_before).then_some(compiled)
}

fn route(route: &EnvoyRoute, path: &str, problems: &mut Problems) -> Option<Route> {
    let errors_before = problems.errors.len();
    if !route.typed_per_filter_config.is_empty() {
        problems.warning(
            format!("{path}.typed_per_filter_config"),
            "per-route HTTP filter configs are not implemented; ignored",
        );
    }
    let matcher = route_match(route.r#match.as_ref(), &format!("{path}.match"), problems);
    let action = match &route.action {
        Some(EnvoyActionKind::Route(action)) => {
            route_action(action, matcher.as_ref(), &format!("{path}.route"), problems)
                .map(Action::Route)
        }
        Some(EnvoyActionKind::Redirect(redirect)) => {
            redirect_action(redirect, &format!("{path}.redirect"), problems).map(Action::Redirect)
        }
        Some(EnvoyActionKind::DirectResponse(direct)) => {
            let d_path = format!("{path}.direct_response");
            let status = StatusCode::from_u16(direct.status as u16)
                .ok()
                .filter(|_| (200..600).contains(&direct.status));
            if status.is_none() {
                problems.error(
                    format!("{d_path}.status"),
                    format!("{} is not an HTTP status from 200 to 599", direct.status),
                );
            }
            let body = direct
                .body
                .as_ref()
                .map(|b| data_source(b, &format!("{d_path}.body"), problems))
                .unwrap_or_default();
            if direct.body_format.is_some() {
                problems.warning(
                    format!("{d_path}.body_format"),
                    "body formats are not implemented; the body is sent as written",
                );
            }
            status.map(|status| Action::DirectResponse { status, body })
        }
        Some(EnvoyActionKind::FilterAction(_)) => {
            problems.error(
                format!("{path}.filter_action"),
                "filter actions are not implemented yet",
            );
            None
        }
        Some(EnvoyActionKind::NonForwardingAction(_)) => {
            problems.error(
                format!("{path}.non_forwarding_action"),
                "non-forwarding actions are not implemented yet",
            );
            None
        }
        None => {
            problems.error(path, "a route needs route, redirect or direct_response");
            None
        }
    };
    let request_headers = header_rules(
        &route.request_headers_to_add,
        &route.request_headers_to_remove,
        path,
        "request",
        problems,
    );
    let response_headers = header_rules(
        &route.response_headers_to_add,
        &route.response_headers_to_remove,
        path,
        "response",
        problems,
    );
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(Route {
        name: route.name.clone(),
        matcher: matcher?,
        action: action?,
        request_headers,
        response_headers,
    })
}

fn route_match(m: Option<&EnvoyMatch>, path: &str, problems: &mut Problems) -> Option<RouteMatch> {
    let Some(m) = m else {
        problems.error(path, "a route needs a match");
        return None;
    };
    let errors_before = problems.errors.len();
    let path_match = match &m.path_specifier {
        Some(PathSpecifier::Prefix(prefix)) => Some(PathMatch::Prefix(prefix.clone())),
        Some(PathSpecifier::Path(exact)) => Some(PathMatch::Path(exact.clone())),
        Some(PathSpecifier::SafeRegex(re)) => {
            regex(re, &format!("{path}.safe_regex"), problems).map(PathMatch::Regex)
        }
        Some(PathSpecifier::PathSeparatedPrefix(prefix)) => {
            if prefix.ends_with('/') || prefix.contains(['?', '#']) {
                problems.error(
                    format!("{path}.path_separated_prefix"),
                    format!("{prefix:?} may not end with / nor hold ? or #"),
                );
            }
            Some(PathMatch::SeparatedPrefix(prefix.clone()))
        }
        Some(PathSpecifier::ConnectMatcher(_)) => {
            problems.error(
                format!("{path}.connect_matcher"),
                "CONNECT is not implemented yet",
            );
            None
        }
        Some(PathSpecifier::PathMatchPolicy(_)) => {
            problems.error(
                format!("{path}.path_match_policy"),
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
            format!("{path}.runtime_fraction"),
            "runtime fractions are not implemented yet",
        );
    }
    if !m.cookies.is_empty() {
        problems.error(
            format!("{path}.cookies"),
            "cookie matching is not implemented yet",
        );
    }
    if m.tls_context.is_some() {
        problems.error(
            format!("{path}.tls_context"),
            "TLS context matching is not implemented yet",
        );
    }
    if !m.dynamic_metadata.is_empty() {
        problems.error(
            format!("{path}.dynamic_metadata"),
            "dynamic metadata matching is not implemented yet",
        );
    }
    if !m.filter_state.is_empty() {
        problems.error(
            format!("{path}.filter_state"),
            "filter state matching is not implemented yet",
        );
    }
    let headers = m
        .headers
        .iter()
        .enumerate()
        .filter_map(|(i, h)| header_matcher(h, &format!("{path}.headers[{i}]"), problems))
        .collect();
    let query_parameters = m
        .query_parameters
        .iter()
        .enumerate()
        .filter_map(|(i, q)| query_matcher(q, &format!("{path}.query_parameters[{i}]"), problems))
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

fn regex(re: &RegexMatcher, path: &str, problems: &mut Problems) -> Option<regex::Regex> {
    match full_match_regex(&re.regex) {
        Ok(re) => Some(re),
        Err(err) => {
            // The regex crate's message draws the pattern over lines; its last says why.
            let why = err.to_string();
            let why = why
                .lines()
                .last()
                .unwrap_or_default()
                .trim_start_matches("error: ")
                .to_owned();
            problems.error(
                format!("{path}.regex"),
                format!("{:?} is not a valid regex: {why}", re.regex),
            );
            None
        }
    }
}

pub fn string_matcher(
    m: &EnvoyStringMatcher,
    path: &str,
    problems: &mut Problems,
) -> Option<StringMatcher> {
    let pattern = match &m.match_pattern {
        Some(MatchPattern::Exact(s)) => StringPattern::Exact(s.clone()),
        Some(MatchPattern::Prefix(s)) => StringPattern::Prefix(s.clone()),
        Some(MatchPattern::Suffix(s)) => StringPattern::Suffix(s.clone()),
        Some(MatchPattern::Contains(s)) => StringPattern::Contains(s.clone()),
        Some(MatchPattern::SafeRegex(re)) => {
            StringPattern::Regex(regex(re, &format!("{path}.safe_regex"), problems)?)
        }
        Some(MatchPattern::Custom(_)) => {
            problems.error(
                format!("{path}.custom"),
                "custom string matchers are not implemented yet",
            );
            return None;
        }
        None => {
            problems.error(path, "a string matcher needs a pattern");
            return None;
        }
    };
    Some(StringMatcher {
        pattern,
        ignore_case: m.ignore_case,
    })
}

// The deprecated matcher fields are still accepted by Envoy, and by us.
#[allow(deprecated)]
fn header_matcher(
    h: &EnvoyHeaderMatcher,
    path: &str,
    problems: &mut Problems,
) -> Option<HeaderMatcher> {
    let exact = |p: StringPattern| {
        Some(HeaderMatch::String(StringMatcher {
            pattern: p,
            ignore_case: false,
        }))
    };
    let matcher = match &h.header_match_specifier {
        // No specifier: the header must be present.
        None => Some(HeaderMatch::Present(true)),
        Some(HeaderMatchSpecifier::PresentMatch(present)) => Some(HeaderMatch::Present(*present)),
        Some(HeaderMatchSpecifier::ExactMatch(s)) => exact(StringPattern::Exact(s.clone())),
        Some(HeaderMatchSpecifier::PrefixMatch(s)) => exact(StringPattern::Prefix(s.clone())),
        Some(HeaderMatchSpecifier::SuffixMatch(s)) => exact(StringPattern::Suffix(s.clone())),
        Some(HeaderMatchSpecifier::ContainsMatch(s)) => exact(StringPattern::Contains(s.clone())),
        Some(HeaderMatchSpecifier::SafeRegexMatch(re)) => {
            regex(re, &format!("{path}.safe_regex_match"), problems)
                .and_then(|re| exact(StringPattern::Regex(re)))
        }
        Some(HeaderMatchSpecifier::StringMatch(m)) => {
            string_matcher(m, &format!("{path}.string_match"), problems).map(HeaderMatch::String)
        }
        Some(HeaderMatchSpecifier::RangeMatch(_)) => {
            problems.error(
                format!("{path}.range_match"),
                "range matching is not implemented yet",
            );
            None
        }
    };
    if h.name.is_empty() {
        problems.error(format!("{path}.name"), "is required");
        return None;
    }
    Some(HeaderMatcher {
        name: h.name.to_ascii_lowercase(),
        matcher: matcher?,
        invert: h.invert_match,
        treat_missing_as_empty: h.treat_missing_header_as_empty,
    })
}

fn query_matcher(
    q: &EnvoyQueryMatcher,
    path: &str,
    problems: &mut Problems,
) -> Option<QueryParameterMatcher> {
    let matcher = match &q.query_parameter_match_specifier {
        Some(QueryParameterMatchSpecifier::StringMatch(m)) => Some(string_matcher(
            m,
            &format!("{path}.string_match"),
            problems,
        )?),
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

#[allow(
    deprecated,
    reason = "`cors` moved to a filter config; still warned about"
)]
fn route_action(
    a: &EnvoyAction,
    matcher: Option<&RouteMatch>,
    path: &str,
    problems: &mut Problems,
) -> Option<RouteAction> {
    let errors_before = problems.errors.len();
    let cluster = match &a.cluster_specifier {
        Some(route_action::ClusterSpecifier::Cluster(name)) if !name.is_empty() => {
            Some(ClusterChoice::Cluster(name.as_str().into()))
        }
        Some(route_action::ClusterSpecifier::ClusterHeader(header)) => {
            match HeaderName::from_bytes(header.as_bytes()) {
                Ok(name) => Some(ClusterChoice::Header(name)),
                Err(_) => {
                    problems.error(
                        format!("{path}.cluster_header"),
                        format!("{header:?} is not a header name"),
                    );
                    None
                }
            }
        }
        Some(route_action::ClusterSpecifier::WeightedClusters(weighted)) => {
            let w_path = format!("{path}.weighted_clusters");
            let mut clusters = Vec::new();
            for (i, c) in weighted.clusters.iter().enumerate() {
                let c_path = format!("{w_path}.clusters[{i}]");
                if c.name.is_empty() {
                    problems.error(
                        format!("{c_path}.name"),
                        "is required (cluster_header in weighted clusters is not implemented yet)",
                    );
                    continue;
                }
                if c.metadata_match.is_some() {
                    problems.warning(
                        format!("{c_path}.metadata_match"),
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
                    request_headers: header_rules(
                        &c.request_headers_to_add,
                        &c.request_headers_to_remove,
                        &c_path,
                        "request",
                        problems,
                    ),
                    response_headers: header_rules(
                        &c.response_headers_to_add,
                        &c.response_headers_to_remove,
                        &c_path,
                        "response",
                        problems,
                    ),
                    host_rewrite,
                });
            }
            if clusters.iter().all(|c| c.weight == 0) {
                problems.error(&w_path, "needs at least one cluster with a positive weight");
                None
            } else {
                Some(ClusterChoice::Weighted(clusters))
            }
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
    };
    let prefix_rewrite = (!a.prefix_rewrite.is_empty()).then(|| a.prefix_rewrite.clone());
    if prefix_rewrite.is_some() && matcher.is_some_and(|m| m.matched_prefix_len().is_none()) {
        problems.error(
            format!("{path}.prefix_rewrite"),
            "cannot be used with a safe_regex match; use regex_rewrite",
        );
    }
    let regex_rewrite = a.regex_rewrite.as_ref().and_then(|r| {
        let r_path = format!("{path}.regex_rewrite");
        let pattern = r
            .pattern
            .as_ref()
            .and_then(|p| match regex::Regex::new(&p.regex) {
                Ok(re) => Some(re),
                Err(err) => {
                    problems.error(
                        format!("{r_path}.pattern.regex"),
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
            format!("{path}.regex_rewrite"),
            "cannot be used together with prefix_rewrite",
        );
    }
    if a.path_rewrite_policy.is_some() {
        problems.error(
            format!("{path}.path_rewrite_policy"),
            "path rewrite policies are not implemented yet",
        );
    }
    let host_rewrite = match &a.host_rewrite_specifier {
        Some(route_action::HostRewriteSpecifier::HostRewriteLiteral(h)) => Some(h.clone()),
        Some(route_action::HostRewriteSpecifier::AutoHostRewrite(b)) if b.value => {
            problems.warning(
                format!("{path}.auto_host_rewrite"),
                "not implemented; the authority is sent as received",
            );
            None
        }
        Some(route_action::HostRewriteSpecifier::AutoHostRewrite(_)) | None => None,
        Some(_) => {
            problems.error(
                format!("{path}.host_rewrite_specifier"),
                "only host_rewrite_literal is implemented",
            );
            None
        }
    };
    let timeout = duration_or(
        a.timeout.as_ref(),
        DEFAULT_ROUTE_TIMEOUT,
        &format!("{path}.timeout"),
        problems,
    );
    let retry_policy = a
        .retry_policy
        .as_ref()
        .map(|p| Arc::new(retry_policy(p, &format!("{path}.retry_policy"), problems)));
    if a.retry_policy_typed_config.is_some() {
        problems.warning(
            format!("{path}.retry_policy_typed_config"),
            "not implemented; ignored",
        );
    }
    for (field, set) in [
        (
            "request_mirror_policies",
            !a.request_mirror_policies.is_empty(),
        ),
        ("rate_limits", !a.rate_limits.is_empty()),
        ("hedge_policy", a.hedge_policy.is_some()),
        ("cors", a.cors.is_some()),
        ("idle_timeout", a.idle_timeout.is_some()),
        (
            "internal_redirect_policy",
            a.internal_redirect_policy.is_some(),
        ),
        ("upgrade_configs", !a.upgrade_configs.is_empty()),
    ] {
        if set {
            problems.warning(format!("{path}.{field}"), "not implemented; ignored");
        }
    }
    let mut hash_policy = Vec::new();
    for (i, policy) in a.hash_policy.iter().enumerate() {
        use route_action::hash_policy::PolicySpecifier;
        let h_path = format!("{path}.hash_policy[{i}]");
        let key = match &policy.policy_specifier {
            Some(PolicySpecifier::Header(h)) => {
                match HeaderName::from_bytes(h.header_name.as_bytes()) {
                    Ok(name) => Some(HashKey::Header(name)),
                    Err(_) => {
                        problems.error(
                            format!("{h_path}.header.header_name"),
                            format!("{:?} is not a header name", h.header_name),
                        );
                        None
                    }
                }
            }
            Some(PolicySpecifier::Cookie(c)) => {
                if c.ttl.is_some() {
                    problems.warning(format!("{h_path}.cookie.ttl"), "generating cookies is not implemented; only a cookie the request has is hashed");
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
    if a.metadata_match.is_some() {
        problems.warning(
            format!("{path}.metadata_match"),
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
    Some(RouteAction {
        cluster: cluster?,
        prefix_rewrite,
        regex_rewrite,
        host_rewrite,
        timeout: (!timeout.is_zero()).then_some(timeout),
        retry_policy,
        cluster_not_found,
        hash_policy,
    })
}

fn retry_policy(p: &EnvoyRetryPolicy, path: &str, problems: &mut Problems) -> RetryPolicy {
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
                format!("{path}.retry_on"),
                format!("retry condition {other:?} is not implemented; it never retries"),
            ),
        }
    }
    if !p.retry_host_predicate.is_empty() {
        // Retries already avoid the hosts tried, which is what Istio's
        // previous_hosts predicate asks for.
        problems.warning(
            format!("{path}.retry_host_predicate"),
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
                    &format!("{path}.per_try_timeout"),
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

fn redirect_action(r: &RedirectAction, path: &str, problems: &mut Problems) -> Option<Redirect> {
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
                format!("{path}.port_redirect"),
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

fn data_source(source: &DataSource, path: &str, problems: &mut Problems) -> Bytes {
    match &source.specifier {
        Some(data_source::Specifier::InlineString(s)) => Bytes::from(s.clone()),
        Some(data_source::Specifier::InlineBytes(b)) => Bytes::from(b.clone()),
        Some(data_source::Specifier::Filename(file)) => match std::fs::read(file) {
            Ok(body) => Bytes::from(body),
            Err(err) => {
                problems.error(
                    format!("{path}.filename"),
                    format!("cannot read {file:?}: {err}"),
                );
                Bytes::new()
            }
        },
        Some(data_source::Specifier::EnvironmentVariable(var)) => match std::env::var(var) {
            Ok(body) => Bytes::from(body),
            Err(_) => {
                problems.error(
                    format!("{path}.environment_variable"),
                    format!("{var} is not set"),
                );
                Bytes::new()
            }
        },
        None => Bytes::new(),
    }
}

/// Compiles a level's `<kind>_headers_to_add` and `<kind>_headers_to_remove`.
#[allow(deprecated, reason = "Envoy still honours `append`")]
pub fn header_rules(
    add: &[HeaderValueOption],
    remove: &[String],
    path: &str,
    kind: &str,
    problems: &mut Problems,
) -> HeaderRules {
    let mut rules = HeaderRules::default();
    for (i, name) in remove.iter().enumerate() {
        let r_path = format!("{path}.{kind}_headers_to_remove[{i}]");
        let lower = name.to_ascii_lowercase();
        if lower.starts_with(':') || lower == "host" {
            problems.error(r_path, format!("{name:?} cannot be removed"));
            continue;
        }
        match HeaderName::from_bytes(lower.as_bytes()) {
            Ok(name) => rules.remove.push(name),
            Err(_) => problems.error(r_path, format!("{name:?} is not a header name")),
        }
    }
    for (i, option) in add.iter().enumerate() {
        let a_path = format!("{path}.{kind}_headers_to_add[{i}]");
        let Some(header) = &option.header else {
            problems.error(format!("{a_path}.header"), "is required");
            continue;
        };
        let lower = header.key.to_ascii_lowercase();
        if lower.starts_with(':') || lower == "host" {
            problems.error(
                format!("{a_path}.header.key"),
                format!("{:?} cannot be set by a header rule", header.key),
            );
            continue;
        }
        let Ok(name) = HeaderName::from_bytes(lower.as_bytes()) else {
            problems.error(
                format!("{a_path}.header.key"),
                format!("{:?} is not a header name", header.key),
            );
            continue;
        };
        let raw = if header.raw_value.is_empty() {
            header.value.as_bytes()
        } else {
            header.raw_value.as_slice()
        };
        if raw.contains(&b'%') {
            problems.warning(
                format!("{a_path}.header.value"),
                "command operators (%...%) in header values are not implemented; the value is sent as written",
            );
        }
        let Ok(value) = HeaderValue::from_bytes(raw) else {
            problems.error(
                format!("{a_path}.header.value"),
                "is not a valid header value",
            );
            continue;
        };
        // Envoy leaves out a header whose value is empty unless asked to keep it.
        if value.is_empty() && !option.keep_empty_value {
            continue;
        }
        let action = match option.append {
            Some(append) if append.value => AppendAction::AppendIfExistsOrAdd,
            Some(_) => AppendAction::OverwriteIfExistsOrAdd,
            None => match HeaderAppendAction::try_from(option.append_action) {
                Ok(HeaderAppendAction::AddIfAbsent) => AppendAction::AddIfAbsent,
                Ok(HeaderAppendAction::OverwriteIfExistsOrAdd) => {
                    AppendAction::OverwriteIfExistsOrAdd
                }
                Ok(HeaderAppendAction::OverwriteIfExists) => AppendAction::OverwriteIfExists,
                _ => AppendAction::AppendIfExistsOrAdd,
            },
        };
        rules.add.push(HeaderAdd {
            name,
            value,
            action,
        });
    }
    rules
}
