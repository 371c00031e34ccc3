//! [`super::copy`]'s job for connections with TLS on either side: the same semantics
//! (a half-close passes through as `close_notify` + FIN, a reset or failure on one side
//! resets the other, the idle timeout, Envoy's byte counts) over any [`TransportStream`], at the
//! cost of the socket fast path: TLS records must pass through rustls anyway.
//!
//! Each direction owns one 64 KiB buffer (four TLS records) for the connection's life.

use std::io;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::copy::{Activity, End, Outcome, Side};
use shunt_tls::TransportStream;

const BUFFER: usize = 64 * 1024;

/// Copies both ways until both directions end, one side fails, or nothing moves for
/// `idle_timeout`; then closes both (RST to the survivor of a failure).
pub async fn copy<D: super::DownstreamIo>(
    downstream: D,
    upstream: TransportStream,
    idle_timeout: Option<Duration>,
) -> Outcome {
    let activity = Activity::new();
    let (mut down_read, mut down_write) = tokio::io::split(downstream);
    let (mut up_read, mut up_write) = tokio::io::split(upstream);
    let (mut received, mut forwarded, mut fetched, mut sent) = (0u64, 0u64, 0u64, 0u64);
    let work = async {
        let mut to_upstream = std::pin::pin!(pump(
            &mut down_read,
            &mut up_write,
            &mut received,
            &mut forwarded,
            &activity,
        ));
        let mut to_downstream = std::pin::pin!(pump(
            &mut up_read,
            &mut down_write,
            &mut fetched,
            &mut sent,
            &activity,
        ));
        // A failure belongs to the side it happened on: the source when reading, the
        // sink when writing.
        let up = |(read, error): (bool, io::Error)| {
            let side = if read {
                Side::Downstream
            } else {
                Side::Upstream
            };
            (side, error)
        };
        let down = |(read, error): (bool, io::Error)| {
            let side = if read {
                Side::Upstream
            } else {
                Side::Downstream
            };
            (side, error)
        };
        let failure = tokio::select! {
            done = &mut to_upstream => match done {
                Ok(()) => to_downstream.await.map_err(down),
                Err(e) => Err(up(e)),
            },
            done = &mut to_downstream => match done {
                Ok(()) => to_upstream.await.map_err(up),
                Err(e) => Err(down(e)),
            },
        };
        match failure {
            Ok(()) => End::Closed,
            Err((side, error)) => End::Failed { side, error },
        }
    };
    let end = match idle_timeout {
        None => work.await,
        Some(idle) => tokio::select! {
            end = work => end,
            () = activity.idle_for(idle) => End::IdleTimeout,
        },
    };
    let downstream = down_read.unsplit(down_write);
    let mut upstream = up_read.unsplit(up_write);
    match &end {
        End::Failed { side, .. } => match side {
            Side::Downstream => upstream.abort(),
            Side::Upstream => super::DownstreamIo::abort(&downstream),
        },
        // Close both with close_notify and FIN, as the plain copy closes with FIN.
        End::IdleTimeout => {
            let mut downstream = downstream;
            let close = async {
                let _ = downstream.shutdown().await;
                let _ = upstream.shutdown().await;
            };
            let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
        }
        // Never parked: only the plain copy is (super::handover).
        End::Closed | End::HandedOver => {}
    }
    Outcome {
        bytes_received: received,
        bytes_sent: sent,
        upstream_bytes_sent: forwarded,
        upstream_bytes_received: fetched,
        end,
    }
}

/// Copies `from` to `to` until EOF, then half-closes `to`. An error says whether it
/// happened reading (`true`) or writing.
async fn pump<R, W>(
    from: &mut R,
    to: &mut W,
    read: &mut u64,
    written: &mut u64,
    activity: &Activity,
) -> Result<(), (bool, io::Error)>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUFFER];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(n) => n,
            // A TLS peer that closed TCP without close_notify: Envoy treats it as a
            // close, and so does every client that does it.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => 0,
            Err(e) => return Err((true, e)),
        };
        if n == 0 {
            break;
        }
        *read += n as u64;
        activity.touch();
        to.write_all(&buf[..n]).await.map_err(|e| (false, e))?;
        // TLS buffers a record until flushed.
        to.flush().await.map_err(|e| (false, e))?;
        *written += n as u64;
        activity.touch();
    }
    match to.shutdown().await {
        Err(e) if e.kind() != io::ErrorKind::NotConnected => Err((false, e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use shunt_config::Diagnostics;
    use shunt_tls::testing::Pki;
    use shunt_tls::{DownstreamTls, Secrets, UpstreamTls};

    /// A TLS client, the proxy's copy (TLS downstream, raw upstream) and a plain server.
    struct Proxied {
        client: tokio_rustls::client::TlsStream<shunt_tls::stream::TransportStream>,
        server: TcpStream,
        outcome: tokio::task::JoinHandle<Outcome>,
        _pki: Pki,
    }

    async fn proxied(idle_timeout: Option<Duration>) -> Proxied {
        let pki = Pki::new();
        let mut problems = Diagnostics::default();
        let server_tls = DownstreamTls::compile(
            &shunt_config::message_from_json(json!({"common_tls_context": {"tls_certificates": [{
                "certificate_chain": {"filename": pki.path("server.pem")},
                "private_key": {"filename": pki.path("server.key")}}]}}))
            .unwrap(),
            &shunt_config::JsonPath::new("d"),
            &mut problems,
        )
        .unwrap();
        let client_tls = UpstreamTls::compile(
            &shunt_config::message_from_json(json!({"common_tls_context": {
                "validation_context": {"trusted_ca": {"filename": pki.path("ca.pem")}}}}))
            .unwrap(),
            &shunt_config::JsonPath::new("u"),
            &mut problems,
        )
        .unwrap();
        let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (front_addr, backend_addr) =
            (front.local_addr().unwrap(), backend.local_addr().unwrap());
        let none = Secrets::new();
        let (client, downstream) = tokio::join!(
            async {
                let tcp = TcpStream::connect(front_addr).await.unwrap();
                client_tls
                    .connect(tcp, front_addr, &none, None, None)
                    .await
                    .unwrap()
            },
            async {
                let (tcp, _) = front.accept().await.unwrap();
                server_tls.accept(tcp, &none).await.unwrap()
            }
        );
        let upstream = TcpStream::connect(backend_addr).await.unwrap();
        let (server, _) = backend.accept().await.unwrap();
        let outcome = tokio::spawn(copy::<TransportStream>(
            downstream.into(),
            TransportStream::Raw(upstream),
            idle_timeout,
        ));
        Proxied {
            client,
            server,
            outcome,
            _pki: pki,
        }
    }

    #[tokio::test]
    async fn a_tls_half_close_reaches_the_server_and_its_later_reply_comes_back() {
        let Proxied {
            mut client,
            mut server,
            outcome,
            _pki,
        } = proxied(None).await;
        client.write_all(b"request").await.unwrap();
        // close_notify and FIN.
        client.shutdown().await.unwrap();
        let mut request = Vec::new();
        server.read_to_end(&mut request).await.unwrap();
        assert_eq!(request, b"request");
        server.write_all(b"late reply").await.unwrap();
        server.shutdown().await.unwrap();
        let mut reply = Vec::new();
        client.read_to_end(&mut reply).await.unwrap();
        assert_eq!(reply, b"late reply");
        let outcome = outcome.await.unwrap();
        assert!(matches!(outcome.end, End::Closed), "{:?}", outcome.end);
        assert_eq!((outcome.bytes_received, outcome.bytes_sent), (7, 10));
        assert_eq!(
            (outcome.upstream_bytes_sent, outcome.upstream_bytes_received),
            (7, 10)
        );
    }

    #[tokio::test]
    async fn a_server_reset_resets_the_tls_client() {
        let Proxied {
            mut client,
            server,
            outcome,
            _pki,
        } = proxied(None).await;
        server.set_zero_linger().unwrap();
        drop(server);
        let mut buf = [0u8; 16];
        let err = client.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionReset, "{err}");
        let outcome = outcome.await.unwrap();
        assert!(
            matches!(
                outcome.end,
                End::Failed {
                    side: Side::Upstream,
                    ..
                }
            ),
            "{:?}",
            outcome.end
        );
    }

    #[tokio::test]
    async fn nothing_moving_for_the_idle_timeout_closes_both_sides() {
        let Proxied {
            mut client,
            mut server,
            outcome,
            _pki,
        } = proxied(Some(Duration::from_millis(200))).await;
        client.write_all(b"x").await.unwrap();
        let mut one = [0u8; 1];
        server.read_exact(&mut one).await.unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(5), outcome)
            .await
            .expect("the idle timeout fired")
            .unwrap();
        assert!(matches!(outcome.end, End::IdleTimeout), "{:?}", outcome.end);
        // Both peers see a clean close.
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        server.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
    }
}
