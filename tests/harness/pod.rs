//! A pod: a network namespace plus a cgroup, inside a [`crate::Node`].

use crate::{netns, node::NodeShared, process::PodCommand};
use anyhow::Result;
use std::{
    ffi::OsStr,
    net::{Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    sync::Arc,
};

/// A pod of a [`crate::Node`]. Cheap to clone; clones refer to the same pod. A pod is
/// only usable while its node is alive (commands fail once the node is dropped).
#[derive(Clone)]
pub struct Pod {
    inner: Arc<PodInner>,
}

struct PodInner {
    node: Arc<NodeShared>,
    name: String,
    index: usize,
    ipv4: Ipv4Addr,
    ipv6: Ipv6Addr,
    netns_name: String,
    cgroup_path: PathBuf,
}

impl Pod {
    pub(crate) fn new(
        node: Arc<NodeShared>,
        name: &str,
        index: usize,
        ipv4: Ipv4Addr,
        ipv6: Ipv6Addr,
    ) -> Pod {
        let inner = PodInner {
            netns_name: format!("{}-{name}", node.name),
            cgroup_path: node.cgroup_dir.join(name),
            node,
            name: name.to_owned(),
            index,
            ipv4,
            ipv6,
        };
        Pod {
            inner: Arc::new(inner),
        }
    }

    pub(crate) fn node(&self) -> &Arc<NodeShared> {
        &self.inner.node
    }

    /// The name given to [`crate::Node::add_pod`].
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Position in the node: 0, 1, 2, ... in the order pods were added.
    pub fn index(&self) -> usize {
        self.inner.index
    }

    /// `10.77.<node subnet>.(10 + index)`, on `eth0`, prefix /24.
    pub fn ipv4(&self) -> Ipv4Addr {
        self.inner.ipv4
    }

    /// `fd77:0:0:<node subnet>::(10 + index)`, on `eth0`, prefix /64, no DAD.
    pub fn ipv6(&self) -> Ipv6Addr {
        self.inner.ipv6
    }

    /// Name of the pod's netns: `sh<pid>-<n>-<pod>`.
    pub fn netns_name(&self) -> &str {
        &self.inner.netns_name
    }

    /// `/var/run/netns/<netns name>`; open it and `setns(fd, CLONE_NEWNET)` to join,
    /// or use `nsenter --net=PATH` (never `ip netns exec`: it hides cgroup2 and bpffs).
    pub fn netns_path(&self) -> PathBuf {
        netns::path_of(&self.inner.netns_name)
    }

    /// `<cgroup2 mount>/shunt-test/<node>/<pod>`; every process started with
    /// [`Pod::command`] runs in it.
    pub fn cgroup_path(&self) -> PathBuf {
        self.inner.cgroup_path.clone()
    }

    /// Start building a command that runs inside this pod (netns + cgroup).
    pub fn command(&self, program: impl AsRef<OsStr>) -> PodCommand {
        PodCommand::new(self.clone(), program.as_ref())
    }

    /// Run `f` on a thread inside this pod's netns (not in its cgroup). Handy for
    /// creating sockets in the pod straight from a test.
    pub fn run_in_netns<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R> {
        netns::run_in_netns(Path::new(&self.netns_path()), f)
    }
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pod")
            .field("name", &self.inner.name)
            .field("index", &self.inner.index)
            .field("ipv4", &self.inner.ipv4)
            .field("ipv6", &self.inner.ipv6)
            .field("netns", &self.inner.netns_name)
            .finish()
    }
}
