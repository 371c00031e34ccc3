//! aya-log, for the few things an operator must hear about because they change what
//! happens to traffic and no counter explains them on its own: a map too full to hold a
//! record (the connection stays uncaptured), a pod config missing where capture is
//! attached, a pod's traffic passing without its proxy (fail-open) or dropped (no
//! listener, fail-closed). Records reach the process that loaded the programs (the
//! node, or the pod's proxy), which logs them at these levels.
//!
//! Each kind is logged at most once a second per CPU (`LOG_LAST`), so a storm (every
//! connect of a pod whose proxy is down) leaves a line a second, not a flood; the
//! counters and decision events still see every one.

use aya_ebpf::{Global, btf_maps::PerCpuArray, helpers::bpf_ktime_get_ns, macros::btf_map};

/// Set to 1 by node mode's loader: its cgroup programs sit above pods that are not
/// enrolled, so a namespace without a config is normal there, and not worth a line.
#[unsafe(no_mangle)]
static SHUNT_NODE_MODE: Global<u8> = Global::new(0);

pub mod kind {
    pub const MAP_FULL: u32 = 0;
    pub const CONFIG_MISSING: u32 = 1;
    pub const FAIL_OPEN: u32 = 2;
    pub const NO_LISTENER: u32 = 3;
    pub const COUNT: usize = 4;
}

/// When each kind was last logged on this CPU (`bpf_ktime_get_ns`).
#[btf_map]
static LOG_LAST: PerCpuArray<u64, { kind::COUNT }> = PerCpuArray::new();

const INTERVAL_NS: u64 = 1_000_000_000;

/// Whether a line of `kind` may be logged now (and if so, notes that it is).
#[inline(always)]
pub fn due(kind: u32) -> bool {
    let Some(last) = LOG_LAST.get_ptr_mut(kind) else {
        return false;
    };
    // SAFETY: a helper every program type may call.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: this CPU's slot of a per-CPU array; programs do not migrate mid-run.
    unsafe {
        if *last != 0 && now.wrapping_sub(*last) < INTERVAL_NS {
            return false;
        }
        *last = now;
    }
    true
}

/// Whether the programs were loaded by node mode.
#[inline(always)]
pub fn node_mode() -> bool {
    SHUNT_NODE_MODE.load() != 0
}
