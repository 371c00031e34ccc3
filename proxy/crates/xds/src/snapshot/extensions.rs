//! What this build of shunt implements, for config validation
//! ([`shunt_config::extensions::check`]: `--mode validate`, and every bootstrap served),
//! read from the code that compiles each kind of extension rather than kept as a second
//! list: the network and HTTP filters from their registries; listener filters, the
//! terminal network filters and filter-chain matching from the listener's compiler;
//! transport sockets from `shunt_tls`; cluster types, protocol options and upstream
//! network filters from the cluster compiler; access loggers and their extension filters
//! from `shunt_filters::common::access_log`; the compression libraries from
//! `shunt_filters::common::compression`; tracers and request id extensions from
//! `shunt_filters::tracers`; the
//! bootstrap extensions from this module's snapshot compile and Istio's workload
//! discovery. This crate is the lowest that sees all of them.

use std::sync::LazyLock;

use shunt_config::extensions::Implemented;
use shunt_filters::common::compression;
use shunt_filters::{http, network};
use shunt_listener::{chain_matcher, compile as listener};
use shunt_upstream::compile as cluster;

/// What shunt implements, by where it sits; what `shunt_config::check` is given.
pub static IMPLEMENTED: LazyLock<Implemented> = LazyLock::new(|| Implemented {
    network_filters: listener::TERMINAL_FILTERS
        .iter()
        .copied()
        .chain(network::registry::type_names())
        .collect(),
    upstream_network_filters: cluster::UPSTREAM_NETWORK_FILTERS.to_vec(),
    http_filters: std::iter::once(http::compile::ROUTER)
        .chain(http::filter::registry::type_names())
        .collect(),
    http_filter_per_route: http::filter::registry::per_route_type_names().collect(),
    listener_filters: listener::LISTENER_FILTERS.to_vec(),
    transport_sockets: shunt_tls::transport_socket::TRANSPORT_SOCKETS.to_vec(),
    bootstrap_extensions: vec![
        super::INTERNAL_LISTENER_EXTENSION,
        shunt_core::peer::workload_discovery::EXTENSION,
    ],
    cluster_types: cluster::CLUSTER_TYPES.to_vec(),
    custom_cluster_types: cluster::CUSTOM_CLUSTER_TYPES.to_vec(),
    access_loggers: shunt_filters::common::access_log::ACCESS_LOGGERS.to_vec(),
    protocol_options: cluster::PROTOCOL_OPTIONS.to_vec(),
    filter_chain_matching: chain_matcher::FILTER_CHAIN_MATCHING.to_vec(),
    filter_extensions: compression::COMPRESSOR_TYPES
        .iter()
        .chain(compression::DECOMPRESSOR_TYPES.iter())
        .chain(shunt_filters::common::access_log::filter::EXTENSION_FILTERS.iter())
        .copied()
        .collect(),
    tracers: shunt_filters::tracers::TRACERS.to_vec(),
    request_id_extensions: shunt_filters::tracers::REQUEST_ID_EXTENSIONS.to_vec(),
});

#[cfg(test)]
mod tests {
    //! Real bootstraps validated against what shunt implements: the shared corpus
    //! (Istio's rendered bootstraps, Envoy's and go-control-plane's samples) and the
    //! config crate's `testdata/`.

    use std::path::{Path, PathBuf};

    use super::*;
    use shunt_config::testing::{TESTDATA, corpus};
    use shunt_config::{Loaded, Options, Report, Severity};

    /// Loads and validates; panics with the report unless the bootstrap is valid.
    fn check_valid(path: &Path) -> (Loaded, Report) {
        let options = Options {
            config_path: Some(path.to_owned()),
            ..Default::default()
        };
        let (loaded, report) = shunt_config::check(&options, &IMPLEMENTED)
            .unwrap_or_else(|err| panic!("{}: {err:#}", path.display()));
        let errors: Vec<String> = report.errors().map(ToString::to_string).collect();
        assert!(
            errors.is_empty(),
            "{}:\n{}",
            path.display(),
            errors.join("\n")
        );
        (loaded, report)
    }

    /// Files in `dir` ending in `suffix`.
    fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap_or_else(|err| panic!("reading {}: {err}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.to_string_lossy().ends_with(suffix))
            .collect()
    }

    #[test]
    fn every_corpus_bootstrap_is_valid() {
        let corpus = corpus();
        let mut bootstraps = files(&corpus.join("istio/bootstrap"), ".json");
        bootstraps.extend(files(&corpus.join("envoy"), ".yaml"));
        bootstraps.extend(files(&corpus.join("go-control-plane"), ".yaml"));
        assert!(
            bootstraps.len() >= 35,
            "only {} bootstraps",
            bootstraps.len()
        );
        for path in bootstraps {
            check_valid(&path);
        }
    }

    #[test]
    fn istio_bootstrap_from_testdata_loads_with_the_expected_warnings() {
        let path = Path::new(TESTDATA).join("istio-default_golden.json");
        let (loaded, report) = check_valid(&path);
        let bootstrap = &loaded.bootstrap;
        let node = bootstrap.node.as_ref().unwrap();
        assert!(node.id.starts_with("sidecar~"), "{}", node.id);
        let resources = bootstrap.static_resources.as_ref().unwrap();
        assert_eq!(resources.listeners.len(), 2);

        let warnings: Vec<(&str, &str)> = report
            .warnings()
            .map(|f| (f.path.as_str(), f.message.as_str()))
            .collect();
        let has = |path: &str, words: &str| {
            warnings
                .iter()
                .any(|(p, m)| *p == path && m.contains(words))
        };
        // Istio's internal listener extension is implemented: no warning for it.
        assert!(
            !warnings
                .iter()
                .any(|(p, _)| p.starts_with("bootstrap_extensions")),
            "{warnings:#?}"
        );
        // Istio's http_conn_manager_listener_prefix tag uses a lookahead, which Envoy's old
        // std::regex took and RE2 (like the regex crate) refuses.
        assert!(
            has("stats_config.stats_tags[6].regex", "look-around"),
            "{warnings:#?}"
        );
        // The 15090 scrape's compressor is served: no warning for it.
        assert!(
            !warnings
                .iter()
                .any(|(_, m)| m.contains("envoy.extensions.filters.http.compressor.v3.Compressor")),
            "{warnings:#?}"
        );
    }

    #[test]
    fn an_unimplemented_tracer_is_only_a_warning() {
        let path = corpus().join("istio/bootstrap/tracing_zipkin_golden.json");
        let (_, report) = check_valid(&path);
        let tracer = report
            .findings
            .iter()
            .find(|f| f.path == "tracing.http.typed_config")
            .expect("a finding for the zipkin tracer");
        assert_eq!(tracer.severity, Severity::Warning);
        assert!(
            tracer
                .message
                .contains("envoy.config.trace.v3.ZipkinConfig"),
            "{tracer}"
        );
    }

    /// Every type named as implemented is one the descriptor pool knows, so validation
    /// can read it (else it would report "an Any of type ..., which shunt does not
    /// know"); a misspelt type name fails here. Cluster types are enum names, not
    /// messages; Istio's `set_internal_dst_address` config only ever comes in a
    /// TypedStruct (as istiod writes it), whose inner type validation reads by name.
    #[test]
    fn every_implemented_type_is_in_the_descriptor_pool() {
        let pool = shunt_config::descriptor_pool().unwrap();
        let i = &*IMPLEMENTED;
        let lists = [
            &i.network_filters,
            &i.upstream_network_filters,
            &i.http_filters,
            &i.http_filter_per_route,
            &i.listener_filters,
            &i.transport_sockets,
            &i.bootstrap_extensions,
            &i.custom_cluster_types,
            &i.access_loggers,
            &i.protocol_options,
            &i.filter_chain_matching,
        ];
        let unknown: Vec<&str> = lists
            .into_iter()
            .flatten()
            .copied()
            .filter(|name| *name != "istio.set_internal_dst_address.v1.Config")
            .filter(|name| pool.get_message_by_name(name).is_none())
            .collect();
        assert_eq!(unknown, Vec::<&str>::new());
    }

    /// The stderr access logger is compiled (`shunt_core::access_log::compile`), so
    /// validation does not call it unimplemented (the list config kept lacked it).
    #[test]
    fn a_stderr_access_log_is_implemented() {
        let options = Options {
            config_yaml: Some(
                r#"
static_resources:
  listeners:
  - name: l
    address: {socket_address: {address: 127.0.0.1, port_value: 10000}}
    filter_chains:
    - filters:
      - name: tcp
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: tcp
          cluster: c
          access_log:
          - name: envoy.access_loggers.stderr
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StderrAccessLog
  clusters:
  - name: c
"#
                .into(),
            ),
            ..Default::default()
        };
        let (_, report) = shunt_config::check(&options, &IMPLEMENTED).unwrap();
        assert!(report.findings.is_empty(), "{:#?}", report.findings);
    }
}
