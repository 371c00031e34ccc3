//! Envoy's compressor filter (`envoy.filters.http.compressor`,
//! `envoy.extensions.filters.http.compressor.v3.Compressor`): responses compressed with
//! gzip, brotli or zstd ([`crate::common::compression`]) when the client accepts it.
//!
//! Envoy's rules, as functions of the headers so they are tested without a stream:
//! - the encoding is chosen once per request among every compressor filter of the
//!   chain ([`choose_encoding`]): the `accept-encoding` entry with the highest q-value
//!   that a filter (whose content types allow the response's) provides, `identity`, or
//!   `*` (the first filter's); `q=0` rules an encoding out, even for `*`;
//! - a response is compressible ([`Compressible`]) when it has a body, its
//!   `content-length` is at least `min_content_length` (30) or it is chunked (HTTP/1.1
//!   from the upstream), its
//!   content type is in the list (Envoy's default list of text types), it has no
//!   `cache-control: no-transform`, no `content-encoding`, no ETag when
//!   `disable_on_etag_header`, and its status is not in `uncompressible_response_codes`;
//! - a compressible response gets `vary: accept-encoding` even when not compressed; a
//!   compressed one loses `content-length` and its strong ETag (or has it weakened with
//!   `weaken_etag_on_compress`) and gets `content-encoding`.
//!
//! Request compression (`request_direction_config`) is not implemented: a config that
//! enables it is refused by name.

use std::collections::HashSet;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::compressor::v3::Compressor;
use hyper::header::{
    CACHE_CONTROL, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, ETAG, TRANSFER_ENCODING,
};
use hyper::{HeaderMap, Version};

use crate::common::compression::CompressorLibrary;
use shunt_config::{Diagnostics, JsonPath};

pub mod filter;
#[cfg(test)]
mod tests;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.compressor.v3.Compressor";
pub const PER_ROUTE_TYPE_NAME: &str =
    "envoy.extensions.filters.http.compressor.v3.CompressorPerRoute";

/// Envoy's default `min_content_length`.
const DEFAULT_MIN_CONTENT_LENGTH: u64 = 30;

/// Envoy's default content types, when the config lists none.
const DEFAULT_CONTENT_TYPES: [&str; 18] = [
    "text/html",
    "text/plain",
    "text/css",
    "application/javascript",
    "application/x-javascript",
    "text/javascript",
    "text/x-javascript",
    "text/ecmascript",
    "text/js",
    "text/jscript",
    "text/x-js",
    "application/ecmascript",
    "application/x-json",
    "application/xml",
    "application/json",
    "image/svg+xml",
    "text/xml",
    "application/xhtml+xml",
];

/// A compressor filter as configured.
#[derive(Debug)]
pub struct CompressorConfig {
    pub library: CompressorLibrary,
    /// The library's `name`, part of the stat names.
    pub library_name: String,
    pub response: ResponseDirection,
}

/// What decides whether a response is compressed.
#[derive(Debug)]
pub struct ResponseDirection {
    pub enabled: bool,
    pub min_content_length: u64,
    /// Lowercase media types (no parameters).
    pub content_types: Arc<HashSet<String>>,
    pub disable_on_etag_header: bool,
    pub weaken_etag_on_compress: bool,
    pub remove_accept_encoding_header: bool,
    pub uncompressible_response_codes: Vec<u16>,
}

/// Compiles a `Compressor` at `path`.
pub fn compile(
    config: &Compressor,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<CompressorConfig> {
    let library = CompressorLibrary::compile(
        config.compressor_library.as_ref(),
        &path.field("compressor_library"),
        problems,
    )?;
    if let Some(request) = &config.request_direction_config {
        let enabled = request
            .common_config
            .as_ref()
            .and_then(|c| c.enabled.as_ref())
            .is_none_or(flag_default);
        if enabled {
            problems.error(
                path.field("request_direction_config"),
                "request compression is not supported by shunt (response compression is)",
            );
            return None;
        }
    }
    let response = compile_response(config, path, problems)?;
    Some(CompressorConfig {
        library,
        library_name: config
            .compressor_library
            .as_ref()
            .map(|l| l.name.clone())
            .unwrap_or_default(),
        response,
    })
}

fn flag_default(flag: &envoy_types::pb::envoy::config::core::v3::RuntimeFeatureFlag) -> bool {
    flag.default_value.is_none_or(|v| v.value)
}

/// The response direction: `response_direction_config` when set, else the deprecated
/// fields at the top of the config.
fn compile_response(
    config: &Compressor,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ResponseDirection> {
    #[allow(deprecated)]
    let mut response = ResponseDirection {
        enabled: config.runtime_enabled.as_ref().is_none_or(flag_default),
        min_content_length: config
            .content_length
            .map_or(DEFAULT_MIN_CONTENT_LENGTH, |l| u64::from(l.value)),
        content_types: content_types(&config.content_type),
        disable_on_etag_header: config.disable_on_etag_header,
        weaken_etag_on_compress: false,
        remove_accept_encoding_header: config.remove_accept_encoding_header,
        uncompressible_response_codes: Vec::new(),
    };
    let Some(direction) = &config.response_direction_config else {
        return Some(response);
    };
    let path = path.field("response_direction_config");
    if direction.status_header_enabled {
        problems.error(
            path.field("status_header_enabled"),
            "the compression status header is not supported by shunt",
        );
        return None;
    }
    if let Some(common) = &direction.common_config {
        if !common.content_type_matcher.is_empty() {
            problems.error(
                path.field("common_config").field("content_type_matcher"),
                "content_type_matcher is not supported by shunt (content_type is)",
            );
            return None;
        }
        response.enabled = common.enabled.as_ref().is_none_or(flag_default);
        response.min_content_length = common
            .min_content_length
            .map_or(DEFAULT_MIN_CONTENT_LENGTH, |l| u64::from(l.value));
        #[allow(deprecated)]
        let configured = &common.content_type;
        response.content_types = content_types(configured);
    }
    response.disable_on_etag_header = direction.disable_on_etag_header;
    response.weaken_etag_on_compress = direction.weaken_etag_on_compress;
    response.remove_accept_encoding_header = direction.remove_accept_encoding_header;
    response.uncompressible_response_codes = direction
        .uncompressible_response_codes
        .iter()
        .map(|&c| c.min(u32::from(u16::MAX)) as u16)
        .collect();
    Some(response)
}

fn content_types(configured: &[String]) -> Arc<HashSet<String>> {
    let types: HashSet<String> = if configured.is_empty() {
        DEFAULT_CONTENT_TYPES
            .iter()
            .map(|t| t.to_string())
            .collect()
    } else {
        configured.iter().map(|t| t.to_ascii_lowercase()).collect()
    };
    Arc::new(types)
}

/// The media type of a `content-type` value: before any `;`, trimmed, lowercase.
fn media_type(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(CONTENT_TYPE)?.to_str().ok()?;
    let media = value.split(';').next().unwrap_or("").trim();
    Some(media.to_ascii_lowercase())
}

/// Whether `token` is one of the comma-separated values of `name` (case-insensitive).
fn has_token(headers: &HeaderMap, name: hyper::header::HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.to_str()
            .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    })
}

/// What a compressor filter makes of a response's head (before the encoding choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compressible {
    /// Enabled, and long enough (or chunked).
    pub long_enough: bool,
    /// Its `content-length` is under the minimum (counted `content_length_too_small`).
    pub too_small: bool,
    /// Everything else allows it too: the response gets `vary: accept-encoding`.
    pub allowed: bool,
    /// Refused for its ETag (counted `not_compressed_etag`).
    pub etag_refused: bool,
}

impl ResponseDirection {
    /// Envoy's checks, in its order (a check not reached counts nothing).
    pub fn compressible(&self, status: u16, version: Version, headers: &HeaderMap) -> Compressible {
        let length = self
            .enabled
            .then(|| minimum_length(headers, version, self.min_content_length));
        let long_enough = length.is_some_and(|l| l.is_ok());
        let too_small = length.is_some_and(|l| l == Err(Some(TooSmall)));
        let type_allowed = media_type(headers).is_none_or(|t| self.content_types.contains(&t));
        let etag_checked =
            long_enough && type_allowed && !has_token(headers, CACHE_CONTROL, "no-transform");
        let etag_refused =
            etag_checked && self.disable_on_etag_header && headers.contains_key(ETAG);
        let allowed = etag_checked
            && !etag_refused
            && !headers.contains_key(CONTENT_ENCODING)
            && !self.uncompressible_response_codes.contains(&status);
        Compressible {
            long_enough,
            too_small,
            allowed,
            etag_refused,
        }
    }
}

/// A `content-length` under the minimum (or not a number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TooSmall;

/// `content-length` at least `min`; without one, only a chunked response passes (and is
/// not counted as too small when it does not). An HTTP/1.1 response with a body and no
/// length is chunked: shunt's codec keeps `transfer-encoding` out of the head.
fn minimum_length(headers: &HeaderMap, version: Version, min: u64) -> Result<(), Option<TooSmall>> {
    match headers.get(CONTENT_LENGTH) {
        Some(length) => length
            .to_str()
            .ok()
            .and_then(|l| l.trim().parse::<u64>().ok())
            .filter(|&l| l >= min)
            .map(|_| ())
            .ok_or(Some(TooSmall)),
        None if version == Version::HTTP_11 || has_token(headers, TRANSFER_ENCODING, "chunked") => {
            Ok(())
        }
        None => Err(None),
    }
}

/// `transfer-encoding` already compresses (with this encoding, gzip or deflate).
pub fn transfer_encoding_compresses(headers: &HeaderMap, encoding: &str) -> bool {
    [encoding, "gzip", "deflate"]
        .iter()
        .any(|t| has_token(headers, TRANSFER_ENCODING, t))
}

/// The encoding decision for one request, shared by the chain's compressor filters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// The chosen `content-encoding` token, or `identity`.
    pub encoding: String,
    pub stat: HeaderStat,
}

/// Which `header_*` counter a decision bumps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStat {
    /// An encoding a filter provides was chosen.
    ValidCompressor,
    Identity,
    Wildcard,
    NotValid,
}

/// A compressor filter as the encoding choice sees it.
#[derive(Debug, Clone)]
pub struct Registered {
    pub encoding: &'static str,
    pub content_types: Arc<HashSet<String>>,
}

/// Envoy's `chooseEncoding`: the request's `accept_encoding` against the compressor
/// filters `registered` in the chain (in chain order), for a response of
/// `content_type`.
pub fn choose_encoding(
    accept_encoding: &str,
    registered: &[Registered],
    content_type: Option<&str>,
) -> Decision {
    let not_valid = || Decision {
        encoding: "identity".into(),
        stat: HeaderStat::NotValid,
    };
    // The filters whose content types allow the response's, first registration first.
    let mut allowed: Vec<&'static str> = Vec::new();
    for filter in registered {
        let excluded = content_type
            .filter(|t| !t.is_empty())
            .is_some_and(|t| !filter.content_types.contains(t));
        if !excluded && !allowed.contains(&filter.encoding) {
            allowed.push(filter.encoding);
        }
    }
    let mut pairs: Vec<(&str, f32)> = Vec::new();
    for token in accept_encoding.split(',').filter(|t| !t.trim().is_empty()) {
        let (name, params) = token.split_once(';').unwrap_or((token, ""));
        let mut q = 1.0f32;
        if let Some((key, value)) = params.split_once('=')
            && key.trim().eq_ignore_ascii_case("q")
        {
            match value.trim().parse::<f32>() {
                Ok(value) => q = value,
                Err(_) => continue,
            }
        }
        let name = name.trim();
        pairs.push((name, q));
        if q == 0.0 {
            allowed.retain(|e| *e != name);
        }
    }
    if pairs.is_empty() || allowed.is_empty() {
        return not_valid();
    }
    let mut choice = ("identity", 0.0f32);
    for &(name, q) in &pairs {
        if q > choice.1 && (allowed.contains(&name) || name == "identity" || name == "*") {
            choice = (name, q);
        }
    }
    if choice.1 == 0.0 {
        // Nothing acceptable with a positive q-value.
        return not_valid();
    }
    match choice {
        ("identity", _) => Decision {
            encoding: "identity".into(),
            stat: HeaderStat::Identity,
        },
        ("*", _) => Decision {
            encoding: allowed[0].into(),
            stat: HeaderStat::Wildcard,
        },
        (name, _) => Decision {
            encoding: name.into(),
            stat: HeaderStat::ValidCompressor,
        },
    }
}
