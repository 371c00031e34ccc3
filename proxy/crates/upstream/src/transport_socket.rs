//! An upstream connection with the cluster's transport socket: TCP, then TLS when the
//! cluster has an `UpstreamTlsContext`. The handshake counts against `connect_timeout`,
//! as in Envoy, where a connection is not connected until its transport socket is.
//! A host that is an internal listener gets an in-process pipe instead, with the
//! metadata the `internal_upstream` socket passes.

use std::io;
use std::sync::Arc;

use shunt_core::interned::EncodedMetadata;

use super::Cluster;
use super::cluster::UpstreamConnection;
use super::host::Host;
use super::internal::SharedFilterState;
use shunt_tls::TransportStream;
use shunt_tls::{HandshakeError, Secrets};

/// Why an upstream connection could not be made (flag `UF` either way).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0}")]
    Connect(io::Error),
    /// The TLS handshake failed, or the secrets it needs are missing.
    #[error("TLS error: {0}")]
    Tls(HandshakeError),
}

type Socket = Option<Arc<shunt_tls::UpstreamTls>>;
type Passthrough = Option<Arc<shunt_tls::internal_upstream::Passthrough>>;

/// The socket `host` of `cluster` is reached with: the first of
/// `transport_socket_matches` the endpoint's metadata satisfies, else the cluster's own.
fn socket_for<'a>(cluster: &'a Cluster, host: &Host) -> (&'a Socket, &'a Passthrough) {
    match cluster
        .transport_socket_matches
        .iter()
        .find(|m| m.matches(host.socket_match.as_deref()))
    {
        Some(m) => {
            tracing::trace!(cluster = %cluster.name, host = %host.address, socket_match = %m.name, "transport socket match");
            (&m.socket, &m.passthrough)
        }
        None => (&cluster.transport_socket, &cluster.passthrough),
    }
}

/// What the TLS session of `stream`, made by [`connect`] to `host`, tells: the server's
/// SANs as the peer's, and the URI SANs of the certificate this side presented (Istio's
/// source principal on the client side). `None` for a connection without TLS.
pub fn session(
    cluster: &Cluster,
    host: &Host,
    stream: &TransportStream,
    secrets: &Secrets,
) -> Option<shunt_core::stream_info::Tls> {
    let mut tls = stream.client_session_info()?.tls;
    if let (Some(context), _) = socket_for(cluster, host) {
        tls.local_uri_sans = context.local_uri_sans(secrets);
    }
    Some(tls)
}

/// Connects to `host` of `cluster`, resolving SDS secrets in `secrets`.
pub async fn connect(
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    secrets: &Secrets,
) -> Result<(TransportStream, UpstreamConnection), ConnectError> {
    connect_sharing(cluster, host, secrets, SharedFilterState::default()).await
}

/// [`connect`], sharing `filter_state` with the internal listener `host` may be.
pub async fn connect_sharing(
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    secrets: &Secrets,
    filter_state: SharedFilterState,
) -> Result<(TransportStream, UpstreamConnection), ConnectError> {
    connect_with(cluster, host, secrets, filter_state, None, None).await
}

/// [`connect_sharing`], offering `alpn` in the TLS handshake instead of the
/// context's list when given, and `fallback` when neither has one.
pub async fn connect_with(
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    secrets: &Secrets,
    filter_state: SharedFilterState,
    alpn: Option<&[String]>,
    fallback: Option<&str>,
) -> Result<(TransportStream, UpstreamConnection), ConnectError> {
    let (socket, passthrough) = socket_for(cluster, host);
    if let Some(internal) = &host.internal {
        if socket.is_some() {
            return Err(ConnectError::Connect(io::Error::new(
                io::ErrorKind::Unsupported,
                "TLS to an internal listener is not implemented",
            )));
        }
        let metadata = passthrough
            .as_deref()
            .map(|p| {
                let (of_cluster, of_host) = (&cluster.metadata, &host.metadata);
                p.collect(
                    EncodedMetadata::of(of_cluster),
                    EncodedMetadata::of(of_host),
                )
            })
            .unwrap_or_default();
        let dial = async { super::internal::connect(internal, metadata, filter_state) };
        let (pipe, guard) = cluster
            .connect_with(host, dial)
            .await
            .map_err(ConnectError::Connect)?;
        return Ok((TransportStream::in_process(pipe), guard));
    }
    if let Some(tls) = socket
        && let Some(client) = super::same_node::current()
        && let Some(result) = same_node(&client, cluster, host, tls, secrets).await
    {
        return result;
    }
    let (tcp, guard) = cluster.connect(host).await.map_err(ConnectError::Connect)?;
    let Some(tls) = socket else {
        return Ok((TransportStream::Raw(tcp), guard));
    };
    let handshake = tls.connect(tcp, host.address, secrets, alpn, fallback);
    let result = match tokio::time::timeout(cluster.connect_timeout, handshake).await {
        Ok(result) => result,
        Err(_) => Err(HandshakeError::Io(io::Error::new(
            io::ErrorKind::TimedOut,
            "handshake timed out",
        ))),
    };
    match result {
        Ok(stream) => {
            cluster.stats.ssl.handshake.inc();
            Ok((stream.into(), guard))
        }
        Err(err) => {
            cluster.stats.ssl.connection_error.inc();
            Err(ConnectError::Tls(err))
        }
    }
}

/// The fast path: a TLS connection to a pod of this process, handed over in process
/// (`None`: no such pod, connect over the network).
async fn same_node(
    client: &super::same_node::Client,
    cluster: &Arc<Cluster>,
    host: &Arc<Host>,
    tls: &shunt_tls::UpstreamTls,
    secrets: &Secrets,
) -> Option<Result<(TransportStream, UpstreamConnection), ConnectError>> {
    let hello = match tls.in_process_hello(secrets) {
        Ok(hello) => hello,
        Err(err) => return Some(Err(ConnectError::Tls(err))),
    };
    let offered = super::same_node::offer(client, host.address, hello)?;
    tracing::trace!(cluster = %cluster.name, host = %host.address, "same-node fast path");
    let dial = async {
        let chain = match tokio::time::timeout(cluster.connect_timeout, offered.answer).await {
            Ok(Ok(Ok(chain))) => chain,
            Ok(Ok(Err(why))) => return Err(super::same_node::refused(why)),
            Ok(Err(_)) => return Err(super::same_node::refused("the destination closed".into())),
            Err(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "handshake timed out",
                ));
            }
        };
        Ok((offered.stream, chain))
    };
    let ((stream, chain), guard) = match cluster.connect_with(host, dial).await {
        Ok(done) => done,
        Err(err) => {
            cluster.stats.ssl.connection_error.inc();
            return Some(Err(ConnectError::Tls(HandshakeError::Io(err))));
        }
    };
    if let Err(err) = tls.verify_in_process_server(secrets, &chain) {
        cluster.stats.ssl.connection_error.inc();
        return Some(Err(ConnectError::Tls(err)));
    }
    Some(Ok((TransportStream::in_process(stream), guard)))
}
