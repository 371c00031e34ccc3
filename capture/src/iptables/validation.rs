//! istio-iptables' `--run-validation`: prove the rules capture the proxy's traffic
//! before the pod starts. Listeners on 127.0.0.1 at the outbound and inbound capture
//! ports wait while a client, with the proxy's uid and gid, connects to
//! 127.0.0.6:<probe port>; the rules must hand that connection to one of the
//! listeners, whose `SO_ORIGINAL_DST` must be the probe port.

use std::{
    io::Write,
    net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use anyhow::bail;

use crate::config::CaptureConfig;

/// `SO_ORIGINAL_DST` (linux/netfilter_ipv4.h), which the libc crate does not export.
const SO_ORIGINAL_DST: libc::c_int = 80;
const PROBE_SOURCE: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// Envoy's inbound passthrough address: loopback, but not the loopback destination the
/// rules exempt, so the proxy's connection to it is captured as a call to its own pod.
const PROBE_TARGET: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 6);

pub fn run(cfg: &CaptureConfig, probe_port: u16, timeout: Duration) -> anyhow::Result<()> {
    let ports = [cfg.proxy_port, cfg.inbound_capture_port];
    let listeners: Vec<TcpListener> = ports
        .iter()
        .filter_map(|&p| TcpListener::bind(SocketAddrV4::new(PROBE_SOURCE, p)).ok())
        .collect();
    if listeners.is_empty() {
        bail!(
            "--run-validation: cannot listen on 127.0.0.1:{} or 127.0.0.1:{} (is the proxy already running?)",
            ports[0],
            ports[1]
        );
    }
    for l in &listeners {
        l.set_nonblocking(true)?;
    }
    let (uid, gid) = (cfg.proxy_uid, cfg.proxy_gid);
    let deadline = Instant::now() + timeout;
    let mut next_probe = Instant::now();
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        if Instant::now() >= next_probe {
            next_probe += Duration::from_secs(1);
            std::thread::spawn(move || probe(uid, gid, probe_port));
        }
        for l in &listeners {
            while let Ok((mut conn, _)) = l.accept() {
                let port = original_dst_port(&conn);
                let _ = conn.write_all(port.map_or(0, |p| p).to_string().as_bytes());
                if port == Some(probe_port) {
                    return Ok(());
                }
                seen.push(port);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!(
        "--run-validation: iptables validation failed: a connection from uid {uid} to \
         {PROBE_TARGET}:{probe_port} did not arrive redirected at 127.0.0.1:{} or :{} within \
         {timeout:?}{}; the rules in this network namespace do not capture the proxy's traffic",
        ports[0],
        ports[1],
        if seen.is_empty() {
            String::new()
        } else {
            format!(" (other connections arrived with original ports {seen:?})")
        }
    )
}

/// One connection attempt with the proxy's credentials. The thread changes only its
/// own ids (raw syscalls; glibc's wrappers would change every thread's) and ends after.
fn probe(uid: u32, gid: u32, port: u16) -> Option<()> {
    // SAFETY: setgroups/setresgid/setresuid take plain integers (and a null list); as
    // raw syscalls they affect only the calling thread, which exits after this probe.
    let ok = unsafe {
        libc::syscall(libc::SYS_setgroups, 0, std::ptr::null::<libc::gid_t>()) == 0
            && libc::syscall(libc::SYS_setresgid, gid, gid, gid) == 0
            && libc::syscall(libc::SYS_setresuid, uid, uid, uid) == 0
    };
    if !ok {
        return None;
    }
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let sock = socket(AddressFamily::INET, SocketType::STREAM, None).ok()?;
    // From 127.0.0.1, as istio-iptables' client: 127.0.0.6 as the source is exempt.
    bind(&sock, &SocketAddrV4::new(PROBE_SOURCE, 0)).ok()?;
    connect(&sock, &SocketAddrV4::new(PROBE_TARGET, port)).ok()
}

/// The destination the connection had before the nat table redirected it.
fn original_dst_port(conn: &TcpStream) -> Option<u16> {
    // SAFETY: sockaddr_in is plain old data; all-zero is a valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: the socket is open for the duration of the call, and `addr` / `len` are
    // live locals with `len` the exact size of `addr`.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_IP,
            SO_ORIGINAL_DST,
            (&raw mut addr).cast(),
            &mut len,
        )
    };
    (rc == 0).then(|| u16::from_be(addr.sin_port))
}
