//! Local short-circuit: bytes between two sockets on this node skip the TCP/IP stack.
//!
//! `sockops` puts the two proxies' ends of a connection between enrolled pods into
//! `SOCK_PAIRS` when they are established (see `in_scope` for why app-facing sockets
//! stay on TCP); `sk_msg` then hands each send to the peer socket's receive side.
//!
//! Ordering is kept by construction: a socket's first message decides between
//! redirect and TCP, and the only later change is to TCP (see `pair_state`).

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_INGRESS, BPF_SOCK_OPS_STATE_CB_FLAG},
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::sk_msg,
    programs::{SkMsgContext, SockOpsContext},
};
use shunt_common::{AF_INET, AddrKey, Decision, PodConfig, SockTuple, Verdict, flags, pair_state};

use crate::{
    addr::{is_loopback, read6, unmap_v4, v4},
    events,
    inbound::captures_port,
    maps::{
        PAIR_STATE, POD_ADDRS, POD_CONFIG, PROXY_SOCKS, SOCK_PAIRS, count, count_n, count_pod,
        is_pod_addr,
    },
    original_dst::tuple_event,
};

const SK_PASS: u32 = 1;

/// The key a socket is stored under: its own 4-tuple. Loopback addresses repeat in every
/// pod, so they keep the namespace cookie; pod addresses are unique on the node, so a
/// pair spanning two pods' namespaces drops it and each side finds the other.
#[inline(always)]
pub fn pair_key(t: &SockTuple) -> SockTuple {
    let mut key = *t;
    if !is_loopback(&t.src, t.family) && !is_loopback(&t.dst, t.family) {
        key.netns = 0;
    }
    key
}

/// Whether this established socket belongs to a pair shunt short-circuits: the two
/// proxies' ends of a connection between enrolled pods of this node.
///
/// App-facing sockets (app ↔ its proxy, proxy → app from 127.0.0.6) stay on TCP: once a
/// socket is in a sockmap its reads go through the kernel's `tcp_bpf_recvmsg`, which
/// (Linux 6.18) returns EAGAIN to a *blocking* reader woken by a reset or a timeout and
/// left half-closes undelivered in our stress tests (tests/sockmap.rs). An app must never
/// see what plain TCP would not give it, and we do not control how apps read.
#[inline(always)]
fn in_scope(ctx: &SockOpsContext, cfg: &PodConfig, t: &SockTuple, active: bool) -> bool {
    let family = t.family;
    if is_loopback(&t.dst, family) || is_pod_addr(t.dst, family, cfg.pod_id) {
        return false;
    }
    // The peer must be another enrolled pod of this node with the short-circuit on.
    let Some(peer) = POD_ADDRS.get_ptr(&AddrKey {
        addr: t.dst,
        family,
    }) else {
        return false;
    };
    // SAFETY: value pointer from a successful lookup.
    if unsafe { (*peer).flags } & flags::SOCKMAP == 0 {
        return false;
    }
    if active {
        // Only the proxy's own upstream connections (marked at connect), never app-to-app.
        // SAFETY: a helper this program type may call, given its own context pointer.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        PROXY_SOCKS.get_ptr(&cookie).is_some()
    } else {
        // Accepted on a captured inbound port: sk_lookup gave it to this pod's proxy.
        captures_port(cfg, t.src_port)
    }
}

/// sockops, established: join `SOCK_PAIRS` if in scope. `t` is the socket's own view.
#[inline(always)]
pub fn on_established(ctx: &SockOpsContext, t: &SockTuple, active: bool) {
    let Some(cfg) = POD_CONFIG.get_ptr(&t.netns) else {
        return;
    };
    // SAFETY: value pointer from a successful lookup.
    let cfg = unsafe { *cfg };
    if cfg.flags & flags::SOCKMAP == 0 || !in_scope(ctx, &cfg, t, active) {
        return;
    }
    let mut key = pair_key(t);
    if SOCK_PAIRS
        // SAFETY: the context is the kernel's bpf_sock_ops for this socket, and nothing
        // else holds a reference to it while the program runs.
        .update(&mut key, unsafe { &mut *ctx.ops }, 0)
        .is_err()
    {
        return;
    }
    let _ = PAIR_STATE.insert(&key, &pair_state::UNDECIDED, 0);
    let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    count_pod(cfg.pod_id, Decision::PairAdded);
    if events::on(cfg.flags) {
        // SAFETY: a helper this program type may call, given its own context pointer.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        events::send(
            tuple_event(t, cookie, cfg.pod_id),
            Verdict::ruleless(Decision::PairAdded),
        );
    }
}

/// sockops, closed: the kernel drops the socket from `SOCK_PAIRS` itself.
#[inline(always)]
pub fn on_close(ctx: &SockOpsContext, t: &SockTuple) {
    if PAIR_STATE.remove(&pair_key(t)).is_ok() {
        count(Decision::PairRemoved);
        report_unpaired(t.netns, Decision::PairRemoved, || {
            // SAFETY: a helper this program type may call, given its own context pointer.
            let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
            tuple_event(t, cookie, 0)
        });
    }
}

/// Reports a decision about a socket leaving the short-circuit (rare: once a socket),
/// when events are on for its pod (found by `netns`) or node-wide.
#[inline(always)]
fn report_unpaired(
    netns: u64,
    decision: Decision,
    event: impl FnOnce() -> shunt_common::events::DecisionEvent,
) {
    let (pod_id, pod_flags) = match POD_CONFIG.get_ptr(netns) {
        // SAFETY: a value pointer from a successful lookup.
        Some(cfg) => unsafe { ((*cfg).pod_id, (*cfg).flags) },
        None => (0, 0),
    };
    if events::on(pod_flags) {
        let mut e = event();
        e.pod_id = pod_id;
        events::send(e, Verdict::ruleless(decision));
    }
}

#[sk_msg]
pub fn short_circuit(ctx: SkMsgContext) -> u32 {
    redirect(&ctx);
    // With a redirect set, PASS delivers to the peer; without, it sends through TCP.
    SK_PASS
}

#[inline(always)]
fn redirect(ctx: &SkMsgContext) {
    let md = ctx.msg;
    // SAFETY: `md` is this program's context, the kernel's sk_msg_md, live for the run.
    let (family, raw_remote_port, local_port, size) = unsafe {
        (
            (*md).family,
            (*md).remote_port,
            (*md).local_port,
            (*md).size,
        )
    };
    let (family, src, dst) = if family == AF_INET {
        // SAFETY: fields of this program's context.
        unsafe { (AF_INET, v4((*md).local_ip4), v4((*md).remote_ip4)) }
    } else {
        // SAFETY: four-word fields of this program's context.
        let (local, remote) = unsafe {
            (
                read6(&raw const (*md).local_ip6),
                read6(&raw const (*md).remote_ip6),
            )
        };
        match (unmap_v4(&local), unmap_v4(&remote)) {
            (Some(l), Some(r)) => (AF_INET, v4(l), v4(r)),
            _ => (family, local, remote),
        }
    };
    // remote_port holds the network-order port, shifted left 16 on little-endian kernels.
    let remote_port = u16::from_be(if raw_remote_port > 0xffff {
        (raw_remote_port >> 16) as u16
    } else {
        raw_remote_port as u16
    });
    let own = pair_key(&SockTuple {
        // SAFETY: a helper this program type may call, given its own context pointer.
        netns: unsafe { bpf_get_netns_cookie(ctx.as_ptr()) },
        src,
        dst,
        src_port: local_port as u16,
        dst_port: remote_port,
        family,
    });
    let state = match PAIR_STATE.get_ptr(&own) {
        // SAFETY: value pointer from a successful lookup.
        Some(s) => unsafe { *s },
        None => pair_state::FALLBACK,
    };
    if state == pair_state::FALLBACK {
        return;
    }
    let mut peer = SockTuple {
        netns: own.netns,
        src: own.dst,
        dst: own.src,
        src_port: own.dst_port,
        dst_port: own.src_port,
        family: own.family,
    };
    if SOCK_PAIRS.redirect_msg(ctx, &mut peer, u64::from(BPF_F_INGRESS)) == i64::from(SK_PASS) {
        if state == pair_state::UNDECIDED {
            let _ = PAIR_STATE.insert(&own, &pair_state::REDIRECT, 0);
        }
        count(Decision::MsgRedirected);
        count_n(Decision::BytesRedirected, u64::from(size));
    } else {
        // The peer is not (or no longer) there: TCP for the rest of this socket's life.
        let _ = PAIR_STATE.insert(&own, &pair_state::FALLBACK, 0);
        count(Decision::MsgFallback);
        // SAFETY: a helper this program type may call, given its own context pointer.
        let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
        report_unpaired(netns, Decision::MsgFallback, || {
            tuple_event(&own, 0, 0)
        });
    }
}
