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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};

use super::instance::PodStats;
use crate::PodInfo;
use shunt_agent::ca::{CaOptions, CertificateProvider};
use shunt_listener::connection_handler::{self, Context};
use shunt_upstream::same_node::{Client, Handoff};
use shunt_xds::local::LocalServers;
use shunt_xds::manager::ListenerChange;
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
        let (loaded, report) = shunt_config::check(&options)?;
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
/// sends the pod's name table.
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
}

/// What serving one of the pod's connections takes, shared by its accept loops and the
/// same-node directory.
pub struct Handle {
    context: Arc<Context>,
    netns: Arc<OwnedFd>,
    stats: Arc<PodStats>,
    cut: watch::Receiver<bool>,
    /// The pod as a same-node client (the fast path on).
    client: Option<Arc<Client>>,
    /// The listener names of the pod's bound sockets, by address.
    bound: Mutex<HashMap<SocketAddr, Arc<str>>>,
}

impl Handle {
    /// The pod's listener bound at `addr`, if any.
    pub fn listener_at(&self, addr: SocketAddr) -> Option<Arc<str>> {
        let bound = self.bound.lock().unwrap_or_else(|e| e.into_inner());
        bound.get(&addr).cloned()
    }

    /// Serves a same-node connection handed over in process on `listener`.
    pub fn serve_handed(&self, handoff: Handoff, listener: Arc<str>, port: u16) {
        let handled =
            connection_handler::handle_handed(handoff, listener, port, self.context.clone());
        self.spawn(handled);
    }

    /// Runs one connection of the pod: counted, in the pod's namespace (and as the
    /// pod's client when the fast path is on), cut when the pod's drain is over.
    fn spawn(&self, handled: impl std::future::Future<Output = ()> + Send + 'static) {
        let stats = self.stats.clone();
        super::fast_path::count(&stats);
        let netns = self.netns.clone();
        let client = self.client.clone();
        let mut cut = self.cut.clone();
        tokio::spawn(async move {
            let handled = shunt_upstream::netns::scope(netns, async move {
                match client {
                    Some(client) => shunt_upstream::same_node::scope(client, handled).await,
                    None => handled.await,
                }
            });
            tokio::select! {
                () = handled => {}
                _ = cut.wait_for(|c| *c) => {}
            }
            stats.downstream_cx_active.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// A pod's running proxy. Stopping it ([`PodProxy::stop`]) closes its listeners (other
/// than the capture sockets, which the instance owns) and ends its xDS streams.
pub struct PodProxy {
    serving: JoinHandle<()>,
    /// The pod's own stats (Envoy's names, not prefixed by the pod).
    pub stats: shunt_core::stats::Store,
    pub config: Arc<Current>,
    pub handle: Arc<Handle>,
}

/// What the pod's proxy is started with, besides its sockets.
pub struct Setup {
    pub bootstrap: Bootstrap,
    /// In-process xDS servers (the pod's SDS), by the socket path the bootstrap names.
    pub local: LocalServers,
    pub drain_time: Duration,
    /// The pod as a same-node client; `None`: the fast path is off.
    pub client: Option<Arc<Client>>,
    /// The pod's stats store (its DNS proxy counts there too).
    pub stats: shunt_core::stats::Store,
    /// The pod's DNS proxy's name table, which the pod's ADS stream then asks for.
    pub dns: Option<Arc<shunt_dns::Tables>>,
}

/// The connection-level pieces the instance shares with its proxy.
pub struct Shared {
    pub netns: Arc<OwnedFd>,
    pub stats: Arc<PodStats>,
    pub cut: watch::Receiver<bool>,
    /// Set once the first configuration is in (the health port says ready).
    pub ready: Arc<AtomicBool>,
}

impl PodProxy {
    /// Compiles the pod's bootstrap, starts its xDS manager and its serve loop on
    /// `runtime`. `capture` are the sockets opened at enrollment, by address: a
    /// listener the control plane puts at one of them accepts on it.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        setup: Setup,
        capture: Vec<(SocketAddr, std::net::TcpListener)>,
        shared: Shared,
    ) -> anyhow::Result<PodProxy> {
        let _entered = runtime.enter();
        let Setup {
            bootstrap,
            local,
            drain_time,
            client,
            stats,
            dns,
        } = setup;
        let mut plan = shunt_xds::source::plan(&bootstrap)?
            .context("the node's bootstrap has no dynamic_resources: pods would get no config")?;
        plan.local = local;
        if let Some(tables) = &dns
            && !plan.add_name_table()
        {
            tracing::warn!("the pod's DNS proxy without an ADS stream: forwarding every query");
            let _ = tables.apply(Default::default(), "");
        }
        let compiled = snapshot::compile(&bootstrap, &stats)?;
        let config = Arc::new(Current::new(compiled.snapshot));
        let own_ports: Vec<u16> = capture.iter().map(|(a, _)| a.port()).collect();
        let context = Arc::new(Context {
            config: config.clone(),
            own_ports: std::sync::RwLock::new(own_ports.into()),
            shutdown: Default::default(),
        });
        let capture: HashMap<SocketAddr, std::net::TcpListener> = capture.into_iter().collect();
        let netns = shared.netns.clone();
        let binder: shunt_xds::manager::Binder = Arc::new(move |listener, addr| {
            match capture.get(&addr) {
                // The same socket (a second descriptor): its backlog is the pod's.
                Some(socket) => socket.try_clone(),
                None => super::listen::bind_listener(&netns, listener, addr),
            }
        });
        // Static listeners of the bootstrap, other than the health ports the instance
        // serves itself.
        let health = shunt_config::health_ports::find(&bootstrap);
        let mut bound = Vec::new();
        for listener in config.load().listeners.iter().filter(|l| l.bind_to_port) {
            if health.iter().any(|h| *h.name == *listener.name) {
                continue;
            }
            for addr in &listener.addresses {
                let socket = binder(listener, *addr).with_context(|| {
                    format!("listener {:?}: cannot listen on {addr}", listener.name)
                })?;
                bound.push(shunt_xds::manager::BoundSocket {
                    listener: listener.name.clone(),
                    direction: listener.direction,
                    addr: *addr,
                    socket,
                });
            }
        }
        // Ready once the serve loop accepts on the first listeners (the manager sends
        // them before it says ready), so the fast path finds them too.
        let (configured, first_config) = tokio::sync::oneshot::channel();
        let changes = shunt_xds::Manager::start(
            bootstrap,
            plan,
            config.clone(),
            stats.clone(),
            Box::new(move || {
                let _ = configured.send(());
            }),
            binder,
            bound.iter().map(|b| (b.listener.clone(), b.addr)),
            dns,
        );
        let handle = Arc::new(Handle {
            context,
            netns: shared.netns,
            stats: shared.stats,
            cut: shared.cut,
            client,
            bound: Mutex::default(),
        });
        let serve = Serve {
            handle: handle.clone(),
            ready: shared.ready,
            drain_time,
            accepting: JoinSet::new(),
            loops: Vec::new(),
        };
        let serving = runtime.spawn(serve.run(
            config.clone(),
            ListenerChange {
                bound,
                ..Default::default()
            },
            changes,
            first_config,
        ));
        Ok(PodProxy {
            serving,
            stats,
            config,
            handle,
        })
    }

    /// Stops accepting on every listener of the pod's config and ends its xDS streams;
    /// HTTP connections are told to close after the requests in flight.
    pub fn stop(&self) {
        self.serving.abort();
        self.handle.context.shutdown.close_connections();
    }
}

struct Serve {
    handle: Arc<Handle>,
    ready: Arc<AtomicBool>,
    drain_time: Duration,
    accepting: JoinSet<()>,
    /// (listener, address, its accept loop)
    loops: Vec<(Arc<str>, SocketAddr, AbortHandle)>,
}

impl Serve {
    async fn run(
        mut self,
        config: Arc<Current>,
        initial: ListenerChange,
        mut changes: tokio::sync::mpsc::UnboundedReceiver<ListenerChange>,
        mut first_config: tokio::sync::oneshot::Receiver<()>,
    ) {
        // Cluster warming, as the proxy's: first DNS answers before the first connection.
        let snapshot = config.load();
        let mut warming = JoinSet::new();
        for cluster in snapshot.clusters.values() {
            let cluster = cluster.clone();
            warming.spawn(async move { cluster.start().await });
        }
        while warming.join_next().await.is_some() {}
        drop(snapshot);
        self.apply(initial);
        loop {
            tokio::select! {
                change = changes.recv() => match change {
                    Some(change) => self.apply(change),
                    None => return,
                },
                Ok(()) = &mut first_config, if !self.ready.load(Ordering::SeqCst) => {
                    while let Ok(change) = changes.try_recv() {
                        self.apply(change);
                    }
                    self.ready.store(true, Ordering::SeqCst);
                }
                Some(_) = self.accepting.join_next() => {}
            }
        }
    }

    fn apply(&mut self, change: ListenerChange) {
        let context = &self.handle.context;
        let mut names = self.handle.bound.lock().unwrap_or_else(|e| e.into_inner());
        for (name, addr) in &change.unbound {
            if names.get(addr) == Some(name) {
                names.remove(addr);
            }
            self.loops.retain(|(l, a, handle)| {
                let gone = l == name && a == addr;
                if gone {
                    handle.abort();
                }
                !gone
            });
        }
        let mut ports: Vec<u16> = context
            .own_ports
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .to_vec();
        for b in change.bound {
            let listener = match TcpListener::from_std(b.socket) {
                Ok(listener) => listener,
                Err(err) => {
                    tracing::error!(listener = %b.listener, addr = %b.addr, %err, "registering a pod's listener failed");
                    continue;
                }
            };
            tracing::debug!(listener = %b.listener, addr = %b.addr, "pod listening");
            ports.push(b.addr.port());
            names.insert(b.addr, b.listener.clone());
            let accept = Accept {
                listener,
                name: b.listener.clone(),
                addr: b.addr,
                handle: self.handle.clone(),
            };
            let handle = self.accepting.spawn(accept.run());
            self.loops.push((b.listener, b.addr, handle));
        }
        ports.sort_unstable();
        ports.dedup();
        *context.own_ports.write().unwrap_or_else(|e| e.into_inner()) = ports.into();
        if !change.retired.is_empty() {
            let (retired, drain_time) = (change.retired, self.drain_time);
            tokio::spawn(async move {
                tokio::time::sleep(drain_time).await;
                for listener in retired {
                    listener.draining.close_connections();
                }
            });
        }
    }
}

struct Accept {
    listener: TcpListener,
    name: Arc<str>,
    addr: SocketAddr,
    handle: Arc<Handle>,
}

impl Accept {
    async fn run(self) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => self.spawn(stream, peer),
                Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(err) => {
                    tracing::warn!(listener = %self.name, addr = %self.addr, %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn spawn(&self, stream: tokio::net::TcpStream, peer: SocketAddr) {
        let handled = connection_handler::handle(
            stream,
            peer,
            self.name.clone(),
            self.addr,
            self.handle.context.clone(),
        );
        self.handle.spawn(handled);
    }
}
