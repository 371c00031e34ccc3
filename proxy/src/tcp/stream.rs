//! A proxied connection's byte stream: raw TCP (Envoy's `raw_buffer` transport socket)
//! or TLS over TCP, on either side. Raw pairs keep [`super::copy`]'s socket fast path;
//! anything with TLS goes through [`super::copy_io`].

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsStream;

#[derive(Debug)]
pub enum Stream {
    Raw(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl From<tokio_rustls::server::TlsStream<TcpStream>> for Stream {
    fn from(tls: tokio_rustls::server::TlsStream<TcpStream>) -> Self {
        Stream::Tls(Box::new(TlsStream::Server(tls)))
    }
}

impl From<tokio_rustls::client::TlsStream<TcpStream>> for Stream {
    fn from(tls: tokio_rustls::client::TlsStream<TcpStream>) -> Self {
        Stream::Tls(Box::new(TlsStream::Client(tls)))
    }
}

impl Stream {
    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Raw(tcp) => tcp,
            Stream::Tls(tls) => tls.get_ref().0,
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.tcp().local_addr()
    }

    /// Makes the coming close send RST, as [`super::copy::abort`].
    pub fn abort(&self) {
        super::copy::abort(self.tcp());
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Raw(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Raw(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Raw(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    /// For TLS: `close_notify`, then the TCP half-close.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Raw(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
