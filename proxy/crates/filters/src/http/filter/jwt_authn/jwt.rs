//! A JSON Web Token as Envoy's jwt_verify_lib reads it: three base64url sections, the
//! header's `alg`/`kid`, the payload's registered claims, and the [`Status`] of every
//! way a token can fail, with the texts Envoy answers with.

use base64::Engine;
use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use serde_json::{Map, Value};

/// jwt_verify_lib's `Status`, with its `getStatusString` text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    JwtMissed,
    JwtNotYetValid,
    JwtExpired,
    JwtBadFormat,
    JwtHeaderParseErrorBadBase64,
    JwtHeaderParseErrorBadJson,
    JwtHeaderBadAlg,
    JwtHeaderNotImplementedAlg,
    JwtHeaderBadKid,
    JwtPayloadParseErrorBadBase64,
    JwtPayloadParseErrorBadJson,
    JwtPayloadParseErrorIssNotString,
    JwtPayloadParseErrorSubNotString,
    JwtPayloadParseErrorIatNotInteger,
    JwtPayloadParseErrorNbfNotInteger,
    JwtPayloadParseErrorExpNotInteger,
    JwtPayloadParseErrorJtiNotString,
    JwtPayloadParseErrorAudNotString,
    JwtSignatureParseErrorBadBase64,
    JwtUnknownIssuer,
    JwtAudienceNotAllowed,
    JwtVerificationFail,
    JwtMissingExpiration,
    JwksFetchFail,
    JwksKidAlgMismatch,
    JwksNoValidKeys,
}

impl Status {
    pub fn text(self) -> &'static str {
        use Status::*;
        match self {
            Ok => "OK",
            JwtMissed => "Jwt is missing",
            JwtNotYetValid => "Jwt not yet valid",
            JwtExpired => "Jwt is expired",
            JwtBadFormat => {
                "Jwt is not in the form of Header.Payload.Signature with two dots and 3 sections"
            }
            JwtHeaderParseErrorBadBase64 => "Jwt header is an invalid Base64url encoded",
            JwtHeaderParseErrorBadJson => "Jwt header is an invalid JSON",
            JwtHeaderBadAlg => "Jwt header [alg] field is required and must be a string",
            JwtHeaderNotImplementedAlg => "Jwt header [alg] is not supported",
            JwtHeaderBadKid => "Jwt header [kid] field is not a string",
            JwtPayloadParseErrorBadBase64 => "Jwt payload is an invalid Base64url encoded",
            JwtPayloadParseErrorBadJson => "Jwt payload is an invalid JSON",
            JwtPayloadParseErrorIssNotString => "Jwt payload [iss] field is not a string",
            JwtPayloadParseErrorSubNotString => "Jwt payload [sub] field is not a string",
            JwtPayloadParseErrorIatNotInteger => "Jwt payload [iat] field is not an integer",
            JwtPayloadParseErrorNbfNotInteger => "Jwt payload [nbf] field is not an integer",
            JwtPayloadParseErrorExpNotInteger => "Jwt payload [exp] field is not an integer",
            JwtPayloadParseErrorJtiNotString => "Jwt payload [jti] field is not a string",
            JwtPayloadParseErrorAudNotString => {
                "Jwt payload [aud] field is not a string or string list"
            }
            JwtSignatureParseErrorBadBase64 => "Jwt signature is an invalid Base64url encoded",
            JwtUnknownIssuer => "Jwt issuer is not configured",
            JwtAudienceNotAllowed => "Audiences in Jwt are not allowed",
            JwtVerificationFail => "Jwt verification fails",
            JwtMissingExpiration => "Jwt is missing required exp claim",
            JwksFetchFail => "Jwks remote fetch is failed",
            JwksKidAlgMismatch => "Jwks doesn't have key to match kid or alg from Jwt",
            JwksNoValidKeys => "Jwks doesn't have any valid public key",
        }
    }
}

/// The algorithms Envoy verifies.
pub const ALGORITHMS: &[&str] = &[
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "HS256",
    "HS384", "HS512", "EdDSA",
];

/// A parsed token (not yet verified).
#[derive(Debug, Clone)]
pub struct Jwt {
    pub alg: String,
    pub kid: String,
    pub iss: String,
    pub sub: String,
    pub audiences: Vec<String>,
    pub exp: u64,
    pub nbf: u64,
    /// The payload section as it came (base64url), for `forward_payload_header`.
    pub payload_base64url: String,
    pub payload: Map<String, Value>,
    pub header: Map<String, Value>,
    /// `header.payload`: what the signature covers.
    pub signed: String,
    pub signature: Vec<u8>,
}

/// Base64url with or without padding, as jwt_verify_lib accepts.
pub fn decode_base64url(text: &str) -> Option<Vec<u8>> {
    if text.ends_with('=') {
        URL_SAFE.decode(text).ok()
    } else {
        URL_SAFE_NO_PAD.decode(text).ok()
    }
}

fn section(text: &str, bad_base64: Status, bad_json: Status) -> Result<Map<String, Value>, Status> {
    let bytes = decode_base64url(text).ok_or(bad_base64)?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(bad_json),
    }
}

fn string_claim(payload: &Map<String, Value>, name: &str, bad: Status) -> Result<String, Status> {
    match payload.get(name) {
        None => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(bad),
    }
}

fn time_claim(payload: &Map<String, Value>, name: &str, bad: Status) -> Result<u64, Status> {
    match payload.get(name) {
        None => Ok(0),
        Some(Value::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
            .ok_or(bad),
        Some(_) => Err(bad),
    }
}

fn audiences(payload: &Map<String, Value>) -> Result<Vec<String>, Status> {
    let bad = Status::JwtPayloadParseErrorAudNotString;
    match payload.get("aud") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned).ok_or(bad))
            .collect(),
        Some(_) => Err(bad),
    }
}

impl Jwt {
    /// jwt_verify_lib's `Jwt::parseFromString`, with the same failures in the same
    /// order.
    pub fn parse(token: &str) -> Result<Jwt, Status> {
        let parts: Vec<&str> = token.split('.').collect();
        let [header_text, payload_text, signature_text] = parts[..] else {
            return Err(Status::JwtBadFormat);
        };
        let header = section(
            header_text,
            Status::JwtHeaderParseErrorBadBase64,
            Status::JwtHeaderParseErrorBadJson,
        )?;
        let alg = match header.get("alg") {
            Some(Value::String(alg)) => alg.clone(),
            _ => return Err(Status::JwtHeaderBadAlg),
        };
        if !ALGORITHMS.contains(&alg.as_str()) {
            return Err(Status::JwtHeaderNotImplementedAlg);
        }
        let kid = string_claim(&header, "kid", Status::JwtHeaderBadKid)?;
        let payload = section(
            payload_text,
            Status::JwtPayloadParseErrorBadBase64,
            Status::JwtPayloadParseErrorBadJson,
        )?;
        let iss = string_claim(&payload, "iss", Status::JwtPayloadParseErrorIssNotString)?;
        let sub = string_claim(&payload, "sub", Status::JwtPayloadParseErrorSubNotString)?;
        time_claim(&payload, "iat", Status::JwtPayloadParseErrorIatNotInteger)?;
        let nbf = time_claim(&payload, "nbf", Status::JwtPayloadParseErrorNbfNotInteger)?;
        let exp = time_claim(&payload, "exp", Status::JwtPayloadParseErrorExpNotInteger)?;
        string_claim(&payload, "jti", Status::JwtPayloadParseErrorJtiNotString)?;
        let audiences = audiences(&payload)?;
        let signature =
            decode_base64url(signature_text).ok_or(Status::JwtSignatureParseErrorBadBase64)?;
        Ok(Jwt {
            alg,
            kid,
            iss,
            sub,
            audiences,
            exp,
            nbf,
            payload_base64url: payload_text.to_owned(),
            payload,
            header,
            signed: format!("{header_text}.{payload_text}"),
            signature,
        })
    }

    /// `verifyTimeConstraint`: `nbf` and `exp` with the provider's clock skew.
    pub fn check_time(&self, now: u64, skew: u64, require_exp: bool) -> Status {
        if self.nbf != 0 && now + skew < self.nbf {
            return Status::JwtNotYetValid;
        }
        if self.exp == 0 {
            return if require_exp {
                Status::JwtMissingExpiration
            } else {
                Status::Ok
            };
        }
        if now > self.exp + skew {
            return Status::JwtExpired;
        }
        Status::Ok
    }
}

/// Envoy compares audiences without scheme and trailing slash.
fn normalized(audience: &str) -> &str {
    let a = audience
        .strip_prefix("http://")
        .or_else(|| audience.strip_prefix("https://"))
        .unwrap_or(audience);
    a.strip_suffix('/').unwrap_or(a)
}

/// Whether one of the token's audiences is allowed (no allowed list: any).
pub fn audiences_allowed(allowed: &[String], audiences: &[String]) -> bool {
    allowed.is_empty()
        || audiences
            .iter()
            .any(|a| allowed.iter().any(|b| normalized(a) == normalized(b)))
}
