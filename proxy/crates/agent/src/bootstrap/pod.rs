//! Filling [`BootstrapInputs`] in a pod as pilot-agent does: the environment the
//! injector sets, the mesh config file, and the downward API's labels and annotations
//! files (`key="Go-quoted value"` lines).

use std::collections::BTreeMap;

use super::node::env_value;
use super::proxy_config::AuthenticationPolicy;
use super::{BootstrapError, BootstrapInputs, NodeType, ProxyConfig, node_id};

/// The annotation that carries a pod's own ProxyConfig.
const PROXY_CONFIG_ANNOTATION: &str = "proxy.istio.io/config";

/// The files pilot-agent reads, as text (None: absent).
#[derive(Clone, Debug, Default)]
pub struct PodFiles {
    /// The mesh config (`/etc/istio/config/mesh`): its `defaultConfig` is the base
    /// ProxyConfig.
    pub mesh_config: Option<String>,
    /// `/etc/istio/pod/labels`.
    pub labels: Option<String>,
    /// `/etc/istio/pod/annotations`.
    pub annotations: Option<String>,
}

impl BootstrapInputs {
    /// The inputs pilot-agent has in a pod with this environment and these files.
    pub fn from_pod(
        kind: NodeType,
        env: Vec<(String, String)>,
        files: &PodFiles,
    ) -> Result<Self, BootstrapError> {
        let get = |name: &str| env_value(&env, name).unwrap_or_default();
        let annotations = files
            .annotations
            .as_deref()
            .map(|t| parse_downward_api(t, "annotations"))
            .transpose()?;
        let pod_labels = files
            .labels
            .as_deref()
            .map(|t| parse_downward_api(t, "labels"))
            .transpose()?;

        // Mesh config's defaultConfig, then PROXY_CONFIG, then the pod's annotation.
        let mut proxy_config = ProxyConfig::istio_defaults();
        if let Some(mesh) = &files.mesh_config {
            let mesh: serde_json::Value =
                serde_yaml_ng::from_str(mesh).map_err(|e| BootstrapError::ProxyConfig {
                    source_name: "the mesh config".into(),
                    reason: e.to_string(),
                })?;
            if let Some(default) = mesh.get("defaultConfig") {
                proxy_config.apply(&default.to_string(), "the mesh config's defaultConfig")?;
            }
        }
        proxy_config.apply(&get("PROXY_CONFIG"), "PROXY_CONFIG")?;
        if let Some(a) = annotations
            .as_ref()
            .and_then(|a| a.get(PROXY_CONFIG_ANNOTATION))
        {
            proxy_config.apply(a, PROXY_CONFIG_ANNOTATION)?;
        }
        let view = proxy_config.view()?;

        // istiod's certificate names the discovery host (localhost: a debugging setup
        // with istiod's usual name).
        let mut pilot_san = Vec::new();
        if view.control_plane_auth_policy.map(|p| p.0) == Some(AuthenticationPolicy::MutualTls) {
            let host = view.discovery_address.split(':').next().unwrap_or_default();
            pilot_san.push(if host == "localhost" {
                "istiod.istio-system.svc".to_owned()
            } else {
                host.to_owned()
            });
        }

        let ip = get("INSTANCE_IP");
        let namespace = get("POD_NAMESPACE");
        let domain = env_value(&env, "DOMAIN_SUFFIX").unwrap_or_else(|| "cluster.local".into());
        let port = |name: &str, default: u16| -> Result<u16, BootstrapError> {
            match env_value(&env, name).filter(|v| !v.is_empty()) {
                None => Ok(default),
                Some(v) => v.parse().map_err(|_| BootstrapError::Metadata {
                    key: name.into(),
                    reason: format!("{v:?} is not a port"),
                }),
            }
        };
        let flag = |name: &str| -> Result<Option<bool>, BootstrapError> {
            env_value(&env, name)
                .filter(|v| !v.is_empty())
                .map(|v| {
                    v.parse().map_err(|_| BootstrapError::Metadata {
                        key: name.into(),
                        reason: format!("{v:?} is not true or false"),
                    })
                })
                .transpose()
        };
        Ok(Self {
            node_id: node_id(
                kind,
                &ip,
                &get("POD_NAME"),
                &namespace,
                &format!("svc.{domain}"),
            ),
            instance_ips: ip
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect(),
            pilot_san,
            annotations,
            pod_labels,
            envoy_status_port: port("ENVOY_STATUS_PORT", 15021)?,
            envoy_prometheus_port: port("ENVOY_PROMETHEUS_PORT", 15090)?,
            secure_metrics_port: port("ENVOY_SECURE_METRICS_PORT", 0)?,
            secure_merged_metrics_port: port("ENVOY_SECURE_MERGED_METRICS_PORT", 0)?,
            exit_on_zero_active_connections: flag("EXIT_ON_ZERO_ACTIVE_CONNECTIONS")?
                .unwrap_or(false),
            metadata_discovery: flag("PEER_METADATA_DISCOVERY")?,
            envoy_skip_deprecated_logs: flag("ENVOY_SKIP_DEPRECATED_LOGS")?.unwrap_or(false),
            workload_identity_socket_file: env_value(&env, "WORKLOAD_IDENTITY_SOCKET_FILE")
                .filter(|v| !v.is_empty())
                .unwrap_or_else(|| "socket".into()),
            proxy_config,
            env,
            ..Self::default()
        })
    }
}

/// The downward API's `key="value"` lines (values quoted as Go's `%q`); lines without
/// `=` are skipped, as pilot-agent skips them.
pub fn parse_downward_api(
    text: &str,
    file: &str,
) -> Result<BTreeMap<String, String>, BootstrapError> {
    let mut out = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let Some((key, quoted)) = line.split_once('=') else {
            continue;
        };
        let value = unquote(quoted).ok_or_else(|| BootstrapError::Metadata {
            key: format!("{file} line {} ({key})", n + 1),
            reason: format!("{quoted} is not a quoted string"),
        })?;
        out.insert(key.to_owned(), value);
    }
    Ok(out)
}

/// Go's strconv.Unquote for double-quoted strings.
fn unquote(s: &str) -> Option<String> {
    let inner = s.strip_prefix('"')?.strip_suffix('"')?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c == '"' {
            return None;
        }
        if c != '\\' {
            out.push(c);
            continue;
        }
        let hex = |chars: &mut std::str::Chars, n: usize| -> Option<u32> {
            let s: String = chars.take(n).collect();
            (s.len() == n).then(|| u32::from_str_radix(&s, 16).ok())?
        };
        match chars.next()? {
            'n' => out.push('\n'),
            't' => out.push('\t'),
            'r' => out.push('\r'),
            'a' => out.push('\x07'),
            'b' => out.push('\x08'),
            'f' => out.push('\x0c'),
            'v' => out.push('\x0b'),
            '\\' => out.push('\\'),
            '"' => out.push('"'),
            '\'' => out.push('\''),
            'x' => out.push(char::from_u32(hex(&mut chars, 2)?)?),
            'u' => out.push(char::from_u32(hex(&mut chars, 4)?)?),
            'U' => out.push(char::from_u32(hex(&mut chars, 8)?)?),
            d @ '0'..='7' => {
                let rest: String = chars.by_ref().take(2).collect();
                let v = u32::from_str_radix(&format!("{d}{rest}"), 8).ok()?;
                out.push(char::from_u32(v)?);
            }
            _ => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::render;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    #[test]
    fn downward_api_files_read_as_kubernetes_writes_them() {
        let m = parse_downward_api(
            "app=\"reviews\"\nconfig=\"foo: bar\\nother: setting\"\nweird=\"a=b\"\n\n",
            "labels",
        )
        .unwrap();
        assert_eq!(m["app"], "reviews");
        assert_eq!(m["config"], "foo: bar\nother: setting");
        assert_eq!(m["weird"], "a=b");
        let err = parse_downward_api("app=reviews", "labels")
            .unwrap_err()
            .to_string();
        assert!(err.contains("labels line 1 (app)"), "{err}");
    }

    #[test]
    fn a_pod_gets_the_sidecar_bootstrap_of_its_environment_and_files() {
        let files = PodFiles {
            mesh_config: Some(
                "defaultConfig:\n  discoveryAddress: istiod.istio-system.svc:15012\n  tracing:\n    zipkin:\n      address: zipkin.istio-system:9411\n".into(),
            ),
            labels: Some("app=\"reviews\"\nversion=\"v1\"\npod-template-hash=\"5d4f\"\ntopology.istio.io/locality=\"eu.west.a\"\n".into()),
            annotations: Some("proxy.istio.io/config=\"proxyAdminPort: 15099\"\n".into()),
        };
        let inputs = BootstrapInputs::from_pod(
            NodeType::Sidecar,
            env(&[
                ("POD_NAME", "reviews-v1-5d4f"),
                ("POD_NAMESPACE", "bookinfo"),
                ("INSTANCE_IP", "10.1.2.3"),
                ("SERVICE_ACCOUNT", "bookinfo-reviews"),
                ("ISTIO_META_CLUSTER_ID", "Kubernetes"),
                ("ISTIO_META_DNS_CAPTURE", "true"),
                ("PROXY_CONFIG", "{\"statusPort\": 15020, \"proxyMetadata\": {\"ISTIO_META_MESH_ID\": \"mesh1\"}}"),
            ]),
            &files,
        )
        .unwrap();
        assert_eq!(
            inputs.node_id,
            "sidecar~10.1.2.3~reviews-v1-5d4f.bookinfo~bookinfo.svc.cluster.local"
        );
        assert_eq!(inputs.pilot_san, ["istiod.istio-system.svc"]);
        let b = render(&inputs).unwrap().bootstrap;
        let meta = &b["node"]["metadata"];
        assert_eq!(meta["CLUSTER_ID"], "Kubernetes");
        assert_eq!(meta["MESH_ID"], "mesh1");
        assert_eq!(meta["DNS_CAPTURE"], "true");
        assert_eq!(meta["NAMESPACE"], "bookinfo");
        assert_eq!(meta["NAME"], "reviews-v1-5d4f");
        assert_eq!(meta["SERVICE_ACCOUNT"], "bookinfo-reviews");
        assert_eq!(meta["LABELS"]["istio-locality"], "eu/west/a");
        assert!(meta["LABELS"].get("pod-template-hash").is_none());
        assert_eq!(b["node"]["cluster"], "reviews.bookinfo");
        assert_eq!(
            b["node"]["locality"],
            serde_json::json!({"region": "eu", "zone": "west", "sub_zone": "a"})
        );
        // The annotation wins over the mesh config's default admin port.
        assert_eq!(b["admin"]["address"]["socket_address"]["port_value"], 15099);
        let clusters = b["static_resources"]["clusters"].as_array().unwrap();
        let zipkin = clusters.iter().find(|c| c["name"] == "zipkin").unwrap();
        assert_eq!(
            zipkin["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"],
            serde_json::json!({"address": "zipkin.istio-system", "port_value": 9411})
        );
        let sds = clusters.iter().find(|c| c["name"] == "sds-grpc").unwrap();
        assert_eq!(
            sds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
                ["path"],
            "./var/run/secrets/workload-spiffe-uds/socket"
        );
    }

    /// Istio's `TestGetMeshConfig` ("Environment Override"): an explicit zero value in
    /// `PROXY_CONFIG` is a value. `controlPlaneAuthPolicy: NONE` replaces the mesh
    /// default MUTUAL_TLS, so istiod's name is not expected in its certificate and the
    /// node metadata's ProxyConfig leaves the (zero) policy out, as protojson does.
    #[test]
    fn an_explicit_zero_value_in_proxy_config_overrides_the_mesh_config() {
        let files = PodFiles {
            mesh_config: Some(
                "defaultConfig:\n  holdApplicationUntilProxyStarts: true\n  statNameLength: 200\n  tracingServiceName: CANONICAL_NAME_ONLY\n".into(),
            ),
            ..PodFiles::default()
        };
        let proxy_config = "controlPlaneAuthPolicy: NONE\nholdApplicationUntilProxyStarts: false\nstatNameLength: 0\ntracingServiceName: APP_LABEL_AND_NAMESPACE\ndiscoveryAddress: istiod.istio-system.svc:15010\n";
        let inputs = BootstrapInputs::from_pod(
            NodeType::Sidecar,
            env(&[("PROXY_CONFIG", proxy_config), ("POD_NAMESPACE", "ns")]),
            &files,
        )
        .unwrap();
        assert!(inputs.pilot_san.is_empty(), "{:?}", inputs.pilot_san);
        let b = render(&inputs).unwrap().bootstrap;
        let pc = &b["node"]["metadata"]["PROXY_CONFIG"];
        assert!(pc.get("controlPlaneAuthPolicy").is_none(), "{pc}");
        assert!(pc.get("statNameLength").is_none(), "{pc}");
        // A wrapper keeps its false; a oneof member its zero value, replacing the other.
        assert_eq!(pc["holdApplicationUntilProxyStarts"], false, "{pc}");
        assert_eq!(pc["tracingServiceName"], "APP_LABEL_AND_NAMESPACE", "{pc}");
        assert!(pc.get("serviceCluster").is_none(), "{pc}");
        assert_eq!(pc["discoveryAddress"], "istiod.istio-system.svc:15010");
        assert!(b["node"]["metadata"].get("PILOT_SAN").is_none(), "{b}");
    }

    #[test]
    fn a_bad_port_in_the_environment_is_named() {
        let err = BootstrapInputs::from_pod(
            NodeType::Sidecar,
            env(&[("ENVOY_STATUS_PORT", "fifteen")]),
            &PodFiles::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("ENVOY_STATUS_PORT") && err.contains("fifteen"),
            "{err}"
        );
    }
}
