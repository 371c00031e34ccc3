//! `shunt inspect`: what capture installed, for a person (or `--json` for machines):
//! the pods and their links, the decision counters, live redirected connections.
//! `--follow` streams each decision as the programs take it (`events.rs`),
//! `--explain IP:PORT` says what they would decide (`explain.rs`), `--events on|off`
//! switches the decision events.

use std::{
    io::Write,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::bail;
use shunt_common::pins;

use crate::{
    events::{self, Filter, Reader, Renderer, Switched},
    explain::{self, Question},
    pod_names, state,
};

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Where capture pinned its maps and links.
    #[arg(long, env = "SHUNT_BPFFS", default_value = "/sys/fs/bpf/shunt")]
    bpffs: PathBuf,
    /// JSON instead of text (with --follow: one object a line).
    #[arg(long)]
    json: bool,
    /// Stream each decision the programs take (switching events on for --pod, or
    /// node-wide, until interrupted).
    #[arg(long, conflicts_with_all = ["explain", "events"])]
    follow: bool,
    /// What the programs would decide for a connection to IP:PORT (from --pod as --uid,
    /// and inbound to the pod that owns IP), without making it.
    #[arg(long, value_name = "IP:PORT", conflicts_with = "events")]
    explain: Option<SocketAddr>,
    /// Turn decision events on or off, node-wide or for --pod (they stay as set).
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    events: Option<String>,
    /// A pod: `pod_<id>`, its id, `namespace/name` or a name (repeat for several with
    /// --follow).
    #[arg(long)]
    pod: Vec<String>,
    /// --follow: only decisions about this port (source, destination, or where a
    /// capture sent it).
    #[arg(long, requires = "follow")]
    port: Option<u16>,
    /// --follow: only these decisions (names as in the counters) or outcomes
    /// (`captured`, `passed`, `dropped`, ...), comma-separated.
    #[arg(long, value_delimiter = ',', requires = "follow")]
    decision: Vec<String>,
    /// --explain: the connecting process's uid.
    #[arg(long, default_value_t = 0, requires = "explain")]
    uid: u32,
    /// --explain: its gid (default: the uid).
    #[arg(long, requires = "explain")]
    gid: Option<u32>,
    /// --explain: the address its socket is bound to (127.0.0.6 for rule 15).
    #[arg(long, requires = "explain")]
    src: Option<IpAddr>,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    if args.follow || args.explain.is_some() || args.events.is_some() {
        if !args.bpffs.join(pins::EVENTS).exists() {
            bail!(
                "no eBPF capture with decision events under {} (nothing installed, or installed by an older shunt)",
                args.bpffs.display()
            );
        }
        if args.follow {
            return follow(&args);
        }
        if let Some(target) = args.explain {
            return explain(&args, target);
        }
        return switch(&args);
    }
    show(args)
}

/// `--events on|off [--pod P]`.
fn switch(args: &InspectArgs) -> anyhow::Result<()> {
    let on = args.events.as_deref() == Some("on");
    let root = &args.bpffs;
    if args.pod.is_empty() {
        events::set_node_wide(root, on)?;
        println!(
            "decision events {} node-wide",
            if on { "on" } else { "off" }
        );
    }
    for p in &args.pod {
        let id = pod_names::resolve(root, p)?;
        events::set_pod(root, id, on)?;
        println!(
            "decision events {} for pod_{id}",
            if on { "on" } else { "off" }
        );
    }
    Ok(())
}

fn explain(args: &InspectArgs, target: SocketAddr) -> anyhow::Result<()> {
    if args.pod.len() > 1 {
        bail!("--explain takes one --pod");
    }
    let q = Question {
        target,
        pod: args.pod.first().cloned(),
        uid: args.uid,
        gid: args.gid.unwrap_or(args.uid),
        src: args.src,
    };
    let answer = explain::explain(&args.bpffs, &q)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else {
        print!("{}", answer.text(&q));
    }
    Ok(())
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// `--follow`: events on (for the pods asked, else node-wide), then every record read
/// printed until SIGINT or SIGTERM, then the switches as they were.
fn follow(args: &InspectArgs) -> anyhow::Result<()> {
    let root = args.bpffs.as_path();
    events::check_decisions(&args.decision)?;
    let pods = args
        .pod
        .iter()
        .map(|p| pod_names::resolve(root, p))
        .collect::<anyhow::Result<Vec<u32>>>()?;
    let mut reader = Reader::open(root)?;
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_stop_signal as *const () as libc::sighandler_t) };
    }
    let switched = Switched::on(root, &pods)?;
    let dropped_at_start = events::dropped(root)?;
    eprintln!(
        "shunt inspect: following decision events under {} ({}); interrupt to stop",
        root.display(),
        switched.describe()
    );
    let filter = Filter {
        pods,
        port: args.port,
        decisions: args.decision.clone(),
    };
    let mut printer = Printer {
        renderer: Renderer::new(root),
        filter,
        json: args.json,
        shown: 0,
    };
    let mut drops = Drops {
        at_start: dropped_at_start,
        reported: dropped_at_start,
        checked: Instant::now(),
    };
    while !STOP.load(Ordering::Relaxed) {
        // The programs wake the reader only when the ring fills up: look often.
        let batch = reader.next_batch(Duration::from_millis(50));
        if !printer.print(&batch) {
            break;
        }
        drops.report_new(root, Duration::from_secs(1));
    }
    // What arrived before the switches go back.
    let _ = printer.print(&reader.next_batch(Duration::ZERO));
    drop(switched);
    drops.report_new(root, Duration::ZERO);
    eprintln!(
        "shunt inspect: {} events shown; {} dropped while following",
        printer.shown,
        drops.reported - drops.at_start
    );
    Ok(())
}

struct Printer {
    renderer: Renderer,
    filter: Filter,
    json: bool,
    shown: u64,
}

impl Printer {
    /// Prints the records `filter` keeps; false once stdout is gone.
    fn print(&mut self, batch: &[shunt_common::events::DecisionEvent]) -> bool {
        let mut out = std::io::stdout().lock();
        for e in batch.iter().filter(|e| self.filter.matches(e)) {
            let ev = self.renderer.event(e);
            let line = if self.json {
                serde_json::to_string(&ev).unwrap_or_default()
            } else {
                ev.line()
            };
            if writeln!(out, "{line}").is_err() {
                return false;
            }
            self.shown += 1;
        }
        out.flush().is_ok()
    }
}

/// The ring's drop counter, reported as it grows.
struct Drops {
    at_start: u64,
    reported: u64,
    checked: Instant,
}

impl Drops {
    fn report_new(&mut self, root: &Path, every: Duration) {
        if self.checked.elapsed() < every {
            return;
        }
        self.checked = Instant::now();
        if let Ok(n) = events::dropped(root)
            && n > self.reported
        {
            eprintln!(
                "shunt inspect: {} decision events dropped: the ring was full (the programs never wait for a reader)",
                n - self.reported
            );
            self.reported = n;
        }
    }
}

fn show(args: InspectArgs) -> anyhow::Result<()> {
    let Some(state) = state::state(&args.bpffs)? else {
        if args.json {
            println!("null");
        } else {
            println!("no eBPF capture installed under {}", args.bpffs.display());
        }
        return Ok(());
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&state)?);
        return Ok(());
    }
    println!("eBPF capture under {}", state.bpffs);
    let pods_on: Vec<&str> = state
        .pods
        .iter()
        .filter(|p| p.events)
        .map(|p| p.pod.as_str())
        .collect();
    println!(
        "decision events: {}; {} dropped (ring full) so far",
        match (state.events.node_wide, pods_on.as_slice()) {
            (true, _) => "on node-wide".to_owned(),
            (false, []) => "off".to_owned(),
            (false, pods) => format!("on for {}", pods.join(", ")),
        },
        state.events.dropped
    );
    for pod in &state.pods {
        let name = pod
            .name
            .as_ref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        println!(
            "  {}{name} [{}] outbound :{} inbound :{} proxy uid/gid {}/{}; inbound listener registered: {}",
            pod.pod,
            pod.addresses.join(", "),
            pod.outbound_port,
            pod.inbound_port,
            pod.proxy_uid,
            pod.proxy_gid,
            if pod.inbound_listeners.is_empty() {
                "none".into()
            } else {
                pod.inbound_listeners.join("+")
            }
        );
        for link in &pod.links {
            println!("    {link}");
        }
        let to = shunt_common::DNS_PROXY_PORT;
        match pod.dns_capture {
            "off" => println!("    DNS capture: off"),
            "all" => println!("    DNS capture: port 53 of any address -> :{to}"),
            _ if pod.dns_servers.is_empty() => {
                println!("    DNS capture: on, but the pod has no resolvers")
            }
            _ => println!(
                "    DNS capture: port 53 of {} -> :{to}",
                pod.dns_servers.join(", ")
            ),
        }
        let counts: Vec<String> = pod
            .counters
            .iter()
            .map(|(n, c)| format!("{n} {c}"))
            .collect();
        println!("    decisions: {}", counts.join(", "));
    }
    println!("pinned maps:");
    for m in &state.maps {
        println!(
            "  {:<44} id {:<6} {:<22} max {}",
            m.pin, m.id, m.kind, m.max_entries
        );
    }
    println!("decisions:");
    for (name, n) in state.counters.iter().filter(|(_, n)| *n > 0) {
        println!("  {name:<34} {n}");
    }
    println!(
        "short-circuited sockets now: {} in SOCK_PAIRS, {} with a send state",
        state.sockmap_sockets,
        state.short_circuited.len()
    );
    for p in &state.short_circuited {
        println!("  {} -> {} ({})", p.local, p.remote, p.state);
    }
    println!(
        "redirected connections open now: {}",
        state.connections.len()
    );
    for c in &state.connections {
        println!(
            "  {} {} {} -> {} (original destination {})",
            c.pod, c.direction, c.client, c.proxy_listener, c.original_dst
        );
    }
    Ok(())
}
