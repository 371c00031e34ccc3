//! `cargo xtask dist`: the shunt users get, the build the benches measure. The
//! profile-guided release build (`cargo xtask pgo`: an instrumented build serves
//! `bench http`'s training load in pods, then the release build with the profile),
//! its debug info split into `shunt.debug` (`objcopy --only-keep-debug`, then
//! `--strip-debug` and a `.gnu_debuglink` naming it, so gdb, perf and debuginfod find
//! it), and `shunt.build.json` saying what was built. Into `target/dist/`, which
//! `deploy/Dockerfile` copies from. `--no-pgo` splits the plain release build instead
//! (no training, no root needed).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use serde_json::json;

use crate::pods::target_dir;

#[derive(clap::Args)]
pub struct DistArgs {
    /// The plain release build (no profile-guided training).
    #[arg(long)]
    no_pgo: bool,
}

pub fn run(args: &DistArgs) -> Result<()> {
    let (built, kind) = if args.no_pgo {
        let bins = crate::pods::Bins::build(true)?;
        (bins.shunt, "release (plain, not profile-guided)")
    } else {
        (
            crate::bench::pgo()?,
            "profile-guided release (cargo xtask pgo)",
        )
    };
    let dir = target_dir().join("dist");
    let shunt = split(&built, &dir)?;
    let stamp = json!({
        "build": format!("{kind}, stripped, debug info in shunt.debug"),
        "from": built.display().to_string(),
        "rustc": rustc_version(),
        "commit": git_head(),
        "bytes": std::fs::metadata(&shunt)?.len(),
        "debug_bytes": std::fs::metadata(dir.join("shunt.debug"))?.len(),
    });
    std::fs::write(
        dir.join("shunt.build.json"),
        serde_json::to_string_pretty(&stamp)? + "\n",
    )?;
    let envoy = crate::setup::envoy().ok().and_then(|e| real_binary(&e));
    println!(
        "xtask dist: {} ({:.1} MB; debug info {:.1} MB in shunt.debug){}",
        shunt.display(),
        stamp["bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
        stamp["debug_bytes"].as_u64().unwrap_or(0) as f64 / 1e6,
        envoy.map_or(String::new(), |(path, bytes)| format!(
            "; Envoy's stripped binary {} is {:.1} MB",
            path.display(),
            bytes as f64 / 1e6
        ))
    );
    Ok(())
}

/// Copies `built` into `dir` as `shunt` without debug info, beside `shunt.debug`; the
/// stripped binary.
pub fn split(built: &Path, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let shunt = dir.join("shunt");
    let debug = dir.join("shunt.debug");
    crate::run_checked(
        Command::new("objcopy")
            .arg("--only-keep-debug")
            .arg(built)
            .arg(&debug),
    )?;
    // The symbol table stays (backtraces and perf name functions without the debug
    // file); DWARF goes. The link is made from `dir`, so it names the file alone.
    crate::run_checked(
        Command::new("objcopy")
            .arg("--strip-debug")
            .arg("--add-gnu-debuglink=shunt.debug")
            .arg(built)
            .arg(&shunt)
            .current_dir(dir),
    )?;
    let sections = Command::new("readelf")
        .args(["-S", "-W"])
        .arg(&shunt)
        .output()
        .context("readelf -S")?;
    let sections = String::from_utf8_lossy(&sections.stdout);
    ensure!(
        sections.contains(".gnu_debuglink") && !sections.contains(".debug_info"),
        "{}: still has debug info or no debug link",
        shunt.display()
    );
    Ok(shunt)
}

/// Envoy's own binary behind the pip package's wrapper script, and its size.
fn real_binary(wrapper: &Path) -> Option<(PathBuf, u64)> {
    let root = wrapper.parent()?.parent()?;
    let bin = root.join("envoy/_bin/envoy");
    let bytes = std::fs::metadata(&bin).ok()?.len();
    Some((bin, bytes))
}

fn rustc_version() -> String {
    Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

fn git_head() -> String {
    Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(crate::workspace_root())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small binary built here with debug info: split, it runs, has no DWARF, and its
    /// debug link names a file that holds the DWARF.
    #[test]
    fn the_split_binary_runs_without_dwarf_and_links_its_debug_file() {
        let dir = std::env::temp_dir().join(format!("xtask-dist-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("hello.rs");
        std::fs::write(&src, "fn main() { println!(\"hello\"); }\n").unwrap();
        let built = dir.join("hello");
        let ok = Command::new("rustc")
            .args(["-g", "-o"])
            .arg(&built)
            .arg(&src)
            .status()
            .unwrap()
            .success();
        assert!(ok, "rustc");
        let out = dir.join("out");
        let shunt = split(&built, &out).unwrap();
        let ran = Command::new(&shunt).output().unwrap();
        let debug_sections = Command::new("readelf")
            .args(["-S", "-W"])
            .arg(out.join("shunt.debug"))
            .output()
            .unwrap();
        let link = Command::new("readelf")
            .args(["--string-dump=.gnu_debuglink"])
            .arg(&shunt)
            .output()
            .unwrap();
        let smaller =
            std::fs::metadata(&shunt).unwrap().len() < std::fs::metadata(&built).unwrap().len();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(String::from_utf8_lossy(&ran.stdout), "hello\n");
        assert!(String::from_utf8_lossy(&debug_sections.stdout).contains(".debug_info"));
        assert!(String::from_utf8_lossy(&link.stdout).contains("shunt.debug"));
        assert!(smaller);
    }
}
