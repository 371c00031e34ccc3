//! `testapp bench-rate`: a fixed-rate load generator that corrects for coordinated
//! omission (wrk2's method), for HTTP/1.1 (a POST whose body the server echoes) or the
//! TCP echo.
//!
//! Each of the N connections (threads) owns every N-th slot of a global schedule: slot
//! `i` is due at `start + i / rate`. A request is sent when its slot is due, or at once
//! if the connection is late, and its latency is counted from the slot, not from when
//! it was sent: a stall shows as the wait of every request that queued behind it, as a
//! user would see it. `--rate 0` sends as fast as each connection can (closed loop, the
//! maximum rate; latency from the send). `--new-connection yes` opens a connection per
//! request (the HTTP request says `connection: close`, as fortio does without
//! keep-alive); its latency includes the connect.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{Args, connect, percentile, print_json, pseudo_random, read_hello};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Proto {
    Http,
    Tcp,
}

struct Plan {
    target: SocketAddr,
    proto: Proto,
    /// Requests per second over all connections; 0: as fast as possible.
    rate: f64,
    connections: usize,
    new_connection: bool,
    duration: Duration,
    /// Requests due before this much of the run has passed are sent but not counted.
    warmup: Duration,
    timeout: Duration,
    payload: Vec<u8>,
}

#[derive(Serialize)]
struct RateReport {
    requests: u64,
    errors: u64,
    seconds: f64,
    per_sec: f64,
    /// The rate asked for (0: as fast as possible).
    rate: f64,
    connections: usize,
    /// Connections opened (keep-alive: N plus reconnects after errors).
    connects: u64,
    p50_us: u64,
    p90_us: u64,
    p99_us: u64,
    p999_us: u64,
    max_us: u64,
    first_error: Option<String>,
}

pub fn bench_rate(argv: &[String]) -> std::process::ExitCode {
    let plan = match parse(argv) {
        Ok(p) => p,
        Err(e) => return super::usage_error("bench-rate", &e),
    };
    // Timer slack (50 us by default) would delay every due request by up to that.
    // SAFETY: plain prctl on this thread; the workers inherit it.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0u64, 0u64, 0u64) };
    print_json(&run(&plan));
    std::process::ExitCode::SUCCESS
}

fn parse(argv: &[String]) -> Result<Plan, String> {
    let args = Args::parse(
        argv,
        &[
            "proto",
            "rate",
            "connections",
            "new-connection",
            "duration-ms",
            "warmup-ms",
            "timeout-ms",
            "payload",
        ],
    )?;
    let proto = match args.get::<String>("proto")?.as_deref() {
        None | Some("http") => Proto::Http,
        Some("tcp") => Proto::Tcp,
        Some(other) => return Err(format!("--proto {other:?}: http or tcp")),
    };
    let new_connection = match args.get::<String>("new-connection")?.as_deref() {
        None | Some("no") => false,
        Some("yes") => true,
        Some(other) => return Err(format!("--new-connection {other:?}: yes or no")),
    };
    let connections: usize = args.num("connections", 4)?;
    let rate: f64 = args.num("rate", 1000.0)?;
    let payload: usize = args.num("payload", 1024)?;
    if connections == 0 || payload == 0 || rate.is_nan() || rate < 0.0 {
        return Err("--connections and --payload must be at least 1, --rate at least 0".into());
    }
    Ok(Plan {
        target: args.target()?,
        proto,
        rate,
        connections,
        new_connection,
        duration: args.millis("duration-ms", 5000)?,
        warmup: args.millis("warmup-ms", 500)?,
        timeout: args.millis("timeout-ms", 2000)?,
        payload: pseudo_random(payload, 13),
    })
}

/// What one connection's thread measured.
#[derive(Default)]
struct Tally {
    latencies: Vec<u64>,
    errors: u64,
    connects: u64,
    first_error: Option<String>,
}

fn run(plan: &Plan) -> RateReport {
    let start = Instant::now() + Duration::from_millis(20);
    let tallies: Vec<Tally> = thread::scope(|s| {
        let workers: Vec<_> = (0..plan.connections)
            .map(|k| s.spawn(move || worker(plan, start, k)))
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("worker panicked"))
            .collect()
    });
    let seconds = (plan.duration.saturating_sub(plan.warmup)).as_secs_f64();
    let mut latencies = Vec::new();
    let (mut errors, mut connects, mut first_error) = (0, 0, None);
    for t in tallies {
        latencies.extend(t.latencies);
        errors += t.errors;
        connects += t.connects;
        first_error = first_error.or(t.first_error);
    }
    latencies.sort_unstable();
    RateReport {
        requests: latencies.len() as u64,
        errors,
        seconds,
        per_sec: latencies.len() as f64 / seconds,
        rate: plan.rate,
        connections: plan.connections,
        connects,
        p50_us: percentile(&latencies, 50.0),
        p90_us: percentile(&latencies, 90.0),
        p99_us: percentile(&latencies, 99.0),
        p999_us: percentile(&latencies, 99.9),
        max_us: latencies.last().copied().unwrap_or(0),
        first_error,
    }
}

/// Connection `k`: slots k, k+N, k+2N, ... until the run's end.
fn worker(plan: &Plan, start: Instant, k: usize) -> Tally {
    let mut tally = Tally::default();
    let end = start + plan.duration;
    let counted_from = start + plan.warmup;
    let mut conn: Option<TcpStream> = None;
    let mut buf = vec![0u8; plan.payload.len() + 512];
    let request = request_bytes(plan);
    let mut slot = k as u64;
    loop {
        let due = if plan.rate > 0.0 {
            start + Duration::from_secs_f64(slot as f64 / plan.rate)
        } else {
            Instant::now().max(start)
        };
        if due >= end {
            return tally;
        }
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        let result = one_request(plan, &mut conn, &mut tally, &request, &mut buf);
        let done = Instant::now();
        match result {
            Ok(()) if due >= counted_from => {
                tally
                    .latencies
                    .push(done.duration_since(due).as_micros() as u64);
            }
            Ok(()) => {}
            Err(e) => {
                conn = None;
                if due >= counted_from {
                    tally.errors += 1;
                    tally.first_error.get_or_insert(e);
                }
            }
        }
        if plan.new_connection {
            conn = None;
        }
        slot += plan.connections as u64;
    }
}

fn request_bytes(plan: &Plan) -> Vec<u8> {
    match plan.proto {
        Proto::Tcp => plan.payload.clone(),
        Proto::Http => {
            let close = if plan.new_connection {
                "connection: close\r\n"
            } else {
                ""
            };
            let mut r = format!(
                "POST /echo HTTP/1.1\r\nhost: echo\r\ncontent-type: application/octet-stream\r\n\
                 content-length: {}\r\n{close}\r\n",
                plan.payload.len()
            )
            .into_bytes();
            r.extend_from_slice(&plan.payload);
            r
        }
    }
}

fn one_request(
    plan: &Plan,
    conn: &mut Option<TcpStream>,
    tally: &mut Tally,
    request: &[u8],
    buf: &mut [u8],
) -> Result<(), String> {
    if conn.is_none() {
        let mut stream = connect(plan.target, None, plan.timeout)?;
        tally.connects += 1;
        if plan.proto == Proto::Tcp {
            read_hello(&mut stream)?;
        }
        *conn = Some(stream);
    }
    let stream = conn.as_mut().expect("connected above");
    stream
        .write_all(request)
        .map_err(|e| format!("sending the request: {e}"))?;
    let body = match plan.proto {
        Proto::Tcp => {
            let n = plan.payload.len();
            stream
                .read_exact(&mut buf[..n])
                .map_err(|e| format!("reading the echo: {e}"))?;
            &buf[..n]
        }
        Proto::Http => read_response(stream, buf)?,
    };
    if body != plan.payload.as_slice() {
        return Err(format!(
            "the echo differs from the payload ({} bytes back)",
            body.len()
        ));
    }
    Ok(())
}

/// One HTTP/1.1 response with a `content-length` body into `buf`; its body. Anything
/// but a 200 is an error naming the status line.
fn read_response<'b>(stream: &mut TcpStream, buf: &'b mut [u8]) -> Result<&'b [u8], String> {
    let mut have = 0;
    let head_end = loop {
        if let Some(i) = find(&buf[..have], b"\r\n\r\n") {
            break i + 4;
        }
        if have == buf.len() {
            return Err("response head longer than the buffer".into());
        }
        match stream.read(&mut buf[have..]) {
            Ok(0) => return Err(format!("connection closed after {have} bytes of response")),
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the response: {e}")),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let status = head.lines().next().unwrap_or_default();
    if !status.starts_with("HTTP/1.1 200") {
        return Err(format!("status {status:?}"));
    }
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .ok_or_else(|| format!("no content-length in {head:?}"))?;
    let total = head_end + length;
    if total > buf.len() {
        return Err(format!("a {length}-byte body: longer than the payload"));
    }
    while have < total {
        match stream.read(&mut buf[have..total]) {
            Ok(0) => {
                return Err(format!(
                    "connection closed {} bytes into the body",
                    have - head_end
                ));
            }
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the body: {e}")),
        }
    }
    Ok(&buf[head_end..total])
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
