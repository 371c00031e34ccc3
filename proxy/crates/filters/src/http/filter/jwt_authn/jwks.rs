//! JSON Web Key Sets and signature checks (ring): the keys of a JWKS by type (RSA, EC
//! P-256/P-384, oct for HMAC, OKP Ed25519), and jwt_verify_lib's choice of keys for a
//! token: the `kid` (when both have one) and `alg` (when the key has one) must match,
//! every fitting key is tried, and no fitting key at all is a different failure from a
//! failed signature.

use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde_json::Value;

use super::jwt::{Jwt, Status, decode_base64url};

#[derive(Debug, Clone)]
enum Material {
    Rsa {
        n: Vec<u8>,
        e: Vec<u8>,
    },
    /// The uncompressed point (`04 || x || y`) and its curve.
    Ec {
        curve: Curve,
        point: Vec<u8>,
    },
    Oct(Vec<u8>),
    Ed25519(Vec<u8>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Curve {
    P256,
    P384,
    P521,
}

#[derive(Debug, Clone)]
struct Key {
    kid: String,
    alg: String,
    material: Material,
}

/// A parsed key set; keys it cannot read are left out (as jwt_verify_lib does).
#[derive(Debug, Clone, Default)]
pub struct Jwks {
    keys: Vec<Key>,
}

fn field<'a>(key: &'a Value, name: &str) -> Option<&'a str> {
    key.get(name).and_then(Value::as_str)
}

fn bytes(key: &Value, name: &str) -> Option<Vec<u8>> {
    decode_base64url(field(key, name)?)
}

fn material(key: &Value) -> Option<Material> {
    match field(key, "kty")? {
        "RSA" => Some(Material::Rsa {
            n: bytes(key, "n")?,
            e: bytes(key, "e")?,
        }),
        "EC" => {
            let curve = match field(key, "crv").unwrap_or("P-256") {
                "P-256" => Curve::P256,
                "P-384" => Curve::P384,
                "P-521" => Curve::P521,
                _ => return None,
            };
            let mut point = vec![4];
            point.extend(bytes(key, "x")?);
            point.extend(bytes(key, "y")?);
            Some(Material::Ec { curve, point })
        }
        "oct" => Some(Material::Oct(bytes(key, "k")?)),
        "OKP" if field(key, "crv") == Some("Ed25519") => Some(Material::Ed25519(bytes(key, "x")?)),
        _ => None,
    }
}

impl Jwks {
    /// A JWKS document (`{"keys": [...]}`); `Err` when it is not one or has no key
    /// that can be used.
    pub fn parse(text: &[u8]) -> Result<Jwks, String> {
        let doc: Value =
            serde_json::from_slice(text).map_err(|e| format!("the JWKS is not JSON: {e}"))?;
        let Some(items) = doc.get("keys").and_then(Value::as_array) else {
            return Err("the JWKS has no [keys] list".into());
        };
        let keys: Vec<Key> = items
            .iter()
            .filter_map(|item| {
                Some(Key {
                    kid: field(item, "kid").unwrap_or_default().to_owned(),
                    alg: field(item, "alg").unwrap_or_default().to_owned(),
                    material: material(item)?,
                })
            })
            .collect();
        if keys.is_empty() {
            return Err("the JWKS has no valid public key".into());
        }
        Ok(Jwks { keys })
    }

    /// jwt_verify_lib's `verifyJwtWithoutTimeChecking` over these keys.
    pub fn verify(&self, jwt: &Jwt) -> Status {
        let mut fitting = false;
        for key in &self.keys {
            if !jwt.kid.is_empty() && !key.kid.is_empty() && key.kid != jwt.kid {
                continue;
            }
            if !key.alg.is_empty() && key.alg != jwt.alg {
                continue;
            }
            let Some(ok) = check(&key.material, jwt) else {
                continue;
            };
            fitting = true;
            if ok {
                return Status::Ok;
            }
        }
        if fitting {
            Status::JwtVerificationFail
        } else {
            Status::JwksKidAlgMismatch
        }
    }
}

/// `None`: the key does not fit the token's algorithm; else whether the signature
/// checks out.
fn check(material: &Material, jwt: &Jwt) -> Option<bool> {
    let message = jwt.signed.as_bytes();
    let signature = &jwt.signature;
    let alg = jwt.alg.as_str();
    match material {
        Material::Rsa { n, e } => {
            let params: &signature::RsaParameters = match alg {
                "RS256" => &signature::RSA_PKCS1_2048_8192_SHA256,
                "RS384" => &signature::RSA_PKCS1_2048_8192_SHA384,
                "RS512" => &signature::RSA_PKCS1_2048_8192_SHA512,
                "PS256" => &signature::RSA_PSS_2048_8192_SHA256,
                "PS384" => &signature::RSA_PSS_2048_8192_SHA384,
                "PS512" => &signature::RSA_PSS_2048_8192_SHA512,
                _ => return None,
            };
            let components = RsaPublicKeyComponents { n, e };
            Some(components.verify(params, message, signature).is_ok())
        }
        Material::Ec { curve, point } => {
            let algorithm: &signature::EcdsaVerificationAlgorithm = match (alg, curve) {
                ("ES256", Curve::P256) => &signature::ECDSA_P256_SHA256_FIXED,
                ("ES384", Curve::P384) => &signature::ECDSA_P384_SHA384_FIXED,
                // ring has no P-521: such a token cannot be verified here.
                ("ES512", Curve::P521) => return Some(false),
                _ => return None,
            };
            Some(
                UnparsedPublicKey::new(algorithm, point)
                    .verify(message, signature)
                    .is_ok(),
            )
        }
        Material::Oct(secret) => {
            let algorithm = match alg {
                "HS256" => ring::hmac::HMAC_SHA256,
                "HS384" => ring::hmac::HMAC_SHA384,
                "HS512" => ring::hmac::HMAC_SHA512,
                _ => return None,
            };
            let key = ring::hmac::Key::new(algorithm, secret);
            Some(ring::hmac::verify(&key, message, signature).is_ok())
        }
        Material::Ed25519(public) => (alg == "EdDSA").then(|| {
            UnparsedPublicKey::new(&signature::ED25519, public)
                .verify(message, signature)
                .is_ok()
        }),
    }
}
