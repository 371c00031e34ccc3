//! The upstream half of Istio's TCP metadata exchange (istio-proxy's
//! `envoy.filters.network.upstream.metadata_exchange` on a cluster): once the upstream
//! TLS session negotiated the exchange's ALPN protocol, send this node's header first,
//! then read the server's, before any payload moves. The header is length-prefixed, so
//! exactly its bytes are read; a peer that answers with something else keeps its bytes,
//! which reach the downstream as payload (the peer is then unknown, as in istio-proxy).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use crate::peer::LocalNode;
use crate::peer::exchange::{self, Decoded, PREFIX_LEN, PeerExchange};
use crate::tls::TransportStream;

/// What the exchange found, and the stream to go on with.
pub struct Exchanged {
    /// `None`: the peer sent no exchange header.
    pub peer: Option<PeerExchange>,
    pub stream: TransportStream,
}

/// Runs the exchange on `stream` when its ALPN is `protocol`; otherwise hands it back
/// untouched with no peer.
pub async fn upstream(
    mut stream: TransportStream,
    protocol: &str,
    node: &LocalNode,
) -> io::Result<Exchanged> {
    let negotiated = stream.client_session_info().and_then(|s| s.alpn);
    if negotiated.as_deref() != Some(protocol) {
        return Ok(Exchanged { peer: None, stream });
    }
    stream.write_all(&exchange::encode(node)).await?;
    stream.flush().await?;
    let mut prefix = [0u8; PREFIX_LEN];
    stream.read_exact(&mut prefix).await?;
    let want = match exchange::decode(&prefix) {
        Ok(Decoded::NeedMore { want }) => want,
        Ok(Decoded::Done { .. }) => PREFIX_LEN,
        Err(err) => {
            tracing::debug!(%err, "upstream metadata exchange: no header from the peer");
            let stream = TransportStream::in_process(Prefixed {
                prefix: BytesMut::from(&prefix[..]),
                inner: stream,
            });
            return Ok(Exchanged { peer: None, stream });
        }
    };
    let mut header = prefix.to_vec();
    header.resize(want, 0);
    stream.read_exact(&mut header[PREFIX_LEN..]).await?;
    match exchange::decode(&header) {
        Ok(Decoded::Done { peer, .. }) => Ok(Exchanged {
            peer: Some(*peer),
            stream,
        }),
        Ok(Decoded::NeedMore { .. }) => unreachable_need_more(),
        Err(err) => {
            // The header's bytes are gone either way: istio-proxy drops them too.
            tracing::debug!(%err, "upstream metadata exchange: the peer's header is unreadable");
            Ok(Exchanged { peer: None, stream })
        }
    }
}

/// `decode` of a buffer holding the whole announced length never needs more.
fn unreachable_need_more() -> io::Result<Exchanged> {
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "upstream metadata exchange: header shorter than announced",
    ))
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
