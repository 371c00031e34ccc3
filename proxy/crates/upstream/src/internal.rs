//! Connections to Envoy's internal listeners (the `envoy.bootstrap.internal_listener`
//! extension): an endpoint addressed as `envoy_internal_address { server_listener_name,
//! endpoint_id }` is not dialled over the network but handed, as one end of an
//! in-process pipe, to the listener of that name, with the metadata the cluster's
//! `internal_upstream` socket passes and the filter state shared with upstream.
//!
//! The listeners live above this layer, so each proxy instance runs its connections in
//! the [`scope`] of its own [`Acceptor`] (its internal listeners; Envoy's registry is
//! per server instance). An upstream connection made in that scope reaches them.

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

use tokio::io::DuplexStream;

use shunt_tls::internal_upstream::PassedMetadata;

/// How much each direction of an internal connection buffers (Envoy's internal
/// listener default `buffer_size_kb` is 1 MiB; a pipe this size keeps copies large).
pub const PIPE_BUFFER: usize = 256 * 1024;

/// An endpoint's `envoy_internal_address`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct InternalAddress {
    pub server_listener_name: Arc<str>,
    pub endpoint_id: String,
}

impl InternalAddress {
    /// The socket address the host stands for in stats, logs, hashing and pools:
    /// `endpoint_id` when it is an `ip:port` (Istio writes the final destination there),
    /// else 0.0.0.0:0.
    pub fn synthetic(&self) -> SocketAddr {
        self.endpoint_id
            .parse()
            .unwrap_or(SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0))
    }
}

impl std::fmt::Display for InternalAddress {
    /// Envoy's form: `envoy://listener/endpoint_id`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "envoy://{}/{}",
            self.server_listener_name, self.endpoint_id
        )
    }
}

/// What the downstream side shares with an internal listener's connection: Envoy's
/// well-known objects its `original_dst` listener filter reads
/// (`envoy.filters.listener.original_dst.local_ip` / `remote_ip`), and every object
/// shared with the upstream, which become the connection's filter state.
#[derive(Debug, Clone, Default)]
pub struct SharedFilterState {
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    pub objects: shunt_core::stream_info::FilterState,
}

/// One connection for an internal listener.
#[derive(Debug)]
pub struct InternalConnection {
    pub listener: Arc<str>,
    pub endpoint_id: String,
    /// The dynamic metadata the `internal_upstream` socket passed, by namespace.
    pub metadata: PassedMetadata,
    pub filter_state: SharedFilterState,
    /// The listener's end of the pipe.
    pub stream: DuplexStream,
}

/// Serves connections for the process's internal listeners.
pub trait Acceptor: Send + Sync {
    /// Takes `connection` if an internal listener of its name exists now;
    /// `ConnectionRefused` otherwise (the upstream connect fails, flag `UF`).
    fn accept(&self, connection: InternalConnection) -> io::Result<()>;
}

tokio::task_local! {
    static ACCEPTOR: Arc<dyn Acceptor>;
}

/// Runs `f` with `acceptor` as the internal listener registry of its connections.
pub fn scope<F: std::future::Future>(
    acceptor: Arc<dyn Acceptor>,
    f: F,
) -> impl std::future::Future<Output = F::Output> {
    // Not an `async fn`: that would hold `f` twice (captured, and inside the scope).
    ACCEPTOR.scope(acceptor, f)
}

/// The current task's internal listener registry, if it has one.
pub fn current() -> Option<Arc<dyn Acceptor>> {
    ACCEPTOR.try_with(Arc::clone).ok()
}

/// Opens a connection to the internal listener `address` names; returns the
/// upstream's end of the pipe.
pub fn connect(
    address: &InternalAddress,
    metadata: PassedMetadata,
    filter_state: SharedFilterState,
) -> io::Result<DuplexStream> {
    let acceptor = ACCEPTOR.try_with(Arc::clone).map_err(|_| {
        io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "no internal listener registry (not a connection of a serving proxy)",
        )
    })?;
    let (upstream, listener_end) = tokio::io::duplex(PIPE_BUFFER);
    acceptor.accept(InternalConnection {
        listener: address.server_listener_name.clone(),
        endpoint_id: address.endpoint_id.clone(),
        metadata,
        filter_state,
        stream: listener_end,
    })?;
    Ok(upstream)
}

/// The internal listener names `addresses` use that `exists` does not know, each with
/// the first JSON path that names it: a static bootstrap must not name a listener it
/// lacks.
pub fn unknown_listeners<'a>(
    addresses: impl IntoIterator<Item = (&'a InternalAddress, String)>,
    exists: impl Fn(&str) -> bool,
) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (address, path) in addresses {
        let name = &*address.server_listener_name;
        if !exists(name) && !out.iter().any(|(n, _)| n == name) {
            out.push((name.to_owned(), path));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_synthetic_address_is_the_endpoint_id_when_it_is_one() {
        let a = InternalAddress {
            server_listener_name: "connect_originate".into(),
            endpoint_id: "10.0.0.5:80".into(),
        };
        assert_eq!(a.synthetic(), "10.0.0.5:80".parse().unwrap());
        assert_eq!(a.to_string(), "envoy://connect_originate/10.0.0.5:80");
        let b = InternalAddress {
            server_listener_name: "main_internal".into(),
            endpoint_id: String::new(),
        };
        assert_eq!(b.synthetic(), "0.0.0.0:0".parse().unwrap());
    }

    #[test]
    fn unknown_listener_names_are_reported_once_with_their_first_path() {
        let known = InternalAddress {
            server_listener_name: "connect_originate".into(),
            endpoint_id: String::new(),
        };
        let unknown = InternalAddress {
            server_listener_name: "nowhere".into(),
            endpoint_id: String::new(),
        };
        let found = unknown_listeners(
            [
                (&known, "a".to_owned()),
                (&unknown, "b".to_owned()),
                (&unknown, "c".to_owned()),
            ],
            |name| name == "connect_originate",
        );
        assert_eq!(found, [("nowhere".to_owned(), "b".to_owned())]);
    }
}
