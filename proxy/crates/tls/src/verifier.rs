//! Checking a peer's certificate as Envoy's validation context does: the chain against
//! `trusted_ca` (when set), then the SAN matchers. Unlike a browser, Envoy does not check
//! the server's name against the SNI; identity is what the SAN matchers say (Istio's
//! SPIFFE URIs), so the upstream verifier leaves the name out on purpose.

use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, Error, SignatureScheme};

use super::san;
use super::secret::ValidationContext;

/// The peer's certificate fails the SAN matchers.
struct SanMismatch(Vec<san::San>);

/// rustls shows a custom certificate error with `Debug`: make that the sentence.
impl std::fmt::Debug for SanMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::fmt::Display for SanMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "no subject alternative name matches the validation context (peer has {})",
            self.0
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

impl std::error::Error for SanMismatch {}

fn check_sans(context: &ValidationContext, end_entity: &CertificateDer<'_>) -> Result<(), Error> {
    if context.san_matchers.is_empty() {
        return Ok(());
    }
    let sans = san::of_certificate(end_entity);
    if san::accepts(&context.san_matchers, &sans) {
        Ok(())
    } else {
        Err(Error::InvalidCertificate(rustls::CertificateError::Other(
            rustls::OtherError(Arc::new(SanMismatch(sans))),
        )))
    }
}

/// The chains a verifier accepted (trust and SAN matchers both), each until it would
/// expire. A mesh meets the same few peer certificates on every connection, and
/// checking a chain again (an ECDSA signature per link) was a third of node mode's CPU
/// per new connection. A verifier belongs to one set of trust anchors and matchers: new
/// roots from SDS build a new verifier, so nothing accepted under the old ones is kept.
#[derive(Debug, Default)]
struct Accepted(Mutex<Vec<AcceptedChain>>);

#[derive(Debug)]
struct AcceptedChain {
    /// Leaf first, then the intermediates as presented.
    chain: Vec<CertificateDer<'static>>,
    /// The latest `not_before` and the earliest `not_after` in the chain, in seconds.
    valid: (u64, u64),
}

impl AcceptedChain {
    fn is(&self, leaf: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) -> bool {
        self.chain.len() == intermediates.len() + 1
            && self.chain[0] == *leaf
            && self.chain[1..] == *intermediates
    }
}

/// Enough for the identities one context meets (a node's pods, a service's peers);
/// past it the oldest is forgotten and checked again when it comes back.
const ACCEPTED_CHAINS: usize = 64;

impl Accepted {
    fn holds(
        &self,
        leaf: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> bool {
        let now = now.as_secs();
        let accepted = self.0.lock().unwrap_or_else(|e| e.into_inner());
        accepted
            .iter()
            .any(|a| (a.valid.0..=a.valid.1).contains(&now) && a.is(leaf, intermediates))
    }

    /// Remembers a chain just accepted; one whose validity cannot be read is not kept.
    fn remember(&self, leaf: &CertificateDer<'_>, intermediates: &[CertificateDer<'_>]) {
        let chain: Vec<CertificateDer<'static>> = std::iter::once(leaf)
            .chain(intermediates)
            .map(|c| c.clone().into_owned())
            .collect();
        let Some(valid) = validity(&chain) else {
            return;
        };
        let mut accepted = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // Two connections may have checked the same chain at once.
        if accepted.iter().any(|a| a.is(leaf, intermediates)) {
            return;
        }
        if accepted.len() >= ACCEPTED_CHAINS {
            accepted.remove(0);
        }
        accepted.push(AcceptedChain { chain, valid });
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// The window in which every certificate of `chain` is valid, as webpki checks it.
fn validity(chain: &[CertificateDer<'_>]) -> Option<(u64, u64)> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let mut window = (0u64, u64::MAX);
    for der in chain {
        let (_, cert) = X509Certificate::from_der(der).ok()?;
        let validity = cert.validity();
        let from = u64::try_from(validity.not_before.timestamp()).unwrap_or(0);
        let until = u64::try_from(validity.not_after.timestamp()).ok()?;
        window = (window.0.max(from), window.1.min(until));
    }
    Some(window)
}

/// Verifies an upstream server for the client side.
#[derive(Debug)]
pub struct UpstreamVerifier {
    context: ValidationContext,
    provider: Arc<CryptoProvider>,
    accepted: Accepted,
}

impl UpstreamVerifier {
    pub fn new(context: ValidationContext, provider: Arc<CryptoProvider>) -> Self {
        UpstreamVerifier {
            context,
            provider,
            accepted: Accepted::default(),
        }
    }

    /// How many chains it remembers having accepted.
    #[cfg(test)]
    pub fn accepted_chains(&self) -> usize {
        self.accepted.len()
    }
}

impl ServerCertVerifier for UpstreamVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        if self.accepted.holds(end_entity, intermediates, now) {
            return Ok(ServerCertVerified::assertion());
        }
        if let Some(roots) = &self.context.roots {
            let cert = ParsedCertificate::try_from(end_entity)?;
            rustls::client::verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.provider.signature_verification_algorithms.all,
            )?;
        }
        check_sans(&self.context, end_entity)?;
        self.accepted.remember(end_entity, intermediates);
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Verifies a downstream client's certificate: webpki's chain check (with the client
/// auth key usage), then the SAN matchers.
#[derive(Debug)]
pub struct DownstreamVerifier {
    chain: Arc<dyn ClientCertVerifier>,
    context: ValidationContext,
    accepted: Accepted,
}

impl DownstreamVerifier {
    /// `None` when the context has no `trusted_ca`: there is nothing to verify a client
    /// against, so none is asked for.
    pub fn new(
        context: ValidationContext,
        required: bool,
        provider: Arc<CryptoProvider>,
    ) -> Result<Option<Self>, String> {
        let Some(roots) = context.roots.clone() else {
            if required || !context.san_matchers.is_empty() {
                return Err(
                    "verifying client certificates needs a validation context with trusted_ca"
                        .into(),
                );
            }
            return Ok(None);
        };
        let builder = WebPkiClientVerifier::builder_with_provider(roots, provider);
        let builder = if required {
            builder
        } else {
            builder.allow_unauthenticated()
        };
        let chain = builder.build().map_err(|e| e.to_string())?;
        Ok(Some(DownstreamVerifier {
            chain,
            context,
            accepted: Accepted::default(),
        }))
    }

    /// How many chains it remembers having accepted.
    #[cfg(test)]
    pub fn accepted_chains(&self) -> usize {
        self.accepted.len()
    }
}

impl ClientCertVerifier for DownstreamVerifier {
    fn offer_client_auth(&self) -> bool {
        self.chain.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.chain.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.chain.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        if self.accepted.holds(end_entity, intermediates, now) {
            return Ok(ClientCertVerified::assertion());
        }
        self.chain
            .verify_client_cert(end_entity, intermediates, now)?;
        check_sans(&self.context, end_entity)?;
        self.accepted.remember(end_entity, intermediates);
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}
