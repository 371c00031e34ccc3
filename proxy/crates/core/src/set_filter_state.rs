//! Envoy's `set_filter_state` values (`envoy.extensions.filters.common.set_filter_state.v3`),
//! shared by the network filter (`on_new_connection`) and the HTTP filter
//! (`on_request_headers`): each value is a format string rendered when the filter
//! runs, turned into a filter state object by its factory (`factory_key`, else the
//! `object_key`), and stored under `object_key`, shared with the upstream when asked:
//! an internal listener's connection gets the shared objects in its filter state,
//! `ONCE` ones for itself, `TRANSITIVE` ones shared on with its own upstream.
//!
//! The factories are Envoy's well-known objects: plain strings, and addresses for
//! `envoy.filters.listener.original_dst.local_ip` / `remote_ip` (which an internal
//! listener's `original_dst` restores when they are shared with its upstream
//! connection). A key with no factory is refused at config time, as Envoy does.

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::SubstitutionFormatString;
use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
use envoy_types::pb::envoy::config::core::v3::substitution_format_string::Format as FormatSource;
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::FilterStateValue;
use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::filter_state_value::{
    Key, SharedWithUpstream, Value,
};

use crate::formatter::{Context, Format};
use crate::stream_info::{
    FilterState, FilterStateEntry, FilterStateObject, LifeSpan, StringAccessor,
};
use shunt_config::{Diagnostics, JsonPath};

/// The original destination an internal listener's `original_dst` restores.
pub const ORIGINAL_DST_LOCAL: &str = "envoy.filters.listener.original_dst.local_ip";
/// The original source it restores.
pub const ORIGINAL_DST_REMOTE: &str = "envoy.filters.listener.original_dst.remote_ip";
/// `tcp_proxy` connects to this cluster instead of its own.
pub const TCP_PROXY_CLUSTER: &str = "envoy.tcp_proxy.cluster";

/// How a rendered value becomes an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Factory {
    String,
    Address,
    Unsigned,
}

/// Envoy's registered object factories that shunt knows, by key.
fn factory(key: &str) -> Option<Factory> {
    Some(match key {
        ORIGINAL_DST_LOCAL
        | ORIGINAL_DST_REMOTE
        | "envoy.network.transport_socket.original_dst_address" => Factory::Address,
        "envoy.upstream.dynamic_port" | "envoy.tcp_proxy.per_connection_idle_timeout_ms" => {
            Factory::Unsigned
        }
        "envoy.string"
        | "envoy.hashable_string"
        | "envoy.network.upstream_server_name"
        | "envoy.network.application_protocols"
        | "envoy.network.upstream_subject_alt_names"
        | "envoy.upstream.dynamic_host"
        | "envoy.tcp_proxy.cluster"
        | "io.istio.connect_authority"
        | "io.istio.peer_principal"
        | "io.istio.local_principal" => Factory::String,
        _ => return None,
    })
}

/// An address object (Envoy's `Network::AddressObject`): `ip:port` as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressObject(pub SocketAddr);

impl FilterStateObject for AddressObject {
    fn serialize_as_string(&self) -> Option<String> {
        Some(self.0.to_string())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// One compiled `FilterStateValue`.
#[derive(Debug, Clone)]
pub struct ValueSetter {
    key: String,
    factory: Factory,
    format: Format,
    read_only: bool,
    shared_with_upstream: bool,
    transitive: bool,
    skip_if_empty: bool,
}

/// Compiles `values` (at `path`, a list).
pub fn compile(
    values: &[FilterStateValue],
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Vec<ValueSetter>> {
    let before = problems.errors.len();
    let setters: Vec<_> = values
        .iter()
        .enumerate()
        .filter_map(|(i, v)| compile_value(v, &path.index(i), problems))
        .collect();
    (problems.errors.len() == before).then_some(setters)
}

#[allow(
    deprecated,
    reason = "read_only is deprecated but still honoured by Envoy"
)]
fn compile_value(
    value: &FilterStateValue,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<ValueSetter> {
    let Some(Key::ObjectKey(key)) = &value.key else {
        problems.error(path.field("object_key"), "is required");
        return None;
    };
    if key.is_empty() {
        problems.error(path.field("object_key"), "must not be empty");
        return None;
    }
    let factory_key = if value.factory_key.is_empty() {
        key
    } else {
        &value.factory_key
    };
    let Some(factory) = factory(factory_key) else {
        let field = if value.factory_key.is_empty() {
            "object_key"
        } else {
            "factory_key"
        };
        problems.error(
            path.field(field),
            format!("'{factory_key}' does not have an object factory"),
        );
        return None;
    };
    let format = compile_format(value.value.as_ref(), &path.field("format_string"), problems)?;
    let (shared_with_upstream, transitive) =
        match SharedWithUpstream::try_from(value.shared_with_upstream) {
            Ok(SharedWithUpstream::None) => (false, false),
            Ok(SharedWithUpstream::Once) => (true, false),
            Ok(SharedWithUpstream::Transitive) => (true, true),
            Err(_) => {
                problems.error(
                    path.field("shared_with_upstream"),
                    format!(
                        "{} is not a SharedWithUpstream value",
                        value.shared_with_upstream
                    ),
                );
                return None;
            }
        };
    Some(ValueSetter {
        key: key.clone(),
        factory,
        format,
        read_only: value.read_only,
        shared_with_upstream,
        transitive,
        skip_if_empty: value.skip_if_empty,
    })
}

#[allow(
    deprecated,
    reason = "text_format is deprecated but still accepted by Envoy"
)]
fn compile_format(
    value: Option<&Value>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Format> {
    let Some(Value::FormatString(SubstitutionFormatString {
        format,
        omit_empty_values,
        formatters,
        ..
    })) = value
    else {
        problems.error(path, "is required");
        return None;
    };
    if !formatters.is_empty() {
        problems.error(path.field("formatters"), "is not implemented");
        return None;
    }
    let text = match format {
        Some(FormatSource::TextFormat(text)) => text.clone(),
        Some(FormatSource::TextFormatSource(source)) => match &source.specifier {
            Some(Specifier::InlineString(text)) => text.clone(),
            Some(Specifier::InlineBytes(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
            _ => {
                problems.error(
                    path.field("text_format_source"),
                    "only inline_string and inline_bytes are implemented",
                );
                return None;
            }
        },
        Some(FormatSource::JsonFormat(_)) => {
            problems.error(path.field("json_format"), "is not implemented");
            return None;
        }
        None => {
            problems.error(path, "a text_format_source is required");
            return None;
        }
    };
    Some(Format::compile(&text, path, problems)?.omit_empty_values(*omit_empty_values))
}

impl ValueSetter {
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Renders the value: the entry to store, or `None` when it is skipped (empty
    /// with `skip_if_empty`, or not a value its factory takes).
    pub fn render(&self, ctx: &Context<'_>, life_span: LifeSpan) -> Option<FilterStateEntry> {
        let text = self.format.render(ctx);
        if text.is_empty() && self.skip_if_empty {
            return None;
        }
        let value: Arc<dyn FilterStateObject> = match self.factory {
            Factory::String => Arc::new(StringAccessor(text)),
            Factory::Address => match text.parse::<SocketAddr>() {
                Ok(address) => Arc::new(AddressObject(address)),
                Err(_) => {
                    tracing::debug!(key = %self.key, value = %text, "set_filter_state: not an address; not set");
                    return None;
                }
            },
            Factory::Unsigned => match text.parse::<u64>() {
                Ok(_) => Arc::new(StringAccessor(text)),
                Err(_) => {
                    tracing::debug!(key = %self.key, value = %text, "set_filter_state: not a number; not set");
                    return None;
                }
            },
        };
        Some(FilterStateEntry {
            value,
            read_only: self.read_only,
            life_span,
            shared_with_upstream: self.shared_with_upstream,
            transitive: self.transitive,
        })
    }
}

/// Sets `entry` under `key` in `state`, saying why not when a read-only object is
/// in the way.
pub fn store(state: &mut FilterState, key: &str, entry: FilterStateEntry) {
    if let Err(err) = state.set_entry(key, entry) {
        tracing::debug!(%err, "set_filter_state: not set");
    }
}

/// An address object shared with the upstream under `key`, if one is.
pub fn shared_address(state: &FilterState, key: &str) -> Option<SocketAddr> {
    let entry = state.get(key).filter(|e| e.shared_with_upstream)?;
    entry
        .value
        .as_any()
        .downcast_ref::<AddressObject>()
        .map(|a| a.0)
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::DataSource;

    use super::*;
    use crate::stream_info::Connection;

    fn value(
        key: &str,
        format: &str,
        factory_key: &str,
        shared: SharedWithUpstream,
    ) -> FilterStateValue {
        FilterStateValue {
            key: Some(Key::ObjectKey(key.into())),
            factory_key: factory_key.into(),
            shared_with_upstream: shared as i32,
            value: Some(Value::FormatString(SubstitutionFormatString {
                format: Some(FormatSource::TextFormatSource(DataSource {
                    specifier: Some(Specifier::InlineString(format.into())),
                    ..DataSource::default()
                })),
                ..SubstitutionFormatString::default()
            })),
            ..FilterStateValue::default()
        }
    }

    #[test]
    fn values_become_objects_by_their_factory() {
        let mut problems = Diagnostics::default();
        let setters = compile(
            &[
                value(
                    ORIGINAL_DST_LOCAL,
                    "%DOWNSTREAM_LOCAL_ADDRESS%",
                    "",
                    SharedWithUpstream::Once,
                ),
                value(
                    "my.key",
                    "tenant-%DOWNSTREAM_LOCAL_PORT%",
                    "envoy.string",
                    SharedWithUpstream::None,
                ),
            ],
            &JsonPath::new("on_new_connection"),
            &mut problems,
        )
        .expect("compiles");
        let mut connection = Connection::new(
            "10.0.0.1:8080".parse().unwrap(),
            "10.0.0.2:5000".parse().unwrap(),
        );
        for setter in &setters {
            let entry = setter
                .render(&Context::connection(&connection), LifeSpan::Connection)
                .expect("rendered");
            store(&mut connection.filter_state, setter.key(), entry);
        }
        assert_eq!(
            shared_address(&connection.filter_state, ORIGINAL_DST_LOCAL),
            Some("10.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(
            connection.filter_state.get_string("my.key").as_deref(),
            Some("tenant-8080")
        );
        assert_eq!(shared_address(&connection.filter_state, "my.key"), None);
    }

    #[test]
    fn once_reaches_one_upstream_connection_and_transitive_every_one() {
        let mut problems = Diagnostics::default();
        let setters = compile(
            &[
                value("x.once", "o", "envoy.string", SharedWithUpstream::Once),
                value("x.all", "t", "envoy.string", SharedWithUpstream::Transitive),
                value("x.none", "n", "envoy.string", SharedWithUpstream::None),
            ],
            &JsonPath::new("on_new_connection"),
            &mut problems,
        )
        .expect("compiles");
        let mut connection =
            Connection::new("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        for setter in &setters {
            let entry = setter
                .render(&Context::connection(&connection), LifeSpan::Connection)
                .expect("rendered");
            store(&mut connection.filter_state, setter.key(), entry);
        }
        let first_hop = connection.filter_state.shared_with_upstream();
        assert_eq!(first_hop.get_string("x.once").as_deref(), Some("o"));
        assert_eq!(first_hop.get_string("x.all").as_deref(), Some("t"));
        assert!(first_hop.get("x.none").is_none());
        let second_hop = first_hop.shared_with_upstream();
        assert!(second_hop.get("x.once").is_none());
        assert_eq!(second_hop.get_string("x.all").as_deref(), Some("t"));
    }

    #[test]
    fn a_key_without_a_factory_is_refused_by_name() {
        let mut problems = Diagnostics::default();
        let refused = compile(
            &[value("unknown.key", "x", "", SharedWithUpstream::None)],
            &JsonPath::new("on_request_headers"),
            &mut problems,
        );
        assert!(refused.is_none());
        let error = format!("{:?}", problems.errors);
        assert!(
            error.contains("'unknown.key' does not have an object factory")
                && error.contains("on_request_headers[0].object_key"),
            "{error}"
        );
    }

    #[test]
    fn an_address_factory_skips_what_is_not_an_address() {
        let mut problems = Diagnostics::default();
        let setters = compile(
            &[value(
                ORIGINAL_DST_REMOTE,
                "not-an-address",
                "",
                SharedWithUpstream::Once,
            )],
            &JsonPath::new("v"),
            &mut problems,
        )
        .unwrap();
        let connection =
            Connection::new("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
        assert!(
            setters[0]
                .render(&Context::connection(&connection), LifeSpan::Connection)
                .is_none()
        );
    }
}
