//! The HTTP connection manager on requests and responses at the protocol's edges, as
//! Envoy 1.40 answers them on the same config: a malformed chunked body, an upstream
//! response that cannot be parsed, an h2c upgrade, CONNECT, and Host headers that are
//! missing, doubled or carry a port no domain names. Raw HTTP/1.1 over 127.0.0.1 to the
//! built `shunt proxy -c`, with an in-process upstream that echoes the request head it
//! got. Needs no privileges.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::thread;

use common::*;

/// An upstream answering every request with `200` and, as its body, the request head it
/// received (lines joined by ` | `); the heads are also kept for the test.
struct Upstream {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

fn upstream() -> Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let seen = seen.clone();
            thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                loop {
                    let Some((head, length)) = read_head(&mut reader) else {
                        return;
                    };
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    seen.lock().unwrap().push(head.clone());
                    let body = format!("upstream got: {}\n", head.replace("\r\n", " | "));
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if writer.write_all(answer.as_bytes()).is_err() {
                        return;
                    }
                }
            });
        }
    });
    Upstream { addr, heads }
}

/// An upstream whose every answer is not HTTP: a status line with a bad status code.
fn garbling_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut writer = stream;
                if read_head(&mut reader).is_some() {
                    let _ = writer.write_all(b"HTTP/1.1 2x0 WHAT\r\nfoo\r\n\r\n");
                }
            });
        }
    });
    addr
}

/// A message head (without its blank line) and its content-length; `None` at EOF.
fn read_head(reader: &mut impl BufRead) -> Option<(String, usize)> {
    let mut head = String::new();
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if line == "\r\n" {
            return Some((head.trim_end().to_owned(), length));
        }
        if let Some((name, value)) = line.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
        head.push_str(&line);
    }
}

/// A response as the client saw it.
#[derive(Debug)]
struct Reply {
    status: u16,
    /// Header lines, names lowercased.
    headers: Vec<(String, String)>,
    body: String,
    /// Whether the proxy closed the connection after this response.
    closed: bool,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `request` as is on a new connection to `proxy` and reads one response (by its
/// content-length), then whether the proxy closes the connection. Returns the client's
/// address too, which names the access log line.
fn exchange(proxy: SocketAddr, request: &str) -> (Reply, SocketAddr) {
    let stream = TcpStream::connect(proxy).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let client = stream.local_addr().unwrap();
    (&stream).write_all(request.as_bytes()).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let (head, length) = read_head(&mut reader).expect("a response head");
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {head:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    // Closed: EOF. Kept alive: a second request on it is answered.
    let closed = if (&stream)
        .write_all(b"GET /again HTTP/1.1\r\nhost: again\r\n\r\n")
        .is_err()
    {
        true
    } else {
        read_head(&mut reader).is_none()
    };
    let reply = Reply {
        status,
        headers,
        body: String::from_utf8(body).unwrap(),
        closed,
    };
    (reply, client)
}

const HCM: &str = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager";
const ROUTER: &str = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router";

/// One HTTP listener `http` on 127.0.0.1:0 logging to stdout. Virtual host
/// `only.example.com` answers `vhost only` directly; `*` sends `/garbled` to the
/// garbling upstream and the rest to the echoing one. `hcm_extra` adds fields to the
/// connection manager (`strip_any_host_port: true, `).
fn http_bootstrap(echo: SocketAddr, garbled: SocketAddr, hcm_extra: &str) -> String {
    let listener = format!(
        "  - name: http\n    address: {{socket_address: {{address: 127.0.0.1, port_value: 0}}}}\n    \
         filter_chains:\n    - filters:\n      - name: envoy.filters.network.http_connection_manager\n        \
         typed_config:\n          '@type': {HCM}\n          stat_prefix: ing\n          {hcm_extra}\n          \
         access_log: [{STDOUT_LOG}]\n          \
         http_filters: [{{name: envoy.filters.http.router, typed_config: {{'@type': {ROUTER}}}}}]\n          \
         route_config:\n            virtual_hosts:\n            \
         - name: only\n              domains: [only.example.com]\n              \
         routes: [{{match: {{prefix: /}}, direct_response: {{status: 200, body: {{inline_string: \"vhost only\\n\"}}}}}}]\n            \
         - name: star\n              domains: ['*']\n              routes:\n              \
         - {{match: {{prefix: /garbled}}, route: {{cluster: garbled}}}}\n              \
         - {{match: {{prefix: /}}, route: {{cluster: echo}}}}\n"
    );
    bootstrap(
        &[listener],
        &[
            cluster("echo", "", &[echo]),
            cluster("garbled", "", &[garbled]),
        ],
    )
}

struct Scene {
    shunt: Shunt,
    proxy: SocketAddr,
    upstream: Upstream,
}

impl Scene {
    fn new(hcm_extra: &str) -> Scene {
        let upstream = upstream();
        let mut shunt = Shunt::start(&http_bootstrap(
            upstream.addr,
            garbling_upstream(),
            hcm_extra,
        ));
        let proxy = shunt.listening("http");
        Scene {
            shunt,
            proxy,
            upstream,
        }
    }

    /// The response to `request`, and its access log line.
    fn send(&self, request: &str) -> (Reply, serde_json::Value) {
        let (reply, client) = exchange(self.proxy, request);
        (reply, self.shunt.access_log(client))
    }
}

#[test]
fn a_malformed_chunked_request_body_is_400_dpe_and_closes() {
    let s = Scene::new("");
    let (reply, log) = s.send(
        "POST /chunk HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    );
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (400, "Bad Request"),
        "{reply:?}"
    );
    assert!(reply.closed, "{reply:?}");
    assert_eq!(reply.header("connection"), Some("close"), "{reply:?}");
    assert_eq!(log["response_code"], 400, "{log}");
    assert_eq!(log["response_flags"], "DPE", "{log}");
}

#[test]
fn an_unparsable_upstream_response_is_502_upe() {
    let s = Scene::new("");
    let (reply, log) = s.send("GET /garbled HTTP/1.1\r\nHost: h\r\n\r\n");
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (
            502,
            "upstream connect error or disconnect/reset before headers. reset reason: protocol error"
        ),
        "{reply:?}"
    );
    assert_eq!(log["response_code"], 502, "{log}");
    assert_eq!(log["response_flags"], "UPE", "{log}");
}

#[test]
fn an_h2c_upgrade_is_served_over_http1_without_its_upgrade_headers() {
    let s = Scene::new("");
    let (reply, log) = s.send(
        "GET /h2c HTTP/1.1\r\nHost: h\r\nConnection: Upgrade, HTTP2-Settings\r\n\
         Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n",
    );
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        reply.body.starts_with("upstream got: GET /h2c HTTP/1.1 | "),
        "{reply:?}"
    );
    assert!(
        !reply.closed,
        "served as a keep-alive HTTP/1.1 request: {reply:?}"
    );
    let heads = s.upstream.heads.lock().unwrap().clone();
    let head = heads
        .iter()
        .find(|h| h.starts_with("GET /h2c "))
        .expect("forwarded");
    let lower = head.to_ascii_lowercase();
    for gone in ["upgrade", "http2-settings", "connection"] {
        assert!(
            !lower.lines().any(|l| l.starts_with(&format!("{gone}:"))),
            "{gone} reached the upstream: {head}"
        );
    }
    assert_eq!(log["response_code"], 200, "{log}");
    assert_eq!(log["response_flags"], "-", "{log}");
}

#[test]
fn connect_without_a_connect_matcher_route_is_404_nr_and_never_reaches_an_upstream() {
    let s = Scene::new("");
    let (reply, log) = s.send("CONNECT h:80 HTTP/1.1\r\nHost: h:80\r\n\r\n");
    assert_eq!((reply.status, reply.body.as_str()), (404, ""), "{reply:?}");
    assert!(reply.closed, "{reply:?}");
    assert_eq!(log["response_code"], 404, "{log}");
    assert_eq!(log["response_flags"], "NR", "{log}");
    assert!(log["upstream_cluster"].is_null(), "{log}");
    // Not host:port: Envoy's HTTP/1 codec rejects the request target.
    let (reply, log) = s.send("CONNECT / HTTP/1.1\r\nHost: h\r\n\r\n");
    assert_eq!(
        (reply.status, reply.body.as_str()),
        (400, "Bad Request"),
        "{reply:?}"
    );
    assert!(reply.closed, "{reply:?}");
    assert_eq!(log["response_flags"], "DPE", "{log}");
    let heads = s.upstream.heads.lock().unwrap().clone();
    assert!(!heads.iter().any(|h| h.starts_with("CONNECT")), "{heads:?}");
}

#[test]
fn a_host_port_no_domain_names_goes_to_the_star_virtual_host() {
    let s = Scene::new("");
    let (exact, _) = s.send("GET /p HTTP/1.1\r\nHost: only.example.com\r\n\r\n");
    assert_eq!(exact.body, "vhost only\n", "{exact:?}");
    // Envoy matches the authority with its port and does not retry without it.
    let (port, log) = s.send("GET /p HTTP/1.1\r\nHost: only.example.com:9999\r\n\r\n");
    assert_eq!(port.status, 200, "{port:?}");
    assert!(
        port.body.contains("| host: only.example.com:9999 |"),
        "{port:?}"
    );
    assert_eq!(log["upstream_cluster"], "echo", "{log}");

    // Unless the connection manager strips the port first.
    let stripping = Scene::new("strip_any_host_port: true");
    let (stripped, log) = stripping.send("GET /p HTTP/1.1\r\nHost: only.example.com:9999\r\n\r\n");
    assert_eq!(stripped.body, "vhost only\n", "{stripped:?}");
    assert_eq!(log["authority"], "only.example.com", "{log}");
}

#[test]
fn http1_without_exactly_one_host_is_400() {
    let s = Scene::new("");
    let (missing, log) = s.send("GET /nohost HTTP/1.1\r\n\r\n");
    assert_eq!(
        (missing.status, missing.body.as_str()),
        (400, ""),
        "{missing:?}"
    );
    assert!(missing.closed, "{missing:?}");
    assert_eq!(log["response_code"], 400, "{log}");
    assert_eq!(log["response_flags"], "-", "{log}");
    let (doubled, log) = s.send("GET /duphost HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n");
    assert_eq!(
        (doubled.status, doubled.body.as_str()),
        (400, ""),
        "{doubled:?}"
    );
    assert!(doubled.closed, "{doubled:?}");
    assert_eq!(log["response_code"], 400, "{log}");
    let (same, _) = s.send("GET /duphost HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n");
    assert_eq!(same.status, 400, "{same:?}");
    // An absolute target carries the authority: no Host needed.
    let (absolute, _) = s.send("GET http://abs.example/x HTTP/1.1\r\n\r\n");
    assert_eq!(absolute.status, 200, "{absolute:?}");
    let heads = s.upstream.heads.lock().unwrap().clone();
    assert!(
        !heads
            .iter()
            .any(|h| h.starts_with("GET /nohost") || h.starts_with("GET /duphost")),
        "{heads:?}"
    );
}
