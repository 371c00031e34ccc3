//! Envoy's OpenTelemetry access logger, `envoy.access_loggers.open_telemetry` (Istio's
//! `envoyOtelAls` provider): each entry becomes an OTLP `LogRecord` whose body and
//! attributes are format strings rendered against it, sent in batches to
//! `opentelemetry.proto.collector.logs.v1.LogsService/Export`. The OTLP log messages
//! are declared here (envoy-types carries only OTLP's common types).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use envoy_types::pb::opentelemetry::proto::common::v1::{
    AnyValue, InstrumentationScope, KeyValue, any_value,
};
use prost::Message;

use super::batch::{Batcher, Exporter};
use super::service::Endpoint;
use shunt_core::access_log::{Entry, ServiceSink};
use shunt_core::formatter::Format;

const METHOD: &str = "/opentelemetry.proto.collector.logs.v1.LogsService/Export";

/// `opentelemetry.proto.collector.logs.v1.ExportLogsServiceRequest`.
#[derive(Clone, PartialEq, Message)]
pub struct ExportLogsServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_logs: Vec<ResourceLogs>,
}

/// `opentelemetry.proto.logs.v1.ResourceLogs`.
#[derive(Clone, PartialEq, Message)]
pub struct ResourceLogs {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_logs: Vec<ScopeLogs>,
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

/// `opentelemetry.proto.resource.v1.Resource`.
#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
    #[prost(uint32, tag = "2")]
    pub dropped_attributes_count: u32,
}

/// `opentelemetry.proto.logs.v1.ScopeLogs`.
#[derive(Clone, PartialEq, Message)]
pub struct ScopeLogs {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub log_records: Vec<LogRecord>,
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

/// `opentelemetry.proto.logs.v1.LogRecord`.
#[derive(Clone, PartialEq, Message)]
pub struct LogRecord {
    #[prost(fixed64, tag = "1")]
    pub time_unix_nano: u64,
    #[prost(fixed64, tag = "11")]
    pub observed_time_unix_nano: u64,
    #[prost(int32, tag = "2")]
    pub severity_number: i32,
    #[prost(string, tag = "3")]
    pub severity_text: String,
    #[prost(message, optional, tag = "5")]
    pub body: Option<AnyValue>,
    #[prost(message, repeated, tag = "6")]
    pub attributes: Vec<KeyValue>,
    #[prost(uint32, tag = "7")]
    pub dropped_attributes_count: u32,
    #[prost(fixed32, tag = "8")]
    pub flags: u32,
    #[prost(bytes = "vec", tag = "9")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "10")]
    pub span_id: Vec<u8>,
}

/// A logger's formats and resource, from its config.
#[derive(Debug)]
pub struct Settings {
    pub body: Option<Format>,
    pub attributes: Vec<(String, Format)>,
    pub resource: Vec<KeyValue>,
}

#[derive(Debug)]
pub struct OtelExporter {
    pub settings: Settings,
    pub endpoint: Arc<Endpoint>,
}

#[derive(Debug)]
pub struct OtelLogger(pub Arc<Batcher<OtelExporter>>);

impl ServiceSink for OtelLogger {
    fn log(&self, entry: &Entry) {
        let record = record(entry, &self.0.exporter().settings);
        let size = record.encoded_len();
        self.0.push(record, size);
    }

    fn wants_headers(&self) -> bool {
        true
    }
}

impl Exporter for OtelExporter {
    type Message = LogRecord;

    fn export(
        &self,
        batch: &[LogRecord],
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> {
        let request = ExportLogsServiceRequest {
            resource_logs: vec![ResourceLogs {
                resource: Some(Resource {
                    attributes: self.settings.resource.clone(),
                    dropped_attributes_count: 0,
                }),
                scope_logs: vec![ScopeLogs {
                    scope: None,
                    log_records: batch.to_vec(),
                    schema_url: String::new(),
                }],
                schema_url: String::new(),
            }],
        };
        let body = crate::common::ext_authz::grpc::frame(&request);
        let endpoint = self.endpoint.clone();
        Box::pin(async move { endpoint.call(METHOD, body).await })
    }
}

/// A string attribute.
pub fn string_attribute(key: &str, value: String) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue {
            value: Some(any_value::Value::StringValue(value)),
        }),
        ..Default::default()
    }
}

fn record(entry: &Entry, settings: &Settings) -> LogRecord {
    let start = entry
        .start_time()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    LogRecord {
        time_unix_nano: u64::try_from(start.as_nanos()).unwrap_or(u64::MAX),
        body: settings.body.as_ref().map(|body| AnyValue {
            value: Some(any_value::Value::StringValue(super::render(body, entry))),
        }),
        attributes: settings
            .attributes
            .iter()
            .map(|(key, format)| string_attribute(key, super::render(format, entry)))
            .collect(),
        ..Default::default()
    }
}
