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

/// See [`TransportStream::session_info`].
#[derive(Debug, Clone)]
pub struct SessionInfo {
    pub tls: crate::stream_info::Tls,
    pub server_name: Option<String>,
    pub alpn: Option<String>,
}

pub enum TransportStream {
    Raw(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
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
            TransportStream::Tls(tls) => f.debug_tuple("Tls").field(tls).finish(),
            TransportStream::InProcess(_) => f.write_str("InProcess"),
        }
    }
}

impl From<tokio_rustls::server::TlsStream<TcpStream>> for TransportStream {
    fn from(tls: tokio_rustls::server::TlsStream<TcpStream>) -> Self {
        TransportStream::Tls(Box::new(TlsStream::Server(tls)))
    }
}

impl From<tokio_rustls::client::TlsStream<TcpStream>> for TransportStream {
    fn from(tls: tokio_rustls::client::TlsStream<TcpStream>) -> Self {
        TransportStream::Tls(Box::new(TlsStream::Client(tls)))
    }
}

impl TransportStream {
    /// An in-process stream.
    pub fn in_process(stream: impl InProcessStream + 'static) -> Self {
        TransportStream::InProcess(Box::new(stream))
    }

    /// The TCP socket underneath; `None` in process.
    pub fn tcp(&self) -> Option<&TcpStream> {
        match self {
            TransportStream::Raw(tcp) => Some(tcp),
            TransportStream::Tls(tls) => Some(tls.get_ref().0),
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
        let mut info = crate::stream_info::Tls {
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
        let mut info = crate::stream_info::Tls {
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
            TransportStream::Raw(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            TransportStream::Raw(s) => s.is_write_vectored(),
            TransportStream::Tls(s) => s.is_write_vectored(),
            TransportStream::InProcess(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_flush(cx),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            TransportStream::InProcess(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// For TLS: `close_notify`, then the TCP half-close.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_shutdown(cx),
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
