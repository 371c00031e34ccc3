//! Envoy's decompressor filter (`envoy.filters.http.decompressor`,
//! `envoy.extensions.filters.http.decompressor.v3.Decompressor`): request and response
//! bodies whose first `content-encoding` is the library's (gzip, br, zstd) are
//! decompressed, as Envoy does:
//! - a message with a body, no `cache-control: no-transform` (unless
//!   `ignore_no_transform_header`), and the encoding first in `content-encoding` loses
//!   that token (the header goes when it was the only one) and `content-length`;
//! - every request gets the encoding put last in `accept-encoding`
//!   (`advertise_accept_encoding`, on by default) when responses are decompressed;
//! - stats `decompressed`, `not_decompressed`, `total_compressed_bytes`,
//!   `total_uncompressed_bytes` under `http.<stat_prefix>.decompressor.<library
//!   name>.<gzip|brotli|zstd>.<request|response>.`.
//!
//! A response streams through the decompressor; a request body is read whole first (up
//! to the connection manager's buffer limit) and goes upstream with its length, where
//! Envoy streams it chunked.

use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::RuntimeFeatureFlag;
use envoy_types::pb::envoy::extensions::filters::http::decompressor::v3::{
    Decompressor, decompressor::CommonDirectionConfig,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::HeaderMap;
use hyper::StatusCode;
use hyper::header::{
    ACCEPT_ENCODING, CACHE_CONTROL, CONTENT_ENCODING, CONTENT_LENGTH, HeaderValue,
};

use crate::common::compression::{BodyTransform, DecompressorLibrary};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders, ResponseHeaders,
    StreamCtx,
};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::stats::Counter;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.decompressor.v3.Decompressor";

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[],
    compile_per_route: None,
};

/// One direction's settings and stats.
#[derive(Debug)]
struct Direction {
    enabled: bool,
    ignore_no_transform_header: bool,
    decompressed: Counter,
    not_decompressed: Counter,
    total_compressed_bytes: Counter,
    total_uncompressed_bytes: Counter,
}

impl Direction {
    fn new(common: Option<&CommonDirectionConfig>, prefix: &str, ctx: &CompileCtx<'_>) -> Self {
        let counter = |name: &str| ctx.stats.counter(&format!("{prefix}{name}"));
        Direction {
            enabled: common
                .and_then(|c| c.enabled.as_ref())
                .is_none_or(flag_default),
            ignore_no_transform_header: common.is_some_and(|c| c.ignore_no_transform_header),
            decompressed: counter("decompressed"),
            not_decompressed: counter("not_decompressed"),
            total_compressed_bytes: counter("total_compressed_bytes"),
            total_uncompressed_bytes: counter("total_uncompressed_bytes"),
        }
    }

    /// Whether a message with these headers is decompressed; counted either way.
    fn applies(&self, headers: &HeaderMap, encoding: &str) -> bool {
        let no_transform = !self.ignore_no_transform_header
            && headers.get_all(CACHE_CONTROL).iter().any(|v| {
                v.to_str().is_ok_and(|v| {
                    v.split(',')
                        .any(|t| t.trim().eq_ignore_ascii_case("no-transform"))
                })
            });
        let applies = self.enabled && !no_transform && first_encoding_is(headers, encoding);
        match applies {
            true => self.decompressed.inc(),
            false => self.not_decompressed.inc(),
        }
        applies
    }
}

fn flag_default(flag: &RuntimeFeatureFlag) -> bool {
    flag.default_value.is_none_or(|v| v.value)
}

/// Whether the first token of `content-encoding` is `encoding`.
fn first_encoding_is(headers: &HeaderMap, encoding: &str) -> bool {
    headers
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .is_some_and(|first| first.trim().eq_ignore_ascii_case(encoding))
}

/// Drops the first `content-encoding` token (the header, when it was the only one) and
/// `content-length`.
fn strip_encoding(headers: &mut HeaderMap) {
    headers.remove(CONTENT_LENGTH);
    let rest = headers
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(','))
        .map(|(_, rest)| rest.trim().to_owned());
    match rest.and_then(|r| HeaderValue::from_str(&r).ok()) {
        Some(rest) => {
            headers.insert(CONTENT_ENCODING, rest);
        }
        None => {
            headers.remove(CONTENT_ENCODING);
        }
    }
}

#[derive(Debug)]
struct Config(Arc<Settings>);

#[derive(Debug)]
struct Settings {
    library: DecompressorLibrary,
    request: Direction,
    response: Direction,
    advertise_accept_encoding: bool,
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: Decompressor = decode(any, path, problems)?;
    let library = DecompressorLibrary::compile(
        config.decompressor_library.as_ref(),
        &path.field("decompressor_library"),
        problems,
    )?;
    let prefix = format!(
        "http.{}.decompressor.{}.{}",
        ctx.stat_prefix,
        config
            .decompressor_library
            .as_ref()
            .map_or("", |l| l.name.as_str()),
        library.encoding.stats_prefix()
    );
    let request = config.request_direction_config.as_ref();
    let response = config.response_direction_config.as_ref();
    Some(Arc::new(Config(Arc::new(Settings {
        library,
        request: Direction::new(
            request.and_then(|r| r.common_config.as_ref()),
            &format!("{prefix}request."),
            ctx,
        ),
        response: Direction::new(
            response.and_then(|r| r.common_config.as_ref()),
            &format!("{prefix}response."),
            ctx,
        ),
        advertise_accept_encoding: request
            .and_then(|r| r.advertise_accept_encoding)
            .is_none_or(|b| b.value),
    }))))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(DecompressorFilter {
            config: self.0.clone(),
            decompress_request: false,
            decompress_response: false,
        })
    }
}

struct DecompressorFilter {
    config: Arc<Settings>,
    decompress_request: bool,
    decompress_response: bool,
}

impl HttpFilter for DecompressorFilter {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        end_stream: bool,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let config = &self.config;
        let encoding = config.library.encoding.token();
        if config.response.enabled && config.advertise_accept_encoding {
            advertise(&mut request.headers, encoding);
        }
        if !end_stream && config.request.applies(&request.headers, encoding) {
            strip_encoding(&mut request.headers);
            self.decompress_request = true;
            return FilterStatus::StopIteration.into();
        }
        Flow::CONTINUE
    }

    fn decode_data<'a>(
        &'a mut self,
        data: &'a mut Bytes,
        _end_stream: bool,
        _ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        if !self.decompress_request {
            return Flow::CONTINUE;
        }
        self.decompress_request = false;
        let mut decompressor = self.config.library.decompressor();
        match decompressor.transform(data, true) {
            Ok(plain) => {
                let request = &self.config.request;
                request.total_compressed_bytes.add(data.len() as u64);
                request.total_uncompressed_bytes.add(plain.len() as u64);
                *data = plain;
                Flow::CONTINUE
            }
            Err(err) => {
                tracing::debug!(%err, "decompressing a request body failed");
                FilterStatus::Reply(LocalReply::new(
                    StatusCode::BAD_REQUEST,
                    "Bad Request",
                    "request_decompression_failed",
                ))
                .into()
            }
        }
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let encoding = self.config.library.encoding.token();
        if !end_stream && self.config.response.applies(&response.headers, encoding) {
            strip_encoding(&mut response.headers);
            self.decompress_response = true;
        }
        FilterStatus::Continue
    }

    fn response_body_transform(&mut self) -> Option<Box<dyn BodyTransform>> {
        self.decompress_response.then(|| {
            Box::new(Counted {
                inner: self.config.library.decompressor(),
                config: self.config.clone(),
            }) as Box<dyn BodyTransform>
        })
    }
}

/// Puts `encoding` last in `accept-encoding`, as Envoy does: the other entries kept
/// (trimmed, joined by `,`), any for this encoding dropped.
fn advertise(headers: &mut HeaderMap, encoding: &str) {
    let existing = headers
        .get(ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mut tokens: Vec<&str> = existing
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .filter(|t| {
            let name = t.split(';').next().unwrap_or("").trim();
            !name.eq_ignore_ascii_case(encoding)
        })
        .collect();
    tokens.push(encoding);
    let value = tokens.join(",");
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(ACCEPT_ENCODING, value);
    }
}

/// A response decompressor that counts the bytes in and out.
#[derive(Debug)]
struct Counted {
    inner: Box<dyn BodyTransform>,
    config: Arc<Settings>,
}

impl BodyTransform for Counted {
    fn transform(&mut self, data: &[u8], end_stream: bool) -> std::io::Result<Bytes> {
        let out = self.inner.transform(data, end_stream)?;
        let response = &self.config.response;
        response.total_compressed_bytes.add(data.len() as u64);
        response.total_uncompressed_bytes.add(out.len() as u64);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    hyper::header::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn only_the_first_content_encoding_is_taken_off() {
        assert!(first_encoding_is(
            &headers(&[("content-encoding", "GZIP, br")]),
            "gzip"
        ));
        assert!(!first_encoding_is(
            &headers(&[("content-encoding", "br, gzip")]),
            "gzip"
        ));
        let mut h = headers(&[("content-encoding", "gzip, br"), ("content-length", "9")]);
        strip_encoding(&mut h);
        assert_eq!(h.get(CONTENT_ENCODING).unwrap(), "br");
        assert!(h.get(CONTENT_LENGTH).is_none());
        let mut h = headers(&[("content-encoding", "gzip")]);
        strip_encoding(&mut h);
        assert!(h.get(CONTENT_ENCODING).is_none());
    }

    #[test]
    fn accept_encoding_ends_with_the_encoding() {
        let mut h = headers(&[("accept-encoding", "deflate, GZIP;q=0.5, br")]);
        advertise(&mut h, "gzip");
        assert_eq!(h.get(ACCEPT_ENCODING).unwrap(), "deflate,br,gzip");
        let mut h = HeaderMap::new();
        advertise(&mut h, "gzip");
        assert_eq!(h.get(ACCEPT_ENCODING).unwrap(), "gzip");
    }
}
