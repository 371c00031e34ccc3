//! One gRPC stream to an xDS server, kept up: connect (TCP or Unix socket, plaintext
//! HTTP/2), tell the manager, forward every response to it, and when the stream ends
//! reconnect after a jittered exponential back-off (Envoy's 500 ms base, 30 s cap),
//! reset once a stream has delivered a response.

use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use hyper_util::rt::TokioIo;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::{Channel, Endpoint};

use std::sync::Arc;

use super::local::{LocalServer, LocalServers, MessageStream};
use super::source::{Stream, Target, Tls};
use super::{grpc, wire};
use shunt_upstream::backoff::Backoff;

/// Full jitter: a random wait up to `500 ms * 2^attempt`, capped at 30 s, and at least a
/// tenth of that so a flapping server is not hammered.
const BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(500), Duration::from_secs(30)).full_jitter(0.1);
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A request for the server, of the stream's kind.
#[derive(Debug)]
pub enum Outbound {
    Sotw(DiscoveryRequest),
    Delta(DeltaDiscoveryRequest),
}

/// What a stream tells the manager.
#[derive(Debug)]
pub enum Event {
    /// Connected: send requests through `requests` (the initial ones first).
    Connected {
        stream: usize,
        requests: mpsc::UnboundedSender<Outbound>,
    },
    Sotw {
        stream: usize,
        response: wire::DiscoveryResponse,
    },
    Delta {
        stream: usize,
        response: wire::DeltaDiscoveryResponse,
    },
    Disconnected {
        stream: usize,
        error: String,
    },
}

/// Runs stream `index` until the manager goes away; a target among `local` is called
/// in this process rather than connected to.
pub async fn run(
    index: usize,
    config: Stream,
    events: mpsc::UnboundedSender<Event>,
    local: LocalServers,
    pool: Option<Arc<ChannelPool>>,
) {
    let path = crate::type_url::method(&config.types, config.delta);
    let server = local.get(&config.target);
    if server.is_some() {
        tracing::info!(target = %config.target, "xDS stream served in process: no socket");
    }
    let mut attempt = 0u32;
    loop {
        let result = match &server {
            Some(server) => local_session(index, &config, path, server.as_ref(), &events).await,
            None => session(index, &config, path, &events, pool.as_deref()).await,
        };
        if events.is_closed() {
            return;
        }
        let (error, delivered) = match result {
            Ok(delivered) => ("the server closed the stream".to_owned(), delivered),
            Err((error, delivered)) => (error, delivered),
        };
        tracing::warn!(target = %config.target, %error, "xDS stream ended; reconnecting");
        if events
            .send(Event::Disconnected {
                stream: index,
                error,
            })
            .is_err()
        {
            return;
        }
        attempt = if delivered { 0 } else { attempt + 1 };
        tokio::time::sleep(BACKOFF.delay(attempt)).await;
    }
}

/// One connected stream; returns whether any response arrived.
async fn session(
    index: usize,
    config: &Stream,
    path: &'static str,
    events: &mpsc::UnboundedSender<Event>,
    pool: Option<&ChannelPool>,
) -> Result<bool, (String, bool)> {
    let mut channel = connect(&config.target, config.tls.as_ref(), config.timeout, pool)
        .await
        .map_err(|e| (format!("connecting to {}: {e}", config.target), false))?;
    // Connected once the channel can take the call.
    grpc::ready(&mut channel)
        .await
        .map_err(|e| (format!("{}: {e}", config.target), false))?;
    let (tx, rx) = mpsc::unbounded_channel();
    let (sotw_tx, sotw_rx) = mpsc::unbounded_channel::<DiscoveryRequest>();
    let (delta_tx, delta_rx) = mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
    // One typed request channel per kind; the manager speaks `Outbound`.
    tokio::spawn(split(rx, sotw_tx, delta_tx));
    if events
        .send(Event::Connected {
            stream: index,
            requests: tx,
        })
        .is_err()
    {
        return Ok(false);
    }
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    if config.delta {
        let wrap = |response: wire::DeltaDiscoveryResponse| Event::Delta {
            stream: index,
            response,
        };
        exchange(channel, delta_rx, config, path, wrap, events).await
    } else {
        let wrap = |response: wire::DiscoveryResponse| Event::Sotw {
            stream: index,
            response,
        };
        exchange(channel, sotw_rx, config, path, wrap, events).await
    }
}

/// One stream to a server in this process: the same exchange as [`session`], by call.
async fn local_session(
    index: usize,
    config: &Stream,
    path: &'static str,
    server: &dyn LocalServer,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<bool, (String, bool)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let (sotw_tx, sotw_rx) = mpsc::unbounded_channel::<DiscoveryRequest>();
    let (delta_tx, delta_rx) = mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
    tokio::spawn(split(rx, sotw_tx, delta_tx));
    if events
        .send(Event::Connected {
            stream: index,
            requests: tx,
        })
        .is_err()
    {
        return Ok(false);
    }
    fn requests<T: Send + 'static>(rx: mpsc::UnboundedReceiver<T>) -> MessageStream<T> {
        Box::pin(UnboundedReceiverStream::new(rx).map(Ok))
    }
    let fail = |status: tonic::Status, delivered: bool| {
        (
            format!("gRPC status {:?}: {}", status.code(), status.message()),
            delivered,
        )
    };
    let mut delivered = false;
    if config.delta {
        let mut responses = server
            .delta(path, requests(delta_rx))
            .await
            .map_err(|s| fail(s, false))?;
        while let Some(response) = responses.next().await {
            let response = response.map_err(|s| fail(s, delivered))?;
            delivered = true;
            let event = Event::Delta {
                stream: index,
                response: response.into(),
            };
            if events.send(event).is_err() {
                break;
            }
        }
    } else {
        let mut responses = server
            .sotw(path, requests(sotw_rx))
            .await
            .map_err(|s| fail(s, false))?;
        while let Some(response) = responses.next().await {
            let response = response.map_err(|s| fail(s, delivered))?;
            delivered = true;
            let event = Event::Sotw {
                stream: index,
                response: response.into(),
            };
            if events.send(event).is_err() {
                break;
            }
        }
    }
    Ok(delivered)
}

/// Streams `requests` to the server and hands every response to the manager, wrapped;
/// returns whether any arrived. No cap on a response's size: a full push of a large
/// mesh is more than gRPC's usual 4 MiB (Envoy has none).
async fn exchange<Req, Resp>(
    channel: Channel,
    requests: mpsc::UnboundedReceiver<Req>,
    config: &Stream,
    path: tonic::codegen::http::uri::PathAndQuery,
    wrap: impl Fn(Resp) -> Event,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<bool, (String, bool)>
where
    Req: prost::Message + Send + 'static,
    Resp: prost::Message + Default + Send + 'static,
{
    let fail = |status: tonic::Status, delivered: bool| {
        (
            format!("gRPC status {:?}: {}", status.code(), status.message()),
            delivered,
        )
    };
    let metadata = metadata(config)?;
    let requests = UnboundedReceiverStream::new(requests);
    let mut responses = grpc::call::<Req, Resp>(channel, path, metadata, requests)
        .await
        .map_err(|s| fail(s, false))?;
    let mut delivered = false;
    while let Some(response) = responses.message().await.map_err(|s| fail(s, delivered))? {
        delivered = true;
        if events.send(wrap(response)).is_err() {
            break;
        }
    }
    Ok(delivered)
}

async fn split(
    mut rx: mpsc::UnboundedReceiver<Outbound>,
    sotw: mpsc::UnboundedSender<DiscoveryRequest>,
    delta: mpsc::UnboundedSender<DeltaDiscoveryRequest>,
) {
    while let Some(request) = rx.recv().await {
        let sent = match request {
            Outbound::Sotw(r) => sotw.send(r).is_ok(),
            Outbound::Delta(r) => delta.send(r).is_ok(),
        };
        if !sent {
            return;
        }
    }
}

/// The stream's `initial_metadata`, as request headers.
fn metadata(config: &Stream) -> Result<tonic::metadata::MetadataMap, (String, bool)> {
    let mut metadata = tonic::metadata::MetadataMap::new();
    for (key, value) in &config.initial_metadata {
        let key = tonic::metadata::MetadataKey::from_bytes(key.as_bytes())
            .map_err(|_| (format!("{}: bad metadata key {key:?}", config.path), false))?;
        let value = value.parse().map_err(|_| {
            (
                format!("{}: bad metadata value {value:?}", config.path),
                false,
            )
        })?;
        metadata.insert(key, value);
    }
    Ok(metadata)
}

/// A gRPC channel to `target` (TLS when given): the manager's streams use it, and so
/// does the agent's xDS proxy for its upstream. With a `pool`, streams to the same
/// server share its connection.
pub async fn connect(
    target: &Target,
    tls: Option<&Tls>,
    timeout: Option<Duration>,
    pool: Option<&ChannelPool>,
) -> Result<Channel, String> {
    match pool {
        Some(pool) => pool.connect(target, tls, timeout).await,
        None => connect_new(target, tls, timeout).await,
    }
}

/// Connections shared by the xDS streams of several proxy instances: every stream to
/// one server (same address, same TLS) goes over one HTTP/2 connection, as many streams
/// as there are xDS nodes. Node mode gives one to its pods (each pod is its own node, so
/// the streams stay one per pod; the connection is shared). A channel reconnects by
/// itself.
#[derive(Default)]
pub struct ChannelPool {
    channels: std::sync::Mutex<Vec<(Target, Option<Tls>, Channel)>>,
}

impl std::fmt::Debug for ChannelPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("ChannelPool")
            .field("connections", &channels.len())
            .finish()
    }
}

impl ChannelPool {
    async fn connect(
        &self,
        target: &Target,
        tls: Option<&Tls>,
        timeout: Option<Duration>,
    ) -> Result<Channel, String> {
        if let Some(channel) = self.find(target, tls) {
            return Ok(channel);
        }
        let channel = connect_new(target, tls, timeout).await?;
        let mut channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        // Another stream may have connected meanwhile: keep one connection.
        if let Some((_, _, c)) = channels
            .iter()
            .find(|(t, s, _)| t == target && s.as_ref() == tls)
        {
            return Ok(c.clone());
        }
        channels.push((target.clone(), tls.cloned(), channel.clone()));
        Ok(channel)
    }

    fn find(&self, target: &Target, tls: Option<&Tls>) -> Option<Channel> {
        let channels = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        channels
            .iter()
            .find(|(t, s, _)| t == target && s.as_ref() == tls)
            .map(|(_, _, c)| c.clone())
    }
}

async fn connect_new(
    target: &Target,
    tls: Option<&Tls>,
    timeout: Option<Duration>,
) -> Result<Channel, String> {
    let timeout = timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let endpoint = Endpoint::from_static("http://xds").connect_timeout(timeout);
    let tls = match tls {
        Some(tls) => Some(tls_connector(tls, target)?),
        None => None,
    };
    let target = target.clone();
    let connector = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let (target, tls) = (target.clone(), tls.clone());
        async move { dial(&target, tls).await }
    });
    endpoint
        .connect_with_connector(connector)
        .await
        .map_err(|e| error_chain(&e))
}

/// A byte stream to the server: TCP or a Unix socket, in TLS when asked.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Io for T {}

type TlsDial = (
    tokio_rustls::TlsConnector,
    rustls::pki_types::ServerName<'static>,
);

async fn dial(target: &Target, tls: Option<TlsDial>) -> std::io::Result<TokioIo<Box<dyn Io>>> {
    let plain: Box<dyn Io> = match target {
        Target::Tcp(addr) => {
            let stream = tokio::net::TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            Box::new(stream)
        }
        Target::Unix(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
    };
    Ok(TokioIo::new(match tls {
        Some((connector, name)) => Box::new(connector.connect(name, plain).await?),
        None => plain,
    }))
}

/// The TLS client for `tls`: the server must chain to `trusted_ca` and be named by
/// `sni` (else its IP address); a client certificate when given; ALPN h2, as gRPC wants.
fn tls_connector(tls: &Tls, target: &Target) -> Result<TlsDial, String> {
    use rustls::pki_types::ServerName;
    use shunt_tls::pem;
    // The data plane's PEM readers: the same errors for the same mistakes.
    let roots = pem::roots(&tls.trusted_ca).map_err(|e| format!("trusted_ca: {e}"))?;
    let builder = rustls::ClientConfig::builder_with_provider(shunt_tls::secret::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots);
    let mut config = match &tls.client_certificate {
        Some((chain, key)) => {
            let chain = pem::certificates(chain).map_err(|e| format!("certificate_chain: {e}"))?;
            let key = pem::private_key(key).map_err(|e| format!("private_key: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("tls_certificates[0]: {e}"))?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    let name = match (&tls.server_name, target) {
        (Some(sni), _) => ServerName::try_from(sni.clone()).map_err(|e| format!("sni: {e}"))?,
        (None, Target::Tcp(addr)) => ServerName::IpAddress(addr.ip().into()),
        (None, Target::Unix(_)) => return Err("TLS over a Unix socket needs an sni".into()),
    };
    Ok((tokio_rustls::TlsConnector::from(Arc::new(config)), name))
}

/// An error with its causes, which tonic's transport errors hide.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
