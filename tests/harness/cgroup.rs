//! cgroup v2 helpers.

use anyhow::{Context, Result};
use std::{
    fs, io,
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

/// Directory under the cgroup2 mount that holds one directory per [`crate::Node`].
pub(crate) const ROOT_DIR: &str = "shunt-test";

/// Where the cgroup2 filesystem is mounted, found by parsing `/proc/self/mountinfo`
/// (hybrid hosts mount it at e.g. `/sys/fs/cgroup/unified`, pure v2 hosts at
/// `/sys/fs/cgroup`). Prefers a mount of the hierarchy's root.
pub fn cgroup2_mount() -> Result<PathBuf> {
    let text =
        fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    parse_cgroup2_mount(&text).context(
        "no cgroup2 filesystem in /proc/self/mountinfo (running under `ip netns exec`, \
         which remounts /sys? join namespaces with setns or `nsenter --net=` instead)",
    )
}

fn parse_cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    let mut fallback = None;
    for line in mountinfo.lines() {
        // "<id> <parent> <maj:min> <root> <mount point> <opts> [optional...] - <fstype> <source> <super opts>"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        if right.split_whitespace().next() != Some("cgroup2") {
            continue;
        }
        let fields: Vec<&str> = left.split_whitespace().collect();
        if fields.len() < 5 {
            continue;
        }
        let path = PathBuf::from(unescape_octal(fields[4]));
        if fields[3] == "/" {
            return Some(path);
        }
        fallback.get_or_insert(path);
    }
    fallback
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 4 <= bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// SIGKILL every process in the cgroup subtree at `dir`.
pub(crate) fn kill_all(dir: &Path) {
    // cgroup.kill (Linux 5.14+) kills the whole subtree, including processes that are
    // not our children.
    if fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    kill_listed(dir);
}

fn kill_listed(dir: &Path) {
    if let Ok(procs) = fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs
            .lines()
            .filter_map(|l| l.trim().parse::<libc::pid_t>().ok())
        {
            // SAFETY: plain syscall.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                kill_listed(&entry.path());
            }
        }
    }
}

/// Kill everything in the subtree at `dir`, then remove it (children first). A cgroup
/// stays busy for a moment after its last process is killed, so EBUSY is retried until
/// `timeout`.
pub(crate) fn remove_tree(dir: &Path, timeout: Duration) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    kill_all(dir);
    remove_dirs(dir, Instant::now() + timeout)
}

fn remove_dirs(dir: &Path, deadline: Instant) -> Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_dirs(&entry.path(), deadline)?;
        }
    }
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                kill_all(dir);
                thread::sleep(Duration::from_millis(10));
            }
            Err(e) => {
                let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                return Err(e).with_context(|| {
                    format!(
                        "removing cgroup {} (processes still in it: {:?})",
                        dir.display(),
                        procs.split_whitespace().collect::<Vec<_>>()
                    )
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cgroup2_in_hybrid_layout() {
        let mi = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
";
        assert_eq!(
            parse_cgroup2_mount(mi),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn prefers_root_of_hierarchy_and_unescapes() {
        let mi = "\
50 23 0:38 /sub /mnt/sub rw - cgroup2 cgroup2 rw
51 23 0:38 / /mnt/with\\040space rw - cgroup2 cgroup2 rw
";
        assert_eq!(
            parse_cgroup2_mount(mi),
            Some(PathBuf::from("/mnt/with space"))
        );
        assert_eq!(
            parse_cgroup2_mount("1 2 0:3 / /x rw - ext4 /dev/sda rw\n"),
            None
        );
    }
}
