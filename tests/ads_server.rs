//! The harness's ADS server over the wire, with a tonic client: SotW over TCP, Delta
//! over a Unix socket, and a restart. Needs no root.

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
    aggregated_discovery_service_client::AggregatedDiscoveryServiceClient,
};
use envoy_types::pb::google::rpc::Status as RpcStatus;
use harness::ads::{AdsServer, Listen, Received, type_urls};
use hyper_util::rt::TokioIo;
use prost::Message;
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};
use tokio::{
    runtime::Runtime,
    sync::mpsc::{UnboundedSender, unbounded_channel},
};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{
    Streaming,
    transport::{Channel, Endpoint, Uri},
};

const WAIT: Duration = Duration::from_secs(5);

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn connect(rt: &Runtime, listen: &Listen) -> AggregatedDiscoveryServiceClient<Channel> {
    let channel = rt.block_on(async {
        match listen {
            Listen::Tcp(addr) => Endpoint::try_from(format!("http://{addr}"))
                .unwrap()
                .connect()
                .await
                .unwrap(),
            Listen::TcpTls { .. } => unimplemented!("these tests speak plaintext"),
            Listen::Unix(path) => {
                let path = path.clone();
                // The URI is unused: the connector dials the socket.
                Endpoint::try_from("http://localhost")
                    .unwrap()
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            Ok::<_, std::io::Error>(TokioIo::new(
                                tokio::net::UnixStream::connect(path).await?,
                            ))
                        }
                    }))
                    .await
                    .unwrap()
            }
        }
    });
    AggregatedDiscoveryServiceClient::new(channel)
}

/// A synchronous view of one bidirectional stream. The call is made on the runtime
/// without waiting for its response headers: the server, as grpc-go, sends them only
/// with its first response, which needs a request first.
struct Stream<'a, Req, Resp> {
    rt: &'a Runtime,
    tx: UnboundedSender<Req>,
    call: Option<tokio::task::JoinHandle<Result<Streaming<Resp>, tonic::Status>>>,
    rx: Option<Streaming<Resp>>,
}

impl<Req, Resp: Message + Default + std::fmt::Debug + 'static> Stream<'_, Req, Resp> {
    fn send(&self, req: Req) {
        assert!(self.tx.send(req).is_ok(), "stream closed");
    }

    /// The next message, end or error; `None` if nothing came within `wait`.
    fn next(&mut self, wait: Duration) -> Option<Result<Option<Resp>, tonic::Status>> {
        // timeout() needs the runtime's context, hence the async block.
        let (call, rx) = (&mut self.call, &mut self.rx);
        self.rt
            .block_on(async {
                tokio::time::timeout(wait, async {
                    if let Some(pending) = call.as_mut() {
                        let opened = pending.await.expect("the call's task");
                        *call = None;
                        *rx = Some(opened?);
                    }
                    rx.as_mut().expect("the stream is open").message().await
                })
                .await
            })
            .ok()
    }

    fn recv(&mut self) -> Resp {
        self.next(WAIT)
            .expect("a response in time")
            .expect("no error")
            .expect("stream not ended")
    }

    fn expect_silence(&mut self) {
        let got = self.next(Duration::from_millis(200));
        assert!(got.is_none(), "unexpected: {got:?}");
    }

    /// The stream's end: the status it ended with, if any.
    fn end(&mut self) -> Option<tonic::Status> {
        match self.next(WAIT).expect("the stream to end in time") {
            Ok(None) => None,
            Ok(Some(m)) => panic!("unexpected message {m:?}"),
            Err(status) => Some(status),
        }
    }
}

fn sotw<'a>(
    rt: &'a Runtime,
    client: &mut AggregatedDiscoveryServiceClient<Channel>,
) -> Stream<'a, DiscoveryRequest, DiscoveryResponse> {
    let (tx, rx) = unbounded_channel();
    let mut req = tonic::Request::new(UnboundedReceiverStream::new(rx));
    req.metadata_mut().insert("x-test", "sotw".parse().unwrap());
    let mut client = client.clone();
    let call = rt.spawn(async move {
        client
            .stream_aggregated_resources(req)
            .await
            .map(|r| r.into_inner())
    });
    Stream {
        rt,
        tx,
        call: Some(call),
        rx: None,
    }
}

fn delta<'a>(
    rt: &'a Runtime,
    client: &mut AggregatedDiscoveryServiceClient<Channel>,
) -> Stream<'a, DeltaDiscoveryRequest, DeltaDiscoveryResponse> {
    let (tx, rx) = unbounded_channel();
    let mut client = client.clone();
    let call = rt.spawn(async move {
        client
            .delta_aggregated_resources(UnboundedReceiverStream::new(rx))
            .await
            .map(|r| r.into_inner())
    });
    Stream {
        rt,
        tx,
        call: Some(call),
        rx: None,
    }
}

fn cluster(name: &str) -> (String, envoy_types::pb::google::protobuf::Any) {
    let c = Cluster {
        name: name.into(),
        ..Default::default()
    };
    (name.into(), AdsServer::any(&c))
}

fn cla(name: &str, weight_hint: u32) -> (String, envoy_types::pb::google::protobuf::Any) {
    let c = ClusterLoadAssignment {
        cluster_name: name.into(),
        endpoints: vec![Default::default(); weight_hint as usize],
        ..Default::default()
    };
    (name.into(), AdsServer::any(&c))
}

fn cluster_names(r: &DiscoveryResponse) -> Vec<String> {
    r.resources
        .iter()
        .map(|a| {
            assert_eq!(a.type_url, type_urls::CLUSTER);
            Cluster::decode(a.value.as_slice()).unwrap().name
        })
        .collect()
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn cds_request(version: &str, nonce: &str) -> DiscoveryRequest {
    DiscoveryRequest {
        type_url: type_urls::CLUSTER.into(),
        version_info: version.into(),
        response_nonce: nonce.into(),
        ..Default::default()
    }
}

#[test]
fn sotw_over_tcp() {
    let ads = AdsServer::start(Listen::Tcp("127.0.0.1:0".parse().unwrap())).unwrap();
    let addr = ads.local_addr().unwrap();
    assert_ne!(addr.port(), 0);
    ads.set(type_urls::CLUSTER, "1", vec![cluster("a")]);

    let rt = runtime();
    let mut client = connect(&rt, &ads.listen());
    let mut s = sotw(&rt, &mut client);
    s.send(DiscoveryRequest {
        node: Some(Node {
            id: "node-1".into(),
            ..Default::default()
        }),
        ..cds_request("", "")
    });
    let r1 = s.recv();
    assert_eq!(
        (r1.version_info.as_str(), r1.type_url.as_str()),
        ("1", type_urls::CLUSTER)
    );
    assert_eq!(cluster_names(&r1), ["a"]);
    assert_eq!(ads.streams(), 1);

    s.send(cds_request("1", &r1.nonce));
    let ack = ads
        .wait_for(WAIT, |r| r.is_ack() && r.version_info == "1")
        .unwrap();
    // The node is sent once; later requests still carry the stream's node id.
    assert_eq!(ack.node_id.as_deref(), Some("node-1"));
    assert!(ack.node.is_none());
    assert_eq!(ack.metadata("x-test"), Some("sotw"));
    s.expect_silence();

    ads.set(type_urls::CLUSTER, "2", vec![cluster("a"), cluster("b")]);
    let r2 = s.recv();
    assert_eq!(r2.version_info, "2");
    assert_eq!(cluster_names(&r2), ["a", "b"]);
    assert_ne!(r2.nonce, r1.nonce);

    s.send(DiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: 3,
            message: "rejected b".into(),
            details: vec![],
        }),
        ..cds_request("1", &r2.nonce)
    });
    let nack = ads.wait_for(WAIT, Received::is_nack).unwrap();
    assert_eq!(nack.error_detail, Some((3, "rejected b".into())));
    assert_eq!(nack.response_nonce, r2.nonce);
    s.expect_silence();

    let sent = ads.responses();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].names, ["a", "b"]);
    assert_eq!(sent[1].nonce, r2.nonce);
    let err = ads
        .wait_for(Duration::from_millis(50), |r| r.version_info == "nope")
        .unwrap_err();
    assert!(err.to_string().contains("NACK(3: rejected b)"), "{err}");

    drop(s);
    drop(client);
    wait_until("the stream to close", || ads.streams() == 0);
}

#[test]
fn delta_over_unix_socket() {
    let dir = std::env::temp_dir().join(format!("shunt-ads-test-{}", std::process::id()));
    let path: PathBuf = dir.join("nested").join("ads.sock");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"stale").unwrap();

    let ads = AdsServer::start(Listen::Unix(path.clone())).unwrap();
    assert_eq!(ads.local_addr(), None);
    ads.set(type_urls::ENDPOINT, "1", vec![cla("a", 1), cla("b", 1)]);
    ads.set(type_urls::ENDPOINT, "2", vec![cla("a", 1), cla("b", 2)]);

    let rt = runtime();
    let mut client = connect(&rt, &ads.listen());
    let mut s = delta(&rt, &mut client);
    // Reconnecting with a@1 (current), b@1 (stale) and gone@1 (deleted meanwhile).
    s.send(DeltaDiscoveryRequest {
        type_url: type_urls::ENDPOINT.into(),
        resource_names_subscribe: vec!["a".into(), "b".into(), "gone".into()],
        initial_resource_versions: [("a", "1"), ("b", "1"), ("gone", "1")]
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .into(),
        ..Default::default()
    });
    let r = s.recv();
    assert_eq!(r.system_version_info, "2");
    let got: Vec<_> = r
        .resources
        .iter()
        .map(|r| (r.name.as_str(), r.version.as_str()))
        .collect();
    assert_eq!(got, [("b", "2")]);
    let b =
        ClusterLoadAssignment::decode(r.resources[0].resource.as_ref().unwrap().value.as_slice())
            .unwrap();
    assert_eq!(b.endpoints.len(), 2);
    assert_eq!(r.removed_resources, ["gone"]);

    s.send(DeltaDiscoveryRequest {
        type_url: type_urls::ENDPOINT.into(),
        response_nonce: r.nonce.clone(),
        ..Default::default()
    });
    let ack = ads.wait_for(WAIT, |r| r.delta && r.is_ack()).unwrap();
    assert_eq!(ack.response_nonce, r.nonce);
    s.expect_silence();

    // b removed, a unchanged, c is not subscribed: only the removal goes out.
    ads.set(type_urls::ENDPOINT, "3", vec![cla("a", 1), cla("c", 1)]);
    let r = s.recv();
    assert_eq!(r.system_version_info, "3");
    assert!(r.resources.is_empty());
    assert_eq!(r.removed_resources, ["b"]);

    let first = &ads.requests()[0];
    assert!(first.delta);
    assert_eq!(first.initial_resource_versions.len(), 3);
    assert_eq!(ads.responses()[1].removed, ["b"]);

    drop(s);
    drop(client);
    ads.stop();
    assert!(!path.exists(), "stop removes the socket file");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn restart_keeps_the_store_and_the_address() {
    let ads = AdsServer::start(Listen::Tcp("127.0.0.1:0".parse().unwrap())).unwrap();
    let addr = ads.local_addr().unwrap();
    ads.set(type_urls::CLUSTER, "7", vec![cluster("a")]);

    let rt = runtime();
    let mut client = connect(&rt, &ads.listen());
    let mut s = sotw(&rt, &mut client);
    s.send(cds_request("", ""));
    assert_eq!(s.recv().version_info, "7");

    ads.restart().unwrap();
    // Trailers go out before the connection closes, so clients see why.
    let status = s.end().expect("an error status");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(ads.local_addr(), Some(addr));
    assert_eq!(ads.streams(), 0);

    let mut client = connect(&rt, &ads.listen());
    let mut s2 = sotw(&rt, &mut client);
    s2.send(cds_request("7", ""));
    let r = s2.recv();
    assert_eq!(r.version_info, "7");
    assert_eq!(cluster_names(&r), ["a"]);

    let streams: Vec<u64> = ads.requests().iter().map(|r| r.stream).collect();
    assert_eq!(streams.len(), 2);
    assert_ne!(streams[0], streams[1]);

    // Stopped: new connections are refused; the handle still answers.
    ads.stop();
    assert!(
        rt.block_on(
            Endpoint::try_from(format!("http://{addr}"))
                .unwrap()
                .connect()
        )
        .is_err()
    );
    assert_eq!(ads.version(type_urls::CLUSTER).as_deref(), Some("7"));
}
