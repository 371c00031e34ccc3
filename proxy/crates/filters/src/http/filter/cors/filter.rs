//! The CORS filter on a stream: the policies of the route (weighted cluster, route,
//! virtual host, route configuration; most specific first), the preflight answered
//! here, the simple response's headers set on the way back; stats
//! `http.<stat_prefix>.cors.origin_valid|origin_invalid`.

use std::any::Any;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::http::cors::v3::CorsPolicy;
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::StatusCode;
use hyper::header::{HeaderName, HeaderValue};

use super::{Counted, FILTER_TYPE_NAME, OnRequest, POLICY_TYPE_NAME, Policies, Policy, compile};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders, ResponseHeaders,
    RouteSpecificConfig, Routed, StreamCtx,
};
use crate::http::route::Action;
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::stats::Counter;

pub const FACTORY: Factory = Factory {
    type_name: FILTER_TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[POLICY_TYPE_NAME],
    compile_per_route: Some(compile_route),
};

#[derive(Debug)]
struct RoutePolicy(Policy);

impl RouteSpecificConfig for RoutePolicy {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug)]
struct Config {
    origin_valid: Counter,
    origin_invalid: Counter,
}

fn compile_filter(
    _any: &PbAny,
    ctx: &CompileCtx<'_>,
    _path: &JsonPath,
    _problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let stat = |name: &str| {
        ctx.stats
            .counter(&format!("http.{}.cors.{name}", ctx.stat_prefix))
    };
    Some(Arc::new(Config {
        origin_valid: stat("origin_valid"),
        origin_invalid: stat("origin_invalid"),
    }))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let policy: CorsPolicy = decode(any, path, problems)?;
    Some(Arc::new(RoutePolicy(compile(&policy, path, problems)?)))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(Cors {
            origin_valid: self.origin_valid.clone(),
            origin_invalid: self.origin_invalid.clone(),
            allowed_origin: None,
        })
    }
}

struct Cors {
    origin_valid: Counter,
    origin_invalid: Counter,
    /// A forwarded cross-origin request's allowed origin: its response gets the
    /// headers.
    allowed_origin: Option<String>,
}

/// This filter's policies on the route, most specific first (Envoy reads each field
/// from the first policy that sets it).
fn policies<'r>(routed: &'r Routed, name: &str) -> Policies<'r> {
    let levels = [
        routed
            .weighted_cluster()
            .and_then(|w| w.per_filter_configs.get(name)),
        routed.route().per_filter_configs.get(name),
        routed.virtual_host().per_filter_configs.get(name),
        routed.config.per_filter_configs.get(name),
    ];
    Policies(
        levels
            .into_iter()
            .flatten()
            .filter_map(|c| c.config.as_ref()?.as_any().downcast_ref::<RoutePolicy>())
            .map(|p| &p.0)
            .collect(),
    )
}

impl HttpFilter for Cors {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        // Envoy's CORS acts only on routes that forward (not direct responses or
        // redirects).
        let Some(routed) = ctx.route.as_ref() else {
            return Flow::CONTINUE;
        };
        if !matches!(routed.route().action, Action::Route(_)) {
            return Flow::CONTINUE;
        }
        let policies = policies(routed, ctx.filter_name());
        let mut counted = Counted::default();
        let decided = policies.on_request(
            request.method.as_str(),
            &request.headers,
            fastrand::u64(..),
            &mut counted,
        );
        if counted.origin_valid {
            self.origin_valid.inc();
        }
        if counted.origin_invalid {
            self.origin_invalid.inc();
        }
        match decided {
            OnRequest::Ignore => Flow::CONTINUE,
            OnRequest::Forward { origin } => {
                self.allowed_origin = origin;
                Flow::CONTINUE
            }
            OnRequest::Preflight(headers) => {
                // Envoy's encoder adds the simple headers to the answer too.
                self.allowed_origin = headers
                    .iter()
                    .find(|(name, _)| *name == "access-control-allow-origin")
                    .map(|(_, origin)| origin.clone());
                let mut reply = LocalReply::new(StatusCode::OK, "", "cors_response");
                for (name, value) in headers {
                    if let Ok(value) = HeaderValue::from_str(&value) {
                        reply = reply.with_header(HeaderName::from_static(name), value);
                    }
                }
                FilterStatus::Reply(reply).into()
            }
        }
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let (Some(origin), Some(routed)) = (self.allowed_origin.take(), ctx.route.as_ref()) else {
            return FilterStatus::Continue;
        };
        for (name, value) in policies(routed, ctx.filter_name()).simple_response_headers(&origin) {
            if let Ok(value) = HeaderValue::from_str(&value) {
                response
                    .headers
                    .insert(HeaderName::from_static(name), value);
            }
        }
        FilterStatus::Continue
    }
}
