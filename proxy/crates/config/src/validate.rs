//! Validation of a loaded bootstrap beyond its schema, and the report `--mode validate`
//! prints: what shunt does not implement ([`super::extensions`]), references that cannot
//! resolve, and a short summary of what the bootstrap asks for.
//!
//! ERROR means shunt cannot serve the config as written; WARNING means it would serve it
//! but not do everything Envoy would. Only errors make a bootstrap invalid.

use std::collections::HashSet;
use std::fmt;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::envoy::config::core::v3::{
    Address, ApiConfigSource, ConfigSource, address, api_config_source::ApiType,
    config_source::ConfigSourceSpecifier, grpc_service::TargetSpecifier,
    socket_address::PortSpecifier,
};

use envoy_types::pb::envoy::config::metrics::v3::stats_matcher::StatsMatcher;
use envoy_types::pb::envoy::config::metrics::v3::tag_specifier::TagValue;
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;

use super::diagnostic::{Diagnostic, JsonPath, Severity};
use super::extensions::{self, Implemented};
use super::load::Options;
use super::pool::PoolError;

/// Everything validation found, in bootstrap order.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub findings: Vec<Diagnostic>,
}

impl Report {
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
    }

    pub fn warnings(&self) -> impl Iterator<Item = &Diagnostic> {
        self.findings
            .iter()
            .filter(|f| f.severity == Severity::Warning)
    }

    pub fn is_valid(&self) -> bool {
        self.errors().next().is_none()
    }

    /// Adds what compiling the bootstrap into a snapshot found (shunt's own limits, at
    /// their JSON paths), leaving out what validation already reported at the same
    /// path: an error there, or any finding when compiling only warns.
    pub fn add_compiled(&mut self, errors: &[Diagnostic], warnings: &[Diagnostic]) {
        let problems = errors
            .iter()
            .map(|p| (Severity::Error, p))
            .chain(warnings.iter().map(|p| (Severity::Warning, p)));
        let mut added = Vec::new();
        for (severity, problem) in problems {
            let known = self.findings.iter().any(|f| {
                f.path == problem.path
                    && (f.severity == Severity::Error || severity == Severity::Warning)
            });
            if !known {
                added.push(Diagnostic {
                    severity,
                    path: problem.path.clone(),
                    message: problem.message.clone(),
                });
            }
        }
        self.findings.extend(added);
    }
}

/// Validates a bootstrap, its extensions against `implemented`; `findings` from loading
/// (leniencies) come first in the report.
pub fn validate(
    bootstrap: &Bootstrap,
    options: &Options,
    implemented: &Implemented,
    findings: Vec<Diagnostic>,
) -> Result<Report, PoolError> {
    let mut report = Report { findings };
    extensions::check(bootstrap, implemented, &mut report.findings)?;
    check_names(bootstrap, &mut report.findings);
    check_dynamic_resources(bootstrap, &mut report.findings);
    check_stats(bootstrap, &mut report.findings);
    if options.drain_time > options.parent_shutdown_time {
        report.findings.push(Diagnostic::warning(
            "",
            format!(
                "--drain-time-s ({}s) is longer than --parent-shutdown-time-s ({}s): \
                 connections still draining are cut at parent shutdown",
                options.drain_time.as_secs(),
                options.parent_shutdown_time.as_secs()
            ),
        ));
    }
    Ok(report)
}

/// Names that must be unique, or present.
fn check_names(bootstrap: &Bootstrap, findings: &mut Vec<Diagnostic>) {
    let Some(resources) = &bootstrap.static_resources else {
        return;
    };
    let mut seen = HashSet::new();
    for (i, listener) in resources.listeners.iter().enumerate() {
        let path = JsonPath::new("static_resources")
            .field("listeners")
            .index(i);
        if !listener.name.is_empty() && !seen.insert(listener.name.as_str()) {
            findings.push(Diagnostic::error(
                path.field("name"),
                format!("a second listener named {:?}", listener.name),
            ));
        }
        if listener.address.is_none()
            && listener.listener_specifier.is_none()
            && listener.api_listener.is_none()
        {
            findings.push(Diagnostic::error(
                &path,
                "a listener needs an address (or internal_listener)",
            ));
        }
    }
    let mut seen = HashSet::new();
    for (i, cluster) in resources.clusters.iter().enumerate() {
        let path = JsonPath::new("static_resources")
            .field("clusters")
            .index(i)
            .field("name");
        if cluster.name.is_empty() {
            findings.push(Diagnostic::error(&path, "a cluster needs a name"));
        } else if !seen.insert(cluster.name.as_str()) {
            findings.push(Diagnostic::error(
                &path,
                format!("a second cluster named {:?}", cluster.name),
            ));
        }
    }
    let mut seen = HashSet::new();
    for (i, secret) in resources.secrets.iter().enumerate() {
        if !secret.name.is_empty() && !seen.insert(secret.name.as_str()) {
            findings.push(Diagnostic::error(
                JsonPath::new("static_resources")
                    .field("secrets")
                    .index(i)
                    .field("name"),
                format!("a second secret named {:?}", secret.name),
            ));
        }
    }
}

/// The xDS servers must be reachable from the bootstrap alone: an `envoy_grpc` target
/// must be a static cluster, and `ads: {}` needs `ads_config`.
fn check_dynamic_resources(bootstrap: &Bootstrap, findings: &mut Vec<Diagnostic>) {
    let Some(dynamic) = &bootstrap.dynamic_resources else {
        return;
    };
    let static_clusters: HashSet<&str> = bootstrap
        .static_resources
        .iter()
        .flat_map(|resources| &resources.clusters)
        .map(|cluster| cluster.name.as_str())
        .collect();
    let check_api = |api: &ApiConfigSource, path: &JsonPath, findings: &mut Vec<Diagnostic>| {
        for (i, service) in api.grpc_services.iter().enumerate() {
            if let Some(TargetSpecifier::EnvoyGrpc(grpc)) = &service.target_specifier
                && !static_clusters.contains(grpc.cluster_name.as_str())
            {
                findings.push(Diagnostic::error(
                    path.field("grpc_services")
                        .index(i)
                        .field("envoy_grpc")
                        .field("cluster_name"),
                    format!(
                        "{:?} is not a static cluster, and the xDS server must be reachable \
                         before any dynamic cluster exists",
                        grpc.cluster_name
                    ),
                ));
            }
        }
    };
    if let Some(ads) = &dynamic.ads_config {
        let path = JsonPath::new("dynamic_resources").field("ads_config");
        check_api(ads, &path, findings);
    }
    for (name, source) in [
        ("lds_config", &dynamic.lds_config),
        ("cds_config", &dynamic.cds_config),
    ] {
        let path = JsonPath::new("dynamic_resources").field(name);
        match source
            .as_ref()
            .and_then(|s| s.config_source_specifier.as_ref())
        {
            Some(ConfigSourceSpecifier::ApiConfigSource(api)) => {
                check_api(api, &path.field("api_config_source"), findings)
            }
            Some(ConfigSourceSpecifier::Ads(_)) if dynamic.ads_config.is_none() => {
                findings.push(Diagnostic::error(
                    path.field("ads"),
                    "says ADS, but dynamic_resources.ads_config is not set",
                ));
            }
            _ => {}
        }
    }
}

/// Stats options the admin API cannot honour as written: tag and matcher regexes its
/// regex engine (RE2 syntax, as Envoy's `safe_regex`) refuses, such as the lookaheads
/// Envoy's older std::regex took, and custom matchers.
fn check_stats(bootstrap: &Bootstrap, findings: &mut Vec<Diagnostic>) {
    let Some(stats) = &bootstrap.stats_config else {
        return;
    };
    for (i, tag) in stats.stats_tags.iter().enumerate() {
        if let Some(TagValue::Regex(pattern)) = &tag.tag_value
            && let Err(err) = regex::Regex::new(pattern)
        {
            findings.push(Diagnostic::warning(
                JsonPath::new("stats_config")
                    .field("stats_tags")
                    .index(i)
                    .field("regex"),
                format!(
                    "tag {:?}: shunt cannot run this regex ({}); the tag is not extracted",
                    tag.tag_name,
                    first_line(&err.to_string())
                ),
            ));
        }
    }
    let patterns = match stats
        .stats_matcher
        .as_ref()
        .and_then(|m| m.stats_matcher.as_ref())
    {
        Some(StatsMatcher::InclusionList(list)) => Some(("inclusion_list", &list.patterns)),
        Some(StatsMatcher::ExclusionList(list)) => Some(("exclusion_list", &list.patterns)),
        _ => None,
    };
    if let Some((list, patterns)) = patterns {
        for (i, pattern) in patterns.iter().enumerate() {
            let path = JsonPath::new("stats_config")
                .field("stats_matcher")
                .field(list)
                .field("patterns")
                .index(i);
            match &pattern.match_pattern {
                Some(MatchPattern::SafeRegex(regex)) => {
                    if let Err(err) = regex::Regex::new(&regex.regex) {
                        findings.push(Diagnostic::warning(
                            path.field("safe_regex").field("regex"),
                            format!(
                                "invalid regex ({}); it matches no stat",
                                first_line(&err.to_string())
                            ),
                        ));
                    }
                }
                Some(MatchPattern::Custom(_)) => findings.push(Diagnostic::warning(
                    path.field("custom"),
                    "custom string matchers are not implemented; it matches no stat",
                )),
                _ => {}
            }
        }
    }
}

/// The regex crate's errors span lines (the pattern, a caret, the reason): the reason.
fn first_line(message: &str) -> &str {
    message
        .lines()
        .rev()
        .find(|line| line.trim_start().starts_with("error:"))
        .map_or(message, |line| {
            line.trim_start().trim_start_matches("error:").trim()
        })
}

/// The short account of a bootstrap `--mode validate` prints.
pub struct Summary<'a> {
    pub bootstrap: &'a Bootstrap,
    pub options: &'a Options,
}

impl fmt::Display for Summary<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bootstrap = self.bootstrap;
        if let Some(node) = &bootstrap.node {
            writeln!(f, "node: id {:?}, cluster {:?}", node.id, node.cluster)?;
        } else {
            writeln!(f, "node: none")?;
        }
        let admin = bootstrap
            .admin
            .as_ref()
            .and_then(|admin| admin.address.as_ref())
            .map_or_else(|| "none".to_owned(), describe_address);
        writeln!(f, "admin: {admin}")?;
        let (listeners, clusters, secrets) =
            bootstrap
                .static_resources
                .as_ref()
                .map_or((0, 0, 0), |resources| {
                    (
                        resources.listeners.len(),
                        resources.clusters.len(),
                        resources.secrets.len(),
                    )
                });
        writeln!(
            f,
            "static resources: {listeners} listeners, {clusters} clusters, {secrets} secrets"
        )?;
        writeln!(f, "dynamic resources: {}", describe_dynamic(bootstrap))?;
        write!(
            f,
            "drain time: {}s, parent shutdown time: {}s",
            self.options.drain_time.as_secs(),
            self.options.parent_shutdown_time.as_secs()
        )
    }
}

fn describe_address(address: &Address) -> String {
    match &address.address {
        Some(address::Address::SocketAddress(socket)) => match &socket.port_specifier {
            Some(PortSpecifier::PortValue(port)) if socket.address.contains(':') => {
                format!("[{}]:{port}", socket.address)
            }
            Some(PortSpecifier::PortValue(port)) => format!("{}:{port}", socket.address),
            Some(PortSpecifier::NamedPort(name)) => format!("{}:{name}", socket.address),
            None => socket.address.clone(),
        },
        Some(address::Address::Pipe(pipe)) => format!("unix:{}", pipe.path),
        Some(address::Address::EnvoyInternalAddress(_)) => "an internal address".into(),
        None => "none".into(),
    }
}

fn describe_dynamic(bootstrap: &Bootstrap) -> String {
    let Some(dynamic) = &bootstrap.dynamic_resources else {
        return "none".into();
    };
    let mut parts = Vec::new();
    if let Some(ads) = &dynamic.ads_config {
        parts.push(format!("ADS {}", describe_api(ads)));
    }
    for (kind, source, locator) in [
        ("LDS", &dynamic.lds_config, &dynamic.lds_resources_locator),
        ("CDS", &dynamic.cds_config, &dynamic.cds_resources_locator),
    ] {
        if let Some(source) = source {
            parts.push(format!("{kind} {}", describe_source(source)));
        } else if !locator.is_empty() {
            parts.push(format!("{kind} from {locator}"));
        }
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("; ")
    }
}

fn describe_source(source: &ConfigSource) -> String {
    match &source.config_source_specifier {
        Some(ConfigSourceSpecifier::Ads(_)) => "over ADS".into(),
        Some(ConfigSourceSpecifier::ApiConfigSource(api)) => describe_api(api),
        #[allow(deprecated, reason = "Envoy still reads the deprecated `path`")]
        Some(ConfigSourceSpecifier::Path(path)) => format!("from file {path}"),
        Some(ConfigSourceSpecifier::PathConfigSource(path)) => {
            format!("from file {}", path.path)
        }
        Some(ConfigSourceSpecifier::Self_(_)) => "from the server that sent it".into(),
        None => "unspecified".into(),
    }
}

/// `DELTA_GRPC to cluster xds-grpc`.
fn describe_api(api: &ApiConfigSource) -> String {
    let api_type = ApiType::try_from(api.api_type).map_or_else(
        |_| format!("api_type {}", api.api_type),
        |t| t.as_str_name().to_owned(),
    );
    let mut targets: Vec<String> = api
        .grpc_services
        .iter()
        .filter_map(|service| match &service.target_specifier {
            Some(TargetSpecifier::EnvoyGrpc(grpc)) => {
                Some(format!("cluster {}", grpc.cluster_name))
            }
            Some(TargetSpecifier::GoogleGrpc(grpc)) => {
                Some(format!("Google gRPC {}", grpc.target_uri))
            }
            None => None,
        })
        .collect();
    targets.extend(
        api.cluster_names
            .iter()
            .map(|name| format!("cluster {name}")),
    );
    if targets.is_empty() {
        api_type
    } else {
        format!("{api_type} to {}", targets.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::json::from_json;

    fn report_for(value: serde_json::Value) -> Report {
        let (bootstrap, leniencies) = from_json::<Bootstrap>(value).unwrap();
        assert!(leniencies.is_empty());
        validate(
            &bootstrap,
            &Options::default(),
            &Implemented::default(),
            Vec::new(),
        )
        .unwrap()
    }

    #[test]
    fn the_ads_cluster_must_be_static() {
        let report = report_for(json!({
            "dynamic_resources": {
                "ads_config": {"api_type": "GRPC", "grpc_services": [{"envoy_grpc": {"cluster_name": "xds"}}]},
                "lds_config": {"ads": {}}
            }
        }));
        let errors: Vec<_> = report.errors().map(|f| f.path.as_str()).collect();
        assert_eq!(
            errors,
            ["dynamic_resources.ads_config.grpc_services[0].envoy_grpc.cluster_name"]
        );
    }

    #[test]
    fn ads_without_ads_config_is_an_error() {
        let report = report_for(json!({"dynamic_resources": {"cds_config": {"ads": {}}}}));
        let errors: Vec<_> = report.errors().map(|f| f.path.as_str()).collect();
        assert_eq!(errors, ["dynamic_resources.cds_config.ads"]);
    }

    #[test]
    fn duplicate_cluster_names_are_errors() {
        let report =
            report_for(json!({"static_resources": {"clusters": [{"name": "a"}, {"name": "a"}]}}));
        assert!(!report.is_valid());
        assert_eq!(
            report.errors().next().unwrap().path,
            "static_resources.clusters[1].name"
        );
    }

    #[test]
    fn summary_names_what_the_bootstrap_asks_for() {
        let (bootstrap, _) = from_json::<Bootstrap>(json!({
            "node": {"id": "n", "cluster": "c"},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
            "dynamic_resources": {
                "ads_config": {"api_type": "DELTA_GRPC", "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]},
                "lds_config": {"ads": {}},
                "cds_config": {"ads": {}}
            },
            "static_resources": {"clusters": [{"name": "xds-grpc"}]}
        }))
        .unwrap();
        let options = Options {
            drain_time: std::time::Duration::from_secs(45),
            parent_shutdown_time: std::time::Duration::from_secs(60),
            ..Default::default()
        };
        let text = Summary {
            bootstrap: &bootstrap,
            options: &options,
        }
        .to_string();
        assert_eq!(
            text,
            "node: id \"n\", cluster \"c\"\n\
             admin: 127.0.0.1:15000\n\
             static resources: 0 listeners, 1 clusters, 0 secrets\n\
             dynamic resources: ADS DELTA_GRPC to cluster xds-grpc; LDS over ADS; CDS over ADS\n\
             drain time: 45s, parent shutdown time: 60s"
        );
    }
}
