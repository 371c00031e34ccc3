//! shunt's kernel side, the only crate that needs bpf-linker: `build.rs` builds the eBPF
//! programs (`../ebpf`) and this crate embeds them, loads, attaches and pins them.
//!
//! `shunt capture` ([`CaptureArgs`], [`run`]) is istio-init's job. It takes
//! istio-iptables' flags (and environment variables), then installs capture with eBPF
//! or, as a fallback, with istio-iptables' exact iptables rules. It runs inside the
//! pod's network namespace, as istio-init does. `shunt inspect` ([`inspect::InspectArgs`],
//! [`inspect::run`]) shows what capture installed.

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod config;
pub mod ebpf;
pub mod inspect;
pub mod iptables;
pub mod link;
pub mod netns;

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

#[derive(clap::Args, Debug)]
pub struct CaptureArgs {
    /// Port the proxy captures outbound TCP on (istio-iptables -p).
    #[arg(short = 'p', long, env = "PROXY_PORT", default_value = "15001")]
    proxy_port: String,
    /// Port the proxy captures inbound TCP on (-z).
    #[arg(
        short = 'z',
        long,
        env = "PROXY_INBOUND_CAPTURE_PORT",
        default_value = "15006"
    )]
    inbound_capture_port: String,
    /// The proxy's uid: its traffic is not captured (-u).
    #[arg(short = 'u', long, env = "PROXY_UID", default_value_t = 1337)]
    proxy_uid: u32,
    /// The proxy's gid (-g).
    #[arg(short = 'g', long, env = "PROXY_GID", default_value_t = 1337)]
    proxy_gid: u32,
    /// Inbound interception mode (-m).
    #[arg(
        short = 'm',
        long,
        env = "INBOUND_INTERCEPTION_MODE",
        value_enum,
        ignore_case = true,
        default_value = "REDIRECT"
    )]
    inbound_interception_mode: InterceptionMode,
    /// Outbound destinations to capture: '*' or CIDRs, comma-separated (-i).
    #[arg(
        short = 'i',
        long,
        env = "OUTBOUND_IP_RANGES_INCLUDE",
        default_value = "*",
        allow_hyphen_values = true
    )]
    outbound_ip_ranges_include: String,
    /// Outbound destinations never captured: CIDRs (-x).
    #[arg(
        short = 'x',
        long,
        env = "OUTBOUND_IP_RANGES_EXCLUDE",
        default_value = ""
    )]
    outbound_ip_ranges_exclude: String,
    /// Inbound ports to capture: '*' or ports (-b); empty turns inbound capture off.
    #[arg(short = 'b', long, env = "INBOUND_PORTS_INCLUDE", default_value = "*")]
    inbound_ports_include: String,
    /// Inbound ports never captured, with '-b *' (-d). 22 is added as istio-iptables does.
    #[arg(
        short = 'd',
        long,
        env = "INBOUND_PORTS_EXCLUDE",
        default_value = "15090,15021,15020"
    )]
    inbound_ports_exclude: String,
    /// Outbound destination ports never captured (-o).
    #[arg(short = 'o', long, env = "OUTBOUND_PORTS_EXCLUDE", default_value = "")]
    outbound_ports_exclude: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// The pod's cgroup (v2) directory: the eBPF backend attaches there.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Print what would be installed (for iptables, the iptables-restore input) and exit.
    #[arg(long)]
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
    /// Send the pod's DNS (UDP and TCP to its resolvers' port 53) to the DNS proxy on 15053.
    #[arg(long)]
    redirect_dns: bool,
    /// With --redirect-dns: DNS to any address, not only the resolvers in resolv.conf.
    #[arg(long)]
    capture_all_dns: bool,
    /// Where the eBPF maps and links are pinned.
    #[arg(long, env = "SHUNT_BPFFS", default_value = "/sys/fs/bpf/shunt")]
    bpffs: PathBuf,
}

impl CaptureArgs {
    pub fn config(&self) -> anyhow::Result<CaptureConfig> {
        let c = || -> Result<CaptureConfig, String> {
            Ok(CaptureConfig {
                proxy_port: config::parse_port("-p", &self.proxy_port)?,
                inbound_capture_port: config::parse_port("-z", &self.inbound_capture_port)?,
                proxy_uid: self.proxy_uid,
                proxy_gid: self.proxy_gid,
                mode: self.inbound_interception_mode,
                outbound_include: config::parse_cidr_set("-i", &self.outbound_ip_ranges_include)?,
                outbound_exclude: config::parse_cidrs("-x", &self.outbound_ip_ranges_exclude)?,
                inbound_include: config::parse_port_set("-b", &self.inbound_ports_include)?,
                inbound_exclude: config::parse_ports("-d", &self.inbound_ports_exclude)?,
                outbound_ports_exclude: config::parse_ports("-o", &self.outbound_ports_exclude)?,
                sockmap: !self.no_sockmap,
                dns: config::DnsCapture {
                    redirect: self.redirect_dns,
                    capture_all: self.capture_all_dns,
                    servers: if self.redirect_dns {
                        config::resolv_conf_servers(
                            &std::fs::read_to_string(config::RESOLV_CONF).unwrap_or_default(),
                        )
                    } else {
                        Vec::new()
                    },
                },
            })
        };
        c().map_err(|e| anyhow::anyhow!("invalid flag {e}"))
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
    let cgroup = args.checked_cgroup()?;
    if args.cleanup {
        return cleanup(&args);
    }
    if let Some(state) = &args.set_sockmap {
        let pod = ebpf::set_sockmap(&args.bpffs, state == "on")?;
        println!("shunt capture: short-circuit {state} for pod_{}", pod.id);
        return Ok(());
    }
    if args.dry_run {
        let text = match (args.backend, &cgroup) {
            (Backend::Iptables, _) | (Backend::Auto, None) => iptables::dry_run(&cfg)?,
            (Backend::Ebpf | Backend::Auto, cg) => ebpf::plan(&cfg, cg.as_deref(), &args.bpffs)?,
        };
        print!("{text}");
        return Ok(());
    }
    let installed = match (args.backend, cgroup) {
        (Backend::Iptables, _) => install_iptables(&cfg),
        (Backend::Ebpf, None) => {
            bail!("--backend ebpf needs --cgroup (the pod's cgroup v2 directory)")
        }
        (Backend::Ebpf, Some(cg)) => install_ebpf(&cfg, &cg, &args),
        (Backend::Auto, None) => {
            eprintln!(
                "shunt capture: eBPF capture needs --cgroup (the pod's cgroup v2 directory); falling back to iptables"
            );
            install_iptables(&cfg)
        }
        (Backend::Auto, Some(cg)) => match install_ebpf(&cfg, &cg, &args) {
            Ok(()) => Ok(()),
            Err(err) => {
                eprintln!(
                    "shunt capture: eBPF capture unavailable: {err:#}; falling back to iptables"
                );
                install_iptables(&cfg)
            }
        },
    };
    installed?;
    if !netns::add_inbound_passthrough_v6() {
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
        ebpf::pod_dir(&args.bpffs, pod.id).display()
    );
    Ok(())
}

fn install_iptables(cfg: &CaptureConfig) -> anyhow::Result<()> {
    iptables::install(cfg)?;
    println!(
        "shunt capture: iptables capture installed: outbound to :{}, inbound to :{} (nat chains ISTIO_INBOUND, ISTIO_REDIRECT, ISTIO_IN_REDIRECT, ISTIO_OUTPUT)",
        cfg.proxy_port, cfg.inbound_capture_port
    );
    Ok(())
}

fn cleanup(args: &CaptureArgs) -> anyhow::Result<()> {
    let mut removed = Vec::new();
    if matches!(args.backend, Backend::Ebpf | Backend::Auto) && ebpf::cleanup(&args.bpffs)? {
        removed.push("eBPF");
    }
    if matches!(args.backend, Backend::Iptables | Backend::Auto) && iptables::cleanup()? {
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
