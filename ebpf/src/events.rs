//! Decision events (`shunt_common::events`): while events are on for a pod (its
//! `flags::EVENTS`) or node-wide (`EVENTS_ON[0]`), each decision is also sent to user
//! space through the `EVENTS` ring buffer. Off, the cost is the check: a flag of the
//! config the program already holds, then one array lookup (which the verifier turns
//! into a load). A full ring drops the record and counts it; nothing waits.
//!
//! The reader is woken only once a quarter of the ring waits (it also looks every
//! 50 ms): the kernel's default, a wake-up per record, costs an interrupt's work for
//! every decision (`bench capture`: about 900 ns per event against 200).

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    helpers::{bpf_ktime_get_ns, bpf_ringbuf_query},
};
use shunt_common::{
    Verdict,
    events::{DecisionEvent, EVENTS_RING_BYTES, switch},
    flags,
};

use crate::maps::{EVENTS, EVENTS_DROPPED, EVENTS_ON};

/// Whether every decision on the node reports.
#[inline(always)]
pub fn node_wide() -> bool {
    match EVENTS_ON.get_ptr(0) {
        // SAFETY: a value pointer of an array map (always there for index 0).
        Some(v) => (unsafe { *v }) == switch::NODE,
        None => false,
    }
}

/// Whether a decision for the pod with these `PodConfig` flags reports.
#[inline(always)]
pub fn on(pod_flags: u32) -> bool {
    pod_flags & flags::EVENTS != 0 || node_wide()
}

/// Whether a connection recorded with this `OriginalDst::events` reports its later
/// decisions.
#[inline(always)]
pub fn on_for_record(events: u16) -> bool {
    events != 0 || node_wide()
}

/// `OriginalDst::events` for a record made now for a pod with these flags.
#[inline(always)]
pub fn record_flag(pod_flags: u32) -> u16 {
    u16::from(pod_flags & flags::EVENTS != 0)
}

/// Stamps `event` with the decision, the rule and the time, and sends it.
#[inline(always)]
pub fn send(mut event: DecisionEvent, verdict: Verdict) {
    event.decision = verdict.decision as u32;
    event.rule = verdict.rule as u16;
    // SAFETY: a helper every program type may call.
    event.time_ns = unsafe { bpf_ktime_get_ns() };
    if EVENTS.output(event, wake_flag()).is_err()
        && let Some(n) = EVENTS_DROPPED.get_ptr_mut(0)
    {
        // SAFETY: this CPU's slot of a per-CPU array; programs do not migrate mid-run.
        unsafe { *n += 1 };
    }
}

/// Bytes waiting in the ring past which a record wakes the reader.
const WAKE_AT: u64 = EVENTS_RING_BYTES as u64 / 4;

#[inline(always)]
fn wake_flag() -> u64 {
    let ring = core::ptr::from_ref(&EVENTS).cast_mut().cast();
    // SAFETY: `ring` is the EVENTS map (its address is what the loader relocates to the
    // map); querying a ring buffer's positions is allowed to every program type.
    let waiting = unsafe { bpf_ringbuf_query(ring, u64::from(BPF_RB_AVAIL_DATA)) };
    if waiting >= WAKE_AT {
        u64::from(BPF_RB_FORCE_WAKEUP)
    } else {
        u64::from(BPF_RB_NO_WAKEUP)
    }
}
