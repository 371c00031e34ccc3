//! istio-iptables' UDP half of DNS capture as one pure function: the nat OUTPUT rules a
//! UDP datagram to port 53 meets (ISTIO_OUTPUT's protocol-free rules 15, 18 and 21,
//! then ISTIO_OUTPUT_DNS `-p udp --dport 53 [-d RESOLVER] -j REDIRECT --to-port 15053`).
//! The kernel's sendmsg and connect hooks and the host tests share it. TCP to port 53
//! is part of [`crate::outbound::decide`], as it is part of ISTIO_OUTPUT.

use crate::{Decision, Rule, Verdict};

/// What a hook knows about one UDP datagram (or UDP `connect()`) to port 53 in a pod
/// with DNS capture on.
#[derive(Clone, Copy, Debug, Default)]
pub struct QueryFacts {
    pub uid: u32,
    pub gid: u32,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    /// Bound to 127.0.0.6 / ::6 and routed over lo (rule 15).
    pub inbound_passthrough: bool,
    /// `--capture-all-dns`, or the destination is one of the pod's resolvers.
    pub resolver: bool,
}

/// The first rule that matches decides; `DnsCapturedUdp` means "to the DNS proxy".
#[inline(always)]
pub fn decide_udp(f: &QueryFacts) -> Decision {
    verdict_udp(f).decision
}

/// [`decide_udp`], with the rule that matched.
#[inline(always)]
pub fn verdict_udp(f: &QueryFacts) -> Verdict {
    // 15: -o lo -s 127.0.0.6/32 -j RETURN
    if f.inbound_passthrough {
        return Verdict::new(Decision::DnsSkipInboundPassthrough, Rule::PassthroughSource);
    }
    // 18: -m owner --uid-owner 1337 -j RETURN: the proxy's forwarded queries leave.
    if f.uid == f.proxy_uid {
        return Verdict::new(Decision::DnsSkipProxyUid, Rule::ProxyUid);
    }
    // 21: -m owner --gid-owner 1337 -j RETURN
    if f.gid == f.proxy_gid {
        return Verdict::new(Decision::DnsSkipProxyGid, Rule::ProxyGid);
    }
    if f.resolver {
        Verdict::new(Decision::DnsCapturedUdp, Rule::DnsRedirect)
    } else {
        // No ISTIO_OUTPUT_DNS rule names this address, and UDP meets no other redirect.
        Verdict::ruleless(Decision::DnsSkipNotResolver)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app_query() -> QueryFacts {
        QueryFacts {
            uid: 1000,
            gid: 1000,
            proxy_uid: 1337,
            proxy_gid: 1337,
            inbound_passthrough: false,
            resolver: true,
        }
    }

    #[test]
    fn the_apps_query_to_a_resolver_is_captured() {
        assert_eq!(decide_udp(&app_query()), Decision::DnsCapturedUdp);
    }

    #[test]
    fn the_proxys_own_queries_leave_by_uid_or_gid() {
        let q = QueryFacts {
            uid: 1337,
            ..app_query()
        };
        assert_eq!(decide_udp(&q), Decision::DnsSkipProxyUid);
        let q = QueryFacts {
            gid: 1337,
            ..app_query()
        };
        assert_eq!(decide_udp(&q), Decision::DnsSkipProxyGid);
    }

    #[test]
    fn other_addresses_and_the_passthrough_source_are_left_alone() {
        let q = QueryFacts {
            resolver: false,
            ..app_query()
        };
        assert_eq!(decide_udp(&q), Decision::DnsSkipNotResolver);
        let q = QueryFacts {
            inbound_passthrough: true,
            uid: 1337,
            ..app_query()
        };
        assert_eq!(decide_udp(&q), Decision::DnsSkipInboundPassthrough);
    }
}
