//! The DNS proxy's sockets: UDP and TCP on each listen address, bound while the process
//! is still root (so a privileged address works) and served once the runtime runs.
//!
//! UDP: local and cached answers are sent from the receive loop itself; a query that
//! goes upstream gets a task of its own, so a slow upstream never holds up the rest,
//! within the in-flight bound (over it the loop answers SERVFAIL). TCP: each connection
//! reads length-prefixed queries one after the other (RFC 7766) and is closed after
//! [`TCP_IDLE`] without one.

use std::io;
use std::net::{SocketAddr, TcpListener as StdTcpListener, UdpSocket as StdUdpSocket};
use std::sync::Arc;
use std::time::Duration;

use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::{Resolver, Step, Transport};

/// How long a TCP client may stay silent between queries.
pub const TCP_IDLE: Duration = Duration::from_secs(10);

/// The bound sockets, not yet served.
#[derive(Debug)]
pub struct Sockets {
    pub udp: Vec<StdUdpSocket>,
    pub tcp: Vec<StdTcpListener>,
}

/// A DNS address that could not be bound, naming it and the protocol.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for DNS on {addr} ({protocol}): {error}")]
pub struct BindError {
    pub addr: SocketAddr,
    pub protocol: &'static str,
    pub error: io::Error,
}

/// Binds UDP and TCP on each address. With `skip_unavailable` (the default addresses),
/// an address the host does not have (no IPv6) is left out with a warning.
pub fn bind(addrs: &[SocketAddr], skip_unavailable: bool) -> Result<Sockets, BindError> {
    bind_with(addrs, skip_unavailable, &|domain, ty, protocol| {
        Socket::new(domain, ty, Some(protocol))
    })
}

/// As [`bind`], with the sockets made inside the network namespace `netns` (node mode:
/// a pod's DNS proxy listens on the pod's own loopback). SO_REUSEPORT: a node process
/// taking over from one that does not hand its DNS sockets over binds beside it, and
/// the pod's queries find one of the two until the old one exits.
pub fn bind_in(
    netns: &std::os::fd::OwnedFd,
    addrs: &[SocketAddr],
    skip_unavailable: bool,
) -> Result<Sockets, BindError> {
    bind_with(addrs, skip_unavailable, &|domain, ty, protocol| {
        let socket =
            shunt_upstream::netns::in_netns(netns, || Socket::new(domain, ty, Some(protocol)))?;
        socket.set_reuse_port(true)?;
        Ok(socket)
    })
}

/// Makes a socket (of a domain, type and protocol) where it must live.
type MakeSocket<'a> = &'a dyn Fn(Domain, Type, Protocol) -> io::Result<Socket>;

fn bind_with(
    addrs: &[SocketAddr],
    skip_unavailable: bool,
    make: MakeSocket<'_>,
) -> Result<Sockets, BindError> {
    let mut sockets = Sockets {
        udp: Vec::new(),
        tcp: Vec::new(),
    };
    for addr in addrs {
        let udp = bind_udp(*addr, make).map_err(|error| BindError {
            addr: *addr,
            protocol: "UDP",
            error,
        });
        let udp = match udp {
            Ok(udp) => udp,
            Err(err) if skip_unavailable && unavailable(&err.error) => {
                tracing::warn!("{err}; going on without it");
                continue;
            }
            Err(err) => return Err(err),
        };
        // The kernel's port for port 0, so UDP and TCP share it.
        let addr = udp.local_addr().map_err(|error| BindError {
            addr: *addr,
            protocol: "UDP",
            error,
        })?;
        let tcp = bind_tcp(addr, make).map_err(|error| BindError {
            addr,
            protocol: "TCP",
            error,
        })?;
        sockets.udp.push(udp);
        sockets.tcp.push(tcp);
    }
    Ok(sockets)
}

fn unavailable(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EADDRNOTAVAIL | libc::EAFNOSUPPORT)
    )
}

fn bind_udp(addr: SocketAddr, make: MakeSocket<'_>) -> io::Result<StdUdpSocket> {
    let socket = make(Domain::for_address(addr), Type::DGRAM, Protocol::UDP)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

fn bind_tcp(addr: SocketAddr, make: MakeSocket<'_>) -> io::Result<StdTcpListener> {
    let socket = make(Domain::for_address(addr), Type::STREAM, Protocol::TCP)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Serves every socket on the current runtime until the process ends, or until the
/// returned tasks are aborted (node mode, when the pod leaves).
pub fn serve(
    sockets: Sockets,
    resolver: Arc<Resolver>,
) -> io::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut tasks = Vec::new();
    for udp in sockets.udp {
        let udp = UdpSocket::from_std(udp)?;
        tracing::info!(addr = %udp.local_addr()?, "DNS proxy listening (UDP)");
        tasks.push(tokio::spawn(serve_udp(Arc::new(udp), resolver.clone())));
    }
    for tcp in sockets.tcp {
        let tcp = TcpListener::from_std(tcp)?;
        tracing::info!(addr = %tcp.local_addr()?, "DNS proxy listening (TCP)");
        tasks.push(tokio::spawn(serve_tcp(tcp, resolver.clone())));
    }
    Ok(tasks)
}

async fn serve_udp(socket: Arc<UdpSocket>, resolver: Arc<Resolver>) {
    let mut buf = vec![0u8; 65535];
    loop {
        let (len, peer) = match socket.recv_from(&mut buf).await {
            Ok(received) => received,
            Err(error) => {
                tracing::warn!(%error, "DNS UDP receive failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Local and cached answers go out from this loop: no task, no hand-off.
        let forward = match resolver.answer_now(&buf[..len], Transport::Udp) {
            Step::Done(None) => continue,
            Step::Done(Some(reply)) => match socket.try_send_to(&reply, peer) {
                Ok(_) => continue,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    let socket = socket.clone();
                    tokio::spawn(async move { send(&socket, &reply, peer).await });
                    continue;
                }
                Err(error) => {
                    tracing::debug!(%peer, %error, "sending a DNS answer failed");
                    continue;
                }
            },
            Step::Forward(forward) => forward,
        };
        let Some(permit) = resolver.admit(peer.ip()) else {
            if let Some(reply) = resolver.shed(forward) {
                let _ = socket.try_send_to(&reply, peer);
            }
            continue;
        };
        let socket = socket.clone();
        let resolver = resolver.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Some(reply) = resolver.forward(forward).await {
                send(&socket, &reply, peer).await;
            }
        });
    }
}

async fn send(socket: &UdpSocket, reply: &[u8], peer: SocketAddr) {
    if let Err(error) = socket.send_to(reply, peer).await {
        tracing::debug!(%peer, %error, "sending a DNS answer failed");
    }
}

async fn serve_tcp(listener: TcpListener, resolver: Arc<Resolver>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let resolver = resolver.clone();
                tokio::spawn(async move {
                    if let Err(error) = serve_connection(stream, peer, &resolver).await {
                        tracing::debug!(%peer, %error, "DNS TCP connection ended");
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "DNS TCP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    resolver: &Resolver,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    loop {
        let len = match tokio::time::timeout(TCP_IDLE, stream.read_u16()).await {
            Err(_) => return Ok(()),
            Ok(Err(error)) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(len) => len?,
        };
        let mut request = vec![0u8; usize::from(len)];
        tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut request))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "query cut short"))??;
        let Some(reply) = resolver
            .answer_from(&request, Transport::Tcp, peer.ip())
            .await
        else {
            return Ok(());
        };
        let mut framed = Vec::with_capacity(reply.len() + 2);
        framed.extend_from_slice(&(reply.len() as u16).to_be_bytes());
        framed.extend_from_slice(&reply);
        stream.write_all(&framed).await?;
    }
}
