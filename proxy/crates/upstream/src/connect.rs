//! Opening an upstream TCP connection: from a chosen source address if the cluster asks
//! for one (`upstream_bind_config`, Istio's 127.0.0.6 for inbound passthrough), within
//! the cluster's `connect_timeout`.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use socket2::{Domain, Socket};
use tokio::net::{TcpSocket, TcpStream};

/// Connects to `host`, bound to `source` first if set, giving up after `timeout`.
pub async fn connect(
    host: SocketAddr,
    source: Option<SocketAddr>,
    timeout: Duration,
) -> io::Result<TcpStream> {
    // In node mode, made in the pod's network namespace (see `super::netns`).
    let socket = super::netns::tcp_socket(Domain::for_address(host))?;
    socket.set_nonblocking(true)?;
    socket.set_tcp_nodelay(true)?;
    if let Some(source) = source {
        // FREEBIND: ::6 need not be configured on lo for the bind to succeed.
        match source.ip() {
            IpAddr::V4(_) => socket.set_freebind_v4(true)?,
            IpAddr::V6(_) => socket.set_freebind_v6(true)?,
        }
        if source.port() == 0 {
            // Let connect() pick the port, so the 4-tuple, not the source port alone,
            // must be unique: without it every connection holds one of the source's ports.
            set_bind_address_no_port(&socket);
        }
        socket.bind(&source.into())?;
    }
    let socket = TcpSocket::from_std_stream(socket.into());
    match tokio::time::timeout(timeout, socket.connect(host)).await {
        Ok(connected) => connected,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("connect timed out after {} ms", timeout.as_millis()),
        )),
    }
}

/// IP_BIND_ADDRESS_NO_PORT, which socket2 does not wrap.
fn set_bind_address_no_port(socket: &Socket) {
    use nix::sys::socket::{setsockopt, sockopt::IpBindAddressNoPort};
    if let Err(err) = setsockopt(socket, IpBindAddressNoPort, &true) {
        tracing::debug!(%err, "IP_BIND_ADDRESS_NO_PORT failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use socket2::Type;

    #[tokio::test]
    async fn a_full_accept_queue_makes_connect_time_out() {
        // Backlog 0 holds one pending connection; Linux drops the next SYNs, so a third
        // connect waits for an answer that never comes.
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        socket
            .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        socket.listen(0).unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        let mut held = Vec::new();
        let err = loop {
            match connect(addr, None, Duration::from_millis(200)).await {
                Ok(stream) => held.push(stream),
                Err(err) => break err,
            }
            assert!(held.len() < 64, "the accept queue never filled");
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("200 ms"), "{err}");
    }

    #[tokio::test]
    async fn a_source_address_is_bound_before_connecting() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let source = SocketAddr::from(([127, 0, 0, 6], 0));
        let stream = connect(addr, Some(source), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(stream.local_addr().unwrap().ip(), source.ip());
        let (_, peer) = listener.accept().await.unwrap();
        assert_eq!(peer.ip(), source.ip());
    }
}
