//! The access loggers a listener, `tcp_proxy` or connection manager configures
//! (`access_log`): files and streams (`shunt_core::access_log`), the gRPC access log
//! service ([`grpc_als`]: `http_grpc`, `tcp_grpc`) and OpenTelemetry ([`otel`]), each
//! behind its `filter` ([`filter`], with Istio's [`cel`] expressions). A service logger
//! buffers and sends off the request path ([`batch`]) through its cluster
//! ([`service`]); its stats are Envoy's `access_logs.grpc_access_log.logs_written` /
//! `logs_dropped` (`access_logs.open_telemetry_access_log.*` for OpenTelemetry).

pub mod batch;
pub mod cel;
pub mod filter;
pub mod grpc_als;
pub mod otel;
pub mod service;

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::config::accesslog::v3::{AccessLog, access_log};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::extensions::access_loggers::grpc::v3::{
    CommonGrpcAccessLogConfig, HttpGrpcAccessLogConfig, TcpGrpcAccessLogConfig,
};
use envoy_types::pb::envoy::extensions::access_loggers::open_telemetry::v3::OpenTelemetryAccessLogConfig;
use envoy_types::pb::opentelemetry::proto::common::v1::{AnyValue, any_value};

use shunt_config::convert::{self, decode};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::access_log::{self as core_log, Builtin, Entry, ServiceSink, Sink};
use shunt_core::formatter::Format;
use shunt_core::stats::Store;

use service::Endpoint;

const HTTP_GRPC: &str = "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig";
const TCP_GRPC: &str = "envoy.extensions.access_loggers.grpc.v3.TcpGrpcAccessLogConfig";
const OPEN_TELEMETRY: &str =
    "envoy.extensions.access_loggers.open_telemetry.v3.OpenTelemetryAccessLogConfig";

/// Every access logger shunt compiles: config validation's list of them.
pub const ACCESS_LOGGERS: &[&str] = &[
    "envoy.extensions.access_loggers.file.v3.FileAccessLog",
    "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
    "envoy.extensions.access_loggers.stream.v3.StderrAccessLog",
    HTTP_GRPC,
    TCP_GRPC,
    OPEN_TELEMETRY,
];

/// Envoy's defaults for `buffer_flush_interval` and `buffer_size_bytes`.
const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_secs(1);
const DEFAULT_BUFFER_SIZE: usize = 16_384;

/// What the loggers need from where they are compiled.
#[derive(Clone, Copy)]
pub struct Env<'a> {
    pub clusters: &'a shunt_upstream::Clusters,
    pub stats: &'a Store,
    /// The proxy's `node`, for the gRPC ALS identifier.
    pub node: &'a Node,
}

/// Compiles the `access_log` list at `path`.
pub fn compile(
    logs: &[AccessLog],
    env: Env<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Vec<Sink> {
    let mut sinks = Vec::new();
    for (i, log) in logs.iter().enumerate() {
        let log_path = path.index(i);
        let Some(access_log::ConfigType::TypedConfig(any)) = &log.config_type else {
            problems.warning(&log_path, "an access log without typed_config is ignored");
            continue;
        };
        let typed_path = log_path.field("typed_config");
        let formatted = match formatted_file(any, &typed_path, problems) {
            Ok(formatted) => formatted,
            Err(()) => continue,
        };
        let builtin = match formatted {
            Some(sink) => Builtin::Opened(sink),
            None => core_log::builtin(any, &typed_path, problems),
        };
        let sink = match builtin {
            Builtin::Opened(sink) => sink,
            Builtin::Failed => continue,
            Builtin::Other => match service(any, env, &typed_path, problems) {
                Some(sink) => sink,
                None => continue,
            },
        };
        match &log.filter {
            None => sinks.push(sink),
            Some(f) => {
                if let Some(filter) = filter::compile(f, &log_path.field("filter"), problems) {
                    sinks.push(Sink::Service(Arc::new(Filtered { filter, sink })));
                }
            }
        }
    }
    sinks
}

/// A `FileAccessLog` with a text `log_format` (Istio's mesh-wide access log): each
/// entry rendered with it. `Ok(None)`: not one (the JSON line's loggers); `Err`: its
/// error is in `problems`.
// `text_format` is deprecated, but a config may still use it.
#[allow(deprecated)]
fn formatted_file(
    any: &envoy_types::pb::google::protobuf::Any,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Result<Option<Sink>, ()> {
    use envoy_types::pb::envoy::config::core::v3::{data_source, substitution_format_string};
    use envoy_types::pb::envoy::extensions::access_loggers::file::v3::{
        FileAccessLog, file_access_log::AccessLogFormat,
    };
    if convert::type_name(any) != "envoy.extensions.access_loggers.file.v3.FileAccessLog" {
        return Ok(None);
    }
    let Some(file) = decode::<FileAccessLog>(any, path, problems) else {
        return Err(());
    };
    let format_path = path.field("log_format");
    let (text, omit_empty) = match &file.access_log_format {
        Some(AccessLogFormat::LogFormat(format)) => match &format.format {
            Some(substitution_format_string::Format::TextFormat(text)) => {
                (text.clone(), format.omit_empty_values)
            }
            Some(substitution_format_string::Format::TextFormatSource(source)) => {
                match &source.specifier {
                    Some(data_source::Specifier::InlineString(text)) => {
                        (text.clone(), format.omit_empty_values)
                    }
                    _ => return Ok(None),
                }
            }
            _ => return Ok(None),
        },
        _ => return Ok(None),
    };
    let text_path = format_path
        .field("text_format_source")
        .field("inline_string");
    let format = Format::compile(&text, &text_path, problems).ok_or(())?;
    let sink = match core_log::Sink::open(std::path::Path::new(&file.path)) {
        Ok(sink) => sink,
        Err(err) => {
            problems.error(
                path.field("path"),
                format!("cannot open {:?}: {err}", file.path),
            );
            return Err(());
        }
    };
    Ok(Some(Sink::Service(Arc::new(FormattedFile {
        format: format.omit_empty_values(omit_empty),
        sink,
    }))))
}

/// A stream or file whose lines are a format rendered against each entry.
#[derive(Debug)]
struct FormattedFile {
    format: Format,
    sink: Sink,
}

impl ServiceSink for FormattedFile {
    fn log(&self, entry: &Entry) {
        self.sink.write_line(render(&self.format, entry).as_bytes());
    }

    fn wants_headers(&self) -> bool {
        true
    }
}

/// `format` rendered against an entry: its connection, its request (headers as
/// copied for the loggers), the entry's own fields.
pub fn render(format: &Format, entry: &Entry) -> String {
    static NO_HEADERS: std::sync::LazyLock<hyper::HeaderMap> =
        std::sync::LazyLock::new(hyper::HeaderMap::new);
    let fallback;
    let connection = match entry.connection.as_deref() {
        Some(connection) => connection,
        None => {
            fallback = shunt_core::stream_info::Connection::new(
                entry.downstream_local_address,
                entry.downstream_remote_address,
            );
            &fallback
        }
    };
    let request = entry
        .http
        .as_deref()
        .map(|http| shunt_core::formatter::Request {
            method: &http.method,
            authority: http.authority.as_deref().unwrap_or_default(),
            path: &http.path,
            scheme: http.scheme,
            protocol: http.protocol,
            headers: http.request_headers.as_ref().unwrap_or(&NO_HEADERS),
        });
    format.render(&shunt_core::formatter::Context {
        connection,
        stream_filter_state: None,
        request,
        entry: Some(entry),
    })
}

/// A sink behind an access-log filter.
#[derive(Debug)]
struct Filtered {
    filter: filter::Filter,
    sink: Sink,
}

impl ServiceSink for Filtered {
    fn log(&self, entry: &Entry) {
        if self.filter.passes(entry) {
            self.sink.log(entry);
        }
    }

    fn wants_headers(&self) -> bool {
        self.filter.wants_headers() || self.sink.wants_headers()
    }
}

fn service(
    any: &envoy_types::pb::google::protobuf::Any,
    env: Env<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Sink> {
    let logger: Arc<dyn ServiceSink> = match convert::type_name(any) {
        HTTP_GRPC => {
            let config = decode::<HttpGrpcAccessLogConfig>(any, path, problems)?;
            let common_path = path.field("common_config");
            let (endpoint, limits, filter_state) =
                common(config.common_config.as_ref(), env, &common_path, problems)?;
            let settings = grpc_als::Settings {
                kind: grpc_als::Kind::Http,
                log_name: config
                    .common_config
                    .as_ref()
                    .map(|c| c.log_name.clone())
                    .unwrap_or_default(),
                node: env.node.clone(),
                filter_state_objects_to_log: filter_state,
                request_headers: lowercase(&config.additional_request_headers_to_log),
                response_headers: lowercase(&config.additional_response_headers_to_log),
            };
            if !config.additional_response_trailers_to_log.is_empty() {
                problems.warning(
                    path.field("additional_response_trailers_to_log"),
                    "response trailers are not logged by shunt; ignored",
                );
            }
            als(settings, endpoint, limits, env)
        }
        TCP_GRPC => {
            let config = decode::<TcpGrpcAccessLogConfig>(any, path, problems)?;
            let common_path = path.field("common_config");
            let (endpoint, limits, filter_state) =
                common(config.common_config.as_ref(), env, &common_path, problems)?;
            let settings = grpc_als::Settings {
                kind: grpc_als::Kind::Tcp,
                log_name: config
                    .common_config
                    .as_ref()
                    .map(|c| c.log_name.clone())
                    .unwrap_or_default(),
                node: env.node.clone(),
                filter_state_objects_to_log: filter_state,
                request_headers: Vec::new(),
                response_headers: Vec::new(),
            };
            als(settings, endpoint, limits, env)
        }
        OPEN_TELEMETRY => {
            let config = decode::<OpenTelemetryAccessLogConfig>(any, path, problems)?;
            open_telemetry(&config, env, path, problems)?
        }
        other => {
            problems.warning(
                path,
                format!("access logger {other} is not implemented; ignored"),
            );
            return None;
        }
    };
    Some(Sink::Service(logger))
}

/// How much a logger buffers and for how long.
#[derive(Debug, Clone, Copy)]
struct Limits {
    flush_interval: Duration,
    buffer_size: usize,
}

fn common(
    common: Option<&CommonGrpcAccessLogConfig>,
    env: Env<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<(Endpoint, Limits, Vec<String>)> {
    let Some(common) = common else {
        problems.error(path, "is required");
        return None;
    };
    if common.log_name.is_empty() {
        problems.error(path.field("log_name"), "is required");
        return None;
    }
    let endpoint = Endpoint::compile(
        common.grpc_service.as_ref(),
        env.clusters,
        &path.field("grpc_service"),
        problems,
    )?;
    let limits = limits(
        common.buffer_flush_interval.as_ref(),
        common.buffer_size_bytes.as_ref().map(|b| b.value),
        path,
        problems,
    )?;
    Some((endpoint, limits, common.filter_state_objects_to_log.clone()))
}

fn limits(
    interval: Option<&envoy_types::pb::google::protobuf::Duration>,
    size: Option<u32>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Limits> {
    let flush_interval = match interval {
        Some(d) => convert::duration(d, &path.field("buffer_flush_interval"), problems)?,
        None => DEFAULT_FLUSH_INTERVAL,
    };
    Some(Limits {
        flush_interval: if flush_interval.is_zero() {
            DEFAULT_FLUSH_INTERVAL
        } else {
            flush_interval
        },
        buffer_size: size.map_or(DEFAULT_BUFFER_SIZE, |s| s as usize),
    })
}

fn log_stats(env: Env<'_>, prefix: &str) -> batch::LogStats {
    batch::LogStats {
        written: env
            .stats
            .counter(&format!("access_logs.{prefix}.logs_written")),
        dropped: env
            .stats
            .counter(&format!("access_logs.{prefix}.logs_dropped")),
        flushed: env
            .stats
            .counter(&format!("access_logs.{prefix}.grpc_entries_flushed")),
        flush_failed: env
            .stats
            .counter(&format!("access_logs.{prefix}.grpc_entries_flush_failed")),
    }
}

fn als(
    settings: grpc_als::Settings,
    endpoint: Endpoint,
    limits: Limits,
    env: Env<'_>,
) -> Arc<dyn ServiceSink> {
    let exporter = grpc_als::AlsExporter {
        settings,
        endpoint: Arc::new(endpoint),
    };
    let batcher = batch::Batcher::new(
        exporter,
        limits.flush_interval,
        limits.buffer_size,
        log_stats(env, "grpc_access_log"),
    );
    Arc::new(grpc_als::AlsLogger(batcher))
}

// istiod writes the deprecated `common_config`.
#[allow(deprecated)]
fn open_telemetry(
    config: &OpenTelemetryAccessLogConfig,
    env: Env<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn ServiceSink>> {
    if config.http_service.is_some() {
        problems.error(
            path.field("http_service"),
            "OTLP over HTTP is not implemented by shunt; use grpc_service",
        );
        return None;
    }
    // The service, name and buffer come from `common_config` (what istiod writes) or
    // from the logger's own fields (Envoy's newer form).
    let (endpoint, limits, log_name) = match &config.common_config {
        Some(common_config) => {
            let (endpoint, limits, _) = common(
                Some(common_config),
                env,
                &path.field("common_config"),
                problems,
            )?;
            (endpoint, limits, common_config.log_name.clone())
        }
        None => {
            let endpoint = Endpoint::compile(
                config.grpc_service.as_ref(),
                env.clusters,
                &path.field("grpc_service"),
                problems,
            )?;
            let limits = limits(
                config.buffer_flush_interval.as_ref(),
                config.buffer_size_bytes.as_ref().map(|b| b.value),
                path,
                problems,
            )?;
            (endpoint, limits, config.log_name.clone())
        }
    };
    let body = match &config.body {
        None => None,
        Some(value) => Some(format_of(value, &path.field("body"), problems)?),
    };
    let mut attributes = Vec::new();
    for (i, kv) in config.attributes.iter().flat_map(|l| &l.values).enumerate() {
        let kv_path = path.field("attributes").field("values").index(i);
        let Some(value) = &kv.value else { continue };
        attributes.push((
            kv.key.clone(),
            format_of(value, &kv_path.field("value"), problems)?,
        ));
    }
    let mut resource = Vec::new();
    if !config.disable_builtin_labels {
        resource.push(otel::string_attribute("log_name", log_name));
        resource.push(otel::string_attribute(
            "zone_name",
            env.node
                .locality
                .as_ref()
                .map(|l| l.zone.clone())
                .unwrap_or_default(),
        ));
        resource.push(otel::string_attribute(
            "cluster_name",
            env.node.cluster.clone(),
        ));
        resource.push(otel::string_attribute("node_name", env.node.id.clone()));
    }
    resource.extend(
        config
            .resource_attributes
            .iter()
            .flat_map(|l| l.values.iter().cloned()),
    );
    let exporter = otel::OtelExporter {
        settings: otel::Settings {
            body,
            attributes,
            resource,
        },
        endpoint: Arc::new(endpoint),
    };
    let batcher = batch::Batcher::new(
        exporter,
        limits.flush_interval,
        limits.buffer_size,
        log_stats(env, "open_telemetry_access_log"),
    );
    Some(Arc::new(otel::OtelLogger(batcher)))
}

/// An OTLP `AnyValue` as a format: only `string_value` is (what istiod writes).
fn format_of(value: &AnyValue, path: &JsonPath, problems: &mut Diagnostics) -> Option<Format> {
    match &value.value {
        Some(any_value::Value::StringValue(text)) => {
            Format::compile(text, &path.field("string_value"), problems)
        }
        _ => {
            problems.error(path, "only string_value formats are implemented by shunt");
            None
        }
    }
}

fn lowercase(names: &[String]) -> Vec<String> {
    names.iter().map(|n| n.to_ascii_lowercase()).collect()
}
