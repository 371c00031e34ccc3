//! An upstream host (Envoy's `Host`): one endpoint address of a cluster, with the state
//! that outlives a single connection: why it is unhealthy, how many connections it
//! carries, and its outlier detection counters.
//!
//! Health is a set of flags, as in Envoy, because several sources judge a host
//! independently (active health checks, outlier detection, the endpoint's own
//! `health_status`) and each clears only its own verdict.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

/// Active health checking has not (yet) seen this host pass.
pub const FAILED_ACTIVE_HC: u8 = 1 << 0;
/// Outlier detection ejected this host.
pub const FAILED_OUTLIER_CHECK: u8 = 1 << 1;
/// The endpoint's `health_status` says unhealthy, draining or timed out.
pub const FAILED_EDS_HEALTH: u8 = 1 << 2;

#[derive(Debug)]
pub struct Host {
    pub address: SocketAddr,
    /// The endpoint's `hostname`, or the DNS name it was resolved from; may be empty.
    pub hostname: String,
    /// `load_balancing_weight`, at least 1.
    pub weight: u32,
    /// The locality's `priority`: 0 is used first.
    pub priority: u32,
    /// The endpoint's `envoy.transport_socket_match` metadata, which chooses among the
    /// cluster's `transport_socket_matches`.
    pub socket_match: Option<Arc<shunt_tls::transport_socket::MatchMetadata>>,
    /// `envoy_internal_address`: the host is an internal listener, and `address` only a
    /// stand-in (see [`super::internal::InternalAddress::synthetic`]).
    pub internal: Option<Arc<super::internal::InternalAddress>>,
    /// The endpoint's metadata, for `internal_upstream`'s `passthrough_metadata`.
    pub metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
    health: AtomicU8,
    /// Upstream connections open now (LEAST_REQUEST's "active requests" for TCP).
    active: AtomicU32,
    /// Outlier detection: consecutive local-origin failures since the last success.
    pub(super) consecutive_failures: AtomicU32,
    /// Outlier detection: how many times this host was ejected (ejection time multiplier).
    pub(super) ejections: AtomicU32,
    /// Connections attempted (`cx_total` in `/clusters`).
    connections: AtomicU64,
    /// Connect attempts that failed (`cx_connect_fail`).
    connect_failures: AtomicU64,
}

impl Host {
    pub fn new(address: SocketAddr) -> Self {
        Host {
            address,
            hostname: String::new(),
            weight: 1,
            priority: 0,
            socket_match: None,
            internal: None,
            metadata: None,
            health: AtomicU8::new(0),
            active: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            connections: AtomicU64::new(0),
            connect_failures: AtomicU64::new(0),
        }
    }

    /// The same endpoint with none of this one's run-time state but its health flags:
    /// a pod's own host, made from the hosts a shared compile made (see
    /// `compile::Prototype`).
    pub fn fresh(&self) -> Self {
        Host {
            address: self.address,
            hostname: self.hostname.clone(),
            weight: self.weight,
            priority: self.priority,
            socket_match: self.socket_match.clone(),
            internal: self.internal.clone(),
            metadata: self.metadata.clone(),
            ..Host::new(self.address)
        }
        .with_health_flags(self.health_flags())
    }

    pub fn with_weight(mut self, weight: u32) -> Self {
        self.weight = weight.max(1);
        self
    }

    pub fn with_priority(mut self, priority: u32) -> Self {
        self.priority = priority;
        self
    }

    pub fn with_socket_match(
        mut self,
        metadata: Option<Arc<shunt_tls::transport_socket::MatchMetadata>>,
    ) -> Self {
        self.socket_match = metadata;
        self
    }

    /// A host that is the internal listener `address` names.
    pub fn internal(address: super::internal::InternalAddress) -> Self {
        let mut host = Host::new(address.synthetic());
        host.internal = Some(Arc::new(address));
        host
    }

    pub fn with_metadata(
        mut self,
        metadata: Option<Arc<shunt_core::interned::EncodedMetadata>>,
    ) -> Self {
        self.metadata = metadata;
        self
    }

    pub fn with_hostname(mut self, hostname: impl Into<String>) -> Self {
        self.hostname = hostname.into();
        self
    }

    pub fn with_health_flags(self, flags: u8) -> Self {
        self.health.store(flags, Ordering::Relaxed);
        self
    }

    pub fn healthy(&self) -> bool {
        self.health.load(Ordering::Acquire) == 0
    }

    pub fn has_flag(&self, flag: u8) -> bool {
        self.health.load(Ordering::Acquire) & flag != 0
    }

    /// Sets or clears `flag`; true if that changed anything.
    pub fn set_flag(&self, flag: u8, on: bool) -> bool {
        let before = if on {
            self.health.fetch_or(flag, Ordering::AcqRel)
        } else {
            self.health.fetch_and(!flag, Ordering::AcqRel)
        };
        (before & flag != 0) != on
    }

    pub fn active_connections(&self) -> u32 {
        self.active.load(Ordering::Relaxed)
    }

    /// Counts a connection to this host until the guard is dropped.
    pub fn track_connection(self: &Arc<Self>) -> ActiveConnection {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.connections.fetch_add(1, Ordering::Relaxed);
        ActiveConnection { host: self.clone() }
    }

    pub fn total_connections(&self) -> u64 {
        self.connections.load(Ordering::Relaxed)
    }

    pub fn connect_failures(&self) -> u64 {
        self.connect_failures.load(Ordering::Relaxed)
    }

    pub(super) fn count_connect_failure(&self) {
        self.connect_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// The health flags set now (`FAILED_*`).
    pub fn health_flags(&self) -> u8 {
        self.health.load(Ordering::Acquire)
    }

    /// The key Ring hash and Maglev hash this host by: Envoy's `address:port` string.
    pub fn hash_key(&self) -> String {
        self.address.to_string()
    }
}

/// One upstream connection counted against its host.
#[derive(Debug)]
pub struct ActiveConnection {
    host: Arc<Host>,
}

impl Drop for ActiveConnection {
    fn drop(&mut self) {
        self.host.active.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_source_clears_only_its_own_verdict() {
        let host = Host::new("127.0.0.1:1".parse().unwrap());
        assert!(host.healthy());
        assert!(host.set_flag(FAILED_ACTIVE_HC, true));
        assert!(host.set_flag(FAILED_OUTLIER_CHECK, true));
        assert!(!host.set_flag(FAILED_OUTLIER_CHECK, true));
        assert!(host.set_flag(FAILED_ACTIVE_HC, false));
        assert!(!host.healthy());
        assert!(host.set_flag(FAILED_OUTLIER_CHECK, false));
        assert!(host.healthy());
    }

    #[test]
    fn active_connections_count_while_guarded() {
        let host = Arc::new(Host::new("127.0.0.1:1".parse().unwrap()));
        let a = host.track_connection();
        let b = host.track_connection();
        assert_eq!(host.active_connections(), 2);
        drop(a);
        assert_eq!(host.active_connections(), 1);
        drop(b);
        assert_eq!(host.active_connections(), 0);
        assert_eq!(host.total_connections(), 2);
    }
}
