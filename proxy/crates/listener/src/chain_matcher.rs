//! Envoy's `filter_chain_matcher`: the xDS matcher API (`xds.type.matcher.v3.Matcher`)
//! choosing a listener's filter chain by name, as istiod writes it for waypoint-style
//! listeners (`main_internal`: destination IP, then port or ALPN). When a listener has
//! one, its chains' `filter_chain_match` fields are not used; no match falls back to
//! `default_filter_chain`.
//!
//! A tree looks its input up in an exact map, a prefix map (longest first) or an
//! `IPMatcher` (longest range first, less specific ones tried when a nested matcher does
//! not match, unless `exclusive`); a list takes the first predicate that holds. A
//! failed nested matcher is a non-match of its parent, which then tries
//! `on_no_match`. Actions name a chain (`google.protobuf.StringValue`).

use std::collections::HashMap;
use std::net::IpAddr;

use envoy_types::pb::google::protobuf::{Any, StringValue};
use envoy_types::pb::xds::core::v3::TypedExtensionConfig;
use envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::Predicate as PbPredicate;
use envoy_types::pb::xds::r#type::matcher::v3::matcher::matcher_list::predicate::{
    self, single_predicate,
};
use envoy_types::pb::xds::r#type::matcher::v3::matcher::{
    MatcherType, OnMatch as PbOnMatch, matcher_tree::TreeType, on_match,
};
use envoy_types::pb::xds::r#type::matcher::v3::{
    Matcher as PbMatcher, StringMatcher, string_matcher::MatchPattern,
};
use ipnet::IpNet;
use prost::Message;

use super::filter_chain::{ConnectionInfo, is_local};
use shunt_config::convert::type_name;
use shunt_config::{Diagnostics, JsonPath};

/// A connection fact the matcher reads (`envoy.extensions.matching.common_inputs.network.v3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Input {
    DestinationIp,
    DestinationPort,
    SourceIp,
    SourcePort,
    DirectSourceIp,
    SourceType,
    ServerName,
    TransportProtocol,
    ApplicationProtocol,
}

impl Input {
    fn parse(
        config: Option<&TypedExtensionConfig>,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Input> {
        let Some(any) = config.and_then(|c| c.typed_config.as_ref()) else {
            problems.error(path, "a matcher needs an input");
            return None;
        };
        let input = match type_name(any).strip_prefix(INPUT_PREFIX) {
            Some("DestinationIPInput") => Input::DestinationIp,
            Some("DestinationPortInput") => Input::DestinationPort,
            Some("SourceIPInput") => Input::SourceIp,
            Some("SourcePortInput") => Input::SourcePort,
            Some("DirectSourceIPInput") => Input::DirectSourceIp,
            Some("SourceTypeInput") => Input::SourceType,
            Some("ServerNameInput") => Input::ServerName,
            Some("TransportProtocolInput") => Input::TransportProtocol,
            Some("ApplicationProtocolInput") => Input::ApplicationProtocol,
            _ => {
                problems.error(
                    path.field("typed_config"),
                    format!(
                        "matcher input {} is not implemented for filter chains",
                        type_name(any)
                    ),
                );
                return None;
            }
        };
        Some(input)
    }

    /// The input's value for `conn`, as Envoy renders it; `None` when it has none.
    fn value(self, conn: &ConnectionInfo<'_>) -> Option<String> {
        match self {
            Input::DestinationIp => Some(conn.destination.ip().to_canonical().to_string()),
            Input::DestinationPort => Some(conn.destination.port().to_string()),
            Input::SourceIp => Some(conn.source.ip().to_canonical().to_string()),
            Input::SourcePort => Some(conn.source.port().to_string()),
            Input::DirectSourceIp => Some(conn.direct_source.ip().to_canonical().to_string()),
            Input::SourceType => is_local(conn).then(|| "local".to_owned()),
            Input::ServerName => conn
                .server_name
                .filter(|s| !s.is_empty())
                .map(str::to_owned),
            Input::TransportProtocol => {
                Some(conn.transport_protocol.to_owned()).filter(|s| !s.is_empty())
            }
            // Envoy quotes each protocol and joins them: `'h2','http/1.1'`.
            Input::ApplicationProtocol => (!conn.application_protocols.is_empty()).then(|| {
                conn.application_protocols
                    .iter()
                    .map(|p| format!("'{p}'"))
                    .collect::<Vec<_>>()
                    .join(",")
            }),
        }
    }

    fn ip(self, conn: &ConnectionInfo<'_>) -> Option<IpAddr> {
        match self {
            Input::DestinationIp => Some(conn.destination.ip().to_canonical()),
            Input::SourceIp => Some(conn.source.ip().to_canonical()),
            Input::DirectSourceIp => Some(conn.direct_source.ip().to_canonical()),
            _ => None,
        }
    }
}

/// What a match leads to.
#[derive(Debug)]
enum OnMatch {
    /// The filter chain at this index of the listener's compiled chains.
    Chain(usize),
    Matcher(Box<ChainMatcher>),
}

#[derive(Debug)]
enum Map {
    Exact(HashMap<String, OnMatch>),
    /// Longest prefix first.
    Prefix(Vec<(String, OnMatch)>),
    /// Longest range first: (range, exclusive, what it leads to).
    Ip(Vec<(IpNet, bool, OnMatch)>),
}

#[derive(Debug)]
enum Predicate {
    Single(Input, Text),
    Or(Vec<Predicate>),
    And(Vec<Predicate>),
    Not(Box<Predicate>),
}

/// A `StringMatcher` without regex.
#[derive(Debug)]
struct Text {
    pattern: MatchPattern,
    ignore_case: bool,
}

impl Text {
    fn matches(&self, value: &str) -> bool {
        let fold = |s: &str| {
            if self.ignore_case {
                s.to_lowercase()
            } else {
                s.to_owned()
            }
        };
        let value = fold(value);
        match &self.pattern {
            MatchPattern::Exact(s) => value == fold(s),
            MatchPattern::Prefix(s) => value.starts_with(&fold(s)),
            MatchPattern::Suffix(s) => value.ends_with(&fold(s)),
            MatchPattern::Contains(s) => value.contains(&fold(s)),
            _ => false,
        }
    }
}

#[derive(Debug)]
enum Kind {
    Tree(Input, Map),
    List(Vec<(Predicate, OnMatch)>),
}

/// A compiled `filter_chain_matcher`.
#[derive(Debug)]
pub struct ChainMatcher {
    kind: Option<Kind>,
    on_no_match: Option<OnMatch>,
}

impl ChainMatcher {
    /// Compiles `matcher`; `chains` finds a chain's index by name. Errors are at `path`.
    pub fn compile(
        matcher: &PbMatcher,
        chains: &dyn Fn(&str) -> Option<usize>,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<ChainMatcher> {
        let errors_before = problems.errors.len();
        let compiled = Compiler { chains, problems }.matcher(matcher, path);
        (problems.errors.len() == errors_before).then_some(compiled)
    }

    /// The index of the chain `conn` runs, if the matcher picks one.
    pub fn select(&self, conn: &ConnectionInfo<'_>) -> Option<usize> {
        let matched = match &self.kind {
            Some(Kind::Tree(input, map)) => tree(*input, map, conn),
            Some(Kind::List(list)) => list
                .iter()
                .filter(|(p, _)| p.holds(conn))
                .find_map(|(_, on_match)| on_match.select(conn)),
            None => None,
        };
        matched.or_else(|| self.on_no_match.as_ref()?.select(conn))
    }
}

impl OnMatch {
    fn select(&self, conn: &ConnectionInfo<'_>) -> Option<usize> {
        match self {
            OnMatch::Chain(i) => Some(*i),
            OnMatch::Matcher(m) => m.select(conn),
        }
    }
}

impl Predicate {
    fn holds(&self, conn: &ConnectionInfo<'_>) -> bool {
        match self {
            Predicate::Single(input, text) => input.value(conn).is_some_and(|v| text.matches(&v)),
            Predicate::Or(list) => list.iter().any(|p| p.holds(conn)),
            Predicate::And(list) => list.iter().all(|p| p.holds(conn)),
            Predicate::Not(p) => !p.holds(conn),
        }
    }
}

fn tree(input: Input, map: &Map, conn: &ConnectionInfo<'_>) -> Option<usize> {
    match map {
        Map::Exact(entries) => entries.get(&input.value(conn)?)?.select(conn),
        Map::Prefix(entries) => {
            let value = input.value(conn)?;
            entries
                .iter()
                .filter(|(prefix, _)| value.starts_with(prefix.as_str()))
                .find_map(|(_, on_match)| on_match.select(conn))
        }
        Map::Ip(ranges) => {
            let ip = input.ip(conn)?;
            for (_, exclusive, on_match) in ranges.iter().filter(|(r, _, _)| r.contains(&ip)) {
                if let Some(chain) = on_match.select(conn) {
                    return Some(chain);
                }
                if *exclusive {
                    return None;
                }
            }
            None
        }
    }
}

/// `xds.type.matcher.v3.IPMatcher`, which envoy-types lacks.
#[derive(Clone, PartialEq, Message)]
struct IpMatcher {
    #[prost(message, repeated, tag = "1")]
    range_matchers: Vec<IpRangeMatcher>,
}

#[derive(Clone, PartialEq, Message)]
struct IpRangeMatcher {
    #[prost(message, repeated, tag = "1")]
    ranges: Vec<envoy_types::pb::xds::core::v3::CidrRange>,
    #[prost(message, optional, tag = "2")]
    on_match: Option<PbOnMatch>,
    #[prost(bool, tag = "3")]
    exclusive: bool,
}

const IP_MATCHER: &str = "xds.type.matcher.v3.IPMatcher";

/// Where the network inputs' type names start.
const INPUT_PREFIX: &str = "envoy.extensions.matching.common_inputs.network.v3.";

/// The inputs [`Input::parse`] reads and the matchers compiled here: config
/// validation's list of what a `filter_chain_matcher` may use (a test checks each input
/// parses).
pub const FILTER_CHAIN_MATCHING: &[&str] = &[
    "envoy.extensions.matching.common_inputs.network.v3.DestinationIPInput",
    "envoy.extensions.matching.common_inputs.network.v3.DestinationPortInput",
    "envoy.extensions.matching.common_inputs.network.v3.SourceIPInput",
    "envoy.extensions.matching.common_inputs.network.v3.SourcePortInput",
    "envoy.extensions.matching.common_inputs.network.v3.DirectSourceIPInput",
    "envoy.extensions.matching.common_inputs.network.v3.SourceTypeInput",
    "envoy.extensions.matching.common_inputs.network.v3.ServerNameInput",
    "envoy.extensions.matching.common_inputs.network.v3.TransportProtocolInput",
    "envoy.extensions.matching.common_inputs.network.v3.ApplicationProtocolInput",
    IP_MATCHER,
];

struct Compiler<'a> {
    chains: &'a dyn Fn(&str) -> Option<usize>,
    problems: &'a mut Diagnostics,
}

impl Compiler<'_> {
    fn matcher(&mut self, matcher: &PbMatcher, path: &JsonPath) -> ChainMatcher {
        let kind = match &matcher.matcher_type {
            Some(MatcherType::MatcherTree(tree)) => {
                let t_path = path.field("matcher_tree");
                let input =
                    Input::parse(tree.input.as_ref(), &t_path.field("input"), self.problems);
                let map = self.map(tree.tree_type.as_ref(), &t_path, input);
                input.zip(map).map(|(input, map)| Kind::Tree(input, map))
            }
            Some(MatcherType::MatcherList(list)) => {
                let mut compiled = Vec::new();
                for (i, field) in list.matchers.iter().enumerate() {
                    let f_path = path.field("matcher_list").field("matchers").index(i);
                    let predicate = match &field.predicate {
                        Some(p) => self.predicate(p, &f_path.field("predicate")),
                        None => {
                            self.problems
                                .error(f_path.field("predicate"), "is required");
                            None
                        }
                    };
                    let on_match =
                        self.on_match(field.on_match.as_ref(), &f_path.field("on_match"));
                    if let (Some(p), Some(m)) = (predicate, on_match) {
                        compiled.push((p, m));
                    }
                }
                Some(Kind::List(compiled))
            }
            None => None,
        };
        let on_no_match = matcher
            .on_no_match
            .as_ref()
            .and_then(|m| self.on_match(Some(m), &path.field("on_no_match")));
        ChainMatcher { kind, on_no_match }
    }

    fn map(
        &mut self,
        tree: Option<&TreeType>,
        path: &JsonPath,
        input: Option<Input>,
    ) -> Option<Map> {
        match tree {
            Some(TreeType::ExactMatchMap(map)) => {
                let mut entries = HashMap::new();
                for (key, on_match) in &map.map {
                    let m_path = path.field("exact_match_map").field("map").key(key);
                    if let Some(m) = self.on_match(Some(on_match), &m_path) {
                        entries.insert(key.clone(), m);
                    }
                }
                Some(Map::Exact(entries))
            }
            Some(TreeType::PrefixMatchMap(map)) => {
                let mut entries = Vec::new();
                for (key, on_match) in &map.map {
                    let m_path = path.field("prefix_match_map").field("map").key(key);
                    if let Some(m) = self.on_match(Some(on_match), &m_path) {
                        entries.push((key.clone(), m));
                    }
                }
                entries.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
                Some(Map::Prefix(entries))
            }
            Some(TreeType::CustomMatch(custom)) => {
                let c_path = path.field("custom_match").field("typed_config");
                let any = custom
                    .typed_config
                    .as_ref()
                    .filter(|a| type_name(a) == IP_MATCHER);
                let Some(any) = any else {
                    self.problems.error(
                        &c_path,
                        format!(
                            "custom matcher {} is not implemented for filter chains",
                            custom.typed_config.as_ref().map_or("(none)", type_name)
                        ),
                    );
                    return None;
                };
                if !input.is_none_or(|i| {
                    matches!(
                        i,
                        Input::DestinationIp | Input::SourceIp | Input::DirectSourceIp
                    )
                }) {
                    self.problems
                        .error(&c_path, "an IPMatcher needs an IP input");
                    return None;
                }
                self.ip_matcher(any, &c_path).map(Map::Ip)
            }
            None => {
                self.problems.error(path, "a matcher tree needs a map");
                None
            }
        }
    }

    fn ip_matcher(&mut self, any: &Any, path: &JsonPath) -> Option<Vec<(IpNet, bool, OnMatch)>> {
        let matcher = match IpMatcher::decode(any.value.as_slice()) {
            Ok(m) => m,
            Err(err) => {
                self.problems
                    .error(path, format!("{IP_MATCHER} does not decode: {err}"));
                return None;
            }
        };
        let mut ranges = Vec::new();
        for (i, range) in matcher.range_matchers.iter().enumerate() {
            let r_path = path.field("range_matchers").index(i);
            // Each range shares the one OnMatch: compiled once per range.
            for (j, cidr) in range.ranges.iter().enumerate() {
                let len = cidr.prefix_len.as_ref().map_or(0, |l| l.value);
                let net = cidr.address_prefix.parse::<IpAddr>().ok().and_then(|ip| {
                    u8::try_from(len)
                        .ok()
                        .and_then(|len| shunt_config::convert::prefix(ip, len))
                });
                let Some(net) = net else {
                    self.problems.error(
                        r_path.field("ranges").index(j),
                        format!("{:?}/{len} is not an IP range", cidr.address_prefix),
                    );
                    continue;
                };
                if let Some(m) = self.on_match(range.on_match.as_ref(), &r_path.field("on_match")) {
                    ranges.push((net, range.exclusive, m));
                }
            }
        }
        ranges.sort_by_key(|r| std::cmp::Reverse(r.0.prefix_len()));
        Some(ranges)
    }

    fn predicate(&mut self, p: &PbPredicate, path: &JsonPath) -> Option<Predicate> {
        let list = |this: &mut Self, list: &predicate::PredicateList, path: &JsonPath| {
            list.predicate
                .iter()
                .enumerate()
                .map(|(i, p)| this.predicate(p, &path.field("predicate").index(i)))
                .collect::<Option<Vec<_>>>()
        };
        match &p.match_type {
            Some(predicate::MatchType::SinglePredicate(single)) => {
                let s_path = path.field("single_predicate");
                let input =
                    Input::parse(single.input.as_ref(), &s_path.field("input"), self.problems)?;
                match &single.matcher {
                    Some(single_predicate::Matcher::ValueMatch(value)) => self
                        .text(value, &s_path.field("value_match"))
                        .map(|t| Predicate::Single(input, t)),
                    _ => {
                        self.problems.error(
                            s_path.field("custom_match"),
                            "custom predicate matchers are not implemented for filter chains",
                        );
                        None
                    }
                }
            }
            Some(predicate::MatchType::OrMatcher(l)) => {
                list(self, l, &path.field("or_matcher")).map(Predicate::Or)
            }
            Some(predicate::MatchType::AndMatcher(l)) => {
                list(self, l, &path.field("and_matcher")).map(Predicate::And)
            }
            Some(predicate::MatchType::NotMatcher(p)) => self
                .predicate(p, &path.field("not_matcher"))
                .map(|p| Predicate::Not(Box::new(p))),
            None => {
                self.problems.error(path, "a predicate needs a match type");
                None
            }
        }
    }

    fn text(&mut self, matcher: &StringMatcher, path: &JsonPath) -> Option<Text> {
        match &matcher.match_pattern {
            Some(MatchPattern::SafeRegex(_)) | Some(MatchPattern::Custom(_)) | None => {
                self.problems.error(
                    path,
                    "only exact, prefix, suffix and contains are implemented here",
                );
                None
            }
            Some(pattern) => Some(Text {
                pattern: pattern.clone(),
                ignore_case: matcher.ignore_case,
            }),
        }
    }

    fn on_match(&mut self, on_match: Option<&PbOnMatch>, path: &JsonPath) -> Option<OnMatch> {
        match on_match.and_then(|m| m.on_match.as_ref()) {
            Some(on_match::OnMatch::Matcher(m)) => Some(OnMatch::Matcher(Box::new(
                self.matcher(m, &path.field("matcher")),
            ))),
            Some(on_match::OnMatch::Action(action)) => {
                let a_path = path.field("action").field("typed_config");
                let name = action
                    .typed_config
                    .as_ref()
                    .filter(|a| type_name(a) == "google.protobuf.StringValue")
                    .and_then(|a| StringValue::decode(a.value.as_slice()).ok());
                let Some(name) = name else {
                    self.problems.error(
                        &a_path,
                        "a filter chain matcher's action must be a google.protobuf.StringValue naming a filter chain",
                    );
                    return None;
                };
                match (self.chains)(&name.value) {
                    Some(i) => Some(OnMatch::Chain(i)),
                    None => {
                        self.problems
                            .error(&a_path, format!("no filter chain named {:?}", name.value));
                        None
                    }
                }
            }
            None => {
                self.problems.error(path, "needs a matcher or an action");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use envoy_types::pb::envoy::config::listener::v3::Listener;

    use super::*;

    /// Istio's `main_internal` (a waypoint's listener) from the corpus's config dump.
    fn main_internal() -> Listener {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../../tests/fixtures/istio/config_dump/proxyconfig_config_dump.json"
        );
        let dump: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let listener = dump["configs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|c| {
                c["dynamic_listeners"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|l| l["active_state"]["listener"].clone())
            .find(|l| l["name"] == "main_internal")
            .unwrap();
        let mut listener = listener;
        listener.as_object_mut().unwrap().remove("@type");
        shunt_config::message_from_json(listener).unwrap()
    }

    fn conn<'a>(destination: &str, alpn: &'a [String]) -> ConnectionInfo<'a> {
        let destination: SocketAddr = destination.parse().unwrap();
        let source: SocketAddr = "10.0.0.9:40000".parse().unwrap();
        ConnectionInfo {
            destination,
            source,
            direct_source: source,
            server_name: None,
            transport_protocol: "raw_buffer",
            application_protocols: alpn,
        }
    }

    #[test]
    fn istios_waypoint_matcher_picks_chains_by_ip_then_port_or_alpn() {
        let listener = main_internal();
        let names: Vec<&str> = listener
            .filter_chains
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        let by_name = |name: &str| names.iter().position(|n| *n == name);
        let mut problems = Diagnostics::default();
        let matcher = ChainMatcher::compile(
            listener.filter_chain_matcher.as_ref().unwrap(),
            &by_name,
            &JsonPath::new("m"),
            &mut problems,
        )
        .unwrap_or_else(|| panic!("{:?}", problems.errors));
        let picked = |destination: &str, alpn: &[&str]| {
            let alpn: Vec<String> = alpn.iter().map(|s| s.to_string()).collect();
            matcher.select(&conn(destination, &alpn)).map(|i| names[i])
        };
        let vip = "inbound-vip|8000||httpbin.default.svc.cluster.local-http";
        assert_eq!(picked("10.104.171.68:8000", &[]), Some(vip));
        assert_eq!(
            picked("10.104.171.68:8100", &[]),
            Some("inbound-vip|8100||httpbin.default.svc.cluster.local-http")
        );
        // A port the VIP does not serve: no chain (the default, if any).
        assert_eq!(picked("10.104.171.68:9999", &[]), None);
        // The pod IP: HTTP by ALPN, else the TCP chain (on_no_match).
        assert_eq!(
            picked("192.168.195.248:8000", &["http/1.1"]),
            Some("direct-http")
        );
        assert_eq!(
            picked("192.168.195.248:8000", &["h2c"]),
            Some("direct-http")
        );
        assert_eq!(picked("192.168.195.248:8000", &[]), Some("direct-tcp"));
        assert_eq!(picked("192.168.195.248:8000", &["h2"]), Some("direct-tcp"));
        assert_eq!(picked("10.1.1.1:8000", &[]), None);
    }

    #[test]
    fn a_matcher_naming_a_missing_chain_is_an_error_at_its_path() {
        let listener = main_internal();
        let mut problems = Diagnostics::default();
        let matcher = ChainMatcher::compile(
            listener.filter_chain_matcher.as_ref().unwrap(),
            &|name| (name != "direct-tcp").then_some(0),
            &JsonPath::new("Listener \"main_internal\".filter_chain_matcher"),
            &mut problems,
        );
        assert!(matcher.is_none());
        assert_eq!(problems.errors.len(), 1, "{:?}", problems.errors);
        assert!(
            problems.errors[0]
                .path
                .ends_with("on_no_match.action.typed_config")
                && problems.errors[0].message == "no filter chain named \"direct-tcp\"",
            "{:?}",
            problems.errors
        );
    }

    #[test]
    fn every_listed_input_is_one_a_matcher_reads() {
        let inputs = FILTER_CHAIN_MATCHING.iter().filter(|t| **t != IP_MATCHER);
        for type_name in inputs {
            let config = TypedExtensionConfig {
                name: "input".into(),
                typed_config: Some(Any {
                    type_url: format!("type.googleapis.com/{type_name}"),
                    value: Vec::new(),
                }),
            };
            let mut problems = Diagnostics::default();
            let input = Input::parse(Some(&config), &JsonPath::new("input"), &mut problems);
            assert!(input.is_some(), "{type_name}: {:?}", problems.errors);
        }
    }
}
