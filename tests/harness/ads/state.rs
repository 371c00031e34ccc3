//! What outlives a server restart: the store, the logs, and the open streams (one
//! lock, so a `set` pushes to every stream before it returns and logs stay ordered).

use super::delta::DeltaStream;
use super::sotw::SotwStream;
use super::store::Store;
use super::{Any, Received, Sent, methods};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;
use tonic::Status;

pub(crate) type SotwTx = UnboundedSender<Result<DiscoveryResponse, Status>>;
pub(crate) type DeltaTx = UnboundedSender<Result<DeltaDiscoveryResponse, Status>>;

/// Nonces are unique across all streams, which makes them unique per stream too.
#[derive(Debug, Default)]
pub(crate) struct Nonces(u64);

impl Nonces {
    pub fn next(&mut self) -> String {
        self.0 += 1;
        self.0.to_string()
    }
}

#[derive(Debug)]
enum Kind {
    Sotw(SotwTx, SotwStream),
    Delta(DeltaTx, DeltaStream),
}

#[derive(Debug)]
struct Stream {
    /// The gRPC method it came on (ADS, or a per-type service).
    method: &'static str,
    metadata: Vec<(String, String)>,
    /// The latest node id the stream sent (clients usually send the node only once).
    node_id: Option<String>,
    kind: Kind,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    pub store: Store,
    /// What a node sees instead of `store`, by node id (a control plane's per-proxy
    /// config): a stream whose node has one is served from it alone.
    pub per_node: HashMap<String, Store>,
    streams: HashMap<u64, Stream>,
    next_stream: u64,
    nonces: Nonces,
    pub requests: Vec<Received>,
    pub responses: Vec<Sent>,
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Signalled on every request and response, for the `wait_for*` helpers.
    pub changed: Condvar,
}

impl Shared {
    /// A panic elsewhere while holding the lock must not wedge the harness.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn open_sotw(
        &self,
        method: &'static str,
        metadata: Vec<(String, String)>,
        tx: SotwTx,
    ) -> u64 {
        self.open(method, metadata, Kind::Sotw(tx, SotwStream::default()))
    }

    pub fn open_delta(
        &self,
        method: &'static str,
        metadata: Vec<(String, String)>,
        tx: DeltaTx,
    ) -> u64 {
        self.open(method, metadata, Kind::Delta(tx, DeltaStream::default()))
    }

    fn open(&self, method: &'static str, metadata: Vec<(String, String)>, kind: Kind) -> u64 {
        let mut st = self.lock();
        st.next_stream += 1;
        let id = st.next_stream;
        let stream = Stream {
            method,
            metadata,
            node_id: None,
            kind,
        };
        st.streams.insert(id, stream);
        id
    }

    /// Dropping the sender ends the response stream (with OK unless `status` was sent).
    pub fn close(&self, id: u64, status: Option<Status>) {
        let Some(stream) = self.lock().streams.remove(&id) else {
            return;
        };
        if let Some(status) = status {
            // The receiver may be gone already; nothing to tell then.
            match stream.kind {
                Kind::Sotw(tx, _) => drop(tx.send(Err(status))),
                Kind::Delta(tx, _) => drop(tx.send(Err(status))),
            }
        }
    }

    pub fn close_all(&self, status: Status) {
        let ids: Vec<u64> = self.lock().streams.keys().copied().collect();
        for id in ids {
            self.close(id, Some(status.clone()));
        }
    }

    pub fn stream_count(&self) -> usize {
        self.lock().streams.len()
    }

    pub fn on_sotw(&self, id: u64, mut req: DiscoveryRequest) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(stream) = st.streams.get_mut(&id) else {
            return;
        };
        if let Some(node) = &req.node {
            stream.node_id = Some(node.id.clone());
        }
        let wrong_type = implicit_type(stream.method, &mut req.type_url);
        st.requests.push(Received {
            stream: id,
            method: stream.method,
            delta: false,
            at: Instant::now(),
            type_url: req.type_url.clone(),
            node_id: stream.node_id.clone(),
            node: req.node.clone(),
            version_info: req.version_info.clone(),
            response_nonce: req.response_nonce.clone(),
            resource_names: req.resource_names.clone(),
            unsubscribe: Vec::new(),
            initial_resource_versions: HashMap::new(),
            error_detail: req
                .error_detail
                .as_ref()
                .map(|s| (s.code, s.message.clone())),
            metadata: stream.metadata.clone(),
        });
        if let Some(status) = wrong_type {
            reject(st, id, status);
        } else if req.type_url.is_empty() {
            eprintln!("ads: stream {id}: request without type_url ignored");
        } else if let Kind::Sotw(tx, sotw) = &mut stream.kind
            && let Some(reply) = sotw.on_request(
                store_of(&st.store, &st.per_node, &stream.node_id),
                &mut st.nonces,
                &req,
            )
        {
            send_sotw(&mut st.responses, id, stream.method, tx, reply);
        }
        self.changed.notify_all();
    }

    pub fn on_delta(&self, id: u64, mut req: DeltaDiscoveryRequest) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(stream) = st.streams.get_mut(&id) else {
            return;
        };
        if let Some(node) = &req.node {
            stream.node_id = Some(node.id.clone());
        }
        let wrong_type = implicit_type(stream.method, &mut req.type_url);
        st.requests.push(Received {
            stream: id,
            method: stream.method,
            delta: true,
            at: Instant::now(),
            type_url: req.type_url.clone(),
            node_id: stream.node_id.clone(),
            node: req.node.clone(),
            version_info: String::new(),
            response_nonce: req.response_nonce.clone(),
            resource_names: req.resource_names_subscribe.clone(),
            unsubscribe: req.resource_names_unsubscribe.clone(),
            initial_resource_versions: req.initial_resource_versions.clone(),
            error_detail: req
                .error_detail
                .as_ref()
                .map(|s| (s.code, s.message.clone())),
            metadata: stream.metadata.clone(),
        });
        if let Some(status) = wrong_type {
            reject(st, id, status);
        } else if req.type_url.is_empty() {
            eprintln!("ads: stream {id}: delta request without type_url ignored");
        } else if let Kind::Delta(tx, delta) = &mut stream.kind
            && let Some(resp) = delta.on_request(
                store_of(&st.store, &st.per_node, &stream.node_id),
                &mut st.nonces,
                &req,
            )
        {
            send_delta(&mut st.responses, id, stream.method, tx, resp);
        }
        self.changed.notify_all();
    }

    pub fn set(&self, type_url: &str, version: &str, resources: Vec<(String, Any)>) {
        self.set_for(None, type_url, version, resources);
    }

    /// As [`Shared::set`], for `node` alone when given (its streams are pushed to).
    pub fn set_for(
        &self,
        node: Option<&str>,
        type_url: &str,
        version: &str,
        resources: Vec<(String, Any)>,
    ) {
        let mut guard = self.lock();
        let st = &mut *guard;
        match node {
            Some(node) => st
                .per_node
                .entry(node.to_owned())
                .or_default()
                .set(type_url, version, resources),
            None => st.store.set(type_url, version, resources),
        }
        let mut ids: Vec<u64> = st
            .streams
            .iter()
            .filter(|(_, s)| node.is_none() || s.node_id.as_deref() == node)
            .map(|(id, _)| *id)
            .collect();
        // Push in stream order, so the response log is deterministic.
        ids.sort_unstable();
        for id in ids {
            let stream = st.streams.get_mut(&id).expect("id listed above");
            let store = store_of(&st.store, &st.per_node, &stream.node_id);
            match &mut stream.kind {
                Kind::Sotw(tx, sotw) => {
                    if let Some(reply) = sotw.on_set(store, &mut st.nonces, type_url) {
                        send_sotw(&mut st.responses, id, stream.method, tx, reply);
                    }
                }
                Kind::Delta(tx, delta) => {
                    if let Some(resp) = delta.on_set(store, &mut st.nonces, type_url) {
                        send_delta(&mut st.responses, id, stream.method, tx, resp);
                    }
                }
            }
        }
        self.changed.notify_all();
    }
}

/// The store a stream of `node` is served from.
fn store_of<'a>(
    shared: &'a Store,
    per_node: &'a HashMap<String, Store>,
    node: &Option<String>,
) -> &'a Store {
    node.as_ref()
        .and_then(|n| per_node.get(n))
        .unwrap_or(shared)
}

/// A per-type stream carries its one type: a request may leave `type_url` empty (it is
/// filled in), but one naming another type gets the stream closed, as
/// go-control-plane does.
fn implicit_type(method: &'static str, type_url: &mut String) -> Option<Status> {
    let only = methods::type_of(method)?;
    if type_url.is_empty() {
        only.clone_into(type_url);
        None
    } else if type_url != only {
        Some(Status::invalid_argument(format!(
            "{method} carries {only}, not {type_url}"
        )))
    } else {
        None
    }
}

/// End stream `id` with `status` (under the lock, from a request handler).
fn reject(st: &mut State, id: u64, status: Status) {
    eprintln!("ads: stream {id}: {}", status.message());
    if let Some(stream) = st.streams.remove(&id) {
        match stream.kind {
            Kind::Sotw(tx, _) => drop(tx.send(Err(status))),
            Kind::Delta(tx, _) => drop(tx.send(Err(status))),
        }
    }
}

fn send_sotw(
    log: &mut Vec<Sent>,
    stream: u64,
    method: &'static str,
    tx: &SotwTx,
    (resp, names): (DiscoveryResponse, Vec<String>),
) {
    log.push(Sent {
        stream,
        method,
        delta: false,
        at: Instant::now(),
        type_url: resp.type_url.clone(),
        version_info: resp.version_info.clone(),
        nonce: resp.nonce.clone(),
        names,
        removed: Vec::new(),
    });
    // A closed receiver means the stream is ending; its reader task cleans up.
    let _ = tx.send(Ok(resp));
}

fn send_delta(
    log: &mut Vec<Sent>,
    stream: u64,
    method: &'static str,
    tx: &DeltaTx,
    resp: DeltaDiscoveryResponse,
) {
    log.push(Sent {
        stream,
        method,
        delta: true,
        at: Instant::now(),
        type_url: resp.type_url.clone(),
        version_info: resp.system_version_info.clone(),
        nonce: resp.nonce.clone(),
        names: resp.resources.iter().map(|r| r.name.clone()).collect(),
        removed: resp.removed_resources.clone(),
    });
    let _ = tx.send(Ok(resp));
}
