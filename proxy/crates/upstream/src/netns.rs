//! Upstream sockets made in another network namespace. In node mode one process serves
//! many pods, and a pod's upstream connections must leave from the pod's own namespace
//! (its addresses, its routes, its loopback for the inbound passthrough). A socket
//! belongs to the namespace it was created in, whatever thread later uses it, so only
//! the `socket()` call runs inside the pod: the calling thread enters the namespace,
//! creates the socket and comes straight back.
//!
//! The namespace is a task-local ([`scope`]): the connection's task says which pod it
//! serves, and every connect made for it ([`super::connect`]) picks that up.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, OnceLock};

use socket2::{Domain, Protocol, Socket, Type};

tokio::task_local! {
    static UPSTREAM_NETNS: Arc<OwnedFd>;
}

/// Runs `f` with its upstream sockets made in `netns`.
pub fn scope<F: std::future::Future>(
    netns: Arc<OwnedFd>,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    // Not an `async fn`: that would hold `f` twice (captured, and inside the scope).
    UPSTREAM_NETNS.scope(netns, f)
}

/// The namespace the current task's upstream sockets belong to, if not the process's.
pub fn current() -> Option<Arc<OwnedFd>> {
    UPSTREAM_NETNS.try_with(Arc::clone).ok()
}

/// The mark on the node's upstream sockets (Istio's 0x539, as ztunnel marks its own):
/// the node's capture programs see every socket of the pods' cgroups, the node's own
/// too, and let the marked ones go where they were sent.
pub const PROXY_MARK: u32 = shunt_common::NODE_PROXY_MARK;

/// A TCP socket for `domain`, in the current task's upstream namespace if it has one
/// (then marked [`PROXY_MARK`]).
pub fn tcp_socket(domain: Domain) -> io::Result<Socket> {
    match current() {
        Some(netns) => {
            let socket = in_netns(&netns, || plain_tcp_socket(domain))?;
            socket.set_mark(PROXY_MARK)?;
            Ok(socket)
        }
        None => plain_tcp_socket(domain),
    }
}

/// A UDP socket for `domain` made in `netns` and marked [`PROXY_MARK`] (node mode's DNS
/// proxy forwarding a pod's query from inside the pod), or the process's own.
pub fn udp_socket_in(netns: Option<&OwnedFd>, domain: Domain) -> io::Result<Socket> {
    let plain = || Socket::new(domain, Type::DGRAM, Some(Protocol::UDP));
    match netns {
        Some(netns) => {
            let socket = in_netns(netns, plain)?;
            socket.set_mark(PROXY_MARK)?;
            Ok(socket)
        }
        None => plain(),
    }
}

/// A TCP socket in the calling thread's namespace.
pub fn plain_tcp_socket(domain: Domain) -> io::Result<Socket> {
    Socket::new(domain, Type::STREAM, Some(Protocol::TCP))
}

/// The process's own network namespace, opened once: where threads come back to.
fn home() -> io::Result<&'static OwnedFd> {
    static HOME: OnceLock<OwnedFd> = OnceLock::new();
    if let Some(fd) = HOME.get() {
        return Ok(fd);
    }
    // The thread group leader's namespace, not this thread's (which may be a pod's).
    let fd: OwnedFd = std::fs::File::open("/proc/self/ns/net")?.into();
    Ok(HOME.get_or_init(|| fd))
}

/// Runs `f` on the calling thread inside `netns`, then returns to the process's
/// namespace. Keep `f` to syscalls that create sockets: anything else the thread does
/// meanwhile (another task, a log line) happens in the pod.
pub fn in_netns<R>(netns: &OwnedFd, f: impl FnOnce() -> io::Result<R>) -> io::Result<R> {
    let home = home()?;
    setns(netns)?;
    let result = f();
    if let Err(err) = setns(home) {
        // A worker thread left in a pod would serve every later task from there.
        tracing::error!(%err, "cannot return to the node's network namespace; aborting");
        std::process::abort();
    }
    result
}

fn setns(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: `fd` is an open namespace file descriptor owned by the caller for the
    // call; setns only changes this thread's network namespace.
    if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn without_a_scope_sockets_are_the_process_own() {
        assert!(current().is_none());
        let socket = tcp_socket(Domain::IPV4).unwrap();
        socket
            .bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
    }

    #[tokio::test]
    async fn a_scope_is_seen_by_the_task() {
        let own: OwnedFd = std::fs::File::open("/proc/self/ns/net").unwrap().into();
        let seen = scope(Arc::new(own), async { current().is_some() }).await;
        assert!(seen);
    }
}
