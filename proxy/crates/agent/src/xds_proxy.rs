//! pilot-agent's xDS proxy: the agent holds the connection to istiod and the proxy
//! (a supervised Envoy) talks to the agent over a Unix socket
//! (`./etc/istio/proxy/XDS`), so the proxy needs neither istiod's address nor a
//! credential. Each stream the proxy opens gets its own stream upstream; requests go
//! up and responses come down unchanged, except the name table (NDS), which the agent
//! asks for itself and keeps for its DNS proxy: the proxy never sees that type.
//!
//! When either side's stream ends the other is ended too, so Envoy's own reconnect
//! logic (with its back-off) drives the retries, as with pilot-agent.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc::Status as RpcStatus;
use shunt_xds::grpc::Responses;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::ca::CertificateProvider;
use shunt_xds::local::{LocalServer, MessageStream};
use shunt_xds::source::{Target, Tls};

/// The name table istiod sends to the agent's DNS proxy.
pub const NAME_TABLE: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";

const ADS_SOTW: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
const ADS_DELTA: &str =
    "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";

/// Takes a pushed name table and its version; an error NACKs it (the DNS proxy keeps
/// its last good one).
pub type NameTableSink = Arc<dyn Fn(&Any, &str) -> Result<(), String> + Send + Sync>;

/// Where the agent reaches istiod, and with what.
#[derive(Clone)]
pub struct Upstream {
    pub target: Target,
    pub tls: Option<Tls>,
    /// gRPC metadata on every upstream stream (pilot-agent's `ClusterID`, ...).
    pub metadata: Vec<(String, String)>,
    /// A bearer token file, read at every connect (Kubernetes rotates it):
    /// `authorization: Bearer <token>`.
    pub token_path: Option<PathBuf>,
    /// The workload certificate: once there is one, each TLS connect presents the
    /// current one as its client certificate (mTLS to istiod).
    pub certificates: Option<CertificateProvider>,
}

/// The proxy, and what it counts.
pub struct XdsProxy {
    upstream: Upstream,
    name_table: Option<NameTableSink>,
    /// Downstream streams accepted, name tables taken, name tables refused.
    pub streams: AtomicU64,
    pub name_tables: AtomicU64,
    pub name_tables_rejected: AtomicU64,
    /// Responses from the control plane, and why the last upstream stream failed:
    /// what the status server says when the proxy is not ready.
    responses: AtomicU64,
    last_error: std::sync::Mutex<Option<String>>,
}

type ResponseStream<T> = MessageStream<T>;

impl XdsProxy {
    /// `name_table`: where NDS goes; `None` means the agent runs no DNS proxy and does not
    /// ask for it.
    pub fn new(upstream: Upstream, name_table: Option<NameTableSink>) -> Arc<XdsProxy> {
        Arc::new(XdsProxy {
            upstream,
            name_table,
            streams: AtomicU64::new(0),
            name_tables: AtomicU64::new(0),
            name_tables_rejected: AtomicU64::new(0),
            responses: AtomicU64::new(0),
            last_error: std::sync::Mutex::new(None),
        })
    }

    /// Why the control plane may be what keeps the proxy unready: nothing when it has
    /// answered; else where it is and the last error of a stream to it.
    pub fn diagnosis(&self) -> Option<String> {
        if self.responses.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let last = self
            .last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Some(match last {
            Some(error) => format!(
                "no response from the control plane at {} yet (last error: {error})",
                self.upstream.target
            ),
            None => format!(
                "no response from the control plane at {} yet",
                self.upstream.target
            ),
        })
    }

    fn note_error(&self, error: &str) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_owned());
    }

    /// Serves the ADS service on the Unix socket `path` (replacing a stale socket file)
    /// until `shutdown` resolves.
    pub async fn serve_unix(
        self: Arc<Self>,
        path: &Path,
        shutdown: impl std::future::Future<Output = ()> + Send,
    ) -> anyhow::Result<()> {
        if path.exists() {
            std::fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let listener = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("listening on {}", path.display()))?;
        tracing::info!(socket = %path.display(), upstream = %self.upstream.target, "xDS proxy listening");
        // One service: served without a router.
        let service = AggregatedDiscoveryServiceServer::new(Downstream(self));
        tonic::transport::Server::builder()
            .serve_with_incoming_shutdown(service, UnixListenerStream::new(listener), shutdown)
            .await
            .context("serving the xDS proxy")
    }

    async fn channel(&self) -> Result<tonic::transport::Channel, Status> {
        let mut tls = self.upstream.tls.clone();
        let workload = self
            .upstream
            .certificates
            .as_ref()
            .and_then(|c| c.current());
        if let (Some(tls), Some(bundle)) = (tls.as_mut(), workload) {
            tls.client_certificate = Some((
                bundle.cert_chain.as_bytes().to_vec(),
                bundle.private_key.as_bytes().to_vec(),
            ));
        }
        shunt_xds::stream::connect(&self.upstream.target, tls.as_ref(), None, None)
            .await
            .map_err(|e| Status::unavailable(format!("istiod at {}: {e}", self.upstream.target)))
    }

    /// The upstream request with the agent's metadata and a freshly read token.
    fn upstream_request<T>(&self, body: T) -> Result<Request<T>, Status> {
        let mut request = Request::new(body);
        let mut metadata = self.upstream.metadata.clone();
        if let Some(path) = &self.upstream.token_path {
            let token = std::fs::read_to_string(path).map_err(|e| {
                Status::unauthenticated(format!("reading the token {}: {e}", path.display()))
            })?;
            metadata.push(("authorization".into(), format!("Bearer {}", token.trim())));
        }
        for (key, value) in metadata {
            let key = tonic::metadata::MetadataKey::from_bytes(key.as_bytes())
                .map_err(|_| Status::internal(format!("bad metadata key {key:?}")))?;
            let value = value
                .parse()
                .map_err(|_| Status::internal(format!("bad metadata value for {key}")))?;
            request.metadata_mut().insert(key, value);
        }
        Ok(request)
    }

    /// Hands a name table to the sink; the error to NACK it with, if refused.
    fn take_name_table(&self, resources: &[Any], version: &str) -> Option<String> {
        let sink = self.name_table.as_ref()?;
        let result = match resources {
            [table] => sink(table, version),
            [] => Err("the response has no NameTable".into()),
            more => Err(format!("{} NameTables in one response", more.len())),
        };
        match result {
            Ok(()) => {
                self.name_tables.fetch_add(1, Ordering::Relaxed);
                None
            }
            Err(error) => {
                self.name_tables_rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "name table refused");
                Some(error)
            }
        }
    }
}

struct Downstream(Arc<XdsProxy>);

#[tonic::async_trait]
impl AggregatedDiscoveryService for Downstream {
    type StreamAggregatedResourcesStream = ResponseStream<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = ResponseStream<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let responses = self.0.clone().sotw(Box::pin(request.into_inner())).await?;
        Ok(Response::new(responses))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let responses = self.0.clone().delta(Box::pin(request.into_inner())).await?;
        Ok(Response::new(responses))
    }
}

/// The in-process proxy's ADS stream, by call (see [`shunt_xds::local`]): relayed as
/// a supervised Envoy's is, with no socket in between.
#[tonic::async_trait]
impl LocalServer for Downstream {
    async fn sotw(
        &self,
        method: &'static str,
        requests: MessageStream<DiscoveryRequest>,
    ) -> Result<MessageStream<DiscoveryResponse>, Status> {
        if method != ADS_SOTW {
            return Err(Status::unimplemented(format!(
                "the xDS proxy serves ADS, not {method}"
            )));
        }
        self.0.clone().sotw(requests).await
    }

    async fn delta(
        &self,
        method: &'static str,
        requests: MessageStream<DeltaDiscoveryRequest>,
    ) -> Result<MessageStream<DeltaDiscoveryResponse>, Status> {
        if method != ADS_DELTA {
            return Err(Status::unimplemented(format!(
                "the xDS proxy serves ADS, not {method}"
            )));
        }
        self.0.clone().delta(requests).await
    }
}

impl XdsProxy {
    /// This proxy as a server the in-process proxy's streams call.
    pub fn local(self: &Arc<Self>) -> Arc<dyn LocalServer> {
        Arc::new(Downstream(self.clone()))
    }

    /// One downstream SotW ADS stream, relayed over a stream of its own upstream.
    ///
    /// Returns at once: the upstream stream is opened and relayed by a task, and the
    /// proxy's requests are forwarded from the start. istiod (grpc-go) sends its
    /// response headers only with its first response, which it sends only after it
    /// has a request: waiting for the headers before forwarding would wait forever.
    async fn sotw(
        self: Arc<Self>,
        downstream_requests: MessageStream<DiscoveryRequest>,
    ) -> Result<ResponseStream<DiscoveryResponse>, Status> {
        let proxy = self;
        proxy.streams.fetch_add(1, Ordering::Relaxed);
        let (up_tx, up_rx) = mpsc::unbounded_channel::<DiscoveryRequest>();
        let (down_tx, down_rx) = mpsc::unbounded_channel();
        // Proxy -> istiod, with the agent's own NDS subscription after the first request
        // (which carries the node: istiod has it from the first request of the stream).
        let ask_nds = proxy.name_table.is_some();
        tokio::spawn(forward_requests(
            downstream_requests,
            up_tx.clone(),
            move |_: &DiscoveryRequest| {
                ask_nds.then(|| DiscoveryRequest {
                    type_url: NAME_TABLE.into(),
                    ..Default::default()
                })
            },
        ));
        // istiod -> proxy, minus the name table, which the agent ACKs itself.
        let relay = proxy.clone();
        tokio::spawn(async move {
            let upstream = match open(&relay, up_rx, ADS_SOTW).await {
                Ok(upstream) => upstream,
                Err(status) => return fail_open(&relay, &down_tx, status),
            };
            let counted = relay.clone();
            relay_responses(
                upstream,
                &counted,
                down_tx,
                up_tx,
                move |r: &DiscoveryResponse| {
                    (r.type_url == NAME_TABLE).then(|| DiscoveryRequest {
                        version_info: r.version_info.clone(),
                        response_nonce: r.nonce.clone(),
                        type_url: NAME_TABLE.into(),
                        error_detail: relay
                            .take_name_table(&r.resources, &r.version_info)
                            .map(nack),
                        ..Default::default()
                    })
                },
            )
            .await
        });
        Ok(Box::pin(UnboundedReceiverStream::new(down_rx)))
    }

    /// One downstream Delta ADS stream, relayed over a stream of its own upstream
    /// (opened as [`Self::sotw`] opens it).
    async fn delta(
        self: Arc<Self>,
        downstream_requests: MessageStream<DeltaDiscoveryRequest>,
    ) -> Result<ResponseStream<DeltaDiscoveryResponse>, Status> {
        let proxy = self;
        proxy.streams.fetch_add(1, Ordering::Relaxed);
        let (up_tx, up_rx) = mpsc::unbounded_channel::<DeltaDiscoveryRequest>();
        let (down_tx, down_rx) = mpsc::unbounded_channel();
        let ask_nds = proxy.name_table.is_some();
        tokio::spawn(forward_requests(
            downstream_requests,
            up_tx.clone(),
            move |_: &DeltaDiscoveryRequest| {
                // A wildcard subscription: no names.
                ask_nds.then(|| DeltaDiscoveryRequest {
                    type_url: NAME_TABLE.into(),
                    ..Default::default()
                })
            },
        ));
        let relay = proxy.clone();
        tokio::spawn(async move {
            let upstream = match open(&relay, up_rx, ADS_DELTA).await {
                Ok(upstream) => upstream,
                Err(status) => return fail_open(&relay, &down_tx, status),
            };
            let counted = relay.clone();
            relay_responses(
                upstream,
                &counted,
                down_tx,
                up_tx,
                move |r: &DeltaDiscoveryResponse| {
                    (r.type_url == NAME_TABLE).then(|| {
                        let tables: Vec<Any> = r
                            .resources
                            .iter()
                            .filter_map(|r| r.resource.clone())
                            .collect();
                        DeltaDiscoveryRequest {
                            response_nonce: r.nonce.clone(),
                            type_url: NAME_TABLE.into(),
                            error_detail: relay
                                .take_name_table(&tables, &r.system_version_info)
                                .map(nack),
                            ..Default::default()
                        }
                    })
                },
            )
            .await
        });
        Ok(Box::pin(UnboundedReceiverStream::new(down_rx)))
    }
}

/// The upstream stream could not be opened: the proxy's stream ends with why, and the
/// proxy's own back-off drives the retry.
fn fail_open<Resp>(
    proxy: &XdsProxy,
    down: &mpsc::UnboundedSender<Result<Resp, Status>>,
    status: Status,
) {
    tracing::warn!(error = %status.message(), "xDS proxy: opening the upstream stream failed");
    proxy.note_error(status.message());
    let _ = down.send(Err(status));
}

fn nack(message: String) -> RpcStatus {
    RpcStatus {
        // INVALID_ARGUMENT, as Envoy NACKs.
        code: 3,
        message,
        details: Vec::new(),
    }
}

/// istiod -> proxy: every response goes down, except those `keep` takes (the name
/// table), whose ACK or NACK it returns to go back up. Ends with either stream; an
/// upstream error goes down as the stream's status, so the proxy reconnects.
async fn relay_responses<Req, Resp>(
    mut responses: Responses<Resp>,
    proxy: &XdsProxy,
    down: mpsc::UnboundedSender<Result<Resp, Status>>,
    up: mpsc::UnboundedSender<Req>,
    keep: impl Fn(&Resp) -> Option<Req>,
) where
    Resp: prost::Message + Default,
{
    loop {
        // The proxy's stream may end first (Envoy restarts): then the upstream one ends
        // now, not at istiod's next push.
        let message = tokio::select! {
            message = responses.message() => message,
            () = down.closed() => return,
        };
        let response = match message {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(status) => {
                proxy.note_error(status.message());
                let _ = down.send(Err(status));
                return;
            }
        };
        proxy.responses.fetch_add(1, Ordering::Relaxed);
        let sent = match keep(&response) {
            Some(ack) => up.send(ack).is_ok(),
            None => down.send(Ok(response)).is_ok(),
        };
        if !sent {
            return;
        }
    }
}

/// Opens the upstream stream of `path`, fed from `requests`. Its responses are framed
/// by [`shunt_xds::grpc`]: no cap on their size (a full push of a large mesh is more
/// than tonic's default 4 MiB) and no receive buffer kept between them.
async fn open<Req, Resp>(
    proxy: &XdsProxy,
    requests: mpsc::UnboundedReceiver<Req>,
    path: &'static str,
) -> Result<Responses<Resp>, Status>
where
    Req: prost::Message + Send + 'static,
    Resp: prost::Message + Default + Send + 'static,
{
    let mut channel = proxy.channel().await?;
    shunt_xds::grpc::ready(&mut channel)
        .await
        .map_err(|e| Status::unavailable(format!("istiod not ready: {e}")))?;
    let (metadata, _, requests) = proxy
        .upstream_request(UnboundedReceiverStream::new(requests))?
        .into_parts();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    shunt_xds::grpc::call(channel, path, metadata, requests).await
}

/// Forwards the proxy's requests upstream; after the first, sends `extra(first)` if any.
/// Ends (dropping the upstream sender, which ends the upstream stream) when the proxy's
/// stream ends.
async fn forward_requests<Req>(
    mut downstream: MessageStream<Req>,
    upstream: mpsc::UnboundedSender<Req>,
    extra: impl FnOnce(&Req) -> Option<Req>,
) where
    Req: prost::Message + Clone + Default + Send + 'static,
{
    let mut extra = Some(extra);
    while let Some(Ok(request)) = downstream.next().await {
        let follow = extra.take().and_then(|f| f(&request));
        if upstream.send(request).is_err() {
            return;
        }
        if let Some(follow) = follow
            && upstream.send(follow).is_err()
        {
            return;
        }
    }
}
