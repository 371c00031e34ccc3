//! Serving: [`NodePods`], the [`Pods`] the enrollers call. Each pod gets its own proxy
//! instance in this one process: its listeners (15001 and 15006 for captured traffic,
//! 15021 for health, each on 0.0.0.0 and [::]; with DNS on, the DNS proxy ([`dns`]) on
//! the pod's loopback 15053) are opened *inside the pod's network
//! namespace* ([`listen`]), and the connections they accept make their upstream
//! connections from inside it too ([`shunt_upstream::netns`]), so the pod's addresses
//! are the sources and destinations on the wire. A connection's pod is the pod whose
//! listener accepted it. Instances share the runtime and the read-only data; each has
//! its own stats ([`instance::PodStats`]) and xDS node ([`xds_node_id`]).
//!
//! The process's threads stay in the node's namespace: only the `socket()` calls run,
//! for an instant, in a pod's.

pub mod capture;
pub mod dns;
pub mod fast_path;
pub mod handover;
pub mod instance;
pub mod listen;
pub mod proxy;

use std::collections::HashMap;
use std::net::IpAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use super::{EnrollError, PodInfo, Pods};
use instance::Instance;
use listen::Role;
use shunt_core::access_log::Direction;
use shunt_filters::tcp;

/// How pods are served; the defaults are an Istio sidecar's ports.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Captured outbound traffic (istio-iptables -p).
    pub outbound_port: u16,
    /// Captured inbound traffic (istio-iptables -z).
    pub inbound_port: u16,
    /// The health port with `/healthz/ready`; 0 turns it off.
    pub health_port: u16,
    /// The pod's own stats at `/stats/prometheus`; 0 turns it off.
    pub prometheus_port: u16,
    /// Time allowed for an upstream connect.
    pub connect_timeout: Duration,
    /// Time a removed pod's connections have to finish.
    pub drain_time: Duration,
    /// Same-node fast path: a pod's mTLS connection to another pod of this process is
    /// handed to that pod's inbound side in process (no sockets, no TLS records).
    pub fast_path: bool,
    /// Each pod's DNS proxy on its loopback (for the capture's `--redirect-dns`);
    /// `None`: no DNS proxy.
    pub dns: Option<dns::DnsOptions>,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            outbound_port: 15001,
            inbound_port: 15006,
            health_port: 15021,
            prometheus_port: 15090,
            connect_timeout: Duration::from_secs(10),
            drain_time: Duration::from_secs(5),
            fast_path: true,
            dns: None,
        }
    }
}

/// What enrolling a pod does in the kernel (capture), besides opening its listeners.
/// `shunt_capture::node::NodeCapture` is the eBPF one; tests may leave it out.
pub trait PodCapture: Send + Sync {
    /// Captures the pod's traffic. Called before its listeners open.
    fn enroll(&self, pod: &PodInfo, netns: &OwnedFd) -> anyhow::Result<()>;
    /// Releases the pod. Called after its listeners closed.
    fn withdraw(&self, pod: &PodInfo, netns: &OwnedFd) -> anyhow::Result<()>;
}

/// Every pod this node serves. Cheap to share (`Arc`); [`Pods`] is its enrollment API.
pub struct NodePods {
    options: NodeOptions,
    runtime: tokio::runtime::Handle,
    capture: Option<Box<dyn PodCapture>>,
    tcp: Arc<tcp::Settings>,
    pods: Mutex<HashMap<String, Served>>,
    /// Per-pod proxies from the control plane; `None`: every pod gets the passthrough.
    config: Option<proxy::Template>,
    certificates: proxy::Certificates,
    /// The pods by address, for the same-node fast path.
    registry: Arc<fast_path::Registry>,
    /// How a pod's 15090 writes its stats (the template's `stats_config`).
    scrape: Arc<shunt_admin::StatsScrape>,
    /// The pods' xDS streams share their connections to the control plane.
    channels: Option<Arc<shunt_xds::stream::ChannelPool>>,
    /// Returns free heap to the kernel (see [`HeapTrim`]); with per-pod proxies only.
    _heap_trim: Option<HeapTrim>,
}

/// Every [`HEAP_TRIM_EVERY`], hands glibc's free heap back to the kernel once it holds
/// [`HEAP_TRIM_FREE`]: each pod's first push (its response, decoded on a worker thread,
/// and the compile's temporaries) is freed into that thread's arena, which keeps the
/// pages (as `shunt proxy` does for its own updates). Stops when dropped.
struct HeapTrim(tokio::task::AbortHandle);

const HEAP_TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
const HEAP_TRIM_FREE: usize = 8 << 20;

impl HeapTrim {
    fn start(runtime: &tokio::runtime::Handle) -> HeapTrim {
        let task = runtime.spawn(async {
            let mut every = tokio::time::interval(HEAP_TRIM_EVERY);
            loop {
                every.tick().await;
                if let Some(free) = shunt_config::periodic_trim(HEAP_TRIM_FREE) {
                    tracing::debug!(free, "free heap returned to the kernel");
                }
            }
        });
        HeapTrim(task.abort_handle())
    }
}

impl Drop for HeapTrim {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Served {
    info: PodInfo,
    netns: Arc<OwnedFd>,
    netns_inode: u64,
    instance: Instance,
    node_id: String,
    dns: Option<dns::PodDnsProxy>,
    /// The pod's stats store.
    stats: shunt_core::stats::Store,
}

/// A served pod as the admin side sees it.
#[derive(Debug, Clone)]
pub struct PodSummary {
    pub info: PodInfo,
    pub node_id: String,
    pub listeners: Vec<std::net::SocketAddr>,
    pub downstream_cx_total: u64,
    pub downstream_cx_active: u64,
    /// Whether the pod's proxy has its first configuration.
    pub ready: bool,
}

impl NodePods {
    /// Pods are served on `runtime` (the node's data-plane runtime, shared by every pod).
    pub fn new(
        options: NodeOptions,
        runtime: tokio::runtime::Handle,
        capture: Option<Box<dyn PodCapture>>,
    ) -> NodePods {
        let mut own_ports = vec![options.outbound_port, options.inbound_port];
        own_ports.retain(|p| *p != 0);
        let tcp = Arc::new(tcp::Settings {
            connect_timeout: options.connect_timeout,
            own_ports,
        });
        NodePods {
            options,
            runtime,
            capture,
            tcp,
            pods: Mutex::default(),
            config: None,
            certificates: proxy::Certificates::default(),
            registry: Arc::default(),
            scrape: Arc::new(shunt_admin::StatsScrape::new(&Default::default())),
            channels: None,
            _heap_trim: None,
        }
    }

    /// Each pod gets a proxy of its own from the control plane `template` names, its
    /// certificate from the template's CA, instead of the passthrough.
    pub fn with_config(mut self, template: proxy::Template) -> NodePods {
        // One connection to the control plane, a stream per pod on it.
        self.channels = Some(Arc::default());
        self._heap_trim = Some(HeapTrim::start(&self.runtime));
        // Pods with the same push share what it compiles to.
        shunt_core::interned::share_compiled();
        self.scrape = Arc::new(shunt_admin::StatsScrape::new(&template.bootstrap));
        self.config = Some(template);
        self
    }

    /// A pod's own stats store (what its 15090 shows: its proxy's and its DNS
    /// proxy's counters), by uid.
    pub fn proxy_stats(&self, uid: &str) -> Option<shunt_core::stats::Store> {
        Some(self.lock().get(uid)?.stats.clone())
    }

    /// A pod's config as its `/config_dump` shows it (static and xDS resources), by uid;
    /// `None` for a pod without a proxy from the control plane.
    pub fn proxy_resources(&self, uid: &str) -> Option<shunt_config::Resources> {
        let pods = self.lock();
        let config = pods.get(uid)?.instance.proxy.config()?;
        Some(config.load().resources())
    }

    /// How many CA clients run: one per service account of the pods served.
    pub fn certificate_accounts(&self) -> usize {
        self.certificates.accounts()
    }

    /// The pod's proxy setup, when pods are configured from the control plane: its
    /// stats go to `stats`, its name table (NDS) to `dns`.
    fn setup(
        &self,
        pod: &PodInfo,
        stats: &shunt_core::stats::Store,
        dns: Option<&dns::PodDnsProxy>,
    ) -> Option<proxy::Setup> {
        let Some(template) = self.config.as_ref() else {
            // The passthrough has no xDS: the pod's DNS proxy forwards every name.
            if let Some(dns) = dns {
                let _ = dns.tables.apply(Default::default(), "");
            }
            return None;
        };
        let mut local = shunt_xds::local::LocalServers::default();
        if let Some(ca) = &template.ca {
            let provider = self.certificates.provider(
                &self.runtime,
                ca,
                &pod.namespace,
                proxy::service_account(pod),
                pod.token_path.as_deref(),
            );
            local.insert(
                std::path::Path::new(shunt_agent::sds::DEFAULT_SOCKET),
                shunt_agent::sds::local(provider),
            );
        }
        Some(proxy::Setup {
            bootstrap: proxy::pod_bootstrap(&template.bootstrap, pod, dns.is_some()),
            local,
            stats: stats.clone(),
            dns: dns.map(|d| d.tables.clone()),
            channels: self.channels.clone(),
        })
    }

    /// Where the pod's connections run: in its network namespace, and, with a proxy from
    /// the control plane and the fast path on, as its same-node client.
    fn scope(
        &self,
        pod: &PodInfo,
        netns: Arc<OwnedFd>,
        configured: bool,
    ) -> shunt_instance::ConnectionScope {
        shunt_instance::ConnectionScope {
            netns: Some(netns),
            same_node: (configured && self.options.fast_path)
                .then(|| self.registry.client(&pod.ips)),
            // A configured instance adds its own internal listeners.
            internal: None,
        }
    }

    /// Gives back what [`NodePods::setup`] took for the pod (its CA client's share).
    fn release(&self, pod: &PodInfo) {
        if self.config.as_ref().is_some_and(|t| t.ca.is_some()) {
            self.certificates
                .release(&pod.namespace, proxy::service_account(pod));
        }
    }

    /// Lists the pod for the fast path (with a proxy from the control plane and the
    /// fast path on).
    fn register(&self, pod: &PodInfo, instance: &Instance) {
        if instance.configured && self.options.fast_path {
            let inbound = fast_path::Inbound {
                proxy: instance.proxy.clone(),
                inbound_port: self.options.inbound_port,
            };
            self.registry.insert(&pod.ips, Arc::new(inbound));
        }
    }

    /// The served pods with their listeners and counters.
    pub fn summaries(&self) -> Vec<PodSummary> {
        let pods = self.lock();
        let mut out: Vec<_> = pods
            .values()
            .map(|s| PodSummary {
                info: s.info.clone(),
                node_id: s.node_id.clone(),
                listeners: s.instance.addrs.clone(),
                downstream_cx_total: s.instance.proxy.connections().total(),
                downstream_cx_active: s.instance.proxy.connections().active() as u64,
                ready: s.instance.ready.load(ORDER),
            })
            .collect();
        out.sort_by(|a, b| a.info.uid.cmp(&b.info.uid));
        out
    }

    /// Whether the pod `uid` is served and its proxy has its first configuration: what
    /// [`NodePods::summaries`] says of it, without a summary of every pod.
    pub fn ready(&self, uid: &str) -> bool {
        self.lock()
            .get(uid)
            .is_some_and(|s| s.instance.ready.load(ORDER))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Served>> {
        self.pods.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn enroll_error(pod: &PodInfo, reason: impl std::fmt::Display) -> EnrollError {
        EnrollError {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            reason: reason.to_string(),
        }
    }

    /// What every instance is started with; `stats` is the pod's store (its 15090).
    fn settings(&self, stats: &shunt_core::stats::Store) -> instance::Settings {
        instance::Settings {
            tcp: self.tcp.clone(),
            drain_time: self.options.drain_time,
            stats: stats.clone(),
            scrape: self.scrape.clone(),
        }
    }

    /// Starts the pod's DNS proxy, when DNS is on, on `handed` sockets if any.
    fn start_dns(
        &self,
        pod: &PodInfo,
        netns: &OwnedFd,
        stats: &shunt_core::stats::Store,
        handed: Vec<dns::DnsSocket>,
    ) -> anyhow::Result<Option<dns::PodDnsProxy>> {
        let Some(options) = &self.options.dns else {
            return Ok(None);
        };
        let netns = Arc::new(netns.try_clone()?);
        let proxy = dns::PodDnsProxy::start(&self.runtime, options, pod, netns, stats, handed)?;
        Ok(Some(proxy))
    }

    /// Opens every listener of the pod, or none.
    fn open_listeners(&self, netns: &OwnedFd) -> std::io::Result<Vec<listen::PodListener>> {
        let o = &self.options;
        let mut all = Vec::new();
        for (role, port) in [
            (Role::Capture(Direction::Outbound), o.outbound_port),
            (Role::Capture(Direction::Inbound), o.inbound_port),
            (Role::Health, o.health_port),
            (Role::Prometheus, o.prometheus_port),
        ] {
            if port != 0 {
                // On error the ones opened so far close as `all` drops.
                all.extend(listen::open(netns, role, port)?);
            }
        }
        Ok(all)
    }

    /// Captures and serves `pod`. If serving fails, a fresh enrollment (`undo`) takes
    /// the capture back (the runtime will not run the pod); a restored one keeps it
    /// (the pod runs: its failure policy holds until it is served).
    fn start(&self, pod: &PodInfo, netns: OwnedFd, undo: bool) -> Result<Served, EnrollError> {
        let started = Instant::now();
        let netns_inode = inode(&netns)
            .map_err(|e| Self::enroll_error(pod, format!("the network namespace handle: {e}")))?;
        if let Some(capture) = &self.capture {
            capture
                .enroll(pod, &netns)
                .map_err(|e| Self::enroll_error(pod, format!("capture: {e:#}")))?;
        }
        let stats = shunt_core::stats::Store::new();
        let mut pod_dns = None;
        let opened = self
            .open_listeners(&netns)
            .map_err(anyhow::Error::from)
            .and_then(|listeners| {
                pod_dns = self
                    .start_dns(pod, &netns, &stats, Vec::new())
                    .context("DNS proxy")?;
                let netns = Arc::new(netns.try_clone()?);
                let settings = self.settings(&stats);
                let setup = self.setup(pod, &stats, pod_dns.as_ref());
                let configured = setup.is_some();
                let scope = self.scope(pod, netns, configured);
                Instance::start(&self.runtime, listeners, scope, &settings, setup).inspect_err(
                    |_| {
                        if configured {
                            self.release(pod);
                        }
                    },
                )
            });
        let instance = match opened {
            Ok(instance) => instance,
            Err(err) => {
                if let Some(dns) = &pod_dns {
                    dns.stop();
                }
                if let Some(capture) = self.capture.as_ref().filter(|_| undo)
                    && let Err(undo) = capture.withdraw(pod, &netns)
                {
                    tracing::warn!(pod = %pod.name, %undo, "undoing capture failed");
                }
                return Err(Self::enroll_error(pod, format!("listeners: {err:#}")));
            }
        };
        self.register(pod, &instance);
        tracing::info!(
            pod = %format_args!("{}/{}", pod.namespace, pod.name),
            uid = %pod.uid,
            listeners = instance.addrs.len(),
            took_us = started.elapsed().as_micros() as u64,
            "serving pod"
        );
        Ok(Served {
            node_id: xds_node_id(pod),
            info: pod.clone(),
            netns: Arc::new(netns),
            netns_inode,
            instance,
            dns: pod_dns,
            stats,
        })
    }

    /// Serves a pod whose listeners (and DNS sockets) were opened elsewhere (handed
    /// over by the process this one replaces); its capture is refreshed, its sockets
    /// kept.
    pub fn adopt(
        &self,
        pod: PodInfo,
        netns: OwnedFd,
        listeners: Vec<listen::PodListener>,
        dns: Vec<dns::DnsSocket>,
    ) -> Result<(), EnrollError> {
        let netns_inode = inode(&netns).map_err(|e| Self::enroll_error(&pod, e))?;
        if let Some(capture) = &self.capture {
            capture
                .enroll(&pod, &netns)
                .map_err(|e| Self::enroll_error(&pod, format!("capture: {e:#}")))?;
        }
        let netns = Arc::new(netns);
        // The old process's DNS sockets; from a process that handed none, new ones are
        // bound beside its own (SO_REUSEPORT), both answering until it exits.
        let stats = shunt_core::stats::Store::new();
        let pod_dns = self
            .start_dns(&pod, &netns, &stats, dns)
            .unwrap_or_else(|err| {
                tracing::warn!(pod = %pod.name, "DNS proxy not started: {err:#}");
                None
            });
        let settings = self.settings(&stats);
        let setup = self.setup(&pod, &stats, pod_dns.as_ref());
        let configured = setup.is_some();
        let scope = self.scope(&pod, netns.clone(), configured);
        let instance =
            Instance::start(&self.runtime, listeners, scope, &settings, setup).map_err(|e| {
                if configured {
                    self.release(&pod);
                }
                if let Some(dns) = &pod_dns {
                    dns.stop();
                }
                Self::enroll_error(&pod, format!("listeners: {e:#}"))
            })?;
        self.register(&pod, &instance);
        let served = Served {
            node_id: xds_node_id(&pod),
            info: pod.clone(),
            netns,
            netns_inode,
            instance,
            dns: pod_dns,
            stats,
        };
        if let Some(old) = self.lock().insert(pod.uid, served) {
            self.stop(old);
        }
        Ok(())
    }

    fn stop(&self, served: Served) {
        if served.instance.configured {
            self.registry
                .remove(&served.info.ips, &served.instance.proxy);
        }
        if let Some(dns) = &served.dns {
            dns.stop();
        }
        if served.instance.configured {
            self.release(&served.info);
        }
        served.instance.stop(&self.runtime, self.options.drain_time);
        if let Some(capture) = &self.capture
            && let Err(err) = capture.withdraw(&served.info, &served.netns)
        {
            tracing::warn!(pod = %served.info.name, %err, "withdrawing capture failed");
        }
        tracing::info!(
            pod = %format_args!("{}/{}", served.info.namespace, served.info.name),
            uid = %served.info.uid,
            "stopped serving pod"
        );
    }
}

const ORDER: std::sync::atomic::Ordering = std::sync::atomic::Ordering::Relaxed;

impl NodePods {
    fn enroll(&self, pod: PodInfo, netns: OwnedFd, undo: bool) -> Result<(), EnrollError> {
        let mut pods = self.lock();
        if let Some(served) = pods.get(&pod.uid) {
            // A repeated ADD of the same sandbox: nothing to do. Another namespace under
            // the same uid (the sandbox was recreated): serve the new one.
            if inode(&netns).ok() == Some(served.netns_inode) {
                return Ok(());
            }
            if let Some(old) = pods.remove(&pod.uid) {
                self.stop(old);
            }
        }
        let served = self.start(&pod, netns, undo)?;
        pods.insert(pod.uid.clone(), served);
        Ok(())
    }
}

impl Pods for NodePods {
    fn add(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        self.enroll(pod, netns, true)
    }

    fn restore(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        self.enroll(pod, netns, false)
    }

    fn remove(&self, uid: &str) {
        let removed = self.lock().remove(uid);
        if let Some(served) = removed {
            self.stop(served);
        }
    }

    fn served(&self) -> Vec<PodInfo> {
        self.summaries().into_iter().map(|s| s.info).collect()
    }
}

fn inode(fd: &OwnedFd) -> std::io::Result<u64> {
    let file = std::fs::File::from(fd.as_fd().try_clone_to_owned()?);
    Ok(file.metadata()?.ino())
}

/// The pod's xDS node id, as Istio's sidecar has it:
/// `sidecar~<ip>~<pod>.<namespace>~<namespace>.svc.cluster.local`, the first address
/// (IPv4 preferred) standing for the pod.
pub fn xds_node_id(pod: &PodInfo) -> String {
    let ip = pod
        .ips
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(pod.ips.first())
        .map_or_else(String::new, IpAddr::to_string);
    format!(
        "sidecar~{ip}~{}.{}~{}.svc.cluster.local",
        pod.name, pod.namespace, pod.namespace
    )
}

#[cfg(test)]
mod tests;
