//! Forwarding to the pod's resolvers (the `nameserver`s of its `resolv.conf`), as
//! Istio's agent does: the servers in a shuffled order, the first answer wins, a
//! server that fails or times out passes the query on to the next one, and when all
//! fail the client gets SERVFAIL. A UDP answer with the TC bit is asked again over TCP
//! from the same server; a client on TCP is forwarded over TCP.
//!
//! Over UDP the queries share one socket per server ([`crate::udp_pool`]), over TCP each
//! gets a connection of its own (a TCP client has one query in flight at a time).
//! Sockets are created after the proxy dropped to its own uid, so the capture lets them
//! leave instead of sending them back here. In node mode they are made inside the pod's
//! network namespace (its routes, its resolvers) and carry the node proxy's mark, by
//! which the capture lets them leave.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::udp_pool::{AnswerKey, UdpPool};

/// What the pod's `resolv.conf` says: where to forward and the search domains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvConf {
    pub servers: Vec<SocketAddr>,
    pub search: Vec<String>,
}

/// A `resolv.conf` that cannot be read or used.
#[derive(Debug, thiserror::Error)]
pub enum ResolvConfError {
    #[error("reading {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path}: {error}")]
    Parse {
        path: String,
        error: resolv_conf::ParseError,
    },
}

impl ResolvConf {
    pub fn load(path: &Path) -> Result<ResolvConf, ResolvConfError> {
        let text = std::fs::read(path).map_err(|error| ResolvConfError::Read {
            path: path.display().to_string(),
            error,
        })?;
        let config = resolv_conf::Config::parse(&text).map_err(|error| ResolvConfError::Parse {
            path: path.display().to_string(),
            error,
        })?;
        Ok(ResolvConf {
            servers: config
                .nameservers
                .iter()
                .map(|ip| SocketAddr::new(IpAddr::from(ip.clone()), 53))
                .collect(),
            search: config.get_search().cloned().unwrap_or_default(),
        })
    }
}

/// Why one server gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("{server}: no answer within {timeout:?}")]
    Timeout {
        server: SocketAddr,
        timeout: Duration,
    },
    #[error("{server}: {error}")]
    Io {
        server: SocketAddr,
        error: std::io::Error,
    },
    #[error("{server}: the answer does not parse: {error}")]
    Parse { server: SocketAddr, error: String },
}

/// An answer from upstream: the message and whether it took a TCP retry.
#[derive(Debug)]
pub struct Answer {
    pub message: Message,
    pub retried_over_tcp: bool,
}

/// The upstream resolvers.
#[derive(Debug, Clone)]
pub struct Upstreams {
    pub servers: Vec<SocketAddr>,
    pub timeout: Duration,
    /// Node mode: the pod's network namespace, where the queries leave from.
    pub netns: Option<Arc<OwnedFd>>,
}

impl Upstreams {
    /// Asks the servers in turn (shuffled) until one answers. `query` is the client's
    /// query as it came; `key` its message id and questions, which the answer must
    /// carry; UDP goes through `pool`'s shared sockets.
    pub async fn exchange(
        &self,
        pool: &UdpPool,
        query: &[u8],
        key: &AnswerKey,
        tcp: bool,
    ) -> Result<Answer, Vec<ExchangeError>> {
        let id = key.id();
        let mut servers = self.servers.clone();
        fastrand::shuffle(&mut servers);
        let mut errors = Vec::new();
        for server in servers {
            let result = if tcp {
                self.over_tcp(server, query, id)
                    .await
                    .map(|message| Answer {
                        message,
                        retried_over_tcp: false,
                    })
            } else {
                self.over_udp_then_tcp(pool, server, query, key).await
            };
            match result {
                Ok(answer) => return Ok(answer),
                Err(error) => {
                    tracing::info!("upstream failure: {error}");
                    errors.push(error);
                }
            }
        }
        Err(errors)
    }

    async fn over_udp_then_tcp(
        &self,
        pool: &UdpPool,
        server: SocketAddr,
        query: &[u8],
        key: &AnswerKey,
    ) -> Result<Answer, ExchangeError> {
        let id = key.id();
        let message = self.over_udp(pool, server, query, key).await?;
        if !message.metadata.truncation {
            return Ok(Answer {
                message,
                retried_over_tcp: false,
            });
        }
        tracing::debug!(%server, "truncated answer: asking again over TCP");
        let message = self.over_tcp(server, query, id).await?;
        Ok(Answer {
            message,
            retried_over_tcp: true,
        })
    }

    async fn over_udp(
        &self,
        pool: &UdpPool,
        server: SocketAddr,
        query: &[u8],
        key: &AnswerKey,
    ) -> Result<Message, ExchangeError> {
        let io = |error| ExchangeError::Io { server, error };
        let socket = pool.socket(server, self.netns.as_deref()).map_err(io)?;
        let answer = socket.wait_for(key.clone());
        let delivered = async {
            socket.send(query).await.map_err(io)?;
            match answer.await {
                Ok(Ok(message)) => Ok(message),
                Ok(Err(kind)) => Err(io(kind.into())),
                Err(_) => Err(io(std::io::ErrorKind::BrokenPipe.into())),
            }
        };
        let result = tokio::time::timeout(self.timeout, delivered).await;
        socket.forget(key);
        result.map_err(|_| ExchangeError::Timeout {
            server,
            timeout: self.timeout,
        })?
    }

    async fn connect_tcp(&self, server: SocketAddr) -> std::io::Result<TcpStream> {
        match &self.netns {
            // Node mode: made in the pod and marked, as the proxy's upstream connections.
            Some(netns) => {
                let connect = shunt_upstream::connect::connect(server, None, self.timeout);
                shunt_upstream::netns::scope(netns.clone(), connect).await
            }
            None => {
                let stream = TcpStream::connect(server).await?;
                stream.set_nodelay(true)?;
                Ok(stream)
            }
        }
    }

    async fn over_tcp(
        &self,
        server: SocketAddr,
        query: &[u8],
        id: u16,
    ) -> Result<Message, ExchangeError> {
        let exchange = async {
            let io = |error| ExchangeError::Io { server, error };
            let mut stream = self.connect_tcp(server).await.map_err(io)?;
            let mut framed = Vec::with_capacity(query.len() + 2);
            framed.extend_from_slice(&(query.len() as u16).to_be_bytes());
            framed.extend_from_slice(query);
            stream.write_all(&framed).await.map_err(io)?;
            let len = stream.read_u16().await.map_err(io)?;
            let mut buf = vec![0u8; len as usize];
            stream.read_exact(&mut buf).await.map_err(io)?;
            let message = Message::from_vec(&buf).map_err(|error| ExchangeError::Parse {
                server,
                error: error.to_string(),
            })?;
            if message.metadata.id != id {
                return Err(ExchangeError::Parse {
                    server,
                    error: format!("answer id {} for query id {id}", message.metadata.id),
                });
            }
            Ok(message)
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| ExchangeError::Timeout {
                server,
                timeout: self.timeout,
            })?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_gives_servers_on_port_53_and_search_domains() {
        let dir = std::env::temp_dir().join(format!("shunt-resolv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("resolv.conf");
        std::fs::write(
            &path,
            "search ns1.svc.cluster.local svc.cluster.local cluster.local\n\
             nameserver 10.96.0.10\nnameserver fd00::10\noptions ndots:5\n",
        )
        .unwrap();
        let conf = ResolvConf::load(&path).unwrap();
        assert_eq!(
            conf.servers,
            [
                "10.96.0.10:53".parse::<SocketAddr>().unwrap(),
                "[fd00::10]:53".parse().unwrap()
            ]
        );
        assert_eq!(
            conf.search,
            [
                "ns1.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local"
            ]
        );
        let missing = ResolvConf::load(&dir.join("nope")).unwrap_err();
        assert!(missing.to_string().starts_with("reading "), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
