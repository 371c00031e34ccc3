//! Named network namespaces (`ip netns add`), `ip` batches, and running code inside a
//! namespace from a dedicated thread (setns affects only the calling thread).

use anyhow::{Context, Result, bail};
use std::{
    fs::{self, File},
    io::{self, Write},
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Mutex,
    thread,
};

pub(crate) const NETNS_RUN_DIR: &str = "/var/run/netns";

/// `ip netns add` bind-mounts /var/run/netns onto itself the first time; serialise
/// add/del inside this process so concurrent tests do not race on that.
static NETNS_LOCK: Mutex<()> = Mutex::new(());

pub(crate) fn path_of(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

pub(crate) fn add(name: &str) -> Result<()> {
    let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    run(Command::new("ip").args(["netns", "add", name]))
}

/// Delete a named netns; a missing one is not an error.
pub(crate) fn delete(name: &str) -> Result<()> {
    let _guard = NETNS_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if fs::symlink_metadata(path_of(name)).is_err() {
        return Ok(());
    }
    run(Command::new("ip").args(["netns", "del", name]))
}

/// Names of all named network namespaces.
pub(crate) fn list() -> Vec<String> {
    fs::read_dir(NETNS_RUN_DIR)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Run `ip [-n NETNS] -batch -` with one command per line (without the leading `ip`).
pub(crate) fn ip_batch(netns: Option<&str>, lines: &[String]) -> Result<()> {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    cmd.args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .context("running `ip` (is iproute2 installed?)")?;
    let script = lines.join("\n") + "\n";
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(script.as_bytes())
        .context("writing to `ip -batch -`")?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "`ip{} -batch -` failed ({}): {}\nbatch was:\n{}",
            netns.map(|ns| format!(" -n {ns}")).unwrap_or_default(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            script.trim_end()
        );
    }
    Ok(())
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Run `f` on a fresh thread that has joined the network namespace at `netns` (e.g.
/// [`crate::Pod::netns_path`]). Sockets `f` creates belong to that namespace, and
/// `/proc/thread-self/net/*` and `/proc/sys/net/*` show it. The calling thread is not
/// affected. A panic in `f` is propagated.
pub fn run_in_netns<R: Send>(netns: &Path, f: impl FnOnce() -> R + Send) -> Result<R> {
    let file = File::open(netns).with_context(|| format!("opening netns {}", netns.display()))?;
    thread::scope(|scope| {
        let handle = scope.spawn(move || -> io::Result<R> {
            // SAFETY: plain syscall on a valid fd; it only changes this thread's netns.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error());
            }
            drop(file);
            Ok(f())
        });
        match handle.join() {
            Ok(r) => r.with_context(|| format!("setns into {}", netns.display())),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Write sysctls (`net.ipv6.conf.all.accept_dad` style keys) inside a netns.
pub(crate) fn set_sysctls(netns: &Path, sysctls: &[(&str, &str)]) -> Result<()> {
    run_in_netns(netns, || -> Result<()> {
        for (key, value) in sysctls {
            let path = format!("/proc/sys/{}", key.replace('.', "/"));
            fs::write(&path, value).with_context(|| format!("writing {value} to {path}"))?;
        }
        Ok(())
    })?
    .with_context(|| format!("setting sysctls in {}", netns.display()))
}
