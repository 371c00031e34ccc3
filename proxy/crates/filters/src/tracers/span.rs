//! A span as every tracer records it (Envoy's `Tracing::Span`): ids, kind, operation
//! name, times and string tags. The drivers turn finished spans into their wire forms
//! (`opentelemetry`, `zipkin`).

use std::time::{Duration, SystemTime};

/// Envoy's span kinds: a sidecar's inbound listener serves (SERVER), its outbound one
/// calls (CLIENT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Server,
    Client,
}

/// Where a span sits in its trace, and whether it is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanContext {
    /// 128 bits; a 64-bit Zipkin trace id has a zero high half.
    pub trace_id: u128,
    pub span_id: u64,
    pub parent_id: Option<u64>,
    pub sampled: bool,
}

/// One span, finished or being recorded.
#[derive(Debug, Clone)]
pub struct Span {
    pub context: SpanContext,
    pub kind: Kind,
    /// The operation: the route's decorator, else `ingress` / `egress <host>`.
    pub name: String,
    pub start: SystemTime,
    pub duration: Duration,
    /// Tags in the order they were set; a later value of a name replaces the earlier.
    pub tags: Vec<(String, String)>,
    /// W3C `tracestate`, carried on unchanged (OpenTelemetry).
    pub trace_state: String,
    /// The proxy's address on the connection (Zipkin's `localEndpoint`).
    pub local_ip: Option<std::net::IpAddr>,
}

impl Span {
    pub fn set_tag(&mut self, name: &str, value: impl Into<String>) {
        let value = value.into();
        match self.tags.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) => *v = value,
            None => self.tags.push((name.to_owned(), value)),
        }
    }

    pub fn tag(&self, name: &str) -> Option<&str> {
        self.tags
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Envoy's `error=true` (set on 5xx and on streams without a response).
    pub fn is_error(&self) -> bool {
        self.tag("error") == Some("true")
    }
}

/// A random id that is never zero (zero means "none" in both wire formats).
pub fn random_id() -> u64 {
    loop {
        let id = fastrand::u64(..);
        if id != 0 {
            return id;
        }
    }
}
