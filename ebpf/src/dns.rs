//! DNS capture: a UDP query to port 53 of one of the pod's resolvers (or to any address
//! with `--capture-all-dns`) goes to the DNS proxy on loopback (127.0.0.1 / ::1, port
//! 15053), as istio-iptables' `REDIRECT --to-port 15053` does, and the proxy's reply
//! comes back with the resolver's address as its source, so the app's resolver library
//! (glibc and musl compare it with the server they asked) takes it.
//!
//! - `cgroup/sendmsg4|6`: unconnected sockets (`sendto`); `cgroup/connect4|6` (in
//!   `connect.rs`) calls [`capture_query`] for connected ones (glibc's `getaddrinfo`).
//! - `cgroup/recvmsg4|6`: the reply's source, from the record kept by socket cookie in
//!   `DNS_ORIG_DST`. One record per socket: a socket that asks two resolvers at once
//!   sees both answers as from the last one asked (resolvers ask one at a time).
//!
//! A dual-stack socket sending to `::ffff:a.b.c.d` goes through the IPv4 sendmsg hook
//! (the kernel hands it to UDP over IPv4) but receives through the IPv6 recvmsg hook.

use core::ptr::write_volatile;

use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_get_current_uid_gid, bpf_get_netns_cookie, bpf_get_socket_cookie},
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use aya_log_ebpf::error;
use shunt_common::{
    AF_INET, DNS_PORT, DNS_PROXY_PORT, Decision, DnsServerKey, NODE_PROXY_MARK, OriginalDst,
    PodConfig, Rule, Verdict, direction,
    dns::{QueryFacts, verdict_udp},
    events::DecisionEvent,
    flags,
};

use crate::{
    addr::{
        LOCALHOST4, LOCALHOST6, PASSTHROUGH4, PASSTHROUGH6, eq6, is_loopback, map_v4, read6,
        unmap_v4, v4,
    },
    connect::{Conn, Decided, Dial, IPPROTO_UDP, dial, report, report_before_pod},
    events, log,
    maps::{DNS_ORIG_DST, DNS_SERVERS, POD_CONFIG, count, count_pod},
};

const ALLOW: i32 = 1;

#[cgroup_sock_addr(sendmsg4)]
pub fn capture_dns4(ctx: SockAddrContext) -> i32 {
    if is_udp_to_port_53(&ctx) {
        capture_query(&ctx, false);
    }
    ALLOW
}

#[cgroup_sock_addr(sendmsg6)]
pub fn capture_dns6(ctx: SockAddrContext) -> i32 {
    if is_udp_to_port_53(&ctx) {
        capture_query(&ctx, true);
    }
    ALLOW
}

#[cgroup_sock_addr(recvmsg4)]
pub fn restore_dns_reply4(ctx: SockAddrContext) -> i32 {
    restore_reply(&ctx, false);
    ALLOW
}

#[cgroup_sock_addr(recvmsg6)]
pub fn restore_dns_reply6(ctx: SockAddrContext) -> i32 {
    restore_reply(&ctx, true);
    ALLOW
}

/// Port 53, checked before any map lookup: these hooks see every datagram the pod sends.
#[inline(always)]
pub fn is_udp_to_port_53(ctx: &SockAddrContext) -> bool {
    // SAFETY: fields of this program's context, the kernel's bpf_sock_addr.
    let (protocol, port_be) = unsafe { ((*ctx.sock_addr).protocol, (*ctx.sock_addr).user_port) };
    protocol == IPPROTO_UDP && u16::from_be(port_be as u16) == DNS_PORT
}

/// Whether `dial` goes to one of the pod's resolvers, or DNS capture takes any address.
#[inline(always)]
pub fn is_resolver(cfg: &PodConfig, dial: &Dial) -> bool {
    cfg.flags & flags::DNS_CAPTURE_ALL != 0
        || DNS_SERVERS
            .get_ptr(&DnsServerKey {
                pod_id: cfg.pod_id,
                family: dial.family,
                addr: dial.dst,
            })
            .is_some()
}

/// A UDP query to port 53 (sendmsg, or connect of a UDP socket): decide, and if it is
/// captured, remember the resolver by socket cookie and send it to the DNS proxy.
#[inline(always)]
pub fn capture_query(ctx: &SockAddrContext, v6: bool) {
    // SAFETY: a helper this program type may call, given its own context pointer.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(cfg) = POD_CONFIG.get_ptr(&netns) else {
        count(Decision::SkipNotEnrolled);
        report_before_pod(ctx, v6, Decision::SkipNotEnrolled);
        return;
    };
    // SAFETY: a value pointer from a successful lookup.
    let cfg = unsafe { *cfg };
    if cfg.flags & flags::DNS_REDIRECT == 0 {
        // Only the connect hooks get here without DNS capture: a UDP connect as before.
        count(Decision::SkipNotTcp);
        if events::on(cfg.flags) {
            let dial = dial(ctx, v6);
            let uid_gid = bpf_get_current_uid_gid();
            let conn = Conn { ctx, cfg: &cfg, dial: &dial, uid_gid };
            report_query(&conn, Verdict::ruleless(Decision::SkipNotTcp), 0);
        }
        return;
    }
    // SAFETY: sock_addr hooks always set `sk` (the socket at hand); `mark` is one of
    // its readable fields.
    if unsafe { (*(*ctx.sock_addr).__bindgen_anon_1.sk).mark } == NODE_PROXY_MARK {
        // Node mode's DNS proxy forwarding a pod's query from inside the pod.
        count_pod(cfg.pod_id, Decision::SkipNodeProxyMark);
        if events::on(cfg.flags) {
            let dial = dial(ctx, v6);
            let uid_gid = bpf_get_current_uid_gid();
            let conn = Conn { ctx, cfg: &cfg, dial: &dial, uid_gid };
            let marked = Verdict::new(Decision::SkipNodeProxyMark, Rule::NodeProxyMark);
            report_query(&conn, marked, 0);
        }
        return;
    }
    let dial = dial(ctx, v6);
    let uid_gid = bpf_get_current_uid_gid();
    let via_lo = is_loopback(&dial.dst, dial.family);
    let passthrough_src = if dial.family == AF_INET {
        dial.src[0] == PASSTHROUGH4
    } else {
        eq6(&dial.src, &PASSTHROUGH6)
    };
    let verdict = verdict_udp(&QueryFacts {
        uid: uid_gid as u32,
        gid: (uid_gid >> 32) as u32,
        proxy_uid: cfg.proxy_uid,
        proxy_gid: cfg.proxy_gid,
        inbound_passthrough: via_lo && passthrough_src,
        resolver: is_resolver(&cfg, &dial),
    });
    let decision = verdict.decision;
    let conn = Conn {
        ctx,
        cfg: &cfg,
        dial: &dial,
        uid_gid,
    };
    if decision != Decision::DnsCapturedUdp {
        count_pod(cfg.pod_id, decision);
        report_query(&conn, verdict, 0);
        return;
    }
    let original = OriginalDst {
        addr: dial.dst,
        port: dial.port_be,
        events: events::record_flag(cfg.flags),
        family: dial.family,
        pod_id: cfg.pod_id,
        direction: direction::OUTBOUND,
    };
    // SAFETY: a helper this program type may call, given its own context pointer.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if DNS_ORIG_DST.insert(&cookie, &original, 0).is_err() {
        // Without the record the reply could not be restored: leave the query alone.
        count_pod(cfg.pod_id, Decision::SkipMapFull);
        if log::due(log::kind::MAP_FULL) {
            error!(
                ctx,
                "pod {}: DNS_ORIG_DST is full: DNS query left uncaptured", cfg.pod_id
            );
        }
        report_query(&conn, Verdict::ruleless(Decision::SkipMapFull), 0);
        return;
    }
    count_pod(cfg.pod_id, decision);
    report_query(&conn, verdict, DNS_PROXY_PORT);
    rewrite_to_proxy(ctx, &dial, v6);
}

/// Reports a decision about the pod's query, if events are on for the pod.
#[inline(always)]
fn report_query(conn: &Conn, verdict: Verdict, to_port: u16) {
    report(conn, IPPROTO_UDP, Decided { verdict, to_port });
}

/// Rewrites the destination to the DNS proxy on loopback, in the socket's own family.
#[inline(always)]
pub fn rewrite_to_proxy(ctx: &SockAddrContext, dial: &Dial, v6: bool) {
    let sa = ctx.sock_addr;
    // SAFETY: context fields writable by connect and sendmsg hooks, one 32-bit store
    // each (volatile, so LLVM cannot merge them into a store the verifier refuses).
    unsafe {
        if !v6 {
            write_volatile(&raw mut (*sa).user_ip4, LOCALHOST4);
        } else {
            let to = if dial.v4_mapped {
                map_v4(LOCALHOST4)
            } else {
                LOCALHOST6
            };
            let p = (&raw mut (*sa).user_ip6) as *mut u32;
            write_volatile(p, to[0]);
            write_volatile(p.add(1), to[1]);
            write_volatile(p.add(2), to[2]);
            write_volatile(p.add(3), to[3]);
        }
        write_volatile(&raw mut (*sa).user_port, u32::from(DNS_PROXY_PORT.to_be()));
    }
}

/// A datagram from the DNS proxy (loopback, port 15053) to a socket whose query was
/// captured gets the resolver's address and port as its source.
#[inline(always)]
fn restore_reply(ctx: &SockAddrContext, v6: bool) {
    let sa = ctx.sock_addr;
    // SAFETY: fields of this program's context (for recvmsg: the datagram's source).
    let (protocol, port_be) = unsafe { ((*sa).protocol, (*sa).user_port) };
    if protocol != IPPROTO_UDP || u16::from_be(port_be as u16) != DNS_PROXY_PORT {
        return;
    }
    let from_proxy = if v6 {
        // SAFETY: a four-word field of this program's context.
        let src = unsafe { read6(&raw const (*sa).user_ip6) };
        eq6(&src, &LOCALHOST6) || unmap_v4(&src) == Some(LOCALHOST4)
    } else {
        // SAFETY: a field of this program's context.
        (unsafe { (*sa).user_ip4 }) == LOCALHOST4
    };
    if !from_proxy {
        return;
    }
    // SAFETY: a helper this program type may call, given its own context pointer.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let Some(original) = DNS_ORIG_DST.get_ptr(&cookie) else {
        return;
    };
    // SAFETY: a value pointer from a successful lookup.
    let original = unsafe { *original };
    let v4_original = original.family == AF_INET;
    if !v6 && !v4_original {
        return;
    }
    // SAFETY: context fields a recvmsg hook may write, one 32-bit store each.
    unsafe {
        if !v6 {
            write_volatile(&raw mut (*sa).user_ip4, original.addr[0]);
        } else {
            let from = if v4_original {
                map_v4(original.addr[0])
            } else {
                original.addr
            };
            let p = (&raw mut (*sa).user_ip6) as *mut u32;
            write_volatile(p, from[0]);
            write_volatile(p.add(1), from[1]);
            write_volatile(p.add(2), from[2]);
            write_volatile(p.add(3), from[3]);
        }
        write_volatile(&raw mut (*sa).user_port, u32::from(original.port));
    }
    count_pod(original.pod_id, Decision::DnsReplyRestored);
    if events::on_for_record(original.events) {
        // The reply as the app now sees it: from the resolver, to the app's socket.
        events::send(
            DecisionEvent {
                // SAFETY: a helper this program type may call, given its own context.
                cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
                src: if v4_original { v4(original.addr[0]) } else { original.addr },
                dst: [0; 4],
                src_port: u16::from_be(original.port),
                family: original.family,
                pod_id: original.pod_id,
                // recvmsg runs in the reading process.
                uid: bpf_get_current_uid_gid() as u32,
                gid: (bpf_get_current_uid_gid() >> 32) as u32,
                protocol: IPPROTO_UDP as u8,
                ..DecisionEvent::default()
            },
            Verdict::ruleless(Decision::DnsReplyRestored),
        );
    }
}
