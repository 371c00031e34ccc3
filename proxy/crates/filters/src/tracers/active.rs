//! One request's span, from the connection manager's trace decision to its end
//! (Envoy's `ActiveStream::traceRequest`, the tracers' `startSpan`, and
//! `HttpTracerUtility::finalizeDownstreamSpan`): the context read from the request, the
//! operation name (default, route decorator, `x-envoy-decorator-operation`), the context
//! written on the request upstream, and the standard and custom tags set when the stream
//! ends, after which a sampled span goes to its tracer's queue.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use super::propagation::{self, W3c};
use super::request_id::Reason;
use super::span::{Kind, Span, SpanContext, random_id};
use super::{Driver, HttpTracing};
use shunt_core::access_log::Entry;
use shunt_core::stream_info::Metadata;

pub const DECORATOR_OPERATION: HeaderName = HeaderName::from_static("x-envoy-decorator-operation");
const DOWNSTREAM_CLUSTER: HeaderName =
    HeaderName::from_static("x-envoy-downstream-service-cluster");
const CLIENT_TRACE_ID: HeaderName = HeaderName::from_static("x-client-trace-id");
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// What the span reads from the request as it arrives.
pub struct RequestFacts<'a> {
    pub method: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub scheme: &'a str,
    pub protocol: &'static str,
    pub peer: IpAddr,
    pub local: IpAddr,
}

/// A request's span while the request runs.
#[derive(Debug)]
pub struct ActiveSpan {
    tracing: Arc<HttpTracing>,
    span: Span,
    started: Instant,
    /// B3 went in as the single header / with the debug flag: it goes on so.
    b3_single: bool,
    b3_debug: bool,
    /// The route decorator's operation, while it may still go in a response header.
    decorated: Option<String>,
    propagate_decorator: bool,
    status: u16,
}

impl ActiveSpan {
    /// The trace decision (packed into `x-request-id`, counted) and the span, unless the
    /// request's trace context cannot be read (Envoy then reports no span for it).
    pub fn start(
        tracing: &Arc<HttpTracing>,
        headers: &mut HeaderMap,
        request: &RequestFacts<'_>,
    ) -> Option<ActiveSpan> {
        let reason = tracing.request_id.decide(headers, &tracing.sampling);
        tracing.stats.charge(reason);
        let (context, trace_state, b3_single, b3_debug) = match &tracing.driver {
            Driver::OpenTelemetry(_) => w3c_context(headers, reason)?,
            Driver::Zipkin(z) => b3_context(headers, reason, tracing.egress, z)?,
        };
        let name = if tracing.egress {
            format!("egress {}", request.authority)
        } else {
            "ingress".to_owned()
        };
        let mut span = Span {
            context,
            kind: if tracing.egress {
                Kind::Client
            } else {
                Kind::Server
            },
            name,
            start: SystemTime::now(),
            duration: Duration::ZERO,
            tags: Vec::new(),
            trace_state,
            local_ip: Some(request.local),
        };
        // An unsampled span only carries context on: its tags would never be read.
        if span.context.sampled {
            span.set_tag("node_id", &tracing.node_id);
            span.set_tag("zone", &tracing.zone);
            request_tags(&mut span, tracing, headers, request);
        }
        Some(ActiveSpan {
            tracing: tracing.clone(),
            span,
            started: Instant::now(),
            b3_single,
            b3_debug,
            decorated: None,
            propagate_decorator: true,
            status: 0,
        })
    }

    pub fn sampled(&self) -> bool {
        self.span.context.sampled
    }

    /// The route's decorator names the span; egress passes it on to the next proxy,
    /// ingress takes the caller's (`x-envoy-decorator-operation`) over its own.
    pub fn decorate(&mut self, decorator: Option<(&str, bool)>, headers: &mut HeaderMap) {
        if let Some((operation, propagate)) = decorator {
            self.span.name = operation.to_owned();
            self.decorated = Some(operation.to_owned());
            self.propagate_decorator = propagate;
        }
        if self.tracing.egress {
            if let Some(operation) = self
                .decorated
                .as_deref()
                .filter(|_| self.propagate_decorator)
                && let Ok(value) = HeaderValue::from_str(operation)
            {
                headers.insert(DECORATOR_OPERATION, value);
            }
        } else if let Some(value) = headers.remove(DECORATOR_OPERATION)
            && let Ok(operation) = value.to_str()
            && !operation.is_empty()
        {
            self.span.name = operation.to_owned();
            self.decorated = None;
        }
    }

    /// The span's context on the request upstream.
    pub fn inject(&self, headers: &mut HeaderMap) {
        if self.tracing.no_context_propagation {
            return;
        }
        match &self.tracing.driver {
            Driver::OpenTelemetry(_) => {
                propagation::inject_w3c(&self.span.context, &self.span.trace_state, headers)
            }
            Driver::Zipkin(z) => propagation::inject_b3(
                &self.span.context,
                z.trace_id_128bit,
                self.b3_debug,
                self.b3_single,
                headers,
            ),
        }
    }

    /// The response's status, and the decorator in its headers: ingress passes its own
    /// back, egress takes the callee's (and removes it).
    pub fn on_response(&mut self, status: u16, headers: &mut HeaderMap) {
        self.status = status;
        if !self.tracing.egress {
            if let Some(operation) = self
                .decorated
                .as_deref()
                .filter(|_| self.propagate_decorator)
                && let Ok(value) = HeaderValue::from_str(operation)
            {
                headers.insert(DECORATOR_OPERATION, value);
            }
        } else if let Some(value) = headers.remove(DECORATOR_OPERATION)
            && let Ok(operation) = value.to_str()
            && !operation.is_empty()
        {
            self.span.name = operation.to_owned();
        }
    }

    /// Ends the span with what the stream's log entry knows, and reports it if sampled.
    pub fn finish(mut self, entry: &Entry, metadata: Option<&Metadata>) {
        if !self.span.context.sampled {
            return;
        }
        self.span.duration = self.started.elapsed();
        let span = &mut self.span;
        for tag in self.tracing.custom_tags.iter().filter(|t| t.is_metadata()) {
            if let Some(value) = tag.from_metadata(metadata) {
                span.set_tag(&tag.tag, value);
            }
        }
        span.set_tag("component", "proxy");
        span.set_tag("http.status_code", self.status.to_string());
        span.set_tag(
            "response_flags",
            shunt_core::access_log::flags_string(&entry.response_flags),
        );
        if entry.upstream_host.is_some()
            && let Some(cluster) = &entry.upstream_cluster
        {
            span.set_tag("upstream_cluster", &**cluster);
            span.set_tag("upstream_cluster.name", &**cluster);
        }
        span.set_tag("request_size", entry.bytes_received.to_string());
        span.set_tag("response_size", entry.bytes_sent.to_string());
        if self.status == 0 || self.status >= 500 {
            span.set_tag("error", "true");
        }
        let span = std::mem::replace(
            &mut self.span,
            Span {
                context: SpanContext {
                    trace_id: 0,
                    span_id: 0,
                    parent_id: None,
                    sampled: false,
                },
                kind: Kind::Server,
                name: String::new(),
                start: SystemTime::UNIX_EPOCH,
                duration: Duration::ZERO,
                tags: Vec::new(),
                trace_state: String::new(),
                local_ip: None,
            },
        );
        match &self.tracing.driver {
            Driver::OpenTelemetry(d) => d.report(span),
            Driver::Zipkin(d) => d.report(span),
        }
    }
}

/// The tags read from the request (Envoy sets them at the end from the same headers).
fn request_tags(
    span: &mut Span,
    tracing: &HttpTracing,
    headers: &HeaderMap,
    request: &RequestFacts<'_>,
) {
    let text = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(id) = text(&REQUEST_ID) {
        span.set_tag("guid:x-request-id", id);
    }
    let path = truncate(request.path, tracing.max_path_tag_length);
    let scheme = text(&FORWARDED_PROTO).unwrap_or(request.scheme);
    span.set_tag(
        "http.url",
        format!("{scheme}://{}{path}", request.authority),
    );
    span.set_tag("http.method", request.method);
    span.set_tag(
        "downstream_cluster",
        text(&DOWNSTREAM_CLUSTER).unwrap_or("-"),
    );
    span.set_tag(
        "user_agent",
        text(&hyper::header::USER_AGENT).unwrap_or("-"),
    );
    span.set_tag("http.protocol", request.protocol);
    span.set_tag("peer.address", request.peer.to_canonical().to_string());
    if let Some(id) = text(&CLIENT_TRACE_ID) {
        span.set_tag("guid:x-client-trace-id", id);
    }
    for tag in &tracing.custom_tags {
        if let Some(value) = tag.from_request(headers) {
            span.set_tag(&tag.tag, value);
        }
    }
}

fn truncate(path: &str, max: usize) -> &str {
    if path.len() <= max {
        return path;
    }
    let mut end = max;
    while !path.is_char_boundary(end) {
        end -= 1;
    }
    &path[..end]
}

/// OpenTelemetry: a child of the `traceparent`'s span (its sampled flag decides), or a
/// new trace sampled as the request was decided; an unreadable `traceparent`: no span.
fn w3c_context(headers: &HeaderMap, reason: Reason) -> Option<(SpanContext, String, bool, bool)> {
    let (context, state) = match propagation::extract_w3c(headers) {
        W3c::Invalid => return None,
        W3c::Absent => (
            SpanContext {
                trace_id: (u128::from(random_id()) << 64) | u128::from(random_id()),
                span_id: random_id(),
                parent_id: None,
                sampled: reason.traced(),
            },
            String::new(),
        ),
        W3c::Parent {
            trace_id,
            span_id,
            sampled,
            trace_state,
        } => (
            SpanContext {
                trace_id,
                span_id: random_id(),
                parent_id: Some(span_id),
                sampled,
            },
            trace_state,
        ),
    };
    Some((context, state, false, false))
}

/// Zipkin: a child of the B3 context's span (a SERVER span shares its caller's id under
/// `shared_span_context`), else a new trace whose low 64 bits are the root span's id;
/// sampled as the B3 headers say, else as the request was decided.
fn b3_context(
    headers: &HeaderMap,
    reason: Reason,
    egress: bool,
    zipkin: &super::zipkin::Driver,
) -> Option<(SpanContext, String, bool, bool)> {
    let b3 = propagation::extract_b3(headers).ok()?;
    let sampled = b3.debug || b3.sampled.unwrap_or_else(|| reason.traced());
    let context = match b3.parent {
        None => {
            let id = random_id();
            let high = if zipkin.trace_id_128bit {
                random_id()
            } else {
                0
            };
            SpanContext {
                trace_id: (u128::from(high) << 64) | u128::from(id),
                span_id: id,
                parent_id: None,
                sampled,
            }
        }
        Some((trace_id, span_id)) if !egress && zipkin.shared_span_context => SpanContext {
            trace_id,
            span_id,
            parent_id: parent_of(headers, b3.single),
            sampled,
        },
        Some((trace_id, span_id)) => SpanContext {
            trace_id,
            span_id: random_id(),
            parent_id: Some(span_id),
            sampled,
        },
    };
    Some((context, String::new(), b3.single, b3.debug))
}

/// The caller's own parent (a shared SERVER span keeps it).
fn parent_of(headers: &HeaderMap, single: bool) -> Option<u64> {
    let text = if single {
        headers
            .get(propagation::B3)?
            .to_str()
            .ok()?
            .split('-')
            .nth(3)?
            .to_owned()
    } else {
        headers
            .get(propagation::X_B3_PARENT_SPAN_ID)?
            .to_str()
            .ok()?
            .to_owned()
    };
    u64::from_str_radix(&text, 16).ok()
}
