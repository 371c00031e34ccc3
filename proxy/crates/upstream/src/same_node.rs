//! The same-node fast path of node mode. When a pod's upstream connection with TLS goes
//! to a pod this very process serves, no socket and no handshake are needed: the
//! connection becomes an in-process pipe handed to the destination pod's inbound side
//! ([`Directory`], implemented by `node`), which checks the client's certificate chain
//! with its own verifier and answers with its own chain, which the client checks with
//! its verifier. What a handshake proves is proved; what it costs (key exchange,
//! record encryption both ways, two kernel sockets) is not paid.
//!
//! The client's side is a task-local ([`scope`]): the pod a connection's task serves,
//! set only while the fast path is on.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use rustls::pki_types::CertificateDer;
use tokio::io::DuplexStream;
use tokio::sync::oneshot;

use shunt_tls::context::InProcessHello;

/// A connection offered to the destination's inbound side.
pub struct Handoff {
    /// Where the client connected (the original destination, a pod address).
    pub destination: SocketAddr,
    /// The client pod's address, as the destination would see it over the network.
    pub source: SocketAddr,
    pub hello: InProcessHello,
    /// The destination's answer: its certificate chain once it accepted the client, or
    /// why not (the handshake's failure).
    pub answer: oneshot::Sender<Result<Vec<CertificateDer<'static>>, String>>,
    /// The destination's end of the pipe.
    pub stream: DuplexStream,
}

/// The pods served in this process, by address.
pub trait Directory: Send + Sync {
    /// Takes `handoff` if a pod of this process owns its destination; gives it back
    /// otherwise (the connection then goes over the network).
    fn offer(&self, handoff: Box<Handoff>) -> Result<(), Box<Handoff>>;
}

/// The pod a connection's task serves, as a fast-path client.
pub struct Client {
    pub directory: Arc<dyn Directory>,
    pub ips: Vec<IpAddr>,
}

tokio::task_local! {
    static CLIENT: Arc<Client>;
}

/// Runs `f` as `client`: its TLS upstream connections to pods of this process are
/// handed over in process.
pub fn scope<F: std::future::Future>(
    client: Arc<Client>,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    // Not an `async fn`: that would hold `f` twice (captured, and inside the scope).
    CLIENT.scope(client, f)
}

pub fn current() -> Option<Arc<Client>> {
    CLIENT.try_with(Arc::clone).ok()
}

/// Bytes the pipe buffers each way (a socket's default buffer order of magnitude).
const PIPE_BUFFER: usize = 256 << 10;

/// A source port for a handed connection: the destination sees an address as it would
/// over the network (the client pod's, an ephemeral-range port).
fn next_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    32768 + NEXT.fetch_add(1, Ordering::Relaxed) % 28232
}

/// What the client gets: the pipe, and the destination's answer to wait for.
pub struct Offered {
    pub stream: DuplexStream,
    pub answer: oneshot::Receiver<Result<Vec<CertificateDer<'static>>, String>>,
}

/// Offers a connection to `destination` from `client`; `None` when no pod of this
/// process owns the destination.
pub fn offer(client: &Client, destination: SocketAddr, hello: InProcessHello) -> Option<Offered> {
    let ip = client
        .ips
        .iter()
        .find(|ip| ip.is_ipv4() == destination.is_ipv4())?;
    let (ours, theirs) = tokio::io::duplex(PIPE_BUFFER);
    let (answer, answered) = oneshot::channel();
    let handoff = Box::new(Handoff {
        destination,
        source: SocketAddr::new(*ip, next_port()),
        hello,
        answer,
        stream: theirs,
    });
    client.directory.offer(handoff).ok()?;
    Some(Offered {
        stream: ours,
        answer: answered,
    })
}

/// The destination refused the client (its verifier, or no TLS on its side).
pub fn refused(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why)
}
