//! What the machine must have before set-up installs anything: root, a cgroup2 file
//! system, a bpffs (or the right to mount one) and a kernel new enough for the eBPF
//! programs (sk_lookup and the cgroup sock_addr hooks shunt attaches need 5.10). Each
//! missing one is named with what to do, all at once, before a long build starts.

use std::path::Path;

/// The oldest kernel shunt's eBPF capture loads on (sk_lookup: 5.9; the BTF-based
/// programs are tested from 5.10, the oldest LTS with both).
pub const MIN_KERNEL: (u32, u32) = (5, 10);

/// What was found on the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    pub euid: u32,
    /// `uname -r`.
    pub kernel_release: String,
    pub cgroup2: bool,
    /// Whether /sys/fs/bpf is a bpffs already (set-up mounts it when root).
    pub bpffs: bool,
}

impl Facts {
    pub fn of_this_machine() -> Facts {
        Facts {
            // SAFETY: geteuid has no preconditions and cannot fail.
            euid: unsafe { libc::geteuid() },
            kernel_release: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .unwrap_or_default()
                .trim()
                .to_owned(),
            cgroup2: crate::setup::cgroup2_mount().is_some(),
            bpffs: bpffs_mounted(Path::new("/proc/self/mounts")),
        }
    }
}

fn bpffs_mounted(mounts: &Path) -> bool {
    std::fs::read_to_string(mounts).is_ok_and(|m| {
        m.lines().any(|l| {
            let mut f = l.split_whitespace();
            f.nth(1) == Some("/sys/fs/bpf") && f.next() == Some("bpf")
        })
    })
}

/// Every missing prerequisite, each a sentence naming what to do (empty: all there).
pub fn problems(facts: &Facts) -> Vec<String> {
    let mut out = Vec::new();
    if facts.euid != 0 {
        out.push(format!(
            "not root (euid {}): the tests and the demo create network namespaces, cgroups \
             and load eBPF programs; run as root, e.g. `sudo -E cargo xtask ...`",
            facts.euid
        ));
    }
    match kernel_version(&facts.kernel_release) {
        Some(v) if v >= MIN_KERNEL => {}
        Some((major, minor)) => out.push(format!(
            "kernel {major}.{minor} ({}) is too old for the eBPF capture (needs {}.{}: \
             sk_lookup and BTF); boot a newer kernel, or use `--backend iptables` where a \
             command offers it",
            facts.kernel_release, MIN_KERNEL.0, MIN_KERNEL.1
        )),
        None => out.push(format!(
            "cannot read the kernel version from {:?} (/proc/sys/kernel/osrelease); is /proc mounted?",
            facts.kernel_release
        )),
    }
    if !facts.cgroup2 {
        out.push(
            "no cgroup2 file system is mounted (pods are cgroups, the capture attaches to \
             one): mount it with `mount -t cgroup2 none /sys/fs/cgroup` (or boot with \
             systemd.unified_cgroup_hierarchy=1)"
                .into(),
        );
    }
    if !facts.bpffs && facts.euid != 0 {
        out.push(
            "no bpffs at /sys/fs/bpf (the capture pins its programs there) and not root to \
             mount it: `sudo mount -t bpf bpf /sys/fs/bpf`"
                .into(),
        );
    }
    out
}

/// `6.18.44-fc-v595` -> (6, 18).
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Fails naming every missing prerequisite.
pub fn check() -> anyhow::Result<()> {
    let problems = problems(&Facts::of_this_machine());
    if problems.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "this machine is missing what shunt needs:\n  - {}",
        problems.join("\n  - ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready() -> Facts {
        Facts {
            euid: 0,
            kernel_release: "6.18.44-fc-v595".into(),
            cgroup2: true,
            bpffs: true,
        }
    }

    #[test]
    fn a_ready_machine_has_no_problem() {
        assert_eq!(problems(&ready()), Vec::<String>::new());
    }

    #[test]
    fn each_missing_prerequisite_is_named_with_what_to_do() {
        let facts = Facts {
            euid: 1000,
            kernel_release: "5.4.0-150-generic".into(),
            cgroup2: false,
            bpffs: false,
        };
        let p = problems(&facts);
        assert_eq!(p.len(), 4, "{p:#?}");
        assert!(
            p[0].contains("not root") && p[0].contains("sudo"),
            "{}",
            p[0]
        );
        assert!(
            p[1].contains("kernel 5.4") && p[1].contains("5.10"),
            "{}",
            p[1]
        );
        assert!(
            p[2].contains("cgroup2") && p[2].contains("mount -t cgroup2"),
            "{}",
            p[2]
        );
        assert!(p[3].contains("mount -t bpf"), "{}", p[3]);
    }

    #[test]
    fn root_mounts_bpffs_itself() {
        let facts = Facts {
            bpffs: false,
            ..ready()
        };
        assert!(problems(&facts).is_empty());
    }

    #[test]
    fn the_kernel_version_is_compared_as_numbers() {
        assert_eq!(kernel_version("5.10.0"), Some((5, 10)));
        assert_eq!(kernel_version("6.1-rc2"), Some((6, 1)));
        assert_eq!(kernel_version("garbage"), None);
        let old = Facts {
            kernel_release: "5.9.16".into(),
            ..ready()
        };
        assert_eq!(problems(&old).len(), 1);
        let new = Facts {
            kernel_release: "5.10.1".into(),
            ..ready()
        };
        assert!(problems(&new).is_empty());
    }
}
