//! Real bootstraps: the shared corpus (Istio's rendered bootstraps, Envoy's and
//! go-control-plane's samples) and the two copied into `testdata/`, loaded as Envoy
//! loads them. That each validates against what shunt implements is tested where the
//! set is known (`shunt_xds::snapshot::extensions`).

use std::path::{Path, PathBuf};

use envoy_types::pb::envoy::admin::v3::ConfigDump;
use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;

use super::diagnostic::Severity;
use super::extensions::Implemented;
use super::*;

use super::testing::{TESTDATA, corpus};

/// Files in `dir` ending in `suffix`, sorted, at least one.
fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|err| panic!("reading {}: {err}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.to_string_lossy().ends_with(suffix))
        .collect();
    found.sort();
    assert!(!found.is_empty(), "no *{suffix} in {}", dir.display());
    found
}

fn corpus_bootstraps() -> Vec<PathBuf> {
    let corpus = corpus();
    let mut all = files(&corpus.join("istio/bootstrap"), ".json");
    all.extend(files(&corpus.join("envoy"), ".yaml"));
    all.extend(files(&corpus.join("go-control-plane"), ".yaml"));
    all
}

fn options_for(path: &Path) -> Options {
    Options {
        config_path: Some(path.to_owned()),
        ..Default::default()
    }
}

/// Loads as `check` does; panics unless it loads without an error.
fn loads(path: &Path) -> Loaded {
    let loaded =
        load::load(&options_for(path)).unwrap_or_else(|err| panic!("{}: {err:#}", path.display()));
    let errors: Vec<String> = loaded
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Error)
        .map(ToString::to_string)
        .collect();
    assert!(
        errors.is_empty(),
        "{}:\n{}",
        path.display(),
        errors.join("\n")
    );
    loaded
}

#[test]
fn every_corpus_bootstrap_survives_a_json_round_trip() {
    let bootstraps = corpus_bootstraps();
    assert!(
        bootstraps.len() >= 35,
        "only {} bootstraps",
        bootstraps.len()
    );
    for path in bootstraps {
        let loaded = loads(&path);
        assert_round_trip(&path, &loaded.bootstrap);
    }
}

fn assert_round_trip(path: &Path, bootstrap: &Bootstrap) {
    let written = to_json(bootstrap).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
    let (again, leniencies) = json::from_json::<Bootstrap>(written.clone())
        .unwrap_or_else(|err| panic!("{}: reading back: {err}\n{written:#}", path.display()));
    assert!(leniencies.is_empty());
    assert!(
        &again == bootstrap,
        "{}: differs after a round trip",
        path.display()
    );
}

#[test]
fn go_control_plane_bootstrap_from_testdata_loads_leniently() {
    let path = Path::new(TESTDATA).join("go-control-plane-bootstrap-xds.yaml");
    let loaded = loads(&path);
    // `grpc_services:` given one map instead of a list, read as Envoy reads it.
    let lenient = loaded
        .findings
        .iter()
        .find(|f| {
            f.path
                .ends_with("rtds_config.api_config_source.grpc_services")
        })
        .expect("a warning for the single grpc_services value");
    assert!(lenient.message.contains("one-element list"), "{lenient}");
    let layer = &loaded.bootstrap.layered_runtime.as_ref().unwrap().layers[0];
    assert!(format!("{layer:?}").contains("xds_cluster"));
    assert_round_trip(&path, &loaded.bootstrap);
}

/// Istio's listener and cluster dumps use types envoy-types lacks (Istio's filters,
/// `IPMatcher`); every `Any` in them must resolve through the pool, for xDS and the
/// admin `/config_dump` later.
#[test]
fn corpus_config_dumps_load_through_the_pool() {
    let corpus = corpus();
    let mut dumps = files(&corpus.join("istio/config_dump"), ".json");
    dumps.extend(files(&corpus.join("istio/config_dump"), ".yaml"));
    dumps.extend(files(&corpus.join("envoy-1.40-generated"), ".json"));
    for path in dumps {
        let text = std::fs::read_to_string(&path).unwrap();
        let value: serde_json::Value = if path.extension().is_some_and(|ext| ext == "yaml") {
            serde_yaml_ng::from_str(&text).unwrap()
        } else {
            serde_json::from_str(&text).unwrap()
        };
        let (dump, _) = json::from_json::<ConfigDump>(value)
            .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        assert!(!dump.configs.is_empty(), "{}", path.display());
        json::to_json(&dump).unwrap_or_else(|err| panic!("{}: writing: {err}", path.display()));
    }
}

#[test]
fn malformed_files_are_errors_naming_file_and_path() {
    let dir = std::env::temp_dir().join(format!("shunt-config-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "bad-duration.yaml",
            "static_resources:\n  clusters:\n  - name: a\n  - name: b\n  - name: c\n    connect_timeout: \"5\"\n",
            "static_resources.clusters[2].connect_timeout: invalid duration \"5\"",
        ),
        (
            "unknown-field.json",
            r#"{"static_resources": {"listeners": [{"name": "l", "adress": {}}]}}"#,
            "static_resources.listeners[0].adress: unknown field",
        ),
        (
            "wrong-type.yaml",
            "admin:\n  address:\n    socket_address:\n      address: 127.0.0.1\n      port_value: [15000]\n",
            "admin.address.socket_address.port_value: invalid uint32 [15000]",
        ),
        (
            "unknown-type.yaml",
            "stats_sinks:\n- name: s\n  typed_config:\n    \"@type\": type.googleapis.com/acme.v1.Sink\n",
            "stats_sinks[0].typed_config: unknown @type \"type.googleapis.com/acme.v1.Sink\"",
        ),
    ];
    for (name, text, expected) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        let err = check(&options_for(&path), &Implemented::default()).unwrap_err();
        let message = format!("{err:#}");
        assert_eq!(
            message.split_once(": ").map(|(file, _)| file),
            Some(path.to_str().unwrap()),
            "{message}"
        );
        assert!(message.contains(expected), "{name}: {message}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unknown_network_filter_makes_the_bootstrap_invalid() {
    let options = Options {
        config_yaml: Some(
            r#"
static_resources:
  listeners:
  - name: redis
    address: {socket_address: {address: 0.0.0.0, port_value: 6379}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.redis_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.redis_proxy.v3.RedisProxy
          stat_prefix: redis
"#
            .into(),
        ),
        ..Default::default()
    };
    // Nothing implemented: the one listener's one filter is the one error.
    let (_, report) = check(&options, &Implemented::default()).unwrap();
    let errors: Vec<_> = report.errors().collect();
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(
        errors[0].path,
        "static_resources.listeners[0].filter_chains[0].filters[0].typed_config"
    );
    assert!(
        errors[0]
            .message
            .contains("envoy.filters.network.redis_proxy")
    );
}

/// What shunt reads from a bootstrap is what Envoy 1.40 read from it: its `/config_dump`
/// shows the bootstrap it parsed. Envoy adds facts about itself to `node` (version,
/// extensions, ...), so `node` compares on what the file says.
#[test]
fn bootstraps_read_as_envoy_read_them() {
    for (bootstrap, dump) in [
        (
            "istio/bootstrap/default_golden.json",
            "envoy-1.40-generated/istio-default_golden__config_dump.json",
        ),
        (
            "go-control-plane/bootstrap-delta-ads.yaml",
            "envoy-1.40-generated/go-cp-bootstrap-delta-ads__python-ads__config_dump.json",
        ),
    ] {
        let dump: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(corpus().join(dump)).unwrap()).unwrap();
        let mut envoys = dump["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|config| {
                config["@type"] == "type.googleapis.com/envoy.admin.v3.BootstrapConfigDump"
            })
            .expect("a bootstrap in the dump")["bootstrap"]
            .clone();
        let loaded = loads(&corpus().join(bootstrap));
        let mut ours = to_json(&loaded.bootstrap).unwrap();
        for node in [&mut ours["node"], &mut envoys["node"]] {
            let node = node.as_object_mut().unwrap();
            node.retain(|key, _| ["id", "cluster", "metadata", "locality"].contains(&key.as_str()));
        }
        let keys = |value: &serde_json::Value| -> Vec<String> {
            value.as_object().unwrap().keys().cloned().collect()
        };
        assert_eq!(keys(&ours), keys(&envoys), "{bootstrap}");
        for key in keys(&ours) {
            assert_eq!(ours[&key], envoys[&key], "{bootstrap}: {key} differs");
        }
    }
}
