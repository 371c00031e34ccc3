//! The data planes of `bench mesh`, each on a node of its own with a client pod and a
//! server pod (testapp's HTTP/1.1 echo on 8080, its TCP echo on 9090), all set up
//! before the first run and kept up, so the runs can alternate between them:
//!
//! - `direct`: no mesh;
//! - `envoy`: an Envoy 1.40 sidecar in each pod with mTLS between them, istio-iptables'
//!   capture (Istio's sidecar shape);
//! - `shunt`: the same bootstrap in two shunt sidecars, eBPF capture;
//! - `node-l7`, `node-l7-nofast`: node mode (one process), each pod a proxy of its own
//!   with the same listeners and clusters, certificates over SDS from a test CA; the
//!   same-node fast path on and off;
//! - `node-l4`: node mode with `tcp_proxy` for both ports (mTLS, fast path on): what
//!   ztunnel does;
//! - `ztunnel`: one ztunnel in shared in-pod mode, HBONE between the pods
//!   ([`crate::ztunnel`]).
//!
//! The sidecars' listeners: 15001 takes the app's outbound connections (original
//! destination), its filter chain by destination port: 8080 through an
//! `http_connection_manager` (a route to the server pod over mTLS), 9090 through
//! `tcp_proxy`; 15006 terminates mTLS (the client's certificate required, its SPIFFE
//! identity in the trust domain) and passes to the app on 127.0.0.1. HTTP/1.1 between
//! the sidecars, as Istio without an h2 upgrade policy.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use harness::{Node, Pod, PodProcess};
use serde_json::{Value, json};

use super::node::Agent;
use super::node_mesh::{self, ControlPlane, IDENTITY, Scratch};
use crate::pods::{APP_UID, Backend, Bins, Capture, call};
use crate::ztunnel::Ztunnel;

pub(super) const HTTP_PORT: u16 = 8080;
pub(super) const TCP_PORT: u16 = 9090;
const TRUST_DOMAIN_PREFIX: &str = "spiffe://cluster.local/";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(super) enum Plane {
    Direct,
    Envoy,
    Shunt,
    NodeL7,
    NodeL7Nofast,
    NodeL4,
    Ztunnel,
}

impl Plane {
    pub(super) const ALL: [Plane; 7] = [
        Plane::Direct,
        Plane::Envoy,
        Plane::Shunt,
        Plane::NodeL7,
        Plane::NodeL7Nofast,
        Plane::NodeL4,
        Plane::Ztunnel,
    ];

    pub(super) fn name(self) -> &'static str {
        match self {
            Plane::Direct => "direct",
            Plane::Envoy => "envoy",
            Plane::Shunt => "shunt",
            Plane::NodeL7 => "node-l7",
            Plane::NodeL7Nofast => "node-l7-nofast",
            Plane::NodeL4 => "node-l4",
            Plane::Ztunnel => "ztunnel",
        }
    }

    /// What the row is, for the table's legend.
    pub(super) fn describe(self) -> &'static str {
        match self {
            Plane::Direct => "no mesh",
            Plane::Envoy => "Envoy 1.40 sidecar pair, mTLS, HTTP routed (L7), iptables capture",
            Plane::Shunt => "shunt sidecar pair, same bootstrap, eBPF capture",
            Plane::NodeL7 => "shunt node mode, HTTP routed (L7), mTLS, same-node fast path",
            Plane::NodeL7Nofast => "shunt node mode, L7, mTLS over the network (fast path off)",
            Plane::NodeL4 => "shunt node mode, tcp_proxy (L4) with mTLS, fast path on",
            Plane::Ztunnel => "ztunnel, shared in-pod mode, HBONE (L4, mTLS)",
        }
    }
}

/// Where a plane's binaries come from.
pub(super) struct Programs {
    pub bins: Bins,
    pub nodeserve: PathBuf,
    pub envoy: PathBuf,
    pub ztunnel: Option<PathBuf>,
}

/// A plane set up and serving: its node, pods and the processes that are the mesh.
pub(super) struct Running {
    pub plane: Plane,
    pub client: Pod,
    pub server: Pod,
    /// The mesh's processes (both sidecars, or the node process): their CPU and RSS
    /// are the plane's cost.
    mesh_pids: Vec<u32>,
    // Dropped in this order: the mesh, capture, then the apps and the node.
    _sidecars: Vec<PodProcess>,
    _agent: Option<Agent>,
    _ztunnel: Option<Ztunnel>,
    _capture: Option<Capture>,
    _control_plane: Option<ControlPlane>,
    _apps: Vec<PodProcess>,
    _scratch: Scratch,
    pub node: Node,
}

impl Running {
    pub(super) fn mesh_pids(&self) -> &[u32] {
        &self.mesh_pids
    }

    pub(super) fn target(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.server.ipv4().into(), port)
    }
}

/// Sets `plane` up on a node of its own and checks that both kinds of traffic take it.
pub(super) fn start(programs: &Programs, plane: Plane) -> Result<Running> {
    let mut node = Node::new()?;
    let client = node.add_pod("client")?;
    let server = node.add_pod("server")?;
    let scratch = Scratch::new(&format!("mesh-{}", plane.name()))?;
    let bins = &programs.bins;
    let apps = vec![
        app(bins, &server, HTTP_PORT, "http-echo")?,
        app(bins, &server, TCP_PORT, "echo")?,
    ];
    let server_ip: IpAddr = server.ipv4().into();
    let mut running = Running {
        plane,
        client: client.clone(),
        server: server.clone(),
        mesh_pids: Vec::new(),
        _sidecars: Vec::new(),
        _agent: None,
        _ztunnel: None,
        _capture: None,
        _control_plane: None,
        _apps: apps,
        _scratch: scratch,
        node,
    };
    let dir = running._scratch.0.clone();
    match plane {
        Plane::Direct => {}
        Plane::Envoy | Plane::Shunt => {
            let ca = node_mesh::TestCaHandle::start(&dir)?;
            let (chain, key, root) = node_mesh::sidecar_certificates(&ca.0, &dir)?;
            let tls = Tls::Files {
                chain: &chain,
                key: &key,
                root: &root,
            };
            let file = dir.join("sidecar.json");
            let bootstrap = json!({"static_resources": resources(server_ip, &tls, Layer::L7)});
            std::fs::write(&file, serde_json::to_string_pretty(&bootstrap)?)?;
            let (program, args, backend) = if plane == Plane::Shunt {
                (
                    bins.shunt.clone(),
                    super::l4::shunt_args(&file),
                    Backend::Ebpf,
                )
            } else {
                (
                    programs.envoy.clone(),
                    super::l4::envoy_args(&file),
                    Backend::Iptables,
                )
            };
            let mut capture = Capture::new(bins, backend, &pin_root(plane));
            for pod in [&client, &server] {
                capture.install_with(pod, &["--no-sockmap"])?;
                let sidecar = node_mesh::start_sidecar(&program, &args, pod)?;
                running.mesh_pids.push(sidecar.pid());
                running._sidecars.push(sidecar);
            }
            running._capture = Some(capture);
        }
        Plane::NodeL7 | Plane::NodeL7Nofast | Plane::NodeL4 => {
            let layer = if plane == Plane::NodeL4 {
                Layer::L4
            } else {
                Layer::L7
            };
            let cp = ControlPlane::start_with(
                &running.node,
                &dir,
                resources(server_ip, &Tls::Sds, layer),
            )?;
            let mut flags = cp.node_flags();
            if plane == Plane::NodeL7Nofast {
                flags.push("--no-fast-path".into());
            }
            let mut agent = Agent::start_with(
                &running.node,
                &programs.nodeserve,
                &format!("mesh-{}", plane.name()),
                &flags,
            )?;
            for pod in [&client, &server] {
                agent.add(pod)?;
            }
            for pod in [&client, &server] {
                agent.wait_ready(pod)?;
            }
            running.mesh_pids.push(agent.pid());
            running._agent = Some(agent);
            running._control_plane = Some(cp);
        }
        Plane::Ztunnel => {
            let bin = programs.ztunnel.as_ref().context(
                "no ztunnel binary (--ztunnel-bin, --ztunnel-src or `cargo xtask ztunnel`)",
            )?;
            let ztunnel = Ztunnel::start(bin, &running.node, &[&client, &server])?;
            running.mesh_pids.push(ztunnel.pid());
            running._ztunnel = Some(ztunnel);
        }
    }
    check_path(bins, &running).with_context(|| format!("{}: the path under test", plane.name()))?;
    Ok(running)
}

fn pin_root(plane: Plane) -> String {
    format!("/sys/fs/bpf/shunt-bench-mesh-{}", plane.name())
}

/// `testapp serve --mode MODE --quiet yes` on 0.0.0.0:port, once it listens.
fn app(bins: &Bins, pod: &Pod, port: u16, mode: &str) -> Result<PodProcess> {
    let app = pod
        .command(&bins.testapp)
        .args(["serve", "--mode", mode, "--quiet", "yes", "--listen"])
        .arg(format!("0.0.0.0:{port}"))
        .spawn()?;
    harness::wait_for_port(
        pod,
        SocketAddr::from(([127, 0, 0, 1], port)),
        crate::pods::secs(10),
    )
    .with_context(|| format!("testapp serve in {}", pod.name()))?;
    Ok(app)
}

/// One TCP call and one HTTP request from the client pod's app: each must arrive, and
/// not straight from the client pod unless the plane is `direct` (sidecars and node
/// mode connect to the app from 127.0.0.1; ztunnel keeps the client's address, so its
/// own count of inbound HBONE connections must grow instead).
fn check_path(bins: &Bins, running: &Running) -> Result<()> {
    let client_ip: IpAddr = running.client.ipv4().into();
    let before = match running.plane {
        Plane::Ztunnel => crate::ztunnel::inbound_connections(&running.node)?,
        _ => 0,
    };
    let tcp = call(
        bins,
        &running.client,
        APP_UID,
        running.target(TCP_PORT),
        1024,
    )?;
    let http = http_call_as_app(running)?;
    for (what, peer) in [("tcp", tcp.server_peer), ("http", http)] {
        match running.plane {
            Plane::Direct | Plane::Ztunnel => ensure!(
                peer.ip() == client_ip,
                "{what}: the server saw {peer}, not the client pod"
            ),
            _ => ensure!(
                peer.ip().is_loopback(),
                "{what}: the server saw {peer}: not through the inbound proxy"
            ),
        }
    }
    if running.plane == Plane::Ztunnel {
        let after = crate::ztunnel::inbound_connections(&running.node)?;
        ensure!(
            after >= before + 2,
            "ztunnel counted {} inbound connections for 2 calls",
            after - before
        );
    }
    Ok(())
}

/// An HTTP GET as the app (captured): where the server saw it come from.
fn http_call_as_app(running: &Running) -> Result<SocketAddr> {
    let cmd = running
        .client
        .command("curl")
        .uid(APP_UID)
        .gid(APP_UID)
        .args(["-sS", "--fail", "--max-time", "10"])
        .arg(format!("http://{}/", running.target(HTTP_PORT)));
    let desc = cmd.description();
    let out = cmd.output()?;
    let body = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("{desc}: {}{body}", String::from_utf8_lossy(&out.stderr));
    }
    body.split_whitespace()
        .find_map(|w| w.strip_prefix("peer="))
        .with_context(|| format!("{desc}: no peer= in {body:?}"))?
        .parse()
        .with_context(|| format!("{desc}: {body:?}"))
}

/// Where the proxies' certificates come from: files (the sidecars) or SDS from the node
/// process (node mode: Istio's `default` and `ROOTCA` secrets over `sds-grpc`).
pub(super) enum Tls<'a> {
    Files {
        chain: &'a Path,
        key: &'a Path,
        root: &'a Path,
    },
    Sds,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Layer {
    /// HTTP through an `http_connection_manager` and a route, TCP through `tcp_proxy`.
    L7,
    /// Both through `tcp_proxy`.
    L4,
}

impl Tls<'_> {
    /// A `common_tls_context` whose peer must present an identity `san` matches.
    fn context(&self, san: Value) -> Value {
        match self {
            Tls::Files { chain, key, root } => json!({
                "tls_certificates": [{
                    "certificate_chain": {"filename": chain.display().to_string()},
                    "private_key": {"filename": key.display().to_string()}}],
                "validation_context": {
                    "trusted_ca": {"filename": root.display().to_string()},
                    "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": san}]}
            }),
            Tls::Sds => {
                let sds = json!({"api_config_source": {"api_type": "GRPC",
                    "transport_api_version": "V3",
                    "grpc_services": [{"envoy_grpc": {"cluster_name": "sds-grpc"}}]},
                    "resource_api_version": "V3"});
                json!({
                    "tls_certificate_sds_secret_configs": [{"name": "default", "sds_config": sds}],
                    "combined_validation_context": {
                        "default_validation_context": {
                            "match_typed_subject_alt_names": [{"san_type": "URI", "matcher": san}]},
                        "validation_context_sds_secret_config": {"name": "ROOTCA", "sds_config": sds}}
                })
            }
        }
    }
}

/// The listeners and clusters every mesh proxy of shunt and Envoy runs (the sidecars'
/// bootstrap, node mode's per-pod template): `{"listeners": [...], "clusters": [...]}`.
pub(super) fn resources(server: IpAddr, tls: &Tls, layer: Layer) -> Value {
    let original_dst = json!([{"name": "envoy.filters.listener.original_dst", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}}]);
    let http_filter = |prefix: &str, cluster: &str| match layer {
        Layer::L7 => hcm(prefix, cluster),
        Layer::L4 => tcp_proxy(prefix, cluster),
    };
    let downstream_tls = json!({"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
        "require_client_certificate": true,
        "common_tls_context": tls.context(json!({"prefix": TRUST_DOMAIN_PREFIX}))}});
    let upstream_tls = json!({"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": tls.context(json!({"exact": IDENTITY}))}});
    let chain = |port: u16, filter: Value, tls: Option<&Value>| {
        let mut c = json!({"filter_chain_match": {"destination_port": port}, "filters": [filter]});
        if let Some(tls) = tls {
            c["transport_socket"] = tls.clone();
        }
        c
    };
    let listeners = json!([
        {"name": "virtualOutbound",
         "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15001}},
         "listener_filters": original_dst,
         "filter_chains": [
            chain(HTTP_PORT, http_filter("outbound_http", "outbound|8080"), None),
            chain(TCP_PORT, tcp_proxy("outbound_tcp", "outbound|9090"), None)]},
        {"name": "virtualInbound",
         "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15006}},
         "listener_filters": original_dst,
         "filter_chains": [
            chain(HTTP_PORT, http_filter("inbound_http", "inbound|8080"), Some(&downstream_tls)),
            chain(TCP_PORT, tcp_proxy("inbound_tcp", "inbound|9090"), Some(&downstream_tls))]},
    ]);
    let cluster = |name: &str, ip: IpAddr, port: u16, tls: Option<&Value>| {
        let mut c = json!({"name": name, "type": "STATIC", "connect_timeout": "2s",
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint":
                {"address": {"socket_address": {"address": ip.to_string(), "port_value": port}}}}]}]}});
        if let Some(tls) = tls {
            c["transport_socket"] = tls.clone();
        }
        c
    };
    let local: IpAddr = [127, 0, 0, 1].into();
    let clusters = json!([
        cluster("outbound|8080", server, HTTP_PORT, Some(&upstream_tls)),
        cluster("outbound|9090", server, TCP_PORT, Some(&upstream_tls)),
        cluster("inbound|8080", local, HTTP_PORT, None),
        cluster("inbound|9090", local, TCP_PORT, None),
    ]);
    json!({"listeners": listeners, "clusters": clusters})
}

fn hcm(prefix: &str, cluster: &str) -> Value {
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": prefix,
        "codec_type": "AUTO",
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": {"name": prefix, "virtual_hosts": [{"name": prefix, "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "5s"}}]}]}}})
}

fn tcp_proxy(prefix: &str, cluster: &str) -> Value {
    json!({"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": prefix, "cluster": cluster}})
}
