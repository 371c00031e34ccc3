//! Circuit breakers (Envoy's cluster `circuit_breakers`, DEFAULT priority): a cap on the
//! upstream connections a cluster may have open at once. A connection over the cap is
//! not queued: the downstream is closed at once and logged with `UO` (upstream
//! overflow), so an overloaded upstream sheds load instead of piling it up. HTTP
//! requests are the exception, as in Envoy: up to `max_pending_requests` of them wait
//! for a pooled connection ([`super::http_pool`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use shunt_core::stats::Counter;

/// Envoy's default `max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: u64 = 1024;

#[derive(Debug)]
pub struct CircuitBreaker {
    max_connections: u64,
    /// Shared with [`OwnedConnectionSlot`]s, which outlive a borrow of the breaker.
    open: Arc<AtomicU64>,
    /// `upstream_cx_overflow`: connections refused for being over the limit.
    overflow: Counter,
}

impl CircuitBreaker {
    pub fn new(max_connections: u64) -> Self {
        CircuitBreaker::counting(max_connections, Counter::default())
    }

    /// A breaker that counts each refusal on `overflow`.
    pub fn counting(max_connections: u64, overflow: Counter) -> Self {
        CircuitBreaker {
            max_connections,
            open: Arc::new(AtomicU64::new(0)),
            overflow,
        }
    }

    pub fn max_connections(&self) -> u64 {
        self.max_connections
    }

    /// A slot for one upstream connection, held until the guard drops; `None` when the
    /// cluster is at its limit.
    pub fn try_acquire(&self) -> Option<ConnectionSlot<'_>> {
        let slot = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max_connections).then_some(open + 1)
            })
            .ok()
            .map(|_| ConnectionSlot { breaker: self });
        if slot.is_none() {
            self.overflow.inc();
        }
        slot
    }

    /// Like [`CircuitBreaker::try_acquire`], for a connection that lives in a task of
    /// its own (a pooled HTTP connection) and so cannot borrow the breaker.
    pub fn try_acquire_owned(&self) -> Option<OwnedConnectionSlot> {
        let slot = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| {
                (open < self.max_connections).then_some(open + 1)
            })
            .ok()
            .map(|_| OwnedConnectionSlot {
                open: self.open.clone(),
            });
        if slot.is_none() {
            self.overflow.inc();
        }
        slot
    }

    /// Whether a connection now would be over the limit (not counted as an overflow).
    pub fn is_full(&self) -> bool {
        self.open.load(Ordering::Acquire) >= self.max_connections
    }

    #[cfg_attr(not(test), allow(dead_code, reason = "read by tests"))]
    pub fn open_connections(&self) -> u64 {
        self.open.load(Ordering::Acquire)
    }
}

impl Default for CircuitBreaker {
    fn default() -> Self {
        CircuitBreaker::new(DEFAULT_MAX_CONNECTIONS)
    }
}

/// One upstream connection counted against the cluster's `max_connections`.
#[derive(Debug)]
pub struct ConnectionSlot<'a> {
    breaker: &'a CircuitBreaker,
}

impl Drop for ConnectionSlot<'_> {
    fn drop(&mut self) {
        self.breaker.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One upstream connection counted against the cluster's `max_connections`, owning its
/// share of the count.
#[derive(Debug)]
pub struct OwnedConnectionSlot {
    open: Arc<AtomicU64>,
}

impl Drop for OwnedConnectionSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_connection_over_the_limit_is_refused_until_one_closes() {
        let breaker = CircuitBreaker::new(2);
        let a = breaker.try_acquire().unwrap();
        let _b = breaker.try_acquire().unwrap();
        assert!(breaker.try_acquire().is_none());
        assert_eq!(breaker.open_connections(), 2);
        drop(a);
        assert!(breaker.try_acquire().is_some());
    }

    #[test]
    fn each_refusal_is_counted_as_an_overflow() {
        let overflow = Counter::default();
        let breaker = CircuitBreaker::counting(1, overflow.clone());
        let _held = breaker.try_acquire().unwrap();
        assert!(breaker.try_acquire().is_none());
        assert!(breaker.try_acquire().is_none());
        assert_eq!(overflow.value(), 2);
    }

    #[test]
    fn zero_refuses_everything() {
        assert!(CircuitBreaker::new(0).try_acquire().is_none());
    }
}
