//! Builds the eBPF programs (`../ebpf`, its own workspace) for bpfel-unknown-none and
//! leaves the object at `$OUT_DIR/shunt-ebpf.o` for `include_bytes!`. Needs what
//! `cargo xtask setup` installs: the `rust-src` component and bpf-linker (cached under
//! ~/.cache/shunt/bpf-linker). The stable toolchain builds `core` for the BPF target
//! with `-Z build-std` under RUSTC_BOOTSTRAP=1.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

fn main() {
    if let Err(err) = build() {
        eprintln!("error building the eBPF programs: {err}");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    for input in [
        "../ebpf/src",
        "../ebpf/Cargo.toml",
        "../common/src",
        "../common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={input}");
    }
    println!("cargo:rerun-if-env-changed=SHUNT_BPF_LINKER_DIR");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR not set")?);
    let linker_dir = env::var_os("SHUNT_BPF_LINKER_DIR")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| Path::new(&h).join(".cache/shunt/bpf-linker/bin")))
        .unwrap_or_default();
    let mut paths = vec![linker_dir.clone()];
    paths.extend(env::split_paths(&env::var_os("PATH").unwrap_or_default()));
    if !paths.iter().any(|dir| dir.join("bpf-linker").exists()) {
        return Err(format!(
            "bpf-linker is neither in {} nor on PATH: run `cargo xtask setup`",
            linker_dir.display()
        ));
    }
    let target_dir = out_dir.join("ebpf-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir("../ebpf")
        .args([
            "build",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("PATH", env::join_paths(paths).map_err(|e| e.to_string())?)
        .env("RUSTC_BOOTSTRAP", "1")
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            [
                "--cfg=bpf_target_arch=\"x86_64\"",
                "-Cdebuginfo=2",
                "-Clink-arg=--btf",
            ]
            .join("\x1f"),
        )
        // The outer build's compiler settings are for the host, not for BPF.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WRAPPER")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if !status.success() {
        return Err(format!("cargo build of ../ebpf failed: {status}"));
    }
    let object = target_dir.join("bpfel-unknown-none/release/shunt");
    std::fs::copy(&object, out_dir.join("shunt-ebpf.o"))
        .map_err(|e| format!("copy {}: {e}", object.display()))?;
    Ok(())
}
