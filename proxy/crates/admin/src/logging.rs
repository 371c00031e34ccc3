//! `/logging`: the log levels, listed and changed at run time.
//!
//! The admin API does not own the tracing subscriber: whoever installs it hands over a
//! reload closure with [`register`] (or calls [`init`], which installs a reloadable
//! subscriber and registers it). The admin keeps the levels as Envoy presents them, one
//! default level and per-logger overrides (tracing targets, `shunt::tcp`), and applies
//! them as one `EnvFilter` directive string (`info,shunt::tcp=debug`).

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex, OnceLock};

/// Applies a filter (tracing `EnvFilter` directives) to the process's logging.
pub type Reload = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// The levels and the way to apply them. Cloning shares them.
#[derive(Clone)]
pub struct LogControl {
    inner: Arc<Mutex<Levels>>,
    reload: Option<Reload>,
}

#[derive(Debug, Clone)]
struct Levels {
    default: String,
    /// Per-logger overrides, by tracing target.
    loggers: BTreeMap<String, String>,
}

/// Envoy's level names (`warning`, `critical`) and tracing's (`warn`), as tracing's.
pub fn tracing_level(level: &str) -> Option<&'static str> {
    Some(match level.to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warning" | "warn" => "warn",
        "error" | "critical" => "error",
        "off" => "off",
        _ => return None,
    })
}

impl LogControl {
    /// Levels read from `filter` (EnvFilter directives), changed through `reload`.
    pub fn new(filter: &str, reload: Option<Reload>) -> Self {
        let mut levels = Levels {
            default: "info".into(),
            loggers: BTreeMap::new(),
        };
        for directive in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
            match directive.split_once('=') {
                Some((target, level)) => {
                    levels.loggers.insert(target.into(), level.into());
                }
                None => levels.default = directive.into(),
            }
        }
        LogControl {
            inner: Arc::new(Mutex::new(levels)),
            reload,
        }
    }

    /// The registered control (see [`register`]), or one that can list but not change.
    pub fn global() -> Self {
        GLOBAL
            .get()
            .cloned()
            .unwrap_or_else(|| LogControl::new("info", None))
    }

    /// Whether levels can be changed (a reload closure was given).
    #[cfg(test)]
    pub fn can_change(&self) -> bool {
        self.reload.is_some()
    }

    /// Envoy's listing: `active loggers:` then one `  name: level` line per logger,
    /// `default` first.
    pub fn listing(&self) -> String {
        let levels = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = format!("active loggers:\n  default: {}\n", levels.default);
        for (target, level) in &levels.loggers {
            out.push_str(&format!("  {target}: {level}\n"));
        }
        out
    }

    /// `?level=`: every logger to `level`.
    pub fn set_all(&self, level: &str) -> Result<(), String> {
        let level = tracing_level(level).ok_or_else(|| format!("unknown level {level:?}"))?;
        self.change(|levels| {
            levels.default = level.into();
            levels.loggers.clear();
        })
    }

    /// `?paths=name:level,name:level`: the named loggers (tracing targets, which may
    /// contain `::`; the level is after the last `:`).
    pub fn set_paths(&self, paths: &str) -> Result<(), String> {
        let mut changes = Vec::new();
        for pair in paths.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (target, level) = pair
                .rsplit_once(':')
                .filter(|(target, _)| !target.is_empty())
                .ok_or_else(|| format!("{pair:?} is not <logger>:<level>"))?;
            let level = tracing_level(level)
                .ok_or_else(|| format!("unknown level {level:?} in {pair:?}"))?;
            changes.push((target.to_owned(), level));
        }
        self.change(|levels| {
            for (target, level) in changes {
                levels.loggers.insert(target, level.into());
            }
        })
    }

    fn change(&self, edit: impl FnOnce(&mut Levels)) -> Result<(), String> {
        let Some(reload) = &self.reload else {
            return Err("log levels cannot be changed: no reloadable logger is installed".into());
        };
        let mut levels = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let mut changed = levels.clone();
        edit(&mut changed);
        reload(&filter_of(&changed))?;
        *levels = changed;
        Ok(())
    }
}

fn filter_of(levels: &Levels) -> String {
    std::iter::once(levels.default.clone())
        .chain(
            levels
                .loggers
                .iter()
                .map(|(target, level)| format!("{target}={level}")),
        )
        .collect::<Vec<_>>()
        .join(",")
}

static GLOBAL: OnceLock<LogControl> = OnceLock::new();

/// Hands the admin API the way to change the process's log filter; `filter` is the one
/// in force. The first registration wins.
pub fn register(filter: &str, reload: impl Fn(&str) -> Result<(), String> + Send + Sync + 'static) {
    let _ = GLOBAL.set(LogControl::new(filter, Some(Arc::new(reload))));
}

/// Installs the process's stderr logger with `filter` (a level or EnvFilter directives),
/// reloadable from `/logging`. Does nothing if a logger is already installed.
pub fn init(filter: &str) -> anyhow::Result<()> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;

    let env_filter = tracing_subscriber::EnvFilter::try_new(filter)
        .map_err(|err| anyhow::anyhow!("invalid log filter {filter:?}: {err}"))?;
    let (layer, handle) = tracing_subscriber::reload::Layer::new(env_filter);
    let installed = tracing_subscriber::registry()
        .with(layer)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal()),
        )
        .try_init()
        .is_ok();
    if installed {
        register(filter, reload_with(handle));
    }
    Ok(())
}

/// A reload closure over a `tracing_subscriber::reload` handle of an `EnvFilter`.
pub fn reload_with<S: 'static>(
    handle: tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, S>,
) -> impl Fn(&str) -> Result<(), String> + Send + Sync + 'static {
    move |filter| {
        let filter = tracing_subscriber::EnvFilter::try_new(filter).map_err(|e| e.to_string())?;
        handle.reload(filter).map_err(|e| e.to_string())
    }
}
