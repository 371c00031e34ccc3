//! Envoy's stream info: what filters share about one downstream connection
//! ([`Connection`]: addresses, SNI, ALPN, the TLS peer) and one HTTP stream
//! ([`StreamInfo`]: filter state, dynamic metadata, response code and flags, the
//! upstream, bytes, timing).
//!
//! Cheap when nothing reads it: a [`Connection`] is built once per connection and
//! shared by `Arc`; an empty [`FilterState`] or [`Metadata`] allocates nothing.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// Envoy's response flags that a TCP passthrough can raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseFlag {
    /// `UF`: upstream connection failure (refused, unreachable or timed out).
    UpstreamConnectionFailure,
    /// `UH`: no healthy upstream; we raise it where Istio's BlackHoleCluster would, for
    /// a destination that would loop back into the proxy.
    NoHealthyUpstream,
    /// `NR`: no route; the connection had no original destination to pass through to.
    NoRouteFound,
    /// `UR`: the upstream reset the connection (or failed while bytes were flowing).
    UpstreamRemoteReset,
    /// `DR`: the downstream reset the connection (or failed while bytes were flowing).
    DownstreamRemoteReset,
    /// `UO`: upstream overflow; the cluster's circuit breaker refused the connection.
    UpstreamOverflow,
    /// `NC`: the cluster the filter names does not exist.
    NoClusterFound,
    /// `UT`: the upstream did not answer an HTTP request within the route's timeout.
    UpstreamRequestTimeout,
    /// `UC`: the upstream closed the connection before its HTTP response was complete.
    UpstreamConnectionTermination,
    /// `DC`: the downstream went away before its HTTP response was sent.
    DownstreamConnectionTermination,
    /// `DPE`: the downstream's HTTP request broke the protocol (a bad chunk, a malformed
    /// request target).
    DownstreamProtocolError,
    /// `UPE`: the upstream's HTTP response broke the protocol (it could not be parsed).
    UpstreamProtocolError,
    /// `SI`: the stream was idle for `stream_idle_timeout`.
    StreamIdleTimeout,
    /// `FI`: the fault filter aborted the request.
    FaultInjected,
    /// `DI`: the fault filter delayed the request.
    DelayInjected,
    /// `UAEX`: the external authorization service denied the request.
    UnauthorizedExternalService,
    /// `RL`: a rate limit filter refused the request.
    RateLimited,
    /// `RLSE`: the rate limit service failed and the filter denies when it does.
    RateLimitServiceError,
}

impl ResponseFlag {
    /// Every flag shunt raises.
    pub const ALL: &'static [ResponseFlag] = &[
        Self::UpstreamConnectionFailure,
        Self::NoHealthyUpstream,
        Self::NoRouteFound,
        Self::UpstreamRemoteReset,
        Self::DownstreamRemoteReset,
        Self::UpstreamOverflow,
        Self::NoClusterFound,
        Self::UpstreamRequestTimeout,
        Self::UpstreamConnectionTermination,
        Self::DownstreamConnectionTermination,
        Self::DownstreamProtocolError,
        Self::UpstreamProtocolError,
        Self::StreamIdleTimeout,
        Self::FaultInjected,
        Self::DelayInjected,
        Self::UnauthorizedExternalService,
        Self::RateLimited,
        Self::RateLimitServiceError,
    ];

    pub fn code(self) -> &'static str {
        match self {
            Self::UpstreamConnectionFailure => "UF",
            Self::NoHealthyUpstream => "UH",
            Self::NoRouteFound => "NR",
            Self::UpstreamRemoteReset => "UR",
            Self::DownstreamRemoteReset => "DR",
            Self::UpstreamOverflow => "UO",
            Self::NoClusterFound => "NC",
            Self::UpstreamRequestTimeout => "UT",
            Self::StreamIdleTimeout => "SI",
            Self::FaultInjected => "FI",
            Self::DelayInjected => "DI",
            Self::UnauthorizedExternalService => "UAEX",
            Self::RateLimited => "RL",
            Self::RateLimitServiceError => "RLSE",
            Self::UpstreamConnectionTermination => "UC",
            Self::DownstreamConnectionTermination => "DC",
            Self::DownstreamProtocolError => "DPE",
            Self::UpstreamProtocolError => "UPE",
        }
    }
}

/// One downstream connection as filters see it.
#[derive(Debug, Clone)]
pub struct Connection {
    /// The downstream's local address: the original destination once restored.
    pub local: SocketAddr,
    /// The address the connection was accepted on (before any restore).
    pub socket_local: SocketAddr,
    /// The downstream's remote address (Envoy's `remote_ip`: the same unless a proxy
    /// protocol or XFF changes it).
    pub remote: SocketAddr,
    /// The peer of the TCP connection itself (Envoy's `direct_remote_ip`).
    pub direct_remote: SocketAddr,
    /// SNI from the TLS inspector or the terminated handshake.
    pub requested_server_name: Option<String>,
    /// The ALPN protocol negotiated (TLS) or detected (`http_inspector`).
    pub alpn: Option<String>,
    /// Set when shunt terminated TLS on the connection.
    pub tls: Option<Arc<Tls>>,
    /// Connection-lived filter state set by network filters (`istio_authn`,
    /// `set_filter_state`, metadata exchange); each HTTP stream sees it below its own.
    pub filter_state: FilterState,
    /// Connection-level dynamic metadata from network filters.
    pub metadata: Metadata,
    /// Response flags network filters set (ext_authz's `UAEX` on a connection it
    /// closed), for the connection's access log.
    pub response_flags: Vec<ResponseFlag>,
}

impl Connection {
    pub fn new(local: SocketAddr, remote: SocketAddr) -> Self {
        Connection {
            local,
            socket_local: local,
            remote,
            direct_remote: remote,
            requested_server_name: None,
            alpn: None,
            tls: None,
            filter_state: FilterState::default(),
            metadata: Metadata::default(),
            response_flags: Vec::new(),
        }
    }

    /// The peer certificate's identity as Envoy's `authenticated.principal_name` reads
    /// it: its URI SANs, else its DNS SANs, else its subject.
    pub fn peer_principals(&self) -> impl Iterator<Item = &str> {
        let tls = self.tls.as_deref();
        let (uris, dns) = tls.map_or((&[][..], &[][..]), |t| {
            (&t.peer_uri_sans[..], &t.peer_dns_sans[..])
        });
        let subject = tls
            .filter(|_| uris.is_empty() && dns.is_empty())
            .and_then(|t| t.peer_subject.as_deref());
        let sans = if uris.is_empty() { dns } else { uris };
        sans.iter().map(String::as_str).chain(subject)
    }
}

/// A TLS session shunt terminated.
#[derive(Debug, Clone, Default)]
pub struct Tls {
    /// Whether the peer presented a certificate (mTLS).
    pub peer_certificate_presented: bool,
    pub peer_uri_sans: Vec<String>,
    pub peer_dns_sans: Vec<String>,
    /// The peer certificate's subject, RFC 2253 text, when known.
    pub peer_subject: Option<String>,
    /// The URI SANs of the certificate shunt presented.
    pub local_uri_sans: Vec<String>,
    pub version: Option<&'static str>,
}

/// Envoy's `FilterState::LifeSpan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LifeSpan {
    #[default]
    FilterChain,
    Request,
    Connection,
}

/// An object in the filter state. Filters downcast through [`FilterStateObject::as_any`].
pub trait FilterStateObject: fmt::Debug + Send + Sync + 'static {
    /// Envoy's `serializeAsString`: what `filter_state` string matchers and
    /// `%FILTER_STATE(...)%` read; `None` when the object has no string form.
    fn serialize_as_string(&self) -> Option<String>;
    fn as_any(&self) -> &dyn Any;
}

/// A plain string value (Envoy's `StringAccessor`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StringAccessor(pub String);

impl FilterStateObject for StringAccessor {
    fn serialize_as_string(&self) -> Option<String> {
        Some(self.0.clone())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[derive(Debug, Clone)]
pub struct FilterStateEntry {
    pub value: Arc<dyn FilterStateObject>,
    pub read_only: bool,
    pub life_span: LifeSpan,
    /// Envoy's `StreamSharing::SHARED_WITH_UPSTREAM_CONNECTION`.
    pub shared_with_upstream: bool,
    /// With `shared_with_upstream`: the upstream connection shares it again (Envoy's
    /// `TRANSITIVE`); else only that connection gets it (`ONCE`).
    pub transitive: bool,
}

/// Why a filter state write was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("filter state object {0:?} is read-only")]
pub struct ReadOnly(pub String);

/// Envoy's filter state: named objects. Few entries, so a vector (no allocation
/// until the first).
#[derive(Debug, Clone, Default)]
pub struct FilterState {
    entries: Vec<(Arc<str>, FilterStateEntry)>,
}

impl FilterState {
    /// Sets `name`; refused when an existing object of that name is read-only (Envoy).
    pub fn set(
        &mut self,
        name: &str,
        value: Arc<dyn FilterStateObject>,
        read_only: bool,
        life_span: LifeSpan,
    ) -> Result<(), ReadOnly> {
        let entry = FilterStateEntry {
            value,
            read_only,
            life_span,
            shared_with_upstream: false,
            transitive: false,
        };
        self.set_entry(name, entry)
    }

    pub fn set_entry(&mut self, name: &str, entry: FilterStateEntry) -> Result<(), ReadOnly> {
        match self.entries.iter_mut().find(|(n, _)| &**n == name) {
            Some((_, existing)) if existing.read_only => Err(ReadOnly(name.to_owned())),
            Some((_, existing)) => {
                *existing = entry;
                Ok(())
            }
            None => {
                self.entries.push((name.into(), entry));
                Ok(())
            }
        }
    }

    pub fn get(&self, name: &str) -> Option<&FilterStateEntry> {
        self.entries
            .iter()
            .find(|(n, _)| &**n == name)
            .map(|(_, e)| e)
    }

    /// The object named `name` as `T`, if it is one.
    pub fn get_as<T: 'static>(&self, name: &str) -> Option<&T> {
        self.get(name)?.value.as_any().downcast_ref()
    }

    /// The object's string form (what `filter_state` matchers compare).
    pub fn get_string(&self, name: &str) -> Option<String> {
        self.get(name)?.value.serialize_as_string()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &FilterStateEntry)> {
        self.entries.iter().map(|(n, e)| (&**n, e))
    }
    /// The objects shared with an upstream connection, as that connection's filter
    /// state (an internal listener's) holds them: for the connection's life, a
    /// `TRANSITIVE` one shared again, a `ONCE` one no further (Envoy's
    /// `objectsSharedWithUpstreamConnection`).
    pub fn shared_with_upstream(&self) -> FilterState {
        FilterState {
            entries: self
                .entries
                .iter()
                .filter(|(_, e)| e.shared_with_upstream)
                .map(|(name, e)| {
                    let entry = FilterStateEntry {
                        value: e.value.clone(),
                        read_only: e.read_only,
                        life_span: LifeSpan::Connection,
                        shared_with_upstream: e.transitive,
                        transitive: e.transitive,
                    };
                    (name.clone(), entry)
                })
                .collect(),
        }
    }
}

/// What the upstream side of a `tcp_proxy` connection learned (Envoy's `upstreamInfo()`
/// with its upstream filter state), for the downstream connection's network filters:
/// the cluster, the endpoint, the upstream TLS session, and the peer an upstream
/// metadata exchange found.
#[derive(Debug, Clone, Default)]
pub struct UpstreamInfo {
    pub cluster_name: Option<Arc<str>>,
    pub cluster_metadata: Option<Arc<crate::interned::EncodedMetadata>>,
    pub host_metadata: Option<Arc<crate::interned::EncodedMetadata>>,
    /// The upstream TLS session: the server's SANs as `peer_*`, ours as `local_uri_sans`.
    pub tls: Option<Tls>,
    pub filter_state: FilterState,
}

/// Where a network filter asks `tcp_proxy` to leave its [`UpstreamInfo`]: put in the
/// connection's filter state under [`UpstreamSlot::NAME`] by `on_new_connection`, filled
/// once the upstream is connected, read by `on_data`/`on_close`.
#[derive(Debug, Default)]
pub struct UpstreamSlot {
    info: std::sync::Mutex<Option<Arc<UpstreamInfo>>>,
    /// The response flags `tcp_proxy` set before the downstream closed (`UF`, `NC`,
    /// `UH`, ...): what Istio's TCP metrics report when no peer was ever read.
    flags: std::sync::Mutex<Vec<ResponseFlag>>,
}

impl UpstreamSlot {
    pub const NAME: &'static str = "shunt.upstream_info";

    pub fn fill(&self, info: UpstreamInfo) {
        *self.info.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(info));
    }

    pub fn get(&self) -> Option<Arc<UpstreamInfo>> {
        self.info.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn flag(&self, flag: ResponseFlag) {
        let mut flags = self.flags.lock().unwrap_or_else(|e| e.into_inner());
        if !flags.contains(&flag) {
            flags.push(flag);
        }
    }

    pub fn flags(&self) -> Vec<ResponseFlag> {
        self.flags.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl FilterStateObject for UpstreamSlot {
    fn serialize_as_string(&self) -> Option<String> {
        None
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Dynamic metadata: filter namespace (`envoy.filters.http.rbac`, `istio_authn`) to a
/// `Struct`, as JSON.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    pub filter_metadata: BTreeMap<String, serde_json::Map<String, serde_json::Value>>,
}

impl Metadata {
    /// Merges `fields` into the namespace, as Envoy's `setDynamicMetadata` does (keys
    /// replace keys).
    pub fn set(&mut self, namespace: &str, fields: serde_json::Map<String, serde_json::Value>) {
        self.filter_metadata
            .entry(namespace.to_owned())
            .or_default()
            .extend(fields);
    }

    /// The value at `path` inside `namespace` (Envoy's `MetadataKey`).
    pub fn value(&self, namespace: &str, path: &[String]) -> Option<&serde_json::Value> {
        let (first, rest) = path.split_first()?;
        let mut value = self.filter_metadata.get(namespace)?.get(first)?;
        for key in rest {
            value = value.as_object()?.get(key)?;
        }
        Some(value)
    }
}

/// One HTTP stream's info, as its filters share it.
#[derive(Debug)]
pub struct StreamInfo {
    pub connection: Arc<Connection>,
    pub start: Instant,
    /// The stream's own filter state; [`StreamInfo::filter_state_string`] also looks at
    /// the connection's.
    pub filter_state: FilterState,
    pub metadata: Metadata,
    /// The route's name once routed (empty name: `None`).
    pub route_name: Option<Arc<str>>,
    pub response_code: Option<u16>,
    /// Envoy's `%RESPONSE_CODE_DETAILS%` (`rbac_access_denied_matched_policy[none]`).
    pub response_code_details: Option<String>,
    pub response_flags: Vec<ResponseFlag>,
    pub upstream_cluster: Option<Arc<str>>,
    pub upstream_cluster_metadata: Option<Arc<crate::interned::EncodedMetadata>>,
    pub upstream_host: Option<SocketAddr>,
    /// The upstream TLS session's URI SANs: the server's, and those of the certificate
    /// shunt presented (Istio's destination and source principals on the client side).
    pub upstream_peer_uri_sans: Vec<String>,
    pub upstream_local_uri_sans: Vec<String>,
    /// The wire size of the request's and the response's heads (HTTP/1.1 form), known at
    /// stream end: with the body bytes, what Istio counts as request and response size.
    pub request_head_bytes: u64,
    pub response_head_bytes: u64,
    /// Body bytes from and to the downstream (known at stream end).
    pub bytes_received: u64,
    pub bytes_sent: u64,
}

impl StreamInfo {
    pub fn new(connection: Arc<Connection>) -> Self {
        StreamInfo {
            connection,
            start: Instant::now(),
            filter_state: FilterState::default(),
            metadata: Metadata::default(),
            route_name: None,
            response_code: None,
            response_code_details: None,
            response_flags: Vec::new(),
            upstream_cluster: None,
            upstream_cluster_metadata: None,
            upstream_host: None,
            upstream_peer_uri_sans: Vec::new(),
            upstream_local_uri_sans: Vec::new(),
            request_head_bytes: 0,
            response_head_bytes: 0,
            bytes_received: 0,
            bytes_sent: 0,
        }
    }

    /// A filter state object of the stream, else of its connection.
    pub fn filter_state_entry(&self, name: &str) -> Option<&FilterStateEntry> {
        self.filter_state
            .get(name)
            .or_else(|| self.connection.filter_state.get(name))
    }

    pub fn filter_state_string(&self, name: &str) -> Option<String> {
        self.filter_state_entry(name)?.value.serialize_as_string()
    }

    /// Dynamic metadata of the stream, else of its connection.
    pub fn metadata_value(&self, namespace: &str, path: &[String]) -> Option<&serde_json::Value> {
        self.metadata
            .value(namespace, path)
            .or_else(|| self.connection.metadata.value(namespace, path))
    }

    pub fn flag(&mut self, flag: ResponseFlag) {
        if !self.response_flags.contains(&flag) {
            self.response_flags.push(flag);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_only_objects_stay() {
        let mut state = FilterState::default();
        let value = |s: &str| Arc::new(StringAccessor(s.into())) as Arc<dyn FilterStateObject>;
        state
            .set("a", value("1"), true, LifeSpan::Connection)
            .unwrap();
        assert_eq!(
            state.set("a", value("2"), false, LifeSpan::Request),
            Err(ReadOnly("a".into()))
        );
        state
            .set("b", value("x"), false, LifeSpan::Request)
            .unwrap();
        state
            .set("b", value("y"), false, LifeSpan::Request)
            .unwrap();
        assert_eq!(state.get_string("a").as_deref(), Some("1"));
        assert_eq!(state.get_string("b").as_deref(), Some("y"));
        assert_eq!(
            state.get_as::<StringAccessor>("b"),
            Some(&StringAccessor("y".into()))
        );
    }

    #[test]
    fn streams_see_their_connections_state_below_their_own() {
        let local = "10.0.0.1:80".parse().unwrap();
        let mut connection = Connection::new(local, "10.0.0.2:5000".parse().unwrap());
        connection
            .filter_state
            .set(
                "k",
                Arc::new(StringAccessor("conn".into())),
                true,
                LifeSpan::Connection,
            )
            .unwrap();
        let mut stream = StreamInfo::new(Arc::new(connection));
        assert_eq!(stream.filter_state_string("k").as_deref(), Some("conn"));
        stream
            .filter_state
            .set(
                "k",
                Arc::new(StringAccessor("stream".into())),
                false,
                LifeSpan::Request,
            )
            .unwrap();
        assert_eq!(stream.filter_state_string("k").as_deref(), Some("stream"));
    }

    #[test]
    fn principal_is_uri_then_dns_then_subject() {
        let mut c = Connection::new("1.1.1.1:1".parse().unwrap(), "2.2.2.2:2".parse().unwrap());
        assert_eq!(c.peer_principals().count(), 0);
        let tls = Tls {
            peer_certificate_presented: true,
            peer_dns_sans: vec!["a.example".into()],
            peer_subject: Some("CN=a".into()),
            ..Tls::default()
        };
        c.tls = Some(Arc::new(tls.clone()));
        assert_eq!(c.peer_principals().collect::<Vec<_>>(), ["a.example"]);
        let mut with_uri = tls.clone();
        with_uri.peer_uri_sans = vec!["spiffe://td/ns/a/sa/b".into()];
        c.tls = Some(Arc::new(with_uri));
        assert_eq!(
            c.peer_principals().collect::<Vec<_>>(),
            ["spiffe://td/ns/a/sa/b"]
        );
        let mut only_subject = tls;
        only_subject.peer_dns_sans.clear();
        c.tls = Some(Arc::new(only_subject));
        assert_eq!(c.peer_principals().collect::<Vec<_>>(), ["CN=a"]);
    }
}
