//! Profile-guided release builds of shunt (`cargo xtask pgo`, `cargo xtask bench http
//! --pgo`).
//!
//! Three steps, as rustc's own PGO guide has them: a release build instrumented with
//! `-Cprofile-generate`, a training load the caller runs through it (the counters are
//! written when the process exits, so it must be stopped with SIGTERM, not killed), and
//! the release build again with `-Cprofile-use` on the merged profile. Each build has
//! its own target dir under `target/pgo/`: RUSTFLAGS differ, and sharing one dir would
//! rebuild every dependency at every switch. The flags apply to the host target only
//! (`--target <host>`), so build scripts and proc macros are neither instrumented nor
//! optimised with a profile they never ran. The profile's file name is its content's
//! hash: a new profile is a new RUSTFLAGS, so cargo rebuilds the dependencies with it
//! instead of keeping code laid out for an old one.

use std::hash::{Hash as _, Hasher as _};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};

use crate::pods::target_dir;

/// The instrumented shunt, and where its runs leave their counters.
pub struct Instrumented {
    pub shunt: PathBuf,
    raw: PathBuf,
}

/// Builds the instrumented shunt, with an empty counter dir.
pub fn instrumented() -> Result<Instrumented> {
    let root = target_dir().join("pgo");
    let raw = root.join("raw");
    if raw.exists() {
        std::fs::remove_dir_all(&raw).with_context(|| format!("clearing {}", raw.display()))?;
    }
    std::fs::create_dir_all(&raw)?;
    let flags = format!("-Cprofile-generate={}", raw.display());
    let shunt = build(&root.join("instrumented"), &flags)?;
    Ok(Instrumented { shunt, raw })
}

impl Instrumented {
    /// Merges what the training runs wrote and builds the optimised shunt from it.
    pub fn optimize(self) -> Result<PathBuf> {
        let root = target_dir().join("pgo");
        let runs: Vec<PathBuf> = std::fs::read_dir(&self.raw)?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "profraw"))
            .collect();
        ensure!(
            !runs.is_empty(),
            "the instrumented shunt wrote no profile into {} (was it stopped with SIGTERM?)",
            self.raw.display()
        );
        let merged = root.join("merged.profdata");
        crate::run_checked(
            Command::new(crate::setup::llvm_profdata()?)
                .arg("merge")
                .arg("-o")
                .arg(&merged)
                .args(&runs),
        )?;
        let bytes = std::fs::read(&merged)?;
        let profile = root.join(format!("shunt-{:016x}.profdata", content_hash(&bytes)));
        std::fs::rename(&merged, &profile)?;
        remove_other_profiles(&root, &profile)?;
        build(
            &root.join("optimized"),
            &format!("-Cprofile-use={}", profile.display()),
        )
    }
}

/// Every training leaves a new profile (13 MB for shunt); only the newest is built from.
fn remove_other_profiles(root: &Path, keep: &Path) -> Result<()> {
    for entry in std::fs::read_dir(root)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path != keep && name.starts_with("shunt-") && name.ends_with(".profdata") {
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    Ok(())
}

/// A cache key, not a checksum: the same bytes give the same name within one toolchain.
fn content_hash(bytes: &[u8]) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// `cargo build --release -p shunt` into `dir` with `rustflags` on the host target.
fn build(dir: &Path, rustflags: &str) -> Result<PathBuf> {
    let host = crate::setup::host_triple()?;
    eprintln!("xtask pgo: building shunt with {rustflags}");
    crate::run_checked(
        crate::cargo()
            .args(["build", "--release", "--bins", "-p", "shunt", "--target"])
            .arg(&host)
            .env("CARGO_TARGET_DIR", dir)
            .env("RUSTFLAGS", rustflags)
            .env_remove("CARGO_ENCODED_RUSTFLAGS"),
    )?;
    let shunt = dir.join(&host).join("release/shunt");
    ensure!(shunt.is_file(), "the build left no {}", shunt.display());
    Ok(shunt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_different_profile_gets_a_different_name() {
        assert_eq!(content_hash(b"abc"), content_hash(b"abc"));
        assert_ne!(content_hash(b"abc"), content_hash(b"abd"));
    }

    #[test]
    fn only_the_newest_profile_is_kept() {
        let root = std::env::temp_dir().join(format!("xtask-pgo-{}", std::process::id()));
        std::fs::create_dir_all(root.join("raw")).unwrap();
        for name in ["shunt-01.profdata", "shunt-02.profdata", "other.profdata"] {
            std::fs::write(root.join(name), b"x").unwrap();
        }
        let result = remove_other_profiles(&root, &root.join("shunt-02.profdata"));
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        std::fs::remove_dir_all(&root).unwrap();
        result.unwrap();
        assert_eq!(left, ["other.profdata", "raw", "shunt-02.profdata"]);
    }
}
