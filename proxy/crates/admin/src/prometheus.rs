//! Stats in the Prometheus text exposition format, as Envoy's `/stats/prometheus` writes
//! them: one group per tag-extracted name, `envoy_` before it, the tags as labels:
//!
//! ```text
//! # TYPE envoy_cluster_upstream_cx_total counter
//! envoy_cluster_upstream_cx_total{envoy_cluster_name="agent"} 0
//!
//! ```
//!
//! Counters first, then gauges, then histograms (`_bucket`, `_sum`, `_count`).

use std::collections::BTreeMap;
use std::fmt::Write;

use regex::Regex;

use super::tags::StatsConfig;
use shunt_core::stats::{CUSTOM_NAMESPACES, Stat, StatValue};

/// What to include: Envoy's `?usedonly` and `?filter=` (a regex searched in the full name).
#[derive(Debug, Default)]
pub struct Selection {
    pub used_only: bool,
    pub filter: Option<Regex>,
}

impl Selection {
    pub fn includes(&self, stat: &Stat) -> bool {
        (!self.used_only || stat.used)
            && self
                .filter
                .as_ref()
                .is_none_or(|filter| filter.is_match(&stat.name))
    }
}

/// Renders `stats` (already limited to those that exist under `stats_config`).
pub fn render(stats: &[Stat], config: &StatsConfig, selection: &Selection) -> String {
    let mut out = String::new();
    for kind in ["counter", "gauge", "histogram"] {
        // Metric name → (label text, stat), sorted by metric then by full stat name.
        let mut groups: BTreeMap<String, Vec<(String, &Stat)>> = BTreeMap::new();
        for stat in stats.iter().filter(|s| selection.includes(s)) {
            let this_kind = match stat.value {
                StatValue::Counter(_) => "counter",
                StatValue::Gauge(_) => "gauge",
                StatValue::Histogram(_) => "histogram",
            };
            if this_kind != kind {
                continue;
            }
            // A tagged stat brings its tags; the others have them extracted from the name.
            let (extracted_name, tags) = match &stat.tags {
                Some(tag_set) => (tag_set.extracted_name.clone(), tag_set.tags.clone()),
                None => {
                    let tagged = config.extract(&stat.name);
                    (tagged.extracted_name, tagged.tags)
                }
            };
            let labels = tags
                .iter()
                .map(|(name, value)| format!("{}=\"{}\"", sanitize(name), escape(value)))
                .collect::<Vec<_>>()
                .join(",");
            groups
                .entry(metric_name(&extracted_name))
                .or_default()
                .push((labels, stat));
        }
        for (name, mut members) in groups {
            members.sort_by(|a, b| a.1.name.cmp(&b.1.name));
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, stat) in members {
                match &stat.value {
                    StatValue::Counter(value) | StatValue::Gauge(value) => {
                        let _ = writeln!(out, "{name}{{{labels}}} {value}");
                    }
                    StatValue::Histogram(summary) => {
                        let prefix = if labels.is_empty() {
                            String::new()
                        } else {
                            format!("{labels},")
                        };
                        for (bound, count) in &summary.buckets {
                            let _ =
                                writeln!(out, "{name}_bucket{{{prefix}le=\"{bound}\"}} {count}");
                        }
                        let _ = writeln!(
                            out,
                            "{name}_bucket{{{prefix}le=\"+Inf\"}} {}",
                            summary.count
                        );
                        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", summary.sum);
                        let _ = writeln!(out, "{name}_count{{{labels}}} {}", summary.count);
                    }
                }
            }
            out.push('\n');
        }
    }
    out
}

/// `envoy_` + the name with every character outside `[a-zA-Z0-9_]` as `_`; a name in a
/// custom namespace (`istiocustom.istio_requests_total`) loses the namespace instead and
/// gets no prefix (`istio_requests_total`), as Envoy writes Istio's metrics.
pub fn metric_name(extracted_name: &str) -> String {
    for namespace in CUSTOM_NAMESPACES {
        if let Some(rest) = extracted_name
            .strip_prefix(namespace)
            .and_then(|rest| rest.strip_prefix('.'))
        {
            return sanitize(rest);
        }
    }
    format!("envoy_{}", sanitize(extracted_name))
}

fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Label values escaped as the exposition format requires (Envoy writes them raw; the
/// names it produces never need escaping, but a cluster name could).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use shunt_core::stats::Store;

    #[test]
    fn groups_by_metric_with_tags_as_labels() {
        let store = Store::new();
        store.counter("cluster.b.upstream_cx_total").add(2);
        store.counter("cluster.a.upstream_cx_total").inc();
        store.gauge("server.live").set(1);
        store
            .histogram("cluster.a.upstream_cx_length_ms")
            .record(3.0);
        let text = render(
            &store.snapshot(),
            &StatsConfig::default(),
            &Selection::default(),
        );
        let expected_start = "\
# TYPE envoy_cluster_upstream_cx_total counter
envoy_cluster_upstream_cx_total{envoy_cluster_name=\"a\"} 1
envoy_cluster_upstream_cx_total{envoy_cluster_name=\"b\"} 2

# TYPE envoy_server_live gauge
envoy_server_live{} 1

# TYPE envoy_cluster_upstream_cx_length_ms histogram
envoy_cluster_upstream_cx_length_ms_bucket{envoy_cluster_name=\"a\",le=\"0.5\"} 0
";
        assert!(text.starts_with(expected_start), "{text}");
        assert!(text.contains(
            "envoy_cluster_upstream_cx_length_ms_bucket{envoy_cluster_name=\"a\",le=\"+Inf\"} 1\n\
             envoy_cluster_upstream_cx_length_ms_sum{envoy_cluster_name=\"a\"} 3\n\
             envoy_cluster_upstream_cx_length_ms_count{envoy_cluster_name=\"a\"} 1\n"
        ));
    }
}

#[cfg(test)]
mod tagged_tests {
    use super::*;
    use shunt_core::stats::Store;

    #[test]
    fn tagged_stats_in_a_custom_namespace_are_written_as_istio_writes_them() {
        let store = Store::new();
        let tags = [("reporter", "destination"), ("response_code", "404")];
        store
            .tagged_counter("istiocustom.istio_requests_total", &tags)
            .add(2);
        store
            .tagged_histogram("istiocustom.istio_request_bytes", &tags)
            .record(700.0);
        store
            .tagged_gauge(
                "istiocustom.istio_build",
                &[("component", "proxy"), ("tag", "1.28.0")],
            )
            .set(1);
        // Tag extraction does not touch a tagged stat, even where a default regex would
        // match its name.
        let text = render(
            &store.snapshot(),
            &StatsConfig::default(),
            &Selection::default(),
        );
        assert!(
            text.contains(
                "# TYPE istio_requests_total counter\n\
                 istio_requests_total{reporter=\"destination\",response_code=\"404\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "# TYPE istio_build gauge\nistio_build{component=\"proxy\",tag=\"1.28.0\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "istio_request_bytes_bucket{reporter=\"destination\",response_code=\"404\",le=\"500\"} 0\n\
                 istio_request_bytes_bucket{reporter=\"destination\",response_code=\"404\",le=\"1000\"} 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "istio_request_bytes_count{reporter=\"destination\",response_code=\"404\"} 1\n"
            ),
            "{text}"
        );
    }
}
