//! Envoy's gRPC access log service loggers, `envoy.access_loggers.http_grpc` and
//! `envoy.access_loggers.tcp_grpc` (Istio's `envoyHttpAls` / `envoyTcpAls`
//! providers): each entry becomes an `HTTPAccessLogEntry` or `TCPAccessLogEntry`
//! (`envoy.data.accesslog.v3`), sent in batches to
//! `envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs` with the identifier
//! (node, `log_name`) first.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use envoy_types::pb::envoy::config::core::v3::{
    Address, Node, RequestMethod, SocketAddress, address, socket_address::PortSpecifier,
};
use envoy_types::pb::envoy::data::accesslog::v3::{
    AccessLogCommon, AccessLogType, ConnectionProperties, HttpAccessLogEntry,
    HttpRequestProperties, HttpResponseProperties, ResponseFlags, TcpAccessLogEntry, TlsProperties,
    http_access_log_entry::HttpVersion,
    tls_properties::{CertificateProperties, TlsVersion, certificate_properties},
};
use envoy_types::pb::envoy::service::accesslog::v3::{
    StreamAccessLogsMessage,
    stream_access_logs_message::{
        HttpAccessLogEntries, Identifier, LogEntries, TcpAccessLogEntries,
    },
};
use envoy_types::pb::google::protobuf::{Any, Timestamp, UInt32Value};
use prost::Message;

use super::batch::{Batcher, Exporter};
use super::service::Endpoint;
use shunt_core::access_log::{Entry, ResponseFlag, ServiceSink};

const METHOD: &str = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs";

/// Which entries a logger writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Http,
    Tcp,
}

/// What a gRPC ALS logger adds to every entry, from its config.
#[derive(Debug)]
pub struct Settings {
    pub kind: Kind,
    pub log_name: String,
    pub node: Node,
    pub filter_state_objects_to_log: Vec<String>,
    pub request_headers: Vec<String>,
    pub response_headers: Vec<String>,
}

#[derive(Debug)]
pub struct AlsExporter {
    pub settings: Settings,
    pub endpoint: Arc<Endpoint>,
}

/// One logger: its settings, its buffer and the task that empties it.
#[derive(Debug)]
pub struct AlsLogger(pub Arc<Batcher<AlsExporter>>);

impl ServiceSink for AlsLogger {
    fn log(&self, entry: &Entry) {
        let settings = &self.0.exporter().settings;
        let (message, size) = match settings.kind {
            Kind::Http if entry.http.is_some() => {
                let e = http_entry(entry, settings);
                let size = e.encoded_len();
                (Logged::Http(Box::new(e)), size)
            }
            Kind::Tcp if entry.http.is_none() => {
                let e = tcp_entry(entry, settings);
                let size = e.encoded_len();
                (Logged::Tcp(Box::new(e)), size)
            }
            // An HTTP logger on a tcp_proxy (or the reverse) writes nothing, as Envoy's.
            _ => return,
        };
        self.0.push(message, size);
    }

    fn wants_headers(&self) -> bool {
        let settings = &self.0.exporter().settings;
        settings.kind == Kind::Http
    }
}

#[derive(Debug)]
pub enum Logged {
    Http(Box<HttpAccessLogEntry>),
    Tcp(Box<TcpAccessLogEntry>),
}

impl Exporter for AlsExporter {
    type Message = Logged;

    fn export(&self, batch: &[Logged]) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> {
        let identifier = Some(Identifier {
            node: Some(self.settings.node.clone()),
            log_name: self.settings.log_name.clone(),
        });
        let entries = match self.settings.kind {
            Kind::Http => LogEntries::HttpLogs(HttpAccessLogEntries {
                log_entry: batch
                    .iter()
                    .filter_map(|m| match m {
                        Logged::Http(e) => Some((**e).clone()),
                        Logged::Tcp(_) => None,
                    })
                    .collect(),
            }),
            Kind::Tcp => LogEntries::TcpLogs(TcpAccessLogEntries {
                log_entry: batch
                    .iter()
                    .filter_map(|m| match m {
                        Logged::Tcp(e) => Some((**e).clone()),
                        Logged::Http(_) => None,
                    })
                    .collect(),
            }),
        };
        let message = StreamAccessLogsMessage {
            identifier,
            log_entries: Some(entries),
        };
        let body = crate::common::ext_authz::grpc::frame(&message);
        let endpoint = self.endpoint.clone();
        Box::pin(async move { endpoint.call(METHOD, body).await })
    }
}

/// `%START_TIME%`-style fields every entry shares.
pub fn common(entry: &Entry, settings: &Settings, kind: AccessLogType) -> AccessLogCommon {
    let connection = entry.connection.as_deref();
    let direct_remote = connection.map_or(entry.downstream_remote_address, |c| c.direct_remote);
    AccessLogCommon {
        downstream_remote_address: Some(address(entry.downstream_remote_address)),
        downstream_local_address: Some(address(entry.downstream_local_address)),
        downstream_direct_remote_address: Some(address(direct_remote)),
        start_time: Some(timestamp(entry.start_time())),
        duration: {
            let duration = entry.duration();
            Some(envoy_types::pb::google::protobuf::Duration {
                seconds: duration.as_secs() as i64,
                nanos: duration.subsec_nanos() as i32,
            })
        },
        upstream_remote_address: entry.upstream_host.map(address),
        upstream_local_address: entry.upstream_local_address.map(address),
        upstream_cluster: entry
            .upstream_cluster
            .as_deref()
            .unwrap_or_default()
            .to_owned(),
        // Envoy leaves the flags out when none is raised.
        response_flags: (!entry.response_flags.is_empty())
            .then(|| response_flags(&entry.response_flags)),
        // One attempt when an upstream was chosen (shunt's retries are not counted).
        upstream_request_attempt_count: u32::from(entry.upstream_host.is_some()),
        upstream_transport_failure_reason: entry
            .upstream_transport_failure_reason
            .clone()
            .unwrap_or_default(),
        tls_properties: connection.and_then(tls_properties),
        filter_state_objects: connection
            .map(|c| {
                settings
                    .filter_state_objects_to_log
                    .iter()
                    .filter_map(|key| {
                        let text = c.filter_state.get(key)?.value.serialize_as_string()?;
                        Some((key.clone(), string_value(text)))
                    })
                    .collect()
            })
            .unwrap_or_default(),
        access_log_type: kind as i32,
        ..Default::default()
    }
}

fn http_entry(entry: &Entry, settings: &Settings) -> HttpAccessLogEntry {
    let http = entry.http.as_deref().expect("an HTTP entry");
    let header = |name: &str| {
        http.request_headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    let pick = |headers: Option<&hyper::HeaderMap>, names: &[String]| {
        names
            .iter()
            .filter_map(|name| {
                let value = headers?.get(name.as_str())?;
                Some((
                    name.clone(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                ))
            })
            .collect()
    };
    let mut common = common(entry, settings, AccessLogType::DownstreamEnd);
    common.route_name = http.route_name.as_deref().unwrap_or_default().to_owned();
    HttpAccessLogEntry {
        common_properties: Some(common),
        protocol_version: match http.protocol {
            "HTTP/1.0" => HttpVersion::Http10,
            "HTTP/1.1" => HttpVersion::Http11,
            "HTTP/2" => HttpVersion::Http2,
            "HTTP/3" => HttpVersion::Http3,
            _ => HttpVersion::ProtocolUnspecified,
        } as i32,
        request: Some(HttpRequestProperties {
            request_method: method(&http.method) as i32,
            scheme: http.scheme.to_owned(),
            authority: http.authority.clone().unwrap_or_default(),
            path: http.path.clone(),
            user_agent: http.user_agent.clone().unwrap_or_default(),
            referer: header("referer").unwrap_or_default(),
            forwarded_for: header("x-forwarded-for").unwrap_or_default(),
            request_id: http.request_id.clone().unwrap_or_default(),
            original_path: header("x-envoy-original-path").unwrap_or_default(),
            request_headers_bytes: entry.request_head_bytes,
            request_body_bytes: entry.bytes_received,
            request_headers: pick(http.request_headers.as_ref(), &settings.request_headers),
            ..Default::default()
        }),
        response: Some(HttpResponseProperties {
            response_code: (http.response_code != 0).then_some(UInt32Value {
                value: u32::from(http.response_code),
            }),
            response_headers_bytes: entry.response_head_bytes,
            response_body_bytes: entry.bytes_sent,
            response_headers: pick(http.response_headers.as_ref(), &settings.response_headers),
            response_code_details: http.response_code_details.clone().unwrap_or_default(),
            ..Default::default()
        }),
    }
}

fn tcp_entry(entry: &Entry, settings: &Settings) -> TcpAccessLogEntry {
    TcpAccessLogEntry {
        common_properties: Some(common(entry, settings, AccessLogType::TcpConnectionEnd)),
        connection_properties: Some(ConnectionProperties {
            received_bytes: entry.bytes_received,
            sent_bytes: entry.bytes_sent,
        }),
    }
}

pub fn address(at: SocketAddr) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: at.ip().to_string(),
            port_specifier: Some(PortSpecifier::PortValue(u32::from(at.port()))),
            ..Default::default()
        })),
    }
}

pub fn timestamp(time: SystemTime) -> Timestamp {
    let since = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp {
        seconds: since.as_secs() as i64,
        nanos: since.subsec_nanos() as i32,
    }
}

/// A filter state object's string form, as Envoy packs a `StringAccessor`.
fn string_value(text: String) -> Any {
    let value = envoy_types::pb::google::protobuf::StringValue { value: text };
    Any {
        type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
        value: value.encode_to_vec(),
    }
}

fn method(name: &str) -> RequestMethod {
    match name {
        "GET" => RequestMethod::Get,
        "HEAD" => RequestMethod::Head,
        "POST" => RequestMethod::Post,
        "PUT" => RequestMethod::Put,
        "DELETE" => RequestMethod::Delete,
        "CONNECT" => RequestMethod::Connect,
        "OPTIONS" => RequestMethod::Options,
        "TRACE" => RequestMethod::Trace,
        "PATCH" => RequestMethod::Patch,
        _ => RequestMethod::MethodUnspecified,
    }
}

fn response_flags(flags: &[ResponseFlag]) -> ResponseFlags {
    let mut out = ResponseFlags::default();
    for flag in flags {
        match flag {
            ResponseFlag::UpstreamConnectionFailure => out.upstream_connection_failure = true,
            ResponseFlag::NoHealthyUpstream => out.no_healthy_upstream = true,
            ResponseFlag::NoRouteFound => out.no_route_found = true,
            ResponseFlag::UpstreamRemoteReset => out.upstream_remote_reset = true,
            ResponseFlag::DownstreamRemoteReset => out.downstream_remote_reset = true,
            ResponseFlag::UpstreamOverflow => out.upstream_overflow = true,
            ResponseFlag::NoClusterFound => out.no_cluster_found = true,
            ResponseFlag::UpstreamRequestTimeout => out.upstream_request_timeout = true,
            ResponseFlag::UpstreamConnectionTermination => {
                out.upstream_connection_termination = true;
            }
            ResponseFlag::DownstreamConnectionTermination => {
                out.downstream_connection_termination = true;
            }
            ResponseFlag::DownstreamProtocolError => out.downstream_protocol_error = true,
            ResponseFlag::UpstreamProtocolError => out.upstream_protocol_error = true,
            ResponseFlag::StreamIdleTimeout => out.stream_idle_timeout = true,
            ResponseFlag::FaultInjected => out.fault_injected = true,
            ResponseFlag::DelayInjected => out.delay_injected = true,
            ResponseFlag::UnauthorizedExternalService => {
                out.unauthorized_details = Some(
                    envoy_types::pb::envoy::data::accesslog::v3::response_flags::Unauthorized {
                        reason: 1,
                    },
                );
            }
            ResponseFlag::RateLimited => out.rate_limited = true,
            ResponseFlag::RateLimitServiceError => out.rate_limit_service_error = true,
        }
    }
    out
}

fn tls_properties(connection: &shunt_core::stream_info::Connection) -> Option<TlsProperties> {
    let tls = connection.tls.as_deref()?;
    let uris = |sans: &[String]| {
        sans.iter()
            .map(|uri| certificate_properties::SubjectAltName {
                san: Some(certificate_properties::subject_alt_name::San::Uri(
                    uri.clone(),
                )),
            })
            .collect::<Vec<_>>()
    };
    Some(TlsProperties {
        tls_version: match tls.version {
            Some("TLSv1") => TlsVersion::TlSv1,
            Some("TLSv1.1") => TlsVersion::TlSv11,
            Some("TLSv1.2") => TlsVersion::TlSv12,
            Some("TLSv1.3") => TlsVersion::TlSv13,
            _ => TlsVersion::VersionUnspecified,
        } as i32,
        tls_sni_hostname: connection.requested_server_name.clone().unwrap_or_default(),
        local_certificate_properties: Some(CertificateProperties {
            subject_alt_name: uris(&tls.local_uri_sans),
            ..Default::default()
        }),
        peer_certificate_properties: tls.peer_certificate_presented.then(|| {
            CertificateProperties {
                subject_alt_name: uris(&tls.peer_uri_sans),
                subject: tls.peer_subject.clone().unwrap_or_default(),
                ..Default::default()
            }
        }),
        ..Default::default()
    })
}
