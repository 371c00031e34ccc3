//! Envoy's HTTP RBAC filter (`envoy.filters.http.rbac`): the shadow engine is
//! evaluated for stats and metadata only, the enforced one answers a denied request
//! with 403 `RBAC: access denied`. `RBACPerRoute` replaces both engines on a route
//! (no `rbac` in it: the filter is off there). Stats, as Envoy names them:
//! `http.<stat_prefix>.rbac.<rules_stat_prefix>{allowed,denied}` and
//! `http.<stat_prefix>.rbac.<shadow_rules_stat_prefix>.shadow_{allowed,denied}` (checked
//! against Envoy 1.40 in tests/rbac.rs).

pub mod engine;

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::config::rbac::v3::Rbac as EnvoyRbac;
use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{
    Rbac as EnvoyHttpRbac, RbacPerRoute as EnvoyRbacPerRoute,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::StatusCode;

use self::engine::{Decision, Engine, Subject};
use super::registry::{CompileCtx, Factory};
use super::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders,
    RouteSpecificConfig, StreamCtx,
};
use shunt_config::convert::decode;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::{Counter, Store};

pub const TYPE: &str = "envoy.extensions.filters.http.rbac.v3.RBAC";
pub const PER_ROUTE_TYPE: &str = "envoy.extensions.filters.http.rbac.v3.RBACPerRoute";
/// The dynamic metadata namespace the filter writes its results under.
pub const METADATA_NAMESPACE: &str = "envoy.filters.http.rbac";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
    per_route_types: &[PER_ROUTE_TYPE],
    compile_per_route: Some(compile_per_route),
};

/// Envoy's `statPrefixJoin(prefix, "rbac.")`.
pub fn stats_prefix(prefix: &str) -> String {
    if prefix.is_empty() {
        "rbac.".to_owned()
    } else if prefix.ends_with('.') {
        format!("{prefix}rbac.")
    } else {
        format!("{prefix}.rbac.")
    }
}

/// `allowed`, `denied`, `shadow_allowed`, `shadow_denied`.
#[derive(Debug, Clone, Default)]
pub struct RbacStats {
    pub allowed: Counter,
    pub denied: Counter,
    pub shadow_allowed: Counter,
    pub shadow_denied: Counter,
}

impl RbacStats {
    /// `prefix` is the filter's (`http.<stat_prefix>.` or the network filter's own).
    pub fn new(store: &Store, prefix: &str, rules_prefix: &str, shadow_prefix: &str) -> Self {
        let base = stats_prefix(prefix);
        // Envoy joins a non-empty rules prefix with a dot: `rbac.istio_dry_run_allow_.shadow_denied`.
        let join = |p: &str| {
            if p.is_empty() || p.ends_with('.') {
                p.to_owned()
            } else {
                format!("{p}.")
            }
        };
        let (rules_prefix, shadow_prefix) = (join(rules_prefix), join(shadow_prefix));
        let enforced = |name: &str| store.counter(&format!("{base}{rules_prefix}{name}"));
        let shadow = |name: &str| store.counter(&format!("{base}{shadow_prefix}{name}"));
        RbacStats {
            allowed: enforced("allowed"),
            denied: enforced("denied"),
            shadow_allowed: shadow("shadow_allowed"),
            shadow_denied: shadow("shadow_denied"),
        }
    }
}

/// The enforced and shadow engines of one RBAC config.
#[derive(Debug, Default)]
pub struct Engines {
    pub enforced: Option<Engine>,
    pub shadow: Option<Engine>,
}

impl Engines {
    pub fn compile(
        rules: Option<&EnvoyRbac>,
        shadow_rules: Option<&EnvoyRbac>,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Engines> {
        let enforced = match rules {
            Some(rules) => Some(Engine::compile(rules, &path.field("rules"), problems)?),
            None => None,
        };
        let shadow = match shadow_rules {
            Some(rules) => Some(Engine::compile(
                rules,
                &path.field("shadow_rules"),
                problems,
            )?),
            None => None,
        };
        Some(Engines { enforced, shadow })
    }

    /// Shadow first (stats only), then the enforced engine; `None` without one.
    pub fn evaluate(
        &self,
        subject: &Subject<'_>,
        stats: &RbacStats,
    ) -> (Option<Decision>, Option<Decision>) {
        let shadow = self.shadow.as_ref().map(|engine| {
            let decision = engine.decide(subject);
            if decision.allowed {
                stats.shadow_allowed.inc();
            } else {
                stats.shadow_denied.inc();
            }
            decision
        });
        let enforced = self.enforced.as_ref().map(|engine| {
            let decision = engine.decide(subject);
            if decision.allowed {
                stats.allowed.inc();
            } else {
                stats.denied.inc();
            }
            decision
        });
        (shadow, enforced)
    }
}

/// Envoy's `responseDetail`: `rbac_access_denied_matched_policy[<id or none>]`.
pub fn denied_details(decision: &Decision) -> String {
    format!(
        "rbac_access_denied_matched_policy[{}]",
        decision.effective_policy_id.as_deref().unwrap_or("none")
    )
}

#[derive(Debug)]
struct Config {
    engines: Engines,
    stats: RbacStats,
    rules_stat_prefix: String,
    shadow_rules_stat_prefix: String,
}

#[derive(Debug)]
struct RbacFilter(Arc<Config>);

/// `RBACPerRoute`: `None` turns the filter off on the route.
#[derive(Debug)]
pub struct PerRoute(Option<Engines>);

impl RouteSpecificConfig for PerRoute {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn check_unsupported(rbac: &EnvoyHttpRbac, path: &JsonPath, problems: &mut Diagnostics) {
    if rbac.matcher.is_some() || rbac.shadow_matcher.is_some() {
        problems.error(
            path.field("matcher"),
            "RBAC matcher trees are not implemented; use rules",
        );
    }
    if rbac.track_per_rule_stats {
        problems.warning(
            path.field("track_per_rule_stats"),
            "per-rule RBAC stats are not implemented; ignored",
        );
    }
}

fn compile(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let rbac = decode::<EnvoyHttpRbac>(any, path, problems)?;
    let errors_before = problems.errors.len();
    check_unsupported(&rbac, path, problems);
    let engines = Engines::compile(
        rbac.rules.as_ref(),
        rbac.shadow_rules.as_ref(),
        path,
        problems,
    )?;
    if problems.errors.len() > errors_before {
        return None;
    }
    let stats = RbacStats::new(
        ctx.stats,
        &format!("http.{}.", ctx.stat_prefix),
        &rbac.rules_stat_prefix,
        &rbac.shadow_rules_stat_prefix,
    );
    Some(Arc::new(RbacFilter(Arc::new(Config {
        engines,
        stats,
        rules_stat_prefix: rbac.rules_stat_prefix,
        shadow_rules_stat_prefix: rbac.shadow_rules_stat_prefix,
    }))))
}

fn compile_per_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let per_route = decode::<EnvoyRbacPerRoute>(any, path, problems)?;
    let Some(rbac) = per_route.rbac else {
        return Some(Arc::new(PerRoute(None)));
    };
    let r_path = path.field("rbac");
    let errors_before = problems.errors.len();
    check_unsupported(&rbac, &r_path, problems);
    let engines = Engines::compile(
        rbac.rules.as_ref(),
        rbac.shadow_rules.as_ref(),
        &r_path,
        problems,
    )?;
    (problems.errors.len() == errors_before).then(|| Arc::new(PerRoute(Some(engines))) as _)
}

impl HttpFilterConfig for RbacFilter {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(RbacStream(self.0.clone()))
    }
}

struct RbacStream(Arc<Config>);

impl HttpFilter for RbacStream {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let config = &*self.0;
        let engines = match ctx.route_config::<PerRoute>() {
            Some(PerRoute(None)) => return Flow::CONTINUE,
            Some(PerRoute(Some(engines))) => engines,
            None => &config.engines,
        };
        let view = request.view();
        let subject = Subject {
            connection: &ctx.info.connection,
            request: Some(&view),
            info: Some(&ctx.info),
        };
        let (shadow, enforced) = engines.evaluate(&subject, &config.stats);
        let mut fields = serde_json::Map::new();
        let result = |d: &Decision| if d.allowed { "allowed" } else { "denied" };
        if let Some(shadow) = &shadow {
            let prefix = &config.shadow_rules_stat_prefix;
            if let Some(id) = &shadow.effective_policy_id {
                fields.insert(
                    format!("{prefix}shadow_effective_policy_id"),
                    id.clone().into(),
                );
            }
            fields.insert(
                format!("{prefix}shadow_engine_result"),
                result(shadow).into(),
            );
        }
        if let Some(enforced) = &enforced {
            let prefix = &config.rules_stat_prefix;
            if let Some(id) = &enforced.effective_policy_id {
                fields.insert(
                    format!("{prefix}enforced_effective_policy_id"),
                    id.clone().into(),
                );
            }
            fields.insert(
                format!("{prefix}enforced_engine_result"),
                result(enforced).into(),
            );
        }
        if !fields.is_empty() {
            ctx.info.metadata.set(METADATA_NAMESPACE, fields);
        }
        match enforced {
            Some(decision) if !decision.allowed => {
                tracing::debug!(policy = ?decision.effective_policy_id, "RBAC: access denied");
                FilterStatus::Reply(LocalReply::new(
                    StatusCode::FORBIDDEN,
                    "RBAC: access denied",
                    denied_details(&decision),
                ))
                .into()
            }
            _ => Flow::CONTINUE,
        }
    }
}
