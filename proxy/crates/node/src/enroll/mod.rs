//! Enrollment: how pods arrive at and leave the node agent, and [`Enrollment`], the one
//! place that calls [`Pods`] for all of them.
//!
//! - `cni_server`: the `shunt-cni` plugin's socket (JSON in `SOCK_SEQPACKET` packets,
//!   see `wire.rs`);
//! - `zds`: istio-cni's ZDS protocol (shunt connects to istio-cni's socket as ztunnel
//!   does);
//! - `state`: the state directory, read back after a restart.
//!
//! Every change is applied to [`Pods`] first and recorded after, under one lock: a pod is
//! never recorded that is not served, and an ADD and a DEL of one pod never interleave.

pub mod cni_server;
pub mod state;
pub mod wire;
pub mod zds;

use std::collections::{BTreeMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Context;

pub use state::{Record, Source};
use state::{StateDir, check_uid};

use super::{EnrollError, PodInfo, Pods};

/// What a restart found in the state directory.
#[derive(Debug, Default)]
pub struct Restored {
    /// CNI pods served again (their netns paths still open).
    pub served: Vec<String>,
    /// CNI pods dropped: their netns is gone (deleted while the agent was down); with
    /// the reason.
    pub dropped: Vec<(String, String)>,
    /// CNI pods recorded and running but not served again (their listeners could not
    /// be opened); kept, with their capture, and the reason.
    pub unserved: Vec<(String, String)>,
    /// ZDS pods waiting for istio-cni's snapshot to send their netns again.
    pub awaiting_snapshot: Vec<String>,
    /// State files that could not be read.
    pub unreadable: Vec<String>,
}

pub struct Enrollment {
    pods: Arc<dyn Pods>,
    state: StateDir,
    records: Mutex<BTreeMap<String, Record>>,
}

impl Enrollment {
    /// Opens the state directory and rebuilds the pods it records: a CNI pod is added
    /// again through its netns path; a ZDS pod is kept (unserved) until istio-cni's
    /// snapshot sends it again or leaves it out.
    pub fn open(pods: Arc<dyn Pods>, state_dir: &Path) -> anyhow::Result<(Self, Restored)> {
        let state = StateDir::open(state_dir)
            .with_context(|| format!("state directory {}", state_dir.display()))?;
        let (records, unreadable) = state
            .read_all()
            .with_context(|| format!("reading state directory {}", state_dir.display()))?;
        let mut restored = Restored {
            unreadable,
            ..Restored::default()
        };
        let mut kept = BTreeMap::new();
        for record in records {
            let uid = record.pod.uid.clone();
            match record.source {
                Source::Zds => {
                    restored.awaiting_snapshot.push(uid.clone());
                    kept.insert(uid, record);
                }
                Source::Cni => match reopen(&record.pod) {
                    Ok(netns) => match pods.restore(record.pod.clone(), netns) {
                        Ok(()) => {
                            restored.served.push(uid.clone());
                            kept.insert(uid, record);
                        }
                        // The pod runs (its namespace is there): its record and its
                        // capture stay, so a fail-closed pod is never reachable around
                        // a proxy; a later ADD or restart serves it.
                        Err(e) => {
                            restored.unserved.push((uid.clone(), e.reason));
                            kept.insert(uid, record);
                        }
                    },
                    Err(e) => {
                        let _ = state.remove(&uid);
                        restored.dropped.push((uid, e));
                    }
                },
            }
        }
        let enrollment = Self {
            pods,
            state,
            records: Mutex::new(kept),
        };
        Ok((enrollment, restored))
    }

    fn records(&self) -> MutexGuard<'_, BTreeMap<String, Record>> {
        // A panic in `Pods` while the lock was held leaves the map as it was before the
        // change (records are written after the call): still consistent.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Serves `pod` and records it. An ADD for a uid already enrolled is passed on
    /// (`Pods::add` re-checks it) and its record replaced.
    pub fn add(&self, source: Source, pod: PodInfo, netns: OwnedFd) -> Result<(), EnrollError> {
        let (namespace, name) = (pod.namespace.clone(), pod.name.clone());
        let refuse = |reason: String| EnrollError {
            namespace: namespace.clone(),
            name: name.clone(),
            reason,
        };
        check_uid(&pod.uid).map_err(refuse)?;
        check_netns(&netns).map_err(|e| refuse(format!("the fd received: {e}")))?;
        let mut records = self.records();
        self.pods.add(pod.clone(), netns)?;
        let record = Record { source, pod };
        if let Err(e) = self.state.write(&record) {
            // Served but not recorded would be lost at the next restart: undo.
            self.pods.remove(&record.pod.uid);
            return Err(refuse(format!(
                "recording the pod in the state directory: {e}"
            )));
        }
        records.insert(record.pod.uid.clone(), record);
        Ok(())
    }

    /// Stops serving the pod and forgets it. Unknown uids are fine (a DEL may repeat).
    pub fn remove(&self, uid: &str) {
        let mut records = self.records();
        self.pods.remove(uid);
        if let Err(e) = self.state.remove(uid) {
            tracing::warn!(uid, "removing the pod's state file: {e}");
        }
        records.remove(uid);
    }

    /// The uid of the pod enrolled with this runtime container id, if any.
    pub fn uid_of_container(&self, container_id: &str) -> Option<String> {
        self.records()
            .values()
            .find(|r| r.pod.container_id == container_id && !container_id.is_empty())
            .map(|r| r.pod.uid.clone())
    }

    /// The pod's record, if it is enrolled.
    pub fn record(&self, uid: &str) -> Option<Record> {
        self.records().get(uid).cloned()
    }

    /// Whether `Pods` serves the pod now.
    pub fn is_served(&self, uid: &str) -> bool {
        self.pods.served().iter().any(|p| p.uid == uid)
    }

    /// The pods recorded now.
    pub fn recorded(&self) -> Vec<Record> {
        self.records().values().cloned().collect()
    }

    /// After an enroller's full snapshot: removes the pods it enrolled that the snapshot
    /// did not name. Returns their uids.
    pub fn reconcile(&self, source: Source, snapshot: &HashSet<String>) -> Vec<String> {
        let gone: Vec<String> = self
            .records()
            .values()
            .filter(|r| r.source == source && !snapshot.contains(&r.pod.uid))
            .map(|r| r.pod.uid.clone())
            .collect();
        for uid in &gone {
            self.remove(uid);
        }
        gone
    }
}

/// Opens a CNI pod's netns again by its path.
fn reopen(pod: &PodInfo) -> Result<OwnedFd, String> {
    let path = pod
        .netns_path
        .as_ref()
        .ok_or("no netns path was recorded")?;
    let fd = std::fs::File::open(path)
        .map(OwnedFd::from)
        .map_err(|e| format!("netns {}: {e}", path.display()))?;
    check_netns(&fd).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(fd)
}

/// Refuses a descriptor that is not a network namespace (a runtime may leave the mount
/// point behind as an empty file once the pod is gone).
pub fn check_netns(fd: &OwnedFd) -> Result<(), String> {
    // NS_GET_NSTYPE = _IO(0xb7, 0x3): the namespace type of an nsfs descriptor.
    const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
    // SAFETY: the ioctl takes no argument and only reads the descriptor's type; `fd` is
    // open for the whole call.
    let kind = unsafe { libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    if kind == libc::CLONE_NEWNET {
        Ok(())
    } else {
        Err("not a network namespace".into())
    }
}
