//! The CA client: pilot-agent's secret manager against `CA_ADDR`. Each round makes a new
//! key and CSR, calls `CreateCertificate` over TLS (trusting the mesh root) with the
//! service-account token as bearer (read again every time: kubelet rotates it) and the
//! `ClusterID` header, checks the chain it gets against the root and publishes it; then
//! sleeps until Istio's grace period before expiry. Failures back off exponentially.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

use super::csr::{self, KeyType};
use super::proto::{IstioCertificateRequest, create_certificate};
use super::{Bundle, Publisher};
use shunt_upstream::backoff::Backoff;

/// Where the CA is and what to ask it for. [`CaOptions::from_env`] reads pilot-agent's
/// environment; every field can be set by hand.
#[derive(Debug, Clone)]
pub struct CaOptions {
    /// `host:port` (`CA_ADDR`, e.g. `istiod.istio-system.svc:15012`).
    pub address: String,
    /// The TLS name the CA's certificate must carry; the host of `address` if `None`.
    pub server_name: Option<String>,
    /// The mesh root: trusted for the CA's own certificate and for what it issues.
    pub root_cert: PathBuf,
    /// The bearer token, read on every call.
    pub token_path: PathBuf,
    /// The token is not the identity's own but a node agent's (node mode's, for a pod
    /// enrolled without one): the request names the identity in its metadata as
    /// `ImpersonatedIdentity`, as ztunnel's does, for istiod to authorize.
    pub impersonate: bool,
    /// Sent as the `ClusterID` header.
    pub cluster_id: String,
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
    pub key_type: KeyType,
    /// Requested lifetime (`SECRET_TTL`); the CA may shorten it.
    pub ttl: Duration,
    /// Rotate when this fraction of the lifetime is left (`SECRET_GRACE_PERIOD_RATIO`).
    pub grace_period_ratio: f64,
    /// Spread of that ratio, ± (`SECRET_GRACE_PERIOD_RATIO_JITTER`).
    pub grace_period_jitter: f64,
    /// Waits between failed attempts.
    pub backoff: Backoff,
    /// How long one attempt (connect and call) may take.
    pub timeout: Duration,
}

/// pilot-agent's defaults for the paths in a pod.
pub const DEFAULT_TOKEN_PATH: &str = "./var/run/secrets/tokens/istio-token";
pub const DEFAULT_ROOT_CERT: &str = "./var/run/secrets/istio/root-cert.pem";

impl CaOptions {
    /// The options for `identity`'s parts with pilot-agent's defaults.
    pub fn new(address: impl Into<String>, namespace: &str, service_account: &str) -> CaOptions {
        CaOptions {
            address: address.into(),
            server_name: None,
            root_cert: DEFAULT_ROOT_CERT.into(),
            token_path: DEFAULT_TOKEN_PATH.into(),
            impersonate: false,
            cluster_id: "Kubernetes".into(),
            trust_domain: "cluster.local".into(),
            namespace: namespace.into(),
            service_account: service_account.into(),
            key_type: KeyType::EcdsaP256,
            ttl: Duration::from_secs(24 * 3600),
            grace_period_ratio: 0.5,
            grace_period_jitter: 0.01,
            backoff: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(60))
                .full_jitter(0.5),
            timeout: Duration::from_secs(30),
        }
    }

    /// pilot-agent's environment: `CA_ADDR` (default `istiod.istio-system.svc:15012`),
    /// `POD_NAMESPACE`, `SERVICE_ACCOUNT`, `TRUST_DOMAIN`, `ISTIO_META_CLUSTER_ID`,
    /// `ISTIO_META_TLS_CLIENT_ROOT_CERT` (the root file), `SECRET_TTL`,
    /// `SECRET_GRACE_PERIOD_RATIO`, `SECRET_GRACE_PERIOD_RATIO_JITTER`, and
    /// `SHUNT_WORKLOAD_KEY_TYPE` (`ECDSA`, the default, or `RSA`). A bad value is an
    /// error naming the variable.
    pub fn from_env() -> anyhow::Result<CaOptions> {
        Self::from_vars(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
    }

    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<CaOptions> {
        use anyhow::Context;
        let mut options = CaOptions::new(
            var("CA_ADDR").unwrap_or_else(|| "istiod.istio-system.svc:15012".into()),
            &var("POD_NAMESPACE").unwrap_or_else(|| "default".into()),
            &var("SERVICE_ACCOUNT").unwrap_or_else(|| "default".into()),
        );
        if let Some(v) = var("TRUST_DOMAIN") {
            options.trust_domain = v;
        }
        if let Some(v) = var("ISTIO_META_CLUSTER_ID") {
            options.cluster_id = v;
        }
        if let Some(v) = var("ISTIO_META_TLS_CLIENT_ROOT_CERT") {
            options.root_cert = v.into();
        }
        if let Some(v) = var("SECRET_TTL") {
            options.ttl = humantime::parse_duration(&v)
                .with_context(|| format!("SECRET_TTL={v:?} is not a duration"))?;
        }
        for (name, field) in [
            ("SECRET_GRACE_PERIOD_RATIO", &mut options.grace_period_ratio),
            (
                "SECRET_GRACE_PERIOD_RATIO_JITTER",
                &mut options.grace_period_jitter,
            ),
        ] {
            if let Some(v) = var(name) {
                *field = v
                    .parse::<f64>()
                    .ok()
                    .filter(|r| (0.0..1.0).contains(r))
                    .with_context(|| format!("{name}={v:?} is not a ratio in [0, 1)"))?;
            }
        }
        if let Some(v) = var("SHUNT_WORKLOAD_KEY_TYPE") {
            options.key_type = v
                .parse()
                .map_err(|e| anyhow::anyhow!("SHUNT_WORKLOAD_KEY_TYPE: {e}"))?;
        }
        Ok(options)
    }

    /// `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
    pub fn identity(&self) -> String {
        csr::spiffe_id(&self.trust_domain, &self.namespace, &self.service_account)
    }
}

/// Fetches, publishes and rotates until every provider is dropped.
pub(super) async fn run(options: CaOptions, publisher: Publisher) {
    let mut attempt = 0;
    while !publisher.bundle.is_closed() {
        match fetch(&options).await {
            Ok(bundle) => {
                attempt = 0;
                let jitter = (fastrand::f64() * 2.0 - 1.0) * options.grace_period_jitter;
                let wait = rotate_after(
                    SystemTime::now(),
                    bundle.not_after,
                    options.grace_period_ratio + jitter,
                );
                tracing::info!(
                    serial = %bundle.serial,
                    identity = %options.identity(),
                    "workload certificate issued; rotating in {wait:?}"
                );
                publisher.publish(bundle);
                tokio::time::sleep(wait).await;
            }
            Err(error) => {
                let failures = publisher.failed(error.clone());
                let wait = options.backoff.delay(attempt);
                attempt = attempt.saturating_add(1);
                tracing::warn!(
                    ca = %options.address,
                    failures,
                    "workload certificate: {error}; retrying in {wait:?}"
                );
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// When to rotate a certificate issued at `issued` that expires at `expires`: when
/// `ratio` of its lifetime is left (Istio's `rotateTime`), at once if that has passed.
pub fn rotate_after(issued: SystemTime, expires: SystemTime, ratio: f64) -> Duration {
    let lifetime = expires.duration_since(issued).unwrap_or_default();
    let grace = lifetime.mul_f64(ratio.clamp(0.0, 1.0));
    (expires - grace)
        .duration_since(SystemTime::now())
        .unwrap_or_default()
}

/// One issuance: a new key, the call, the checks.
pub async fn fetch(options: &CaOptions) -> Result<Bundle, String> {
    let token = std::fs::read_to_string(&options.token_path)
        .map_err(|e| format!("reading the token {}: {e}", options.token_path.display()))?;
    let root = std::fs::read_to_string(&options.root_cert)
        .map_err(|e| format!("reading the root {}: {e}", options.root_cert.display()))?;
    let identity = options.identity();
    let key_type = options.key_type;
    let id = identity.clone();
    let (key, csr) = tokio::task::spawn_blocking(move || csr::generate(key_type, &id))
        .await
        .map_err(|e| format!("key generation: {e}"))??;

    let mut request = tonic::Request::new(IstioCertificateRequest {
        csr,
        validity_duration: options.ttl.as_secs() as i64,
        metadata: options
            .impersonate
            .then(|| super::proto::impersonating(&identity)),
    });
    let bearer = format!("Bearer {}", token.trim()).parse().map_err(|_| {
        format!(
            "the token {} is not a header value",
            options.token_path.display()
        )
    })?;
    request.metadata_mut().insert("authorization", bearer);
    request.metadata_mut().insert(
        "clusterid",
        options
            .cluster_id
            .parse()
            .map_err(|_| format!("cluster id {:?} is not a header value", options.cluster_id))?,
    );
    let call = async {
        let channel = connect(options, &root).await?;
        create_certificate(channel, request)
            .await
            .map_err(|s| format!("CA {}: {:?}: {}", options.address, s.code(), s.message()))
    };
    let response = tokio::time::timeout(options.timeout, call)
        .await
        .map_err(|_| format!("CA {}: no answer in {:?}", options.address, options.timeout))??;
    if response.cert_chain.is_empty() {
        return Err(format!(
            "CA {}: an empty certificate chain",
            options.address
        ));
    }
    let chain: String = response
        .cert_chain
        .iter()
        .map(|pem| {
            let pem = pem.trim_end();
            format!("{pem}\n")
        })
        .collect();
    let bundle =
        Bundle::new(chain, key, root).map_err(|e| format!("CA {}: {e}", options.address))?;
    if !bundle.uris.contains(&identity) {
        return Err(format!(
            "CA {}: the certificate names {:?}, not {identity}",
            options.address, bundle.uris
        ));
    }
    Ok(bundle)
}

/// A TLS channel to the CA, trusting `root` only, ALPN h2.
async fn connect(options: &CaOptions, root: &str) -> Result<Channel, String> {
    let (host, _) = options
        .address
        .rsplit_once(':')
        .ok_or_else(|| format!("CA_ADDR {:?} is not host:port", options.address))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let name = options.server_name.clone().unwrap_or_else(|| host.clone());
    let name = rustls::pki_types::ServerName::try_from(name)
        .map_err(|e| format!("CA server name: {e}"))?;
    let roots = shunt_tls::pem::roots(root.as_bytes())
        .map_err(|e| format!("root {}: {e}", options.root_cert.display()))?;
    let mut config = rustls::ClientConfig::builder_with_provider(shunt_tls::secret::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let address = options.address.clone();
    let dial = tower::service_fn(move |_: tonic::codegen::http::Uri| {
        let (connector, name, address) = (connector.clone(), name.clone(), address.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(&address).await?;
            tcp.set_nodelay(true)?;
            Ok::<_, std::io::Error>(TokioIo::new(connector.connect(name, tcp).await?))
        }
    });
    Endpoint::from_static("http://ca")
        .connect_timeout(options.timeout)
        .connect_with_connector(dial)
        .await
        .map_err(|e| {
            let mut text = format!("connecting to the CA {}: {e}", options.address);
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                text.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            text
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_comes_when_the_grace_ratio_of_the_lifetime_is_left() {
        let now = SystemTime::now();
        let wait = rotate_after(now, now + Duration::from_secs(100), 0.5);
        assert!(
            wait <= Duration::from_secs(50) && wait > Duration::from_secs(49),
            "{wait:?}"
        );
        let wait = rotate_after(now, now + Duration::from_secs(100), 0.2);
        assert!(
            wait <= Duration::from_secs(80) && wait > Duration::from_secs(79),
            "{wait:?}"
        );
        // Already past the grace point (a long outage): at once.
        let old = now - Duration::from_secs(90);
        assert_eq!(
            rotate_after(old, old + Duration::from_secs(100), 0.5),
            Duration::ZERO
        );
    }

    #[test]
    fn the_environment_is_read_as_pilot_agent_reads_it() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let o = CaOptions::from_vars(vars(&[
            ("CA_ADDR", "ca.test:15012"),
            ("POD_NAMESPACE", "prod"),
            ("SERVICE_ACCOUNT", "api"),
            ("TRUST_DOMAIN", "example.org"),
            ("ISTIO_META_CLUSTER_ID", "east"),
            ("SECRET_TTL", "12h"),
            ("SECRET_GRACE_PERIOD_RATIO", "0.25"),
            ("SHUNT_WORKLOAD_KEY_TYPE", "RSA"),
        ]))
        .unwrap();
        assert_eq!(o.identity(), "spiffe://example.org/ns/prod/sa/api");
        assert_eq!(
            (
                o.address.as_str(),
                o.cluster_id.as_str(),
                o.ttl,
                o.grace_period_ratio,
                o.key_type
            ),
            (
                "ca.test:15012",
                "east",
                Duration::from_secs(12 * 3600),
                0.25,
                KeyType::Rsa2048
            )
        );
        let bad = CaOptions::from_vars(vars(&[("SECRET_GRACE_PERIOD_RATIO", "1.5")])).unwrap_err();
        assert!(
            bad.to_string()
                .contains("SECRET_GRACE_PERIOD_RATIO=\"1.5\""),
            "{bad}"
        );
        let bad = CaOptions::from_vars(vars(&[("SECRET_TTL", "soon")])).unwrap_err();
        assert!(bad.to_string().contains("SECRET_TTL"), "{bad}");
    }
}
