//! Envoy's `delayed_close_timeout`. When shunt closes a downstream connection the peer
//! may still be sending (a request refused with 431 or 400 before it was read, a body
//! left unread): closing a socket with unread bytes makes the kernel send a reset, and a
//! reset can destroy the response before the client reads it, or fail the client's
//! write so it never looks. So the close is delayed: FIN after the last response, then
//! whatever still arrives is read and dropped until the peer closes or the timeout ends.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// The downstream stream with the delayed close done when it is dropped (hyper owns it
/// and drops it when the connection ends, whichever way that happens).
pub struct DelayedClose<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    io: Option<IO>,
    timeout: Option<Duration>,
    /// The peer closed its side: nothing can arrive, so nothing to wait for.
    peer_closed: bool,
}

impl<IO> DelayedClose<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    pub fn new(io: IO, timeout: Option<Duration>) -> Self {
        DelayedClose {
            io: Some(io),
            timeout,
            peer_closed: false,
        }
    }

    fn io(&mut self) -> &mut IO {
        // Only `Drop` takes it.
        self.io.as_mut().expect("stream present until dropped")
    }
}

impl<IO> Drop for DelayedClose<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    fn drop(&mut self) {
        let (Some(io), Some(timeout)) = (self.io.take(), self.timeout) else {
            return;
        };
        if self.peer_closed {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(linger(io, timeout));
        }
    }
}

async fn linger<IO>(mut io: IO, timeout: Duration)
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let drain = async {
        io.shutdown().await?;
        let mut discard = vec![0u8; 16 * 1024];
        while io.read(&mut discard).await? != 0 {}
        Ok::<_, io::Error>(())
    };
    // Either way the stream is closed when this returns.
    let _ = tokio::time::timeout(timeout, drain).await;
}

impl<IO> AsyncRead for DelayedClose<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(self.io()).poll_read(cx, buf);
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() == before && buf.remaining() > 0 => {
                self.peer_closed = true;
            }
            Poll::Ready(Err(_)) => self.peer_closed = true,
            _ => {}
        }
        polled
    }
}

impl<IO> AsyncWrite for DelayedClose<IO>
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.io()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.io()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(AsyncWrite::is_write_vectored)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.io()).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.io()).poll_shutdown(cx)
    }
}
