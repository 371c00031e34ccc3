//! The calls to the authorization service, made through the service cluster's own
//! connection pools (HTTP/2 for gRPC: one shared connection per host, as Envoy's gRPC
//! async client multiplexes its calls), with the cluster's load balancing and TLS.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::auth::v3::{CheckRequest, CheckResponse};
use http_body_util::BodyExt;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Method, Request, Response, Version};
use prost::Message;

use super::check::{Allowed, Denied, HeaderChange, Verdict};
use shunt_upstream::Cluster;
use shunt_upstream::http_pool::RequestBody;
use shunt_upstream::load_balancer::LbContext;

pub const CHECK_PATH: &str = "/envoy.service.auth.v3.Authorization/Check";

/// A gRPC message: the uncompressed flag, the length, the bytes.
pub fn frame(message: &impl Message) -> Bytes {
    let len = message.encoded_len();
    let mut out = BytesMut::with_capacity(5 + len);
    out.put_u8(0);
    out.put_u32(len as u32);
    message.encode(&mut out).expect("BytesMut grows as needed");
    out.freeze()
}

/// The first gRPC message of a response body.
pub fn unframe<M: Message + prost::Name + Default>(mut body: Bytes) -> Result<M, String> {
    if body.len() < 5 {
        return Err("the response carried no gRPC message".into());
    }
    if body.get_u8() != 0 {
        return Err("compressed gRPC messages are not supported".into());
    }
    let len = body.get_u32() as usize;
    if body.len() < len {
        return Err("a truncated gRPC message".into());
    }
    M::decode(body.slice(..len)).map_err(|e| format!("decoding {}: {e}", M::full_name()))
}

/// One request to `cluster` (a host its load balancer picks, a pooled connection),
/// its whole response read, within `timeout`.
pub async fn call(
    cluster: &Arc<Cluster>,
    secrets: &shunt_tls::Secrets,
    request: Request<RequestBody>,
    http2: bool,
    timeout: Duration,
) -> Result<(Response<()>, Bytes, Option<HeaderMap>), String> {
    let exchange = async {
        let ctx = LbContext {
            hash: None,
            tried: &[],
        };
        let host = cluster
            .choose_host(&ctx, None)
            .ok_or_else(|| format!("no healthy host in cluster {}", cluster.name))?;
        let sender = cluster
            .http_pools
            .checkout(cluster, &host, http2, secrets)
            .await
            .map_err(|e| format!("connecting to {}: {e}", host.address))?;
        cluster.stats.upstream_rq_total.inc();
        let response = sender
            .send(request)
            .await
            .map_err(|e| format!("calling {}: {}", host.address, e.error))?;
        cluster.stats.charge(response.status().as_u16());
        let (head, body) = response.into_parts();
        let collected = body
            .collect()
            .await
            .map_err(|e| format!("reading the answer: {e}"))?;
        let trailers = collected.trailers().cloned();
        Ok((
            Response::from_parts(head, ()),
            collected.to_bytes(),
            trailers,
        ))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => {
            cluster.stats.upstream_rq_timeout.inc();
            Err(format!("no answer within {timeout:?}"))
        }
    }
}

/// `Authorization/Check` over gRPC.
pub async fn check(
    cluster: &Arc<Cluster>,
    secrets: &shunt_tls::Secrets,
    authority: &str,
    timeout: Duration,
    check: &CheckRequest,
) -> Verdict {
    let mut request = Request::builder()
        .method(Method::POST)
        .version(Version::HTTP_2)
        .uri(format!("http://{authority}{CHECK_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", format!("{}m", timeout.as_millis().max(1)))
        .body(RequestBody::buffered(frame(check), None))
        .expect("a valid gRPC request");
    if let Ok(host) = HeaderValue::from_str(authority) {
        request.headers_mut().insert(hyper::header::HOST, host);
    }
    let (head, body, trailers) = match call(cluster, secrets, request, true, timeout).await {
        Ok(answer) => answer,
        Err(err) => return Verdict::Error(err),
    };
    if head.status() != hyper::StatusCode::OK {
        return Verdict::Error(format!("HTTP status {}", head.status()));
    }
    // grpc-status in the trailers, or in the head of a trailers-only answer.
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| head.headers().get("grpc-status"))
        .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
    match status {
        Some(0) => match unframe::<CheckResponse>(body) {
            Ok(response) => super::check::verdict(&response),
            Err(err) => Verdict::Error(err),
        },
        Some(code) => Verdict::Error(format!("gRPC status {code}")),
        None => Verdict::Error("the answer has no grpc-status".into()),
    }
}

/// What an HTTP-mode check sends: to `authority`, `path` (the service's prefix and
/// the request's path), the request's method, headers and buffered body.
pub struct HttpCheck<'a> {
    pub authority: &'a str,
    pub path: &'a str,
    pub method: &'a Method,
    pub headers: &'a HeaderMap,
    pub body: Option<Bytes>,
}

/// Envoy's HTTP service mode: the request's headers (no body unless buffered) sent to
/// the service at `path_prefix` + path; 200 allows (without `allowed_upstream_headers`
/// none of the service's headers go upstream), any other status denies with the
/// service's status, headers (but framing and hop-by-hop ones) and body.
pub async fn check_http(
    cluster: &Arc<Cluster>,
    secrets: &shunt_tls::Secrets,
    check: HttpCheck<'_>,
    timeout: Duration,
) -> Verdict {
    let HttpCheck {
        authority,
        path,
        method,
        headers,
        body,
    } = check;
    let mut builder = Request::builder()
        .method(method.clone())
        .uri(format!("http://{authority}{path}"));
    for (name, value) in headers {
        if name == hyper::header::CONTENT_LENGTH || name == hyper::header::TRANSFER_ENCODING {
            continue;
        }
        builder = builder.header(name, value);
    }
    let body = body.unwrap_or_default();
    let mut request = match builder
        .header(hyper::header::CONTENT_LENGTH, body.len())
        .body(RequestBody::buffered(body, None))
    {
        Ok(request) => request,
        Err(err) => return Verdict::Error(format!("building the check request: {err}")),
    };
    if let Ok(host) = HeaderValue::from_str(authority) {
        request.headers_mut().insert(hyper::header::HOST, host);
    }
    let http2 = cluster.http_protocol == shunt_upstream::cluster::UpstreamProtocol::Http2;
    let (head, body, _) = match call(cluster, secrets, request, http2, timeout).await {
        Ok(answer) => answer,
        Err(err) => return Verdict::Error(err),
    };
    let changes = |h: &HeaderMap| -> Vec<HeaderChange> {
        h.iter()
            .filter(|(n, _)| !skipped(n))
            .filter_map(|(n, v)| {
                Some(HeaderChange {
                    name: n.as_str().to_owned(),
                    value: v.to_str().ok()?.to_owned(),
                    apply: super::check::Apply::Set,
                })
            })
            .collect()
    };
    if head.status() == hyper::StatusCode::OK {
        Verdict::Allow(Allowed::default())
    } else {
        Verdict::Deny(Denied {
            status: head.status().as_u16(),
            headers: changes(head.headers()),
            body,
        })
    }
}

fn skipped(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "content-length"
            | "transfer-encoding"
            | "connection"
            | "keep-alive"
            | "date"
            | "server"
            | "content-type"
    )
}
