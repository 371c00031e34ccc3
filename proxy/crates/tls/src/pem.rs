//! PEM to the DER values rustls takes: certificate chains, private keys and trust
//! anchors. Errors say what is missing in which field, since a PEM file that parses to
//! nothing (a key given as the chain, a DER file) is the common mistake.

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Every `CERTIFICATE` block of `pem`, in order; at least one.
pub fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("malformed PEM: {e}"))?;
    if certs.is_empty() {
        return Err("no PEM CERTIFICATE block".into());
    }
    Ok(certs)
}

/// The first private key of `pem` (PKCS#8, PKCS#1 RSA or SEC1 EC).
pub fn private_key(pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            "no PEM PRIVATE KEY block (PKCS#8, RSA or EC)".to_owned()
        }
        e => format!("malformed PEM: {e}"),
    })
}

/// A trust store of every certificate in `pem`; at least one must be a usable anchor.
pub fn roots(pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in certificates(pem)? {
        roots
            .add(cert)
            .map_err(|e| format!("not a usable CA certificate: {e}"))?;
    }
    Ok(roots)
}
