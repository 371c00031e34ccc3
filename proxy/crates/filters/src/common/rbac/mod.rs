//! What the HTTP and network RBAC filters share (Envoy's `filters/common/rbac/`): the
//! [`engine`] that decides, the enforced and shadow [`Engines`] of one config, their
//! stats and the denial's response details.

pub mod engine;

use envoy_types::pb::envoy::config::rbac::v3::Rbac as EnvoyRbac;

use self::engine::{Decision, Engine, Subject};
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::{Counter, Store};

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
