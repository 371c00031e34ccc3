//! The upstream half of Istio's TCP metadata exchange (istio-proxy's
//! `envoy.filters.network.upstream.metadata_exchange` on a cluster): once the upstream
//! TLS session negotiated the exchange's ALPN protocol, send this node's header first,
//! then read the server's (for at most [`HEADER_TIMEOUT`]) before any payload moves.
//! Bytes read past the header, or that are no header at all (a peer that answers with
//! something else, or too late), reach the downstream as payload; the peer is then
//! unknown, as in istio-proxy.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use std::time::Duration;

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use shunt_core::peer::LocalNode;
use shunt_core::peer::exchange::{self, Decoded, PeerExchange};
use shunt_tls::TransportStream;

/// What the exchange found, and the stream to go on with.
pub struct Exchanged {
    /// `None`: the peer sent no exchange header.
    pub peer: Option<PeerExchange>,
    pub stream: TransportStream,
}

/// How long the server's header is waited for before the payload moves without it.
/// istio-proxy never holds the payload back (it reads the header off the response as
/// it comes), so a peer that negotiated the protocol but sends no header only leaves
/// the peer unknown there; shunt exchanges before proxying, and this bounds the wait.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs the exchange on `stream` when its ALPN is `protocol`; otherwise hands it back
/// untouched with no peer.
pub async fn upstream(
    stream: TransportStream,
    protocol: &str,
    node: &LocalNode,
) -> io::Result<Exchanged> {
    let negotiated = stream.client_session_info().and_then(|s| s.alpn);
    if negotiated.as_deref() != Some(protocol) {
        return Ok(Exchanged { peer: None, stream });
    }
    exchange(stream, node, HEADER_TIMEOUT).await
}

/// Sends this node's header, then reads the peer's for at most `wait`. Whatever was
/// read that is not the header (a peer that answered with payload, or too late) stays
/// in front of the stream.
async fn exchange(
    mut stream: TransportStream,
    node: &LocalNode,
    wait: Duration,
) -> io::Result<Exchanged> {
    stream.write_all(&exchange::encode(node)).await?;
    stream.flush().await?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut read = BytesMut::new();
    loop {
        let decoded = match exchange::decode(&read) {
            Ok(Decoded::NeedMore { .. }) => None,
            Ok(Decoded::Done { peer, consumed }) => Some(Ok((peer, consumed))),
            Err(err) => Some(Err(err)),
        };
        match decoded {
            None => {}
            Some(Ok((peer, consumed))) => {
                let rest = read.split_off(consumed);
                return Ok(Exchanged {
                    peer: Some(*peer),
                    stream: prefixed(rest, stream),
                });
            }
            Some(Err(err)) => {
                // No header (another magic): the bytes are the peer's payload. A header
                // that does not parse is dropped whole, as istio-proxy drops it.
                tracing::debug!(%err, "upstream metadata exchange: no usable header from the peer");
                let rest = match exchange::announced_len(&read) {
                    Some(len) if len <= read.len() => read.split_off(len),
                    _ => read,
                };
                return Ok(Exchanged {
                    peer: None,
                    stream: prefixed(rest, stream),
                });
            }
        }
        match tokio::time::timeout_at(deadline, stream.read_buf(&mut read)).await {
            Ok(Ok(0)) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "upstream metadata exchange: the peer closed before its header",
                ));
            }
            Ok(Ok(_)) => {}
            Ok(Err(err)) => return Err(err),
            Err(_elapsed) => {
                tracing::debug!(
                    waited = ?wait,
                    "upstream metadata exchange: no header from the peer in time; going on without"
                );
                return Ok(Exchanged {
                    peer: None,
                    stream: prefixed(read, stream),
                });
            }
        }
    }
}

/// `stream` with `prefix` read first (itself when there is none).
fn prefixed(prefix: BytesMut, stream: TransportStream) -> TransportStream {
    if prefix.is_empty() {
        stream
    } else {
        TransportStream::in_process(Prefixed {
            prefix,
            inner: stream,
        })
    }
}

/// A stream whose first bytes were already read.
struct Prefixed {
    prefix: BytesMut,
    inner: TransportStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = buf.remaining().min(this.prefix.len());
            buf.put_slice(&this.prefix[..n]);
            this.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, data)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> LocalNode {
        LocalNode::from_node(&envoy_types::pb::envoy::config::core::v3::Node {
            id: id.into(),
            ..Default::default()
        })
    }

    /// Our end of an in-process pipe, and the peer's.
    fn pipe() -> (TransportStream, tokio::io::DuplexStream) {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        (TransportStream::in_process(ours), theirs)
    }

    async fn read_some(stream: &mut (impl AsyncRead + Unpin), n: usize) -> Vec<u8> {
        let mut got = vec![0; n];
        stream.read_exact(&mut got).await.unwrap();
        got
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_waited_for_at_most_the_timeout_and_its_bytes_stay() {
        let (ours, mut theirs) = pipe();
        // Not a header, and not enough to tell: the peer then waits for our payload.
        theirs.write_all(b"GE").await.unwrap();
        let exchanged = exchange(ours, &node("client"), HEADER_TIMEOUT)
            .await
            .unwrap();
        assert!(exchanged.peer.is_none());
        let mut stream = exchanged.stream;
        // Our header went out first.
        let header = exchange::encode(&node("client"));
        assert_eq!(read_some(&mut theirs, header.len()).await, header);
        theirs.write_all(b"T /").await.unwrap();
        assert_eq!(read_some(&mut stream, 5).await, b"GET /");
    }

    #[tokio::test]
    async fn the_peers_header_and_the_payload_behind_it_in_one_read() {
        let (ours, mut theirs) = pipe();
        let mut sent = exchange::encode(&node("server"));
        sent.extend_from_slice(b"payload");
        theirs.write_all(&sent).await.unwrap();
        let exchanged = exchange(ours, &node("client"), HEADER_TIMEOUT)
            .await
            .unwrap();
        assert_eq!(exchanged.peer.and_then(|p| p.id).as_deref(), Some("server"));
        let mut stream = exchanged.stream;
        assert_eq!(read_some(&mut stream, 7).await, b"payload");
    }

    #[tokio::test]
    async fn a_peer_answering_with_payload_keeps_every_byte() {
        let (ours, mut theirs) = pipe();
        theirs.write_all(b"HELLO peer=x\n").await.unwrap();
        let exchanged = exchange(ours, &node("client"), HEADER_TIMEOUT)
            .await
            .unwrap();
        assert!(exchanged.peer.is_none());
        let mut stream = exchanged.stream;
        assert_eq!(read_some(&mut stream, 13).await, b"HELLO peer=x\n");
    }

    #[tokio::test]
    async fn a_peer_closing_before_its_header_fails_the_connection() {
        let (ours, mut theirs) = pipe();
        theirs
            .write_all(&exchange::encode(&node("server"))[..6])
            .await
            .unwrap();
        theirs.shutdown().await.unwrap();
        let err = exchange(ours, &node("client"), HEADER_TIMEOUT)
            .await
            .err()
            .expect("an error");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }
}
