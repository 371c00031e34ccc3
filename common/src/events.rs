//! Decision events: one record per decision a program takes, carried to user space by
//! the `EVENTS` ring buffer while events are on (node-wide in `EVENTS_ON[0]`, or for one
//! pod by `flags::EVENTS` in its `PodConfig`). `shunt inspect --follow` reads them.
//!
//! And `PodLabel`, the `POD_LABELS` value: which Kubernetes pod a pod id is, written
//! by whoever enrolls the pod (node mode knows every pod's name), read by user space
//! only.

use crate::Addr;

/// A uid or gid the hook cannot know (it runs outside the process: `sk_lookup` in
/// softirq, `sockops` callbacks).
pub const NO_ID: u32 = u32::MAX;

/// `EVENTS`' size in bytes (a power of two, page-aligned): about 2,900 records of
/// 88 bytes (80 and the ring's 8-byte header). Records that do not fit are dropped and
/// counted in `EVENTS_DROPPED`; a program never waits.
pub const EVENTS_RING_BYTES: u32 = 256 * 1024;

/// `EVENTS_ON[0]` values.
pub mod switch {
    /// Only pods with `flags::EVENTS` report.
    pub const PODS: u32 = 0;
    /// Every decision on the node reports, pod or not.
    pub const NODE: u32 = 1;
}

/// One decision, as a program took it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecisionEvent {
    /// `bpf_ktime_get_ns()`: CLOCK_MONOTONIC, nanoseconds.
    pub time_ns: u64,
    /// The socket's cookie (what ties a connect to its sockops and getsockopt events); 0
    /// where the hook has no socket of its own (`sk_lookup`).
    pub cookie: u64,
    /// The connection as the deciding hook saw it: for connect and sendmsg, the socket's
    /// own address (often unbound yet: 0) and the destination asked for; for sk_lookup,
    /// the remote peer and the pod's address.
    pub src: Addr,
    pub dst: Addr,
    /// Host byte order.
    pub src_port: u16,
    /// Host byte order.
    pub dst_port: u16,
    pub family: u32,
    /// The pod (its network namespace inode); 0 when not known (not enrolled).
    pub pod_id: u32,
    /// A `Decision`.
    pub decision: u32,
    /// The calling process's, or `NO_ID`.
    pub uid: u32,
    pub gid: u32,
    /// A `Rule`.
    pub rule: u16,
    /// IPPROTO_TCP or IPPROTO_UDP.
    pub protocol: u8,
    pub _pad: u8,
    /// Where a capture sent the connection (host order), 0 otherwise.
    pub to_port: u16,
    pub _pad2: u16,
}

/// `POD_LABELS` value: a pod's Kubernetes namespace and name, NUL-padded UTF-8.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodLabel {
    pub namespace: [u8; 64],
    pub name: [u8; 256],
}

impl Default for PodLabel {
    fn default() -> Self {
        PodLabel {
            namespace: [0; 64],
            name: [0; 256],
        }
    }
}

impl PodLabel {
    /// The label for `namespace`/`name`; either is cut at its field's length (Kubernetes
    /// allows 63 and 253 bytes, which fit), at a character boundary.
    pub fn new(namespace: &str, name: &str) -> PodLabel {
        let mut label = PodLabel::default();
        copy_str(&mut label.namespace, namespace);
        copy_str(&mut label.name, name);
        label
    }

    pub fn namespace(&self) -> &str {
        read_str(&self.namespace)
    }

    pub fn name(&self) -> &str {
        read_str(&self.name)
    }
}

fn copy_str(field: &mut [u8], s: &str) {
    let mut end = s.len().min(field.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    field[..end].copy_from_slice(&s.as_bytes()[..end]);
}

fn read_str(field: &[u8]) -> &str {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    core::str::from_utf8(&field[..end]).unwrap_or("")
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::string::ToString;

    #[test]
    fn an_event_is_80_bytes_with_no_hidden_padding() {
        assert_eq!(size_of::<DecisionEvent>(), 80);
    }

    #[test]
    fn labels_round_trip_and_cut_long_names_at_a_character() {
        let l = PodLabel::new("default", "sleep-7d4b9c");
        assert_eq!((l.namespace(), l.name()), ("default", "sleep-7d4b9c"));
        let long = "é".repeat(40).to_string();
        let l = PodLabel::new(&long, "x");
        assert_eq!(l.namespace(), "é".repeat(32));
    }
}
