//! A `transport_socket` (on a filter chain or a cluster) as shunt serves it: Envoy's
//! `raw_buffer` (plain bytes, the default) or `tls` (a `DownstreamTlsContext` /
//! `UpstreamTlsContext`), and upstream `internal_upstream` around either (the metadata it
//! passes is read by [`passthrough`]). Anything else is refused by name.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::TransportSocket;
use envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    DownstreamTlsContext, UpstreamTlsContext,
};
use prost::Message;

use super::{DownstreamTls, UpstreamTls};
use shunt_config::{Diagnostics, JsonPath, Reported};

const RAW_BUFFER: &str = "envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer";
const DOWNSTREAM_TLS: &str = "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext";
const UPSTREAM_TLS: &str = "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext";

/// The transport sockets [`downstream`] and [`upstream`] serve: config validation's list
/// of them.
pub const TRANSPORT_SOCKETS: &[&str] = &[
    RAW_BUFFER,
    UPSTREAM_TLS,
    DOWNSTREAM_TLS,
    super::internal_upstream::INTERNAL_UPSTREAM,
];

/// The message type of a socket's `typed_config`; empty when there is none.
fn type_name(socket: &TransportSocket) -> (&str, &[u8]) {
    match &socket.config_type {
        Some(ConfigType::TypedConfig(any)) => (
            any.type_url.rsplit('/').next().unwrap_or_default(),
            any.value.as_slice(),
        ),
        None => ("", &[]),
    }
}

fn decode<M: Message + Default>(
    bytes: &[u8],
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<M> {
    M::decode(bytes)
        .map_err(|e| problems.error(path, format!("cannot decode: {e}")))
        .ok()
}

/// A filter chain's `transport_socket` at `path`: `Ok(None)` for raw bytes, the TLS
/// context to terminate with, or `Err(Reported)` once the problem is reported.
pub fn downstream(
    socket: &TransportSocket,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Result<Option<Arc<DownstreamTls>>, Reported> {
    let typed = path.field("typed_config");
    match type_name(socket) {
        ("", _) | (RAW_BUFFER, _) => Ok(None),
        (DOWNSTREAM_TLS, bytes) => {
            let context: DownstreamTlsContext = decode(bytes, &typed, problems).ok_or(Reported)?;
            DownstreamTls::compile(&context, &typed, problems)
                .map(|tls| Some(Arc::new(tls)))
                .ok_or(Reported)
        }
        (other, _) => {
            problems.error(
                typed,
                format!("downstream transport socket {other} is not implemented"),
            );
            Err(Reported)
        }
    }
}

/// A cluster's `transport_socket` at `path`, as [`downstream`].
pub fn upstream(
    socket: &TransportSocket,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Result<Option<Arc<UpstreamTls>>, Reported> {
    let typed = path.field("typed_config");
    match type_name(socket) {
        ("", _) | (RAW_BUFFER, _) => Ok(None),
        (UPSTREAM_TLS, bytes) => {
            let context: UpstreamTlsContext = decode(bytes, &typed, problems).ok_or(Reported)?;
            UpstreamTls::compile(&context, &typed, problems)
                .map(|tls| Some(Arc::new(tls)))
                .ok_or(Reported)
        }
        (super::internal_upstream::INTERNAL_UPSTREAM, bytes) => {
            let (_, inner) =
                super::internal_upstream::compile(bytes, &typed, problems).ok_or(Reported)?;
            match inner {
                Some(inner) => upstream(&inner, &typed.field("transport_socket"), problems),
                None => Ok(None),
            }
        }
        (other, _) => {
            problems.error(
                typed,
                format!("upstream transport socket {other} is not implemented"),
            );
            Err(Reported)
        }
    }
}

/// The metadata an upstream socket passes to internal listeners: `Some` only for
/// `internal_upstream` (whose problems [`upstream`] reports).
pub fn passthrough(socket: &TransportSocket) -> Option<Arc<super::internal_upstream::Passthrough>> {
    match type_name(socket) {
        (super::internal_upstream::INTERNAL_UPSTREAM, bytes) => {
            let mut ignored = Diagnostics::default();
            super::internal_upstream::compile(bytes, &JsonPath::default(), &mut ignored)
                .map(|(p, _)| Arc::new(p))
        }
        _ => None,
    }
}

/// An endpoint's `envoy.transport_socket_match` metadata: each key with its value's
/// protobuf encoding, so values compare exactly (a string, a number, a list...).
pub type MatchMetadata = std::collections::BTreeMap<String, Vec<u8>>;

/// The metadata namespace transport socket matches read (Envoy's).
const MATCH_NAMESPACE: &str = "envoy.transport_socket_match";

fn encoded(
    fields: &std::collections::HashMap<String, envoy_types::pb::google::protobuf::Value>,
) -> MatchMetadata {
    fields
        .iter()
        .map(|(k, v)| (k.clone(), v.encode_to_vec()))
        .collect()
}

/// The `envoy.transport_socket_match` part of an endpoint's metadata; `None` without.
/// Shared by every endpoint with the same (Istio's `tlsMode: istio`, mostly).
pub fn endpoint_match_metadata(
    metadata: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
) -> Option<Arc<MatchMetadata>> {
    use std::hash::{Hash, Hasher};
    let fields = &metadata?.filter_metadata.get(MATCH_NAMESPACE)?.fields;
    let encoded = encoded(fields);
    let mut hasher = std::hash::DefaultHasher::new();
    encoded.hash(&mut hasher);
    Some(shunt_core::interned::intern(hasher.finish(), &encoded))
}

/// One of a cluster's `transport_socket_matches`: endpoints whose metadata has every
/// field of `criteria` use `socket`. Istio sends `{tlsMode: istio}` → mTLS, then `{}` →
/// raw, so a pod without a sidecar still gets plain TCP.
#[derive(Debug)]
pub struct SocketMatch {
    pub name: String,
    criteria: MatchMetadata,
    pub socket: Option<Arc<UpstreamTls>>,
    /// `internal_upstream`'s metadata to pass, if the socket is one.
    pub passthrough: Option<Arc<super::internal_upstream::Passthrough>>,
}

impl SocketMatch {
    pub fn matches(&self, metadata: Option<&MatchMetadata>) -> bool {
        self.criteria
            .iter()
            .all(|(k, v)| metadata.and_then(|m| m.get(k)) == Some(v))
    }
}

/// A cluster's `transport_socket_matches` at `path`, in order (the first match wins).
pub fn matches(
    matches: &[envoy_types::pb::envoy::config::cluster::v3::cluster::TransportSocketMatch],
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Vec<SocketMatch> {
    let mut out = Vec::new();
    for (i, m) in matches.iter().enumerate() {
        let at = path.index(i);
        let (socket, passthrough) = match &m.transport_socket {
            Some(socket) => match upstream(socket, &at.field("transport_socket"), problems) {
                Ok(tls) => (tls, passthrough(socket)),
                Err(Reported) => continue,
            },
            None => (None, None),
        };
        out.push(SocketMatch {
            name: m.name.clone(),
            criteria: m
                .r#match
                .as_ref()
                .map(|s| encoded(&s.fields))
                .unwrap_or_default(),
            socket,
            passthrough,
        });
    }
    out
}
