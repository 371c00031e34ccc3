//! Node mode: one privileged `shunt node` per node serving every enrolled pod (the
//! DaemonSet shape, as ztunnel's in-pod mode, but speaking Envoy's xDS and carrying L7).
//!
//! Two halves meet at [`Pods`]:
//! - enrollment (how pods arrive and leave: the `shunt-cni` plugin's socket, istio-cni's
//!   ZDS socket, the state directory replayed after a restart) calls it;
//! - serving (each pod's proxy instance, its listeners opened inside the pod's network
//!   namespace, its xDS node, certificate and stats) implements it.

pub mod cni;
pub mod enroll;
pub mod owner;
pub mod serve;

use std::net::IpAddr;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// What the node knows of one pod when it is enrolled: the CNI plugin's view (its
/// `CNI_ARGS` and the previous plugin's result) or istio-cni's `WorkloadInfo`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodInfo {
    /// `K8S_POD_UID`: the key a pod is known by (stable across a re-ADD).
    pub uid: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// The runtime's container (sandbox) id, `CNI_CONTAINERID`.
    pub container_id: String,
    /// Where the pod's network namespace is mounted (`CNI_NETNS`), when known by path;
    /// ZDS hands a file descriptor instead.
    pub netns_path: Option<PathBuf>,
    /// The pod's addresses, from the previous plugin's result.
    pub ips: Vec<IpAddr>,
    /// The pod's service account, when the enroller knows it (ZDS does).
    pub service_account: Option<String>,
    /// The pod's resolvers and search domains (what its `resolv.conf` says: the CNI
    /// `dns` capability), when the enroller knows them; else the node's are used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dns: Option<PodDns>,
    /// The token the CA client presents for the pod's service account, when the
    /// enroller gives one (a projected token of that account); else the node's own
    /// token is presented and the pod's identity asked for (as ztunnel does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_path: Option<PathBuf>,
}

/// A pod's DNS configuration, as the CNI `dns` capability carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodDns {
    /// `nameserver`s.
    #[serde(default)]
    pub servers: Vec<IpAddr>,
    /// `search` domains.
    #[serde(default)]
    pub searches: Vec<String>,
}

/// Why a pod could not be added: said back to the enroller (the CNI plugin fails the
/// ADD with it, ZDS answers with it).
#[derive(Debug, thiserror::Error)]
#[error("pod {namespace}/{name}: {reason}")]
pub struct EnrollError {
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

/// The pods this node serves. Enrollment calls it; serving implements it. Calls are
/// idempotent: adding a pod already served (same uid) re-checks it, removing an unknown
/// pod is not an error (a DEL may be repeated, per the CNI spec).
pub trait Pods: Send + Sync {
    /// Start serving `pod`, whose network namespace is `netns` (an open handle: the
    /// pod stays reachable even if its mount goes away). Returns once the pod's
    /// listeners are bound, so the pod's first packet already finds its proxy.
    fn add(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError>;
    /// Serves again a pod recorded before a restart. Unlike [`Pods::add`] (where a
    /// refused ADD means the pod will not run, so its capture is undone), a pod that
    /// cannot be served again keeps its capture: it runs, and its failure policy holds
    /// until it is served (a later ADD, CHECK or restart).
    fn restore(&self, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        self.add(pod, netns)
    }
    /// Stop serving the pod: listeners closed, its connections drained.
    fn remove(&self, uid: &str);
    /// The pods served now (for reconciliation with an enroller's snapshot).
    fn served(&self) -> Vec<PodInfo>;
}
