//! Shared upstream UDP sockets: one per resolver address, made on first use (inside the
//! pod's network namespace in node mode) and connected to it, so only its datagrams
//! arrive. One task per socket reads the answers and hands each to the queries waiting
//! for it, matched by message id and question as a forwarder does: queries in flight
//! cost a map entry each, not a socket, a task and a 64 KiB buffer.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use hickory_proto::op::Message;
use tokio::net::UdpSocket;
use tokio::sync::oneshot;

/// What an answer is matched by: the message id and the questions (names lowercased).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AnswerKey {
    id: u16,
    questions: Vec<(String, u16, u16)>,
}

impl AnswerKey {
    pub fn id(&self) -> u16 {
        self.id
    }

    pub fn of(message: &Message) -> AnswerKey {
        AnswerKey {
            id: message.metadata.id,
            questions: message
                .queries
                .iter()
                .map(|q| {
                    (
                        q.name().to_ascii().to_ascii_lowercase(),
                        u16::from(q.query_type()),
                        u16::from(q.query_class()),
                    )
                })
                .collect(),
        }
    }
}

/// What a waiting query gets: the answer, or the socket's error (a resolver refusing
/// with ICMP fails every query waiting on it at once, as a socket of its own would).
pub type Delivery = Result<Message, std::io::ErrorKind>;

type Waiting = Mutex<HashMap<AnswerKey, Vec<oneshot::Sender<Delivery>>>>;

/// The shared sockets of one resolver (DNS proxy).
#[derive(Debug, Default)]
pub struct UdpPool {
    sockets: Mutex<HashMap<SocketAddr, Arc<SharedSocket>>>,
}

/// One resolver's socket and the queries waiting on it.
#[derive(Debug)]
pub struct SharedSocket {
    socket: Arc<UdpSocket>,
    waiting: Arc<Waiting>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for SharedSocket {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl UdpPool {
    /// The socket to `server`, made and connected on first use.
    pub fn socket(
        &self,
        server: SocketAddr,
        netns: Option<&OwnedFd>,
    ) -> std::io::Result<Arc<SharedSocket>> {
        let mut sockets = self.sockets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(shared) = sockets.get(&server) {
            return Ok(shared.clone());
        }
        let shared = Arc::new(SharedSocket::open(server, netns)?);
        sockets.insert(server, shared.clone());
        Ok(shared)
    }

    /// Sockets open now.
    pub fn len(&self) -> usize {
        self.sockets.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl SharedSocket {
    fn open(server: SocketAddr, netns: Option<&OwnedFd>) -> std::io::Result<SharedSocket> {
        let local: SocketAddr = match server {
            SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let socket =
            shunt_upstream::netns::udp_socket_in(netns, socket2::Domain::for_address(server))?;
        socket.set_nonblocking(true)?;
        socket.bind(&local.into())?;
        socket.connect(&server.into())?;
        let socket = Arc::new(UdpSocket::from_std(socket.into())?);
        let waiting = Arc::new(Waiting::default());
        let reader = tokio::spawn(read_answers(socket.clone(), Arc::downgrade(&waiting)));
        Ok(SharedSocket {
            socket,
            waiting,
            reader,
        })
    }

    /// Registers a query waiting for the answer `key` names; dropping the receiver
    /// (a timeout) leaves a closed sender that [`SharedSocket::forget`] clears.
    pub fn wait_for(&self, key: AnswerKey) -> oneshot::Receiver<Delivery> {
        let (tx, rx) = oneshot::channel();
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.entry(key).or_default().push(tx);
        rx
    }

    /// Clears the places of queries that stopped waiting for `key`.
    pub fn forget(&self, key: &AnswerKey) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(senders) = waiting.get_mut(key) {
            senders.retain(|s| !s.is_closed());
            if senders.is_empty() {
                waiting.remove(key);
            }
        }
    }

    pub async fn send(&self, query: &[u8]) -> std::io::Result<()> {
        self.socket.send(query).await.map(|_| ())
    }

    /// Queries waiting on this socket now.
    pub fn waiting(&self) -> usize {
        let waiting = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        waiting.values().map(Vec::len).sum()
    }
}

/// Reads answers until the socket's owner goes, handing each to its waiting queries.
/// A datagram that does not parse or that no query waits for is dropped.
async fn read_answers(socket: Arc<UdpSocket>, waiting: std::sync::Weak<Waiting>) {
    let mut buf = vec![0u8; 65535];
    loop {
        let received = socket.recv(&mut buf).await;
        let Some(waiting) = waiting.upgrade() else {
            return;
        };
        let mut waiting = waiting.lock().unwrap_or_else(|e| e.into_inner());
        match received {
            Ok(len) => {
                let Ok(message) = Message::from_vec(&buf[..len]) else {
                    tracing::debug!("an upstream DNS answer that does not parse: dropped");
                    continue;
                };
                for tx in waiting.remove(&AnswerKey::of(&message)).unwrap_or_default() {
                    let _ = tx.send(Ok(message.clone()));
                }
            }
            Err(error) => {
                for (_, senders) in waiting.drain() {
                    for tx in senders {
                        let _ = tx.send(Err(error.kind()));
                    }
                }
            }
        }
    }
}
