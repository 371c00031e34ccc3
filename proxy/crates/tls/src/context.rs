//! Envoy's TLS transport sockets: `DownstreamTlsContext` on a filter chain (terminating
//! TLS) and `UpstreamTlsContext` on a cluster (originating it), with their
//! `CommonTlsContext`.
//!
//! Certificates and validation contexts are either inline (compiled with the listener or
//! cluster) or SDS secrets named by `*_sds_secret_config(s)`. Named secrets are looked up
//! when a handshake starts, in the secrets of the snapshot current then, so an SDS
//! rotation reaches the next handshake without recompiling or draining anything. The
//! rustls config built from a set of secrets is cached against those secrets' `Arc`s:
//! building one per handshake would cost more than the handshake.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};

use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::ValidationContextType;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::tls_parameters::TlsProtocol;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, UpstreamTlsContext,
};
use rustls::pki_types::ServerName;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, ServerConfig, SignatureScheme, SupportedProtocolVersion};
use tokio::net::TcpStream;

use super::san::{self, San};
use super::secret::{
    self, Secret, SecretKind, TlsCertificate, ValidationContext, compile_certificate,
    compile_validation_context,
};
use super::stream::TransportStream;
use super::verifier::{DownstreamVerifier, UpstreamVerifier};
use shunt_config::{Diagnostics, JsonPath};

/// The secrets a handshake can name, by name (the snapshot's).
pub type Secrets = HashMap<String, Arc<Secret>>;

/// Why a handshake did not happen or failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// An SDS secret the context names is not (yet) there: Envoy would still be warming.
    #[error("secret {0:?} is not available")]
    MissingSecret(String),
    /// The secrets found do not make a usable config (a certificate where a validation
    /// context is named, say).
    #[error("{0}")]
    Config(String),
    #[error("TLS handshake: {0}")]
    Io(#[from] std::io::Error),
}

enum CertificateSource {
    Inline(Arc<TlsCertificate>),
    Sds(String),
}

enum ValidationSource {
    Inline(ValidationContext),
    /// `validation_context_sds_secret_config`, or a `combined_validation_context`'s
    /// SDS part with its `default_validation_context`.
    Sds {
        name: String,
        default: Option<ValidationContext>,
    },
}

/// A `CommonTlsContext`, compiled.
pub struct CommonTls {
    certificates: Vec<CertificateSource>,
    validation: Option<ValidationSource>,
    alpn: Vec<Vec<u8>>,
    versions: Vec<&'static SupportedProtocolVersion>,
}

impl std::fmt::Debug for CommonTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommonTls")
            .field("certificates", &self.certificates.len())
            .field("sds_secrets", &self.sds_names().collect::<Vec<_>>())
            .field("alpn", &self.alpn)
            .finish()
    }
}

/// What a context's sources came to for one handshake: the certificates, the
/// validation context, and the SDS secrets used (the cache key).
struct Resolved {
    certificates: Vec<Arc<CertifiedKey>>,
    validation: Option<ValidationContext>,
    used: Vec<Arc<Secret>>,
}

impl CommonTls {
    fn compile(
        common: &CommonTlsContext,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Self> {
        let mut ok = true;
        let unsupported = [
            (
                common.tls_certificate_provider_instance.is_some(),
                "tls_certificate_provider_instance",
            ),
            (
                common.custom_tls_certificate_selector.is_some(),
                "custom_tls_certificate_selector",
            ),
            (common.custom_handshaker.is_some(), "custom_handshaker"),
        ];
        for (set, field) in unsupported {
            if set {
                problems.error(path.field(field), "is not implemented");
                ok = false;
            }
        }
        if common.key_log.is_some() {
            problems.warning(path.field("key_log"), "is not implemented; ignored");
        }
        let mut certificates = Vec::new();
        for (i, cert) in common.tls_certificates.iter().enumerate() {
            match compile_certificate(cert, &path.field("tls_certificates").index(i), problems) {
                Some(cert) => certificates.push(CertificateSource::Inline(Arc::new(cert))),
                None => ok = false,
            }
        }
        for (i, sds) in common.tls_certificate_sds_secret_configs.iter().enumerate() {
            let at = path.field("tls_certificate_sds_secret_configs").index(i);
            match sds_name(sds, &at, problems) {
                Some(name) => certificates.push(CertificateSource::Sds(name)),
                None => ok = false,
            }
        }
        let validation = match &common.validation_context_type {
            None => None,
            Some(ValidationContextType::ValidationContext(context)) => {
                let at = path.field("validation_context");
                match compile_validation_context(context, &at, problems) {
                    Some(context) => Some(ValidationSource::Inline(context)),
                    None => {
                        ok = false;
                        None
                    }
                }
            }
            Some(ValidationContextType::ValidationContextSdsSecretConfig(sds)) => {
                let at = path.field("validation_context_sds_secret_config");
                match sds_name(sds, &at, problems) {
                    Some(name) => Some(ValidationSource::Sds {
                        name,
                        default: None,
                    }),
                    None => {
                        ok = false;
                        None
                    }
                }
            }
            Some(ValidationContextType::CombinedValidationContext(combined)) => {
                let at = path.field("combined_validation_context");
                let default = combined.default_validation_context.as_ref().and_then(|c| {
                    let default = compile_validation_context(
                        c,
                        &at.field("default_validation_context"),
                        problems,
                    );
                    ok &= default.is_some();
                    default
                });
                let name = match &combined.validation_context_sds_secret_config {
                    Some(sds) => sds_name(
                        sds,
                        &at.field("validation_context_sds_secret_config"),
                        problems,
                    ),
                    None => {
                        problems.error(at.field("validation_context_sds_secret_config"), "needed");
                        None
                    }
                };
                match name {
                    Some(name) => Some(ValidationSource::Sds { name, default }),
                    None => {
                        ok = false;
                        None
                    }
                }
            }
            Some(_) => {
                problems.error(
                    path,
                    "certificate provider validation contexts are not implemented",
                );
                ok = false;
                None
            }
        };
        let versions = versions(common, path, problems);
        ok &= versions.is_some();
        let params_path = path.field("tls_params");
        if let Some(params) = &common.tls_params {
            for (set, field) in [
                (!params.cipher_suites.is_empty(), "cipher_suites"),
                (!params.ecdh_curves.is_empty(), "ecdh_curves"),
                (
                    !params.signature_algorithms.is_empty(),
                    "signature_algorithms",
                ),
            ] {
                if set {
                    // rustls' defaults are a modern subset of what these lists name.
                    problems.warning(
                        params_path.field(field),
                        "is not implemented; rustls' defaults are used",
                    );
                }
            }
        }
        if !ok {
            return None;
        }
        Some(CommonTls {
            certificates,
            validation,
            alpn: common
                .alpn_protocols
                .iter()
                .map(|p| p.as_bytes().to_vec())
                .collect(),
            versions: versions?,
        })
    }

    /// The SDS secrets this context names: what a listener or cluster waits for.
    pub fn sds_names(&self) -> impl Iterator<Item = &str> {
        let certificates = self.certificates.iter().filter_map(|c| match c {
            CertificateSource::Sds(name) => Some(name.as_str()),
            CertificateSource::Inline(_) => None,
        });
        let validation = match &self.validation {
            Some(ValidationSource::Sds { name, .. }) => Some(name.as_str()),
            _ => None,
        };
        certificates.chain(validation)
    }

    /// Whether a context over this common part builds. One that names no SDS secret is
    /// built now with `build`, so its errors are the config's (at `path`).
    fn builds_now<T>(
        &self,
        path: JsonPath,
        problems: &mut Diagnostics,
        build: impl FnOnce(&Secrets) -> Result<T, HandshakeError>,
    ) -> bool {
        if self.sds_names().next().is_none()
            && let Err(err) = build(&Secrets::new())
        {
            problems.error(path, err.to_string());
            return false;
        }
        true
    }

    fn resolve(&self, secrets: &Secrets) -> Result<Resolved, HandshakeError> {
        let mut used = Vec::new();
        let mut lookup = |name: &str| {
            let secret = secrets
                .get(name)
                .cloned()
                .ok_or_else(|| HandshakeError::MissingSecret(name.to_owned()))?;
            used.push(secret.clone());
            Ok::<_, HandshakeError>(secret)
        };
        let mut certificates = Vec::new();
        for source in &self.certificates {
            certificates.push(match source {
                CertificateSource::Inline(cert) => cert.key.clone(),
                CertificateSource::Sds(name) => match &lookup(name)?.kind {
                    SecretKind::TlsCertificate(cert) => cert.key.clone(),
                    SecretKind::ValidationContext(_) => {
                        return Err(HandshakeError::Config(format!(
                            "secret {name:?} is a validation context, not a certificate"
                        )));
                    }
                },
            });
        }
        let validation = match &self.validation {
            None => None,
            Some(ValidationSource::Inline(context)) => Some(context.clone()),
            Some(ValidationSource::Sds { name, default }) => match &lookup(name)?.kind {
                SecretKind::ValidationContext(context) => Some(match default {
                    Some(default) => default.merged(context),
                    None => (**context).clone(),
                }),
                SecretKind::TlsCertificate(_) => {
                    return Err(HandshakeError::Config(format!(
                        "secret {name:?} is a certificate, not a validation context"
                    )));
                }
            },
        };
        Ok(Resolved {
            certificates,
            validation,
            used,
        })
    }
}

fn sds_name(sds: &SdsSecretConfig, path: &JsonPath, problems: &mut Diagnostics) -> Option<String> {
    if sds.name.is_empty() {
        problems.error(path.field("name"), "an SDS secret config needs a name");
        return None;
    }
    Some(sds.name.clone())
}

/// `tls_params`' version range as rustls' versions; rustls speaks TLS 1.2 and 1.3 only,
/// so a minimum below 1.2 allows 1.2 and a maximum below it is an error.
fn versions(
    common: &CommonTlsContext,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Vec<&'static SupportedProtocolVersion>> {
    let params = common.tls_params.clone().unwrap_or_default();
    let rank = |v: i32| match TlsProtocol::try_from(v) {
        Ok(TlsProtocol::TlSv13) => 13,
        Ok(TlsProtocol::TlSv12) => 12,
        Ok(TlsProtocol::TlSv11) => 11,
        Ok(TlsProtocol::TlSv10) => 10,
        _ => 0,
    };
    let min = match rank(params.tls_minimum_protocol_version) {
        0 => 12,
        v => v,
    };
    let max = match rank(params.tls_maximum_protocol_version) {
        0 => 13,
        v => v,
    };
    let versions: Vec<_> = [(12, &rustls::version::TLS12), (13, &rustls::version::TLS13)]
        .into_iter()
        .filter(|(v, _)| (min..=max).contains(v))
        .map(|(_, version)| version)
        .collect();
    if versions.is_empty() {
        problems.error(
            path.field("tls_params"),
            "no TLS version left: shunt speaks TLS 1.2 and 1.3",
        );
        return None;
    }
    Some(versions)
}

/// A built rustls config with the SDS secrets it was built from (weak: an entry whose
/// secrets were rotated away is dropped).
type Built<C> = (Vec<Weak<Secret>>, Arc<C>);

/// The configs a context built, one for each set of secrets in use: most handshakes
/// reuse one. In node mode a compiled cluster is shared by every pod that has it
/// (`shunt_upstream::compile::Prototype`), and each pod presents its own certificate,
/// so one context has an entry per identity; a context used by one proxy has one.
struct Cache<C>(Mutex<Vec<Built<C>>>);

impl<C> Default for Cache<C> {
    fn default() -> Self {
        Cache(Mutex::new(Vec::new()))
    }
}

impl<C> Cache<C> {
    fn get_or_build(
        &self,
        used: &[Arc<Secret>],
        build: impl FnOnce() -> Result<C, String>,
    ) -> Result<Arc<C>, HandshakeError> {
        let same = |cached: &[Weak<Secret>]| {
            cached.len() == used.len()
                && cached
                    .iter()
                    .zip(used)
                    .all(|(a, b)| std::ptr::eq(a.as_ptr(), Arc::as_ptr(b)))
        };
        {
            let built = self.0.lock().unwrap_or_else(|e| e.into_inner());
            // The secrets are alive (`used` holds them), so an equal pointer is them.
            if let Some((_, config)) = built.iter().find(|(cached, _)| same(cached)) {
                return Ok(config.clone());
            }
        }
        let config = Arc::new(build().map_err(HandshakeError::Config)?);
        let mut built = self.0.lock().unwrap_or_else(|e| e.into_inner());
        built.retain(|(cached, _)| cached.iter().all(|s| s.strong_count() > 0));
        built.push((used.iter().map(Arc::downgrade).collect(), config.clone()));
        Ok(config)
    }
}

/// A context's certificates, chosen as Envoy chooses: first one whose DNS SANs cover
/// the client's SNI, then one whose key the client can verify (an RSA and an ECDSA
/// certificate side by side), else the first.
#[derive(Debug)]
struct Certificates(Vec<(Arc<CertifiedKey>, Vec<String>)>);

impl Certificates {
    fn new(keys: Vec<Arc<CertifiedKey>>) -> Self {
        let dns_names = |key: &CertifiedKey| -> Vec<String> {
            let sans = key.cert.first().map(|der| san::of_certificate(der));
            sans.unwrap_or_default()
                .into_iter()
                .filter_map(|s| match s {
                    San::Dns(name) => Some(name),
                    _ => None,
                })
                .collect()
        };
        Certificates(
            keys.into_iter()
                .map(|key| {
                    let names = dns_names(&key);
                    (key, names)
                })
                .collect(),
        )
    }

    fn choose(&self, sni: Option<&str>, schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        let covers = |names: &[String]| {
            sni.is_some_and(|sni| names.iter().any(|san| san::dns_covers(san, sni)))
        };
        let usable = |key: &CertifiedKey| key.key.choose_scheme(schemes).is_some();
        self.0
            .iter()
            .find(|(key, names)| covers(names) && usable(key))
            .or_else(|| self.0.iter().find(|(key, _)| usable(key)))
            .or(self.0.first())
            .map(|(key, _)| key.clone())
    }
}

impl rustls::server::ResolvesServerCert for Certificates {
    fn resolve(&self, hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.choose(hello.server_name(), hello.signature_schemes())
    }
}

impl rustls::client::ResolvesClientCert for Certificates {
    fn resolve(&self, _hints: &[&[u8]], schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.choose(None, schemes)
    }

    fn has_certs(&self) -> bool {
        !self.0.is_empty()
    }
}

/// A filter chain's `DownstreamTlsContext`.
#[derive(Debug)]
pub struct DownstreamTls {
    common: CommonTls,
    require_client_certificate: bool,
    cache: Cache<ServerConfigs>,
}

/// A downstream context's server config, with its ALPN list and without (for clients
/// that offer none of it), and the client verifier both use (which the in-process
/// hand-off asks too, so both remember the same accepted chains).
#[derive(Debug)]
pub struct ServerConfigs {
    pub alpn: Arc<ServerConfig>,
    pub no_alpn: Arc<ServerConfig>,
    verifier: Option<Arc<DownstreamVerifier>>,
}

impl ServerConfigs {
    /// How many client chains its verifier remembers having accepted.
    #[cfg(test)]
    pub fn accepted_chains(&self) -> usize {
        self.verifier.as_ref().map_or(0, |v| v.accepted_chains())
    }
}

impl std::fmt::Debug for Cache<ServerConfigs> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cache")
    }
}

impl std::fmt::Debug for Cache<ClientSide> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cache")
    }
}

impl DownstreamTls {
    /// `context` at `path` (the transport socket's `typed_config`). A context naming no
    /// SDS secret is built here, so its errors are the config's.
    pub fn compile(
        context: &DownstreamTlsContext,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Self> {
        if context.require_sni.is_some_and(|v| v.value) {
            problems.error(path.field("require_sni"), "is not implemented");
            return None;
        }
        let common = context.common_tls_context.clone().unwrap_or_default();
        let common_path = path.field("common_tls_context");
        let common = CommonTls::compile(&common, &common_path, problems)?;
        if common.certificates.is_empty() {
            problems.error(
                common_path.field("tls_certificates"),
                "terminating TLS needs a certificate (tls_certificates or \
                 tls_certificate_sds_secret_configs)",
            );
            return None;
        }
        let tls = DownstreamTls {
            common,
            require_client_certificate: context.require_client_certificate.is_some_and(|v| v.value),
            cache: Cache::default(),
        };
        tls.common
            .builds_now(common_path, problems, |secrets| tls.server_configs(secrets))
            .then_some(tls)
    }

    /// The SDS secrets this context names: what warming waits for.
    #[allow(dead_code, reason = "for listener and cluster warming on SDS secrets")]
    pub fn sds_names(&self) -> impl Iterator<Item = &str> {
        self.common.sds_names()
    }

    /// The server configs for a handshake now, with named secrets from `secrets`.
    pub fn server_configs(&self, secrets: &Secrets) -> Result<Arc<ServerConfigs>, HandshakeError> {
        let resolved = self.common.resolve(secrets)?;
        self.cache.get_or_build(&resolved.used, || {
            let builder = ServerConfig::builder_with_provider(secret::provider())
                .with_protocol_versions(&self.common.versions)
                .map_err(|e| e.to_string())?;
            let verifier = match resolved.validation {
                Some(context) => DownstreamVerifier::new(
                    context,
                    self.require_client_certificate,
                    secret::provider(),
                )?,
                None if self.require_client_certificate => {
                    return Err(
                        "require_client_certificate needs a validation context with trusted_ca"
                            .into(),
                    );
                }
                None => None,
            };
            let verifier = verifier.map(Arc::new);
            let builder = match &verifier {
                Some(verifier) => builder.with_client_cert_verifier(verifier.clone()),
                None => builder.with_no_client_auth(),
            };
            let config =
                builder.with_cert_resolver(Arc::new(Certificates::new(resolved.certificates)));
            let mut alpn = config.clone();
            alpn.alpn_protocols = self.common.alpn.clone();
            Ok(ServerConfigs {
                alpn: Arc::new(alpn),
                no_alpn: Arc::new(config),
                verifier,
            })
        })
    }

    /// The URI SANs of the certificate this context serves first (Istio serves one),
    /// for the local principal filters read; empty when its secret is missing.
    pub fn local_uri_sans(&self, secrets: &Secrets) -> Vec<String> {
        let Ok(resolved) = self.common.resolve(secrets) else {
            return Vec::new();
        };
        let Some(leaf) = resolved.certificates.first().and_then(|c| c.cert.first()) else {
            return Vec::new();
        };
        super::san::of_certificate(leaf)
            .into_iter()
            .filter_map(|san| match san {
                super::san::San::Uri(uri) => Some(uri),
                _ => None,
            })
            .collect()
    }

    /// Terminates TLS on `stream`.
    pub async fn accept(
        &self,
        stream: TcpStream,
        secrets: &Secrets,
    ) -> Result<tokio_rustls::server::TlsStream<TransportStream>, HandshakeError> {
        let configs = self.server_configs(secrets)?;
        let acceptor = rustls::server::Acceptor::default();
        let start =
            tokio_rustls::LazyConfigAcceptor::new(acceptor, TransportStream::under_tls(stream))
                .await?;
        // BoringSSL (Envoy) goes on without ALPN when the client offers none of ours;
        // rustls would fail the handshake. Istio's peers offer `istio-peer-exchange`
        // and `istio` to listeners that may list only h2 and http/1.1.
        let ours = &configs.alpn.alpn_protocols;
        let overlap = match start.client_hello().alpn() {
            None => true,
            Some(mut offered) => offered.any(|p| ours.iter().any(|o| o.as_slice() == p)),
        };
        let config = if overlap || ours.is_empty() {
            configs.alpn.clone()
        } else {
            configs.no_alpn.clone()
        };
        Ok(start.into_stream(config).await?)
    }
}

/// A cluster's `UpstreamTlsContext`.
#[derive(Debug)]
pub struct UpstreamTls {
    common: CommonTls,
    /// `sni`; without it no SNI is sent.
    sni: Option<ServerName<'static>>,
    cache: Cache<ClientSide>,
}

/// An upstream context's client config and the server verifier in it (which the
/// in-process hand-off asks too).
struct ClientSide {
    config: Arc<ClientConfig>,
    verifier: Arc<UpstreamVerifier>,
}

impl UpstreamTls {
    /// The URI SANs of the client certificate this context presents; empty without one.
    pub fn local_uri_sans(&self, secrets: &Secrets) -> Vec<String> {
        let Ok(resolved) = self.common.resolve(secrets) else {
            return Vec::new();
        };
        let Some(leaf) = resolved.certificates.first().and_then(|c| c.cert.first()) else {
            return Vec::new();
        };
        super::san::of_certificate(leaf)
            .into_iter()
            .filter_map(|san| match san {
                super::san::San::Uri(uri) => Some(uri),
                _ => None,
            })
            .collect()
    }

    pub fn compile(
        context: &UpstreamTlsContext,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Self> {
        let mut ok = true;
        for (set, field) in [
            (context.auto_host_sni, "auto_host_sni"),
            (context.auto_sni_san_validation, "auto_sni_san_validation"),
        ] {
            if set {
                problems.error(path.field(field), "is not implemented");
                ok = false;
            }
        }
        let sni = if context.sni.is_empty() {
            None
        } else {
            match ServerName::try_from(context.sni.clone()) {
                Ok(name) => Some(name),
                Err(err) => {
                    problems.error(path.field("sni"), format!("{:?}: {err}", context.sni));
                    ok = false;
                    None
                }
            }
        };
        let common = context.common_tls_context.clone().unwrap_or_default();
        let common_path = path.field("common_tls_context");
        let common = CommonTls::compile(&common, &common_path, problems)?;
        if !ok {
            return None;
        }
        let tls = UpstreamTls {
            common,
            sni,
            cache: Cache::default(),
        };
        tls.common
            .builds_now(common_path, problems, |secrets| tls.client_config(secrets))
            .then_some(tls)
    }

    /// The SDS secrets this context names: what warming waits for.
    #[allow(dead_code, reason = "for listener and cluster warming on SDS secrets")]
    pub fn sds_names(&self) -> impl Iterator<Item = &str> {
        self.common.sds_names()
    }

    /// The client config for a handshake now, with named secrets from `secrets`.
    pub fn client_config(&self, secrets: &Secrets) -> Result<Arc<ClientConfig>, HandshakeError> {
        Ok(self.client_side(secrets)?.config.clone())
    }

    /// How many server chains the verifier for `secrets` remembers having accepted.
    #[cfg(test)]
    pub fn accepted_chains(&self, secrets: &Secrets) -> Result<usize, HandshakeError> {
        Ok(self.client_side(secrets)?.verifier.accepted_chains())
    }

    fn client_side(&self, secrets: &Secrets) -> Result<Arc<ClientSide>, HandshakeError> {
        let resolved = self.common.resolve(secrets)?;
        self.cache.get_or_build(&resolved.used, || {
            let verifier = Arc::new(UpstreamVerifier::new(
                resolved.validation.unwrap_or_default(),
                secret::provider(),
            ));
            let builder = ClientConfig::builder_with_provider(secret::provider())
                .with_protocol_versions(&self.common.versions)
                .map_err(|e| e.to_string())?
                .dangerous()
                .with_custom_certificate_verifier(verifier.clone());
            let mut config = if resolved.certificates.is_empty() {
                builder.with_no_client_auth()
            } else {
                builder
                    .with_client_cert_resolver(Arc::new(Certificates::new(resolved.certificates)))
            };
            config.alpn_protocols = self.common.alpn.clone();
            Ok(ClientSide {
                config: Arc::new(config),
                verifier,
            })
        })
    }

    /// Originates TLS on `stream` to `host`. The ALPN offered is Envoy's choice:
    /// `alpn` (an override: `istio.alpn`, `envoy.network.application_protocols`),
    /// else the context's list, else `fallback` (the HTTP pool's own protocol).
    pub async fn connect(
        &self,
        stream: TcpStream,
        host: SocketAddr,
        secrets: &Secrets,
        alpn: Option<&[String]>,
        fallback: Option<&str>,
    ) -> Result<tokio_rustls::client::TlsStream<TransportStream>, HandshakeError> {
        let mut config = self.client_config(secrets)?;
        let offered: Option<Vec<Vec<u8>>> = match alpn.filter(|a| !a.is_empty()) {
            Some(list) => Some(list.iter().map(|p| p.as_bytes().to_vec()).collect()),
            None if self.common.alpn.is_empty() => fallback.map(|f| vec![f.as_bytes().to_vec()]),
            None => None,
        };
        if let Some(offered) = offered {
            let mut with = (*config).clone();
            with.alpn_protocols = offered;
            config = Arc::new(with);
        }
        // rustls sends no SNI for an IP address, which is Envoy's behaviour without `sni`;
        // the verifier ignores the name either way.
        let name = self
            .sni
            .clone()
            .unwrap_or_else(|| ServerName::IpAddress(host.ip().into()));
        Ok(tokio_rustls::TlsConnector::from(config)
            .connect(name, TransportStream::under_tls(stream))
            .await?)
    }
}

/// What a same-node hand-off in this process proves in place of a handshake: each
/// side's certificate chain, checked by the other side's very verifier (trust anchors
/// and SAN matchers), and the ALPN and SNI the client would have sent. No key exchange
/// and no record encryption: both ends are this process.
#[derive(Debug, Clone, Default)]
pub struct InProcessHello {
    /// The client's certificate chain (leaf first); empty when it has none.
    pub chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    pub alpn: Vec<Vec<u8>>,
    pub server_name: Option<String>,
}

fn first_chain(resolved: &Resolved) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    resolved
        .certificates
        .first()
        .map(|c| c.cert.clone())
        .unwrap_or_default()
}

fn rejected(err: rustls::Error) -> HandshakeError {
    HandshakeError::Io(std::io::Error::new(
        std::io::ErrorKind::PermissionDenied,
        err,
    ))
}

impl UpstreamTls {
    /// The client's side of an in-process hand-off: what it would present and offer.
    pub fn in_process_hello(&self, secrets: &Secrets) -> Result<InProcessHello, HandshakeError> {
        let resolved = self.common.resolve(secrets)?;
        let server_name = match &self.sni {
            Some(ServerName::DnsName(name)) => Some(name.as_ref().to_owned()),
            _ => None,
        };
        Ok(InProcessHello {
            chain: first_chain(&resolved),
            alpn: self.common.alpn.clone(),
            server_name,
        })
    }

    /// Checks the server's chain as the handshake would have: trust, then SAN matchers.
    pub fn verify_in_process_server(
        &self,
        secrets: &Secrets,
        chain: &[rustls::pki_types::CertificateDer<'static>],
    ) -> Result<(), HandshakeError> {
        use rustls::client::danger::ServerCertVerifier;
        let side = self.client_side(secrets)?;
        let Some((leaf, intermediates)) = chain.split_first() else {
            return Err(rejected(rustls::Error::NoCertificatesPresented));
        };
        let name = ServerName::IpAddress(std::net::Ipv4Addr::UNSPECIFIED.into());
        side.verifier
            .verify_server_cert(
                leaf,
                intermediates,
                &name,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .map(|_| ())
            .map_err(rejected)
    }
}

impl DownstreamTls {
    /// The server's certificate chain for an in-process hand-off.
    pub fn in_process_chain(
        &self,
        secrets: &Secrets,
    ) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>, HandshakeError> {
        Ok(first_chain(&self.common.resolve(secrets)?))
    }

    /// Checks a client's chain as the handshake would have: a certificate required
    /// (`require_client_certificate`), trust, SAN matchers. Returns the ALPN protocol
    /// the handshake would have chosen.
    pub fn verify_in_process_client(
        &self,
        secrets: &Secrets,
        hello: &InProcessHello,
    ) -> Result<Option<String>, HandshakeError> {
        use rustls::server::danger::ClientCertVerifier;
        // The handshake's own configs: a context that cannot verify clients fails here
        // as its handshake would.
        let configs = self.server_configs(secrets)?;
        match (&configs.verifier, hello.chain.split_first()) {
            (Some(verifier), Some((leaf, intermediates))) => {
                verifier
                    .verify_client_cert(leaf, intermediates, rustls::pki_types::UnixTime::now())
                    .map_err(rejected)?;
            }
            (Some(_), None) if self.require_client_certificate => {
                return Err(rejected(rustls::Error::NoCertificatesPresented));
            }
            _ => {}
        }
        // The server's first protocol the client offered, as rustls picks.
        let chosen = self
            .common
            .alpn
            .iter()
            .find(|ours| hello.alpn.contains(ours))
            .map(|p| String::from_utf8_lossy(p).into_owned());
        Ok(chosen)
    }
}
