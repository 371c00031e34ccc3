//! A proxied connection's byte stream: raw TCP (Envoy's `raw_buffer` transport socket),
//! TLS over TCP, or an in-process stream (a connection to or from an internal listener,
//! or a tunnel's HTTP/2 CONNECT stream), on either side. Raw pairs keep `tcp::copy`'s
//! socket fast path; anything else goes through `tcp::copy_io`.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

use shunt_core::event::deferred_write::DeferredWrite;

/// See [`TransportStream::session_info`].
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub tls: shunt_core::stream_info::Tls,
    pub server_name: Option<String>,
    pub alpn: Option<String>,
}

pub enum TransportStream {
    Raw(TcpStream),
    /// A raw stream whose writes leave at the end of the worker's run (HTTP's codecs:
    /// see `event::deferred_write`).
    Deferred(DeferredWrite),
    /// Over a raw or deferred stream (see [`TransportStream::under_tls`]).
    Tls(Box<TlsStream<TransportStream>>),
    /// No socket underneath: bytes move within the process.
    InProcess(Box<dyn InProcessStream>),
}

/// What an in-process stream must be (a `tokio::io::DuplexStream`, an upgraded HTTP/2
/// stream...).
pub trait InProcessStream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> InProcessStream for T {}

impl std::fmt::Debug for TransportStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransportStream::Raw(tcp) => f.debug_tuple("Raw").field(tcp).finish(),
            TransportStream::Deferred(s) => f.debug_tuple("Deferred").field(s.tcp()).finish(),
            TransportStream::Tls(tls) => f.debug_tuple("Tls").field(tls).finish(),
            TransportStream::InProcess(_) => f.write_str("InProcess"),
        }
    }
}

impl From<tokio_rustls::server::TlsStream<TransportStream>> for TransportStream {
    fn from(tls: tokio_rustls::server::TlsStream<TransportStream>) -> Self {
        TransportStream::Tls(Box::new(TlsStream::Server(tls)))
    }
}

impl From<tokio_rustls::client::TlsStream<TransportStream>> for TransportStream {
    fn from(tls: tokio_rustls::client::TlsStream<TransportStream>) -> Self {
        TransportStream::Tls(Box::new(TlsStream::Client(tls)))
    }
}

impl TransportStream {
    /// An in-process stream.
    pub fn in_process(stream: impl InProcessStream + 'static) -> Self {
        TransportStream::InProcess(Box::new(stream))
    }

    /// A raw stream that holds its writes back to the end of the worker's run, when
    /// this thread's worker does (`event::deferred_write`); any other stream as it is.
    /// For request/response codecs, whose many small writes gain from leaving together.
    pub fn defer_writes(self) -> Self {
        match self {
            TransportStream::Raw(tcp) if shunt_core::event::deferred_write::defers_here() => {
                TransportStream::Deferred(DeferredWrite::new(tcp))
            }
            other => other,
        }
    }

    /// The socket under a TLS session: deferred on a worker that defers writes, as a raw
    /// HTTP stream is, so a session's records wait for the end of the worker's run too
    /// (a response's head and body, written one after the other, then leave in one send
    /// instead of two, each of which could wake the peer).
    pub fn under_tls(tcp: TcpStream) -> Self {
        TransportStream::Raw(tcp).defer_writes()
    }

    /// The TCP socket underneath; `None` in process.
    pub fn tcp(&self) -> Option<&TcpStream> {
        match self {
            TransportStream::Raw(tcp) => Some(tcp),
            TransportStream::Deferred(s) => Some(s.tcp()),
            TransportStream::Tls(tls) => tls.get_ref().0.tcp(),
            TransportStream::InProcess(_) => None,
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self.tcp() {
            Some(tcp) => tcp.local_addr(),
            None => Err(io::Error::new(
                io::ErrorKind::AddrNotAvailable,
                "an in-process stream has no socket address",
            )),
        }
    }

    /// What a TLS session shunt terminated tells filters: the peer's identity, the SNI
    /// and the ALPN protocol negotiated. `None` for raw TCP or a client session.
    pub fn session_info(&self) -> Option<SessionInfo> {
        let TransportStream::Tls(tls) = self else {
            return None;
        };
        let TlsStream::Server(server) = tls.as_ref() else {
            return None;
        };
        let session = server.get_ref().1;
        let mut info = shunt_core::stream_info::Tls {
            version: session.protocol_version().and_then(|v| v.as_str()),
            ..Default::default()
        };
        if let Some(leaf) = session.peer_certificates().and_then(|c| c.first()) {
            info.peer_certificate_presented = true;
            for san in super::san::of_certificate(leaf) {
                match san {
                    super::san::San::Uri(uri) => info.peer_uri_sans.push(uri),
                    super::san::San::Dns(dns) => info.peer_dns_sans.push(dns),
                    _ => {}
                }
            }
            info.peer_subject = super::subject::of_certificate(leaf);
        }
        Some(SessionInfo {
            tls: info,
            server_name: session.server_name().map(str::to_owned),
            alpn: session
                .alpn_protocol()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
        })
    }

    /// What a TLS session shunt originated tells: the server's certificate SANs and the
    /// ALPN protocol negotiated. `None` for raw TCP or a server session.
    pub fn client_session_info(&self) -> Option<SessionInfo> {
        let TransportStream::Tls(tls) = self else {
            return None;
        };
        let TlsStream::Client(client) = tls.as_ref() else {
            return None;
        };
        let session = client.get_ref().1;
        let mut info = shunt_core::stream_info::Tls {
            version: session.protocol_version().and_then(|v| v.as_str()),
            ..Default::default()
        };
        if let Some(leaf) = session.peer_certificates().and_then(|c| c.first()) {
            info.peer_certificate_presented = true;
            for san in super::san::of_certificate(leaf) {
                match san {
                    super::san::San::Uri(uri) => info.peer_uri_sans.push(uri),
                    super::san::San::Dns(dns) => info.peer_dns_sans.push(dns),
                    _ => {}
                }
            }
        }
        Some(SessionInfo {
            tls: info,
            server_name: None,
            alpn: session
                .alpn_protocol()
                .map(|p| String::from_utf8_lossy(p).into_owned()),
        })
    }

    /// TCP_NODELAY on the socket underneath, if there is one.
    pub fn set_nodelay(&self) {
        if let Some(tcp) = self.tcp()
            && let Err(err) = tcp.set_nodelay(true)
        {
            tracing::debug!(%err, "TCP_NODELAY failed");
        }
    }

    /// Makes the coming close send RST instead of FIN. The socket is closed when dropped;
    /// an in-process stream just ends.
    pub fn abort(&self) {
        if let Some(tcp) = self.tcp() {
            abort(tcp);
        }
    }
}

impl AsyncRead for TransportStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_read(cx, buf),
            TransportStream::Deferred(s) => Pin::new(s).poll_read(cx, buf),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for TransportStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_write(cx, buf),
            TransportStream::Deferred(s) => Pin::new(s).poll_write(cx, buf),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    /// Gathered writes reach the socket as one `writev` (an HTTP head and its body).
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            TransportStream::Raw(s) => shunt_core::event::write::poll_write_vectored(s, cx, bufs),
            TransportStream::Deferred(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            TransportStream::Raw(s) => s.is_write_vectored(),
            TransportStream::Deferred(s) => s.is_write_vectored(),
            TransportStream::Tls(s) => s.is_write_vectored(),
            TransportStream::InProcess(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_flush(cx),
            TransportStream::Deferred(s) => Pin::new(s).poll_flush(cx),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// For TLS: `close_notify`, then the TCP half-close.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_shutdown(cx),
            TransportStream::Deferred(s) => Pin::new(s).poll_shutdown(cx),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Makes the coming close of `stream` send RST instead of FIN (SO_LINGER 0).
pub fn abort(stream: &TcpStream) {
    if let Err(err) = stream.set_zero_linger() {
        tracing::debug!(%err, "setting SO_LINGER=0 failed; the peer will see FIN");
    }
}

#[cfg(test)]
mod tests {
    use std::io::IoSlice;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::TransportStream;

    async fn pair() -> (TransportStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (TransportStream::Raw(client), server)
    }

    #[tokio::test]
    async fn a_raw_streams_vectored_writes_send_every_slice_in_order() {
        let (mut stream, mut peer) = pair().await;
        // 2,000 slices of 1 KiB: more than one sendmsg takes (1,024), and more than the
        // socket buffers hold, so the writes also wait for the reader.
        let chunks: Vec<Vec<u8>> = (0..2000u32)
            .map(|i| {
                (0..1024u32)
                    .map(|j| (i.wrapping_mul(31) ^ j) as u8)
                    .collect()
            })
            .collect();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            peer.read_to_end(&mut got).await.unwrap();
            got
        });
        let mut slices: Vec<IoSlice<'_>> = chunks.iter().map(|c| IoSlice::new(c)).collect();
        let mut rest = &mut slices[..];
        let mut writes = 0;
        while !rest.is_empty() {
            let sent = stream.write_vectored(rest).await.unwrap();
            assert!(sent > 0);
            IoSlice::advance_slices(&mut rest, sent);
            writes += 1;
        }
        stream.shutdown().await.unwrap();
        assert!(writes > 1, "one write took all 2 MiB");
        assert_eq!(reader.await.unwrap(), chunks.concat());
    }

    #[tokio::test]
    async fn a_head_and_a_short_body_go_out_together() {
        let (mut stream, mut peer) = pair().await;
        let bufs = [
            IoSlice::new(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
            IoSlice::new(b""),
            IoSlice::new(b"hello"),
        ];
        let sent = stream.write_vectored(&bufs).await.unwrap();
        assert_eq!(sent, 43);
        stream.shutdown().await.unwrap();
        let mut got = Vec::new();
        peer.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello");
    }

    #[tokio::test]
    async fn a_vectored_write_to_a_reset_peer_is_an_error() {
        let (mut stream, peer) = pair().await;
        super::abort(&peer);
        drop(peer);
        let failed = async {
            loop {
                let bufs = [IoSlice::new(b"head"), IoSlice::new(b"body")];
                if let Err(err) = stream.write_vectored(&bufs).await {
                    return err;
                }
                tokio::task::yield_now().await;
            }
        };
        let err = tokio::time::timeout(std::time::Duration::from_secs(5), failed)
            .await
            .expect("writes to a reset peer kept succeeding");
        assert!(
            matches!(
                err.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ),
            "{err}"
        );
    }
}
