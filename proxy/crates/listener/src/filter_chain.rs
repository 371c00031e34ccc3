//! Filter chain matching (Envoy's `FilterChainMatch`): which of a listener's filter chains
//! an accepted connection runs.
//!
//! The criteria are tried in Envoy's order: destination port, destination IP
//! (`prefix_ranges`), server name (SNI), transport protocol, application protocols
//! (ALPN), direct source IP, source type, source IP, source port. At each step only the
//! chains with the most specific match survive (an exact port over no port, the longest
//! prefix, an exact server name over the longest wildcard over none, ...), and a step
//! that leaves no chain ends the search: Envoy never backtracks to a less specific
//! chain of an earlier step, it falls back to `default_filter_chain` (or closes).
//!
//! The destination is the connection's address after the `original_dst` listener
//! filter restored it, which is how Istio's virtualInbound (15006) picks a chain by the
//! port the app was called on.

use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use super::chain_matcher::ChainMatcher;

/// What a connection offers to filter chain matching.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionInfo<'a> {
    /// The local address, or the original destination once restored.
    pub destination: SocketAddr,
    /// The peer address (the same as `direct_source` without the PROXY protocol).
    pub source: SocketAddr,
    pub direct_source: SocketAddr,
    /// SNI, lowercase, from `tls_inspector`.
    pub server_name: Option<&'a str>,
    /// `tls` from `tls_inspector`, else `raw_buffer`.
    pub transport_protocol: &'a str,
    /// ALPN from `tls_inspector`, or the protocol `http_inspector` recognised, in the
    /// client's order of preference.
    pub application_protocols: &'a [String],
}

/// Envoy's `source_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SourceType {
    #[default]
    Any,
    /// From the same host: a loopback source or the destination's own IP.
    SameIpOrLoopback,
    External,
}

/// One filter chain's match criteria; empty means "any".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FilterChainMatch {
    pub destination_port: Option<u16>,
    pub prefix_ranges: Vec<IpNet>,
    /// Lowercase; `*.example.com` is a wildcard for any name ending in `.example.com`.
    pub server_names: Vec<String>,
    pub transport_protocol: String,
    pub application_protocols: Vec<String>,
    pub direct_source_prefix_ranges: Vec<IpNet>,
    pub source_type: SourceType,
    pub source_prefix_ranges: Vec<IpNet>,
    pub source_ports: Vec<u16>,
}

/// How specifically a criterion matched: higher is more specific; `None` is no match.
type Rank = Option<u64>;

impl FilterChainMatch {
    /// The rank of each criterion, in Envoy's order.
    fn ranks(&self, conn: &ConnectionInfo<'_>) -> [Rank; 9] {
        [
            match self.destination_port {
                None => Some(0),
                Some(port) => (port == conn.destination.port()).then_some(1),
            },
            prefix_rank(&self.prefix_ranges, conn.destination.ip()),
            self.server_name_rank(conn.server_name),
            if self.transport_protocol.is_empty() {
                Some(0)
            } else {
                (self.transport_protocol == conn.transport_protocol).then_some(1)
            },
            self.application_protocol_rank(conn.application_protocols),
            prefix_rank(&self.direct_source_prefix_ranges, conn.direct_source.ip()),
            match self.source_type {
                SourceType::Any => Some(0),
                SourceType::SameIpOrLoopback => is_local(conn).then_some(1),
                SourceType::External => (!is_local(conn)).then_some(1),
            },
            prefix_rank(&self.source_prefix_ranges, conn.source.ip()),
            if self.source_ports.is_empty() {
                Some(0)
            } else {
                self.source_ports.contains(&conn.source.port()).then_some(1)
            },
        ]
    }

    /// Exact beats any wildcard; a longer wildcard suffix beats a shorter one; a chain
    /// without server names matches any connection, with or without SNI, least.
    fn server_name_rank(&self, name: Option<&str>) -> Rank {
        if self.server_names.is_empty() {
            return Some(0);
        }
        let name = name?;
        self.server_names
            .iter()
            .filter_map(|pattern| {
                if pattern == name {
                    Some(u64::MAX)
                } else {
                    let suffix = pattern.strip_prefix('*')?;
                    (suffix.starts_with('.') && name.ends_with(suffix) && name.len() > suffix.len())
                        .then_some(suffix.len() as u64)
                }
            })
            .max()
    }

    /// The client's first protocol that any chain lists wins, as Envoy walks the
    /// client's list in order; a chain without protocols matches least.
    fn application_protocol_rank(&self, offered: &[String]) -> Rank {
        if self.application_protocols.is_empty() {
            return Some(0);
        }
        let first = offered
            .iter()
            .position(|p| self.application_protocols.contains(p))?;
        Some((offered.len() - first) as u64)
    }

    /// Whether some connection could match both `self` and `other` with the same
    /// specificity at every step: Envoy rejects such a listener ("multiple filter chains
    /// with the same matching rules").
    pub fn overlaps(&self, other: &FilterChainMatch) -> bool {
        fn intersect<T: PartialEq>(a: &[T], b: &[T]) -> bool {
            (a.is_empty() && b.is_empty()) || a.iter().any(|x| b.contains(x))
        }
        self.destination_port == other.destination_port
            && intersect(&self.prefix_ranges, &other.prefix_ranges)
            && intersect(&self.server_names, &other.server_names)
            && self.transport_protocol == other.transport_protocol
            && intersect(&self.application_protocols, &other.application_protocols)
            && intersect(
                &self.direct_source_prefix_ranges,
                &other.direct_source_prefix_ranges,
            )
            && self.source_type == other.source_type
            && intersect(&self.source_prefix_ranges, &other.source_prefix_ranges)
            && intersect(&self.source_ports, &other.source_ports)
    }
}

/// Whether `ip` is in `prefix`, an IPv4-mapped IPv6 address counting as IPv4 (as Envoy
/// matches a dual-stack socket's peer).
fn in_prefix(prefix: &IpNet, ip: IpAddr) -> bool {
    prefix.contains(&ip.to_canonical())
}

/// The longest matching prefix wins; no ranges matches any address, least.
fn prefix_rank(ranges: &[IpNet], ip: IpAddr) -> Rank {
    if ranges.is_empty() {
        return Some(0);
    }
    ranges
        .iter()
        .filter(|cidr| in_prefix(cidr, ip))
        .map(|cidr| u64::from(cidr.prefix_len()) + 1)
        .max()
}

pub(super) fn is_local(conn: &ConnectionInfo<'_>) -> bool {
    let source = conn.source.ip().to_canonical();
    source.is_loopback() || source == conn.destination.ip().to_canonical()
}

/// A listener's filter chains with their matches, and the default chain.
#[derive(Debug)]
pub struct FilterChains<T> {
    chains: Vec<(FilterChainMatch, T)>,
    default: Option<T>,
    /// The listener's `filter_chain_matcher`: when set, it alone picks the chain.
    matcher: Option<ChainMatcher>,
}

impl<T> FilterChains<T> {
    pub fn new(chains: Vec<(FilterChainMatch, T)>, default: Option<T>) -> Self {
        FilterChains {
            chains,
            default,
            matcher: None,
        }
    }

    /// Chains picked by a `filter_chain_matcher`, which names them by index.
    pub fn with_matcher(mut self, matcher: ChainMatcher) -> Self {
        self.matcher = Some(matcher);
        self
    }

    /// The first pair of chains (by index) that no connection could tell apart (none
    /// when a `filter_chain_matcher` picks them).
    pub fn first_overlap(&self) -> Option<(usize, usize)> {
        if self.matcher.is_some() {
            return None;
        }
        for (i, (a, _)) in self.chains.iter().enumerate() {
            for (j, (b, _)) in self.chains.iter().enumerate().skip(i + 1) {
                if a.overlaps(b) {
                    return Some((i, j));
                }
            }
        }
        None
    }

    /// The chain `conn` runs, or `None` (no match and no default: Envoy closes).
    pub fn select(&self, conn: &ConnectionInfo<'_>) -> Option<&T> {
        if let Some(matcher) = &self.matcher {
            return match matcher.select(conn) {
                Some(i) => self.chains.get(i).map(|(_, chain)| chain),
                None => self.default.as_ref(),
            };
        }
        let mut candidates: Vec<(usize, [Rank; 9])> = self
            .chains
            .iter()
            .enumerate()
            .map(|(i, (m, _))| (i, m.ranks(conn)))
            .collect();
        for step in 0..9 {
            let best = candidates.iter().filter_map(|(_, r)| r[step]).max();
            let Some(best) = best else {
                return self.default.as_ref();
            };
            candidates.retain(|(_, r)| r[step] == Some(best));
        }
        // Compilation rejects overlapping chains, so at most one is left.
        match candidates.first() {
            Some((i, _)) => Some(&self.chains[*i].1),
            None => self.default.as_ref(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(s: &str) -> IpNet {
        let (ip, len) = s.split_once('/').unwrap();
        shunt_config::convert::prefix(ip.parse().unwrap(), len.parse().unwrap()).unwrap()
    }

    struct Conn {
        destination: &'static str,
        source: &'static str,
        sni: Option<&'static str>,
        transport: &'static str,
        alpn: Vec<String>,
    }

    fn conn(destination: &'static str) -> Conn {
        Conn {
            destination,
            source: "10.0.0.9:40000",
            sni: None,
            transport: "raw_buffer",
            alpn: Vec::new(),
        }
    }

    impl Conn {
        fn sni(mut self, sni: &'static str) -> Self {
            self.sni = Some(sni);
            self.transport = "tls";
            self
        }
        fn alpn(mut self, alpn: &[&str]) -> Self {
            self.alpn = alpn.iter().map(|s| s.to_string()).collect();
            self
        }
        fn from(mut self, source: &'static str) -> Self {
            self.source = source;
            self
        }
        fn select<'a>(&self, chains: &'a FilterChains<&'static str>) -> Option<&'a str> {
            let info = ConnectionInfo {
                destination: self.destination.parse().unwrap(),
                source: self.source.parse().unwrap(),
                direct_source: self.source.parse().unwrap(),
                server_name: self.sni,
                transport_protocol: self.transport,
                application_protocols: &self.alpn,
            };
            chains.select(&info).copied()
        }
    }

    fn chains(
        list: Vec<(&'static str, FilterChainMatch)>,
        default: Option<&'static str>,
    ) -> FilterChains<&'static str> {
        let chains = FilterChains::new(list.into_iter().map(|(n, m)| (m, n)).collect(), default);
        assert_eq!(chains.first_overlap(), None);
        chains
    }

    fn port(p: u16) -> FilterChainMatch {
        FilterChainMatch {
            destination_port: Some(p),
            ..Default::default()
        }
    }

    fn names(list: &[&str]) -> FilterChainMatch {
        FilterChainMatch {
            server_names: list.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn cidr_contains_its_prefix_only() {
        assert!(in_prefix(
            &cidr("10.1.0.0/16"),
            "10.1.200.3".parse().unwrap()
        ));
        assert!(!in_prefix(
            &cidr("10.1.0.0/16"),
            "10.2.0.1".parse().unwrap()
        ));
        assert!(in_prefix(&cidr("0.0.0.0/0"), "1.2.3.4".parse().unwrap()));
        assert!(!in_prefix(&cidr("0.0.0.0/0"), "::1".parse().unwrap()));
        assert!(in_prefix(&cidr("::/0"), "fd00::1".parse().unwrap()));
        assert!(in_prefix(
            &cidr("10.0.0.7/32"),
            "::ffff:10.0.0.7".parse().unwrap()
        ));
        // Host bits are cleared as Envoy does.
        assert_eq!(cidr("10.1.2.3/8"), cidr("10.0.0.0/8"));
        assert!(shunt_config::convert::prefix("10.0.0.0".parse().unwrap(), 33).is_none());
    }

    #[test]
    fn matching_follows_envoys_order_and_specificity() {
        let table = chains(
            vec![
                ("port 8080", port(8080)),
                (
                    "port 8080 tls",
                    FilterChainMatch {
                        transport_protocol: "tls".into(),
                        ..port(8080)
                    },
                ),
                (
                    "10.1/16",
                    FilterChainMatch {
                        prefix_ranges: vec![cidr("10.1.0.0/16")],
                        ..Default::default()
                    },
                ),
                (
                    "10.1.2/24",
                    FilterChainMatch {
                        prefix_ranges: vec![cidr("10.1.2.0/24"), cidr("192.168.0.0/16")],
                        ..Default::default()
                    },
                ),
                ("exact sni", names(&["api.example.com"])),
                ("wildcard sni", names(&["*.example.com"])),
                ("short wildcard", names(&["*.com"])),
                ("catch-all", FilterChainMatch::default()),
            ],
            Some("default"),
        );
        let cases: Vec<(Conn, Option<&str>)> = vec![
            // An exact destination port beats everything after it.
            (conn("10.1.2.3:8080"), Some("port 8080")),
            (
                conn("10.1.2.3:8080").sni("api.example.com"),
                Some("port 8080 tls"),
            ),
            // Longest destination prefix.
            (conn("10.1.2.3:80"), Some("10.1.2/24")),
            (conn("10.1.9.9:80"), Some("10.1/16")),
            (conn("192.168.7.7:80"), Some("10.1.2/24")),
            // Server names: exact, then the longest wildcard, then none.
            (
                conn("10.9.0.1:443").sni("api.example.com"),
                Some("exact sni"),
            ),
            (
                conn("10.9.0.1:443").sni("www.example.com"),
                Some("wildcard sni"),
            ),
            (
                conn("10.9.0.1:443").sni("example.com"),
                Some("short wildcard"),
            ),
            (conn("10.9.0.1:443").sni("example.org"), Some("catch-all")),
            (conn("10.9.0.1:443"), Some("catch-all")),
        ];
        for (conn, expected) in cases {
            assert_eq!(
                conn.select(&table),
                expected,
                "{} {:?}",
                conn.destination,
                conn.sni
            );
        }
    }

    #[test]
    fn no_backtracking_once_a_step_chose_its_chains() {
        // Port 9080's only chain wants SNI foo: a connection to 9080 with another SNI
        // does not fall back to the port-less chain; it gets the default chain.
        let table = chains(
            vec![
                (
                    "9080 foo",
                    FilterChainMatch {
                        server_names: vec!["foo".into()],
                        ..port(9080)
                    },
                ),
                ("any", FilterChainMatch::default()),
            ],
            Some("default"),
        );
        assert_eq!(
            conn("10.0.0.1:9080").sni("foo").select(&table),
            Some("9080 foo")
        );
        assert_eq!(
            conn("10.0.0.1:9080").sni("bar").select(&table),
            Some("default")
        );
        assert_eq!(conn("10.0.0.1:9081").sni("bar").select(&table), Some("any"));
        let no_default = chains(vec![("9080 foo", names(&["foo"]))], None);
        assert_eq!(conn("10.0.0.1:9080").select(&no_default), None);
    }

    #[test]
    fn istio_inbound_chains_pick_by_transport_and_alpn() {
        // virtualInbound 15006: mTLS with Istio's ALPN, TLS without it, plaintext HTTP,
        // plaintext TCP.
        let alpn = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let table = chains(
            vec![
                (
                    "mtls",
                    FilterChainMatch {
                        transport_protocol: "tls".into(),
                        application_protocols: alpn(&["istio-peer-exchange", "istio"]),
                        ..Default::default()
                    },
                ),
                (
                    "tls",
                    FilterChainMatch {
                        transport_protocol: "tls".into(),
                        ..Default::default()
                    },
                ),
                (
                    "plaintext http",
                    FilterChainMatch {
                        transport_protocol: "raw_buffer".into(),
                        application_protocols: alpn(&["http/1.1", "h2c"]),
                        ..Default::default()
                    },
                ),
                (
                    "plaintext tcp",
                    FilterChainMatch {
                        transport_protocol: "raw_buffer".into(),
                        ..Default::default()
                    },
                ),
            ],
            None,
        );
        let istio = conn("10.0.0.5:9080").sni("outbound_.9080_._.svc").alpn(&[
            "istio-peer-exchange",
            "istio",
            "h2",
        ]);
        assert_eq!(istio.select(&table), Some("mtls"));
        let plain_tls = conn("10.0.0.5:9080").sni("svc").alpn(&["h2"]);
        assert_eq!(plain_tls.select(&table), Some("tls"));
        assert_eq!(
            conn("10.0.0.5:9080").alpn(&["http/1.1"]).select(&table),
            Some("plaintext http")
        );
        assert_eq!(conn("10.0.0.5:9080").select(&table), Some("plaintext tcp"));
    }

    #[test]
    fn the_clients_first_offered_protocol_decides() {
        let alpn = |p: &str| FilterChainMatch {
            application_protocols: vec![p.into()],
            ..Default::default()
        };
        let table = chains(
            vec![("h2", alpn("h2")), ("http/1.1", alpn("http/1.1"))],
            None,
        );
        assert_eq!(
            conn("10.0.0.1:443")
                .alpn(&["h2", "http/1.1"])
                .select(&table),
            Some("h2")
        );
        assert_eq!(
            conn("10.0.0.1:443")
                .alpn(&["http/1.1", "h2"])
                .select(&table),
            Some("http/1.1")
        );
        assert_eq!(conn("10.0.0.1:443").alpn(&["spdy"]).select(&table), None);
    }

    #[test]
    fn source_criteria_come_last() {
        let table = chains(
            vec![
                (
                    "local",
                    FilterChainMatch {
                        source_type: SourceType::SameIpOrLoopback,
                        ..Default::default()
                    },
                ),
                (
                    "external 10.9/16",
                    FilterChainMatch {
                        source_type: SourceType::External,
                        source_prefix_ranges: vec![cidr("10.9.0.0/16")],
                        ..Default::default()
                    },
                ),
                (
                    "external 10.9/16 port 5555",
                    FilterChainMatch {
                        source_type: SourceType::External,
                        source_prefix_ranges: vec![cidr("10.9.0.0/16")],
                        source_ports: vec![5555],
                        ..Default::default()
                    },
                ),
                (
                    "external other",
                    FilterChainMatch {
                        source_type: SourceType::External,
                        ..Default::default()
                    },
                ),
            ],
            None,
        );
        assert_eq!(
            conn("10.0.0.5:80").from("127.0.0.1:1234").select(&table),
            Some("local")
        );
        // The destination's own IP counts as local too.
        assert_eq!(
            conn("10.0.0.5:80").from("10.0.0.5:1234").select(&table),
            Some("local")
        );
        assert_eq!(
            conn("10.0.0.5:80").from("10.9.1.1:1234").select(&table),
            Some("external 10.9/16")
        );
        assert_eq!(
            conn("10.0.0.5:80").from("10.9.1.1:5555").select(&table),
            Some("external 10.9/16 port 5555")
        );
        assert_eq!(
            conn("10.0.0.5:80").from("10.8.1.1:5555").select(&table),
            Some("external other")
        );
    }

    #[test]
    fn indistinguishable_chains_are_found() {
        let a = names(&["a.example.com", "b.example.com"]);
        let b = names(&["b.example.com"]);
        let table = FilterChains::new(vec![(a, 0), (port(80), 1), (b, 2)], None);
        assert_eq!(table.first_overlap(), Some((0, 2)));
        let table = FilterChains::new(
            vec![
                (FilterChainMatch::default(), 0),
                (FilterChainMatch::default(), 1),
            ],
            None,
        );
        assert_eq!(table.first_overlap(), Some((0, 1)));
        let table = FilterChains::new(vec![(port(80), 0), (port(81), 1)], None);
        assert_eq!(table.first_overlap(), None);
    }
}
