//! Access-log `filter`s: which entries a logger writes. Envoy's status-code, duration,
//! response-flag, not-health-check, and/or filters, and the CEL extension filter
//! istiod writes for a Telemetry's `accessLogging.filter.expression`
//! (`envoy.access_loggers.extension_filters.cel`), whose attributes are read from the
//! entry here.

use envoy_types::pb::envoy::config::accesslog::v3::{
    AccessLogFilter, ComparisonFilter, access_log_filter::FilterSpecifier, comparison_filter::Op,
    extension_filter::ConfigType as ExtensionConfig,
};
use envoy_types::pb::envoy::extensions::access_loggers::filters::cel::v3::ExpressionFilter;

use super::cel::{self, Program, Value};
use shunt_config::convert::{decode, type_name};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::access_log::{Entry, ResponseFlag};

const CEL: &str = "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter";

/// The access-log `extension_filter`s shunt compiles: config validation's list.
pub const EXTENSION_FILTERS: &[&str] = &[CEL];

/// A compiled access-log filter.
#[derive(Debug, Clone)]
pub enum Filter {
    StatusCode(Comparison),
    /// In milliseconds.
    Duration(Comparison),
    /// Entries with any of these flags (none listed: any flag at all).
    ResponseFlags(Vec<&'static str>),
    /// shunt answers no health checks through its listeners: every entry passes.
    NotHealthCheck,
    And(Vec<Filter>),
    Or(Vec<Filter>),
    Cel(Box<Program>),
}

#[derive(Debug, Clone, Copy)]
pub struct Comparison {
    op: Op,
    value: u64,
}

impl Comparison {
    fn holds(self, actual: u64) -> bool {
        match self.op {
            Op::Eq => actual == self.value,
            Op::Ge => actual >= self.value,
            Op::Le => actual <= self.value,
            Op::Ne => actual != self.value,
        }
    }
}

/// Compiles `filter` at `path`; an unsupported filter or CEL construct is an error
/// naming it.
pub fn compile(
    filter: &AccessLogFilter,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Filter> {
    let Some(specifier) = &filter.filter_specifier else {
        problems.error(path, "an access log filter needs one filter");
        return None;
    };
    Some(match specifier {
        FilterSpecifier::StatusCodeFilter(f) => Filter::StatusCode(comparison(
            f.comparison.as_ref(),
            &path.field("status_code_filter"),
            problems,
        )?),
        FilterSpecifier::DurationFilter(f) => Filter::Duration(comparison(
            f.comparison.as_ref(),
            &path.field("duration_filter"),
            problems,
        )?),
        FilterSpecifier::NotHealthCheckFilter(_) => Filter::NotHealthCheck,
        FilterSpecifier::ResponseFlagFilter(f) => {
            let mut flags = Vec::new();
            for (i, flag) in f.flags.iter().enumerate() {
                match ResponseFlag::ALL.iter().find(|known| known.code() == flag) {
                    Some(known) => flags.push(known.code()),
                    // A flag shunt never raises matches nothing, as it would in Envoy
                    // on a proxy that never raises it.
                    None if is_envoy_flag(flag) => flags.push(leak(flag)),
                    None => {
                        problems.error(
                            path.field("response_flag_filter").field("flags").index(i),
                            format!("{flag:?} is not one of Envoy's response flags"),
                        );
                        return None;
                    }
                }
            }
            Filter::ResponseFlags(flags)
        }
        FilterSpecifier::AndFilter(f) => {
            Filter::And(list(&f.filters, &path.field("and_filter"), problems)?)
        }
        FilterSpecifier::OrFilter(f) => {
            Filter::Or(list(&f.filters, &path.field("or_filter"), problems)?)
        }
        FilterSpecifier::ExtensionFilter(extension) => {
            let ext_path = path.field("extension_filter");
            let Some(ExtensionConfig::TypedConfig(any)) = &extension.config_type else {
                problems.error(&ext_path, "an extension filter needs typed_config");
                return None;
            };
            let typed_path = ext_path.field("typed_config");
            if type_name(any) != CEL {
                problems.error(
                    &typed_path,
                    format!(
                        "the access log filter {} is not implemented by shunt",
                        type_name(any)
                    ),
                );
                return None;
            }
            let expression = decode::<ExpressionFilter>(any, &typed_path, problems)?;
            if expression.expression.is_empty() {
                problems.error(
                    typed_path.field("expression"),
                    "a CEL filter needs an expression (parsed_expr is not supported)",
                );
                return None;
            }
            match Program::parse(&expression.expression) {
                Ok(program) => Filter::Cel(Box::new(program)),
                Err(why) => {
                    problems.error(
                        typed_path.field("expression"),
                        format!("CEL {:?}: {why}", expression.expression),
                    );
                    return None;
                }
            }
        }
        other => {
            let name = match other {
                FilterSpecifier::TraceableFilter(_) => "traceable_filter",
                FilterSpecifier::RuntimeFilter(_) => "runtime_filter",
                FilterSpecifier::HeaderFilter(_) => "header_filter",
                FilterSpecifier::GrpcStatusFilter(_) => "grpc_status_filter",
                FilterSpecifier::MetadataFilter(_) => "metadata_filter",
                FilterSpecifier::LogTypeFilter(_) => "log_type_filter",
                _ => "this filter",
            };
            problems.error(
                path.field(name),
                format!("{name} is not implemented by shunt"),
            );
            return None;
        }
    })
}

fn list(
    filters: &[AccessLogFilter],
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Vec<Filter>> {
    let mut out = Vec::new();
    for (i, filter) in filters.iter().enumerate() {
        out.push(compile(filter, &path.field("filters").index(i), problems)?);
    }
    Some(out)
}

fn comparison(
    comparison: Option<&ComparisonFilter>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Comparison> {
    let Some(c) = comparison else {
        problems.error(path.field("comparison"), "is required");
        return None;
    };
    // The runtime key's default: shunt has no runtime overrides.
    let value = c.value.as_ref().map_or(0, |v| u64::from(v.default_value));
    Some(Comparison {
        op: Op::try_from(c.op).unwrap_or(Op::Eq),
        value,
    })
}

fn is_envoy_flag(flag: &str) -> bool {
    matches!(
        flag,
        "LH" | "UH"
            | "UT"
            | "LR"
            | "UR"
            | "UF"
            | "UC"
            | "UO"
            | "NR"
            | "DI"
            | "FI"
            | "RL"
            | "UAEX"
            | "RLSE"
            | "DC"
            | "URX"
            | "SI"
            | "IH"
            | "DPE"
            | "UMSDR"
            | "RFCF"
            | "NFCF"
            | "DT"
            | "UPE"
            | "NC"
            | "OM"
            | "DF"
            | "DO"
            | "DR"
    )
}

fn leak(flag: &str) -> &'static str {
    // Envoy's flags are a fixed set of short codes: interned once per config.
    Box::leak(flag.to_owned().into_boxed_str())
}

impl Filter {
    /// Whether `entry` is logged.
    pub fn passes(&self, entry: &Entry) -> bool {
        match self {
            Filter::StatusCode(c) => c.holds(
                entry
                    .http
                    .as_ref()
                    .map_or(0, |h| u64::from(h.response_code)),
            ),
            Filter::Duration(c) => {
                c.holds(u64::try_from(entry.duration().as_millis()).unwrap_or(u64::MAX))
            }
            Filter::ResponseFlags(flags) if flags.is_empty() => !entry.response_flags.is_empty(),
            Filter::ResponseFlags(flags) => entry
                .response_flags
                .iter()
                .any(|f| flags.contains(&f.code())),
            Filter::NotHealthCheck => true,
            Filter::And(all) => all.iter().all(|f| f.passes(entry)),
            Filter::Or(any) => any.iter().any(|f| f.passes(entry)),
            Filter::Cel(program) => program.matches(&EntryAttributes(entry)),
        }
    }

    /// Whether the filter reads headers (they are copied into the entry for it).
    pub fn wants_headers(&self) -> bool {
        match self {
            Filter::Cel(_) => true,
            Filter::And(all) | Filter::Or(all) => all.iter().any(Filter::wants_headers),
            _ => false,
        }
    }
}

/// Envoy's CEL attributes, read from an access-log entry.
struct EntryAttributes<'a>(&'a Entry);

impl cel::Attributes for EntryAttributes<'_> {
    fn get(&self, root: &str, field: &str) -> Option<Value> {
        let entry = self.0;
        let http = entry.http.as_deref();
        let connection = entry.connection.as_deref();
        let tls = connection.and_then(|c| c.tls.as_deref());
        let string = |s: &str| Some(Value::String(s.to_owned()));
        let sans = |sans: &[String]| sans.first().map(|s| Value::String(s.clone()));
        match (root, field) {
            ("request", "path") => string(&http?.path),
            ("request", "url_path") => string(http?.path.split('?').next().unwrap_or_default()),
            ("request", "query") => string(http?.path.split_once('?').map_or("", |(_, q)| q)),
            ("request", "host") => string(http?.authority.as_deref()?),
            ("request", "scheme") => string(http?.scheme),
            ("request", "method") => string(&http?.method),
            ("request", "protocol") => string(http?.protocol),
            ("request", "id") => string(http?.request_id.as_deref()?),
            ("request", "useragent") => string(http?.user_agent.as_deref()?),
            ("request", "referer") => header(http?.request_headers.as_ref()?, "referer"),
            ("request", "headers") => headers(http?.request_headers.as_ref()?),
            ("request", "duration") => None,
            ("request", "size") => Some(Value::Int(entry.bytes_received as i64)),
            ("request", "total_size") => Some(Value::Int(
                (entry.bytes_received + entry.request_head_bytes) as i64,
            )),
            ("response", "code") => Some(Value::Int(i64::from(http?.response_code))),
            ("response", "code_details") => string(http?.response_code_details.as_deref()?),
            ("response", "headers") => headers(http?.response_headers.as_ref()?),
            ("response", "grpc_status") => {
                let status = header(http?.response_headers.as_ref()?, "grpc-status")?;
                match status {
                    Value::String(s) => s.parse().ok().map(Value::Int),
                    _ => None,
                }
            }
            ("response", "size") => Some(Value::Int(entry.bytes_sent as i64)),
            ("response", "total_size") => Some(Value::Int(
                (entry.bytes_sent + entry.response_head_bytes) as i64,
            )),
            ("response", "flags") => None,
            ("source", "address") => string(&entry.downstream_remote_address.ip().to_string()),
            ("source", "port") => Some(Value::Int(i64::from(
                entry.downstream_remote_address.port(),
            ))),
            ("destination", "address") => string(&entry.downstream_local_address.ip().to_string()),
            ("destination", "port") => {
                Some(Value::Int(i64::from(entry.downstream_local_address.port())))
            }
            ("connection", "mtls") => Some(Value::Bool(
                tls.is_some_and(|t| t.peer_certificate_presented),
            )),
            ("connection", "requested_server_name") => {
                string(connection?.requested_server_name.as_deref().unwrap_or(""))
            }
            ("connection", "tls_version") => string(tls?.version?),
            ("connection", "subject_peer_certificate") => string(tls?.peer_subject.as_deref()?),
            ("connection", "uri_san_peer_certificate") => sans(&tls?.peer_uri_sans),
            ("connection", "uri_san_local_certificate") => sans(&tls?.local_uri_sans),
            ("connection", "dns_san_peer_certificate") => sans(&tls?.peer_dns_sans),
            ("connection", "termination_details") => None,
            ("upstream", "address") => string(&entry.upstream_host?.ip().to_string()),
            ("upstream", "port") => Some(Value::Int(i64::from(entry.upstream_host?.port()))),
            ("upstream", "uri_san_peer_certificate") => sans(&entry.upstream_peer_uri_sans),
            ("upstream", "uri_san_local_certificate") => sans(&entry.upstream_local_uri_sans),
            ("upstream", "transport_failure_reason") => {
                string(entry.upstream_transport_failure_reason.as_deref()?)
            }
            ("xds", "cluster_name") => string(entry.upstream_cluster.as_deref()?),
            ("filter_state", _) => Some(Value::Map(
                connection?
                    .filter_state
                    .iter()
                    .filter_map(|(key, e)| {
                        Some((
                            key.to_string(),
                            Value::String(e.value.serialize_as_string()?),
                        ))
                    })
                    .collect(),
            )),
            _ => None,
        }
    }
}

fn header(headers: &hyper::HeaderMap, name: &str) -> Option<Value> {
    let value = headers.get(name)?;
    Some(Value::String(
        String::from_utf8_lossy(value.as_bytes()).into_owned(),
    ))
}

/// A header map as CEL sees it: one value per name (several joined by commas).
fn headers(headers: &hyper::HeaderMap) -> Option<Value> {
    let mut out: Vec<(String, Value)> = Vec::with_capacity(headers.keys_len());
    for name in headers.keys() {
        let joined = headers
            .get_all(name)
            .iter()
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            .collect::<Vec<_>>()
            .join(",");
        out.push((name.as_str().to_owned(), Value::String(joined)));
    }
    Some(Value::Map(out))
}
