//! Tokens signed here (ECDSA P-256, HMAC, Ed25519 with ring) against the filter's
//! parsing, key choice and checks; RSA is covered against Envoy in tests/jwt_authn.rs.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use ring::rand::SystemRandom;
use ring::signature::{self, KeyPair};
use serde_json::{Value, json};

use super::jwks::Jwks;
use super::jwt::{Jwt, Status, audiences_allowed};

fn sign(header: Value, payload: Value, signer: impl Fn(&[u8]) -> Vec<u8>) -> String {
    let signed = format!(
        "{}.{}",
        B64.encode(header.to_string()),
        B64.encode(payload.to_string())
    );
    format!("{signed}.{}", B64.encode(signer(signed.as_bytes())))
}

fn es256() -> (signature::EcdsaKeyPair, Value) {
    let rng = SystemRandom::new();
    let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
    let pkcs8 = signature::EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
    let pair = signature::EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
    let point = pair.public_key().as_ref();
    let jwk = json!({"kty": "EC", "crv": "P-256", "kid": "ec1",
        "x": B64.encode(&point[1..33]), "y": B64.encode(&point[33..])});
    (pair, jwk)
}

#[test]
fn es256_hs256_eddsa_verify_and_tampering_fails() {
    let rng = SystemRandom::new();
    let (ec, ec_jwk) = es256();
    let secret = b"0123456789abcdef0123456789abcdef";
    let ed_pkcs8 = signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let ed = signature::Ed25519KeyPair::from_pkcs8(ed_pkcs8.as_ref()).unwrap();
    let jwks = Jwks::parse(
        json!({"keys": [
            ec_jwk,
            {"kty": "oct", "k": B64.encode(secret), "alg": "HS256"},
            {"kty": "OKP", "crv": "Ed25519", "x": B64.encode(ed.public_key().as_ref())},
            {"kty": "unknown"}
        ]})
        .to_string()
        .as_bytes(),
    )
    .unwrap();
    let payload = json!({"iss": "i", "sub": "s", "exp": 4_000_000_000u64});
    let es = sign(
        json!({"alg": "ES256", "kid": "ec1"}),
        payload.clone(),
        |m| ec.sign(&rng, m).unwrap().as_ref().to_vec(),
    );
    let hs = sign(json!({"alg": "HS256"}), payload.clone(), |m| {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        ring::hmac::sign(&key, m).as_ref().to_vec()
    });
    let eddsa = sign(json!({"alg": "EdDSA"}), payload.clone(), |m| {
        ed.sign(m).as_ref().to_vec()
    });
    for token in [&es, &hs, &eddsa] {
        assert_eq!(
            jwks.verify(&Jwt::parse(token).unwrap()),
            Status::Ok,
            "{token}"
        );
    }
    // Another payload under the same signature.
    let parts: Vec<&str> = es.split('.').collect();
    let forged = format!(
        "{}.{}.{}",
        parts[0],
        B64.encode(r#"{"iss":"i","sub":"root"}"#),
        parts[2]
    );
    assert_eq!(
        jwks.verify(&Jwt::parse(&forged).unwrap()),
        Status::JwtVerificationFail
    );
    // A kid no key has: no key fits.
    let other = sign(json!({"alg": "ES256", "kid": "nope"}), payload, |m| {
        ec.sign(&rng, m).unwrap().as_ref().to_vec()
    });
    assert_eq!(
        jwks.verify(&Jwt::parse(&other).unwrap()),
        Status::JwksKidAlgMismatch
    );
}

#[test]
fn malformed_tokens_fail_as_envoy_says() {
    let h = |v: Value| B64.encode(v.to_string());
    let cases = [
        ("a.b", Status::JwtBadFormat),
        ("!!.e30.e30", Status::JwtHeaderParseErrorBadBase64),
        (
            &format!("{}.e30.e30", B64.encode("nojson")),
            Status::JwtHeaderParseErrorBadJson,
        ),
        (
            &format!("{}.e30.e30", h(json!({}))),
            Status::JwtHeaderBadAlg,
        ),
        (
            &format!("{}.e30.e30", h(json!({"alg": "none"}))),
            Status::JwtHeaderNotImplementedAlg,
        ),
        (
            &format!(
                "{}.{}.e30",
                h(json!({"alg": "RS256"})),
                h(json!({"exp": "x"}))
            ),
            Status::JwtPayloadParseErrorExpNotInteger,
        ),
        (
            &format!(
                "{}.{}.e30",
                h(json!({"alg": "RS256"})),
                h(json!({"aud": 1}))
            ),
            Status::JwtPayloadParseErrorAudNotString,
        ),
        (
            &format!("{}.e30.!!", h(json!({"alg": "RS256"}))),
            Status::JwtSignatureParseErrorBadBase64,
        ),
    ];
    for (token, status) in cases {
        assert_eq!(Jwt::parse(token).unwrap_err(), status, "{token}");
    }
}

#[test]
fn time_and_audience_checks() {
    let token = |payload: Value| {
        Jwt::parse(&format!(
            "{}.{}.e30",
            B64.encode(r#"{"alg":"RS256"}"#),
            B64.encode(payload.to_string())
        ))
        .unwrap()
    };
    let now = 1_000_000;
    assert_eq!(
        token(json!({"exp": now - 61})).check_time(now, 60, false),
        Status::JwtExpired
    );
    assert_eq!(
        token(json!({"exp": now - 59})).check_time(now, 60, false),
        Status::Ok
    );
    assert_eq!(
        token(json!({"nbf": now + 61})).check_time(now, 60, false),
        Status::JwtNotYetValid
    );
    assert_eq!(
        token(json!({})).check_time(now, 60, true),
        Status::JwtMissingExpiration
    );
    let aud = token(json!({"aud": ["https://a.example/", "b"]})).audiences;
    assert!(audiences_allowed(&["a.example".into()], &aud));
    assert!(audiences_allowed(&[], &aud));
    assert!(!audiences_allowed(&["c".into()], &aud));
}
