//! A proxied connection's byte stream: raw TCP (Envoy's `raw_buffer` transport socket)
//! or TLS over TCP, on either side. Raw pairs keep `tcp::copy`'s socket fast path;
//! anything with TLS goes through `tcp::copy_io`.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

#[derive(Debug)]
pub enum TransportStream {
    Raw(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
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
    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            TransportStream::Raw(tcp) => tcp,
            TransportStream::Tls(tls) => tls.get_ref().0,
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().local_addr()
    }

    /// Makes the coming close send RST instead of FIN. The socket is closed when dropped.
    pub fn abort(&self) {
        abort(self.tcp());
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
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_flush(cx),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// For TLS: `close_notify`, then the TCP half-close.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            TransportStream::Raw(s) => Pin::new(s).poll_shutdown(cx),
            TransportStream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Makes the coming close of `stream` send RST instead of FIN (SO_LINGER 0).
pub fn abort(stream: &TcpStream) {
    if let Err(err) = stream.set_zero_linger() {
        tracing::debug!(%err, "setting SO_LINGER=0 failed; the peer will see FIN");
    }
}
