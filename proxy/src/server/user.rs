//! Dropping root once the listeners are bound.
//!
//! Capture (iptables' `--uid-owner 1337`, or the eBPF programs' uid/gid check) lets the
//! proxy's own upstream connections out uncaptured only because they come from uid or
//! gid 1337: running as anything else would send every passthrough back into 15001.

use anyhow::{Context, bail};

/// Whether the process runs as root (effective uid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Drops every group, then the gid, then the uid, for good (real, effective and saved).
///
/// Called before any other thread exists; glibc applies set*id to every thread of the
/// process anyway.
pub fn drop_to(uid: u32, gid: u32) -> anyhow::Result<()> {
    // SAFETY: plain syscalls; setgroups reads no memory with a count of 0.
    unsafe {
        check(libc::setgroups(0, std::ptr::null())).context("setgroups([])")?;
        check(libc::setgid(gid)).with_context(|| format!("setgid({gid})"))?;
        check(libc::setuid(uid)).with_context(|| format!("setuid({uid})"))?;
    }
    // SAFETY: as above; setuid(0) is expected to fail.
    if uid != 0 && unsafe { libc::setuid(0) } == 0 {
        bail!("setuid({uid}) left a way back to root");
    }
    Ok(())
}

fn check(rc: libc::c_int) -> std::io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Raises the soft open-files limit to the hard one, as ztunnel does: each proxied
/// connection holds two sockets, so the usual soft limit of 1024 caps a proxy at ~500.
pub fn raise_open_files_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                tracing::warn!(
                    "cannot raise the open files limit: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}
