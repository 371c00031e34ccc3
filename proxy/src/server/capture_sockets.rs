//! The capture ports, bound before anything else: `shunt agent` opens 15001 and 15006
//! (0.0.0.0 and [::]) as the first thing it does, before it reads its bootstrap, so an
//! app that connects while the proxy is still loading its configuration waits in the
//! listen backlog (the kernel completes its handshake and keeps its bytes) instead of
//! being refused. Under iptables' REDIRECT and under the eBPF connect hook alike a
//! captured connect to a port nobody listens on is reset, so this is what turns an
//! early connect from ECONNREFUSED into a call served as soon as the proxy is.
//!
//! When the proxy's configuration puts a listener at one of these addresses (from the
//! bootstrap or over LDS) the binder takes this very socket, backlog included. What the
//! configuration never claims is closed once the proxy is ready: a connection must not
//! wait on a port nobody will serve. Node mode does the same per pod at enrollment
//! (`shunt_node::serve::proxy`).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::sync::Mutex;

use super::bind::{BindError, bind_listener};
use shunt_core::access_log::Direction;

/// Listening sockets waiting for the proxy's listeners at their addresses.
#[derive(Debug, Default)]
pub struct CaptureSockets {
    waiting: Mutex<HashMap<SocketAddr, TcpListener>>,
}

impl CaptureSockets {
    /// Binds each port on 0.0.0.0 and [::]; a port that cannot be bound (taken, or no
    /// IPv6) is left to the proxy, which reports it if its configuration needs it. The
    /// errors come back for the caller to log once logging is up.
    pub fn bind(ports: &[u16]) -> (CaptureSockets, Vec<BindError>) {
        let mut waiting = HashMap::new();
        let mut errors = Vec::new();
        for (index, port) in ports.iter().enumerate() {
            // istio-iptables' order: -p (outbound) first, then -z (inbound).
            let direction = if index == 0 {
                Direction::Outbound
            } else {
                Direction::Inbound
            };
            match bind_listener(direction, *port) {
                Ok(bound) => waiting.extend(bound.into_iter().map(|b| (b.addr, b.listener))),
                Err(err) => errors.push(err),
            }
        }
        let sockets = CaptureSockets {
            waiting: Mutex::new(waiting),
        };
        (sockets, errors)
    }

    /// The addresses still waiting for a listener.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        let mut addrs: Vec<SocketAddr> = self.lock().keys().copied().collect();
        addrs.sort();
        addrs
    }

    /// The socket bound at `addr`, for the listener the configuration puts there; it is
    /// no longer held here, so a listener removed later really stops listening.
    pub fn take(&self, addr: SocketAddr) -> Option<TcpListener> {
        self.lock().remove(&addr)
    }

    /// Closes the held sockets of `addr`'s port and family (they are wildcards, which
    /// a listener at a specific address could not bind beside), returning their
    /// addresses: what queued there is reset.
    pub fn release_same_port(&self, addr: SocketAddr) -> Vec<SocketAddr> {
        let mut waiting = self.lock();
        let same =
            |held: &SocketAddr| held.port() == addr.port() && held.is_ipv4() == addr.is_ipv4();
        let released: Vec<SocketAddr> = waiting.keys().copied().filter(same).collect();
        for held in &released {
            waiting.remove(held);
        }
        released
    }

    /// Closes the sockets no listener took (their queued connections are reset), and
    /// returns their addresses.
    pub fn close_unclaimed(&self) -> Vec<SocketAddr> {
        let closed: Vec<SocketAddr> = self.lock().drain().map(|(addr, _)| addr).collect();
        closed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, TcpListener>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpStream;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// A client that connects before anyone accepts is queued, not refused, and its
    /// bytes reach whoever takes the socket.
    #[test]
    fn an_early_connect_waits_in_the_backlog_for_the_listener_that_takes_the_socket() {
        let port = free_port();
        let (sockets, errors) = CaptureSockets::bind(&[port]);
        assert!(errors.is_empty(), "{errors:?}");
        let mut early = TcpStream::connect(("127.0.0.1", port)).expect("queued, not refused");
        early.write_all(b"first").unwrap();

        let any = SocketAddr::from(([0, 0, 0, 0], port));
        let listener = sockets.take(any).expect("the IPv4 socket");
        assert!(sockets.take(any).is_none(), "taken once");
        listener.set_nonblocking(false).unwrap();
        let (mut accepted, _) = listener.accept().unwrap();
        let mut got = [0u8; 5];
        accepted.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"first");
    }

    #[test]
    fn unclaimed_sockets_close_and_their_port_refuses_again() {
        let port = free_port();
        let (sockets, _) = CaptureSockets::bind(&[port]);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
        let closed = sockets.close_unclaimed();
        assert!(
            closed.contains(&SocketAddr::from(([0, 0, 0, 0], port))),
            "{closed:?}"
        );
        assert!(sockets.addrs().is_empty());
        let refused = TcpStream::connect(("127.0.0.1", port)).unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    /// A listener at 127.0.0.1 of a held port binds once the wildcard gives way.
    #[test]
    fn a_specific_address_of_a_held_port_binds_once_the_wildcard_gives_way() {
        let port = free_port();
        let (sockets, _) = CaptureSockets::bind(&[port]);
        let loopback = SocketAddr::from(([127, 0, 0, 1], port));
        assert!(TcpListener::bind(loopback).is_err(), "the wildcard is held");
        let released = sockets.release_same_port(loopback);
        assert_eq!(released, vec![SocketAddr::from(([0, 0, 0, 0], port))]);
        assert!(TcpListener::bind(loopback).is_ok());
        assert!(
            sockets.addrs().iter().all(|a| a.is_ipv6()),
            "{:?}",
            sockets.addrs()
        );
    }

    #[test]
    fn a_taken_port_is_reported_and_left_out() {
        let taken = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let (sockets, errors) = CaptureSockets::bind(&[port]);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].to_string().contains("EADDRINUSE"),
            "{}",
            errors[0]
        );
        assert!(sockets.addrs().is_empty());
    }
}
