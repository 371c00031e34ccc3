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
//! - new → old: `started` once it accepts on all of them; the old one then lets go.

use std::io::{IoSlice, IoSliceMut};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use anyhow::{Context, bail};
use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};

use super::NodePods;
use super::dns::{DnsSocket, Protocol};
use super::listen::{PodListener, Role};
use crate::PodInfo;
use shunt_core::access_log::Direction;

/// One pod as handed over.
#[derive(Debug, Serialize, Deserialize)]
struct Wire {
    pod: PodInfo,
    listeners: Vec<(String, SocketAddr)>,
    /// The pod's DNS proxy's sockets (none from a process that did not hand them).
    #[serde(default)]
    dns: Vec<(Protocol, SocketAddr)>,
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

/// The old process's side: waits at `path` for one new process, hands it every pod,
/// and once it runs them stops accepting here and drains. Returns the pods handed.
pub fn hand_over(pods: &NodePods, path: &Path) -> anyhow::Result<usize> {
    let _ = std::fs::remove_file(path);
    let server = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    server
        .bind(&SockAddr::unix(path)?)
        .with_context(|| format!("binding {}", path.display()))?;
    server.listen(1)?;
    let (conn, _) = server
        .accept()
        .context("waiting for the new node process")?;
    let _ = std::fs::remove_file(path);
    expect(&conn, "take")?;
    let exported = pods.export();
    for (wire, fds) in &exported {
        let text = serde_json::to_vec(wire)?;
        let raw: Vec<RawFd> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
        sendmsg::<()>(
            conn.as_raw_fd(),
            &[IoSlice::new(&text)],
            &[ControlMessage::ScmRights(&raw)],
            MsgFlags::empty(),
            None,
        )
        .with_context(|| format!("handing over pod {}", wire.pod.uid))?;
    }
    send(&conn, b"end")?;
    expect(&conn, "started")?;
    pods.release_all();
    Ok(exported.len())
}

/// The new process's side: takes every pod from the old process listening at `path`
/// and serves them here. Returns the pods taken.
pub fn take_over(pods: &NodePods, path: &Path) -> anyhow::Result<usize> {
    let conn = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    conn.connect(&SockAddr::unix(path)?)
        .with_context(|| format!("connecting to the old node process at {}", path.display()))?;
    send(&conn, b"take")?;
    let mut taken = 0;
    loop {
        let (text, mut fds) = receive(&conn)?;
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
    send(&conn, b"started")?;
    Ok(taken)
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
    /// (another process holds them now) and drains; the kernel side is left as it is.
    fn release_all(&self) {
        let all: Vec<_> = self.lock().drain().collect();
        for (_, served) in all {
            if let Some(dns) = &served.dns {
                dns.stop();
            }
            served
                .instance
                .release(&self.runtime, self.options.drain_time);
        }
    }
}

fn send(conn: &Socket, text: &[u8]) -> anyhow::Result<()> {
    conn.send(text).context("handover socket")?;
    Ok(())
}

fn expect(conn: &Socket, what: &str) -> anyhow::Result<()> {
    let (text, _) = receive(conn)?;
    if text != what.as_bytes() {
        bail!(
            "handover: expected {what:?}, got {:?}",
            String::from_utf8_lossy(&text)
        );
    }
    Ok(())
}

fn receive(conn: &Socket) -> anyhow::Result<(Vec<u8>, Vec<OwnedFd>)> {
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
