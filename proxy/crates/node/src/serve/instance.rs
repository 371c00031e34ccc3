//! One pod's proxy: a [`ProxyInstance`] on the node's shared runtime whose connections
//! run in the pod (its network namespace, its same-node client), serving the pod's
//! capture ports as the passthrough or as its control plane configures it ([`proxy`]),
//! with the pod's health (15021) and stats (15090) ports as local replies. Which pod a
//! connection belongs to is known from the listener that accepted it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::listen::{PodListener, Role};
use super::proxy::{self, Setup};
use shunt_filters::tcp;
use shunt_filters::tcp::handover::{Flows, ParkedFlow};
use shunt_instance::local_reply::{self, LocalReply};
use shunt_instance::{ConnectionScope, InstanceConfig, ProxyInputs, ProxyInstance, Serves, Socket};

/// A running pod; dropping it does not stop it, [`Instance::stop`] does.
pub struct Instance {
    pub proxy: Arc<ProxyInstance>,
    /// The sockets opened at enrollment (second handles): what an upgrade hands over,
    /// and what a stop shuts at once.
    enrolled: Vec<(Role, SocketAddr, std::net::TcpListener)>,
    pub addrs: Vec<SocketAddr>,
    /// Whether the pod's proxy has its first configuration (always, for passthrough).
    pub ready: Arc<AtomicBool>,
    /// Whether the pod's proxy comes from the control plane.
    pub configured: bool,
}

pub struct Settings {
    pub tcp: Arc<tcp::Settings>,
    pub drain_time: Duration,
    /// The pod's own stats store, which its 15090 shows.
    pub stats: shunt_core::stats::Store,
    pub scrape: Arc<shunt_admin::StatsScrape>,
}

impl Instance {
    /// Starts serving `listeners` on `runtime`, the pod's connections in `scope`. With
    /// `xds` the capture listeners are the pod's proxy's (its config decides what they
    /// do); without, they are the passthrough proxy's.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        listeners: Vec<PodListener>,
        scope: ConnectionScope,
        settings: &Settings,
        xds: Option<Setup>,
    ) -> anyhow::Result<Instance> {
        let ready = Arc::new(AtomicBool::new(false));
        let mut enrolled = Vec::new();
        let mut addrs = Vec::new();
        let mut sockets = Vec::new();
        let mut capture = Vec::new();
        let configured = xds.is_some();
        for l in listeners {
            enrolled.push((l.role, l.addr, l.listener.try_clone()?));
            addrs.push(l.addr);
            let serves = match l.role {
                // A configured pod's capture ports go to the listeners its control plane
                // puts there; until then connections wait in their backlog.
                Role::Capture(_) if configured => {
                    capture.push((l.addr, l.listener));
                    continue;
                }
                Role::Capture(direction) => Serves::Passthrough(direction),
                Role::Health => Serves::LocalReply(Arc::new(Health(ready.clone()))),
                Role::Prometheus => Serves::LocalReply(Arc::new(PodStats {
                    store: settings.stats.clone(),
                    scrape: settings.scrape.clone(),
                })),
            };
            sockets.push(Socket {
                addr: l.addr,
                listener: l.listener,
                serves,
            });
        }
        let netns = scope.netns.clone();
        let config = match xds {
            Some(setup) => {
                let netns = netns.ok_or_else(|| anyhow::anyhow!("a pod without a namespace"))?;
                let (configured, statics) = proxy::configure(runtime, setup, capture, netns)?;
                sockets.extend(statics);
                InstanceConfig::Configured(Box::new(configured))
            }
            None => InstanceConfig::Passthrough(settings.tcp.clone()),
        };
        let inputs = ProxyInputs {
            config,
            sockets,
            scope,
            drain_time: settings.drain_time,
            ready: ready.clone(),
            // An upgrade hands the pod's plain-TCP flows to the next process.
            flows: Some(Arc::default()),
        };
        let proxy = Arc::new(ProxyInstance::start(runtime, inputs)?);
        Ok(Instance {
            proxy,
            enrolled,
            addrs,
            ready,
            configured,
        })
    }

    /// The sockets opened at enrollment with their roles and addresses.
    pub fn listeners(&self) -> impl Iterator<Item = (Role, SocketAddr, &std::net::TcpListener)> {
        self.enrolled.iter().map(|(r, a, l)| (*r, *a, l))
    }

    /// Closes the listeners at once (a connect is refused from now on); open
    /// connections run on for `drain_time`, then are cut.
    pub fn stop(self, runtime: &tokio::runtime::Handle, drain_time: Duration) {
        for (_, _, socket) in &self.enrolled {
            let _ = socket2::SockRef::from(socket).shutdown(std::net::Shutdown::Both);
        }
        self.proxy.stop(true);
        drop(Self::drain(self.proxy, runtime, drain_time));
    }

    /// Stops accepting here but leaves the sockets listening (a new process accepts on
    /// them now) and parks the plain-TCP flows (they arrive on the returned receiver, to
    /// be handed on); other connections run on for `drain_time`, then are cut. The
    /// handle ends with the drain.
    pub fn release(
        self,
        runtime: &tokio::runtime::Handle,
        drain_time: Duration,
    ) -> (tokio::task::JoinHandle<()>, Option<ParkedFlows>) {
        self.proxy.stop(false);
        let parked = self.proxy.flows().and_then(|flows| {
            let receiver = flows.parked()?;
            flows.park_all();
            Some(ParkedFlows {
                flows: flows.clone(),
                receiver,
            })
        });
        (Self::drain(self.proxy, runtime, drain_time), parked)
    }

    /// Copies on a flow handed from the previous process.
    pub fn resume(&self, flow: ParkedFlow) {
        self.proxy.resume(flow);
    }

    fn drain(
        proxy: Arc<ProxyInstance>,
        runtime: &tokio::runtime::Handle,
        drain_time: Duration,
    ) -> tokio::task::JoinHandle<()> {
        runtime.spawn(async move { proxy.drain(drain_time).await })
    }
}

/// A released instance's flows as they park.
pub struct ParkedFlows {
    pub flows: Arc<Flows>,
    pub receiver: tokio::sync::mpsc::UnboundedReceiver<ParkedFlow>,
}

/// The health port: `GET /healthz/ready` is 200 while the pod is served (the instance
/// only exists then) and its proxy has its first configuration (503 before), anything
/// else 404.
struct Health(Arc<AtomicBool>);

impl LocalReply for Health {
    fn reply(&self, method: &str, path: &str) -> Vec<u8> {
        let asked = matches!(method, "GET" | "HEAD") && path == "/healthz/ready";
        if asked && self.0.load(Ordering::SeqCst) {
            local_reply::status_only("200 OK")
        } else if asked {
            local_reply::status_only("503 Service Unavailable")
        } else {
            local_reply::status_only("404 Not Found")
        }
    }
}

/// The pod's Prometheus port: `GET /stats/prometheus` is the pod's own stats (its
/// store: its proxy's and its DNS proxy's), as Envoy writes them; anything else 404.
struct PodStats {
    store: shunt_core::stats::Store,
    scrape: Arc<shunt_admin::StatsScrape>,
}

impl LocalReply for PodStats {
    fn reply(&self, method: &str, path: &str) -> Vec<u8> {
        if method == "GET" && path == "/stats/prometheus" {
            let body = self.scrape.render(&self.store);
            local_reply::ok("text/plain; version=0.0.4", &body)
        } else {
            local_reply::status_only("404 Not Found")
        }
    }
}
