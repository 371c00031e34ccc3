//! `tcp_proxy`'s `tunneling_config`: instead of copying bytes straight to the upstream
//! connection, send them through an HTTP CONNECT tunnel (`:method CONNECT`,
//! `:authority` the configured `hostname`, the `headers_to_add`), and copy once the
//! upstream answers 200. Over HTTP/2, as Istio's HBONE, tunnels are streams of the
//! cluster's pooled connection to the host, as in Envoy (many tunnels, one mTLS
//! connection); over HTTP/1.1 each tunnel has a connection of its own. The hostname
//! and header values are Envoy format strings with the downstream connection's
//! commands.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::TunnelingConfig as EnvoyTunneling;
use http_body_util::Empty;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, Request, StatusCode, Version};
use hyper_util::rt::{TokioExecutor, TokioIo};

use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::FilterState;
use shunt_tls::TransportStream;
use shunt_upstream::http_pool::RequestBody;
use shunt_upstream::tunnel_pool::{MAX_STREAMS, TunnelSlot};
use shunt_upstream::{Cluster, host::Host};

/// One piece of a format string.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    LocalAddress,
    LocalAddressWithoutPort,
    LocalPort,
    RemoteAddress,
    RemoteAddressWithoutPort,
    RemotePort,
    /// `%FILTER_STATE(key:PLAIN)%` (`plain`), else the object's JSON string, from the
    /// connection's filter state; a missing object renders empty (and a header whose
    /// value is empty is not sent, as in Envoy).
    FilterState {
        key: String,
        plain: bool,
    },
}

/// A compiled format string with the commands a tunnel's headers use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format(Vec<Piece>);

/// What a connection's format strings may name.
#[derive(Debug, Clone)]
pub struct Downstream {
    /// The local address (the original destination once restored).
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The connection's filter state (set by its network filters).
    pub filter_state: FilterState,
}

impl Format {
    /// Compiles `text` at `path`; an unknown command is an error.
    pub fn compile(text: &str, path: &JsonPath, problems: &mut Diagnostics) -> Option<Format> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find('%') {
            if start > 0 {
                pieces.push(Piece::Text(rest[..start].to_owned()));
            }
            let after = &rest[start + 1..];
            let Some(end) = after.find('%') else {
                problems.error(path, format!("{text:?}: a '%' without its closing '%'"));
                return None;
            };
            let command = &after[..end];
            pieces.push(match command {
                "" => Piece::Text("%".into()),
                "DOWNSTREAM_LOCAL_ADDRESS" => Piece::LocalAddress,
                "DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => Piece::LocalAddressWithoutPort,
                "DOWNSTREAM_LOCAL_PORT" => Piece::LocalPort,
                "DOWNSTREAM_REMOTE_ADDRESS" => Piece::RemoteAddress,
                "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => Piece::RemoteAddressWithoutPort,
                "DOWNSTREAM_REMOTE_PORT" => Piece::RemotePort,
                c if c.starts_with("FILTER_STATE(") && c.ends_with(')') => {
                    let arg = &c["FILTER_STATE(".len()..c.len() - 1];
                    match arg.rsplit_once(':') {
                        Some((key, "PLAIN")) => Piece::FilterState {
                            key: key.to_owned(),
                            plain: true,
                        },
                        Some((key, "TYPED")) => Piece::FilterState {
                            key: key.to_owned(),
                            plain: false,
                        },
                        _ => Piece::FilterState {
                            key: arg.to_owned(),
                            plain: false,
                        },
                    }
                }
                other => {
                    problems.error(
                        path,
                        format!(
                            "{text:?}: the command %{other}% is not implemented in tunneling_config"
                        ),
                    );
                    return None;
                }
            });
            rest = &after[end + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        Some(Format(pieces))
    }

    pub fn render(&self, d: &Downstream) -> String {
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::LocalAddress => out.push_str(&d.local.to_string()),
                Piece::LocalAddressWithoutPort => out.push_str(&d.local.ip().to_string()),
                Piece::LocalPort => out.push_str(&d.local.port().to_string()),
                Piece::RemoteAddress => out.push_str(&d.remote.to_string()),
                Piece::RemoteAddressWithoutPort => out.push_str(&d.remote.ip().to_string()),
                Piece::RemotePort => out.push_str(&d.remote.port().to_string()),
                Piece::FilterState { key, plain } => {
                    if let Some(value) = d.filter_state.get_string(key) {
                        if *plain {
                            out.push_str(&value);
                        } else {
                            out.push_str(&serde_json::Value::String(value).to_string());
                        }
                    }
                }
            }
        }
        out
    }
}

#[derive(Debug)]
pub struct Tunneling {
    pub hostname: Format,
    pub headers: Vec<(HeaderName, Format)>,
}

/// Compiles `tunneling_config` at `path`.
pub fn compile(
    config: &EnvoyTunneling,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Tunneling> {
    let errors_before = problems.errors.len();
    if config.hostname.is_empty() {
        problems.error(path.field("hostname"), "is required");
    }
    if config.use_post {
        problems.error(
            path.field("use_post"),
            "tunneling with POST is not implemented; only CONNECT",
        );
    }
    if config.propagate_response_headers || config.propagate_response_trailers {
        problems.warning(
            path,
            "propagate_response_headers/trailers are not implemented; the tunnel's response headers are not kept",
        );
    }
    let hostname = Format::compile(&config.hostname, &path.field("hostname"), problems);
    let mut headers = Vec::new();
    for (i, option) in config.headers_to_add.iter().enumerate() {
        let h_path = path.field("headers_to_add").index(i).field("header");
        let Some(header) = &option.header else {
            problems.error(&h_path, "is required");
            continue;
        };
        let Ok(name) = HeaderName::from_bytes(header.key.as_bytes()) else {
            problems.error(
                h_path.field("key"),
                format!("{:?} is not a header name", header.key),
            );
            continue;
        };
        if name.as_str().starts_with(':') || name == hyper::header::HOST {
            problems.error(
                h_path.field("key"),
                "pseudo-headers and host cannot be added",
            );
            continue;
        }
        let value = if header.raw_value.is_empty() {
            header.value.clone()
        } else {
            String::from_utf8_lossy(&header.raw_value).into_owned()
        };
        if let Some(format) = Format::compile(&value, &h_path.field("value"), problems) {
            headers.push((name, format));
        }
    }
    if problems.errors.len() > errors_before {
        return None;
    }
    Some(Tunneling {
        hostname: hostname?,
        headers,
    })
}

/// Why a tunnel could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    #[error("HTTP handshake with the tunnel's upstream failed: {0}")]
    Handshake(hyper::Error),
    #[error("the CONNECT request failed: {0}")]
    Request(hyper::Error),
    #[error("the upstream answered the CONNECT with {0}")]
    Refused(StatusCode),
    #[error("the CONNECT request is invalid: {0}")]
    Invalid(String),
    #[error("the tunnel did not open: {0}")]
    Upgrade(hyper::Error),
    #[error("no HTTP/2 connection to the tunnel's upstream: {0}")]
    Checkout(shunt_upstream::http_pool::CheckoutError),
}

impl Tunneling {
    /// The CONNECT request for the downstream `d`.
    fn request<B>(&self, d: &Downstream, http2: bool, body: B) -> Result<Request<B>, TunnelError> {
        let authority = self.hostname.render(d);
        let mut request = Request::builder()
            .method(Method::CONNECT)
            .uri(authority.as_str())
            .version(if http2 {
                Version::HTTP_2
            } else {
                Version::HTTP_11
            });
        if !http2 {
            request = request.header(hyper::header::HOST, authority.as_str());
        }
        let mut request = request
            .body(body)
            .map_err(|e| TunnelError::Invalid(format!("{authority:?}: {e}")))?;
        for (name, format) in &self.headers {
            let value = format.render(d);
            if value.is_empty() {
                continue;
            }
            let value = HeaderValue::from_str(&value)
                .map_err(|e| TunnelError::Invalid(format!("{name}: {e}")))?;
            request.headers_mut().insert(name.clone(), value);
        }
        Ok(request)
    }

    /// Opens the tunnel as a stream of one of the cluster's HTTP/2 connections to
    /// `host` (made if none has room); the returned stream carries the tunnel's bytes,
    /// the slot counts it on its connection while held.
    pub async fn open_pooled(
        &self,
        cluster: &Arc<Cluster>,
        host: &Arc<Host>,
        secrets: &shunt_tls::Secrets,
        d: &Downstream,
    ) -> Result<(TransportStream, TunnelSlot), TunnelError> {
        let request = self.request(d, true, RequestBody::empty())?;
        let (mut sender, slot) = cluster
            .tunnel_pools
            .checkout(cluster, host, secrets, MAX_STREAMS)
            .await
            .map_err(TunnelError::Checkout)?;
        cluster.stats.upstream_rq_total.inc();
        let response = sender
            .send_request(request)
            .await
            .map_err(TunnelError::Request)?;
        cluster.stats.charge(response.status().as_u16());
        Ok((upgraded(response).await?, slot))
    }

    /// Opens the tunnel on `upstream`, a connection of its own, with HTTP/1.1 (or
    /// HTTP/2 when `http2`).
    pub async fn open(
        &self,
        upstream: TransportStream,
        http2: bool,
        d: &Downstream,
    ) -> Result<TransportStream, TunnelError> {
        let request = self.request(d, http2, Empty::<Bytes>::new())?;
        let io = TokioIo::new(upstream);
        let response = if http2 {
            let (mut sender, connection) =
                hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                    .handshake(io)
                    .await
                    .map_err(TunnelError::Handshake)?;
            tokio::spawn(async move {
                if let Err(err) = connection.await {
                    tracing::debug!(%err, "tunnel's HTTP/2 connection ended with an error");
                }
            });
            sender
                .send_request(request)
                .await
                .map_err(TunnelError::Request)?
        } else {
            let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(TunnelError::Handshake)?;
            tokio::spawn(async move {
                if let Err(err) = connection.with_upgrades().await {
                    tracing::debug!(%err, "tunnel's HTTP/1.1 connection ended with an error");
                }
            });
            sender
                .send_request(request)
                .await
                .map_err(TunnelError::Request)?
        };
        upgraded(response).await
    }
}

/// The tunnel a CONNECT's 200 opened.
async fn upgraded(
    mut response: hyper::Response<hyper::body::Incoming>,
) -> Result<TransportStream, TunnelError> {
    if response.status() != StatusCode::OK {
        return Err(TunnelError::Refused(response.status()));
    }
    let upgraded = hyper::upgrade::on(&mut response)
        .await
        .map_err(TunnelError::Upgrade)?;
    Ok(TransportStream::in_process(TokioIo::new(upgraded)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn downstream() -> Downstream {
        Downstream {
            local: "10.0.0.5:80".parse().unwrap(),
            remote: "10.0.0.1:40000".parse().unwrap(),
            filter_state: FilterState::default(),
        }
    }

    #[test]
    fn istio_hostname_renders_the_original_destination() {
        let mut problems = Diagnostics::default();
        let f = Format::compile(
            "%DOWNSTREAM_LOCAL_ADDRESS%",
            &JsonPath::new("h"),
            &mut problems,
        )
        .unwrap();
        assert_eq!(f.render(&downstream()), "10.0.0.5:80");
        let f = Format::compile(
            "%DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT%:15008 from %DOWNSTREAM_REMOTE_PORT% 100%%",
            &JsonPath::new("h"),
            &mut problems,
        )
        .unwrap();
        assert_eq!(f.render(&downstream()), "10.0.0.5:15008 from 40000 100%");
        // Istio's baggage header: nothing is sent while no filter set the object.
        let f = Format::compile(
            "%FILTER_STATE(io.istio.baggage:PLAIN)%",
            &JsonPath::new("h"),
            &mut problems,
        )
        .unwrap();
        assert_eq!(f.render(&downstream()), "");
        let mut d = downstream();
        d.filter_state
            .set(
                "io.istio.baggage",
                std::sync::Arc::new(shunt_core::stream_info::StringAccessor(
                    "k8s.pod.name=a".into(),
                )),
                true,
                shunt_core::stream_info::LifeSpan::Connection,
            )
            .unwrap();
        assert_eq!(f.render(&d), "k8s.pod.name=a");
        let json = Format::compile(
            "%FILTER_STATE(io.istio.baggage)%",
            &JsonPath::new("h"),
            &mut problems,
        )
        .unwrap();
        assert_eq!(json.render(&d), "\"k8s.pod.name=a\"");
        assert!(problems.errors.is_empty(), "{problems:?}");
    }

    #[test]
    fn unknown_commands_and_post_are_refused_at_their_paths() {
        let config = EnvoyTunneling {
            hostname: "%UPSTREAM_WHATEVER%".into(),
            use_post: true,
            ..Default::default()
        };
        let mut problems = Diagnostics::default();
        assert!(compile(&config, &JsonPath::new("t"), &mut problems).is_none());
        let paths: Vec<&str> = problems.errors.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(paths, ["t.use_post", "t.hostname"]);
        assert!(problems.errors[1].message.contains("%UPSTREAM_WHATEVER%"));
    }
}
