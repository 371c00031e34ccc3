//! Envoy's network RBAC filter (`envoy.filters.network.rbac`): decides on the
//! connection's first read, as Envoy's does (`ONE_TIME_ON_FIRST_BYTE`; `CONTINUOUS`
//! decides on every read). A denied connection is closed before the terminal filter
//! sees a byte. Stats: `<stat_prefix>rbac.<...>allowed|denied|shadow_allowed|
//! shadow_denied` (Envoy's `statPrefixJoin`).

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::{
    Rbac as EnvoyRbac, rbac::EnforcementType,
};
use envoy_types::pb::google::protobuf::Any;

use crate::common::rbac::engine::Subject;
use crate::common::rbac::{Engines, RbacStats, denied_details};
use crate::network::factory::{CompileCtx, Factory};
use crate::network::{NetworkFilter, NetworkFilterConfig, NetworkStatus};
use shunt_config::convert::decode;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::Connection;

pub const TYPE: &str = "envoy.extensions.filters.network.rbac.v3.RBAC";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct Config {
    engines: Engines,
    stats: RbacStats,
    continuous: bool,
}

#[derive(Debug)]
struct Rbac(Arc<Config>);

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let rbac = decode::<EnvoyRbac>(any, path, problems)?;
    let errors_before = problems.errors.len();
    if rbac.stat_prefix.is_empty() {
        problems.error(path.field("stat_prefix"), "is required");
    }
    if rbac.matcher.is_some() || rbac.shadow_matcher.is_some() {
        problems.error(
            path.field("matcher"),
            "RBAC matcher trees are not implemented; use rules",
        );
    }
    if rbac.delay_deny.is_some() {
        problems.warning(
            path.field("delay_deny"),
            "not implemented: denied connections are closed at once",
        );
    }
    let engines = Engines::compile(
        rbac.rules.as_ref(),
        rbac.shadow_rules.as_ref(),
        path,
        problems,
    )?;
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(Arc::new(Rbac(Arc::new(Config {
        engines,
        stats: RbacStats::new(
            ctx.stats,
            &rbac.stat_prefix,
            "",
            &rbac.shadow_rules_stat_prefix,
        ),
        continuous: EnforcementType::try_from(rbac.enforcement_type)
            == Ok(EnforcementType::Continuous),
    }))))
}

impl NetworkFilterConfig for Rbac {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(RbacConnection {
            config: self.0.clone(),
            decided: None,
        })
    }
}

struct RbacConnection {
    config: Arc<Config>,
    /// The first decision (ONE_TIME_ON_FIRST_BYTE keeps it).
    decided: Option<NetworkStatus>,
}

impl NetworkFilter for RbacConnection {
    fn wants_data(&self) -> bool {
        self.decided.is_none() || self.config.continuous
    }

    fn on_data(
        &mut self,
        _data: &[u8],
        _end_stream: bool,
        connection: &Connection,
    ) -> NetworkStatus {
        if let Some(decided) = self.decided
            && !self.config.continuous
        {
            return decided;
        }
        let subject = Subject {
            connection,
            request: None,
            info: None,
        };
        let (_, enforced) = self.config.engines.evaluate(&subject, &self.config.stats);
        let status = match enforced {
            Some(decision) if !decision.allowed => {
                tracing::debug!(details = %denied_details(&decision), remote = %connection.remote, "network RBAC: closing");
                NetworkStatus::Close
            }
            _ => NetworkStatus::Continue,
        };
        self.decided = Some(status);
        status
    }
}
