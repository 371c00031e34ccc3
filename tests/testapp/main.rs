//! testapp: the TCP workload of the integration tests (std + threads only).
//!
//! ```text
//! testapp serve --listen ADDR:PORT [--listen ADDR:PORT ...] [--mode echo|half-close|http|http-echo] [--quiet yes]
//! testapp call ADDR:PORT [--bind IP] [--bytes N] [--timeout-ms MS] [--seed S]
//! testapp bench-connect ADDR:PORT [--duration-ms MS] [--concurrency C] [--payload B] [--timeout-ms MS]
//! testapp bench-rr ADDR:PORT [--duration-ms MS] [--payload B] [--timeout-ms MS]
//! testapp bench-rate ADDR:PORT [--proto http|tcp] [--rate RPS] [--connections N] [--new-connection yes|no] [--duration-ms MS] [--warmup-ms MS] [--payload B]
//! testapp probe ADDR:PORT [--timeout-ms MS]
//! testapp dns-query ADDR:PORT --name NAME [--type A|AAAA] [--connect yes|no] [--bind IP] [--timeout-ms MS]
//! ```
//!
//! Protocol: the server first sends `HELLO peer=<ip:port> local=<ip:port>\n` (its view
//! of the connection), then echoes every byte until the client's EOF, then shuts down
//! its write side.

mod dns;
mod rate;
mod sock;

use serde::Serialize;
use std::{
    io::{self, Read, Write},
    net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
    str::FromStr,
    thread,
    time::{Duration, Instant},
};

const USAGE: &str = "\
usage:
  testapp serve --listen ADDR:PORT [--listen ADDR:PORT ...] [--mode echo|half-close|http|http-echo] [--quiet yes]
  testapp call ADDR:PORT [--bind IP] [--bytes N=1024] [--timeout-ms 5000] [--seed S]
  testapp bench-connect ADDR:PORT [--duration-ms 3000] [--concurrency 4] [--payload 64] [--timeout-ms 2000]
  testapp bench-rr ADDR:PORT [--duration-ms 3000] [--payload 64] [--timeout-ms 2000]
  testapp bench-rate ADDR:PORT [--proto http] [--rate 1000 (0: maximum)] [--connections 4] [--new-connection no] [--duration-ms 5000] [--warmup-ms 500] [--payload 1024] [--timeout-ms 2000]
  testapp probe ADDR:PORT [--timeout-ms 200]
  testapp dns-query ADDR:PORT --name NAME [--type A|AAAA] [--connect no] [--bind IP] [--timeout-ms 3000]
IPv6 addresses are written [addr]:port.";

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some((cmd, rest)) = argv.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    match cmd.as_str() {
        "serve" => serve(rest),
        "call" => call(rest),
        "bench-connect" => bench_connect(rest),
        "bench-rr" => bench_rr(rest),
        "bench-rate" => rate::bench_rate(rest),
        "probe" => probe(rest),
        "many" => report(many(rest)),
        "hold" => report(hold(rest)),
        "half-close" => report(half_close(rest)),
        "dns-query" => report(dns::query(rest)),
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("testapp: unknown command {other:?}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

// ---------------------------------------------------------------- arguments

struct Args {
    positional: Vec<String>,
    flags: Vec<(String, String)>,
}

impl Args {
    /// Every flag takes a value: `--name value` or `--name=value`.
    fn parse(argv: &[String], known: &[&str]) -> Result<Args, String> {
        let mut args = Args {
            positional: Vec::new(),
            flags: Vec::new(),
        };
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            let Some(flag) = a.strip_prefix("--") else {
                args.positional.push(a.clone());
                continue;
            };
            let (name, value) = match flag.split_once('=') {
                Some((n, v)) => (n.to_owned(), v.to_owned()),
                None => {
                    let v = it.next().ok_or_else(|| format!("--{flag} needs a value"))?;
                    (flag.to_owned(), v.clone())
                }
            };
            if !known.contains(&name.as_str()) {
                return Err(format!("unknown option --{name}"));
            }
            args.flags.push((name, value));
        }
        Ok(args)
    }

    fn all(&self, name: &str) -> impl Iterator<Item = &str> {
        self.flags
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn get<T: FromStr>(&self, name: &str) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.all(name).last() {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|e| format!("--{name} {v:?}: {e}")),
        }
    }

    fn num<T: FromStr>(&self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        Ok(self.get(name)?.unwrap_or(default))
    }

    fn millis(&self, name: &str, default: u64) -> Result<Duration, String> {
        Ok(Duration::from_millis(self.num(name, default)?))
    }

    /// The one positional argument, ADDR:PORT.
    fn target(&self) -> Result<SocketAddr, String> {
        match self.positional.as_slice() {
            [one] => one
                .parse()
                .map_err(|e| format!("bad address {one:?} (want IP:PORT or [IPv6]:PORT): {e}")),
            [] => Err("missing ADDR:PORT".into()),
            more => Err(format!("expected one ADDR:PORT, got {more:?}")),
        }
    }
}

fn usage_error(cmd: &str, msg: &str) -> ExitCode {
    eprintln!("testapp {cmd}: {msg}\n{USAGE}");
    ExitCode::from(2)
}

/// One line on stdout, flushed at once (stdout is a pipe when run by the harness).
fn say(line: &str) {
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn print_json(value: &impl Serialize) {
    say(&serde_json::to_string(value).expect("serialisable"));
}

// ---------------------------------------------------------------- serve

fn serve(argv: &[String]) -> ExitCode {
    let args = match Args::parse(argv, &["listen", "mode", "quiet"]) {
        Ok(a) => a,
        Err(e) => return usage_error("serve", &e),
    };
    match args.all("mode").collect::<Vec<_>>().as_slice() {
        [] | ["echo"] => {}
        ["half-close"] => {
            HALF_CLOSE.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        ["http"] => {
            HTTP.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        ["http-echo"] => {
            HTTP.store(true, std::sync::atomic::Ordering::Relaxed);
            HTTP_ECHO.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        other => {
            return usage_error(
                "serve",
                &format!("--mode {other:?}: echo, half-close, http or http-echo"),
            );
        }
    }
    match args.all("quiet").last() {
        None | Some("no") => {}
        Some("yes") => QUIET.store(true, std::sync::atomic::Ordering::Relaxed),
        Some(other) => return usage_error("serve", &format!("--quiet {other:?}: yes or no")),
    }
    if !args.positional.is_empty() {
        return usage_error("serve", &format!("unexpected {:?}", args.positional));
    }
    let mut addrs = Vec::new();
    for v in args.all("listen") {
        match v.parse::<SocketAddr>() {
            Ok(a) => addrs.push(a),
            Err(e) => return usage_error("serve", &format!("--listen {v:?}: {e}")),
        }
    }
    if addrs.is_empty() {
        return usage_error("serve", "at least one --listen ADDR:PORT is needed");
    }
    harness::raise_open_files_limit();
    let mut listeners = Vec::new();
    for addr in addrs {
        match sock::listen(addr) {
            Ok(l) => listeners.push(l),
            Err(e) => {
                eprintln!("testapp serve: listening on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    for l in &listeners {
        if let Ok(a) = l.local_addr() {
            say(&format!("LISTEN {a}"));
        }
    }
    let acceptors: Vec<_> = listeners
        .into_iter()
        .map(|l| thread::spawn(move || accept_loop(l)))
        .collect();
    for a in acceptors {
        let _ = a.join();
    }
    ExitCode::SUCCESS
}

fn accept_loop(listener: TcpListener) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                thread::spawn(move || serve_conn(stream));
            }
            Err(e) => {
                eprintln!("testapp serve: accept: {e}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve_conn(mut stream: TcpStream) {
    let (peer, local) = match (stream.peer_addr(), stream.local_addr()) {
        (Ok(p), Ok(l)) => (p, l),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("testapp serve: getpeername/getsockname: {e}");
            return;
        }
    };
    let quiet = QUIET.load(std::sync::atomic::Ordering::Relaxed);
    if !quiet {
        say(&format!("ACCEPT peer={peer} local={local}"));
    }
    let _ = stream.set_nodelay(true);
    let mut received = 0u64;
    let result = if HALF_CLOSE.load(std::sync::atomic::Ordering::Relaxed) {
        speak_then_listen(&mut stream, peer, local, &mut received)
    } else if HTTP.load(std::sync::atomic::Ordering::Relaxed) {
        http(&mut stream, peer, local, &mut received)
    } else {
        echo(&mut stream, peer, local, &mut received)
    };
    // How the connection ended, for tests: a clean EOF or a reset, and what arrived.
    let end = match &result {
        Ok(()) => "eof".to_string(),
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => "reset".to_string(),
        Err(e) => format!("error:{}", e.kind()),
    };
    if !quiet {
        say(&format!("END peer={peer} received={received} result={end}"));
    }
    if let Err(e) = result {
        let quiet = matches!(
            e.kind(),
            io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
        );
        if !quiet {
            eprintln!("testapp serve: connection from {peer}: {e}");
        }
    }
}

/// `serve --half-close`: the server speaks first and closes its side first.
static HALF_CLOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--mode http`: answer HTTP/1.1 requests instead of echoing.
static HTTP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--mode http-echo`: the response's body is the request's (a load generator's echo).
static HTTP_ECHO: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// `--quiet yes`: no ACCEPT/END line per connection (a load test opens thousands).
static QUIET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// What a `--half-close` server sends before shutting down its write side.
const HALF_CLOSE_BYTES: usize = 1 << 20;

fn speak_then_listen(
    stream: &mut TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    received: &mut u64,
) -> io::Result<()> {
    stream.write_all(format!("HELLO peer={peer} local={local}\n").as_bytes())?;
    stream.write_all(&pseudo_random(HALF_CLOSE_BYTES, 11))?;
    stream.shutdown(Shutdown::Write)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => *received += n as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

fn echo(
    stream: &mut TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    received: &mut u64,
) -> io::Result<()> {
    stream.write_all(format!("HELLO peer={peer} local={local}\n").as_bytes())?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match stream.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return stream.shutdown(Shutdown::Write);
        }
        *received += n as u64;
        stream.write_all(&buf[..n])?;
    }
}

/// `--mode http`: answers each HTTP/1.1 request on the connection (keep-alive) with 200
/// and the greeting line as the body, so an HTTP client learns which server it reached
/// and from where. Request bodies (`content-length`) are read and counted; with
/// `--mode http-echo` a request's body is the response's (the greeting when it has none).
fn http(
    stream: &mut TcpStream,
    peer: SocketAddr,
    local: SocketAddr,
    received: &mut u64,
) -> io::Result<()> {
    let body = format!("HELLO peer={peer} local={local}\n");
    let mut reader = io::BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    loop {
        let mut length = 0u64;
        let mut close = false;
        loop {
            line.clear();
            if io::BufRead::read_line(&mut reader, &mut line)? == 0 {
                return Ok(());
            }
            if line == "\r\n" || line == "\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            close |= lower.starts_with("connection:") && lower.contains("close");
        }
        let echo = HTTP_ECHO.load(std::sync::atomic::Ordering::Relaxed) && length > 0;
        let reply = if echo {
            let mut request_body = Vec::with_capacity(length as usize);
            (&mut reader).take(length).read_to_end(&mut request_body)?;
            *received += request_body.len() as u64;
            request_body
        } else {
            *received += io::copy(&mut (&mut reader).take(length), &mut io::sink())?;
            body.as_bytes().to_vec()
        };
        let mut response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n",
            reply.len()
        )
        .into_bytes();
        response.extend_from_slice(&reply);
        // One write: head and body in one segment, as a server with a buffered writer.
        stream.write_all(&response)?;
        if close {
            return stream.shutdown(Shutdown::Write);
        }
    }
}

// ---------------------------------------------------------------- client side

/// Read the server's `HELLO peer=.. local=..` line; returns (peer, local) as the
/// server saw them.
fn read_hello(stream: &mut TcpStream) -> Result<(String, String), String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        match stream.read(&mut byte) {
            Ok(0) => {
                return Err(format!(
                    "connection closed before the HELLO line (got {:?})",
                    String::from_utf8_lossy(&line)
                ));
            }
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) => line.push(byte[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the HELLO line: {e}")),
        }
        if line.len() > 512 {
            return Err("HELLO line longer than 512 bytes".into());
        }
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let bad = || format!("malformed HELLO line {line:?}");
    let rest = line.strip_prefix("HELLO ").ok_or_else(bad)?;
    let (mut peer, mut local) = (None, None);
    for field in rest.split_whitespace() {
        match field.split_once('=') {
            Some(("peer", v)) => peer = Some(v.to_owned()),
            Some(("local", v)) => local = Some(v.to_owned()),
            _ => {}
        }
    }
    Ok((peer.ok_or_else(bad)?, local.ok_or_else(bad)?))
}

fn connect(
    target: SocketAddr,
    bind: Option<IpAddr>,
    timeout: Duration,
) -> Result<TcpStream, String> {
    let stream =
        sock::connect(target, bind, timeout).map_err(|e| format!("connecting to {target}: {e}"))?;
    let setup = || -> io::Result<()> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)
    };
    setup().map_err(|e| format!("configuring socket: {e}"))?;
    Ok(stream)
}

/// xorshift64 bytes: deterministic, cheap, not compressible.
fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed ^ 0x9E37_79B9_7F4A_7C15;
    if x == 0 {
        x = 1;
    }
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// FNV-1a, 64 bit.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[derive(Serialize)]
struct CallOk {
    ok: bool,
    server_peer: String,
    server_local: String,
    client_local: String,
    /// The client socket's `SO_COOKIE`, as the capture programs' events name it.
    cookie: u64,
    bytes: usize,
    /// From the first payload byte sent to the last echoed byte received.
    elapsed_us: u64,
}

#[derive(Serialize)]
struct CallErr {
    ok: bool,
    error: String,
}

fn call(argv: &[String]) -> ExitCode {
    match call_inner(argv) {
        Ok(report) => {
            print_json(&report);
            ExitCode::SUCCESS
        }
        Err(error) => {
            print_json(&CallErr { ok: false, error });
            ExitCode::FAILURE
        }
    }
}

fn call_inner(argv: &[String]) -> Result<CallOk, String> {
    let args = Args::parse(
        argv,
        &[
            "bind",
            "bytes",
            "timeout-ms",
            "seed",
            "read-delay-ms",
            "abort-after",
        ],
    )?;
    let target = args.target()?;
    let bind: Option<IpAddr> = args.get("bind")?;
    let len: usize = args.num("bytes", 1024)?;
    let timeout = args.millis("timeout-ms", 5000)?;
    let seed: u64 = args.num("seed", 1)?;
    // A slow reader: pause this long after every read.
    let read_delay = args.millis("read-delay-ms", 0)?;
    // Reset the connection (SO_LINGER 0) after sending this many bytes.
    let abort_after: Option<usize> = args.get("abort-after")?;

    let mut stream = connect(target, bind, timeout)?;
    let client_local = stream
        .local_addr()
        .map_err(|e| format!("getsockname: {e}"))?;
    let cookie = sock::cookie(&stream);
    let (server_peer, server_local) = read_hello(&mut stream)?;

    let data = pseudo_random(len, seed);
    if let Some(k) = abort_after {
        stream
            .write_all(&data[..k.min(len)])
            .map_err(|e| format!("sending before the abort: {e}"))?;
        // Let the bytes get through before the reset overtakes them.
        thread::sleep(Duration::from_millis(200));
        sock::abort(stream).map_err(|e| format!("abort: {e}"))?;
        return Ok(CallOk {
            ok: true,
            server_peer,
            server_local,
            client_local: client_local.to_string(),
            cookie,
            bytes: k.min(len),
            elapsed_us: 0,
        });
    }
    let mut expected = Fnv::new();
    expected.update(&data);
    // Write from another thread: with big payloads, writing everything before reading
    // would fill both directions' buffers and deadlock against the echo.
    let mut writer = stream.try_clone().map_err(|e| format!("dup socket: {e}"))?;
    let started = Instant::now();
    let sender = thread::spawn(move || writer.write_all(&data));

    let mut got = Fnv::new();
    let mut received = 0usize;
    let mut buf = vec![0u8; 64 * 1024];
    while received < len {
        let want = buf.len().min(len - received);
        match stream.read(&mut buf[..want]) {
            Ok(0) => {
                return Err(format!(
                    "connection closed after {received} of {len} echoed bytes"
                ));
            }
            Ok(n) => {
                got.update(&buf[..n]);
                received += n;
                if !read_delay.is_zero() {
                    thread::sleep(read_delay);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(format!(
                    "reading the echo after {received} of {len} bytes: {e}"
                ));
            }
        }
    }
    match sender.join() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(format!("sending {len} bytes: {e}")),
        Err(_) => return Err("sender thread panicked".into()),
    }
    let elapsed_us = started.elapsed().as_micros() as u64;
    if got != expected {
        return Err(format!("the {len} echoed bytes differ from the bytes sent"));
    }
    stream
        .shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown(write): {e}"))?;
    match stream.read(&mut buf) {
        Ok(0) => {}
        Ok(n) => return Err(format!("expected EOF, got {n} more bytes")),
        Err(e) => return Err(format!("expected EOF after shutdown: {e}")),
    }
    Ok(CallOk {
        ok: true,
        server_peer,
        server_local,
        client_local: client_local.to_string(),
        cookie,
        bytes: len,
        elapsed_us,
    })
}

/// Prints a command's JSON result, `{"ok":false,"error":..}` on failure.
fn report(result: Result<serde_json::Value, String>) -> ExitCode {
    match result {
        Ok(v) => {
            print_json(&v);
            if v["ok"] == false {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(error) => {
            print_json(&CallErr { ok: false, error });
            ExitCode::FAILURE
        }
    }
}

/// `many ADDR --connections N --bytes B`: N connections open at once, each echoing B
/// bytes (checked), then all closed with a clean EOF.
fn many(argv: &[String]) -> Result<serde_json::Value, String> {
    harness::raise_open_files_limit();
    let args = Args::parse(argv, &["connections", "bytes", "timeout-ms"])?;
    let target = args.target()?;
    let n: usize = args.num("connections", 1000)?;
    let len: usize = args.num("bytes", 4096)?;
    let timeout = args.millis("timeout-ms", 10000)?;
    let mut streams = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = connect(target, None, timeout).map_err(|e| format!("connection {i}: {e}"))?;
        read_hello(&mut s).map_err(|e| format!("connection {i}: {e}"))?;
        streams.push(s);
    }
    let mut buf = vec![0u8; len];
    for (i, s) in streams.iter_mut().enumerate() {
        let data = pseudo_random(len, i as u64 + 1);
        s.write_all(&data)
            .map_err(|e| format!("connection {i}: write: {e}"))?;
        s.read_exact(&mut buf)
            .map_err(|e| format!("connection {i}: read: {e}"))?;
        if buf != data {
            return Err(format!("connection {i}: echoed bytes differ"));
        }
    }
    for (i, s) in streams.iter_mut().enumerate() {
        s.shutdown(Shutdown::Write)
            .map_err(|e| format!("connection {i}: shutdown: {e}"))?;
        match s.read(&mut buf) {
            Ok(0) => {}
            other => return Err(format!("connection {i}: expected EOF, got {other:?}")),
        }
    }
    Ok(serde_json::json!({"ok": true, "connections": n, "bytes": len}))
}

/// `hold ADDR --connections N --duration-ms D --payload P`: opens N connections, then
/// for D ms makes round trips on them in turn. A connection that fails is broken and
/// left (never reopened); the longest round trip is the longest stall any of them saw.
fn hold(argv: &[String]) -> Result<serde_json::Value, String> {
    harness::raise_open_files_limit();
    let args = Args::parse(
        argv,
        &["connections", "duration-ms", "payload", "timeout-ms"],
    )?;
    let target = args.target()?;
    let n: usize = args.num("connections", 100)?;
    let duration = args.millis("duration-ms", 5000)?;
    let payload = pseudo_random(args.num("payload", 64)?, 5);
    let timeout = args.millis("timeout-ms", 10000)?;
    let mut streams = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = connect(target, None, timeout).map_err(|e| format!("connection {i}: {e}"))?;
        read_hello(&mut s).map_err(|e| format!("connection {i}: {e}"))?;
        s.set_read_timeout(Some(timeout))
            .map_err(|e| e.to_string())?;
        streams.push(Some(s));
    }
    let mut buf = vec![0u8; payload.len()];
    let (mut round_trips, mut broken, mut longest_us) = (0u64, 0u64, 0u64);
    let mut first_error = None;
    let deadline = Instant::now() + duration;
    while Instant::now() < deadline && broken < n as u64 {
        for slot in streams.iter_mut() {
            let Some(stream) = slot else { continue };
            let t0 = Instant::now();
            match round_trip(stream, &payload, &mut buf) {
                Ok(()) => {
                    round_trips += 1;
                    longest_us = longest_us.max(t0.elapsed().as_micros() as u64);
                }
                Err(e) => {
                    broken += 1;
                    first_error.get_or_insert(e);
                    *slot = None;
                }
            }
        }
    }
    // No "ok": a broken connection is a measurement here, not a failure of the tool.
    Ok(serde_json::json!({
        "connections": n,
        "broken": broken,
        "round_trips": round_trips,
        "longest_round_trip_us": longest_us,
        "first_error": first_error,
    }))
}

/// `half-close ADDR --bytes B` against `serve --mode half-close`: the server sends
/// 1 MiB and closes its side first; we read to EOF, then still send B bytes and close.
fn half_close(argv: &[String]) -> Result<serde_json::Value, String> {
    let args = Args::parse(argv, &["bytes", "timeout-ms"])?;
    let target = args.target()?;
    let len: usize = args.num("bytes", 4096)?;
    let timeout = args.millis("timeout-ms", 10000)?;
    let mut s = connect(target, None, timeout)?;
    let client_local = s.local_addr().map_err(|e| format!("getsockname: {e}"))?;
    let (server_peer, _) = read_hello(&mut s)?;
    let mut got = Vec::new();
    s.read_to_end(&mut got)
        .map_err(|e| format!("reading until the server's FIN: {e}"))?;
    if got != pseudo_random(HALF_CLOSE_BYTES, 11) {
        return Err(format!(
            "{} bytes before the server's FIN, not its 1 MiB",
            got.len()
        ));
    }
    s.write_all(&pseudo_random(len, 5))
        .map_err(|e| format!("writing after the server's FIN: {e}"))?;
    s.shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    Ok(serde_json::json!({
        "ok": true, "received": got.len(), "sent": len,
        "server_peer": server_peer, "client_local": client_local.to_string(),
    }))
}

// ---------------------------------------------------------------- benchmarks

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Send `payload`, read the same bytes back.
fn round_trip(stream: &mut TcpStream, payload: &[u8], buf: &mut [u8]) -> Result<(), String> {
    if payload.is_empty() {
        return Ok(());
    }
    stream
        .write_all(payload)
        .map_err(|e| format!("sending payload: {e}"))?;
    stream
        .read_exact(&mut buf[..payload.len()])
        .map_err(|e| format!("reading echo: {e}"))?;
    if &buf[..payload.len()] != payload {
        return Err("echo differs from payload".into());
    }
    Ok(())
}

/// Latency percentiles in microseconds, shared by the bench reports.
#[derive(Serialize)]
struct Latency {
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    max_us: u64,
}

impl Latency {
    /// From latencies sorted ascending.
    fn of(sorted: &[u64]) -> Latency {
        Latency {
            p50_us: percentile(sorted, 50.0),
            p90_us: percentile(sorted, 90.0),
            p99_us: percentile(sorted, 99.0),
            max_us: sorted.last().copied().unwrap_or(0),
        }
    }
}

#[derive(Serialize)]
struct ConnectReport {
    connections: u64,
    errors: u64,
    seconds: f64,
    conn_per_sec: f64,
    #[serde(flatten)]
    latency: Latency,
    /// connect() alone (SYN, SYN-ACK: through the capture path, before the proxy acts).
    connect_p50_us: u64,
    connect_p99_us: u64,
    first_error: Option<String>,
}

fn bench_connect(argv: &[String]) -> ExitCode {
    let parsed = (|| -> Result<_, String> {
        let args = Args::parse(
            argv,
            &["duration-ms", "concurrency", "payload", "timeout-ms"],
        )?;
        let concurrency: usize = args.num("concurrency", 4)?;
        if concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        Ok((
            args.target()?,
            args.millis("duration-ms", 3000)?,
            concurrency,
            args.num::<usize>("payload", 64)?,
            args.millis("timeout-ms", 2000)?,
        ))
    })();
    let (target, duration, concurrency, payload_len, timeout) = match parsed {
        Ok(p) => p,
        Err(e) => return usage_error("bench-connect", &e),
    };
    let payload = pseudo_random(payload_len, 7);
    let start = Instant::now();
    let deadline = start + duration;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let payload = payload.clone();
            thread::spawn(move || {
                let mut latencies = Vec::new();
                let mut connects = Vec::new();
                let mut errors = 0u64;
                let mut first_error = None;
                let mut buf = vec![0u8; payload.len()];
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let result = connect(target, None, timeout).and_then(|mut s| {
                        // connect() alone: what the capture path itself costs.
                        let connected = t0.elapsed();
                        read_hello(&mut s)?;
                        round_trip(&mut s, &payload, &mut buf).map(|()| connected)
                    });
                    match result {
                        Ok(connected) => {
                            latencies.push(t0.elapsed().as_micros() as u64);
                            connects.push(connected.as_micros() as u64);
                        }
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e);
                            thread::sleep(Duration::from_millis(1));
                        }
                    }
                }
                (latencies, connects, errors, first_error)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut connects = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for w in workers {
        let (l, c, e, f) = w.join().expect("worker panicked");
        latencies.extend(l);
        connects.extend(c);
        errors += e;
        if first_error.is_none() {
            first_error = f;
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    latencies.sort_unstable();
    connects.sort_unstable();
    print_json(&ConnectReport {
        connect_p50_us: percentile(&connects, 50.0),
        connect_p99_us: percentile(&connects, 99.0),
        connections: latencies.len() as u64,
        errors,
        seconds,
        conn_per_sec: latencies.len() as f64 / seconds,
        latency: Latency::of(&latencies),
        first_error,
    });
    ExitCode::SUCCESS
}

#[derive(Serialize)]
struct RrReport {
    round_trips: u64,
    errors: u64,
    seconds: f64,
    rtt_per_sec: f64,
    #[serde(flatten)]
    latency: Latency,
    first_error: Option<String>,
}

fn bench_rr(argv: &[String]) -> ExitCode {
    let parsed = (|| -> Result<_, String> {
        let args = Args::parse(argv, &["duration-ms", "payload", "timeout-ms"])?;
        let payload: usize = args.num("payload", 64)?;
        if payload == 0 {
            return Err("--payload must be at least 1".into());
        }
        Ok((
            args.target()?,
            args.millis("duration-ms", 3000)?,
            payload,
            args.millis("timeout-ms", 2000)?,
        ))
    })();
    let (target, duration, payload_len, timeout) = match parsed {
        Ok(p) => p,
        Err(e) => return usage_error("bench-rr", &e),
    };
    let payload = pseudo_random(payload_len, 11);
    let mut buf = vec![0u8; payload_len];
    let mut latencies = Vec::new();
    let mut errors = 0u64;
    let mut first_error = None;
    let start = Instant::now();
    let deadline = start + duration;
    let mut conn: Option<TcpStream> = None;
    while Instant::now() < deadline {
        let stream = match conn.as_mut() {
            Some(s) => s,
            None => match connect(target, None, timeout).and_then(|mut s| {
                read_hello(&mut s)?;
                Ok(s)
            }) {
                Ok(s) => conn.insert(s),
                Err(e) => {
                    errors += 1;
                    first_error.get_or_insert(e);
                    thread::sleep(Duration::from_millis(1));
                    continue;
                }
            },
        };
        let t0 = Instant::now();
        match round_trip(stream, &payload, &mut buf) {
            Ok(()) => latencies.push(t0.elapsed().as_micros() as u64),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e);
                conn = None; // reconnect
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    latencies.sort_unstable();
    print_json(&RrReport {
        round_trips: latencies.len() as u64,
        errors,
        seconds,
        rtt_per_sec: latencies.len() as f64 / seconds,
        latency: Latency::of(&latencies),
        first_error,
    });
    ExitCode::SUCCESS
}

// ---------------------------------------------------------------- probe

fn probe(argv: &[String]) -> ExitCode {
    let parsed = Args::parse(argv, &["timeout-ms"])
        .and_then(|a| Ok((a.target()?, a.millis("timeout-ms", 200)?)));
    let (target, timeout) = match parsed {
        Ok(p) => p,
        Err(e) => return usage_error("probe", &e),
    };
    match sock::connect(target, None, timeout) {
        Ok(stream) => {
            print_json(&serde_json::json!({"ok": true, "cookie": sock::cookie(&stream)}));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("testapp probe: {target}: {e}");
            ExitCode::FAILURE
        }
    }
}
