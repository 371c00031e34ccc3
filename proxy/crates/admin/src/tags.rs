//! The bootstrap's `stats_config` applied to stat names: which stats exist
//! (`stats_matcher`) and which parts of a name are tags (`stats_tags` and Envoy's default
//! tag extractors), as Envoy does it.
//!
//! A tag extractor is a regex searched in the full name: its first capture group is cut
//! out of the name and its second (or, alone, the first) is the tag's value. So Envoy's
//! default `^cluster\.((<name>)\.)` turns `cluster.agent.upstream_cx_total` into the
//! metric `cluster.upstream_cx_total` with `envoy.cluster_name="agent"`, and Istio's
//! `^cluster(\.(.+);)` does the same for its `alt_stat_name: "agent;"` names. Prometheus
//! shows the metric and the tags as labels; `/stats` shows the full names.

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::metrics::v3::stats_matcher::StatsMatcher;
use envoy_types::pb::envoy::config::metrics::v3::tag_specifier::TagValue;
use envoy_types::pb::envoy::r#type::matcher::v3::StringMatcher;
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
use regex::Regex;

/// A stat name split as Prometheus shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tagged {
    /// The name with the tag values cut out: `cluster.upstream_cx_total`.
    pub extracted_name: String,
    /// `(tag name, value)` in extraction order.
    pub tags: Vec<(String, String)>,
}

/// The compiled `stats_config`.
#[derive(Debug)]
pub struct StatsConfig {
    extractors: Vec<Extractor>,
    /// Tags every stat carries (`stats_tags` with `fixed_value`).
    fixed: Vec<(String, String)>,
    matcher: Matcher,
}

#[derive(Debug)]
struct Extractor {
    name: String,
    regex: Regex,
    /// A substring the name must contain for the regex to be worth running.
    hint: &'static str,
}

#[derive(Debug)]
enum Matcher {
    All,
    None,
    Include(Vec<NameMatcher>),
    Exclude(Vec<NameMatcher>),
}

#[derive(Debug)]
enum NameMatcher {
    Exact(String, bool),
    Prefix(String, bool),
    Suffix(String, bool),
    Contains(String, bool),
    Regex(Regex),
    /// A matcher shunt cannot evaluate (a custom extension, an invalid regex): matches
    /// nothing.
    Never,
}

/// Envoy's default tag extractors (`source/common/config/well_known_names.cc`) that
/// apply to the stats shunt has, in Envoy's order: `(tag name, regex, substring hint)`.
/// `\d` and `\w` are written out as the ASCII classes they are in Envoy's ECMAScript
/// regexes: Unicode's took 1 MiB of compiled automata in every process, these 0.3.
/// The Mongo and DynamoDB ones are left out with those filters.
const DEFAULT_EXTRACTORS: &[(&str, &str, &str)] = &[
    ("envoy.response_code", r"_rq(_([0-9]{3}))$", "_rq_"),
    ("envoy.response_code_class", r"_rq_(([0-9]))xx$", "_rq_"),
    (
        "envoy.grpc_bridge_method",
        r"^cluster\.[^\.]+\.grpc\.[^\.]+\.(([^\.]+)\.)",
        ".grpc.",
    ),
    (
        "envoy.http_user_agent",
        r"^http\.[^\.]+\.user_agent\.(([^\.]+)\.)",
        ".user_agent.",
    ),
    (
        "envoy.virtual_cluster",
        r"^vhost\.[^\.]+\.vcluster\.(([^\.]+)\.)",
        ".vcluster.",
    ),
    (
        "envoy.fault_downstream_cluster",
        r"^http\.[^\.]+\.fault\.(([^\.]+)\.)",
        ".fault.",
    ),
    (
        "envoy.ssl_cipher",
        r"^listener\..*?\.ssl\.cipher(\.([0-9A-Za-z_-]+))$",
        "",
    ),
    (
        "cipher_suite",
        r"^cluster\.[^\.]+\.ssl\.ciphers(\.([0-9A-Za-z_-]+))$",
        ".ssl.ciphers.",
    ),
    (
        "envoy.grpc_bridge_service",
        r"^cluster\.[^\.]+\.grpc\.(([^\.]+)\.)",
        ".grpc.",
    ),
    ("envoy.tcp_prefix", r"^tcp\.(([^\.]+)\.)", ""),
    ("envoy.udp_prefix", r"^udp\.(([^\.]+)\.)", ""),
    (
        "envoy.clientssl_prefix",
        r"^auth\.clientssl\.(([^\.]+)\.)",
        "",
    ),
    ("envoy.ratelimit_prefix", r"^ratelimit\.(([^\.]+)\.)", ""),
    ("envoy.cluster_name", r"^cluster\.(([^\.]+)\.)", ""),
    (
        "envoy.http_conn_manager_prefix",
        r"^listener\..*?\.http\.(([^\.]+)\.)",
        ".http.",
    ),
    ("envoy.http_conn_manager_prefix", r"^http\.(([^\.]+)\.)", ""),
    (
        "envoy.listener_address",
        r"^listener\.(([0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}_[0-9]+|\[[_aAbBcCdDeEfF[:digit:]]+\]_[0-9]+)\.)",
        "",
    ),
    ("envoy.virtual_host", r"^vhost\.(([^\.]+)\.)", ""),
    (
        "envoy.rds_route_config",
        r"^http\.[^\.]+\.rds\.(([0-9A-Za-z_\-\.]+)\.)[0-9A-Za-z_]+?$",
        ".rds.",
    ),
    (
        "envoy.worker_id",
        r"^listener_manager\.((worker_[0-9]+)\.)",
        "listener_manager.worker_",
    ),
];

impl Default for StatsConfig {
    /// Envoy's behaviour without a `stats_config`: every stat, default tags.
    fn default() -> Self {
        StatsConfig::from_bootstrap(&Bootstrap::default())
    }
}

impl StatsConfig {
    pub fn from_bootstrap(bootstrap: &Bootstrap) -> Self {
        let config = bootstrap.stats_config.clone().unwrap_or_default();
        let mut extractors = Vec::new();
        let mut fixed = Vec::new();
        for specifier in &config.stats_tags {
            let name = specifier.tag_name.clone();
            match &specifier.tag_value {
                Some(TagValue::FixedValue(value)) => fixed.push((name, value.clone())),
                Some(TagValue::Regex(pattern)) => match Regex::new(pattern) {
                    Ok(regex) => extractors.push(Extractor {
                        name,
                        regex,
                        hint: "",
                    }),
                    // Envoy's std::regex engine takes lookaheads that RE2 and the regex
                    // crate refuse: such a tag is not extracted and stays in the name.
                    Err(err) => tracing::warn!(
                        tag = %name,
                        %err,
                        "stats_config.stats_tags: regex not supported; tag not extracted"
                    ),
                },
                // A default tag named without a regex: Envoy's own regex for it.
                None => extractors.extend(
                    DEFAULT_EXTRACTORS
                        .iter()
                        .filter(|(default, _, _)| *default == name)
                        .map(default_extractor),
                ),
            }
        }
        if config
            .use_all_default_tags
            .is_none_or(|use_all| use_all.value)
        {
            let named: Vec<String> = extractors.iter().map(|e| e.name.clone()).collect();
            extractors.extend(
                DEFAULT_EXTRACTORS
                    .iter()
                    .filter(|(name, _, _)| !named.iter().any(|n| n == name))
                    .map(default_extractor),
            );
        }
        let matcher = match config.stats_matcher.and_then(|m| m.stats_matcher) {
            None => Matcher::All,
            Some(StatsMatcher::RejectAll(true)) => Matcher::None,
            Some(StatsMatcher::RejectAll(false)) => Matcher::All,
            Some(StatsMatcher::InclusionList(list)) => {
                Matcher::Include(list.patterns.iter().map(NameMatcher::new).collect())
            }
            Some(StatsMatcher::ExclusionList(list)) => {
                Matcher::Exclude(list.patterns.iter().map(NameMatcher::new).collect())
            }
        };
        StatsConfig {
            extractors,
            fixed,
            matcher,
        }
    }

    /// Whether a stat of this name exists under `stats_matcher` (Envoy never creates the
    /// others, so they are shown nowhere).
    pub fn accepts(&self, name: &str) -> bool {
        match &self.matcher {
            Matcher::All => true,
            Matcher::None => false,
            Matcher::Include(list) => list.iter().any(|m| m.matches(name)),
            Matcher::Exclude(list) => !list.iter().any(|m| m.matches(name)),
        }
    }

    /// Splits a name into the metric name and its tags.
    pub fn extract(&self, name: &str) -> Tagged {
        let mut removed: Vec<(usize, usize)> = Vec::new();
        let mut tags = Vec::new();
        for extractor in &self.extractors {
            if !extractor.hint.is_empty() && !name.contains(extractor.hint) {
                continue;
            }
            let Some(captures) = extractor.regex.captures(name) else {
                continue;
            };
            let Some(remove) = captures.get(1) else {
                continue;
            };
            let value = captures.get(2).unwrap_or(remove);
            tags.push((extractor.name.clone(), value.as_str().to_owned()));
            removed.push((remove.start(), remove.end()));
        }
        tags.extend(self.fixed.iter().cloned());
        let extracted_name = name
            .char_indices()
            .filter(|(at, _)| !removed.iter().any(|&(from, to)| (from..to).contains(at)))
            .map(|(_, c)| c)
            .collect();
        Tagged {
            extracted_name,
            tags,
        }
    }
}

fn default_extractor(&(name, pattern, hint): &(&str, &'static str, &'static str)) -> Extractor {
    Extractor {
        name: name.to_owned(),
        regex: Regex::new(pattern).expect("Envoy's default tag regexes compile"),
        hint,
    }
}

impl NameMatcher {
    fn new(matcher: &StringMatcher) -> Self {
        let ignore_case = matcher.ignore_case;
        let folded = |s: &str| {
            if ignore_case {
                s.to_lowercase()
            } else {
                s.to_owned()
            }
        };
        match &matcher.match_pattern {
            Some(MatchPattern::Exact(s)) => NameMatcher::Exact(folded(s), ignore_case),
            Some(MatchPattern::Prefix(s)) => NameMatcher::Prefix(folded(s), ignore_case),
            Some(MatchPattern::Suffix(s)) => NameMatcher::Suffix(folded(s), ignore_case),
            Some(MatchPattern::Contains(s)) => NameMatcher::Contains(folded(s), ignore_case),
            // Envoy's safe_regex must match the whole name.
            Some(MatchPattern::SafeRegex(regex)) => {
                match Regex::new(&format!("^(?:{})$", regex.regex)) {
                    Ok(regex) => NameMatcher::Regex(regex),
                    Err(err) => {
                        tracing::warn!(%err, "stats_config.stats_matcher: invalid regex");
                        NameMatcher::Never
                    }
                }
            }
            Some(MatchPattern::Custom(_)) | None => NameMatcher::Never,
        }
    }

    fn matches(&self, name: &str) -> bool {
        let folded = |ignore_case: bool| {
            if ignore_case {
                std::borrow::Cow::Owned(name.to_lowercase())
            } else {
                std::borrow::Cow::Borrowed(name)
            }
        };
        match self {
            NameMatcher::Exact(s, ic) => folded(*ic) == s.as_str(),
            NameMatcher::Prefix(s, ic) => folded(*ic).starts_with(s.as_str()),
            NameMatcher::Suffix(s, ic) => folded(*ic).ends_with(s.as_str()),
            NameMatcher::Contains(s, ic) => folded(*ic).contains(s.as_str()),
            NameMatcher::Regex(regex) => regex.is_match(name),
            NameMatcher::Never => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tagged(extracted_name: &str, tags: &[(&str, &str)]) -> Tagged {
        Tagged {
            extracted_name: extracted_name.into(),
            tags: tags
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }
    }

    #[test]
    fn envoys_default_tags() {
        let config = StatsConfig::default();
        assert_eq!(
            config.extract("cluster.agent.upstream_cx_total"),
            tagged(
                "cluster.upstream_cx_total",
                &[("envoy.cluster_name", "agent")]
            )
        );
        assert_eq!(
            config.extract("listener.0.0.0.0_15001.downstream_cx_total"),
            tagged(
                "listener.downstream_cx_total",
                &[("envoy.listener_address", "0.0.0.0_15001")]
            )
        );
        assert_eq!(
            config.extract("http.admin.downstream_rq_200"),
            tagged(
                "http.downstream_rq",
                &[
                    ("envoy.response_code", "200"),
                    ("envoy.http_conn_manager_prefix", "admin")
                ]
            )
        );
        assert_eq!(config.extract("server.live"), tagged("server.live", &[]));
    }

    #[test]
    fn istios_tags_from_its_bootstrap() {
        let bootstrap = crate::tests::istio_bootstrap();
        let config = StatsConfig::from_bootstrap(&bootstrap);
        assert_eq!(
            config.extract("cluster.xds-grpc;.upstream_cx_total"),
            tagged("cluster.upstream_cx_total", &[("cluster_name", "xds-grpc")])
        );
        // Istio's inclusion list: server.*, cluster.xds-grpc, not other clusters.
        assert!(config.accepts("server.live"));
        assert!(config.accepts("cluster.xds-grpc;.upstream_cx_total"));
        assert!(!config.accepts("cluster.agent;.upstream_cx_total"));
        assert!(config.accepts("vhost.x.route.y.upstream_rq_total"));
    }
}
