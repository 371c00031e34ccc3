//! Internal listeners end to end inside one process: compiling them and the clusters
//! that name them, refusing a name no listener has, and a connection through the
//! registry whose `internal_upstream` metadata tells the internal listener's
//! `original_dst` where the bytes go.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use shunt_config::Options;
use shunt_listener::connection_handler::{Context, InternalListeners};

fn bootstrap(yaml: &str) -> Bootstrap {
    let options = Options {
        config_yaml: Some(yaml.to_owned()),
        ..Default::default()
    };
    shunt_config::check(&options, &extensions::IMPLEMENTED)
        .expect("a loadable bootstrap")
        .0
        .bootstrap
}

/// Istio's sidecar shape for HBONE, pointed at `target` instead of a tunnel: a cluster
/// whose endpoint is the internal listener `connect_originate`, passing the endpoint's
/// `envoy.filters.listener.original_dst` metadata; the listener restores the
/// destination from it and passes through to it (ORIGINAL_DST).
fn istio_shaped(target: &str, listener_name: &str) -> String {
    format!(
        r#"
bootstrap_extensions:
- name: envoy.bootstrap.internal_listener
  typed_config:
    "@type": type.googleapis.com/udpa.type.v1.TypedStruct
    type_url: type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener
static_resources:
  listeners:
  - name: connect_originate
    use_original_dst: false
    internal_listener: {{}}
    listener_filters:
    - name: envoy.filters.listener.original_dst
      typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: connect_originate
          cluster: passthrough
  clusters:
  - name: passthrough
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
  - name: outbound|80||app.default.svc.cluster.local
    type: STATIC
    transport_socket:
      name: envoy.transport_sockets.internal_upstream
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport
        passthrough_metadata:
        - kind: {{host: {{}}}}
          name: envoy.filters.listener.original_dst
        transport_socket:
          name: raw_buffer
          typed_config: {{"@type": type.googleapis.com/envoy.extensions.transport_sockets.raw_buffer.v3.RawBuffer}}
    load_assignment:
      cluster_name: outbound|80||app.default.svc.cluster.local
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              envoy_internal_address:
                server_listener_name: {listener_name}
                endpoint_id: "{target}"
          metadata:
            filter_metadata:
              envoy.filters.listener.original_dst:
                local: "{target}"
"#
    )
}

#[test]
fn internal_listeners_and_the_endpoints_naming_them_compile() {
    let compiled = compile(
        &bootstrap(&istio_shaped("10.0.0.5:80", "connect_originate")),
        &Default::default(),
    )
    .unwrap_or_else(|err| panic!("{err}"));
    let snapshot = compiled.snapshot;
    let listener = snapshot.listener("connect_originate").unwrap();
    assert!(listener.internal);
    assert!(!listener.bind_to_port);
    assert!(listener.addresses.is_empty());
    assert!(listener.listener_filters.original_dst);
    let cluster = &snapshot.clusters["outbound|80||app.default.svc.cluster.local"];
    let hosts = cluster.hosts();
    let internal = hosts[0].internal.as_deref().unwrap();
    assert_eq!(&*internal.server_listener_name, "connect_originate");
    assert_eq!(hosts[0].address, "10.0.0.5:80".parse().unwrap());
    let passthrough = cluster.passthrough.as_deref().unwrap();
    assert_eq!(
        passthrough.sources,
        [(
            shunt_tls::internal_upstream::Source::Host,
            "envoy.filters.listener.original_dst".to_owned()
        )]
    );
}

#[test]
fn an_endpoint_naming_no_internal_listener_is_refused_at_its_path() {
    let err = compile(
        &bootstrap(&istio_shaped("10.0.0.5:80", "connect_orignate")),
        &Default::default(),
    )
    .expect_err("an unknown internal listener");
    let errors: Vec<String> = err.errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].starts_with(
            "static_resources.clusters[1].load_assignment.endpoints[0].lb_endpoints[0]\
             .endpoint.address.envoy_internal_address.server_listener_name"
        ),
        "{}",
        errors[0]
    );
    assert!(errors[0].contains("\"connect_orignate\""), "{}", errors[0]);
}

#[test]
fn an_internal_listener_has_no_address() {
    let yaml = r#"
static_resources:
  listeners:
  - name: inner
    address: {socket_address: {address: 127.0.0.1, port_value: 9}}
    internal_listener: {}
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: x
          cluster: x
"#;
    let err = compile(&bootstrap(yaml), &Default::default()).expect_err("an address");
    assert!(
        err.errors
            .iter()
            .any(|e| e.path == "static_resources.listeners[0].address"),
        "{err}"
    );
}

#[test]
fn internal_listeners_need_the_bootstrap_extension_as_in_envoy() {
    let yaml = istio_shaped("10.0.0.5:80", "connect_originate");
    let without: String = yaml
        .split("static_resources:")
        .nth(1)
        .map(|rest| format!("static_resources:{rest}"))
        .unwrap();
    let err = compile(&bootstrap(&without), &Default::default()).expect_err("no extension");
    let errors: Vec<String> = err.errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].starts_with("static_resources.listeners[0].internal_listener"),
        "{}",
        errors[0]
    );
}

#[tokio::test]
async fn a_connection_reaches_the_internal_listener_and_its_restored_destination() {
    // The app: echoes what it reads, prefixed.
    let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let target = app.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = app.accept().await.unwrap();
        let mut buf = [0u8; 5];
        s.read_exact(&mut buf).await.unwrap();
        s.write_all(b"app:").await.unwrap();
        s.write_all(&buf).await.unwrap();
    });
    let stats = StatsStore::default();
    let compiled = compile(
        &bootstrap(&istio_shaped(&target.to_string(), "connect_originate")),
        &stats,
    )
    .unwrap_or_else(|err| panic!("{err}"));
    let snapshot = compiled.snapshot;
    let cluster = snapshot.clusters["outbound|80||app.default.svc.cluster.local"].clone();
    let passthrough = snapshot.clusters["passthrough"].clone();
    let store = Arc::new(Current::new(snapshot));
    let ctx = Arc::new(Context {
        config: store.clone(),
        own_ports: std::sync::RwLock::new(Arc::from(Vec::new())),
        shutdown: Default::default(),
    });
    let registry: Arc<dyn shunt_upstream::internal::Acceptor> = Arc::new(InternalListeners(ctx));

    // The instance's connections run in its registry's scope.
    shunt_upstream::internal::scope(registry, async move {
        let host = cluster.hosts()[0].clone();
        let (mut stream, _guard) =
            shunt_upstream::transport_socket::connect(&cluster, &host, &Default::default())
                .await
                .expect("the internal listener takes the connection");
        stream.write_all(b"hello").await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        assert_eq!(answer, b"app:hello");
        // The internal listener's ORIGINAL_DST cluster connected to the restored address.
        let hosts: Vec<_> = passthrough.hosts().iter().map(|h| h.address).collect();
        assert_eq!(hosts, [target]);
        // Counted under Envoy's name for an internal listener.
        let total = stats.counter("listener.envoy_internal_connect_originate.downstream_cx_total");
        assert_eq!(total.value(), 1);

        // Without the metadata nothing restores a destination: the internal listener's
        // ORIGINAL_DST cluster has no host for it (UH), and the connection just closes.
        let mut bare =
            shunt_upstream::host::Host::internal(shunt_upstream::internal::InternalAddress {
                server_listener_name: "connect_originate".into(),
                endpoint_id: String::new(),
            });
        bare.metadata = None;
        let none_healthy = stats.counter("cluster.passthrough.upstream_cx_none_healthy");
        let (mut stream, _guard) = shunt_upstream::transport_socket::connect(
            &cluster,
            &Arc::new(bare),
            &Default::default(),
        )
        .await
        .expect("the internal listener takes the connection");
        let mut nothing = Vec::new();
        stream.read_to_end(&mut nothing).await.unwrap();
        assert!(nothing.is_empty());
        assert_eq!(none_healthy.value(), 1);

        // A name no listener has: the connect fails, as Envoy's does (flag UF).
        let missing =
            shunt_upstream::host::Host::internal(shunt_upstream::internal::InternalAddress {
                server_listener_name: "nowhere".into(),
                endpoint_id: String::new(),
            });
        let err = shunt_upstream::transport_socket::connect(
            &cluster,
            &Arc::new(missing),
            &Default::default(),
        )
        .await
        .expect_err("no such internal listener");
        assert!(err.to_string().contains("\"nowhere\""), "{err}");
    })
    .await;
}

#[test]
fn istio_wraps_its_listener_filters_in_typed_structs() {
    // As in tests/fixtures/istio/config_dump/authz_configdump.yaml (Istio 1.18).
    let yaml = r#"
bootstrap_extensions:
- name: envoy.bootstrap.internal_listener
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.bootstrap.internal_listener.v3.InternalListener
static_resources:
  listeners:
  - name: connect_originate
    use_original_dst: false
    internal_listener: {}
    listener_filters:
    - name: set_dst_address
      typed_config:
        "@type": type.googleapis.com/udpa.type.v1.TypedStruct
        type_url: type.googleapis.com/istio.set_internal_dst_address.v1.Config
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: connect_originate
          cluster: connect_originate
          tunneling_config:
            hostname: "%DOWNSTREAM_LOCAL_ADDRESS%"
            headers_to_add:
            - header: {key: baggage, value: "k8s.namespace.name=default,service.name=httpbin"}
  - name: plain
    address: {socket_address: {address: 127.0.0.1, port_value: 9}}
    listener_filters:
    - name: set_dst_address
      typed_config:
        "@type": type.googleapis.com/udpa.type.v1.TypedStruct
        type_url: type.googleapis.com/istio.set_internal_dst_address.v1.Config
    filter_chains:
    - filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: x
          cluster: x
"#;
    let err = compile(&bootstrap(yaml), &Default::default()).expect_err("plain listener");
    let errors: Vec<String> = err.errors.iter().map(ToString::to_string).collect();
    // Only on an internal listener.
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert!(
        errors[0].starts_with("static_resources.listeners[1].listener_filters[0].typed_config"),
        "{}",
        errors[0]
    );
    let yaml = yaml.split("  - name: plain").next().unwrap();
    let compiled = compile(&bootstrap(yaml), &Default::default()).unwrap_or_else(|e| panic!("{e}"));
    let listener = compiled.snapshot.listener("connect_originate").unwrap();
    assert!(listener.listener_filters.set_internal_dst_address);
    let NetworkFilterRef::TcpProxy(proxy) = network(listener) else {
        panic!("tcp_proxy");
    };
    let tunneling = proxy.tunneling.as_ref().unwrap();
    let d = shunt_filters::tcp::tunnel::Downstream {
        local: "10.0.0.5:80".parse().unwrap(),
        remote: "10.0.0.1:4000".parse().unwrap(),
        filter_state: Default::default(),
    };
    assert_eq!(tunneling.hostname.render(&d), "10.0.0.5:80");
    assert_eq!(tunneling.headers[0].0, "baggage");
}

enum NetworkFilterRef<'a> {
    TcpProxy(&'a shunt_filters::tcp::tcp_proxy::TcpProxy),
    Other,
}

fn network(listener: &shunt_listener::Listener) -> NetworkFilterRef<'_> {
    let chain = listener
        .filter_chains
        .select(&shunt_listener::filter_chain::ConnectionInfo {
            destination: "10.0.0.5:80".parse().unwrap(),
            source: "10.0.0.1:4000".parse().unwrap(),
            direct_source: "10.0.0.1:4000".parse().unwrap(),
            server_name: None,
            transport_protocol: "raw_buffer",
            application_protocols: &[],
        })
        .expect("a chain");
    match &chain.network {
        shunt_listener::config::NetworkFilter::TcpProxy(p) => NetworkFilterRef::TcpProxy(p),
        _ => NetworkFilterRef::Other,
    }
}
