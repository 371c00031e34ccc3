//! Envoy's RBAC engine (`envoy.config.rbac.v3.RBAC`), shared by the HTTP and network
//! RBAC filters: policies of permissions (what is asked) and principals (who asks),
//! and the action (ALLOW, DENY, LOG) that turns "a policy matched" into a decision.
//!
//! Matching follows Envoy's: a policy matches when any of its permissions and any of
//! its principals match; policies are tried in name order (Envoy keeps them in an
//! ordered map), so the effective policy is the first by name.

use std::net::SocketAddr;

use envoy_types::pb::envoy::config::rbac::v3::{
    Permission as EnvoyPermission, Policy as EnvoyPolicy, Principal as EnvoyPrincipal,
    Rbac as EnvoyRbac, permission::Rule, principal::Identifier, rbac::Action as EnvoyAction,
};
use envoy_types::pb::envoy::r#type::matcher::v3::{
    MetadataMatcher as EnvoyMetadataMatcher, ValueMatcher as EnvoyValueMatcher, double_matcher,
    filter_state_matcher, list_matcher, metadata_matcher::path_segment, value_matcher,
};
use ipnet::IpNet;
use prost::Message;
use regex::Regex;

use crate::common::matcher::{self, HeaderMatcher, RequestView, StringMatcher};
use shunt_config::convert::cidr;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::{Connection, StreamInfo};

/// What a decision is made about: the connection, and for HTTP the request and its
/// stream info.
#[derive(Clone, Copy)]
pub struct Subject<'a> {
    pub connection: &'a Connection,
    pub request: Option<&'a RequestView<'a>>,
    pub info: Option<&'a StreamInfo>,
}

impl Subject<'_> {
    fn header(&self, matcher: &HeaderMatcher) -> bool {
        match self.request {
            Some(request) => matcher.matches(request),
            // Envoy's network RBAC matches headers against an empty header map.
            None => matcher.matches_value(None),
        }
    }

    fn path(&self) -> Option<&str> {
        self.request.map(|r| r.path_only())
    }

    fn filter_state(&self, key: &str) -> Option<String> {
        match self.info {
            Some(info) => info.filter_state_string(key),
            None => self.connection.filter_state.get_string(key),
        }
    }

    fn metadata(&self, namespace: &str, path: &[String]) -> Option<&serde_json::Value> {
        match self.info {
            Some(info) => info.metadata_value(namespace, path),
            None => self.connection.metadata.value(namespace, path),
        }
    }
}

/// Envoy's RBAC action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Allow,
    Deny,
    /// Always allowed; a match only marks the request for the access log.
    Log,
}

/// The engine's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    /// The first matching policy's name, if any matched.
    pub effective_policy_id: Option<String>,
}

#[derive(Debug)]
pub struct Engine {
    pub action: Action,
    /// By name, as Envoy orders them.
    policies: Vec<(String, Policy)>,
}

#[derive(Debug)]
struct Policy {
    permissions: Vec<Permission>,
    principals: Vec<Principal>,
}

#[derive(Debug)]
enum Permission {
    And(Vec<Permission>),
    Or(Vec<Permission>),
    Not(Box<Permission>),
    Any,
    Header(HeaderMatcher),
    UrlPath(StringMatcher),
    UriTemplate(Regex),
    DestinationIp(IpNet),
    DestinationPort(u16),
    /// `[start, end)`.
    DestinationPortRange(i64, i64),
    RequestedServerName(StringMatcher),
    Metadata(MetadataMatcher),
}

#[derive(Debug)]
enum Principal {
    And(Vec<Principal>),
    Or(Vec<Principal>),
    Not(Box<Principal>),
    Any,
    /// `None`: any peer that presented a certificate.
    Authenticated(Option<StringMatcher>),
    DirectRemoteIp(IpNet),
    RemoteIp(IpNet),
    Header(HeaderMatcher),
    UrlPath(StringMatcher),
    Metadata(MetadataMatcher),
    FilterState(String, StringMatcher),
}

#[derive(Debug)]
struct MetadataMatcher {
    filter: String,
    path: Vec<String>,
    value: ValueMatcher,
    invert: bool,
}

#[derive(Debug)]
enum ValueMatcher {
    Null,
    Double(DoubleMatch),
    String(StringMatcher),
    Bool(bool),
    Present(bool),
    /// `list_match.one_of`: some element of a list matches.
    ListOneOf(Box<ValueMatcher>),
    Or(Vec<ValueMatcher>),
}

#[derive(Debug)]
enum DoubleMatch {
    Exact(f64),
    /// `[start, end)`.
    Range(f64, f64),
}

impl Engine {
    /// Compiles `rbac` at `path`; errors go to `problems`.
    pub fn compile(
        rbac: &EnvoyRbac,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Engine> {
        let errors_before = problems.errors.len();
        let action = match EnvoyAction::try_from(rbac.action) {
            Ok(EnvoyAction::Allow) => Action::Allow,
            Ok(EnvoyAction::Deny) => Action::Deny,
            Ok(EnvoyAction::Log) => Action::Log,
            Err(_) => {
                problems.error(path.field("action"), "unknown action");
                Action::Allow
            }
        };
        if rbac.audit_logging_options.is_some() {
            problems.warning(
                path.field("audit_logging_options"),
                "RBAC audit logging is not implemented; ignored",
            );
        }
        let mut names: Vec<&String> = rbac.policies.keys().collect();
        names.sort();
        let mut policies = Vec::with_capacity(names.len());
        for name in names {
            let p_path = path.field("policies").key(name);
            if let Some(policy) = compile_policy(&rbac.policies[name], &p_path, problems) {
                policies.push((name.clone(), policy));
            }
        }
        (problems.errors.len() == errors_before).then_some(Engine { action, policies })
    }

    /// Envoy's `handleAction`.
    pub fn decide(&self, subject: &Subject<'_>) -> Decision {
        let matched = self
            .policies
            .iter()
            .find(|(_, policy)| policy.matches(subject))
            .map(|(name, _)| name.clone());
        let allowed = match self.action {
            Action::Allow => matched.is_some(),
            Action::Deny => matched.is_none(),
            Action::Log => true,
        };
        Decision {
            allowed,
            effective_policy_id: matched,
        }
    }
}

fn compile_policy(
    policy: &EnvoyPolicy,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Policy> {
    if policy.condition.is_some() || policy.checked_condition.is_some() {
        problems.error(
            path.field("condition"),
            "RBAC CEL conditions are not implemented",
        );
        return None;
    }
    if policy.permissions.is_empty() {
        problems.error(path.field("permissions"), "needs at least one permission");
    }
    if policy.principals.is_empty() {
        problems.error(path.field("principals"), "needs at least one principal");
    }
    let permissions = policy
        .permissions
        .iter()
        .enumerate()
        .map(|(i, p)| permission(p, &path.field("permissions").index(i), problems))
        .collect::<Option<Vec<_>>>();
    let principals = policy
        .principals
        .iter()
        .enumerate()
        .map(|(i, p)| principal(p, &path.field("principals").index(i), problems))
        .collect::<Option<Vec<_>>>();
    Some(Policy {
        permissions: permissions?,
        principals: principals?,
    })
}

fn ip_range(
    range: &envoy_types::pb::envoy::config::core::v3::CidrRange,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<IpNet> {
    cidr(range, path, problems)
}

#[allow(
    deprecated,
    reason = "`metadata` is deprecated for `sourced_metadata`; Istio still writes it"
)]
fn permission(
    p: &EnvoyPermission,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Permission> {
    let set = |rules: &[EnvoyPermission], field: &str, problems: &mut Diagnostics| {
        rules
            .iter()
            .enumerate()
            .map(|(i, r)| permission(r, &path.field(field).field("rules").index(i), problems))
            .collect::<Option<Vec<_>>>()
    };
    Some(match &p.rule {
        Some(Rule::AndRules(s)) => Permission::And(set(&s.rules, "and_rules", problems)?),
        Some(Rule::OrRules(s)) => Permission::Or(set(&s.rules, "or_rules", problems)?),
        Some(Rule::NotRule(inner)) => Permission::Not(Box::new(permission(
            inner,
            &path.field("not_rule"),
            problems,
        )?)),
        Some(Rule::Any(_)) => Permission::Any,
        Some(Rule::Header(h)) => {
            Permission::Header(matcher::header_matcher(h, &path.field("header"), problems)?)
        }
        Some(Rule::UrlPath(m)) => {
            Permission::UrlPath(path_matcher(m, &path.field("url_path"), problems)?)
        }
        Some(Rule::DestinationIp(r)) => {
            Permission::DestinationIp(ip_range(r, &path.field("destination_ip"), problems)?)
        }
        Some(Rule::DestinationPort(port)) => match u16::try_from(*port) {
            Ok(port) => Permission::DestinationPort(port),
            Err(_) => {
                problems.error(
                    path.field("destination_port"),
                    format!("{port} is not a port"),
                );
                return None;
            }
        },
        Some(Rule::DestinationPortRange(r)) => {
            Permission::DestinationPortRange(i64::from(r.start), i64::from(r.end))
        }
        Some(Rule::RequestedServerName(m)) => Permission::RequestedServerName(
            matcher::string_matcher(m, &path.field("requested_server_name"), problems)?,
        ),
        Some(Rule::Metadata(m)) => {
            Permission::Metadata(metadata_matcher(m, &path.field("metadata"), problems)?)
        }
        Some(Rule::UriTemplate(config)) => {
            Permission::UriTemplate(uri_template(config, &path.field("uri_template"), problems)?)
        }
        Some(Rule::Matcher(_)) => {
            problems.error(
                path.field("matcher"),
                "extension permission matchers are not implemented",
            );
            return None;
        }
        Some(Rule::SourcedMetadata(_)) => {
            problems.error(
                path.field("sourced_metadata"),
                "sourced_metadata is not implemented",
            );
            return None;
        }
        None => {
            problems.error(path, "a permission needs a rule");
            return None;
        }
    })
}

#[allow(
    deprecated,
    reason = "source_ip is Envoy's older name of direct_remote_ip"
)]
fn principal(p: &EnvoyPrincipal, path: &JsonPath, problems: &mut Diagnostics) -> Option<Principal> {
    let set = |ids: &[EnvoyPrincipal], field: &str, problems: &mut Diagnostics| {
        ids.iter()
            .enumerate()
            .map(|(i, id)| principal(id, &path.field(field).field("ids").index(i), problems))
            .collect::<Option<Vec<_>>>()
    };
    Some(match &p.identifier {
        Some(Identifier::AndIds(s)) => Principal::And(set(&s.ids, "and_ids", problems)?),
        Some(Identifier::OrIds(s)) => Principal::Or(set(&s.ids, "or_ids", problems)?),
        Some(Identifier::NotId(inner)) => {
            Principal::Not(Box::new(principal(inner, &path.field("not_id"), problems)?))
        }
        Some(Identifier::Any(_)) => Principal::Any,
        Some(Identifier::Authenticated(a)) => Principal::Authenticated(match &a.principal_name {
            Some(m) => Some(matcher::string_matcher(
                m,
                &path.field("authenticated").field("principal_name"),
                problems,
            )?),
            None => None,
        }),
        Some(Identifier::SourceIp(r)) => {
            Principal::DirectRemoteIp(ip_range(r, &path.field("source_ip"), problems)?)
        }
        Some(Identifier::DirectRemoteIp(r)) => {
            Principal::DirectRemoteIp(ip_range(r, &path.field("direct_remote_ip"), problems)?)
        }
        Some(Identifier::RemoteIp(r)) => {
            Principal::RemoteIp(ip_range(r, &path.field("remote_ip"), problems)?)
        }
        Some(Identifier::Header(h)) => {
            Principal::Header(matcher::header_matcher(h, &path.field("header"), problems)?)
        }
        Some(Identifier::UrlPath(m)) => {
            Principal::UrlPath(path_matcher(m, &path.field("url_path"), problems)?)
        }
        Some(Identifier::Metadata(m)) => {
            Principal::Metadata(metadata_matcher(m, &path.field("metadata"), problems)?)
        }
        Some(Identifier::FilterState(f)) => {
            let f_path = path.field("filter_state");
            match &f.matcher {
                Some(filter_state_matcher::Matcher::StringMatch(m)) => Principal::FilterState(
                    f.key.clone(),
                    matcher::string_matcher(m, &f_path.field("string_match"), problems)?,
                ),
                _ => {
                    problems.error(
                        &f_path,
                        "only string_match filter state matchers are implemented",
                    );
                    return None;
                }
            }
        }
        Some(Identifier::SourcedMetadata(_)) => {
            problems.error(
                path.field("sourced_metadata"),
                "sourced_metadata is not implemented",
            );
            return None;
        }
        Some(Identifier::Custom(_)) => {
            problems.error(
                path.field("custom"),
                "custom principals are not implemented",
            );
            return None;
        }
        None => {
            problems.error(path, "a principal needs an identifier");
            return None;
        }
    })
}

fn path_matcher(
    m: &envoy_types::pb::envoy::r#type::matcher::v3::PathMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<StringMatcher> {
    use envoy_types::pb::envoy::r#type::matcher::v3::path_matcher::Rule;
    match &m.rule {
        Some(Rule::Path(s)) => matcher::string_matcher(s, &path.field("path"), problems),
        None => {
            problems.error(path, "a path matcher needs path");
            None
        }
    }
}

/// Envoy's `uri_template` path matcher (`UriTemplateMatchConfig.path_template`): `*`
/// and `{name}` match one segment, `**` and `{name=**}` any number; the rest literally.
fn uri_template(
    config: &envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Regex> {
    use envoy_types::pb::envoy::extensions::path::r#match::uri_template::v3::UriTemplateMatchConfig;
    let typed_path = path.field("typed_config");
    let any = config.typed_config.as_ref().or_else(|| {
        problems.error(&typed_path, "is required");
        None
    })?;
    let any = shunt_config::typed_struct::unwrap(any, &typed_path, problems)?;
    let template =
        shunt_config::convert::decode::<UriTemplateMatchConfig>(&any, &typed_path, problems)?;
    let mut pattern = String::from("^");
    let mut rest = template.path_template.as_str();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("**") {
            pattern.push_str(".*");
            rest = after;
        } else if let Some(after) = rest.strip_prefix('*') {
            pattern.push_str("[^/]+");
            rest = after;
        } else if let Some(after) = rest.strip_prefix('{') {
            let Some((variable, after)) = after.split_once('}') else {
                problems.error(typed_path.field("path_template"), "an unclosed {");
                return None;
            };
            pattern.push_str(if variable.ends_with("=**") {
                ".*"
            } else {
                "[^/]+"
            });
            rest = after;
        } else {
            let next = rest.find(['*', '{']).unwrap_or(rest.len());
            pattern.push_str(&regex::escape(&rest[..next]));
            rest = &rest[next..];
        }
    }
    pattern.push('$');
    match Regex::new(&pattern) {
        Ok(regex) => Some(regex),
        Err(err) => {
            problems.error(typed_path.field("path_template"), err.to_string());
            None
        }
    }
}

fn metadata_matcher(
    m: &EnvoyMetadataMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<MetadataMatcher> {
    let keys = m
        .path
        .iter()
        .map(|segment| {
            segment
                .segment
                .as_ref()
                .map(|path_segment::Segment::Key(key)| key.clone())
        })
        .collect::<Option<Vec<_>>>();
    let Some(keys) = keys.filter(|k| !k.is_empty()) else {
        problems.error(path.field("path"), "needs at least one key");
        return None;
    };
    let Some(value) = &m.value else {
        problems.error(path.field("value"), "is required");
        return None;
    };
    Some(MetadataMatcher {
        filter: m.filter.clone(),
        path: keys,
        value: value_matcher(value, &path.field("value"), problems)?,
        invert: m.invert,
    })
}

fn value_matcher(
    m: &EnvoyValueMatcher,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ValueMatcher> {
    use value_matcher::MatchPattern;
    Some(match &m.match_pattern {
        Some(MatchPattern::NullMatch(_)) => ValueMatcher::Null,
        Some(MatchPattern::DoubleMatch(d)) => ValueMatcher::Double(match &d.match_pattern {
            Some(double_matcher::MatchPattern::Exact(x)) => DoubleMatch::Exact(*x),
            Some(double_matcher::MatchPattern::Range(r)) => DoubleMatch::Range(r.start, r.end),
            None => {
                problems.error(path.field("double_match"), "needs exact or range");
                return None;
            }
        }),
        Some(MatchPattern::StringMatch(s)) => ValueMatcher::String(matcher::string_matcher(
            s,
            &path.field("string_match"),
            problems,
        )?),
        Some(MatchPattern::BoolMatch(b)) => ValueMatcher::Bool(*b),
        Some(MatchPattern::PresentMatch(p)) => ValueMatcher::Present(*p),
        Some(MatchPattern::ListMatch(l)) => match &l.match_pattern {
            Some(list_matcher::MatchPattern::OneOf(inner)) => ValueMatcher::ListOneOf(Box::new(
                value_matcher(inner, &path.field("list_match").field("one_of"), problems)?,
            )),
            None => {
                problems.error(path.field("list_match"), "needs one_of");
                return None;
            }
        },
        Some(MatchPattern::OrMatch(or)) => ValueMatcher::Or(
            or.value_matchers
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    value_matcher(
                        v,
                        &path.field("or_match").field("value_matchers").index(i),
                        problems,
                    )
                })
                .collect::<Option<Vec<_>>>()?,
        ),
        None => {
            problems.error(path, "a value matcher needs a pattern");
            return None;
        }
    })
}

impl ValueMatcher {
    /// Envoy's `ValueMatcher::match` on a `google.protobuf.Value` (as JSON).
    fn matches(&self, value: Option<&serde_json::Value>) -> bool {
        use serde_json::Value;
        match (self, value) {
            (ValueMatcher::Present(present), v) => *present == v.is_some_and(|v| !v.is_null()),
            (_, None) => false,
            (ValueMatcher::Null, Some(v)) => v.is_null(),
            (ValueMatcher::Double(d), Some(Value::Number(n))) => {
                let x = n.as_f64().unwrap_or(f64::NAN);
                match d {
                    DoubleMatch::Exact(e) => x == *e,
                    DoubleMatch::Range(start, end) => *start <= x && x < *end,
                }
            }
            (ValueMatcher::String(s), Some(Value::String(text))) => s.matches(text),
            (ValueMatcher::Bool(b), Some(Value::Bool(v))) => b == v,
            (ValueMatcher::ListOneOf(inner), Some(Value::Array(items))) => {
                items.iter().any(|item| inner.matches(Some(item)))
            }
            (ValueMatcher::Or(matchers), v) => matchers.iter().any(|m| m.matches(v)),
            _ => false,
        }
    }
}

impl MetadataMatcher {
    fn matches(&self, subject: &Subject<'_>) -> bool {
        let value = subject.metadata(&self.filter, &self.path);
        self.value.matches(value) != self.invert
    }
}

fn in_range(range: &IpNet, address: SocketAddr) -> bool {
    range.contains(&address.ip().to_canonical())
}

impl Permission {
    fn matches(&self, s: &Subject<'_>) -> bool {
        match self {
            Permission::And(rules) => rules.iter().all(|r| r.matches(s)),
            Permission::Or(rules) => rules.iter().any(|r| r.matches(s)),
            Permission::Not(rule) => !rule.matches(s),
            Permission::Any => true,
            Permission::Header(h) => s.header(h),
            Permission::UrlPath(m) => s.path().is_some_and(|p| m.matches(p)),
            Permission::UriTemplate(re) => s.path().is_some_and(|p| re.is_match(p)),
            Permission::DestinationIp(range) => in_range(range, s.connection.local),
            Permission::DestinationPort(port) => s.connection.local.port() == *port,
            Permission::DestinationPortRange(start, end) => {
                let port = i64::from(s.connection.local.port());
                *start <= port && port < *end
            }
            Permission::RequestedServerName(m) => {
                m.matches(s.connection.requested_server_name.as_deref().unwrap_or(""))
            }
            Permission::Metadata(m) => m.matches(s),
        }
    }
}

impl Principal {
    fn matches(&self, s: &Subject<'_>) -> bool {
        match self {
            Principal::And(ids) => ids.iter().all(|id| id.matches(s)),
            Principal::Or(ids) => ids.iter().any(|id| id.matches(s)),
            Principal::Not(id) => !id.matches(s),
            Principal::Any => true,
            Principal::Authenticated(name) => {
                let presented = s
                    .connection
                    .tls
                    .as_ref()
                    .is_some_and(|t| t.peer_certificate_presented);
                match name {
                    None => presented,
                    Some(m) => presented && s.connection.peer_principals().any(|p| m.matches(p)),
                }
            }
            Principal::DirectRemoteIp(range) => in_range(range, s.connection.direct_remote),
            Principal::RemoteIp(range) => in_range(range, s.connection.remote),
            Principal::Header(h) => s.header(h),
            Principal::UrlPath(m) => s.path().is_some_and(|p| m.matches(p)),
            Principal::Metadata(m) => m.matches(s),
            Principal::FilterState(key, m) => s.filter_state(key).is_some_and(|v| m.matches(&v)),
        }
    }
}

impl Policy {
    fn matches(&self, s: &Subject<'_>) -> bool {
        self.permissions.iter().any(|p| p.matches(s))
            && self.principals.iter().any(|p| p.matches(s))
    }
}

/// Decodes an RBAC message from its bytes (shared by the filters' compilers).
pub fn decode<M: Message + Default + prost::Name>(
    any: &envoy_types::pb::google::protobuf::Any,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<M> {
    shunt_config::convert::decode::<M>(any, path, problems)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::*;
    use shunt_core::stream_info::{LifeSpan, StringAccessor, Tls};

    fn engine(config: serde_json::Value) -> Engine {
        let rbac: EnvoyRbac = shunt_config::message_from_json(config).unwrap();
        let mut problems = Diagnostics::default();
        let engine = Engine::compile(&rbac, &JsonPath::new("rbac"), &mut problems);
        assert!(problems.errors.is_empty(), "{:?}", problems.errors);
        engine.unwrap()
    }

    fn connection(peer: Option<&str>) -> Connection {
        let mut c = Connection::new(
            "10.0.0.2:8080".parse().unwrap(),
            "10.1.0.7:40000".parse().unwrap(),
        );
        if let Some(peer) = peer {
            c.tls = Some(Arc::new(Tls {
                peer_certificate_presented: true,
                peer_uri_sans: vec![peer.to_owned()],
                ..Tls::default()
            }));
            c.filter_state
                .set(
                    "io.istio.peer_principal",
                    Arc::new(StringAccessor(peer.to_owned())),
                    true,
                    LifeSpan::Connection,
                )
                .unwrap();
        }
        c
    }

    fn decide(engine: &Engine, c: &Connection, method: &str, path: &str) -> Decision {
        let headers = hyper::HeaderMap::new();
        let view = RequestView {
            method,
            authority: "svc",
            path,
            scheme: "http",
            headers: &headers,
        };
        let info = StreamInfo::new(Arc::new(c.clone()));
        engine.decide(&Subject {
            connection: c,
            request: Some(&view),
            info: Some(&info),
        })
    }

    #[test]
    fn istio_style_allow_policy() {
        let e = engine(json!({"policies": {
            "b-second": {"permissions": [{"any": true}], "principals": [{"remote_ip": {"address_prefix": "10.9.0.0", "prefix_len": 16}}]},
            "a-first": {
                "permissions": [{"and_rules": {"rules": [
                    {"or_rules": {"rules": [{"header": {"name": ":method", "exact_match": "GET"}}]}},
                    {"or_rules": {"rules": [{"url_path": {"path": {"prefix": "/info"}}}]}},
                    {"destination_port_range": {"start": 8000, "end": 8081}}
                ]}}],
                "principals": [{"and_ids": {"ids": [{"or_ids": {"ids": [
                    {"filter_state": {"key": "io.istio.peer_principal", "string_match": {"exact": "spiffe://cluster.local/ns/default/sa/sleep"}}},
                    {"authenticated": {"principal_name": {"suffix": "/sa/curl"}}}
                ]}}]}}]
            }
        }}));
        let sleep = connection(Some("spiffe://cluster.local/ns/default/sa/sleep"));
        let curl = connection(Some("spiffe://cluster.local/ns/other/sa/curl"));
        let nobody = connection(None);
        let allowed = decide(&e, &sleep, "GET", "/info?x=1");
        assert_eq!(
            allowed,
            Decision {
                allowed: true,
                effective_policy_id: Some("a-first".into())
            }
        );
        assert!(decide(&e, &curl, "GET", "/info/more").allowed);
        assert!(!decide(&e, &sleep, "POST", "/info").allowed);
        assert!(!decide(&e, &sleep, "GET", "/other?/info").allowed);
        assert_eq!(
            decide(&e, &nobody, "GET", "/info"),
            Decision {
                allowed: false,
                effective_policy_id: None
            }
        );
    }

    #[test]
    fn deny_log_not_and_metadata() {
        let deny = engine(json!({"action": "DENY", "policies": {"p": {
            "permissions": [{"not_rule": {"url_path": {"path": {"exact": "/ok"}}}}],
            "principals": [{"not_id": {"direct_remote_ip": {"address_prefix": "10.1.0.0", "prefix_len": 24}}}]
        }}}));
        let c = connection(None);
        // The remote is in 10.1.0.0/24, so the principal never matches: allowed.
        assert!(decide(&deny, &c, "GET", "/anything").allowed);
        let deny_all = engine(json!({"action": "DENY", "policies": {"p": {
            "permissions": [{"destination_ip": {"address_prefix": "10.0.0.2", "prefix_len": 32}}],
            "principals": [{"any": true}]
        }}}));
        assert!(!decide(&deny_all, &c, "GET", "/").allowed);
        let log = engine(json!({"action": "LOG", "policies": {"p": {
            "permissions": [{"any": true}], "principals": [{"any": true}]}}}));
        assert_eq!(
            decide(&log, &c, "GET", "/"),
            Decision {
                allowed: true,
                effective_policy_id: Some("p".into())
            }
        );
        let empty = engine(json!({}));
        assert!(
            !decide(&empty, &c, "GET", "/").allowed,
            "ALLOW with no policy"
        );

        let meta = engine(json!({"policies": {"p": {"permissions": [{"any": true}],
            "principals": [{"metadata": {"filter": "istio_authn", "path": [{"key": "request.auth.claims"}, {"key": "iss"}],
              "value": {"list_match": {"one_of": {"string_match": {"exact": "issuer"}}}}}}]}}}));
        let mut info = StreamInfo::new(Arc::new(c.clone()));
        let headers = hyper::HeaderMap::new();
        let view = RequestView {
            method: "GET",
            authority: "svc",
            path: "/",
            scheme: "http",
            headers: &headers,
        };
        let subject = |info: &StreamInfo| {
            meta.decide(&Subject {
                connection: &c,
                request: Some(&view),
                info: Some(info),
            })
            .allowed
        };
        assert!(!subject(&info));
        info.metadata.set(
            "istio_authn",
            json!({"request.auth.claims": {"iss": ["other", "issuer"]}})
                .as_object()
                .unwrap()
                .clone(),
        );
        assert!(subject(&info));
    }

    #[test]
    fn uri_templates_and_network_headers() {
        let e = engine(json!({"policies": {"p": {
            "permissions": [{"uri_template": {"name": "t", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.path.match.uri_template.v3.UriTemplateMatchConfig",
                "path_template": "/api/*/items/**"}}}],
            "principals": [{"any": true}]}}}));
        let c = connection(None);
        assert!(decide(&e, &c, "GET", "/api/v1/items/a/b?q").allowed);
        assert!(!decide(&e, &c, "GET", "/api/v1/x/items/a").allowed);
        // Network RBAC: no request, so header and path matchers do not match.
        let header = engine(json!({"policies": {"p": {
            "permissions": [{"header": {"name": ":method", "present_match": true}}],
            "principals": [{"any": true}]}}}));
        let network = Subject {
            connection: &c,
            request: None,
            info: None,
        };
        assert!(!header.decide(&network).allowed);
    }

    #[test]
    fn unsupported_matchers_are_errors_at_their_path() {
        let rbac: EnvoyRbac = shunt_config::message_from_json(json!({"policies": {"p": {
            "permissions": [{"any": true}],
            "principals": [{"filter_state": {"key": "k", "address_match": {}}}]}}}))
        .unwrap();
        let mut problems = Diagnostics::default();
        assert!(Engine::compile(&rbac, &JsonPath::new("rbac"), &mut problems).is_none());
        assert_eq!(
            problems.errors[0].path,
            "rbac.policies[\"p\"].principals[0].filter_state"
        );
    }
}
