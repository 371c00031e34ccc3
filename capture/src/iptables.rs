//! The fallback backend: istio-iptables' exact rules ([`plan`]), written with
//! iptables-restore / ip6tables-restore, TPROXY's policy routing with `ip`, checked by
//! istio-iptables' validation probe ([`validation`]) and removed on cleanup.

pub mod builder;
pub mod plan;
pub mod validation;

use std::{
    io::Write,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

use crate::config::{CaptureConfig, InterceptionMode, PortSet};

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
    fn ip_flag(self) -> &'static str {
        match self {
            Family::V4 => "-4",
            Family::V6 => "-6",
        }
    }
}

/// The families a config installs: IPv6 only with `ENABLE_INBOUND_IPV6`.
fn families(cfg: &CaptureConfig) -> Vec<Family> {
    if cfg.ipv6 {
        vec![Family::V4, Family::V6]
    } else {
        vec![Family::V4]
    }
}

/// Every rule line (`-A ...` / `-I ...`) for one family, all tables, in order.
pub fn rules(cfg: &CaptureConfig, family: Family) -> Vec<String> {
    plan::plan(cfg)
        .rules(family)
        .iter()
        .map(|r| r.line.clone())
        .collect()
}

/// The iptables-restore input for one family.
pub fn restore_text(cfg: &CaptureConfig, family: Family) -> String {
    plan::plan(cfg).restore(family)
}

/// TPROXY's policy routing: marked packets are delivered locally through lo.
fn tproxy_routes(cfg: &CaptureConfig) -> Vec<(Family, Vec<String>)> {
    if cfg.mode != InterceptionMode::Tproxy || cfg.inbound_include == PortSet::Only(vec![]) {
        return vec![];
    }
    let (mark, table) = (
        cfg.tproxy.mark.to_string(),
        cfg.tproxy.route_table.to_string(),
    );
    let mut cmds = Vec::new();
    for family in families(cfg) {
        let f = family.ip_flag().to_owned();
        let rule = ["rule", "add", "fwmark", &mark, "lookup", &table];
        let route = [
            "route", "add", "local", "default", "dev", "lo", "table", &table,
        ];
        for args in [&rule[..], &route[..]] {
            let mut cmd = vec![f.clone()];
            cmd.extend(args.iter().map(|s| s.to_string()));
            cmds.push((family, cmd));
        }
    }
    cmds
}

pub fn dry_run(cfg: &CaptureConfig) -> anyhow::Result<String> {
    let plan = plan::plan(cfg);
    let mut out = String::new();
    for family in [Family::V4, Family::V6] {
        if family == Family::V6 && !cfg.ipv6 {
            out.push_str("# ip6tables: IPv6 off (ENABLE_INBOUND_IPV6=false)\n");
            continue;
        }
        out.push_str(&format!("# {} --noflush\n", family.restore_tool()));
        out.push_str(&plan.restore(family));
    }
    for (_, cmd) in tproxy_routes(cfg) {
        out.push_str(&format!("# ip {}\n", cmd.join(" ")));
    }
    Ok(out)
}

/// Writes the rules (and TPROXY's routes); if any step fails, what was written is
/// taken back.
pub fn install(cfg: &CaptureConfig) -> anyhow::Result<()> {
    for family in families(cfg) {
        if chain_exists(family, "nat", "ISTIO_OUTPUT") {
            bail!(
                "{}: chain ISTIO_OUTPUT already exists in this network namespace's nat table: \
                 capture is already installed (run `shunt capture --cleanup` first)",
                family.tool()
            );
        }
    }
    let plan = plan::plan(cfg);
    let applied = (|| -> anyhow::Result<()> {
        for family in families(cfg) {
            restore(family, &plan.restore(family))?;
        }
        for (_, args) in tproxy_routes(cfg) {
            run("ip", &args)?;
        }
        Ok(())
    })();
    if let Err(err) = applied {
        let _ = cleanup(cfg);
        return Err(err.context("nothing left installed"));
    }
    Ok(())
}

fn run(tool: &str, args: &[String]) -> anyhow::Result<()> {
    let out = Command::new(tool)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {tool}"))?;
    if !out.status.success() {
        bail!(
            "{tool} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn restore(family: Family, text: &str) -> anyhow::Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let tool = family.restore_tool();
    let mut child = Command::new(tool)
        .args(["-w", "--noflush"])
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

fn chain_exists(family: Family, table: &str, chain: &str) -> bool {
    ipt(family, table, &["-S", chain])
}

fn ipt(family: Family, table: &str, args: &[&str]) -> bool {
    Command::new(family.tool())
        .args(["-w", "-t", table])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `iptables -t TABLE -S`: the table's chains and rules as `-N` / `-A` lines.
fn list(family: Family, table: &str) -> Vec<String> {
    Command::new(family.tool())
        .args(["-w", "-t", table, "-S"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Removes what `install` writes for this config, then every jump to an ISTIO_ chain
/// and every ISTIO_ chain left in nat, mangle and raw (so `--cleanup` without the
/// install's flags still removes the capture). Returns whether anything was there.
fn cleanup_family(cfg: &CaptureConfig, family: Family) -> anyhow::Result<bool> {
    let mut found = false;
    let plan = plan::plan(&CaptureConfig {
        ipv6: true,
        ..cfg.clone()
    });
    // Rules in built-in chains that do not jump to our chains (-c, -k, TPROXY marks,
    // --drop-invalid): only the config says which.
    for rule in plan.rules(family).iter().rev() {
        if builder::is_built_in(&rule.chain) {
            let mut args = vec!["-D", rule.chain.as_str()];
            args.extend(rule.spec().split_whitespace());
            found |= ipt(family, rule.table, &args);
        }
    }
    for (table, _) in plan::CHAINS {
        let lines = list(family, table);
        for line in &lines {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["-A", chain, .., "-j", target] = words.as_slice()
                && builder::is_built_in(chain)
                && target.starts_with("ISTIO_")
            {
                let mut args = vec!["-D"];
                args.extend(&words[1..]);
                found |= ipt(family, table, &args);
            }
        }
        let ours: Vec<&str> = lines
            .iter()
            .filter_map(|l| l.strip_prefix("-N "))
            .map(str::trim)
            .filter(|c| c.starts_with("ISTIO_"))
            .collect();
        for chain in &ours {
            found = true;
            ipt(family, table, &["-F", chain]);
        }
        for chain in &ours {
            if !ipt(family, table, &["-X", chain]) {
                bail!("{} -t {table}: cannot delete chain {chain}", family.tool());
            }
        }
    }
    let (mark, table) = (
        cfg.tproxy.mark.to_string(),
        cfg.tproxy.route_table.to_string(),
    );
    let f = family.ip_flag();
    while Command::new("ip")
        .args([f, "rule", "del", "fwmark", &mark, "lookup", &table])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        found = true;
    }
    let _ = Command::new("ip")
        .args([f, "route", "flush", "table", &table])
        .stderr(Stdio::null())
        .status();
    Ok(found)
}

pub fn cleanup(cfg: &CaptureConfig) -> anyhow::Result<bool> {
    let v4 = cleanup_family(cfg, Family::V4)?;
    let v6 = cleanup_family(cfg, Family::V6)?;
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
            inbound_tunnel_port: 15008,
            proxy_uid: 1337,
            proxy_gid: 1337,
            proxy_uids: vec![1337],
            proxy_gids: vec![1337],
            mode: InterceptionMode::Redirect,
            tproxy: Tproxy::default(),
            outbound_include: CidrSet::All,
            outbound_exclude: vec![],
            inbound_include: PortSet::All,
            inbound_exclude: vec![15090, 15021, 15020],
            outbound_ports_exclude: vec![],
            outbound_ports_include: vec![],
            kube_virt_interfaces: vec![],
            exclude_interfaces: vec![],
            owner_groups: OwnerGroups::AllExcept(vec![]),
            drop_invalid: false,
            ipv6: true,
            host_ipv4_loopback: default_loopback(),
            sockmap: true,
            dns: Default::default(),
        }
    }

    /// SEEDS.md section 2, rules 6-23, verbatim (whitespace normalised).
    const SEED_RULES: &str = include_str!("../../tests/fixtures/istio-iptables-seed.rules");

    /// The seed's rules come from Istio 1.6-1.14; today's istio-iptables (the goldens)
    /// writes the same chains with three differences, and shunt writes today's:
    /// ISTIO_INBOUND first returns the HBONE tunnel port 15008 (and the proxy's loopback
    /// calls to it are not redirected), OUTPUT jumps for every protocol, and SSH's 22 is
    /// no longer excluded unless `-d` names it.
    #[test]
    fn seed_flags_render_the_seed_rules_as_istio_iptables_writes_them_today() {
        let seed: Vec<String> = SEED_RULES
            .lines()
            .filter(|l| l.starts_with("-A"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|l| l != "-A ISTIO_INBOUND -p tcp --dport 22 -j RETURN")
            .map(|l| {
                l.replace("-A OUTPUT -p tcp -j", "-A OUTPUT -j").replace(
                    "-m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT",
                    "-p tcp ! --dport 15008 -m owner --uid-owner 1337 -j ISTIO_IN_REDIRECT",
                )
            })
            .map(|l| {
                l.replace(
                    "-m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT",
                    "-p tcp ! --dport 15008 -m owner --gid-owner 1337 -j ISTIO_IN_REDIRECT",
                )
            })
            .collect();
        let mut expected = vec!["-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN".to_owned()];
        expected.extend(seed);
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
        assert!(v4.contains(&"-A ISTIO_INBOUND -p tcp --dport 8080 -j ISTIO_IN_REDIRECT".into()));
        let pos = |r: &str| v4.iter().position(|x| x == r).unwrap();
        assert!(
            pos("-A ISTIO_OUTPUT -p udp --dport 3306 -j RETURN")
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
        let off = CaptureConfig { ipv6: false, ..cfg };
        assert!(rules(&off, Family::V6).is_empty());
        assert!(!dry_run(&off).unwrap().contains("ip6tables-restore"));
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
    fn tproxy_renders_mangle_rules_and_its_routes() {
        let cfg = CaptureConfig {
            mode: InterceptionMode::Tproxy,
            tproxy: Tproxy {
                mark: 7,
                route_table: 70,
            },
            ..seed_config()
        };
        let text = dry_run(&cfg).unwrap();
        assert!(
            text.contains("-A ISTIO_TPROXY ! -d 127.0.0.1/32 -p tcp -j TPROXY --tproxy-mark 7/0xffffffff --on-port 15006"),
            "{text}"
        );
        assert!(
            text.contains("# ip -4 rule add fwmark 7 lookup 70"),
            "{text}"
        );
        assert!(
            text.contains("# ip -6 route add local default dev lo table 70"),
            "{text}"
        );
        assert!(!text.contains(
            "-A PREROUTING -p tcp -j ISTIO_INBOUND\n-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT"
        ));
    }

    #[test]
    fn dns_capture_without_resolvers_is_off_as_in_istio_iptables() {
        let cfg = CaptureConfig {
            dns: DnsCapture {
                redirect: true,
                ..Default::default()
            },
            ..seed_config()
        };
        assert!(!dry_run(&cfg).unwrap().contains("ISTIO_OUTPUT_DNS"));
        let all = CaptureConfig {
            dns: DnsCapture {
                redirect: true,
                capture_all: true,
                servers: vec![],
            },
            ..seed_config()
        };
        let v4 = rules(&all, Family::V4);
        assert!(
            v4.contains(
                &"-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j REDIRECT --to-port 15053".into()
            )
        );
        assert!(v4.contains(&"-A ISTIO_INBOUND -p udp --sport 53 -j CT --zone 1".into()));
    }
}
