//! Facts about the network namespace `shunt capture` runs in (the pod's), and the
//! kernel file systems it needs.

use std::{
    ffi::CString,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::unix::fs::MetadataExt,
    path::Path,
};

const SO_NETNS_COOKIE: libc::c_int = 71;
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;

/// The pod's id in the shared maps: its network namespace inode (unique while it lives).
pub fn netns_inode() -> io::Result<u32> {
    let ino = std::fs::metadata("/proc/self/ns/net")?.ino();
    u32::try_from(ino).map_err(|_| io::Error::other(format!("netns inode {ino} exceeds 32 bits")))
}

/// The kernel's cookie for the current network namespace (what BPF programs see).
pub fn netns_cookie() -> io::Result<u64> {
    // SAFETY: plain socket/getsockopt/close on a fresh fd with a correctly sized buffer.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut cookie: u64 = 0;
        let mut len = size_of::<u64>() as libc::socklen_t;
        let rc = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        );
        let err = io::Error::last_os_error();
        libc::close(fd);
        if rc != 0 {
            return Err(err);
        }
        Ok(cookie)
    }
}

/// Every non-loopback address configured in this namespace: the pod's own addresses.
pub fn pod_addresses() -> io::Result<Vec<IpAddr>> {
    let mut addrs = Vec::new();
    // SAFETY: getifaddrs' list is walked read-only and freed once.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut cur = head;
        while !cur.is_null() {
            let sa = (*cur).ifa_addr;
            if !sa.is_null() {
                let ip = match i32::from((*sa).sa_family) {
                    libc::AF_INET => {
                        let sin = &*(sa as *const libc::sockaddr_in);
                        Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                            sin.sin_addr.s_addr,
                        ))))
                    }
                    libc::AF_INET6 => {
                        let sin6 = &*(sa as *const libc::sockaddr_in6);
                        Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                    }
                    _ => None,
                };
                if let Some(ip) = ip.filter(|ip| !ip.is_loopback() && !addrs.contains(ip)) {
                    addrs.push(ip);
                }
            }
            cur = (*cur).ifa_next;
        }
        libc::freeifaddrs(head);
    }
    Ok(addrs)
}

fn fs_magic(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: statfs into a zeroed struct.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        if libc::statfs(c.as_ptr(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st.f_type)
    }
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
    let c = CString::new("/sys/fs/bpf")?;
    let fstype = CString::new("bpf")?;
    // SAFETY: mount(2) with valid C strings.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            c.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        anyhow::bail!(
            "no bpffs at /sys/fs/bpf and mounting one failed: {}",
            io::Error::last_os_error()
        );
    }
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
