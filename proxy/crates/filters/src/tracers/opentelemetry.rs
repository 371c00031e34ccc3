//! `envoy.tracers.opentelemetry` (Envoy's `source/extensions/tracers/opentelemetry`):
//! spans as OTLP, exported with `opentelemetry.proto.collector.trace.v1.TraceService/
//! Export` over gRPC to the `grpc_service`'s cluster; W3C trace context. Stats
//! `tracing.opentelemetry.{spans_sent, spans_dropped, timer_flushed}` as Envoy's:
//! spans are counted as sent when their batch is handed to the collector's cluster.

use std::sync::{Arc, Weak};
use std::time::{Duration, UNIX_EPOCH};

use envoy_types::pb::envoy::config::trace::v3::OpenTelemetryConfig;
use envoy_types::pb::opentelemetry::proto::common::v1::{
    AnyValue, InstrumentationScope, KeyValue, any_value,
};
use hyper::{Method, Request, Version};

use super::exporter::{Exporter, Flush};
use super::span::{Kind, Span};
use crate::common::ext_authz::{Service, grpc, grpc_service};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::{Counter, Store};
use shunt_upstream::http_pool::RequestBody;

const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

pub const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";

/// OTLP's trace messages (opentelemetry-proto's `trace/v1` and `collector/trace/v1`,
/// the fields Envoy fills); `common/v1` comes with envoy-types.
pub mod otlp {
    use super::{InstrumentationScope, KeyValue};

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ExportTraceServiceRequest {
        #[prost(message, repeated, tag = "1")]
        pub resource_spans: Vec<ResourceSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResourceSpans {
        #[prost(message, optional, tag = "1")]
        pub resource: Option<Resource>,
        #[prost(message, repeated, tag = "2")]
        pub scope_spans: Vec<ScopeSpans>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Resource {
        #[prost(message, repeated, tag = "1")]
        pub attributes: Vec<KeyValue>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ScopeSpans {
        #[prost(message, optional, tag = "1")]
        pub scope: Option<InstrumentationScope>,
        #[prost(message, repeated, tag = "2")]
        pub spans: Vec<Span>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Span {
        #[prost(bytes = "vec", tag = "1")]
        pub trace_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub span_id: Vec<u8>,
        #[prost(string, tag = "3")]
        pub trace_state: String,
        #[prost(bytes = "vec", tag = "4")]
        pub parent_span_id: Vec<u8>,
        #[prost(string, tag = "5")]
        pub name: String,
        /// 2 SERVER, 3 CLIENT.
        #[prost(int32, tag = "6")]
        pub kind: i32,
        #[prost(fixed64, tag = "7")]
        pub start_time_unix_nano: u64,
        #[prost(fixed64, tag = "8")]
        pub end_time_unix_nano: u64,
        #[prost(message, repeated, tag = "9")]
        pub attributes: Vec<KeyValue>,
        #[prost(message, optional, tag = "15")]
        pub status: Option<Status>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Status {
        #[prost(string, tag = "2")]
        pub message: String,
        /// 0 UNSET, 1 OK, 2 ERROR.
        #[prost(int32, tag = "3")]
        pub code: i32,
    }
}

#[derive(Debug)]
pub struct Driver {
    pub service_name: String,
    cluster: String,
    authority: String,
    timeout: Duration,
    exporter: Exporter,
    spans_sent: Counter,
}

impl Driver {
    pub fn compile(
        config: &OpenTelemetryConfig,
        stats: &Store,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Driver> {
        for (set, field, what) in [
            (
                config.http_service.is_some(),
                "http_service",
                "OTLP over HTTP is not implemented; use grpc_service",
            ),
            (
                config.sampler.is_some(),
                "sampler",
                "OpenTelemetry samplers are not implemented",
            ),
        ] {
            if set {
                problems.error(path.field(field), what);
                return None;
            }
        }
        if !config.resource_detectors.is_empty() {
            problems.warning(path.field("resource_detectors"), "not implemented; ignored");
        }
        let Some(service) = &config.grpc_service else {
            problems.error(path.field("grpc_service"), "is required");
            return None;
        };
        let Service::Grpc {
            cluster,
            authority,
            timeout,
        } = grpc_service(service, &path.field("grpc_service"), problems)?
        else {
            return None;
        };
        // Envoy's export call has no deadline unless one is configured; a bound keeps
        // a stalled collector from holding the flush task for ever.
        let timeout = if service.timeout.is_some() {
            timeout
        } else {
            DEFAULT_EXPORT_TIMEOUT
        };
        Some(Driver {
            service_name: if config.service_name.is_empty() {
                "unknown_service:envoy".into()
            } else {
                config.service_name.clone()
            },
            cluster,
            authority,
            timeout,
            exporter: Exporter::new(
                stats.counter("tracing.opentelemetry.spans_dropped"),
                stats.counter("tracing.opentelemetry.timer_flushed"),
            ),
            spans_sent: stats.counter("tracing.opentelemetry.spans_sent"),
        })
    }

    pub fn report(self: &Arc<Self>, span: Span) {
        self.exporter.start(Arc::downgrade(self) as Weak<Self>);
        self.exporter.push(span);
    }

    pub fn exporter_ref(&self) -> &Exporter {
        &self.exporter
    }

    /// The batch as one `ExportTraceServiceRequest`.
    pub fn request(&self, batch: &[Span]) -> otlp::ExportTraceServiceRequest {
        let string = |key: &str, value: &str| KeyValue {
            key: key.into(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(value.into())),
            }),
            ..Default::default()
        };
        let resource = otlp::Resource {
            attributes: vec![
                string("service.name", &self.service_name),
                string("telemetry.sdk.language", "rust"),
                string("telemetry.sdk.name", "shunt"),
                string("telemetry.sdk.version", env!("CARGO_PKG_VERSION")),
            ],
        };
        let spans = batch.iter().map(|span| to_otlp(span, &string)).collect();
        otlp::ExportTraceServiceRequest {
            resource_spans: vec![otlp::ResourceSpans {
                resource: Some(resource),
                scope_spans: vec![otlp::ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "envoy".into(),
                        ..Default::default()
                    }),
                    spans,
                }],
            }],
        }
    }
}

fn to_otlp(span: &Span, string: &dyn Fn(&str, &str) -> KeyValue) -> otlp::Span {
    let nanos = |t: std::time::SystemTime| {
        t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as u64
    };
    let start = nanos(span.start);
    let kind = match span.kind {
        Kind::Server => 2,
        Kind::Client => 3,
    };
    otlp::Span {
        trace_id: span.context.trace_id.to_be_bytes().to_vec(),
        span_id: span.context.span_id.to_be_bytes().to_vec(),
        trace_state: span.trace_state.clone(),
        parent_span_id: span
            .context
            .parent_id
            .map(|p| p.to_be_bytes().to_vec())
            .unwrap_or_default(),
        name: span.name.clone(),
        kind,
        start_time_unix_nano: start,
        end_time_unix_nano: start + span.duration.as_nanos() as u64,
        attributes: span.tags.iter().map(|(k, v)| string(k, v)).collect(),
        status: Some(otlp::Status {
            message: String::new(),
            code: status_code(span),
        }),
    }
}

/// Envoy's span status: ERROR for a 5xx, and for a 4xx on a CLIENT span.
fn status_code(span: &Span) -> i32 {
    let status = span
        .tag("http.status_code")
        .and_then(|s| s.parse::<u16>().ok())
        .unwrap_or(0);
    let error = status >= 500 || (status >= 400 && span.kind == Kind::Client);
    if error { 2 } else { 0 }
}

impl Flush for Driver {
    fn exporter(&self) -> &Exporter {
        &self.exporter
    }

    async fn send(self: Arc<Self>, batch: Vec<Span>) {
        self.spans_sent.add(batch.len() as u64);
        let Some(source) = self.exporter.source() else {
            return;
        };
        let Some(cluster) = source.cluster(&self.cluster) else {
            tracing::debug!(cluster = %self.cluster, "OpenTelemetry collector cluster not found");
            return;
        };
        let body = grpc::frame(&self.request(&batch));
        let request = Request::builder()
            .method(Method::POST)
            .version(Version::HTTP_2)
            .uri(format!("http://{}{EXPORT_PATH}", self.authority))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header(
                "grpc-timeout",
                format!("{}m", self.timeout.as_millis().max(1)),
            )
            .body(RequestBody::buffered(body, None))
            .expect("a valid gRPC request");
        if let Err(err) = grpc::call(&cluster, source.secrets(), request, true, self.timeout).await
        {
            tracing::debug!(cluster = %self.cluster, %err, "OpenTelemetry export failed");
        }
    }
}
