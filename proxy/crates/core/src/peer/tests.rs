use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use serde_json::json;

use super::exchange::{self, Decoded, ExchangeError, PeerExchange};
use super::headers;
use super::*;

/// istio-proxy's metadata exchange test node: id `test`, namespace `default`, and a label
/// (its test puts `labels` lower case, which the exchange drops; here `LABELS`).
fn test_node() -> LocalNode {
    LocalNode::from_node(&Node {
        id: "test".into(),
        metadata: Some(struct_from_json(&json!({
            "NAMESPACE": "default",
            "LABELS": {"app": "details"},
            "SERVICE_ACCOUNT": "bookinfo-details",
            "INTERCEPTION_MODE": "REDIRECT",
        }))),
        ..Node::default()
    })
}

/// The exchange header for [`test_node`], encoded independently (by hand, following
/// protobuf's deterministic encoding: map entries by key, key and value always written).
const TEST_NODE_HEADER: &str = "3d230467000000a70a2a747970652e676f6f676c65617069732e636f6d2f676f6f676c652e70726f746f6275662e53747275637412790a530a15782d656e766f792d706565722d6d65746164617461123a2a380a1e0a064c4142454c5312142a120a100a0361707012091a0764657461696c730a160a094e414d45535041434512091a0764656661756c740a220a18782d656e766f792d706565722d6d657461646174612d696412061a0474657374";

fn hex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn the_exchange_header_is_byte_for_byte_istio_proxys() {
    let node = test_node();
    assert_eq!(node.service_account, "bookinfo-details");
    assert_eq!(exchange::encode(&node), hex(TEST_NODE_HEADER));
}

#[test]
fn a_header_followed_by_payload_decodes_and_leaves_the_payload() {
    let node = test_node();
    let mut wire = exchange::encode(&node);
    let header_len = wire.len();
    wire.extend_from_slice(b"world");
    let Decoded::Done { peer, consumed } = exchange::decode(&wire).unwrap() else {
        panic!("complete header not decoded");
    };
    assert_eq!(consumed, header_len);
    assert_eq!(&wire[consumed..], b"world");
    assert_eq!(
        *peer,
        PeerExchange {
            metadata: Some(node.metadata.clone()),
            id: Some("test".into()),
        }
    );
    // The exchange keeps only the exchanged fields.
    let workload = peer.metadata.unwrap().workload();
    assert_eq!(workload.namespace_name, "default");
    assert_eq!(workload.app_name, "details");
}

#[test]
fn every_prefix_of_a_header_asks_for_more() {
    let wire = exchange::encode(&test_node());
    for cut in 0..wire.len() {
        match exchange::decode(&wire[..cut]) {
            Ok(Decoded::NeedMore { want }) => {
                assert!(want > cut && want <= wire.len(), "{cut}: {want}")
            }
            other => panic!("{cut}: {other:?}"),
        }
    }
}

#[test]
fn bad_headers_are_named() {
    assert_eq!(
        exchange::decode(b"GET / HTTP/1.1\r\n"),
        Err(ExchangeError::BadMagic { found: 0x47455420 })
    );
    let mut big = exchange::MAGIC.to_be_bytes().to_vec();
    big.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        exchange::decode(&big),
        Err(ExchangeError::TooLarge { .. })
    ));
    let mut junk = exchange::MAGIC.to_be_bytes().to_vec();
    junk.extend_from_slice(&3u32.to_be_bytes());
    junk.extend_from_slice(&[0xff, 0xff, 0xff]);
    assert!(matches!(
        exchange::decode(&junk),
        Err(ExchangeError::NotAny { .. })
    ));
    let other = Any {
        type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
        value: vec![],
    }
    .encode_to_vec();
    let mut wrong = exchange::MAGIC.to_be_bytes().to_vec();
    wrong.extend_from_slice(&(other.len() as u32).to_be_bytes());
    wrong.extend_from_slice(&other);
    let err = exchange::decode(&wrong).unwrap_err();
    assert!(err.to_string().contains("StringValue"), "{err}");
}

#[test]
fn node_metadata_keeps_the_exchanged_fields_and_round_trips() {
    let metadata = NodeMetadata {
        name: "productpage-v1-84975bc778-pxz2w".into(),
        namespace: "default".into(),
        owner: "kubernetes://apis/apps/v1/namespaces/default/deployments/productpage-v1".into(),
        workload_name: "productpage-v1".into(),
        istio_version: "1.5-dev".into(),
        mesh_id: "mesh".into(),
        cluster_id: "client-cluster".into(),
        labels: BTreeMap::from([("app".into(), "productpage".into())]),
        platform_metadata: BTreeMap::from([("gcp_project".into(), "p".into())]),
        app_containers: vec!["test".into(), "bonzai".into()],
        instance_ips: vec!["10.52.0.34".into(), "fe80::1".into()],
    };
    assert_eq!(NodeMetadata::from_struct(&metadata.to_struct()), metadata);
    assert_eq!(metadata.workload().workload_type, WorkloadType::Deployment);
}

#[test]
fn the_peer_metadata_header_is_base64_of_the_struct() {
    let node = test_node();
    let value = headers::encode_metadata(&node.metadata);
    assert_eq!(
        value,
        "Ch4KBkxBQkVMUxIUKhIKEAoDYXBwEgkaB2RldGFpbHMKFgoJTkFNRVNQQUNFEgkaB2RlZmF1bHQ="
    );
    assert_eq!(headers::decode_metadata(&value).unwrap(), node.metadata);
    // Envoy decodes without padding too.
    assert_eq!(
        headers::decode_metadata(value.trim_end_matches('=')).unwrap(),
        node.metadata
    );
    assert!(matches!(
        headers::decode_metadata("not base64!"),
        Err(headers::HeaderError::NotBase64(_))
    ));
    assert!(matches!(
        headers::decode_metadata("/w=="),
        Err(headers::HeaderError::NotStruct(_))
    ));
}

#[test]
fn baggage_reads_and_writes_as_istio_proxy_does() {
    let workload = Workload::from_baggage(
        "k8s.deployment.name=ratings-v1,k8s.namespace.name=default,service.name=ratings,\
         service.version=v1,app.name=ratings,app.version=v1,k8s.cluster.name=c1,other=x,bare",
    );
    assert_eq!(workload.workload_type, WorkloadType::Deployment);
    assert_eq!(workload.workload_name, "ratings-v1");
    assert_eq!(workload.cluster_name, "c1");
    assert_eq!(
        workload.baggage(),
        "k8s.deployment.name=ratings-v1,k8s.cluster.name=c1,k8s.namespace.name=default,\
         service.name=ratings,service.version=v1,app.name=ratings,app.version=v1"
    );
    let pod = Workload::from_baggage("k8s.pod.name=p-1");
    assert_eq!(pod.instance_name, "p-1");
    assert_eq!(pod.baggage(), "k8s.pod.name=p-1");
    // Through node metadata (what the HTTP filter stores), the workload survives.
    assert_eq!(workload.to_node_metadata().workload(), workload);
}

#[test]
fn owners_name_the_workload_type() {
    let owner = |kind: &str| format!("{OWNER_PREFIX}default/{kind}/w");
    assert_eq!(
        WorkloadType::from_owner(&owner("deployments"), "w"),
        WorkloadType::Deployment
    );
    assert_eq!(
        WorkloadType::from_owner(&owner("cronjobs"), "w"),
        WorkloadType::CronJob
    );
    assert_eq!(
        WorkloadType::from_owner(&owner("jobs"), "w"),
        WorkloadType::Job
    );
    assert_eq!(
        WorkloadType::from_owner(&owner("jobs"), "x"),
        WorkloadType::Pod
    );
    assert_eq!(WorkloadType::from_owner("", ""), WorkloadType::Pod);
    assert_eq!(
        Workload::from_endpoint_metadata("ratings-v1;default;ratings;v1;Kubernetes").map(|w| (
            w.workload_name,
            w.namespace_name,
            w.cluster_name
        )),
        Some(("ratings-v1".into(), "default".into(), "Kubernetes".into()))
    );
    assert_eq!(Workload::from_endpoint_metadata("a;b"), None);
}
