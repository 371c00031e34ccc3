//! A fresh key pair and a CSR naming the workload's SPIFFE identity as its only SAN
//! (a URI), as pilot-agent asks the mesh CA. ECDSA P-256 by default; RSA 2048 by option
//! (ring cannot generate RSA keys, so the `rsa` crate makes them and rcgen signs).

use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};

/// The workload key's algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyType {
    #[default]
    EcdsaP256,
    Rsa2048,
}

impl std::str::FromStr for KeyType {
    type Err = String;
    /// Istio's `ECC_SIGNATURE_ALGORITHM` spelling (`ECDSA`) or `RSA`.
    fn from_str(s: &str) -> Result<KeyType, String> {
        match s.to_ascii_uppercase().as_str() {
            "" | "ECDSA" | "EC" | "ECDSA_P256" => Ok(KeyType::EcdsaP256),
            "RSA" | "RSA2048" => Ok(KeyType::Rsa2048),
            _ => Err(format!("unknown key type {s:?} (ECDSA or RSA)")),
        }
    }
}

/// `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`.
pub fn spiffe_id(trust_domain: &str, namespace: &str, service_account: &str) -> String {
    format!("spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}")
}

/// A new key of `key_type` and a CSR for `identity`: (key PEM, CSR PEM).
pub fn generate(key_type: KeyType, identity: &str) -> Result<(String, String), String> {
    let key = match key_type {
        KeyType::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| format!("generating an ECDSA key: {e}"))?,
        KeyType::Rsa2048 => {
            use rsa::pkcs8::EncodePrivateKey;
            let rsa = rsa::RsaPrivateKey::new(&mut rand::thread_rng(), 2048)
                .map_err(|e| format!("generating an RSA key: {e}"))?;
            let pem = rsa
                .to_pkcs8_pem(rsa::pkcs8::LineEnding::LF)
                .map_err(|e| format!("encoding the RSA key: {e}"))?;
            KeyPair::from_pkcs8_pem_and_sign_algo(&pem, &rcgen::PKCS_RSA_SHA256)
                .map_err(|e| format!("loading the RSA key: {e}"))?
        }
    };
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    let uri = identity
        .to_owned()
        .try_into()
        .map_err(|e| format!("identity {identity:?} is not a URI SAN: {e}"))?;
    params.subject_alt_names = vec![SanType::URI(uri)];
    let csr = params
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .map_err(|e| format!("making the CSR: {e}"))?;
    Ok((key.serialize_pem(), csr))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(csr: &str) -> rcgen::CertificateSigningRequestParams {
        rcgen::CertificateSigningRequestParams::from_pem(csr).expect("a valid, signed CSR")
    }

    #[test]
    fn the_csr_names_the_spiffe_identity_and_is_signed_by_an_ecdsa_key() {
        let id = spiffe_id("cluster.local", "default", "sleep");
        assert_eq!(id, "spiffe://cluster.local/ns/default/sa/sleep");
        let (key, csr) = generate(KeyType::EcdsaP256, &id).unwrap();
        let params = parsed(&csr);
        assert_eq!(
            params.params.subject_alt_names,
            vec![SanType::URI(id.try_into().unwrap())]
        );
        assert_eq!(
            params.public_key.algorithm(),
            &rcgen::PKCS_ECDSA_P256_SHA256
        );
        assert!(key.contains("BEGIN PRIVATE KEY"), "{key}");
    }

    #[test]
    fn rsa_by_option() {
        let (_, csr) = generate(KeyType::Rsa2048, "spiffe://td/ns/a/sa/b").unwrap();
        assert_eq!(parsed(&csr).public_key.algorithm(), &rcgen::PKCS_RSA_SHA256);
        assert_eq!("rsa".parse(), Ok(KeyType::Rsa2048));
        assert!("dsa".parse::<KeyType>().unwrap_err().contains("\"dsa\""));
    }
}
