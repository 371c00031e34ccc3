//! [`ProxyInstance`]: one proxy, started from its [`ProxyInputs`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
use tokio::net::TcpStream;
use tokio::task::{AbortHandle, JoinSet};

use crate::connections::Connections;
pub use crate::listener_manager::BoundEvent;
use crate::listener_manager::{ListenerManager, OnBound, Socket};
use shunt_core::access_log::Direction;
use shunt_filters::tcp::{
    self, copy,
    handover::{self, Flows, ParkedFlow},
};
use shunt_listener::connection_handler::{self, Context, InternalListeners};
use shunt_upstream::internal::Acceptor;
use shunt_upstream::same_node::Handoff;
use shunt_xds::manager::{Binder, ListenerChange};
use shunt_xds::snapshot::Current;

/// Everything an instance is started from.
pub struct ProxyInputs {
    pub config: InstanceConfig,
    /// Sockets opened for it before it starts (bound while still root, or inside a pod,
    /// or handed over by another process).
    pub sockets: Vec<Socket>,
    pub scope: ConnectionScope,
    /// How long connections get to finish when a listener is removed or replaced.
    pub drain_time: Duration,
    /// Set once the instance serves its first configuration (its listeners accept; with
    /// xDS, the first response of each type is applied).
    pub ready: Arc<AtomicBool>,
    /// Set where established plain-TCP flows may be handed to another process (node
    /// mode's upgrade): the instance's copies can then be parked.
    pub flows: Option<Arc<Flows>>,
}

/// What an instance serves.
pub enum InstanceConfig {
    /// Istio's passthrough: no configuration, only the capture ports.
    Passthrough(Arc<tcp::Settings>),
    /// An Envoy bootstrap, static or from xDS.
    Configured(Box<Configured>),
}

/// A configured instance: its bootstrap compiled, and where its updates come from.
pub struct Configured {
    pub bootstrap: Bootstrap,
    /// The compiled snapshot, swapped by xDS.
    pub store: Arc<Current>,
    /// The instance's stats scope: its listeners, clusters and xDS count here.
    pub stats: shunt_core::stats::Store,
    pub xds: Option<XdsInputs>,
    /// How a listener's address is bound (in the host's network namespace, or inside a
    /// pod's, where sockets opened at enrollment are handed to the listener put there).
    pub binder: Binder,
    /// Ports this instance listens on besides its sockets' (ORIGINAL_DST loop
    /// protection).
    pub own_ports: Vec<u16>,
    /// Told when the instance becomes ready (the admin API's `/ready`).
    pub on_ready: Option<Box<dyn FnOnce() + Send>>,
    /// Told where configured listeners accept (the admin API's `/listeners`).
    pub on_bound: Option<OnBound>,
}

/// A configured instance's xDS.
pub struct XdsInputs {
    pub plan: shunt_xds::source::Plan,
    /// Envoy's main thread: the streams and their compiles run there, off the workers.
    pub main_thread: tokio::runtime::Handle,
    /// The DNS proxy's name table, set from NDS.
    pub dns: Option<Arc<shunt_dns::Tables>>,
}

/// Where an instance's connections run: for a pod of node mode, in the pod's network
/// namespace (its upstream sockets are made there) and as the pod's same-node client;
/// the instance adds its internal listeners.
pub use shunt_upstream::scope::ConnectionScope;

/// What every connection of one instance shares.
pub(crate) struct Shared {
    connections: Arc<Connections>,
    scope: ConnectionScope,
    served: Served,
    flows: Option<Arc<Flows>>,
}

enum Served {
    Passthrough(Arc<tcp::Settings>),
    /// The connections' scope holds the instance's internal listeners, which their
    /// upstreams reach.
    Configured {
        context: Arc<Context>,
    },
}

impl Shared {
    /// Runs `connection` in the instance's scope, counted and cuttable. Boxed first: the
    /// scope's layers each hold the future they wrap, and a connection's future is large
    /// (moved by value through them it overflowed a worker's stack).
    fn spawn(&self, connection: impl Future<Output = ()> + Send + 'static) {
        let connection: std::pin::Pin<Box<dyn Future<Output = ()> + Send>> = match &self.flows {
            Some(flows) => Box::pin(handover::scope(flows.clone(), connection)),
            None => Box::pin(connection),
        };
        self.connections.spawn(self.scope.clone().run(connection));
    }

    pub(crate) fn serve_listener(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        listener: Arc<str>,
        bound: SocketAddr,
    ) {
        let Served::Configured { context, .. } = &self.served else {
            tracing::error!(%listener, "a configured listener's socket on a passthrough instance");
            return;
        };
        self.spawn(connection_handler::handle(
            stream,
            peer,
            listener,
            bound,
            context.clone(),
        ));
    }

    pub(crate) fn serve_passthrough(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        direction: Direction,
        bound: SocketAddr,
    ) {
        let Served::Passthrough(settings) = &self.served else {
            tracing::error!(%bound, "a passthrough socket on a configured instance");
            return;
        };
        let settings = settings.clone();
        self.spawn(async move {
            crate::passthrough::handle(stream, peer, direction, bound.port(), &settings).await;
        });
    }

    pub(crate) fn add_own_ports(&self, ports: &[u16]) {
        let Served::Configured { context, .. } = &self.served else {
            return;
        };
        let mut own = context.own_ports.write().unwrap_or_else(|e| e.into_inner());
        let mut all = own.to_vec();
        all.extend_from_slice(ports);
        all.sort_unstable();
        all.dedup();
        *own = all.into();
    }
}

/// A running proxy instance. Dropping it does not stop it: [`ProxyInstance::stop`]
/// and [`ProxyInstance::drain`] do.
pub struct ProxyInstance {
    shared: Arc<Shared>,
    listeners: Arc<Mutex<ListenerManager>>,
    /// The configured instance's serve task (cluster warming, xDS changes).
    serving: Option<AbortHandle>,
    config: Option<Arc<Current>>,
    ready: Arc<AtomicBool>,
}

impl ProxyInstance {
    /// Starts the instance on `runtime` (its data plane).
    pub fn start(runtime: &tokio::runtime::Handle, inputs: ProxyInputs) -> anyhow::Result<Self> {
        let _entered = runtime.enter();
        let ProxyInputs {
            config,
            sockets,
            scope,
            drain_time,
            ready,
            flows,
        } = inputs;
        let connections = Arc::new(Connections::default());
        match config {
            InstanceConfig::Passthrough(settings) => {
                let shared = Arc::new(Shared {
                    connections,
                    scope,
                    served: Served::Passthrough(settings),
                    flows,
                });
                let mut listeners = ListenerManager::new(shared.clone(), None, drain_time);
                for socket in sockets {
                    listeners.add(socket)?;
                }
                ready.store(true, Ordering::SeqCst);
                Ok(ProxyInstance {
                    shared,
                    listeners: Arc::new(Mutex::new(listeners)),
                    serving: None,
                    config: None,
                    ready,
                })
            }
            InstanceConfig::Configured(configured) => {
                let shared = |served, internal| {
                    let mut scope = scope;
                    scope.internal = Some(internal);
                    Arc::new(Shared {
                        connections,
                        scope,
                        served,
                        flows,
                    })
                };
                Self::start_configured(*configured, sockets, shared, drain_time, ready)
            }
        }
    }

    fn start_configured(
        configured: Configured,
        sockets: Vec<Socket>,
        // The instance's shared part, made once its internal listeners exist.
        shared: impl FnOnce(Served, Arc<dyn Acceptor>) -> Arc<Shared>,
        drain_time: Duration,
        ready: Arc<AtomicBool>,
    ) -> anyhow::Result<Self> {
        let Configured {
            bootstrap,
            store,
            stats,
            xds,
            binder,
            mut own_ports,
            on_ready,
            on_bound,
        } = configured;
        own_ports.extend(sockets.iter().map(|s| s.addr.port()));
        own_ports.sort_unstable();
        own_ports.dedup();
        let context = Arc::new(Context {
            config: store.clone(),
            own_ports: RwLock::new(own_ports.into()),
            shutdown: Default::default(),
        });
        let internal: Arc<dyn Acceptor> = Arc::new(InternalListeners(context.clone()));
        let shared = shared(Served::Configured { context }, internal);
        let listeners = Arc::new(Mutex::new(ListenerManager::new(
            shared.clone(),
            on_bound,
            drain_time,
        )));
        let serve = Serve {
            store: store.clone(),
            listeners: listeners.clone(),
            ready: ready.clone(),
            on_ready,
        };
        let xds = xds.map(|x| (x, bootstrap, stats, binder));
        let serving = tokio::spawn(serve.run(sockets, xds)).abort_handle();
        Ok(ProxyInstance {
            shared,
            listeners,
            serving: Some(serving),
            config: Some(store),
            ready,
        })
    }

    /// Whether the instance serves its first configuration.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    /// The configured instance's snapshot store.
    pub fn config(&self) -> Option<&Arc<Current>> {
        self.config.as_ref()
    }

    pub fn connections(&self) -> &Arc<Connections> {
        &self.shared.connections
    }

    /// The configured listener accepting at `addr`, if any.
    pub fn listener_at(&self, addr: SocketAddr) -> Option<Arc<str>> {
        self.lock().listener_at(addr)
    }

    /// The addresses the instance accepts on.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.lock().addrs()
    }

    /// Serves a same-node connection handed over in process as if accepted on
    /// `listener` (bound at `port`).
    pub fn serve_handed(&self, handoff: Handoff, listener: Arc<str>, port: u16) {
        let Served::Configured { context, .. } = &self.shared.served else {
            return;
        };
        self.shared.spawn(connection_handler::handle_handed(
            handoff,
            listener,
            port,
            context.clone(),
        ));
    }

    /// The instance's parkable flows, where they may be handed over.
    pub fn flows(&self) -> Option<&Arc<Flows>> {
        self.shared.flows.as_ref()
    }

    /// Copies on a flow another process parked and handed here (its sockets, with
    /// whatever bytes wait in their queues), in this instance's scope: counted, drained
    /// and parkable again.
    pub fn resume(&self, flow: ParkedFlow) {
        self.shared.spawn(async move {
            let outcome = copy::copy_bidirectional(flow.downstream, flow.upstream).await;
            if let copy::End::Failed { side, error } = outcome.end {
                tracing::debug!(?side, %error, "a resumed flow ended abnormally");
            }
        });
    }

    /// Stops accepting on every listener, or on the INBOUND ones (Envoy's
    /// `/drain_listeners`); connections already accepted carry on.
    pub fn close_listeners(&self, inbound_only: bool) {
        self.lock().close(inbound_only);
    }

    /// Stops accepting and ends the instance's xDS streams (see
    /// [`ListenerManager::stop`] for `refuse`); connections carry on.
    pub fn stop(&self, refuse: bool) {
        if let Some(serving) = &self.serving {
            serving.abort();
        }
        self.lock().stop(refuse);
    }

    /// Tells HTTP connections to finish the requests in flight and close (Envoy's drain
    /// on shutdown), then waits for the connections to end, at most `drain_time`, and
    /// cuts the rest.
    pub async fn drain(&self, drain_time: Duration) {
        if let Served::Configured { context, .. } = &self.shared.served {
            context.shutdown.close_connections();
        }
        self.shared.connections.drain(drain_time).await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ListenerManager> {
        self.listeners.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A configured instance's serve task.
struct Serve {
    store: Arc<Current>,
    listeners: Arc<Mutex<ListenerManager>>,
    ready: Arc<AtomicBool>,
    on_ready: Option<Box<dyn FnOnce() + Send>>,
}

type XdsStart = (XdsInputs, Bootstrap, shunt_core::stats::Store, Binder);

impl Serve {
    async fn run(mut self, sockets: Vec<Socket>, xds: Option<XdsStart>) {
        warm_clusters(&self.store).await;
        let mut bound = Vec::new();
        {
            let mut listeners = self.lock();
            for socket in sockets {
                if let crate::Serves::Listener { name, .. } = &socket.serves {
                    bound.push((name.clone(), socket.addr));
                }
                let addr = socket.addr;
                if let Err(err) = listeners.add(socket) {
                    tracing::error!(%addr, %err, "registering a listener failed");
                }
            }
        }
        let Some((xds, bootstrap, stats, binder)) = xds else {
            self.became_ready();
            return;
        };
        // Ready once the first listeners accept: the manager sends them before it says
        // ready, and they are applied before readiness is told.
        let (configured, mut first_config) = tokio::sync::oneshot::channel();
        let mut changes = {
            let _on_main_thread = xds.main_thread.enter();
            shunt_xds::Manager::start(
                bootstrap,
                xds.plan,
                self.store.clone(),
                stats,
                Box::new(move || {
                    let _ = configured.send(());
                }),
                binder,
                bound,
                xds.dns,
            )
        };
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
                    self.became_ready();
                }
            }
        }
    }

    fn apply(&self, change: ListenerChange) {
        self.lock().apply(change);
    }

    fn became_ready(&mut self) {
        self.ready.store(true, Ordering::SeqCst);
        if let Some(on_ready) = self.on_ready.take() {
            on_ready();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ListenerManager> {
        self.listeners.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Envoy's cluster warming: first DNS answers and health checks before the first
/// connection.
async fn warm_clusters(store: &Current) {
    let mut warming = JoinSet::new();
    // A cluster not made yet is one whose making starts nothing.
    for cluster in store.load().clusters.made_clusters() {
        let cluster = cluster.clone();
        warming.spawn(async move { cluster.start().await });
    }
    while warming.join_next().await.is_some() {}
}
