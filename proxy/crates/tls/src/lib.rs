//! Data-plane TLS, Envoy's `tls` transport socket and its secrets, with rustls (ring):
//! [`secret`] compiles `Secret`s (certificates with keys, validation contexts),
//! [`context`] the `DownstreamTlsContext` / `UpstreamTlsContext` of filter chains and
//! clusters and does their handshakes, [`verifier`] checks peers the way Envoy's
//! validation context does (chain, then SAN matchers from [`san`]). [`data_source`] and
//! [`pem`] read certificates and keys, for the xDS client's own TLS too.
//! [`internal_upstream`] is the socket that wraps another for internal listeners.

#![forbid(unsafe_code)]

pub mod context;
pub mod data_source;
pub mod internal_upstream;
pub mod pem;
pub mod san;
pub mod secret;
pub mod stream;
pub mod subject;
pub mod transport_socket;
mod verifier;

pub use context::{DownstreamTls, HandshakeError, Secrets, UpstreamTls};
pub use secret::Secret;
pub use stream::TransportStream;

use shunt_core::stats::{Counter, Store};

/// A listener's or cluster's `<prefix>.ssl.*` stats, as Envoy names them.
#[derive(Debug, Clone, Default)]
pub struct SslStats {
    /// Handshakes completed.
    pub handshake: Counter,
    /// Handshakes that failed (and, Envoy's meaning too, TLS errors after them).
    pub connection_error: Counter,
}

impl SslStats {
    /// The stats under `prefix` (`listener.0.0.0.0_443`, `cluster.backend`).
    pub fn new(store: &Store, prefix: &str) -> Self {
        SslStats {
            handshake: store.counter(&format!("{prefix}.ssl.handshake")),
            connection_error: store.counter(&format!("{prefix}.ssl.connection_error")),
        }
    }
}

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;
