//! Envoy's UUID request id extension (`envoy.request_id.uuid`) and the connection
//! manager's trace decision (`ConnectionManagerUtility::mutateTracingRequestHeader`):
//! the decision is packed into `x-request-id` (its 15th character: `9` sampled, `a`
//! forced, `b` client, `4` none), so every proxy after the first reads it from there,
//! and random sampling takes the id's first 8 hex digits modulo 10000.

use hyper::HeaderMap;
use hyper::header::{HeaderName, HeaderValue};

use crate::common::percent::Percent;

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const CLIENT_TRACE_ID: HeaderName = HeaderName::from_static("x-client-trace-id");
const FORCE_TRACE: HeaderName = HeaderName::from_static("x-envoy-force-trace");

const TRACE_BYTE_POSITION: usize = 14;
const TRACE_SAMPLED: u8 = b'9';
const TRACE_FORCED: u8 = b'a';
const TRACE_CLIENT: u8 = b'b';
const NO_TRACE: u8 = b'4';
const UUID_LENGTH: usize = 36;

/// Envoy's `Tracing::Reason`, counted as `http.<prefix>.tracing.<reason>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    NotTraceable,
    HealthCheck,
    Sampling,
    ServiceForced,
    ClientForced,
}

impl Reason {
    /// Whether the request is traced (Envoy's `Decision::traced`).
    pub fn traced(self) -> bool {
        matches!(
            self,
            Reason::Sampling | Reason::ServiceForced | Reason::ClientForced
        )
    }
}

/// `UuidRequestIdConfig`, Envoy's defaults (both true) where unset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UuidRequestId {
    pub pack_trace_reason: bool,
    pub use_request_id_for_trace_sampling: bool,
}

impl Default for UuidRequestId {
    fn default() -> Self {
        UuidRequestId {
            pack_trace_reason: true,
            use_request_id_for_trace_sampling: true,
        }
    }
}

/// The HCM's three sampling percentages (`client_sampling`, `random_sampling`,
/// `overall_sampling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub client: Percent,
    pub random: Percent,
    pub overall: Percent,
}

impl UuidRequestId {
    /// The request's trace reason, packed into its `x-request-id` as Envoy does.
    pub fn decide(&self, headers: &mut HeaderMap, sampling: &Sampling) -> Reason {
        if !self.use_request_id_for_trace_sampling {
            return Reason::Sampling;
        }
        let Some(random) = request_id_integer(headers) else {
            return Reason::NotTraceable;
        };
        let random = random % 10_000;
        let mut reason = self.trace_reason(headers);
        if reason == Reason::NotTraceable {
            if headers.contains_key(CLIENT_TRACE_ID) && sampling.client.hit(random) {
                reason = Reason::ClientForced;
                self.set_trace_reason(headers, reason);
            } else if headers.contains_key(FORCE_TRACE) {
                reason = Reason::ServiceForced;
                self.set_trace_reason(headers, reason);
            } else if sampling.random.hit(random) {
                reason = Reason::Sampling;
                self.set_trace_reason(headers, reason);
            }
        }
        if reason != Reason::NotTraceable && !sampling.overall.hit(random) {
            reason = Reason::NotTraceable;
            self.set_trace_reason(headers, reason);
        }
        reason
    }

    fn trace_reason(&self, headers: &HeaderMap) -> Reason {
        if !self.pack_trace_reason {
            return Reason::NotTraceable;
        }
        match uuid(headers).map(|id| id[TRACE_BYTE_POSITION]) {
            Some(TRACE_FORCED) => Reason::ServiceForced,
            Some(TRACE_SAMPLED) => Reason::Sampling,
            Some(TRACE_CLIENT) => Reason::ClientForced,
            _ => Reason::NotTraceable,
        }
    }

    fn set_trace_reason(&self, headers: &mut HeaderMap, reason: Reason) {
        if !self.pack_trace_reason {
            return;
        }
        let Some(id) = uuid(headers) else { return };
        let mut id = id.to_vec();
        id[TRACE_BYTE_POSITION] = match reason {
            Reason::ServiceForced => TRACE_FORCED,
            Reason::ClientForced => TRACE_CLIENT,
            Reason::Sampling => TRACE_SAMPLED,
            Reason::NotTraceable | Reason::HealthCheck => NO_TRACE,
        };
        if let Ok(mut value) = HeaderValue::from_bytes(&id) {
            value.set_sensitive(true);
            headers.insert(REQUEST_ID, value);
        }
    }
}

/// The request id if it has a UUID's length.
fn uuid(headers: &HeaderMap) -> Option<&[u8]> {
    headers
        .get(REQUEST_ID)
        .map(HeaderValue::as_bytes)
        .filter(|id| id.len() == UUID_LENGTH)
}

/// The id's first 8 hex digits as a number (Envoy's `getInteger`).
fn request_id_integer(headers: &HeaderMap) -> Option<u64> {
    let id = headers.get(REQUEST_ID)?.to_str().ok()?;
    u64::from_str_radix(id.get(..8)?, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn percent(value: f64) -> Percent {
        Percent {
            numerator: (value * 100.0).round() as u64,
            denominator: 10_000,
        }
    }

    fn sampling(random: f64) -> Sampling {
        Sampling {
            client: percent(100.0),
            random: percent(random),
            overall: percent(100.0),
        }
    }

    fn with_id(id: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_str(id).unwrap());
        h
    }

    #[test]
    fn a_sampled_request_id_carries_9_at_its_15th_character() {
        let mut h = with_id("11e8d62e-8df6-4699-9678-da2ae9267762");
        let ext = UuidRequestId::default();
        assert_eq!(ext.decide(&mut h, &sampling(100.0)), Reason::Sampling);
        assert_eq!(h[REQUEST_ID], "11e8d62e-8df6-9699-9678-da2ae9267762");
        // The next proxy reads the decision back, whatever its own percentage.
        assert_eq!(ext.decide(&mut h, &sampling(0.0)), Reason::Sampling);
    }

    #[test]
    fn random_sampling_takes_the_ids_first_digits_modulo_10000() {
        // 0x00000064 = 100: sampled at 1.01 %, not at 1 %.
        let ext = UuidRequestId::default();
        let mut h = with_id("00000064-8df6-4699-9678-da2ae9267762");
        assert_eq!(ext.decide(&mut h, &sampling(1.0)), Reason::NotTraceable);
        let mut h = with_id("00000064-8df6-4699-9678-da2ae9267762");
        assert_eq!(ext.decide(&mut h, &sampling(1.01)), Reason::Sampling);
    }

    #[test]
    fn without_the_request_id_every_request_is_sampled() {
        let ext = UuidRequestId {
            pack_trace_reason: true,
            use_request_id_for_trace_sampling: false,
        };
        let mut h = with_id("11e8d62e-8df6-4699-9678-da2ae9267762");
        assert_eq!(ext.decide(&mut h, &sampling(0.0)), Reason::Sampling);
        assert_eq!(h[REQUEST_ID], "11e8d62e-8df6-4699-9678-da2ae9267762");
    }
}
