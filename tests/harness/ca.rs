//! A test mesh CA: Istio's `IstioCertificateService/CreateCertificate` over TLS, on its
//! own thread and runtime, as istiod's CA would answer pilot-agent. It checks the bearer
//! token, signs CSRs with its own root for a lifetime the test sets (seconds), logs every
//! call, and can be stopped and started again on the same port (an outage).
//!
//! Its messages are written here from `ca.proto`, apart from shunt's own, so a mistake
//! in shunt's would show.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, anyhow};
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use tokio::sync::watch;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::transport::Server;

use crate::ads::server::tls_incoming;

pub const METHOD: &str = "/istio.v1.auth.IstioCertificateService/CreateCertificate";

#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateRequest {
    #[prost(string, tag = "1")]
    pub csr: String,
    #[prost(int64, tag = "3")]
    pub validity_duration: i64,
    #[prost(message, optional, tag = "4")]
    pub metadata: Option<Struct>,
}

/// `google.protobuf.Struct`, only as far as the CA reads it: string values.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Struct {
    #[prost(btree_map = "string, message", tag = "1")]
    pub fields: std::collections::BTreeMap<String, Value>,
}

/// `google.protobuf.Value`: its `string_value` (3) of the `kind` oneof.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(string, optional, tag = "3")]
    pub string_value: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct IstioCertificateResponse {
    #[prost(string, repeated, tag = "1")]
    pub cert_chain: Vec<String>,
}

/// One call as the CA saw it.
#[derive(Debug, Clone)]
pub struct CaCall {
    pub authorization: Option<String>,
    pub cluster_id: Option<String>,
    pub validity_duration: i64,
    /// `metadata`'s `ImpersonatedIdentity` (ztunnel's: a node agent's token asking
    /// for a workload's identity).
    pub impersonated_identity: Option<String>,
    /// The URI SANs the CSR asked for.
    pub uris: Vec<String>,
    /// `None` if signed, else why not.
    pub refused: Option<String>,
}

struct State {
    root_pem: String,
    root_params: CertificateParams,
    root_key: KeyPair,
    token: Mutex<String>,
    /// Tokens accepted besides `token` (a service account's own, say).
    more_tokens: Mutex<Vec<String>>,
    lifetime: Mutex<Duration>,
    calls: Mutex<Vec<CaCall>>,
    serial: AtomicU64,
}

pub struct TestCa {
    state: Arc<State>,
    /// The root, PEM, as `root-cert.pem` in the folder given.
    pub root_pem: String,
    pub root_file: PathBuf,
    addr: SocketAddr,
    tls: tokio_rustls::TlsAcceptor,
    running: Option<(watch::Sender<bool>, std::thread::JoinHandle<()>)>,
}

impl TestCa {
    /// A new root (written to `dir/root-cert.pem`) and a CA serving on 127.0.0.1 that
    /// accepts `token` and issues certificates for `lifetime`.
    pub fn start(dir: &Path, token: &str, lifetime: Duration) -> Result<TestCa> {
        Self::start_on(dir, token, lifetime, "127.0.0.1".parse()?)
    }

    /// As [`TestCa::start`], serving on `ip` (its certificate names that address): a
    /// node's gateway address, say, so every pod reaches the one CA.
    pub fn start_on(
        dir: &Path,
        token: &str,
        lifetime: Duration,
        ip: std::net::IpAddr,
    ) -> Result<TestCa> {
        let root_key = KeyPair::generate()?;
        let mut root_params = CertificateParams::default();
        root_params
            .distinguished_name
            .push(DnType::CommonName, "shunt test mesh root");
        root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        root_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        root_params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        let root_pem = root_params.self_signed(&root_key)?.pem();
        let root_file = dir.join("root-cert.pem");
        std::fs::write(&root_file, &root_pem)?;
        let state = Arc::new(State {
            root_pem: root_pem.clone(),
            root_params,
            root_key,
            token: Mutex::new(token.to_owned()),
            more_tokens: Mutex::new(Vec::new()),
            lifetime: Mutex::new(lifetime),
            calls: Mutex::new(Vec::new()),
            serial: AtomicU64::new(0x1000 + u64::from(std::process::id()) * 0x10000),
        });
        // The CA's own serving certificate, for its address, from the same root.
        let (chain, key) = state.issue(vec![SanType::IpAddress(ip)], Duration::from_secs(3600))?;
        let tls = acceptor(&chain, &key)?;
        let mut ca = TestCa {
            state,
            root_pem,
            root_file,
            addr: SocketAddr::new(ip, 0),
            tls,
            running: None,
        };
        ca.restart()?;
        Ok(ca)
    }

    /// `CA_ADDR` for this CA.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    pub fn set_token(&self, token: &str) {
        *self.state.token.lock().unwrap() = token.to_owned();
    }

    /// Accepts `token` too (the callers are told apart by the token they present).
    pub fn accept_token(&self, token: &str) {
        self.state
            .more_tokens
            .lock()
            .unwrap()
            .push(token.to_owned());
    }

    pub fn calls(&self) -> Vec<CaCall> {
        self.state.calls.lock().unwrap().clone()
    }

    /// A certificate for `identity` (a URI SAN) from this CA's root: (chain, key) PEM.
    pub fn issue(&self, identity: &str, lifetime: Duration) -> Result<(String, String)> {
        self.state.issue(
            vec![SanType::URI(identity.to_owned().try_into()?)],
            lifetime,
        )
    }

    /// A serving certificate for `ip` (an IP SAN, as istiod's for an address) from
    /// this CA's root: (chain, key) PEM.
    pub fn issue_for_ip(
        &self,
        ip: std::net::IpAddr,
        lifetime: Duration,
    ) -> Result<(String, String)> {
        self.state.issue(vec![SanType::IpAddress(ip)], lifetime)
    }

    /// Stops serving: the port is closed, open connections dropped.
    pub fn stop(&mut self) {
        if let Some((stop, thread)) = self.running.take() {
            let _ = stop.send(true);
            let _ = thread.join();
        }
    }

    /// Serves again, on the same port once it has one.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        let std_listener = std::net::TcpListener::bind(self.addr)
            .with_context(|| format!("binding the test CA to {}", self.addr))?;
        std_listener.set_nonblocking(true)?;
        self.addr = std_listener.local_addr()?;
        let (stop_tx, mut stop_rx) = watch::channel(false);
        let (state, tls) = (self.state.clone(), self.tls.clone());
        let thread = std::thread::Builder::new()
            .name("test-ca".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("test CA runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(std_listener).expect("test CA listener");
                    let incoming = tls_incoming(listener, tls);
                    let signal = async move {
                        let _ = stop_rx.wait_for(|s| *s).await;
                    };
                    if let Err(e) = Server::builder()
                        .serve_with_incoming_shutdown(CaService(state), incoming, signal)
                        .await
                    {
                        eprintln!("test CA: {e}");
                    }
                });
                // Dropping the runtime ends the accept loop and every connection.
            })?;
        self.running = Some((stop_tx, thread));
        Ok(())
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        self.stop();
    }
}

impl State {
    fn issue(&self, sans: Vec<SanType>, lifetime: Duration) -> Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        let cert = self.sign(params, &key, lifetime)?;
        Ok((cert, key.serialize_pem()))
    }

    /// Signs `params` for `public_key` as a workload certificate of `lifetime`.
    fn sign(
        &self,
        mut params: CertificateParams,
        public_key: &impl rcgen::PublicKeyData,
        lifetime: Duration,
    ) -> Result<String> {
        let now = SystemTime::now();
        // Back-dated a little, as CAs do for clock skew; the end is exact.
        params.not_before = (now - Duration::from_secs(60)).into();
        params.not_after = (now + lifetime).into();
        params.serial_number = Some(self.serial.fetch_add(1, Ordering::Relaxed).into());
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let issuer = Issuer::from_params(&self.root_params, &self.root_key);
        Ok(params.signed_by(public_key, &issuer)?.pem())
    }

    fn create_certificate(
        &self,
        request: tonic::Request<IstioCertificateRequest>,
    ) -> Result<IstioCertificateResponse, tonic::Status> {
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let mut call = CaCall {
            authorization: header("authorization"),
            cluster_id: header("clusterid"),
            validity_duration: request.get_ref().validity_duration,
            impersonated_identity: request
                .get_ref()
                .metadata
                .as_ref()
                .and_then(|m| m.fields.get("ImpersonatedIdentity"))
                .and_then(|v| v.string_value.clone()),
            uris: Vec::new(),
            refused: None,
        };
        let result = self.check_and_sign(request.get_ref(), &mut call);
        if let Err(status) = &result {
            call.refused = Some(status.message().to_owned());
        }
        self.calls.lock().unwrap().push(call);
        result
    }

    fn check_and_sign(
        &self,
        request: &IstioCertificateRequest,
        call: &mut CaCall,
    ) -> Result<IstioCertificateResponse, tonic::Status> {
        let presented = call.authorization.as_deref().unwrap_or_default();
        let accepted = std::iter::once(self.token.lock().unwrap().clone())
            .chain(self.more_tokens.lock().unwrap().iter().cloned())
            .any(|token| presented == format!("Bearer {token}"));
        if !accepted {
            return Err(tonic::Status::unauthenticated(
                "authentication failure: the bearer token is not valid",
            ));
        }
        let csr = CertificateSigningRequestParams::from_pem(&request.csr)
            .map_err(|e| tonic::Status::invalid_argument(format!("bad CSR: {e}")))?;
        for san in &csr.params.subject_alt_names {
            if let SanType::URI(uri) = san {
                call.uris.push(uri.as_str().to_owned());
            }
        }
        let lifetime = *self.lifetime.lock().unwrap();
        let mut params = CertificateParams::default();
        params.subject_alt_names = csr.params.subject_alt_names.clone();
        let leaf = self
            .sign(params, &csr.public_key, lifetime)
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        // Leaf first, root last, as istiod answers.
        Ok(IstioCertificateResponse {
            cert_chain: vec![leaf, self.root_pem.clone()],
        })
    }
}

fn acceptor(chain: &str, key: &str) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(chain.as_bytes()).collect::<Result<Vec<_>, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes())?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .map_err(|e| anyhow!("CA serving certificate: {e}"))?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// The one method, routed by hand (no codegen in the test crates).
#[derive(Clone)]
struct CaService(Arc<State>);

impl tonic::server::NamedService for CaService {
    const NAME: &'static str = "istio.v1.auth.IstioCertificateService";
}

impl Service<http::Request<tonic::body::Body>> for CaService {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            if request.uri().path() != METHOD {
                return Ok(
                    tonic::Status::unimplemented(request.uri().path().to_owned()).into_http(),
                );
            }
            let codec =
                tonic_prost::ProstCodec::<IstioCertificateResponse, IstioCertificateRequest>::default();
            Ok(tonic::server::Grpc::new(codec)
                .unary(Sign(state), request)
                .await)
        })
    }
}

struct Sign(Arc<State>);

impl tonic::server::UnaryService<IstioCertificateRequest> for Sign {
    type Response = IstioCertificateResponse;
    type Future = BoxFuture<tonic::Response<IstioCertificateResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<IstioCertificateRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move { state.create_certificate(request).map(tonic::Response::new) })
    }
}
