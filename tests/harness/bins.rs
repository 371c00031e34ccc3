//! Locating the binaries the tests run: `shunt` and `testapp`.

use anyhow::{Result, bail, ensure};
use std::{env, path::PathBuf};

/// The `shunt` binary: `$SHUNT_BIN`, else `shunt` next to the running executable or in
/// its parent directory. Panics with a hint to `cargo build -p shunt` when missing.
pub fn shunt_bin() -> PathBuf {
    try_shunt_bin().unwrap_or_else(|e| panic!("{e:#}"))
}

/// The `testapp` binary: `$TESTAPP_BIN`, else `testapp` next to the running executable
/// or in its parent directory. Panics with a build hint when missing.
pub fn testapp_bin() -> PathBuf {
    try_testapp_bin().unwrap_or_else(|e| panic!("{e:#}"))
}

/// Like [`shunt_bin`], but returns the error instead of panicking.
pub fn try_shunt_bin() -> Result<PathBuf> {
    find_bin("shunt", "SHUNT_BIN", "cargo build -p shunt")
}

/// Like [`testapp_bin`], but returns the error instead of panicking.
pub fn try_testapp_bin() -> Result<PathBuf> {
    find_bin(
        "testapp",
        "TESTAPP_BIN",
        "cargo build -p shunt-tests --bin testapp",
    )
}

fn find_bin(name: &str, env_var: &str, build_hint: &str) -> Result<PathBuf> {
    if let Some(path) = env::var_os(env_var) {
        let path = PathBuf::from(path);
        ensure!(
            path.is_file(),
            "${env_var} is set to {}, which is not a file",
            path.display()
        );
        return Ok(path);
    }
    // Tests run from target/<profile>/deps/, xtask and the binaries themselves from
    // target/<profile>/: look next to the executable, then one directory up.
    let exe = env::current_exe()?;
    let mut searched = Vec::new();
    let mut dir = exe.parent();
    for _ in 0..2 {
        let Some(d) = dir else { break };
        let candidate = d.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        searched.push(candidate);
        dir = d.parent();
    }
    bail!(
        "the `{name}` binary was not found (looked at {}); build it with `{build_hint}` \
         or set ${env_var} to its path",
        searched
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}
