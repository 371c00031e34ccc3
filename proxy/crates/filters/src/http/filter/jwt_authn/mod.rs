//! Envoy's JWT authentication filter (`envoy.filters.http.jwt_authn`), as istiod writes
//! it for a RequestAuthentication: providers (issuer, audiences, where the token is,
//! local or remote JWKS, what is forwarded and what goes into dynamic metadata for
//! RBAC's `requestPrincipals` / `request.auth.claims`) and the requirements
//! (`rules` by route match, `requirement_map` for `PerRouteConfig`). Compiled here;
//! [`jwt`] parses tokens, [`jwks`] checks signatures, [`filter`] runs a stream.

use std::collections::HashMap;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::http_uri::HttpUpstreamType;
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    JwtAuthentication, JwtProvider, JwtRequirement, PerRouteConfig, jwt_provider,
    jwt_requirement::RequiresType, per_route_config::RequirementSpecifier,
    requirement_rule::RequirementType,
};
use hyper::header::HeaderName;

use crate::http::route::RouteMatch;
use crate::http::route_config::{data_source, route_match};
use shunt_config::{Diagnostics, JsonPath, convert};

pub mod filter;
pub mod jwks;
pub mod jwt;
#[cfg(test)]
mod tests;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication";
pub const PER_ROUTE_TYPE_NAME: &str = "envoy.extensions.filters.http.jwt_authn.v3.PerRouteConfig";
/// The dynamic metadata namespace of the payloads (what Istio's RBAC reads).
pub const METADATA_NAMESPACE: &str = "envoy.filters.http.jwt_authn";

const DEFAULT_CLOCK_SKEW: u64 = 60;
const DEFAULT_CACHE_DURATION: Duration = Duration::from_secs(600);
const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(1);

/// Where a provider looks for tokens.
#[derive(Debug, Clone, Default)]
pub struct Locations {
    /// Header and the prefix before the token (`Authorization`, `Bearer `).
    pub headers: Vec<(HeaderName, String)>,
    pub params: Vec<String>,
    pub cookies: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct RemoteJwks {
    pub cluster: String,
    pub authority: String,
    pub path: String,
    pub timeout: Duration,
    pub cache_duration: Duration,
}

#[derive(Debug, Clone)]
pub enum KeySource {
    /// `local_jwks`, or why it cannot be used (every token then fails).
    Local(Result<jwks::Jwks, String>),
    Remote(RemoteJwks),
}

#[derive(Debug, Clone)]
pub struct Provider {
    pub name: String,
    pub issuer: String,
    pub audiences: Vec<String>,
    pub require_expiration: bool,
    pub clock_skew: u64,
    pub locations: Locations,
    pub forward: bool,
    pub forward_payload_header: Option<HeaderName>,
    pub pad_forward_payload_header: bool,
    pub payload_in_metadata: String,
    pub header_in_metadata: String,
    pub space_delimited_claims: Vec<String>,
    /// Header and the claim's path (`a.b` is nested).
    pub claim_to_headers: Vec<(HeaderName, Vec<String>)>,
    pub keys: KeySource,
}

impl Provider {
    /// `isIssuerAllowed`: a provider without issuer takes any, a token without one
    /// fits any provider.
    pub fn issuer_allowed(&self, iss: &str) -> bool {
        self.issuer.is_empty() || iss.is_empty() || self.issuer == iss
    }
}

/// A `JwtRequirement`, providers by index.
#[derive(Debug, Clone)]
pub enum Requirement {
    Provider {
        provider: usize,
        /// `provider_and_audiences`: these instead of the provider's.
        audiences: Option<Vec<String>>,
    },
    Any(Vec<Requirement>),
    All(Vec<Requirement>),
    AllowMissing,
    AllowMissingOrFailed,
}

#[derive(Debug)]
pub struct Rule {
    pub route_match: RouteMatch,
    /// `None`: no requirement on matching requests.
    pub requires: Option<Requirement>,
}

#[derive(Debug)]
pub struct JwtAuthnConfig {
    pub providers: Vec<Provider>,
    pub rules: Vec<Rule>,
    pub requirement_map: HashMap<String, Requirement>,
    pub bypass_cors_preflight: bool,
    pub strip_failure_response: bool,
    pub stat_prefix: String,
}

/// `PerRouteConfig`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PerRoute {
    Disabled,
    RequirementName(String),
}

pub fn compile(
    config: &JwtAuthentication,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<JwtAuthnConfig> {
    let errors_before = problems.errors.len();
    if config.filter_state_rules.is_some() {
        problems.error(
            path.field("filter_state_rules"),
            "filter_state_rules are not implemented",
        );
    }
    let mut names: Vec<&String> = config.providers.keys().collect();
    names.sort();
    let providers: Vec<Provider> = names
        .iter()
        .filter_map(|name| {
            let p_path = path.field("providers").field(name);
            provider(name, &config.providers[*name], &p_path, problems)
        })
        .collect();
    let index: HashMap<&str, usize> = providers
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let rules = config
        .rules
        .iter()
        .enumerate()
        .filter_map(|(i, rule)| {
            let r_path = path.field("rules").index(i);
            let route_match = route_match(rule.r#match.as_ref(), &r_path.field("match"), problems)?;
            let requires = match &rule.requirement_type {
                None => None,
                Some(RequirementType::Requires(r)) => {
                    Some(requirement(r, &index, &r_path.field("requires"), problems)?)
                }
                Some(RequirementType::RequirementName(name)) => {
                    let Some(r) = config.requirement_map.get(name) else {
                        problems.error(
                            r_path.field("requirement_name"),
                            format!("{name:?} is not in requirement_map"),
                        );
                        return None;
                    };
                    let m_path = path.field("requirement_map").field(name);
                    Some(requirement(r, &index, &m_path, problems)?)
                }
            };
            Some(Rule {
                route_match,
                requires,
            })
        })
        .collect();
    let requirement_map = config
        .requirement_map
        .iter()
        .filter_map(|(name, r)| {
            let m_path = path.field("requirement_map").field(name);
            Some((name.clone(), requirement(r, &index, &m_path, problems)?))
        })
        .collect();
    (problems.errors.len() == errors_before).then(|| JwtAuthnConfig {
        providers,
        rules,
        requirement_map,
        bypass_cors_preflight: config.bypass_cors_preflight,
        strip_failure_response: config.strip_failure_response,
        stat_prefix: config.stat_prefix.clone(),
    })
}

pub fn compile_per_route(
    config: &PerRouteConfig,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<PerRoute> {
    match &config.requirement_specifier {
        Some(RequirementSpecifier::Disabled(true)) => Some(PerRoute::Disabled),
        Some(RequirementSpecifier::RequirementName(name)) if !name.is_empty() => {
            Some(PerRoute::RequirementName(name.clone()))
        }
        _ => {
            problems.error(path, "needs disabled: true or a requirement_name");
            None
        }
    }
}

fn header_name(name: &str, path: &JsonPath, problems: &mut Diagnostics) -> Option<HeaderName> {
    match HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()) {
        Ok(h) => Some(h),
        Err(_) => {
            problems.error(path, format!("{name:?} is not a valid header name"));
            None
        }
    }
}

fn locations(p: &JwtProvider, path: &JsonPath, problems: &mut Diagnostics) -> Locations {
    if p.from_headers.is_empty() && p.from_params.is_empty() && p.from_cookies.is_empty() {
        // Envoy's default: a bearer token, or the `access_token` query parameter.
        return Locations {
            headers: vec![(hyper::header::AUTHORIZATION, "Bearer ".into())],
            params: vec!["access_token".into()],
            cookies: Vec::new(),
        };
    }
    let headers = p
        .from_headers
        .iter()
        .enumerate()
        .filter_map(|(i, h)| {
            let h_path = path.field("from_headers").index(i).field("name");
            Some((
                header_name(&h.name, &h_path, problems)?,
                h.value_prefix.clone(),
            ))
        })
        .collect();
    Locations {
        headers,
        params: p.from_params.clone(),
        cookies: p.from_cookies.clone(),
    }
}

fn keys(p: &JwtProvider, path: &JsonPath, problems: &mut Diagnostics) -> Option<KeySource> {
    match &p.jwks_source_specifier {
        Some(jwt_provider::JwksSourceSpecifier::LocalJwks(source)) => {
            let l_path = path.field("local_jwks");
            let text = data_source(source, &l_path, problems);
            let parsed = jwks::Jwks::parse(&text);
            if let Err(err) = &parsed {
                problems.warning(l_path, format!("{err}: every token of this provider fails"));
            }
            Some(KeySource::Local(parsed))
        }
        Some(jwt_provider::JwksSourceSpecifier::RemoteJwks(remote)) => {
            let r_path = path.field("remote_jwks");
            let Some(uri) = &remote.http_uri else {
                problems.error(r_path.field("http_uri"), "is required");
                return None;
            };
            let u_path = r_path.field("http_uri");
            let Some(HttpUpstreamType::Cluster(cluster)) = &uri.http_upstream_type else {
                problems.error(u_path.field("cluster"), "is required");
                return None;
            };
            let timeout = match &uri.timeout {
                Some(t) => convert::duration(t, &u_path.field("timeout"), problems)?,
                None => DEFAULT_FETCH_TIMEOUT,
            };
            let cache_duration = match &remote.cache_duration {
                Some(d) => convert::duration(d, &r_path.field("cache_duration"), problems)?,
                None => DEFAULT_CACHE_DURATION,
            };
            let Some((_, rest)) = uri.uri.split_once("://") else {
                problems.error(u_path.field("uri"), format!("{:?} is not a URL", uri.uri));
                return None;
            };
            let (authority, path_part) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            if remote.retry_policy.is_some() {
                problems.warning(
                    r_path.field("retry_policy"),
                    "JWKS fetch retries are not implemented; one attempt per fetch",
                );
            }
            if remote.async_fetch.is_some() {
                problems.warning(
                    r_path.field("async_fetch"),
                    "async JWKS fetching is not implemented; keys are fetched on first use",
                );
            }
            Some(KeySource::Remote(RemoteJwks {
                cluster: cluster.clone(),
                authority: authority.to_owned(),
                path: if path_part.is_empty() {
                    "/".into()
                } else {
                    path_part.to_owned()
                },
                timeout,
                cache_duration,
            }))
        }
        None => {
            problems.error(path, "a provider needs remote_jwks or local_jwks");
            None
        }
    }
}

fn provider(
    name: &str,
    p: &JwtProvider,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Provider> {
    for (set, field) in [
        (p.subjects.is_some(), "subjects"),
        (p.max_lifetime.is_some(), "max_lifetime"),
        (
            !p.failed_status_in_metadata.is_empty(),
            "failed_status_in_metadata",
        ),
    ] {
        if set {
            problems.error(path.field(field), format!("{field} is not implemented"));
        }
    }
    if p.jwt_cache_config.is_some() {
        problems.warning(
            path.field("jwt_cache_config"),
            "the verified-token cache is not implemented; every token is verified",
        );
    }
    let forward_payload_header = match p.forward_payload_header.as_str() {
        "" => None,
        h => Some(header_name(
            h,
            &path.field("forward_payload_header"),
            problems,
        )?),
    };
    let claim_to_headers = p
        .claim_to_headers
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let c_path = path.field("claim_to_headers").index(i);
            let header = header_name(&c.header_name, &c_path.field("header_name"), problems)?;
            let claim = if c.claim_path.is_empty() {
                c.claim_name.split('.').map(str::to_owned).collect()
            } else {
                c.claim_path.iter().map(|s| s.key.clone()).collect()
            };
            Some((header, claim))
        })
        .collect();
    Some(Provider {
        name: name.to_owned(),
        issuer: p.issuer.clone(),
        audiences: p.audiences.clone(),
        require_expiration: p.require_expiration,
        clock_skew: if p.clock_skew_seconds == 0 {
            DEFAULT_CLOCK_SKEW
        } else {
            u64::from(p.clock_skew_seconds)
        },
        locations: locations(p, path, problems),
        forward: p.forward,
        forward_payload_header,
        pad_forward_payload_header: p.pad_forward_payload_header,
        payload_in_metadata: p.payload_in_metadata.clone(),
        header_in_metadata: p.header_in_metadata.clone(),
        space_delimited_claims: p
            .normalize_payload_in_metadata
            .as_ref()
            .map(|n| n.space_delimited_claims.clone())
            .unwrap_or_default(),
        claim_to_headers,
        keys: keys(p, path, problems)?,
    })
}

fn requirement(
    r: &JwtRequirement,
    index: &HashMap<&str, usize>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Requirement> {
    let provider = |name: &str, path: JsonPath, problems: &mut Diagnostics| {
        let found = index.get(name).copied();
        if found.is_none() {
            problems.error(path, format!("provider {name:?} is not in providers"));
        }
        found
    };
    let list = |items: &[JwtRequirement], field: &str, problems: &mut Diagnostics| {
        items
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let l_path = path.field(field).field("requirements").index(i);
                requirement(r, index, &l_path, problems)
            })
            .collect::<Option<Vec<_>>>()
    };
    Some(match &r.requires_type {
        Some(RequiresType::ProviderName(name)) => Requirement::Provider {
            provider: provider(name, path.field("provider_name"), problems)?,
            audiences: None,
        },
        Some(RequiresType::ProviderAndAudiences(p)) => Requirement::Provider {
            provider: provider(
                &p.provider_name,
                path.field("provider_and_audiences").field("provider_name"),
                problems,
            )?,
            audiences: Some(p.audiences.clone()),
        },
        Some(RequiresType::RequiresAny(any)) => {
            Requirement::Any(list(&any.requirements, "requires_any", problems)?)
        }
        Some(RequiresType::RequiresAll(all)) => {
            Requirement::All(list(&all.requirements, "requires_all", problems)?)
        }
        Some(RequiresType::AllowMissing(_)) => Requirement::AllowMissing,
        Some(RequiresType::AllowMissingOrFailed(_)) => Requirement::AllowMissingOrFailed,
        Some(RequiresType::ExtractOnlyWithoutValidation(_)) => {
            problems.error(
                path.field("extract_only_without_validation"),
                "extract_only_without_validation is not implemented",
            );
            return None;
        }
        None => {
            problems.error(path, "a requirement needs one of its kinds");
            return None;
        }
    })
}
