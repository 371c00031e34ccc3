//! One workload certificate with its key and the mesh root, checked once when it is
//! made: the key belongs to the leaf, the chain leads to the root. What SDS serves
//! (Istio's `default` and `ROOTCA` secrets) and what the in-process proxy's secret
//! store takes are both made from it.

use std::time::SystemTime;

use envoy_types::pb::envoy::config::core::v3::DataSource;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::secret::Type as SecretType;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, Secret as EnvoySecret, TlsCertificate,
};
use rustls::pki_types::{CertificateDer, UnixTime};
use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension, X509Certificate};

use shunt_config::{Diagnostics, JsonPath};
use shunt_tls::{Secrets, secret};

/// The SDS name of the workload certificate (Istio's `default`).
pub const WORKLOAD_CERTIFICATE: &str = "default";
/// The SDS name of the mesh's trust anchors (Istio's `ROOTCA`).
pub const ROOT_CA: &str = "ROOTCA";

/// A certificate chain (leaf first), its private key and the roots it was checked
/// against, all PEM; and what the leaf says about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct Bundle {
    pub cert_chain: String,
    pub private_key: String,
    pub root_cert: String,
    /// The leaf's serial number, hex (what `openssl x509 -serial` prints).
    pub serial: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    /// The leaf's URI SANs (the SPIFFE identity).
    pub uris: Vec<String>,
}

impl Bundle {
    /// Checks and describes a bundle: the key must match the leaf and the chain must
    /// verify against `root_cert` now. The error says which of the three is wrong.
    pub fn new(
        cert_chain: String,
        private_key: String,
        root_cert: String,
    ) -> Result<Bundle, String> {
        let chain = shunt_tls::pem::certificates(cert_chain.as_bytes())
            .map_err(|e| format!("certificate chain: {e}"))?;
        let roots = shunt_tls::pem::roots(root_cert.as_bytes())
            .map_err(|e| format!("root certificate: {e}"))?;
        // The key check: the same one a handshake would meet.
        let mut problems = Diagnostics::default();
        let certificate = TlsCertificate {
            certificate_chain: Some(inline(&cert_chain)),
            private_key: Some(inline(&private_key)),
            ..Default::default()
        };
        if secret::compile_certificate(&certificate, &JsonPath::new("private key"), &mut problems)
            .is_none()
        {
            let why: Vec<String> = problems.errors.iter().map(|d| d.to_string()).collect();
            return Err(why.join("; "));
        }
        verify_chain(&chain, roots)?;
        let leaf = describe(&chain[0])?;
        Ok(Bundle {
            cert_chain,
            private_key,
            root_cert,
            serial: leaf.serial,
            not_before: leaf.not_before,
            not_after: leaf.not_after,
            uris: leaf.uris,
        })
    }

    /// Istio's two SDS secrets: `default` (the chain and key) and `ROOTCA` (the roots
    /// as `trusted_ca`), inline as pilot-agent sends them.
    pub fn envoy_secrets(&self) -> [EnvoySecret; 2] {
        [
            EnvoySecret {
                name: WORKLOAD_CERTIFICATE.into(),
                r#type: Some(SecretType::TlsCertificate(TlsCertificate {
                    certificate_chain: Some(inline(&self.cert_chain)),
                    private_key: Some(inline(&self.private_key)),
                    ..Default::default()
                })),
            },
            EnvoySecret {
                name: ROOT_CA.into(),
                r#type: Some(SecretType::ValidationContext(
                    CertificateValidationContext {
                        trusted_ca: Some(inline(&self.root_cert)),
                        ..Default::default()
                    },
                )),
            },
        ]
    }

    /// The same two secrets compiled for the in-process proxy's secret store
    /// (`Snapshot::secrets`): merge them in on every rotation.
    pub fn tls_secrets(&self) -> Result<Secrets, String> {
        let mut problems = Diagnostics::default();
        let mut secrets = Secrets::new();
        for s in self.envoy_secrets() {
            if let Some(compiled) =
                secret::compile(&s, &JsonPath::new(s.name.as_str()), &mut problems)
            {
                secrets.insert(s.name.clone(), std::sync::Arc::new(compiled));
            }
        }
        match problems.finish() {
            Ok(()) => Ok(secrets),
            Err(e) => Err(e.to_string()),
        }
    }
}

fn inline(pem: &str) -> DataSource {
    DataSource {
        specifier: Some(Specifier::InlineBytes(pem.as_bytes().to_vec())),
        ..Default::default()
    }
}

/// The chain must lead from its leaf to one of `roots`, valid now, for a workload
/// (client auth, as Istio's certificates carry; webpki checks validity and signatures).
fn verify_chain(
    chain: &[CertificateDer<'static>],
    roots: rustls::RootCertStore,
) -> Result<(), String> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        secret::provider(),
    )
    .build()
    .map_err(|e| format!("root certificate: {e}"))?;
    let now = UnixTime::since_unix_epoch(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default(),
    );
    verifier
        .verify_client_cert(&chain[0], &chain[1..], now)
        .map(|_| ())
        .map_err(|e| format!("certificate chain does not verify against the root: {e}"))
}

struct Leaf {
    serial: String,
    not_before: SystemTime,
    not_after: SystemTime,
    uris: Vec<String>,
}

fn describe(der: &CertificateDer<'_>) -> Result<Leaf, String> {
    let (_, cert) = X509Certificate::from_der(der)
        .map_err(|e| format!("certificate chain: unreadable leaf: {e}"))?;
    let time = |t: x509_parser::time::ASN1Time| {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(t.timestamp().max(0) as u64)
    };
    let mut uris = Vec::new();
    for ext in cert.extensions() {
        if let ParsedExtension::SubjectAlternativeName(san) = ext.parsed_extension() {
            for name in &san.general_names {
                if let GeneralName::URI(uri) = name {
                    uris.push((*uri).to_owned());
                }
            }
        }
    }
    Ok(Leaf {
        serial: cert.raw_serial_as_string().replace(':', "").to_uppercase(),
        not_before: time(cert.validity().not_before),
        not_after: time(cert.validity().not_after),
        uris,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};

    use super::*;

    /// A root (PEM) and a function issuing leaves for a URI from it: (chain, key).
    pub(crate) fn root() -> (String, impl Fn(&str) -> (String, String)) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).unwrap().pem();
        let issue = move |uri: &str| {
            let leaf_key = KeyPair::generate().unwrap();
            let mut leaf = CertificateParams::default();
            leaf.subject_alt_names = vec![SanType::URI(uri.to_owned().try_into().unwrap())];
            leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
            let issuer = Issuer::from_params(&params, &key);
            let cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
            (cert.pem(), leaf_key.serialize_pem())
        };
        (pem, issue)
    }

    #[test]
    fn a_bundle_describes_its_leaf_and_makes_istios_two_secrets() {
        let (root, issue) = root();
        let (chain, key) = issue("spiffe://td/ns/a/sa/b");
        let bundle = Bundle::new(chain.clone(), key, root.clone()).unwrap();
        assert_eq!(bundle.uris, ["spiffe://td/ns/a/sa/b"]);
        assert!(bundle.not_before < bundle.not_after);
        assert!(!bundle.serial.is_empty() && !bundle.serial.contains(':'));
        let [default, rootca] = bundle.envoy_secrets();
        assert_eq!(
            (default.name.as_str(), rootca.name.as_str()),
            ("default", "ROOTCA")
        );
        let secrets = bundle.tls_secrets().unwrap();
        assert!(matches!(
            secrets["default"].kind,
            shunt_tls::secret::SecretKind::TlsCertificate(_)
        ));
        assert!(matches!(
            secrets["ROOTCA"].kind,
            shunt_tls::secret::SecretKind::ValidationContext(_)
        ));
    }

    #[test]
    fn a_key_of_another_certificate_or_a_foreign_root_is_refused_by_name() {
        let (root, issue) = root();
        let (chain, _) = issue("spiffe://td/ns/a/sa/b");
        let (_, other_key) = issue("spiffe://td/ns/a/sa/c");
        let err = Bundle::new(chain.clone(), other_key, root).unwrap_err();
        assert!(
            err.contains("private key") && err.contains("does not match"),
            "{err}"
        );

        let (foreign_root, _) = super::tests::root();
        let (chain, key) = issue("spiffe://td/ns/a/sa/d");
        let err = Bundle::new(chain, key, foreign_root).unwrap_err();
        assert!(
            err.starts_with("certificate chain does not verify against the root"),
            "{err}"
        );

        let err = Bundle::new("not PEM".into(), String::new(), String::new()).unwrap_err();
        assert!(err.starts_with("certificate chain:"), "{err}");
    }
}
