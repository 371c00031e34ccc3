//! Envoy's network rate limit filter (`envoy.filters.network.ratelimit`): when a
//! connection opens, one `ShouldRateLimit` call with the filter's static descriptors;
//! `OVER_LIMIT` closes the connection before the terminal filter sees it, and so does
//! a failed call when `failure_mode_deny`. Stats as Envoy's:
//! `ratelimit.<stat_prefix>.{total,ok,over_limit,error,failure_mode_allowed,cx_closed}`
//! and the gauge `active`.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::network::ratelimit::v3::RateLimit;
use envoy_types::pb::google::protobuf::Any;

use crate::common::ratelimit::client::{self, LimitStatus};
use crate::common::ratelimit::{self as common, Descriptor, Entry, Service};
use crate::network::factory::{CompileCtx, Factory};
use crate::network::{
    NetworkFilter, NetworkFilterConfig, NetworkFlow, NetworkStatus, NewConnection,
};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::stats::{Counter, Gauge};
use shunt_upstream::Cluster;

pub const TYPE: &str = "envoy.extensions.filters.network.ratelimit.v3.RateLimit";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct Stats {
    total: Counter,
    ok: Counter,
    over_limit: Counter,
    error: Counter,
    failure_mode_allowed: Counter,
    cx_closed: Counter,
    active: Gauge,
}

#[derive(Debug)]
struct Config {
    domain: String,
    descriptors: Vec<Descriptor>,
    service: Service,
    cluster: Option<Arc<Cluster>>,
    failure_mode_deny: bool,
    stats: Stats,
}

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let config: RateLimit = decode(any, path, problems)?;
    let errors_before = problems.errors.len();
    for (empty, field) in [
        (config.stat_prefix.is_empty(), "stat_prefix"),
        (config.domain.is_empty(), "domain"),
        (config.descriptors.is_empty(), "descriptors"),
    ] {
        if empty {
            problems.error(path.field(field), "is required");
        }
    }
    let descriptors = descriptors(&config, path, problems);
    let service = common::service(
        config.rate_limit_service.as_ref(),
        config.timeout.as_ref(),
        path,
        problems,
    );
    if problems.errors.len() > errors_before {
        return None;
    }
    let service = service?;
    let cluster = ctx.clusters.get(service.cluster.as_str()).cloned();
    if cluster.is_none() {
        problems.warning(
            path.field("rate_limit_service"),
            format!(
                "cluster {:?} of the rate limit service is not known: calls fail until the listener is updated",
                service.cluster
            ),
        );
    }
    let stat = |name: &str| format!("ratelimit.{}.{name}", config.stat_prefix);
    let stats = Stats {
        total: ctx.stats.counter(&stat("total")),
        ok: ctx.stats.counter(&stat("ok")),
        over_limit: ctx.stats.counter(&stat("over_limit")),
        error: ctx.stats.counter(&stat("error")),
        failure_mode_allowed: ctx.stats.counter(&stat("failure_mode_allowed")),
        cx_closed: ctx.stats.counter(&stat("cx_closed")),
        active: ctx.stats.gauge(&stat("active")),
    };
    Some(Arc::new(Shared(Arc::new(Config {
        domain: config.domain.clone(),
        descriptors,
        service,
        cluster,
        failure_mode_deny: config.failure_mode_deny,
        stats,
    }))))
}

/// The static descriptors. Envoy formats values with `%...%` commands; only literal
/// values are served here, and a command is refused by name.
fn descriptors(config: &RateLimit, path: &JsonPath, problems: &mut Diagnostics) -> Vec<Descriptor> {
    let mut out = Vec::new();
    for (i, d) in config.descriptors.iter().enumerate() {
        let d_path = path.field("descriptors").index(i);
        if d.limit.is_some() || d.hits_addend.is_some() {
            problems.error(
                &d_path,
                "limit and hits_addend overrides are not implemented",
            );
        }
        let mut entries = Vec::new();
        for (k, e) in d.entries.iter().enumerate() {
            let e_path = d_path.field("entries").index(k);
            if e.key.is_empty() {
                problems.error(e_path.field("key"), "is required");
            }
            if e.value.contains('%') {
                problems.error(
                    e_path.field("value"),
                    format!(
                        "{:?}: substitution commands in descriptor values are not implemented",
                        e.value
                    ),
                );
            }
            entries.push(Entry::new(&e.key, &e.value));
        }
        if entries.is_empty() {
            problems.error(d_path.field("entries"), "needs at least one entry");
        }
        out.push(Descriptor { entries });
    }
    out
}

#[derive(Debug)]
struct Shared(Arc<Config>);

impl NetworkFilterConfig for Shared {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(NetworkRateLimit(self.0.clone()))
    }
}

struct NetworkRateLimit(Arc<Config>);

impl NetworkFilter for NetworkRateLimit {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        let config = self.0.clone();
        NetworkFlow::Pending(Box::pin(async move {
            let stats = &config.stats;
            stats.total.inc();
            stats.active.inc();
            let answer = client::should_rate_limit(
                &config.service,
                config.cluster.as_ref(),
                &config.domain,
                &config.descriptors,
            )
            .await;
            stats.active.dec();
            let close = match answer.status {
                LimitStatus::Ok => {
                    stats.ok.inc();
                    false
                }
                LimitStatus::OverLimit => {
                    stats.over_limit.inc();
                    true
                }
                LimitStatus::Error => {
                    stats.error.inc();
                    if !config.failure_mode_deny {
                        stats.failure_mode_allowed.inc();
                    }
                    config.failure_mode_deny
                }
            };
            if !close {
                return NetworkStatus::Continue;
            }
            stats.cx_closed.inc();
            tracing::debug!(remote = %ctx.connection.remote, "rate limit: closing the connection");
            // Envoy closes without flushing, what the client sent unread: a reset.
            ctx.reset_on_close();
            NetworkStatus::Close
        }))
    }
}
