//! A compiled `RouteConfiguration`: virtual hosts chosen by the request's authority with
//! Envoy's domain precedence, routes matched in order, and what a matched route does
//! (forward to a cluster, redirect, or answer directly). Immutable; an RDS update
//! replaces the whole thing.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};
use regex::Regex;

use super::header_rules::HeaderRules;
use super::rate_limit_policy::RateLimitPolicy;
use crate::common::matcher::{HeaderMatcher, RequestView, StringMatcher};

/// Envoy's default route `timeout`.
pub const DEFAULT_ROUTE_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, Default)]
pub struct RouteConfig {
    pub name: String,
    pub virtual_hosts: Vec<VirtualHost>,
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
    /// Apply the most specific level's header rules last, so they win (Envoy's
    /// `most_specific_header_mutations_wins`); by default the route configuration's win.
    pub most_specific_header_mutations_wins: bool,
    pub ignore_port_in_host_matching: bool,
    pub domains: Domains,
    /// `typed_per_filter_config`, the least specific level.
    pub per_filter_configs: PerFilterConfigs,
}

impl RouteConfig {
    /// Whether any `typed_per_filter_config` in it keeps run-time state (see
    /// [`RouteSpecificConfig::holds_state`]).
    pub fn holds_state(&self) -> bool {
        let stateful = |configs: &PerFilterConfigs| {
            configs
                .values()
                .any(|c| c.config.as_ref().is_some_and(|c| c.holds_state()))
        };
        stateful(&self.per_filter_configs)
            || self.virtual_hosts.iter().any(|vhost| {
                stateful(&vhost.per_filter_configs)
                    || vhost.routes.iter().any(|route| {
                        stateful(&route.per_filter_configs)
                            || matches!(&route.action, Action::Route(action)
                                if matches!(&action.cluster, ClusterChoice::Weighted(weighted)
                                    if weighted.iter().any(|w| stateful(&w.per_filter_configs))))
                    })
            })
    }
}

/// Virtual host indexes by domain, in Envoy's search order.
#[derive(Debug, Default)]
pub struct Domains {
    /// Looked up with every request's host: foldhash, not SipHash (only config inserts).
    pub exact: std::collections::HashMap<String, usize, foldhash::fast::RandomState>,
    /// `*.example.com` / `*-bar.example.com`, by suffix (without the `*`), longest first.
    pub suffix: Vec<(String, usize)>,
    /// `example.*`, by prefix (without the `*`), longest first.
    pub prefix: Vec<(String, usize)>,
    /// `*`.
    pub any: Option<usize>,
}

impl Domains {
    /// Exact, then the longest suffix wildcard, then the longest prefix wildcard. A
    /// wildcard never matches an empty part.
    fn find(&self, host: &str) -> Option<usize> {
        if let Some(&index) = self.exact.get(host) {
            return Some(index);
        }
        let suffix = self
            .suffix
            .iter()
            .find(|(suffix, _)| host.len() > suffix.len() && host.ends_with(suffix.as_str()));
        if let Some((_, index)) = suffix {
            return Some(*index);
        }
        self.prefix
            .iter()
            .find(|(prefix, _)| host.len() > prefix.len() && host.starts_with(prefix.as_str()))
            .map(|(_, index)| *index)
    }
}

/// Removes a `:port` from an authority (IPv6 literals keep their brackets).
pub fn strip_port(authority: &str) -> &str {
    if authority.starts_with('[') {
        return match authority.find("]:") {
            Some(end) => &authority[..=end],
            None => authority,
        };
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

impl RouteConfig {
    /// The virtual host for `authority`: the domain search on the whole (lowercased)
    /// authority, port included, then `*`, as Envoy's `findVirtualHost`. The port is
    /// only left out with `ignore_port_in_host_matching` (or when the connection
    /// manager's `strip_*_host_port` removed it first): `host:9999` that no domain
    /// names goes to `*`, not to the virtual host of `host`.
    pub fn virtual_host(&self, authority: &str) -> Option<&VirtualHost> {
        // Hosts arrive lower-case nearly always: copy only one that is not.
        let lowered;
        let host = if authority.bytes().any(|b| b.is_ascii_uppercase()) {
            lowered = authority.to_ascii_lowercase();
            lowered.as_str()
        } else {
            authority
        };
        let host = if self.ignore_port_in_host_matching {
            strip_port(host)
        } else {
            host
        };
        self.domains
            .find(host)
            .or(self.domains.any)
            .map(|index| &self.virtual_hosts[index])
    }

    /// Whether a route has a `connect_matcher` (serves CONNECT).
    pub fn has_connect_routes(&self) -> bool {
        self.virtual_hosts
            .iter()
            .flat_map(|v| &v.routes)
            .any(|r| matches!(r.matcher.path, PathMatch::Connect))
    }

    /// The virtual host and the first of its routes that matches the request.
    pub fn route(&self, request: &RequestView<'_>) -> Option<(&VirtualHost, &Route)> {
        let vhost = self.virtual_host(request.authority)?;
        let route = vhost.routes.iter().find(|r| r.matcher.matches(request))?;
        Some((vhost, route))
    }

    /// The header rules that apply to a request routed by `route` of `vhost`, in the
    /// order they are applied: the last one wins a conflict.
    pub fn header_rules<'a>(
        &'a self,
        vhost: &'a VirtualHost,
        route: &'a Route,
        response: bool,
    ) -> [&'a HeaderRules; 3] {
        let pick = |request: &'a HeaderRules, response_rules: &'a HeaderRules| {
            if response { response_rules } else { request }
        };
        let levels = [
            pick(&route.request_headers, &route.response_headers),
            pick(&vhost.request_headers, &vhost.response_headers),
            pick(&self.request_headers, &self.response_headers),
        ];
        if self.most_specific_header_mutations_wins {
            let [r, v, c] = levels;
            [c, v, r]
        } else {
            levels
        }
    }
}

#[derive(Debug, Default)]
pub struct VirtualHost {
    pub name: String,
    pub routes: Vec<Route>,
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
    /// Used by routes without a retry policy of their own.
    pub retry_policy: Option<Arc<RetryPolicy>>,
    pub per_filter_configs: PerFilterConfigs,
    /// What the rate limit filters read for the routes (see `include_vh_rate_limits`).
    pub rate_limits: RateLimitPolicy,
}

#[derive(Debug)]
pub struct Route {
    pub name: String,
    pub matcher: RouteMatch,
    pub action: Action,
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
    pub per_filter_configs: PerFilterConfigs,
    /// The route action's `rate_limits` (Envoy's route entry's rate limit policy).
    pub rate_limits: RouteRateLimits,
    /// `decorator`: the operation name of the request's span (Istio sets
    /// `<host>:<port>/*`), and whether it goes on in `x-envoy-decorator-operation`.
    pub decorator: Option<Decorator>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decorator {
    pub operation: String,
    pub propagate: bool,
}

#[derive(Debug)]
pub enum PathMatch {
    Prefix(String),
    Path(String),
    /// Anchored: matches the whole path.
    Regex(Regex),
    /// The path is the prefix, or the prefix then `/`.
    SeparatedPrefix(String),
    /// `connect_matcher`: CONNECT requests, which no path matcher matches.
    Connect,
}

#[derive(Debug)]
pub struct RouteMatch {
    pub path: PathMatch,
    /// Prefix and path matchers compare lowercased when false (regexes are unaffected).
    pub case_sensitive: bool,
    pub headers: Vec<HeaderMatcher>,
    pub query_parameters: Vec<QueryParameterMatcher>,
    /// Only gRPC requests (`content-type: application/grpc*`).
    pub grpc: bool,
}

impl RouteMatch {
    pub fn matches(&self, request: &RequestView<'_>) -> bool {
        let connect = request.method == "CONNECT";
        let path_ok = match self.path {
            PathMatch::Connect => connect,
            _ => !connect && self.path_matches(request.path_only()),
        };
        path_ok
            && self.headers.iter().all(|h| h.matches(request))
            && self.query_parameters.iter().all(|q| q.matches(request))
            && (!self.grpc
                || request
                    .headers
                    .get(hyper::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.starts_with("application/grpc")))
    }

    fn path_matches(&self, path: &str) -> bool {
        // Compared in place, folding ASCII case when asked: nothing allocated per route
        // tried. Envoy ignores `case_sensitive` for regexes (they see the path as is).
        let fold = !self.case_sensitive;
        let starts_with = |prefix: &str| {
            path.len() >= prefix.len() && same(&path.as_bytes()[..prefix.len()], prefix, fold)
        };
        match &self.path {
            PathMatch::Prefix(prefix) => starts_with(prefix),
            PathMatch::Path(exact) => same(path.as_bytes(), exact, fold),
            PathMatch::Regex(re) => re.is_match(path),
            PathMatch::Connect => false,
            PathMatch::SeparatedPrefix(prefix) => {
                starts_with(prefix)
                    && matches!(path.as_bytes().get(prefix.len()), None | Some(b'/'))
            }
        }
    }

    /// The length of the path's part that a `prefix_rewrite` replaces.
    pub fn matched_prefix_len(&self) -> Option<usize> {
        match &self.path {
            PathMatch::Prefix(prefix) | PathMatch::SeparatedPrefix(prefix) => Some(prefix.len()),
            PathMatch::Path(path) => Some(path.len()),
            PathMatch::Regex(_) | PathMatch::Connect => None,
        }
    }
}

#[derive(Debug)]
pub struct QueryParameterMatcher {
    pub name: String,
    /// `None`: `present_match`, any value.
    pub matcher: Option<StringMatcher>,
}

impl QueryParameterMatcher {
    pub fn matches(&self, request: &RequestView<'_>) -> bool {
        request
            .query_parameters()
            .find(|(name, _)| *name == self.name)
            .is_some_and(|(_, value)| self.matcher.as_ref().is_none_or(|m| m.matches(value)))
    }
}

/// `a == b`, ignoring ASCII case when `fold`.
fn same(a: &[u8], b: &str, fold: bool) -> bool {
    if fold {
        a.eq_ignore_ascii_case(b.as_bytes())
    } else {
        a == b.as_bytes()
    }
}

#[derive(Debug)]
pub enum Action {
    Route(RouteAction),
    Redirect(Redirect),
    DirectResponse { status: StatusCode, body: Bytes },
}

#[derive(Debug)]
pub struct RouteAction {
    pub cluster: ClusterChoice,
    pub prefix_rewrite: Option<String>,
    /// `regex_rewrite`: every match in the path is replaced.
    pub regex_rewrite: Option<(Regex, String)>,
    pub host_rewrite: Option<String>,
    /// `None`: no timeout (configured as 0s).
    pub timeout: Option<Duration>,
    /// `x-envoy-expected-rq-timeout-ms`'s value for `timeout`, made once with the route.
    pub timeout_header: Option<HeaderValue>,
    pub retry_policy: Option<Arc<RetryPolicy>>,
    pub cluster_not_found: StatusCode,
    /// What RING_HASH and MAGLEV clusters hash for this route's requests.
    pub hash_policy: Vec<HashPolicy>,
    /// `max_stream_duration`: the route's override of the connection manager's.
    pub stream_duration: Option<StreamDuration>,
    /// `upgrade_configs` `CONNECT`: the route terminates CONNECT requests.
    pub connect: Option<ConnectUpgrade>,
}

/// A route's `rate_limits`, and whether its requests carry the virtual host's
/// descriptors too (`include_vh_rate_limits`; else only when the route has none).
#[derive(Debug, Default)]
pub struct RouteRateLimits {
    pub policy: RateLimitPolicy,
    pub include_vh_rate_limits: bool,
}

/// A route's `max_stream_duration` block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamDuration {
    /// `max_stream_duration`; `Some(None)`: set to 0, which turns the connection
    /// manager's off for this route.
    pub max: Option<Option<Duration>>,
    /// `grpc_timeout_header_max`: a request's `grpc-timeout` header sets the duration,
    /// capped by this (0: not capped).
    pub grpc_header_max: Option<Duration>,
    /// `grpc_timeout_header_offset`: subtracted from the header's value.
    pub grpc_header_offset: Option<Duration>,
}

impl StreamDuration {
    /// The stream's duration limit for a request with `headers`, as Envoy's connection
    /// manager recomputes it once the route is known: `None` keeps the connection
    /// manager's, `Some(None)` turns the limit off.
    pub fn for_request(&self, headers: &hyper::HeaderMap) -> Option<Option<Duration>> {
        let grpc = self.grpc_header_max.zip(
            headers
                .get("grpc-timeout")
                .and_then(|v| grpc_timeout(v.as_bytes())),
        );
        let Some((cap, mut timeout)) = grpc else {
            return self.max;
        };
        if !cap.is_zero() && timeout > cap {
            timeout = cap;
        }
        if let Some(offset) = self.grpc_header_offset {
            timeout = timeout.saturating_sub(offset);
        }
        Some((!timeout.is_zero()).then_some(timeout))
    }
}

/// gRPC's `grpc-timeout` value: at most 8 digits and a unit (H, M, S, m, u, n).
pub fn grpc_timeout(value: &[u8]) -> Option<Duration> {
    let (&unit, digits) = value.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[derive(Debug)]
pub enum HashKey {
    Header(HeaderName),
    /// A cookie's value, when the request has it.
    Cookie(String),
    SourceIp,
    QueryParameter(String),
}

#[derive(Debug)]
pub struct HashPolicy {
    pub key: HashKey,
    /// Stop at this policy if it produced a hash.
    pub terminal: bool,
}

/// Envoy's request hash: each policy that finds its key hashes it (xxHash64), folded
/// into the previous ones by rotating left one bit and xoring; `None` when no policy
/// found anything (the balancer then picks at random).
pub fn request_hash(
    policies: &[HashPolicy],
    request: &RequestView<'_>,
    source: std::net::IpAddr,
) -> Option<u64> {
    let mut hash: Option<u64> = None;
    for policy in policies {
        let key = match &policy.key {
            HashKey::Header(name) => request.headers.get(name).map(|v| v.as_bytes().to_vec()),
            HashKey::Cookie(name) => request
                .headers
                .get_all(hyper::header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .filter_map(|pair| pair.trim().split_once('='))
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_bytes().to_vec()),
            HashKey::SourceIp => Some(source.to_canonical().to_string().into_bytes()),
            HashKey::QueryParameter(name) => request
                .query_parameters()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_bytes().to_vec()),
        };
        let Some(key) = key else {
            continue;
        };
        let new = shunt_upstream::load_balancer::hash_key(&key);
        hash = Some(hash.map_or(new, |h| h.rotate_left(1) ^ new));
        if policy.terminal {
            break;
        }
    }
    hash
}

#[derive(Debug)]
pub enum ClusterChoice {
    Cluster(Arc<str>),
    /// The cluster named by this request header.
    Header(HeaderName),
    /// At least one weight is positive.
    Weighted(Vec<WeightedCluster>),
}

#[derive(Debug)]
pub struct WeightedCluster {
    pub name: Arc<str>,
    pub weight: u32,
    pub request_headers: HeaderRules,
    pub response_headers: HeaderRules,
    pub host_rewrite: Option<String>,
    pub per_filter_configs: PerFilterConfigs,
}

impl ClusterChoice {
    /// The cluster for one request (weighted: at random by weight), with the weighted
    /// cluster chosen if any; `None` when the named header is absent.
    pub fn pick(&self, request: &RequestView<'_>) -> Option<(Arc<str>, Option<&WeightedCluster>)> {
        match self {
            ClusterChoice::Cluster(name) => Some((name.clone(), None)),
            ClusterChoice::Header(header) => {
                let value = request.headers.get(header)?.to_str().ok()?;
                Some((Arc::from(value), None))
            }
            ClusterChoice::Weighted(clusters) => {
                let total: u64 = clusters.iter().map(|c| u64::from(c.weight)).sum();
                let mut point = fastrand::u64(..total.max(1));
                for cluster in clusters {
                    if point < u64::from(cluster.weight) {
                        return Some((cluster.name.clone(), Some(cluster)));
                    }
                    point -= u64::from(cluster.weight);
                }
                clusters.first().map(|c| (c.name.clone(), Some(c)))
            }
        }
    }
}

/// What a retry policy's `retry_on` lists, as flags.
pub mod retry_on {
    pub const FIVE_XX: u8 = 1;
    pub const GATEWAY_ERROR: u8 = 1 << 1;
    pub const CONNECT_FAILURE: u8 = 1 << 2;
    pub const RESET: u8 = 1 << 3;
    pub const RETRIABLE_STATUS_CODES: u8 = 1 << 4;
}

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub retry_on: u8,
    pub num_retries: u32,
    pub per_try_timeout: Option<Duration>,
    pub retriable_status_codes: Vec<u16>,
}

impl RetryPolicy {
    fn on(&self, flag: u8) -> bool {
        self.retry_on & flag != 0
    }

    /// Whether a response with `status` is worth another try.
    pub fn retries_status(&self, status: StatusCode) -> bool {
        let code = status.as_u16();
        (self.on(retry_on::FIVE_XX) && code >= 500)
            || (self.on(retry_on::GATEWAY_ERROR) && matches!(code, 502..=504))
            || (self.on(retry_on::RETRIABLE_STATUS_CODES)
                && self.retriable_status_codes.contains(&code))
    }

    /// Whether a failed connect is worth another try.
    pub fn retries_connect_failure(&self) -> bool {
        self.retry_on & (retry_on::CONNECT_FAILURE | retry_on::FIVE_XX | retry_on::GATEWAY_ERROR)
            != 0
    }

    /// Whether a reset before the response (or a per-try timeout) is worth another try.
    pub fn retries_reset(&self) -> bool {
        self.retry_on & (retry_on::RESET | retry_on::FIVE_XX | retry_on::GATEWAY_ERROR) != 0
    }
}

#[derive(Debug)]
pub enum PathRedirect {
    Keep,
    Path(String),
    Prefix(String),
}

#[derive(Debug)]
pub struct Redirect {
    pub scheme: Option<String>,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub path: PathRedirect,
    pub status: StatusCode,
    pub strip_query: bool,
}

/// A route action's CONNECT upgrade (served by `http::connect`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectUpgrade {
    /// `connect_config` is set: terminate here (else the CONNECT would be proxied on).
    pub terminate: bool,
}

/// A filter's compiled per-route config; the filter downcasts it
/// ([`crate::http::filter::StreamCtx::route_config`]; Envoy's
/// `RouteSpecificFilterConfig`).
pub trait RouteSpecificConfig: fmt::Debug + Send + Sync {
    fn as_any(&self) -> &dyn Any;

    /// Whether it keeps run-time state (a local rate limit's token bucket): then the
    /// route configuration holding it is each proxy's own, never shared across pods.
    fn holds_state(&self) -> bool {
        false
    }
}

/// One `typed_per_filter_config` entry.
#[derive(Debug, Clone, Default)]
pub struct PerFilterConfig {
    /// The filter is off for this route (or, when false and the filter is disabled in
    /// the connection manager, on).
    pub disabled: bool,
    /// `None`: only `disabled` was given (a `FilterConfig` without `config`), or the
    /// filter is not implemented and the entry was optional.
    pub config: Option<Arc<dyn RouteSpecificConfig>>,
}

/// Filter name to its entry; empty (and unallocated) for most routes.
pub type PerFilterConfigs = HashMap<String, PerFilterConfig>;
