//! A route's or virtual host's `rate_limits` (Envoy's `router_ratelimit`): each entry
//! a list of actions that together make one descriptor for a request, or none when an
//! action finds nothing to say (a missing header, a header match that fails). The HTTP
//! rate limit filters read them: the global one sends the descriptors of its `stage` to
//! the rate limit service, the local one matches them against its own buckets.

use std::net::IpAddr;

use envoy_types::pb::envoy::config::route::v3::RateLimit as EnvoyRateLimit;
use envoy_types::pb::envoy::config::route::v3::rate_limit::action::{
    ActionSpecifier, meta_data::Source,
};
use envoy_types::pb::envoy::r#type::metadata::v3::metadata_key::path_segment::Segment;

use super::route::RouteRateLimits;
use crate::common::matcher::{HeaderMatcher, RequestView, header_matcher};
use crate::common::ratelimit::{Descriptor, Entry};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::StreamInfo;

/// Envoy's highest stage.
pub const MAX_STAGE: u32 = 10;

/// One `rate_limits` list, compiled.
#[derive(Debug, Default)]
pub struct RateLimitPolicy {
    pub entries: Vec<RateLimitEntry>,
}

#[derive(Debug)]
pub struct RateLimitEntry {
    pub stage: u32,
    /// `disable_key`: Envoy reads runtime `ratelimit.<key>.http_filter_enabled`; with no
    /// runtime layer it is always on, as here.
    pub disable_key: String,
    pub actions: Vec<Action>,
}

#[derive(Debug)]
pub enum Action {
    /// `("source_cluster", <the node's cluster>)`.
    SourceCluster,
    /// `("destination_cluster", <the route's cluster>)`.
    DestinationCluster,
    /// `(<key>, <the header's value>)`; without the header, no descriptor unless
    /// `skip_if_absent` (then no entry).
    RequestHeaders {
        header: String,
        key: String,
        skip_if_absent: bool,
    },
    /// `("remote_address", <the downstream's address>)`.
    RemoteAddress,
    /// `("masked_remote_address", <address>/<len>)`.
    MaskedRemoteAddress { v4: u8, v6: u8 },
    /// `(<key or "generic_key">, <value>)`.
    GenericKey { key: String, value: String },
    /// `(<key or "header_match">, <value>)` when the headers match as `expect_match`
    /// says.
    HeaderValueMatch {
        key: String,
        value: String,
        expect_match: bool,
        headers: Vec<HeaderMatcher>,
    },
    /// `(<key>, <the string in the dynamic metadata>)`, else `default_value`, else no
    /// descriptor unless `skip_if_absent`.
    Metadata {
        key: String,
        filter: String,
        path: Vec<String>,
        default_value: String,
        skip_if_absent: bool,
    },
}

/// What the actions read from a request.
pub struct Inputs<'a> {
    /// The node's `cluster`.
    pub local_cluster: &'a str,
    /// The cluster the route sends to.
    pub route_cluster: &'a str,
    pub request: RequestView<'a>,
    pub info: &'a StreamInfo,
}

impl RateLimitPolicy {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The descriptors of the entries of `filter.stage`, appended to `out` in the
    /// entries' order.
    pub fn populate(&self, filter: Filter, inputs: &Inputs<'_>, out: &mut Vec<Descriptor>) {
        for entry in &self.entries {
            if entry.stage != filter.stage || (filter.local && !entry.disable_key.is_empty()) {
                continue;
            }
            if let Some(descriptor) = entry.descriptor(inputs) {
                out.push(descriptor);
            }
        }
    }
}

/// Which rate limit filter asks.
#[derive(Debug, Clone, Copy)]
pub struct Filter {
    pub stage: u32,
    /// The local rate limit filter, which skips the entries with a `disable_key`.
    pub local: bool,
}

/// Whether a route's request also carries its virtual host's descriptors (the
/// filters' `vh_rate_limits`, or the route's `include_vh_rate_limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VhRateLimits {
    /// The virtual host's only when the route has none (the default).
    Override,
    Include,
    Ignore,
}

impl VhRateLimits {
    /// `vh_rate_limits` as Envoy's enums number it (OVERRIDE, INCLUDE, IGNORE).
    pub fn from_i32(value: i32) -> Option<VhRateLimits> {
        match value {
            0 => Some(VhRateLimits::Override),
            1 => Some(VhRateLimits::Include),
            2 => Some(VhRateLimits::Ignore),
            _ => None,
        }
    }
}

/// Envoy's `populateRateLimitDescriptors` for a request: the route's descriptors,
/// then the virtual host's as `vh` says (`include_vh_rate_limits` on the route wins).
pub fn route_descriptors(
    route: &RouteRateLimits,
    vhost: &RateLimitPolicy,
    vh: VhRateLimits,
    filter: Filter,
    inputs: &Inputs<'_>,
) -> Vec<Descriptor> {
    let mut out = Vec::new();
    route.policy.populate(filter, inputs, &mut out);
    let vh = if route.include_vh_rate_limits {
        VhRateLimits::Include
    } else {
        vh
    };
    match vh {
        VhRateLimits::Include => vhost.populate(filter, inputs, &mut out),
        VhRateLimits::Override if route.policy.is_empty() => {
            vhost.populate(filter, inputs, &mut out);
        }
        VhRateLimits::Override | VhRateLimits::Ignore => {}
    }
    out
}

impl RateLimitEntry {
    fn descriptor(&self, inputs: &Inputs<'_>) -> Option<Descriptor> {
        let mut descriptor = Descriptor::default();
        for action in &self.actions {
            match action.entry(inputs) {
                Produced::Entry(entry) => descriptor.entries.push(entry),
                Produced::Skip => {}
                Produced::Nothing => return None,
            }
        }
        Some(descriptor)
    }
}

/// What one action makes of a request.
enum Produced {
    Entry(Entry),
    /// No entry, but the descriptor goes on (`skip_if_absent`).
    Skip,
    /// No descriptor at all.
    Nothing,
}

impl Action {
    fn entry(&self, inputs: &Inputs<'_>) -> Produced {
        match self {
            Action::SourceCluster => {
                Produced::Entry(Entry::new("source_cluster", inputs.local_cluster))
            }
            Action::DestinationCluster => {
                Produced::Entry(Entry::new("destination_cluster", inputs.route_cluster))
            }
            Action::RequestHeaders {
                header,
                key,
                skip_if_absent,
            } => match inputs.request.header(header) {
                Some(value) => Produced::Entry(Entry::new(key, value.into_owned())),
                None if *skip_if_absent => Produced::Skip,
                None => Produced::Nothing,
            },
            Action::RemoteAddress => Produced::Entry(Entry::new(
                "remote_address",
                inputs.info.connection.remote.ip().to_string(),
            )),
            Action::MaskedRemoteAddress { v4, v6 } => Produced::Entry(Entry::new(
                "masked_remote_address",
                masked(inputs.info.connection.remote.ip(), *v4, *v6),
            )),
            Action::GenericKey { key, value } => Produced::Entry(Entry::new(key, value)),
            Action::HeaderValueMatch {
                key,
                value,
                expect_match,
                headers,
            } => {
                let matched = headers.iter().all(|h| h.matches(&inputs.request));
                if matched == *expect_match {
                    Produced::Entry(Entry::new(key, value))
                } else {
                    Produced::Nothing
                }
            }
            Action::Metadata {
                key,
                filter,
                path,
                default_value,
                skip_if_absent,
            } => {
                let found = inputs
                    .info
                    .metadata_value(filter, path)
                    .and_then(|v| v.as_str())
                    .filter(|v| !v.is_empty());
                match found {
                    Some(value) => Produced::Entry(Entry::new(key, value)),
                    None if !default_value.is_empty() => {
                        Produced::Entry(Entry::new(key, default_value))
                    }
                    None if *skip_if_absent => Produced::Skip,
                    None => Produced::Nothing,
                }
            }
        }
    }
}

/// `address/len` with the address's host bits cleared.
fn masked(ip: IpAddr, v4: u8, v6: u8) -> String {
    match ip {
        IpAddr::V4(a) => {
            let len = u32::from(v4.min(32));
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            format!("{}/{len}", std::net::Ipv4Addr::from(u32::from(a) & mask))
        }
        IpAddr::V6(a) => {
            let len = u32::from(v6.min(128));
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            format!("{}/{len}", std::net::Ipv6Addr::from(u128::from(a) & mask))
        }
    }
}

/// Compiles a `rate_limits` list at `path`.
pub fn compile(
    list: &[EnvoyRateLimit],
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> RateLimitPolicy {
    RateLimitPolicy {
        entries: list
            .iter()
            .enumerate()
            .filter_map(|(i, r)| entry(r, &path.index(i), problems))
            .collect(),
    }
}

fn entry(
    r: &EnvoyRateLimit,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<RateLimitEntry> {
    let errors_before = problems.errors.len();
    let stage = r.stage.map_or(0, |s| s.value);
    if stage > MAX_STAGE {
        problems.error(path.field("stage"), format!("{stage} is above {MAX_STAGE}"));
    }
    for (set, field) in [
        (r.limit.is_some(), "limit"),
        (r.hits_addend.is_some(), "hits_addend"),
        (r.apply_on_stream_done, "apply_on_stream_done"),
        (r.x_ratelimit_option != 0, "x_ratelimit_option"),
    ] {
        if set {
            problems.error(path.field(field), "is not implemented");
        }
    }
    let actions: Vec<Action> = r
        .actions
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            action(
                a.action_specifier.as_ref(),
                &path.field("actions").index(i),
                problems,
            )
        })
        .collect();
    if r.actions.is_empty() {
        problems.error(path.field("actions"), "needs at least one action");
    }
    (problems.errors.len() == errors_before).then(|| RateLimitEntry {
        stage,
        disable_key: r.disable_key.clone(),
        actions,
    })
}

fn or(key: &str, default: &str) -> String {
    if key.is_empty() { default } else { key }.to_owned()
}

#[allow(
    deprecated,
    reason = "dynamic_metadata is deprecated but still served by Envoy"
)]
fn action(
    a: Option<&ActionSpecifier>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Action> {
    match a {
        Some(ActionSpecifier::SourceCluster(_)) => Some(Action::SourceCluster),
        Some(ActionSpecifier::DestinationCluster(_)) => Some(Action::DestinationCluster),
        Some(ActionSpecifier::RequestHeaders(h)) => {
            let a_path = path.field("request_headers");
            if h.header_name.is_empty() || h.descriptor_key.is_empty() {
                problems.error(&a_path, "header_name and descriptor_key are required");
                return None;
            }
            Some(Action::RequestHeaders {
                header: h.header_name.to_ascii_lowercase(),
                key: h.descriptor_key.clone(),
                skip_if_absent: h.skip_if_absent,
            })
        }
        Some(ActionSpecifier::RemoteAddress(_)) => Some(Action::RemoteAddress),
        Some(ActionSpecifier::MaskedRemoteAddress(m)) => {
            let a_path = path.field("masked_remote_address");
            let v4 = m.v4_prefix_mask_len.map_or(32, |v| v.value);
            let v6 = m.v6_prefix_mask_len.map_or(128, |v| v.value);
            if v4 > 32 {
                problems.error(a_path.field("v4_prefix_mask_len"), "must be at most 32");
                return None;
            }
            if v6 > 128 {
                problems.error(a_path.field("v6_prefix_mask_len"), "must be at most 128");
                return None;
            }
            Some(Action::MaskedRemoteAddress {
                v4: v4 as u8,
                v6: v6 as u8,
            })
        }
        Some(ActionSpecifier::GenericKey(g)) => {
            if g.descriptor_value.is_empty() {
                problems.error(
                    path.field("generic_key").field("descriptor_value"),
                    "is required",
                );
                return None;
            }
            Some(Action::GenericKey {
                key: or(&g.descriptor_key, "generic_key"),
                value: g.descriptor_value.clone(),
            })
        }
        Some(ActionSpecifier::HeaderValueMatch(m)) => {
            let a_path = path.field("header_value_match");
            if m.descriptor_value.is_empty() {
                problems.error(a_path.field("descriptor_value"), "is required");
                return None;
            }
            let headers: Vec<HeaderMatcher> = m
                .headers
                .iter()
                .enumerate()
                .filter_map(|(i, h)| header_matcher(h, &a_path.field("headers").index(i), problems))
                .collect();
            if headers.len() != m.headers.len() {
                return None;
            }
            Some(Action::HeaderValueMatch {
                key: or(&m.descriptor_key, "header_match"),
                value: m.descriptor_value.clone(),
                expect_match: m.expect_match.is_none_or(|b| b.value),
                headers,
            })
        }
        Some(ActionSpecifier::DynamicMetadata(m)) => metadata(
            &m.descriptor_key,
            m.metadata_key.as_ref(),
            &m.default_value,
            false,
            &path.field("dynamic_metadata"),
            problems,
        ),
        Some(ActionSpecifier::Metadata(m)) => {
            let a_path = path.field("metadata");
            if m.source == Source::RouteEntry as i32 {
                problems.error(
                    a_path.field("source"),
                    "ROUTE_ENTRY metadata is not implemented; only DYNAMIC",
                );
                return None;
            }
            metadata(
                &m.descriptor_key,
                m.metadata_key.as_ref(),
                &m.default_value,
                m.skip_if_absent,
                &a_path,
                problems,
            )
        }
        Some(other) => {
            let name = match other {
                ActionSpecifier::QueryParameters(_) => "query_parameters",
                ActionSpecifier::QueryParameterValueMatch(_) => "query_parameter_value_match",
                ActionSpecifier::RemoteAddressMatch(_) => "remote_address_match",
                _ => "extension",
            };
            problems.error(
                path.field(name),
                "this rate limit action is not implemented",
            );
            None
        }
        None => {
            problems.error(path, "an action needs one of its kinds");
            None
        }
    }
}

fn metadata(
    key: &str,
    metadata_key: Option<&envoy_types::pb::envoy::r#type::metadata::v3::MetadataKey>,
    default_value: &str,
    skip_if_absent: bool,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Action> {
    let Some(m) = metadata_key else {
        problems.error(path.field("metadata_key"), "is required");
        return None;
    };
    if key.is_empty() {
        problems.error(path.field("descriptor_key"), "is required");
        return None;
    }
    let mut keys = Vec::new();
    for (i, segment) in m.path.iter().enumerate() {
        match &segment.segment {
            Some(Segment::Key(k)) => keys.push(k.clone()),
            _ => {
                problems.error(
                    path.field("metadata_key").field("path").index(i),
                    "only key segments are implemented",
                );
                return None;
            }
        }
    }
    Some(Action::Metadata {
        key: key.to_owned(),
        filter: m.key.clone(),
        path: keys,
        default_value: default_value.to_owned(),
        skip_if_absent,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use envoy_types::pb::envoy::config::route::v3::RateLimit as EnvoyRateLimit;
    use hyper::HeaderMap;
    use serde_json::json;
    use shunt_core::stream_info::Connection;

    use super::*;

    fn policy(list: serde_json::Value) -> (RateLimitPolicy, Diagnostics) {
        let list: Vec<EnvoyRateLimit> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|r| shunt_config::message_from_json(r.clone()).expect("RateLimit JSON"))
            .collect();
        let mut problems = Diagnostics::default();
        let compiled = compile(&list, &JsonPath::new("rate_limits"), &mut problems);
        (compiled, problems)
    }

    fn info() -> StreamInfo {
        let mut info = StreamInfo::new(Arc::new(Connection::new(
            "10.0.0.1:80".parse().unwrap(),
            "192.168.7.9:5555".parse().unwrap(),
        )));
        let fields = json!({"tenant": {"id": "acme"}});
        info.metadata.set(
            "envoy.filters.http.jwt_authn",
            fields.as_object().unwrap().clone(),
        );
        info
    }

    /// Each descriptor as `key=value` entries joined by `,`.
    fn descriptors(policy: &RateLimitPolicy, headers: &[(&str, &str)], stage: u32) -> Vec<String> {
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.append(
                hyper::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let info = info();
        let inputs = Inputs {
            local_cluster: "local",
            route_cluster: "backend",
            request: RequestView {
                method: "GET",
                authority: "example.com",
                path: "/a?b=c",
                scheme: "http",
                headers: &map,
            },
            info: &info,
        };
        let mut out = Vec::new();
        let filter = Filter {
            stage,
            local: false,
        };
        policy.populate(filter, &inputs, &mut out);
        out.iter()
            .map(|d| {
                d.entries
                    .iter()
                    .map(|e| format!("{}={}", e.key, e.value))
                    .collect::<Vec<_>>()
                    .join(",")
            })
            .collect()
    }

    #[test]
    fn actions_make_envoys_entries() {
        let (policy, problems) = policy(json!([
            {"actions": [{"source_cluster": {}}, {"destination_cluster": {}}]},
            {"actions": [{"remote_address": {}}, {"masked_remote_address": {"v4_prefix_mask_len": 24}}]},
            {"actions": [{"generic_key": {"descriptor_value": "v"}},
                {"generic_key": {"descriptor_key": "k", "descriptor_value": "w"}}]},
            {"actions": [{"request_headers": {"header_name": ":path", "descriptor_key": "path"}},
                {"request_headers": {"header_name": "X-User", "descriptor_key": "user"}}]},
            {"actions": [{"header_value_match": {"descriptor_value": "get",
                "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]}}]},
            {"actions": [{"metadata": {"descriptor_key": "tenant",
                "metadata_key": {"key": "envoy.filters.http.jwt_authn", "path": [{"key": "tenant"}, {"key": "id"}]}}}]},
            {"stage": 1, "actions": [{"generic_key": {"descriptor_value": "stage1"}}]}
        ]));
        assert!(problems.errors.is_empty(), "{problems:?}");
        assert_eq!(
            descriptors(&policy, &[("x-user", "alice")], 0),
            [
                "source_cluster=local,destination_cluster=backend",
                "remote_address=192.168.7.9,masked_remote_address=192.168.7.0/24",
                "generic_key=v,k=w",
                "path=/a?b=c,user=alice",
                "header_match=get",
                "tenant=acme",
            ]
        );
        assert_eq!(descriptors(&policy, &[], 1), ["generic_key=stage1"]);
    }

    #[test]
    fn a_missing_input_drops_the_descriptor_unless_skipped() {
        let (policy, _) = policy(json!([
            {"actions": [{"generic_key": {"descriptor_value": "a"}},
                {"request_headers": {"header_name": "x-user", "descriptor_key": "user"}}]},
            {"actions": [{"generic_key": {"descriptor_value": "b"}},
                {"request_headers": {"header_name": "x-user", "descriptor_key": "user", "skip_if_absent": true}}]},
            {"actions": [{"header_value_match": {"descriptor_value": "post", "expect_match": true,
                "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}}]},
            {"actions": [{"header_value_match": {"descriptor_value": "not-post", "expect_match": false,
                "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]}}]},
            {"actions": [{"metadata": {"descriptor_key": "absent", "default_value": "none",
                "metadata_key": {"key": "nothing", "path": [{"key": "here"}]}}}]},
            {"actions": [{"metadata": {"descriptor_key": "absent",
                "metadata_key": {"key": "nothing", "path": [{"key": "here"}]}}}]}
        ]));
        assert_eq!(
            descriptors(&policy, &[], 0),
            ["generic_key=b", "header_match=not-post", "absent=none"]
        );
    }

    #[test]
    fn errors_name_their_path() {
        for (list, path) in [
            (
                json!([{"stage": 11, "actions": [{"remote_address": {}}]}]),
                "rate_limits[0].stage",
            ),
            (json!([{"actions": []}]), "rate_limits[0].actions"),
            (
                json!([{"actions": [{"remote_address": {}}, {"query_parameters": {
                "query_parameter_name": "q", "descriptor_key": "q"}}]}]),
                "rate_limits[0].actions[1].query_parameters",
            ),
            (
                json!([{"actions": [{"metadata": {"descriptor_key": "k", "source": "ROUTE_ENTRY",
                "metadata_key": {"key": "f", "path": [{"key": "p"}]}}}]}]),
                "rate_limits[0].actions[0].metadata.source",
            ),
            (
                json!([{"actions": [{"remote_address": {}}], "limit": {"dynamic_metadata": {
                "metadata_key": {"key": "f", "path": [{"key": "p"}]}}}}]),
                "rate_limits[0].limit",
            ),
        ] {
            let (compiled, problems) = policy(list.clone());
            assert!(compiled.is_empty(), "{list}");
            assert!(
                problems.errors.iter().any(|e| e.path == path),
                "{path}: {:?}",
                problems.errors
            );
        }
    }

    #[test]
    fn masked_addresses_keep_their_prefix() {
        let v4: IpAddr = "192.168.1.77".parse().unwrap();
        assert_eq!(masked(v4, 24, 128), "192.168.1.0/24");
        assert_eq!(masked(v4, 32, 128), "192.168.1.77/32");
        assert_eq!(masked(v4, 0, 128), "0.0.0.0/0");
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(masked(v6, 32, 64), "2001:db8::/64");
    }
}
