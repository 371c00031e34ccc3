//! Envoy's HTTP RBAC filter (`envoy.filters.http.rbac`): the shadow engine is
//! evaluated for stats and metadata only, the enforced one answers a denied request
//! with 403 `RBAC: access denied`. `RBACPerRoute` replaces both engines on a route
//! (no `rbac` in it: the filter is off there). Stats, as Envoy names them:
//! `http.<stat_prefix>.rbac.<rules_stat_prefix>{allowed,denied}` and
//! `http.<stat_prefix>.rbac.<shadow_rules_stat_prefix>.shadow_{allowed,denied}` (checked
//! against Envoy 1.40 in tests/rbac.rs).

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::rbac::v3::{
    Rbac as EnvoyHttpRbac, RbacPerRoute as EnvoyRbacPerRoute,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::StatusCode;

use super::factory::{CompileCtx, Factory};
use super::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders,
    RouteSpecificConfig, StreamCtx,
};
use crate::common::rbac::engine::{Decision, Subject};
use crate::common::rbac::{Engines, RbacStats, denied_details};
use shunt_config::convert::decode;
use shunt_config::{Diagnostics, JsonPath};

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
