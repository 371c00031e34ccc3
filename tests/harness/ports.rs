//! Waiting for listeners, by reading the pod's TCP tables (no test connection is made,
//! so servers do not see extra connections).

use crate::pod::Pod;
use anyhow::{Context, Result, bail};
use std::{
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    thread,
    time::{Duration, Instant},
};

/// Poll (every 10 ms) until a TCP socket listens on `addr` inside `pod`'s netns.
///
/// A listener on the unspecified address of the same family counts for any address,
/// and `addr` with an unspecified IP accepts any listener of its family on the port.
/// An IPv4 `addr` does not match a dual-stack `[::]` listener (the table does not say
/// whether it is v6only): wait for the `[::]:port` address instead.
pub fn wait_for_port(pod: &Pod, addr: SocketAddr, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let found = pod.run_in_netns(|| -> Result<Option<Vec<SocketAddr>>> {
        loop {
            let listeners = read_listeners()?;
            if listeners.iter().any(|l| covers(l, &addr)) {
                return Ok(None);
            }
            if Instant::now() >= deadline {
                return Ok(Some(listeners));
            }
            thread::sleep(Duration::from_millis(10));
        }
    })??;
    if let Some(listeners) = found {
        bail!(
            "nothing listened on {addr} in pod {} within {timeout:?} (TCP listeners there: {listeners:?})",
            pod.name()
        );
    }
    Ok(())
}

/// Every listening TCP socket's local address in `pod`'s netns.
pub fn tcp_listeners(pod: &Pod) -> Result<Vec<SocketAddr>> {
    pod.run_in_netns(read_listeners)?
}

fn covers(listener: &SocketAddr, want: &SocketAddr) -> bool {
    if listener.port() != want.port() {
        return false;
    }
    match (listener.ip(), want.ip()) {
        (IpAddr::V4(l), IpAddr::V4(w)) => l == w || l.is_unspecified() || w.is_unspecified(),
        (IpAddr::V6(l), IpAddr::V6(w)) => l == w || l.is_unspecified() || w.is_unspecified(),
        (IpAddr::V6(l), IpAddr::V4(w)) => l.to_ipv4_mapped() == Some(w),
        (IpAddr::V4(_), IpAddr::V6(_)) => false,
    }
}

/// Must run on a thread inside the netns: /proc/self/net follows the thread-group
/// leader's netns, /proc/thread-self/net the calling thread's.
fn read_listeners() -> Result<Vec<SocketAddr>> {
    let mut out = Vec::new();
    for (file, v6) in [("tcp", false), ("tcp6", true)] {
        let path = format!("/proc/thread-self/net/{file}");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            // No tcp6 table when IPv6 is disabled.
            Err(e) if v6 && e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {path}")),
        };
        out.extend(parse_listeners(&text, v6));
    }
    Ok(out)
}

const TCP_LISTEN: &str = "0A";

fn parse_listeners(table: &str, v6: bool) -> Vec<SocketAddr> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.get(3) != Some(&TCP_LISTEN) {
                return None;
            }
            parse_hex_addr(fields.get(1)?, v6)
        })
        .collect()
}

/// `0100007F:1F90` / 32 hex digits + port. The kernel prints each 32-bit word of the
/// (network-order) address as a native-endian integer; the port is in host order.
fn parse_hex_addr(s: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = if v6 {
        if ip.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for i in 0..4 {
            bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
        }
        IpAddr::V6(Ipv6Addr::from(bytes))
    } else {
        if ip.len() != 8 {
            return None;
        }
        IpAddr::V4(Ipv4Addr::from(word(0)?))
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_tcp() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0 100 0 0 10 0\n\
   1: 0100007F:0016 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0\n";
        assert_eq!(
            parse_listeners(v4, false),
            vec!["0.0.0.0:8080".parse().unwrap()]
        );
        if cfg!(target_endian = "little") {
            let v6 = "  sl  local_address                         remote_address                        st\n\
   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A\n\
   1: 000077FD000000000000000011000000:0050 00000000000000000000000000000000:0000 0A\n";
            assert_eq!(
                parse_listeners(v6, true),
                vec![
                    "[::1]:8080".parse().unwrap(),
                    "[fd77::11]:80".parse().unwrap()
                ]
            );
        }
    }

    #[test]
    fn matching_rules() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(covers(&a("0.0.0.0:80"), &a("10.0.0.1:80")));
        assert!(covers(&a("10.0.0.1:80"), &a("0.0.0.0:80")));
        assert!(!covers(&a("10.0.0.1:80"), &a("10.0.0.2:80")));
        assert!(!covers(&a("0.0.0.0:80"), &a("0.0.0.0:81")));
        assert!(covers(&a("[::]:80"), &a("[fd77::a]:80")));
        assert!(!covers(&a("[::]:80"), &a("0.0.0.0:80")));
        assert!(!covers(&a("0.0.0.0:80"), &a("[::]:80")));
    }
}
