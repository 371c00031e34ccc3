//! The mTLS shapes of `bench node`: the same client-pod-to-server-pod call with
//! workload certificates from a test CA, through two sidecars (shunt or Envoy, each
//! with its own static bootstrap and certificate, eBPF capture, a TLS handshake between
//! them) or through node mode (one process, each pod its own proxy from a test control
//! plane and its own SDS certificate), with the same-node fast path on or off.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use harness::ads::resources::{
    ads_source, eds_cluster, grpc_source, load_assignment, named, tcp_proxy_listener,
    tls_tcp_proxy_listener, with_upstream_mtls,
};
use harness::ads::{AdsServer, Listen, type_urls};
use harness::ca::TestCa;
use harness::{Node, Pod, PodProcess};

pub const TOKEN: &str = "bench-node-token";
pub const IDENTITY: &str = "spiffe://cluster.local/ns/default/sa/default";
const APP: u16 = 8080;

/// A scratch folder readable by uid 1337 (the sidecars' user), removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Result<Scratch> {
        let path =
            std::env::temp_dir().join(format!("shunt-bench-node-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        Ok(Scratch(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A sidecar's static bootstrap (shunt and Envoy run the same file): 15001 to the
/// server pod's app over mTLS requiring its identity, 15006 terminating mTLS to the
/// local app.
pub fn sidecar_bootstrap(server: IpAddr, chain: &Path, key: &Path, root: &Path) -> String {
    let (chain, key, root) = (chain.display(), key.display(), root.display());
    format!(
        r#"# Written by `cargo xtask bench node`; shunt and Envoy both run this file.
static_resources:
  listeners:
  - name: virtualOutbound
    address: {{ socket_address: {{ address: 0.0.0.0, port_value: 15001 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: outbound
          cluster: to-server
  - name: virtualInbound
    address: {{ socket_address: {{ address: 0.0.0.0, port_value: 15006 }} }}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          require_client_certificate: true
          common_tls_context:
            tls_certificates: [{{ certificate_chain: {{ filename: {chain} }}, private_key: {{ filename: {key} }} }}]
            validation_context: {{ trusted_ca: {{ filename: {root} }} }}
      filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: inbound
          cluster: app
  clusters:
  - name: to-server
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: to-server
      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: {server}, port_value: {APP} }} }} }} }}] }}]
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
        common_tls_context:
          tls_certificates: [{{ certificate_chain: {{ filename: {chain} }}, private_key: {{ filename: {key} }} }}]
          validation_context:
            trusted_ca: {{ filename: {root} }}
            match_typed_subject_alt_names: [{{ san_type: URI, matcher: {{ exact: "{IDENTITY}" }} }}]
  - name: app
    type: STATIC
    connect_timeout: 2s
    load_assignment:
      cluster_name: app
      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {APP} }} }} }} }}] }}]
"#
    )
}

/// The workload certificate files for the sidecars: chain, key, root.
pub fn sidecar_certificates(ca: &TestCa, dir: &Path) -> Result<(PathBuf, PathBuf, PathBuf)> {
    let (chain, key) = ca.issue(IDENTITY, Duration::from_secs(3600))?;
    let paths = (
        dir.join("chain.pem"),
        dir.join("key.pem"),
        dir.join("root.pem"),
    );
    std::fs::write(&paths.0, chain)?;
    std::fs::write(&paths.1, key)?;
    std::fs::write(&paths.2, &ca.root_pem)?;
    Ok(paths)
}

/// A sidecar running `bootstrap` in `pod` as uid 1337 (capture lets its own traffic
/// pass), once its two listeners are up.
pub fn start_sidecar(program: &Path, args: &[String], pod: &Pod) -> Result<PodProcess> {
    let proxy = pod
        .command(program)
        .args(args)
        .uid(1337)
        .gid(1337)
        .spawn()?;
    for port in [15001, 15006] {
        harness::wait_for_port(
            pod,
            SocketAddr::from(([127, 0, 0, 1], port)),
            Duration::from_secs(20),
        )
        .with_context(|| {
            format!(
                "{} in {}:\n{}",
                program.display(),
                pod.name(),
                proxy.stderr_text()
            )
        })?;
    }
    Ok(proxy)
}

/// The control plane of node mode's pods: every pod gets the same config (its proxy
/// is a sidecar's: 15001 to the server pod's app over mTLS, 15006 terminating mTLS to
/// the local app), its certificate over SDS from the node process.
pub struct ControlPlane {
    /// Serves while held.
    _ads: AdsServer,
    pub template: PathBuf,
    pub ca: TestCa,
    pub token: PathBuf,
}

impl ControlPlane {
    pub fn start(node: &Node, dir: &Path, server: IpAddr) -> Result<ControlPlane> {
        let (ca, token, ads, socket) = serve(node, dir)?;
        let sds = grpc_source("sds-grpc");
        let to_server = with_upstream_mtls(
            eds_cluster("to-server", ads_source(), 2),
            sds.clone(),
            "default",
            "ROOTCA",
            IDENTITY,
        );
        ads.set(
            type_urls::CLUSTER,
            "1",
            vec![
                named("to-server", &to_server),
                named("app", &eds_cluster("app", ads_source(), 2)),
            ],
        );
        ads.set(
            type_urls::ENDPOINT,
            "1",
            vec![
                named(
                    "to-server",
                    &load_assignment("to-server", &[SocketAddr::new(server, APP)]),
                ),
                named(
                    "app",
                    &load_assignment("app", &[SocketAddr::from(([127, 0, 0, 1], APP))]),
                ),
            ],
        );
        let outbound = tcp_proxy_listener(
            "virtualOutbound",
            SocketAddr::from(([0, 0, 0, 0], 15001)),
            "to-server",
        );
        let inbound = tls_tcp_proxy_listener(
            "virtualInbound",
            SocketAddr::from(([0, 0, 0, 0], 15006)),
            "app",
            sds,
            "default",
            Some("ROOTCA"),
        );
        ads.set(
            type_urls::LISTENER,
            "1",
            vec![
                named("virtualOutbound", &outbound),
                named("virtualInbound", &inbound),
            ],
        );
        let template = write_template(dir, &socket)?;
        Ok(ControlPlane {
            _ads: ads,
            template,
            ca,
            token,
        })
    }

    /// As [`ControlPlane::start`], serving Istio's push of [`super::node_push`] to
    /// every pod (version `1` of each type).
    pub fn start_push(
        node: &Node,
        dir: &Path,
        push: &super::node_push::Push,
    ) -> Result<ControlPlane> {
        let (ca, token, ads, socket) = serve(node, dir)?;
        push.serve(&ads, "1");
        let template = write_template(dir, &socket)?;
        Ok(ControlPlane {
            _ads: ads,
            template,
            ca,
            token,
        })
    }

    /// As [`ControlPlane::start`], with the listeners and clusters of `resources`
    /// (`{"listeners": [...], "clusters": [...]}` in Envoy's JSON, TLS from SDS as an
    /// Istio control plane sends them), read with shunt's own config loader and served
    /// over ADS.
    pub fn start_with(
        node: &Node,
        dir: &Path,
        resources: serde_json::Value,
    ) -> Result<ControlPlane> {
        let cp = ControlPlane::start_unset(node, dir)?;
        cp.push(dir, "1", resources)?;
        Ok(cp)
    }

    /// A control plane with nothing to serve yet: proxies wait for a first
    /// [`ControlPlane::push`].
    pub fn start_unset(node: &Node, dir: &Path) -> Result<ControlPlane> {
        let (ca, token, ads, socket) = serve(node, dir)?;
        let template = write_template(dir, &socket)?;
        Ok(ControlPlane {
            _ads: ads,
            template,
            ca,
            token,
        })
    }

    /// Serves `resources` (as [`ControlPlane::start_with`] reads them) as `version`
    /// to every proxy: a new version replaces what they run.
    pub fn push(&self, dir: &Path, version: &str, resources: serde_json::Value) -> Result<()> {
        let file = dir.join(format!("resources-{version}.json"));
        std::fs::write(
            &file,
            serde_json::json!({"static_resources": resources}).to_string(),
        )?;
        let options = shunt::config::Options {
            config_path: Some(file.clone()),
            ..Default::default()
        };
        let (loaded, report) =
            shunt::config::check(&options, &shunt::snapshot::extensions::IMPLEMENTED)?;
        anyhow::ensure!(
            report.is_valid(),
            "{}: {}",
            file.display(),
            report
                .errors()
                .map(|e| e.to_string())
                .collect::<Vec<_>>()
                .join("; ")
        );
        let statics = loaded.bootstrap.static_resources.unwrap_or_default();
        self._ads.set(
            type_urls::CLUSTER,
            version,
            statics.clusters.iter().map(|c| named(&c.name, c)).collect(),
        );
        self._ads.set(
            type_urls::LISTENER,
            version,
            statics
                .listeners
                .iter()
                .map(|l| named(&l.name, l))
                .collect(),
        );
        Ok(())
    }

    /// The ADS server, for resources of other types (NDS's name table).
    pub fn ads(&self) -> &AdsServer {
        &self._ads
    }

    /// `nodeserve`'s flags for per-pod proxies from this control plane.
    pub fn node_flags(&self) -> Vec<String> {
        vec![
            "--config".into(),
            self.template.display().to_string(),
            "--ca-addr".into(),
            self.ca.address(),
            "--ca-root".into(),
            self.ca.root_file.display().to_string(),
            "--ca-token".into(),
            self.token.display().to_string(),
        ]
    }
}

/// The CA (in the node's bridge namespace, where the node process runs), the token
/// file, and the ADS server on a Unix socket: what every node-mode control plane has.
fn serve(node: &Node, dir: &Path) -> Result<(TestCa, PathBuf, AdsServer, PathBuf)> {
    let gateway = IpAddr::V4(node.gateway_ipv4());
    let ca = harness::run_in_netns(&node.bridge_netns_path(), || {
        TestCa::start_on(dir, TOKEN, Duration::from_secs(3600), gateway)
    })??;
    let token = dir.join("token");
    std::fs::write(&token, TOKEN)?;
    let socket = dir.join("XDS");
    let ads = AdsServer::start(Listen::Unix(socket.clone()))?;
    Ok((ca, token, ads, socket))
}

/// The pods' bootstrap template: ADS over `socket`, SDS from the node process.
fn write_template(dir: &Path, socket: &Path) -> Result<PathBuf> {
    let pipe = |name: &str, path: &str| {
        serde_json::json!({
            "name": name, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": path}}}}]}]}
        })
    };
    let bootstrap = serde_json::json!({
        "node": {"id": "template", "cluster": "template"},
        "dynamic_resources": {
            "lds_config": {"ads": {}, "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "ads_config": {"api_type": "GRPC", "transport_api_version": "V3",
                           "set_node_on_first_message_only": true,
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]}
        },
        "static_resources": {"clusters": [
            pipe("xds-grpc", &socket.display().to_string()),
            pipe("sds-grpc", "./var/run/secrets/workload-spiffe-uds/socket"),
        ]}
    });
    let template = dir.join("pods.json");
    std::fs::write(&template, bootstrap.to_string())?;
    Ok(template)
}

/// A test CA in this process's namespace (the sidecars' certificates are issued from
/// it directly; nothing calls it).
pub struct TestCaHandle(pub TestCa);

impl TestCaHandle {
    pub fn start(dir: &Path) -> Result<TestCaHandle> {
        Ok(TestCaHandle(TestCa::start(
            dir,
            TOKEN,
            Duration::from_secs(3600),
        )?))
    }
}

/// Envoy where uid 1337 can run it (the cached build sits under root's home): a copy
/// in the temp folder, made once.
pub fn envoy_for_sidecars(envoy: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let copy = std::env::temp_dir().join("shunt-bench-node-envoy");
    let same = |a: &Path, b: &Path| {
        let (Ok(a), Ok(b)) = (std::fs::metadata(a), std::fs::metadata(b)) else {
            return false;
        };
        a.len() == b.len()
    };
    if !same(envoy, &copy) {
        std::fs::copy(envoy, &copy)
            .with_context(|| format!("copying {} for uid 1337", envoy.display()))?;
    }
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755))?;
    Ok(copy)
}
