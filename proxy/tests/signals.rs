//! `shunt proxy -c` and the signals a process gets in production, treated as Envoy
//! treats them: SIGHUP is ignored, SIGUSR1 reopens the access log files (logrotate),
//! SIGTERM drains (the listeners close, open connections finish, then the process exits
//! 0). The built binary on 127.0.0.1, as in `static_bootstrap.rs`. Needs no privileges.

mod common;

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::mpsc;
use std::thread;

use common::*;

fn send_signal(shunt: &Shunt, signal: &str) {
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &shunt.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{signal}");
}

/// Waits for shunt to log `what` on stderr (it handled the signal); fails at once if
/// the signal killed it instead.
fn logged(shunt: &mut Shunt, what: &str) {
    let child = &mut shunt.child;
    shunt.stderr.wait_for(what, |line| {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("shunt exited with {status}");
        }
        line.contains(what).then_some(())
    });
}

/// Waits until connects to `addr` are refused: the listener closed.
fn wait_refused(shunt: &mut Shunt, addr: SocketAddr) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while !refused(addr) {
        assert!(std::time::Instant::now() < deadline, "{addr} still accepts");
        thread::sleep(std::time::Duration::from_millis(10));
    }
    still_running(shunt);
}

fn still_running(shunt: &mut Shunt) {
    if let Some(status) = shunt.child.try_wait().unwrap() {
        panic!(
            "shunt exited with {status}:\n{}",
            shunt.stderr.snapshot().join("\n")
        );
    }
}

#[test]
fn sighup_is_ignored_and_traffic_goes_on() {
    let a = echo("A");
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: a")],
        &[cluster("a", "", &[a.addr])],
    ));
    let front = shunt.listening("front");
    assert_eq!(call(front).0.as_deref(), Some("A"));
    send_signal(&shunt, "HUP");
    logged(&mut shunt, "SIGHUP: ignored");
    still_running(&mut shunt);
    assert_eq!(call(front).0.as_deref(), Some("A"));
    send_signal(&shunt, "HUP");
    assert_eq!(call(front).0.as_deref(), Some("A"));
    still_running(&mut shunt);
}

/// The bootstrap is a FIFO, so shunt is held while loading it: the signals sent then
/// find no tokio handler yet, and must not take the process down.
#[test]
fn signals_while_the_bootstrap_loads_do_not_kill_the_proxy() {
    let a = echo("A");
    let fifo = std::env::temp_dir().join(format!("shunt-signals-{}.yaml", std::process::id()));
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success(), "mkfifo");
    let mut shunt = Shunt::spawn(fifo.clone(), &[]);
    // Until a writer opens the FIFO, shunt sits in openat(2) (x86_64: 257).
    let syscall = format!("/proc/{}/syscall", shunt.child.id());
    let deadline = std::time::Instant::now() + PATIENCE;
    while !std::fs::read_to_string(&syscall).is_ok_and(|s| s.starts_with("257 ")) {
        assert!(
            std::time::Instant::now() < deadline,
            "shunt never opened its bootstrap"
        );
        still_running(&mut shunt);
        thread::sleep(std::time::Duration::from_millis(5));
    }
    send_signal(&shunt, "HUP");
    send_signal(&shunt, "USR1");
    // Non-blocking: with no reader left (the signal killed shunt) the open fails with
    // ENXIO instead of waiting forever.
    let mut writer = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap_or_else(|e| panic!("shunt no longer reads its bootstrap: {e}"))
    };
    let yaml = bootstrap(
        &[listener("front", "cluster: a")],
        &[cluster("a", "", &[a.addr])],
    );
    writer.write_all(yaml.as_bytes()).unwrap();
    drop(writer);
    let front = shunt.listening("front");
    assert_eq!(call(front).0.as_deref(), Some("A"));
    still_running(&mut shunt);
}

/// The access log lines in `path` (none if it does not exist), as JSON.
fn log_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn logs_client(path: &Path, client: SocketAddr) -> bool {
    log_lines(path)
        .iter()
        .any(|l| l["downstream_remote_address"] == client.to_string().as_str())
}

/// Waits until the line of `client` is in `path` (written when its connection ends).
fn wait_logged(path: &Path, client: SocketAddr) {
    let deadline = std::time::Instant::now() + PATIENCE;
    while !logs_client(path, client) {
        assert!(
            std::time::Instant::now() < deadline,
            "no line for {client} in {}",
            path.display()
        );
        thread::sleep(std::time::Duration::from_millis(20));
    }
}

#[test]
fn sigusr1_reopens_the_access_log_file_after_logrotate_moved_it() {
    let a = echo("A");
    let dir = std::env::temp_dir().join(format!("shunt-signals-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("access.log");
    let rotated = dir.join("access.log.1");
    let file_log = format!(
        "{{name: file, typed_config: {{'@type': type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog, path: {}}}}}",
        path.display()
    );
    let tcp = format!(
        "  - name: front\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
         filter_chains:\n    - filters:\n      - name: envoy.filters.network.tcp_proxy\n        \
         typed_config: {{'@type': {TCP_PROXY}, stat_prefix: front, access_log: [{file_log}], cluster: a}}\n"
    );
    let mut shunt = Shunt::start(&bootstrap(&[tcp], &[cluster("a", "", &[a.addr])]));
    let front = shunt.listening("front");

    let (_, before) = call(front);
    wait_logged(&path, before);
    // logrotate: move the file away, then tell the proxy.
    std::fs::rename(&path, &rotated).unwrap();
    send_signal(&shunt, "USR1");
    logged(&mut shunt, "SIGUSR1: access logs reopened");
    still_running(&mut shunt);

    let (greeting, after) = call(front);
    assert_eq!(greeting.as_deref(), Some("A"));
    wait_logged(&path, after);
    assert!(!logs_client(&path, before), "the new file starts empty");
    assert!(logs_client(&rotated, before));
    assert!(
        !logs_client(&rotated, after),
        "a line went on into the rotated file"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// An HTTP/1.1 upstream that answers each request's head and the first half of its
/// body at once, and the rest only when the test says so (`release`).
fn slow_upstream() -> (SocketAddr, mpsc::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (release, released) = mpsc::channel::<()>();
    thread::spawn(move || {
        let Ok((stream, _)) = listener.accept() else {
            return;
        };
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
            line.clear();
        }
        let mut stream = stream;
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst")
            .unwrap();
        let _ = released.recv();
        let _ = stream.write_all(b"-last");
        // Hold the connection open: the response's end is its length, not a close.
        let mut rest = Vec::new();
        let _ = reader.read_to_end(&mut rest);
    });
    (addr, release)
}

const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

fn refused(addr: SocketAddr) -> bool {
    match TcpStream::connect(addr) {
        Err(err) => err.kind() == ErrorKind::ConnectionRefused,
        Ok(_) => false,
    }
}

#[test]
fn sigterm_drains_an_http_response_in_flight_refuses_new_connects_and_exits_0() {
    let (slow, release) = slow_upstream();
    let http = format!(
        "  - name: http\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
         filter_chains:\n    - filters:\n      - name: envoy.filters.network.http_connection_manager\n        \
         typed_config:\n          '@type': {HCM}\n          stat_prefix: ing\n          \
         http_filters: [{{name: envoy.filters.http.router, typed_config: {{'@type': {ROUTER}}}}}]\n          \
         route_config: {{virtual_hosts: [{{name: all, domains: ['*'], routes: [{{match: {{prefix: /}}, route: {{cluster: slow, timeout: 0s}}}}]}}]}}\n"
    );
    let mut shunt = Shunt::start(&bootstrap(&[http], &[cluster("slow", "", &[slow])]));
    let proxy = shunt.listening("http");

    // A keep-alive request whose response is half sent.
    let stream = TcpStream::connect(proxy).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    (&stream)
        .write_all(b"GET /slow HTTP/1.1\r\nhost: h\r\n\r\n")
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut head = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let mut first = [0u8; 5];
    reader.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"first");

    send_signal(&shunt, "TERM");
    // The listener closes; the process stays for the response in flight.
    wait_refused(&mut shunt, proxy);

    // The response completes, then the drained connection closes (no keep-alive).
    release.send(()).unwrap();
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, b"-last");
    let status = shunt.wait_exit();
    assert!(status.success(), "{status}");
}

#[test]
fn sigterm_lets_an_open_tcp_transfer_finish_then_exits_0() {
    let a = echo("A");
    let mut shunt = Shunt::start(&bootstrap(
        &[listener("front", "cluster: a")],
        &[cluster("a", "", &[a.addr])],
    ));
    let front = shunt.listening("front");
    let stream = TcpStream::connect(front).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut greeting = String::new();
    reader.read_line(&mut greeting).unwrap();
    assert_eq!(greeting, "A\n");

    send_signal(&shunt, "TERM");
    wait_refused(&mut shunt, front);
    // The transfer goes on.
    for i in 0..3 {
        let ping = format!("ping {i}\n");
        (&stream).write_all(ping.as_bytes()).unwrap();
        let mut echoed = String::new();
        reader.read_line(&mut echoed).unwrap();
        assert_eq!(echoed, ping);
    }
    still_running(&mut shunt);
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    reader.read_to_end(&mut rest).unwrap();
    let status = shunt.wait_exit();
    assert!(status.success(), "{status}");
}
