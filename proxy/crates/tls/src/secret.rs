//! Envoy's `Secret` (static `secrets`, SDS): a certificate with its key, or a validation
//! context (trust anchors and SAN matchers), compiled once into what rustls takes. Files
//! are read and keys checked against their certificate here, so a handshake never
//! meets a bad secret; every problem is reported at the field's JSON path.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::certificate_validation_context::TrustChainVerification;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::secret::Type as SecretType;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret as EnvoySecret, TlsCertificate as EnvoyTlsCertificate,
};
use rustls::RootCertStore;
use rustls::sign::CertifiedKey;

use super::san::SanMatcher;
use super::{data_source, pem};
use shunt_config::{Diagnostics, JsonPath};

/// A compiled secret. Shared by `Arc`: its identity is what TLS configs are cached by.
#[derive(Debug)]
pub struct Secret {
    pub name: String,
    pub kind: SecretKind,
}

#[derive(Debug)]
pub enum SecretKind {
    TlsCertificate(Arc<TlsCertificate>),
    ValidationContext(Arc<ValidationContext>),
}

/// A certificate chain and its private key, loaded and checked to match.
#[derive(Debug)]
pub struct TlsCertificate {
    pub key: Arc<CertifiedKey>,
}

/// How a peer's certificate is checked.
#[derive(Debug, Clone, Default)]
pub struct ValidationContext {
    /// `trusted_ca`: the peer must chain to one of these. `None`: the chain is not
    /// verified (Envoy's behaviour without `trusted_ca`).
    pub roots: Option<Arc<RootCertStore>>,
    /// Any one must match a SAN of the peer's certificate; none: any peer.
    pub san_matchers: Vec<SanMatcher>,
}

impl ValidationContext {
    /// `self` merged with an SDS-provided `dynamic` one, as Envoy's
    /// `CombinedCertificateValidationContext` does (`MergeFrom`): singular fields from
    /// `dynamic` win, repeated ones are concatenated.
    pub fn merged(&self, dynamic: &ValidationContext) -> ValidationContext {
        ValidationContext {
            roots: dynamic.roots.clone().or_else(|| self.roots.clone()),
            san_matchers: self
                .san_matchers
                .iter()
                .chain(&dynamic.san_matchers)
                .cloned()
                .collect(),
        }
    }
}

/// The crypto every TLS config of the proxy uses: ring's, with the cipher suites in
/// BoringSSL's (Envoy's) order of preference, AES-128-GCM first. rustls would put
/// AES-256-GCM-SHA384 first, whose SHA-384 key schedule runs without hardware help
/// where SHA-256 has it (x86's SHA extensions): 6% of a sidecar's CPU per new mTLS
/// connection went to it.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    static PROVIDER: std::sync::OnceLock<Arc<rustls::crypto::CryptoProvider>> =
        std::sync::OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            use rustls::crypto::ring::cipher_suite::*;
            Arc::new(rustls::crypto::CryptoProvider {
                cipher_suites: vec![
                    TLS13_AES_128_GCM_SHA256,
                    TLS13_AES_256_GCM_SHA384,
                    TLS13_CHACHA20_POLY1305_SHA256,
                    TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
                    TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
                    TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
                    TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
                    TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
                    TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
                ],
                ..rustls::crypto::ring::default_provider()
            })
        })
        .clone()
}

/// Compiles `secret` at `path`; `None` after reporting what is wrong.
pub fn compile(
    secret: &EnvoySecret,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Secret> {
    if secret.name.is_empty() {
        problems.error(path.field("name"), "a secret needs a name");
        return None;
    }
    let kind = match &secret.r#type {
        Some(SecretType::TlsCertificate(cert)) => SecretKind::TlsCertificate(Arc::new(
            compile_certificate(cert, &path.field("tls_certificate"), problems)?,
        )),
        Some(SecretType::ValidationContext(context)) => SecretKind::ValidationContext(Arc::new(
            compile_validation_context(context, &path.field("validation_context"), problems)?,
        )),
        Some(SecretType::SessionTicketKeys(_)) => {
            problems.error(
                path.field("session_ticket_keys"),
                "session ticket key secrets are not implemented",
            );
            return None;
        }
        Some(SecretType::GenericSecret(_)) => {
            problems.error(
                path.field("generic_secret"),
                "generic secrets are not implemented",
            );
            return None;
        }
        None => {
            problems.error(path, "a secret needs tls_certificate or validation_context");
            return None;
        }
    };
    Some(Secret {
        name: secret.name.clone(),
        kind,
    })
}

/// A `TlsCertificate`: its chain and key read, parsed and checked to belong together.
pub fn compile_certificate(
    cert: &EnvoyTlsCertificate,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<TlsCertificate> {
    for (set, field) in [
        (cert.private_key_provider.is_some(), "private_key_provider"),
        (cert.password.is_some(), "password"),
        (cert.pkcs12.is_some(), "pkcs12"),
        (cert.watched_directory.is_some(), "watched_directory"),
    ] {
        if set {
            problems.error(path.field(field), "is not implemented");
            return None;
        }
    }
    let chain_path = path.field("certificate_chain");
    let key_path = path.field("private_key");
    let (Some(chain), Some(key)) = (&cert.certificate_chain, &cert.private_key) else {
        let missing = if cert.certificate_chain.is_none() {
            chain_path
        } else {
            key_path
        };
        problems.error(missing, "needed");
        return None;
    };
    let chain = data_source::read_with(chain, &chain_path, pem::certificates);
    let key = data_source::read_with(key, &key_path, pem::private_key);
    let (chain, key) = match (chain, key) {
        (Ok(chain), Ok(key)) => (chain, key),
        (chain, key) => {
            for err in [chain.err(), key.err()].into_iter().flatten() {
                problems.error(err.path, err.message);
            }
            return None;
        }
    };
    match CertifiedKey::from_der(chain, key, &provider()) {
        Ok(key) => Some(TlsCertificate { key: Arc::new(key) }),
        Err(rustls::Error::InconsistentKeys(_)) => {
            problems.error(
                key_path,
                "does not match the public key of the certificate_chain's first certificate",
            );
            None
        }
        Err(err) => {
            problems.error(key_path, format!("unusable private key: {err}"));
            None
        }
    }
}

/// A `CertificateValidationContext`. What shunt cannot check (pins, CRLs, custom
/// validators) is refused rather than ignored, since ignoring it would let in peers the
/// config keeps out.
pub fn compile_validation_context(
    context: &CertificateValidationContext,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ValidationContext> {
    let mut ok = true;
    for (set, field) in [
        (
            !context.verify_certificate_spki.is_empty(),
            "verify_certificate_spki",
        ),
        (
            !context.verify_certificate_hash.is_empty(),
            "verify_certificate_hash",
        ),
        (context.crl.is_some(), "crl"),
        (
            context.custom_validator_config.is_some(),
            "custom_validator_config",
        ),
        (
            context.ca_certificate_provider_instance.is_some(),
            "ca_certificate_provider_instance",
        ),
        (context.system_root_certs.is_some(), "system_root_certs"),
        (context.watched_directory.is_some(), "watched_directory"),
        (
            context.trust_chain_verification == TrustChainVerification::AcceptUntrusted as i32,
            "trust_chain_verification",
        ),
    ] {
        if set {
            problems.error(path.field(field), "is not implemented");
            ok = false;
        }
    }
    let roots = match &context.trusted_ca {
        None => None,
        Some(source) => {
            match data_source::read_with(source, &path.field("trusted_ca"), pem::roots) {
                Ok(roots) => Some(Arc::new(roots)),
                Err(err) => {
                    problems.error(err.path, err.message);
                    ok = false;
                    None
                }
            }
        }
    };
    let mut san_matchers = Vec::new();
    for (i, m) in context.match_typed_subject_alt_names.iter().enumerate() {
        let at = path.field("match_typed_subject_alt_names").index(i);
        match SanMatcher::compile_typed(m, &at, problems) {
            Some(m) => san_matchers.push(m),
            None => ok = false,
        }
    }
    #[allow(deprecated, reason = "Envoy still honours match_subject_alt_names")]
    for (i, m) in context.match_subject_alt_names.iter().enumerate() {
        let at = path.field("match_subject_alt_names").index(i);
        match SanMatcher::compile_untyped(m, &at, problems) {
            Some(m) => san_matchers.push(m),
            None => ok = false,
        }
    }
    ok.then_some(ValidationContext {
        roots,
        san_matchers,
    })
}

/// The bootstrap's `static_resources.secrets`, by name; a repeated name is an error.
pub fn compile_static(
    secrets: &[EnvoySecret],
    problems: &mut Diagnostics,
) -> std::collections::HashMap<String, Arc<Secret>> {
    let mut compiled = std::collections::HashMap::new();
    for (i, secret) in secrets.iter().enumerate() {
        let path = JsonPath::new("static_resources").field("secrets").index(i);
        let Some(secret) = compile(secret, &path, problems) else {
            continue;
        };
        if compiled.contains_key(&secret.name) {
            problems.error(
                path.field("name"),
                format!("secret {:?} is defined twice", secret.name),
            );
            continue;
        }
        compiled.insert(secret.name.clone(), Arc::new(secret));
    }
    compiled
}
