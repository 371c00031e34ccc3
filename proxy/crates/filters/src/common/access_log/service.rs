//! A log service's gRPC endpoint (`envoy_grpc`: a cluster and an authority) and the
//! one call a batch makes to it, over the cluster's own HTTP/2 pool (as ext_authz's
//! checks do). A batch is one call: `StreamAccessLogs` gets a client stream of one
//! message that carries the identifier and ends, `Export` a unary request.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::GrpcService;
use hyper::header::HeaderValue;
use hyper::{Method, Request, Version};

use crate::common::ext_authz::{self, grpc};
use shunt_config::{Diagnostics, JsonPath};
use shunt_upstream::Cluster;
use shunt_upstream::http_pool::RequestBody;

/// How long a batch may take to be accepted before it counts as not sent.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Endpoint {
    pub cluster_name: String,
    /// The cluster as compiled with the logger (`None`: not defined, every batch fails).
    cluster: Option<Arc<Cluster>>,
    authority: String,
    timeout: Duration,
}

impl Endpoint {
    /// The `grpc_service` at `path`, whose cluster should be among `clusters`.
    pub fn compile(
        service: Option<&GrpcService>,
        clusters: &shunt_upstream::Clusters,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<Endpoint> {
        let Some(service) = service else {
            problems.error(path, "is required");
            return None;
        };
        let ext_authz::Service::Grpc {
            cluster, authority, ..
        } = ext_authz::grpc_service(service, path, problems)?
        else {
            return None;
        };
        let compiled = clusters.get(cluster.as_str()).cloned();
        if compiled.is_none() {
            problems.warning(
                path.field("envoy_grpc").field("cluster_name"),
                format!("no cluster named {cluster:?}: its access log entries will be dropped"),
            );
        }
        let timeout = match &service.timeout {
            Some(_) => match ext_authz::grpc_service(service, path, &mut Diagnostics::default()) {
                Some(ext_authz::Service::Grpc { timeout, .. }) => timeout,
                _ => CALL_TIMEOUT,
            },
            None => CALL_TIMEOUT,
        };
        Some(Endpoint {
            cluster_name: cluster,
            cluster: compiled,
            authority,
            timeout,
        })
    }

    /// One call of `method` (`/package.Service/Method`) with `body` (framed messages).
    pub async fn call(&self, method: &str, body: Bytes) -> Result<(), String> {
        let cluster = self
            .cluster
            .as_ref()
            .ok_or_else(|| format!("no cluster named {:?}", self.cluster_name))?;
        let mut request = Request::builder()
            .method(Method::POST)
            .version(Version::HTTP_2)
            .uri(format!("http://{}{method}", self.authority))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(RequestBody::buffered(body, None))
            .map_err(|e| format!("building the request: {e}"))?;
        if let Ok(host) = HeaderValue::from_str(&self.authority) {
            request.headers_mut().insert(hyper::header::HOST, host);
        }
        let secrets = shunt_tls::Secrets::default();
        let (head, _, trailers) =
            grpc::call(cluster, &secrets, request, true, self.timeout).await?;
        if head.status() != hyper::StatusCode::OK {
            return Err(format!("HTTP status {}", head.status()));
        }
        let status = trailers
            .as_ref()
            .and_then(|t| t.get("grpc-status"))
            .or_else(|| head.headers().get("grpc-status"))
            .and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
        match status {
            Some(0) => Ok(()),
            Some(code) => Err(format!("gRPC status {code}")),
            None => Err("the answer has no grpc-status".into()),
        }
    }
}
