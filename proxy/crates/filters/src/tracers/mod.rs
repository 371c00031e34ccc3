//! Distributed tracing as Envoy's HTTP connection manager does it (Envoy's
//! `source/common/tracing/` and `source/extensions/tracers/`): the HCM's `tracing` block
//! compiled ([`HttpTracing`]), the trace decision packed into `x-request-id`
//! ([`request_id`]), trace context read from and written to requests
//! ([`propagation`]), one span per request ([`active`]), and the tracers that export
//! finished spans off the request path: OpenTelemetry (OTLP over gRPC) and Zipkin (v2
//! JSON over HTTP), each with a bounded queue ([`exporter`]).

pub mod active;
pub mod custom_tags;
pub mod exporter;
pub mod opentelemetry;
pub mod propagation;
pub mod request_id;
pub mod span;
pub mod zipkin;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use envoy_types::pb::envoy::config::trace::v3::{
    OpenTelemetryConfig, ZipkinConfig, tracing::Http as TracerProvider, tracing::http::ConfigType,
};
use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::{
    HttpConnectionManager as EnvoyHcm, http_connection_manager::Tracing as EnvoyTracing,
};
use envoy_types::pb::envoy::extensions::request_id::uuid::v3::UuidRequestIdConfig;

use crate::common::percent::Percent;
use custom_tags::CustomTag;
use request_id::{Sampling, UuidRequestId};
use shunt_config::convert::{decode, type_name};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::peer::LocalNode;
use shunt_core::stats::{Counter, Store};

pub use exporter::CollectorSource;

/// Envoy's default `max_path_tag_length`.
pub const DEFAULT_MAX_PATH_TAG_LENGTH: usize = 256;

/// A tracer: where finished spans go and how context is carried.
#[derive(Debug, Clone)]
pub enum Driver {
    OpenTelemetry(Arc<opentelemetry::Driver>),
    Zipkin(Arc<zipkin::Driver>),
}

impl Driver {
    pub fn exporter(&self) -> &exporter::Exporter {
        match self {
            Driver::OpenTelemetry(d) => d.exporter_ref(),
            Driver::Zipkin(d) => d.exporter_ref(),
        }
    }
}

/// An HCM's `tracing`, compiled.
#[derive(Debug)]
pub struct HttpTracing {
    /// The listener's direction: OUTBOUND is Envoy's egress operation (CLIENT spans,
    /// `egress <host>`), the rest ingress (SERVER spans, `ingress`).
    pub egress: bool,
    pub sampling: Sampling,
    pub request_id: UuidRequestId,
    pub custom_tags: Vec<CustomTag>,
    pub max_path_tag_length: usize,
    /// `no_context_propagation`: spans are reported, no context goes upstream.
    pub no_context_propagation: bool,
    pub driver: Driver,
    pub node_id: String,
    pub zone: String,
    pub stats: TracingStats,
}

/// `http.<stat_prefix>.tracing.*`: how each request's trace was decided.
#[derive(Debug)]
pub struct TracingStats {
    pub client_enabled: Counter,
    pub health_check: Counter,
    pub not_traceable: Counter,
    pub random_sampling: Counter,
    pub service_forced: Counter,
}

impl TracingStats {
    fn new(stats: &Store, stat_prefix: &str) -> Self {
        let counter = |name: &str| stats.counter(&format!("http.{stat_prefix}.tracing.{name}"));
        TracingStats {
            client_enabled: counter("client_enabled"),
            health_check: counter("health_check"),
            not_traceable: counter("not_traceable"),
            random_sampling: counter("random_sampling"),
            service_forced: counter("service_forced"),
        }
    }

    pub fn charge(&self, reason: request_id::Reason) {
        use request_id::Reason;
        match reason {
            Reason::ClientForced => self.client_enabled.inc(),
            Reason::HealthCheck => self.health_check.inc(),
            Reason::NotTraceable => self.not_traceable.inc(),
            Reason::Sampling => self.random_sampling.inc(),
            Reason::ServiceForced => self.service_forced.inc(),
        }
    }
}

/// The HCM's `tracing` with its `request_id_extension`; None (and errors in
/// `problems`) when a part is wrong or not implemented, None without errors when the
/// HCM has no tracing.
pub fn compile(
    hcm: &EnvoyHcm,
    egress: bool,
    node: &LocalNode,
    stats: &Store,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<HttpTracing> {
    let tracing = hcm.tracing.as_ref()?;
    let t_path = path.field("tracing");
    let request_id = request_id_extension(hcm, path, problems);
    let Some(provider) = &tracing.provider else {
        // Envoy 1.40 has no bootstrap-level tracer: without a provider nothing traces.
        problems.warning(
            t_path.field("provider"),
            "no tracer provider: no spans are reported",
        );
        return None;
    };
    let driver = driver(provider, node, stats, &t_path.field("provider"), problems)?;
    if !tracing.operation.is_empty() || !tracing.upstream_operation.is_empty() {
        problems.warning(
            &t_path,
            "operation and upstream_operation are not implemented; ignored",
        );
    }
    if tracing.spawn_upstream_span.is_some_and(|b| b.value) {
        problems.warning(
            t_path.field("spawn_upstream_span"),
            "not implemented; the request's one span stands for the upstream call",
        );
    }
    if tracing.verbose {
        problems.warning(t_path.field("verbose"), "not implemented; ignored");
    }
    let custom_tags =
        custom_tags::compile(&tracing.custom_tags, &t_path.field("custom_tags"), problems);
    Some(HttpTracing {
        egress,
        sampling: sampling(tracing),
        request_id: request_id?,
        custom_tags,
        max_path_tag_length: tracing
            .max_path_tag_length
            .map_or(DEFAULT_MAX_PATH_TAG_LENGTH, |v| v.value as usize),
        no_context_propagation: tracing.no_context_propagation,
        driver,
        node_id: node.id.clone(),
        zone: node.zone.clone(),
        stats: TracingStats::new(stats, &hcm.stat_prefix),
    })
}

/// Envoy's conversion: client and overall sampling out of 100 (default 100), random
/// sampling rounded to out of 10 000 (default 10 000).
fn sampling(tracing: &EnvoyTracing) -> Sampling {
    let hundred = |p: Option<f64>| Percent {
        numerator: p.map_or(100, |v| v.max(0.0) as u64),
        denominator: 100,
    };
    Sampling {
        client: hundred(tracing.client_sampling.as_ref().map(|p| p.value)),
        random: Percent {
            numerator: tracing.random_sampling.as_ref().map_or(10_000, |p| {
                (p.value / 100.0 * 10_000.0).round().max(0.0) as u64
            }),
            denominator: 10_000,
        },
        overall: hundred(tracing.overall_sampling.as_ref().map(|p| p.value)),
    }
}

const UUID_REQUEST_ID: &str = "envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig";

fn request_id_extension(
    hcm: &EnvoyHcm,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<UuidRequestId> {
    let Some(any) = hcm
        .request_id_extension
        .as_ref()
        .and_then(|e| e.typed_config.as_ref())
    else {
        return Some(UuidRequestId::default());
    };
    let path = path.field("request_id_extension").field("typed_config");
    if type_name(any) != UUID_REQUEST_ID {
        problems.error(
            &path,
            format!(
                "request id extension {} is not implemented; only envoy.request_id.uuid",
                type_name(any)
            ),
        );
        return None;
    }
    let config: UuidRequestIdConfig = decode(any, &path, problems)?;
    Some(UuidRequestId {
        pack_trace_reason: config.pack_trace_reason.is_none_or(|b| b.value),
        use_request_id_for_trace_sampling: config
            .use_request_id_for_trace_sampling
            .is_none_or(|b| b.value),
    })
}

const OPENTELEMETRY: &str = "envoy.config.trace.v3.OpenTelemetryConfig";
const ZIPKIN: &str = "envoy.config.trace.v3.ZipkinConfig";

/// The tracer configs an HCM's `tracing.provider` may hold, for config validation.
pub const TRACERS: &[&str] = &[OPENTELEMETRY, ZIPKIN];
/// The request id extensions an HCM may name.
pub const REQUEST_ID_EXTENSIONS: &[&str] = &[UUID_REQUEST_ID];

/// The provider's tracer, shared by every HCM of the node with the same config (as
/// Envoy's tracer manager shares one driver per config): one queue and flush task.
fn driver(
    provider: &TracerProvider,
    node: &LocalNode,
    stats: &Store,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Driver> {
    let Some(ConfigType::TypedConfig(any)) = &provider.config_type else {
        problems.error(
            path.field("typed_config"),
            format!("tracer {:?} needs a typed_config", provider.name),
        );
        return None;
    };
    let t_path = path.field("typed_config");
    let key = (node.id.clone(), any.type_url.clone(), any.value.clone());
    if let Some(shared) = cached(&key) {
        return Some(shared);
    }
    let driver = match type_name(any) {
        OPENTELEMETRY => {
            let config: OpenTelemetryConfig = decode(any, &t_path, problems)?;
            Driver::OpenTelemetry(Arc::new(opentelemetry::Driver::compile(
                &config, stats, &t_path, problems,
            )?))
        }
        ZIPKIN => {
            let config: ZipkinConfig = decode(any, &t_path, problems)?;
            Driver::Zipkin(Arc::new(zipkin::Driver::compile(
                &config,
                &node.cluster,
                stats,
                &t_path,
                problems,
            )?))
        }
        other => {
            problems.error(
                &t_path,
                format!(
                    "tracer {:?} ({other}) is not implemented; shunt serves envoy.tracers.opentelemetry and envoy.tracers.zipkin",
                    provider.name
                ),
            );
            return None;
        }
    };
    remember(key, &driver);
    Some(driver)
}

type DriverKey = (String, String, Vec<u8>);

#[derive(Clone)]
enum WeakDriver {
    OpenTelemetry(Weak<opentelemetry::Driver>),
    Zipkin(Weak<zipkin::Driver>),
}

static DRIVERS: Mutex<Option<HashMap<DriverKey, WeakDriver>>> = Mutex::new(None);

fn cached(key: &DriverKey) -> Option<Driver> {
    let drivers = DRIVERS.lock().unwrap_or_else(|e| e.into_inner());
    match drivers.as_ref()?.get(key)? {
        WeakDriver::OpenTelemetry(d) => d.upgrade().map(Driver::OpenTelemetry),
        WeakDriver::Zipkin(d) => d.upgrade().map(Driver::Zipkin),
    }
}

fn remember(key: DriverKey, driver: &Driver) {
    let mut drivers = DRIVERS.lock().unwrap_or_else(|e| e.into_inner());
    let drivers = drivers.get_or_insert_with(HashMap::new);
    drivers.retain(|_, d| match d {
        WeakDriver::OpenTelemetry(d) => d.strong_count() > 0,
        WeakDriver::Zipkin(d) => d.strong_count() > 0,
    });
    let weak = match driver {
        Driver::OpenTelemetry(d) => WeakDriver::OpenTelemetry(Arc::downgrade(d)),
        Driver::Zipkin(d) => WeakDriver::Zipkin(Arc::downgrade(d)),
    };
    drivers.insert(key, weak);
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::Any;

    fn hcm(provider: &str, type_url: &str, value: Vec<u8>) -> EnvoyHcm {
        EnvoyHcm {
            stat_prefix: "t".into(),
            tracing: Some(EnvoyTracing {
                provider: Some(TracerProvider {
                    name: provider.into(),
                    config_type: Some(ConfigType::TypedConfig(Any {
                        type_url: type_url.into(),
                        value,
                    })),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn an_unknown_tracer_is_an_error_naming_it_at_its_path() {
        let mut problems = Diagnostics::default();
        let hcm = hcm(
            "envoy.tracers.datadog",
            "type.googleapis.com/envoy.config.trace.v3.DatadogConfig",
            Vec::new(),
        );
        let compiled = compile(
            &hcm,
            true,
            &LocalNode::default(),
            &Store::new(),
            &JsonPath::new("hcm"),
            &mut problems,
        );
        assert!(compiled.is_none());
        assert_eq!(problems.errors.len(), 1, "{problems:?}");
        assert_eq!(problems.errors[0].path, "hcm.tracing.provider.typed_config");
        assert!(problems.errors[0].message.contains("envoy.tracers.datadog"));
    }

    #[test]
    fn sampling_percentages_convert_as_envoys() {
        use envoy_types::pb::envoy::r#type::v3::Percent as EnvoyPercent;
        let tracing = EnvoyTracing {
            random_sampling: Some(EnvoyPercent { value: 1.0 }),
            client_sampling: Some(EnvoyPercent { value: 50.0 }),
            ..Default::default()
        };
        let s = sampling(&tracing);
        assert_eq!((s.random.numerator, s.random.denominator), (100, 10_000));
        assert_eq!((s.client.numerator, s.client.denominator), (50, 100));
        // Unset: everything.
        assert_eq!(s.overall.numerator, 100);
        assert_eq!(sampling(&EnvoyTracing::default()).random.numerator, 10_000);
    }
}
