//! `cgroup/connect4|6`: istio-iptables' OUTPUT/ISTIO_OUTPUT chain at connect time.
//! A captured connect is rewritten to the proxy's port on the pod's own address (a
//! local route, like REDIRECT's loopback, but the source the kernel then picks is the
//! pod address, exactly what the proxy sees under iptables), and its original
//! destination is kept by socket cookie until sockops learns the 4-tuple. The connect itself is always allowed.
//! With DNS capture, TCP to a resolver's port 53 goes to the DNS proxy on loopback
//! (recorded the same way), and a UDP socket connected to port 53 is handed to `dns.rs`.

use core::ptr::write_volatile;

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_F_CURRENT_NETNS, bpf_sock_tuple, bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1,
        bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2,
    },
    btf_maps::lpm_trie::Key,
    helpers::{
        bpf_get_current_uid_gid, bpf_get_netns_cookie, bpf_get_socket_cookie,
        bpf_sk_lookup_tcp, bpf_sk_release,
    },
    macros::cgroup_sock_addr,
    programs::SockAddrContext,
};
use aya_log_ebpf::{error, warn};
use shunt_common::{
    AF_INET, AF_INET6, Addr, CIDR_KEY_PREFIX_BITS, Cidr4, Cidr6, DNS_PORT, DNS_PROXY_PORT,
    Decision, NODE_PROXY_MARK, OriginalDst, PodConfig, PortKey, Rule, Verdict, cidr_kind,
    direction,
    events::DecisionEvent,
    flags,
    outbound::{ConnectFacts, verdict},
    port_kind,
};

use crate::{
    addr::{
        LOCALHOST4, LOCALHOST6, PASSTHROUGH4, PASSTHROUGH6, eq6, is_loopback, is_unspecified6,
        map_v4, read6, unmap_v4, v4,
    },
    dns, events, log,
    maps::{
        CIDR_V4, CIDR_V6, ORIG_DST_COOKIE, POD_CONFIG, POD_PORTS, PROXY_SOCKS, count, count_pod,
        is_pod_addr,
    },
};

pub const IPPROTO_TCP: u32 = 6;
pub const IPPROTO_UDP: u32 = 17;
const ALLOW: i32 = 1;

#[cgroup_sock_addr(connect4)]
pub fn capture_connect4(ctx: SockAddrContext) -> i32 {
    capture(&ctx, false);
    ALLOW
}

#[cgroup_sock_addr(connect6)]
pub fn capture_connect6(ctx: SockAddrContext) -> i32 {
    capture(&ctx, true);
    ALLOW
}

/// One connect (or datagram) as the rules see it: IPv4 also when a dual-stack socket
/// dials `::ffff:a.b.c.d`.
pub struct Dial {
    pub family: u32,
    pub dst: Addr,
    pub src: Addr,
    pub v4_mapped: bool,
    /// Network byte order, as in the context.
    pub port_be: u16,
}

/// The destination the program may rewrite, and the socket's own address.
#[inline(always)]
pub fn dial(ctx: &SockAddrContext, v6: bool) -> Dial {
    let sa = ctx.sock_addr;
    // SAFETY: a context field; sock_addr hooks always set `sk` (the socket at hand).
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    // SAFETY: a field of this program's context.
    let port_be = unsafe { (*sa).user_port } as u16;
    if v6 {
        // SAFETY: `user_ip6` and `src_ip6` are four-word fields of the context and of its
        // socket; the verifier checks every load.
        let (dst, src) = unsafe {
            (
                read6(&raw const (*sa).user_ip6),
                read6(&raw const (*sk).src_ip6),
            )
        };
        match unmap_v4(&dst) {
            Some(dst4) => Dial {
                family: AF_INET,
                dst: v4(dst4),
                src: v4(unmap_v4(&src).unwrap_or(0)),
                v4_mapped: true,
                port_be,
            },
            None => Dial {
                family: AF_INET6,
                dst,
                src,
                v4_mapped: false,
                port_be,
            },
        }
    } else {
        Dial {
            family: AF_INET,
            // SAFETY: fields of the context and of its socket (`sk`, always set).
            dst: v4(unsafe { (*sa).user_ip4 }),
            // SAFETY: as above.
            src: v4(unsafe { (*sk).src_ip4 }),
            v4_mapped: false,
            port_be,
        }
    }
}

#[inline(always)]
fn capture(ctx: &SockAddrContext, v6: bool) {
    let sa = ctx.sock_addr;
    // SAFETY: `sa` is this program's context, the kernel's bpf_sock_addr, live for the run.
    let protocol = unsafe { (*sa).protocol };
    if protocol == IPPROTO_UDP {
        // glibc's resolver connects its UDP socket: its queries never pass sendmsg.
        if dns::is_udp_to_port_53(ctx) {
            dns::capture_query(ctx, v6);
        } else {
            count(Decision::SkipNotTcp);
            report_before_pod(ctx, v6, Decision::SkipNotTcp);
        }
        return;
    }
    if protocol != IPPROTO_TCP {
        count(Decision::SkipNotTcp);
        report_before_pod(ctx, v6, Decision::SkipNotTcp);
        return;
    }
    // SAFETY: a helper this program type may call, given its own context pointer.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let Some(cfg) = POD_CONFIG.get_ptr(&netns) else {
        count(Decision::SkipNotEnrolled);
        if !log::node_mode() && log::due(log::kind::CONFIG_MISSING) {
            warn!(
                ctx,
                "capture is attached to this cgroup, but network namespace cookie {} has no POD_CONFIG entry: connect left uncaptured",
                netns
            );
        }
        report_before_pod(ctx, v6, Decision::SkipNotEnrolled);
        return;
    };
    // SAFETY: a value pointer from a successful lookup.
    let cfg = unsafe { *cfg };
    // SAFETY: sock_addr hooks always set `sk` (the socket at hand); `mark` is one of
    // its readable fields.
    if unsafe { (*(*sa).__bindgen_anon_1.sk).mark } == NODE_PROXY_MARK {
        // Node mode's proxy connecting upstream from inside the pod.
        count_pod(cfg.pod_id, Decision::SkipNodeProxyMark);
        if events::on(cfg.flags) {
            let dial = dial(ctx, v6);
            let seen = Seen::now(ctx, &dial, cfg.pod_id, IPPROTO_TCP);
            events::send(
                seen.event(0),
                Verdict::new(Decision::SkipNodeProxyMark, Rule::NodeProxyMark),
            );
        }
        return;
    }
    let dial = dial(ctx, v6);
    let port_be = dial.port_be;
    let uid_gid = bpf_get_current_uid_gid();
    let verdict = verdict(&facts(&cfg, &dial, u16::from_be(port_be), uid_gid));
    let decision = verdict.decision;
    let conn = Conn {
        ctx,
        cfg: &cfg,
        dial: &dial,
        uid_gid,
    };
    let decided = |verdict, to_port| Decided { verdict, to_port };
    let (to_port, direction) = match decision {
        Decision::OutboundRedirected => (cfg.outbound_port, direction::OUTBOUND),
        Decision::InboundRedirectedLocal => (cfg.inbound_port, direction::INBOUND),
        Decision::DnsCapturedTcp => (DNS_PROXY_PORT, direction::OUTBOUND),
        skipped => {
            count_pod(cfg.pod_id, skipped);
            if matches!(skipped, Decision::SkipProxyUid | Decision::SkipProxyGid)
                && cfg.flags & flags::SOCKMAP != 0
            {
                // The proxy's own upstream connection: may pair with a proxy in another pod.
                // SAFETY: a helper this program type may call, given its own context pointer.
                let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
                let _ = PROXY_SOCKS.insert(&cookie, &1, 0);
            }
            report(&conn, IPPROTO_TCP, decided(verdict, 0));
            return;
        }
    };
    if cfg.flags & flags::FAIL_OPEN != 0
        && decision != Decision::DnsCapturedTcp
        && !proxy_listening(ctx, &cfg, &dial, v6, to_port)
    {
        // Nothing serves the pod now (node mode, the proxy down): straight through.
        count_pod(cfg.pod_id, Decision::FailOpenNoProxy);
        if log::due(log::kind::FAIL_OPEN) {
            warn!(
                ctx,
                "pod {}: nothing listens on its proxy port {}: connect to port {} passed uncaptured (fail-open)",
                cfg.pod_id,
                to_port,
                u16::from_be(port_be)
            );
        }
        report(
            &conn,
            IPPROTO_TCP,
            decided(Verdict::ruleless(Decision::FailOpenNoProxy), 0),
        );
        return;
    }
    let original = OriginalDst {
        addr: dial.dst,
        port: port_be,
        events: events::record_flag(cfg.flags),
        family: dial.family,
        pod_id: cfg.pod_id,
        direction,
    };
    // SAFETY: a helper this program type may call, given its own context pointer.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    if ORIG_DST_COOKIE.insert(&cookie, &original, 0).is_err() {
        // Without the record the proxy could not tell where to go: leave it uncaptured.
        count_pod(cfg.pod_id, Decision::SkipMapFull);
        if log::due(log::kind::MAP_FULL) {
            error!(
                ctx,
                "pod {}: ORIG_DST_COOKIE is full: connect to port {} left uncaptured",
                cfg.pod_id,
                u16::from_be(port_be)
            );
        }
        report(
            &conn,
            IPPROTO_TCP,
            decided(Verdict::ruleless(Decision::SkipMapFull), 0),
        );
        return;
    }
    count_pod(cfg.pod_id, decision);
    report(&conn, IPPROTO_TCP, decided(verdict, to_port));
    if decision == Decision::DnsCapturedTcp {
        // The DNS proxy listens on loopback, as iptables' REDIRECT of a local packet
        // delivers it there.
        dns::rewrite_to_proxy(ctx, &dial, v6);
        return;
    }
    // To the pod's own address (loopback if it has none): routed over lo, with the pod
    // address as source, so the proxy sees the app where iptables' REDIRECT shows it.
    let to4 = proxy_addr_v4(&cfg);
    // SAFETY: context fields writable by connect hooks, one 32-bit store each.
    unsafe {
        if !v6 {
            write_volatile(&raw mut (*sa).user_ip4, to4);
        } else {
            let to = if dial.v4_mapped {
                map_v4(to4)
            } else {
                proxy_addr_v6(&cfg)
            };
            let p = (&raw mut (*sa).user_ip6) as *mut u32;
            write_volatile(p, to[0]);
            write_volatile(p.add(1), to[1]);
            write_volatile(p.add(2), to[2]);
            write_volatile(p.add(3), to[3]);
        }
        write_volatile(&raw mut (*sa).user_port, u32::from(to_port.to_be()));
    }
}

/// One connect of a pod, as far as its event needs it.
pub struct Conn<'a> {
    pub ctx: &'a SockAddrContext,
    pub cfg: &'a PodConfig,
    pub dial: &'a Dial,
    pub uid_gid: u64,
}

/// A verdict and where it sends the connection (0: nowhere).
pub struct Decided {
    pub verdict: Verdict,
    pub to_port: u16,
}

/// Reports a decision about a pod's connection (TCP connect, UDP query), if events
/// are on for the pod.
#[inline(always)]
pub fn report(conn: &Conn, protocol: u32, d: Decided) {
    if events::on(conn.cfg.flags) {
        let seen = Seen::with_ids(conn.ctx, conn.dial, conn.cfg.pod_id, protocol, conn.uid_gid);
        events::send(seen.event(d.to_port), d.verdict);
    }
}

/// A decision taken before the pod is known (not TCP, not enrolled): reported only
/// node-wide, and then tagged with the pod if the namespace is one.
#[inline(always)]
pub fn report_before_pod(ctx: &SockAddrContext, v6: bool, decision: Decision) {
    if !events::node_wide() {
        return;
    }
    // SAFETY: a field of this program's context.
    let protocol = unsafe { (*ctx.sock_addr).protocol };
    // SAFETY: a helper this program type may call, given its own context pointer.
    let netns = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let pod_id = match POD_CONFIG.get_ptr(netns) {
        // SAFETY: a value pointer from a successful lookup.
        Some(cfg) => unsafe { (*cfg).pod_id },
        None => 0,
    };
    let dial = dial(ctx, v6);
    let seen = Seen::now(ctx, &dial, pod_id, protocol as u8 as u32);
    events::send(seen.event(0), Verdict::ruleless(decision));
}

/// What a sock_addr hook reports of its connection: everything but the verdict.
pub struct Seen {
    event: DecisionEvent,
}

impl Seen {
    /// With the calling process's uid and gid read now.
    #[inline(always)]
    pub fn now(ctx: &SockAddrContext, dial: &Dial, pod_id: u32, protocol: u32) -> Seen {
        Self::with_ids(ctx, dial, pod_id, protocol, bpf_get_current_uid_gid())
    }

    #[inline(always)]
    pub fn with_ids(
        ctx: &SockAddrContext,
        dial: &Dial,
        pod_id: u32,
        protocol: u32,
        uid_gid: u64,
    ) -> Seen {
        // SAFETY: sock_addr hooks always set `sk`; `src_port` (host order) is readable.
        let src_port = unsafe { (*(*ctx.sock_addr).__bindgen_anon_1.sk).src_port } as u16;
        Seen {
            event: DecisionEvent {
                // SAFETY: a helper this program type may call, given its own context.
                cookie: unsafe { bpf_get_socket_cookie(ctx.as_ptr()) },
                src: dial.src,
                dst: dial.dst,
                src_port,
                dst_port: u16::from_be(dial.port_be),
                family: dial.family,
                pod_id,
                uid: uid_gid as u32,
                gid: (uid_gid >> 32) as u32,
                protocol: protocol as u8,
                ..DecisionEvent::default()
            },
        }
    }

    /// The event, with where a capture sends the connection (0: nowhere).
    #[inline(always)]
    pub fn event(self, to_port: u16) -> DecisionEvent {
        DecisionEvent {
            to_port,
            ..self.event
        }
    }
}

/// Where captured IPv4 connects go: the pod's own address, loopback if it has none.
#[inline(always)]
fn proxy_addr_v4(cfg: &PodConfig) -> u32 {
    if cfg.addr_v4 != 0 {
        cfg.addr_v4
    } else {
        LOCALHOST4
    }
}

#[inline(always)]
fn proxy_addr_v6(cfg: &PodConfig) -> Addr {
    if is_unspecified6(&cfg.addr_v6) {
        LOCALHOST6
    } else {
        cfg.addr_v6
    }
}

/// Whether a socket listens where this connect would be sent (the pod's proxy port), in
/// the socket's own namespace. The source given is the pod's address, so the lookup is
/// local as the real connect would be (`sk_lookup` leaves local sources alone).
#[inline(always)]
fn proxy_listening(ctx: &SockAddrContext, cfg: &PodConfig, dial: &Dial, v6: bool, port: u16) -> bool {
    // SAFETY: a plain C struct of integers, all-zero is a valid value.
    let mut tuple: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let size = if !v6 || dial.v4_mapped {
        let a = proxy_addr_v4(cfg);
        tuple.__bindgen_anon_1.ipv4 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1 {
            saddr: a,
            daddr: a,
            sport: 0,
            dport: port.to_be(),
        };
        size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_1>()
    } else {
        let a = proxy_addr_v6(cfg);
        tuple.__bindgen_anon_1.ipv6 = bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2 {
            saddr: a,
            daddr: a,
            sport: 0,
            dport: port.to_be(),
        };
        size_of::<bpf_sock_tuple__bindgen_ty_1__bindgen_ty_2>()
    };
    // SAFETY: helpers connect hooks may call: the tuple is a live local of `size` bytes,
    // and a socket returned is released at once.
    unsafe {
        let sk = bpf_sk_lookup_tcp(
            ctx.as_ptr(),
            &mut tuple,
            size as u32,
            BPF_F_CURRENT_NETNS as u64,
            0,
        );
        if sk.is_null() {
            return false;
        }
        bpf_sk_release(sk.cast());
    }
    true
}

#[inline(always)]
fn facts(cfg: &PodConfig, dial: &Dial, port: u16, uid_gid: u64) -> ConnectFacts {
    let v4 = dial.family == AF_INET;
    let dns_port = cfg.flags & flags::DNS_REDIRECT != 0 && port == DNS_PORT;
    let all = if v4 {
        cfg.flags & flags::OUTBOUND_ALL_V4 != 0
    } else {
        cfg.flags & flags::OUTBOUND_ALL_V6 != 0
    };
    ConnectFacts {
        uid: uid_gid as u32,
        gid: (uid_gid >> 32) as u32,
        proxy_uid: cfg.proxy_uid,
        proxy_gid: cfg.proxy_gid,
        port_excluded: POD_PORTS
            .get_ptr(&PortKey {
                pod_id: cfg.pod_id,
                port,
                kind: port_kind::OUTBOUND_EXCLUDE,
            })
            .is_some(),
        src_inbound_passthrough: if v4 {
            dial.src[0] == PASSTHROUGH4
        } else {
            eq6(&dial.src, &PASSTHROUGH6)
        },
        via_lo: is_loopback(&dial.dst, dial.family)
            || is_pod_addr(dial.dst, dial.family, cfg.pod_id),
        dst_localhost: if v4 {
            dial.dst[0] == LOCALHOST4
        } else {
            eq6(&dial.dst, &LOCALHOST6)
        },
        cidr_excluded: in_cidr(cfg.pod_id, cidr_kind::EXCLUDE, &dial.dst, dial.family),
        cidr_included: all || in_cidr(cfg.pod_id, cidr_kind::INCLUDE, &dial.dst, dial.family),
        dns_port,
        dns_resolver: dns_port && dns::is_resolver(cfg, dial),
    }
}

#[inline(always)]
fn in_cidr(pod_id: u32, kind: u32, dst: &Addr, family: u32) -> bool {
    if family == AF_INET {
        let data = Cidr4 {
            pod_id,
            kind,
            addr: dst[0],
        };
        CIDR_V4
            .get(&Key::new(CIDR_KEY_PREFIX_BITS + 32, data))
            .is_some()
    } else {
        let data = Cidr6 {
            pod_id,
            kind,
            addr: *dst,
        };
        CIDR_V6
            .get(&Key::new(CIDR_KEY_PREFIX_BITS + 128, data))
            .is_some()
    }
}
