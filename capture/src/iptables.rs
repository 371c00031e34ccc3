//! The fallback backend: istio-iptables' exact nat rules (SEEDS.md section 2), written
//! with iptables-restore / ip6tables-restore, removed rule by rule on cleanup.

use std::{
    io::Write,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};
use ipnet::IpNet;

use crate::config::{CaptureConfig, CidrSet, InterceptionMode, PortSet};

const CHAINS: [&str; 4] = [
    "ISTIO_INBOUND",
    "ISTIO_REDIRECT",
    "ISTIO_IN_REDIRECT",
    "ISTIO_OUTPUT",
];
/// The jumps from the built-in chains; everything else lives in our own chains.
const JUMPS: [(&str, &str); 2] = [("PREROUTING", "ISTIO_INBOUND"), ("OUTPUT", "ISTIO_OUTPUT")];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn restore_tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables-restore",
            Family::V6 => "ip6tables-restore",
        }
    }
    fn tool(self) -> &'static str {
        match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        }
    }
    /// Envoy's inbound passthrough source and the loopback host, per family.
    fn passthrough_src(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.6/32",
            Family::V6 => "::6/128",
        }
    }
    fn localhost(self) -> &'static str {
        match self {
            Family::V4 => "127.0.0.1/32",
            Family::V6 => "::1/128",
        }
    }
}

/// The `-A` rules for one family, in istio-iptables' order.
pub fn rules(cfg: &CaptureConfig, family: Family) -> Vec<String> {
    let mut r = Vec::new();
    let lo = family.localhost();
    r.push(format!(
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports {}",
        cfg.proxy_port
    ));
    r.push(format!(
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports {}",
        cfg.inbound_capture_port
    ));
    let inbound_on = cfg.inbound_include != PortSet::Only(vec![]);
    if inbound_on {
        r.push("-A PREROUTING -p tcp -j ISTIO_INBOUND".into());
        match &cfg.inbound_include {
            PortSet::All => {
                for port in cfg.inbound_exclusions() {
                    r.push(format!("-A ISTIO_INBOUND -p tcp --dport {port} -j RETURN"));
                }
                r.push("-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT".into());
            }
            PortSet::Only(ports) => {
                for port in ports {
                    r.push(format!(
                        "-A ISTIO_INBOUND -p tcp --dport {port} -j ISTIO_IN_REDIRECT"
                    ));
                }
            }
        }
    }
    r.push("-A OUTPUT -p tcp -j ISTIO_OUTPUT".into());
    for port in &cfg.outbound_ports_exclude {
        r.push(format!("-A ISTIO_OUTPUT -p tcp --dport {port} -j RETURN"));
    }
    r.push(format!(
        "-A ISTIO_OUTPUT -o lo -s {} -j RETURN",
        family.passthrough_src()
    ));
    for (owner, id) in [
        ("--uid-owner", cfg.proxy_uid),
        ("--gid-owner", cfg.proxy_gid),
    ] {
        r.push(format!(
            "-A ISTIO_OUTPUT -o lo ! -d {lo} -m owner {owner} {id} -j ISTIO_IN_REDIRECT"
        ));
        r.push(format!(
            "-A ISTIO_OUTPUT -o lo -m owner ! {owner} {id} -j RETURN"
        ));
        r.push(format!("-A ISTIO_OUTPUT -m owner {owner} {id} -j RETURN"));
    }
    r.push(format!("-A ISTIO_OUTPUT -d {lo} -j RETURN"));
    let ours = |c: &&IpNet| matches!(c, IpNet::V4(_)) == (family == Family::V4);
    for cidr in cfg.outbound_exclude.iter().filter(ours) {
        r.push(format!("-A ISTIO_OUTPUT -d {cidr} -j RETURN"));
    }
    match &cfg.outbound_include {
        CidrSet::All => r.push("-A ISTIO_OUTPUT -j ISTIO_REDIRECT".into()),
        CidrSet::Only(cidrs) => {
            for cidr in cidrs.iter().filter(ours) {
                r.push(format!("-A ISTIO_OUTPUT -d {cidr} -j ISTIO_REDIRECT"));
            }
        }
    }
    r
}

/// The iptables-restore input for one family.
pub fn restore_text(cfg: &CaptureConfig, family: Family) -> String {
    let mut text = String::from("*nat\n");
    for chain in CHAINS {
        text.push_str(&format!(":{chain} - [0:0]\n"));
    }
    for rule in rules(cfg, family) {
        text.push_str(&rule);
        text.push('\n');
    }
    text.push_str("COMMIT\n");
    text
}

pub fn dry_run(cfg: &CaptureConfig) -> anyhow::Result<String> {
    check_mode(cfg)?;
    Ok(format!(
        "# iptables-restore --noflush\n{}# ip6tables-restore --noflush\n{}",
        restore_text(cfg, Family::V4),
        restore_text(cfg, Family::V6)
    ))
}

fn check_mode(cfg: &CaptureConfig) -> anyhow::Result<()> {
    if cfg.mode == InterceptionMode::Tproxy {
        bail!(
            "-m TPROXY: the iptables backend renders REDIRECT rules only; use -m REDIRECT, or \
             --backend ebpf (its sk_lookup keeps the original destination as TPROXY does)"
        );
    }
    Ok(())
}

/// Writes the rules for both families; if the second fails the first is taken back.
pub fn install(cfg: &CaptureConfig) -> anyhow::Result<()> {
    check_mode(cfg)?;
    for family in [Family::V4, Family::V6] {
        if chain_exists(family, "ISTIO_OUTPUT") {
            bail!(
                "{}: chain ISTIO_OUTPUT already exists in this network namespace's nat table: \
                 capture is already installed (run `shunt capture --cleanup` first)",
                family.tool()
            );
        }
    }
    restore(Family::V4, &restore_text(cfg, Family::V4))?;
    if let Err(err) = restore(Family::V6, &restore_text(cfg, Family::V6)) {
        let _ = cleanup_family(Family::V4);
        return Err(err.context("IPv4 rules rolled back"));
    }
    Ok(())
}

fn restore(family: Family, text: &str) -> anyhow::Result<()> {
    let tool = family.restore_tool();
    let mut child = Command::new(tool)
        .arg("--noflush")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {tool} (is the iptables package installed?)"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{tool} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn chain_exists(family: Family, chain: &str) -> bool {
    Command::new(family.tool())
        .args(["-w", "-t", "nat", "-S", chain])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn ipt(family: Family, args: &[&str]) -> bool {
    Command::new(family.tool())
        .arg("-w")
        .args(["-t", "nat"])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Removes the jumps and our chains, nothing else. Returns whether anything was there.
fn cleanup_family(family: Family) -> anyhow::Result<bool> {
    let mut found = false;
    for (builtin, target) in JUMPS {
        while ipt(family, &["-D", builtin, "-p", "tcp", "-j", target]) {
            found = true;
        }
    }
    for chain in CHAINS {
        if chain_exists(family, chain) {
            found = true;
            ipt(family, &["-F", chain]);
        }
    }
    for chain in CHAINS {
        if chain_exists(family, chain) && !ipt(family, &["-X", chain]) {
            bail!("{}: cannot delete chain {chain}", family.tool());
        }
    }
    Ok(found)
}

pub fn cleanup() -> anyhow::Result<bool> {
    let v4 = cleanup_family(Family::V4)?;
    let v6 = cleanup_family(Family::V6)?;
    Ok(v4 || v6)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::*;

    pub fn seed_config() -> CaptureConfig {
        CaptureConfig {
            proxy_port: 15001,
            inbound_capture_port: 15006,
            proxy_uid: 1337,
            proxy_gid: 1337,
            mode: InterceptionMode::Redirect,
            outbound_include: CidrSet::All,
            outbound_exclude: vec![],
            inbound_include: PortSet::All,
            inbound_exclude: vec![15090, 15021, 15020],
            outbound_ports_exclude: vec![],
            sockmap: true,
            dns: Default::default(),
        }
    }

    /// SEEDS.md section 2, rules 6-23, verbatim (whitespace normalised).
    const SEED_RULES: &str = include_str!("../../tests/fixtures/istio-iptables-seed.rules");

    #[test]
    fn seed_flags_render_the_seed_rules_in_order() {
        let expected: Vec<String> = SEED_RULES
            .lines()
            .filter(|l| l.starts_with("-A"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(rules(&seed_config(), Family::V4), expected);
    }

    #[test]
    fn flags_change_the_rules_as_istio_iptables_does() {
        let cfg = CaptureConfig {
            outbound_include: CidrSet::Only(parse_cidrs("-i", "10.0.0.0/8,fd00::/8").unwrap()),
            outbound_exclude: parse_cidrs("-x", "10.9.0.0/16").unwrap(),
            inbound_include: PortSet::Only(vec![8080]),
            outbound_ports_exclude: vec![3306],
            ..seed_config()
        };
        let v4 = rules(&cfg, Family::V4);
        assert!(
            !v4.iter().any(|r| r.contains("--dport 22")),
            "22 only with -b '*'"
        );
        assert!(v4.contains(&"-A ISTIO_INBOUND -p tcp --dport 8080 -j ISTIO_IN_REDIRECT".into()));
        let pos = |r: &str| v4.iter().position(|x| x == r).unwrap();
        assert!(
            pos("-A ISTIO_OUTPUT -p tcp --dport 3306 -j RETURN")
                < pos("-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN")
        );
        assert!(
            pos("-A ISTIO_OUTPUT -d 10.9.0.0/16 -j RETURN")
                < pos("-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT")
        );
        let v6 = rules(&cfg, Family::V6);
        assert!(v6.contains(&"-A ISTIO_OUTPUT -d fd00::/8 -j ISTIO_REDIRECT".into()));
        assert!(v6.contains(&"-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN".into()));
        assert!(!v6.iter().any(|r| r.contains("10.0.0.0")));
    }

    #[test]
    fn no_inbound_ports_means_no_prerouting_jump() {
        let cfg = CaptureConfig {
            inbound_include: PortSet::Only(vec![]),
            ..seed_config()
        };
        assert!(
            !rules(&cfg, Family::V4)
                .iter()
                .any(|r| r.contains("PREROUTING"))
        );
    }

    #[test]
    fn tproxy_is_refused_with_the_alternative_named() {
        let cfg = CaptureConfig {
            mode: InterceptionMode::Tproxy,
            ..seed_config()
        };
        let err = dry_run(&cfg).unwrap_err().to_string();
        assert!(
            err.contains("TPROXY") && err.contains("--backend ebpf"),
            "{err}"
        );
    }
}
