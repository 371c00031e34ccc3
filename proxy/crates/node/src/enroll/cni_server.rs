//! The `shunt-cni` plugin's socket: one [`CniRequest`] per connection, answered with one
//! [`CniResponse`]. Blocking threads, as [`Pods`](crate::Pods) is synchronous and
//! enrollments are rare next to traffic.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::wire::{self, CniRequest, CniResponse};
use super::{Enrollment, Source};

/// How long a connected plugin has to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The listening socket, serving on its own thread until [`CniServer::stop`] or drop.
pub struct CniServer {
    path: PathBuf,
    listener: Arc<UnixListener>,
    enrollment: Arc<Enrollment>,
    serving: Option<Serving>,
    /// Handed to a successor: the socket file is its now.
    released: bool,
}

/// The accept thread, and how to wake it to stop (without touching the socket, which a
/// successor may be accepting on).
struct Serving {
    thread: JoinHandle<()>,
    wake: OwnedFd,
}

impl CniServer {
    /// Binds `path` and serves `enrollment` there.
    pub fn start(path: &Path, enrollment: Arc<Enrollment>) -> io::Result<Self> {
        let listener = wire::bind(path)?;
        Self::start_on(path, listener, enrollment)
    }

    /// Serves `enrollment` on `listener`, already listening at `path` (handed over by
    /// the process this one replaces).
    pub fn start_on(
        path: &Path,
        listener: UnixListener,
        enrollment: Arc<Enrollment>,
    ) -> io::Result<Self> {
        let mut server = Self {
            path: path.to_path_buf(),
            listener: Arc::new(listener),
            enrollment,
            serving: None,
            released: false,
        };
        server.listener.set_nonblocking(true)?;
        server.resume()?;
        Ok(server)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The listening socket, to hand to a successor.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// Accepts again after [`CniServer::pause`].
    pub fn resume(&mut self) -> io::Result<()> {
        if self.serving.is_some() {
            return Ok(());
        }
        let (wake_rx, wake) = nix::unistd::pipe().map_err(io::Error::from)?;
        let thread = {
            let listener = self.listener.clone();
            let enrollment = self.enrollment.clone();
            std::thread::Builder::new()
                .name("cni-server".into())
                .spawn(move || accept_loop(&listener, &wake_rx, &enrollment))?
        };
        self.serving = Some(Serving { thread, wake });
        Ok(())
    }

    /// Stops accepting, leaving the socket listening: requests queue until this or a
    /// successor accepts them (requests in flight finish).
    pub fn pause(&mut self) {
        let Some(serving) = self.serving.take() else {
            return;
        };
        let _ = nix::unistd::write(&serving.wake, b"x");
        let _ = serving.thread.join();
    }

    /// Stops accepting and removes the socket file (requests in flight finish).
    pub fn stop(&mut self) {
        self.pause();
        if !self.released {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Stops accepting and leaves the socket to the successor that took it over: the
    /// file stays.
    pub fn release(&mut self) {
        self.pause();
        self.released = true;
    }
}

impl Drop for CniServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: &UnixListener, wake: &OwnedFd, enrollment: &Arc<Enrollment>) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    loop {
        let mut fds = [
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
            PollFd::new(wake.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::warn!("cni server: poll: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        }
        if fds[1].any().unwrap_or(true) {
            return;
        }
        let conn = listener.accept();
        match conn {
            Ok((conn, _)) => {
                let enrollment = enrollment.clone();
                let spawned = std::thread::Builder::new()
                    .name("cni-request".into())
                    .spawn(move || serve(conn, &enrollment));
                if let Err(e) = spawned {
                    tracing::warn!("cni server: no thread for a request: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // Taken by the other process holding this socket during a hand-over.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::warn!("cni server: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn serve(conn: UnixStream, enrollment: &Enrollment) {
    let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
    let response = match wire::recv(conn.as_fd()) {
        Ok(packet) => handle(packet, enrollment),
        Err(e) => CniResponse {
            error: format!("reading the request: {e}"),
        },
    };
    let json = serde_json::to_vec(&response).expect("a response serializes");
    if let Err(e) = wire::send(conn.as_fd(), &json, None) {
        tracing::warn!("cni server: answering the plugin: {e}");
    }
}

fn handle(packet: wire::Packet, enrollment: &Enrollment) -> CniResponse {
    let request: CniRequest = match serde_json::from_slice(&packet.bytes) {
        Ok(r) => r,
        Err(e) => {
            return CniResponse {
                error: format!("request is not a shunt-cni request: {e}"),
            };
        }
    };
    let error = match request {
        CniRequest::Add { pod } => {
            let (uid, ns, name) = (pod.uid.clone(), pod.namespace.clone(), pod.name.clone());
            match packet.fd {
                None => "ADD carries no network namespace fd".into(),
                Some(netns) => match enrollment.add(Source::Cni, pod, netns) {
                    Ok(()) => {
                        tracing::info!(uid, "enrolled pod {ns}/{name} (CNI)");
                        String::new()
                    }
                    Err(e) => e.to_string(),
                },
            }
        }
        CniRequest::Del { uid, container_id } => {
            let uid = uid.or_else(|| enrollment.uid_of_container(&container_id));
            let record = uid.as_deref().and_then(|uid| enrollment.record(uid));
            match (uid, record) {
                // A DEL for an earlier sandbox of the pod (the pod was ADDed again in a new
                // one since): the pod now served is not that one.
                (Some(uid), Some(r))
                    if r.source == Source::Cni
                        && !r.pod.container_id.is_empty()
                        && r.pod.container_id != container_id =>
                {
                    tracing::info!(
                        uid,
                        "ignored a DEL for sandbox {container_id}: the pod is served in {}",
                        r.pod.container_id
                    );
                }
                (Some(uid), _) => {
                    enrollment.remove(&uid);
                    tracing::info!(uid, "withdrew pod (CNI DEL)");
                }
                (None, _) => {}
            }
            String::new()
        }
        CniRequest::Check { uid, container_id } => {
            match uid.or_else(|| enrollment.uid_of_container(&container_id)) {
                Some(uid) if enrollment.is_served(&uid) => String::new(),
                Some(uid) => format!("pod {uid} is not served by this node"),
                None => format!("no pod with container id {container_id} is enrolled"),
            }
        }
    };
    CniResponse { error }
}
