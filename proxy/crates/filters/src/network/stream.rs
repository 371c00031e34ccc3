//! The downstream stream a terminal filter reads through when a chain has network
//! filters: bytes the filters read first come back first, then every read goes past the
//! filters' `on_data` (a `Close` ends the stream with an error), and when it is dropped
//! the filters hear `on_close` with the bytes moved.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::{NetworkFilter, NetworkStatus};
use shunt_core::stream_info::Connection;
use shunt_tls::TransportStream;

pub struct Filtered {
    inner: TransportStream,
    /// Read by `on_new_connection` and not consumed: the terminal filter's first bytes.
    prefix: BytesMut,
    filters: Vec<Box<dyn NetworkFilter>>,
    connection: Arc<Connection>,
    closed: bool,
    received: u64,
    sent: u64,
}

impl std::fmt::Debug for Filtered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Filtered")
            .field("inner", &self.inner)
            .field("prefix", &self.prefix.len())
            .field("filters", &self.filters.len())
            .field("closed", &self.closed)
            .finish()
    }
}

impl Filtered {
    pub fn new(
        inner: TransportStream,
        prefix: BytesMut,
        filters: Vec<Box<dyn NetworkFilter>>,
        connection: Arc<Connection>,
    ) -> Self {
        Filtered {
            inner,
            prefix,
            filters,
            connection,
            closed: false,
            received: 0,
            sent: 0,
        }
    }

    /// The TCP socket underneath; `None` in process.
    pub fn tcp(&self) -> Option<&TcpStream> {
        self.inner.tcp()
    }

    /// Makes the coming close send RST instead of FIN.
    pub fn abort(&self) {
        self.inner.abort();
    }

    /// Passes `data` by the filters; false when one closed the connection.
    fn filter(&mut self, data: &[u8], end_stream: bool) -> bool {
        self.received += data.len() as u64;
        for filter in &mut self.filters {
            if filter.wants_data()
                && filter.on_data(data, end_stream, &self.connection) == NetworkStatus::Close
            {
                self.closed = true;
                return false;
            }
        }
        true
    }
}

fn closed_by_filter() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "a network filter closed the connection",
    )
}

impl AsyncRead for Filtered {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.closed {
            return Poll::Ready(Err(closed_by_filter()));
        }
        if !this.prefix.is_empty() {
            let n = buf.remaining().min(this.prefix.len());
            let data = this.prefix.split_to(n);
            if !this.filter(&data, false) {
                return Poll::Ready(Err(closed_by_filter()));
            }
            buf.put_slice(&data);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let end_stream = buf.filled().len() == before && buf.remaining() > 0;
                // The filters see the bytes before the terminal filter does.
                if !this.filter(&buf.filled()[before..], end_stream) {
                    buf.set_filled(before);
                    return Poll::Ready(Err(closed_by_filter()));
                }
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl Filtered {
    /// Adds what a write took to the bytes sent (the filters' `on_close` count).
    fn count_sent(&mut self, written: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = &written {
            self.sent += *n as u64;
        }
        written
    }
}

impl AsyncWrite for Filtered {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write(cx, data);
        this.count_sent(written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.count_sent(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Drop for Filtered {
    fn drop(&mut self) {
        for filter in &mut self.filters {
            filter.on_close(&self.connection, self.received, self.sent);
        }
    }
}

impl crate::tcp::DownstreamIo for Filtered {
    fn tcp(&self) -> Option<&TcpStream> {
        self.inner.tcp()
    }

    fn connection(&self) -> Option<&Arc<Connection>> {
        Some(&self.connection)
    }

    fn abort(&self) {
        self.inner.abort();
    }
}
