//! A fast per-thread pseudo-random source for load balancing decisions (RANDOM,
//! LEAST_REQUEST's choices, weighted clusters, outlier enforcement). Not for secrets:
//! it only has to spread picks evenly and never contend across worker threads.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};

thread_local! {
    // RandomState is seeded from the OS once per thread, so threads diverge.
    static STATE: Cell<u64> = Cell::new(
        std::collections::hash_map::RandomState::new().build_hasher().finish() | 1,
    );
}

/// A uniformly distributed `u64` (wyrand).
pub fn next_u64() -> u64 {
    STATE.with(|state| {
        let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
        state.set(s);
        let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
        ((t >> 64) as u64) ^ (t as u64)
    })
}

/// A uniformly distributed number in `0..n` (`n` > 0), without modulo bias worth noting
/// for the small `n` of host lists (Lemire's multiply-shift).
pub fn below(n: u64) -> u64 {
    ((u128::from(next_u64()) * u128::from(n)) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_stays_in_range_and_reaches_every_value() {
        let mut seen = [0u32; 7];
        for _ in 0..7000 {
            seen[below(7) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 0), "{seen:?}");
    }
}
