//! The istio-iptables rule each decision stands for, so an operator who knows
//! `iptables -t nat -L` reads an eBPF decision in the same terms. Numbers are the seed's
//! (SEEDS.md section 2, the README's "How the eBPF capture decides"); the rules
//! istio-iptables adds around them for flags (`-o`, `-x`, `-i`, `-b PORTS`, DNS) have
//! no number there and are named by their flag.

use crate::Decision;

/// One rule of istio-iptables' nat table (or `None`: a decision no rule makes, such as
/// the bookkeeping of original destinations, or shunt's own fail-open).
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    None = 0,
    /// `-A ISTIO_INBOUND -p tcp --dport P -j RETURN`: the tunnel port, then `-d` (seed
    /// rules 9-12 for 22, 15090, 15021, 15020).
    InboundExcludedPort = 9,
    /// `-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT` (`-b '*'`, or one per listed port).
    InboundRedirect = 13,
    /// `-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN`.
    PassthroughSource = 15,
    /// `-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT`.
    OwnPodIpByUid = 16,
    /// `-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN`.
    AppLocalByUid = 17,
    /// `-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN`.
    ProxyUid = 18,
    /// `-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT`.
    OwnPodIpByGid = 19,
    /// `-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN`.
    AppLocalByGid = 20,
    /// `-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN`.
    ProxyGid = 21,
    /// `-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN`.
    Localhost = 22,
    /// `-A ISTIO_OUTPUT -j ISTIO_REDIRECT`.
    Redirect = 23,
    /// `-o`: `-A ISTIO_OUTPUT -p tcp --dport P -j RETURN`, first in the chain.
    ExcludedPort = 100,
    /// `-x`: `-A ISTIO_OUTPUT -d CIDR -j RETURN`.
    ExcludedCidr = 101,
    /// `-i CIDRS`: the redirect is `-d CIDR -j ISTIO_REDIRECT`, and none matched.
    NotIncludedCidr = 102,
    /// `-b PORTS`: ISTIO_INBOUND redirects only the listed ports, and this is not one.
    NotListedInboundPort = 103,
    /// `-b ""`: no ISTIO_INBOUND chain at all.
    NoInboundCapture = 104,
    /// `--redirect-dns`: ISTIO_OUTPUT_DNS's `--dport 53 [-d RESOLVER] -j REDIRECT
    /// --to-ports 15053`.
    DnsRedirect = 105,
    /// In-pod (node) mode: the node proxy's mark, `-m mark --mark 0x539 -j RETURN`.
    NodeProxyMark = 106,
}

impl Rule {
    pub const ALL: [Rule; 19] = [
        Rule::None,
        Rule::InboundExcludedPort,
        Rule::InboundRedirect,
        Rule::PassthroughSource,
        Rule::OwnPodIpByUid,
        Rule::AppLocalByUid,
        Rule::ProxyUid,
        Rule::OwnPodIpByGid,
        Rule::AppLocalByGid,
        Rule::ProxyGid,
        Rule::Localhost,
        Rule::Redirect,
        Rule::ExcludedPort,
        Rule::ExcludedCidr,
        Rule::NotIncludedCidr,
        Rule::NotListedInboundPort,
        Rule::NoInboundCapture,
        Rule::DnsRedirect,
        Rule::NodeProxyMark,
    ];

    /// The rule an event field names (unknown numbers read as `None`).
    pub fn from_u16(n: u16) -> Rule {
        Self::ALL
            .iter()
            .copied()
            .find(|r| *r as u16 == n)
            .unwrap_or(Rule::None)
    }

    /// How the README's table names the rule: its number, or the flag that adds it;
    /// empty for `None`.
    pub const fn label(self) -> &'static str {
        match self {
            Rule::None => "",
            Rule::InboundExcludedPort => "9-12",
            Rule::InboundRedirect => "13",
            Rule::PassthroughSource => "15",
            Rule::OwnPodIpByUid => "16",
            Rule::AppLocalByUid => "17",
            Rule::ProxyUid => "18",
            Rule::OwnPodIpByGid => "19",
            Rule::AppLocalByGid => "20",
            Rule::ProxyGid => "21",
            Rule::Localhost => "22",
            Rule::Redirect => "23",
            Rule::ExcludedPort => "-o",
            Rule::ExcludedCidr => "-x",
            Rule::NotIncludedCidr => "-i",
            Rule::NotListedInboundPort => "-b",
            Rule::NoInboundCapture => "-b \"\"",
            Rule::DnsRedirect => "dns",
            Rule::NodeProxyMark => "mark",
        }
    }

    /// The iptables rule itself, as `iptables -t nat -S` shows it (with the seed's
    /// 1337 for the proxy's uid and gid).
    pub const fn text(self) -> &'static str {
        match self {
            Rule::None => "",
            Rule::InboundExcludedPort => "-A ISTIO_INBOUND -p tcp --dport PORT -j RETURN",
            Rule::InboundRedirect => "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT",
            Rule::PassthroughSource => "-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN",
            Rule::OwnPodIpByUid => {
                "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT"
            }
            Rule::AppLocalByUid => "-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner 1337 -j RETURN",
            Rule::ProxyUid => "-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN",
            Rule::OwnPodIpByGid => {
                "-A ISTIO_OUTPUT -o lo ! -d 127.0.0.1/32 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT"
            }
            Rule::AppLocalByGid => "-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner 1337 -j RETURN",
            Rule::ProxyGid => "-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN",
            Rule::Localhost => "-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN",
            Rule::Redirect => "-A ISTIO_OUTPUT -j ISTIO_REDIRECT",
            Rule::ExcludedPort => "-A ISTIO_OUTPUT -p tcp --dport PORT -j RETURN",
            Rule::ExcludedCidr => "-A ISTIO_OUTPUT -d CIDR -j RETURN",
            Rule::NotIncludedCidr => {
                "-A ISTIO_OUTPUT -d CIDR -j ISTIO_REDIRECT (no -i CIDR matched)"
            }
            Rule::NotListedInboundPort => {
                "-A ISTIO_INBOUND -p tcp --dport PORT -j ISTIO_IN_REDIRECT (port not in -b)"
            }
            Rule::NoInboundCapture => "no ISTIO_INBOUND chain (-b \"\")",
            Rule::DnsRedirect => "-A ISTIO_OUTPUT_DNS --dport 53 -j REDIRECT --to-ports 15053",
            Rule::NodeProxyMark => "-A ISTIO_OUTPUT -m mark --mark 0x539 -j RETURN",
        }
    }
}

/// A decision with the rule that made it: what the pure decision functions return.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub decision: Decision,
    pub rule: Rule,
}

impl Verdict {
    #[inline(always)]
    pub const fn new(decision: Decision, rule: Rule) -> Verdict {
        Verdict { decision, rule }
    }

    /// A decision no istio-iptables rule makes.
    #[inline(always)]
    pub const fn ruleless(decision: Decision) -> Verdict {
        Verdict {
            decision,
            rule: Rule::None,
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::string::ToString;

    #[test]
    fn every_rule_reads_back_from_its_number() {
        for r in Rule::ALL {
            assert_eq!(Rule::from_u16(r as u16), r);
        }
        assert_eq!(Rule::from_u16(7), Rule::None);
    }

    #[test]
    fn numbered_rules_are_labelled_by_their_seed_number() {
        for r in Rule::ALL {
            let n = r as u16;
            if (13..=23).contains(&n) {
                assert_eq!(r.label(), n.to_string());
            }
        }
    }
}
