//! The few socket operations std lacks: IPv6-only listeners, binding a client's source
//! address before connect, and connect with a timeout on such a socket.

use std::{
    io, mem,
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::{Duration, Instant},
};

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn raw_addr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
            mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
            mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

fn tcp_socket(addr: &SocketAddr) -> io::Result<OwnedFd> {
    let family = if addr.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain syscall; the fd is fresh and owned by the OwnedFd.
    unsafe {
        let fd = cvt(libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
        ))?;
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

fn set_int_opt(
    fd: RawFd,
    level: libc::c_int,
    name: libc::c_int,
    value: libc::c_int,
) -> io::Result<()> {
    // SAFETY: value outlives the call; the length matches.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const value).cast(),
            mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(drop)
}

fn bind(fd: RawFd, addr: &SocketAddr) -> io::Result<()> {
    let (storage, len) = raw_addr(addr);
    // SAFETY: storage holds a valid sockaddr of length len.
    cvt(unsafe { libc::bind(fd, (&raw const storage).cast(), len) }).map(drop)
}

fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: plain fcntl calls.
    unsafe {
        let flags = cvt(libc::fcntl(fd, libc::F_GETFL))?;
        let flags = if on {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        cvt(libc::fcntl(fd, libc::F_SETFL, flags)).map(drop)
    }
}

/// A listener with SO_REUSEADDR; IPv6 listeners are v6only, so `0.0.0.0:P` and
/// `[::]:P` can both be bound.
pub fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let fd = tcp_socket(&addr)?;
    set_int_opt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    if addr.is_ipv6() {
        set_int_opt(fd.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
    }
    bind(fd.as_raw_fd(), &addr)?;
    // SAFETY: plain syscall.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 1024) })?;
    Ok(TcpListener::from(fd))
}

/// Connect to `addr`, first binding the source IP to `bind` if given, giving up after
/// `timeout`. The returned stream is blocking.
pub fn connect(
    addr: SocketAddr,
    bind_ip: Option<IpAddr>,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let fd = tcp_socket(&addr)?;
    let raw = fd.as_raw_fd();
    if let Some(ip) = bind_ip {
        if ip.is_ipv4() != addr.is_ipv4() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("--bind {ip} and {addr} are different address families"),
            ));
        }
        bind(raw, &SocketAddr::new(ip, 0))?;
    }
    set_nonblocking(raw, true)?;
    let (storage, len) = raw_addr(&addr);
    // SAFETY: storage holds a valid sockaddr of length len.
    let rc = unsafe { libc::connect(raw, (&raw const storage).cast(), len) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(err);
        }
        wait_writable(raw, timeout)?;
        let mut so_error: libc::c_int = 0;
        let mut optlen = mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: so_error and optlen are valid for writes.
        cvt(unsafe {
            libc::getsockopt(
                raw,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&raw mut so_error).cast(),
                &mut optlen,
            )
        })?;
        if so_error != 0 {
            return Err(io::Error::from_raw_os_error(so_error));
        }
    }
    set_nonblocking(raw, false)?;
    Ok(TcpStream::from(fd))
}

fn wait_writable(fd: RawFd, timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connect timed out after {timeout:?}"),
            ));
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut pfd, 1, ms) } {
            n if n > 0 => return Ok(()),
            0 => continue,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
}

/// Closes with a reset: SO_LINGER on with a zero timeout.
pub fn abort(stream: std::net::TcpStream) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on an open fd with a correctly sized linger struct.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&stream),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    drop(stream);
    Ok(())
}

/// The socket's cookie (`SO_COOKIE`): the id the kernel's eBPF programs know it by (0
/// if the kernel will not say).
pub fn cookie(fd: &impl std::os::fd::AsRawFd) -> u64 {
    let mut cookie: u64 = 0;
    let mut len = mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: a u64 and its length for the kernel to fill, on a socket the caller holds.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc == 0 { cookie } else { 0 }
}
