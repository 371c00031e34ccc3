//! Messages on the node agent's sockets: Unix `SOCK_SEQPACKET` sockets, one message per
//! packet (so no framing of our own), a network namespace riding along by SCM_RIGHTS.
//!
//! The `shunt-cni` socket carries JSON: the plugin connects, sends one [`CniRequest`]
//! (an ADD with the pod's netns fd attached), reads one [`CniResponse`], and closes.
//! istio-cni's ZDS socket carries protobuf in the same packets (see `zds.rs`).

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use serde::{Deserialize, Serialize};
use socket2::{Domain, SockAddr, Socket, Type};

use crate::PodInfo;

/// The largest message either socket accepts: a pod's info is well under 1 KiB.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// What `shunt-cni` asks the node agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "UPPERCASE")]
pub enum CniRequest {
    /// Serve this pod; its network namespace is the fd attached to the message.
    Add { pod: PodInfo },
    /// Stop serving the pod: by uid when `CNI_ARGS` had one, else by container id.
    Del {
        uid: Option<String>,
        container_id: String,
    },
    /// Is the pod served?
    Check {
        uid: Option<String>,
        container_id: String,
    },
}

/// The node agent's answer: `error` is empty on success.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniResponse {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
}

/// A `SOCK_SEQPACKET` socket listening at `path` (a stale socket file left by an earlier
/// run is replaced; the parent directory is created).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let socket = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    socket.bind(&SockAddr::unix(path)?)?;
    socket.listen(128)?;
    Ok(UnixListener::from(OwnedFd::from(socket)))
}

/// A `SOCK_SEQPACKET` connection to `path`.
pub fn connect(path: &Path) -> io::Result<UnixStream> {
    let socket = Socket::new(Domain::UNIX, Type::SEQPACKET, None)?;
    socket.connect(&SockAddr::unix(path)?)?;
    Ok(UnixStream::from(OwnedFd::from(socket)))
}

/// Sends one packet, with `fd` attached by SCM_RIGHTS when given.
pub fn send(socket: BorrowedFd<'_>, message: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let iov = [IoSlice::new(message)];
    let fds: Vec<RawFd> = fd.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let sent = sendmsg::<()>(
        socket.as_raw_fd(),
        &iov,
        cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent != message.len() {
        return Err(io::Error::other(format!(
            "sent {sent} of a {}-byte message",
            message.len()
        )));
    }
    Ok(())
}

/// One received packet: its bytes (empty at end of stream) and the fd it carried.
pub struct Packet {
    pub bytes: Vec<u8>,
    pub fd: Option<OwnedFd>,
}

/// Receives one packet. More than one fd, a truncated message or truncated control data
/// is an error (every fd received is closed then, so none leaks).
pub fn recv(socket: BorrowedFd<'_>) -> io::Result<Packet> {
    let mut buf = vec![0u8; MAX_MESSAGE];
    let mut cmsg_space = nix::cmsg_space!([RawFd; 1]);
    let (len, flags, fds) = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let msg = recvmsg::<()>(
            socket.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )?;
        let mut fds = Vec::new();
        for cmsg in msg.cmsgs()? {
            if let ControlMessageOwned::ScmRights(raw) = cmsg {
                // SAFETY: the kernel installed these descriptors in our table for this
                // message; nothing else owns them.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        (msg.bytes, msg.flags, fds)
    };
    if flags.contains(MsgFlags::MSG_TRUNC) {
        return Err(io::Error::other(format!(
            "message longer than {MAX_MESSAGE} bytes"
        )));
    }
    if flags.contains(MsgFlags::MSG_CTRUNC) || fds.len() > 1 {
        return Err(io::Error::other(
            "message carries more than one file descriptor",
        ));
    }
    buf.truncate(len);
    Ok(Packet {
        bytes: buf,
        fd: fds.into_iter().next(),
    })
}
