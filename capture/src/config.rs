//! istio-iptables' flags, parsed and validated once into a `CaptureConfig` that both
//! backends render from. Every error names the flag and the bad value.

use std::net::IpAddr;

use ipnet::IpNet;

/// An IP prefix such as `10.0.0.0/8` or `fd00::/8`; a bare address is a /32 or /128.
/// Host bits are kept as written (istio-iptables passes them to iptables unchanged);
/// the eBPF backend truncates them.
pub fn parse_cidr(s: &str) -> Result<IpNet, String> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (a, Some(l)),
        None => (s, None),
    };
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("'{s}' is not an IP address or CIDR"))?;
    let Some(len) = len else {
        return Ok(IpNet::from(addr));
    };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    len.parse::<u8>()
        .ok()
        .and_then(|n| IpNet::new(addr, n).ok())
        .ok_or_else(|| format!("'{s}': prefix length must be 0..={max}"))
}

/// `-i`: `*` (everything) or a list of CIDRs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CidrSet {
    All,
    Only(Vec<IpNet>),
}

/// `-b`: `*` (every port but the excluded ones) or a list of ports (empty: no inbound capture).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortSet {
    All,
    Only(Vec<u16>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "UPPER")]
pub enum InterceptionMode {
    Redirect,
    Tproxy,
}

/// What to capture, from istio-iptables' flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureConfig {
    pub proxy_port: u16,
    pub inbound_capture_port: u16,
    /// The HBONE tunnel port (`-e`, Istio's 15008): inbound to it and the proxy's own
    /// loopback traffic to it are never captured.
    pub inbound_tunnel_port: u16,
    /// The first of `proxy_uids` (the eBPF backend exempts one uid).
    pub proxy_uid: u32,
    /// The first of `proxy_gids`.
    pub proxy_gid: u32,
    /// Every uid in `-u` (istio-iptables takes a comma-separated list).
    pub proxy_uids: Vec<u32>,
    /// Every gid in `-g`.
    pub proxy_gids: Vec<u32>,
    pub mode: InterceptionMode,
    /// TPROXY's packet mark and policy-routing table (`-t`, `-r`).
    pub tproxy: Tproxy,
    pub outbound_include: CidrSet,
    pub outbound_exclude: Vec<IpNet>,
    pub inbound_include: PortSet,
    pub inbound_exclude: Vec<u16>,
    pub outbound_ports_exclude: Vec<u16>,
    /// Outbound destination ports captured even outside `-i` (`-q`).
    pub outbound_ports_include: Vec<u16>,
    /// Interfaces whose inbound traffic is treated as outbound (`-k`, KubeVirt VMs).
    pub kube_virt_interfaces: Vec<String>,
    /// Interfaces never captured either way (`-c`).
    pub exclude_interfaces: Vec<String>,
    /// Whose outbound traffic is captured, by the socket owner's group.
    pub owner_groups: OwnerGroups,
    /// Drop conntrack-INVALID packets instead of letting the kernel reset (`--drop-invalid`).
    pub drop_invalid: bool,
    /// Render and install the IPv6 rules too (`ENABLE_INBOUND_IPV6`).
    pub ipv6: bool,
    /// What counts as the pod's loopback destination (`ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR`).
    pub host_ipv4_loopback: IpNet,
    /// Short-circuit local socket pairs through the sockmap (eBPF backend).
    pub sockmap: bool,
    /// DNS capture to the agent's DNS proxy (istio-iptables `--redirect-dns`).
    pub dns: DnsCapture,
}

/// TPROXY mode's mark on diverted packets and the routing table that sends them to lo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tproxy {
    pub mark: u32,
    pub route_table: u32,
}

impl Default for Tproxy {
    fn default() -> Self {
        Tproxy {
            mark: 1337,
            route_table: 133,
        }
    }
}

/// istio-iptables' owner-group filter (`ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]`): groups
/// by name or gid, handed to iptables' owner match as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnerGroups {
    /// `*`: every group but these.
    AllExcept(Vec<String>),
    /// Only these groups.
    Only(Vec<String>),
}

/// One iptables rule holds every included group as a match; istio-iptables caps it.
pub const MAX_OWNER_GROUPS_INCLUDE: usize = 64;

/// The agent's DNS proxy port (Istio's 15053), shared with the eBPF programs.
pub use shunt_common::DNS_PROXY_PORT;

/// DNS capture: UDP and TCP to port 53 go to the DNS proxy instead.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DnsCapture {
    /// Capture DNS at all (`--redirect-dns`, env `REDIRECT_DNS`).
    pub redirect: bool,
    /// Capture queries to any resolver, not only the pod's (`--capture-all-dns`).
    pub capture_all: bool,
    /// The pod's resolvers (from `resolv.conf`, or the flags): only these are captured
    /// unless `capture_all`.
    pub servers: Vec<std::net::IpAddr>,
}

impl DnsCapture {
    /// istio-iptables turns DNS capture off (with a warning) when it has neither
    /// `--capture-all-dns` nor a resolver to capture.
    pub fn active(&self) -> bool {
        self.redirect && (self.capture_all || !self.servers.is_empty())
    }
}

/// The `nameserver` addresses of a `resolv.conf`, in order and without repeats. Lines
/// that are not a nameserver with a parseable address (comments, `search`, `options`)
/// are skipped, as the C library's resolver skips them; an IPv6 zone (`%eth0`) is dropped.
pub fn resolv_conf_servers(text: &str) -> Vec<IpAddr> {
    let mut servers = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        let Some(addr) = words.next() else { continue };
        let addr = addr.split('%').next().unwrap_or(addr);
        if let Ok(ip) = addr.parse::<IpAddr>()
            && !servers.contains(&ip)
        {
            servers.push(ip);
        }
    }
    servers
}

impl CaptureConfig {
    /// Inbound ports that bypass the proxy with `-b '*'`, in istio-iptables' rule order:
    /// the tunnel port, then `-d`. (istio-iptables no longer adds SSH's 22 by itself.)
    pub fn inbound_exclusions(&self) -> Vec<u16> {
        let mut ports = vec![self.inbound_tunnel_port];
        for &p in &self.inbound_exclude {
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        ports
    }

    /// Flags only the iptables backend implements, named as on the command line; the
    /// eBPF backend refuses a config that uses any (and `auto` falls back to iptables).
    pub fn iptables_only_flags(&self) -> Vec<&'static str> {
        let mut flags = Vec::new();
        if self.proxy_uids.len() > 1 {
            flags.push("-u with more than one uid");
        }
        if self.proxy_gids.len() > 1 {
            flags.push("-g with more than one gid");
        }
        if !self.outbound_ports_include.is_empty() {
            flags.push("-q");
        }
        if !self.kube_virt_interfaces.is_empty() {
            flags.push("-k");
        }
        if !self.exclude_interfaces.is_empty() {
            flags.push("-c");
        }
        if self.owner_groups != OwnerGroups::AllExcept(vec![]) {
            flags.push("ISTIO_OUTBOUND_OWNER_GROUPS[_EXCLUDE]");
        }
        if self.drop_invalid {
            flags.push("--drop-invalid");
        }
        if self.host_ipv4_loopback != default_loopback() {
            flags.push("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR");
        }
        if !self.ipv6 {
            // The eBPF programs capture both families.
            flags.push("ENABLE_INBOUND_IPV6=false");
        }
        flags
    }
}

pub fn default_loopback() -> IpNet {
    IpNet::from(IpAddr::from([127, 0, 0, 1]))
}

pub fn parse_port(flag: &str, s: &str) -> Result<u16, String> {
    match s.trim().parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(format!("{flag}: '{s}' is not a port (1-65535)")),
    }
}

/// A comma-separated port list; empty means none.
pub fn parse_ports(flag: &str, s: &str) -> Result<Vec<u16>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| parse_port(flag, p))
        .collect()
}

pub fn parse_port_set(flag: &str, s: &str) -> Result<PortSet, String> {
    if s.trim() == "*" {
        Ok(PortSet::All)
    } else {
        parse_ports(flag, s).map(PortSet::Only)
    }
}

pub fn parse_cidrs(flag: &str, s: &str) -> Result<Vec<IpNet>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .map(|c| parse_cidr(c).map_err(|e| format!("{flag}: {e}")))
        .collect()
}

pub fn parse_cidr_set(flag: &str, s: &str) -> Result<CidrSet, String> {
    if s.trim() == "*" {
        Ok(CidrSet::All)
    } else {
        parse_cidrs(flag, s).map(CidrSet::Only)
    }
}

/// `-u` / `-g`: one or more numeric ids, comma-separated.
pub fn parse_ids(flag: &str, s: &str) -> Result<Vec<u32>, String> {
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .map(|i| {
            i.parse()
                .map_err(|_| format!("{flag}: '{i}' is not a numeric id"))
        })
        .collect::<Result<_, _>>()?;
    if ids.is_empty() {
        return Err(format!("{flag}: needs at least one id"));
    }
    Ok(ids)
}

/// `-k` / `-c`: interface names as the kernel allows them (1-15 bytes, no '/', ':' or
/// whitespace).
pub fn parse_interfaces(flag: &str, s: &str) -> Result<Vec<String>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|i| !i.is_empty())
        .map(|i| {
            let ok = i.len() <= 15
                && i != "."
                && i != ".."
                && !i
                    .bytes()
                    .any(|b| b == b'/' || b == b':' || b.is_ascii_whitespace());
            if ok {
                Ok(i.to_owned())
            } else {
                Err(format!("{flag}: '{i}' is not an interface name"))
            }
        })
        .collect()
}

/// istio-iptables' owner-group filter: `include` is `*` or groups; `exclude` applies
/// with `*` only. Groups are names or gids.
pub fn parse_owner_groups(include: &str, exclude: &str) -> Result<OwnerGroups, String> {
    let groups = |flag: &str, s: &str| -> Result<Vec<String>, String> {
        s.split(',')
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .map(|g| {
                let ok = g.len() <= 32
                    && g.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
                if ok {
                    Ok(g.to_owned())
                } else {
                    Err(format!("{flag}: '{g}' is not a group name or gid"))
                }
            })
            .collect()
    };
    if include.trim() == "*" {
        return Ok(OwnerGroups::AllExcept(groups(
            "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE",
            exclude,
        )?));
    }
    let only = groups("ISTIO_OUTBOUND_OWNER_GROUPS", include)?;
    if only.len() > MAX_OWNER_GROUPS_INCLUDE {
        return Err(format!(
            "ISTIO_OUTBOUND_OWNER_GROUPS: {} groups, at most {MAX_OWNER_GROUPS_INCLUDE} fit one iptables rule",
            only.len()
        ));
    }
    Ok(OwnerGroups::Only(only))
}

/// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR`: an IPv4 loopback prefix with a mask of 8 to 32,
/// kept as written (`127.0.0.1/8`).
pub fn parse_loopback_cidr(flag: &str, s: &str) -> Result<IpNet, String> {
    let net = parse_cidr(s.trim()).map_err(|e| format!("{flag}: {e}"))?;
    match net {
        IpNet::V4(v4) if v4.addr().is_loopback() && (8..=32).contains(&v4.prefix_len()) => Ok(net),
        _ => Err(format!(
            "{flag}: '{s}' is not an IPv4 loopback CIDR with a mask of 8 to 32"
        )),
    }
}

/// istio-iptables' booleans (Go's strconv.ParseBool).
pub fn parse_bool(flag: &str, s: &str) -> Result<bool, String> {
    match s.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Ok(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Ok(false),
        _ => Err(format!("{flag}: '{s}' is not true or false")),
    }
}

/// A duration as Go writes it for `--probe-timeout`: `5s`, `500ms`, `1m`.
pub fn parse_duration(flag: &str, s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{flag}: '{s}' is not a duration such as 5s or 500ms"))?;
    match unit {
        "ms" => Ok(std::time::Duration::from_millis(n)),
        "s" => Ok(std::time::Duration::from_secs(n)),
        "m" => Ok(std::time::Duration::from_secs(n * 60)),
        _ => Err(format!(
            "{flag}: '{s}' is not a duration such as 5s or 500ms"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs_parse_and_reject_with_the_flag_named() {
        assert_eq!(
            parse_cidrs("-x", "10.0.0.0/8, 1.2.3.4").unwrap(),
            vec![
                "10.0.0.0/8".parse::<IpNet>().unwrap(),
                "1.2.3.4/32".parse::<IpNet>().unwrap()
            ]
        );
        assert_eq!(parse_cidr_set("-i", "*").unwrap(), CidrSet::All);
        let err = parse_cidrs("-x", "10.0.0.0/33").unwrap_err();
        assert!(err.starts_with("-x:") && err.contains("0..=32"), "{err}");
        let err = parse_cidrs("-i", "10.0.0/8").unwrap_err();
        assert!(err.contains("'10.0.0/8'"), "{err}");
        assert!(parse_cidrs("-x", "fd00::/129").is_err());
        assert!(parse_cidrs("-x", "fd00::/x").is_err());
        // Host bits are kept as written, as istio-iptables hands them to iptables.
        assert_eq!(parse_cidr("10.1.2.3/8").unwrap().to_string(), "10.1.2.3/8");
        assert_eq!(parse_cidr("fd00::1").unwrap().prefix_len(), 128);
    }

    #[test]
    fn resolv_conf_nameservers_are_read_in_order() {
        let text = "# generated\nsearch ns.svc.cluster.local svc.cluster.local\n\
                    nameserver 10.96.0.10\nnameserver fd00::a%eth0\n;nameserver 1.1.1.1\n\
                    nameserver   10.96.0.10\nnameserver bogus\nnameserver\noptions ndots:5\n";
        let want: Vec<IpAddr> = vec!["10.96.0.10".parse().unwrap(), "fd00::a".parse().unwrap()];
        assert_eq!(resolv_conf_servers(text), want);
        assert!(resolv_conf_servers("").is_empty());
    }

    #[test]
    fn ports_parse_and_reject() {
        assert_eq!(
            parse_ports("-d", "15090,15021, 15020").unwrap(),
            vec![15090, 15021, 15020]
        );
        assert_eq!(parse_ports("-o", "").unwrap(), Vec::<u16>::new());
        assert_eq!(parse_port_set("-b", "*").unwrap(), PortSet::All);
        assert!(parse_ports("-d", "80,http").unwrap_err().contains("'http'"));
        assert!(parse_ports("-d", "70000").is_err());
        assert!(parse_ports("-d", "0").is_err());
    }

    #[test]
    fn resolv_conf_nameservers_in_order() {
        let text = "# generated\nsearch default.svc.cluster.local svc.cluster.local\n\
                    nameserver 10.96.0.10\n  nameserver   fd00::a  \n; comment\n\
                    nameserver fe80::1%eth0\nnameserver dns.example\noptions ndots:5\n\
                    nameserver\nnameserver 127.0.0.53 # stub\n";
        assert_eq!(
            resolv_conf_servers(text),
            ["10.96.0.10", "fd00::a", "fe80::1", "127.0.0.53"]
                .map(|a| a.parse::<IpAddr>().unwrap())
                .to_vec()
        );
        assert!(resolv_conf_servers("").is_empty());
    }

    #[test]
    fn the_new_flags_parse_and_reject_naming_the_flag() {
        assert_eq!(parse_ids("-u", "3, 4").unwrap(), vec![3, 4]);
        assert!(parse_ids("-u", "").unwrap_err().starts_with("-u:"));
        assert!(parse_ids("-g", "1,root").unwrap_err().contains("'root'"));
        assert_eq!(
            parse_interfaces("-k", "eth0,,eth1").unwrap(),
            ["eth0", "eth1"]
        );
        assert!(
            parse_interfaces("-c", "a-very-long-interface")
                .unwrap_err()
                .starts_with("-c:")
        );
        assert_eq!(
            parse_owner_groups("java,202", "ignored").unwrap(),
            OwnerGroups::Only(vec!["java".into(), "202".into()])
        );
        assert_eq!(
            parse_owner_groups("*", "888,ftp").unwrap(),
            OwnerGroups::AllExcept(vec!["888".into(), "ftp".into()])
        );
        let many = (0..65).map(|g| g.to_string()).collect::<Vec<_>>().join(",");
        assert!(
            parse_owner_groups(&many, "")
                .unwrap_err()
                .contains("at most 64")
        );
        assert!(
            parse_owner_groups("*", "a b")
                .unwrap_err()
                .contains("_EXCLUDE")
        );
        assert_eq!(
            parse_loopback_cidr("-l", "127.0.0.1/8")
                .unwrap()
                .to_string(),
            "127.0.0.1/8"
        );
        assert!(parse_loopback_cidr("-l", "127.0.0.1/7").is_err());
        assert!(parse_loopback_cidr("-l", "10.0.0.1/32").is_err());
        assert!(parse_loopback_cidr("-l", "::1/128").is_err());
        assert!(parse_bool("--drop-invalid", "T").unwrap());
        assert!(
            parse_bool("--drop-invalid", "yes")
                .unwrap_err()
                .contains("'yes'")
        );
        assert_eq!(
            parse_duration("-t", "500ms").unwrap(),
            std::time::Duration::from_millis(500)
        );
        assert!(parse_duration("-t", "5").is_err());
    }

    #[test]
    fn dns_capture_needs_resolvers_or_capture_all() {
        let mut dns = DnsCapture {
            redirect: true,
            ..Default::default()
        };
        assert!(!dns.active());
        dns.capture_all = true;
        assert!(dns.active());
        dns.redirect = false;
        assert!(!dns.active());
    }
}
