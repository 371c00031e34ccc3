//! Envoy's `set_filter_state` HTTP filter
//! (`envoy.extensions.filters.http.set_filter_state.v3.Config`): its
//! `on_request_headers` values become the stream's filter state when the request's
//! head arrives (Istio's HBONE `connect_terminate` shares a CONNECT's authority
//! this way as the tunnel's original destination).

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::set_filter_state::v3::Config;
use envoy_types::pb::google::protobuf::Any;

use super::factory::{CompileCtx, Factory};
use super::{Flow, HttpFilter, HttpFilterConfig, RequestHeaders, StreamCtx};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::formatter::{self, Context};
use shunt_core::set_filter_state::{ValueSetter, compile as compile_values, store};
use shunt_core::stream_info::LifeSpan;

pub const TYPE_NAME: &str = "envoy.extensions.filters.http.set_filter_state.v3.Config";

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile,
    per_route_types: &[],
    compile_per_route: None,
};

#[derive(Debug)]
struct SetFilterState {
    values: Arc<[ValueSetter]>,
    clear_route_cache: bool,
}

fn compile(
    any: &Any,
    _ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: Config = decode(any, path, problems)?;
    let values = compile_values(
        &config.on_request_headers,
        &path.field("on_request_headers"),
        problems,
    )?;
    Some(Arc::new(SetFilterState {
        values: values.into(),
        clear_route_cache: config.clear_route_cache,
    }))
}

impl HttpFilterConfig for SetFilterState {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(Active {
            values: self.values.clone(),
            clear_route_cache: self.clear_route_cache,
        })
    }
}

struct Active {
    values: Arc<[ValueSetter]>,
    clear_route_cache: bool,
}

/// What `%REQ(...)%` and the connection's operators read of a stream.
pub fn format_context<'a>(request: &'a RequestHeaders, ctx: &'a StreamCtx) -> Context<'a> {
    Context {
        connection: &ctx.info.connection,
        stream_filter_state: Some(&ctx.info.filter_state),
        entry: None,
        request: Some(formatter::Request {
            method: request.method.as_str(),
            authority: &request.authority,
            path: &request.path,
            scheme: request.scheme,
            protocol: protocol(request.version),
            headers: &request.headers,
        }),
    }
}

fn protocol(version: hyper::Version) -> &'static str {
    match version {
        hyper::Version::HTTP_10 => "HTTP/1.0",
        hyper::Version::HTTP_2 => "HTTP/2",
        hyper::Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

impl HttpFilter for Active {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        for setter in self.values.iter() {
            if let Some(entry) = setter.render(&format_context(request, ctx), LifeSpan::FilterChain)
            {
                store(&mut ctx.info.filter_state, setter.key(), entry);
            }
        }
        if self.clear_route_cache {
            ctx.clear_route_cache();
        }
        Flow::CONTINUE
    }
}
