//! A pod's proxy as the control plane configures it: the pod is its own xDS node
//! (Istio's sidecar node id and metadata), with its own snapshot, stats store, listeners
//! and access logs, and its own workload certificate over an in-process SDS server
//! (one CA client per service account, shared by the pods that run as it). What the
//! pods share is the process: the runtime, the descriptor pool, the roots.
//!
//! The capture ports (15001, 15006) are opened at enrollment, before any config exists,
//! so the pod's first connection queues in their backlog rather than being refused; when
//! the pod's `virtualOutbound` / `virtualInbound` listeners arrive over LDS, the binder
//! hands them those very sockets. Every other listener is bound inside the pod's
//! network namespace.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use tokio::task::AbortHandle;

use crate::PodInfo;
use shunt_agent::ca::{CaOptions, CertificateProvider};
use shunt_instance::{Configured, Serves, Socket, XdsInputs};
use shunt_xds::local::LocalServers;
use shunt_xds::manager::Binder;
use shunt_xds::snapshot::{self, Current};

/// What every pod's proxy starts from: a bootstrap whose `node` is replaced per pod
/// (its metadata merged under the pod's), and where certificates come from.
#[derive(Debug, Clone)]
pub struct Template {
    pub bootstrap: Bootstrap,
    /// The mesh CA; `None`: no workload certificates (plaintext mesh).
    pub ca: Option<CaTemplate>,
}

impl Template {
    /// The template bootstrap at `path` (JSON or YAML, as `shunt proxy -c` reads it):
    /// an invalid one is refused here, with its errors, before any pod is served.
    pub fn load(path: &std::path::Path, ca: Option<CaTemplate>) -> anyhow::Result<Template> {
        let options = shunt_config::Options {
            config_path: Some(path.to_owned()),
            ..Default::default()
        };
        let (loaded, report) =
            shunt_config::check(&options, &shunt_xds::snapshot::extensions::IMPLEMENTED)?;
        if !report.is_valid() {
            let errors: Vec<String> = report.errors().map(|e| e.to_string()).collect();
            anyhow::bail!(
                "{}: invalid pod bootstrap: {}",
                path.display(),
                errors.join("; ")
            );
        }
        if loaded.bootstrap.dynamic_resources.is_none() {
            anyhow::bail!(
                "{}: the pod bootstrap has no dynamic_resources: pods would get no config",
                path.display()
            );
        }
        Ok(Template {
            bootstrap: loaded.bootstrap,
            ca,
        })
    }
}

/// The CA client's settings shared by every pod; namespace and service account are
/// each pod's.
#[derive(Debug, Clone)]
pub struct CaTemplate {
    /// `host:port` of the CA (istiod's 15012).
    pub address: String,
    pub server_name: Option<String>,
    pub root_cert: PathBuf,
    /// The bearer token presented for a service account whose pods came without one
    /// of their own (the node's: Istio's node agents present theirs for every pod).
    pub token_path: PathBuf,
    pub trust_domain: String,
}

impl CaTemplate {
    fn options(
        &self,
        namespace: &str,
        service_account: &str,
        token_path: Option<&std::path::Path>,
    ) -> CaOptions {
        let mut options = CaOptions::new(self.address.clone(), namespace, service_account);
        options.server_name = self.server_name.clone();
        options.root_cert = self.root_cert.clone();
        options.token_path = token_path.unwrap_or(&self.token_path).to_owned();
        // The node's token stands for the account's: say whose certificate it asks for.
        options.impersonate = token_path.is_none();
        options.trust_domain = self.trust_domain.clone();
        options
    }
}

/// One CA client per service account: pods of the same account share its certificate
/// and its rotations; the client (its rotation task) stops when the account's last pod
/// leaves.
#[derive(Default)]
pub struct Certificates {
    by_account: Mutex<HashMap<(String, String), Account>>,
}

struct Account {
    provider: CertificateProvider,
    rotation: AbortHandle,
    /// Pods served with this account's certificate.
    pods: usize,
}

impl Certificates {
    /// The provider of `namespace`/`service_account` for one more pod, started on
    /// `runtime` the first time it is asked for, presenting `token_path` (the pod's
    /// own token for its account) or the template's. Each call is matched by a
    /// [`Certificates::release`].
    pub fn provider(
        &self,
        runtime: &tokio::runtime::Handle,
        ca: &CaTemplate,
        namespace: &str,
        service_account: &str,
        token_path: Option<&std::path::Path>,
    ) -> CertificateProvider {
        let key = (namespace.to_owned(), service_account.to_owned());
        let mut all = self.lock();
        if let Some(account) = all.get_mut(&key) {
            account.pods += 1;
            return account.provider.clone();
        }
        let _entered = runtime.enter();
        let (provider, task) =
            CertificateProvider::start_ca(ca.options(namespace, service_account, token_path));
        all.insert(
            key,
            Account {
                provider: provider.clone(),
                rotation: task.abort_handle(),
                pods: 1,
            },
        );
        provider
    }

    /// One pod of `namespace`/`service_account` left: with none left, its CA client
    /// stops (no further CSRs).
    pub fn release(&self, namespace: &str, service_account: &str) {
        let key = (namespace.to_owned(), service_account.to_owned());
        let mut all = self.lock();
        let Some(account) = all.get_mut(&key) else {
            return;
        };
        account.pods = account.pods.saturating_sub(1);
        if account.pods == 0 {
            account.rotation.abort();
            all.remove(&key);
            tracing::info!(namespace, service_account, "CA client stopped: no pod left");
        }
    }

    /// How many CA clients run (one per service account with a pod).
    pub fn accounts(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Account>> {
        self.by_account.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Certificates {
    fn drop(&mut self) {
        if let Ok(all) = self.by_account.get_mut() {
            for account in all.values() {
                account.rotation.abort();
            }
        }
    }
}

/// The pod's service account, `default` when the enroller did not say.
pub fn service_account(pod: &PodInfo) -> &str {
    pod.service_account.as_deref().unwrap_or("default")
}

/// `template` with the pod's node: Istio's sidecar id, cluster `<pod>.<namespace>`, and
/// the metadata pilot-agent derives from the pod (over the template's own).
/// With `dns`, `DNS_CAPTURE` is on (pilot-agent's `ISTIO_META_DNS_CAPTURE`): istiod then
/// sends the pod's name table. Its clusters are made on first use
/// (`cluster_manager.enable_deferred_cluster_creation`): istiod pushes each pod every
/// service of the mesh, the pods share those clusters' compile, and a pod that made
/// its own of each would pay per pod what sharing saves.
pub fn pod_bootstrap(template: &Bootstrap, pod: &PodInfo, dns: bool) -> Bootstrap {
    let mut bootstrap = template.clone();
    let mut node = bootstrap.node.take().unwrap_or_default();
    node.id = super::xds_node_id(pod);
    node.cluster = format!("{}.{}", pod.name, pod.namespace);
    let metadata = node.metadata.get_or_insert_with(Struct::default);
    let ips: Vec<String> = pod.ips.iter().map(|ip| ip.to_string()).collect();
    for (key, value) in [
        ("NAME", pod.name.clone()),
        ("NAMESPACE", pod.namespace.clone()),
        ("INSTANCE_IPS", ips.join(",")),
        ("SERVICE_ACCOUNT", service_account(pod).to_owned()),
        ("WORKLOAD_NAME", pod.name.clone()),
        ("INTERCEPTION_MODE", "REDIRECT".to_owned()),
    ] {
        metadata.fields.insert(
            key.to_owned(),
            Value {
                kind: Some(Kind::StringValue(value)),
            },
        );
    }
    if dns {
        metadata.fields.insert(
            "DNS_CAPTURE".to_owned(),
            Value {
                kind: Some(Kind::StringValue("true".to_owned())),
            },
        );
    }
    bootstrap.node = Some(node);
    bootstrap
        .cluster_manager
        .get_or_insert_with(Default::default)
        .enable_deferred_cluster_creation = true;
    bootstrap
}

/// What the pod's proxy is started with, besides its sockets.
pub struct Setup {
    pub bootstrap: Bootstrap,
    /// In-process xDS servers (the pod's SDS), by the socket path the bootstrap names.
    pub local: LocalServers,
    /// The pod's stats store (its DNS proxy counts there too).
    pub stats: shunt_core::stats::Store,
    /// The pod's DNS proxy's name table, which the pod's ADS stream then asks for.
    pub dns: Option<Arc<shunt_dns::Tables>>,
    /// The node's connections to the control plane, shared by the pods' streams.
    pub channels: Option<Arc<shunt_xds::stream::ChannelPool>>,
}

/// The pod's proxy as an instance's configuration: its bootstrap compiled, its xDS
/// (on `runtime`, the node's), a binder that gives the listeners its control plane puts
/// at the `capture` addresses the sockets opened at enrollment and binds any other
/// inside the pod; and the sockets of the bootstrap's static listeners.
pub fn configure(
    runtime: &tokio::runtime::Handle,
    setup: Setup,
    capture: Vec<(SocketAddr, std::net::TcpListener)>,
    netns: Arc<OwnedFd>,
) -> anyhow::Result<(Configured, Vec<Socket>)> {
    let Setup {
        bootstrap,
        local,
        stats,
        dns,
        channels,
    } = setup;
    let mut plan = shunt_xds::source::plan(&bootstrap)?
        .context("the node's bootstrap has no dynamic_resources: pods would get no config")?;
    plan.local = local;
    plan.channels = channels;
    if let Some(tables) = &dns
        && !plan.add_name_table()
    {
        tracing::warn!("the pod's DNS proxy without an ADS stream: forwarding every query");
        let _ = tables.apply(Default::default(), "");
    }
    let compiled = snapshot::compile(&bootstrap, &stats)?;
    let store = Arc::new(Current::new(compiled.snapshot));
    let own_ports: Vec<u16> = capture.iter().map(|(a, _)| a.port()).collect();
    let capture: HashMap<SocketAddr, std::net::TcpListener> = capture.into_iter().collect();
    let binder: Binder = Arc::new(move |listener, addr| {
        match capture.get(&addr) {
            // The same socket (a second descriptor): its backlog is the pod's.
            Some(socket) => socket.try_clone(),
            None => super::listen::bind_listener(&netns, listener, addr),
        }
    });
    // The bootstrap's static listeners (compiling left out the health ports, which the
    // instance answers itself).
    let mut statics = Vec::new();
    for listener in store.load().listeners.iter().filter(|l| l.bind_to_port) {
        for addr in &listener.addresses {
            let socket = binder(listener, *addr).with_context(|| {
                format!("listener {:?}: cannot listen on {addr}", listener.name)
            })?;
            statics.push(Socket {
                addr: *addr,
                listener: socket,
                serves: Serves::Listener {
                    name: listener.name.clone(),
                    direction: listener.direction,
                },
            });
        }
    }
    let configured = Configured {
        bootstrap,
        store,
        stats,
        xds: Some(XdsInputs {
            plan,
            main_thread: runtime.clone(),
            dns,
        }),
        binder,
        own_ports,
        on_ready: None,
        on_bound: None,
    };
    Ok((configured, statics))
}
