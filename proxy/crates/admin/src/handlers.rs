//! The admin endpoints: each a function from the shared admin state and the query to a
//! reply, in Envoy's formats. The table [`ENDPOINTS`] is also the help text; a path not in
//! it gets 404 with that help, and an endpoint that changes the server answers only POST
//! (405 otherwise), as Envoy's admin does.

use std::fmt::Write;
use std::time::Duration;

use envoy_types::pb::envoy::admin::v3::{Clusters, Listeners, ServerInfo, server_info};
use envoy_types::pb::envoy::config::core::v3::HealthStatus;
use hyper::{Method, StatusCode};
use regex::Regex;
use serde_json::json;

use super::Shared;
use super::config_dump;
use super::prometheus::{self, Selection};
use super::state::Drain;
use shunt_config::address_text;
use shunt_core::stats::{QUANTILES, Stat, StatValue};

/// An answer: status, content type, body.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub status: StatusCode,
    pub content_type: &'static str,
    pub body: String,
}

pub const TEXT: &str = "text/plain; charset=UTF-8";
pub const JSON: &str = "application/json";

impl Reply {
    pub fn text(status: StatusCode, body: impl Into<String>) -> Self {
        Reply {
            status,
            content_type: TEXT,
            body: body.into(),
        }
    }

    pub fn ok(body: impl Into<String>) -> Self {
        Reply::text(StatusCode::OK, body)
    }

    pub fn json(value: &serde_json::Value) -> Self {
        let mut body = serde_json::to_string_pretty(value).unwrap_or_default();
        body.push('\n');
        Reply {
            status: StatusCode::OK,
            content_type: JSON,
            body,
        }
    }
}

/// The decoded query string, in order; a key without `=` has an empty value.
#[derive(Debug, Default)]
pub struct Query(Vec<(String, String)>);

impl Query {
    pub fn parse(query: &str) -> Self {
        Query(
            query
                .split('&')
                .filter(|pair| !pair.is_empty())
                .map(|pair| {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    (percent_decode(key), percent_decode(value))
                })
                .collect(),
        )
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn has(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `%XX` decoded (as Envoy's admin does; `+` stays `+`, it is common in regexes, so
/// this is not `application/x-www-form-urlencoded`); a `%` without two hex digits stays.
fn percent_decode(text: &str) -> String {
    percent_encoding::percent_decode_str(text)
        .decode_utf8_lossy()
        .into_owned()
}

type Handler = fn(&Shared, &Query) -> Reply;

/// One endpoint: path, help, whether it changes the server (POST only), parameters
/// (`name`, help, choices), handler.
pub struct Endpoint {
    pub path: &'static str,
    pub help: &'static str,
    pub mutates: bool,
    pub params: &'static [(&'static str, &'static str, &'static [&'static str])],
    handler: Handler,
}

/// Every endpoint, sorted by path (the help lists them in this order).
pub const ENDPOINTS: &[Endpoint] = &[
    Endpoint {
        path: "/",
        help: "Admin home page",
        mutates: false,
        params: &[],
        handler: help,
    },
    Endpoint {
        path: "/clusters",
        help: "upstream cluster status",
        mutates: false,
        params: &[("format", "File format to use", &["text", "json"])],
        handler: clusters,
    },
    Endpoint {
        path: "/config_dump",
        help: "dump current Envoy configs (experimental)",
        mutates: false,
        params: &[
            ("resource", "The resource to dump", &[]),
            (
                "mask",
                "The mask to apply. When both resource and mask are specified, the mask is \
                 applied to every element in the desired repeated field so that only a subset \
                 of fields are returned. The mask is parsed as a ProtobufWkt::FieldMask",
                &[],
            ),
            (
                "name_regex",
                "Dump only the currently loaded configurations whose names match the \
                 specified regex. Can be used with both resource and mask query parameters.",
                &[],
            ),
            (
                "include_eds",
                "Dump currently loaded configuration including EDS. See the response \
                 definition for more information",
                &[],
            ),
        ],
        handler: config_dump,
    },
    Endpoint {
        path: "/drain_listeners",
        help: "drain listeners",
        mutates: true,
        params: &[
            (
                "graceful",
                "When draining listeners, enter a graceful drain period prior to closing \
                 listeners. This behaviour and duration is configurable via server options \
                 or CLI",
                &[],
            ),
            (
                "skip_exit",
                "When draining listeners, do not exit after the drain period. This must be \
                 used with graceful",
                &[],
            ),
            (
                "inboundonly",
                "Drains all inbound listeners. traffic_direction field in \
                 envoy_v3_api_msg_config.listener.v3.Listener is used to determine whether a \
                 listener is inbound or outbound.",
                &[],
            ),
        ],
        handler: drain_listeners,
    },
    Endpoint {
        path: "/healthcheck/fail",
        help: "cause the server to fail health checks",
        mutates: true,
        params: &[],
        handler: healthcheck_fail,
    },
    Endpoint {
        path: "/healthcheck/ok",
        help: "cause the server to pass health checks",
        mutates: true,
        params: &[],
        handler: healthcheck_ok,
    },
    Endpoint {
        path: "/help",
        help: "print out list of admin commands",
        mutates: false,
        params: &[],
        handler: help,
    },
    Endpoint {
        path: "/listeners",
        help: "print listener info",
        mutates: false,
        params: &[("format", "File format to use", &["text", "json"])],
        handler: listeners,
    },
    Endpoint {
        path: "/logging",
        help: "query/change logging levels",
        mutates: true,
        params: &[
            (
                "paths",
                "Change multiple logging levels by setting to \
                 <logger_name1>:<desired_level1>,<logger_name2>:<desired_level2>. \
                 Logger names are tracing targets, for example shunt::tcp:debug",
                &[],
            ),
            (
                "level",
                "desired logging level, this will change all loggers's level",
                &[
                    "", "trace", "debug", "info", "warning", "error", "critical", "off",
                ],
            ),
        ],
        handler: logging,
    },
    Endpoint {
        path: "/quitquitquit",
        help: "exit the server",
        mutates: true,
        params: &[],
        handler: quitquitquit,
    },
    Endpoint {
        path: "/ready",
        help: "print server state, return 200 if LIVE, otherwise return 503",
        mutates: false,
        params: &[],
        handler: ready,
    },
    Endpoint {
        path: "/server_info",
        help: "print server version/status information",
        mutates: false,
        params: &[],
        handler: server_info,
    },
    Endpoint {
        path: "/stats",
        help: "print server stats",
        mutates: false,
        params: &[
            (
                "usedonly",
                "Only include stats that have been written by system since restart",
                &[],
            ),
            (
                "filter",
                "Regular expression (Google re2) for filtering stats",
                &[],
            ),
            (
                "format",
                "Format to use",
                &["html", "active-html", "text", "json", "prometheus"],
            ),
            (
                "type",
                "Stat types to include.",
                &["All", "Counters", "Histograms", "Gauges", "TextReadouts"],
            ),
        ],
        handler: stats,
    },
    Endpoint {
        path: "/stats/prometheus",
        help: "print server stats in prometheus format",
        mutates: false,
        params: &[
            (
                "usedonly",
                "Only include stats that have been written by system since restart",
                &[],
            ),
            (
                "filter",
                "Regular expression (Google re2) for filtering stats",
                &[],
            ),
        ],
        handler: stats_prometheus,
    },
];

/// Routes one admin request.
pub fn handle(shared: &Shared, method: &Method, path: &str, query: &str) -> Reply {
    let query = Query::parse(query);
    let Some(endpoint) = ENDPOINTS.iter().find(|e| e.path == path) else {
        return Reply::text(
            StatusCode::NOT_FOUND,
            format!("invalid path. {}", help_text()),
        );
    };
    // Listing the log levels changes nothing, so GET may do it; changing them needs POST.
    let listing_levels = endpoint.path == "/logging" && query.is_empty();
    if endpoint.mutates && method != Method::POST && !listing_levels {
        tracing::warn!(
            path = endpoint.path,
            %method,
            "admin path mutates state, method is not POST"
        );
        return Reply::text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("Method {method} not allowed, POST required."),
        );
    }
    (endpoint.handler)(shared, &query)
}

/// Envoy's help: `admin commands are:` then each endpoint and its parameters.
pub fn help_text() -> String {
    let mut out = String::from("admin commands are:\n");
    for endpoint in ENDPOINTS {
        let post = if endpoint.mutates { " (POST)" } else { "" };
        let _ = writeln!(out, "  {}{post}: {}", endpoint.path, endpoint.help);
        for (name, help, choices) in endpoint.params {
            let _ = write!(out, "      {name}: {help}");
            if !choices.is_empty() {
                let _ = write!(out, "; One of ({})", choices.join(", "));
            }
            out.push('\n');
        }
    }
    out
}

fn help(_: &Shared, _: &Query) -> Reply {
    Reply::ok(help_text())
}

fn config_dump(shared: &Shared, query: &Query) -> Reply {
    let params = config_dump::Params {
        resource: query.get("resource").map(str::to_owned),
        mask: query.get("mask").map(str::to_owned),
        name_regex: query.get("name_regex").map(str::to_owned),
        include_eds: query.has("include_eds"),
    };
    match config_dump::config_dump(&*shared.state, shared.started, &params) {
        Ok(dump) => Reply::json(&dump),
        Err((status, message)) => Reply::text(status, message),
    }
}

fn clusters(shared: &Shared, query: &Query) -> Reply {
    let statuses = shared.state.clusters();
    if query.get("format") == Some("json") {
        return to_json(&Clusters {
            cluster_statuses: statuses,
        });
    }
    let mut out = String::new();
    for cluster in &statuses {
        let name = &cluster.name;
        let _ = writeln!(
            out,
            "{name}::observability_name::{}",
            cluster.observability_name
        );
        let thresholds = cluster
            .circuit_breakers
            .as_ref()
            .map(|cb| cb.thresholds.as_slice())
            .unwrap_or_default();
        for (priority, label) in [(0, "default"), (1, "high")] {
            let Some(t) = thresholds.iter().find(|t| t.priority == priority) else {
                continue;
            };
            let value = |v: Option<envoy_types::pb::google::protobuf::UInt32Value>| {
                v.map_or(0, |v| v.value)
            };
            let _ = writeln!(
                out,
                "{name}::{label}_priority::max_connections::{}",
                value(t.max_connections)
            );
            let _ = writeln!(
                out,
                "{name}::{label}_priority::max_pending_requests::{}",
                value(t.max_pending_requests)
            );
            let _ = writeln!(
                out,
                "{name}::{label}_priority::max_requests::{}",
                value(t.max_requests)
            );
            let _ = writeln!(
                out,
                "{name}::{label}_priority::max_retries::{}",
                value(t.max_retries)
            );
        }
        let _ = writeln!(out, "{name}::added_via_api::{}", cluster.added_via_api);
        if !cluster.eds_service_name.is_empty() {
            let _ = writeln!(
                out,
                "{name}::eds_service_name::{}",
                cluster.eds_service_name
            );
        }
        for host in &cluster.host_statuses {
            let address = host.address.as_ref().map(address_text).unwrap_or_default();
            let mut stats: Vec<_> = host.stats.iter().collect();
            stats.sort_by(|a, b| a.name.cmp(&b.name));
            for stat in stats {
                let _ = writeln!(out, "{name}::{address}::{}::{}", stat.name, stat.value);
            }
            let locality = host.locality.clone().unwrap_or_default();
            let health = host.health_status.unwrap_or_default();
            let rate = |r: Option<envoy_types::pb::envoy::r#type::v3::Percent>| {
                r.map_or("-1".to_owned(), |r| r.value.to_string())
            };
            let lines = [
                ("hostname", host.hostname.clone()),
                ("health_flags", health_flags(&health)),
                ("weight", host.weight.to_string()),
                ("region", locality.region),
                ("zone", locality.zone),
                ("sub_zone", locality.sub_zone),
                ("canary", "false".into()),
                ("priority", host.priority.to_string()),
                ("success_rate", rate(host.success_rate)),
                (
                    "local_origin_success_rate",
                    rate(host.local_origin_success_rate),
                ),
            ];
            for (key, value) in lines {
                let _ = writeln!(out, "{name}::{address}::{key}::{value}");
            }
        }
    }
    Reply::ok(out)
}

/// Envoy's `healthFlagsToString`: `healthy`, or each failing flag as `/flag`.
fn health_flags(health: &envoy_types::pb::envoy::admin::v3::HostHealthStatus) -> String {
    let mut flags = String::new();
    let checks = [
        (health.failed_active_health_check, "/failed_active_hc"),
        (health.failed_outlier_check, "/failed_outlier_check"),
        (
            health.eds_health_status == HealthStatus::Unhealthy as i32,
            "/failed_eds_health",
        ),
        (health.failed_active_degraded_check, "/degraded_active_hc"),
        (
            health.eds_health_status == HealthStatus::Degraded as i32,
            "/degraded_eds_health",
        ),
        (health.pending_dynamic_removal, "/pending_dynamic_removal"),
        (health.pending_active_hc, "/pending_active_hc"),
        (
            health.excluded_via_immediate_hc_fail,
            "/excluded_via_immediate_hc_fail",
        ),
        (health.active_hc_timeout, "/active_hc_timeout"),
        (
            health.eds_health_status == HealthStatus::Draining as i32,
            "/eds_status_draining",
        ),
    ];
    for (set, flag) in checks {
        if set {
            flags.push_str(flag);
        }
    }
    if flags.is_empty() {
        "healthy".into()
    } else {
        flags
    }
}

fn listeners(shared: &Shared, query: &Query) -> Reply {
    let statuses = shared.state.listeners();
    if query.get("format") == Some("json") {
        return to_json(&Listeners {
            listener_statuses: statuses,
        });
    }
    let mut out = String::new();
    for listener in &statuses {
        let address = listener
            .local_address
            .as_ref()
            .map(address_text)
            .unwrap_or_default();
        let _ = writeln!(out, "{}::{address}", listener.name);
    }
    Reply::ok(out)
}

fn to_json<M: prost::Message + prost::Name>(message: &M) -> Reply {
    match shunt_config::message_to_json(message) {
        Ok(value) => Reply::json(&value),
        Err(err) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n")),
    }
}

fn server_info(shared: &Shared, _: &Query) -> Reply {
    let uptime = prost_types_duration(shared.uptime());
    let state = shared.server_state();
    let info = ServerInfo {
        version: super::version(),
        state: state as i32,
        uptime_current_epoch: Some(uptime),
        uptime_all_epochs: Some(uptime),
        hot_restart_version: "disabled".into(),
        command_line_options: Some(shared.command_line.clone()),
        node: shared.state.bootstrap().node,
        hot_restart_initializing: false,
    };
    match shunt_config::message_to_json(&info) {
        Ok(mut value) => {
            // Envoy prints the state even when it is LIVE, proto3's default.
            if let Some(object) = value.as_object_mut() {
                object.insert("state".into(), json!(state.as_str_name()));
            }
            Reply::json(&value)
        }
        Err(err) => Reply::text(StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n")),
    }
}

fn prost_types_duration(duration: Duration) -> envoy_types::pb::google::protobuf::Duration {
    envoy_types::pb::google::protobuf::Duration {
        seconds: duration.as_secs() as i64,
        nanos: 0,
    }
}

fn ready(shared: &Shared, _: &Query) -> Reply {
    let state = shared.server_state();
    let status = if state == server_info::State::Live {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Reply::text(status, format!("{}\n", state.as_str_name()))
}

fn healthcheck_fail(shared: &Shared, _: &Query) -> Reply {
    shared.set_health_check_failed(true);
    Reply::ok("OK\n")
}

fn healthcheck_ok(shared: &Shared, _: &Query) -> Reply {
    shared.set_health_check_failed(false);
    Reply::ok("OK\n")
}

fn drain_listeners(shared: &Shared, query: &Query) -> Reply {
    let drain = Drain {
        graceful: query.has("graceful"),
        inbound_only: query.has("inboundonly"),
        skip_exit: query.has("skip_exit"),
    };
    if drain.skip_exit && !drain.graceful {
        return Reply::text(StatusCode::BAD_REQUEST, "skip_exit requires graceful\n");
    }
    shared.state.drain_listeners(drain);
    Reply::ok("OK\n")
}

fn quitquitquit(shared: &Shared, _: &Query) -> Reply {
    tracing::info!("/quitquitquit: shutting down");
    shared.state.shutdown();
    shared.request_stop();
    Reply::ok("OK\n")
}

const LOGGING_USAGE: &str = "usage: /logging?level=<level> (change all levels)\n\
     usage: /logging?paths=<logger>:<level>,<logger>:<level> (change the named loggers)\n\
     levels: trace debug info warning error critical off\n";

fn logging(shared: &Shared, query: &Query) -> Reply {
    let result = if query.is_empty() {
        Ok(())
    } else if let Some(level) = query.get("level").filter(|l| !l.is_empty()) {
        shared.log.set_all(level)
    } else if let Some(paths) = query.get("paths").filter(|p| !p.is_empty()) {
        shared.log.set_paths(paths)
    } else {
        Err("no level or paths given".into())
    };
    match result {
        Ok(()) => Reply::ok(shared.log.listing()),
        Err(err) => Reply::text(
            StatusCode::BAD_REQUEST,
            format!("error: {err}\n{LOGGING_USAGE}"),
        ),
    }
}

/// `?usedonly` and `?filter=`.
fn selection(query: &Query) -> Result<Selection, Reply> {
    let filter = match query.get("filter").filter(|f| !f.is_empty()) {
        None => None,
        Some(pattern) => Some(Regex::new(pattern).map_err(|err| {
            Reply::text(
                StatusCode::BAD_REQUEST,
                format!("Invalid re2 regex: {err}\n"),
            )
        })?),
    };
    Ok(Selection {
        used_only: query.has("usedonly"),
        filter,
    })
}

fn stats_prometheus(shared: &Shared, query: &Query) -> Reply {
    match selection(query) {
        Ok(selection) => Reply::ok(prometheus::render(
            &shared.stats(),
            &shared.stats_config,
            &selection,
        )),
        Err(reply) => reply,
    }
}

/// The labels of [`QUANTILES`], as Envoy prints them.
const QUANTILE_LABELS: &[&str] = &[
    "0", "25", "50", "75", "90", "95", "99", "99.5", "99.9", "100",
];

fn stats(shared: &Shared, query: &Query) -> Reply {
    if query.get("format") == Some("prometheus") {
        return stats_prometheus(shared, query);
    }
    let selection = match selection(query) {
        Ok(selection) => selection,
        Err(reply) => return reply,
    };
    let kind = query.get("type").unwrap_or("All");
    let wanted = |stat: &Stat| {
        matches!(
            (&stat.value, kind),
            (_, "All")
                | (StatValue::Counter(_), "Counters")
                | (StatValue::Gauge(_), "Gauges")
                | (StatValue::Histogram(_), "Histograms")
        )
    };
    if !["All", "Counters", "Gauges", "Histograms", "TextReadouts"].contains(&kind) {
        return Reply::text(
            StatusCode::BAD_REQUEST,
            format!("invalid &type= param: '{kind}'\n"),
        );
    }
    let stats: Vec<Stat> = shared
        .stats()
        .into_iter()
        .filter(|s| selection.includes(s) && wanted(s))
        .collect();
    let (numbers, histograms): (Vec<&Stat>, Vec<&Stat>) = stats
        .iter()
        .partition(|s| !matches!(s.value, StatValue::Histogram(_)));

    if query.get("format") == Some("json") {
        let mut entries: Vec<serde_json::Value> = numbers
            .iter()
            .map(|stat| match stat.value {
                StatValue::Counter(v) | StatValue::Gauge(v) => {
                    json!({"name": stat.name, "value": v})
                }
                StatValue::Histogram(_) => unreachable!("partitioned out"),
            })
            .collect();
        if !histograms.is_empty() {
            let computed: Vec<serde_json::Value> = histograms
                .iter()
                .filter_map(|stat| match &stat.value {
                    StatValue::Histogram(summary) => Some(json!({
                        "name": stat.name,
                        "values": QUANTILES
                            .iter()
                            .map(|&q| json!({"interval": null, "cumulative": summary.quantile(q)}))
                            .collect::<Vec<_>>(),
                    })),
                    _ => None,
                })
                .collect();
            let supported: Vec<serde_json::Value> = QUANTILE_LABELS
                .iter()
                .map(|label| serde_json::from_str(label).unwrap_or(serde_json::Value::Null))
                .collect();
            entries.push(json!({"histograms": {
                "supported_quantiles": supported,
                "computed_quantiles": computed,
            }}));
        }
        return Reply::json(&json!({ "stats": entries }));
    }

    let mut out = String::new();
    for stat in numbers {
        if let StatValue::Counter(v) | StatValue::Gauge(v) = stat.value {
            let _ = writeln!(out, "{}: {v}", stat.name);
        }
    }
    for stat in histograms {
        let StatValue::Histogram(summary) = &stat.value else {
            continue;
        };
        if summary.count == 0 {
            let _ = writeln!(out, "{}: No recorded values", stat.name);
            continue;
        }
        let quantiles: Vec<String> = QUANTILES
            .iter()
            .zip(QUANTILE_LABELS)
            .map(|(&q, label)| {
                let value = summary.quantile(q).map_or("nan".into(), significant);
                format!("P{label}(nan,{value})")
            })
            .collect();
        let _ = writeln!(out, "{}: {}", stat.name, quantiles.join(" "));
    }
    Reply::ok(out)
}

/// A number with six significant digits, like C's `%g` without the exponent form.
fn significant(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return value.to_string();
    }
    let magnitude = value.abs().log10().floor() as i32 + 1;
    let scale = 10f64.powi(6 - magnitude);
    ((value * scale).round() / scale).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_like_envoys() {
        let query = Query::parse("filter=cluster%5C..*%2Bx&usedonly&format=json");
        assert_eq!(query.get("filter"), Some("cluster\\..*+x"));
        assert!(query.has("usedonly"));
        assert_eq!(query.get("format"), Some("json"));
        assert_eq!(query.get("nope"), None);
    }

    #[test]
    fn plus_stays_and_stray_percents_pass_through() {
        let query = Query::parse("a=1+1&b=100%&c=%zz%41&d=%E2%9C%93&=x&e");
        assert_eq!(query.get("a"), Some("1+1"));
        assert_eq!(query.get("b"), Some("100%"));
        assert_eq!(query.get("c"), Some("%zzA"));
        assert_eq!(query.get("d"), Some("\u{2713}"));
        assert_eq!(query.get(""), Some("x"));
        assert_eq!(query.get("e"), Some(""));
    }

    #[test]
    fn help_marks_post_endpoints_and_lists_choices() {
        let help = help_text();
        assert!(help.starts_with("admin commands are:\n  /: Admin home page\n"));
        assert!(help.contains("  /quitquitquit (POST): exit the server\n"));
        assert!(help.contains("      format: File format to use; One of (text, json)\n"));
        let paths: Vec<&str> = ENDPOINTS.iter().map(|e| e.path).collect();
        let mut sorted = paths.clone();
        sorted.sort();
        assert_eq!(paths, sorted);
    }

    #[test]
    fn six_significant_digits() {
        assert_eq!(significant(1.0333333333), "1.03333");
        assert_eq!(significant(2500.0), "2500");
        assert_eq!(significant(0.5), "0.5");
    }
}
