//! `stats.PluginConfig`, the config istiod gives the `istio.stats` filters, read from its
//! proto3 JSON form (typed or inside a `TypedStruct`), checked once: a wrong type names its
//! JSON path; an expression that does not parse is treated as istio-proxy treats it (a
//! dimension override with a bad expression removes the tag, an added dimension or a
//! definition with one is skipped) and reported as a warning.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use serde_json::Value;

use super::expr::Expr;
use super::labels::Tags;
use super::{Metric, STANDARD_TAGS};

/// Which side reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reporter {
    /// An outbound sidecar listener: `reporter="source"`.
    #[default]
    ClientSidecar,
    /// An inbound sidecar listener: `reporter="destination"`.
    ServerSidecar,
    /// A gateway (waypoint) listener: `reporter="destination"`, the destination is the
    /// upstream endpoint.
    ServerGateway,
}

/// A custom metric's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// A custom metric (`definitions`): `istio_<name>`, valued by an integer expression.
#[derive(Debug, Clone, PartialEq)]
pub struct Definition {
    pub name: String,
    pub value: Expr,
    pub kind: MetricKind,
}

/// The compiled plugin config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PluginConfig {
    pub reporter: Reporter,
    pub disable_host_header_fallback: bool,
    /// How often a long TCP connection (or gRPC stream) reports its bytes; 5s by default.
    pub tcp_reporting_duration: Duration,
    pub definitions: Vec<Definition>,
    /// Standard metrics not recorded.
    drop: HashSet<Metric>,
    /// Per standard metric: standard tags replaced by an expression, or removed (`None`).
    overrides: HashMap<Metric, HashMap<String, Option<Expr>>>,
    /// Per metric (standard by config name, or custom): tags added, in order.
    additions: HashMap<String, Vec<(String, Expr)>>,
    /// Expressions that did not parse, for the operator.
    pub warnings: Vec<String>,
}

/// A plugin config that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stats.PluginConfig: {path}: {message}")]
pub struct ConfigError {
    /// JSON path inside the config: `metrics[0].tags_to_remove[1]`.
    pub path: String,
    pub message: String,
}

fn error(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        path: path.into(),
        message: message.into(),
    }
}

fn string<'a>(value: &'a Value, path: &str) -> Result<&'a str, ConfigError> {
    value
        .as_str()
        .ok_or_else(|| error(path, format!("expected a string, got {value}")))
}

fn array<'a>(value: &'a Value, path: &str) -> Result<&'a [Value], ConfigError> {
    value
        .as_array()
        .map(Vec::as_slice)
        .ok_or_else(|| error(path, format!("expected a list, got {value}")))
}

/// A proto3 JSON `Duration`: `"5s"`, `"0.250s"`.
fn duration(value: &Value, path: &str) -> Result<Duration, ConfigError> {
    let text = string(value, path)?;
    text.strip_suffix('s')
        .and_then(|secs| secs.parse::<f64>().ok())
        .filter(|secs| secs.is_finite() && *secs >= 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            error(
                path,
                format!("expected a duration like \"5s\", got {value}"),
            )
        })
}

impl PluginConfig {
    /// Reads the config. `inbound` is the listener's `traffic_direction` (`Some(true)`
    /// INBOUND, `Some(false)` OUTBOUND, `None` unspecified): an unspecified reporter
    /// follows it.
    pub fn from_json(config: &Value, inbound: Option<bool>) -> Result<Self, ConfigError> {
        let object = config
            .as_object()
            .ok_or_else(|| error("", format!("expected an object, got {config}")))?;
        let mut out = PluginConfig {
            tcp_reporting_duration: Duration::from_secs(5),
            reporter: match inbound {
                Some(true) => Reporter::ServerSidecar,
                _ => Reporter::ClientSidecar,
            },
            ..PluginConfig::default()
        };
        let mut metrics: &[Value] = &[];
        let mut definitions: &[Value] = &[];
        for (key, value) in object {
            match key.as_str() {
                "disable_host_header_fallback" | "disableHostHeaderFallback" => {
                    out.disable_host_header_fallback = value
                        .as_bool()
                        .ok_or_else(|| error(key, format!("expected a bool, got {value}")))?;
                }
                "tcp_reporting_duration" | "tcpReportingDuration" => {
                    out.tcp_reporting_duration = duration(value, key)?;
                }
                "reporter" => match value {
                    Value::String(s) if s == "UNSPECIFIED" => {}
                    Value::Number(n) if n.as_u64() == Some(0) => {}
                    Value::String(s) if s == "SERVER_GATEWAY" => {
                        out.reporter = Reporter::ServerGateway
                    }
                    Value::Number(n) if n.as_u64() == Some(1) => {
                        out.reporter = Reporter::ServerGateway
                    }
                    _ => {
                        return Err(error(
                            key,
                            format!("expected UNSPECIFIED or SERVER_GATEWAY, got {value}"),
                        ));
                    }
                },
                "metrics" => metrics = array(value, key)?,
                "definitions" => definitions = array(value, key)?,
                // Scope rotation bounds memory in Envoy's symbol tables; shunt's store has no
                // such growth to bound beyond the label sets themselves.
                "rotation_interval"
                | "rotationInterval"
                | "graceful_deletion_interval"
                | "gracefulDeletionInterval"
                | "rescoping_duration"
                | "scope_grace_period_duration" => {
                    duration(value, key)?;
                }
                other => return Err(error(other, "unknown field of stats.PluginConfig")),
            }
        }
        for (index, definition) in definitions.iter().enumerate() {
            out.read_definition(definition, &format!("definitions[{index}]"))?;
        }
        for (index, metric) in metrics.iter().enumerate() {
            out.read_metric(metric, &format!("metrics[{index}]"))?;
        }
        Ok(out)
    }

    fn read_definition(&mut self, value: &Value, path: &str) -> Result<(), ConfigError> {
        let name = value
            .get("name")
            .map(|v| string(v, &format!("{path}.name")))
            .transpose()?
            .unwrap_or_default();
        let expression = value
            .get("value")
            .map(|v| string(v, &format!("{path}.value")))
            .transpose()?
            .unwrap_or_default();
        let kind = match value.get("type") {
            None => MetricKind::Counter,
            Some(Value::String(s)) if s == "COUNTER" => MetricKind::Counter,
            Some(Value::String(s)) if s == "GAUGE" => MetricKind::Gauge,
            Some(Value::String(s)) if s == "HISTOGRAM" => MetricKind::Histogram,
            Some(Value::Number(n)) if n.as_u64() == Some(0) => MetricKind::Counter,
            Some(Value::Number(n)) if n.as_u64() == Some(1) => MetricKind::Gauge,
            Some(Value::Number(n)) if n.as_u64() == Some(2) => MetricKind::Histogram,
            Some(other) => {
                return Err(error(
                    format!("{path}.type"),
                    format!("expected COUNTER, GAUGE or HISTOGRAM, got {other}"),
                ));
            }
        };
        if Metric::from_config_name(name).is_some() {
            self.warnings.push(format!(
                "{path}: re-defining standard metric {name} is not allowed"
            ));
            return Ok(());
        }
        match Expr::parse(expression) {
            Ok(expr) => {
                if !self.definitions.iter().any(|d| d.name == name) {
                    self.definitions.push(Definition {
                        name: name.to_owned(),
                        value: expr,
                        kind,
                    });
                }
            }
            Err(err) => self
                .warnings
                .push(format!("{path}.value: {err}; the metric is skipped")),
        }
        Ok(())
    }

    fn read_metric(&mut self, value: &Value, path: &str) -> Result<(), ConfigError> {
        let name = value
            .get("name")
            .map(|v| string(v, &format!("{path}.name")))
            .transpose()?
            .unwrap_or_default();
        let standard = Metric::from_config_name(name);
        let all_standard = || Metric::ALL.to_vec();
        let targets: Vec<Metric> = match (name.is_empty(), standard) {
            (true, _) => all_standard(),
            (false, Some(metric)) => vec![metric],
            (false, None) => Vec::new(),
        };
        if value.get("drop").and_then(Value::as_bool) == Some(true) {
            if let Some(metric) = standard {
                self.drop.insert(metric);
            }
            return Ok(());
        }
        if let Some(tags) = value.get("tags_to_remove").or(value.get("tagsToRemove")) {
            for (index, tag) in array(tags, &format!("{path}.tags_to_remove"))?
                .iter()
                .enumerate()
            {
                let tag = string(tag, &format!("{path}.tags_to_remove[{index}]"))?;
                if !STANDARD_TAGS.contains(&tag) {
                    self.warnings.push(format!(
                        "{path}.tags_to_remove[{index}]: {tag} is not a standard tag"
                    ));
                    continue;
                }
                for metric in &targets {
                    self.overrides
                        .entry(*metric)
                        .or_default()
                        .insert(tag.to_owned(), None);
                }
            }
        }
        if let Some(dimensions) = value.get("dimensions") {
            let dimensions = dimensions.as_object().ok_or_else(|| {
                error(
                    format!("{path}.dimensions"),
                    format!("expected a map of tag to expression, got {dimensions}"),
                )
            })?;
            // Sorted, as istio-proxy sorts them, so added tags come in a stable order.
            let sorted: BTreeMap<&String, &Value> = dimensions.iter().collect();
            let custom_targets: Vec<String> = if name.is_empty() {
                self.definitions.iter().map(|d| d.name.clone()).collect()
            } else if self.definitions.iter().any(|d| d.name == name) {
                vec![name.to_owned()]
            } else {
                Vec::new()
            };
            for (tag, expression) in sorted {
                let expression = string(expression, &format!("{path}.dimensions.{tag}"))?;
                let expr = match Expr::parse(expression) {
                    Ok(expr) => Some(expr),
                    Err(err) => {
                        self.warnings
                            .push(format!("{path}.dimensions.{tag}: {err}"));
                        None
                    }
                };
                let is_standard = STANDARD_TAGS.contains(&tag.as_str());
                if is_standard {
                    for metric in &targets {
                        self.overrides
                            .entry(*metric)
                            .or_default()
                            .insert(tag.clone(), expr.clone());
                    }
                } else if let Some(expr) = &expr {
                    for metric in &targets {
                        self.additions
                            .entry(metric.config_name().to_owned())
                            .or_default()
                            .push((tag.clone(), expr.clone()));
                    }
                }
                if let Some(expr) = &expr {
                    for custom in &custom_targets {
                        self.additions
                            .entry(custom.clone())
                            .or_default()
                            .push((tag.clone(), expr.clone()));
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether `metric` is dropped.
    pub fn drops(&self, metric: Metric) -> bool {
        self.drop.contains(&metric)
    }

    /// `tags` after this config's overrides and additions for `metric`.
    pub fn override_tags(
        &self,
        metric: Metric,
        tags: &Tags,
        attributes: &dyn super::expr::Attributes,
    ) -> Tags {
        let overrides = self.overrides.get(&metric);
        let additions = self.additions.get(metric.config_name());
        if overrides.is_none() && additions.is_none() {
            return tags.clone();
        }
        let mut out = Tags::default();
        for (name, value) in &tags.0 {
            match overrides.and_then(|o| o.get(name)) {
                None => out.push(name, value),
                Some(None) => {}
                Some(Some(expr)) => out.push(name, &expr.evaluate(attributes)),
            }
        }
        for (name, expr) in additions.into_iter().flatten() {
            out.push(name, &expr.evaluate(attributes));
        }
        out
    }

    /// The tags of custom metric `name`: only its added dimensions.
    pub fn custom_tags(
        &self,
        name: &str,
        attributes: &dyn super::expr::Attributes,
    ) -> Option<Tags> {
        let additions = self.additions.get(name)?;
        let mut out = Tags::default();
        for (tag, expr) in additions {
            out.push(tag, &expr.evaluate(attributes));
        }
        Some(out)
    }
}
