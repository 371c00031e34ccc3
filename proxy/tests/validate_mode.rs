//! `shunt proxy --mode validate`, run as a user would: the built binary, its exit code and
//! what it prints. Needs no privileges and opens no sockets.

use std::path::Path;
use std::process::{Command, Output};

const TESTDATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/config/testdata");

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

#[test]
fn a_valid_bootstrap_passes_with_a_summary() {
    let file = Path::new(TESTDATA).join("istio-default_golden.json");
    let out = shunt(&[
        "--mode",
        "validate",
        "-c",
        file.to_str().unwrap(),
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
    assert!(
        stdout.contains("WARNING stats_config.stats_tags"),
        "{stdout}"
    );
    assert!(
        stdout.lines().last().unwrap().starts_with("OK: valid"),
        "{stdout}"
    );
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
fn serving_a_bootstrap_is_refused_for_now() {
    let file = Path::new(TESTDATA).join("go-control-plane-bootstrap-xds.yaml");
    let out = shunt(&["-c", file.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("not implemented yet"), "{stderr}");
}
