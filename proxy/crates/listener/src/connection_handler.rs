//! What happens to a connection accepted on a bootstrap listener, in Envoy's order:
//! listener filters (original destination, then the inspectors, all within
//! `listener_filters_timeout`), the `use_original_dst` hand-off to the listener for the
//! restored destination (which then runs its own listener filters), filter chain
//! matching, and the chain's network filter. The connection keeps the snapshot it was
//! accepted under until it ends. Connections to internal listeners arrive in process
//! ([`handle_internal`]) and take the same path with a pipe instead of a socket.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpStream;

use super::internal::Rewound;
use shunt_tls::internal_upstream::PassedMetadata;
use shunt_upstream::internal::{InternalConnection, SharedFilterState};

use super::config::{FilterChain, Listener, ListenerFilters, NetworkFilter};
use super::filter_chain::ConnectionInfo;
use super::inspector::{self, HttpVerdict, TlsVerdict};
use super::original_dst;
use super::{ConnectionConfig, ListenerProvider, ListenerStats};
use shunt_core::access_log::{Entry, ResponseFlag};
use shunt_filters::http::HttpConnectionManager;
use shunt_filters::tcp::tcp_proxy::{TcpProxy, Upstreams};
use shunt_tls::HandshakeError;
use shunt_tls::TransportStream;

/// What every connection of a serving proxy shares.
pub struct Context {
    /// The current config (the snapshot store).
    pub config: Arc<dyn ListenerProvider>,
    /// Ports the proxy listens on (ORIGINAL_DST loop protection); xDS adds to them.
    pub own_ports: std::sync::RwLock<Arc<[u16]>>,
    /// Set when the proxy starts shutting down (SIGTERM): HTTP connections finish the
    /// requests in flight and close.
    pub shutdown: crate::config::Draining,
}

/// What listener filters learned about a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// The local address, or the original destination once restored.
    pub destination: SocketAddr,
    /// Whether `original_dst` restored a destination (the hand-off condition).
    pub restored: bool,
    pub server_name: Option<String>,
    pub transport_protocol: &'static str,
    pub application_protocols: Vec<String>,
    /// Where an ORIGINAL_DST cluster connects instead of `destination`
    /// (`set_internal_dst_address`'s `tunnel.address`).
    pub upstream_override: Option<SocketAddr>,
    /// The remote address an internal listener's `original_dst` restored.
    pub restored_remote: Option<SocketAddr>,
}

impl Facts {
    pub fn new(local: SocketAddr) -> Self {
        Facts {
            destination: local,
            restored: false,
            server_name: None,
            transport_protocol: "raw_buffer",
            application_protocols: Vec::new(),
            upstream_override: None,
            restored_remote: None,
        }
    }
}

fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// A connection as accepted: a socket, or a pipe to an internal listener.
enum Accepted {
    Tcp(TcpStream),
    Internal {
        stream: Rewound,
        metadata: PassedMetadata,
        filter_state: SharedFilterState,
    },
    /// A same-node connection handed over in process (node mode's fast path): TLS in
    /// all but the bytes, the client's chain to verify and ours to send back.
    Handed {
        stream: tokio::io::DuplexStream,
        hello: shunt_tls::context::InProcessHello,
        answer: Option<HandedAnswer>,
    },
}

type HandedAnswer =
    tokio::sync::oneshot::Sender<Result<Vec<rustls::pki_types::CertificateDer<'static>>, String>>;

/// Serves a same-node connection handed over in process as if it had been accepted on
/// `listener_name` (bound at `bound_port`) over mTLS: the client is `handoff.source`,
/// its destination `handoff.destination`.
pub async fn handle_handed(
    handoff: shunt_upstream::same_node::Handoff,
    listener_name: Arc<str>,
    bound_port: u16,
    ctx: Arc<Context>,
) {
    let shunt_upstream::same_node::Handoff {
        destination,
        source,
        hello,
        answer,
        stream,
    } = handoff;
    let accepted = Accepted::Handed {
        stream,
        hello,
        answer: Some(answer),
    };
    serve(
        accepted,
        canonical(source),
        canonical(destination),
        listener_name,
        bound_port,
        ctx,
    )
    .await;
}

/// Serves one connection accepted by `listener_name` on its socket bound to `bound`.
pub async fn handle(
    stream: TcpStream,
    peer: SocketAddr,
    listener_name: Arc<str>,
    bound: SocketAddr,
    ctx: Arc<Context>,
) {
    let local = match stream.local_addr() {
        Ok(local) => canonical(local),
        Err(err) => {
            tracing::warn!(%peer, %err, "accepted connection has no local address; closing");
            return;
        }
    };
    serve(
        Accepted::Tcp(stream),
        canonical(peer),
        local,
        listener_name,
        bound.port(),
        ctx,
    )
    .await;
}

/// An internal connection has no socket address: Envoy's are `envoy://` names; shunt
/// writes 0.0.0.0:0 until `original_dst` restores one.
fn unaddressed() -> SocketAddr {
    SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), 0)
}

/// Serves one connection an upstream opened to the internal listener it names.
pub async fn handle_internal(connection: InternalConnection, ctx: Arc<Context>) {
    let InternalConnection {
        listener,
        metadata,
        filter_state,
        stream,
        ..
    } = connection;
    let accepted = Accepted::Internal {
        stream: Rewound::new(stream),
        metadata,
        filter_state,
    };
    serve(accepted, unaddressed(), unaddressed(), listener, 0, ctx).await;
}

/// A proxy instance's internal listener registry: its current snapshot's internal
/// listeners, served on the data plane's runtime.
pub struct InternalListeners(pub Arc<Context>);

impl shunt_upstream::internal::Acceptor for InternalListeners {
    fn accept(&self, connection: InternalConnection) -> std::io::Result<()> {
        let snapshot = self.0.config.connection_config();
        if !snapshot
            .listener(&connection.listener)
            .is_some_and(|l| l.internal)
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                format!("no internal listener named {:?}", connection.listener),
            ));
        }
        // In the same registry's scope: an internal listener's own upstream may be
        // another internal listener.
        let registry = Arc::new(InternalListeners(self.0.clone()));
        tokio::spawn(shunt_upstream::internal::scope(
            registry,
            handle_internal(connection, self.0.clone()),
        ));
        Ok(())
    }
}

/// Serves one accepted connection to its end, in Envoy's order: listener filters and
/// hand-off, filter chain match, transport socket, network filters, the terminal filter.
/// The stages are async functions awaited in place: their states live inside this
/// connection's one task, with no allocation or suspension point of their own.
async fn serve(
    mut accepted: Accepted,
    remote: SocketAddr,
    local: SocketAddr,
    listener_name: Arc<str>,
    bound_port: u16,
    ctx: Arc<Context>,
) {
    let snapshot = ctx.config.connection_config();
    let Some(accepting) = snapshot.listener(&listener_name).cloned() else {
        // The listener left the config after this socket was bound.
        return;
    };
    let mut facts = Facts::new(local);
    let Some(listener) =
        listener_filters(&*snapshot, accepting, &mut accepted, bound_port, &mut facts).await
    else {
        return;
    };
    let remote = facts.restored_remote.unwrap_or(remote);
    // What the upstream side shared with an internal connection starts its filter state.
    let inherited = match &accepted {
        Accepted::Internal { filter_state, .. } => filter_state.objects.clone(),
        Accepted::Tcp(_) | Accepted::Handed { .. } => Default::default(),
    };
    // An internal connection's local address is the one restored.
    let local = match accepted {
        Accepted::Internal { .. } => facts.destination,
        Accepted::Tcp(_) | Accepted::Handed { .. } => local,
    };

    let mut entry = Entry::start(listener.direction, remote, local);
    if facts.restored {
        entry.original_dst = Some(facts.destination);
    }
    let info = ConnectionInfo {
        destination: facts.destination,
        source: remote,
        direct_source: remote,
        server_name: facts.server_name.as_deref(),
        transport_protocol: facts.transport_protocol,
        application_protocols: &facts.application_protocols,
    };
    // The listener that serves the connection counts it (after a hand-off, the target).
    let stats = snapshot
        .listener_stats(&listener)
        .cloned()
        .unwrap_or_default();
    let Some(chain) = listener.filter_chains.select(&info) else {
        tracing::debug!(listener = %listener.name, %remote, destination = %facts.destination, "no filter chain matches; closing");
        stats.no_filter_chain_match.inc();
        entry.flag(ResponseFlag::NoRouteFound);
        entry.emit_to(&listener.access_log);
        return;
    };
    let _active = stats.connection();
    tracing::debug!(listener = %listener.name, chain = %chain.name, %remote, destination = %facts.destination, "filter chain selected");
    let secure = chain.transport_socket.is_some();
    let Some((stream, handed_session)) =
        transport_socket(chain, &listener, accepted, remote, &ctx, &stats).await
    else {
        return;
    };
    let session = handed_session.or_else(|| stream.session_info());
    let mut connection = stream_info(&facts, (remote, local), chain, session, &ctx);
    connection.filter_state = inherited;
    // HTTP's many small writes leave together at the end of the worker's run (behind
    // network filters too); tcp_proxy's stream stays raw for splice and sockmap.
    let stream = match &chain.network {
        NetworkFilter::Http(_) => stream.defer_writes(),
        _ => stream,
    };
    let Some((stream, connection)) =
        network_filters(chain, &listener, stream, connection, &mut entry).await
    else {
        return;
    };
    match &chain.network {
        NetworkFilter::TcpProxy(proxy) => {
            let destination = facts.upstream_override.unwrap_or(facts.destination);
            let served = Served::into_tcp(stream);
            let peers = (&*snapshot, &*ctx, &*listener);
            let addresses = (remote, destination);
            serve_tcp_proxy(proxy, peers, served, &connection, addresses, &mut entry).await;
        }
        NetworkFilter::Http(hcm) => {
            let addresses = (remote, local, secure);
            serve_http(hcm, &ctx, &listener, stream, connection, addresses, &facts).await;
        }
    }
}

/// What filters read about the connection: its addresses, the server name the
/// tls_inspector saw and its TLS session (with our own SANs when network filters
/// need them).
fn stream_info(
    facts: &Facts,
    (remote, local): (SocketAddr, SocketAddr),
    chain: &FilterChain,
    session: Option<shunt_tls::stream::SessionInfo>,
    ctx: &Context,
) -> shunt_core::stream_info::Connection {
    let mut connection = shunt_core::stream_info::Connection::new(facts.destination, remote);
    connection.socket_local = local;
    // As in Envoy, only the tls_inspector tells the requested server name: the TLS
    // session's own SNI is not copied here (RBAC's `requested_server_name` sees "" on a
    // listener without the inspector).
    connection.requested_server_name = facts.server_name.clone();
    if let Some(session) = session {
        connection.alpn = session.alpn;
        let mut tls = session.tls;
        if let Some(context) = &chain.transport_socket
            && !chain.filters.is_empty()
        {
            tls.local_uri_sans = context.local_uri_sans(ctx.config.request_config().secrets());
        }
        connection.tls = Some(Arc::new(tls));
    }
    connection
}

/// Runs the accepting listener's filters, then hands the connection off to the
/// listener for its restored destination (which runs its own): the listener that
/// serves it, or `None` to close it.
async fn listener_filters(
    snapshot: &dyn ConnectionConfig,
    accepting: Arc<Listener>,
    accepted: &mut Accepted,
    bound_port: u16,
    facts: &mut Facts,
) -> Option<Arc<Listener>> {
    if !run_listener_filters(&accepting.listener_filters, accepted, bound_port, facts).await {
        return None;
    }
    let Some(target) = hand_off_target(snapshot, &accepting, facts) else {
        return Some(accepting);
    };
    tracing::debug!(from = %accepting.name, to = %target.name, destination = %facts.destination, "hand-off");
    let target = target.clone();
    if !run_listener_filters(&target.listener_filters, accepted, bound_port, facts).await {
        return None;
    }
    Some(target)
}

/// The chain's transport socket over the accepted stream: TLS terminated (or, for a
/// same-node connection handed over, verified in process), or the stream as it is.
/// With the session a hand-over made; `None` closes the connection.
async fn transport_socket(
    chain: &FilterChain,
    listener: &Listener,
    accepted: Accepted,
    remote: SocketAddr,
    ctx: &Context,
    stats: &ListenerStats,
) -> Option<(TransportStream, Option<shunt_tls::stream::SessionInfo>)> {
    match (&chain.transport_socket, accepted) {
        (None, Accepted::Handed { answer, .. }) => {
            // What a TLS client meets on a plaintext chain: no handshake.
            if let Some(answer) = answer {
                let _ = answer.send(Err(format!(
                    "filter chain {:?} of listener {:?} has no TLS",
                    chain.name, listener.name
                )));
            }
            None
        }
        (
            Some(tls),
            Accepted::Handed {
                stream,
                hello,
                answer,
            },
        ) => {
            let current = ctx.config.request_config();
            let verified = tls
                .verify_in_process_client(current.secrets(), &hello)
                .and_then(|alpn| Ok((alpn, tls.in_process_chain(current.secrets())?)));
            let (alpn, ours) = match verified {
                Ok(verified) => verified,
                Err(err) => {
                    stats.ssl.connection_error.inc();
                    tracing::debug!(listener = %listener.name, %err, "same-node client refused");
                    if let Some(answer) = answer {
                        let _ = answer.send(Err(err.to_string()));
                    }
                    return None;
                }
            };
            if let Some(answer) = answer
                && answer.send(Ok(ours)).is_err()
            {
                return None;
            }
            let session = handed_session_info(&hello, alpn);
            Some((TransportStream::in_process(stream), Some(session)))
        }
        (None, Accepted::Tcp(stream)) => Some((TransportStream::Raw(stream), None)),
        (None, Accepted::Internal { stream, .. }) => {
            Some((TransportStream::in_process(stream), None))
        }
        (Some(_), Accepted::Internal { .. }) => {
            // Compiling refuses such chains; a pipe has no TLS to terminate.
            tracing::debug!(listener = %listener.name, "TLS on an internal connection; closing");
            None
        }
        (Some(tls), Accepted::Tcp(stream)) => {
            let handshake = terminate_tls(tls, stream, ctx, stats);
            let timeout = async {
                match chain.transport_socket_connect_timeout {
                    Some(timeout) => tokio::time::sleep(timeout).await,
                    None => std::future::pending().await,
                }
            };
            let stream = tokio::select! {
                stream = handshake => stream,
                () = timeout => {
                    stats.ssl.connection_error.inc();
                    None
                }
                () = listener.draining.closed() => None,
            };
            let Some(stream) = stream else {
                tracing::debug!(listener = %listener.name, chain = %chain.name, %remote, "no TLS session; closing");
                return None;
            };
            Some((stream, None))
        }
    }
}

/// Starts the chain's network filters before the terminal one, if it has any: the
/// stream they wrap, and the connection they share with it. `None` closes the
/// connection (a filter refused it: a tcp_proxy chain logs it).
async fn network_filters(
    chain: &FilterChain,
    listener: &Listener,
    stream: TransportStream,
    mut connection: shunt_core::stream_info::Connection,
    entry: &mut Entry,
) -> Option<(Served, Arc<shunt_core::stream_info::Connection>)> {
    if chain.filters.is_empty() {
        return Some((Served::Plain(stream), Arc::new(connection)));
    }
    let mut stream = stream;
    let mut buffer = bytes::BytesMut::new();
    let started = tokio::select! {
        started = chain.filters.start(&mut connection, &mut stream, &mut buffer) => started,
        () = listener.draining.closed() => None,
    };
    let Some(active) = started else {
        if let NetworkFilter::TcpProxy(proxy) = &chain.network {
            for flag in &connection.response_flags {
                entry.flag(*flag);
            }
            entry.emit_to(&proxy.access_log);
        }
        return None;
    };
    let connection = Arc::new(connection);
    let filtered =
        shunt_filters::network::Filtered::new(stream, buffer, active, connection.clone());
    Some((Served::Filtered(filtered), connection))
}

/// The terminal `tcp_proxy`, from `remote` to `destination` (an ORIGINAL_DST
/// cluster's), until either side closes or the listener's drain time is over; then the
/// access log.
async fn serve_tcp_proxy(
    proxy: &TcpProxy,
    (snapshot, ctx, listener): (&dyn ConnectionConfig, &Context, &Listener),
    stream: shunt_filters::tcp::Downstream,
    connection: &Arc<shunt_core::stream_info::Connection>,
    (remote, destination): (SocketAddr, SocketAddr),
    entry: &mut Entry,
) {
    let own_ports = ctx
        .own_ports
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    // Upstream TLS names secrets as they are now (an SDS rotation applies).
    let current = ctx.config.request_config();
    let upstreams = Upstreams {
        clusters: snapshot.clusters(),
        own_ports: &own_ports,
        secrets: current.secrets(),
    };
    tokio::select! {
        () = proxy.serve(&upstreams, stream, connection, destination, entry) => {}
        // An xDS update removed or replaced the listener and its drain time passed.
        () = listener.draining.closed() => {
            tracing::debug!(listener = %listener.name, %remote, "listener drained: closing");
        }
    }
    if !proxy.access_log.is_empty() {
        entry.connection = Some(connection.clone());
    }
    entry.emit_to(&proxy.access_log);
}

/// The terminal `http_connection_manager`, until the connection ends, the proxy shuts
/// down or the listener's drain time is over.
async fn serve_http(
    hcm: &Arc<HttpConnectionManager>,
    ctx: &Context,
    listener: &Listener,
    stream: Served,
    connection: Arc<shunt_core::stream_info::Connection>,
    (remote, local, secure): (SocketAddr, SocketAddr, bool),
    facts: &Facts,
) {
    let own_ports = ctx
        .own_ports
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    stream.set_nodelay();
    let downstream = shunt_filters::http::connection_manager::Downstream {
        remote,
        local,
        original_dst: facts.restored.then_some(facts.destination),
        direction: listener.direction,
        secure,
        own_ports,
        connection,
    };
    let serve = async {
        match stream {
            Served::Plain(stream) => {
                shunt_filters::http::connection_manager::serve(
                    hcm.clone(),
                    ctx.config.clone(),
                    stream,
                    downstream,
                    ctx.shutdown.closed(),
                )
                .await;
            }
            Served::Filtered(stream) => {
                shunt_filters::http::connection_manager::serve(
                    hcm.clone(),
                    ctx.config.clone(),
                    stream,
                    downstream,
                    ctx.shutdown.closed(),
                )
                .await;
            }
        }
    };
    // Polled only when it woke the task, not at every byte the connection moves.
    let drained = std::pin::pin!(listener.draining.closed());
    let drained = shunt_core::event::when_woken(drained);
    tokio::select! {
        () = serve => {}
        // As for tcp_proxy: the listener's drain time is over, close.
        () = drained => {
            tracing::debug!(listener = %listener.name, %remote, "listener drained: closing");
        }
    }
}

/// A connection's stream once its network filters started: as accepted, or wrapped
/// by them.
enum Served {
    Plain(TransportStream),
    Filtered(shunt_filters::network::Filtered),
}

impl Served {
    /// TCP_NODELAY on the socket underneath, if there is one.
    fn set_nodelay(&self) {
        let tcp = match self {
            Served::Plain(stream) => stream.tcp(),
            Served::Filtered(stream) => stream.tcp(),
        };
        if let Some(tcp) = tcp
            && let Err(err) = tcp.set_nodelay(true)
        {
            tracing::debug!(%err, "TCP_NODELAY failed");
        }
    }

    fn into_tcp(self) -> shunt_filters::tcp::Downstream {
        match self {
            Served::Plain(stream) => shunt_filters::tcp::Downstream::Transport(stream),
            Served::Filtered(stream) => shunt_filters::tcp::Downstream::Filtered(Box::new(stream)),
        }
    }
}

/// Terminates TLS on a connection whose filter chain has a `DownstreamTlsContext`. Named
/// secrets are looked up in the snapshot current now, not the one the connection was
/// accepted under, so an SDS rotation applies to every handshake after it. `None`
/// closes the connection: the handshake failed, or a secret is not there yet (Envoy
/// would still be warming the listener).
async fn terminate_tls(
    tls: &shunt_tls::DownstreamTls,
    stream: TcpStream,
    ctx: &Context,
    stats: &ListenerStats,
) -> Option<TransportStream> {
    // The handshake's flights should not wait for Nagle.
    if let Err(err) = stream.set_nodelay(true) {
        tracing::debug!(%err, "TCP_NODELAY on the downstream failed");
    }
    let current = ctx.config.request_config();
    match tls.accept(stream, current.secrets()).await {
        Ok(tls) => {
            stats.ssl.handshake.inc();
            Some(tls.into())
        }
        Err(HandshakeError::MissingSecret(name)) => {
            tracing::debug!(secret = %name, "TLS secret not available; closing");
            None
        }
        Err(err) => {
            stats.ssl.connection_error.inc();
            tracing::debug!(%err, "downstream TLS handshake failed");
            None
        }
    }
}

/// The listener a connection is handed to: only from a `use_original_dst` listener,
/// only once a destination was restored, and never to itself.
pub fn hand_off_target<'a>(
    snapshot: &'a dyn ConnectionConfig,
    accepting: &Arc<Listener>,
    facts: &Facts,
) -> Option<&'a Arc<Listener>> {
    if !accepting.use_original_dst || !facts.restored {
        return None;
    }
    snapshot
        .listener_for_address(facts.destination)
        .filter(|target| !Arc::ptr_eq(target, accepting))
}

/// Runs the listener filters; false if the connection must be closed (timeout).
async fn run_listener_filters(
    filters: &ListenerFilters,
    accepted: &mut Accepted,
    listener_port: u16,
    facts: &mut Facts,
) -> bool {
    match accepted {
        Accepted::Tcp(stream) => {
            if filters.original_dst
                && !facts.restored
                && let Ok(dst) =
                    original_dst::original_dst(stream, facts.destination, listener_port)
            {
                facts.destination = dst;
                facts.restored = true;
            }
        }
        Accepted::Handed { hello, .. } => {
            // The destination is known, and so is what the TLS inspector would read.
            if filters.original_dst && !facts.restored {
                facts.restored = true;
            }
            if filters.tls_inspector {
                facts.transport_protocol = "tls";
                facts.server_name = hello.server_name.clone();
                facts.application_protocols = hello
                    .alpn
                    .iter()
                    .map(|p| String::from_utf8_lossy(p).into_owned())
                    .collect();
            }
            return true;
        }
        Accepted::Internal {
            metadata,
            filter_state,
            ..
        } => {
            let restored = if filters.set_internal_dst_address {
                let (local, upstream) =
                    super::internal::set_internal_dst_address(metadata, filter_state);
                facts.upstream_override = upstream.or(facts.upstream_override);
                (local, None)
            } else if filters.original_dst {
                super::internal::original_dst(metadata, filter_state)
            } else {
                (None, None)
            };
            if let (Some(local), false) = (restored.0, facts.restored) {
                facts.destination = canonical(local);
                facts.restored = true;
            }
            if let Some(remote) = restored.1 {
                facts.restored_remote = Some(canonical(remote));
            }
        }
    }
    if !filters.inspects() {
        return true;
    }
    let inspect = inspect(filters, accepted, facts);
    match filters.timeout {
        None => {
            inspect.await;
            true
        }
        Some(timeout) => match tokio::time::timeout(timeout, inspect).await {
            Ok(()) => true,
            Err(_) if filters.continue_on_timeout => true,
            Err(_) => {
                tracing::debug!("listener filters timed out; closing");
                false
            }
        },
    }
}

/// Peeks (a socket) or reads ahead (a pipe) until `decide` answers.
async fn look<T>(
    accepted: &mut Accepted,
    max: usize,
    decide: impl FnMut(&[u8], bool) -> Option<T>,
) -> std::io::Result<T> {
    match accepted {
        Accepted::Tcp(stream) => inspector::peek_until(stream, max, decide).await,
        Accepted::Internal { stream, .. } => stream.inspect(max, decide).await,
        // Never inspected: its facts come with it.
        Accepted::Handed { .. } => Err(std::io::ErrorKind::Unsupported.into()),
    }
}

/// `tls_inspector`, then `http_inspector` unless the connection is TLS.
async fn inspect(filters: &ListenerFilters, accepted: &mut Accepted, facts: &mut Facts) {
    if filters.tls_inspector {
        let hello = look(accepted, inspector::MAX_CLIENT_HELLO, |buf, complete| {
            match inspector::parse_client_hello(buf) {
                TlsVerdict::NeedMore if !complete => None,
                TlsVerdict::ClientHello(hello) => Some(Some(hello)),
                _ => Some(None),
            }
        })
        .await;
        if let Ok(Some(hello)) = hello {
            facts.transport_protocol = "tls";
            facts.server_name = hello.server_name;
            facts.application_protocols = hello.alpn;
        }
    }
    if filters.http_inspector && facts.transport_protocol != "tls" {
        let protocol = look(accepted, inspector::MAX_HTTP_INSPECT, |buf, complete| {
            match inspector::inspect_http(buf) {
                HttpVerdict::NeedMore if !complete => None,
                HttpVerdict::Protocol(protocol) => Some(Some(protocol)),
                _ => Some(None),
            }
        })
        .await;
        if let Ok(Some(protocol)) = protocol {
            facts.application_protocols = vec![protocol.to_owned()];
        }
    }
}

/// The session a handshake with `hello` would have made: the client's certificate and
/// its SANs, the protocol chosen.
fn handed_session_info(
    hello: &shunt_tls::context::InProcessHello,
    alpn: Option<String>,
) -> shunt_tls::stream::SessionInfo {
    let mut tls = shunt_core::stream_info::Tls {
        version: Some("TLSv1_3"),
        ..Default::default()
    };
    if let Some(leaf) = hello.chain.first() {
        tls.peer_certificate_presented = true;
        for san in shunt_tls::san::of_certificate(leaf) {
            match san {
                shunt_tls::san::San::Uri(uri) => tls.peer_uri_sans.push(uri),
                shunt_tls::san::San::Dns(dns) => tls.peer_dns_sans.push(dns),
                _ => {}
            }
        }
    }
    shunt_tls::stream::SessionInfo {
        tls,
        server_name: hello.server_name.clone(),
        alpn,
    }
}
