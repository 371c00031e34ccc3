//! The node: a bridge netns, pod netns joined to it by veth pairs, a cgroup per pod.

use crate::{cgroup, netns, pod::Pod, process::ProcInner};
use anyhow::{Context, Result, bail, ensure};
use std::{
    fs::{self, File, OpenOptions},
    net::{Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

/// Lock files that hand out subnet bytes; `flock` makes a lease die with its owner.
const LEASE_DIR: &str = "/run/shunt-test";
/// Pod addresses are .10, .11, ...; keep them below .255.
const MAX_PODS: usize = 200;

static NEXT_NODE: AtomicU32 = AtomicU32::new(0);

/// A small test node. See the crate docs.
///
/// Naming: the node is `sh<pid>-<n>` (owner pid, per-process counter). Its bridge lives
/// in netns `sh<pid>-<n>` (bridge `br0`, ports `p<index>`), each pod in netns
/// `sh<pid>-<n>-<pod>` (interface `eth0`), with cgroup
/// `<cgroup2>/shunt-test/sh<pid>-<n>/<pod>`. Nothing is created in the caller's netns.
///
/// Addressing: every node leases a subnet byte `S` (unique among all live nodes on the
/// machine, across processes): the bridge has 10.77.S.1/24 and fd77:0:0:S::1/64 and is
/// every pod's default gateway; pod `i` has 10.77.S.(10+i) and fd77:0:0:S::(10+i).
///
/// Drop kills and reaps every process started in the pods (then SIGKILLs whatever else
/// is left in the pod cgroups), removes the cgroups and deletes the namespaces.
pub struct Node {
    shared: Arc<NodeShared>,
    pods: Vec<Pod>,
    /// Namespaces we created, in creation order (deleted in reverse).
    created_netns: Vec<String>,
    _lease: File,
}

pub(crate) struct NodeShared {
    pub(crate) name: String,
    pub(crate) cgroup_dir: PathBuf,
    pub(crate) subnet: u8,
    procs: Mutex<Registry>,
}

#[derive(Default)]
struct Registry {
    closed: bool,
    procs: Vec<Weak<ProcInner>>,
}

impl NodeShared {
    /// Track a process so the node's Drop kills it; fails once the node is dropped.
    pub(crate) fn register(&self, proc: &Arc<ProcInner>) -> Result<()> {
        let mut reg = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        if reg.closed {
            proc.kill_and_reap();
            bail!("node {} has been dropped", self.name);
        }
        reg.procs.retain(|p| p.strong_count() > 0);
        reg.procs.push(Arc::downgrade(proc));
        Ok(())
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.procs.lock().unwrap_or_else(|e| e.into_inner()).closed
    }

    pub(crate) fn gateway_v4(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.subnet, 1)
    }

    pub(crate) fn gateway_v6(&self) -> Ipv6Addr {
        Ipv6Addr::new(0xfd77, 0, 0, self.subnet.into(), 0, 0, 0, 1)
    }
}

impl Node {
    /// Build an empty node: sweep leftovers of dead test processes, lease a subnet,
    /// create the node cgroup and the bridge netns. Needs root.
    pub fn new() -> Result<Node> {
        // SAFETY: plain syscall.
        ensure!(
            unsafe { libc::geteuid() } == 0,
            "the pod harness needs root (network namespaces, cgroups, setns)"
        );
        let cgroup_root = cgroup::cgroup2_mount()?.join(cgroup::ROOT_DIR);
        sweep_leftovers(&cgroup_root);

        let (subnet, lease) = lease_subnet()?;
        let name = format!(
            "sh{}-{}",
            std::process::id(),
            NEXT_NODE.fetch_add(1, Ordering::Relaxed)
        );
        let shared = Arc::new(NodeShared {
            cgroup_dir: cgroup_root.join(&name),
            name,
            subnet,
            procs: Mutex::default(),
        });
        // From here on, Drop cleans up whatever part got built.
        let mut node = Node {
            shared,
            pods: Vec::new(),
            created_netns: Vec::new(),
            _lease: lease,
        };
        node.build_bridge()
            .with_context(|| format!("building node {}", node.name()))?;
        Ok(node)
    }

    fn build_bridge(&mut self) -> Result<()> {
        let s = self.shared.clone();
        fs::create_dir_all(&s.cgroup_dir)
            .with_context(|| format!("creating cgroup {}", s.cgroup_dir.display()))?;
        netns::add(&s.name)?;
        self.created_netns.push(s.name.clone());
        netns::set_sysctls(
            &netns::path_of(&s.name),
            &[
                ("net.ipv6.conf.all.accept_dad", "0"),
                ("net.ipv6.conf.default.accept_dad", "0"),
            ],
        )?;
        netns::ip_batch(
            Some(&s.name),
            &[
                "link set lo up".into(),
                "link add br0 type bridge".into(),
                "link set br0 up".into(),
                format!("addr add {}/24 dev br0", s.gateway_v4()),
                format!("addr add {}/64 dev br0 nodad", s.gateway_v6()),
            ],
        )
    }

    /// Add a pod: netns `sh<pid>-<n>-<name>` with `lo` up and `eth0` (addresses, default
    /// routes via the bridge), plus cgroup `<node cgroup>/<name>`. Pods get index 0, 1,
    /// 2, ... in the order they are added. Names: lowercase letters, digits, `-`, `_`.
    pub fn add_pod(&mut self, name: &str) -> Result<Pod> {
        ensure!(
            !name.is_empty()
                && name.len() <= 32
                && name.bytes().all(|b| b.is_ascii_lowercase()
                    || b.is_ascii_digit()
                    || b == b'-'
                    || b == b'_'),
            "bad pod name {name:?}: use 1-32 of [a-z0-9_-]"
        );
        ensure!(
            !self.pods.iter().any(|p| p.name() == name),
            "node {} already has a pod named {name:?}",
            self.name()
        );
        ensure!(
            self.pods.len() < MAX_PODS,
            "a node holds at most {MAX_PODS} pods"
        );

        let index = self.pods.len();
        let s = &self.shared;
        let pod = Pod::new(
            s.clone(),
            name,
            index,
            Ipv4Addr::new(10, 77, s.subnet, 10 + index as u8),
            Ipv6Addr::new(0xfd77, 0, 0, s.subnet.into(), 0, 0, 0, 10 + index as u16),
        );
        let ns = pod.netns_name().to_owned();
        let ctx = || format!("adding pod {name:?} to node {}", self.shared.name);

        fs::create_dir(pod.cgroup_path())
            .with_context(|| format!("creating cgroup {}", pod.cgroup_path().display()))
            .with_context(ctx)?;
        netns::add(&ns).with_context(ctx)?;
        self.created_netns.push(ns.clone());
        netns::set_sysctls(
            &pod.netns_path(),
            &[
                ("net.ipv6.conf.all.accept_dad", "0"),
                ("net.ipv6.conf.default.accept_dad", "0"),
                // Connection benchmarks leave many TIME_WAITs; let connect() reuse them.
                ("net.ipv4.tcp_tw_reuse", "1"),
            ],
        )
        .with_context(ctx)?;
        netns::ip_batch(
            Some(&s.name),
            &[
                format!("link add p{index} type veth peer name eth0 netns {ns}"),
                format!("link set p{index} master br0"),
                format!("link set p{index} up"),
            ],
        )
        .with_context(ctx)?;
        netns::ip_batch(
            Some(&ns),
            &[
                "link set lo up".into(),
                "link set eth0 up".into(),
                format!("addr add {}/24 dev eth0", pod.ipv4()),
                format!("addr add {}/64 dev eth0 nodad", pod.ipv6()),
                format!("route add 0.0.0.0/0 via {}", s.gateway_v4()),
                format!("route add ::/0 via {}", s.gateway_v6()),
            ],
        )
        .with_context(ctx)?;
        self.pods.push(pod.clone());
        Ok(pod)
    }

    /// `sh<pid>-<n>`: the node's cgroup directory name and its bridge netns name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The pods, in index order.
    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// The pod called `name`, if any.
    pub fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|p| p.name() == name)
    }

    /// The netns holding the bridge `br0` (ports `p<index>`).
    pub fn bridge_netns_path(&self) -> PathBuf {
        netns::path_of(&self.shared.name)
    }

    /// `<cgroup2>/shunt-test/<node>`, parent of the pod cgroups.
    pub fn cgroup_path(&self) -> PathBuf {
        self.shared.cgroup_dir.clone()
    }

    /// The node's subnet byte `S` (10.77.S.0/24, fd77:0:0:S::/64).
    pub fn subnet(&self) -> u8 {
        self.shared.subnet
    }

    /// The bridge's addresses, which are the pods' default gateways.
    pub fn gateway_ipv4(&self) -> Ipv4Addr {
        self.shared.gateway_v4()
    }

    /// See [`Node::gateway_ipv4`].
    pub fn gateway_ipv6(&self) -> Ipv6Addr {
        self.shared.gateway_v6()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let procs = {
            let mut reg = self.shared.procs.lock().unwrap_or_else(|e| e.into_inner());
            reg.closed = true;
            std::mem::take(&mut reg.procs)
        };
        for proc in procs.iter().filter_map(Weak::upgrade) {
            proc.kill_and_reap();
        }
        // Also kills whatever those processes forked.
        if let Err(e) = cgroup::remove_tree(&self.shared.cgroup_dir, Duration::from_secs(10)) {
            eprintln!("harness: cleaning up node {}: {e:#}", self.shared.name);
        }
        for ns in self.created_netns.iter().rev() {
            if let Err(e) = netns::delete(ns) {
                eprintln!("harness: cleaning up node {}: {e:#}", self.shared.name);
            }
        }
    }
}

/// Hand out a subnet byte no other live node (in any process) holds: an exclusive
/// `flock` on `/run/shunt-test/subnet-<S>.lock`, released when the file is closed or
/// the process dies.
fn lease_subnet() -> Result<(u8, File)> {
    fs::create_dir_all(LEASE_DIR).with_context(|| format!("creating {LEASE_DIR}"))?;
    for subnet in 1..=250u8 {
        let path = Path::new(LEASE_DIR).join(format!("subnet-{subnet}.lock"));
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        if file.try_lock().is_ok() {
            return Ok((subnet, file));
        }
    }
    bail!("all 250 node subnets are in use (by live nodes holding locks in {LEASE_DIR})")
}

/// Owner pid of a harness name: `sh<pid>-<n>` or `sh<pid>-<n>-<pod>`.
pub(crate) fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("sh")?;
    let (pid, rest) = rest.split_once('-')?;
    let n = rest.split_once('-').map_or(rest, |(n, _pod)| n);
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(pid) || !all_digits(n) {
        return None;
    }
    pid.parse().ok()
}

/// A zombie counts as dead: a SIGKILLed test binary stays one until its parent (or a
/// lazy init) reaps it.
fn pid_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "<pid> (<comm>) <state> ...": comm may contain anything, so look after the last ')'.
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x"))
}

fn is_stale(name: &str) -> bool {
    owner_pid(name).is_some_and(|pid| pid != std::process::id() && !pid_alive(pid))
}

/// Remove cgroups and netns of earlier runs whose owning process is dead (a test
/// binary that was killed, or crashed before Drop ran). Processes first, so that the
/// namespaces are really freed.
fn sweep_leftovers(cgroup_root: &Path) {
    if let Ok(entries) = fs::read_dir(cgroup_root) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if is_stale(&name)
                && let Err(e) = cgroup::remove_tree(&entry.path(), Duration::from_secs(5))
            {
                eprintln!("harness: sweeping leftover cgroup {name}: {e:#}");
            }
        }
    }
    for name in netns::list() {
        if is_stale(&name)
            && let Err(e) = netns::delete(&name)
        {
            eprintln!("harness: sweeping leftover netns {name}: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::owner_pid;

    #[test]
    fn parses_owner_pids() {
        assert_eq!(owner_pid("sh123-0"), Some(123));
        assert_eq!(owner_pid("sh123-4-client"), Some(123));
        assert_eq!(owner_pid("sh123-4-my-pod"), Some(123));
        assert_eq!(owner_pid("shx-4-a"), None);
        assert_eq!(owner_pid("sh12"), None);
        assert_eq!(owner_pid("sh12-"), None);
        assert_eq!(owner_pid("sh12-a"), None);
        assert_eq!(owner_pid("other"), None);
    }
}
