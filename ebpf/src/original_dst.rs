//! The original destination, handed to the proxy the way netfilter does it.
//!
//! `sockops` sees the client side of a redirected connection just before its SYN
//! (`TCP_CONNECT_CB`, 4-tuple known) and re-keys the connect-time record by 4-tuple.
//! The proxy's accepted socket finds it with `getsockopt(SO_ORIGINAL_DST)`, answered by
//! `cgroup/getsockopt`. The entry lives until the proxy's side closes (a client that
//! connects, writes and closes at once must not take it away before the proxy asks),
//! or until the client's connect fails.
//!
//! `track_sockets` is the one sockops program; it also feeds the short-circuit.

use core::ptr::write_volatile;

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB,
        BPF_SOCK_OPS_TCP_LISTEN_CB,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::{cgroup_sockopt, sock_ops},
    programs::{SockOpsContext, SockoptContext},
};
use aya_ebpf::helpers::bpf_get_current_uid_gid;
use aya_log_ebpf::error;
use shunt_common::{
    AF_INET, AF_INET6, Addr, Decision, IP6T_SO_ORIGINAL_DST, ListenerKey, SO_ORIGINAL_DST, SOL_IP,
    SOL_IPV6, SockTuple, Verdict,
    events::{DecisionEvent, NO_ID},
};

use crate::{
    addr::{read6, unmap_v4, v4},
    connect::IPPROTO_TCP,
    events, log,
    maps::{LISTENERS, ORIG_DST_COOKIE, ORIG_DST_TUPLE, POD_CONFIG, count, count_pod},
    shortcircuit,
};

const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

#[sock_ops]
pub fn track_sockets(ctx: SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => on_connect(&ctx),
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            if let Some(t) = tuple(&ctx) {
                shortcircuit::on_established(&ctx, &t, true);
            }
        }
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => on_passive_established(&ctx),
        BPF_SOCK_OPS_STATE_CB => on_state_change(&ctx),
        BPF_SOCK_OPS_TCP_LISTEN_CB => on_listen(&ctx),
        _ => {}
    }
    1
}

/// The connection as seen from `ctx`'s socket: (local, remote), IPv4 when mapped.
#[inline(always)]
fn tuple(ctx: &SockOpsContext) -> Option<SockTuple> {
    let ops = ctx.ops;
    // SAFETY: a helper this program type may call, given its own context pointer.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    // remote_port holds the network-order port, shifted left 16 on little-endian kernels.
    let raw = ctx.remote_port();
    let remote_port = u16::from_be(if raw > 0xffff {
        (raw >> 16) as u16
    } else {
        raw as u16
    });
    let local_port = ctx.local_port() as u16;
    let family = ctx.family();
    let (family, src, dst) = if family == AF_INET {
        (AF_INET, v4(ctx.local_ip4()), v4(ctx.remote_ip4()))
    } else if family == AF_INET6 {
        // SAFETY: four-word fields of this program's context (the kernel's bpf_sock_ops).
        let (local, remote) = unsafe {
            (
                read6(&raw const (*ops).local_ip6),
                read6(&raw const (*ops).remote_ip6),
            )
        };
        match (unmap_v4(&local), unmap_v4(&remote)) {
            (Some(l), Some(r)) => (AF_INET, v4(l), v4(r)),
            _ => (AF_INET6, local, remote),
        }
    } else {
        return None;
    };
    Some(SockTuple {
        netns,
        src,
        dst,
        src_port: local_port,
        dst_port: remote_port,
        family,
    })
}

/// A sockops (or getsockopt) event about the connection `t` (the socket's own view).
#[inline(always)]
pub fn tuple_event(t: &SockTuple, cookie: u64, pod_id: u32) -> DecisionEvent {
    DecisionEvent {
        cookie,
        src: t.src,
        dst: t.dst,
        src_port: t.src_port,
        dst_port: t.dst_port,
        family: t.family,
        pod_id,
        uid: NO_ID,
        gid: NO_ID,
        protocol: IPPROTO_TCP as u8,
        ..DecisionEvent::default()
    }
}

#[inline(always)]
fn swapped(t: &SockTuple) -> SockTuple {
    SockTuple {
        netns: t.netns,
        src: t.dst,
        dst: t.src,
        src_port: t.dst_port,
        dst_port: t.src_port,
        family: t.family,
    }
}

fn on_connect(ctx: &SockOpsContext) {
    // SAFETY: a helper this program type may call, given its own context pointer.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let Some(original) = ORIG_DST_COOKIE.get_ptr(&cookie) else {
        return;
    };
    // SAFETY: value pointer from a successful lookup.
    let original = unsafe { *original };
    let Some(key) = tuple(ctx) else { return };
    if ORIG_DST_TUPLE.insert(&key, &original, 0).is_ok() {
        count_pod(original.pod_id, Decision::OrigDstRecorded);
        // Told on close, so a failed connect can take its entry back.
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
        if events::on_for_record(original.events) {
            let mut e = tuple_event(&key, cookie, original.pod_id);
            e.to_port = u16::from_be(original.port);
            events::send(e, Verdict::ruleless(Decision::OrigDstRecorded));
        }
    } else if log::due(log::kind::MAP_FULL) {
        error!(
            ctx,
            "pod {}: ORIG_DST_TUPLE refused a record: the proxy will not find the original destination of a connection from port {}",
            original.pod_id,
            key.src_port
        );
    }
    let _ = ORIG_DST_COOKIE.remove(&cookie);
}

fn on_passive_established(ctx: &SockOpsContext) {
    let Some(local) = tuple(ctx) else { return };
    shortcircuit::on_established(ctx, &local, false);
    if ORIG_DST_TUPLE.get_ptr(&swapped(&local)).is_some() {
        // The proxy's side of a redirected connection: its close ends the entry.
        let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
    }
}

fn on_state_change(ctx: &SockOpsContext) {
    if ctx.arg(1) != TCP_CLOSE {
        return;
    }
    let Some(local) = tuple(ctx) else { return };
    shortcircuit::on_close(ctx, &local);
    // The proxy's side closing ends the record; or the client's, if its connect failed.
    let key = if ORIG_DST_TUPLE.get_ptr(&swapped(&local)).is_some() {
        swapped(&local)
    } else if ctx.arg(0) == TCP_SYN_SENT {
        local
    } else {
        return;
    };
    let Some(original) = ORIG_DST_TUPLE.get_ptr(&key) else {
        return;
    };
    // SAFETY: a value pointer from a successful lookup.
    let (pod_id, record_events, port) =
        unsafe { ((*original).pod_id, (*original).events, (*original).port) };
    if ORIG_DST_TUPLE.remove(&key).is_ok() {
        count(Decision::OrigDstRemoved);
        if events::on_for_record(record_events) {
            // Cookie 0: the closing socket is mostly the proxy's, not the one that
            // connected; the 4-tuple ties this to the `orig_dst_recorded` event.
            let mut e = tuple_event(&key, 0, pod_id);
            e.to_port = u16::from_be(port);
            events::send(e, Verdict::ruleless(Decision::OrigDstRemoved));
        }
    }
}

/// A pod's inbound listener (its `inbound_port`) becomes `sk_lookup`'s target.
fn on_listen(ctx: &SockOpsContext) {
    // SAFETY: a helper this program type may call, given its own context pointer.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(cfg) = POD_CONFIG.get_ptr(&netns) else {
        return;
    };
    // SAFETY: value pointer from a successful lookup.
    let (pod_id, inbound_port, pod_flags) =
        unsafe { ((*cfg).pod_id, (*cfg).inbound_port, (*cfg).flags) };
    if ctx.local_port() != u32::from(inbound_port) {
        return;
    }
    let mut key = ListenerKey {
        pod_id,
        family: ctx.family(),
    };
    if LISTENERS
        // SAFETY: the context is the kernel's bpf_sock_ops for this socket, and nothing
        // else holds a reference to it while the program runs.
        .update(&mut key, unsafe { &mut *ctx.ops }, 0)
        .is_err()
    {
        if log::due(log::kind::MAP_FULL) {
            error!(
                ctx,
                "pod {}: LISTENERS refused its inbound listener: inbound connections will be dropped",
                pod_id
            );
        }
        return;
    }
    count_pod(pod_id, Decision::ListenerRegistered);
    if events::on(pod_flags)
        && let Some(t) = tuple(ctx)
    {
        // SAFETY: a helper this program type may call, given its own context pointer.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        events::send(
            tuple_event(&t, cookie, pod_id),
            Verdict::ruleless(Decision::ListenerRegistered),
        );
    }
}

#[repr(C)]
struct SockaddrIn {
    family: u16,
    port: u16,
    addr: u32,
    zero: [u8; 8],
}

#[repr(C)]
struct SockaddrIn6 {
    family: u16,
    port: u16,
    flowinfo: u32,
    addr: Addr,
    scope_id: u32,
}

#[cgroup_sockopt(getsockopt)]
pub fn original_dst(ctx: SockoptContext) -> i32 {
    answer_original_dst(&ctx);
    1
}

#[inline(always)]
fn answer_original_dst(ctx: &SockoptContext) {
    let so = ctx.sockopt;
    // SAFETY: `so` is this program's context, the kernel's bpf_sockopt, live for the run.
    let (level, optname) = unsafe { ((*so).level, (*so).optname) };
    let family = if level == SOL_IP && optname == SO_ORIGINAL_DST {
        AF_INET
    } else if level == SOL_IPV6 && optname == IP6T_SO_ORIGINAL_DST {
        AF_INET6
    } else {
        return;
    };
    // SAFETY: a context field (the socket, checked for null below).
    let sk = unsafe { (*so).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    // The accepted socket: its peer is the redirected client, its local end the proxy.
    let (peer, local) = if family == AF_INET {
        // SAFETY: `sk` is the context's socket, not null; the verifier checks each load.
        unsafe { (v4((*sk).dst_ip4), v4((*sk).src_ip4)) }
    } else {
        // SAFETY: four-word fields of the context's socket, which is not null.
        unsafe {
            (
                read6(&raw const (*sk).dst_ip6),
                read6(&raw const (*sk).src_ip6),
            )
        }
    };
    let key = SockTuple {
        // SAFETY: a helper this program type may call, given its own context pointer.
        netns: unsafe { bpf_get_netns_cookie(ctx.as_ptr()) },
        src: peer,
        dst: local,
        // SAFETY: a field of the context's socket, which is not null.
        src_port: u16::from_be(unsafe { (*sk).dst_port }),
        // SAFETY: as above.
        dst_port: unsafe { (*sk).src_port } as u16,
        family,
    };
    let Some(original) = ORIG_DST_TUPLE.get_ptr(&key) else {
        return;
    };
    // SAFETY: value pointer from a successful lookup.
    let original = unsafe { *original };
    if original.family != family {
        return;
    }
    // SAFETY: fields of this program's context: the option buffer and its end.
    let optval = unsafe { (*so).__bindgen_anon_2.optval } as *mut u8;
    // SAFETY: as above.
    let end = unsafe { (*so).__bindgen_anon_3.optval_end } as *mut u8;
    let len = if family == AF_INET {
        // wrapping_add: the end of the sockaddr may lie past the buffer; it is only compared.
        if optval.wrapping_add(size_of::<SockaddrIn>()) > end {
            return;
        }
        let sin = SockaddrIn {
            family: AF_INET as u16,
            port: original.port,
            addr: original.addr[0],
            zero: [0; 8],
        };
        // SAFETY: `optval..optval + size_of::<SockaddrIn>()` lies within the option
        // buffer (checked against `end` above), which the program may write.
        unsafe { (optval as *mut SockaddrIn).write_unaligned(sin) };
        size_of::<SockaddrIn>()
    } else {
        if optval.wrapping_add(size_of::<SockaddrIn6>()) > end {
            return;
        }
        let sin6 = SockaddrIn6 {
            family: AF_INET6 as u16,
            port: original.port,
            flowinfo: 0,
            addr: original.addr,
            scope_id: 0,
        };
        // SAFETY: within the option buffer, checked against `end` above.
        unsafe { (optval as *mut SockaddrIn6).write_unaligned(sin6) };
        size_of::<SockaddrIn6>()
    };
    // Separate volatile stores: merged into one 8-byte store, the verifier refuses them.
    // SAFETY: `optlen` and `retval` are context fields a getsockopt program may write.
    unsafe {
        write_volatile(&raw mut (*so).optlen, len as i32);
        write_volatile(&raw mut (*so).retval, 0);
    }
    count_pod(original.pod_id, Decision::OrigDstAnswered);
    if events::on_for_record(original.events) {
        // The proxy's accepted socket asking: its peer is the client, its end the proxy.
        // (getsockopt programs may not ask for socket cookies.)
        let mut e = tuple_event(&key, 0, original.pod_id);
        let uid_gid = bpf_get_current_uid_gid();
        e.uid = uid_gid as u32;
        e.gid = (uid_gid >> 32) as u32;
        e.to_port = u16::from_be(original.port);
        events::send(e, Verdict::ruleless(Decision::OrigDstAnswered));
    }
}
