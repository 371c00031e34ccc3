//! One pod's proxy instance: its listeners (opened in the pod), its accept loops on the
//! node's shared runtime, its connections (upstreams made in the pod), its drain.
//! Which pod a connection belongs to is known from the listener that accepted it.

use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::listen::{PodListener, Role};
use super::proxy::{PodProxy, Setup, Shared};
use shunt_core::access_log::{Direction, Entry};
use shunt_filters::tcp;
use shunt_listener::original_dst;

/// A pod's counters, named as Envoy's listener stats.
#[derive(Debug, Default)]
pub struct PodStats {
    /// `downstream_cx_total`: connections accepted on the capture listeners.
    pub downstream_cx_total: AtomicU64,
    /// `downstream_cx_active`.
    pub downstream_cx_active: AtomicU64,
}

/// A running instance; dropping it does not stop it, [`Instance::stop`] does.
pub struct Instance {
    accepting: Vec<JoinHandle<()>>,
    /// Second handles on the listening sockets, so `stop` closes them at once (an
    /// aborted accept task drops its listener only when the runtime gets to it).
    controls: Vec<std::net::TcpListener>,
    roles: Vec<Role>,
    /// Set to true when the drain is over: connections still open are cut.
    cut: watch::Sender<bool>,
    pub stats: Arc<PodStats>,
    pub addrs: Vec<SocketAddr>,
    /// The pod's proxy from the control plane; `None`: the passthrough proxy.
    pub proxy: Option<PodProxy>,
    /// Whether the pod's proxy has its first configuration (always, for passthrough).
    pub ready: Arc<AtomicBool>,
}

pub struct Settings {
    pub tcp: Arc<tcp::Settings>,
    pub drain_time: Duration,
    /// The pod's own stats store, which its 15090 shows.
    pub stats: shunt_core::stats::Store,
    pub scrape: Arc<shunt_admin::StatsScrape>,
}

impl Instance {
    /// Starts serving `listeners` on `runtime`; upstream sockets are made in `netns`.
    /// With `xds` the capture listeners are the pod's proxy's (its config decides what
    /// they do); without, they are the passthrough proxy's.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        listeners: Vec<PodListener>,
        netns: Arc<OwnedFd>,
        settings: &Settings,
        xds: Option<Setup>,
    ) -> anyhow::Result<Instance> {
        let _entered = runtime.enter();
        let (cut, cut_rx) = watch::channel(false);
        let stats = Arc::new(PodStats::default());
        let ready = Arc::new(AtomicBool::new(xds.is_none()));
        let mut accepting = Vec::new();
        let mut addrs = Vec::new();
        let mut controls = Vec::new();
        let mut roles = Vec::new();
        let mut capture = Vec::new();
        for l in listeners {
            roles.push(l.role);
            addrs.push(l.addr);
            controls.push(l.listener.try_clone()?);
            if xds.is_some() && matches!(l.role, Role::Capture(_)) {
                capture.push((l.addr, l.listener));
                continue;
            }
            let listener = TcpListener::from_std(l.listener)?;
            let job = Accept {
                listener,
                role: l.role,
                addr: l.addr,
                netns: netns.clone(),
                tcp: settings.tcp.clone(),
                stats: stats.clone(),
                cut: cut_rx.clone(),
                ready: ready.clone(),
                store: settings.stats.clone(),
                scrape: settings.scrape.clone(),
            };
            accepting.push(runtime.spawn(job.run()));
        }
        let proxy = match xds {
            Some(setup) => {
                let shared = Shared {
                    netns,
                    stats: stats.clone(),
                    cut: cut_rx,
                    ready: ready.clone(),
                };
                match PodProxy::start(runtime, setup, capture, shared) {
                    Ok(proxy) => Some(proxy),
                    Err(err) => {
                        for a in &accepting {
                            a.abort();
                        }
                        return Err(err);
                    }
                }
            }
            None => None,
        };
        Ok(Instance {
            accepting,
            controls,
            roles,
            cut,
            stats,
            addrs,
            proxy,
            ready,
        })
    }

    /// The listening sockets with their roles and addresses.
    pub fn listeners(&self) -> impl Iterator<Item = (Role, SocketAddr, &std::net::TcpListener)> {
        self.roles
            .iter()
            .zip(&self.addrs)
            .zip(&self.controls)
            .map(|((r, a), l)| (*r, *a, l))
    }

    /// Closes the listeners at once; open connections run on for `drain_time`, then
    /// are cut.
    pub fn stop(self, runtime: &tokio::runtime::Handle, drain_time: Duration) {
        for c in &self.controls {
            // shutdown() on a listening socket stops it listening: from here on a
            // connect is refused, not queued for an accept that never comes.
            let _ = socket2::SockRef::from(c).shutdown(std::net::Shutdown::Both);
        }
        self.release(runtime, drain_time);
    }

    /// Stops accepting here but leaves the sockets listening (a new process accepts on
    /// them now); open connections run on for `drain_time`, then are cut.
    pub fn release(self, runtime: &tokio::runtime::Handle, drain_time: Duration) {
        for a in &self.accepting {
            a.abort();
        }
        if let Some(proxy) = &self.proxy {
            proxy.stop();
        }
        let stats = self.stats.clone();
        let cut = self.cut;
        runtime.spawn(async move {
            let drained = async {
                while stats.downstream_cx_active.load(Ordering::SeqCst) > 0 {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            };
            let _ = tokio::time::timeout(drain_time, drained).await;
            let _ = cut.send(true);
        });
    }
}

struct Accept {
    listener: TcpListener,
    role: Role,
    addr: SocketAddr,
    netns: Arc<OwnedFd>,
    tcp: Arc<tcp::Settings>,
    stats: Arc<PodStats>,
    cut: watch::Receiver<bool>,
    ready: Arc<AtomicBool>,
    store: shunt_core::stats::Store,
    scrape: Arc<shunt_admin::StatsScrape>,
}

impl Accept {
    async fn run(self) {
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => self.spawn(stream, peer),
                Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => {}
                Err(err) => {
                    // Out of file descriptors or memory: back off, the backlog holds.
                    tracing::warn!(addr = %self.addr, %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn spawn(&self, stream: TcpStream, peer: SocketAddr) {
        let mut cut = self.cut.clone();
        match self.role {
            Role::Health => {
                let ready = self.ready.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        _ = health(stream, &ready) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
            Role::Prometheus => {
                let (store, scrape) = (self.store.clone(), self.scrape.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        _ = prometheus(stream, &store, &scrape) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
            Role::Capture(direction) => {
                let stats = self.stats.clone();
                stats.downstream_cx_total.fetch_add(1, Ordering::Relaxed);
                stats.downstream_cx_active.fetch_add(1, Ordering::SeqCst);
                let handled = shunt_upstream::netns::scope(
                    self.netns.clone(),
                    handle(stream, peer, direction, self.addr.port(), self.tcp.clone()),
                );
                tokio::spawn(async move {
                    tokio::select! {
                        () = handled => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                    stats.downstream_cx_active.fetch_sub(1, Ordering::SeqCst);
                });
            }
        }
    }
}

/// As the passthrough proxy: the original destination from the kernel, then `tcp`.
async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    direction: Direction,
    listener_port: u16,
    settings: Arc<tcp::Settings>,
) {
    let Ok(local) = stream.local_addr() else {
        return;
    };
    let canonical = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
    let entry = Entry::start(direction, canonical(peer), canonical(local));
    let original_dst = match original_dst::original_dst(&stream, local, listener_port) {
        Ok(dst) => Some(dst),
        Err(err) => {
            tracing::warn!(%peer, %err, "closing connection");
            None
        }
    };
    tcp::proxy(stream, entry, original_dst, &settings).await;
}

/// The health port: `GET /healthz/ready` is 200 while the pod is served (the instance
/// only exists then) and its proxy has its first configuration (503 before), anything
/// else 404. One request per connection.
async fn health(mut stream: TcpStream, ready: &AtomicBool) {
    let Some(head) = request_head(&mut stream).await else {
        return;
    };
    let asked =
        head.starts_with(b"GET /healthz/ready ") || head.starts_with(b"HEAD /healthz/ready ");
    let reply: &[u8] = if asked && ready.load(Ordering::SeqCst) {
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    } else if asked {
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    } else {
        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    };
    let _ = stream.write_all(reply).await;
    let _ = stream.shutdown().await;
}

/// A request's head (up to the blank line), or `None` if it does not come in 5 s.
async fn request_head(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut head = Vec::with_capacity(256);
    let mut buf = [0u8; 512];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 && head.len() < 8192 => head.extend_from_slice(&buf[..n]),
            _ => return None,
        }
    }
    Some(head)
}

/// The pod's Prometheus port: `GET /stats/prometheus` is the pod's own stats (its
/// store: its proxy's and its DNS proxy's), as Envoy writes them; anything else 404.
/// One request per connection.
async fn prometheus(
    mut stream: TcpStream,
    store: &shunt_core::stats::Store,
    scrape: &shunt_admin::StatsScrape,
) {
    let Some(head) = request_head(&mut stream).await else {
        return;
    };
    let path = head
        .split(|b| *b == b' ')
        .nth(1)
        .map(|p| p.split(|b| *b == b'?').next().unwrap_or(p));
    let reply = if head.starts_with(b"GET ") && path == Some(b"/stats/prometheus") {
        let body = scrape.render(store);
        format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned()
    };
    let _ = stream.write_all(reply.as_bytes()).await;
    let _ = stream.shutdown().await;
}
