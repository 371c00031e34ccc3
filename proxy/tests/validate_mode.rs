//! `shunt proxy --mode validate`, run as a user would: the built binary, its exit code and
//! what it prints: validation's findings and what compiling the bootstrap, as serving
//! does, finds. Needs no privileges and opens no sockets.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/crates/config/src/testdata");

fn shunt(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shunt"))
        .arg("proxy")
        .args(args)
        .output()
        .expect("run shunt")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A file removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &str) -> Self {
        let path =
            std::env::temp_dir().join(format!("shunt-validate-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        TempFile(path)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Istio's bootstrap without its `dynamic_resources`: what shunt can serve until xDS.
fn istio_static_bootstrap() -> TempFile {
    let golden =
        std::fs::read_to_string(Path::new(TESTDATA).join("istio-default_golden.json")).unwrap();
    let mut bootstrap: serde_json::Value = serde_json::from_str(&golden).unwrap();
    bootstrap
        .as_object_mut()
        .unwrap()
        .remove("dynamic_resources");
    TempFile::new("istio-static.json", &bootstrap.to_string())
}

#[test]
fn a_valid_bootstrap_passes_with_a_summary() {
    let file = istio_static_bootstrap();
    let out = shunt(&[
        "--mode",
        "validate",
        "-c",
        file.path(),
        "--service-node",
        "sidecar~10.1.1.1~app-1.default~default.svc.cluster.local",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("node: id \"sidecar~10.1.1.1~app-1.default~default.svc.cluster.local\", cluster \"istio-proxy\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("static resources: 2 listeners, 4 clusters, 0 secrets"),
        "{stdout}"
    );
    assert!(stdout.contains("dynamic resources: none"), "{stdout}");
    // Istio's http_conn_manager_listener_prefix tag regex has a lookahead.
    assert!(
        stdout.contains("WARNING stats_config.stats_tags[6].regex"),
        "{stdout}"
    );
    // Compiling found what shunt leaves out, where nothing routes to it: warnings.
    assert!(
        stdout.contains(
            "WARNING static_resources.clusters[2].load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.pipe: \
             Unix domain socket endpoints are not implemented yet; no listener routes to cluster \"sds-grpc\""
        ),
        "{stdout}"
    );
    assert!(
        stdout.lines().last().unwrap().starts_with("OK: valid"),
        "{stdout}"
    );
}

#[test]
fn istios_bootstrap_with_ads_is_valid() {
    let file = Path::new(TESTDATA).join("istio-default_golden.json");
    let out = shunt(&["--mode", "validate", "-c", file.to_str().unwrap()]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.contains("ADS "),
        "the summary names the ADS source: {stdout}"
    );
    assert!(stdout.contains("OK: valid"), "{stdout}");
}

#[test]
fn what_shunt_cannot_serve_is_reported_at_its_path() {
    let out = shunt(&[
        "--mode",
        "validate",
        "--config-yaml",
        "static_resources: {listeners: [{name: web, address: {socket_address: {address: 0.0.0.0, port_value: 9000}}, \
         filter_chains: [{filters: [{name: hcm, typed_config: \
         {'@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager, \
         stat_prefix: h, route_config: {}, http_filters: [{name: lua, typed_config: \
         {'@type': type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua}}, {name: r, typed_config: \
         {'@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}]}}]}]}], \
         clusters: [{name: m, lb_policy: MAGLEV, maglev_lb_config: {table_size: 100}}]}",
    ]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains(
            "ERROR static_resources.listeners[0].filter_chains[0].filters[0].typed_config.http_filters[0].typed_config: HTTP filter \"lua\" (envoy.extensions.filters.http.lua.v3.Lua) is not implemented by shunt"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "ERROR static_resources.clusters[0].maglev_lb_config.table_size: 100 must be a prime"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("INVALID: 2 errors,"), "{stdout}");
}

#[test]
fn a_listener_needing_an_unknown_filter_fails_validation() {
    let out = shunt(&[
        "--mode",
        "validate",
        "--config-yaml",
        "static_resources: {listeners: [{name: l, address: {socket_address: {address: 0.0.0.0, port_value: 9000}}, \
         filter_chains: [{filters: [{name: mongo, typed_config: \
         {'@type': type.googleapis.com/envoy.extensions.filters.network.mongo_proxy.v3.MongoProxy, stat_prefix: m}}]}]}]}",
    ]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains(
            "ERROR static_resources.listeners[0].filter_chains[0].filters[0].typed_config: network filter \"mongo\""
        ),
        "{stdout}"
    );
    assert!(stdout.contains("INVALID: 1 error,"), "{stdout}");
}

#[test]
fn a_malformed_bootstrap_names_file_and_path() {
    let dir = std::env::temp_dir().join(format!("shunt-validate-mode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("envoy.yaml");
    std::fs::write(
        &file,
        "static_resources:\n  clusters:\n  - name: a\n    connect_timeout: 5\n",
    )
    .unwrap();
    let out = shunt(&["--mode", "validate", "-c", file.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!(
            "{}: static_resources.clusters[0].connect_timeout: invalid duration 5",
            file.display()
        )),
        "{stderr}"
    );
}

#[test]
fn serving_an_xds_source_shunt_cannot_use_is_refused_at_its_path() {
    let yaml =
        std::fs::read_to_string(Path::new(TESTDATA).join("go-control-plane-bootstrap-xds.yaml"))
            .unwrap()
            .replacen("api_type: GRPC", "api_type: REST", 1);
    let file = TempFile::new("rest-xds.yaml", &yaml);
    let out = shunt(&["-c", file.path()]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "dynamic_resources.cds_config.api_config_source.api_type: REST is not implemented"
        ),
        "{stderr}"
    );
}
