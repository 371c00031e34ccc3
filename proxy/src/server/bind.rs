//! Binding the listening sockets, done as root before privileges are dropped.
//!
//! Each listener port is bound twice, on 0.0.0.0 and on [::] with IPV6_V6ONLY, so an
//! IPv6 connection is never seen as an IPv4-mapped one. A host without IPv6 gets a
//! warning and IPv4 only.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use socket2::{Domain, Protocol, Socket, Type};

use shunt_core::access_log::Direction;

/// Kernel accept queue per listening socket (capped by net.core.somaxconn).
const BACKLOG: i32 = 1024;

/// A listening socket ready to hand to the runtime.
#[derive(Debug)]
pub struct Bound {
    pub direction: Direction,
    /// The address actually bound (port 0 asks the kernel for one).
    pub addr: SocketAddr,
    pub listener: TcpListener,
}

/// A listener that could not be set up, naming the address, the step and the errno.
#[derive(Debug, thiserror::Error)]
#[error("cannot {step} the {direction} listener on {addr}: {}", describe(.error))]
pub struct BindError {
    pub direction: Direction,
    pub addr: SocketAddr,
    pub step: &'static str,
    /// Not a `#[source]`: the message already carries it, errno name included.
    pub error: io::Error,
}

/// Binds `direction`'s listener on 0.0.0.0:`port` and, if the host has IPv6, [::] on
/// the same port.
pub fn bind_listener(direction: Direction, port: u16) -> Result<Vec<Bound>, BindError> {
    let v4 = bind(
        direction,
        SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port),
    )?;
    // With port 0 the IPv6 socket takes the port the kernel gave the IPv4 one.
    let v6_addr = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), v4.addr.port());
    let mut bound = vec![v4];
    match bind(direction, v6_addr) {
        Ok(v6) => bound.push(v6),
        Err(err) if ipv6_unavailable(&err.error) => {
            tracing::warn!("{err}; IPv6 looks unavailable, going on with IPv4 only");
        }
        Err(err) => return Err(err),
    }
    Ok(bound)
}

fn bind(direction: Direction, addr: SocketAddr) -> Result<Bound, BindError> {
    let fail = |step| {
        move |error| BindError {
            direction,
            addr,
            step,
            error,
        }
    };
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
        .map_err(fail("open a socket for"))?;
    if addr.is_ipv6() {
        socket
            .set_only_v6(true)
            .map_err(fail("set IPV6_V6ONLY on"))?;
    }
    // A restarted proxy can rebind while old connections sit in TIME_WAIT.
    socket
        .set_reuse_address(true)
        .map_err(fail("set SO_REUSEADDR on"))?;
    socket
        .set_nonblocking(true)
        .map_err(fail("set O_NONBLOCK on"))?;
    socket.bind(&addr.into()).map_err(fail("bind"))?;
    socket.listen(BACKLOG).map_err(fail("listen on"))?;
    let listener = TcpListener::from(socket);
    let addr = listener.local_addr().map_err(fail("read the address of"))?;
    Ok(Bound {
        direction,
        addr,
        listener,
    })
}

/// The errors a host without IPv6 gives for a socket or bind on [::].
fn ipv6_unavailable(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::EAFNOSUPPORT | libc::EPROTONOSUPPORT | libc::EADDRNOTAVAIL)
    )
}

/// `Address already in use (EADDRINUSE, os error 98)`: the text, the errno's name and
/// its number.
fn describe(err: &io::Error) -> String {
    let Some(code) = err.raw_os_error() else {
        return err.to_string();
    };
    let text = io::Error::from_raw_os_error(code).to_string();
    let text = text.split(" (os error").next().unwrap_or(&text).to_owned();
    match errno_name(code) {
        Some(name) => format!("{text} ({name}, os error {code})"),
        None => format!("{text} (os error {code})"),
    }
}

fn errno_name(code: i32) -> Option<&'static str> {
    Some(match code {
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::EACCES => "EACCES",
        libc::EPERM => "EPERM",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EPROTONOSUPPORT => "EPROTONOSUPPORT",
        libc::EMFILE => "EMFILE",
        libc::ENFILE => "ENFILE",
        libc::ENOBUFS => "ENOBUFS",
        libc::ENOMEM => "ENOMEM",
        libc::EINVAL => "EINVAL",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_port_in_use_is_reported_with_its_address_and_errno() {
        let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let err = bind_listener(Direction::Outbound, port).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&format!("0.0.0.0:{port}")), "{text}");
        assert!(text.contains("EADDRINUSE, os error 98"), "{text}");
        assert!(text.contains("outbound listener"), "{text}");
    }

    #[test]
    fn port_zero_binds_both_families_on_one_port() {
        let bound = bind_listener(Direction::Inbound, 0).unwrap();
        let port = bound[0].addr.port();
        assert_ne!(port, 0);
        assert!(bound.iter().all(|b| b.addr.port() == port));
        assert!(bound[0].addr.is_ipv4());
    }
}
