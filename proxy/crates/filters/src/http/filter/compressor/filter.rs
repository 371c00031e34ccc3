//! The compressor filter on a stream: the request's `accept-encoding` kept (and
//! removed upstream with `remove_accept_encoding_header`), the filter registered in the
//! stream's filter state so the chain's compressors choose one encoding together, the
//! response's head judged and changed, and its body compressed as it streams. Stats as
//! Envoy's under `http.<stat_prefix>.compressor.<library name>.<gzip|brotli|zstd>.`
//! (the direction's under `request.` and `response.`).

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::compressor::v3::{
    Compressor, CompressorPerRoute, compressor_per_route::Override,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::header::{ACCEPT_ENCODING, CONTENT_ENCODING, CONTENT_LENGTH, ETAG, HeaderValue, VARY};

use super::{
    CompressorConfig, Decision, HeaderStat, PER_ROUTE_TYPE_NAME, Registered, TYPE_NAME,
    choose_encoding, compile, media_type, transfer_encoding_compresses,
};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    BodyTransform, FilterStatus, Flow, HttpFilter, HttpFilterConfig, RequestHeaders,
    ResponseHeaders, RouteSpecificConfig, StreamCtx,
};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::stats::Counter;
use shunt_core::stream_info::{FilterStateObject, LifeSpan};

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[PER_ROUTE_TYPE_NAME],
    compile_per_route: Some(compile_route),
};

/// The filter state names Envoy's compressors share a stream's decision under.
const REGISTRY_KEY: &str = "compressors";
const DECISION_KEY: &str = "encoding_decision";

#[derive(Debug)]
struct Stats {
    compressed: Counter,
    not_compressed: Counter,
    content_length_too_small: Counter,
    total_uncompressed_bytes: Counter,
    total_compressed_bytes: Counter,
    /// Every request: shunt does not compress requests.
    request_not_compressed: Counter,
    not_compressed_etag: Counter,
    no_accept_header: Counter,
    header_identity: Counter,
    header_compressor_used: Counter,
    header_compressor_overshadowed: Counter,
    header_wildcard: Counter,
    header_not_valid: Counter,
}

impl Stats {
    fn new(ctx: &CompileCtx<'_>, config: &CompressorConfig) -> Stats {
        let prefix = format!(
            "http.{}.compressor.{}.{}",
            ctx.stat_prefix,
            config.library_name,
            config.library.encoding.stats_prefix()
        );
        let counter = |name: &str| ctx.stats.counter(&format!("{prefix}{name}"));
        let response = |name: &str| counter(&format!("response.{name}"));
        Stats {
            compressed: response("compressed"),
            not_compressed: response("not_compressed"),
            content_length_too_small: response("content_length_too_small"),
            total_uncompressed_bytes: response("total_uncompressed_bytes"),
            total_compressed_bytes: response("total_compressed_bytes"),
            request_not_compressed: counter("request.not_compressed"),
            not_compressed_etag: counter("not_compressed_etag"),
            no_accept_header: counter("no_accept_header"),
            header_identity: counter("header_identity"),
            header_compressor_used: counter("header_compressor_used"),
            header_compressor_overshadowed: counter("header_compressor_overshadowed"),
            header_wildcard: counter("header_wildcard"),
            header_not_valid: counter("header_not_valid"),
        }
    }
}

#[derive(Debug)]
struct Config {
    compressor: Arc<CompressorConfig>,
    stats: Arc<Stats>,
}

/// `CompressorPerRoute`: off for the route, or `remove_accept_encoding_header`
/// overridden.
#[derive(Debug)]
enum RouteCompressor {
    Disabled,
    RemoveAcceptEncoding(Option<bool>),
}

impl RouteSpecificConfig for RouteCompressor {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: Compressor = decode(any, path, problems)?;
    let compressor = compile(&config, path, problems)?;
    let stats = Arc::new(Stats::new(ctx, &compressor));
    Some(Arc::new(Config {
        compressor: Arc::new(compressor),
        stats,
    }))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let config: CompressorPerRoute = decode(any, path, problems)?;
    let route = match config.r#override {
        Some(Override::Disabled(true)) => RouteCompressor::Disabled,
        Some(Override::Overrides(overrides)) => {
            if overrides.compressor_library.is_some() {
                problems.error(
                    path.field("overrides").field("compressor_library"),
                    "a per-route compressor library is not supported by shunt",
                );
                return None;
            }
            RouteCompressor::RemoveAcceptEncoding(
                overrides
                    .response_direction_config
                    .and_then(|r| r.remove_accept_encoding_header)
                    .map(|b| b.value),
            )
        }
        _ => RouteCompressor::RemoveAcceptEncoding(None),
    };
    Some(Arc::new(route))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(CompressorFilter {
            config: self.compressor.clone(),
            stats: self.stats.clone(),
            accept_encoding: None,
            compressing: false,
        })
    }
}

/// The compressor filters of a stream, in chain order (Envoy's `CompressorRegistry`).
#[derive(Debug, Default)]
struct Registry(Vec<Registered>);

impl FilterStateObject for Registry {
    fn serialize_as_string(&self) -> Option<String> {
        None
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl FilterStateObject for Decision {
    fn serialize_as_string(&self) -> Option<String> {
        None
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

struct CompressorFilter {
    config: Arc<CompressorConfig>,
    stats: Arc<Stats>,
    /// The request's `accept-encoding`, if it had one.
    accept_encoding: Option<String>,
    /// This filter compresses the response body.
    compressing: bool,
}

impl CompressorFilter {
    /// Adds this filter to the stream's registry of compressors.
    fn register(&self, ctx: &mut StreamCtx) {
        let state = &mut ctx.info.filter_state;
        let mut registered = state
            .get_as::<Registry>(REGISTRY_KEY)
            .map(|r| r.0.clone())
            .unwrap_or_default();
        registered.push(Registered {
            encoding: self.config.library.encoding.token(),
            content_types: self.config.response.content_types.clone(),
        });
        let _ = state.set(
            REGISTRY_KEY,
            Arc::new(Registry(registered)),
            false,
            LifeSpan::Request,
        );
    }

    /// Envoy's `isAcceptEncodingAllowed`: the stream's decision (made by the first
    /// compressor to ask), and whether it names this filter's encoding.
    fn accepted(&self, response: &ResponseHeaders, ctx: &mut StreamCtx) -> bool {
        let Some(accept_encoding) = &self.accept_encoding else {
            self.stats.no_accept_header.inc();
            return false;
        };
        let state = &mut ctx.info.filter_state;
        let decision = match state.get_as::<Decision>(DECISION_KEY) {
            Some(decision) => decision.clone(),
            None => {
                let registered = state
                    .get_as::<Registry>(REGISTRY_KEY)
                    .map(|r| r.0.as_slice())
                    .unwrap_or_default();
                let content_type = media_type(&response.headers);
                let decision =
                    choose_encoding(accept_encoding, registered, content_type.as_deref());
                let _ = state.set(
                    DECISION_KEY,
                    Arc::new(decision.clone()),
                    true,
                    LifeSpan::Request,
                );
                decision
            }
        };
        let encoding = self.config.library.encoding.token();
        let chosen = decision.encoding.eq_ignore_ascii_case(encoding);
        let stats = &self.stats;
        match decision.stat {
            HeaderStat::ValidCompressor if chosen => stats.header_compressor_used.inc(),
            HeaderStat::ValidCompressor => stats.header_compressor_overshadowed.inc(),
            HeaderStat::Identity => stats.header_identity.inc(),
            HeaderStat::Wildcard => stats.header_wildcard.inc(),
            HeaderStat::NotValid => stats.header_not_valid.inc(),
        }
        chosen
    }

    /// The head of a response this filter compresses.
    fn prepare(&self, response: &mut ResponseHeaders) {
        let headers = &mut response.headers;
        if let Some(etag) = headers.get(ETAG).cloned() {
            let bytes = etag.as_bytes();
            let weak = bytes.len() > 2 && bytes[0].eq_ignore_ascii_case(&b'w') && bytes[1] == b'/';
            if bytes.len() > 2 && !weak {
                match self.config.response.weaken_etag_on_compress {
                    true => {
                        let mut value = b"W/".to_vec();
                        value.extend_from_slice(bytes);
                        if let Ok(value) = HeaderValue::from_bytes(&value) {
                            headers.insert(ETAG, value);
                        }
                    }
                    false => {
                        headers.remove(ETAG);
                    }
                }
            }
        }
        headers.remove(CONTENT_LENGTH);
        headers.insert(
            CONTENT_ENCODING,
            HeaderValue::from_static(self.config.library.encoding.token()),
        );
    }
}

/// Adds `accept-encoding` to `vary` unless it is there (Envoy's `insertVaryHeader`).
fn insert_vary(response: &mut ResponseHeaders) {
    let headers = &mut response.headers;
    let Some(vary) = headers.get(VARY) else {
        headers.insert(VARY, HeaderValue::from_static("Accept-Encoding"));
        return;
    };
    let value = vary.to_str().unwrap_or("");
    if value
        .split(',')
        .any(|t| t.trim().eq_ignore_ascii_case("accept-encoding"))
    {
        return;
    }
    if let Ok(joined) = HeaderValue::from_str(&format!("{value}, Accept-Encoding")) {
        headers.insert(VARY, joined);
    }
}

impl HttpFilter for CompressorFilter {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        self.stats.request_not_compressed.inc();
        let route = ctx.route_config::<RouteCompressor>();
        if matches!(route, Some(RouteCompressor::Disabled)) {
            return Flow::CONTINUE;
        }
        let remove = match route {
            Some(RouteCompressor::RemoveAcceptEncoding(Some(remove))) => *remove,
            _ => self.config.response.remove_accept_encoding_header,
        };
        self.accept_encoding = request
            .headers
            .get(ACCEPT_ENCODING)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        if remove && self.config.response.enabled {
            request.headers.remove(ACCEPT_ENCODING);
        }
        self.register(ctx);
        Flow::CONTINUE
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        end_stream: bool,
        ctx: &mut StreamCtx,
    ) -> FilterStatus {
        if matches!(
            ctx.route_config::<RouteCompressor>(),
            Some(RouteCompressor::Disabled)
        ) {
            return FilterStatus::Continue;
        }
        let judged = self.config.response.compressible(
            response.status.as_u16(),
            response.version,
            &response.headers,
        );
        if judged.too_small {
            self.stats.content_length_too_small.inc();
        }
        if judged.etag_refused {
            self.stats.not_compressed_etag.inc();
        }
        let encoding = self.config.library.encoding.token();
        if !end_stream
            && judged.long_enough
            && self.accepted(response, ctx)
            && judged.allowed
            && !transfer_encoding_compresses(&response.headers, encoding)
        {
            self.prepare(response);
            self.stats.compressed.inc();
            self.compressing = true;
        } else {
            self.stats.not_compressed.inc();
        }
        if judged.allowed {
            insert_vary(response);
        }
        FilterStatus::Continue
    }

    fn response_body_transform(&mut self) -> Option<Box<dyn BodyTransform>> {
        self.compressing.then(|| {
            Box::new(Counted {
                inner: self.config.library.compressor(),
                stats: self.stats.clone(),
            }) as Box<dyn BodyTransform>
        })
    }
}

/// A compressor that counts the bytes in and out.
#[derive(Debug)]
struct Counted {
    inner: Box<dyn BodyTransform>,
    stats: Arc<Stats>,
}

impl BodyTransform for Counted {
    fn transform(&mut self, data: &[u8], end_stream: bool) -> std::io::Result<bytes::Bytes> {
        let out = self.inner.transform(data, end_stream)?;
        let stats = &self.stats;
        stats.total_uncompressed_bytes.add(data.len() as u64);
        stats.total_compressed_bytes.add(out.len() as u64);
        Ok(out)
    }
}
