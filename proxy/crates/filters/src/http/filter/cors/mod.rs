//! Envoy's CORS filter (`envoy.filters.http.cors`): the policies (`CorsPolicy` in a
//! route's or virtual host's `typed_per_filter_config`, else their deprecated `cors`
//! field) compiled, and the two decisions the filter makes: the answer to a preflight
//! and the headers a simple cross-origin response gains.
//!
//! As Envoy: the route's policy is asked first, then the virtual host's, field by
//! field (the first policy that sets a field wins); `filter_enabled` and
//! `shadow_enabled` come from the most specific policy; a preflight is `OPTIONS` with
//! `Origin` and `Access-Control-Request-Method`; a preflight from an origin that is not
//! allowed goes upstream unless `forward_not_matching_preflights` is false, and then it
//! gets a bare 200.

use envoy_types::pb::envoy::config::core::v3::RuntimeFractionalPercent;
use envoy_types::pb::envoy::config::route::v3::CorsPolicy as RouteCorsPolicy;
use envoy_types::pb::envoy::extensions::filters::http::cors::v3::CorsPolicy;
use envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher as EnvoyStringMatcher;
use hyper::HeaderMap;

use crate::common::matcher::{StringMatcher, string_matcher};
use crate::common::percent::Percent;
use shunt_config::{Diagnostics, JsonPath};

pub mod filter;
#[cfg(test)]
mod tests;

pub const FILTER_TYPE_NAME: &str = "envoy.extensions.filters.http.cors.v3.Cors";
pub const POLICY_TYPE_NAME: &str = "envoy.extensions.filters.http.cors.v3.CorsPolicy";

/// One compiled policy; `None`/empty fields defer to the next, less specific policy.
#[derive(Debug, Default)]
pub struct Policy {
    pub allow_origins: Vec<StringMatcher>,
    pub allow_methods: String,
    pub allow_headers: String,
    pub expose_headers: String,
    pub max_age: String,
    pub allow_credentials: Option<bool>,
    pub allow_private_network_access: Option<bool>,
    pub forward_not_matching_preflights: Option<bool>,
    /// `None`: enabled (Envoy's default).
    pub filter_enabled: Option<Percent>,
    /// `None`: not in shadow mode.
    pub shadow_enabled: Option<Percent>,
}

/// The fields both `CorsPolicy` messages share, borrowed.
struct Fields<'a> {
    origins: &'a [EnvoyStringMatcher],
    allow_methods: &'a str,
    allow_headers: &'a str,
    expose_headers: &'a str,
    max_age: &'a str,
    allow_credentials: Option<bool>,
    allow_private_network_access: Option<bool>,
    forward_not_matching_preflights: Option<bool>,
    filter_enabled: Option<&'a RuntimeFractionalPercent>,
    shadow_enabled: Option<&'a RuntimeFractionalPercent>,
}

/// A typed `CorsPolicy` (per-filter config). `path`: its JSON path.
pub fn compile(p: &CorsPolicy, path: &JsonPath, problems: &mut Diagnostics) -> Option<Policy> {
    compile_fields(
        Fields {
            origins: &p.allow_origin_string_match,
            allow_methods: &p.allow_methods,
            allow_headers: &p.allow_headers,
            expose_headers: &p.expose_headers,
            max_age: &p.max_age,
            allow_credentials: p.allow_credentials.map(|b| b.value),
            allow_private_network_access: p.allow_private_network_access.map(|b| b.value),
            forward_not_matching_preflights: p.forward_not_matching_preflights.map(|b| b.value),
            filter_enabled: p.filter_enabled.as_ref(),
            shadow_enabled: p.shadow_enabled.as_ref(),
        },
        path,
        problems,
    )
}

/// A route's or virtual host's deprecated `cors` field.
#[allow(deprecated)]
pub fn compile_route_policy(
    p: &RouteCorsPolicy,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Policy> {
    use envoy_types::pb::envoy::config::route::v3::cors_policy::EnabledSpecifier;
    compile_fields(
        Fields {
            origins: &p.allow_origin_string_match,
            allow_methods: &p.allow_methods,
            allow_headers: &p.allow_headers,
            expose_headers: &p.expose_headers,
            max_age: &p.max_age,
            allow_credentials: p.allow_credentials.map(|b| b.value),
            allow_private_network_access: p.allow_private_network_access.map(|b| b.value),
            forward_not_matching_preflights: p.forward_not_matching_preflights.map(|b| b.value),
            filter_enabled: match &p.enabled_specifier {
                Some(EnabledSpecifier::FilterEnabled(f)) => Some(f),
                None => None,
            },
            shadow_enabled: p.shadow_enabled.as_ref(),
        },
        path,
        problems,
    )
}

fn compile_fields(f: Fields<'_>, path: &JsonPath, problems: &mut Diagnostics) -> Option<Policy> {
    let before = problems.errors.len();
    let allow_origins = f
        .origins
        .iter()
        .enumerate()
        .filter_map(|(i, m)| {
            string_matcher(
                m,
                &path.field("allow_origin_string_match").index(i),
                problems,
            )
        })
        .collect();
    if problems.errors.len() > before {
        return None;
    }
    let fraction = |r: &RuntimeFractionalPercent| Percent::from_proto(r.default_value.as_ref());
    Some(Policy {
        allow_origins,
        allow_methods: f.allow_methods.to_owned(),
        allow_headers: f.allow_headers.to_owned(),
        expose_headers: f.expose_headers.to_owned(),
        max_age: f.max_age.to_owned(),
        allow_credentials: f.allow_credentials,
        allow_private_network_access: f.allow_private_network_access,
        forward_not_matching_preflights: f.forward_not_matching_preflights,
        filter_enabled: f.filter_enabled.map(fraction),
        shadow_enabled: f.shadow_enabled.map(fraction),
    })
}

/// What the filter does with a request's headers.
#[derive(Debug, PartialEq, Eq)]
pub enum OnRequest {
    /// Not a CORS request (or CORS is off): nothing now, nothing on the response.
    Ignore,
    /// Forward it; the response gains [`simple_response_headers`] when `origin` (the
    /// allowed origin) is set.
    Forward { origin: Option<String> },
    /// Answer the preflight with 200 and these headers.
    Preflight(Vec<(&'static str, String)>),
}

/// The counters a request moves.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counted {
    pub origin_valid: bool,
    pub origin_invalid: bool,
}

/// The policies that apply to a request, most specific first.
pub struct Policies<'a>(pub Vec<&'a Policy>);

impl<'a> Policies<'a> {
    fn first<T>(&self, get: impl Fn(&'a Policy) -> Option<T>) -> Option<T> {
        self.0.iter().find_map(|p| get(p))
    }

    fn text(&self, get: impl Fn(&'a Policy) -> &'a str) -> &'a str {
        self.first(|p| Some(get(p)).filter(|s| !s.is_empty()))
            .unwrap_or("")
    }

    fn enabled(&self, random: u64) -> bool {
        self.0
            .first()
            .is_some_and(|p| p.filter_enabled.is_none_or(|f| f.hit(random)))
    }

    fn shadow_enabled(&self, random: u64) -> bool {
        self.0
            .first()
            .is_some_and(|p| p.shadow_enabled.is_some_and(|f| f.hit(random)))
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        let origins = self
            .first(|p| Some(&p.allow_origins).filter(|o| !o.is_empty()))
            .map_or(&[][..], |o| o.as_slice());
        origins.iter().any(|m| m.matches("*") || m.matches(origin))
    }

    fn allow_credentials(&self) -> bool {
        self.first(|p| p.allow_credentials).unwrap_or(false)
    }

    /// Envoy's request side. `random` decides `filter_enabled`/`shadow_enabled`.
    pub fn on_request(
        &self,
        method: &str,
        headers: &HeaderMap,
        random: u64,
        counted: &mut Counted,
    ) -> OnRequest {
        let enabled = self.enabled(random);
        if !enabled && !self.shadow_enabled(random) {
            return OnRequest::Ignore;
        }
        let Some(origin) = header(headers, "origin").filter(|o| !o.is_empty()) else {
            return OnRequest::Ignore;
        };
        let allowed = self.origin_allowed(origin);
        counted.origin_valid = allowed;
        counted.origin_invalid = !allowed;
        if !enabled {
            return OnRequest::Ignore;
        }
        let forward = OnRequest::Forward {
            origin: allowed.then(|| origin.to_owned()),
        };
        let request_method = header(headers, "access-control-request-method").unwrap_or("");
        if method != "OPTIONS" || request_method.is_empty() {
            return forward;
        }
        if !allowed
            && self
                .first(|p| p.forward_not_matching_preflights)
                .unwrap_or(true)
        {
            return forward;
        }
        let mut out = Vec::new();
        if allowed {
            out.push(("access-control-allow-origin", origin.to_owned()));
        }
        if self.allow_credentials() {
            out.push(("access-control-allow-credentials", "true".to_owned()));
        }
        let echo_or = |configured: &str, requested: &str| {
            if configured == "*" {
                requested.to_owned()
            } else {
                configured.to_owned()
            }
        };
        let methods = self.text(|p| &p.allow_methods);
        if !methods.is_empty() {
            out.push((
                "access-control-allow-methods",
                echo_or(methods, request_method),
            ));
        }
        let allow_headers = self.text(|p| &p.allow_headers);
        if !allow_headers.is_empty() {
            let requested = header(headers, "access-control-request-headers").unwrap_or("");
            out.push((
                "access-control-allow-headers",
                echo_or(allow_headers, requested),
            ));
        }
        let max_age = self.text(|p| &p.max_age);
        if !max_age.is_empty() {
            out.push(("access-control-max-age", max_age.to_owned()));
        }
        if self
            .first(|p| p.allow_private_network_access)
            .unwrap_or(false)
            && header(headers, "access-control-request-private-network") == Some("true")
        {
            out.push(("access-control-allow-private-network", "true".to_owned()));
        }
        OnRequest::Preflight(out)
    }

    /// The headers a forwarded request's response gains (set, replacing the upstream's).
    pub fn simple_response_headers(&self, origin: &str) -> Vec<(&'static str, String)> {
        let mut out = vec![("access-control-allow-origin", origin.to_owned())];
        if self.allow_credentials() {
            out.push(("access-control-allow-credentials", "true".to_owned()));
        }
        let expose = self.text(|p| &p.expose_headers);
        if !expose.is_empty() {
            out.push(("access-control-expose-headers", expose.to_owned()));
        }
        out
    }
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}
