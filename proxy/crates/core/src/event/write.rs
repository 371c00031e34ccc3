//! Writes on a TCP socket, for the streams that own one.

use std::io;
use std::task::{Context, Poll};

use tokio::net::TcpStream;

/// A vectored write on a socket, without `writev(2)`: that reaches the socket through
/// the file layer (the file position lock, the permission hook, the iovec import).
/// hyper writes each HTTP/1.1 response's head and body this way, and perf put the file
/// layer at about 0.3 us of kernel time per request (`bench http`'s HTTP/1.1 load,
/// about 1.5% of the proxy's CPU). One slice, or a few small ones joined (a head and a
/// short body), go out with one `send(2)`; more with `sendmsg(2)`, which enters the
/// socket layer directly.
pub fn poll_write_vectored(
    tcp: &TcpStream,
    cx: &mut Context<'_>,
    bufs: &[io::IoSlice<'_>],
) -> Poll<io::Result<usize>> {
    const JOIN_BELOW: usize = 1024;
    let mut storage;
    let one: Option<&[u8]> = match bufs {
        [single] => Some(single),
        _ => {
            let total = bufs.iter().map(|b| b.len()).fold(0, usize::saturating_add);
            if total <= JOIN_BELOW {
                storage = [0u8; JOIN_BELOW];
                let mut at = 0;
                for buf in bufs {
                    storage[at..at + buf.len()].copy_from_slice(buf);
                    at += buf.len();
                }
                Some(&storage[..total])
            } else {
                None
            }
        }
    };
    loop {
        std::task::ready!(tcp.poll_write_ready(cx))?;
        // `try_io` (and `try_write`) clear the readiness on WouldBlock: the next
        // poll waits for it again.
        let sent = match one {
            Some(buf) => tcp.try_write(buf),
            None => tcp.try_io(tokio::io::Interest::WRITABLE, || sendmsg(tcp, bufs)),
        };
        match sent {
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
            done => return Poll::Ready(done),
        }
    }
}

fn sendmsg(tcp: &TcpStream, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // Linux's UIO_MAXIOV: more is EMSGSIZE, and a partial write is allowed anyway.
    const MAX_IOV: usize = 1024;
    // SAFETY: a zeroed msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is guaranteed ABI-compatible with `iovec` on Unix; sendmsg only reads it.
    msg.msg_iov = bufs.as_ptr().cast_mut().cast::<libc::iovec>();
    msg.msg_iovlen = bufs.len().min(MAX_IOV);
    // SAFETY: the fd is the stream's, open while `tcp` is borrowed; `msg` points at
    // `bufs`, alive for the call.
    let sent = unsafe { libc::sendmsg(tcp.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    usize::try_from(sent).map_err(|_| io::Error::last_os_error())
}
