//! bpf(2) link creation and pinning. aya loads the programs; links are made here so
//! every hook (including cgroup getsockopt, which aya cannot turn into an `FdLink`)
//! is attached and pinned the same way: a pinned link outlives `shunt capture` and is
//! detached by removing its pin.

use std::{
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::Path,
};

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_LINK_CREATE: libc::c_long = 28;

/// Attach types (uapi `enum bpf_attach_type`).
pub const BPF_CGROUP_SOCK_OPS: u32 = 3;
pub const BPF_CGROUP_INET4_CONNECT: u32 = 10;
pub const BPF_CGROUP_INET6_CONNECT: u32 = 11;
pub const BPF_CGROUP_UDP4_SENDMSG: u32 = 14;
pub const BPF_CGROUP_UDP6_SENDMSG: u32 = 15;
pub const BPF_CGROUP_UDP4_RECVMSG: u32 = 19;
pub const BPF_CGROUP_UDP6_RECVMSG: u32 = 20;
pub const BPF_CGROUP_GETSOCKOPT: u32 = 21;
pub const BPF_SK_LOOKUP: u32 = 36;
pub const BPF_SK_MSG_VERDICT: u32 = 7;

#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    _rest: [u64; 12],
}

#[repr(C)]
#[derive(Default)]
struct ObjPinAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    _pad: u32,
}

/// bpf(2) with `attr` as the attribute union (its size is the struct's).
///
/// # Safety
/// Every address stored in `attr` (a path name, an info buffer) must point to memory
/// that is valid, for as many bytes as `attr` says, for what `cmd` does with it: read a
/// NUL-terminated path, or write an info struct.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i64> {
    // SAFETY: `attr` is a live, exclusively borrowed struct of `size_of::<T>()` bytes
    // (the kernel reads and may write it); the caller vouches for the addresses inside.
    // rustix and nix have no bpf(2), and aya keeps its wrappers private.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, std::ptr::from_mut(attr), size_of::<T>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The fd a bpf(2) command returned, now owned (closed on drop).
fn owned_fd(fd: i64) -> io::Result<OwnedFd> {
    let raw =
        i32::try_from(fd).map_err(|_| io::Error::other(format!("bpf(2) returned fd {fd}")))?;
    // SAFETY: the kernel has just returned this new fd to us and nothing else holds it.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// Attaches `prog` to `target` (a cgroup directory or a network namespace fd).
pub fn create(
    prog: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let mut attr = LinkCreateAttr {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: target.as_raw_fd() as u32,
        attach_type,
        ..Default::default()
    };
    // SAFETY: LINK_CREATE's attributes here hold fds only, no addresses.
    let fd = unsafe { bpf(BPF_LINK_CREATE, &mut attr)? };
    owned_fd(fd)
}

pub fn pin(fd: impl AsFd, path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut attr = ObjPinAttr {
        pathname: c.as_ptr() as u64,
        bpf_fd: fd.as_fd().as_raw_fd() as u32,
        ..Default::default()
    };
    // SAFETY: `pathname` is `c`, a NUL-terminated string alive until the call returns.
    unsafe { bpf(BPF_OBJ_PIN, &mut attr) }.map(|_| ())
}

#[repr(C)]
#[derive(Default)]
struct ProgAttachAttr {
    target_fd: u32,
    attach_bpf_fd: u32,
    attach_type: u32,
    attach_flags: u32,
    replace_bpf_fd: u32,
    _rest: [u32; 11],
}

/// Attaches `prog` to a map (sk_msg verdict on a SOCKHASH). The attachment lives as
/// long as the map, which is pinned; attaching again replaces the program.
pub fn attach_to_map(
    prog: BorrowedFd<'_>,
    map: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<()> {
    let mut attr = ProgAttachAttr {
        target_fd: map.as_raw_fd() as u32,
        attach_bpf_fd: prog.as_raw_fd() as u32,
        attach_type,
        ..Default::default()
    };
    // SAFETY: PROG_ATTACH's attributes hold fds only, no addresses.
    unsafe { bpf(BPF_PROG_ATTACH, &mut attr) }.map(|_| ())
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// What a pinned link is attached to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A cgroup, by id (the cgroup v2 directory's inode number).
    Cgroup(u64),
    /// A network namespace, by inode number.
    Netns(u32),
    Other,
}

/// `struct bpf_link_info`, up to the union's first 16 bytes (cgroup and netns members).
#[repr(C)]
#[derive(Default)]
struct LinkInfo {
    link_type: u32,
    id: u32,
    prog_id: u32,
    _pad: u32,
    union: [u64; 2],
    _rest: [u64; 8],
}

const BPF_LINK_TYPE_CGROUP: u32 = 3;
const BPF_LINK_TYPE_NETNS: u32 = 5;

/// Opens a pinned link and asks the kernel what it is attached to.
pub fn pinned_target(path: &Path) -> io::Result<Target> {
    let info = pinned_link_info(path)?;
    Ok(match info.link_type {
        BPF_LINK_TYPE_CGROUP => Target::Cgroup(info.union[0]),
        BPF_LINK_TYPE_NETNS => Target::Netns(info.union[0] as u32),
        _ => Target::Other,
    })
}

/// The id of the program a pinned link runs.
pub fn pinned_prog_id(path: &Path) -> io::Result<u32> {
    Ok(pinned_link_info(path)?.prog_id)
}

fn pinned_link_info(path: &Path) -> io::Result<LinkInfo> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())?;
    let mut get = ObjPinAttr {
        pathname: c.as_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: `pathname` is `c`, a NUL-terminated string alive until the call returns.
    let fd = owned_fd(unsafe { bpf(BPF_OBJ_GET, &mut get)? })?;
    let mut info = LinkInfo::default();
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut attr = InfoAttr {
        bpf_fd: fd.as_raw_fd() as u32,
        info_len: size_of::<LinkInfo>() as u32,
        info: (&raw mut info) as u64,
    };
    // SAFETY: `info` is the address of `info`, a live local of exactly `info_len` bytes
    // that the kernel fills (it writes at most `info_len`).
    unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)? };
    Ok(info)
}
