//! Node mode's capture: the programs are loaded and the cgroup ones attached once per
//! node, at a cgroup that holds every pod (and the node process, whose upstream sockets
//! carry [`shunt_common::NODE_PROXY_MARK`] and so pass the connect hooks untouched).
//! A pod is then enrolled by its map entries (keyed by its network namespace cookie, as
//! `shunt capture` writes them) and the `sk_lookup` link of its namespace, both found
//! from the namespace handle the enroller passed: no process of the pod need exist yet
//! (at CNI ADD time the sandbox may not have started).
//!
//! Everything is pinned under the bpffs root (`<root>/node/` for the node's links,
//! `<root>/pods/pod_<inode>/` for each pod's), so capture outlives a restart of the
//! node process, and the pod's failure policy ([`FailurePolicy`]) is decided in the
//! kernel while nothing serves it.

use std::{
    fs::File,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use shunt_common::{events::PodLabel, flags};

use crate::{
    bpffs::{node_dir, pod_dir},
    config::CaptureConfig,
    ebpf::{self, PodIdentity},
    link, netns,
};

/// What the kernel does with a pod's traffic while no proxy serves it (its listeners
/// are gone: the node process is down or being replaced).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum FailurePolicy {
    /// Connects are refused, inbound connections dropped: nothing bypasses the proxy.
    #[default]
    FailClosed,
    /// Connects go straight to their destination, inbound straight to the app.
    FailOpen,
}

/// The node's capture, loaded and attached.
pub struct NodeCapture {
    cfg: CaptureConfig,
    root: PathBuf,
    /// The `sk_lookup` program, loaded once and linked into each pod's namespace.
    steer_inbound: OwnedFd,
    _kernel_log: crate::kernel_log::KernelLog,
}

impl NodeCapture {
    /// Loads the programs, pins the shared maps under `root` and attaches the cgroup
    /// programs to `cgroup` (the pods' common parent). After a restart the pinned
    /// links are found and kept: nothing is attached twice.
    pub fn open(cfg: CaptureConfig, cgroup: &Path, root: &Path) -> anyhow::Result<NodeCapture> {
        ebpf::built_with_programs()?;
        netns::check_cgroup2_dir(cgroup)?;
        netns::ensure_bpffs(root)?;
        ebpf::check_pinned_maps(root)?;
        let dir = node_dir(root);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut bpf = ebpf::load(root, &dir, ebpf::Loader::Node)?;
        // The programs' aya-log records, into this process's log from now on.
        let kernel_log = crate::kernel_log::KernelLog::start(&mut bpf)?;
        let cgroup_fd =
            File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
        for (name, attach_type) in ebpf::cgroup_programs(&cfg) {
            let pin = dir.join(name);
            if pin.exists() {
                continue;
            }
            let prog_fd = ebpf::load_program(&mut bpf, name)?;
            let link = link::create(prog_fd.as_fd(), cgroup_fd.as_fd(), attach_type)
                .with_context(|| format!("attaching {name} to cgroup {}", cgroup.display()))?;
            link::pin(&link, &pin).with_context(|| format!("pinning link {name}"))?;
        }
        ebpf::attach_sk_msg(&mut bpf, root)?;
        let steer_inbound = ebpf::load_program(&mut bpf, ebpf::NETNS_PROGRAM)?;
        Ok(NodeCapture {
            cfg,
            root: root.to_owned(),
            steer_inbound,
            _kernel_log: kernel_log,
        })
    }

    /// Captures the pod whose network namespace is `netns`: its addresses are
    /// `addresses` (or, when empty, those configured in the namespace now). Enrolling
    /// a pod again (after a restart) rewrites its settings and keeps its link. `label`
    /// (its Kubernetes namespace and name) tags its decision events.
    pub fn enroll(
        &self,
        netns: BorrowedFd<'_>,
        addresses: &[IpAddr],
        policy: FailurePolicy,
        label: &PodLabel,
    ) -> anyhow::Result<PodIdentity> {
        let pod = identity(netns, addresses)?;
        // The inbound passthrough's IPv6 source (::6) must be on the pod's lo.
        in_pod(netns, || Ok(netns::add_inbound_passthrough_v6()))?;
        let extra = match policy {
            FailurePolicy::FailClosed => 0,
            FailurePolicy::FailOpen => flags::FAIL_OPEN,
        };
        let dir = pod_dir(&self.root, pod.id);
        let link_pin = dir.join(ebpf::NETNS_PROGRAM);
        let result = (|| {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            crate::pod_names::write(&self.root, pod.id, label)?;
            ebpf::write_config(&self.root, &self.cfg, &pod, extra)?;
            if !link_pin.exists() {
                let link = link::create(self.steer_inbound.as_fd(), netns, link::BPF_SK_LOOKUP)
                    .context("attaching sk_lookup to the pod's network namespace")?;
                link::pin(&link, &link_pin).context("pinning the sk_lookup link")?;
            }
            anyhow::Ok(())
        })();
        if let Err(err) = result {
            let _ = ebpf::cleanup_pod(&self.root, &pod);
            return Err(err.context("pod capture rolled back"));
        }
        Ok(pod)
    }

    /// Releases the pod: its map entries and its `sk_lookup` link. Returns whether it
    /// was enrolled.
    pub fn withdraw(&self, netns: BorrowedFd<'_>, addresses: &[IpAddr]) -> anyhow::Result<bool> {
        let pod = identity(netns, addresses)?;
        ebpf::cleanup_pod(&self.root, &pod)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// Detaches the node's cgroup programs (their pins go) and, with no pod left, the
/// maps. For uninstalling a node; a restart keeps them.
pub fn uninstall(root: &Path) -> anyhow::Result<()> {
    let dir = node_dir(root);
    if dir.exists() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            std::fs::remove_file(&path).with_context(|| format!("unpinning {}", path.display()))?;
        }
        std::fs::remove_dir(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    ebpf::remove_root_if_unused(root)
}

/// Removes everything the node's capture pinned under `root`: every pod's `sk_lookup`
/// link, the node's cgroup links and the maps (a link detaches with its last pin, a map
/// goes with its last reference). For uninstalling a node; `shunt inspect` then finds
/// nothing. Returns how many pins were removed.
pub fn uninstall_all(root: &Path) -> anyhow::Result<usize> {
    fn remove(dir: &Path, removed: &mut usize) -> anyhow::Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                remove(&path, removed)?;
                std::fs::remove_dir(&path)
                    .with_context(|| format!("removing {}", path.display()))?;
            } else {
                std::fs::remove_file(&path)
                    .with_context(|| format!("unpinning {}", path.display()))?;
                *removed += 1;
            }
        }
        Ok(())
    }
    if !root.exists() {
        return Ok(0);
    }
    let mut removed = 0;
    remove(root, &mut removed)?;
    std::fs::remove_dir(root).with_context(|| format!("removing {}", root.display()))?;
    Ok(removed)
}

/// The pod's identity from its namespace handle: the inode names it, and the cookie
/// (what the programs see) is read from a socket made inside it.
fn identity(netns: BorrowedFd<'_>, addresses: &[IpAddr]) -> anyhow::Result<PodIdentity> {
    let id = File::from(netns.try_clone_to_owned()?).metadata()?.ino();
    let id = u32::try_from(id).map_err(|_| anyhow::anyhow!("netns inode {id} exceeds 32 bits"))?;
    let (netns_cookie, found) = in_pod(netns, || {
        let cookie = netns::netns_cookie().context("SO_NETNS_COOKIE (needs Linux 5.14+)")?;
        let found = if addresses.is_empty() {
            netns::pod_addresses().context("listing the pod's addresses")?
        } else {
            Vec::new()
        };
        Ok((cookie, found))
    })?;
    Ok(PodIdentity {
        id,
        netns_cookie,
        addresses: if addresses.is_empty() {
            found
        } else {
            addresses.to_vec()
        },
    })
}

/// Runs `f` on a helper thread inside the pod's network namespace (processes it
/// starts are born there too); the caller's threads never move.
pub fn in_pod<R: Send>(
    netns: BorrowedFd<'_>,
    f: impl FnOnce() -> anyhow::Result<R> + Send,
) -> anyhow::Result<R> {
    let raw = netns.as_raw_fd();
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: `raw` is the caller's open namespace fd, alive for this scope;
            // setns moves only this helper thread, which ends right after.
            if unsafe { libc::setns(raw, libc::CLONE_NEWNET) } != 0 {
                bail!(
                    "entering the pod's network namespace: {}",
                    std::io::Error::last_os_error()
                );
            }
            f()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the namespace helper thread panicked"))?
    })
}
