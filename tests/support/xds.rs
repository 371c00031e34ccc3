//! What the xDS tests share: an ADS server in a scratch folder, the bootstrap, the
//! admin API from inside a pod, waiting with context, and reading the server's log.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::ads::resources::{self, ads_source, load_assignment, named, tcp_proxy_listener};
use harness::ads::{AdsServer, Any, Received, type_urls};
use harness::{Pod, PodProcess};
use serde_json::Value;

pub use super::TempDir;

/// The proxy runs as uid 1337, which Istio's agent serves its socket to.
pub fn open_to_the_proxy(dir: &Path, socket: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for path in [dir, socket] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
}

/// One HTTP/1.1 GET to the admin API at `address` inside `pod`: status and body.
pub fn admin_at(pod: &Pod, address: &str, path: &str) -> (u16, String) {
    let address = address.to_owned();
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    pod.run_in_netns(move || -> std::io::Result<(u16, String)> {
        let mut stream = TcpStream::connect(&address)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.write_all(request.as_bytes())?;
        let mut raw = String::new();
        stream.read_to_string(&mut raw)?;
        let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let chunked = head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked");
        Ok((
            status,
            if chunked {
                dechunk(body)
            } else {
                body.to_owned()
            },
        ))
    })
    .expect("entering the pod")
    .unwrap_or((0, String::new()))
}

/// A counter or gauge from the admin API at `address` inside `pod`.
pub fn stat_at(pod: &Pod, address: &str, name: &str) -> Option<u64> {
    let (status, body) = admin_at(pod, address, "/stats?format=json");
    assert_eq!(status, 200, "{body}");
    let stats: Value = serde_json::from_str(&body).unwrap();
    stats["stats"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == name)?["value"]
        .as_u64()
}

/// Where the xDS tests' bootstrap puts the admin API.
pub const ADMIN: &str = "127.0.0.1:15000";

/// `/config_dump` of the admin API at `address` inside `pod`, parsed.
pub fn config_dump_at(pod: &Pod, address: &str) -> Value {
    let (status, body) = admin_at(pod, address, "/config_dump");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("config_dump is JSON")
}

/// An HTTP/1.1 chunked body, joined (Envoy's admin answers large bodies so).
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// The `configs` entry of a `/config_dump` whose `@type` is `kind` (its last name).
pub fn dump_section(dump: &Value, kind: &str) -> Value {
    dump["configs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            let type_url = c["@type"].as_str().unwrap_or("");
            type_url.rsplit('.').next() == kind.rsplit('.').next()
        })
        .cloned()
        .unwrap_or_else(|| panic!("no {kind} in {dump}"))
}

/// Polls `check` until it holds (20 s at most); a failure shows the proxy's log and what
/// the server received.
pub fn eventually(what: &str, proxy: &PodProcess, server: &AdsServer, check: impl FnMut() -> bool) {
    super::wait_until(what, proxy, check, || {
        format!("\nserver received:\n{}", describe(&server.requests()))
    });
}

pub fn describe(requests: &[Received]) -> String {
    requests
        .iter()
        .map(|r| {
            format!(
                "  stream {} {} {} version={:?} nonce={:?} names={:?} nack={:?}\n",
                r.stream,
                r.method,
                r.type_url,
                r.version_info,
                r.response_nonce,
                r.resource_names,
                r.error_detail
            )
        })
        .collect()
}

/// Which echo server (its port) a new connection to `target` from `pod` reaches, if any.
pub fn reaches(pod: &Pod, target: SocketAddr) -> Option<u16> {
    match reach(pod, target) {
        Reach::Server(port) => Some(port),
        _ => None,
    }
}

/// How a call from the app to `target` ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Reach {
    /// An echo server answered, listening on this port.
    Server(u16),
    /// Accepted and closed before any server said HELLO, no byte sent: a `tcp_proxy`
    /// with no cluster (NC) or no host (UH), as Envoy does.
    ClosedByProxy,
    /// Connection refused: nothing listens there.
    Refused,
    /// Any other failure, as testapp reported it (a reset, a time-out, ...).
    Other(String),
}

/// Calls `target` as the app and says how it ended. Panics when testapp could not even
/// run, so "did not reach" is never a broken helper.
pub fn reach(pod: &Pod, target: SocketAddr) -> Reach {
    let v = super::Caller::app(pod).call_json(target);
    if v["ok"] == true {
        let port = v["server_local"]
            .as_str()
            .and_then(|s| s.parse::<SocketAddr>().ok())
            .unwrap_or_else(|| panic!("testapp call to {target}: no server_local in {v}"))
            .port();
        return Reach::Server(port);
    }
    let error = v["error"].as_str().unwrap_or_default().to_owned();
    if error.contains("connection closed before the HELLO line (got \"\")") {
        Reach::ClosedByProxy
    } else if error.starts_with(&format!("connecting to {target}")) && error.contains("refused") {
        Reach::Refused
    } else {
        Reach::Other(error)
    }
}

/// Version `version` of `type_url` was sent and ACKed (on `method` when given; by
/// nonce, and for state of the world by version too).
pub fn acked(
    server: &AdsServer,
    type_url: &str,
    version: &str,
    delta: bool,
    method: Option<&str>,
) -> bool {
    let on_method = |m: &str| method.is_none_or(|want| want == m);
    let sent: Vec<_> = server
        .responses()
        .into_iter()
        .filter(|s| s.type_url == type_url && s.version_info == version && on_method(s.method))
        .map(|s| (s.stream, s.nonce))
        .collect();
    server.requests().iter().any(|r| {
        r.type_url == type_url
            && on_method(r.method)
            && r.is_ack()
            && sent.contains(&(r.stream, r.response_nonce.clone()))
            && (delta || r.version_info == version)
    })
}

/// Writes `bootstrap` to `path` and starts `shunt proxy ARGS -c PATH` in `pod`.
pub fn start_shunt(pod: &Pod, path: &Path, bootstrap: &Value, args: &[&str]) -> PodProcess {
    std::fs::write(path, serde_json::to_vec(bootstrap).unwrap()).unwrap();
    pod.command(harness::shunt_bin())
        .arg("proxy")
        .args(args)
        .arg("-c")
        .arg(path)
        .spawn()
        .expect("start shunt proxy")
}

/// An ADS server on the Unix socket `XDS` in a fresh scratch folder `tag`, open to the
/// proxy's uid: the folder, the socket's path and the server.
pub fn unix_server(tag: &str) -> (TempDir, PathBuf, AdsServer) {
    let dir = TempDir::new(tag);
    let socket = dir.0.join("XDS");
    let server = AdsServer::start(harness::ads::Listen::Unix(socket.clone())).expect("ADS server");
    open_to_the_proxy(&dir.0, &socket);
    (dir, socket, server)
}

/// Istio's shape: ADS over a Unix socket through a static cluster with a `pipe` endpoint.
pub fn bootstrap(socket: &Path, delta: bool) -> Value {
    serde_json::json!({
        "node": {"id": "sidecar~10.0.0.1~p.default~default.svc.cluster.local", "cluster": "p.default",
                 "metadata": {"ISTIO_VERSION": "1.24.0"}},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "dynamic_resources": {
            "lds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "cds_config": {"ads": {}, "initial_fetch_timeout": "0s", "resource_api_version": "V3"},
            "ads_config": {
                "api_type": if delta { "DELTA_GRPC" } else { "GRPC" },
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds-grpc"},
                                   "initial_metadata": [{"key": "x-shunt-test", "value": "yes"}]}]
            }
        },
        "static_resources": {"clusters": [pipe_cluster("xds-grpc", socket)]}
    })
}

/// A static gRPC cluster reaching a Unix socket, as Istio's `xds-grpc` and `sds-grpc`.
pub fn pipe_cluster(name: &str, socket: &Path) -> Value {
    serde_json::json!({
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"pipe": {"path": socket.display().to_string()}}}}]}]}
    })
}

/// Serves (versions c1, e1, l1) one cluster `backend` as `cluster` builds it, its
/// endpoint 127.0.0.1:`echo`, and a `tcp_proxy` listener `l1` on 127.0.0.1:`listen`
/// to it: the config most xDS tests start from.
pub fn serve_backend(server: &AdsServer, cluster: (String, Any), echo: u16, listen: u16) {
    let local = |port| SocketAddr::from(([127, 0, 0, 1], port));
    server.set(type_urls::CLUSTER, "c1", vec![cluster]);
    server.set(
        type_urls::ENDPOINT,
        "e1",
        vec![named(
            "backend",
            &load_assignment("backend", &[local(echo)]),
        )],
    );
    server.set(
        type_urls::LISTENER,
        "l1",
        vec![named(
            "l1",
            &tcp_proxy_listener("l1", local(listen), "backend"),
        )],
    );
}

/// An EDS cluster whose endpoints come over ADS, as a named xDS resource.
pub fn eds_cluster(name: &str, connect_timeout_s: i64) -> (String, Any) {
    named(
        name,
        &resources::eds_cluster(name, ads_source(), connect_timeout_s),
    )
}
