//! `shunt node`: the node agent (the DaemonSet's process), and `shunt node install-cni`
//! / `uninstall-cni`, the DaemonSet's CNI install step.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Subcommand};

use shunt_capture::CaptureArgs;

mod lifecycle;
mod uninstall;

use shunt_node::Pods;
use shunt_node::cni::install::{self, PluginSettings};
use shunt_node::cni::plugin::DEFAULT_SOCKET;
use shunt_node::enroll::Enrollment;
use shunt_node::enroll::cni_server::CniServer;
use shunt_node::enroll::zds::ZdsClient;
use shunt_node::owner::{self, Acquired, Owner};
use shunt_node::serve::capture::{EbpfCapture, FailurePolicy, NodeCapture, Policies};
use shunt_node::serve::dns::DnsOptions;
use shunt_node::serve::proxy::{CaTemplate, Template};
use shunt_node::serve::{NodeOptions, NodePods, PodCapture};

/// Where pods come from: the sockets and the state directory.
#[derive(Args, Debug, Clone)]
pub struct EnrollArgs {
    /// The `shunt-cni` plugin's socket.
    #[arg(long, default_value = DEFAULT_SOCKET, value_name = "PATH")]
    pub cni_socket: PathBuf,
    /// istio-cni's ZDS socket to connect to (as ztunnel does); none: no ZDS.
    #[arg(long, value_name = "PATH")]
    pub zds_socket: Option<PathBuf>,
    /// Where enrolled pods are recorded, to be rebuilt after a restart.
    #[arg(long, default_value = "/var/lib/shunt/node", value_name = "DIR")]
    pub state_dir: PathBuf,
}

/// Where each pod's proxy gets its config and certificate.
#[derive(Args, Debug, Clone)]
pub struct PodConfigArgs {
    /// The bootstrap every pod's proxy starts from (its `node` is the pod's, Istio's
    /// sidecar id and metadata); without it pods get the passthrough proxy.
    #[arg(long = "pod-bootstrap", value_name = "FILE")]
    pub bootstrap: Option<PathBuf>,
    /// The mesh CA each service account's certificate comes from (`host:port`);
    /// without it pods have no workload certificate.
    #[arg(long, value_name = "HOST:PORT", requires = "bootstrap")]
    pub ca_addr: Option<String>,
    /// The TLS name of the CA's certificate (default: the host of --ca-addr).
    #[arg(long, value_name = "NAME")]
    pub ca_server_name: Option<String>,
    /// The mesh root, trusted for the CA and for what it issues.
    #[arg(
        long,
        default_value = "/var/run/secrets/istio/root-cert.pem",
        value_name = "PATH"
    )]
    pub ca_root_cert: PathBuf,
    /// The token presented to the CA.
    #[arg(
        long,
        default_value = "/var/run/secrets/tokens/istio-token",
        value_name = "PATH"
    )]
    pub ca_token: PathBuf,
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    pub trust_domain: String,
}

impl PodConfigArgs {
    fn template(&self) -> anyhow::Result<Option<Template>> {
        let Some(path) = &self.bootstrap else {
            return Ok(None);
        };
        let ca = self.ca_addr.as_ref().map(|address| CaTemplate {
            address: address.clone(),
            server_name: self.ca_server_name.clone(),
            root_cert: self.ca_root_cert.clone(),
            token_path: self.ca_token.clone(),
            trust_domain: self.trust_domain.clone(),
        });
        Template::load(path, ca)
            .with_context(|| format!("--pod-bootstrap {}", path.display()))
            .map(Some)
    }
}

/// The node agent: the node's capture (loaded once), [`NodePods`] serving every pod, the
/// enrollers feeding it. The node's state is this process's alone ([`owner`]): a node
/// owned by another process is taken over (`--take-over`, what an upgrade does) or left
/// untouched.
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    super::init_logging(&args.log_level)?;
    let state_dir = args.enroll.state_dir.clone();
    // Nothing is touched before this: a second process leaves the node as it found it.
    let start = match Owner::acquire(&state_dir)? {
        Acquired::Owner(owner) => lifecycle::Start::Fresh(owner),
        Acquired::Busy(by) if args.take_over => {
            tracing::info!("{by}: taking the node over");
            // The old process's sockets and its lock, before anything here is touched.
            let handed = shunt_node::serve::handover::receive(&owner::handover_path(&state_dir))
                .with_context(|| format!("{by}, and it did not hand the node over"))?;
            lifecycle::Start::TakeOver(handed)
        }
        Acquired::Busy(by) => anyhow::bail!(
            "{by}: leaving it untouched (stop that process first, or pass --take-over to \
             take the node over from it, as an upgrade does)"
        ),
    };
    let capture: Option<Box<dyn PodCapture>> = if args.no_capture {
        None
    } else {
        let cgroup = args.capture.cgroup().context(
            "--cgroup: the pods' parent cgroup, where the capture programs attach (or --no-capture)",
        )?;
        let capture = NodeCapture::open(args.capture.config()?, cgroup, args.capture.bpffs())?;
        Some(Box::new(EbpfCapture {
            capture,
            policies: Policies {
                default: args.failure_policy,
                fail_open_namespaces: args.fail_open_namespaces.clone(),
            },
        }))
    };
    let template = args.pods.template()?;
    // With DNS capture on, each pod gets its DNS proxy on its 15053 (forwarding to the
    // resolvers the CNI runtime gave for the pod, else the node's resolv.conf).
    let dns = args.capture.config()?.dns.redirect.then(|| DnsOptions {
        resolv_conf: args.dns_resolv_conf.clone(),
        ..DnsOptions::default()
    });
    // The node's main thread (Envoy's): enrollment, every pod's xDS and compiles. The
    // pods' connections run on the workers, where their listeners accept.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("shunt-node")
        .enable_all()
        .build()
        .context("starting the node's runtime")?;
    shunt_core::event::workers::start(
        None,
        args.concurrency.max(1),
        shunt_memory::cache_this_thread,
    )
    .context("starting the node's workers")?;
    let options = NodeOptions {
        fast_path: !args.no_fast_path,
        dns,
        drain_time: std::time::Duration::from_secs(args.drain_time_s),
        ..NodeOptions::default()
    };
    let mut pods = NodePods::new(options, runtime.handle().clone(), capture);
    if let Some(template) = template {
        pods = pods.with_config(template);
    }
    if let lifecycle::Start::TakeOver(_) = &start
        && args.handover_pause_ms > 0
    {
        std::thread::sleep(std::time::Duration::from_millis(args.handover_pause_ms));
    }
    lifecycle::run(
        start,
        Arc::new(pods),
        &args.enroll,
        args.ready_file.as_deref(),
        &runtime,
    )
}

/// Rebuilds the pods of the state directory into `pods`, then serves the CNI socket
/// (`cni`: the one handed over, or bound at `--cni-socket`) and connects to istio-cni
/// (the sockets open after the rebuild, so a DEL never races it).
pub fn start_enrollers(
    args: &EnrollArgs,
    pods: Arc<dyn Pods>,
    cni: Option<std::os::unix::net::UnixListener>,
) -> anyhow::Result<Enrollers> {
    let (enrollment, restored) = Enrollment::open(pods, &args.state_dir)?;
    for file in &restored.unreadable {
        tracing::warn!("state: unreadable record {file}");
    }
    for (uid, why) in &restored.dropped {
        tracing::info!(uid, "state: pod dropped at start: {why}");
    }
    for (uid, why) in &restored.unserved {
        tracing::warn!(
            uid,
            "state: pod not served again (its capture stays, its failure policy holds): {why}"
        );
    }
    tracing::info!(
        served = restored.served.len(),
        awaiting_snapshot = restored.awaiting_snapshot.len(),
        "state: pods rebuilt from {}",
        args.state_dir.display()
    );
    let enrollment = Arc::new(enrollment);
    let cni = match cni {
        Some(listener) => CniServer::start_on(&args.cni_socket, listener, enrollment.clone()),
        None => CniServer::start(&args.cni_socket, enrollment.clone()),
    }
    .with_context(|| format!("CNI socket {}", args.cni_socket.display()))?;
    let zds = match &args.zds_socket {
        Some(path) => Some(ZdsClient::start(path, enrollment.clone())?),
        None => None,
    };
    Ok(Enrollers {
        enrollment,
        cni,
        zds,
    })
}

/// The enrollers, running until dropped.
pub struct Enrollers {
    pub enrollment: Arc<Enrollment>,
    pub cni: CniServer,
    pub zds: Option<ZdsClient>,
}

#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct NodeArgs {
    #[command(subcommand)]
    pub action: Option<NodeAction>,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// `shunt node` without a subcommand: the node agent.
#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub enroll: EnrollArgs,
    /// When another `shunt node` owns the node's state (the same --state-dir), take the
    /// node over from it: its pods' listening sockets, the CNI socket and the ownership
    /// pass to this process without a connection refused, then it drains and exits.
    /// What the DaemonSet's rolling update does. Without it a second process exits,
    /// naming the owner, and touches nothing.
    #[arg(long)]
    pub take_over: bool,
    /// Written once this process owns the node and serves its pods, removed when it
    /// hands them over or stops: the DaemonSet's readiness (`test -f`).
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// Time a pod's connections have to finish when it is removed, or when this process
    /// hands the node over.
    #[arg(long, default_value_t = 5, value_name = "SECONDS")]
    pub drain_time_s: u64,
    /// Tests only: the pause between receiving a node and serving it, in which a test
    /// kills one side of the hand-over.
    #[arg(long, hide = true, default_value_t = 0)]
    pub handover_pause_ms: u64,
    #[command(flatten)]
    pub pods: PodConfigArgs,
    /// Send same-node mTLS connections over the network (two proxies, a TLS handshake)
    /// instead of handing them to the destination pod's inbound side in process.
    #[arg(long)]
    pub no_fast_path: bool,
    /// With --redirect-dns: where a pod's DNS proxy forwards when its enrollment named
    /// no resolvers (the node's resolv.conf; under `ClusterFirstWithHostNet`, the
    /// cluster DNS).
    #[arg(long, default_value = "/etc/resolv.conf", value_name = "PATH")]
    pub dns_resolv_conf: PathBuf,
    /// Serve the pods' listeners without eBPF capture (the capture flags are ignored).
    #[arg(long)]
    pub no_capture: bool,
    /// What a pod's connects do while no proxy serves it (decided in the kernel).
    #[arg(long, value_enum, default_value = "fail-closed")]
    pub failure_policy: FailurePolicy,
    /// Namespaces whose pods fail open whatever --failure-policy says (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub fail_open_namespaces: Vec<String>,
    /// Worker threads every pod's connections share (Envoy's `--concurrency`).
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Log filter (`info`, `shunt=debug`, ...).
    #[arg(long, default_value = "info", value_name = "LEVEL")]
    pub log_level: String,
    /// The capture, as `shunt capture`'s flags: `--cgroup` is the pods' parent cgroup
    /// (the programs attach there once; this process must run under it too),
    /// `--bpffs` where they are pinned.
    #[command(flatten)]
    pub capture: Box<CaptureArgs>,
}

#[derive(Subcommand, Debug)]
pub enum NodeAction {
    /// Copy this binary to the CNI bin directory as `shunt-cni` and chain it at the end
    /// of the node's network configuration (the first file of the conf directory).
    InstallCni(InstallCniArgs),
    /// Remove `shunt-cni` from every conflist of the conf directory and from the bin
    /// directory.
    UninstallCni(CniDirs),
    /// Remove node mode from this node: every pod's capture, the node's eBPF programs,
    /// links, maps and pins, the state records and the CNI socket. Refused while a
    /// `shunt node` owns the node (stop it first). `uninstall-cni` is separate.
    Uninstall(UninstallArgs),
}

#[derive(Args, Debug)]
pub struct UninstallArgs {
    #[command(flatten)]
    pub enroll: EnrollArgs,
    /// Where the capture is pinned (`shunt node --bpffs`).
    #[arg(
        long,
        env = "SHUNT_BPFFS",
        default_value = "/sys/fs/bpf/shunt",
        value_name = "DIR"
    )]
    pub bpffs: PathBuf,
}

#[derive(Args, Debug)]
pub struct CniDirs {
    /// Where the runtime finds CNI plugins.
    #[arg(long, default_value = "/opt/cni/bin")]
    pub cni_bin_dir: PathBuf,
    /// Where the runtime finds network configurations.
    #[arg(long, default_value = "/etc/cni/net.d")]
    pub cni_conf_dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct InstallCniArgs {
    #[command(flatten)]
    pub dirs: CniDirs,
    /// The agent's socket, as the plugin (on the host) sees it.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    pub agent_socket: PathBuf,
    /// What ADD does when the agent cannot be reached: `fail` (the runtime retries) or
    /// `pass` (the pod starts unenrolled).
    #[arg(long, default_value = "fail", value_parser = ["fail", "pass"])]
    pub agent_unavailable: String,
    /// Namespaces whose pods are never enrolled (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "kube-system")]
    pub exclude_namespaces: Vec<String>,
}

pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let Some(action) = args.action else {
        return serve(args.serve);
    };
    match action {
        NodeAction::InstallCni(a) => {
            let me = std::env::current_exe()?;
            let settings = PluginSettings {
                agent_socket: a.agent_socket,
                agent_unavailable: a.agent_unavailable,
                exclude_namespaces: a.exclude_namespaces,
            };
            let conf = install::install(&me, &a.dirs.cni_bin_dir, &a.dirs.cni_conf_dir, &settings)?;
            eprintln!(
                "shunt node: installed {} and chained it in {}",
                a.dirs.cni_bin_dir.join(install::PLUGIN_TYPE).display(),
                conf.display()
            );
            Ok(())
        }
        NodeAction::Uninstall(a) => uninstall::run(&a),
        NodeAction::UninstallCni(dirs) => {
            let changed = install::uninstall(&dirs.cni_bin_dir, &dirs.cni_conf_dir)?;
            for path in changed {
                eprintln!("shunt node: removed shunt-cni from {}", path.display());
            }
            Ok(())
        }
    }
}
