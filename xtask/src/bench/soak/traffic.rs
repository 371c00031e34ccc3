//! The soak's traffic: each kind paced at its own rate, every outcome counted, every
//! failure kept with when it happened (for the verdict to tell expected from
//! unexpected ones against the flapper's windows).
//!
//! Our own clients (std, blocking, in the proxy pod's netns) speak HTTP/1.1 and the echo
//! protocol and check what came back; h2 is h2load's, mTLS from outside is curl's.

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{Ipv4Addr, Shutdown, SocketAddr, TcpStream},
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use harness::Pod;

use super::config::{HTTP_PORT, MTLS_IN_PORT, MTLS_OUT_PORT, SERVER_NAME, TCP_PORT, Tls};

/// The kinds of traffic, in the order of the counters and the table's columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// HTTP/1.1 on kept-alive connections to `http`.
    H1KeepAlive,
    /// HTTP/1.1, a new connection per request (`connection: close`).
    H1New,
    /// h2c from h2load, several streams per connection, new connections every batch.
    H2,
    /// Echo connections through `tcp`, 64 KiB each, and a bulk 8 MiB one now and then.
    Tcp,
    /// HTTP/1.1 kept alive to `mtls-out`, which goes over mTLS to `mtls-in`.
    Mtls,
    /// curl with a client certificate straight to `mtls-in`, a handshake per batch.
    MtlsCurl,
}

pub(crate) const KINDS: [Kind; 6] = [
    Kind::H1KeepAlive,
    Kind::H1New,
    Kind::H2,
    Kind::Tcp,
    Kind::Mtls,
    Kind::MtlsCurl,
];

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::H1KeepAlive => "h1-keepalive",
            Kind::H1New => "h1-new",
            Kind::H2 => "h2",
            Kind::Tcp => "tcp",
            Kind::Mtls => "mtls",
            Kind::MtlsCurl => "mtls-curl",
        }
    }
}

/// A failure (or `count` of them in one h2load or curl batch) between `from` and `to`
/// since the start, and what it was.
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct Failure {
    pub(crate) kind: &'static str,
    pub(crate) from_s: f64,
    pub(crate) to_s: f64,
    pub(crate) count: u64,
    pub(crate) what: String,
}

/// Failures kept in full; beyond this only counted.
const KEEP_FAILURES: usize = 10_000;

/// The counters every worker adds to, and the stop flag they watch.
pub(crate) struct Traffic {
    pub(crate) start: Instant,
    /// The same moment by the wall clock (h2load's log uses it).
    start_wall: SystemTime,
    pub(crate) stop: AtomicBool,
    ok: [AtomicU64; KINDS.len()],
    failed: [AtomicU64; KINDS.len()],
    failures: Mutex<Vec<Failure>>,
    /// Requests per second of each kind at `--rate 1`.
    rate: f64,
}

impl Traffic {
    pub(crate) fn new(rate: f64) -> Traffic {
        Traffic {
            start: Instant::now(),
            start_wall: SystemTime::now(),
            stop: AtomicBool::new(false),
            ok: Default::default(),
            failed: Default::default(),
            failures: Mutex::default(),
            rate,
        }
    }

    fn index(kind: Kind) -> usize {
        KINDS.iter().position(|k| *k == kind).expect("a kind")
    }

    pub(crate) fn ok(&self, kind: Kind) -> u64 {
        self.ok[Self::index(kind)].load(Ordering::Relaxed)
    }

    pub(crate) fn failed(&self, kind: Kind) -> u64 {
        self.failed[Self::index(kind)].load(Ordering::Relaxed)
    }

    pub(crate) fn failures(&self) -> Vec<Failure> {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn add_ok(&self, kind: Kind, n: u64) {
        self.ok[Self::index(kind)].fetch_add(n, Ordering::Relaxed);
    }

    /// `count` failures of `kind` between `from` and now.
    fn add_failed(&self, kind: Kind, from: Instant, count: u64, what: String) {
        let from_s = (from - self.start).as_secs_f64();
        self.add_failed_at(
            kind,
            from_s,
            self.start.elapsed().as_secs_f64(),
            count,
            what,
        );
    }

    /// `count` failures of `kind` between `from_s` and `to_s` since the start.
    fn add_failed_at(&self, kind: Kind, from_s: f64, to_s: f64, count: u64, what: String) {
        self.failed[Self::index(kind)].fetch_add(count, Ordering::Relaxed);
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if failures.len() < KEEP_FAILURES {
            failures.push(Failure {
                kind: kind.name(),
                from_s,
                to_s,
                count,
                what,
            });
        }
    }

    /// Seconds since the start of a time given in microseconds since the Unix epoch.
    fn since_epoch_us(&self, us: u64) -> f64 {
        let start_us = self
            .start_wall
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        (us as f64 - start_us as f64) / 1e6
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Calls `once` `per_s` times a second (scaled by `--rate`) until stopped; a slow
    /// call is not made up for.
    fn paced(&self, per_s: f64, mut once: impl FnMut()) {
        let interval = Duration::from_secs_f64(1.0 / (per_s * self.rate));
        let mut next = Instant::now();
        while !self.stopped() {
            once();
            next += interval;
            let now = Instant::now();
            if next > now {
                std::thread::sleep(next - now);
            } else {
                next = now;
            }
        }
    }
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// How long a client waits for a connect or a read before calling it a failure.
const TIMEOUT: Duration = Duration::from_secs(10);

fn connect(port: u16) -> Result<TcpStream, String> {
    let stream =
        TcpStream::connect_timeout(&local(port), TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| format!("socket options: {e}"))?;
    Ok(stream)
}

/// One HTTP/1.1 client connection.
struct H1 {
    reader: BufReader<TcpStream>,
}

impl H1 {
    fn connect(port: u16) -> Result<H1, String> {
        Ok(H1 {
            reader: BufReader::new(connect(port)?),
        })
    }

    /// GET `path`: Ok(whether the connection stays open) for a 200 whose body is the
    /// upstream's greeting; otherwise what went wrong.
    fn get(&mut self, path: &str, close: bool) -> Result<bool, String> {
        let request = format!(
            "GET {path} HTTP/1.1\r\nhost: soak.example\r\n{}\r\n",
            if close { "connection: close\r\n" } else { "" }
        );
        self.reader
            .get_mut()
            .write_all(request.as_bytes())
            .map_err(|e| format!("write: {e}"))?;
        let mut line = String::new();
        let read_line = |reader: &mut BufReader<TcpStream>, line: &mut String| {
            line.clear();
            match reader.read_line(line) {
                Ok(0) => Err("EOF before a full response".to_owned()),
                Ok(_) => Ok(()),
                Err(e) => Err(format!("read: {e}")),
            }
        };
        read_line(&mut self.reader, &mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| format!("malformed status line {line:?}"))?;
        let (mut length, mut keep) = (0usize, !close);
        loop {
            read_line(&mut self.reader, &mut line)?;
            if line == "\r\n" {
                break;
            }
            let lower = line.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v
                    .trim()
                    .parse()
                    .map_err(|_| format!("bad content-length {line:?}"))?;
            }
            if lower.starts_with("connection:") && lower.contains("close") {
                keep = false;
            }
        }
        let mut body = vec![0; length];
        self.reader
            .read_exact(&mut body)
            .map_err(|e| format!("reading the body: {e}"))?;
        if status != 200 {
            return Err(format!(
                "status {status}: {}",
                String::from_utf8_lossy(&body).trim()
            ));
        }
        if !body.starts_with(b"HELLO ") {
            return Err(format!(
                "200 without the upstream's greeting: {:?}",
                String::from_utf8_lossy(&body)
            ));
        }
        Ok(keep)
    }
}

/// One request through `http` and `mtls-out` and one echo connection through `tcp`,
/// before the soak starts: a configuration that cannot carry traffic fails at once.
pub(crate) fn check() -> Result<(), String> {
    for port in [HTTP_PORT, MTLS_OUT_PORT] {
        H1::connect(port)
            .and_then(|mut c| c.get("/", true))
            .map_err(|e| format!("GET / through 127.0.0.1:{port}: {e}"))?;
    }
    echo(1024, 0).map_err(|e| format!("echo through 127.0.0.1:{TCP_PORT}: {e}"))
}

const PATHS: [&str; 3] = ["/", "/a", "/b"];

/// HTTP/1.1 requests on one kept-alive connection to `port` (a new one after a
/// failure or a `connection: close`), `per_s` a second.
pub(crate) fn h1_keepalive(traffic: &Traffic, kind: Kind, port: u16, per_s: f64) {
    let mut conn: Option<H1> = None;
    let mut n = 0usize;
    traffic.paced(per_s, || {
        let from = Instant::now();
        n += 1;
        let result = match conn.as_mut() {
            Some(c) => c.get(PATHS[n % PATHS.len()], false),
            None => H1::connect(port).and_then(|mut c| {
                let keep = c.get(PATHS[n % PATHS.len()], false);
                conn = Some(c);
                keep
            }),
        };
        match result {
            Ok(keep) => {
                traffic.add_ok(kind, 1);
                if !keep {
                    conn = None;
                }
            }
            Err(what) => {
                traffic.add_failed(kind, from, 1, what);
                conn = None;
            }
        }
    });
}

/// A new connection per HTTP/1.1 request to `http`.
pub(crate) fn h1_new(traffic: &Traffic, per_s: f64) {
    let mut n = 0usize;
    traffic.paced(per_s, || {
        let from = Instant::now();
        n += 1;
        match H1::connect(HTTP_PORT).and_then(|mut c| c.get(PATHS[n % PATHS.len()], true)) {
            Ok(_) => traffic.add_ok(Kind::H1New, 1),
            Err(what) => traffic.add_failed(Kind::H1New, from, 1, what),
        }
    });
}

/// Echo connections through `tcp`, `bytes` each: the greeting, then every byte sent
/// must come back (16 KiB at a time), then a clean EOF.
pub(crate) fn tcp(traffic: &Traffic, per_s: f64, bytes: usize) {
    let mut seed = 0u8;
    traffic.paced(per_s, || {
        let from = Instant::now();
        seed = seed.wrapping_add(1);
        match echo(bytes, seed) {
            Ok(()) => traffic.add_ok(Kind::Tcp, 1),
            Err(what) => traffic.add_failed(Kind::Tcp, from, 1, format!("{bytes} B: {what}")),
        }
    });
}

fn echo(bytes: usize, seed: u8) -> Result<(), String> {
    let mut reader = BufReader::new(connect(TCP_PORT)?);
    let mut hello = String::new();
    reader
        .read_line(&mut hello)
        .map_err(|e| format!("reading the greeting: {e}"))?;
    if !hello.starts_with("HELLO ") {
        return Err(format!("no greeting but {hello:?}"));
    }
    const CHUNK: usize = 16 * 1024;
    let chunk: Vec<u8> = (0..CHUNK)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect();
    let mut back = vec![0; CHUNK];
    let mut sent = 0;
    while sent < bytes {
        let n = CHUNK.min(bytes - sent);
        reader
            .get_mut()
            .write_all(&chunk[..n])
            .map_err(|e| format!("write after {sent} B: {e}"))?;
        reader
            .read_exact(&mut back[..n])
            .map_err(|e| format!("reading the echo after {sent} B: {e}"))?;
        if back[..n] != chunk[..n] {
            return Err(format!(
                "the echo after {sent} B differs from what was sent"
            ));
        }
        sent += n;
    }
    reader
        .get_mut()
        .shutdown(Shutdown::Write)
        .map_err(|e| format!("shutdown: {e}"))?;
    let mut rest = Vec::new();
    reader
        .read_to_end(&mut rest)
        .map_err(|e| format!("waiting for EOF: {e}"))?;
    if !rest.is_empty() {
        return Err(format!("{} B more than was sent", rest.len()));
    }
    Ok(())
}

/// h2load batches of `batch_s` seconds: 2 clients (connections) of 4 streams each,
/// `per_s` requests a second in all, to `http`. Its per-request log (`log`) dates each
/// failed request; failures it counted but did not log (a connection that failed)
/// span the batch.
pub(crate) fn h2(traffic: &Traffic, pod: &Pod, per_s: f64, batch_s: u64, log: &Path) {
    let rps = ((per_s * traffic.rate / 2.0).round() as u64).max(1);
    while !traffic.stopped() {
        let from = Instant::now();
        let _ = std::fs::remove_file(log);
        let out = pod
            .command("h2load")
            .args(["-c", "2", "-m", "4", "--rps", &rps.to_string(), "-D"])
            .arg(batch_s.to_string())
            .arg("--log-file")
            .arg(log)
            .arg(format!("http://127.0.0.1:{HTTP_PORT}/"))
            .timeout(Duration::from_secs(batch_s + 30))
            .output();
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                traffic.add_failed(Kind::H2, from, 1, format!("h2load: {e:#}"));
                continue;
            }
        };
        let text = String::from_utf8_lossy(&out.stdout);
        let Some((ok, failed, detail)) = h2load_counts(&text) else {
            traffic.add_failed(
                Kind::H2,
                from,
                1,
                format!(
                    "h2load ({}) printed no counts: {}{}",
                    out.status,
                    text.trim(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            );
            continue;
        };
        traffic.add_ok(Kind::H2, ok);
        let mut logged = 0;
        for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
            let mut fields = line.split('\t');
            let (Some(start_us), Some(status), Some(took_us)) =
                (fields.next(), fields.next(), fields.next())
            else {
                continue;
            };
            if status.starts_with('2') || logged >= failed {
                continue;
            }
            let (Ok(start_us), Ok(took_us)) = (start_us.parse::<u64>(), took_us.parse::<u64>())
            else {
                continue;
            };
            let at = traffic.since_epoch_us(start_us);
            traffic.add_failed_at(
                Kind::H2,
                at,
                at + took_us as f64 / 1e6,
                1,
                format!("h2 request: status {status} ({detail})"),
            );
            logged += 1;
        }
        if failed > logged || !out.status.success() {
            traffic.add_failed(
                Kind::H2,
                from,
                (failed - logged).max(1),
                format!("h2load ({}): {detail}", out.status),
            );
        }
    }
}

/// h2load's `requests:` line: (succeeded, failed, that line and the status codes').
fn h2load_counts(text: &str) -> Option<(u64, u64, String)> {
    let requests = text.lines().find(|l| l.starts_with("requests: "))?;
    let count = |what: &str| -> Option<u64> {
        requests
            .trim_start_matches("requests: ")
            .split(", ")
            .find_map(|f| f.strip_suffix(what))
            .and_then(|n| n.trim().parse().ok())
    };
    let codes = text
        .lines()
        .find(|l| l.starts_with("status codes: "))
        .unwrap_or("");
    Some((
        count(" succeeded")?,
        count(" failed")?,
        format!("{requests}; {codes}"),
    ))
}

/// curl with the client certificate straight to `mtls-in`: `per_batch` requests on one
/// connection (one handshake), `batches_per_s` times a second.
pub(crate) fn mtls_curl(
    traffic: &Traffic,
    pod: &Pod,
    tls: &Tls,
    batches_per_s: f64,
    per_batch: usize,
) {
    let at = pod.ipv4();
    let url = format!("https://{SERVER_NAME}:{MTLS_IN_PORT}/");
    traffic.paced(batches_per_s, || {
        let from = Instant::now();
        let mut cmd = pod
            .command("curl")
            .args(["-sS", "--http1.1", "--max-time", "10"])
            .args(["--cacert", &tls.file("ca.pem")])
            .args(["--cert", &tls.file("client.pem")])
            .args(["--key", &tls.file("client.key")])
            .args(["--resolve", &format!("{SERVER_NAME}:{MTLS_IN_PORT}:{at}")])
            .args(["-w", "%{http_code}\\n"]);
        for _ in 0..per_batch {
            cmd = cmd.args(["-o", "/dev/null", &url]);
        }
        let out = match cmd.timeout(Duration::from_secs(30)).output() {
            Ok(out) => out,
            Err(e) => {
                traffic.add_failed(Kind::MtlsCurl, from, per_batch as u64, format!("{e:#}"));
                return;
            }
        };
        let codes = String::from_utf8_lossy(&out.stdout);
        let ok = codes.lines().filter(|c| *c == "200").count();
        traffic.add_ok(Kind::MtlsCurl, ok as u64);
        if ok < per_batch {
            traffic.add_failed(
                Kind::MtlsCurl,
                from,
                (per_batch - ok) as u64,
                format!(
                    "curl ({}): codes {:?}: {}",
                    out.status,
                    codes.lines().collect::<Vec<_>>(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::h2load_counts;

    #[test]
    fn reads_h2loads_summary() {
        let out = "finished in 5.00s, 299.80 req/s, 26.35KB/s\n\
                   requests: 1500 total, 1500 started, 1499 done, 1497 succeeded, 3 failed, 2 errored, 0 timeout\n\
                   status codes: 1497 2xx, 0 3xx, 0 4xx, 1 5xx\n";
        let (ok, failed, detail) = h2load_counts(out).expect("counts");
        assert_eq!((ok, failed), (1497, 3));
        assert!(detail.contains("1 5xx"), "{detail}");
        assert_eq!(h2load_counts("connect: Connection refused\n"), None);
    }
}
