//! istio-cni's ZDS protocol, the ztunnel side: istio-cni's node agent listens on a
//! `SOCK_SEQPACKET` socket (`/var/run/ztunnel/ztunnel.sock` by default) and the node
//! proxy connects to it. One protobuf message per packet:
//!
//! 1. we send `ZdsHello { version: V1 }`;
//! 2. istio-cni sends its snapshot: `AddWorkload` (the pod's netns fd by SCM_RIGHTS) or
//!    `KeepWorkload` (a pod it knows but whose netns it could not open) per pod, then
//!    `SnapshotSent`; we then remove the ZDS pods the snapshot left out;
//! 3. then `AddWorkload` / `DelWorkload` as pods come and go.
//!
//! Every request is answered with one `Ack` (its `error` empty on success). On a lost
//! connection we reconnect and expect a new snapshot.

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use prost::Message;

use super::wire;
use super::{Enrollment, Source};
use crate::PodInfo;

/// The messages of istio/ztunnel's `proto/zds.proto` (package `istio.workload.zds`),
/// field numbers as there.
pub mod proto {
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum Version {
        NotUsed = 0,
        V1 = 1,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ZdsHello {
        #[prost(enumeration = "Version", tag = "1")]
        pub version: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WorkloadInfo {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub namespace: String,
        #[prost(string, tag = "3")]
        pub service_account: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AddWorkload {
        #[prost(string, tag = "1")]
        pub uid: String,
        #[prost(message, optional, tag = "2")]
        pub workload_info: Option<WorkloadInfo>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeepWorkload {
        #[prost(string, tag = "1")]
        pub uid: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DelWorkload {
        #[prost(string, tag = "2")]
        pub uid: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SnapshotSent {}

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Ack {
        #[prost(string, tag = "1")]
        pub error: String,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "1")]
        Add(AddWorkload),
        #[prost(message, tag = "5")]
        Keep(KeepWorkload),
        #[prost(message, tag = "2")]
        Del(DelWorkload),
        #[prost(message, tag = "3")]
        SnapshotSent(SnapshotSent),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WorkloadRequest {
        #[prost(oneof = "Request", tags = "1, 5, 2, 3")]
        pub payload: Option<Request>,
    }

    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        Ack(Ack),
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WorkloadResponse {
        #[prost(oneof = "Response", tags = "1")]
        pub payload: Option<Response>,
    }
}

/// istio-cni's default socket.
pub const DEFAULT_SOCKET: &str = "/var/run/ztunnel/ztunnel.sock";

/// Longest wait between connection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// One connection's snapshot bookkeeping.
#[derive(Default)]
struct Session {
    snapshot_done: bool,
    /// Uids added or kept before `SnapshotSent`.
    named: HashSet<String>,
}

/// The ZDS client, running on its own thread until [`ZdsClient::stop`] or drop.
pub struct ZdsClient {
    stopping: Arc<AtomicBool>,
    conn: Arc<std::sync::Mutex<Option<UnixStream>>>,
    thread: Option<JoinHandle<()>>,
}

impl ZdsClient {
    /// Connects (and keeps reconnecting) to istio-cni at `path`.
    pub fn start(path: &Path, enrollment: Arc<Enrollment>) -> std::io::Result<Self> {
        let stopping = Arc::new(AtomicBool::new(false));
        let conn = Arc::new(std::sync::Mutex::new(None));
        let thread = {
            let (stopping, conn, path) = (stopping.clone(), conn.clone(), path.to_path_buf());
            std::thread::Builder::new()
                .name("zds-client".into())
                .spawn(move || run(&path, &enrollment, &stopping, &conn))?
        };
        Ok(Self {
            stopping,
            conn,
            thread: Some(thread),
        })
    }

    pub fn stop(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        self.stopping.store(true, Ordering::SeqCst);
        if let Some(conn) = self.conn.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
        let _ = thread.join();
    }
}

impl Drop for ZdsClient {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(
    path: &Path,
    enrollment: &Enrollment,
    stopping: &AtomicBool,
    slot: &std::sync::Mutex<Option<UnixStream>>,
) {
    let mut backoff = Duration::from_millis(10);
    while !stopping.load(Ordering::SeqCst) {
        let conn = match wire::connect(path) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("zds: connecting to {}: {e}", path.display());
                sleep_unless_stopping(backoff, stopping);
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = Duration::from_millis(10);
        if let Ok(clone) = conn.try_clone() {
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(clone);
        }
        if stopping.load(Ordering::SeqCst) {
            return;
        }
        tracing::info!("zds: connected to istio-cni at {}", path.display());
        match session(&conn, enrollment) {
            Ok(()) => tracing::info!("zds: istio-cni closed the connection"),
            Err(e) => tracing::warn!("zds: {e}"),
        }
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = None;
        sleep_unless_stopping(backoff, stopping);
    }
}

fn sleep_unless_stopping(total: Duration, stopping: &AtomicBool) {
    let step = Duration::from_millis(20);
    let mut slept = Duration::ZERO;
    while slept < total && !stopping.load(Ordering::SeqCst) {
        std::thread::sleep(step);
        slept += step;
    }
}

/// One connection: hello, then requests until istio-cni closes or breaks the protocol.
fn session(conn: &UnixStream, enrollment: &Enrollment) -> anyhow::Result<()> {
    let hello = proto::ZdsHello {
        version: proto::Version::V1 as i32,
    };
    wire::send(conn.as_fd(), &hello.encode_to_vec(), None)?;
    let mut session = Session::default();
    loop {
        let packet = wire::recv(conn.as_fd())?;
        if packet.bytes.is_empty() && packet.fd.is_none() {
            return Ok(());
        }
        let (error, fatal) = match handle(&packet.bytes, packet.fd, &mut session, enrollment) {
            Ok(()) => (String::new(), false),
            Err(Failure::Refused(e)) => (e, false),
            Err(Failure::Protocol(e)) => (e, true),
        };
        let ack = proto::WorkloadResponse {
            payload: Some(proto::Response::Ack(proto::Ack {
                error: error.clone(),
            })),
        };
        wire::send(conn.as_fd(), &ack.encode_to_vec(), None)?;
        if fatal {
            anyhow::bail!("protocol error: {error}");
        }
    }
}

enum Failure {
    /// This pod could not be served: said in the Ack, the session goes on.
    Refused(String),
    /// istio-cni broke the protocol: said in the Ack, then we reconnect.
    Protocol(String),
}

fn handle(
    bytes: &[u8],
    fd: Option<OwnedFd>,
    session: &mut Session,
    enrollment: &Enrollment,
) -> Result<(), Failure> {
    let request = proto::WorkloadRequest::decode(bytes)
        .map_err(|e| Failure::Protocol(format!("WorkloadRequest does not decode: {e}")))?;
    let payload = request
        .payload
        .ok_or_else(|| Failure::Protocol("WorkloadRequest has no payload".into()))?;
    match (payload, fd) {
        (proto::Request::Add(add), Some(netns)) => {
            let info = add.workload_info.ok_or_else(|| {
                Failure::Refused(format!("AddWorkload {}: no workload_info", add.uid))
            })?;
            let pod = PodInfo {
                uid: add.uid.clone(),
                name: info.name,
                namespace: info.namespace,
                container_id: String::new(),
                netns_path: None,
                ips: Vec::new(),
                service_account: Some(info.service_account).filter(|s| !s.is_empty()),
                dns: None,
                token_path: None,
            };
            if !session.snapshot_done {
                session.named.insert(add.uid.clone());
            }
            enrollment
                .add(Source::Zds, pod, netns)
                .map_err(|e| Failure::Refused(e.to_string()))?;
            tracing::info!(uid = add.uid, "enrolled pod (ZDS)");
            Ok(())
        }
        (proto::Request::Add(add), None) => Err(Failure::Protocol(format!(
            "AddWorkload {} carries no netns fd",
            add.uid
        ))),
        (_, Some(_)) => Err(Failure::Protocol(
            "only AddWorkload may carry a file descriptor".into(),
        )),
        (proto::Request::Keep(keep), None) => {
            if session.snapshot_done {
                return Err(Failure::Protocol(format!(
                    "KeepWorkload {} after SnapshotSent",
                    keep.uid
                )));
            }
            session.named.insert(keep.uid);
            Ok(())
        }
        (proto::Request::Del(del), None) => {
            session.named.remove(&del.uid);
            enrollment.remove(&del.uid);
            tracing::info!(uid = del.uid, "withdrew pod (ZDS)");
            Ok(())
        }
        (proto::Request::SnapshotSent(_), None) => {
            if session.snapshot_done {
                return Err(Failure::Protocol("a second SnapshotSent".into()));
            }
            session.snapshot_done = true;
            let gone = enrollment.reconcile(Source::Zds, &std::mem::take(&mut session.named));
            if !gone.is_empty() {
                tracing::info!(?gone, "zds: removed pods istio-cni's snapshot left out");
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use prost_reflect::{DescriptorPool, DynamicMessage, Value};

    use super::proto;

    const ZDS_PROTO: &str = include_str!("../../../../../tests/fixtures/istio/protos/zds.proto");

    fn pool() -> DescriptorPool {
        let file = protox_parse::parse("zds.proto", ZDS_PROTO).expect("zds.proto parses");
        let mut pool = DescriptorPool::new();
        pool.add_file_descriptor_proto(file)
            .expect("zds.proto resolves");
        pool
    }

    /// `bytes` decoded as ztunnel's `name` message.
    fn decode(name: &str, bytes: &[u8]) -> DynamicMessage {
        let desc = pool()
            .get_message_by_name(&format!("istio.workload.zds.{name}"))
            .unwrap_or_else(|| panic!("{name} in zds.proto"));
        DynamicMessage::decode(desc, bytes).unwrap()
    }

    fn text(message: &DynamicMessage, path: &[&str]) -> String {
        let (last, parents) = path.split_last().unwrap();
        let mut m = message.clone();
        for p in parents {
            m = m
                .get_field_by_name(p)
                .unwrap()
                .as_message()
                .unwrap()
                .clone();
        }
        m.get_field_by_name(last)
            .unwrap()
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn our_messages_are_the_ones_of_ztunnels_zds_proto() {
        let hello = proto::ZdsHello {
            version: proto::Version::V1 as i32,
        };
        let decoded = decode("ZdsHello", &hello.encode_to_vec());
        assert_eq!(
            decoded
                .get_field_by_name("version")
                .unwrap()
                .as_enum_number(),
            Some(1)
        );

        let add = proto::WorkloadRequest {
            payload: Some(proto::Request::Add(proto::AddWorkload {
                uid: "uid-1".into(),
                workload_info: Some(proto::WorkloadInfo {
                    name: "web-0".into(),
                    namespace: "shop".into(),
                    service_account: "web".into(),
                }),
            })),
        };
        let decoded = decode("WorkloadRequest", &add.encode_to_vec());
        assert_eq!(text(&decoded, &["add", "uid"]), "uid-1");
        assert_eq!(text(&decoded, &["add", "workload_info", "name"]), "web-0");
        assert_eq!(
            text(&decoded, &["add", "workload_info", "namespace"]),
            "shop"
        );
        assert_eq!(
            text(&decoded, &["add", "workload_info", "service_account"]),
            "web"
        );

        for (payload, field) in [
            (
                proto::Request::Keep(proto::KeepWorkload { uid: "k".into() }),
                "keep",
            ),
            (
                proto::Request::Del(proto::DelWorkload { uid: "d".into() }),
                "del",
            ),
        ] {
            let bytes = proto::WorkloadRequest {
                payload: Some(payload),
            }
            .encode_to_vec();
            let decoded = decode("WorkloadRequest", &bytes);
            assert_eq!(text(&decoded, &[field, "uid"]), &field[..1]);
        }
        let snap = proto::WorkloadRequest {
            payload: Some(proto::Request::SnapshotSent(proto::SnapshotSent {})),
        };
        assert!(
            decode("WorkloadRequest", &snap.encode_to_vec()).has_field_by_name("snapshot_sent")
        );

        // And back: what ztunnel's descriptor encodes, our types read.
        let desc = pool()
            .get_message_by_name("istio.workload.zds.WorkloadResponse")
            .unwrap();
        let ack_desc = pool()
            .get_message_by_name("istio.workload.zds.Ack")
            .unwrap();
        let mut ack = DynamicMessage::new(ack_desc);
        ack.set_field_by_name("error", Value::String("no netns".into()));
        let mut response = DynamicMessage::new(desc);
        response.set_field_by_name("ack", Value::Message(ack));
        let ours = proto::WorkloadResponse::decode(&response.encode_to_vec()[..]).unwrap();
        assert_eq!(
            ours.payload,
            Some(proto::Response::Ack(proto::Ack {
                error: "no netns".into()
            }))
        );
    }
}
