//! istio-iptables' ISTIO_OUTPUT chain as one pure function, so the connect hooks and
//! the host tests share the exact rule order (SEEDS.md section 2, rules 14-23, plus
//! the `-o` port and `-x`/`-i` CIDR rules istio-iptables adds around them, and with
//! `--redirect-dns` its TCP half of ISTIO_OUTPUT_DNS and the `! --dport 53` it adds to
//! rules 16, 17 and 20).

use crate::{Decision, Rule, Verdict};

/// What the connect hook knows about one `connect()`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConnectFacts {
    pub uid: u32,
    pub gid: u32,
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    /// The destination port is in `-o`.
    pub port_excluded: bool,
    /// The socket is bound to 127.0.0.6 / ::6 (Envoy's inbound passthrough).
    pub src_inbound_passthrough: bool,
    /// The route goes out `lo`: loopback range, unspecified, or one of the pod's addresses.
    pub via_lo: bool,
    /// The destination is exactly 127.0.0.1 / ::1.
    pub dst_localhost: bool,
    /// The destination is in a `-x` CIDR.
    pub cidr_excluded: bool,
    /// `-i '*'`, or the destination is in an `-i` CIDR.
    pub cidr_included: bool,
    /// DNS capture is on and the destination port is 53.
    pub dns_port: bool,
    /// `--capture-all-dns`, or the destination is one of the pod's resolvers.
    pub dns_resolver: bool,
}

/// The chain walked top to bottom; the first rule that matches decides.
#[inline(always)]
pub fn decide(f: &ConnectFacts) -> Decision {
    verdict(f).decision
}

/// [`decide`], with the rule that matched.
#[inline(always)]
pub fn verdict(f: &ConnectFacts) -> Verdict {
    let v = Verdict::new;
    // `-p tcp --dport P -j RETURN`, before everything else.
    if f.port_excluded {
        return v(Decision::SkipExcludedPort, Rule::ExcludedPort);
    }
    // 15: -o lo -s 127.0.0.6/32 -j RETURN
    if f.via_lo && f.src_inbound_passthrough {
        return v(Decision::SkipInboundPassthrough, Rule::PassthroughSource);
    }
    // 16: -o lo ! -d 127.0.0.1/32 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT
    // (with DNS capture: `-m multiport ! --dports 53,15008`)
    if f.via_lo && !f.dst_localhost && f.uid == f.proxy_uid && !f.dns_port {
        return v(Decision::InboundRedirectedLocal, Rule::OwnPodIpByUid);
    }
    // 17: -o lo -m owner ! --uid-owner 1337 -j RETURN (with DNS capture: `! --dport 53`,
    // so the app's TCP DNS to a local resolver such as 127.0.0.53 reaches the DNS rules)
    if f.via_lo && f.uid != f.proxy_uid && !f.dns_port {
        return v(Decision::SkipAppLocal, Rule::AppLocalByUid);
    }
    // 18: -m owner --uid-owner 1337 -j RETURN
    if f.uid == f.proxy_uid {
        return v(Decision::SkipProxyUid, Rule::ProxyUid);
    }
    // 19: -o lo ! -d 127.0.0.1/32 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT
    // (istio-iptables leaves port 53 in this one)
    if f.via_lo && !f.dst_localhost && f.gid == f.proxy_gid {
        return v(Decision::InboundRedirectedLocal, Rule::OwnPodIpByGid);
    }
    // 20: -o lo -m owner ! --gid-owner 1337 -j RETURN (with DNS capture: `! --dport 53`)
    if f.via_lo && f.gid != f.proxy_gid && !f.dns_port {
        return v(Decision::SkipAppLocal, Rule::AppLocalByGid);
    }
    // 21: -m owner --gid-owner 1337 -j RETURN
    if f.gid == f.proxy_gid {
        return v(Decision::SkipProxyGid, Rule::ProxyGid);
    }
    // -j ISTIO_OUTPUT_DNS: -p tcp --dport 53 [-d RESOLVER] -j REDIRECT --to-ports 15053
    if f.dns_port && f.dns_resolver {
        return v(Decision::DnsCapturedTcp, Rule::DnsRedirect);
    }
    // 22: -d 127.0.0.1/32 -j RETURN
    if f.dst_localhost {
        return v(Decision::SkipLoopback, Rule::Localhost);
    }
    // -d EXCLUDED_CIDR -j RETURN (before inclusions)
    if f.cidr_excluded {
        return v(Decision::SkipExcludedCidr, Rule::ExcludedCidr);
    }
    // 23: -j ISTIO_REDIRECT (or -d INCLUDED_CIDR -j ISTIO_REDIRECT)
    if f.cidr_included {
        v(Decision::OutboundRedirected, Rule::Redirect)
    } else {
        v(Decision::SkipNotIncludedCidr, Rule::NotIncludedCidr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app() -> ConnectFacts {
        ConnectFacts {
            uid: 1000,
            gid: 1000,
            proxy_uid: 1337,
            proxy_gid: 1337,
            cidr_included: true,
            ..Default::default()
        }
    }

    #[test]
    fn app_to_remote_is_redirected_outbound() {
        assert_eq!(decide(&app()), Decision::OutboundRedirected);
    }

    #[test]
    fn proxy_to_remote_is_not_captured() {
        let f = ConnectFacts { uid: 1337, ..app() };
        assert_eq!(decide(&f), Decision::SkipProxyUid);
        let f = ConnectFacts { gid: 1337, ..app() };
        assert_eq!(decide(&f), Decision::SkipProxyGid);
    }

    #[test]
    fn proxy_to_own_pod_ip_goes_inbound_but_not_from_passthrough_source() {
        let f = ConnectFacts {
            uid: 1337,
            via_lo: true,
            ..app()
        };
        assert_eq!(decide(&f), Decision::InboundRedirectedLocal);
        let f = ConnectFacts {
            src_inbound_passthrough: true,
            ..f
        };
        assert_eq!(decide(&f), Decision::SkipInboundPassthrough);
        let f = ConnectFacts {
            uid: 1337,
            via_lo: true,
            dst_localhost: true,
            ..app()
        };
        assert_eq!(decide(&f), Decision::SkipProxyUid);
    }

    #[test]
    fn app_local_calls_are_not_captured() {
        let f = ConnectFacts {
            via_lo: true,
            ..app()
        };
        assert_eq!(decide(&f), Decision::SkipAppLocal);
        // gid 1337 but another uid: rule 17 returns first, as in iptables.
        let f = ConnectFacts {
            via_lo: true,
            gid: 1337,
            ..app()
        };
        assert_eq!(decide(&f), Decision::SkipAppLocal);
    }

    #[test]
    fn exclusions_win_over_inclusions() {
        let f = ConnectFacts {
            cidr_excluded: true,
            ..app()
        };
        assert_eq!(decide(&f), Decision::SkipExcludedCidr);
        let f = ConnectFacts {
            cidr_included: false,
            ..app()
        };
        assert_eq!(decide(&f), Decision::SkipNotIncludedCidr);
        let f = ConnectFacts {
            port_excluded: true,
            uid: 1337,
            via_lo: true,
            ..app()
        };
        assert_eq!(decide(&f), Decision::SkipExcludedPort);
    }

    #[test]
    fn tcp_dns_to_a_resolver_goes_to_the_dns_proxy_even_over_lo() {
        let dns = ConnectFacts {
            dns_port: true,
            dns_resolver: true,
            ..app()
        };
        assert_eq!(decide(&dns), Decision::DnsCapturedTcp);
        // 127.0.0.53 (a local resolver): rule 17 no longer returns for port 53.
        let local = ConnectFacts {
            via_lo: true,
            ..dns
        };
        assert_eq!(decide(&local), Decision::DnsCapturedTcp);
        // The proxy's own queries leave.
        let proxy = ConnectFacts { uid: 1337, ..dns };
        assert_eq!(decide(&proxy), Decision::SkipProxyUid);
        let proxy = ConnectFacts { gid: 1337, ..dns };
        assert_eq!(decide(&proxy), Decision::SkipProxyGid);
        // -o still wins, as istio-iptables puts it first.
        let excluded = ConnectFacts {
            port_excluded: true,
            ..dns
        };
        assert_eq!(decide(&excluded), Decision::SkipExcludedPort);
    }

    #[test]
    fn tcp_dns_to_another_address_is_ordinary_outbound_traffic() {
        let other = ConnectFacts {
            dns_port: true,
            ..app()
        };
        assert_eq!(decide(&other), Decision::OutboundRedirected);
        // Over lo it falls past rule 17 (`! --dport 53`) to the loopback and CIDR rules.
        let local = ConnectFacts {
            via_lo: true,
            dst_localhost: true,
            ..other
        };
        assert_eq!(decide(&local), Decision::SkipLoopback);
        // The proxy dialling its own pod address on 53 is not sent inbound (16 excludes
        // 53), but by gid it is (19 does not).
        let proxy_uid = ConnectFacts {
            uid: 1337,
            via_lo: true,
            ..other
        };
        assert_eq!(decide(&proxy_uid), Decision::SkipProxyUid);
        let proxy_gid = ConnectFacts {
            gid: 1337,
            via_lo: true,
            ..other
        };
        assert_eq!(decide(&proxy_gid), Decision::InboundRedirectedLocal);
    }

    #[test]
    fn uid_and_gid_rules_are_told_apart() {
        let uid = ConnectFacts {
            uid: 1337,
            via_lo: true,
            ..app()
        };
        assert_eq!(verdict(&uid).rule, Rule::OwnPodIpByUid);
        let gid = ConnectFacts {
            gid: 1337,
            via_lo: true,
            ..app()
        };
        // 17 returns first for another uid: a gid-only caller over lo is the app...
        assert_eq!(verdict(&gid).rule, Rule::AppLocalByUid);
        // ...unless DNS capture takes port 53 out of 16 and 17: then 19 decides.
        let gid_dns = ConnectFacts {
            dns_port: true,
            ..gid
        };
        assert_eq!(verdict(&gid_dns).rule, Rule::OwnPodIpByGid);
        let app_local = ConnectFacts {
            via_lo: true,
            ..app()
        };
        assert_eq!(verdict(&app_local).rule, Rule::AppLocalByUid);
        assert_eq!(verdict(&app()).rule, Rule::Redirect);
    }
}
