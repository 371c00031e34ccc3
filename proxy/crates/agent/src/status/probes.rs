//! The kubelet's rewritten app probes: the injector moves each container's httpGet,
//! tcpSocket and grpc probes to `/app-health/<container>/{livez,readyz,startupz}` on
//! 15020 and hands the originals over in `ISTIO_KUBE_APP_PROBERS`; the agent runs them
//! against the app, from 127.0.0.6 (::6) so capture lets them through uncaptured, with
//! pilot-agent's answers: the app's status and up to 10 KiB of its body for httpGet, a
//! redirect off the app's host as 200, and 500 whenever the app cannot be reached, does
//! not answer in time or is not SERVING.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use hyper::{HeaderMap, StatusCode};
use serde::Deserialize;

use super::client::{self, Call};

/// Where capture returns early for the proxy's own inbound connections.
const SOURCE_V4: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 6));
const SOURCE_V6: IpAddr = IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6));
/// The app's body an httpGet probe passes on, at most (pilot-agent's).
const MAX_BODY: usize = 10 << 10;
/// Kubernetes' default `timeoutSeconds`.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
/// Redirects followed on the app's own host before the probe fails (Go's client's).
const MAX_REDIRECTS: usize = 10;

/// `ISTIO_KUBE_APP_PROBERS`, as the injector writes it: rewritten path to probe.
#[derive(Debug)]
pub struct AppProbers {
    probers: BTreeMap<String, Prober>,
    /// The pod's IP, where the kubelet would have sent the probe.
    destination: IpAddr,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Prober {
    http_get: Option<HttpGet>,
    tcp_socket: Option<TcpSocket>,
    grpc: Option<Grpc>,
    #[serde(default)]
    timeout_seconds: u64,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct HttpGet {
    #[serde(default)]
    path: String,
    port: serde_json::Value,
    #[serde(default)]
    scheme: String,
    // `host` and `httpHeaders` stay with the kubelet, which sends its headers (and its
    // Host) on the rewritten probe; the agent passes those on, as pilot-agent does.
}

#[derive(Debug, Deserialize)]
struct TcpSocket {
    port: serde_json::Value,
}

#[derive(Debug, Deserialize)]
struct Grpc {
    port: u16,
    service: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProbersError {
    #[error("ISTIO_KUBE_APP_PROBERS is not a JSON map of probes: {0}")]
    Json(serde_json::Error),
    #[error(
        "ISTIO_KUBE_APP_PROBERS: {path:?} is not /app-health/<container>/(livez|readyz|startupz) \
         or /app-lifecycle/<container>/(prestopz|poststartz)"
    )]
    Path { path: String },
    #[error("ISTIO_KUBE_APP_PROBERS: {path:?} must have exactly one of httpGet, tcpSocket, grpc")]
    Kind { path: String },
    #[error("ISTIO_KUBE_APP_PROBERS: {path:?}: the port must be a number in 1-65535, not {port}")]
    Port { path: String, port: String },
}

impl AppProbers {
    /// Parses `ISTIO_KUBE_APP_PROBERS`; probes go to `destination` (the pod's IP).
    pub fn parse(json: &str, destination: IpAddr) -> Result<Self, ProbersError> {
        let probers: BTreeMap<String, Prober> =
            serde_json::from_str(json).map_err(ProbersError::Json)?;
        for (path, prober) in &probers {
            if !valid_path(path) {
                return Err(ProbersError::Path { path: path.clone() });
            }
            let kinds = [
                prober.http_get.is_some(),
                prober.tcp_socket.is_some(),
                prober.grpc.is_some(),
            ];
            if kinds.iter().filter(|k| **k).count() != 1 {
                return Err(ProbersError::Kind { path: path.clone() });
            }
            let port = match (&prober.http_get, &prober.tcp_socket) {
                (Some(get), _) => Some(&get.port),
                (_, Some(tcp)) => Some(&tcp.port),
                _ => None,
            };
            if let Some(port) = port
                && int_port(port).is_none()
            {
                return Err(ProbersError::Port {
                    path: path.clone(),
                    port: port.to_string(),
                });
            }
            if let Some(grpc) = &prober.grpc
                && grpc.port == 0
            {
                return Err(ProbersError::Port {
                    path: path.clone(),
                    port: "0".into(),
                });
            }
        }
        Ok(AppProbers {
            probers,
            destination,
        })
    }

    pub fn none(destination: IpAddr) -> Self {
        AppProbers {
            probers: BTreeMap::new(),
            destination,
        }
    }

    /// Runs the probe for `path`: the status and body to answer the kubelet with.
    /// `host` and `headers` are the kubelet's request's; `status_port` is ours.
    pub async fn probe(
        &self,
        path: &str,
        host: Option<&str>,
        headers: &HeaderMap,
        status_port: u16,
    ) -> (StatusCode, Bytes) {
        let Some(prober) = self.probers.get(path) else {
            return (
                StatusCode::BAD_REQUEST,
                Bytes::from(format!("app prober config does not exists for {path}")),
            );
        };
        let timeout = match prober.timeout_seconds {
            0 => DEFAULT_TIMEOUT,
            s => Duration::from_secs(s),
        };
        let source = match self.destination {
            IpAddr::V4(_) => SOURCE_V4,
            IpAddr::V6(_) => SOURCE_V6,
        };
        let result = if let Some(get) = &prober.http_get {
            let port = int_port(&get.port).unwrap_or_default();
            // The Host the kubelet named, with our port swapped for the app's.
            let host = host.map(|host| match host.rsplit_once(':') {
                Some((name, p)) if p == status_port.to_string() => format!("{name}:{port}"),
                _ => host.to_owned(),
            });
            let probe = HttpProbe {
                to: SocketAddr::new(self.destination, port),
                from: source,
                tls: get.scheme.eq_ignore_ascii_case("https"),
                host,
                headers: headers.clone(),
                timeout,
            };
            probe.run(&get.path).await
        } else if let Some(tcp) = &prober.tcp_socket {
            let to = SocketAddr::new(self.destination, int_port(&tcp.port).unwrap_or_default());
            match tokio::time::timeout(timeout, client::connect(to, Some(source))).await {
                Ok(Ok(_)) => Ok((StatusCode::OK, Bytes::new())),
                Ok(Err(err)) => Err(anyhow::anyhow!("tcp probe to {to}: {err}")),
                Err(_) => Err(anyhow::anyhow!(
                    "tcp probe to {to}: no connection in {timeout:?}"
                )),
            }
        } else if let Some(grpc) = &prober.grpc {
            let to = SocketAddr::new(self.destination, grpc.port);
            grpc_probe(
                to,
                source,
                grpc.service.clone().unwrap_or_default(),
                timeout,
            )
            .await
        } else {
            unreachable!("parse checked there is one kind")
        };
        match result {
            Ok(answer) => answer,
            Err(err) => {
                tracing::warn!(probe = path, "app probe failed: {err:#}");
                (StatusCode::INTERNAL_SERVER_ERROR, Bytes::new())
            }
        }
    }
}

/// `^/(app-health|app-lifecycle)/[^/]+/(livez|readyz|startupz|prestopz|poststartz)$`
fn valid_path(path: &str) -> bool {
    let parts: Vec<&str> = path.split('/').collect();
    matches!(
        parts.as_slice(),
        ["", "app-health" | "app-lifecycle", container, "livez" | "readyz" | "startupz" | "prestopz" | "poststartz"]
            if !container.is_empty()
    )
}

/// A port given as a number (Kubernetes' IntOrString; named ports were resolved by the
/// injector).
fn int_port(port: &serde_json::Value) -> Option<u16> {
    port.as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

struct HttpProbe {
    to: SocketAddr,
    from: IpAddr,
    tls: bool,
    host: Option<String>,
    headers: HeaderMap,
    timeout: Duration,
}

impl HttpProbe {
    async fn run(&self, path: &str) -> anyhow::Result<(StatusCode, Bytes)> {
        let mut path = if path.starts_with('/') {
            path.to_owned()
        } else {
            format!("/{path}")
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        for _ in 0..=MAX_REDIRECTS {
            let mut headers = self.headers.clone();
            headers.remove(hyper::header::HOST);
            // One request per probe, as the kubelet's.
            headers.insert(hyper::header::CONNECTION, "close".parse()?);
            let answer = Call {
                method: hyper::Method::GET,
                to: self.to,
                from: Some(self.from),
                tls: self.tls,
                path_and_query: &path,
                host: self.host.as_deref(),
                headers,
                timeout: deadline.saturating_duration_since(tokio::time::Instant::now()),
                max_body: 16 << 20,
            }
            .send()
            .await?;
            if !answer.status.is_redirection() {
                let mut body = answer.body;
                body.truncate(MAX_BODY);
                return Ok((answer.status, body));
            }
            // Followed on the app's own host; elsewhere the redirect itself is success.
            match answer
                .headers
                .get(hyper::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .and_then(|l| self.same_host_path(l))
            {
                Some(next) => path = next,
                None => return Ok((StatusCode::OK, Bytes::new())),
            }
        }
        anyhow::bail!("stopped after {MAX_REDIRECTS} redirects")
    }

    /// The path of `location` if it stays on the probed host.
    fn same_host_path(&self, location: &str) -> Option<String> {
        if location.starts_with('/') && !location.starts_with("//") {
            return Some(location.to_owned());
        }
        let uri: hyper::Uri = location.parse().ok()?;
        let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
        let same = host.parse::<IpAddr>().ok() == Some(self.to.ip())
            && uri.port_u16().unwrap_or(if self.tls { 443 } else { 80 }) == self.to.port();
        same.then(|| {
            uri.path_and_query()
                .map_or("/".to_owned(), |p| p.to_string())
        })
    }
}

/// gRPC health checking (`grpc.health.v1.Health/Check`): 200 only for SERVING.
async fn grpc_probe(
    to: SocketAddr,
    from: IpAddr,
    service: String,
    timeout: Duration,
) -> anyhow::Result<(StatusCode, Bytes)> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{to}"))?
            .connect_with_connector(tower::service_fn(move |_: hyper::Uri| async move {
                client::connect(to, Some(from))
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }))
            .await?;
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let answer = health
            .check(tonic_health::pb::HealthCheckRequest { service })
            .await?
            .into_inner();
        anyhow::Ok(answer.status())
    };
    match tokio::time::timeout(timeout, check).await {
        Ok(Ok(ServingStatus::Serving)) => Ok((StatusCode::OK, Bytes::new())),
        Ok(Ok(status)) => anyhow::bail!("grpc probe to {to}: {}", status.as_str_name()),
        Ok(Err(err)) => Err(err.context(format!("grpc probe to {to}"))),
        Err(_) => anyhow::bail!("grpc probe to {to}: no answer in {timeout:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));

    #[test]
    fn parses_what_the_injector_writes() {
        let json = r#"{
          "/app-health/web/livez": {"httpGet": {"path": "/healthz", "port": 8080, "scheme": "HTTP",
                                    "httpHeaders": [{"name": "x", "value": "y"}]}, "timeoutSeconds": 3},
          "/app-health/web/readyz": {"tcpSocket": {"port": 8081}, "timeoutSeconds": 1},
          "/app-health/web/startupz": {"grpc": {"port": 8082, "service": "web"}}
        }"#;
        let probers = AppProbers::parse(json, POD).unwrap();
        assert_eq!(probers.probers.len(), 3);
        assert_eq!(probers.probers["/app-health/web/livez"].timeout_seconds, 3);
    }

    #[test]
    fn a_named_port_a_bad_path_or_two_kinds_are_errors_naming_the_probe() {
        let err = AppProbers::parse(
            r#"{"/app-health/web/livez": {"httpGet": {"path": "/", "port": "http"}}}"#,
            POD,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("/app-health/web/livez") && err.contains("\"http\""),
            "{err}"
        );
        let err = AppProbers::parse(r#"{"/health/web/livez": {"tcpSocket": {"port": 1}}}"#, POD)
            .unwrap_err()
            .to_string();
        assert!(err.contains("/health/web/livez"), "{err}");
        let err = AppProbers::parse(
            r#"{"/app-health/web/livez": {"tcpSocket": {"port": 1}, "grpc": {"port": 2}}}"#,
            POD,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("exactly one"), "{err}");
    }
}
