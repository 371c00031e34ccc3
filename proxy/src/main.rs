//! `shunt`: an eBPF-accelerated transparent proxy for service meshes.
//!
//! `shunt capture` replaces istio-init (eBPF, or istio-iptables' exact rules as the
//! fallback); `shunt proxy` is the proxy that captured traffic lands in.

use clap::{Parser, Subcommand};
use shunt_capture::{self as capture, inspect};

#[derive(Parser)]
#[command(name = "shunt", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install (or remove) traffic capture in the current network namespace, as istio-init.
    // Boxed: istio-iptables has many flags.
    Capture(Box<capture::CaptureArgs>),
    /// Run the proxy: outbound (15001) and inbound (15006) listeners.
    // Boxed: it takes Envoy's command line.
    Proxy(Box<shunt::server::ProxyArgs>),
    /// pilot-agent's role: the proxy (in process, or a supervised Envoy), the status
    /// server (15020/15021), app probes, merged metrics and the drain on SIGTERM.
    Agent(Box<shunt::server::agent::AgentArgs>),
    /// Show what capture installed: pods, links, decision counters, live redirections.
    Inspect(inspect::InspectArgs),
    /// Node mode: one privileged process enrolling and serving every pod of the node
    /// (the DaemonSet); `install-cni` / `uninstall-cni` set up the `shunt-cni` plugin.
    Node(Box<shunt::server::node::NodeArgs>),
}

// glibc's malloc behind a per-thread cache of freed blocks (`memory`).
#[global_allocator]
static ALLOCATOR: shunt::memory::CachingMalloc = shunt::memory::CachingMalloc;

fn main() -> std::process::ExitCode {
    // Installed as `shunt-cni`, the binary is a CNI plugin: the runtime gives it no
    // arguments, only `CNI_*` variables and the network configuration on stdin.
    let argv0 = std::env::args_os().next().unwrap_or_default();
    if std::path::Path::new(&argv0)
        .file_name()
        .is_some_and(|name| name == shunt::node::cni::install::PLUGIN_TYPE)
    {
        return shunt::node::cni::plugin::main();
    }
    // glibc's fastbins are merged whenever a block over 1 KiB is asked for, and every
    // request asks for some (its future): without fastbins, small blocks come from the
    // per-thread cache and nothing is merged on the way.
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes allocator parameters, before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MXFAST, 0);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Capture(args) => capture::run(*args),
        Command::Proxy(args) => shunt::server::run(*args),
        Command::Agent(args) => shunt::server::agent::run(*args),
        Command::Inspect(args) => inspect::run(args),
        Command::Node(args) => shunt::server::node::run(*args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("shunt: error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
