//! Dropping root once the listeners are bound.
//!
//! Capture (iptables' `--uid-owner 1337`, or the eBPF programs' uid/gid check) lets the
//! proxy's own upstream connections out uncaptured only because they come from uid or
//! gid 1337: running as anything else would send every passthrough back into 15001.

use anyhow::{Context, bail};

/// Whether the process runs as root (effective uid 0).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Drops every group, then the gid, then the uid, for good (real, effective and saved).
///
/// The admin API's thread already runs by now: these are glibc's setgroups/setgid/setuid
/// (not the raw per-thread syscalls), which apply to every thread of the process.
pub fn drop_to(uid: u32, gid: u32) -> anyhow::Result<()> {
    use nix::unistd::{Gid, Uid, setgid, setgroups, setuid};
    setgroups(&[]).context("setgroups([])")?;
    setgid(Gid::from_raw(gid)).with_context(|| format!("setgid({gid})"))?;
    setuid(Uid::from_raw(uid)).with_context(|| format!("setuid({uid})"))?;
    // Expected to fail: a uid that can become root again has not dropped anything.
    if uid != 0 && setuid(Uid::from_raw(0)).is_ok() {
        bail!("setuid({uid}) left a way back to root");
    }
    Ok(())
}

/// Raises the soft open-files limit to the hard one, as ztunnel does: each proxied
/// connection holds two sockets, so the usual soft limit of 1024 caps a proxy at ~500.
pub fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!("cannot raise the open files limit: {err}");
    }
}
