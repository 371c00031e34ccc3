//! The merged Prometheus endpoint (15020 `/stats/prometheus`): the agent's own metrics,
//! then the proxy's (its admin's `/stats/prometheus`), then the app's, scraped where
//! the pod's `prometheus.io/*` annotations say (`ISTIO_PROMETHEUS_ANNOTATIONS`). One
//! source failing leaves it out and counts a failure; the others are still served.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Deserialize;

/// Ports that are Istio's own, never an app's metrics (pilot-agent's list).
const RESERVED: &[(u16, &str)] = &[
    (15000, "Envoy admin"),
    (15001, "outbound traffic capture"),
    (15004, "pilot debug"),
    (15006, "inbound traffic capture"),
    (15008, "HBONE tunnel"),
    (15020, "pilot-agent status / merged Prometheus"),
    (15021, "Envoy health"),
    (15053, "DNS proxy"),
    (15090, "Envoy Prometheus (already merged)"),
];

/// `ISTIO_PROMETHEUS_ANNOTATIONS` as the injector writes it.
#[derive(Debug, Default, Deserialize)]
struct Annotations {
    #[serde(default)]
    scrape: String,
    #[serde(default)]
    path: String,
    #[serde(default)]
    port: String,
    #[serde(default)]
    targets: Vec<Target>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Target {
    #[serde(default)]
    pub port: String,
    #[serde(default)]
    pub path: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("ISTIO_PROMETHEUS_ANNOTATIONS is not valid JSON: {0}")]
    Json(serde_json::Error),
    #[error("ISTIO_PROMETHEUS_ANNOTATIONS: invalid target port {0:?}")]
    Port(String),
    #[error(
        "ISTIO_PROMETHEUS_ANNOTATIONS: target port {0} is the agent's own status port, which \
         would scrape itself"
    )]
    Loop(u16),
    #[error("ISTIO_PROMETHEUS_ANNOTATIONS: target port {0} is reserved for Istio ({1})")]
    Reserved(u16, &'static str),
}

/// The app's metrics endpoints, on localhost.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AppScrape {
    pub targets: Vec<(u16, String)>,
}

impl AppScrape {
    /// `None` when the app is not scraped (`scrape: "false"`).
    pub fn parse(json: &str, status_port: u16) -> Result<Option<Self>, ScrapeError> {
        let mut annotations: Annotations = serde_json::from_str(json).map_err(ScrapeError::Json)?;
        if annotations.scrape == "false" {
            return Ok(None);
        }
        if annotations.targets.is_empty() {
            annotations.targets.push(Target {
                port: match annotations.port.as_str() {
                    "" => "80".into(),
                    port => port.into(),
                },
                path: annotations.path,
            });
        }
        let mut targets = Vec::new();
        for target in annotations.targets {
            let port: u16 = target
                .port
                .trim()
                .parse()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| ScrapeError::Port(target.port.clone()))?;
            if port == status_port {
                return Err(ScrapeError::Loop(port));
            }
            if let Some((_, why)) = RESERVED.iter().find(|(p, _)| *p == port) {
                return Err(ScrapeError::Reserved(port, why));
            }
            let path = match target.path.trim() {
                "" => "/metrics".to_owned(),
                path => path.to_owned(),
            };
            targets.push((port, path));
        }
        Ok(Some(AppScrape { targets }))
    }
}

/// The agent's own metrics, as pilot-agent names them (`istio_agent_` prefix).
#[derive(Debug, Default)]
pub struct AgentMetrics {
    pub scrapes: AtomicU64,
    pub envoy_scrape_failures: AtomicU64,
    pub app_scrape_failures: AtomicU64,
    pub proxy_restarts: AtomicU64,
    pub start: std::sync::OnceLock<std::time::SystemTime>,
}

impl AgentMetrics {
    /// The agent's section of the merged output, in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counters = [
            (
                "scrapes_total",
                "The total number of scrapes.",
                &self.scrapes,
            ),
            (
                "envoy_scrape_failures_total",
                "The total number of failed scrapes for envoy.",
                &self.envoy_scrape_failures,
            ),
            (
                "app_scrape_failures_total",
                "The total number of failed scrapes for the app.",
                &self.app_scrape_failures,
            ),
            (
                "proxy_restarts_total",
                "Times the supervised proxy was restarted after it died.",
                &self.proxy_restarts,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP istio_agent_{name} {help}\n# TYPE istio_agent_{name} counter\n\
                 istio_agent_{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
        if let Some(rss) = resident_memory_bytes() {
            let _ = writeln!(
                out,
                "# HELP istio_agent_process_resident_memory_bytes Resident memory size in bytes.\n\
                 # TYPE istio_agent_process_resident_memory_bytes gauge\n\
                 istio_agent_process_resident_memory_bytes {rss}"
            );
        }
        if let Some(start) = self
            .start
            .get()
            .and_then(|s| s.duration_since(std::time::UNIX_EPOCH).ok())
        {
            let _ = writeln!(
                out,
                "# HELP istio_agent_process_start_time_seconds Start time of the process since unix epoch in seconds.\n\
                 # TYPE istio_agent_process_start_time_seconds gauge\n\
                 istio_agent_process_start_time_seconds {}",
                start.as_secs()
            );
        }
        out
    }
}

/// This process's RSS, from `/proc/self/status` (`VmRSS`, in kB).
fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_and_path_default_as_in_pilot_agent() {
        let scrape = AppScrape::parse(r#"{"scrape":"true"}"#, 15020)
            .unwrap()
            .unwrap();
        assert_eq!(scrape.targets, vec![(80, "/metrics".to_owned())]);
        let scrape = AppScrape::parse(r#"{"scrape":"true","port":"9100","path":"/m"}"#, 15020)
            .unwrap()
            .unwrap();
        assert_eq!(scrape.targets, vec![(9100, "/m".to_owned())]);
        assert_eq!(
            AppScrape::parse(r#"{"scrape":"false"}"#, 15020).unwrap(),
            None
        );
    }

    #[test]
    fn the_status_port_or_a_reserved_port_is_refused() {
        let err = AppScrape::parse(r#"{"port":"15020"}"#, 15020).unwrap_err();
        assert!(matches!(err, ScrapeError::Loop(15020)), "{err}");
        let err = AppScrape::parse(r#"{"targets":[{"port":"15090"}]}"#, 15020).unwrap_err();
        assert!(err.to_string().contains("15090") && err.to_string().contains("reserved"));
        let err = AppScrape::parse(r#"{"port":"http"}"#, 15020).unwrap_err();
        assert!(err.to_string().contains("\"http\""), "{err}");
    }

    #[test]
    fn agent_metrics_carry_istio_agent_names() {
        let metrics = AgentMetrics::default();
        metrics.scrapes.fetch_add(2, Ordering::Relaxed);
        let text = metrics.render();
        assert!(text.contains("\nistio_agent_scrapes_total 2\n"), "{text}");
        assert!(
            text.contains("istio_agent_process_resident_memory_bytes "),
            "{text}"
        );
    }
}
