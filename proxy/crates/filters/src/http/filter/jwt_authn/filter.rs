//! The jwt_authn filter on a stream: pick the requirement (per-route config, else the
//! first rule whose match fits), extract the tokens each provider looks for, verify
//! them (keys inline or fetched from the JWKS cluster and cached), and either let the
//! request through (the verified payloads in dynamic metadata, the payload and claims
//! as headers, the token removed unless `forward`) or answer as Envoy does: 401 (403
//! for a disallowed audience) with the failure as body and `www-authenticate`.
//! Stats: `http.<stat_prefix>.jwt_authn.<stat_prefix>{allowed,denied,
//! cors_preflight_bypassed,jwks_fetch_success,jwks_fetch_failed}`.

use std::any::Any;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE};
use envoy_types::pb::envoy::extensions::filters::http::jwt_authn::v3::{
    JwtAuthentication, PerRouteConfig,
};
use envoy_types::pb::google::protobuf::Any as PbAny;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, StatusCode};
use serde_json::{Map, Value};

use super::jwks::Jwks;
use super::jwt::{Jwt, Status, audiences_allowed};
use super::{
    JwtAuthnConfig, KeySource, METADATA_NAMESPACE, PER_ROUTE_TYPE_NAME, PerRoute, Provider,
    RemoteJwks, Requirement, TYPE_NAME, compile, compile_per_route,
};
use crate::common::ext_authz::grpc;
use crate::http::filter::factory::{CompileCtx, Factory};
use crate::http::filter::{
    BoxFuture, FilterStatus, Flow, HttpFilter, HttpFilterConfig, LocalReply, RequestHeaders,
    RouteSpecificConfig, StreamCtx,
};
use shunt_config::{Diagnostics, JsonPath, convert::decode};
use shunt_core::stats::Counter;
use shunt_upstream::Cluster;
use shunt_upstream::http_pool::RequestBody;

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
    allowed: Counter,
    denied: Counter,
    cors_preflight_bypassed: Counter,
    jwks_fetch_success: Counter,
    jwks_fetch_failed: Counter,
}

/// A provider's remote key set: fetched on first use, kept for `cache_duration`.
#[derive(Debug)]
struct RemoteKeys {
    spec: RemoteJwks,
    cluster: Option<Arc<Cluster>>,
    /// Held while a fetch is under way, so concurrent requests share it.
    cache: tokio::sync::Mutex<Option<(Arc<Jwks>, Instant)>>,
}

#[derive(Debug)]
struct Shared {
    config: JwtAuthnConfig,
    /// By provider index; `None` for local keys.
    remotes: Vec<Option<RemoteKeys>>,
    stats: Stats,
}

#[derive(Debug)]
struct Config(Arc<Shared>);

fn compile_filter(
    any: &PbAny,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn HttpFilterConfig>> {
    let proto: JwtAuthentication = decode(any, path, problems)?;
    let config = compile(&proto, path, problems)?;
    let remotes = config
        .providers
        .iter()
        .map(|p| match &p.keys {
            KeySource::Local(_) => None,
            KeySource::Remote(spec) => {
                let cluster = ctx.clusters.get(spec.cluster.as_str()).cloned();
                if cluster.is_none() {
                    problems.warning(
                        path.field("providers").field(&p.name).field("remote_jwks"),
                        format!(
                            "JWKS cluster {:?} is not known: fetches fail until the listener is updated",
                            spec.cluster
                        ),
                    );
                }
                Some(RemoteKeys {
                    spec: spec.clone(),
                    cluster,
                    cache: tokio::sync::Mutex::new(None),
                })
            }
        })
        .collect();
    let prefix = format!("http.{}.jwt_authn.{}", ctx.stat_prefix, config.stat_prefix);
    let stat = |name: &str| ctx.stats.counter(&format!("{prefix}{name}"));
    let stats = Stats {
        allowed: stat("allowed"),
        denied: stat("denied"),
        cors_preflight_bypassed: stat("cors_preflight_bypassed"),
        jwks_fetch_success: stat("jwks_fetch_success"),
        jwks_fetch_failed: stat("jwks_fetch_failed"),
    };
    Some(Arc::new(Config(Arc::new(Shared {
        config,
        remotes,
        stats,
    }))))
}

fn compile_route(
    any: &PbAny,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn RouteSpecificConfig>> {
    let proto: PerRouteConfig = decode(any, path, problems)?;
    Some(Arc::new(RouteSettings(compile_per_route(
        &proto, path, problems,
    )?)))
}

impl HttpFilterConfig for Config {
    fn create(&self) -> Box<dyn HttpFilter> {
        Box::new(JwtAuthnFilter(self.0.clone()))
    }
}

struct JwtAuthnFilter(Arc<Shared>);

/// A route's `requirement_name` that `requirement_map` does not have.
struct UnknownRequirement;

/// Where a token was found: what `forward: false` removes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Location {
    Header(HeaderName),
    Param(String),
    Cookie(String),
}

#[derive(Debug, Clone)]
struct Token {
    text: String,
    location: Location,
    /// The providers that look there: the token's issuer must be one of theirs.
    providers: Vec<usize>,
}

/// What verified tokens do to the request once it is let through.
#[derive(Debug, Default)]
struct Effects {
    remove: Vec<HeaderName>,
    /// Query parameters the tokens came in.
    remove_params: Vec<String>,
    set: Vec<(HeaderName, String)>,
    metadata: Map<String, Value>,
}

/// How an authenticator treats missing and failed tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Required,
    AllowMissing,
    AllowFailed,
}

/// The characters a token is made of: what follows a header's prefix up to the first
/// other character is the token.
fn token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '=' | '+' | '/')
}

fn after_prefix(value: &str, prefix: &str) -> Option<String> {
    if prefix.is_empty() {
        return Some(value.trim().to_owned());
    }
    let start = value.find(prefix)? + prefix.len();
    let rest = &value[start..];
    let end = rest.find(|c: char| !token_char(c)).unwrap_or(rest.len());
    Some(rest[..end].to_owned())
}

fn cookies(request: &RequestHeaders) -> impl Iterator<Item = (&str, &str)> {
    request
        .headers
        .get_all(hyper::header::COOKIE)
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| {
            let (name, value) = pair.trim().split_once('=')?;
            Some((name.trim(), value.trim().trim_matches('"')))
        })
}

/// The tokens in the places the given providers look, each once.
fn extract(providers: &[Provider], which: &[usize], request: &RequestHeaders) -> Vec<Token> {
    let mut tokens: Vec<Token> = Vec::new();
    let mut add = |text: String, location: Location, provider: usize| {
        if text.is_empty() {
            return;
        }
        match tokens
            .iter_mut()
            .find(|t| t.text == text && t.location == location)
        {
            Some(t) if !t.providers.contains(&provider) => t.providers.push(provider),
            Some(_) => {}
            None => tokens.push(Token {
                text,
                location,
                providers: vec![provider],
            }),
        }
    };
    let view = request.view();
    for &i in which {
        let locations = &providers[i].locations;
        for (name, prefix) in &locations.headers {
            for value in request.headers.get_all(name) {
                let Some(text) = value.to_str().ok().and_then(|v| after_prefix(v, prefix)) else {
                    continue;
                };
                add(text, Location::Header(name.clone()), i);
            }
        }
        for param in &locations.params {
            for (name, value) in view.query_parameters() {
                if name == param {
                    add(value.to_owned(), Location::Param(param.clone()), i);
                }
            }
        }
        for cookie in &locations.cookies {
            for (name, value) in cookies(request) {
                if name == cookie {
                    add(value.to_owned(), Location::Cookie(cookie.clone()), i);
                }
            }
        }
    }
    tokens
}

/// A claim as a header value: strings as they are, numbers and booleans as text,
/// lists and objects as their JSON in (padded) base64, as Envoy does.
fn claim_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
            _ => n.to_string(),
        }),
        Value::Array(_) | Value::Object(_) => Some(STANDARD.encode(value.to_string())),
        _ => None,
    }
}

/// The payload as metadata: space-delimited claims (Istio's `scope`, `permission`)
/// become lists.
fn normalized_payload(provider: &Provider, jwt: &Jwt) -> Value {
    let mut payload = jwt.payload.clone();
    for claim in &provider.space_delimited_claims {
        if let Some(Value::String(s)) = payload.get(claim) {
            let items: Vec<Value> = s
                .split(' ')
                .filter(|p| !p.is_empty())
                .map(Value::from)
                .collect();
            payload.insert(claim.clone(), Value::Array(items));
        }
    }
    Value::Object(payload)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One request's verification: the requirement tree walked, effects collected.
struct Verification<'r> {
    shared: &'r Shared,
    request: &'r RequestHeaders,
    now: u64,
    effects: Effects,
}

impl<'r> Verification<'r> {
    fn requirement<'a>(&'a mut self, r: &'a Requirement) -> BoxFuture<'a, Status> {
        Box::pin(async move {
            match r {
                Requirement::Provider {
                    provider,
                    audiences,
                } => {
                    self.authenticate(Some((*provider, audiences.as_deref())), Mode::Required)
                        .await
                }
                Requirement::AllowMissing => self.authenticate(None, Mode::AllowMissing).await,
                Requirement::AllowMissingOrFailed => {
                    self.authenticate(None, Mode::AllowFailed).await
                }
                Requirement::Any(list) => {
                    // Envoy's any-verifier: an `allow_missing` among the children is a
                    // flag, not a verifier; any success wins, else the last failure
                    // that is more than a missing token.
                    let allow_missing = list.iter().any(|c| matches!(c, Requirement::AllowMissing));
                    let mut last = Status::JwtMissed;
                    let mut ok = false;
                    for child in list
                        .iter()
                        .filter(|c| !matches!(c, Requirement::AllowMissing))
                    {
                        match self.requirement(child).await {
                            Status::Ok => ok = true,
                            Status::JwtMissed => {}
                            failed => last = failed,
                        }
                    }
                    if ok || (allow_missing && last == Status::JwtMissed) {
                        Status::Ok
                    } else {
                        last
                    }
                }
                Requirement::All(list) => {
                    for child in list {
                        let status = self.requirement(child).await;
                        if status != Status::Ok {
                            return status;
                        }
                    }
                    Status::Ok
                }
            }
        })
    }

    /// Envoy's authenticator: one provider's tokens (or every provider's, for the
    /// allow_missing kinds); all tokens found must verify unless failures are allowed.
    async fn authenticate(
        &mut self,
        provider: Option<(usize, Option<&[String]>)>,
        mode: Mode,
    ) -> Status {
        let providers = &self.shared.config.providers;
        let which: Vec<usize> = match provider {
            Some((i, _)) => vec![i],
            None => (0..providers.len()).collect(),
        };
        let tokens = extract(providers, &which, self.request);
        let mut last = Status::JwtMissed;
        for token in &tokens {
            last = self.verify(token, provider).await;
            if last != Status::Ok && mode == Mode::Required {
                return last;
            }
        }
        match mode {
            Mode::AllowFailed => Status::Ok,
            Mode::AllowMissing if last == Status::JwtMissed => Status::Ok,
            _ => last,
        }
    }

    async fn verify(
        &mut self,
        token: &Token,
        provider: Option<(usize, Option<&[String]>)>,
    ) -> Status {
        let jwt = match Jwt::parse(&token.text) {
            Ok(jwt) => jwt,
            Err(status) => return status,
        };
        let providers = &self.shared.config.providers;
        let allowed = |i: &usize| providers[*i].issuer_allowed(&jwt.iss);
        let (index, audiences) = match provider {
            Some((i, audiences)) if allowed(&i) => (i, audiences),
            Some(_) => return Status::JwtUnknownIssuer,
            None => match token.providers.iter().find(|i| allowed(i)) {
                Some(&i) => (i, None),
                None => return Status::JwtUnknownIssuer,
            },
        };
        let p = &providers[index];
        let status = jwt.check_time(self.now, p.clock_skew, p.require_expiration);
        if status != Status::Ok {
            return status;
        }
        if !audiences_allowed(audiences.unwrap_or(&p.audiences), &jwt.audiences) {
            return Status::JwtAudienceNotAllowed;
        }
        let status = match self.keys(index).await {
            Ok(keys) => keys.verify(&jwt),
            Err(status) => status,
        };
        if status == Status::Ok {
            self.record(p, &jwt, token);
        }
        status
    }

    async fn keys(&self, provider: usize) -> Result<Arc<Jwks>, Status> {
        match &self.shared.config.providers[provider].keys {
            KeySource::Local(Ok(keys)) => Ok(Arc::new(keys.clone())),
            KeySource::Local(Err(_)) => Err(Status::JwksNoValidKeys),
            KeySource::Remote(_) => {
                let remote = self.shared.remotes[provider]
                    .as_ref()
                    .expect("a remote provider has its cache");
                remote.get(&self.shared.stats).await
            }
        }
    }

    fn record(&mut self, p: &Provider, jwt: &Jwt, token: &Token) {
        let effects = &mut self.effects;
        if !p.forward
            && let Location::Header(name) = &token.location
        {
            effects.remove.push(name.clone());
        }
        if !p.forward
            && let Location::Param(name) = &token.location
        {
            effects.remove_params.push(name.clone());
        }
        if let Some(header) = &p.forward_payload_header {
            let mut payload = jwt.payload_base64url.trim_end_matches('=').to_owned();
            if p.pad_forward_payload_header {
                let bytes = super::jwt::decode_base64url(&payload).unwrap_or_default();
                payload = URL_SAFE.encode(bytes);
            }
            effects.set.push((header.clone(), payload));
        }
        for (header, claim) in &p.claim_to_headers {
            let mut value = jwt.payload.get(&claim[0]);
            for key in &claim[1..] {
                value = value.and_then(|v| v.get(key));
            }
            if let Some(text) = value.and_then(claim_text) {
                effects.set.push((header.clone(), text));
            }
        }
        if !p.payload_in_metadata.is_empty() {
            effects
                .metadata
                .insert(p.payload_in_metadata.clone(), normalized_payload(p, jwt));
        }
        if !p.header_in_metadata.is_empty() {
            effects.metadata.insert(
                p.header_in_metadata.clone(),
                Value::Object(jwt.header.clone()),
            );
        }
    }
}

impl RemoteKeys {
    async fn get(&self, stats: &Stats) -> Result<Arc<Jwks>, Status> {
        let mut cache = self.cache.lock().await;
        if let Some((keys, fetched)) = &*cache
            && fetched.elapsed() < self.spec.cache_duration
        {
            return Ok(keys.clone());
        }
        match self.fetch().await {
            Ok(keys) => {
                stats.jwks_fetch_success.inc();
                let keys = Arc::new(keys);
                *cache = Some((keys.clone(), Instant::now()));
                Ok(keys)
            }
            Err(err) => {
                stats.jwks_fetch_failed.inc();
                tracing::warn!(uri = %format!("{}{}", self.spec.authority, self.spec.path), %err, "JWKS fetch failed");
                Err(Status::JwksFetchFail)
            }
        }
    }

    async fn fetch(&self) -> Result<Jwks, String> {
        let Some(cluster) = &self.cluster else {
            return Err(format!("cluster {:?} is not known", self.spec.cluster));
        };
        let request = Request::builder()
            .method(Method::GET)
            .uri(format!("http://{}{}", self.spec.authority, self.spec.path))
            .header(hyper::header::HOST, &self.spec.authority)
            .body(RequestBody::buffered(Default::default(), None))
            .map_err(|e| format!("building the JWKS request: {e}"))?;
        let http2 = cluster.http_protocol == shunt_upstream::cluster::UpstreamProtocol::Http2;
        let secrets = shunt_tls::Secrets::default();
        let (head, body, _) =
            grpc::call(cluster, &secrets, request, http2, self.spec.timeout).await?;
        if head.status() != StatusCode::OK {
            return Err(format!("the JWKS server answered {}", head.status()));
        }
        Jwks::parse(&body)
    }
}

impl JwtAuthnFilter {
    /// The requirement for this request: the route's `PerRouteConfig`, else the first
    /// rule that matches. `Err`: a reply (an unknown requirement name).
    fn requirement<'a>(
        &'a self,
        request: &RequestHeaders,
        ctx: &'a StreamCtx,
    ) -> Result<Option<&'a Requirement>, UnknownRequirement> {
        let config = &self.0.config;
        match ctx.route_config::<RouteSettings>() {
            Some(RouteSettings(PerRoute::Disabled)) => Ok(None),
            Some(RouteSettings(PerRoute::RequirementName(name))) => {
                match config.requirement_map.get(name) {
                    Some(r) => Ok(Some(r)),
                    None => Err(UnknownRequirement),
                }
            }
            None => {
                let view = request.view();
                Ok(config
                    .rules
                    .iter()
                    .find(|rule| rule.route_match.matches(&view))
                    .and_then(|rule| rule.requires.as_ref()))
            }
        }
    }

    fn is_cors_preflight(request: &RequestHeaders) -> bool {
        request.method == Method::OPTIONS
            && request.headers.contains_key(hyper::header::ORIGIN)
            && request
                .headers
                .contains_key(hyper::header::ACCESS_CONTROL_REQUEST_METHOD)
    }
}

/// Envoy's answer to a failed verification.
fn reply(config: &JwtAuthnConfig, status: Status, request: &RequestHeaders) -> LocalReply {
    let code = if status == Status::JwtAudienceNotAllowed {
        StatusCode::FORBIDDEN
    } else {
        StatusCode::UNAUTHORIZED
    };
    let scheme = request
        .headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(request.scheme);
    let path = request.path.split('?').next().unwrap_or_default();
    let mut challenge = format!("Bearer realm=\"{scheme}://{}{path}\"", request.authority);
    if status != Status::JwtMissed {
        challenge.push_str(", error=\"invalid_token\"");
    }
    let body = if config.strip_failure_response {
        ""
    } else {
        status.text()
    };
    let details = format!(
        "jwt_authn_access_denied{{{}}}",
        status.text().replace(' ', "_")
    );
    let mut reply = LocalReply::new(code, body, details);
    if let Ok(value) = HeaderValue::from_str(&challenge) {
        reply = reply.with_header(hyper::header::WWW_AUTHENTICATE, value);
    }
    reply
}

/// `path` without the query parameters named (and without `?` if none is left).
fn without_params(path: &str, names: &[String]) -> String {
    let Some((path_only, query)) = path.split_once('?') else {
        return path.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(n, _)| n);
            !names.iter().any(|n| n == name)
        })
        .collect();
    if kept.is_empty() {
        path_only.to_owned()
    } else {
        format!("{path_only}?{}", kept.join("&"))
    }
}

fn apply(effects: Effects, request: &mut RequestHeaders, ctx: &mut StreamCtx) {
    for name in &effects.remove {
        request.headers.remove(name);
    }
    if !effects.remove_params.is_empty() {
        request.path = without_params(&request.path, &effects.remove_params);
    }
    for (name, value) in effects.set {
        if let Ok(value) = HeaderValue::from_str(&value) {
            request.headers.insert(name, value);
        }
    }
    if !effects.metadata.is_empty() {
        ctx.info.metadata.set(METADATA_NAMESPACE, effects.metadata);
    }
}

impl HttpFilter for JwtAuthnFilter {
    fn decode_headers<'a>(
        &'a mut self,
        request: &'a mut RequestHeaders,
        _end_stream: bool,
        ctx: &'a mut StreamCtx,
    ) -> Flow<'a> {
        let shared = self.0.clone();
        if shared.config.bypass_cors_preflight && Self::is_cors_preflight(request) {
            shared.stats.cors_preflight_bypassed.inc();
            shared.stats.allowed.inc();
            return Flow::CONTINUE;
        }
        let requirement = match self.requirement(request, ctx) {
            Ok(Some(r)) => r.clone(),
            Ok(None) => {
                shared.stats.allowed.inc();
                return Flow::CONTINUE;
            }
            Err(UnknownRequirement) => {
                shared.stats.denied.inc();
                let reply = LocalReply::new(
                    StatusCode::FORBIDDEN,
                    "Failed JWT authentication",
                    "jwt_authn_access_denied{unknown_requirement_name}",
                );
                return FilterStatus::Reply(reply).into();
            }
        };
        Flow::Pending(Box::pin(async move {
            let mut verification = Verification {
                shared: &shared,
                request,
                now: unix_now(),
                effects: Effects::default(),
            };
            let status = verification.requirement(&requirement).await;
            let effects = std::mem::take(&mut verification.effects);
            if status != Status::Ok {
                shared.stats.denied.inc();
                tracing::debug!(status = status.text(), "JWT authentication failed");
                return FilterStatus::Reply(reply(&shared.config, status, request));
            }
            shared.stats.allowed.inc();
            apply(effects, request, ctx);
            FilterStatus::Continue
        }))
    }
}
