//! The HTTP/1.1 connection against a scripted upstream on loopback: what goes on the
//! wire, how bodies come back, and when a connection is reused or closed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::cluster::{Cluster, ClusterConfig};
use crate::host::Host;
use crate::http_pool::{RequestBody, Sender, UpstreamBody};

/// An upstream whose connections each run `script`; it counts what it accepted.
async fn upstream<F, Fut>(script: F) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>)
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(script(stream));
        }
    });
    (address, accepted)
}

/// Reads one request head (and `body` more bytes) off `stream`, as text.
async fn read_request(stream: &mut TcpStream, body: usize) -> String {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !seen.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).await.unwrap() == 0 {
            return String::from_utf8_lossy(&seen).into_owned();
        }
        seen.push(byte[0]);
    }
    let mut rest = vec![0u8; body];
    stream.read_exact(&mut rest).await.unwrap();
    seen.extend_from_slice(&rest);
    String::from_utf8(seen).unwrap()
}

fn cluster(address: SocketAddr) -> (Arc<Cluster>, Arc<Host>) {
    let cluster = Cluster::new(ClusterConfig::new("c"), vec![Host::new(address)]);
    let host = cluster.hosts()[0].clone();
    (cluster, host)
}

async fn checkout(cluster: &Arc<Cluster>, host: &Arc<Host>) -> Sender {
    cluster
        .http_pools
        .checkout(cluster, host, false, &Default::default())
        .await
        .unwrap()
}

fn get(path: &str) -> Request<RequestBody> {
    let mut request = Request::new(RequestBody::empty());
    *request.uri_mut() = path.parse().unwrap();
    request.headers_mut().insert("host", "svc".parse().unwrap());
    request
}

async fn body_of(body: UpstreamBody) -> (Bytes, Option<hyper::HeaderMap>) {
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned();
    (collected.to_bytes(), trailers)
}

/// Waits (up to 5 s) for the cluster's active connections to reach `count`.
async fn active_becomes(cluster: &Cluster, count: u64) {
    for _ in 0..500 {
        if cluster.stats.upstream_cx_active.value() == count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "upstream_cx_active stayed {}, not {count}",
        cluster.stats.upstream_cx_active.value()
    );
}

#[tokio::test]
async fn a_small_response_frees_its_connection_with_the_head_and_the_next_request_reuses_it() {
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let (address, accepted) = upstream(move |mut stream| {
        let seen_tx = seen_tx.clone();
        async move {
            for _ in 0..2 {
                seen_tx.send(read_request(&mut stream, 0).await).unwrap();
                stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: b\r\n\r\nhello")
                    .await
                    .unwrap();
            }
        }
    })
    .await;
    let (cluster, host) = cluster(address);
    let sender = checkout(&cluster, &host).await;
    assert!(!sender.reused());
    let response = sender.send(get("/a?b=c")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-a"], "b");
    // The whole body came with the head: the connection is back before it is read.
    let second = checkout(&cluster, &host).await;
    assert!(second.reused(), "the first connection is idle again");
    assert_eq!(body_of(response.into_body()).await.0, "hello");
    let response = second.send(get("/second")).await.unwrap();
    assert_eq!(body_of(response.into_body()).await.0, "hello");
    assert_eq!(
        seen.recv().await.unwrap(),
        "GET /a?b=c HTTP/1.1\r\nhost: svc\r\n\r\n"
    );
    assert_eq!(
        seen.recv().await.unwrap(),
        "GET /second HTTP/1.1\r\nhost: svc\r\n\r\n"
    );
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_goes_with_its_length_and_a_chunked_response_streams_with_trailers() {
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let (address, _) = upstream(move |mut stream| {
        let seen_tx = seen_tx.clone();
        async move {
            seen_tx.send(read_request(&mut stream, 5).await).unwrap();
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
                .await
                .unwrap();
            // The rest later: the body is read as it comes.
            tokio::time::sleep(Duration::from_millis(50)).await;
            stream
                .write_all(b"6;x=y\r\n world\r\n0\r\nx-t: 1\r\n\r\n")
                .await
                .unwrap();
            // The connection stays open for the next request.
            let _ = read_request(&mut stream, 0).await;
        }
    })
    .await;
    let (cluster, host) = cluster(address);
    let mut request = get("/upload");
    *request.method_mut() = hyper::Method::POST;
    *request.body_mut() = RequestBody::buffered(Bytes::from_static(b"hello"), None);
    let response = checkout(&cluster, &host).await.send(request).await.unwrap();
    assert_eq!(
        seen.recv().await.unwrap(),
        "POST /upload HTTP/1.1\r\nhost: svc\r\ncontent-length: 5\r\n\r\nhello"
    );
    let (data, trailers) = body_of(response.into_body()).await;
    assert_eq!(data, "hello world");
    assert_eq!(trailers.unwrap()["x-t"], "1");
    assert!(checkout(&cluster, &host).await.reused());
}

#[tokio::test]
async fn a_connection_the_upstream_closes_while_idle_is_closed_at_once() {
    let (address, accepted) = upstream(|mut stream| async move {
        read_request(&mut stream, 0).await;
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The upstream's keep-alive timeout.
    })
    .await;
    let (cluster, host) = cluster(address);
    let response = checkout(&cluster, &host)
        .await
        .send(get("/"))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    active_becomes(&cluster, 1).await;
    // No request comes: the pool notices the close by itself, as Envoy does.
    active_becomes(&cluster, 0).await;
    let sender = checkout(&cluster, &host).await;
    assert!(!sender.reused(), "a new connection");
    let response = sender.send(get("/")).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_body_until_close_is_read_whole_and_its_connection_not_reused() {
    let (address, _) = upstream(|mut stream| async move {
        read_request(&mut stream, 0).await;
        stream
            .write_all(b"HTTP/1.1 200 OK\r\n\r\nuntil ")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        stream.write_all(b"close").await.unwrap();
    })
    .await;
    let (cluster, host) = cluster(address);
    let response = checkout(&cluster, &host)
        .await
        .send(get("/"))
        .await
        .unwrap();
    assert_eq!(body_of(response.into_body()).await.0, "until close");
    active_becomes(&cluster, 0).await;
}

#[tokio::test]
async fn a_malformed_response_or_a_close_before_it_fails_the_request() {
    let (address, _) = upstream(|mut stream| async move {
        let head = read_request(&mut stream, 0).await;
        if head.starts_with("GET /bad ") {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n")
                .await;
        }
        if head.starts_with("GET /cut ") {
            // The head stops mid-way and the connection closes.
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-le").await;
        }
        // /closed: nothing comes back.
    })
    .await;
    let (cluster, host) = cluster(address);
    let failed = checkout(&cluster, &host)
        .await
        .send(get("/bad"))
        .await
        .unwrap_err();
    assert!(failed.malformed, "{}", failed.error);
    let failed = checkout(&cluster, &host)
        .await
        .send(get("/cut"))
        .await
        .unwrap_err();
    assert!(failed.malformed, "a head cut off: {}", failed.error);
    let failed = checkout(&cluster, &host)
        .await
        .send(get("/closed"))
        .await
        .unwrap_err();
    assert!(!failed.malformed, "{}", failed.error);
    assert!(failed.unsent.is_none(), "the request was written");
    active_becomes(&cluster, 0).await;
}

#[derive(Debug)]
struct Unwatched;

impl crate::http_pool::BodyObserver for Unwatched {
    fn received(&self, _: u64) {}
}

#[tokio::test]
async fn a_streamed_body_goes_chunked_with_its_declared_trailers() {
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let (upstream, _) = upstream(move |mut stream| {
        let seen_tx = seen_tx.clone();
        async move {
            let mut wire = Vec::new();
            let mut byte = [0u8; 1];
            while !wire.ends_with(b"\r\n0\r\nx-sum: 9\r\n\r\n") {
                if stream.read(&mut byte).await.unwrap() == 0 {
                    break;
                }
                wire.push(byte[0]);
            }
            seen_tx.send(String::from_utf8(wire).unwrap()).unwrap();
            let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
        }
    })
    .await;
    let (cluster, host) = cluster(upstream);
    // A downstream served by hyper, whose streamed body goes upstream as it comes.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
            let (cluster, host) = (cluster.clone(), host.clone());
            async move {
                let body = RequestBody::new(request.into_body(), Arc::new(Unwatched));
                let mut upstream = Request::new(body);
                *upstream.method_mut() = hyper::Method::POST;
                *upstream.uri_mut() = "/up".parse().unwrap();
                upstream
                    .headers_mut()
                    .insert("host", "svc".parse().unwrap());
                upstream
                    .headers_mut()
                    .insert("trailer", "x-sum".parse().unwrap());
                let response = checkout(&cluster, &host)
                    .await
                    .send(upstream)
                    .await
                    .unwrap();
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        let io = hyper_util::rt::TokioIo::new(stream);
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    });
    let mut client = TcpStream::connect(proxy).await.unwrap();
    client
        .write_all(b"POST / HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    client
        .write_all(b"2\r\nde\r\n0\r\nx-sum: 9\r\nx-no: 1\r\n\r\n")
        .await
        .unwrap();
    let wire = seen.recv().await.unwrap();
    assert!(
        wire.ends_with(
            "transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\nx-sum: 9\r\n\r\n"
        ),
        "{wire}"
    );
    let mut answer = [0u8; 12];
    client.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 204");
}

#[tokio::test]
async fn an_early_answer_to_an_upload_the_upstream_stops_reading_is_still_read() {
    let (address, _) = upstream(|mut stream| async move {
        read_request(&mut stream, 0).await;
        stream
            .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbig!")
            .await
            .unwrap();
        // Closed with most of the body unread: the proxy's writes fail.
    })
    .await;
    let (cluster, host) = cluster(address);
    let mut request = get("/upload");
    *request.method_mut() = hyper::Method::POST;
    let body = Bytes::from(vec![b'x'; 16 << 20]);
    *request.body_mut() = RequestBody::buffered(body, None);
    let response = checkout(&cluster, &host).await.send(request).await.unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(body_of(response.into_body()).await.0, "big!");
    active_becomes(&cluster, 0).await;
}

/// A stream that records each write it is given: one entry per call.
#[derive(Default)]
struct Recorder {
    vectored: bool,
    writes: Vec<Vec<u8>>,
}

impl tokio::io::AsyncWrite for Recorder {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.get_mut().writes.push(buf.to_vec());
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let all: Vec<u8> = bufs.iter().flat_map(|b| b.iter().copied()).collect();
        let n = all.len();
        self.get_mut().writes.push(all);
        std::task::Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.vectored
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

#[test]
fn a_head_and_its_body_leave_in_one_write_gathered_or_joined() {
    for vectored in [true, false] {
        let mut io = Recorder {
            vectored,
            ..Recorder::default()
        };
        let mut queue = vec![
            Bytes::from_static(b"POST / HTTP/1.1\r\ncontent-length: 4\r\n\r\n"),
            Bytes::from_static(b"body"),
        ];
        // Part of the head went out already.
        let (mut offset, mut wrote) = (5, false);
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        let done = super::poll_write_queue(&mut io, &mut cx, &mut queue, &mut offset, &mut wrote);
        assert!(matches!(done, Ok(std::task::Poll::Ready(()))));
        assert!(wrote && queue.is_empty());
        assert_eq!(
            io.writes,
            [b"/ HTTP/1.1\r\ncontent-length: 4\r\n\r\nbody".to_vec()],
            "vectored: {vectored}"
        );
    }
}

#[tokio::test]
async fn cookie_fields_go_as_one_line_joined_with_semicolons() {
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel();
    let seen_tx = Arc::new(std::sync::Mutex::new(Some(seen_tx)));
    let (address, _) = upstream(move |mut stream| {
        let seen_tx = seen_tx.clone();
        async move {
            let head = read_request(&mut stream, 0).await;
            let _ = stream.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
            if let Some(tx) = seen_tx.lock().unwrap().take() {
                let _ = tx.send(head);
            }
        }
    })
    .await;
    let (cluster, host) = cluster(address);
    let mut request = get("/");
    // As an HTTP/2 client sends them: one field per cookie.
    for cookie in ["a=1", "b=2", "c=3"] {
        request
            .headers_mut()
            .append("cookie", cookie.parse().unwrap());
    }
    request
        .headers_mut()
        .insert("x-after", "z".parse().unwrap());
    checkout(&cluster, &host).await.send(request).await.unwrap();
    let head = seen_rx.await.unwrap();
    let cookies: Vec<&str> = head
        .lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("cookie:"))
        .collect();
    assert_eq!(cookies, ["cookie: a=1; b=2; c=3"], "{head}");
    assert!(head.contains("x-after: z\r\n"), "{head}");
}

#[test]
fn each_worker_takes_back_the_connections_it_opened() {
    use shunt_core::event::workers;
    // The one test of this process that starts workers (once per process).
    workers::start(None, 2, || {}).unwrap();
    let peers = tokio::runtime::Runtime::new().unwrap();
    // Each response's body is the client port of the connection it came on.
    let (address, accepted) = peers.block_on(upstream(|mut stream| async move {
        let port = stream.peer_addr().unwrap().port().to_string();
        loop {
            if read_request(&mut stream, 0).await.is_empty() {
                return;
            }
            let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", port.len());
            if stream.write_all((head + &port).as_bytes()).await.is_err() {
                return;
            }
        }
    }));
    let (cluster, host) = cluster(address);
    let here = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    fn on<T: Send + 'static>(
        here: &tokio::runtime::Runtime,
        worker: usize,
        job: impl Future<Output = T> + Send + 'static,
    ) -> T {
        here.block_on(workers::handles()[worker].spawn(job))
            .unwrap()
    }
    // One port a request went out on.
    let port = |sender: Sender| async move {
        let response = sender.send(get("/")).await.unwrap();
        body_of(response.into_body()).await.0
    };
    // Both workers open a connection while the other's is taken.
    let (first, opened) = (cluster.clone(), host.clone());
    let held0 = on(&here, 0, async move { checkout(&first, &opened).await });
    let (first, opened) = (cluster.clone(), host.clone());
    let held1 = on(&here, 1, async move { checkout(&first, &opened).await });
    assert!(!held0.reused() && !held1.reused());
    // Worker 1's goes back last: the newest idle one.
    let port0 = here.block_on(port(held0));
    let port1 = here.block_on(port(held1));
    assert_ne!(port0, port1);
    for _ in 0..3 {
        for (worker, opened_by) in [(0, &port0), (1, &port1)] {
            let (cluster, host) = (cluster.clone(), host.clone());
            let sender = on(
                &here,
                worker,
                async move { checkout(&cluster, &host).await },
            );
            assert!(sender.reused());
            assert_eq!(&here.block_on(port(sender)), opened_by, "worker {worker}");
        }
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 2);
}
