//! What `shunt agent` starts besides the proxy when it writes the bootstrap itself, as
//! pilot-agent does: the bootstrap (from the environment, the mesh config and the
//! downward-API files), the xDS proxy on `etc/istio/proxy/XDS` that the bootstrap's
//! `xds-grpc` cluster reaches, and the workload certificate (mesh CA or mounted files)
//! served over SDS on the socket the bootstrap's `sds-grpc` cluster reaches.

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::agent::AgentArgs;
use crate::agent::bootstrap::{BootstrapInputs, NodeType, PodFiles, render};
use crate::agent::ca::{CaOptions, CertificateProvider, FileOptions};
use crate::agent::sds;
use crate::agent::xds_proxy::{Upstream, XdsProxy};
use crate::xds::source::{Target, Tls};

/// pilot-agent's default for `discoveryAddress`.
const DEFAULT_DISCOVERY_ADDRESS: &str = "istiod.istio-system.svc:15012";

/// The generated bootstrap, and where the control plane is.
pub struct Generated {
    pub path: PathBuf,
    pub discovery_address: String,
}

/// Writes pilot-agent's `envoy-rev.json` (and the files it names) into `--config-dir`.
pub fn write_bootstrap(args: &AgentArgs) -> anyhow::Result<Generated> {
    let read = |path: &Path| std::fs::read_to_string(path).ok();
    let files = PodFiles {
        mesh_config: read(&args.mesh_config),
        labels: read(&args.pod_info_dir.join("labels")),
        annotations: read(&args.pod_info_dir.join("annotations")),
    };
    let inputs = BootstrapInputs::from_pod(NodeType::Sidecar, std::env::vars().collect(), &files)
        .context("the bootstrap's inputs")?;
    let discovery_address = inputs
        .proxy_config
        .view()
        .map(|v| v.discovery_address)
        .ok()
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| DEFAULT_DISCOVERY_ADDRESS.to_owned());
    let rendered = render(&inputs).context("rendering the bootstrap")?;
    std::fs::create_dir_all(&args.config_dir)
        .with_context(|| format!("creating {}", args.config_dir.display()))?;
    let path = args.config_dir.join("envoy-rev.json");
    let text = serde_json::to_string_pretty(&rendered.bootstrap)?;
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    for (file, contents) in &rendered.files {
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(file, contents).with_context(|| format!("writing {}", file.display()))?;
    }
    tracing::info!(path = %path.display(), node = %inputs.node_id, "bootstrap written");
    Ok(Generated {
        path,
        discovery_address,
    })
}

/// The xDS proxy's upstream: `--xds-address` (`unix:PATH` or `host:port`), else the
/// ProxyConfig's `discoveryAddress`; TLS with the mesh root when it is there (istiod's
/// 15012), the service-account token as bearer when it is there.
fn upstream(args: &AgentArgs, discovery_address: &str) -> anyhow::Result<Upstream> {
    let address = args.xds_address.as_deref().unwrap_or(discovery_address);
    let (target, host) = match address.strip_prefix("unix:") {
        Some(path) => (Target::Unix(PathBuf::from(path)), None),
        None => {
            let addr = address
                .to_socket_addrs()
                .with_context(|| format!("resolving the discovery address {address}"))?
                .next()
                .with_context(|| format!("{address} has no address"))?;
            let host = address.rsplit_once(':').map(|(h, _)| h.to_owned());
            (Target::Tcp(addr), host)
        }
    };
    let tls = match std::fs::read(&args.xds_root_cert) {
        Ok(trusted_ca) => Some(Tls {
            server_name: host,
            trusted_ca,
            client_certificate: None,
        }),
        Err(_) => {
            tracing::warn!(
                root = %args.xds_root_cert.display(),
                %address,
                "no mesh root: the xDS connection is plaintext"
            );
            None
        }
    };
    let token_path = args.token_path.exists().then(|| args.token_path.clone());
    let mut metadata = Vec::new();
    if let Ok(cluster) = std::env::var("ISTIO_META_CLUSTER_ID") {
        metadata.push(("clusterid".to_owned(), cluster));
    }
    Ok(Upstream {
        target,
        tls,
        metadata,
        token_path,
    })
}

/// Starts the xDS proxy on `<config-dir>/XDS` (on the current runtime).
pub fn start_xds_proxy(args: &AgentArgs, generated: &Generated) -> anyhow::Result<()> {
    let upstream = upstream(args, &generated.discovery_address)?;
    let socket = args.config_dir.join("XDS");
    let proxy = XdsProxy::new(upstream, None);
    tokio::spawn(async move {
        if let Err(err) = proxy.serve_unix(&socket, std::future::pending()).await {
            tracing::error!("xDS proxy: {err:#}");
        }
    });
    Ok(())
}

/// The workload certificate, from the mesh CA (`CA_ADDR`) or mounted files
/// (`<cert-dir>/cert-chain.pem`), served over SDS; nothing when neither is there.
pub fn start_certificates(args: &AgentArgs) -> anyhow::Result<Option<CertificateProvider>> {
    let provider = if std::env::var_os("CA_ADDR").is_some() {
        let (provider, _task) = CertificateProvider::start_ca(CaOptions::from_env()?);
        provider
    } else if args.cert_dir.join("cert-chain.pem").exists() {
        let (provider, _task) = CertificateProvider::start_files(FileOptions {
            dir: args.cert_dir.clone(),
            ..FileOptions::default()
        })?;
        provider
    } else {
        tracing::info!("no CA_ADDR and no mounted certificates: no SDS server");
        return Ok(None);
    };
    let listener = sds::bind(&args.sds_socket)?;
    tokio::spawn(sds::serve(
        listener,
        provider.clone(),
        std::future::pending(),
    ));
    Ok(Some(provider))
}
