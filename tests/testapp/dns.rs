//! `testapp dns-query`: one DNS question over UDP, sent the way resolver libraries send
//! it, with connected (`connect` + `send`, as glibc) or unconnected sockets (`sendto`,
//! as musl), reporting the source address the reply came from, as the app sees it
//! (`recvfrom`), and the addresses it answered. A test client only: the question is
//! encoded and the A/AAAA answers read by hand, nothing else of DNS is understood.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

use crate::Args;

pub fn query(argv: &[String]) -> Result<serde_json::Value, String> {
    let args = Args::parse(argv, &["name", "type", "connect", "bind", "timeout-ms"])?;
    let server = args.target()?;
    let name: String = args.get("name")?.ok_or("missing --name")?;
    let qtype: u16 = match args.get::<String>("type")?.as_deref() {
        None | Some("A") => 1,
        Some("AAAA") => 28,
        Some(other) => return Err(format!("--type {other:?}: A or AAAA")),
    };
    let connect = match args.get::<String>("connect")?.as_deref() {
        None | Some("no") => false,
        Some("yes") => true,
        Some(other) => return Err(format!("--connect {other:?}: yes or no")),
    };
    let timeout = args.millis("timeout-ms", 3000)?;
    let bind: SocketAddr = match (server, args.get::<IpAddr>("bind")?) {
        (_, Some(ip)) => (ip, 0).into(),
        (SocketAddr::V4(_), None) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        // Also for ::ffff:a.b.c.d: a dual-stack socket, as an IPv6 app would have.
        (SocketAddr::V6(_), None) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let sock = UdpSocket::bind(bind).map_err(|e| format!("bind {bind}: {e}"))?;
    sock.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let id = (std::process::id() & 0xffff) as u16;
    let question = encode(id, &name, qtype)?;
    if connect {
        sock.connect(server)
            .map_err(|e| format!("connect {server}: {e}"))?;
        sock.send(&question)
            .map_err(|e| format!("send to {server}: {e}"))?;
    } else {
        sock.send_to(&question, server)
            .map_err(|e| format!("sendto {server}: {e}"))?;
    }
    let mut buf = [0u8; 1500];
    let (len, from) = match sock.recv_from(&mut buf) {
        Ok(got) => got,
        // Still say which socket asked: the capture's events name it by its cookie.
        Err(e) => {
            return Ok(serde_json::json!({
                "ok": false,
                "error": format!("no reply from {server} within {timeout:?}: {e}"),
                "cookie": crate::sock::cookie(&sock),
            }));
        }
    };
    let reply = &buf[..len];
    let (rcode, answers) = decode(id, reply)?;
    Ok(serde_json::json!({
        "ok": true,
        "from": from.to_string(),
        "cookie": crate::sock::cookie(&sock),
        "rcode": rcode,
        "answers": answers.iter().map(ToString::to_string).collect::<Vec<_>>(),
    }))
}

fn encode(id: u16, name: &str, qtype: u16) -> Result<Vec<u8>, String> {
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    // Recursion desired; one question.
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(format!("--name {name:?}: bad label {label:?}"));
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes());
    Ok(q)
}

/// The reply's rcode and its A/AAAA answers.
fn decode(id: u16, r: &[u8]) -> Result<(u8, Vec<IpAddr>), String> {
    let short = || format!("reply of {} bytes is cut short", r.len());
    if r.len() < 12 {
        return Err(short());
    }
    if u16::from_be_bytes([r[0], r[1]]) != id {
        return Err("reply has another id".into());
    }
    let rcode = r[3] & 0x0f;
    let qd = u16::from_be_bytes([r[4], r[5]]);
    let an = u16::from_be_bytes([r[6], r[7]]);
    let mut at = 12;
    for _ in 0..qd {
        at = skip_name(r, at).ok_or_else(short)? + 4;
    }
    let mut answers = Vec::new();
    for _ in 0..an {
        at = skip_name(r, at).ok_or_else(short)?;
        let fixed = r.get(at..at + 10).ok_or_else(short)?;
        let rtype = u16::from_be_bytes([fixed[0], fixed[1]]);
        let rdlen = usize::from(u16::from_be_bytes([fixed[8], fixed[9]]));
        let rdata = r.get(at + 10..at + 10 + rdlen).ok_or_else(short)?;
        match (rtype, rdlen) {
            (1, 4) => answers.push(IpAddr::from(<[u8; 4]>::try_from(rdata).unwrap())),
            (28, 16) => answers.push(IpAddr::from(<[u8; 16]>::try_from(rdata).unwrap())),
            _ => {}
        }
        at += 10 + rdlen;
    }
    Ok((rcode, answers))
}

/// The offset just past the name at `at` (labels, ending in 0 or a compression pointer).
fn skip_name(r: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let len = *r.get(at)?;
        match len {
            0 => return Some(at + 1),
            l if l & 0xc0 == 0xc0 => return Some(at + 2),
            l => at += 1 + usize::from(l),
        }
    }
}
