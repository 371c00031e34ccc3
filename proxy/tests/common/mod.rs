//! What the tests of `shunt proxy -c` share: running the built binary on a bootstrap,
//! following what it prints, echo upstreams, and asking the admin API over HTTP/1.1.
#![allow(dead_code, reason = "each test binary uses its own part")]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// Generous bound for things that should happen promptly; never a measured threshold.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// An upstream that greets each connection with its name and a newline, then echoes.
pub struct Echo {
    pub addr: SocketAddr,
}

pub fn echo(name: &'static str) -> Echo {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            thread::spawn(move || {
                let _ = stream.write_all(format!("{name}\n").as_bytes());
                let mut buf = [0u8; 16 * 1024];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if stream.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    }
                }
                let _ = stream.shutdown(Shutdown::Write);
            });
        }
    });
    Echo { addr }
}

/// A port with nothing listening: connects to it are refused.
pub fn closed_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Lines a child wrote, shared with the thread that reads them.
#[derive(Default)]
pub struct Lines {
    lines: Mutex<Vec<String>>,
    grew: Condvar,
}

impl Lines {
    pub fn follow(self: &Arc<Self>, reader: impl Read + Send + 'static) {
        let lines = self.clone();
        thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { break };
                lines.lines.lock().unwrap().push(line);
                lines.grew.notify_all();
            }
        });
    }

    /// Waits for a line `pick` accepts and returns what it made of it.
    pub fn wait_for<T>(&self, what: &str, mut pick: impl FnMut(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + PATIENCE;
        let mut lines = self.lines.lock().unwrap();
        loop {
            if let Some(found) = lines.iter().find_map(|l| pick(l)) {
                return found;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "gave up waiting for {what}; saw:\n{}",
                lines.join("\n")
            );
            lines = self.grew.wait_timeout(lines, left).unwrap().0;
        }
    }

    pub fn snapshot(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }
}

/// A running `shunt proxy -c FILE`.
pub struct Shunt {
    pub child: Child,
    pub stdout: Arc<Lines>,
    pub stderr: Arc<Lines>,
    _config: TempFile,
}

/// A file removed when dropped.
pub struct TempFile(pub PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Drop for Shunt {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Shunt {
    /// `shunt proxy --keep-user -c FILE` on a YAML bootstrap.
    pub fn start(yaml: &str) -> Shunt {
        Shunt::start_with("yaml", yaml, &[])
    }

    /// `shunt proxy --keep-user ARGS -c FILE`, FILE holding `config` with extension `ext`.
    pub fn start_with(ext: &str, config: &str, args: &[&str]) -> Shunt {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "shunt-static-{}-{}.{ext}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, config).unwrap();
        Shunt::spawn(path, args)
    }

    /// `shunt proxy --keep-user ARGS -c PATH`; PATH is removed when the proxy is.
    pub fn spawn(path: std::path::PathBuf, args: &[&str]) -> Shunt {
        let mut child = Command::new(env!("CARGO_BIN_EXE_shunt"))
            .args(["proxy", "--keep-user", "--log-level", "info"])
            .args(args)
            .arg("-c")
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run shunt");
        let (stdout, stderr) = (Arc::new(Lines::default()), Arc::new(Lines::default()));
        stdout.follow(child.stdout.take().unwrap());
        stderr.follow(child.stderr.take().unwrap());
        Shunt {
            child,
            stdout,
            stderr,
            _config: TempFile(path),
        }
    }

    /// The address listener `name` was bound to (port 0 in the config).
    pub fn listening(&mut self, name: &str) -> SocketAddr {
        let key = format!("listener={name} ");
        let child = &mut self.child;
        self.stderr.wait_for(&format!("listener {name}"), |line| {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("shunt exited with {status}");
            }
            if !line.contains(" listening ") || !line.contains(&key) {
                return None;
            }
            line.split("addr=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
    }

    /// The access log entry of the connection from `client`.
    pub fn access_log(&self, client: SocketAddr) -> serde_json::Value {
        let key = client.to_string();
        self.stdout
            .wait_for(&format!("the access log line of {client}"), |line| {
                let v: serde_json::Value = serde_json::from_str(line).ok()?;
                (v["downstream_remote_address"] == key.as_str()).then_some(v)
            })
    }
    /// The admin API's address, as shunt logs it once bound.
    pub fn admin(&mut self) -> SocketAddr {
        let child = &mut self.child;
        self.stderr.wait_for("the admin address", |line| {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("shunt exited with {status}");
            }
            if !line.contains("admin API listening") {
                return None;
            }
            line.split("addr=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
    }

    /// Waits for shunt to exit by itself.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "shunt did not exit; stderr:\n{}",
                self.stderr.snapshot().join("\n")
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits for the admin API's `/ready` to answer 200 LIVE (clusters warmed, accepting).
pub fn wait_ready(admin: SocketAddr) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let ready = http(admin, "GET", "/ready");
        match (ready.status, ready.body.as_str()) {
            (200, "LIVE\n") => return,
            (503, "INITIALIZING\n") => {}
            other => panic!("/ready answered {other:?}"),
        }
        assert!(Instant::now() < deadline, "never ready");
        thread::sleep(Duration::from_millis(10));
    }
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: String,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        assert_eq!(self.status, 200, "{}", self.body);
        serde_json::from_str(&self.body).unwrap_or_else(|err| panic!("{err}: {}", self.body))
    }
}

/// One HTTP/1.1 request on its own connection, as curl would send it.
pub fn http(address: SocketAddr, method: &str, path: &str) -> Answer {
    let mut stream = TcpStream::connect(address).unwrap_or_else(|err| panic!("{address}: {err}"));
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).expect("UTF-8 answer");
    let (head, body) = raw.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: BTreeMap<String, String> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        content_type: headers.get("content-type").cloned().unwrap_or_default(),
        body: body.to_owned(),
    }
}

pub const TCP_PROXY: &str =
    "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy";
pub const STDOUT_LOG: &str = "{name: stdout, typed_config: {'@type': type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog}}";

/// A listener `name` on 127.0.0.1:0 whose one chain proxies with `tcp_proxy` (YAML flow
/// mapping body, e.g. `cluster: c`), logging to stdout.
pub fn listener(name: &str, tcp_proxy: &str) -> String {
    format!(
        "  - name: {name}\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
         filter_chains:\n    - filters:\n      - name: envoy.filters.network.tcp_proxy\n        \
         typed_config: {{'@type': {TCP_PROXY}, stat_prefix: {name}, access_log: [{STDOUT_LOG}], {tcp_proxy}}}\n"
    )
}

/// A STATIC cluster `name` over `hosts`; `extra` adds fields (`lb_policy: RANDOM, `).
pub fn cluster(name: &str, extra: &str, hosts: &[SocketAddr]) -> String {
    let endpoints: Vec<String> = hosts
        .iter()
        .map(|h| {
            format!(
                "{{endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}}}",
                h.ip(),
                h.port()
            )
        })
        .collect();
    format!(
        "  - {{name: {name}, type: STATIC, connect_timeout: 1s, {extra}load_assignment: \
         {{cluster_name: {name}, endpoints: [{{lb_endpoints: [{}]}}]}}}}\n",
        endpoints.join(", ")
    )
}

pub fn bootstrap(listeners: &[String], clusters: &[String]) -> String {
    format!(
        "static_resources:\n  listeners:\n{}  clusters:\n{}",
        listeners.concat(),
        clusters.concat()
    )
}

/// Connects through the proxy, returns the upstream's greeting after checking that the
/// bytes sent come back; `None` if the proxy closed the connection instead.
pub fn call(proxy: SocketAddr) -> (Option<String>, SocketAddr) {
    let mut stream = TcpStream::connect(proxy).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let client = stream.local_addr().unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut greeting = String::new();
    match reader.read_line(&mut greeting) {
        Ok(0) => return (None, client),
        Err(err) if err.kind() == ErrorKind::ConnectionReset => return (None, client),
        Err(err) => panic!("{err}"),
        Ok(_) => {}
    }
    stream.write_all(b"ping through shunt\n").unwrap();
    let mut echoed = String::new();
    reader.read_line(&mut echoed).unwrap();
    assert_eq!(echoed, "ping through shunt\n");
    stream.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    (Some(greeting.trim().to_owned()), client)
}

/// A listener whose accept queue is full: Linux drops further SYNs, so a connect to it
/// hangs until the cluster's `connect_timeout`. Keep the returned sockets alive.
pub fn stalled_upstream() -> (SocketAddr, Vec<TcpStream>, socket2::Socket) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    socket.listen(0).unwrap();
    let stalled = socket.local_addr().unwrap().as_socket().unwrap();
    let mut filling = Vec::new();
    while let Ok(stream) = TcpStream::connect_timeout(&stalled, Duration::from_millis(300)) {
        filling.push(stream);
        assert!(filling.len() < 64, "the accept queue never filled");
    }
    (stalled, filling, socket)
}

/// A scratch directory, removed with what it holds when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "shunt-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }

    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
