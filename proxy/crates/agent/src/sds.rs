//! The SDS server pilot-agent runs for its Envoy: `envoy.service.secret.v3.
//! SecretDiscoveryService` on a Unix socket (Istio's
//! `./var/run/secrets/workload-spiffe-uds/socket`), serving the workload certificate as
//! `default` and the mesh root as `ROOTCA` from a [`CertificateProvider`], and pushing
//! each rotation to every open stream.
//!
//! State of the world, as Envoy's SDS client speaks it: a request names the secrets it
//! wants; the server answers with a version and a nonce; Envoy ACKs (the nonce back, no
//! `error_detail`) or NACKs (with `error_detail`), and a request carrying an older nonce
//! than the last response is stale and ignored. Nothing is sent until a certificate
//! exists: Envoy's listeners wait (warm) for it, as they do with pilot-agent. Delta SDS
//! is refused (`UNIMPLEMENTED`); Envoy's `sds-grpc` cluster in Istio's bootstrap uses
//! `GRPC`, not `DELTA_GRPC`.
//!
//! The in-process proxy gets the same streams by call ([`local`]): no socket.
//!
//! ```ignore
//! let (provider, _task) = CertificateProvider::start_ca(CaOptions::from_env()?);
//! let listener = sds::bind(Path::new(sds::DEFAULT_SOCKET))?;
//! tokio::spawn(sds::serve(listener, provider, std::future::pending()));
//! ```

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::ca::{Bundle, CertificateProvider};
use shunt_xds::local::{LocalServer, MessageStream};

/// Where Istio's Envoy looks for its SDS server (relative to the proxy's working
/// directory, `/` in the istio-proxy container).
pub const DEFAULT_SOCKET: &str = "./var/run/secrets/workload-spiffe-uds/socket";

pub const SECRET_TYPE_URL: &str =
    "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";

/// Binds the socket at `path`: makes its folder, replaces a stale socket left by an
/// earlier run. The socket is open to every local user, as pilot-agent's is (Envoy runs
/// as the same uid in Istio, but not always here).
pub fn bind(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    use anyhow::Context;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing the old {}", path.display())),
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding the SDS socket {}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("opening {} to the proxy", path.display()))?;
    Ok(listener)
}

/// Serves SDS on `listener` from `provider` until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::UnixListener,
    provider: CertificateProvider,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let service = SecretDiscoveryServiceServer::new(Sds { provider });
    tonic::transport::Server::builder()
        .serve_with_incoming_shutdown(service, UnixListenerStream::new(listener), shutdown)
        .await?;
    Ok(())
}

struct Sds {
    provider: CertificateProvider,
}

#[tonic::async_trait]
impl SecretDiscoveryService for Sds {
    type StreamSecretsStream = ReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaSecretsStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        Ok(Response::new(ReceiverStream::new(open(
            &self.provider,
            Box::pin(request.into_inner()),
        ))))
    }

    async fn delta_secrets(
        &self,
        _request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        Err(Status::unimplemented(
            "delta SDS is not served: use the state-of-the-world StreamSecrets (api_type GRPC)",
        ))
    }

    async fn fetch_secrets(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let bundle = self
            .provider
            .current()
            .ok_or_else(|| Status::unavailable("no workload certificate yet"))?;
        let names = &request.get_ref().resource_names;
        Ok(Response::new(response(&bundle, names, "fetch".into())))
    }
}

/// Starts one `StreamSecrets` stream: its responses come out of the receiver.
fn open(
    provider: &CertificateProvider,
    requests: MessageStream<DiscoveryRequest>,
) -> mpsc::Receiver<Result<DiscoveryResponse, Status>> {
    let (tx, rx) = mpsc::channel(4);
    let stream = SotwStream {
        requests,
        bundles: provider.subscribe(),
        responses: tx,
        names: Vec::new(),
        sent: None,
        nonce: 0,
    };
    tokio::spawn(stream.run());
    rx
}

/// The SDS server for the in-process proxy: the same streams as over the socket, by
/// call (see [`shunt_xds::local`]), so `default`/`ROOTCA` and every rotation reach the
/// proxy's secret store with no socket.
pub fn local(provider: CertificateProvider) -> Arc<dyn LocalServer> {
    Arc::new(Sds { provider })
}

#[tonic::async_trait]
impl LocalServer for Sds {
    async fn sotw(
        &self,
        method: &'static str,
        requests: MessageStream<DiscoveryRequest>,
    ) -> Result<MessageStream<DiscoveryResponse>, Status> {
        if method != STREAM_SECRETS {
            return Err(Status::unimplemented(format!(
                "the agent's SDS server serves {STREAM_SECRETS}, not {method}"
            )));
        }
        Ok(Box::pin(ReceiverStream::new(open(
            &self.provider,
            requests,
        ))))
    }

    async fn delta(
        &self,
        _method: &'static str,
        _requests: MessageStream<DeltaDiscoveryRequest>,
    ) -> Result<MessageStream<DeltaDiscoveryResponse>, Status> {
        Err(Status::unimplemented(
            "delta SDS is not served: use the state-of-the-world StreamSecrets (api_type GRPC)",
        ))
    }
}

const STREAM_SECRETS: &str = "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets";

/// One `StreamSecrets` stream.
struct SotwStream {
    requests: MessageStream<DiscoveryRequest>,
    bundles: watch::Receiver<Option<Arc<Bundle>>>,
    responses: mpsc::Sender<Result<DiscoveryResponse, Status>>,
    /// What the last accepted request asked for.
    names: Vec<String>,
    /// The last response: its bundle, the names it answered, its nonce.
    sent: Option<(Arc<Bundle>, Vec<String>, String)>,
    nonce: u64,
}

impl SotwStream {
    async fn run(mut self) {
        let mut rotating = true;
        loop {
            tokio::select! {
                request = self.requests.next() => match request {
                    Some(Ok(request)) => {
                        if let Err(status) = self.on_request(request) {
                            let _ = self.responses.send(Err(status)).await;
                            return;
                        }
                    }
                    None => return,
                    Some(Err(status)) => {
                        tracing::debug!("SDS stream ended: {status}");
                        return;
                    }
                },
                changed = self.bundles.changed(), if rotating => if changed.is_err() {
                    // The source has ended (a fixed bundle, or the agent stopping): what
                    // was served stays valid, there are just no more rotations.
                    rotating = false;
                },
                _ = self.responses.closed() => return,
            }
            if !self.send_if_due().await {
                return;
            }
        }
    }

    /// Takes a request in: new names, an ACK, a NACK, or a stale request to ignore.
    fn on_request(&mut self, request: DiscoveryRequest) -> Result<(), Status> {
        if !request.type_url.is_empty() && request.type_url != SECRET_TYPE_URL {
            return Err(Status::invalid_argument(format!(
                "this SDS server serves {SECRET_TYPE_URL}, not {:?}",
                request.type_url
            )));
        }
        let last_nonce = self.sent.as_ref().map(|(_, _, nonce)| nonce.as_str());
        if !request.response_nonce.is_empty() && Some(request.response_nonce.as_str()) != last_nonce
        {
            // Answers a response that a newer one has replaced.
            return Ok(());
        }
        if let Some(error) = &request.error_detail {
            tracing::warn!(
                nonce = %request.response_nonce,
                names = ?request.resource_names,
                "the proxy rejected SDS secrets: {}",
                error.message
            );
        }
        self.names = request.resource_names;
        Ok(())
    }

    /// Sends the current secrets if the stream has not got them: a first request, new
    /// names, or a new bundle. `false` once the stream is gone.
    async fn send_if_due(&mut self) -> bool {
        let Some(bundle) = self.bundles.borrow_and_update().clone() else {
            return true;
        };
        if self.names.is_empty() {
            return true;
        }
        if let Some((sent, names, _)) = &self.sent
            && Arc::ptr_eq(sent, &bundle)
            && *names == self.names
        {
            return true;
        }
        self.nonce += 1;
        let nonce = self.nonce.to_string();
        let response = response(&bundle, &self.names, nonce.clone());
        self.sent = Some((bundle, self.names.clone(), nonce));
        self.responses.send(Ok(response)).await.is_ok()
    }
}

/// A response carrying those of `names` this server has (`default`, `ROOTCA`), in the
/// order asked; its version is a digest of the bundle, so it changes with any file.
fn response(bundle: &Bundle, names: &[String], nonce: String) -> DiscoveryResponse {
    let secrets = bundle.envoy_secrets();
    let resources = names
        .iter()
        .filter_map(|name| secrets.iter().find(|s| &s.name == name))
        .map(|secret| Any {
            type_url: SECRET_TYPE_URL.into(),
            value: secret.encode_to_vec(),
        })
        .collect();
    let mut digest = DefaultHasher::new();
    (&bundle.cert_chain, &bundle.private_key, &bundle.root_cert).hash(&mut digest);
    DiscoveryResponse {
        version_info: format!("{:016x}", digest.finish()),
        resources,
        type_url: SECRET_TYPE_URL.into(),
        nonce,
        ..Default::default()
    }
}
