//! `envoy.tracers.zipkin` (Envoy's `source/extensions/tracers/zipkin`): spans as Zipkin
//! v2 JSON (`collector_endpoint_version: HTTP_JSON`), POSTed to `collector_endpoint`
//! on `collector_cluster`; B3 trace context. Stats `tracing.zipkin.{spans_sent,
//! reports_sent, reports_failed, reports_dropped, reports_skipped_no_cluster,
//! timer_flushed}` as Envoy's: a report that got a 2xx is sent, another status failed,
//! no answer (connect failure, timeout) dropped.

use std::sync::{Arc, Weak};
use std::time::{Duration, UNIX_EPOCH};

use envoy_types::pb::envoy::config::trace::v3::{
    ZipkinConfig, zipkin_config::CollectorEndpointVersion,
};
use hyper::{Method, Request};
use serde_json::{Map, Value, json};

use super::exporter::{Exporter, Flush};
use super::span::{Kind, Span};
use crate::common::ext_authz::grpc;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::{Counter, Store};
use shunt_upstream::http_pool::RequestBody;

/// Envoy's report timeout (`collector_service` unset).
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Driver {
    cluster: String,
    endpoint: String,
    hostname: String,
    pub trace_id_128bit: bool,
    /// `shared_span_context` (default true): a SERVER span takes its caller's span id.
    pub shared_span_context: bool,
    /// `localEndpoint.serviceName`: the node's cluster.
    service_name: String,
    exporter: Exporter,
    stats: ZipkinStats,
}

#[derive(Debug)]
struct ZipkinStats {
    spans_sent: Counter,
    reports_sent: Counter,
    reports_failed: Counter,
    reports_dropped: Counter,
    reports_skipped_no_cluster: Counter,
}

impl Driver {
    pub fn compile(
        config: &ZipkinConfig,
        service_name: &str,
        stats: &Store,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Driver> {
        if config.collector_cluster.is_empty() {
            problems.error(path.field("collector_cluster"), "is required");
            return None;
        }
        if config.collector_endpoint.is_empty() {
            problems.error(path.field("collector_endpoint"), "is required");
            return None;
        }
        if CollectorEndpointVersion::try_from(config.collector_endpoint_version)
            != Ok(CollectorEndpointVersion::HttpJson)
        {
            problems.error(
                path.field("collector_endpoint_version"),
                "only HTTP_JSON (Zipkin v2 JSON) is implemented",
            );
            return None;
        }
        if config.trace_context_option != 0 {
            problems.warning(
                path.field("trace_context_option"),
                "W3C propagation beside B3 is not implemented; B3 only",
            );
        }
        let counter = |name: &str| stats.counter(&format!("tracing.zipkin.{name}"));
        Some(Driver {
            cluster: config.collector_cluster.clone(),
            endpoint: config.collector_endpoint.clone(),
            hostname: if config.collector_hostname.is_empty() {
                config.collector_cluster.clone()
            } else {
                config.collector_hostname.clone()
            },
            trace_id_128bit: config.trace_id_128bit,
            shared_span_context: config.shared_span_context.is_none_or(|b| b.value),
            service_name: service_name.to_owned(),
            exporter: Exporter::new(counter("spans_dropped"), counter("timer_flushed")),
            stats: ZipkinStats {
                spans_sent: counter("spans_sent"),
                reports_sent: counter("reports_sent"),
                reports_failed: counter("reports_failed"),
                reports_dropped: counter("reports_dropped"),
                reports_skipped_no_cluster: counter("reports_skipped_no_cluster"),
            },
        })
    }

    pub fn report(self: &Arc<Self>, span: Span) {
        self.exporter.start(Arc::downgrade(self) as Weak<Self>);
        self.exporter.push(span);
    }

    pub fn exporter_ref(&self) -> &Exporter {
        &self.exporter
    }

    /// The batch as Zipkin v2 JSON: an array of spans.
    pub fn report_body(&self, batch: &[Span], local_ip: Option<std::net::IpAddr>) -> Value {
        Value::Array(
            batch
                .iter()
                .map(|span| self.to_json(span, local_ip))
                .collect(),
        )
    }

    fn to_json(&self, span: &Span, local_ip: Option<std::net::IpAddr>) -> Value {
        let micros = |d: Duration| d.as_micros() as u64;
        let trace_id = if self.trace_id_128bit || span.context.trace_id > u128::from(u64::MAX) {
            format!("{:032x}", span.context.trace_id)
        } else {
            format!("{:016x}", span.context.trace_id)
        };
        let mut local = Map::new();
        local.insert("serviceName".into(), json!(self.service_name));
        match local_ip {
            Some(std::net::IpAddr::V4(ip)) => {
                local.insert("ipv4".into(), json!(ip.to_string()));
            }
            Some(std::net::IpAddr::V6(ip)) => {
                local.insert("ipv6".into(), json!(ip.to_string()));
            }
            None => {}
        }
        local.insert("port".into(), json!(0));
        let mut out = json!({
            "traceId": trace_id,
            "id": format!("{:016x}", span.context.span_id),
            "name": span.name,
            "kind": match span.kind { Kind::Server => "SERVER", Kind::Client => "CLIENT" },
            "timestamp": micros(span.start.duration_since(UNIX_EPOCH).unwrap_or_default()),
            "duration": micros(span.duration),
            "localEndpoint": local,
            "tags": span.tags.iter()
                .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                .collect::<Map<String, Value>>(),
        });
        if let Some(parent) = span.context.parent_id {
            out["parentId"] = json!(format!("{parent:016x}"));
        }
        out
    }
}

impl Flush for Driver {
    fn exporter(&self) -> &Exporter {
        &self.exporter
    }

    async fn send(self: Arc<Self>, batch: Vec<Span>) {
        self.stats.spans_sent.add(batch.len() as u64);
        let source = self.exporter.source();
        let Some((source, cluster)) = source.and_then(|s| {
            let cluster = s.cluster(&self.cluster)?;
            Some((s, cluster))
        }) else {
            self.stats.reports_skipped_no_cluster.inc();
            return;
        };
        let local_ip = batch.first().and_then(|s| s.local_ip);
        let body = serde_json::to_vec(&self.report_body(&batch, local_ip)).unwrap_or_default();
        let request = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{}{}", self.hostname, self.endpoint))
            .header(hyper::header::HOST, &self.hostname)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::CONTENT_LENGTH, body.len())
            .body(RequestBody::buffered(body.into(), None));
        let Ok(request) = request else {
            self.stats.reports_dropped.inc();
            return;
        };
        let http2 = cluster.http_protocol == shunt_upstream::cluster::UpstreamProtocol::Http2;
        match grpc::call(&cluster, source.secrets(), request, http2, REPORT_TIMEOUT).await {
            Ok((head, _, _)) if head.status().is_success() => self.stats.reports_sent.inc(),
            Ok((head, _, _)) => {
                tracing::debug!(status = %head.status(), "Zipkin collector refused a report");
                self.stats.reports_failed.inc();
            }
            Err(err) => {
                tracing::debug!(%err, "Zipkin report not delivered");
                self.stats.reports_dropped.inc();
            }
        }
    }
}
