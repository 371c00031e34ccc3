//! Listener filters that look at a connection's first bytes without consuming them:
//! `tls_inspector` (is it TLS? which server name, which ALPN protocols?) and
//! `http_inspector` (is it HTTP/1.x or the HTTP/2 preface?). Their findings feed filter
//! chain matching; the bytes stay in the socket for whichever chain runs.
//!
//! Bytes are read with `MSG_PEEK`. A peek leaves the socket readable, so waiting for
//! more bytes must first tell tokio the socket has nothing *new* (a `WouldBlock` from
//! inside `async_io`), or the wait would spin on the same bytes.

use std::io;

use tokio::io::Interest;
use tokio::net::TcpStream;

/// Envoy's `tls_inspector` reads a ClientHello of up to 64 KiB.
pub const MAX_CLIENT_HELLO: usize = 64 * 1024;
/// `http_inspector` gives up on a request line longer than this.
pub const MAX_HTTP_INSPECT: usize = 8 * 1024;

/// What `tls_inspector` learned.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientHello {
    /// SNI, lowercase.
    pub server_name: Option<String>,
    /// ALPN, in the client's order.
    pub alpn: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TlsVerdict {
    /// Not enough bytes yet to tell.
    NeedMore,
    NotTls,
    ClientHello(ClientHello),
}

/// Parses the TLS records at the start of `buf` as far as the ClientHello goes.
pub fn parse_client_hello(buf: &[u8]) -> TlsVerdict {
    // The handshake message may span several records; gather their payloads.
    let mut handshake = Vec::new();
    let mut rest = buf;
    loop {
        if rest.is_empty() {
            return TlsVerdict::NeedMore;
        }
        // Content type handshake (22), then a TLS 1.x record version.
        if rest[0] != 22 {
            return if handshake.is_empty() {
                TlsVerdict::NotTls
            } else {
                TlsVerdict::NeedMore
            };
        }
        if rest.len() >= 2 && rest[1] != 3 {
            return TlsVerdict::NotTls;
        }
        if rest.len() < 5 {
            return TlsVerdict::NeedMore;
        }
        let len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
        if len == 0 || len > (1 << 14) + 2048 {
            return TlsVerdict::NotTls;
        }
        if rest.len() < 5 + len {
            // A partial record still tells whether the first message is a ClientHello.
            handshake.extend_from_slice(&rest[5..]);
            if handshake.first().is_some_and(|&t| t != 1) {
                return TlsVerdict::NotTls;
            }
            return TlsVerdict::NeedMore;
        }
        handshake.extend_from_slice(&rest[5..5 + len]);
        rest = &rest[5 + len..];
        if handshake[0] != 1 {
            return TlsVerdict::NotTls;
        }
        if handshake.len() >= 4 {
            let body_len = (usize::from(handshake[1]) << 16)
                | (usize::from(handshake[2]) << 8)
                | usize::from(handshake[3]);
            if handshake.len() >= 4 + body_len {
                return match parse_hello_body(&handshake[4..4 + body_len]) {
                    Some(hello) => TlsVerdict::ClientHello(hello),
                    None => TlsVerdict::NotTls,
                };
            }
        }
    }
}

/// A byte cursor that fails (None) instead of panicking on short input.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        Some(self.take(1)?[0])
    }
    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([b[0], b[1]]))
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(usize::from(n))
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(usize::from(n))
    }
}

fn parse_hello_body(body: &[u8]) -> Option<ClientHello> {
    let mut r = Reader(body);
    r.take(2)?; // legacy_version
    r.take(32)?; // random
    r.vec8()?; // legacy_session_id
    r.vec16()?; // cipher_suites
    r.vec8()?; // legacy_compression_methods
    let mut hello = ClientHello::default();
    if r.0.is_empty() {
        return Some(hello); // no extensions at all
    }
    let mut extensions = Reader(r.vec16()?);
    while !extensions.0.is_empty() {
        let kind = extensions.u16()?;
        let mut data = Reader(extensions.vec16()?);
        match kind {
            // server_name: a list of (type, name); type 0 is host_name.
            0 => {
                let mut list = Reader(data.vec16()?);
                while !list.0.is_empty() {
                    let name_type = list.u8()?;
                    let name = list.vec16()?;
                    if name_type == 0 && hello.server_name.is_none() {
                        hello.server_name =
                            Some(String::from_utf8_lossy(name).to_ascii_lowercase());
                    }
                }
            }
            // application_layer_protocol_negotiation
            16 => {
                let mut list = Reader(data.vec16()?);
                while !list.0.is_empty() {
                    hello
                        .alpn
                        .push(String::from_utf8_lossy(list.vec8()?).into_owned());
                }
            }
            _ => {}
        }
    }
    Some(hello)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HttpVerdict {
    NeedMore,
    NotHttp,
    /// The application protocol Envoy reports: `http/1.0`, `http/1.1` or `h2c`.
    Protocol(&'static str),
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The methods `http_inspector` recognises (llhttp's list, as Envoy uses).
const METHODS: &[&str] = &[
    "GET",
    "HEAD",
    "POST",
    "PUT",
    "DELETE",
    "CONNECT",
    "OPTIONS",
    "TRACE",
    "PATCH",
    "COPY",
    "LOCK",
    "MKCOL",
    "MOVE",
    "PROPFIND",
    "PROPPATCH",
    "SEARCH",
    "UNLOCK",
    "BIND",
    "REBIND",
    "UNBIND",
    "ACL",
    "REPORT",
    "MKACTIVITY",
    "CHECKOUT",
    "MERGE",
    "M-SEARCH",
    "NOTIFY",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "PURGE",
    "MKCALENDAR",
    "LINK",
    "UNLINK",
    "SOURCE",
    "QUERY",
];

/// Recognises the HTTP/2 connection preface or an HTTP/1.x request line.
pub fn inspect_http(buf: &[u8]) -> HttpVerdict {
    if buf.is_empty() {
        return HttpVerdict::NeedMore;
    }
    let n = buf.len().min(H2_PREFACE.len());
    if buf[..n] == H2_PREFACE[..n] {
        return if buf.len() >= H2_PREFACE.len() {
            HttpVerdict::Protocol("h2c")
        } else {
            HttpVerdict::NeedMore
        };
    }
    // The method: a known one followed by a space.
    let method_end = buf.iter().position(|&b| b == b' ');
    let method = &buf[..method_end.unwrap_or(buf.len())];
    let known = |m: &&str| m.as_bytes() == method;
    let prefix = |m: &&str| m.as_bytes().starts_with(method);
    match method_end {
        Some(_) if METHODS.iter().any(known) => {}
        None if METHODS.iter().any(prefix) => return HttpVerdict::NeedMore,
        _ => return HttpVerdict::NotHttp,
    }
    let Some(line_end) = buf.iter().position(|&b| b == b'\n') else {
        return if buf.len() >= MAX_HTTP_INSPECT {
            HttpVerdict::NotHttp
        } else {
            HttpVerdict::NeedMore
        };
    };
    let line = buf[..line_end]
        .strip_suffix(b"\r")
        .unwrap_or(&buf[..line_end]);
    let mut parts = line.split(|&b| b == b' ');
    let (_method, target, version) = (parts.next(), parts.next(), parts.next());
    if parts.next().is_some() || target.is_none_or(<[u8]>::is_empty) {
        return HttpVerdict::NotHttp;
    }
    match version {
        Some(b"HTTP/1.1") => HttpVerdict::Protocol("http/1.1"),
        Some(b"HTTP/1.0") => HttpVerdict::Protocol("http/1.0"),
        _ => HttpVerdict::NotHttp,
    }
}

/// Peeks at `stream`'s first bytes until `decide` answers, the peer stops sending
/// (EOF: `decide` sees `complete`), or `max` bytes are buffered (likewise).
pub async fn peek_until<T>(
    stream: &TcpStream,
    max: usize,
    mut decide: impl FnMut(&[u8], bool) -> Option<T>,
) -> io::Result<T> {
    let mut buf = vec![0u8; max];
    let mut seen = 0;
    loop {
        let ready = stream.ready(Interest::READABLE).await?;
        // The peek runs inside try_io so that bytes arriving after tokio's readiness
        // snapshot keep the socket marked readable.
        let peeked = stream.try_io(Interest::READABLE, || {
            let n = peek(stream, &mut buf)?;
            if n == seen && n != 0 && n < max {
                // Nothing new since the last look: wait for the next readiness edge.
                Err(io::ErrorKind::WouldBlock.into())
            } else {
                Ok(n)
            }
        });
        let (n, complete) = match peeked {
            Ok(n) => (n, n == 0 || n == max),
            // The peer half-closed after its last bytes: no more will come.
            Err(err) if err.kind() == io::ErrorKind::WouldBlock && ready.is_read_closed() => {
                (seen, true)
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => continue,
            Err(err) => return Err(err),
        };
        seen = n;
        if let Some(answer) = decide(&buf[..n], complete) {
            return Ok(answer);
        }
        if complete {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the inspector could not decide",
            ));
        }
    }
}

/// What has arrived so far, left in the socket for the connection's own reads.
fn peek(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    use nix::sys::socket::{MsgFlags, recv};
    use std::os::fd::AsRawFd;
    Ok(recv(
        stream.as_raw_fd(),
        buf,
        MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// The bytes a real TLS client (rustls) sends first: its ClientHello.
    pub fn client_hello(server_name: &str, alpn: &[&str]) -> Vec<u8> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.as_bytes().to_vec()).collect();
        let name = rustls::pki_types::ServerName::try_from(server_name.to_owned()).unwrap();
        let mut client = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut bytes = Vec::new();
        client.write_tls(&mut bytes).unwrap();
        bytes
    }

    #[test]
    fn a_real_client_hello_gives_sni_and_alpn() {
        let hello = client_hello("API.Example.com", &["istio-peer-exchange", "istio", "h2"]);
        assert_eq!(
            parse_client_hello(&hello),
            TlsVerdict::ClientHello(ClientHello {
                server_name: Some("api.example.com".into()),
                alpn: vec!["istio-peer-exchange".into(), "istio".into(), "h2".into()],
            })
        );
    }

    #[test]
    fn a_client_hello_cut_anywhere_needs_more() {
        let hello = client_hello("svc.ns.svc.cluster.local", &["h2"]);
        for cut in 0..hello.len() {
            assert_eq!(
                parse_client_hello(&hello[..cut]),
                TlsVerdict::NeedMore,
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn a_client_hello_without_sni_or_alpn() {
        // An IP address as the server name: rustls sends no SNI for it.
        let hello = client_hello("10.0.0.1", &[]);
        assert_eq!(
            parse_client_hello(&hello),
            TlsVerdict::ClientHello(ClientHello::default())
        );
    }

    #[test]
    fn a_client_hello_split_over_two_records_is_reassembled() {
        let hello = client_hello("split.example.com", &["h2"]);
        let payload = &hello[5..];
        let (a, b) = payload.split_at(40);
        let mut split = Vec::new();
        for part in [a, b] {
            split.extend_from_slice(&[22, 3, 1]);
            split.extend_from_slice(&(part.len() as u16).to_be_bytes());
            split.extend_from_slice(part);
        }
        match parse_client_hello(&split) {
            TlsVerdict::ClientHello(h) => {
                assert_eq!(h.server_name.as_deref(), Some("split.example.com"))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_bytes_are_not_tls() {
        assert_eq!(
            parse_client_hello(b"GET / HTTP/1.1\r\n"),
            TlsVerdict::NotTls
        );
        assert_eq!(parse_client_hello(&[22, 9]), TlsVerdict::NotTls);
        // A handshake record whose first message is not a ClientHello.
        assert_eq!(
            parse_client_hello(&[22, 3, 3, 0, 4, 2, 0, 0, 0]),
            TlsVerdict::NotTls
        );
        assert_eq!(parse_client_hello(b""), TlsVerdict::NeedMore);
        assert_eq!(parse_client_hello(&[22]), TlsVerdict::NeedMore);
    }

    #[test]
    fn http_inspection_names_the_protocol() {
        let cases: &[(&[u8], HttpVerdict)] = &[
            (
                b"GET /index.html HTTP/1.1\r\nHost: x\r\n\r\n",
                HttpVerdict::Protocol("http/1.1"),
            ),
            (b"POST /api HTTP/1.0\r\n", HttpVerdict::Protocol("http/1.0")),
            (
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00",
                HttpVerdict::Protocol("h2c"),
            ),
            (b"PRI * HTTP/2.0\r\n", HttpVerdict::NeedMore),
            (b"GE", HttpVerdict::NeedMore),
            (b"GET /still-coming", HttpVerdict::NeedMore),
            (b"DELETE /x HTTP/1.1\r\n", HttpVerdict::Protocol("http/1.1")),
            (b"FOO /x HTTP/1.1\r\n", HttpVerdict::NotHttp),
            (b"GET /x HTTP/2.0\r\n", HttpVerdict::NotHttp),
            (b"GET /x\r\n", HttpVerdict::NotHttp),
            (b"SSH-2.0-OpenSSH_9.6\r\n", HttpVerdict::NotHttp),
            (b"\x16\x03\x01\x02\x00", HttpVerdict::NotHttp),
        ];
        for (bytes, expected) in cases {
            assert_eq!(
                inspect_http(bytes),
                *expected,
                "{:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[tokio::test]
    async fn peeking_waits_for_the_whole_hello_and_consumes_nothing() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let hello = client_hello("peek.example.com", &["http/1.1"]);
        // Send it in two parts, the second only after the inspector has seen the first.
        let (first, second) = hello.split_at(hello.len() / 2);
        client.write_all(first).await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let second = second.to_vec();
        let sender = tokio::spawn(async move {
            rx.await.unwrap();
            client.write_all(&second).await.unwrap();
            client
        });
        let mut tx = Some(tx);
        let found = peek_until(
            &server,
            MAX_CLIENT_HELLO,
            |buf, complete| match parse_client_hello(buf) {
                TlsVerdict::NeedMore if !complete => {
                    if let Some(tx) = tx.take() {
                        tx.send(()).unwrap();
                    }
                    None
                }
                TlsVerdict::ClientHello(hello) => Some(hello),
                other => panic!("{other:?}"),
            },
        )
        .await
        .unwrap();
        assert_eq!(found.server_name.as_deref(), Some("peek.example.com"));
        assert_eq!(found.alpn, ["http/1.1"]);
        // Every byte is still there for the filter chain that runs next.
        let _client = sender.await.unwrap();
        let mut server = server;
        let mut got = vec![0u8; hello.len()];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(got, hello);
    }

    #[tokio::test]
    async fn peeking_sees_eof_as_complete() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        client.write_all(b"GE").await.unwrap();
        client.shutdown().await.unwrap();
        let verdict = peek_until(
            &server,
            MAX_HTTP_INSPECT,
            |buf, complete| match inspect_http(buf) {
                HttpVerdict::NeedMore if !complete => None,
                HttpVerdict::NeedMore => Some(HttpVerdict::NotHttp),
                other => Some(other),
            },
        )
        .await
        .unwrap();
        assert_eq!(verdict, HttpVerdict::NotHttp);
    }
}
