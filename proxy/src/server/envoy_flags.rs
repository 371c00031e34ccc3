//! Envoy's command line on `shunt proxy`, so Istio's pilot-agent can exec shunt in
//! Envoy's place: its level names, its per-component levels, and the flags that have
//! no meaning for shunt (hot restart, flush intervals), accepted and checked.

use super::ProxyArgs;

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainStrategy {
    Gradual,
    Immediate,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpVersion {
    V4,
    V6,
}

/// Envoy's components that name a shunt module, and that module's log target.
const COMPONENTS: &[(&str, &str)] = &[
    ("admin", "shunt::admin"),
    ("config", "shunt::xds"),
    ("connection", "shunt::listener"),
    ("dns", "shunt::upstream::dns"),
    ("filter", "shunt::listener"),
    ("health_checker", "shunt::upstream::health_check"),
    ("hc", "shunt::upstream::health_check"),
    ("http", "shunt::http"),
    ("http2", "shunt::http"),
    ("main", "shunt::server"),
    ("pool", "shunt::upstream"),
    ("router", "shunt::http"),
    ("runtime", "shunt::server"),
    ("secret", "shunt::tls"),
    ("upstream", "shunt::upstream"),
];

/// One of Envoy's level names (or tracing's) as a tracing level; `None` if neither.
fn level(name: &str) -> Option<&'static str> {
    Some(match name {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warning" | "warn" => "warn",
        // tracing has nothing above error.
        "error" | "critical" => "error",
        "off" => "off",
        _ => return None,
    })
}

/// The tracing filter for `-l` and `--component-log-level`: an Envoy level name is
/// translated; anything else is taken as tracing directives (shunt's own syntax).
pub fn log_filter(log_level: &str, components: Option<&str>) -> anyhow::Result<String> {
    let mut filter = level(log_level)
        .map(str::to_owned)
        .unwrap_or_else(|| log_level.to_owned());
    for entry in components
        .unwrap_or_default()
        .split(',')
        .filter(|e| !e.is_empty())
    {
        let Some((component, name)) = entry.split_once(':') else {
            anyhow::bail!(
                "--component-log-level {entry:?}: expected COMPONENT:LEVEL (e.g. misc:error)"
            );
        };
        let Some(level) = level(name) else {
            anyhow::bail!(
                "--component-log-level {entry:?}: unknown level {name:?} (trace, debug, \
                 info, warning, error, critical, off)"
            );
        };
        if component.is_empty()
            || !component
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            anyhow::bail!("--component-log-level {entry:?}: {component:?} is not a component name");
        }
        for (_, target) in COMPONENTS.iter().filter(|(c, _)| *c == component) {
            filter.push_str(&format!(",{target}={level}"));
        }
    }
    Ok(filter)
}

/// The flags shunt accepts without a use, checked so a wrong value is still an error.
pub fn check(args: &ProxyArgs) -> anyhow::Result<()> {
    if args.restart_epoch != 0 {
        anyhow::bail!(
            "--restart-epoch {}: shunt has no hot restart, so only epoch 0 (a first start) \
             can run",
            args.restart_epoch
        );
    }
    tracing::debug!(
        drain_strategy = ?args.drain_strategy,
        local_address_ip_version = ?args.local_address_ip_version,
        file_flush_interval_msec = args.file_flush_interval_msec,
        file_flush_min_size_kb = ?args.file_flush_min_size_kb,
        disable_hot_restart = args.disable_hot_restart,
        allow_unknown_static_fields = args.allow_unknown_static_fields,
        log_format = ?args.log_format,
        "Envoy flags accepted without effect"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_level_names_become_tracing_levels() {
        assert_eq!(log_filter("warning", None).unwrap(), "warn");
        assert_eq!(log_filter("critical", None).unwrap(), "error");
        assert_eq!(log_filter("off", None).unwrap(), "off");
        assert_eq!(
            log_filter("shunt::http=debug", None).unwrap(),
            "shunt::http=debug"
        );
    }

    #[test]
    fn component_levels_name_shunt_modules_and_unknown_components_are_accepted() {
        assert_eq!(
            log_filter("warning", Some("misc:error,upstream:debug")).unwrap(),
            "warn,shunt::upstream=debug"
        );
    }

    #[test]
    fn a_bad_component_level_names_the_entry() {
        let err = log_filter("info", Some("misc:loud"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"misc:loud\"") && err.contains("unknown level"),
            "{err}"
        );
        let err = log_filter("info", Some("misc")).unwrap_err().to_string();
        assert!(err.contains("COMPONENT:LEVEL"), "{err}");
    }
}
