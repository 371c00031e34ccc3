//! `shunt inspect`: what capture installed, for a person (or `--json` for machines):
//! the pods and their links, the decision counters, live redirected connections.

use std::path::PathBuf;

use crate::ebpf;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// Where capture pinned its maps and links.
    #[arg(long, env = "SHUNT_BPFFS", default_value = "/sys/fs/bpf/shunt")]
    bpffs: PathBuf,
    /// One JSON document instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let Some(state) = ebpf::state(&args.bpffs)? else {
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
    for pod in &state.pods {
        println!(
            "  {} [{}] outbound :{} inbound :{} proxy uid/gid {}/{}; inbound listener registered: {}",
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
