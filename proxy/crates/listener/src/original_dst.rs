//! The original destination of a captured connection, as Envoy's `original_dst`
//! listener filter finds it.
//!
//! REDIRECT (iptables) rewrites the destination to our listener, so the socket's own
//! address says nothing; the kernel hands the original back through
//! `getsockopt(SO_ORIGINAL_DST)` (conntrack answers it for iptables, a cgroup getsockopt
//! program for eBPF capture). TPROXY and sk_lookup leave the destination alone, so
//! there the socket's local address is the original destination.

use std::io;
use std::net::SocketAddr;

use socket2::SockRef;
use tokio::net::TcpStream;

/// Why a connection has no destination to pass through to.
#[derive(Debug, thiserror::Error)]
#[error(
    "no original destination: SO_ORIGINAL_DST failed ({query}) and the local address \
     {local} is the listener's own"
)]
pub struct NoOriginalDst {
    pub local: SocketAddr,
    pub query: io::Error,
}

/// Asks the kernel for `stream`'s pre-NAT destination, then falls back as [`resolve`].
pub fn original_dst(
    stream: &TcpStream,
    local: SocketAddr,
    listener_port: u16,
) -> Result<SocketAddr, NoOriginalDst> {
    resolve(query(stream, local), local, listener_port)
}

/// `SOL_IP/SO_ORIGINAL_DST` on IPv4 sockets, `SOL_IPV6/IP6T_SO_ORIGINAL_DST` on IPv6.
fn query(stream: &TcpStream, local: SocketAddr) -> io::Result<SocketAddr> {
    let socket = SockRef::from(stream);
    let addr = match local {
        SocketAddr::V4(_) => socket.original_dst_v4()?,
        SocketAddr::V6(_) => socket.original_dst_v6()?,
    };
    addr.as_socket().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "SO_ORIGINAL_DST returned a non-IP address",
        )
    })
}

/// Decides the original destination from what the kernel said.
///
/// The answer of `SO_ORIGINAL_DST` wins. Without one, the local address serves when it
/// is not the listener's own port: the connection reached us by TPROXY or sk_lookup with
/// its destination intact. A connection made straight to the listener port has no
/// original destination at all. IPv4-mapped IPv6 addresses are reported as IPv4.
pub fn resolve(
    queried: io::Result<SocketAddr>,
    local: SocketAddr,
    listener_port: u16,
) -> Result<SocketAddr, NoOriginalDst> {
    let canonical = |addr: SocketAddr| SocketAddr::new(addr.ip().to_canonical(), addr.port());
    match queried {
        Ok(addr) => Ok(canonical(addr)),
        Err(_) if local.port() != listener_port => Ok(canonical(local)),
        Err(query) => Err(NoOriginalDst { local, query }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn not_natted() -> io::Result<SocketAddr> {
        Err(io::Error::from_raw_os_error(libc::ENOENT))
    }

    #[test]
    fn a_redirected_connection_goes_where_so_original_dst_says() {
        let local = addr("10.0.0.5:15001");
        let got = resolve(Ok(addr("10.96.0.10:80")), local, 15001).unwrap();
        assert_eq!(got, addr("10.96.0.10:80"));
    }

    #[test]
    fn an_ipv6_redirected_connection_goes_where_ip6t_so_original_dst_says() {
        let local = addr("[fd00::5]:15006");
        let got = resolve(Ok(addr("[fd00::5]:8080")), local, 15006).unwrap();
        assert_eq!(got, addr("[fd00::5]:8080"));
    }

    #[test]
    fn without_nat_a_connection_kept_its_destination_as_the_local_address() {
        // TPROXY or sk_lookup: the socket was accepted on 15006 but is bound to 8080.
        let local = addr("10.0.0.5:8080");
        assert_eq!(resolve(not_natted(), local, 15006).unwrap(), local);
    }

    #[test]
    fn a_connection_straight_to_the_listener_port_has_no_destination() {
        let local = addr("127.0.0.1:15001");
        let err = resolve(not_natted(), local, 15001).unwrap_err();
        assert_eq!(err.local, local);
        assert_eq!(err.query.raw_os_error(), Some(libc::ENOENT));
        assert!(err.to_string().contains("127.0.0.1:15001"), "{err}");
    }

    #[test]
    fn ipv4_mapped_addresses_are_reported_as_ipv4() {
        let local = addr("[::ffff:10.0.0.5]:8080");
        assert_eq!(
            resolve(not_natted(), local, 15006).unwrap(),
            addr("10.0.0.5:8080")
        );
        let queried = Ok(addr("[::ffff:10.96.0.10]:443"));
        assert_eq!(
            resolve(queried, addr("[::]:15001"), 15001).unwrap(),
            addr("10.96.0.10:443")
        );
    }
}
