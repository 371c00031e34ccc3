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
    pub proxy_uid: u32,
    pub proxy_gid: u32,
    pub mode: InterceptionMode,
    pub outbound_include: CidrSet,
    pub outbound_exclude: Vec<IpNet>,
    pub inbound_include: PortSet,
    pub inbound_exclude: Vec<u16>,
    pub outbound_ports_exclude: Vec<u16>,
    /// Short-circuit local socket pairs through the sockmap (eBPF backend).
    pub sockmap: bool,
    /// DNS capture to the agent's DNS proxy (istio-iptables `--redirect-dns`).
    pub dns: DnsCapture,
}

/// The agent's DNS proxy port (Istio's 15053).
pub const DNS_PROXY_PORT: u16 = 15053;

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

/// Where the pod's resolvers are listed.
pub const RESOLV_CONF: &str = "/etc/resolv.conf";

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

/// istio-iptables adds SSH to the inbound exclusions when every port is captured.
pub const SSH_PORT: u16 = 22;

impl CaptureConfig {
    /// Inbound ports that bypass the proxy, in istio-iptables' rule order.
    pub fn inbound_exclusions(&self) -> Vec<u16> {
        let mut ports = Vec::new();
        if self.inbound_include == PortSet::All {
            ports.push(SSH_PORT);
        }
        for &p in &self.inbound_exclude {
            if !ports.contains(&p) {
                ports.push(p);
            }
        }
        ports
    }
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
}
