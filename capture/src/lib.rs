//! shunt's kernel side, the only crate that needs bpf-linker: `build.rs` builds the eBPF
//! programs (`../ebpf`) and this crate embeds them, loads, attaches and pins them.
//!
//! `shunt capture` ([`CaptureArgs`], [`run`]) is istio-init's job. It takes
//! istio-iptables' flags (and environment variables), then installs capture with eBPF
//! or, as a fallback, with istio-iptables' exact iptables rules. It runs inside the
//! pod's network namespace, as istio-init does. `shunt inspect` ([`inspect::InspectArgs`],
//! [`inspect::run`]) shows what capture installed.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod bpffs;
pub mod config;
pub mod ebpf;
pub mod events;
pub mod explain;
pub mod inspect;
pub mod iptables;
pub mod kernel_log;
pub mod link;
pub mod netns;
pub mod node;
pub mod pod_names;
pub mod state;

use std::path::PathBuf;

use anyhow::bail;
use config::{CaptureConfig, InterceptionMode};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// eBPF when the kernel and privileges allow it, else iptables (saying why).
    Auto,
    Ebpf,
    Iptables,
}

/// `shunt capture`'s flags: istio-iptables' own (short flags, long names as aliases,
/// environment variables), so istio-init's command line runs unchanged.
#[derive(clap::Args, Debug)]
pub struct CaptureArgs {
    /// Port the proxy captures outbound TCP on (istio-iptables -p).
    #[arg(
        short = 'p',
        long,
        visible_alias = "envoy-port",
        env = "PROXY_PORT",
        default_value = "15001"
    )]
    proxy_port: String,
    /// Port the proxy captures inbound TCP on (-z).
    #[arg(
        short = 'z',
        long,
        env = "PROXY_INBOUND_CAPTURE_PORT",
        default_value = "15006"
    )]
    inbound_capture_port: String,
    /// The HBONE tunnel port: never captured inbound, nor on the proxy's loopback calls (-e).
    #[arg(
        short = 'e',
        long,
        env = "INBOUND_TUNNEL_PORT",
        default_value = "15008"
    )]
    inbound_tunnel_port: String,
    /// The proxy's uids, comma-separated: their traffic is not captured (-u).
    #[arg(short = 'u', long, env = "PROXY_UID", default_value = "1337")]
    proxy_uid: String,
    /// The proxy's gids (-g); the uids when not given.
    #[arg(short = 'g', long, env = "PROXY_GID")]
    proxy_gid: Option<String>,
    /// Inbound interception mode (-m).
    #[arg(
        short = 'm',
        long,
        visible_alias = "istio-inbound-interception-mode",
        env = "INBOUND_INTERCEPTION_MODE",
        value_enum,
        ignore_case = true,
        default_value = "REDIRECT"
    )]
    inbound_interception_mode: InterceptionMode,
    /// TPROXY mode: the mark diverted packets carry (-t).
    #[arg(
        short = 't',
        long = "istio-inbound-tproxy-mark",
        env = "INBOUND_TPROXY_MARK",
        default_value = "1337"
    )]
    tproxy_mark: String,
    /// TPROXY mode: the routing table that delivers marked packets through lo (-r).
    #[arg(
        short = 'r',
        long = "istio-inbound-tproxy-route-table",
        env = "INBOUND_TPROXY_ROUTE_TABLE",
        default_value = "133"
    )]
    tproxy_route_table: String,
    /// Outbound destinations to capture: '*' or CIDRs, comma-separated (-i).
    #[arg(
        short = 'i',
        long,
        visible_alias = "istio-service-cidr",
        env = "OUTBOUND_IP_RANGES_INCLUDE",
        default_value = "*",
        allow_hyphen_values = true
    )]
    outbound_ip_ranges_include: String,
    /// Outbound destinations never captured: CIDRs (-x).
    #[arg(
        short = 'x',
        long,
        visible_alias = "istio-service-exclude-cidr",
        env = "OUTBOUND_IP_RANGES_EXCLUDE",
        default_value = ""
    )]
    outbound_ip_ranges_exclude: String,
    /// Inbound ports to capture: '*' or ports (-b); empty turns inbound capture off.
    #[arg(
        short = 'b',
        long,
        visible_alias = "istio-inbound-ports",
        env = "INBOUND_PORTS_INCLUDE",
        default_value = "*"
    )]
    inbound_ports_include: String,
    /// Inbound ports never captured, with '-b *' (-d).
    #[arg(
        short = 'd',
        long,
        visible_alias = "istio-local-exclude-ports",
        env = "INBOUND_PORTS_EXCLUDE",
        default_value = "15090,15021,15020"
    )]
    inbound_ports_exclude: String,
    /// Outbound destination ports never captured (-o).
    #[arg(
        short = 'o',
        long,
        visible_alias = "istio-local-outbound-ports-exclude",
        env = "OUTBOUND_PORTS_EXCLUDE",
        default_value = ""
    )]
    outbound_ports_exclude: String,
    /// Outbound destination ports captured whatever the destination (-q).
    #[arg(
        short = 'q',
        long = "istio-outbound-ports",
        env = "ISTIO_OUTBOUND_PORTS",
        default_value = ""
    )]
    outbound_ports_include: String,
    /// Virtual interfaces (KubeVirt) whose inbound traffic counts as outbound (-k).
    #[arg(
        short = 'k',
        long = "kube-virt-interfaces",
        env = "KUBE_VIRT_INTERFACES",
        default_value = ""
    )]
    kube_virt_interfaces: String,
    /// Interfaces never captured, inbound or outbound (-c).
    #[arg(
        short = 'c',
        long = "istio-exclude-interfaces",
        env = "ISTIO_EXCLUDE_INTERFACES",
        default_value = ""
    )]
    exclude_interfaces: String,
    /// Groups (names or gids) whose outbound traffic is captured: '*' or a list.
    #[arg(long, env = "ISTIO_OUTBOUND_OWNER_GROUPS", default_value = "*")]
    outbound_owner_groups: String,
    /// With '*' owner groups: groups whose outbound traffic is not captured.
    #[arg(long, env = "ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", default_value = "")]
    outbound_owner_groups_exclude: String,
    /// The IPv4 loopback CIDR the app's container-to-container traffic uses.
    #[arg(
        long,
        env = "ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR",
        default_value = "127.0.0.1/32"
    )]
    host_ipv4_loopback_cidr: String,
    /// Capture DNS to the agent's 15053 [env REDIRECT_DNS, ISTIO_META_DNS_CAPTURE].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    redirect_dns: Option<String>,
    /// Capture DNS to any server, not only the pod's resolvers [env CAPTURE_ALL_DNS].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    capture_all_dns: Option<String>,
    /// The resolvers whose DNS is captured, IPv4 (default: resolv.conf's nameservers).
    #[arg(long, env = "DNS_SERVERS_V4")]
    dns_servers_v4: Option<String>,
    /// The resolvers whose DNS is captured, IPv6 (default: resolv.conf's nameservers).
    #[arg(long, env = "DNS_SERVERS_V6")]
    dns_servers_v6: Option<String>,
    /// Where the pod's resolvers are read from when no --dns-servers-v4/-v6 is given.
    #[arg(long, default_value = "/etc/resolv.conf")]
    resolv_conf: PathBuf,
    /// Drop conntrack-INVALID packets [env DROP_INVALID, INVALID_DROP].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    drop_invalid: Option<String>,
    /// Install the IPv6 rules too (default true; istio-iptables: the pod's IP family)
    /// [env ENABLE_INBOUND_IPV6].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    enable_inbound_ipv6: Option<String>,
    /// After installing, prove the rules redirect the proxy's traffic [env RUN_VALIDATION].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    run_validation: Option<String>,
    /// Write no rules (capture was set up elsewhere, e.g. by a CNI) [env SKIP_RULE_APPLY].
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    skip_rule_apply: Option<String>,
    /// The original port the validation probe connects to.
    #[arg(long, env = "IPTABLES_PROBE_PORT", default_value = "15002")]
    iptables_probe_port: String,
    /// How long validation waits for its probe (5s, 500ms).
    #[arg(long, env = "PROBE_TIMEOUT", default_value = "5s")]
    probe_timeout: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// The pod's cgroup (v2) directory: the eBPF backend attaches there.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Print what would be installed (for iptables, the iptables-restore input) and exit (-n).
    #[arg(short = 'n', long)]
    dry_run: bool,
    /// Remove everything capture installed in this network namespace.
    #[arg(long)]
    cleanup: bool,
    /// Do not short-circuit local socket pairs through the sockmap (eBPF backend).
    #[arg(long)]
    no_sockmap: bool,
    /// Runtime switch for an installed pod: turn the short-circuit on or off.
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    set_sockmap: Option<String>,
    /// Where the eBPF maps and links are pinned.
    #[arg(long, env = "SHUNT_BPFFS", default_value = "/sys/fs/bpf/shunt")]
    bpffs: PathBuf,
}

/// An istio-iptables boolean: the flag, else the first environment variable set (in
/// istio-iptables' precedence), else `default`. Errors name the flag or variable.
fn setting(flag: &str, cli: &Option<String>, envs: &[&str], default: bool) -> Result<bool, String> {
    if let Some(v) = cli {
        return config::parse_bool(flag, v);
    }
    for env in envs {
        if let Ok(v) = std::env::var(env) {
            return config::parse_bool(&format!("{flag} (env {env})"), &v);
        }
    }
    Ok(default)
}

/// What `shunt capture` does besides the config: istio-iptables' switches.
struct Switches {
    run_validation: bool,
    skip_rule_apply: bool,
    probe_port: u16,
    probe_timeout: std::time::Duration,
}

impl CaptureArgs {
    /// `--cgroup`: in node mode, the pods' common parent the programs attach to.
    pub fn cgroup(&self) -> Option<&std::path::Path> {
        self.cgroup.as_deref()
    }

    /// `--bpffs`: where maps and links are pinned.
    pub fn bpffs(&self) -> &std::path::Path {
        &self.bpffs
    }

    pub fn config(&self) -> anyhow::Result<CaptureConfig> {
        let c = || -> Result<CaptureConfig, String> {
            let uids = config::parse_ids("-u", &self.proxy_uid)?;
            let gids = match &self.proxy_gid {
                Some(g) => config::parse_ids("-g", g)?,
                None => uids.clone(),
            };
            let id = |flag: &str, s: &str| {
                s.trim()
                    .parse::<u32>()
                    .map_err(|_| format!("{flag}: '{s}' is not a number"))
            };
            let redirect = setting(
                "--redirect-dns",
                &self.redirect_dns,
                &["ISTIO_META_DNS_CAPTURE", "REDIRECT_DNS"],
                false,
            )?;
            let capture_all = setting(
                "--capture-all-dns",
                &self.capture_all_dns,
                &["CAPTURE_ALL_DNS"],
                false,
            )?;
            let servers = match (&self.dns_servers_v4, &self.dns_servers_v6) {
                (None, None) if redirect && !capture_all => {
                    let text = std::fs::read_to_string(&self.resolv_conf).map_err(|e| {
                        format!(
                            "--redirect-dns: cannot read {}: {e}",
                            self.resolv_conf.display()
                        )
                    })?;
                    config::resolv_conf_servers(&text)
                }
                (v4, v6) => {
                    let mut servers = Vec::new();
                    for (flag, list, want_v4) in [
                        ("--dns-servers-v4", v4, true),
                        ("--dns-servers-v6", v6, false),
                    ] {
                        for s in list.as_deref().unwrap_or("").split(',').map(str::trim) {
                            if s.is_empty() {
                                continue;
                            }
                            let ip: std::net::IpAddr = s
                                .parse()
                                .map_err(|_| format!("{flag}: '{s}' is not an IP address"))?;
                            if ip.is_ipv4() != want_v4 {
                                return Err(format!("{flag}: '{s}' is of the other IP family"));
                            }
                            servers.push(ip);
                        }
                    }
                    servers
                }
            };
            Ok(CaptureConfig {
                proxy_port: config::parse_port("-p", &self.proxy_port)?,
                inbound_capture_port: config::parse_port("-z", &self.inbound_capture_port)?,
                inbound_tunnel_port: config::parse_port("-e", &self.inbound_tunnel_port)?,
                proxy_uid: uids[0],
                proxy_gid: gids[0],
                proxy_uids: uids,
                proxy_gids: gids,
                mode: self.inbound_interception_mode,
                tproxy: config::Tproxy {
                    mark: id("-t", &self.tproxy_mark)?,
                    route_table: id("-r", &self.tproxy_route_table)?,
                },
                outbound_include: config::parse_cidr_set("-i", &self.outbound_ip_ranges_include)?,
                outbound_exclude: config::parse_cidrs("-x", &self.outbound_ip_ranges_exclude)?,
                inbound_include: config::parse_port_set("-b", &self.inbound_ports_include)?,
                inbound_exclude: config::parse_ports("-d", &self.inbound_ports_exclude)?,
                outbound_ports_exclude: config::parse_ports("-o", &self.outbound_ports_exclude)?,
                outbound_ports_include: config::parse_ports("-q", &self.outbound_ports_include)?,
                kube_virt_interfaces: config::parse_interfaces("-k", &self.kube_virt_interfaces)?,
                exclude_interfaces: config::parse_interfaces("-c", &self.exclude_interfaces)?,
                owner_groups: config::parse_owner_groups(
                    &self.outbound_owner_groups,
                    &self.outbound_owner_groups_exclude,
                )?,
                drop_invalid: setting(
                    "--drop-invalid",
                    &self.drop_invalid,
                    &["INVALID_DROP", "DROP_INVALID"],
                    false,
                )?,
                ipv6: setting(
                    "--enable-inbound-ipv6",
                    &self.enable_inbound_ipv6,
                    &["ENABLE_INBOUND_IPV6"],
                    true,
                )?,
                host_ipv4_loopback: config::parse_loopback_cidr(
                    "--host-ipv4-loopback-cidr",
                    &self.host_ipv4_loopback_cidr,
                )?,
                sockmap: !self.no_sockmap,
                dns: config::DnsCapture {
                    redirect,
                    capture_all,
                    servers,
                },
            })
        };
        c().map_err(|e| anyhow::anyhow!("invalid flag {e}"))
    }

    fn switches(&self) -> anyhow::Result<Switches> {
        let s = || -> Result<Switches, String> {
            Ok(Switches {
                run_validation: setting(
                    "--run-validation",
                    &self.run_validation,
                    &["RUN_VALIDATION"],
                    false,
                )?,
                skip_rule_apply: setting(
                    "--skip-rule-apply",
                    &self.skip_rule_apply,
                    &["SKIP_RULE_APPLY"],
                    false,
                )?,
                probe_port: config::parse_port("--iptables-probe-port", &self.iptables_probe_port)?,
                probe_timeout: config::parse_duration("--probe-timeout", &self.probe_timeout)?,
            })
        };
        s().map_err(|e| anyhow::anyhow!("invalid flag {e}"))
    }

    /// `--cgroup` checked up front: a wrong path is the user's error, never a reason to fall back.
    fn checked_cgroup(&self) -> anyhow::Result<Option<PathBuf>> {
        let Some(cg) = &self.cgroup else {
            return Ok(None);
        };
        netns::check_cgroup2_dir(cg)?;
        Ok(Some(cg.clone()))
    }
}

pub fn run(args: CaptureArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let switches = args.switches()?;
    let cgroup = args.checked_cgroup()?;
    if cfg.dns.redirect && !cfg.dns.active() {
        eprintln!(
            "shunt capture: --redirect-dns is set, but --capture-all-dns is not and there are no DNS servers to capture: DNS capture disabled (as istio-iptables)"
        );
    }
    if args.cleanup {
        return cleanup(&args, &cfg);
    }
    if let Some(state) = &args.set_sockmap {
        let pod = ebpf::set_sockmap(&args.bpffs, state == "on")?;
        println!("shunt capture: short-circuit {state} for pod_{}", pod.id);
        return Ok(());
    }
    // Flags only the iptables rules implement: eBPF refuses them, auto falls back.
    let iptables_only = cfg.iptables_only_flags();
    let ebpf_refusal = (!iptables_only.is_empty()).then(|| {
        format!(
            "the eBPF backend does not implement {}",
            iptables_only.join(", ")
        )
    });
    if let (Backend::Ebpf, Some(why)) = (args.backend, &ebpf_refusal) {
        bail!("--backend ebpf: {why}; use --backend iptables");
    }
    if args.dry_run {
        let text = match (args.backend, &cgroup) {
            (Backend::Iptables, _) | (Backend::Auto, None) => iptables::dry_run(&cfg)?,
            (Backend::Auto, Some(_)) if ebpf_refusal.is_some() => iptables::dry_run(&cfg)?,
            (Backend::Ebpf | Backend::Auto, cg) => ebpf::plan(&cfg, cg.as_deref(), &args.bpffs)?,
        };
        print!("{text}");
        return Ok(());
    }
    if switches.skip_rule_apply {
        println!("shunt capture: --skip-rule-apply: no rules written");
    } else {
        install(&args, &cfg, cgroup, ebpf_refusal)?;
    }
    if switches.run_validation {
        iptables::validation::run(&cfg, switches.probe_port, switches.probe_timeout)?;
        println!(
            "shunt capture: validation passed: the proxy's connection to 127.0.0.6:{} arrived redirected",
            switches.probe_port
        );
    }
    Ok(())
}

fn install(
    args: &CaptureArgs,
    cfg: &CaptureConfig,
    cgroup: Option<PathBuf>,
    ebpf_refusal: Option<String>,
) -> anyhow::Result<()> {
    let installed = match (args.backend, cgroup) {
        (Backend::Iptables, _) => install_iptables(cfg),
        (Backend::Ebpf, None) => {
            bail!("--backend ebpf needs --cgroup (the pod's cgroup v2 directory)")
        }
        (Backend::Ebpf, Some(cg)) => install_ebpf(cfg, &cg, args),
        (Backend::Auto, None) => {
            eprintln!(
                "shunt capture: eBPF capture needs --cgroup (the pod's cgroup v2 directory); falling back to iptables"
            );
            install_iptables(cfg)
        }
        (Backend::Auto, Some(_)) if ebpf_refusal.is_some() => {
            eprintln!(
                "shunt capture: {}; falling back to iptables",
                ebpf_refusal.unwrap_or_default()
            );
            install_iptables(cfg)
        }
        (Backend::Auto, Some(cg)) => match install_ebpf(cfg, &cg, args) {
            Ok(()) => Ok(()),
            Err(err) => {
                eprintln!(
                    "shunt capture: eBPF capture unavailable: {err:#}; falling back to iptables"
                );
                install_iptables(cfg)
            }
        },
    };
    installed?;
    if cfg.ipv6 && !netns::add_inbound_passthrough_v6() {
        eprintln!("shunt capture: IPv6 is off in this network namespace; IPv4 only");
    }
    Ok(())
}

fn install_ebpf(
    cfg: &CaptureConfig,
    cgroup: &std::path::Path,
    args: &CaptureArgs,
) -> anyhow::Result<()> {
    let pod = ebpf::install(cfg, cgroup, &args.bpffs)?;
    let addrs: Vec<String> = pod.addresses.iter().map(ToString::to_string).collect();
    let mode = match cfg.mode {
        InterceptionMode::Redirect => "REDIRECT",
        InterceptionMode::Tproxy => "TPROXY",
    };
    println!(
        "shunt capture: eBPF capture installed for pod_{} [{}]: outbound to :{}, inbound to :{} ({mode}; sk_lookup keeps the original destination); short-circuit {}; cgroup {}; pinned under {}",
        pod.id,
        addrs.join(", "),
        cfg.proxy_port,
        cfg.inbound_capture_port,
        if cfg.sockmap { "on" } else { "off" },
        cgroup.display(),
        bpffs::pod_dir(&args.bpffs, pod.id).display()
    );
    Ok(())
}

fn install_iptables(cfg: &CaptureConfig) -> anyhow::Result<()> {
    iptables::install(cfg)?;
    let mut tables = vec!["nat"];
    if cfg.mode == InterceptionMode::Tproxy || cfg.drop_invalid {
        tables.push("mangle");
    }
    if cfg.dns.active() {
        tables.push("raw");
    }
    println!(
        "shunt capture: iptables capture installed ({}; tables {}): outbound to :{}, inbound to :{}{}",
        if cfg.ipv6 {
            "IPv4 and IPv6"
        } else {
            "IPv4 only"
        },
        tables.join(", "),
        cfg.proxy_port,
        cfg.inbound_capture_port,
        if cfg.dns.active() {
            format!(", DNS to :{}", config::DNS_PROXY_PORT)
        } else {
            String::new()
        }
    );
    Ok(())
}

fn cleanup(args: &CaptureArgs, cfg: &CaptureConfig) -> anyhow::Result<()> {
    let mut removed = Vec::new();
    if matches!(args.backend, Backend::Ebpf | Backend::Auto) && ebpf::cleanup(&args.bpffs)? {
        removed.push("eBPF");
    }
    if matches!(args.backend, Backend::Iptables | Backend::Auto) && iptables::cleanup(cfg)? {
        removed.push("iptables");
    }
    netns::remove_inbound_passthrough_v6();
    if removed.is_empty() {
        println!("shunt capture: nothing to clean up in this network namespace");
    } else {
        println!("shunt capture: removed {} capture", removed.join(" and "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shunt_common::flags;

    /// The configuration `shunt capture FLAGS` makes.
    fn config(flags: &[&str]) -> CaptureConfig {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: super::CaptureArgs,
        }
        let argv = std::iter::once("capture").chain(flags.iter().copied());
        <Cli as clap::Parser>::parse_from(argv)
            .args
            .config()
            .unwrap()
    }

    #[test]
    fn dns_capture_sets_its_flags_and_attaches_its_programs_only_when_asked() {
        let pod = ebpf::PodIdentity {
            id: 7,
            netns_cookie: 1,
            addresses: vec![],
        };
        let dns_programs = |cfg: &CaptureConfig| {
            ebpf::cgroup_programs(cfg)
                .iter()
                .filter(|(name, _)| name.contains("dns"))
                .count()
        };
        let off = config(&["--capture-all-dns"]);
        assert_eq!(
            ebpf::pod_config(&off, &pod, 0).flags & (flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL),
            0
        );
        assert_eq!(dns_programs(&off), 0);
        let on = config(&["--redirect-dns"]);
        assert_eq!(
            ebpf::pod_config(&on, &pod, 0).flags & (flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL),
            flags::DNS_REDIRECT
        );
        assert_eq!(dns_programs(&on), 4);
        let all = config(&["--redirect-dns", "--capture-all-dns"]);
        assert_eq!(
            ebpf::pod_config(&all, &pod, 0).flags & (flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL),
            flags::DNS_REDIRECT | flags::DNS_CAPTURE_ALL
        );
    }
}
