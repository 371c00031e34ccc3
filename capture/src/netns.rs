//! Facts about the network namespace `shunt capture` runs in (the pod's), and the
//! kernel file systems it needs.

use std::{
    io,
    net::IpAddr,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    path::Path,
};

use rustix::{
    fs::statfs,
    mount::{MountFlags, mount},
    net::{AddressFamily, SocketFlags, SocketType, socket_with},
};

/// `SO_NETNS_COOKIE` (Linux 5.14), which neither libc's constants for every target nor
/// rustix's typed socket options cover.
const SO_NETNS_COOKIE: libc::c_int = 71;
const BPF_FS_MAGIC: u64 = 0xcafe_4a11;
const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;

/// The pod's id in the shared maps: its network namespace inode (unique while it lives).
pub fn netns_inode() -> io::Result<u32> {
    // thread-self: a helper thread may have entered a pod's namespace (node mode).
    let ino = std::fs::metadata("/proc/thread-self/ns/net")?.ino();
    u32::try_from(ino).map_err(|_| io::Error::other(format!("netns inode {ino} exceeds 32 bits")))
}

/// The kernel's cookie for the current network namespace (what BPF programs see).
pub fn netns_cookie() -> io::Result<u64> {
    let sock = socket_with(
        AddressFamily::INET,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )?;
    let mut cookie: u64 = 0;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `sock` is an open socket that outlives the call; `cookie` and `len` are
    // live locals, and `len` is exactly the size of the buffer `cookie` provides.
    // (Neither rustix nor nix offers SO_NETNS_COOKIE or a raw getsockopt.)
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Every non-loopback address configured in this namespace: the pod's own addresses.
pub fn pod_addresses() -> io::Result<Vec<IpAddr>> {
    let mut addrs = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs()? {
        let Some(sa) = ifa.address else { continue };
        let ip = if let Some(sin) = sa.as_sockaddr_in() {
            IpAddr::V4(sin.ip())
        } else if let Some(sin6) = sa.as_sockaddr_in6() {
            IpAddr::V6(sin6.ip())
        } else {
            continue;
        };
        if !ip.is_loopback() && !addrs.contains(&ip) {
            addrs.push(ip);
        }
    }
    Ok(addrs)
}

/// The file system type (`f_type`) of the file system `path` is on.
fn fs_magic(path: &Path) -> io::Result<u64> {
    // `f_type`'s width and signedness vary by target; every magic is a positive u32.
    let f_type = statfs(path)?.f_type;
    u64::try_from(f_type).map_err(|_| io::Error::other(format!("f_type {f_type} is negative")))
}

/// `--cgroup` must be a cgroup v2 directory; the error says where cgroup2 really is.
pub fn check_cgroup2_dir(path: &Path) -> anyhow::Result<()> {
    if !path.is_dir() {
        anyhow::bail!("--cgroup {}: no such directory", path.display());
    }
    if !fs_magic(path).is_ok_and(|m| m == CGROUP2_SUPER_MAGIC) {
        let hint = cgroup2_mount().map_or("no cgroup2 mount found".into(), |m| {
            format!("cgroup2 is mounted at {}", m.display())
        });
        anyhow::bail!(
            "--cgroup {}: not a cgroup v2 directory ({hint})",
            path.display()
        );
    }
    Ok(())
}

/// Where cgroup v2 is mounted (hybrid layouts put it at /sys/fs/cgroup/unified).
pub fn cgroup2_mount() -> Option<std::path::PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        (post.split_whitespace().next()? == "cgroup2")
            .then(|| pre.split_whitespace().nth(4).map(Into::into))?
    })
}

/// Makes sure `dir`'s parent is a bpffs, mounting one at /sys/fs/bpf if it is absent.
pub fn ensure_bpffs(dir: &Path) -> anyhow::Result<()> {
    let mount_point = Path::new("/sys/fs/bpf");
    let parent = dir.parent().unwrap_or(mount_point);
    if fs_magic(parent).is_ok_and(|m| m == BPF_FS_MAGIC) {
        return Ok(());
    }
    if parent != mount_point {
        anyhow::bail!("{} is not on a bpf file system", parent.display());
    }
    std::fs::create_dir_all(mount_point)?;
    mount("bpf", mount_point, "bpf", MountFlags::empty(), None)
        .map_err(|err| anyhow::anyhow!("no bpffs at /sys/fs/bpf and mounting one failed: {err}"))?;
    Ok(())
}

/// Envoy's IPv6 inbound passthrough binds ::6; like istio-iptables, put it on `lo` so
/// the app's replies to it route back. Returns false when IPv6 is off in this namespace.
pub fn add_inbound_passthrough_v6() -> bool {
    if std::fs::read_to_string("/proc/net/if_inet6").is_err() {
        return false;
    }
    let present = std::process::Command::new("ip")
        .args(["-6", "addr", "show", "dev", "lo"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("inet6 ::6/128"));
    present
        || std::process::Command::new("ip")
            .args(["-6", "addr", "add", "::6/128", "dev", "lo", "nodad"])
            .status()
            .is_ok_and(|s| s.success())
}

pub fn remove_inbound_passthrough_v6() {
    let _ = std::process::Command::new("ip")
        .args(["-6", "addr", "del", "::6/128", "dev", "lo"])
        .stderr(std::process::Stdio::null())
        .status();
}
