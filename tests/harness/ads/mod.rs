//! An in-process xDS v3 ADS management server for tests and benchmarks.
//!
//! Serves both RPCs of AggregatedDiscoveryService (state of the world and Delta) over
//! plaintext HTTP/2 on TCP or a Unix socket, from its own thread and tokio runtime, so
//! tests stay synchronous. The per-type services (Cluster, Endpoint, Listener, Route and
//! Secret discovery, as an `api_config_source` uses them) are served on the same
//! listener from the same store: such a stream is an ADS stream restricted to its one
//! type, and each request and response names the [`methods`] it came on. Resources are
//! replaced per type with [`AdsServer::set`], which pushes to every subscribed stream
//! before returning; every request and response is logged for assertions. The store and
//! logs survive [`AdsServer::restart`].
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use harness::ads::{AdsServer, Listen, type_urls};
//! use std::time::Duration;
//! let ads = AdsServer::start(Listen::Tcp("127.0.0.1:0".parse()?))?;
//! ads.set(type_urls::CLUSTER, "1", vec![]);
//! // ... point a client at ads.local_addr() ...
//! let ack = ads.wait_for(Duration::from_secs(5), |r| r.type_url == type_urls::CLUSTER && r.is_ack())?;
//! assert_eq!(ack.version_info, "1");
//! # Ok(()) }
//! ```

mod delta;
pub mod resources;
pub(crate) mod server;
mod sotw;
mod state;
mod store;

pub use envoy_types::pb::google::protobuf::Any;

use anyhow::{Context, Result};
use envoy_types::pb::envoy::config::core::v3::Node;
use server::Running;
use state::Shared;
use std::{
    collections::HashMap,
    fmt::Write as _,
    fs::File,
    net::SocketAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// Type URLs of the common resource types.
pub mod type_urls {
    pub const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";
    pub const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
    pub const ROUTE: &str = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration";
    pub const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";
    pub const SECRET: &str = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret";
}

/// The gRPC methods served (full paths, as in [`Received::method`]).
pub mod methods {
    use super::type_urls;

    pub const ADS: &str =
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources";
    pub const ADS_DELTA: &str =
        "/envoy.service.discovery.v3.AggregatedDiscoveryService/DeltaAggregatedResources";
    pub const CLUSTERS: &str = "/envoy.service.cluster.v3.ClusterDiscoveryService/StreamClusters";
    pub const CLUSTERS_DELTA: &str =
        "/envoy.service.cluster.v3.ClusterDiscoveryService/DeltaClusters";
    pub const ENDPOINTS: &str =
        "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints";
    pub const ENDPOINTS_DELTA: &str =
        "/envoy.service.endpoint.v3.EndpointDiscoveryService/DeltaEndpoints";
    pub const LISTENERS: &str =
        "/envoy.service.listener.v3.ListenerDiscoveryService/StreamListeners";
    pub const LISTENERS_DELTA: &str =
        "/envoy.service.listener.v3.ListenerDiscoveryService/DeltaListeners";
    pub const ROUTES: &str = "/envoy.service.route.v3.RouteDiscoveryService/StreamRoutes";
    pub const ROUTES_DELTA: &str = "/envoy.service.route.v3.RouteDiscoveryService/DeltaRoutes";
    pub const SECRETS: &str = "/envoy.service.secret.v3.SecretDiscoveryService/StreamSecrets";
    pub const SECRETS_DELTA: &str = "/envoy.service.secret.v3.SecretDiscoveryService/DeltaSecrets";

    /// (type, state-of-the-world method, Delta method) of each per-type service.
    const PER_TYPE: [(&str, &str, &str); 5] = [
        (type_urls::CLUSTER, CLUSTERS, CLUSTERS_DELTA),
        (type_urls::ENDPOINT, ENDPOINTS, ENDPOINTS_DELTA),
        (type_urls::LISTENER, LISTENERS, LISTENERS_DELTA),
        (type_urls::ROUTE, ROUTES, ROUTES_DELTA),
        (type_urls::SECRET, SECRETS, SECRETS_DELTA),
    ];

    /// The method of the per-type service carrying `type_url`, if there is one.
    pub fn per_type(type_url: &str, delta: bool) -> Option<&'static str> {
        PER_TYPE
            .iter()
            .find(|(t, _, _)| *t == type_url)
            .map(|(_, sotw, d)| if delta { *d } else { *sotw })
    }

    /// The one type a per-type method carries; `None` for ADS, which carries any.
    pub fn type_of(method: &str) -> Option<&'static str> {
        PER_TYPE
            .iter()
            .find(|(_, sotw, delta)| *sotw == method || *delta == method)
            .map(|(t, _, _)| *t)
    }
}

/// The pseudo metadata entry (not a valid gRPC key, so never sent by a client) that
/// carries the client's TLS certificate, hex DER, on an mTLS stream.
pub(crate) const PEER_CERTIFICATE: &str = ":tls-peer-certificate";

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// Port 0 picks a free port; a restart reuses the one picked.
    Tcp(SocketAddr),
    /// A stale socket file is replaced and missing parent directories are created.
    Unix(PathBuf),
    /// TCP in TLS (ALPN h2) with this certificate chain and key (PEM files). With
    /// `client_ca`, clients must present a certificate chaining to it (mTLS); each
    /// stream's [`Received::peer_certificate`] has the client's leaf.
    TcpTls {
        addr: SocketAddr,
        cert: PathBuf,
        key: PathBuf,
        client_ca: Option<PathBuf>,
    },
}

/// One request received on a stream.
#[derive(Debug, Clone)]
pub struct Received {
    /// Stream id, unique across restarts.
    pub stream: u64,
    /// The stream's gRPC method, one of [`methods`]: ADS or a per-type service.
    pub method: &'static str,
    /// Delta (DeltaAggregatedResources, DeltaClusters, ...) rather than state of the
    /// world.
    pub delta: bool,
    pub at: Instant,
    /// On a per-type stream a request may leave it empty (the spec makes it implicit
    /// there); it is logged as the stream's type then.
    pub type_url: String,
    /// The id of the latest node this stream sent (clients usually send it once).
    pub node_id: Option<String>,
    /// The node as carried by this very request.
    pub node: Option<Node>,
    /// SotW only (empty for Delta).
    pub version_info: String,
    pub response_nonce: String,
    /// SotW resource_names, or Delta resource_names_subscribe.
    pub resource_names: Vec<String>,
    /// Delta resource_names_unsubscribe.
    pub unsubscribe: Vec<String>,
    /// Delta only.
    pub initial_resource_versions: HashMap<String, String>,
    /// (code, message) of a NACK.
    pub error_detail: Option<(i32, String)>,
    /// The stream's gRPC initial metadata.
    pub metadata: Vec<(String, String)>,
}

impl Received {
    /// Answers a response and accepts it.
    pub fn is_ack(&self) -> bool {
        !self.response_nonce.is_empty() && self.error_detail.is_none()
    }

    /// Rejects a response.
    pub fn is_nack(&self) -> bool {
        self.error_detail.is_some()
    }

    /// Came on an AggregatedDiscoveryService stream rather than a per-type one.
    pub fn is_ads(&self) -> bool {
        methods::type_of(self.method).is_none()
    }

    /// The value of a metadata key (keys are lowercase in gRPC).
    /// The client's TLS certificate (DER) on an mTLS stream.
    pub fn peer_certificate(&self) -> Option<Vec<u8>> {
        let hex = self.metadata(PEER_CERTIFICATE)?;
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
            .collect()
    }

    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// One response sent on a stream.
#[derive(Debug, Clone)]
pub struct Sent {
    pub stream: u64,
    /// The stream's gRPC method, one of [`methods`].
    pub method: &'static str,
    pub delta: bool,
    /// When it was queued to the stream.
    pub at: Instant,
    pub type_url: String,
    /// SotW version_info, or Delta system_version_info.
    pub version_info: String,
    pub nonce: String,
    /// Names of the resources carried.
    pub names: Vec<String>,
    /// Delta removed_resources.
    pub removed: Vec<String>,
}

/// A handle on a running (or stopped) ADS server; clones share it, and dropping the
/// last one stops it.
#[derive(Clone)]
pub struct AdsServer {
    inner: Arc<Inner>,
}

struct Inner {
    shared: Arc<Shared>,
    /// With the actual port once bound, so a restart reuses it.
    listen: Mutex<Listen>,
    netns: Arc<File>,
    running: Mutex<Option<Running>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Inner {
    fn start(&self) -> Result<()> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if running.is_some() {
            return Ok(());
        }
        let mut listen = self.listen.lock().unwrap_or_else(|e| e.into_inner());
        let (handle, addr) =
            server::spawn(self.shared.clone(), listen.clone(), self.netns.clone())?;
        if let (Listen::Tcp(want) | Listen::TcpTls { addr: want, .. }, Some(addr)) =
            (&mut *listen, addr)
        {
            *want = addr;
        }
        *running = Some(handle);
        Ok(())
    }

    fn stop(&self) {
        let Some(running) = self
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        // Clients see UNAVAILABLE, which xDS clients answer by reconnecting.
        self.shared
            .close_all(tonic::Status::unavailable("ADS server stopping"));
        running.stop();
        if let Listen::Unix(path) = &*self.listen.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl AdsServer {
    /// Bind and serve on a new thread running its own tokio runtime; returns once
    /// listening. The server lives in the calling thread's network namespace, also
    /// across restarts.
    pub fn start(listen: Listen) -> Result<AdsServer> {
        let netns =
            File::open("/proc/thread-self/ns/net").context("opening /proc/thread-self/ns/net")?;
        let inner = Inner {
            shared: Arc::default(),
            listen: Mutex::new(listen),
            netns: Arc::new(netns),
            running: Mutex::new(None),
        };
        inner.start()?;
        Ok(AdsServer {
            inner: Arc::new(inner),
        })
    }

    /// The bound TCP address (the picked port for port 0); `None` for a Unix socket.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &*self.inner.listen.lock().unwrap_or_else(|e| e.into_inner()) {
            Listen::Tcp(addr) | Listen::TcpTls { addr, .. } => Some(*addr),
            Listen::Unix(_) => None,
        }
    }

    /// Where the server listens (TCP with the actual port).
    pub fn listen(&self) -> Listen {
        self.inner
            .listen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replace every resource of `type_url`, setting the type's version to `version`,
    /// and push to every stream subscribed to the type before returning. A resource's
    /// Delta version becomes `version` only if its bytes changed.
    pub fn set(&self, type_url: &str, version: &str, resources: Vec<(String, Any)>) {
        self.inner.shared.set(type_url, version, resources);
    }

    /// As [`AdsServer::set`], but what the node `node_id` alone is served (a control
    /// plane's per-proxy config); other nodes keep the shared resources.
    pub fn set_for_node(
        &self,
        node_id: &str,
        type_url: &str,
        version: &str,
        resources: Vec<(String, Any)>,
    ) {
        self.inner
            .shared
            .set_for(Some(node_id), type_url, version, resources);
    }

    /// The type's current version, if it was ever set.
    pub fn version(&self, type_url: &str) -> Option<String> {
        let st = self.inner.shared.lock();
        st.store.get(type_url).map(|ts| ts.version.clone())
    }

    /// Encode a message as an `Any` with the `type.googleapis.com/` URL prefix.
    pub fn any<M: prost::Message + prost::Name>(m: &M) -> Any {
        Any {
            type_url: format!("type.googleapis.com/{}", M::full_name()),
            value: m.encode_to_vec(),
        }
    }

    /// Every request received, in order.
    pub fn requests(&self) -> Vec<Received> {
        self.inner.shared.lock().requests.clone()
    }

    /// Every response sent, in order.
    pub fn responses(&self) -> Vec<Sent> {
        self.inner.shared.lock().responses.clone()
    }

    /// Block until a received request (earlier ones included) satisfies `pred`.
    pub fn wait_for(
        &self,
        timeout: Duration,
        pred: impl Fn(&Received) -> bool,
    ) -> Result<Received> {
        self.wait(timeout, |st| st.requests.iter().find(|r| pred(r)).cloned())
            .map_err(|st| {
                anyhow::anyhow!(
                    "no matching request within {timeout:?}; received:\n{}",
                    describe_requests(&st)
                )
            })
    }

    /// Block until a sent response (earlier ones included) satisfies `pred`.
    pub fn wait_for_sent(&self, timeout: Duration, pred: impl Fn(&Sent) -> bool) -> Result<Sent> {
        self.wait(timeout, |st| st.responses.iter().find(|s| pred(s)).cloned())
            .map_err(|st| {
                anyhow::anyhow!(
                    "no matching response within {timeout:?}; sent:\n{}",
                    describe_responses(&st)
                )
            })
    }

    /// Wait on the condvar until `check` finds something; on timeout hand back the
    /// logs (cloned, so the error can be built without the lock).
    fn wait<T>(
        &self,
        timeout: Duration,
        check: impl Fn(&state::State) -> Option<T>,
    ) -> std::result::Result<T, Logs> {
        let deadline = Instant::now() + timeout;
        let shared = &self.inner.shared;
        let mut st = shared.lock();
        loop {
            if let Some(found) = check(&st) {
                return Ok(found);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Logs {
                    requests: st.requests.clone(),
                    responses: st.responses.clone(),
                });
            }
            st = shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Open streams.
    pub fn streams(&self) -> usize {
        self.inner.shared.stream_count()
    }

    /// Close every stream (with UNAVAILABLE) and stop listening. Resources, versions
    /// and logs are kept. Idempotent.
    pub fn stop(&self) {
        self.inner.stop();
    }

    /// Listen again after [`stop`](Self::stop), on the same address (same port).
    /// Does nothing while running.
    pub fn resume(&self) -> Result<()> {
        self.inner.start()
    }

    /// [`stop`](Self::stop), then [`resume`](Self::resume): clients lose their
    /// streams and reconnect to the same store.
    pub fn restart(&self) -> Result<()> {
        self.stop();
        self.resume()
    }
}

impl std::fmt::Debug for AdsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdsServer")
            .field("listen", &self.listen())
            .field(
                "running",
                &self
                    .inner
                    .running
                    .lock()
                    .map(|r| r.is_some())
                    .unwrap_or(false),
            )
            .finish()
    }
}

struct Logs {
    requests: Vec<Received>,
    responses: Vec<Sent>,
}

/// The last requests, one line each (a timeout message, so keep it bounded).
fn describe_requests(logs: &Logs) -> String {
    let mut out = String::new();
    let skip = logs.requests.len().saturating_sub(50);
    if skip > 0 {
        let _ = writeln!(out, "  ... {skip} earlier");
    }
    for r in &logs.requests[skip..] {
        let _ = writeln!(
            out,
            "  stream {} {} {} version={:?} nonce={:?} names={:?}{}{}",
            r.stream,
            short(r.method),
            r.type_url,
            r.version_info,
            r.response_nonce,
            r.resource_names,
            if r.unsubscribe.is_empty() {
                String::new()
            } else {
                format!(" unsubscribe={:?}", r.unsubscribe)
            },
            match &r.error_detail {
                Some((code, msg)) => format!(" NACK({code}: {msg})"),
                None => String::new(),
            },
        );
    }
    if logs.requests.is_empty() {
        out.push_str("  nothing\n");
    }
    out
}

fn describe_responses(logs: &Logs) -> String {
    let mut out = String::new();
    let skip = logs.responses.len().saturating_sub(50);
    if skip > 0 {
        let _ = writeln!(out, "  ... {skip} earlier");
    }
    for s in &logs.responses[skip..] {
        let _ = writeln!(
            out,
            "  stream {} {} {} version={:?} nonce={:?} names={:?} removed={:?}",
            s.stream,
            short(s.method),
            s.type_url,
            s.version_info,
            s.nonce,
            s.names,
            s.removed,
        );
    }
    if logs.responses.is_empty() {
        out.push_str("  nothing\n");
    }
    out
}

/// A method's name without its service ("StreamClusters").
fn short(method: &str) -> &str {
    method.rsplit('/').next().unwrap_or(method)
}

#[cfg(test)]
mod tests;
