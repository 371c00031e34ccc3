//! Exponential back-off, shared by every retry loop: tcp_proxy's ENOMEM write retries,
//! the router's request retries and the xDS client's reconnects. It lives here, below
//! `tcp`, `http` and `xds`, so all three can use it.
//!
//! Attempt `n` (from 0) has a ceiling of `base * 2^n`, at most `max`; the wait is the
//! ceiling itself, or a uniformly random part of it (jitter, so that many clients
//! failing together do not retry together).

use std::time::Duration;

/// How much of the ceiling a wait takes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Jitter {
    /// The ceiling itself.
    None,
    /// Uniformly random in `[floor × ceiling, ceiling)`: with a floor of 0, the "full
    /// jitter" of Envoy's `JitteredExponentialBackOffStrategy`.
    Full { floor: f64 },
}

/// A back-off schedule: base, cap and jitter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
    pub jitter: Jitter,
}

impl Backoff {
    /// Doubling from `base` to at most `max`, without jitter.
    pub const fn exponential(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max,
            jitter: Jitter::None,
        }
    }

    /// The same schedule, each wait uniformly random in `[floor × ceiling, ceiling)`.
    pub const fn full_jitter(self, floor: f64) -> Backoff {
        Backoff {
            jitter: Jitter::Full { floor },
            ..self
        }
    }

    /// The longest wait before attempt `attempt` (from 0): `base * 2^attempt`, at most
    /// `max`, without overflowing however large `attempt` grows.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        2u32.checked_pow(attempt)
            .and_then(|factor| self.base.checked_mul(factor))
            .map_or(self.max, |ceiling| ceiling.min(self.max))
    }

    /// The wait before attempt `attempt`.
    pub fn delay(&self, attempt: u32) -> Duration {
        let ceiling = self.ceiling(attempt);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full { floor } => {
                let floor = floor.clamp(0.0, 1.0);
                ceiling.mul_f64(floor + (1.0 - floor) * fastrand::f64())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn ceilings_double_from_the_base_up_to_the_cap() {
        let backoff = Backoff::exponential(MS, 100 * MS);
        let ceilings: Vec<_> = (0..9).map(|a| backoff.ceiling(a)).collect();
        let expected = [1, 2, 4, 8, 16, 32, 64, 100, 100].map(|ms| ms * MS);
        assert_eq!(ceilings, expected);
    }

    #[test]
    fn huge_attempts_stay_at_the_cap() {
        let backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(30));
        for attempt in [31, 32, 63, 64, 1000, u32::MAX] {
            assert_eq!(
                backoff.ceiling(attempt),
                Duration::from_secs(30),
                "{attempt}"
            );
        }
        let big = Backoff::exponential(Duration::MAX, Duration::MAX);
        assert_eq!(big.ceiling(5), Duration::MAX);
    }

    #[test]
    fn without_jitter_the_wait_is_the_ceiling() {
        let backoff = Backoff::exponential(25 * MS, 250 * MS);
        for attempt in 0..10 {
            assert_eq!(backoff.delay(attempt), backoff.ceiling(attempt));
        }
    }

    #[test]
    fn full_jitter_spreads_waits_evenly_between_floor_and_ceiling() {
        for floor in [0.0, 0.1] {
            let backoff = Backoff::exponential(500 * MS, 30 * 1000 * MS).full_jitter(floor);
            let ceiling = backoff.ceiling(3);
            assert_eq!(ceiling, 4000 * MS);
            let n = 20_000;
            let mut sum = Duration::ZERO;
            let mut buckets = [0u32; 10];
            for _ in 0..n {
                let wait = backoff.delay(3);
                assert!(wait >= ceiling.mul_f64(floor) && wait < ceiling, "{wait:?}");
                sum += wait;
                buckets[(wait.as_secs_f64() / ceiling.as_secs_f64() * 10.0) as usize] += 1;
            }
            // The mean is the middle of the range; each tenth above the floor is hit.
            let mean = (sum / n).as_secs_f64() / ceiling.as_secs_f64();
            let middle = floor + (1.0 - floor) / 2.0;
            assert!((mean - middle).abs() < 0.02, "floor {floor}: mean {mean}");
            let first = (floor * 10.0).round() as usize;
            assert!(buckets[first..].iter().all(|&b| b > 0), "{buckets:?}");
            assert!(buckets[..first].iter().all(|&b| b == 0), "{buckets:?}");
        }
    }
}
