//! The gRPC side: a thread with its own tokio runtime serving AggregatedDiscoveryService
//! and the per-type discovery services on one listener until told to stop.

use super::state::Shared;
use super::{Listen, methods};
use anyhow::{Context, Result, anyhow};
use envoy_types::pb::envoy::service::{
    cluster::v3::cluster_discovery_service_server::{
        self as cds, ClusterDiscoveryService, ClusterDiscoveryServiceServer,
    },
    discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
        aggregated_discovery_service_server::{
            AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
        },
    },
    endpoint::v3::endpoint_discovery_service_server::{
        self as eds, EndpointDiscoveryService, EndpointDiscoveryServiceServer,
    },
    listener::v3::listener_discovery_service_server::{
        self as lds, ListenerDiscoveryService, ListenerDiscoveryServiceServer,
    },
    route::v3::route_discovery_service_server::{
        self as rds, RouteDiscoveryService, RouteDiscoveryServiceServer,
    },
    secret::v3::secret_discovery_service_server::{
        self as sds, SecretDiscoveryService, SecretDiscoveryServiceServer,
    },
};
use std::{
    convert::Infallible,
    fs::File,
    net::SocketAddr,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    sync::{Arc, mpsc},
    task::{Context as TaskContext, Poll},
    thread::{self, JoinHandle},
    time::Duration,
};
use tokio::sync::{mpsc::unbounded_channel, watch};
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::{
    Request, Response, Status, Streaming,
    body::Body,
    codegen::{BoxFuture, Service, http},
    metadata::{KeyAndValueRef, MetadataMap},
    transport::{Server, server::TcpIncoming},
};

/// How long stopping waits for connections to wind down before dropping them.
const GRACE: Duration = Duration::from_millis(500);

/// One serving instance (a restart makes a new one).
pub(crate) struct Running {
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    /// Streams should be closed first: graceful shutdown waits for them.
    pub fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            eprintln!("ads: server thread panicked");
        }
    }
}

/// Bind `listen` and serve on a new thread; returns once listening, with the bound TCP
/// address. The thread first enters `netns` (the namespace of whoever first started
/// the server), so a restart from another thread listens in the same place.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    listen: Listen,
    netns: Arc<File>,
) -> Result<(Running, Option<SocketAddr>)> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = watch::channel(false);
    let thread = thread::Builder::new()
        .name("ads-server".into())
        .spawn(move || {
            let runtime = enter_netns(&netns).and_then(|()| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("ads-worker")
                    .enable_all()
                    .build()
                    .context("building the ADS server runtime")
            });
            let runtime = match runtime {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            runtime.block_on(serve(shared, listen, stop_rx, ready_tx));
            // Whatever did not finish within the grace period (connections, stream
            // tasks) is dropped here, which closes its sockets.
            runtime.shutdown_timeout(Duration::from_millis(100));
        })
        .context("spawning the ADS server thread")?;
    let running = Running {
        stop: stop_tx,
        thread: Some(thread),
    };
    match ready_rx.recv() {
        Ok(Ok(addr)) => Ok((running, addr)),
        Ok(Err(e)) => {
            running.stop();
            Err(e)
        }
        Err(_) => {
            running.stop();
            Err(anyhow!("the ADS server thread exited before listening"))
        }
    }
}

fn enter_netns(netns: &File) -> Result<()> {
    let want = netns.metadata()?;
    let have = std::fs::metadata("/proc/thread-self/ns/net")?;
    if (want.dev(), want.ino()) == (have.dev(), have.ino()) {
        // setns needs CAP_SYS_ADMIN even into the current namespace; skip it.
        return Ok(());
    }
    // SAFETY: setns on a valid fd only changes this thread's namespace.
    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setns into the ADS server netns");
    }
    Ok(())
}

async fn serve(
    shared: Arc<Shared>,
    listen: Listen,
    stop: watch::Receiver<bool>,
    ready: mpsc::Sender<Result<Option<SocketAddr>>>,
) {
    let service = Services::new(Arc::new(Ads {
        shared,
        stop: stop.clone(),
    }));
    let signal = {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|s| *s).await;
        }
    };
    let server = match bind(&listen).await {
        Ok(Bound::Tcp(listener, addr)) => {
            let _ = ready.send(Ok(Some(addr)));
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(Server::builder().serve_with_incoming_shutdown(service, incoming, signal))
        }
        Ok(Bound::Tls(listener, addr, acceptor)) => {
            let _ = ready.send(Ok(Some(addr)));
            let incoming = tls_incoming(listener, acceptor);
            tokio::spawn(Server::builder().serve_with_incoming_shutdown(service, incoming, signal))
        }
        Ok(Bound::Unix(listener)) => {
            let _ = ready.send(Ok(None));
            let incoming = UnixListenerStream::new(listener);
            tokio::spawn(Server::builder().serve_with_incoming_shutdown(service, incoming, signal))
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut stop = stop;
    let _ = stop.wait_for(|s| *s).await;
    match tokio::time::timeout(GRACE, server).await {
        Ok(Ok(Err(e))) => eprintln!("ads: server on {listen:?} failed: {e}"),
        Ok(Err(e)) => eprintln!("ads: server task on {listen:?} failed: {e}"),
        Ok(Ok(Ok(()))) | Err(_) => {}
    }
}

enum Bound {
    Tcp(tokio::net::TcpListener, SocketAddr),
    Tls(
        tokio::net::TcpListener,
        SocketAddr,
        tokio_rustls::TlsAcceptor,
    ),
    Unix(tokio::net::UnixListener),
}

async fn bind(listen: &Listen) -> Result<Bound> {
    match listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the ADS server to {addr}"))?;
            let addr = listener.local_addr()?;
            Ok(Bound::Tcp(listener, addr))
        }
        Listen::TcpTls {
            addr,
            cert,
            key,
            client_ca,
        } => {
            let acceptor = tls_acceptor(cert, key, client_ca.as_deref())?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the ADS server to {addr}"))?;
            let addr = listener.local_addr()?;
            Ok(Bound::Tls(listener, addr, acceptor))
        }
        Listen::Unix(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
            }
            let listener = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("binding the ADS server to {}", path.display()))?;
            Ok(Bound::Unix(listener))
        }
    }
}

/// The server side of TLS: the certificate chain and key from PEM files, ALPN h2;
/// with `client_ca`, a client certificate chaining to it is required.
fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
    client_ca: Option<&std::path::Path>,
) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading {}", cert.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("parsing {}", cert.display()))?;
    let key =
        PrivateKeyDer::from_pem_file(key).with_context(|| format!("reading {}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca)
                .with_context(|| format!("reading {}", ca.display()))?
            {
                roots.add(cert.with_context(|| format!("parsing {}", ca.display()))?)?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Accepted connections after their TLS handshake (failed handshakes are logged and
/// dropped, as a real server would).
pub(crate) fn tls_incoming(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
) -> UnboundedReceiverStream<std::io::Result<TlsConn>> {
    let (tx, rx) = unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                match acceptor.accept(stream).await {
                    Ok(tls) => {
                        let _ = tx.send(Ok(TlsConn(tls)));
                    }
                    Err(e) => eprintln!("ads: TLS handshake failed: {e}"),
                }
            });
        }
    });
    UnboundedReceiverStream::new(rx)
}

/// A TLS connection as tonic's server takes it.
pub(crate) struct TlsConn(tokio_rustls::server::TlsStream<tokio::net::TcpStream>);

/// The client's leaf certificate (DER), if it sent one.
#[derive(Clone)]
pub(crate) struct PeerCertificate(Option<Vec<u8>>);

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = PeerCertificate;
    fn connect_info(&self) -> Self::ConnectInfo {
        let leaf = self
            .0
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first());
        PeerCertificate(leaf.map(|c| c.to_vec()))
    }
}

impl tokio::io::AsyncRead for TlsConn {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for TlsConn {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.0).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

struct Ads {
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
}

type SotwResponses = Responses<DiscoveryResponse>;
type DeltaResponses = Responses<DeltaDiscoveryResponse>;
type Responses<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// The response stream, returned only once its first response is there: tonic sends a
/// stream's response headers as soon as the handler returns, but grpc-go (istiod) and
/// grpcio send them with the first response, so a client that waits for the headers
/// before it sends its first request hangs against them. The test server behaves as
/// istiod does so that every xDS test would catch such a client.
async fn with_first_response<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Result<T, Status>>,
) -> Result<Response<Responses<T>>, Status> {
    use tokio_stream::StreamExt as _;
    let first = rx
        .recv()
        .await
        .ok_or_else(|| Status::unavailable("the test server stopped the stream"))?;
    let rest = UnboundedReceiverStream::new(rx);
    Ok(Response::new(Box::pin(
        tokio_stream::once(first).chain(rest),
    )))
}

impl Ads {
    /// A state-of-the-world stream on `method`.
    async fn sotw(
        &self,
        method: &'static str,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<SotwResponses>, Status> {
        let (tx, rx) = unbounded_channel();
        let id = self.shared.open_sotw(method, metadata(&request), tx);
        let shared = self.shared.clone();
        tokio::spawn(read(
            request.into_inner(),
            self.stop.clone(),
            shared.clone(),
            id,
            move |req| shared.on_sotw(id, req),
        ));
        with_first_response(rx).await
    }

    /// A Delta stream on `method`.
    async fn delta(
        &self,
        method: &'static str,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<DeltaResponses>, Status> {
        let (tx, rx) = unbounded_channel();
        let id = self.shared.open_delta(method, metadata(&request), tx);
        let shared = self.shared.clone();
        tokio::spawn(read(
            request.into_inner(),
            self.stop.clone(),
            shared.clone(),
            id,
            move |req| shared.on_delta(id, req),
        ));
        with_first_response(rx).await
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = SotwResponses;
    type DeltaAggregatedResourcesStream = DeltaResponses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<SotwResponses>, Status> {
        self.sotw(methods::ADS, request).await
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<DeltaResponses>, Status> {
        self.delta(methods::ADS_DELTA, request).await
    }
}

/// A per-type service: its two streams are ADS streams on their own method (which
/// restricts them to the type); the unary Fetch is not served.
macro_rules! per_type_service {
    ($service:ident, $sotw_stream:ident, $sotw:ident, $sotw_method:expr,
     $delta_stream:ident, $delta:ident, $delta_method:expr, $fetch:ident) => {
        #[tonic::async_trait]
        impl $service for Ads {
            type $sotw_stream = SotwResponses;
            type $delta_stream = DeltaResponses;

            async fn $sotw(
                &self,
                request: Request<Streaming<DiscoveryRequest>>,
            ) -> Result<Response<SotwResponses>, Status> {
                self.sotw($sotw_method, request).await
            }

            async fn $delta(
                &self,
                request: Request<Streaming<DeltaDiscoveryRequest>>,
            ) -> Result<Response<DeltaResponses>, Status> {
                self.delta($delta_method, request).await
            }

            async fn $fetch(
                &self,
                _request: Request<DiscoveryRequest>,
            ) -> Result<Response<DiscoveryResponse>, Status> {
                Err(Status::unimplemented(concat!(
                    stringify!($fetch),
                    " is not served by the test server"
                )))
            }
        }
    };
}

per_type_service!(
    ClusterDiscoveryService,
    StreamClustersStream,
    stream_clusters,
    methods::CLUSTERS,
    DeltaClustersStream,
    delta_clusters,
    methods::CLUSTERS_DELTA,
    fetch_clusters
);
per_type_service!(
    EndpointDiscoveryService,
    StreamEndpointsStream,
    stream_endpoints,
    methods::ENDPOINTS,
    DeltaEndpointsStream,
    delta_endpoints,
    methods::ENDPOINTS_DELTA,
    fetch_endpoints
);
per_type_service!(
    ListenerDiscoveryService,
    StreamListenersStream,
    stream_listeners,
    methods::LISTENERS,
    DeltaListenersStream,
    delta_listeners,
    methods::LISTENERS_DELTA,
    fetch_listeners
);
per_type_service!(
    RouteDiscoveryService,
    StreamRoutesStream,
    stream_routes,
    methods::ROUTES,
    DeltaRoutesStream,
    delta_routes,
    methods::ROUTES_DELTA,
    fetch_routes
);
per_type_service!(
    SecretDiscoveryService,
    StreamSecretsStream,
    stream_secrets,
    methods::SECRETS,
    DeltaSecretsStream,
    delta_secrets,
    methods::SECRETS_DELTA,
    fetch_secrets
);

/// Every service on one listener, dispatched on the path's service name (tonic's own
/// router needs axum). Anything else gets ADS's UNIMPLEMENTED.
#[derive(Clone)]
struct Services {
    ads: AggregatedDiscoveryServiceServer<Ads>,
    cds: ClusterDiscoveryServiceServer<Ads>,
    eds: EndpointDiscoveryServiceServer<Ads>,
    lds: ListenerDiscoveryServiceServer<Ads>,
    rds: RouteDiscoveryServiceServer<Ads>,
    sds: SecretDiscoveryServiceServer<Ads>,
}

/// Large configurations (benchmarks) exceed tonic's 4 MiB default.
macro_rules! unlimited {
    ($server:ident, $ads:expr) => {
        $server::from_arc($ads.clone())
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX)
    };
}

impl Services {
    fn new(ads: Arc<Ads>) -> Services {
        Services {
            ads: unlimited!(AggregatedDiscoveryServiceServer, ads),
            cds: unlimited!(ClusterDiscoveryServiceServer, ads),
            eds: unlimited!(EndpointDiscoveryServiceServer, ads),
            lds: unlimited!(ListenerDiscoveryServiceServer, ads),
            rds: unlimited!(RouteDiscoveryServiceServer, ads),
            sds: unlimited!(SecretDiscoveryServiceServer, ads),
        }
    }
}

impl Service<http::Request<Body>> for Services {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let service = req
            .uri()
            .path()
            .trim_start_matches('/')
            .split('/')
            .next()
            .unwrap_or_default();
        match service {
            cds::SERVICE_NAME => self.cds.call(req),
            eds::SERVICE_NAME => self.eds.call(req),
            lds::SERVICE_NAME => self.lds.call(req),
            rds::SERVICE_NAME => self.rds.call(req),
            sds::SERVICE_NAME => self.sds.call(req),
            _ => self.ads.call(req),
        }
    }
}

/// Feed a stream's requests to `handle` until the client ends or drops it, or the
/// server stops; then forget the stream, which ends its response side. Dropping
/// `inbound` on stop also lets graceful shutdown finish.
async fn read<T>(
    mut inbound: Streaming<T>,
    mut stop: watch::Receiver<bool>,
    shared: Arc<Shared>,
    id: u64,
    handle: impl Fn(T),
) {
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            msg = inbound.message() => match msg {
                Ok(Some(req)) => handle(req),
                // The client ended or dropped the stream; a reset is ordinary here.
                Ok(None) | Err(_) => break,
            },
        }
    }
    shared.close(id, None);
}

/// The stream's initial metadata (binary values kept base64-encoded as sent), and the
/// client's TLS certificate as [`super::PEER_CERTIFICATE`].
fn metadata<T>(request: &Request<T>) -> Vec<(String, String)> {
    let mut metadata = metadata_entries(request.metadata());
    if let Some(PeerCertificate(Some(der))) = request.extensions().get::<PeerCertificate>() {
        let hex = der.iter().map(|b| format!("{b:02x}")).collect();
        metadata.push((super::PEER_CERTIFICATE.to_owned(), hex));
    }
    metadata
}

fn metadata_entries(map: &MetadataMap) -> Vec<(String, String)> {
    map.iter()
        .map(|kv| match kv {
            KeyAndValueRef::Ascii(k, v) => (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_encoded_bytes()).into_owned(),
            ),
            KeyAndValueRef::Binary(k, v) => (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_encoded_bytes()).into_owned(),
            ),
        })
        .collect()
}
