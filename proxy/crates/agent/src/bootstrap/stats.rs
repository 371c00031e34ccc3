//! Stats in the bootstrap: Istio's tag extractors (plus `extraStatTags`), the inclusion
//! list (what pilot-agent always keeps for readiness and draining, plus the
//! `sidecar.istio.io/statsInclusion*` annotations or the ProxyConfig's
//! `proxyStatsMatcher`), histogram buckets, flush and eviction intervals, and the sinks.

use std::time::Duration;

use serde_json::{Value, json};

use super::BootstrapError;
use super::clusters::socket_address;
use super::node::{Node, dedup};
use super::proxy_config::ProxyConfigView;

/// Stats the readiness probe reads.
const REQUIRED_PREFIXES: [&str; 5] = [
    "cluster_manager",
    "listener_manager",
    "server",
    "cluster.xds-grpc",
    "wasm",
];
const RBAC_SUFFIXES: [&str; 4] = [
    "rbac.allowed",
    "rbac.denied",
    "shadow_allowed",
    "shadow_denied",
];
/// Needed to drain until no connection is left.
const DRAIN_SUFFIX: &str = "downstream_cx_active";
/// Stats named from a VirtualService route's stat_prefix.
const REQUIRED_REGEX: &str = r"vhost\..*\.route\..*";

/// Istio's tag extractors before the extra tags.
const TAGS_HEAD: [(&str, &str); 9] = [
    ("cluster_name", r"^cluster(\.(.+);)"),
    (
        "http_conn_manager_prefix",
        r"^http\.(((?:[_.[:digit:]\w]*|[_\[\]aAbBcCdDeEfF[:digit:]\w\:]*));\.)",
    ),
    ("thread_name", r"^server(\.(.+))\.watchdog"),
    ("tcp_prefix", r"^tcp\.((.*?)\.)\w+?$"),
    ("response_code", r"_rq(_(\d{3}))$"),
    ("response_code_class", r"_rq(_(\dxx))$"),
    (
        "http_conn_manager_listener_prefix",
        r"^listener(?=\.).*?\.http\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)",
    ),
    (
        "listener_address",
        r"^listener\.(((?:[_.[:digit:]]*|[_\[\]aAbBcCdDeEfF[:digit:]]*))\.)",
    ),
    (
        "mongo_prefix",
        r"^mongo\.(.+?)\.(collection|cmd|cx_|op_|delays_|decoding_)(.*?)$",
    ),
];
/// And after them.
const TAGS_TAIL: [(&str, &str); 7] = [
    ("cache", r"(cache\.(.+?)\.)"),
    ("component", r"(component\.(.+?)\.)"),
    ("tag", r"(tag\.(.+?);\.)"),
    ("wasm_filter", r"(wasm_filter\.(.+?)\.)"),
    ("authz_enforce_result", r"rbac(\.(allowed|denied))"),
    ("authz_dry_run_action", r"(\.istio_dry_run_(allow|deny)_)"),
    ("authz_dry_run_result", r"(\.shadow_(allowed|denied))"),
];

const ANNO_EXTRA_TAGS: &str = "sidecar.istio.io/extraStatTags";
const ANNO_PREFIXES: &str = "sidecar.istio.io/statsInclusionPrefixes";
const ANNO_SUFFIXES: &str = "sidecar.istio.io/statsInclusionSuffixes";
const ANNO_REGEXPS: &str = "sidecar.istio.io/statsInclusionRegexps";
const ANNO_BUCKETS: &str = "sidecar.istio.io/statsHistogramBuckets";
const ANNO_FLUSH: &str = "sidecar.istio.io/statsFlushInterval";
const ANNO_EVICTION: &str = "sidecar.istio.io/statsEvictionInterval";
/// Envoy's default flush interval.
const DEFAULT_FLUSH: Duration = Duration::from_secs(5);

pub struct Stats {
    extra_tags: Vec<String>,
    prefixes: Vec<String>,
    suffixes: Vec<String>,
    regexps: Vec<String>,
    /// (prefix, buckets), sorted by prefix.
    buckets: Vec<(String, Vec<f64>)>,
    pub flush_interval: Option<String>,
    pub eviction_interval: Option<String>,
}

impl Stats {
    pub fn of(node: &Node, pc: &ProxyConfigView, exit_on_zero_active_connections: bool) -> Self {
        let anno = |k: &str| node.annotations.get(k).cloned().unwrap_or_default();
        // An annotation replaces the ProxyConfig's list (they are not merged); the
        // required entries always follow; `{pod_ip}` expands to each of the pod's IPs.
        let inclusion = |annotation: &str, from_config: Option<&Vec<String>>, required: &[&str]| {
            let mut list: Vec<String> = if !annotation.is_empty() {
                annotation.split(',').map(str::to_owned).collect()
            } else {
                from_config.cloned().unwrap_or_default()
            };
            list.extend(required.iter().map(|s| (*s).to_owned()));
            let mut out = Vec::new();
            for pattern in list {
                if pattern.contains("{pod_ip}") {
                    out.extend(
                        node.instance_ips
                            .iter()
                            .map(|ip| pattern.replace("{pod_ip}", ip)),
                    );
                } else {
                    out.push(pattern);
                }
            }
            out
        };
        let matcher = pc.proxy_stats_matcher.clone().unwrap_or_default();
        let mut suffixes_required: Vec<&str> = RBAC_SUFFIXES.to_vec();
        if exit_on_zero_active_connections {
            suffixes_required.push(DRAIN_SUFFIX);
        }
        let extra: Vec<String> = pc
            .extra_stat_tags
            .iter()
            .cloned()
            .chain(anno(ANNO_EXTRA_TAGS).split(',').map(str::to_owned))
            .filter(|t| !t.is_empty())
            .collect();

        // A bad annotation is left out, as pilot-agent does (it logs a warning).
        let mut buckets: Vec<(String, Vec<f64>)> = node
            .annotations
            .get(ANNO_BUCKETS)
            .and_then(|b| {
                serde_json::from_str::<std::collections::BTreeMap<String, Vec<f64>>>(b).ok()
            })
            .map(|m| m.into_iter().collect())
            .unwrap_or_default();
        buckets.sort_by(|a, b| a.0.cmp(&b.0));

        let mut flush = DEFAULT_FLUSH;
        let mut flush_interval = None;
        if let Some(d) = node
            .annotations
            .get(ANNO_FLUSH)
            .and_then(|v| parse_go_duration(v))
        {
            flush = d;
            // pilot-agent prints Go's form ("1m30s"), which Envoy refuses past a minute;
            // protojson's seconds are the same for "10s" and load for every value.
            flush_interval = Some(proto_duration(d));
        }
        // Envoy needs the eviction interval to be a multiple of the flush interval.
        let eviction_interval = node
            .annotations
            .get(ANNO_EVICTION)
            .and_then(|v| parse_go_duration(v))
            .filter(|d| !flush.is_zero() && d.as_nanos() % flush.as_nanos() == 0)
            .map(|d| format!("{}s", d.as_secs()));

        Self {
            extra_tags: dedup(&extra),
            prefixes: inclusion(
                &anno(ANNO_PREFIXES),
                matcher.inclusion_prefixes.as_ref(),
                &REQUIRED_PREFIXES,
            ),
            suffixes: inclusion(
                &anno(ANNO_SUFFIXES),
                matcher.inclusion_suffixes.as_ref(),
                &suffixes_required,
            ),
            regexps: inclusion(
                &anno(ANNO_REGEXPS),
                matcher.inclusion_regexps.as_ref(),
                &[REQUIRED_REGEX],
            ),
            buckets,
            flush_interval,
            eviction_interval,
        }
    }

    /// `stats_config`.
    pub fn config(&self, metadata_discovery: bool) -> Value {
        let tag = |(name, regex): &(&str, &str)| json!({"tag_name": name, "regex": regex});
        let mut tags: Vec<Value> = TAGS_HEAD.iter().map(tag).collect();
        for t in &self.extra_tags {
            tags.push(json!({"tag_name": t, "regex": format!(r"({t}=\.=(.*?);\.;)")}));
        }
        tags.extend(TAGS_TAIL.iter().map(tag));

        let mut patterns = vec![json!({"prefix": "reporter="})];
        if metadata_discovery {
            patterns.push(json!({"prefix": "workload_discovery"}));
        }
        patterns.extend(self.prefixes.iter().map(|p| json!({"prefix": p})));
        patterns.extend(self.suffixes.iter().map(|s| json!({"suffix": s})));
        patterns.extend(
            self.regexps
                .iter()
                .map(|r| json!({"safe_regex": {"regex": r}})),
        );
        patterns.push(json!({"prefix": "component"}));
        patterns.push(json!({"prefix": "istio"}));

        let mut config = json!({
            "use_all_default_tags": false,
            "stats_tags": tags,
            "stats_matcher": {"inclusion_list": {"patterns": patterns}},
        });
        if !self.buckets.is_empty() {
            config["histogram_bucket_settings"] = self
                .buckets
                .iter()
                .map(|(prefix, b)| {
                    json!({"match": {"prefix": prefix}, "buckets": b.iter().map(|x| number(*x)).collect::<Vec<_>>()})
                })
                .collect();
        }
        config
    }
}

/// A whole number as an integer (as Go prints it), else a float.
fn number(x: f64) -> Value {
    if x.fract() == 0.0 && x.abs() < 9.0e15 {
        json!(x as i64)
    } else {
        json!(x)
    }
}

/// `stats_sinks`: the metrics service (gRPC) and statsd.
pub fn sinks(pc: &ProxyConfigView, host_ip: &str) -> Result<Vec<Value>, BootstrapError> {
    let mut sinks = Vec::new();
    if pc
        .envoy_metrics_service
        .as_ref()
        .is_some_and(|m| !m.address.is_empty())
    {
        sinks.push(json!({
            "name": "envoy.stat_sinks.metrics_service",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.metrics.v3.MetricsServiceConfig",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "envoy_metrics_service"}},
            }
        }));
    }
    if !pc.statsd_udp_address.is_empty() {
        sinks.push(json!({
            "name": "envoy.stat_sinks.statsd",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.metrics.v3.StatsdSink",
                "address": {"socket_address": socket_address("statsdUdpAddress", &pc.statsd_udp_address, host_ip)?},
            }
        }));
    }
    Ok(sinks)
}

/// Go's `time.ParseDuration` for the forms annotations use ("10s", "1m30s", "1.5h").
pub fn parse_go_duration(s: &str) -> Option<Duration> {
    let mut rest = s.trim();
    if rest == "0" {
        return Some(Duration::ZERO);
    }
    let mut total = 0f64;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..num_end].parse().ok()?;
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_end] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        total += n * scale;
        rest = &rest[unit_end..];
    }
    Some(Duration::from_secs_f64(total))
}

/// A protojson Duration: seconds with an 's' ("90s", "1.500000000s").
pub fn proto_duration(d: Duration) -> String {
    match d.subsec_nanos() {
        0 => format!("{}s", d.as_secs()),
        n => format!("{}.{n:09}s", d.as_secs()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_read_as_go_reads_them_and_print_as_protojson() {
        assert_eq!(parse_go_duration("10s"), Some(Duration::from_secs(10)));
        assert_eq!(parse_go_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_go_duration("ten"), None);
        assert_eq!(parse_go_duration("1.5h"), Some(Duration::from_secs(5400)));
        assert_eq!(proto_duration(Duration::from_secs(90)), "90s");
        assert_eq!(proto_duration(Duration::from_millis(1500)), "1.500000000s");
    }
}
