//! The eBPF capture of node mode as [`PodCapture`]: `shunt_capture::node::NodeCapture`
//! with each pod's failure policy, and its name and namespace for the decision events.

use std::os::fd::{AsFd, OwnedFd};

pub use shunt_capture::node::{FailurePolicy, NodeCapture};

use super::PodCapture;
use crate::PodInfo;

/// Which pods fail open; every other pod fails closed (the default policy).
#[derive(Debug, Clone, Default)]
pub struct Policies {
    /// The policy of pods no other rule names.
    pub default: FailurePolicy,
    /// Namespaces whose pods fail open whatever the default.
    pub fail_open_namespaces: Vec<String>,
}

impl Policies {
    pub fn of(&self, pod: &PodInfo) -> FailurePolicy {
        if self.fail_open_namespaces.contains(&pod.namespace) {
            FailurePolicy::FailOpen
        } else {
            self.default
        }
    }
}

pub struct EbpfCapture {
    pub capture: NodeCapture,
    pub policies: Policies,
}

impl PodCapture for EbpfCapture {
    fn enroll(&self, pod: &PodInfo, netns: &OwnedFd) -> anyhow::Result<()> {
        let policy = self.policies.of(pod);
        let label = shunt_common::events::PodLabel::new(&pod.namespace, &pod.name);
        let id = self
            .capture
            .enroll(netns.as_fd(), &pod.ips, policy, &label)?;
        tracing::debug!(pod = %pod.name, pod_id = id.id, ?policy, "pod captured");
        Ok(())
    }

    fn withdraw(&self, pod: &PodInfo, netns: &OwnedFd) -> anyhow::Result<()> {
        self.capture.withdraw(netns.as_fd(), &pod.ips).map(|_| ())
    }
}
