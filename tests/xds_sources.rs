//! Per-type xDS config sources: `dynamic_resources.cds_config` and `lds_config` as an
//! `api_config_source` each (no ADS), so `shunt proxy` opens one stream per type on the
//! per-type gRPC services (ClusterDiscoveryService, EndpointDiscoveryService,
//! ListenerDiscoveryService, ...) of the in-process test server ([`harness::ads`]),
//! reached over a Unix socket as Istio's agent is; once with state of the world (GRPC)
//! and once with Delta (DELTA_GRPC).
//!
//! Each run checks that clusters, endpoints and listeners each come on a stream of their
//! own, on their own service, each stream sending the node and the initial metadata;
//! that every type is ACKed; that traffic through the listener reaches the endpoint; and
//! that an endpoint update moves new connections to the other echo server. Needs root,
//! except `per_type_services_over_the_wire`, which checks the server alone.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::api_config_source::ApiType;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::core::v3::grpc_service::{EnvoyGrpc, TargetSpecifier};
use envoy_types::pb::envoy::config::core::v3::{ApiConfigSource, ConfigSource, GrpcService};
use envoy_types::pb::envoy::service::cluster::v3::cluster_discovery_service_client::ClusterDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use envoy_types::pb::envoy::service::endpoint::v3::endpoint_discovery_service_client::EndpointDiscoveryServiceClient;
use harness::ads::resources::{self, load_assignment, named};
use harness::ads::{AdsServer, Any, Listen, Received, methods, type_urls};
use harness::{Node, Pod};
use serde_json::Value;
use support::xds::{self, admin_at, describe, dump_section, eventually, start_shunt, unix_server};
use support::*;
use tokio_stream::wrappers::UnboundedReceiverStream;

const ADMIN: &str = "127.0.0.1:15000";
const LISTEN_PORT: u16 = 10000;
const ECHO_A: u16 = 9001;
const ECHO_B: u16 = 9002;
const NODE_ID: &str = "sidecar~10.0.0.1~p.default~default.svc.cluster.local";

/// The source the bootstrap's `cds_config` uses, as Envoy wants an EDS cluster's
/// `eds_config` without ADS.
fn api_source(delta: bool) -> ConfigSource {
    ConfigSource {
        config_source_specifier: Some(ConfigSourceSpecifier::ApiConfigSource(ApiConfigSource {
            api_type: if delta {
                ApiType::DeltaGrpc
            } else {
                ApiType::Grpc
            } as i32,
            grpc_services: vec![GrpcService {
                target_specifier: Some(TargetSpecifier::EnvoyGrpc(EnvoyGrpc {
                    cluster_name: "xds-grpc".into(),
                    ..Default::default()
                })),
                ..Default::default()
            }],
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn eds_cluster(name: &str, delta: bool) -> (String, Any) {
    named(name, &resources::eds_cluster(name, api_source(delta), 1))
}

fn endpoints(name: &str, port: u16) -> (String, Any) {
    named(name, &load_assignment(name, &[local(port)]))
}

fn admin(pod: &Pod, path: &str) -> (u16, String) {
    admin_at(pod, ADMIN, path)
}

/// Which echo server a new connection through the listener reaches, if any.
fn reaches(pod: &Pod) -> Option<u16> {
    xds::reaches(pod, local(LISTEN_PORT))
}

/// Version `version` of `type_url` was sent and ACKed, on the type's own method.
fn acked(server: &AdsServer, type_url: &str, version: &str, delta: bool) -> bool {
    let method = methods::per_type(type_url, delta).unwrap();
    xds::acked(server, type_url, version, delta, Some(method))
}

/// CDS and LDS each from an `api_config_source` on the same server (a static cluster
/// with a `pipe` endpoint), no `ads_config`.
fn bootstrap(socket: &Path, delta: bool) -> Value {
    let source = serde_json::json!({
        "api_config_source": {
            "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
            "transport_api_version": "V3",
            "set_node_on_first_message_only": true,
            "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"},
                               "initial_metadata": [{"key": "x-shunt-test", "value": "yes"}]}]
        },
        "initial_fetch_timeout": "0s",
        "resource_api_version": "V3"
    });
    serde_json::json!({
        "node": {"id": NODE_ID, "cluster": "p.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "dynamic_resources": {"cds_config": source, "lds_config": source},
        "static_resources": {"clusters": [{
            "name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": socket.display().to_string()}}}}]}]}
        }]}
    })
}

fn per_type_sources_drive_the_proxy(delta: bool) {
    let (dir, socket, server) = unix_server(if delta { "delta" } else { "sotw" });
    xds::serve_backend(&server, eds_cluster("backend", delta), ECHO_A, LISTEN_PORT);

    let mut node = Node::new().unwrap();
    let pod = node.add_pod("p").unwrap();
    let _echo = start_app(&pod, &[ECHO_A, ECHO_B]);
    let config = dir.0.join("bootstrap.json");
    let proxy = start_shunt(
        &pod,
        &config,
        &bootstrap(&socket, delta),
        &["--concurrency", "2", "--drain-time-s", "1"],
    );

    eventually("ready", &proxy, &server, || admin(&pod, "/ready").0 == 200);
    for (t, v) in [
        (type_urls::CLUSTER, "c1"),
        (type_urls::ENDPOINT, "e1"),
        (type_urls::LISTENER, "l1"),
    ] {
        eventually(&format!("{t} {v} ACKed"), &proxy, &server, || {
            acked(&server, t, v, delta)
        });
    }

    // One stream per type, each on its type's own service and method; none on ADS.
    let requests = server.requests();
    assert!(
        requests.iter().all(|r| !r.is_ads() && r.delta == delta),
        "only per-type {} streams:\n{}",
        if delta { "Delta" } else { "SotW" },
        describe(&requests)
    );
    let mut streams: BTreeMap<u64, BTreeSet<(&str, &str)>> = BTreeMap::new();
    for r in &requests {
        streams
            .entry(r.stream)
            .or_default()
            .insert((r.method, r.type_url.as_str()));
    }
    for (stream, carried) in &streams {
        assert_eq!(
            carried.len(),
            1,
            "stream {stream} carries one type on one method: {carried:?}"
        );
    }
    let stream_of = |type_url: &str| -> u64 {
        let method = methods::per_type(type_url, delta).unwrap();
        let ids: BTreeSet<u64> = requests
            .iter()
            .filter(|r| r.type_url == type_url)
            .map(|r| {
                assert_eq!(r.method, method, "{type_url} on its own method");
                r.stream
            })
            .collect();
        assert_eq!(
            ids.len(),
            1,
            "{type_url} on one stream:\n{}",
            describe(&requests)
        );
        ids.into_iter().next().unwrap()
    };
    let (cds, eds, lds) = (
        stream_of(type_urls::CLUSTER),
        stream_of(type_urls::ENDPOINT),
        stream_of(type_urls::LISTENER),
    );
    assert!(
        cds != eds && eds != lds && cds != lds,
        "CDS {cds}, EDS {eds}, LDS {lds} on separate streams"
    );
    // Each stream sends the node on its first message (and only there) and the
    // source's initial metadata.
    for id in [cds, eds, lds] {
        let on_stream: Vec<&Received> = requests.iter().filter(|r| r.stream == id).collect();
        let first = on_stream[0];
        assert_eq!(
            first.node.as_ref().map(|n| n.id.as_str()),
            Some(NODE_ID),
            "stream {id} ({}) sends the node first",
            first.method
        );
        assert!(
            on_stream[1..].iter().all(|r| r.node.is_none()),
            "set_node_on_first_message_only on stream {id}"
        );
        assert_eq!(first.metadata("x-shunt-test"), Some("yes"), "stream {id}");
    }
    let eds_request = requests.iter().find(|r| r.stream == eds).unwrap();
    assert_eq!(
        eds_request.resource_names,
        ["backend"],
        "EDS asks for the EDS cluster's endpoints"
    );

    // Traffic goes through.
    assert_eq!(reaches(&pod), Some(ECHO_A));
    let (status, body) = admin(&pod, "/config_dump");
    assert_eq!(status, 200, "{body}");
    let dump: Value = serde_json::from_str(&body).unwrap();
    let clusters = dump_section(&dump, "ClustersConfigDump");
    assert_eq!(clusters["version_info"], "c1", "{clusters}");
    let listeners = dump_section(&dump, "ListenersConfigDump");
    assert_eq!(
        listeners["dynamic_listeners"][0]["active_state"]["version_info"], "l1",
        "{listeners}"
    );

    // An endpoint update goes out on the EDS stream alone and moves new connections.
    let responses_before = server.responses().len();
    server.set(
        type_urls::ENDPOINT,
        "e2",
        vec![endpoints("backend", ECHO_B)],
    );
    let pushed: Vec<_> = server.responses()[responses_before..]
        .iter()
        .map(|s| (s.stream, s.method, s.version_info.clone()))
        .collect();
    assert_eq!(
        pushed,
        [(
            eds,
            methods::per_type(type_urls::ENDPOINT, delta).unwrap(),
            "e2".to_owned()
        )],
        "the push goes to the EDS stream"
    );
    eventually("EDS e2 ACKed", &proxy, &server, || {
        acked(&server, type_urls::ENDPOINT, "e2", delta)
    });
    eventually(
        "new connections reach the new endpoint",
        &proxy,
        &server,
        || reaches(&pod) == Some(ECHO_B),
    );
    // No NACK anywhere, and the streams stayed up.
    let requests = server.requests();
    assert!(
        requests.iter().all(|r| !r.is_nack()),
        "{}",
        describe(&requests)
    );
    assert!(
        requests
            .iter()
            .all(|r| [cds, eds, lds].contains(&r.stream) || r.type_url == type_urls::ROUTE),
        "no reconnects:\n{}",
        describe(&requests)
    );
    drop(proxy);
}

#[test]
fn per_type_state_of_the_world_sources_drive_the_proxy() {
    per_type_sources_drive_the_proxy(false);
}

#[test]
fn per_type_delta_sources_drive_the_proxy() {
    per_type_sources_drive_the_proxy(true);
}

/// The test server alone: a per-type stream serves its type, a Delta per-type stream
/// too, each logged with its method; another type ends the stream; Fetch is not served.
#[test]
fn per_type_services_over_the_wire() {
    let server = AdsServer::start(Listen::Tcp("127.0.0.1:0".parse().unwrap())).unwrap();
    server.set(type_urls::CLUSTER, "1", vec![eds_cluster("a", false)]);
    server.set(type_urls::ENDPOINT, "1", vec![endpoints("a", ECHO_A)]);
    let url = format!("http://{}", server.local_addr().unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let wait = Duration::from_secs(5);
        let mut cds = ClusterDiscoveryServiceClient::connect(url.clone())
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send(DiscoveryRequest {
            type_url: type_urls::CLUSTER.into(),
            ..Default::default()
        })
        .unwrap();
        let mut responses = cds
            .stream_clusters(UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let r = tokio::time::timeout(wait, responses.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(
            (r.type_url.as_str(), r.resources.len()),
            (type_urls::CLUSTER, 1)
        );
        // Another type on the cluster stream ends it.
        tx.send(DiscoveryRequest {
            type_url: type_urls::ENDPOINT.into(),
            resource_names: vec!["a".into()],
            ..Default::default()
        })
        .unwrap();
        let end = tokio::time::timeout(wait, responses.message())
            .await
            .unwrap()
            .unwrap_err();
        assert_eq!(end.code(), tonic::Code::InvalidArgument, "{end}");

        let fetch = cds.fetch_clusters(DiscoveryRequest::default()).await;
        assert_eq!(fetch.unwrap_err().code(), tonic::Code::Unimplemented);

        let mut eds = EndpointDiscoveryServiceClient::connect(url).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        // The type is implicit on a per-type stream.
        tx.send(DeltaDiscoveryRequest {
            resource_names_subscribe: vec!["a".into()],
            ..Default::default()
        })
        .unwrap();
        let mut responses = eds
            .delta_endpoints(UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let r = tokio::time::timeout(wait, responses.message())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(r.type_url, type_urls::ENDPOINT);
        assert_eq!(r.resources[0].name, "a");
        drop(tx);
    });
    let requests = server.requests();
    let logged: Vec<_> = requests
        .iter()
        .map(|r| (r.method, r.type_url.as_str()))
        .collect();
    assert_eq!(
        logged,
        [
            (methods::CLUSTERS, type_urls::CLUSTER),
            (methods::CLUSTERS, type_urls::ENDPOINT),
            (methods::ENDPOINTS_DELTA, type_urls::ENDPOINT),
        ]
    );
    let sent: Vec<_> = server.responses().iter().map(|s| s.method).collect();
    assert_eq!(sent, [methods::CLUSTERS, methods::ENDPOINTS_DELTA]);
}
