//! Outlier detection (Envoy's cluster `outlier_detection`), passive health checking on
//! what real connections see: a host that fails `consecutive` connects in a row (local
//! origin failures: refused, unreachable, timed out) is ejected from load balancing for
//! `base_ejection_time` times the number of times it was ejected, capped at
//! `max_ejection_time`, unless `max_ejection_percent` of the cluster is already out.
//!
//! Without `split_external_local_origin_errors`, Envoy counts a connect failure as a
//! 5xx, so `consecutive_5xx` sets the threshold; with it, `consecutive_local_origin_failure`
//! does. Ejected hosts come back when their time is up (Envoy checks on its `interval`
//! timer; returning exactly at expiry is the same bound, sooner).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::host::Host;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutlierDetection {
    /// Consecutive local-origin failures that eject a host.
    pub consecutive: u32,
    /// Percent chance an ejection is enforced when the threshold is reached.
    pub enforcing: u32,
    pub base_ejection_time: Duration,
    pub max_ejection_time: Duration,
    pub max_ejection_percent: u32,
}

impl Default for OutlierDetection {
    /// Envoy's defaults.
    fn default() -> Self {
        OutlierDetection {
            consecutive: 5,
            enforcing: 100,
            base_ejection_time: Duration::from_secs(30),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 10,
        }
    }
}

impl OutlierDetection {
    /// A connect to `host` succeeded: its failure streak ends.
    pub fn on_success(&self, host: &Host) {
        host.consecutive_failures.store(0, Ordering::Relaxed);
    }

    /// A connect to `host` failed. Returns how long to eject it for, if this failure
    /// ejects it; `ejected` and `total` count the cluster's hosts.
    pub fn on_failure(&self, host: &Host, ejected: usize, total: usize) -> Option<Duration> {
        let streak = host.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if streak < self.consecutive {
            return None;
        }
        host.consecutive_failures.store(0, Ordering::Relaxed);
        if host.has_flag(super::host::FAILED_OUTLIER_CHECK) {
            return None;
        }
        // Envoy lets the first ejection through whatever the percentage, and refuses
        // one that would start from at or over the cap.
        let ejected_percent = if total == 0 {
            100.0
        } else {
            100.0 * ejected as f64 / total as f64
        };
        if ejected_percent >= f64::from(self.max_ejection_percent) {
            return None;
        }
        if fastrand::u32(..100) >= self.enforcing {
            return None;
        }
        let times = host.ejections.fetch_add(1, Ordering::Relaxed) + 1;
        let time = self.base_ejection_time.saturating_mul(times);
        Some(time.min(self.max_ejection_time.max(self.base_ejection_time)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector(consecutive: u32) -> OutlierDetection {
        OutlierDetection {
            consecutive,
            base_ejection_time: Duration::from_secs(10),
            max_ejection_time: Duration::from_secs(25),
            max_ejection_percent: 50,
            ..Default::default()
        }
    }

    #[test]
    fn the_nth_consecutive_failure_ejects_and_a_success_resets_the_streak() {
        let od = detector(3);
        let host = Host::new("127.0.0.1:1".parse().unwrap());
        assert_eq!(od.on_failure(&host, 0, 4), None);
        assert_eq!(od.on_failure(&host, 0, 4), None);
        od.on_success(&host);
        assert_eq!(od.on_failure(&host, 0, 4), None);
        assert_eq!(od.on_failure(&host, 0, 4), None);
        assert_eq!(od.on_failure(&host, 0, 4), Some(Duration::from_secs(10)));
    }

    #[test]
    fn ejection_time_grows_with_each_ejection_up_to_the_cap() {
        let od = detector(1);
        let host = Host::new("127.0.0.1:1".parse().unwrap());
        let times: Vec<_> = (0..3)
            .map(|_| od.on_failure(&host, 0, 4).unwrap())
            .collect();
        assert_eq!(times, [10, 20, 25].map(Duration::from_secs));
    }

    #[test]
    fn max_ejection_percent_keeps_enough_hosts_in() {
        let od = detector(1);
        let host = Host::new("127.0.0.1:1".parse().unwrap());
        // 1 of 4 out is 25%, under 50%: eject. 2 of 4 is at the cap: keep.
        assert!(od.on_failure(&host, 1, 4).is_some());
        let other = Host::new("127.0.0.1:2".parse().unwrap());
        assert!(od.on_failure(&other, 2, 4).is_none());
        // The first ejection is allowed even when one host is over the percentage.
        let lone = Host::new("127.0.0.1:3".parse().unwrap());
        let strict = OutlierDetection {
            max_ejection_percent: 10,
            ..detector(1)
        };
        assert!(strict.on_failure(&lone, 0, 2).is_some());
    }

    #[test]
    fn enforcing_zero_never_ejects() {
        let od = OutlierDetection {
            enforcing: 0,
            ..detector(1)
        };
        let host = Host::new("127.0.0.1:1".parse().unwrap());
        assert!((0..20).all(|_| od.on_failure(&host, 0, 4).is_none()));
    }
}
