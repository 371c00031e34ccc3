//! The gRPC side: a thread with its own tokio runtime serving AggregatedDiscoveryService
//! on one listener until told to stop.

use super::Listen;
use super::state::Shared;
use anyhow::{Context, Result, anyhow};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    aggregated_discovery_service_server::{
        AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
    },
};
use std::{
    fs::File,
    net::SocketAddr,
    os::{fd::AsRawFd, unix::fs::MetadataExt},
    sync::{Arc, mpsc},
    thread::{self, JoinHandle},
    time::Duration,
};
use tokio::sync::{mpsc::unbounded_channel, watch};
use tokio_stream::wrappers::{UnboundedReceiverStream, UnixListenerStream};
use tonic::{
    Request, Response, Status, Streaming,
    metadata::{KeyAndValueRef, MetadataMap},
    transport::{Server, server::TcpIncoming},
};

/// How long stopping waits for connections to wind down before dropping them.
const GRACE: Duration = Duration::from_millis(500);

/// One serving instance (a restart makes a new one).
pub(crate) struct Running {
    stop: watch::Sender<bool>,
    thread: Option<JoinHandle<()>>,
}

impl Running {
    /// Streams should be closed first: graceful shutdown waits for them.
    pub fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            eprintln!("ads: server thread panicked");
        }
    }
}

/// Bind `listen` and serve on a new thread; returns once listening, with the bound TCP
/// address. The thread first enters `netns` (the namespace of whoever first started
/// the server), so a restart from another thread listens in the same place.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    listen: Listen,
    netns: Arc<File>,
) -> Result<(Running, Option<SocketAddr>)> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = watch::channel(false);
    let thread = thread::Builder::new()
        .name("ads-server".into())
        .spawn(move || {
            let runtime = enter_netns(&netns).and_then(|()| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("ads-worker")
                    .enable_all()
                    .build()
                    .context("building the ADS server runtime")
            });
            let runtime = match runtime {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            runtime.block_on(serve(shared, listen, stop_rx, ready_tx));
            // Whatever did not finish within the grace period (connections, stream
            // tasks) is dropped here, which closes its sockets.
            runtime.shutdown_timeout(Duration::from_millis(100));
        })
        .context("spawning the ADS server thread")?;
    let running = Running {
        stop: stop_tx,
        thread: Some(thread),
    };
    match ready_rx.recv() {
        Ok(Ok(addr)) => Ok((running, addr)),
        Ok(Err(e)) => {
            running.stop();
            Err(e)
        }
        Err(_) => {
            running.stop();
            Err(anyhow!("the ADS server thread exited before listening"))
        }
    }
}

fn enter_netns(netns: &File) -> Result<()> {
    let want = netns.metadata()?;
    let have = std::fs::metadata("/proc/thread-self/ns/net")?;
    if (want.dev(), want.ino()) == (have.dev(), have.ino()) {
        // setns needs CAP_SYS_ADMIN even into the current namespace; skip it.
        return Ok(());
    }
    // SAFETY: setns on a valid fd only changes this thread's namespace.
    if unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error()).context("setns into the ADS server netns");
    }
    Ok(())
}

async fn serve(
    shared: Arc<Shared>,
    listen: Listen,
    stop: watch::Receiver<bool>,
    ready: mpsc::Sender<Result<Option<SocketAddr>>>,
) {
    let service = AggregatedDiscoveryServiceServer::new(Ads {
        shared,
        stop: stop.clone(),
    })
    // Large configurations (benchmarks) exceed tonic's 4 MiB default.
    .max_decoding_message_size(usize::MAX)
    .max_encoding_message_size(usize::MAX);
    let signal = {
        let mut stop = stop.clone();
        async move {
            let _ = stop.wait_for(|s| *s).await;
        }
    };
    let server = match bind(&listen).await {
        Ok(Bound::Tcp(listener, addr)) => {
            let _ = ready.send(Ok(Some(addr)));
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            tokio::spawn(Server::builder().serve_with_incoming_shutdown(service, incoming, signal))
        }
        Ok(Bound::Unix(listener)) => {
            let _ = ready.send(Ok(None));
            let incoming = UnixListenerStream::new(listener);
            tokio::spawn(Server::builder().serve_with_incoming_shutdown(service, incoming, signal))
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut stop = stop;
    let _ = stop.wait_for(|s| *s).await;
    match tokio::time::timeout(GRACE, server).await {
        Ok(Ok(Err(e))) => eprintln!("ads: server on {listen:?} failed: {e}"),
        Ok(Err(e)) => eprintln!("ads: server task on {listen:?} failed: {e}"),
        Ok(Ok(Ok(()))) | Err(_) => {}
    }
}

enum Bound {
    Tcp(tokio::net::TcpListener, SocketAddr),
    Unix(tokio::net::UnixListener),
}

async fn bind(listen: &Listen) -> Result<Bound> {
    match listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the ADS server to {addr}"))?;
            let addr = listener.local_addr()?;
            Ok(Bound::Tcp(listener, addr))
        }
        Listen::Unix(path) => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
            }
            let listener = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("binding the ADS server to {}", path.display()))?;
            Ok(Bound::Unix(listener))
        }
    }
}

struct Ads {
    shared: Arc<Shared>,
    stop: watch::Receiver<bool>,
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream =
        UnboundedReceiverStream<Result<DiscoveryResponse, Status>>;
    type DeltaAggregatedResourcesStream =
        UnboundedReceiverStream<Result<DeltaDiscoveryResponse, Status>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        let (tx, rx) = unbounded_channel();
        let id = self.shared.open_sotw(metadata(request.metadata()), tx);
        let shared = self.shared.clone();
        tokio::spawn(read(
            request.into_inner(),
            self.stop.clone(),
            shared.clone(),
            id,
            move |req| shared.on_sotw(id, req),
        ));
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let (tx, rx) = unbounded_channel();
        let id = self.shared.open_delta(metadata(request.metadata()), tx);
        let shared = self.shared.clone();
        tokio::spawn(read(
            request.into_inner(),
            self.stop.clone(),
            shared.clone(),
            id,
            move |req| shared.on_delta(id, req),
        ));
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

/// Feed a stream's requests to `handle` until the client ends or drops it, or the
/// server stops; then forget the stream, which ends its response side. Dropping
/// `inbound` on stop also lets graceful shutdown finish.
async fn read<T>(
    mut inbound: Streaming<T>,
    mut stop: watch::Receiver<bool>,
    shared: Arc<Shared>,
    id: u64,
    handle: impl Fn(T),
) {
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            msg = inbound.message() => match msg {
                Ok(Some(req)) => handle(req),
                // The client ended or dropped the stream; a reset is ordinary here.
                Ok(None) | Err(_) => break,
            },
        }
    }
    shared.close(id, None);
}

/// The stream's initial metadata; binary values are kept base64-encoded as sent.
fn metadata(map: &MetadataMap) -> Vec<(String, String)> {
    map.iter()
        .map(|kv| match kv {
            KeyAndValueRef::Ascii(k, v) => (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_encoded_bytes()).into_owned(),
            ),
            KeyAndValueRef::Binary(k, v) => (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_encoded_bytes()).into_owned(),
            ),
        })
        .collect()
}
