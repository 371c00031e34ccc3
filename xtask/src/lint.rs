//! `cargo xtask lint`: `cargo fmt --all --check`, `cargo clippy --workspace
//! --all-targets -- -D warnings`, and the layer check inside each crate (`layers.rs`).

use anyhow::{Result, bail};

/// Runs the three checks, each even when one before it failed; returns the names of
/// those that failed.
pub fn run_all() -> Vec<&'static str> {
    let mut failed = Vec::new();
    eprintln!("xtask lint: cargo fmt --all --check");
    if let Err(e) = crate::run_checked(crate::cargo().args(["fmt", "--all", "--check"])) {
        eprintln!("xtask lint: fmt: {e:#}");
        failed.push("fmt");
    }
    eprintln!("xtask lint: cargo clippy --workspace --all-targets -- -D warnings");
    if let Err(e) = crate::run_checked(crate::cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])) {
        eprintln!("xtask lint: clippy: {e:#}");
        failed.push("clippy");
    }
    eprintln!("xtask lint: layer check inside each crate");
    match crate::layers::check_all() {
        Ok(reports) => {
            for report in reports {
                if report.problems.is_empty() {
                    eprintln!("xtask lint: layers: {report}");
                } else {
                    eprintln!("{report}");
                    if !failed.contains(&"layers") {
                        failed.push("layers");
                    }
                }
            }
        }
        Err(e) => {
            eprintln!("xtask lint: layers: {e:#}");
            failed.push("layers");
        }
    }
    failed
}

pub fn run() -> Result<()> {
    let failed = run_all();
    if !failed.is_empty() {
        bail!("lint failed: {}", failed.join(", "));
    }
    eprintln!("xtask lint: ok");
    Ok(())
}
