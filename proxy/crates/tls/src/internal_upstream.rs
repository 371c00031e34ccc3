//! Envoy's `internal_upstream` transport socket
//! (`envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport`):
//! for connections to an internal listener, it wraps another socket (Istio wraps
//! `raw_buffer`) and names the host and cluster metadata the internal listener's
//! connection receives as its dynamic metadata (`passthrough_metadata`).

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::core::v3::{Metadata, TransportSocket};
use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::InternalUpstreamTransport;
use envoy_types::pb::envoy::r#type::metadata::v3::metadata_kind::Kind;
use envoy_types::pb::google::protobuf::Struct;

use shunt_config::{Diagnostics, JsonPath};

pub const INTERNAL_UPSTREAM: &str =
    "envoy.extensions.transport_sockets.internal_upstream.v3.InternalUpstreamTransport";

/// Where one passed-through metadata namespace is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Host,
    Cluster,
}

/// The namespaces to pass, in config order; a later source of the same name wins, as
/// in Envoy, where each is set in turn on the internal connection's metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Passthrough {
    pub sources: Vec<(Source, String)>,
}

/// Dynamic metadata handed to an internal listener's connection, by namespace.
pub type PassedMetadata = BTreeMap<String, Struct>;

impl Passthrough {
    /// The namespaces found in `cluster`'s and `host`'s metadata.
    pub fn collect(&self, cluster: Option<&Metadata>, host: Option<&Metadata>) -> PassedMetadata {
        let mut out = PassedMetadata::new();
        for (source, name) in &self.sources {
            let from = match source {
                Source::Host => host,
                Source::Cluster => cluster,
            };
            if let Some(value) = from.and_then(|m| m.filter_metadata.get(name)) {
                out.insert(name.clone(), value.clone());
            }
        }
        out
    }
}

/// Decodes an `InternalUpstreamTransport` at `path` (its `typed_config`): the
/// passthrough config and the socket it wraps (`None`: raw bytes).
pub fn compile(
    bytes: &[u8],
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<(Passthrough, Option<TransportSocket>)> {
    let config = <InternalUpstreamTransport as prost::Message>::decode(bytes)
        .map_err(|e| problems.error(path, format!("cannot decode: {e}")))
        .ok()?;
    let mut passthrough = Passthrough::default();
    let errors_before = problems.errors.len();
    for (i, source) in config.passthrough_metadata.iter().enumerate() {
        let at = path.field("passthrough_metadata").index(i);
        let kind = match source.kind.as_ref().and_then(|k| k.kind.as_ref()) {
            Some(Kind::Host(_)) => Source::Host,
            Some(Kind::Cluster(_)) => Source::Cluster,
            Some(other) => {
                let name = match other {
                    Kind::Request(_) => "request",
                    _ => "route",
                };
                problems.error(
                    at.field("kind"),
                    format!("{name} metadata cannot be passed to an internal listener: only host and cluster"),
                );
                continue;
            }
            None => {
                problems.error(at.field("kind"), "is required");
                continue;
            }
        };
        if source.name.is_empty() {
            problems.error(at.field("name"), "is required");
            continue;
        }
        passthrough.sources.push((kind, source.name.clone()));
    }
    if problems.errors.len() > errors_before {
        return None;
    }
    Some((passthrough, config.transport_socket))
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::transport_sockets::internal_upstream::v3::internal_upstream_transport::MetadataValueSource;
    use envoy_types::pb::envoy::r#type::metadata::v3::{MetadataKind, metadata_kind};
    use envoy_types::pb::google::protobuf::{Value, value};

    fn source(kind: Kind, name: &str) -> MetadataValueSource {
        MetadataValueSource {
            kind: Some(MetadataKind { kind: Some(kind) }),
            name: name.into(),
        }
    }

    fn metadata(ns: &str, key: &str, v: &str) -> Metadata {
        let mut s = Struct::default();
        s.fields.insert(
            key.into(),
            Value {
                kind: Some(value::Kind::StringValue(v.into())),
            },
        );
        Metadata {
            filter_metadata: [(ns.to_owned(), s)].into(),
            ..Default::default()
        }
    }

    #[test]
    fn host_and_cluster_namespaces_are_passed_as_configured() {
        let config = InternalUpstreamTransport {
            passthrough_metadata: vec![
                source(
                    Kind::Host(metadata_kind::Host {}),
                    "envoy.filters.listener.original_dst",
                ),
                source(Kind::Cluster(metadata_kind::Cluster {}), "istio"),
                source(Kind::Host(metadata_kind::Host {}), "absent"),
            ],
            transport_socket: None,
        };
        let mut problems = Diagnostics::default();
        let (passthrough, inner) = compile(
            &prost::Message::encode_to_vec(&config),
            &JsonPath::new("ts"),
            &mut problems,
        )
        .unwrap();
        assert!(problems.errors.is_empty(), "{problems:?}");
        assert!(inner.is_none());
        let host = metadata(
            "envoy.filters.listener.original_dst",
            "local",
            "10.0.0.5:80",
        );
        let cluster = metadata("istio", "default_original_port", "80");
        let passed = passthrough.collect(Some(&cluster), Some(&host));
        assert_eq!(
            passed.keys().collect::<Vec<_>>(),
            ["envoy.filters.listener.original_dst", "istio"]
        );
        assert_eq!(
            passed["envoy.filters.listener.original_dst"].fields["local"].kind,
            Some(value::Kind::StringValue("10.0.0.5:80".into()))
        );
    }

    #[test]
    fn request_metadata_is_refused_at_its_path() {
        let config = InternalUpstreamTransport {
            passthrough_metadata: vec![source(Kind::Request(metadata_kind::Request {}), "x")],
            transport_socket: None,
        };
        let mut problems = Diagnostics::default();
        assert!(
            compile(
                &prost::Message::encode_to_vec(&config),
                &JsonPath::new("ts"),
                &mut problems
            )
            .is_none()
        );
        assert_eq!(problems.errors[0].path, "ts.passthrough_metadata[0].kind");
    }
}
