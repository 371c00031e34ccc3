//! The one definition of every map key, value and counter that shunt's eBPF programs
//! and its userspace share. `#[repr(C)]` with explicit padding fields so the layout
//! (and the BTF that bpftool pretty-prints) is the same on both sides.
#![no_std]

/// Address families as the kernel numbers them.
pub const AF_INET: u32 = 2;
pub const AF_INET6: u32 = 10;

/// `getsockopt(SOL_IP, SO_ORIGINAL_DST)`: netfilter's original-destination query.
pub const SOL_IP: i32 = 0;
pub const SOL_IPV6: i32 = 41;
pub const SO_ORIGINAL_DST: i32 = 80;
pub const IP6T_SO_ORIGINAL_DST: i32 = 80;

/// Istio's inbound passthrough source (`upstream_bind_config` of
/// InboundPassthroughClusterIpv4/6): 127.0.0.6 and ::6.
pub const INBOUND_PASSTHROUGH_V4: [u8; 4] = [127, 0, 0, 6];
pub const INBOUND_PASSTHROUGH_V6: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6];

/// Pin names under the bpffs root (default `/sys/fs/bpf/shunt`). bpffs refuses '.'.
pub mod pins {
    pub const POD_CONFIG: &str = "POD_CONFIG";
    pub const POD_ADDRS: &str = "POD_ADDRS";
    pub const POD_PORTS: &str = "POD_PORTS";
    pub const CIDR_V4: &str = "CIDR_V4";
    pub const CIDR_V6: &str = "CIDR_V6";
    pub const ORIG_DST_COOKIE: &str = "ORIG_DST_COOKIE";
    pub const ORIG_DST_TUPLE: &str = "ORIG_DST_TUPLE";
    pub const LISTENERS: &str = "LISTENERS";
    pub const COUNTERS: &str = "COUNTERS";
    pub const SOCK_PAIRS: &str = "SOCK_PAIRS";
    pub const PAIR_STATE: &str = "PAIR_STATE";
    pub const PROXY_SOCKS: &str = "PROXY_SOCKS";
    pub const POD_COUNTERS: &str = "POD_COUNTERS";
    pub const DNS_SERVERS: &str = "DNS_SERVERS";
    pub const DNS_ORIG_DST: &str = "DNS_ORIG_DST";
    pub const EVENTS: &str = "EVENTS";
    pub const EVENTS_ON: &str = "EVENTS_ON";
    pub const EVENTS_DROPPED: &str = "EVENTS_DROPPED";
    pub const POD_LABELS: &str = "POD_LABELS";
    /// aya-log's ring of the programs' log records. Not shared node-wide as the maps
    /// above: pinned in the folder of whoever loaded the programs (a pod's, or the
    /// node's), so the process reading it sees only its own programs' records.
    pub const AYA_LOGS: &str = "AYA_LOGS";
    /// Every map, in the order userspace pins and removes them.
    pub const MAPS: [&str; 19] = [
        POD_CONFIG,
        POD_ADDRS,
        POD_PORTS,
        CIDR_V4,
        CIDR_V6,
        ORIG_DST_COOKIE,
        ORIG_DST_TUPLE,
        LISTENERS,
        COUNTERS,
        SOCK_PAIRS,
        PAIR_STATE,
        PROXY_SOCKS,
        POD_COUNTERS,
        DNS_SERVERS,
        DNS_ORIG_DST,
        EVENTS,
        EVENTS_ON,
        EVENTS_DROPPED,
        POD_LABELS,
    ];
}

/// An IP address as the kernel's socket contexts carry it: four 32-bit words, each in
/// network byte order; IPv4 uses word 0 and leaves the rest zero.
pub type Addr = [u32; 4];

/// `PodConfig::flags`.
pub mod flags {
    /// `-i '*'` for IPv4: every destination not excluded is captured.
    pub const OUTBOUND_ALL_V4: u32 = 1 << 0;
    /// `-i '*'` for IPv6.
    pub const OUTBOUND_ALL_V6: u32 = 1 << 1;
    /// Inbound capture is on (`-b` not empty).
    pub const INBOUND: u32 = 1 << 2;
    /// `-b '*'`: every inbound port but the excluded ones; otherwise only listed ports.
    pub const INBOUND_ALL_PORTS: u32 = 1 << 3;
    /// Local socket pairs of this pod skip the TCP/IP stack (off with `--no-sockmap`).
    pub const SOCKMAP: u32 = 1 << 4;
    /// DNS to the pod's resolvers goes to the DNS proxy (`--redirect-dns`).
    pub const DNS_REDIRECT: u32 = 1 << 5;
    /// With `DNS_REDIRECT`: DNS to any address, not only the pod's resolvers
    /// (`--capture-all-dns`).
    pub const DNS_CAPTURE_ALL: u32 = 1 << 6;
    /// Node mode's `fail-open`: with no proxy listening for the pod, connects go
    /// straight to their destination and inbound straight to the app (default: closed).
    pub const FAIL_OPEN: u32 = 1 << 7;
    /// Decision events are on for this pod (`shunt inspect --follow --pod`, `--events`).
    pub const EVENTS: u32 = 1 << 8;
}

/// The mark node mode's proxy puts on the upstream sockets it opens inside a pod
/// (Istio's 0x539): the connect hooks let them through uncaptured.
pub const NODE_PROXY_MARK: u32 = 0x539;

/// The agent's DNS proxy port (Istio's 15053), on loopback.
pub const DNS_PROXY_PORT: u16 = 15053;
/// The port DNS capture looks at.
pub const DNS_PORT: u16 = 53;

/// `DNS_SERVERS` key: one of a pod's resolvers (from its `resolv.conf`); the value is a
/// `u8` set to 1. An IPv4 resolver is also matched when a dual-stack socket asks
/// `::ffff:a.b.c.d`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DnsServerKey {
    pub pod_id: u32,
    pub family: u32,
    pub addr: Addr,
}

/// Capture settings of one pod, keyed by its network namespace cookie (`POD_CONFIG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodConfig {
    /// The pod's id in the other maps: its network namespace inode number.
    pub pod_id: u32,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    /// Host byte order.
    pub outbound_port: u16,
    /// Host byte order.
    pub inbound_port: u16,
    pub flags: u32,
    /// Where captured connects are sent: the pod's own IPv4 address (network order),
    /// so the kernel picks it as the source and the proxy sees the app's pod IP as
    /// iptables' REDIRECT shows it; 0 means 127.0.0.1.
    pub addr_v4: u32,
    /// The same for IPv6 (`::1` when zero).
    pub addr_v6: Addr,
}

/// `POD_ADDRS` key: one of a pod's own addresses. Value: that pod's `PodConfig`, so `sk_lookup`
/// (which has no network namespace cookie to go by) finds the pod from the destination.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AddrKey {
    pub addr: Addr,
    pub family: u32,
}

/// `LISTENERS` key: a pod's inbound listener socket for one address family (an IPv6-only
/// socket cannot take IPv4 connections, so each family has its own).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    pub pod_id: u32,
    pub family: u32,
}

/// `POD_PORTS` kinds.
pub mod port_kind {
    /// `-d` (and 22 when `-b '*'`): inbound port that bypasses the proxy.
    pub const INBOUND_EXCLUDE: u16 = 1;
    /// `-b PORTS`: inbound port that is captured.
    pub const INBOUND_INCLUDE: u16 = 2;
    /// `-o`: outbound destination port that bypasses the proxy.
    pub const OUTBOUND_EXCLUDE: u16 = 3;
}

/// `POD_PORTS` key; the value is a `u8` set to 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortKey {
    pub pod_id: u32,
    /// Host byte order.
    pub port: u16,
    pub kind: u16,
}

/// `CIDR_V4`/`CIDR_V6` kinds: `-x` exclusions are checked before `-i` inclusions,
/// whatever their prefix lengths, as istio-iptables orders its rules.
pub mod cidr_kind {
    pub const EXCLUDE: u32 = 1;
    pub const INCLUDE: u32 = 2;
}

/// LPM-trie data for `CIDR_V4`: `pod_id` and `kind` are always matched whole (the
/// prefix length is 64 + the CIDR's), so one trie serves every pod.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr4 {
    pub pod_id: u32,
    pub kind: u32,
    pub addr: u32,
}

/// LPM-trie data for `CIDR_V6`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cidr6 {
    pub pod_id: u32,
    pub kind: u32,
    pub addr: Addr,
}

/// `PAIR_STATE` values: what a short-circuited socket's sends do. The first message
/// decides, and the only change allowed later is to `FALLBACK`: bytes redirected to the
/// peer's ingress are read before its TCP receive queue, so going from TCP to redirect
/// mid-stream could reorder them, while going from redirect to TCP cannot.
pub mod pair_state {
    pub const UNDECIDED: u32 = 0;
    pub const REDIRECT: u32 = 1;
    pub const FALLBACK: u32 = 2;
}

/// Prefix bits taken by `pod_id` and `kind` ahead of the address in the CIDR tries.
pub const CIDR_KEY_PREFIX_BITS: u32 = 64;

/// Where a captured connection was going. Value of `ORIG_DST_COOKIE` (by the
/// connecting socket's cookie, written at connect), `ORIG_DST_TUPLE`, and
/// `DNS_ORIG_DST` (by the cookie of a UDP socket whose query went to the DNS proxy:
/// the resolver its replies must appear to come from).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OriginalDst {
    pub addr: Addr,
    /// Network byte order, as in `sockaddr_in`.
    pub port: u16,
    /// 1 when decision events were on for the pod when the record was made: the
    /// connection's later decisions (recorded, answered, removed, restored) are reported
    /// too, without looking the pod up again.
    pub events: u16,
    pub family: u32,
    pub pod_id: u32,
    /// `direction::OUTBOUND` or `direction::INBOUND`.
    pub direction: u32,
}

pub mod direction {
    pub const OUTBOUND: u32 = 1;
    /// The proxy calling its own pod address, sent to the inbound port (rules 16/19).
    pub const INBOUND: u32 = 2;
}

/// `ORIG_DST_TUPLE` key: a redirected connection as its client sees it, in its
/// network namespace. The proxy's accepted socket looks itself up with source and
/// destination swapped.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockTuple {
    pub netns: u64,
    pub src: Addr,
    pub dst: Addr,
    /// Host byte order.
    pub src_port: u16,
    /// Host byte order.
    pub dst_port: u16,
    pub family: u32,
}

/// `POD_COUNTERS` key: one pod's count of one decision (a per-CPU value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodCounterKey {
    pub pod_id: u32,
    pub decision: u32,
}

/// Every decision the programs take has a counter: index into `COUNTERS`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// connect(): sent to the outbound port (rule 23).
    OutboundRedirected = 0,
    /// connect(): the proxy calling its own pod address, sent to the inbound port (16/19).
    InboundRedirectedLocal,
    /// connect(): the socket's network namespace has no capture.
    SkipNotEnrolled,
    /// connect(): not TCP.
    SkipNotTcp,
    /// connect(): source 127.0.0.6/::6 over lo (rule 15).
    SkipInboundPassthrough,
    /// connect(): the proxy's own traffic by uid (18).
    SkipProxyUid,
    /// connect(): the proxy's own traffic by gid (21).
    SkipProxyGid,
    /// connect(): the app calling a local address, its own pod IP or loopback (17/20).
    SkipAppLocal,
    /// connect(): destination 127.0.0.1/::1 (22).
    SkipLoopback,
    /// connect(): destination in an excluded CIDR (`-x`).
    SkipExcludedCidr,
    /// connect(): destination not in an included CIDR (`-i` not `*`).
    SkipNotIncludedCidr,
    /// connect(): destination port excluded (`-o`).
    SkipExcludedPort,
    /// sk_lookup: inbound connection steered to the inbound listener (13).
    InboundSteered,
    /// sk_lookup: inbound port excluded (9-12, `-d`) or not included (`-b PORTS`).
    InboundSkipPort,
    /// sk_lookup: the source is local (the pod itself); the connect hook decided.
    InboundSkipLocalSource,
    /// sk_lookup: captured port but no inbound listener registered: dropped (fail closed).
    InboundNoListener,
    /// sockops: a redirected connection's original destination recorded by 4-tuple.
    OrigDstRecorded,
    /// getsockopt: SO_ORIGINAL_DST answered from the tuple map.
    OrigDstAnswered,
    /// sockops: a redirected connection closed; its tuple entry removed.
    OrigDstRemoved,
    /// sockops: a pod's inbound listener registered for sk_lookup.
    ListenerRegistered,
    /// sk_lookup: the destination is not one of a pod's addresses.
    InboundSkipNotPod,
    /// sockops: a local socket joined the short-circuit map.
    PairAdded,
    /// sockops: a short-circuited socket closed.
    PairRemoved,
    /// sk_msg: a send went straight to the peer's receive queue.
    MsgRedirected,
    /// sk_msg: bytes that went straight to the peer (added per message).
    BytesRedirected,
    /// sk_msg: the peer was not in the map; this socket uses TCP from now on.
    MsgFallback,
    /// sendmsg/connect (UDP): a query to a resolver sent to the DNS proxy.
    DnsCapturedUdp,
    /// connect (TCP): a connection to a resolver's port 53 sent to the DNS proxy.
    DnsCapturedTcp,
    /// sendmsg/connect (UDP): a query from the proxy's uid (its own forwarded queries).
    DnsSkipProxyUid,
    /// sendmsg/connect (UDP): a query from the proxy's gid.
    DnsSkipProxyGid,
    /// sendmsg/connect (UDP): port 53 of an address that is not one of the pod's
    /// resolvers (and no `--capture-all-dns`).
    DnsSkipNotResolver,
    /// sendmsg/connect (UDP): from 127.0.0.6/::6 over lo (rule 15 has no protocol).
    DnsSkipInboundPassthrough,
    /// recvmsg: a reply from the DNS proxy given back the resolver's address as source.
    DnsReplyRestored,
    /// connect(): node mode's proxy opening an upstream in the pod (its socket mark).
    SkipNodeProxyMark,
    /// connect()/sk_lookup: a `fail-open` pod with no proxy listening: passed straight.
    FailOpenNoProxy,
    /// connect()/sendmsg: the record a capture needs could not be stored (its map is
    /// full): left uncaptured rather than captured without its original destination.
    SkipMapFull,
}

impl Decision {
    pub const COUNT: u32 = 36;
    pub const ALL: [Decision; Self::COUNT as usize] = [
        Decision::OutboundRedirected,
        Decision::InboundRedirectedLocal,
        Decision::SkipNotEnrolled,
        Decision::SkipNotTcp,
        Decision::SkipInboundPassthrough,
        Decision::SkipProxyUid,
        Decision::SkipProxyGid,
        Decision::SkipAppLocal,
        Decision::SkipLoopback,
        Decision::SkipExcludedCidr,
        Decision::SkipNotIncludedCidr,
        Decision::SkipExcludedPort,
        Decision::InboundSteered,
        Decision::InboundSkipPort,
        Decision::InboundSkipLocalSource,
        Decision::InboundNoListener,
        Decision::OrigDstRecorded,
        Decision::OrigDstAnswered,
        Decision::OrigDstRemoved,
        Decision::ListenerRegistered,
        Decision::InboundSkipNotPod,
        Decision::PairAdded,
        Decision::PairRemoved,
        Decision::MsgRedirected,
        Decision::BytesRedirected,
        Decision::MsgFallback,
        Decision::DnsCapturedUdp,
        Decision::DnsCapturedTcp,
        Decision::DnsSkipProxyUid,
        Decision::DnsSkipProxyGid,
        Decision::DnsSkipNotResolver,
        Decision::DnsSkipInboundPassthrough,
        Decision::DnsReplyRestored,
        Decision::SkipNodeProxyMark,
        Decision::FailOpenNoProxy,
        Decision::SkipMapFull,
    ];

    /// The decision a counter index or event field names.
    pub fn from_u32(n: u32) -> Option<Decision> {
        Self::ALL.get(n as usize).copied()
    }

    /// The counter's name in `shunt` output and the demo.
    pub const fn name(self) -> &'static str {
        match self {
            Decision::OutboundRedirected => "outbound_redirected",
            Decision::InboundRedirectedLocal => "inbound_redirected_local",
            Decision::SkipNotEnrolled => "skip_not_enrolled",
            Decision::SkipNotTcp => "skip_not_tcp",
            Decision::SkipInboundPassthrough => "skip_inbound_passthrough_source",
            Decision::SkipProxyUid => "skip_proxy_uid",
            Decision::SkipProxyGid => "skip_proxy_gid",
            Decision::SkipAppLocal => "skip_app_local",
            Decision::SkipLoopback => "skip_loopback",
            Decision::SkipExcludedCidr => "skip_excluded_cidr",
            Decision::SkipNotIncludedCidr => "skip_not_included_cidr",
            Decision::SkipExcludedPort => "skip_excluded_port",
            Decision::InboundSteered => "inbound_steered",
            Decision::InboundSkipPort => "inbound_skip_port",
            Decision::InboundSkipLocalSource => "inbound_skip_local_source",
            Decision::InboundNoListener => "inbound_no_listener",
            Decision::OrigDstRecorded => "orig_dst_recorded",
            Decision::OrigDstAnswered => "orig_dst_answered",
            Decision::OrigDstRemoved => "orig_dst_removed",
            Decision::ListenerRegistered => "listener_registered",
            Decision::InboundSkipNotPod => "inbound_skip_not_pod",
            Decision::PairAdded => "sockmap_pair_added",
            Decision::PairRemoved => "sockmap_pair_removed",
            Decision::MsgRedirected => "sockmap_msg_redirected",
            Decision::BytesRedirected => "sockmap_bytes_redirected",
            Decision::MsgFallback => "sockmap_fallback",
            Decision::DnsCapturedUdp => "dns_captured_udp",
            Decision::DnsCapturedTcp => "dns_captured_tcp",
            Decision::DnsSkipProxyUid => "dns_skip_proxy_uid",
            Decision::DnsSkipProxyGid => "dns_skip_proxy_gid",
            Decision::DnsSkipNotResolver => "dns_skip_not_resolver",
            Decision::DnsSkipInboundPassthrough => "dns_skip_inbound_passthrough_source",
            Decision::DnsReplyRestored => "dns_reply_restored",
            Decision::SkipNodeProxyMark => "skip_node_proxy_mark",
            Decision::FailOpenNoProxy => "fail_open_no_proxy",
            Decision::SkipMapFull => "skip_map_full",
        }
    }

    /// What happened to the connection (or record), in one word: `captured` (sent to a
    /// proxy), `passed` (left alone), `dropped`, or for bookkeeping `recorded`,
    /// `answered`, `restored`, `removed`, `fallback`.
    pub const fn outcome(self) -> &'static str {
        use Decision::*;
        match self {
            OutboundRedirected
            | InboundRedirectedLocal
            | InboundSteered
            | DnsCapturedUdp
            | DnsCapturedTcp => "captured",
            SkipNotEnrolled
            | SkipNotTcp
            | SkipInboundPassthrough
            | SkipProxyUid
            | SkipProxyGid
            | SkipAppLocal
            | SkipLoopback
            | SkipExcludedCidr
            | SkipNotIncludedCidr
            | SkipExcludedPort
            | InboundSkipPort
            | InboundSkipLocalSource
            | InboundSkipNotPod
            | DnsSkipProxyUid
            | DnsSkipProxyGid
            | DnsSkipNotResolver
            | DnsSkipInboundPassthrough
            | SkipNodeProxyMark
            | FailOpenNoProxy
            | SkipMapFull => "passed",
            InboundNoListener => "dropped",
            OrigDstRecorded | ListenerRegistered | PairAdded => "recorded",
            OrigDstAnswered => "answered",
            DnsReplyRestored => "restored",
            OrigDstRemoved | PairRemoved => "removed",
            MsgRedirected | BytesRedirected => "redirected",
            MsgFallback => "fallback",
        }
    }
}

#[cfg(feature = "user")]
mod user {
    use super::*;
    // SAFETY: all are #[repr(C)], made only of integers, with explicit padding fields.
    unsafe impl aya::Pod for PodConfig {}
    unsafe impl aya::Pod for AddrKey {}
    unsafe impl aya::Pod for PortKey {}
    unsafe impl aya::Pod for Cidr4 {}
    unsafe impl aya::Pod for Cidr6 {}
    unsafe impl aya::Pod for OriginalDst {}
    unsafe impl aya::Pod for SockTuple {}
    unsafe impl aya::Pod for ListenerKey {}
    unsafe impl aya::Pod for PodCounterKey {}
    unsafe impl aya::Pod for DnsServerKey {}
    unsafe impl aya::Pod for events::DecisionEvent {}
    unsafe impl aya::Pod for events::PodLabel {}
}

pub mod dns;
pub mod events;
pub mod inbound;
pub mod outbound;
pub mod rule;

pub use rule::{Rule, Verdict};
