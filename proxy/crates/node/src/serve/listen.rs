//! A pod's listening sockets, opened inside the pod's network namespace: the socket is
//! created there (so it belongs to the pod: its addresses, its loopback, its
//! `sk_lookup`), then bound and listened on from the node's thread.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;

use socket2::{Domain, Socket};

use shunt_core::access_log::Direction;
use shunt_upstream::netns::in_netns;

/// Kernel accept queue per listening socket (capped by net.core.somaxconn).
const BACKLOG: i32 = 1024;

/// What a pod's listener is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Captured traffic: 15001 (outbound) or 15006 (inbound).
    Capture(Direction),
    /// The health port (Istio's 15021, `/healthz/ready`).
    Health,
    /// The pod's own stats (Istio's 15090, `/stats/prometheus`).
    Prometheus,
}

/// One listening socket of a pod.
#[derive(Debug)]
pub struct PodListener {
    pub role: Role,
    pub addr: SocketAddr,
    pub listener: std::net::TcpListener,
}

/// Opens `role`'s listener on 0.0.0.0:`port` and [::]:`port` (IPV6_V6ONLY) inside
/// `netns`. A pod without IPv6 gets IPv4 only.
pub fn open(netns: &OwnedFd, role: Role, port: u16) -> io::Result<Vec<PodListener>> {
    let v4 = SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port);
    let mut out = vec![open_one(netns, role, v4)?];
    let v6 = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), port);
    match open_one(netns, role, v6) {
        Ok(l) => out.push(l),
        Err(err)
            if matches!(
                err.raw_os_error(),
                Some(libc::EAFNOSUPPORT | libc::EPROTONOSUPPORT | libc::EADDRNOTAVAIL)
            ) =>
        {
            tracing::debug!(%err, port, "no IPv6 in the pod: IPv4 only");
        }
        Err(err) => return Err(err),
    }
    Ok(out)
}

fn open_one(netns: &OwnedFd, role: Role, addr: SocketAddr) -> io::Result<PodListener> {
    let context = |step: &str, err: io::Error| {
        io::Error::new(err.kind(), format!("{step} {addr} in the pod: {err}"))
    };
    let socket = in_netns(netns, || {
        shunt_upstream::netns::plain_tcp_socket(Domain::for_address(addr))
    })
    .map_err(|e| context("opening a socket for", e))?;
    prepare(&socket, addr).map_err(|e| context("listening on", e))?;
    Ok(PodListener {
        role,
        addr,
        listener: socket.into(),
    })
}

fn prepare(socket: &Socket, addr: SocketAddr) -> io::Result<()> {
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // A restarted node can rebind while old connections sit in TIME_WAIT.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(BACKLOG)
}

/// Binds a listener of the pod's config at `addr` inside `netns`, as Envoy binds one
/// (SO_REUSEADDR, IPV6_V6ONLY, `transparent` and `freebind` when asked): the xDS
/// manager's binder for a pod.
pub fn bind_listener(
    netns: &OwnedFd,
    listener: &shunt_listener::Listener,
    addr: SocketAddr,
) -> io::Result<std::net::TcpListener> {
    let socket = in_netns(netns, || {
        shunt_upstream::netns::plain_tcp_socket(Domain::for_address(addr))
    })?;
    if listener.transparent {
        match addr {
            SocketAddr::V4(_) => socket.set_ip_transparent_v4(true)?,
            SocketAddr::V6(_) => socket.set_ip_transparent_v6(true)?,
        }
    }
    if listener.freebind {
        match addr {
            SocketAddr::V4(_) => socket.set_freebind_v4(true)?,
            SocketAddr::V6(_) => socket.set_freebind_v6(true)?,
        }
    }
    prepare(&socket, addr)?;
    Ok(socket.into())
}
