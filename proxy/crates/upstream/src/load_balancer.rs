//! Load balancers (Envoy's `lb_policy`): which host of a cluster the next connection goes
//! to. A [`Balancer`] is built for one set of hosts and rebuilt whenever that set or its
//! health changes, so the expensive tables of RING_HASH and MAGLEV are computed once
//! per change, never per connection.
//!
//! Every policy honours [`LbContext::tried`]: a retried connect goes to a host not tried
//! yet when there is one (Envoy's `previous_hosts` predicate), so `max_connect_attempts`
//! fails over instead of knocking on the same door.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use xxhash_rust::xxh64::xxh64;

use super::host::Host;

/// Envoy's defaults for RING_HASH and MAGLEV.
pub const DEFAULT_MIN_RING_SIZE: u64 = 1024;
pub const DEFAULT_MAX_RING_SIZE: u64 = 8 * 1024 * 1024;
pub const DEFAULT_MAGLEV_TABLE_SIZE: u64 = 65_537;

#[derive(Clone, Debug, PartialEq)]
pub enum LbPolicy {
    RoundRobin,
    /// Power of `choice_count` choices on active connections; with unequal weights,
    /// weights scaled down by load, as Envoy does: `weight / (active + 1) ^ bias`.
    LeastRequest {
        choice_count: u32,
        active_request_bias: f64,
    },
    Random,
    RingHash {
        min_ring_size: u64,
        max_ring_size: u64,
    },
    Maglev {
        /// A prime, as Maglev's permutations need.
        table_size: u64,
    },
}

impl LbPolicy {
    pub fn name(&self) -> &'static str {
        match self {
            LbPolicy::RoundRobin => "ROUND_ROBIN",
            LbPolicy::LeastRequest { .. } => "LEAST_REQUEST",
            LbPolicy::Random => "RANDOM",
            LbPolicy::RingHash { .. } => "RING_HASH",
            LbPolicy::Maglev { .. } => "MAGLEV",
        }
    }
}

/// What a pick may depend on besides the hosts.
#[derive(Debug, Default, Clone, Copy)]
pub struct LbContext<'a> {
    /// The hash of the connection's key (RING_HASH, MAGLEV); random when absent.
    pub hash: Option<u64>,
    /// Hosts this connection already failed to connect to.
    pub tried: &'a [SocketAddr],
}

/// Envoy's hash of a hash policy's key: xxHash64, seed 0.
pub fn hash_key(key: &[u8]) -> u64 {
    xxh64(key, 0)
}

/// A load balancer over one fixed list of hosts.
#[derive(Debug)]
pub struct Balancer {
    hosts: Vec<Arc<Host>>,
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    RoundRobin {
        next: AtomicUsize,
        /// Smooth weighted round robin's running scores, when weights differ.
        weighted: Option<Mutex<Vec<i64>>>,
    },
    LeastRequest {
        choice_count: u32,
    },
    /// Unequal weights: smooth weighted round robin over load-scaled weights, Envoy's
    /// earliest-deadline-first schedule in effect.
    WeightedLeastRequest {
        bias: f64,
        scores: Mutex<Vec<f64>>,
    },
    Random,
    /// Sorted by hash; each entry names an index into `hosts`.
    RingHash {
        ring: Vec<(u64, u32)>,
    },
    /// Slot to index into `hosts`.
    Maglev {
        table: Vec<u32>,
    },
}

impl Balancer {
    pub fn new(policy: &LbPolicy, hosts: Vec<Arc<Host>>) -> Self {
        let kind = match *policy {
            LbPolicy::RoundRobin => Kind::RoundRobin {
                next: AtomicUsize::new(0),
                weighted: hosts
                    .iter()
                    .any(|h| h.weight != hosts[0].weight)
                    .then(|| Mutex::new(vec![0; hosts.len()])),
            },
            LbPolicy::LeastRequest {
                choice_count,
                active_request_bias,
            } => {
                if hosts.iter().any(|h| h.weight != hosts[0].weight) {
                    Kind::WeightedLeastRequest {
                        bias: active_request_bias,
                        scores: Mutex::new(vec![0.0; hosts.len()]),
                    }
                } else {
                    Kind::LeastRequest {
                        choice_count: choice_count.max(2),
                    }
                }
            }
            LbPolicy::Random => Kind::Random,
            LbPolicy::RingHash {
                min_ring_size,
                max_ring_size,
            } => Kind::RingHash {
                ring: build_ring(&hosts, min_ring_size, max_ring_size),
            },
            LbPolicy::Maglev { table_size } => Kind::Maglev {
                table: build_maglev(&hosts, table_size),
            },
        };
        Balancer { hosts, kind }
    }

    pub fn hosts(&self) -> &[Arc<Host>] {
        &self.hosts
    }

    /// The host for a new connection, or `None` when there is no host at all.
    pub fn choose(&self, ctx: &LbContext<'_>) -> Option<Arc<Host>> {
        if self.hosts.is_empty() {
            return None;
        }
        let untried = |h: &Arc<Host>| !ctx.tried.contains(&h.address);
        let hash = ctx.hash.unwrap_or_else(|| fastrand::u64(..));
        // Every policy reaches a different host within a few attempts; the bound only
        // guards against RANDOM's bad luck.
        for attempt in 0..self.hosts.len() * 2 + 2 {
            let host = self.pick(hash, attempt as u64);
            if untried(host) {
                return Some(host.clone());
            }
        }
        // Everything was tried (or luck ran out): retry the first untried, else the pick.
        self.hosts
            .iter()
            .find(|h| untried(h))
            .or_else(|| Some(self.pick(hash, 0)))
            .cloned()
    }

    fn pick(&self, hash: u64, attempt: u64) -> &Arc<Host> {
        let n = self.hosts.len();
        match &self.kind {
            Kind::RoundRobin {
                weighted: Some(scores),
                ..
            } => {
                let mut scores = scores.lock().unwrap_or_else(|e| e.into_inner());
                let total: i64 = self.hosts.iter().map(|h| i64::from(h.weight)).sum();
                let mut best = 0;
                for (i, host) in self.hosts.iter().enumerate() {
                    scores[i] += i64::from(host.weight);
                    if scores[i] > scores[best] {
                        best = i;
                    }
                }
                scores[best] -= total;
                &self.hosts[best]
            }
            Kind::RoundRobin { next, .. } => &self.hosts[next.fetch_add(1, Ordering::Relaxed) % n],
            Kind::Random => &self.hosts[fastrand::usize(..n)],
            Kind::LeastRequest { choice_count } => {
                let mut best = &self.hosts[fastrand::usize(..n)];
                for _ in 1..*choice_count {
                    let other = &self.hosts[fastrand::usize(..n)];
                    if other.active_connections() < best.active_connections() {
                        best = other;
                    }
                }
                best
            }
            Kind::WeightedLeastRequest { bias, scores } => {
                let mut scores = scores.lock().unwrap_or_else(|e| e.into_inner());
                let effective: Vec<f64> = self
                    .hosts
                    .iter()
                    .map(|h| {
                        f64::from(h.weight) / (h.active_connections() as f64 + 1.0).powf(*bias)
                    })
                    .collect();
                let total: f64 = effective.iter().sum();
                let mut best = 0;
                for (i, weight) in effective.iter().enumerate() {
                    scores[i] += weight;
                    if scores[i] > scores[best] {
                        best = i;
                    }
                }
                scores[best] -= total;
                &self.hosts[best]
            }
            Kind::RingHash { ring } => {
                // The first point at or after the hash, wrapping; a retry walks on.
                let start = ring.partition_point(|&(point, _)| point < hash);
                let (_, index) = ring[(start + attempt as usize) % ring.len()];
                &self.hosts[index as usize]
            }
            Kind::Maglev { table } => {
                let slot = (hash % table.len() as u64 + attempt) % table.len() as u64;
                &self.hosts[table[slot as usize] as usize]
            }
        }
    }

    #[cfg(test)]
    fn ring(&self) -> &[(u64, u32)] {
        match &self.kind {
            Kind::RingHash { ring } => ring,
            _ => &[],
        }
    }

    #[cfg(test)]
    fn maglev_table(&self) -> &[u32] {
        match &self.kind {
            Kind::Maglev { table } => table,
            _ => &[],
        }
    }
}

/// Envoy's ring: each host gets points in proportion to its weight, at least
/// `min_ring_size` in all (scaled so the lightest host still gets one), at most
/// `max_ring_size`; point `i` of a host is `xxHash64("ADDRESS:PORT_i")`.
fn build_ring(hosts: &[Arc<Host>], min_ring_size: u64, max_ring_size: u64) -> Vec<(u64, u32)> {
    if hosts.is_empty() {
        return Vec::new();
    }
    let total: f64 = hosts.iter().map(|h| f64::from(h.weight)).sum();
    let min_weight = hosts
        .iter()
        .map(|h| f64::from(h.weight) / total)
        .fold(1.0, f64::min);
    let scale = ((min_weight * min_ring_size as f64).ceil() / min_weight).min(max_ring_size as f64);
    let mut ring = Vec::with_capacity(scale.ceil() as usize);
    let (mut current, mut target) = (0.0, 0.0);
    for (index, host) in hosts.iter().enumerate() {
        let key = host.hash_key();
        target += scale * f64::from(host.weight) / total;
        let mut i = 0u64;
        while current < target {
            let point = xxh64(format!("{key}_{i}").as_bytes(), 0);
            ring.push((point, index as u32));
            i += 1;
            current += 1.0;
        }
    }
    ring.sort_unstable();
    ring
}

/// Envoy's weighted Maglev table: each host walks its own permutation of the slots
/// (offset and skip from its address's hash) and claims the next free one, as often as
/// its weight allows relative to the heaviest host.
fn build_maglev(hosts: &[Arc<Host>], table_size: u64) -> Vec<u32> {
    if hosts.is_empty() {
        return Vec::new();
    }
    struct Entry {
        offset: u64,
        skip: u64,
        weight: f64,
        target: f64,
        next: u64,
    }
    let total: f64 = hosts.iter().map(|h| f64::from(h.weight)).sum();
    let mut entries: Vec<Entry> = hosts
        .iter()
        .map(|host| {
            let key = host.hash_key();
            Entry {
                offset: xxh64(key.as_bytes(), 0) % table_size,
                skip: xxh64(key.as_bytes(), 1) % (table_size - 1) + 1,
                weight: f64::from(host.weight) / total,
                target: 0.0,
                next: 0,
            }
        })
        .collect();
    let max_weight = entries.iter().map(|e| e.weight).fold(0.0, f64::max);
    let mut table = vec![u32::MAX; table_size as usize];
    let mut filled = 0u64;
    let mut iteration = 1u64;
    while filled < table_size {
        for (index, entry) in entries.iter_mut().enumerate() {
            if filled == table_size {
                break;
            }
            if (iteration as f64) * entry.weight < entry.target {
                continue;
            }
            entry.target += max_weight;
            let mut slot = (entry.offset + entry.skip * entry.next) % table_size;
            while table[slot as usize] != u32::MAX {
                entry.next += 1;
                slot = (entry.offset + entry.skip * entry.next) % table_size;
            }
            table[slot as usize] = index as u32;
            entry.next += 1;
            filled += 1;
        }
        iteration += 1;
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn hosts(n: u16) -> Vec<Arc<Host>> {
        (0..n)
            .map(|i| Arc::new(Host::new(SocketAddr::from(([10, 0, 0, 1], 8000 + i)))))
            .collect()
    }

    fn counts(
        balancer: &Balancer,
        picks: usize,
        ctx: impl Fn(usize) -> Option<u64>,
    ) -> HashMap<SocketAddr, usize> {
        let mut seen = HashMap::new();
        for i in 0..picks {
            let ctx = LbContext {
                hash: ctx(i),
                tried: &[],
            };
            *seen
                .entry(balancer.choose(&ctx).unwrap().address)
                .or_default() += 1;
        }
        seen
    }

    #[test]
    fn round_robin_visits_hosts_in_turn() {
        let hosts = hosts(3);
        let lb = Balancer::new(&LbPolicy::RoundRobin, hosts.clone());
        let picks: Vec<_> = (0..6)
            .map(|_| lb.choose(&LbContext::default()).unwrap().address)
            .collect();
        let expected: Vec<_> = hosts.iter().chain(&hosts).map(|h| h.address).collect();
        assert_eq!(picks, expected);
    }

    #[test]
    fn weighted_round_robin_is_exact_and_interleaved() {
        let a = Arc::new(Host::new("10.0.0.1:1".parse().unwrap()).with_weight(3));
        let b = Arc::new(Host::new("10.0.0.2:1".parse().unwrap()).with_weight(1));
        let lb = Balancer::new(&LbPolicy::RoundRobin, vec![a.clone(), b.clone()]);
        let picks: Vec<_> = (0..8)
            .map(|_| lb.choose(&LbContext::default()).unwrap().address == a.address)
            .collect();
        // Smooth weighted round robin: a a b a | a a b a, never b twice in a row.
        assert_eq!(picks.iter().filter(|&&is_a| is_a).count(), 6);
        assert!(!picks.windows(2).any(|w| !w[0] && !w[1]));
    }

    #[test]
    fn a_retry_goes_to_a_host_not_tried_yet() {
        let hosts = hosts(3);
        for policy in [
            LbPolicy::RoundRobin,
            LbPolicy::Random,
            LbPolicy::LeastRequest {
                choice_count: 2,
                active_request_bias: 1.0,
            },
            LbPolicy::RingHash {
                min_ring_size: 64,
                max_ring_size: 1024,
            },
            LbPolicy::Maglev { table_size: 251 },
        ] {
            let lb = Balancer::new(&policy, hosts.clone());
            let tried = [hosts[0].address, hosts[1].address];
            for hash in 0..20u64 {
                let ctx = LbContext {
                    hash: Some(hash.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    tried: &tried,
                };
                assert_eq!(
                    lb.choose(&ctx).unwrap().address,
                    hosts[2].address,
                    "{policy:?}"
                );
            }
        }
    }

    #[test]
    fn random_reaches_every_host_roughly_evenly() {
        let lb = Balancer::new(&LbPolicy::Random, hosts(4));
        let seen = counts(&lb, 4000, |_| None);
        assert_eq!(seen.len(), 4);
        // Expected 1000 each; 700 is more than 9 standard deviations away.
        assert!(seen.values().all(|&n| n > 700), "{seen:?}");
    }

    #[test]
    fn least_request_avoids_the_busiest_host() {
        let hosts = hosts(3);
        let _busy: Vec<_> = (0..5).map(|_| hosts[0].track_connection()).collect();
        let lb = Balancer::new(
            &LbPolicy::LeastRequest {
                choice_count: 2,
                active_request_bias: 1.0,
            },
            hosts.clone(),
        );
        let seen = counts(&lb, 3000, |_| None);
        // The busy host wins only when both choices land on it: 1/9 of the time.
        let busy = seen.get(&hosts[0].address).copied().unwrap_or(0);
        assert!(busy < 600, "{seen:?}");
        assert!(seen[&hosts[1].address] > busy && seen[&hosts[2].address] > busy);
    }

    #[test]
    fn least_request_with_all_choices_picks_the_least_loaded() {
        let hosts = hosts(2);
        let _busy = hosts[0].track_connection();
        let lb = Balancer::new(
            &LbPolicy::LeastRequest {
                choice_count: 2,
                active_request_bias: 1.0,
            },
            hosts.clone(),
        );
        // Two random choices among two hosts: whenever both are seen, host 1 wins, so
        // host 0 only ever gets picks where both choices were host 0.
        let seen = counts(&lb, 2000, |_| None);
        assert!(seen[&hosts[1].address] > 1200, "{seen:?}");
    }

    #[test]
    fn weighted_least_request_follows_weights_and_load() {
        let mut hosts = hosts(2);
        hosts[0] = Arc::new(Host::new(hosts[0].address).with_weight(3));
        let policy = LbPolicy::LeastRequest {
            choice_count: 2,
            active_request_bias: 1.0,
        };
        let lb = Balancer::new(&policy, hosts.clone());
        let seen = counts(&lb, 400, |_| None);
        assert_eq!(seen[&hosts[0].address], 300, "idle: by weight 3:1 {seen:?}");
        // Three open connections on the heavy host: 3/(3+1) against 1/(0+1), 3:4.
        let _busy: Vec<_> = (0..3).map(|_| hosts[0].track_connection()).collect();
        let lb = Balancer::new(&policy, hosts.clone());
        let seen = counts(&lb, 400, |_| None);
        assert!(
            (170..=172).contains(&seen[&hosts[0].address]),
            "loaded: {seen:?}"
        );
    }

    #[test]
    fn ring_hash_is_stable_and_sized_as_envoy() {
        let lb = Balancer::new(
            &LbPolicy::RingHash {
                min_ring_size: 1024,
                max_ring_size: 8 << 20,
            },
            hosts(4),
        );
        assert_eq!(lb.ring().len(), 1024);
        assert!(lb.ring().windows(2).all(|w| w[0].0 <= w[1].0));
        let ctx = LbContext {
            hash: Some(hash_key(b"10.1.2.3")),
            tried: &[],
        };
        let first = lb.choose(&ctx).unwrap().address;
        assert!((0..50).all(|_| lb.choose(&ctx).unwrap().address == first));
        // Each host owns a fair share of the ring points.
        let seen = counts(&lb, 4000, |i| Some(hash_key(&i.to_le_bytes())));
        assert!(seen.values().all(|&n| n > 500), "{seen:?}");
    }

    #[test]
    fn ring_hash_moves_only_the_keys_of_a_removed_host() {
        let policy = LbPolicy::RingHash {
            min_ring_size: 1024,
            max_ring_size: 8 << 20,
        };
        let all = hosts(5);
        let before = Balancer::new(&policy, all.clone());
        let removed = all[2].address;
        let after = Balancer::new(
            &policy,
            all.iter()
                .filter(|h| h.address != removed)
                .cloned()
                .collect(),
        );
        let (mut moved, mut on_removed, mut stayed) = (0, 0, 0);
        for key in 0..5000u32 {
            let ctx = LbContext {
                hash: Some(hash_key(&key.to_le_bytes())),
                tried: &[],
            };
            let was = before.choose(&ctx).unwrap().address;
            let now = after.choose(&ctx).unwrap().address;
            if was == removed {
                on_removed += 1;
                assert_ne!(now, removed);
            } else if was != now {
                moved += 1;
            } else {
                stayed += 1;
            }
        }
        assert!(on_removed > 0);
        // Each surviving host keeps its points, so its keys stay, except those a point
        // it gains takes: Envoy's ring keeps at least min_ring_size points, so four hosts
        // get 256 each where five had 205, about a fifth more. Modulo hashing would move
        // four fifths.
        assert!(
            moved * 4 < moved + stayed,
            "{moved} of {} moved",
            moved + stayed
        );
    }

    #[test]
    fn maglev_fills_every_slot_evenly() {
        let table_size = 65_537;
        let lb = Balancer::new(&LbPolicy::Maglev { table_size }, hosts(3));
        let table = lb.maglev_table();
        assert_eq!(table.len() as u64, table_size);
        let mut per_host = [0u64; 3];
        for &index in table {
            per_host[index as usize] += 1;
        }
        // Equal weights: every host owns a third of the table, to within one slot.
        let max = *per_host.iter().max().unwrap();
        let min = *per_host.iter().min().unwrap();
        assert!(max - min <= 1, "{per_host:?}");
    }

    #[test]
    fn maglev_honours_weights_and_is_mostly_stable_on_removal() {
        let table_size = 65_537;
        let mut all = hosts(4);
        all[0] = Arc::new(Host::new(all[0].address).with_weight(2));
        let lb = Balancer::new(&LbPolicy::Maglev { table_size }, all.clone());
        let mut per_host = [0f64; 4];
        for &index in lb.maglev_table() {
            per_host[index as usize] += 1.0;
        }
        // Weight 2 of 5: 40% of the slots, others 20%.
        assert!(
            (per_host[0] / table_size as f64 - 0.4).abs() < 0.01,
            "{per_host:?}"
        );

        let equal = hosts(4);
        let before = Balancer::new(&LbPolicy::Maglev { table_size }, equal.clone());
        let after = Balancer::new(&LbPolicy::Maglev { table_size }, equal[..3].to_vec());
        let moved = before
            .maglev_table()
            .iter()
            .zip(after.maglev_table())
            .filter(|&(&b, &a)| b != 3 && b != a)
            .count();
        // Maglev trades a little disruption for even load; most slots stay put.
        assert!((moved as f64) < 0.1 * table_size as f64, "{moved}");
    }

    #[test]
    fn no_hosts_means_no_pick() {
        for policy in [LbPolicy::RoundRobin, LbPolicy::Maglev { table_size: 7 }] {
            assert!(
                Balancer::new(&policy, Vec::new())
                    .choose(&LbContext::default())
                    .is_none()
            );
        }
    }
}
