//! The ext_authz filter on a stream: skip (route disabled, `filter_enabled`,
//! `filter_enabled_metadata`), buffer the body when asked, check, then allow (headers
//! changed upstream, some added downstream), deny (the service's answer) or fail
//! (`status_on_error`, or through with `failure_mode_allow`). Stats as Envoy's:
//! `http.<stat_prefix>.ext_authz.*` and `cluster.<route's cluster>.ext_authz.*`.

use std::any::Any;
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::http::ext_authz::v3::{
    ExtAuthz, ExtAuthzPerRoute,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{StatusCode, Version};

use super::{
    BodySettings, ExtAuthzConfig, FAILURE_MODE_ALLOWED_HEADER, PARTIAL_BODY_HEADER,
    PER_ROUTE_TYPE_NAME, PerRoute, TYPE_NAME, compile, compile_per_route,
};
use crate::common::ext_authz::check::{self, CheckInput, HeaderChange, Verdict};
use crate::common::ext_authz::{Service, grpc};
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders, ResponseHeaders,
    RouteSpecificConfig, StreamCtx,
};
use crate::http::route::{Action, ClusterChoice};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::access_log::ResponseFlag;
use shunt_core::stats::{Counter, Store};
use shunt_upstream::Cluster;

pub const FACTORY: Factory = Factory {
    type_name: TYPE_NAME,
    compile: compile_filter,
    per_route_types: &[PER_ROUTE_TYPE_NAME],
    compile_per_route: Some(compile_route),
};

#[derive(Debug)]
struct RouteSettings(PerRoute);

impl RouteSpecificConfig for RouteSettings {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug)]
struct Stats {
    store: Store,
    ok: Counter,
    denied: Counter,
    error: Counter,
    failure_mode_allowed: Counter,
    disabled: Counter,
}

#[derive(Debug)]
struct Config {
    authz: Arc<ExtAuthzConfig>,
    /// The service's cluster as compiled with the listener; `None`: it did not exist
    /// then, and every check fails.
    cluster: Option<Arc<Cluster>>,
    stats: Arc<Stats>,
}

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let config: ExtAuthz = decode(any, path, problems)?;
    let authz = compile(&config, path, problems)?;
    let cluster = ctx.clusters.get(authz.service.cluster()).cloned();
    if cluster.is_none() {
        problems.warning(
            path,
            format!(
                "cluster {:?} of the authorization service is not known: checks fail until the listener is updated",
                authz.service.cluster()
            ),
        );
    }
    let prefix = if authz.stat_prefix.is_empty() {
        format!("http.{}.ext_authz.", ctx.stat_prefix)
    } else {
        format!("http.{}.ext_authz.{}.", ctx.stat_prefix, authz.stat_prefix)
    };
    let stat = |name: &str| ctx.stats.counter(&format!("{prefix}{name}"));
    let stats = Stats {
        store: ctx.stats.clone(),
        ok: stat("ok"),
        denied: stat("denied"),
        error: stat("error"),
        failure_mode_allowed: stat("failure_mode_allowed"),
        disabled: stat("disabled"),
    };
    Some(Arc::new(Config {
        authz: Arc::new(authz),
        cluster,
        stats: Arc::new(stats),
    }))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let config: ExtAuthzPerRoute = decode(any, path, problems)?;
    Some(Arc::new(RouteSettings(compile_per_route(
        &config, path, problems,
    )?)))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(ExtAuthzFilter {
            authz: self.authz.clone(),
            cluster: self.cluster.clone(),
            stats: self.stats.clone(),
            body: None,
            head: None,
            pending: None,
            downstream: Vec::new(),
        })
    }
}

struct ExtAuthzFilter {
    authz: Arc<ExtAuthzConfig>,
    cluster: Option<Arc<Cluster>>,
    stats: Arc<Stats>,
    /// Set while the body is being buffered for the check, with the head it goes with.
    body: Option<BodySettings>,
    head: Option<RequestHeaders>,
    /// What an allowed check changes in the request head, applied in
    /// `decode_complete` (after a buffered body).
    pending: Option<Allowed>,
    /// Headers the check adds to the response.
    downstream: Vec<HeaderChange>,
}

/// The head changes of an allowed check.
struct Allowed {
    upstream: Vec<HeaderChange>,
    remove: Vec<String>,
}

fn route_cluster(ctx: &StreamCtx) -> Option<Arc<str>> {
    match &ctx.route.as_ref()?.route().action {
        Action::Route(action) => match &action.cluster {
            ClusterChoice::Cluster(name) => Some(name.clone()),
            _ => ctx
                .route
                .as_ref()?
                .weighted_cluster()
                .map(|w| w.name.clone()),
        },
        _ => None,
    }
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

impl ExtAuthzFilter {
    /// `ext_authz.<what>` under the connection manager and under the route's cluster.
    fn count(&self, counter: &Counter, what: &str, ctx: &StreamCtx) {
        counter.inc();
        if let Some(cluster) = route_cluster(ctx) {
            self.stats
                .store
                .counter(&format!("cluster.{cluster}.ext_authz.{what}"))
                .inc();
        }
    }

    fn enabled(&self, ctx: &StreamCtx) -> bool {
        if let Some(m) = &self.authz.filter_enabled_metadata {
            let value = ctx.info.metadata_value(&m.filter, &m.path);
            let matched = value
                .and_then(|v| v.as_str())
                .is_some_and(|v| m.value.matches(v));
            if matched == m.invert {
                return false;
            }
        }
        self.authz
            .filter_enabled
            .is_none_or(|p| p.hit(fastrand::u64(..)))
    }

    /// The check, and what it means for the stream.
    async fn check(
        &mut self,
        request: &RequestHeaders,
        body: Option<&[u8]>,
        partial: bool,
        ctx: &mut StreamCtx,
    ) -> FilterStatus {
        let per_route = ctx.route_config::<RouteSettings>().map(|r| r.0.clone());
        let verdict = match &self.cluster {
            None => Verdict::Error(format!(
                "cluster {:?} is not known",
                self.authz.service.cluster()
            )),
            Some(cluster) => {
                let secrets = shunt_tls::Secrets::default();
                match &self.authz.service {
                    Service::Grpc {
                        authority, timeout, ..
                    } => {
                        let mut headers = request.headers.clone();
                        if body.is_some() {
                            headers.insert(
                                HeaderName::from_static(PARTIAL_BODY_HEADER),
                                HeaderValue::from_static(if partial { "true" } else { "false" }),
                            );
                        }
                        let connection = &ctx.info.connection;
                        let principal = connection.peer_principals().next().unwrap_or_default();
                        let input = CheckInput {
                            source: Some(connection.remote),
                            destination: Some(connection.local),
                            source_principal: principal,
                            sni: connection.requested_server_name.as_deref(),
                            stream_id: fastrand::u64(..),
                            method: request.method.as_str(),
                            path: &request.path,
                            host: &request.authority,
                            scheme: request.scheme,
                            protocol: protocol(request.version),
                            headers: Some(&headers),
                            body,
                            pack_as_bytes: self.body.is_some_and(|b| b.pack_as_bytes),
                            context_extensions: per_route
                                .map(|p| p.context_extensions)
                                .unwrap_or_default(),
                            ..Default::default()
                        };
                        grpc::check(
                            cluster,
                            &secrets,
                            authority,
                            *timeout,
                            &check::request(&input),
                        )
                        .await
                    }
                    Service::Http {
                        authority,
                        path_prefix,
                        timeout,
                        ..
                    } => {
                        let path = format!("{path_prefix}{}", request.path);
                        grpc::check_http(
                            cluster,
                            &secrets,
                            grpc::HttpCheck {
                                authority,
                                path: &path,
                                method: &request.method,
                                headers: &request.headers,
                                body: body.map(Bytes::copy_from_slice),
                            },
                            *timeout,
                        )
                        .await
                    }
                }
            }
        };
        match verdict {
            Verdict::Allow(allowed) => {
                self.count(&self.stats.ok, "ok", ctx);
                self.pending = Some(Allowed {
                    upstream: allowed.upstream,
                    remove: allowed.remove,
                });
                self.downstream = allowed.downstream;
                FilterStatus::Continue
            }
            Verdict::Deny(denied) => {
                self.count(&self.stats.denied, "denied", ctx);
                let status = StatusCode::from_u16(denied.status).unwrap_or(StatusCode::FORBIDDEN);
                let mut reply = LocalReply::new(status, denied.body, "ext_authz_denied")
                    .with_flag(ResponseFlag::UnauthorizedExternalService);
                check::apply(&mut reply.headers, &denied.headers);
                FilterStatus::Reply(reply)
            }
            Verdict::Error(why) => {
                tracing::debug!(%why, "ext_authz check failed");
                self.count(&self.stats.error, "error", ctx);
                if self.authz.failure_mode_allow {
                    self.count(
                        &self.stats.failure_mode_allowed,
                        "failure_mode_allowed",
                        ctx,
                    );
                    if self.authz.failure_mode_allow_header_add {
                        self.pending = Some(Allowed {
                            upstream: vec![HeaderChange {
                                name: FAILURE_MODE_ALLOWED_HEADER.to_owned(),
                                value: "true".to_owned(),
                                apply: check::Apply::Set,
                            }],
                            remove: Vec::new(),
                        });
                    }
                    return FilterStatus::Continue;
                }
                let status = StatusCode::from_u16(self.authz.status_on_error)
                    .unwrap_or(StatusCode::FORBIDDEN);
                FilterStatus::Reply(
                    LocalReply::new(status, "", "ext_authz_error")
                        .with_flag(ResponseFlag::UnauthorizedExternalService),
                )
            }
        }
    }

    fn apply_pending(&mut self, request: &mut RequestHeaders) {
        if let Some(allowed) = self.pending.take() {
            for name in &allowed.remove {
                request.headers.remove(name.as_str());
            }
            check::apply(&mut request.headers, &allowed.upstream);
        }
    }
}

impl HttpFilter for ExtAuthzFilter {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let per_route = ctx.route_config::<RouteSettings>();
        if per_route.is_some_and(|r| r.0.disabled) {
            return Flow::CONTINUE;
        }
        if !self.enabled(ctx) {
            if self.authz.deny_at_disable {
                self.stats.disabled.inc();
                return FilterStatus::Reply(LocalReply::new(
                    StatusCode::FORBIDDEN,
                    "",
                    "ext_authz_disabled",
                ))
                .into();
            }
            return Flow::CONTINUE;
        }
        let body = match per_route {
            Some(r) if r.0.disable_request_body_buffering => None,
            Some(r) if r.0.with_request_body.is_some() => r.0.with_request_body,
            _ => self.authz.with_request_body,
        };
        if body.is_some() && !end_stream {
            self.body = body;
            self.head = Some(request.clone());
            return FilterStatus::StopIteration.into();
        }
        let body = body.map(|_| &[][..]);
        Flow::Pending(Box::pin(async move {
            let status = self.check(request, body, false, ctx).await;
            self.apply_pending(request);
            status
        }))
    }

    fn decode_data<'a>(
        &'a mut self,
        data: &'a mut Bytes,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let (Some(settings), Some(head)) = (self.body, self.head.take()) else {
            return Flow::CONTINUE;
        };
        let partial = data.len() > settings.max_request_bytes;
        if partial && !settings.allow_partial_message {
            return FilterStatus::Reply(LocalReply::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "Payload Too Large",
                "request_payload_too_large",
            ))
            .into();
        }
        let sent = data.slice(..data.len().min(settings.max_request_bytes));
        Flow::Pending(Box::pin(async move {
            self.check(&head, Some(&sent), partial, ctx).await
        }))
    }

    /// The check's changes to the head, once the body went to the service.
    fn decode_complete(&mut self, request: &mut RequestHeaders, _ctx: &mut StreamCtx) {
        self.apply_pending(request);
    }

    fn encode_headers(
        &mut self,
        response: &mut ResponseHeaders,
        _end_stream: bool,
        _ctx: &mut StreamCtx,
    ) -> FilterStatus {
        check::apply(&mut response.headers, &self.downstream);
        FilterStatus::Continue
    }
}
