//! Decision events from user space's side: the switches (node-wide `EVENTS_ON[0]`, a
//! pod's `flags::EVENTS`), the reader of the `EVENTS` ring, and an event as a person or
//! a tool reads it (`shunt inspect --follow`).
//!
//! The ring hands each record to one reader, so one follower at a time holds a lock on
//! the bpffs root. The programs never wait for it: a full ring drops the record and
//! counts it in `EVENTS_DROPPED`, which the follower reports.

use std::{
    collections::HashMap,
    fs::File,
    net::SocketAddr,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, bail};
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray, RingBuf};
use shunt_common::{
    AddrKey, Decision, PodConfig, Rule,
    events::{DecisionEvent, NO_ID, switch},
    flags, pins,
};

use crate::bpffs::{Maps, words_addr};

/// Whether every decision on the node reports.
pub fn node_wide(root: &Path) -> anyhow::Result<bool> {
    let arr: Array<MapData, u32> = Array::try_from(Maps { root }.map(pins::EVENTS_ON)?)?;
    Ok(arr.get(&0, 0)? == switch::NODE)
}

/// Turns node-wide events on or off.
pub fn set_node_wide(root: &Path, on: bool) -> anyhow::Result<()> {
    let mut arr: Array<MapData, u32> = Array::try_from(Maps { root }.map(pins::EVENTS_ON)?)?;
    let value = if on { switch::NODE } else { switch::PODS };
    arr.set(0, value, 0).context("EVENTS_ON[0]")?;
    Ok(())
}

/// Records the ring had no room for, since the maps were created.
pub fn dropped(root: &Path) -> anyhow::Result<u64> {
    let arr: PerCpuArray<MapData, u64> =
        PerCpuArray::try_from(Maps { root }.map(pins::EVENTS_DROPPED)?)?;
    Ok(arr.get(&0, 0)?.iter().sum())
}

/// Whether `pod_id` reports its decisions.
pub fn pod_on(root: &Path, pod_id: u32) -> anyhow::Result<bool> {
    let config: BpfHashMap<MapData, u64, PodConfig> = Maps { root }.hash(pins::POD_CONFIG)?;
    Ok(config
        .iter()
        .filter_map(Result::ok)
        .any(|(_, pc)| pc.pod_id == pod_id && pc.flags & flags::EVENTS != 0))
}

/// Turns a pod's events on or off: its `POD_CONFIG` entry and the copies `POD_ADDRS`
/// holds for `sk_lookup`.
pub fn set_pod(root: &Path, pod_id: u32, on: bool) -> anyhow::Result<()> {
    let maps = Maps { root };
    let flip = |pc: &mut PodConfig| {
        if on {
            pc.flags |= flags::EVENTS;
        } else {
            pc.flags &= !flags::EVENTS;
        }
    };
    let mut config: BpfHashMap<MapData, u64, PodConfig> = maps.hash(pins::POD_CONFIG)?;
    let entries: Vec<(u64, PodConfig)> = config
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, pc)| pc.pod_id == pod_id)
        .collect();
    if entries.is_empty() {
        bail!(
            "pod_{pod_id} has no capture installed under {}",
            root.display()
        );
    }
    for (cookie, mut pc) in entries {
        flip(&mut pc);
        config.insert(cookie, pc, 0).context("POD_CONFIG")?;
    }
    let mut addrs: BpfHashMap<MapData, AddrKey, PodConfig> = maps.hash(pins::POD_ADDRS)?;
    let entries: Vec<(AddrKey, PodConfig)> = addrs
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, pc)| pc.pod_id == pod_id)
        .collect();
    for (key, mut pc) in entries {
        flip(&mut pc);
        addrs.insert(key, pc, 0).context("POD_ADDRS")?;
    }
    Ok(())
}

/// Which events a follower wants: the pods' switches it turned on (and turns off again
/// when dropped, so a follower leaves the data path as it found it).
pub struct Switched {
    root: PathBuf,
    node_wide: bool,
    pods: Vec<u32>,
}

impl Switched {
    /// Events on for `pods`, or node-wide when `pods` is empty; what was on already is
    /// left on afterwards.
    pub fn on(root: &Path, pods: &[u32]) -> anyhow::Result<Switched> {
        let mut switched = Switched {
            root: root.to_owned(),
            node_wide: false,
            pods: Vec::new(),
        };
        if node_wide(root)? {
            return Ok(switched);
        }
        if pods.is_empty() {
            set_node_wide(root, true)?;
            switched.node_wide = true;
        }
        for &pod in pods {
            if !pod_on(root, pod)? {
                set_pod(root, pod, true)?;
                switched.pods.push(pod);
            }
        }
        Ok(switched)
    }

    /// What this follower switched on, for its first line.
    pub fn describe(&self) -> String {
        match (self.node_wide, self.pods.as_slice()) {
            (true, _) => "events switched on node-wide until this follower exits".into(),
            (false, []) => "events were already on".into(),
            (false, pods) => format!(
                "events switched on for {} until this follower exits",
                pods.iter()
                    .map(|p| format!("pod_{p}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

impl Drop for Switched {
    fn drop(&mut self) {
        if self.node_wide {
            let _ = set_node_wide(&self.root, false);
        }
        for &pod in &self.pods {
            // The pod may have gone meanwhile; nothing to restore then.
            let _ = set_pod(&self.root, pod, false);
        }
    }
}

/// The one reader of the node's `EVENTS` ring.
pub struct Reader {
    ring: RingBuf<MapData>,
    /// flock on the bpffs root: one follower at a time.
    _lock: OwnedFd,
}

impl Reader {
    pub fn open(root: &Path) -> anyhow::Result<Reader> {
        let lock = lock_root(root)?;
        let path = root.join(pins::EVENTS);
        let data = MapData::from_pin(&path).with_context(|| {
            format!("opening {} (installed by an older shunt?)", path.display())
        })?;
        let ring = RingBuf::try_from(Map::RingBuf(data)).context("mapping the EVENTS ring")?;
        Ok(Reader { ring, _lock: lock })
    }

    /// The records waiting now, after waiting up to `timeout` for the first.
    pub fn next_batch(&mut self, timeout: Duration) -> Vec<DecisionEvent> {
        let mut out = self.drain();
        if out.is_empty() {
            let mut pfd = libc::pollfd {
                fd: self.ring.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd; a signal (EINTR) only ends the wait early.
            unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
            out = self.drain();
        }
        out
    }

    fn drain(&mut self) -> Vec<DecisionEvent> {
        let mut out = Vec::new();
        while let Some(item) = self.ring.next() {
            if item.len() >= size_of::<DecisionEvent>() {
                // SAFETY: the ring holds at least one DecisionEvent (plain integers, any
                // bit pattern valid); read_unaligned copies it out.
                out.push(unsafe { item.as_ptr().cast::<DecisionEvent>().read_unaligned() });
            }
        }
        out
    }
}

fn lock_root(root: &Path) -> anyhow::Result<OwnedFd> {
    let dir = File::open(root).with_context(|| format!("opening {}", root.display()))?;
    // SAFETY: flock on a descriptor this function owns.
    if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "another `shunt inspect --follow` is reading the decision events under {} (the ring hands each record to one reader)",
            root.display()
        );
    }
    // SAFETY: `into_raw_fd` hands over the descriptor that now carries the lock.
    Ok(unsafe { OwnedFd::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(dir)) })
}

/// One decision as `--follow` prints it (`--json`: one object a line).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Event {
    /// UTC, microseconds.
    pub time: String,
    pub time_unix_ns: u64,
    /// `pod_<id>`, or `null` when the decision came before a pod was known.
    pub pod: Option<String>,
    /// `namespace/name`, when known.
    pub pod_name: Option<String>,
    pub cookie: u64,
    pub protocol: &'static str,
    pub src: String,
    pub dst: String,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// `captured`, `passed`, `dropped`, or bookkeeping (`recorded`, `answered`, ...).
    pub outcome: &'static str,
    /// The decision (its counter's name), the reason.
    pub decision: &'static str,
    /// The istio-iptables rule (`23`, `16`, `9-12`, `-o`, ...), empty for none.
    pub rule: &'static str,
    pub rule_text: &'static str,
    /// Where a capture sent the connection.
    pub to_port: Option<u16>,
}

/// Turns kernel records into [`Event`]s: monotonic time to wall time, ids to names.
pub struct Renderer {
    /// CLOCK_REALTIME − CLOCK_MONOTONIC, nanoseconds.
    offset_ns: i128,
    names: HashMap<u32, String>,
    /// When `names` was read: a pod without a label is looked up again at most once a
    /// second (it may have been enrolled since), not for each of its events.
    names_read: std::time::Instant,
    root: PathBuf,
}

impl Renderer {
    pub fn new(root: &Path) -> Renderer {
        Renderer {
            offset_ns: clock_ns(libc::CLOCK_REALTIME) - clock_ns(libc::CLOCK_MONOTONIC),
            names: crate::pod_names::all(root),
            names_read: std::time::Instant::now(),
            root: root.to_owned(),
        }
    }

    pub fn event(&mut self, e: &DecisionEvent) -> Event {
        if e.pod_id != 0
            && !self.names.contains_key(&e.pod_id)
            && self.names_read.elapsed() > Duration::from_secs(1)
        {
            self.names = crate::pod_names::all(&self.root);
            self.names_read = std::time::Instant::now();
        }
        let decision = Decision::from_u32(e.decision);
        let rule = Rule::from_u16(e.rule);
        let unix_ns = (i128::from(e.time_ns) + self.offset_ns).max(0) as u64;
        let id = |v: u32| (v != NO_ID).then_some(v);
        Event {
            time: utc(unix_ns),
            time_unix_ns: unix_ns,
            pod: (e.pod_id != 0).then(|| format!("pod_{}", e.pod_id)),
            pod_name: self.names.get(&e.pod_id).cloned(),
            cookie: e.cookie,
            protocol: match u32::from(e.protocol) {
                6 => "tcp",
                17 => "udp",
                _ => "other",
            },
            src: endpoint(e, true),
            dst: endpoint(e, false),
            uid: id(e.uid),
            gid: id(e.gid),
            outcome: decision.map_or("?", Decision::outcome),
            decision: decision.map_or("unknown", Decision::name),
            rule: rule.label(),
            rule_text: rule.text(),
            to_port: (e.to_port != 0).then_some(e.to_port),
        }
    }
}

fn endpoint(e: &DecisionEvent, src: bool) -> String {
    let (addr, port) = if src {
        (&e.src, e.src_port)
    } else {
        (&e.dst, e.dst_port)
    };
    if e.family != shunt_common::AF_INET && e.family != shunt_common::AF_INET6 {
        return "?".into();
    }
    SocketAddr::new(words_addr(addr, e.family), port).to_string()
}

fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec to fill.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

/// `2025-11-28T01:02:03.123456Z`.
fn utc(unix_ns: u64) -> String {
    let secs = unix_ns / 1_000_000_000;
    let micros = (unix_ns % 1_000_000_000) / 1_000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{micros:06}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's
/// algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

impl Event {
    /// One line for a person.
    pub fn line(&self) -> String {
        let time = self.time.get(11..26).unwrap_or(&self.time);
        let pod = self
            .pod_name
            .clone()
            .or_else(|| self.pod.clone())
            .unwrap_or_else(|| "-".into());
        let ids = match (self.uid, self.gid) {
            (Some(u), Some(g)) => format!(" uid {u} gid {g}"),
            _ => String::new(),
        };
        let to = self
            .to_port
            .map(|p| format!(" -> :{p}"))
            .unwrap_or_default();
        let rule = if self.rule.is_empty() {
            String::new()
        } else {
            format!(" (rule {}: {})", self.rule, self.rule_text)
        };
        format!(
            "{time} {pod} {} {} -> {}{ids}: {} {}{to}{rule} cookie {}",
            self.protocol, self.src, self.dst, self.outcome, self.decision, self.cookie
        )
    }
}

/// `--pod`, `--port`, `--decision`.
#[derive(Debug, Default)]
pub struct Filter {
    pub pods: Vec<u32>,
    pub port: Option<u16>,
    /// Decision names or outcomes.
    pub decisions: Vec<String>,
}

impl Filter {
    pub fn matches(&self, e: &DecisionEvent) -> bool {
        if !self.pods.is_empty() && !self.pods.contains(&e.pod_id) {
            return false;
        }
        if let Some(p) = self.port
            && e.src_port != p
            && e.dst_port != p
            && e.to_port != p
        {
            return false;
        }
        if !self.decisions.is_empty() {
            let Some(d) = Decision::from_u32(e.decision) else {
                return false;
            };
            return self
                .decisions
                .iter()
                .any(|w| w == d.name() || w == d.outcome());
        }
        true
    }
}

/// Checks `--decision` words: each a decision name or an outcome.
pub fn check_decisions(words: &[String]) -> anyhow::Result<()> {
    for w in words {
        let known = Decision::ALL
            .iter()
            .any(|d| d.name() == w || d.outcome() == w);
        if !known {
            let mut names: Vec<&str> = Decision::ALL.iter().map(|d| d.outcome()).collect();
            names.sort();
            names.dedup();
            bail!(
                "--decision {w}: not a decision (see `shunt inspect` for their names) nor an outcome ({})",
                names.join(", ")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_time_reads_as_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(
            utc(1_709_164_800_123_456_789),
            "2024-02-29T00:00:00.123456Z"
        );
        assert_eq!(utc(951_782_400_000_000_000), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn filters_match_pod_port_and_decision_or_outcome() {
        let e = DecisionEvent {
            pod_id: 7,
            dst_port: 8080,
            to_port: 15001,
            decision: Decision::OutboundRedirected as u32,
            ..Default::default()
        };
        assert!(Filter::default().matches(&e));
        let f = |pods: Vec<u32>, port, d: &[&str]| Filter {
            pods,
            port,
            decisions: d.iter().map(|s| s.to_string()).collect(),
        };
        assert!(f(vec![7], Some(15001), &["captured"]).matches(&e));
        assert!(f(vec![], Some(8080), &["outbound_redirected"]).matches(&e));
        assert!(!f(vec![8], None, &[]).matches(&e));
        assert!(!f(vec![], Some(9090), &[]).matches(&e));
        assert!(!f(vec![], None, &["passed", "skip_proxy_uid"]).matches(&e));
        assert!(check_decisions(&["captured".into(), "skip_proxy_uid".into()]).is_ok());
        assert!(check_decisions(&["nope".into()]).is_err());
    }
}
