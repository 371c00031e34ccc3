//! Upgrade without dropping: a new node process takes every pod's listening sockets
//! from the old one over a Unix socket (SCM_RIGHTS). The sockets never close, so no
//! connection attempt is refused: while both processes hold them both may accept, then
//! the old one stops accepting (its accept loops end, the sockets stay open in the new
//! one) and drains what it had.
//!
//! The exchange, over one SOCK_SEQPACKET connection (one message each):
//! - new → old: `take`;
//! - old → new: per pod a JSON [`Wire`] with the pod's namespace, listeners and DNS
//!   sockets as fds (namespace first, then the listeners in `Wire::listeners` order,
//!   then the DNS sockets in `Wire::dns` order), then `end`;
//! - new → old: `started` once it accepts on all of them; the old one then lets go:
//!   it stops accepting and parks its established plain-TCP flows;
//! - old → new: per parked flow a JSON [`FlowWire`] naming its pod, with the downstream
//!   and upstream sockets as fds, then `flows-end`. The new process copies on from
//!   where the old one stopped: bytes in flight wait in the sockets' kernel queues, so
//!   nothing is lost and neither end sees the change. Flows that are not plain TCP
//!   (TLS, HTTP, tunnels) finish on the old process within its drain time.

use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use anyhow::{Context, bail};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};

use super::NodePods;
use super::dns::{DnsSocket, Protocol};
use super::instance::ParkedFlows;
use super::listen::{PodListener, Role};
use crate::PodInfo;
use shunt_core::access_log::Direction;
use shunt_filters::tcp::handover::ParkedFlow;

/// One pod as handed over.
#[derive(Debug, Serialize, Deserialize)]
struct Wire {
    pod: PodInfo,
    listeners: Vec<(String, SocketAddr)>,
    /// The pod's DNS proxy's sockets (none from a process that did not hand them).
    #[serde(default)]
    dns: Vec<(Protocol, SocketAddr)>,
}

/// One parked flow as handed over.
#[derive(Debug, Serialize, Deserialize)]
struct FlowWire {
    /// The pod's uid.
    pod: String,
}

const MAX_MESSAGE: usize = 64 * 1024;
/// A pod's namespace and up to 15 sockets in one message (8 listeners, 4 DNS).
const MAX_FDS: usize = 16;

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Capture(Direction::Outbound) => "outbound",
        Role::Capture(Direction::Inbound) => "inbound",
        Role::Capture(Direction::Unspecified) => "unspecified",
        Role::Health => "health",
        Role::Prometheus => "prometheus",
    }
}

fn role_of(name: &str) -> anyhow::Result<Role> {
    Ok(match name {
        "outbound" => Role::Capture(Direction::Outbound),
        "inbound" => Role::Capture(Direction::Inbound),
        "unspecified" => Role::Capture(Direction::Unspecified),
        "health" => Role::Health,
        "prometheus" => Role::Prometheus,
        other => bail!("unknown listener role {other:?}"),
    })
}

/// What comes before the pods: which of the node's own descriptors follow (the
/// ownership lock, the CNI socket), in that order.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Header {
    lock: bool,
    cni: bool,
}

/// The node's own descriptors, handed with its pods.
#[derive(Debug, Default)]
pub struct NodeFds<'a> {
    /// The ownership lock ([`crate::owner::Owner`]): the successor holds it from the
    /// moment it arrives.
    pub lock: Option<BorrowedFd<'a>>,
    /// The CNI socket, listening: CNI requests queue there while it changes hands.
    pub cni: Option<BorrowedFd<'a>>,
}

/// What the new process took besides the pods.
#[derive(Debug)]
pub struct Taken {
    pub lock: Option<OwnedFd>,
    pub cni: Option<OwnedFd>,
    pub pods: usize,
}

/// The old process's offer of its node to a successor, open while it serves.
pub struct Offer {
    socket: Socket,
}

impl Offer {
    /// Listens at `path` (a stale file replaced). The file is never removed by this
    /// side: a successor's own offer replaces it.
    pub fn open(path: &Path) -> anyhow::Result<Offer> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let _ = std::fs::remove_file(path);
        let socket = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
        socket
            .bind(&SockAddr::unix(path)?)
            .with_context(|| format!("binding {}", path.display()))?;
        socket.listen(1)?;
        Ok(Offer { socket })
    }

    /// Waits for a successor.
    pub fn accept(&self) -> anyhow::Result<Socket> {
        let (conn, _) = self
            .socket
            .accept()
            .context("waiting for the new node process")?;
        Ok(conn)
    }
}

/// The old process's side, on a successor's connection: the node's own descriptors,
/// then every pod (its namespace, listening sockets, DNS sockets), then waits until the
/// successor serves them. The caller then lets go ([`let_go`]); if this fails, nothing
/// was let go and the caller carries on serving.
pub fn hand_over(conn: &Socket, node: NodeFds<'_>, pods: &NodePods) -> anyhow::Result<usize> {
    expect(conn, "take")?;
    let header = Header {
        lock: node.lock.is_some(),
        cni: node.cni.is_some(),
    };
    let fds: Vec<RawFd> = node
        .lock
        .into_iter()
        .chain(node.cni)
        .map(|fd| fd.as_raw_fd())
        .collect();
    send_with_fds(conn, &serde_json::to_vec(&header)?, &fds).context("handing over the node")?;
    let exported = pods.export();
    for (wire, fds) in &exported {
        let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        send_with_fds(conn, &serde_json::to_vec(wire)?, &raw)
            .with_context(|| format!("handing over pod {}", wire.pod.uid))?;
    }
    send(conn, b"end")?;
    expect(conn, "started")?;
    Ok(exported.len())
}

/// One hand-over of the pods alone at `path`, then letting them go (for a process that
/// owns no node state).
pub fn hand_over_once(pods: &NodePods, path: &Path) -> anyhow::Result<usize> {
    let offer = Offer::open(path)?;
    let conn = offer.accept()?;
    let _ = std::fs::remove_file(path);
    let n = hand_over(&conn, NodeFds::default(), pods)?;
    let_go(pods, &conn)?;
    Ok(n)
}

/// The old process's last step, after `started`: stops serving every pod, hands the
/// established plain-TCP flows over as they park, then waits for the other connections
/// to drain (at most the drain time). Only then may the process exit without cutting a
/// connection it accepted before letting go (one still connecting upstream, say).
/// Returns the flows handed. Blocks: not for a runtime thread.
pub fn let_go(pods: &NodePods, conn: &Socket) -> anyhow::Result<usize> {
    let Released { drains, flows } = pods.release_all();
    let handed = hand_over_flows(conn, flows, FLOWS_PARK_LIMIT);
    pods.runtime.block_on(async {
        for drain in drains {
            let _ = drain.await;
        }
    });
    handed
}

/// How long parking may take before what is still copying stays here to drain: a
/// copy parks at the top of its loop, so only one blocked writing (its reader not
/// reading) takes longer.
pub const FLOWS_PARK_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The old process's side, after `started` and [`NodePods::release_all`] (see
/// [`let_go`]): sends every flow as it parks, until each pod's copies have all parked
/// or ended (or `limit` passes: those still copying stay here to the end), then
/// `flows-end`. Returns the flows handed.
fn hand_over_flows(
    conn: &Socket,
    pods: Vec<(String, ParkedFlows)>,
    limit: std::time::Duration,
) -> anyhow::Result<usize> {
    let deadline = std::time::Instant::now() + limit;
    let mut handed = 0;
    for (uid, mut parked) in pods {
        let mut send_parked = |receiver: &mut tokio::sync::mpsc::UnboundedReceiver<ParkedFlow>| {
            while let Ok(flow) = receiver.try_recv() {
                let wire = serde_json::to_vec(&FlowWire { pod: uid.clone() })?;
                let fds = [flow.downstream.as_raw_fd(), flow.upstream.as_raw_fd()];
                send_with_fds(conn, &wire, &fds)
                    .with_context(|| format!("handing over a flow of pod {uid}"))?;
                // Closing this process's handles leaves the connections open: the
                // successor holds them now.
                drop(flow);
                handed += 1;
            }
            anyhow::Ok(())
        };
        loop {
            send_parked(&mut parked.receiver)?;
            let late = std::time::Instant::now() >= deadline;
            if let Some(left) = parked.flows.close(late) {
                if left > 0 {
                    tracing::warn!(
                        pod = %uid,
                        flows = left,
                        "flows not parked in time stay here until the drain ends"
                    );
                }
                // What parked between the last look and the close.
                send_parked(&mut parked.receiver)?;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }
    send(conn, b"flows-end")?;
    Ok(handed)
}

fn send_with_fds(conn: &Socket, text: &[u8], fds: &[RawFd]) -> anyhow::Result<()> {
    sendmsg::<()>(
        conn.as_raw_fd(),
        &[IoSlice::new(text)],
        &[ControlMessage::ScmRights(fds)],
        MsgFlags::empty(),
        None,
    )?;
    Ok(())
}

/// The node as received from the old process, not yet served here.
pub struct Handed {
    conn: Socket,
    /// The ownership lock: held by this process from the moment it arrived.
    pub lock: Option<OwnedFd>,
    /// The CNI socket, listening.
    pub cni: Option<OwnedFd>,
    pods: Vec<(Wire, Vec<OwnedFd>)>,
}

/// The new process's side, first half: takes the node from the old process offering it
/// at `path` (its descriptors and every pod's), before this process touches anything.
pub fn receive(path: &Path) -> anyhow::Result<Handed> {
    let conn = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    conn.connect(&SockAddr::unix(path)?)
        .with_context(|| format!("connecting to the old node process at {}", path.display()))?;
    send(&conn, b"take")?;
    let (text, fds) = receive_message(&conn)?;
    let header: Header = serde_json::from_slice(&text).context("the hand-over's header")?;
    if fds.len() != usize::from(header.lock) + usize::from(header.cni) {
        bail!(
            "the hand-over's header names {header:?} but {} descriptors came",
            fds.len()
        );
    }
    let mut fds = fds.into_iter();
    let lock = if header.lock { fds.next() } else { None };
    let cni = if header.cni { fds.next() } else { None };
    let mut pods = Vec::new();
    loop {
        let (text, fds) = receive_message(&conn)?;
        if text == b"end" {
            break;
        }
        let wire: Wire = serde_json::from_slice(&text).context("a handed-over pod")?;
        if fds.len() != wire.listeners.len() + wire.dns.len() + 1 {
            bail!(
                "pod {}: {} file descriptors for {} listeners and {} DNS sockets",
                wire.pod.uid,
                fds.len(),
                wire.listeners.len(),
                wire.dns.len()
            );
        }
        pods.push((wire, fds));
    }
    Ok(Handed {
        conn,
        lock,
        cni,
        pods,
    })
}

impl Handed {
    /// The second half: serves every pod here on the sockets received, then tells the
    /// old process, which lets go. Returns the pods taken.
    pub fn adopt_into(self, pods: &NodePods) -> anyhow::Result<(usize, FlowsToCome)> {
        let mut taken = 0;
        for (wire, mut fds) in self.pods {
            let netns = fds.remove(0);
            let dns: Vec<DnsSocket> = wire
                .dns
                .iter()
                .zip(fds.split_off(wire.listeners.len()))
                .map(|((protocol, addr), fd)| DnsSocket {
                    protocol: *protocol,
                    addr: *addr,
                    fd,
                })
                .collect();
            let listeners = wire
                .listeners
                .iter()
                .zip(fds)
                .map(|((role, addr), fd)| {
                    Ok(PodListener {
                        role: role_of(role)?,
                        addr: *addr,
                        listener: std::net::TcpListener::from(fd),
                    })
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            pods.adopt(wire.pod, netns, listeners, dns)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            taken += 1;
        }
        // The node is this process's now, whether or not the old one hears it (it may
        // have died mid-way: its lock and sockets are held here already).
        if let Err(err) = send(&self.conn, b"started") {
            tracing::warn!("the old node process did not hear that the node is served: {err:#}");
        }
        Ok((taken, FlowsToCome { conn: self.conn }))
    }
}

/// The old process's established flows, still to arrive after `started`.
pub struct FlowsToCome {
    conn: Socket,
}

impl FlowsToCome {
    /// Receives the flows the old process parks and copies on with each in its pod's
    /// instance, until `flows-end` (or the old process goes away). Blocking. Returns
    /// the flows resumed.
    pub fn resume_into(self, pods: &NodePods) -> usize {
        let mut resumed = 0;
        loop {
            let (text, mut fds) = match receive_message(&self.conn) {
                Ok(message) => message,
                Err(err) => {
                    tracing::warn!("the old process's flows ended early: {err:#}");
                    break;
                }
            };
            if text == b"flows-end" {
                break;
            }
            let Ok(wire) = serde_json::from_slice::<FlowWire>(&text) else {
                tracing::warn!("a handed flow without its pod; closing it");
                continue;
            };
            if fds.len() != 2 {
                tracing::warn!(pod = %wire.pod, fds = fds.len(), "a handed flow needs 2 sockets");
                continue;
            }
            let upstream = std::net::TcpStream::from(fds.remove(1));
            let downstream = std::net::TcpStream::from(fds.remove(0));
            if pods.resume(&wire.pod, downstream, upstream) {
                resumed += 1;
            } else {
                tracing::warn!(pod = %wire.pod, "a handed flow of a pod not served here; closing it");
            }
        }
        tracing::info!(
            flows = resumed,
            "resumed the old process's established flows"
        );
        resumed
    }
}

/// Both halves at once: takes the node from the old process at `path` and serves its
/// pods here.
pub fn take_over(pods: &NodePods, path: &Path) -> anyhow::Result<Taken> {
    let mut handed = receive(path)?;
    let (lock, cni) = (handed.lock.take(), handed.cni.take());
    let (taken, flows) = handed.adopt_into(pods)?;
    flows.resume_into(pods);
    Ok(Taken {
        lock,
        cni,
        pods: taken,
    })
}

impl NodePods {
    /// Every pod with its namespace and listening sockets (duplicated handles).
    fn export(&self) -> Vec<(Wire, Vec<OwnedFd>)> {
        let pods = self.lock();
        pods.values()
            .filter_map(|served| {
                let mut fds = vec![served.netns.try_clone().ok()?];
                let mut listeners = Vec::new();
                for (role, addr, l) in served.instance.listeners() {
                    fds.push(OwnedFd::from(l.try_clone().ok()?));
                    listeners.push((role_name(role).to_owned(), addr));
                }
                let mut dns = Vec::new();
                for socket in served
                    .dns
                    .as_ref()
                    .map(|d| d.sockets())
                    .transpose()
                    .ok()?
                    .into_iter()
                    .flatten()
                {
                    fds.push(socket.fd);
                    dns.push((socket.protocol, socket.addr));
                }
                Some((
                    Wire {
                        pod: served.info.clone(),
                        listeners,
                        dns,
                    },
                    fds,
                ))
            })
            .collect()
    }

    /// Stops accepting (and reading DNS) for every pod without closing the sockets
    /// (another process holds them now), parks the plain-TCP flows and drains the rest;
    /// the kernel side is left as it is.
    fn release_all(&self) -> Released {
        let all: Vec<_> = self.lock().drain().collect();
        let mut released = Released::default();
        for (uid, served) in all {
            if let Some(dns) = &served.dns {
                dns.stop();
            }
            let (drain, parked) = served
                .instance
                .release(&self.runtime, self.options.drain_time);
            released.drains.push(drain);
            released.flows.extend(parked.map(|p| (uid, p)));
        }
        released
    }

    /// Copies on a flow handed from the previous process in pod `uid`'s instance;
    /// false if the pod is not served here.
    fn resume(
        &self,
        uid: &str,
        downstream: std::net::TcpStream,
        upstream: std::net::TcpStream,
    ) -> bool {
        let pods = self.lock();
        let Some(served) = pods.get(uid) else {
            return false;
        };
        let _entered = self.runtime.enter();
        let flow = (|| {
            downstream.set_nonblocking(true)?;
            upstream.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(ParkedFlow {
                downstream: tokio::net::TcpStream::from_std(downstream)?,
                upstream: tokio::net::TcpStream::from_std(upstream)?,
            })
        })();
        match flow {
            Ok(flow) => {
                served.instance.resume(flow);
                true
            }
            Err(err) => {
                tracing::warn!(pod = %uid, %err, "a handed flow could not be registered");
                false
            }
        }
    }
}

/// What [`NodePods::release_all`] let go: each pod's drain, and its flows as they park.
#[derive(Default)]
struct Released {
    drains: Vec<tokio::task::JoinHandle<()>>,
    flows: Vec<(String, ParkedFlows)>,
}

fn send(conn: &Socket, text: &[u8]) -> anyhow::Result<()> {
    conn.send(text).context("handover socket")?;
    Ok(())
}

fn expect(conn: &Socket, what: &str) -> anyhow::Result<()> {
    let (text, _) = receive_message(conn)?;
    if text != what.as_bytes() {
        bail!(
            "handover: expected {what:?}, got {:?}",
            String::from_utf8_lossy(&text)
        );
    }
    Ok(())
}

fn receive_message(conn: &Socket) -> anyhow::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut space = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        conn.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .context("handover socket")?;
    let mut fds = Vec::new();
    for c in msg.cmsgs().context("handover message")? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: SCM_RIGHTS just installed these fds in this process; nothing
                // else owns them.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.bytes == 0 {
        bail!("the other node process closed the handover");
    }
    let n = msg.bytes;
    Ok((buf[..n].to_vec(), fds))
}
