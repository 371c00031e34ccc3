//! What `shunt agent` starts besides the proxy when it writes the bootstrap itself, as
//! pilot-agent does: the bootstrap (from the environment, the mesh config and the
//! downward-API files), the xDS proxy on `etc/istio/proxy/XDS` that the bootstrap's
//! `xds-grpc` cluster reaches, and the workload certificate (mesh CA or mounted files)
//! served over SDS on the socket the bootstrap's `sds-grpc` cluster reaches. For the
//! in-process proxy neither socket is bound (unless asked): its streams to those paths
//! call the SDS server and the xDS proxy directly ([`shunt_xds::local`]).

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;

use super::agent::AgentArgs;
use shunt_agent::bootstrap::{BootstrapInputs, NodeType, PodFiles, render};
use shunt_agent::ca::{CaOptions, CertificateProvider, FileOptions};
use shunt_agent::sds;
use shunt_agent::xds_proxy::{NameTableSink, Upstream, XdsProxy};
use shunt_xds::source::{Target, Tls};

/// pilot-agent's default for `discoveryAddress`.
const DEFAULT_DISCOVERY_ADDRESS: &str = "istiod.istio-system.svc:15012";

/// The generated bootstrap, and where the control plane is.
pub struct Generated {
    pub path: PathBuf,
    pub discovery_address: String,
    /// The ProxyConfig's `configPath`: the bootstrap and the XDS socket are there.
    pub config_dir: PathBuf,
}

impl Generated {
    /// The xDS proxy's socket, which the bootstrap's `xds-grpc` pipe names.
    pub fn xds_socket(&self) -> PathBuf {
        self.config_dir.join("XDS")
    }
}

/// Writes pilot-agent's `envoy-rev.json` (and the files it names) into the
/// ProxyConfig's `configPath` (`--config-dir` sets it).
pub fn write_bootstrap(args: &AgentArgs) -> anyhow::Result<Generated> {
    let read = |path: &Path| std::fs::read_to_string(path).ok();
    let files = PodFiles {
        mesh_config: read(&args.mesh_config),
        labels: read(&args.pod_info_dir.join("labels")),
        annotations: read(&args.pod_info_dir.join("annotations")),
    };
    let mut inputs =
        BootstrapInputs::from_pod(NodeType::Sidecar, std::env::vars().collect(), &files)
            .context("the bootstrap's inputs")?;
    if let Some(dir) = &args.config_dir {
        let dir = dir.to_str().context("--config-dir is not UTF-8")?;
        inputs
            .proxy_config
            .set("configPath", serde_json::Value::from(dir));
    }
    let view = inputs.proxy_config.view()?;
    let discovery_address = Some(view.discovery_address)
        .filter(|a| !a.is_empty())
        .unwrap_or_else(|| DEFAULT_DISCOVERY_ADDRESS.to_owned());
    anyhow::ensure!(
        !view.config_path.is_empty(),
        "the ProxyConfig's configPath is empty: the bootstrap needs a folder"
    );
    let config_dir = PathBuf::from(&view.config_path);
    let rendered = render(&inputs).context("rendering the bootstrap")?;
    std::fs::create_dir_all(&config_dir)
        .with_context(|| format!("creating {}", config_dir.display()))?;
    let path = config_dir.join("envoy-rev.json");
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
        config_dir,
    })
}

/// The xDS proxy's upstream, as pilot-agent dials istiod: `--xds-address` (`unix:PATH`
/// or `host:port`), else the ProxyConfig's `discoveryAddress`; TLS with the mesh root
/// when it is there (istiod's 15012) and the workload certificate as client
/// certificate once there is one; the service-account token as bearer when it is
/// there (pilot-agent sends it with or without mTLS); the `ClusterID` header and each
/// `XDS_HEADER_<NAME>=value` of the environment as header `<name>`.
fn upstream(
    args: &AgentArgs,
    discovery_address: &str,
    certificates: Option<CertificateProvider>,
) -> anyhow::Result<Upstream> {
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
    for (name, value) in std::env::vars() {
        if let Some(header) = name.strip_prefix("XDS_HEADER_").filter(|h| !h.is_empty()) {
            // gRPC metadata keys are lower case (Go's grpc lowers them too).
            metadata.push((header.to_ascii_lowercase(), value));
        }
    }
    Ok(Upstream {
        target,
        tls,
        metadata,
        token_path,
        certificates,
    })
}

/// The xDS proxy to the control plane; served on `<configPath>/XDS` (on the current
/// runtime) when `socket`, else only to the in-process proxy by call.
pub fn start_xds_proxy(
    args: &AgentArgs,
    generated: &Generated,
    certificates: Option<CertificateProvider>,
    name_table: Option<NameTableSink>,
    socket: bool,
) -> anyhow::Result<Arc<XdsProxy>> {
    let upstream = upstream(args, &generated.discovery_address, certificates)?;
    let proxy = XdsProxy::new(upstream, name_table);
    if socket {
        let path = generated.xds_socket();
        let serving = proxy.clone();
        tokio::spawn(async move {
            if let Err(err) = serving.serve_unix(&path, std::future::pending()).await {
                tracing::error!("xDS proxy: {err:#}");
            }
        });
    }
    Ok(proxy)
}

/// The workload certificate, from the mesh CA (`CA_ADDR`) or mounted files
/// (`<cert-dir>/cert-chain.pem`), served over SDS on `--sds-socket` when `socket`;
/// nothing when neither is there.
pub fn start_certificates(
    args: &AgentArgs,
    socket: bool,
) -> anyhow::Result<Option<CertificateProvider>> {
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
    if socket {
        let listener = sds::bind(&args.sds_socket)?;
        tokio::spawn(sds::serve(
            listener,
            provider.clone(),
            std::future::pending(),
        ));
    }
    Ok(Some(provider))
}

/// Where the xDS proxy puts the name tables it takes off istiod's stream: the agent's
/// DNS proxy (beside a supervised Envoy, which never sees NDS).
pub fn name_table_sink(tables: Arc<shunt_dns::Tables>) -> NameTableSink {
    Arc::new(move |any, version| {
        use prost::Message;
        let table = shunt_dns::name_table::NameTable::decode(any.value.as_slice())
            .map_err(|e| format!("NameTable: {e}"))?;
        tables.apply(table, version).map_err(|e| e.to_string())
    })
}
