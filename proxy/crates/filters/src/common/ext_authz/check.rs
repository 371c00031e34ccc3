//! The `CheckRequest` Envoy sends for a request, and what a `CheckResponse` (or a
//! failed call) means for it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::SystemTime;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    Address, HeaderValueOption, SocketAddress, address, socket_address,
};
use envoy_types::pb::envoy::service::auth::v3::{
    AttributeContext, CheckRequest, CheckResponse, attribute_context, check_response,
};
use envoy_types::pb::google::protobuf::Timestamp;
use hyper::HeaderMap;

/// What a check reads from the request and its connection.
#[derive(Debug, Default)]
pub struct CheckInput<'a> {
    pub source: Option<SocketAddr>,
    pub destination: Option<SocketAddr>,
    /// The peer certificate's URI SAN (else subject), as Envoy's `principal`.
    pub source_principal: &'a str,
    /// The local certificate's URI SAN.
    pub destination_principal: &'a str,
    /// The peer certificate, URL-encoded PEM, when `include_peer_certificate`.
    pub source_certificate: &'a str,
    pub sni: Option<&'a str>,
    pub stream_id: u64,
    pub method: &'a str,
    /// Path and query, as forwarded.
    pub path: &'a str,
    pub host: &'a str,
    pub scheme: &'a str,
    /// `HTTP/1.0`, `HTTP/1.1`, `HTTP/2`.
    pub protocol: &'a str,
    pub headers: Option<&'a HeaderMap>,
    /// The buffered body, when `with_request_body`.
    pub body: Option<&'a [u8]>,
    pub pack_as_bytes: bool,
    pub context_extensions: HashMap<String, String>,
}

fn socket(addr: SocketAddr) -> Address {
    Address {
        address: Some(address::Address::SocketAddress(SocketAddress {
            address: addr.ip().to_string(),
            port_specifier: Some(socket_address::PortSpecifier::PortValue(u32::from(
                addr.port(),
            ))),
            ..Default::default()
        })),
    }
}

/// Envoy's `CheckRequestUtils::createHttpCheck`: the peers, the request's headers (one
/// entry per name, values joined with `,`; pseudo-headers included as HTTP/2 has
/// them), its body when buffered, and the route's context extensions.
pub fn request(input: &CheckInput<'_>) -> CheckRequest {
    let mut headers = HashMap::new();
    headers.insert(":authority".to_owned(), input.host.to_owned());
    headers.insert(":method".to_owned(), input.method.to_owned());
    headers.insert(":path".to_owned(), input.path.to_owned());
    if input.protocol == "HTTP/2" {
        headers.insert(":scheme".to_owned(), input.scheme.to_owned());
    }
    if let Some(map) = input.headers {
        for name in map.keys() {
            let joined = map
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect::<Vec<_>>()
                .join(",");
            headers.insert(name.as_str().to_owned(), joined);
        }
    }
    let (body, raw_body, size) = match input.body {
        Some(b) if input.pack_as_bytes => (String::new(), b.to_vec(), b.len() as i64),
        Some(b) => (
            String::from_utf8_lossy(b).into_owned(),
            Vec::new(),
            b.len() as i64,
        ),
        None => (
            String::new(),
            Vec::new(),
            input
                .headers
                .and_then(|h| h.get(hyper::header::CONTENT_LENGTH))
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .unwrap_or(-1),
        ),
    };
    let (path, query) = match input.path.split_once('?') {
        Some((p, q)) => (p, q),
        None => (input.path, ""),
    };
    let _ = path;
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    CheckRequest {
        attributes: Some(AttributeContext {
            source: Some(attribute_context::Peer {
                address: input.source.map(socket),
                principal: input.source_principal.to_owned(),
                certificate: input.source_certificate.to_owned(),
                ..Default::default()
            }),
            destination: Some(attribute_context::Peer {
                address: input.destination.map(socket),
                principal: input.destination_principal.to_owned(),
                ..Default::default()
            }),
            request: Some(attribute_context::Request {
                time: Some(Timestamp {
                    seconds: now.as_secs() as i64,
                    nanos: now.subsec_nanos() as i32,
                }),
                http: Some(attribute_context::HttpRequest {
                    id: input.stream_id.to_string(),
                    method: input.method.to_owned(),
                    headers,
                    path: input.path.to_owned(),
                    host: input.host.to_owned(),
                    scheme: input.scheme.to_owned(),
                    query: query.to_owned(),
                    size,
                    protocol: input.protocol.to_owned(),
                    body,
                    raw_body,
                    ..Default::default()
                }),
            }),
            context_extensions: input.context_extensions.clone(),
            tls_session: input.sni.map(|sni| attribute_context::TlsSession {
                sni: sni.to_owned(),
            }),
            ..Default::default()
        }),
    }
}

/// How one header from the check response is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Apply {
    /// Replace every value (or add).
    Set,
    /// Add the value after the present ones, comma-joined into one (Envoy's
    /// `appendCopy`); nothing when the header is absent.
    Append,
    /// Only if absent.
    AddIfAbsent,
    /// Only if present, replacing.
    OverwriteIfExists,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderChange {
    pub name: String,
    pub value: String,
    pub apply: Apply,
}

/// In ext_authz responses `append` defaults to false (set); `append_action` is used
/// when `append` is absent and it is not the default.
#[allow(deprecated)]
fn change(h: &HeaderValueOption) -> Option<HeaderChange> {
    let header = h.header.as_ref()?;
    let value = if header.value.is_empty() {
        String::from_utf8_lossy(&header.raw_value).into_owned()
    } else {
        header.value.clone()
    };
    let apply = match h.append {
        Some(a) if a.value => Apply::Append,
        Some(_) => Apply::Set,
        None => match HeaderAppendAction::try_from(h.append_action) {
            Ok(HeaderAppendAction::AddIfAbsent) => Apply::AddIfAbsent,
            Ok(HeaderAppendAction::OverwriteIfExistsOrAdd) => Apply::Set,
            Ok(HeaderAppendAction::OverwriteIfExists) => Apply::OverwriteIfExists,
            Ok(HeaderAppendAction::AppendIfExistsOrAdd) | Err(_) => Apply::Set,
        },
    };
    Some(HeaderChange {
        name: header.key.to_ascii_lowercase(),
        value,
        apply,
    })
}

/// Applies `changes` to `headers`, skipping names or values HTTP cannot carry.
pub fn apply(headers: &mut HeaderMap, changes: &[HeaderChange]) {
    use hyper::header::{HeaderName, HeaderValue};
    for c in changes {
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(c.name.as_bytes()),
            HeaderValue::from_str(&c.value),
        ) else {
            tracing::debug!(header = %c.name, "ext_authz: skipping a header HTTP cannot carry");
            continue;
        };
        match c.apply {
            Apply::Set => {
                headers.insert(name, value);
            }
            // Envoy's ext_authz appends only to a header the request has.
            Apply::Append if !headers.contains_key(&name) => {}
            Apply::Append => {
                let joined = headers
                    .get_all(&name)
                    .iter()
                    .map(|v| v.as_bytes())
                    .chain([value.as_bytes()])
                    .collect::<Vec<_>>()
                    .join(&b","[..]);
                if let Ok(joined) = HeaderValue::from_bytes(&joined) {
                    headers.insert(name, joined);
                }
            }
            Apply::AddIfAbsent => {
                if !headers.contains_key(&name) {
                    headers.insert(name, value);
                }
            }
            Apply::OverwriteIfExists => {
                if headers.contains_key(&name) {
                    headers.insert(name, value);
                }
            }
        }
    }
}

/// What the authorization service decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Allowed {
    /// To the upstream request.
    pub upstream: Vec<HeaderChange>,
    pub remove: Vec<String>,
    /// To the response sent downstream.
    pub downstream: Vec<HeaderChange>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Denied {
    pub status: u16,
    pub headers: Vec<HeaderChange>,
    pub body: Bytes,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow(Allowed),
    Deny(Denied),
    /// The call failed (transport, timeout, not a valid answer).
    Error(String),
}

/// Envoy's reading of a `CheckResponse`: `status.code` 0 allows, anything else
/// denies (403 unless the denied response names a status).
pub fn verdict(response: &CheckResponse) -> Verdict {
    let code = response.status.as_ref().map_or(0, |s| s.code);
    if code == 0 {
        let mut allowed = Allowed::default();
        if let Some(check_response::HttpResponse::OkResponse(ok)) = &response.http_response {
            allowed.upstream = ok.headers.iter().filter_map(change).collect();
            allowed.remove = ok
                .headers_to_remove
                .iter()
                .map(|h| h.to_ascii_lowercase())
                // Envoy never removes pseudo-headers or Host this way.
                .filter(|h| !h.starts_with(':') && h != "host")
                .collect();
            allowed.downstream = ok
                .response_headers_to_add
                .iter()
                .filter_map(change)
                .collect();
        }
        return Verdict::Allow(allowed);
    }
    let mut denied = Denied {
        status: 403,
        headers: Vec::new(),
        body: Bytes::new(),
    };
    if let Some(check_response::HttpResponse::DeniedResponse(d)) = &response.http_response {
        if let Some(status) = d.status.as_ref().filter(|s| (200..600).contains(&s.code)) {
            denied.status = status.code as u16;
        }
        denied.headers = d.headers.iter().filter_map(change).collect();
        denied.body = Bytes::from(d.body.clone());
    }
    Verdict::Deny(denied)
}
