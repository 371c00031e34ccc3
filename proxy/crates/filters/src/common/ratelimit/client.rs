//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` over gRPC, through the
//! service cluster's own HTTP/2 pool (the calls of every stream share its connections,
//! as Envoy's async client multiplexes them), and what the answer means: Envoy's
//! `GrpcClientImpl`. A call that fails, times out or answers `UNKNOWN` is an error.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use hyper::header::HeaderValue;
use hyper::{Method, Request, Version};

use super::{Descriptor, Service};
use crate::common::ext_authz::grpc::{call, frame, unframe};
use shunt_upstream::Cluster;
use shunt_upstream::http_pool::RequestBody;

pub const SHOULD_RATE_LIMIT_PATH: &str =
    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// What the filters do with an answer (Envoy's `LimitStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitStatus {
    Ok,
    OverLimit,
    Error,
}

/// The service's answer as the filters use it.
#[derive(Debug)]
pub struct Answer {
    pub status: LimitStatus,
    pub statuses: Vec<DescriptorStatus>,
    /// Lowercase names, in the service's order.
    pub response_headers: Vec<(String, String)>,
    pub request_headers: Vec<(String, String)>,
    /// `raw_body`: the body of the rate limited (or failed) local reply.
    pub body: Bytes,
}

impl Answer {
    fn error(why: &str) -> Answer {
        tracing::debug!(%why, "the rate limit service call failed");
        Answer {
            status: LimitStatus::Error,
            statuses: Vec::new(),
            response_headers: Vec::new(),
            request_headers: Vec::new(),
            body: Bytes::new(),
        }
    }
}

/// The request Envoy sends: the domain and each descriptor's entries.
pub fn request(domain: &str, descriptors: &[Descriptor]) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: descriptors
            .iter()
            .map(|d| RateLimitDescriptor {
                entries: d
                    .entries
                    .iter()
                    .map(|e| rate_limit_descriptor::Entry {
                        key: e.key.clone(),
                        value: e.value.clone(),
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend: 0,
    }
}

/// One `ShouldRateLimit` call; `cluster` is `None` when the service's cluster was not
/// known when the filter was compiled (every call fails, as in Envoy).
pub async fn should_rate_limit(
    service: &Service,
    cluster: Option<&Arc<Cluster>>,
    domain: &str,
    descriptors: &[Descriptor],
) -> Answer {
    let Some(cluster) = cluster else {
        return Answer::error(&format!("cluster {:?} is not known", service.cluster));
    };
    let response = match unary(cluster, service, &request(domain, descriptors)).await {
        Ok(response) => response,
        Err(why) => return Answer::error(&why),
    };
    answer(response)
}

/// What a `RateLimitResponse` means.
pub fn answer(response: RateLimitResponse) -> Answer {
    let status = match Code::try_from(response.overall_code) {
        Ok(Code::Ok) => LimitStatus::Ok,
        Ok(Code::OverLimit) => LimitStatus::OverLimit,
        _ => return Answer::error("the answer's overall_code is UNKNOWN"),
    };
    let headers = |list: &[envoy_types::pb::envoy::config::core::v3::HeaderValue]| {
        list.iter()
            .map(|h| (h.key.to_ascii_lowercase(), h.value.clone()))
            .collect()
    };
    Answer {
        status,
        response_headers: headers(&response.response_headers_to_add),
        request_headers: headers(&response.request_headers_to_add),
        statuses: response.statuses,
        body: Bytes::from(response.raw_body),
    }
}

async fn unary(
    cluster: &Arc<Cluster>,
    service: &Service,
    message: &RateLimitRequest,
) -> Result<RateLimitResponse, String> {
    // No timeout configured: the call waits as long as the stream does.
    let timeout = service.timeout.unwrap_or(Duration::from_secs(3600));
    let authority = &service.authority;
    let mut request = Request::builder()
        .method(Method::POST)
        .version(Version::HTTP_2)
        .uri(format!("http://{authority}{SHOULD_RATE_LIMIT_PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(RequestBody::buffered(frame(message), None))
        .map_err(|e| format!("building the call: {e}"))?;
    if let Some(t) = service.timeout {
        let value = format!("{}m", t.as_millis().max(1));
        request.headers_mut().insert(
            "grpc-timeout",
            HeaderValue::from_str(&value).expect("digits and m"),
        );
    }
    if let Ok(host) = HeaderValue::from_str(authority) {
        request.headers_mut().insert(hyper::header::HOST, host);
    }
    let secrets = shunt_tls::Secrets::default();
    let (head, body, trailers) = call(cluster, &secrets, request, true, timeout).await?;
    if head.status() != hyper::StatusCode::OK {
        return Err(format!("HTTP status {}", head.status()));
    }
    // grpc-status in the trailers, or in the head of a trailers-only answer.
    let status = trailers
        .as_ref()
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| head.headers().get("grpc-status"))
        .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
    match status {
        Some(0) => unframe::<RateLimitResponse>(body),
        Some(code) => Err(format!("gRPC status {code}")),
        None => Err("the answer has no grpc-status".into()),
    }
}
