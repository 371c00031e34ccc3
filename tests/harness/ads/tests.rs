//! Protocol logic against the shared state directly (no gRPC); tests/ads_server.rs
//! covers the wire.

use super::state::Shared;
use super::{AdsServer, Any, methods};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tonic::Status;

const T: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const E: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

fn any(value: &str) -> Any {
    Any {
        type_url: T.into(),
        value: value.as_bytes().to_vec(),
    }
}

fn res(items: &[(&str, &str)]) -> Vec<(String, Any)> {
    items.iter().map(|(n, v)| (n.to_string(), any(v))).collect()
}

fn drain<R>(rx: &mut UnboundedReceiver<Result<R, Status>>) -> Vec<R> {
    let mut out = Vec::new();
    while let Ok(item) = rx.try_recv() {
        out.push(item.expect("no error status"));
    }
    out
}

fn sotw_req(type_url: &str, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: type_url.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn sotw_names(r: &DiscoveryResponse) -> Vec<String> {
    r.resources
        .iter()
        .map(|a| String::from_utf8(a.value.clone()).unwrap())
        .collect()
}

#[test]
fn sotw_wildcard_initial_ack_push() {
    let shared = Shared::default();
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_sotw(methods::ADS, vec![("x-k".into(), "v".into())], tx);

    // Nothing set yet: the client waits.
    shared.on_sotw(id, sotw_req(T, &[], "", ""));
    assert!(drain(&mut rx).is_empty());

    // An empty set still answers a wildcard.
    shared.set(T, "1", vec![]);
    let r = drain(&mut rx);
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].version_info.as_str(), r[0].resources.len()), ("1", 0));

    // ACK: nothing more.
    shared.on_sotw(id, sotw_req(T, &[], "1", &r[0].nonce));
    assert!(drain(&mut rx).is_empty());

    shared.set(T, "2", res(&[("a", "a1"), ("b", "b1")]));
    let r2 = drain(&mut rx);
    assert_eq!(r2.len(), 1);
    assert_eq!(sotw_names(&r2[0]), ["a1", "b1"]);
    assert_ne!(r2[0].nonce, r[0].nonce);

    // A stale ACK (for nonce of v1) is ignored, a NACK of the latest gets no answer.
    shared.on_sotw(id, sotw_req(T, &[], "1", &r[0].nonce));
    let mut nack = sotw_req(T, &[], "1", &r2[0].nonce);
    nack.error_detail = Some(RpcStatus {
        code: 3,
        message: "bad".into(),
        details: vec![],
    });
    shared.on_sotw(id, nack);
    assert!(drain(&mut rx).is_empty());

    let st = shared.lock();
    assert_eq!(st.requests.len(), 4);
    assert!(!st.requests[0].is_ack() && st.requests[1].is_ack());
    assert!(st.requests[3].is_nack() && !st.requests[3].is_ack());
    assert_eq!(st.requests[3].error_detail, Some((3, "bad".into())));
    assert_eq!(
        st.requests[0].metadata,
        [("x-k".to_string(), "v".to_string())]
    );
    assert_eq!(st.responses.len(), 2);
    assert_eq!(st.responses[1].names, ["a", "b"]);
}

#[test]
fn sotw_named_subscription() {
    let shared = Shared::default();
    shared.set(E, "1", res(&[("a", "a1"), ("b", "b1")]));
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_sotw(methods::ADS, vec![], tx);

    // None of the names exist: no response.
    shared.on_sotw(id, sotw_req(E, &["z"], "", ""));
    assert!(drain(&mut rx).is_empty());
    // A changed set (no nonce yet, so not stale) is answered with what exists.
    shared.on_sotw(id, sotw_req(E, &["a", "z"], "", ""));
    let r = drain(&mut rx);
    assert_eq!(sotw_names(&r[0]), ["a1"]);
    // ACK with the same names: nothing. Adding a name: the new subset.
    shared.on_sotw(id, sotw_req(E, &["z", "a"], "1", &r[0].nonce));
    assert!(drain(&mut rx).is_empty());
    shared.on_sotw(id, sotw_req(E, &["a", "b"], "1", &r[0].nonce));
    let r = drain(&mut rx);
    assert_eq!(sotw_names(&r[0]), ["a1", "b1"]);
    // A push carries only the subscribed names.
    shared.set(E, "2", res(&[("a", "a2"), ("b", "b1"), ("c", "c1")]));
    let r = drain(&mut rx);
    assert_eq!(r[0].version_info, "2");
    assert_eq!(sotw_names(&r[0]), ["a2", "b1"]);
    // An empty list on a named subscription unsubscribes: later sets send nothing.
    shared.on_sotw(id, sotw_req(E, &[], "2", &r[0].nonce));
    shared.set(E, "3", res(&[("a", "a3")]));
    assert!(drain(&mut rx).is_empty());
    // Another type on the same stream is independent.
    shared.set(T, "9", vec![]);
    assert!(drain(&mut rx).is_empty());
}

#[test]
fn sotw_legacy_wildcard_survives_empty_requests_and_star() {
    let shared = Shared::default();
    shared.set(T, "1", res(&[("a", "a1")]));
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_sotw(methods::ADS, vec![], tx);
    shared.on_sotw(id, sotw_req(T, &["*", "a"], "", ""));
    let r = drain(&mut rx);
    assert_eq!(sotw_names(&r[0]), ["a1"]);
    shared.on_sotw(id, sotw_req(T, &["*", "a"], "1", &r[0].nonce));
    assert!(drain(&mut rx).is_empty());
    shared.set(T, "2", res(&[("a", "a1"), ("b", "b1")]));
    assert_eq!(sotw_names(&drain(&mut rx)[0]), ["a1", "b1"]);
}

fn delta_req(type_url: &str, sub: &[&str], unsub: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: type_url.into(),
        resource_names_subscribe: sub.iter().map(|s| s.to_string()).collect(),
        resource_names_unsubscribe: unsub.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

fn delta_names(r: &DeltaDiscoveryResponse) -> Vec<(String, String)> {
    r.resources
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect()
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn delta_wildcard_initial_versions_and_removal() {
    let shared = Shared::default();
    shared.set(T, "1", res(&[("a", "a"), ("b", "b")]));
    shared.set(T, "2", res(&[("a", "a"), ("b", "b2"), ("c", "c")]));
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_delta(methods::ADS_DELTA, vec![], tx);

    // The client has a@1 (current), b@1 (stale) and gone@1 (removed since).
    let mut first = delta_req(T, &[], &[], "");
    first.initial_resource_versions = [("a", "1"), ("b", "1"), ("gone", "1")]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    shared.on_delta(id, first);
    let r = drain(&mut rx);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].system_version_info, "2");
    assert_eq!(delta_names(&r[0]), pairs(&[("b", "2"), ("c", "2")]));
    assert_eq!(r[0].removed_resources, ["gone"]);

    // ACK: nothing. A set changing only c sends only c; dropping b removes it.
    shared.on_delta(id, delta_req(T, &[], &[], &r[0].nonce));
    assert!(drain(&mut rx).is_empty());
    shared.set(T, "3", res(&[("a", "a"), ("c", "c3")]));
    let r = drain(&mut rx);
    assert_eq!(delta_names(&r[0]), pairs(&[("c", "3")]));
    assert_eq!(r[0].removed_resources, ["b"]);
    // Same bytes again: nothing changed for this client, no response.
    shared.set(T, "4", res(&[("a", "a"), ("c", "c3")]));
    assert!(drain(&mut rx).is_empty());

    let st = shared.lock();
    assert!(st.requests[0].delta);
    assert_eq!(st.requests[0].initial_resource_versions.len(), 3);
    assert_eq!(st.responses[1].removed, ["b"]);
}

#[test]
fn delta_wildcard_gets_a_first_empty_response() {
    let shared = Shared::default();
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_delta(methods::ADS_DELTA, vec![], tx);
    shared.on_delta(id, delta_req(T, &["*"], &[], ""));
    assert!(drain(&mut rx).is_empty());
    shared.set(T, "1", vec![]);
    let r = drain(&mut rx);
    assert_eq!(r.len(), 1);
    assert!(r[0].resources.is_empty() && r[0].removed_resources.is_empty());
    shared.set(T, "2", vec![]);
    assert!(drain(&mut rx).is_empty());
}

#[test]
fn delta_named_subscribe_unsubscribe() {
    let shared = Shared::default();
    shared.set(E, "1", res(&[("a", "a"), ("b", "b")]));
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_delta(methods::ADS_DELTA, vec![], tx);

    let mut first = delta_req(E, &["a"], &[], "");
    first.initial_resource_versions = [("a".to_string(), "1".to_string())].into();
    shared.on_delta(id, first);
    // Already up to date: no response.
    assert!(drain(&mut rx).is_empty());

    // Subscribing with a stale nonce still counts (subscriptions are diffs).
    shared.on_delta(id, delta_req(E, &["b", "missing"], &[], "stale"));
    let r = drain(&mut rx);
    assert_eq!(delta_names(&r[0]), pairs(&[("b", "1")]));

    // Unsubscribed names are neither updated nor reported removed.
    shared.on_delta(id, delta_req(E, &[], &["a"], ""));
    shared.set(E, "2", res(&[("a", "a2"), ("missing", "m")]));
    let r = drain(&mut rx);
    assert_eq!(r.len(), 1);
    assert_eq!(delta_names(&r[0]), pairs(&[("missing", "2")]));
    assert_eq!(r[0].removed_resources, ["b"]);
    // Resubscribing sends it again (the client dropped it).
    shared.on_delta(id, delta_req(E, &["a"], &[], ""));
    assert_eq!(delta_names(&drain(&mut rx)[0]), pairs(&[("a", "2")]));
}

#[test]
fn set_pushes_to_every_subscribed_stream_and_close_ends_them() {
    let shared = Shared::default();
    let (tx1, mut rx1) = unbounded_channel();
    let (tx2, mut rx2) = unbounded_channel();
    let s1 = shared.open_sotw(methods::ADS, vec![], tx1);
    let s2 = shared.open_delta(methods::ADS_DELTA, vec![], tx2);
    shared.on_sotw(s1, sotw_req(T, &[], "", ""));
    shared.on_delta(s2, delta_req(T, &[], &[], ""));
    shared.set(T, "1", res(&[("a", "a")]));
    assert_eq!(drain(&mut rx1).len(), 1);
    assert_eq!(drain(&mut rx2).len(), 1);
    let st = shared.lock();
    let nonces: Vec<_> = st.responses.iter().map(|s| s.nonce.clone()).collect();
    assert_eq!(nonces.len(), 2);
    assert_ne!(nonces[0], nonces[1]);
    drop(st);

    assert_eq!(shared.stream_count(), 2);
    shared.close_all(Status::unavailable("bye"));
    assert_eq!(shared.stream_count(), 0);
    assert_eq!(
        rx1.try_recv().unwrap().unwrap_err().code(),
        tonic::Code::Unavailable
    );
    assert!(rx1.try_recv().is_err());
    // Requests on a closed stream are dropped, not recorded.
    shared.on_sotw(s1, sotw_req(T, &[], "", ""));
    assert_eq!(shared.lock().requests.len(), 2);
}

#[test]
fn any_uses_the_google_prefix() {
    let cla = envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment {
        cluster_name: "c".into(),
        ..Default::default()
    };
    let a = AdsServer::any(&cla);
    assert_eq!(a.type_url, E);
    assert_eq!(a.value, prost::Message::encode_to_vec(&cla));
}

#[test]
fn per_type_streams_carry_their_one_type() {
    assert_eq!(methods::per_type(E, true), Some(methods::ENDPOINTS_DELTA));
    assert_eq!(methods::type_of(methods::CLUSTERS), Some(T));
    assert_eq!(methods::type_of(methods::ADS), None);

    let shared = Shared::default();
    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_sotw(methods::CLUSTERS, vec![], tx);
    shared.set(T, "1", res(&[("a", "a")]));
    // The type is implicit on a per-type stream: an empty one is the stream's.
    shared.on_sotw(id, sotw_req("", &[], "", ""));
    let r = drain(&mut rx);
    assert_eq!((r.len(), r[0].type_url.as_str()), (1, T));
    {
        let st = shared.lock();
        assert_eq!(st.requests[0].type_url, T);
        assert_eq!(st.requests[0].method, methods::CLUSTERS);
        assert!(!st.requests[0].is_ads());
        assert_eq!(st.responses[0].method, methods::CLUSTERS);
    }
    // Another type ends the stream.
    shared.on_sotw(id, sotw_req(E, &["a"], "", ""));
    assert_eq!(
        rx.try_recv().unwrap().unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    assert_eq!(shared.stream_count(), 0);
    assert_eq!(shared.lock().requests[1].type_url, E, "logged as sent");

    let (tx, mut rx) = unbounded_channel();
    let id = shared.open_delta(methods::LISTENERS_DELTA, vec![], tx);
    shared.on_delta(id, delta_req(T, &[], &[], ""));
    assert_eq!(
        rx.try_recv().unwrap().unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
}
