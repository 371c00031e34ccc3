//! Builds the eBPF programs (`../ebpf`, its own workspace) for `bpf{el,eb}-unknown-none`
//! with `aya-build` and leaves the object at `$OUT_DIR/shunt` (the eBPF crate's binary)
//! for `include_bytes_aligned!`. Needs what `cargo xtask setup` installs: the `rust-src`
//! component and bpf-linker (cached under ~/.cache/shunt/bpf-linker). The stable
//! toolchain builds `core` for the BPF target with `-Z build-std` under RUSTC_BOOTSTRAP=1.
//!
//! Without that toolchain (or with `SHUNT_SKIP_EBPF=1`) the build still succeeds: it says
//! why in a `cargo:warning`, sets `cfg(shunt_no_ebpf)` and the reason in
//! `SHUNT_EBPF_MISSING`, and the eBPF backend then refuses at run time saying so (`auto`
//! falls back to iptables). That keeps `cargo check`, clippy and the proxy's own tests
//! free of the eBPF toolchain.
//!
//! What aya-build (0.2.0) cannot be told, this script arranges around it:
//! - it runs `cargo build --package shunt-ebpf` in the current directory, where our root
//!   workspace (which excludes `ebpf/`) would not find the package: we `cd ../ebpf`;
//! - it finds bpf-linker on PATH only: we put ~/.cache/shunt/bpf-linker/bin (or
//!   `SHUNT_BPF_LINKER_DIR`) first on PATH;
//! - it passes `-Z build-std=core` only on nightly or when RUSTC_BOOTSTRAP is 1: we set it;
//! - it clears RUSTC and RUSTC_WORKSPACE_WRAPPER but not the outer build's other host
//!   settings: we clear RUSTC_WRAPPER, RUSTFLAGS, CARGO_BUILD_TARGET and CARGO_TARGET_DIR;
//! - it forwards the inner cargo's stderr ("Compiling ...") as warnings, which cargo
//!   replays on every build: we make the inner cargo quiet (errors and the eBPF crate's
//!   own compiler warnings still come through).
//!
//! It takes the BPF target's endianness and `bpf_target_arch` from cargo
//! (`CARGO_CFG_TARGET_ENDIAN`, `CARGO_CFG_TARGET_ARCH`) and adds `-Cdebuginfo=2` and
//! `-Clink-arg=--btf`, as the build did before.

use std::{
    env,
    path::{Path, PathBuf},
};

use aya_build::{Package, Toolchain};

/// Set (to 1) to build without the eBPF programs even where bpf-linker is installed.
const SKIP_ENV: &str = "SHUNT_SKIP_EBPF";
/// aya-build's own switch: it then builds nothing, so we must not expect an object.
const AYA_SKIP_ENV: &str = "AYA_BUILD_SKIP";
const LINKER_DIR_ENV: &str = "SHUNT_BPF_LINKER_DIR";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(shunt_no_ebpf)");
    // aya-build watches ../ebpf itself; the shared types live in ../common.
    for input in ["../common/src", "../common/Cargo.toml"] {
        println!("cargo::rerun-if-changed={input}");
    }
    for var in [SKIP_ENV, AYA_SKIP_ENV, LINKER_DIR_ENV] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let linker_dir = linker_dir();
    match missing_toolchain(&linker_dir) {
        Some(reason) => without_ebpf(&reason),
        None => {
            if let Err(err) = build(&linker_dir) {
                // A toolchain that is there but fails is a real error, not a reason to
                // quietly ship a shunt without its programs.
                eprintln!("error building the eBPF programs: {err:#}");
                std::process::exit(1);
            }
        }
    }
}

/// Where `cargo xtask setup` installs bpf-linker, or `SHUNT_BPF_LINKER_DIR`.
fn linker_dir() -> PathBuf {
    env::var_os(LINKER_DIR_ENV)
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cache/shunt/bpf-linker/bin")))
        .unwrap_or_default()
}

fn is_set(var: &str) -> bool {
    env::var(var).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// Why the eBPF programs cannot (or must not) be built here, if they cannot.
fn missing_toolchain(linker_dir: &Path) -> Option<String> {
    if is_set(SKIP_ENV) {
        return Some(format!("{SKIP_ENV}=1 at build time"));
    }
    if is_set(AYA_SKIP_ENV) {
        return Some(format!("{AYA_SKIP_ENV} set at build time"));
    }
    let on_path = env::split_paths(&env::var_os("PATH").unwrap_or_default())
        .any(|dir| dir.join("bpf-linker").is_file());
    let linker = linker_dir.join("bpf-linker");
    if !linker.is_file() && !on_path {
        // No `rerun-if-changed` on the missing bpf-linker: cargo counts a missing path as
        // changed on every build, which would recompile the proxy every time. Instead
        // `cargo xtask setup` touches this script when it installs bpf-linker.
        return Some(format!(
            "bpf-linker missing at build time: neither in {} nor on PATH",
            linker_dir.display()
        ));
    }
    if !rust_src_installed() {
        return Some("the rust-src component missing at build time".into());
    }
    None
}

/// `-Z build-std=core` builds `core` from the toolchain's rust-src component.
fn rust_src_installed() -> bool {
    let rustc = env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let Ok(out) = std::process::Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
    else {
        return false;
    };
    let sysroot = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    sysroot
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .is_file()
}

/// Builds a crate whose eBPF backend refuses at run time, saying why.
fn without_ebpf(reason: &str) {
    println!(
        "cargo::warning=building shunt without its eBPF programs ({reason}); `shunt capture --backend ebpf` will refuse and `auto` will use iptables. `cargo xtask setup` installs the eBPF toolchain (installed by hand: touch capture/build.rs)."
    );
    println!("cargo::rustc-cfg=shunt_no_ebpf");
    println!("cargo::rustc-env=SHUNT_EBPF_MISSING={reason}");
}

fn build(linker_dir: &Path) -> aya_build::Result<()> {
    let path = env::join_paths(
        std::iter::once(linker_dir.to_path_buf())
            .chain(env::split_paths(&env::var_os("PATH").unwrap_or_default())),
    )?;
    // aya-build resolves the package from the current directory; ebpf/ is its own workspace.
    env::set_current_dir("../ebpf")?;
    // SAFETY: a build script is one thread until aya-build spawns its children (which
    // inherit this environment); nothing reads the environment concurrently.
    unsafe {
        env::set_var("PATH", path);
        env::set_var("RUSTC_BOOTSTRAP", "1");
        // aya-build turns every line the inner cargo writes to stderr into a
        // `cargo:warning`, which cargo replays on every build: keep only real messages.
        env::set_var("CARGO_TERM_QUIET", "true");
        // The outer build's compiler settings are for the host, not for BPF.
        for var in [
            "RUSTC_WRAPPER",
            "RUSTFLAGS",
            "CARGO_BUILD_TARGET",
            "CARGO_TARGET_DIR",
        ] {
            env::remove_var(var);
        }
    }
    let toolchain = toolchain();
    aya_build::build_ebpf(
        [Package {
            name: "shunt-ebpf",
            root_dir: "../ebpf",
            ..Default::default()
        }],
        Toolchain::Custom(&toolchain),
    )
}

/// The toolchain this build runs under, for aya-build's `rustup run`: rustup's
/// RUSTUP_TOOLCHAIN, else the toolchain directory `$CARGO` lives in, else stable.
fn toolchain() -> String {
    if let Ok(t) = env::var("RUSTUP_TOOLCHAIN") {
        return t;
    }
    env::var_os("CARGO")
        .map(PathBuf::from)
        .and_then(|cargo| {
            let dir = cargo.parent()?.parent()?;
            (dir.parent()?.file_name()? == "toolchains")
                .then(|| dir.file_name()?.to_str().map(String::from))?
        })
        .unwrap_or_else(|| "stable".into())
}
