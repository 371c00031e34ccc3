//! `nodeserve`: a node process for tests, [`shunt::node::serve::NodePods`] with eBPF
//! capture, driven line by line on stdin (enrollment is a separate job, `shunt node`'s;
//! this drives serving alone):
//!
//! ```text
//! add UID NAME NAMESPACE NETNS_PATH [IP ...]   -> @added UID MICROS | @error UID MESSAGE
//! remove UID                                   -> @removed UID
//! served                                       -> @served UID,UID,...
//! rss                                          -> @rss KIB
//! ready UID                                    -> @ready UID true|false
//! await-ready UID                              -> @ready UID true|false WALL_US CPU_US
//!     (waits up to 60 s; the wall time and this process's CPU time since the pod's
//!     `add` started)
//! stat UID NAME                                -> @stat UID VALUE (the pod's proxy's counter)
//! interned                                     -> @interned DECODED CLUSTERS ROUTES (what
//!     this process holds once for every pod that has it: decoded xDS resources,
//!     compiled clusters, compiled route configurations)
//! clusters UID                                 -> @clusters UID NAME=VERSION:DIGEST,...
//!     (the pod's config_dump clusters, static and dynamic; DIGEST of the cluster's bytes)
//! handover PATH                                -> @handed-over N (once a new process took them)
//! ```
//!
//! `--take-over PATH` starts by taking every pod from the process handing over at PATH.
//! `--config FILE` gives each pod a proxy of its own from the control plane FILE names
//! (with `--ca-addr`, `--ca-root`, `--ca-token`: a certificate per service account); an
//! `add` line may then carry `sa=ACCOUNT` (and `token=PATH`, the account's own token)
//! among its addresses. `--dns-resolv-conf FILE` gives each pod a DNS proxy on its
//! loopback 15053 forwarding to FILE's servers, or to an `add` line's `dns=IP`s.
//!
//! Replies start with `@`; every other stdout line is an access log entry (JSON). The
//! process joins `--join-cgroup` before opening any socket (its sockets must be under
//! the cgroup the capture programs are attached to) and captures with `--bpffs` /
//! `--cgroup` unless `--no-capture`. Capture flags are `shunt capture`'s.

use std::io::{BufRead, Write};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use shunt::node::serve::capture::{EbpfCapture, FailurePolicy, NodeCapture, Policies};
use shunt::node::serve::dns::DnsOptions;
use shunt::node::serve::proxy::{CaTemplate, Template};
use shunt::node::serve::{NodeOptions, NodePods, PodCapture};
use shunt::node::{PodDns, PodInfo, Pods};

#[derive(Parser)]
struct Args {
    /// A cgroup v2 directory to move this process into first (created if missing).
    #[arg(long)]
    join_cgroup: Option<PathBuf>,
    /// Serve without capture (listeners only).
    #[arg(long)]
    no_capture: bool,
    /// The policy of every pod.
    #[arg(long, value_enum, default_value = "fail-closed")]
    failure_policy: FailurePolicy,
    #[arg(long, default_value_t = 5)]
    drain_time_s: u64,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Take every pod from an old process handing over at this Unix socket.
    #[arg(long)]
    take_over: Option<PathBuf>,
    /// The pods' bootstrap template (per-pod proxies from the control plane).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The mesh CA for the pods' certificates (host:port).
    #[arg(long)]
    ca_addr: Option<String>,
    #[arg(long)]
    ca_root: Option<PathBuf>,
    #[arg(long)]
    ca_token: Option<PathBuf>,
    /// Same-node mTLS connections go over the network instead of being handed over in
    /// process.
    #[arg(long)]
    no_fast_path: bool,
    /// Each pod gets a DNS proxy; pods enrolled without `dns=` forward to this file's
    /// nameservers.
    #[arg(long)]
    dns_resolv_conf: Option<PathBuf>,
    #[command(flatten)]
    capture: shunt_capture::CaptureArgs,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    if let Some(dir) = &args.join_cgroup {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("cgroup.procs"), std::process::id().to_string())?;
    }
    let capture: Option<Box<dyn PodCapture>> = if args.no_capture {
        None
    } else {
        // `shunt capture`'s --bpffs and --cgroup: the pods' parent cgroup, which holds
        // this process too.
        let root = args.capture.bpffs();
        let cgroup = args.capture.cgroup().expect("--cgroup");
        let capture = NodeCapture::open(args.capture.config()?, cgroup, root)?;
        Some(Box::new(EbpfCapture {
            capture,
            policies: Policies {
                default: args.failure_policy,
                fail_open_namespaces: Vec::new(),
            },
        }))
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    shunt::event::workers::start(None, args.workers.max(1), shunt::memory::cache_this_thread)?;
    let options = NodeOptions {
        drain_time: Duration::from_secs(args.drain_time_s),
        fast_path: !args.no_fast_path,
        dns: args.dns_resolv_conf.clone().map(|resolv_conf| DnsOptions {
            resolv_conf,
            ..DnsOptions::default()
        }),
        ..NodeOptions::default()
    };
    let mut pods = NodePods::new(options, runtime.handle().clone(), capture);
    if let Some(config) = &args.config {
        let ca = args.ca_addr.as_ref().map(|address| CaTemplate {
            address: address.clone(),
            server_name: None,
            root_cert: args.ca_root.clone().expect("--ca-root with --ca-addr"),
            token_path: args.ca_token.clone().expect("--ca-token with --ca-addr"),
            trust_domain: "cluster.local".into(),
        });
        pods = pods.with_config(Template::load(config, ca)?);
    }
    let pods = Arc::new(pods);
    if let Some(path) = &args.take_over {
        let n = shunt::node::serve::handover::take_over(&pods, path)?.pods;
        reply(&format!("took {n}"));
    }
    reply("ready");
    // When each pod's `add` started: wall clock and this process's CPU clock.
    let mut added: std::collections::HashMap<String, (Instant, Duration)> = Default::default();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["add", uid, name, namespace, netns, ips @ ..] => {
                let started = Instant::now();
                added.insert(uid.to_string(), (started, process_cpu()));
                let result = std::fs::File::open(netns)
                    .map_err(|e| format!("opening {netns}: {e}"))
                    .and_then(|f| {
                        let pod = PodInfo {
                            uid: uid.to_string(),
                            name: name.to_string(),
                            namespace: namespace.to_string(),
                            container_id: format!("sandbox-{uid}"),
                            netns_path: Some(netns.into()),
                            ips: ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
                            service_account: ips
                                .iter()
                                .find_map(|w| w.strip_prefix("sa="))
                                .map(str::to_owned),
                            dns: {
                                let servers: Vec<_> = ips
                                    .iter()
                                    .filter_map(|w| w.strip_prefix("dns=")?.parse().ok())
                                    .collect();
                                (!servers.is_empty()).then(|| PodDns {
                                    servers,
                                    searches: Vec::new(),
                                })
                            },
                            token_path: ips
                                .iter()
                                .find_map(|w| w.strip_prefix("token="))
                                .map(PathBuf::from),
                        };
                        pods.add(pod, OwnedFd::from(f)).map_err(|e| e.to_string())
                    });
                match result {
                    Ok(()) => reply(&format!("added {uid} {}", started.elapsed().as_micros())),
                    Err(err) => reply(&format!("error {uid} {err}")),
                }
            }
            ["remove", uid] => {
                pods.remove(uid);
                reply(&format!("removed {uid}"));
            }
            ["served"] => {
                let uids: Vec<String> = pods.served().into_iter().map(|p| p.uid).collect();
                reply(&format!("served {}", uids.join(",")));
            }
            ["rss"] => reply(&format!("rss {}", rss_kib())),
            ["ready", uid] => {
                let ready = pods
                    .summaries()
                    .iter()
                    .any(|s| s.info.uid == *uid && s.ready);
                reply(&format!("ready {uid} {ready}"));
            }
            ["await-ready", uid] => {
                let deadline = Instant::now() + Duration::from_secs(60);
                // A cheap check every millisecond: this process's CPU is what is measured.
                let is_ready = || pods.ready(uid);
                while !is_ready() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let (wall, cpu) = match added.get(*uid) {
                    Some((at, cpu)) => (at.elapsed(), process_cpu().saturating_sub(*cpu)),
                    None => (Duration::ZERO, Duration::ZERO),
                };
                reply(&format!(
                    "ready {uid} {} {} {}",
                    is_ready(),
                    wall.as_micros(),
                    cpu.as_micros()
                ));
            }
            ["stat", uid, name] => {
                let value = pods
                    .proxy_stats(uid)
                    .map(|stats| stats.counter(name).value());
                match value {
                    Some(v) => reply(&format!("stat {uid} {v}")),
                    None => reply(&format!("error {uid} no proxy stats")),
                }
            }
            ["stats-under", uid, prefix] => match pods.proxy_stats(uid) {
                Some(stats) => {
                    let all = stats.snapshot();
                    let under = all.iter().filter(|s| s.name.starts_with(prefix));
                    reply(&format!("stats-under {uid} {}", under.count()));
                }
                None => reply(&format!("error {uid} no proxy stats")),
            },
            ["interned"] => reply(&format!(
                "interned {} {} {}",
                shunt::xds::interned_resources(),
                shunt::upstream::compile::shared_clusters(),
                shunt::snapshot::shared_route_configs(),
            )),
            ["clusters", uid] => match pods.proxy_resources(uid) {
                Some(resources) => {
                    let clusters: Vec<String> = resources
                        .clusters
                        .iter()
                        .map(|c| {
                            let mut hasher = std::collections::hash_map::DefaultHasher::new();
                            std::hash::Hash::hash(
                                &prost::Message::encode_to_vec(&c.resource),
                                &mut hasher,
                            );
                            let version = c.version_info.as_deref().unwrap_or("static");
                            let digest = std::hash::Hasher::finish(&hasher);
                            format!("{}={version}:{digest:x}", c.resource.name)
                        })
                        .collect();
                    reply(&format!("clusters {uid} {}", clusters.join(",")));
                }
                None => reply(&format!("error {uid} no proxy config")),
            },
            ["handover", path] => {
                let (pods, path) = (pods.clone(), PathBuf::from(path));
                std::thread::spawn(move || {
                    match shunt::node::serve::handover::hand_over_once(&pods, &path) {
                        Ok(n) => reply(&format!("handed-over {n}")),
                        Err(err) => reply(&format!("error - handover: {err:#}")),
                    }
                });
            }
            _ => reply(&format!("error - unknown command {line:?}")),
        }
    }
    Ok(())
}

fn reply(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "@{text}");
    let _ = out.flush();
}

/// The CPU time of this process so far, every thread's.
fn process_cpu() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to write.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) } == 0;
    if !ok {
        return Duration::ZERO;
    }
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}
