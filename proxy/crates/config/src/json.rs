//! Proto3 JSON in and out of Envoy's types, through the descriptor pool, so that an `Any`
//! is read and written as `{"@type": ..., fields...}` exactly as Envoy does.
//!
//! Reading goes JSON → `DynamicMessage` (prost-reflect) → protobuf bytes → the envoy-types
//! struct. prost-reflect's errors say what was wrong but not where; when it fails we walk
//! the JSON beside the schema and try each value on its own, so the error names the JSON
//! path (`static_resources.clusters[2].connect_timeout`). That walk only runs on failure.
//!
//! One leniency, as Envoy has it: a repeated field given a single value instead of a list
//! is read as a one-element list (go-control-plane's sample bootstraps rely on it). Each
//! such place is returned as a [`Leniency`] so that validation can warn about it.

use std::fmt;

use prost::{Message, Name};
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MapKey,
    MessageDescriptor, ReflectMessage, SerializeOptions, Value as ProtoValue,
};
use serde_json::{Map, Value};

use super::pool::{PoolError, pool};

const ANY: &str = "google.protobuf.Any";

/// A JSON document that is not a valid message of the expected type.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JsonError {
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// What was wrong, and where: `path` is empty for the document as a whole.
    #[error("{}{message}", if path.is_empty() { String::new() } else { format!("{path}: ") })]
    Invalid { path: String, message: String },
}

impl JsonError {
    fn at(path: &Path, message: impl Into<String>) -> Self {
        JsonError::Invalid {
            path: path.to_string(),
            message: message.into(),
        }
    }
}

/// A place where the input was accepted although it is not strict proto3 JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leniency {
    pub path: String,
    pub message: String,
}

/// Reads a proto3 JSON document as message `M`, `@type` in `Any` resolved through the pool.
pub fn from_json<M: Message + Name + Default>(
    mut value: Value,
) -> Result<(M, Vec<Leniency>), JsonError> {
    let pool = &pool()?;
    let desc = message_descriptor(pool, &M::full_name())?;
    let mut leniencies = Vec::new();
    wrap_single_values(
        &mut value,
        &desc,
        pool,
        &mut Path::default(),
        &mut leniencies,
    );
    let dynamic = DynamicMessage::deserialize_with_options(desc.clone(), &value, &strict())
        .map_err(|err| {
            locate(&value, &desc, pool, &mut Path::default())
                .unwrap_or_else(|| JsonError::at(&Path::default(), err.to_string()))
        })?;
    let message = M::decode(dynamic.encode_to_vec().as_slice()).map_err(|err| {
        JsonError::at(
            &Path::default(),
            format!("decoding as {}: {err}", M::full_name()),
        )
    })?;
    Ok((message, leniencies))
}

/// Writes `message` as proto3 JSON the way Envoy's `/config_dump` does: proto field
/// names, default values left out, `Any` with `@type`, integral doubles without `.0`.
pub fn to_json<M: Message + Name>(message: &M) -> Result<Value, JsonError> {
    let pool = &pool()?;
    let desc = message_descriptor(pool, &M::full_name())?;
    let dynamic = DynamicMessage::decode(desc, message.encode_to_vec().as_slice())
        .map_err(|err| JsonError::at(&Path::default(), err.to_string()))?;
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(true);
    let mut value = dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|err| {
            // The only way a valid message fails to serialize is an `Any` whose type the
            // pool lacks: name it.
            unknown_any(&dynamic, pool, &mut Path::default())
                .unwrap_or_else(|| JsonError::at(&Path::default(), err.to_string()))
        })?;
    integral_doubles_as_integers(&mut value);
    Ok(value)
}

/// The message inside `any` as proto3 JSON (proto field names, defaults left out), read
/// through the descriptor pool: for extensions whose configs shunt reads as JSON
/// (Istio's `stats.PluginConfig`).
pub fn any_to_json(any: &envoy_types::pb::google::protobuf::Any) -> Result<Value, JsonError> {
    let pool = &pool()?;
    let desc = message_descriptor(pool, type_name_of_url(&any.type_url))?;
    let dynamic = DynamicMessage::decode(desc, any.value.as_slice())
        .map_err(|err| JsonError::at(&Path::default(), err.to_string()))?;
    let options = SerializeOptions::new()
        .use_proto_field_name(true)
        .skip_default_fields(true);
    let mut value = dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|err| JsonError::at(&Path::default(), err.to_string()))?;
    integral_doubles_as_integers(&mut value);
    Ok(value)
}

/// protobuf's own JSON writers (C++, Go) print the double 64 as `64`; serde_json prints
/// `64.0`. Both read back the same; this keeps shunt's output the same as Envoy's.
fn integral_doubles_as_integers(value: &mut Value) {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53: larger doubles are not all integers
    match value {
        Value::Number(number) => {
            if let Some(f) = number.as_f64().filter(|_| number.is_f64())
                && f.fract() == 0.0
                && f.abs() < EXACT
            {
                *number = serde_json::Number::from(f as i64);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(integral_doubles_as_integers),
        Value::Object(entries) => entries.values_mut().for_each(integral_doubles_as_integers),
        _ => {}
    }
}

fn strict() -> DeserializeOptions {
    DeserializeOptions::new().deny_unknown_fields(true)
}

fn message_descriptor(pool: &DescriptorPool, name: &str) -> Result<MessageDescriptor, JsonError> {
    pool.get_message_by_name(name)
        .ok_or_else(|| JsonError::from(PoolError::missing(name)))
}

/// The type name an `Any` type URL refers to (the part after the last `/`).
pub fn type_name_of_url(type_url: &str) -> &str {
    type_url.rsplit('/').next().unwrap_or(type_url)
}

/// A JSON path as shown in errors: `static_resources.clusters[2].connect_timeout`, with map
/// keys as `["key"]`.
#[derive(Debug, Clone, Default)]
pub struct Path(Vec<Step>);

#[derive(Debug, Clone)]
enum Step {
    Field(String),
    Index(usize),
    Key(String),
}

impl Path {
    pub fn field(&mut self, name: &str) -> &mut Self {
        self.0.push(Step::Field(name.to_owned()));
        self
    }
    pub fn pop(&mut self) {
        self.0.pop();
    }
    /// Runs `f` with `step` pushed, then pops it.
    fn with<T>(&mut self, step: Step, f: impl FnOnce(&mut Self) -> T) -> T {
        self.0.push(step);
        let result = f(self);
        self.0.pop();
        result
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, step) in self.0.iter().enumerate() {
            match step {
                Step::Field(name) if i == 0 => write!(f, "{name}")?,
                Step::Field(name) => write!(f, ".{name}")?,
                Step::Index(index) => write!(f, "[{index}]")?,
                Step::Key(key) => write!(f, "[{key:?}]")?,
            }
        }
        Ok(())
    }
}

/// A walk's place as a diagnostic names it.
impl From<&Path> for crate::JsonPath {
    fn from(path: &Path) -> Self {
        crate::JsonPath::new(path.to_string())
    }
}

/// The field a JSON key names: proto3 JSON accepts the lowerCamelCase JSON name and the
/// proto field name.
fn field_for_key(desc: &MessageDescriptor, key: &str) -> Option<FieldDescriptor> {
    desc.get_field_by_json_name(key)
        .or_else(|| desc.get_field_by_name(key))
}

/// Descriptor of the message an `Any` object carries, if its `@type` names a known type.
fn any_payload(object: &Map<String, Value>, pool: &DescriptorPool) -> Option<MessageDescriptor> {
    let type_url = object.get("@type")?.as_str()?;
    pool.get_message_by_name(type_name_of_url(type_url))
}

/// Well-known types have their own JSON forms and are never walked into (except `Any`).
fn is_well_known(desc: &MessageDescriptor) -> bool {
    desc.full_name().starts_with("google.protobuf.") && desc.full_name() != ANY
}

/// An `Any` of a well-known type keeps its payload under `"value"`.
fn any_payload_is_well_known(desc: &MessageDescriptor) -> bool {
    desc.full_name().starts_with("google.protobuf.")
}

fn wrap_single_values(
    value: &mut Value,
    desc: &MessageDescriptor,
    pool: &DescriptorPool,
    path: &mut Path,
    leniencies: &mut Vec<Leniency>,
) {
    let Value::Object(object) = value else {
        return;
    };
    if desc.full_name() == ANY {
        if let Some(payload) = any_payload(object, pool)
            && !any_payload_is_well_known(&payload)
        {
            for (key, item) in object.iter_mut().filter(|(key, _)| *key != "@type") {
                if let Some(field) = field_for_key(&payload, key) {
                    path.with(Step::Field(key.clone()), |path| {
                        wrap_field(item, &field, pool, path, leniencies)
                    });
                }
            }
        }
        return;
    }
    if is_well_known(desc) {
        return;
    }
    for (key, item) in object.iter_mut() {
        if let Some(field) = field_for_key(desc, key) {
            path.with(Step::Field(key.clone()), |path| {
                wrap_field(item, &field, pool, path, leniencies)
            });
        }
    }
}

fn wrap_field(
    value: &mut Value,
    field: &FieldDescriptor,
    pool: &DescriptorPool,
    path: &mut Path,
    leniencies: &mut Vec<Leniency>,
) {
    if field.is_map() {
        if let (Value::Object(entries), Kind::Message(entry)) = (value, field.kind())
            && let Kind::Message(item_desc) = entry.map_entry_value_field().kind()
        {
            for (key, item) in entries.iter_mut() {
                path.with(Step::Key(key.clone()), |path| {
                    wrap_single_values(item, &item_desc, pool, path, leniencies)
                });
            }
        }
        return;
    }
    if field.is_list() && !matches!(value, Value::Array(_) | Value::Null) {
        leniencies.push(Leniency {
            path: path.to_string(),
            message: "a single value where a list is expected; read as a one-element list".into(),
        });
        *value = Value::Array(vec![value.take()]);
    }
    let Kind::Message(item_desc) = field.kind() else {
        return;
    };
    match value {
        Value::Array(items) => {
            for (index, item) in items.iter_mut().enumerate() {
                path.with(Step::Index(index), |path| {
                    wrap_single_values(item, &item_desc, pool, path, leniencies)
                });
            }
        }
        item => wrap_single_values(item, &item_desc, pool, path, leniencies),
    }
}

/// Finds the first place in `value` that is not valid proto3 JSON for `desc`, trying
/// each field on its own through prost-reflect so that its conversion rules stay the
/// only ones. `None` if every part passes on its own.
fn locate(
    value: &Value,
    desc: &MessageDescriptor,
    pool: &DescriptorPool,
    path: &mut Path,
) -> Option<JsonError> {
    if desc.full_name() == ANY {
        return locate_any(value, pool, path);
    }
    let Value::Object(object) = value else {
        if value.is_null() {
            return None;
        }
        return check_whole(value, desc, path);
    };
    if is_well_known(desc) {
        return check_whole(value, desc, path);
    }
    for (key, item) in object {
        let Some(field) = field_for_key(desc, key) else {
            return Some(path.with(Step::Field(key.clone()), |path| {
                JsonError::at(path, format!("unknown field (not in {})", desc.full_name()))
            }));
        };
        let found = path.with(Step::Field(key.clone()), |path| {
            locate_field(key, item, &field, desc, pool, path)
        });
        if found.is_some() {
            return found;
        }
    }
    // Each field passed alone: what is left is how they combine (two members of a oneof).
    check_whole(value, desc, path)
}

fn locate_field(
    key: &str,
    value: &Value,
    field: &FieldDescriptor,
    parent: &MessageDescriptor,
    pool: &DescriptorPool,
    path: &mut Path,
) -> Option<JsonError> {
    if value.is_null() {
        return None;
    }
    let only = |value: Value| Value::Object(Map::from_iter([(key.to_owned(), value)]));
    if field.is_map() {
        let (Value::Object(entries), Kind::Message(entry)) = (value, field.kind()) else {
            return check_field(&only(value.clone()), field, value, parent, path);
        };
        let value_field = entry.map_entry_value_field();
        for (map_key, item) in entries {
            let found = path.with(Step::Key(map_key.clone()), |path| {
                let single = only(Value::Object(Map::from_iter([(
                    map_key.clone(),
                    item.clone(),
                )])));
                // The value first; if it passes, what fails is the key (an integer key, say).
                let in_value = match value_field.kind() {
                    Kind::Message(item_desc) => locate(item, &item_desc, pool, path),
                    _ => None,
                };
                in_value.or_else(|| check_field(&single, &value_field, item, parent, path))
            });
            if found.is_some() {
                return found;
            }
        }
        return None;
    }
    if field.is_list() {
        let Value::Array(items) = value else {
            return check_field(&only(value.clone()), field, value, parent, path);
        };
        for (index, item) in items.iter().enumerate() {
            let found = path.with(Step::Index(index), |path| match field.kind() {
                Kind::Message(item_desc) => locate(item, &item_desc, pool, path),
                _ => check_field(
                    &only(Value::Array(vec![item.clone()])),
                    field,
                    item,
                    parent,
                    path,
                ),
            });
            if found.is_some() {
                return found;
            }
        }
        return None;
    }
    match field.kind() {
        Kind::Message(item_desc) => locate(value, &item_desc, pool, path),
        _ => check_field(&only(value.clone()), field, value, parent, path),
    }
}

fn locate_any(value: &Value, pool: &DescriptorPool, path: &mut Path) -> Option<JsonError> {
    let Value::Object(object) = value else {
        if value.is_null() {
            return None;
        }
        return Some(JsonError::at(
            path,
            format!(
                "expected an object with \"@type\", found {}",
                kind_of(value)
            ),
        ));
    };
    let Some(type_url) = object.get("@type") else {
        return Some(JsonError::at(path, "an Any without \"@type\""));
    };
    let Some(type_url) = type_url.as_str() else {
        return Some(JsonError::at(path, "\"@type\" must be a string"));
    };
    if !type_url.contains('/') {
        return Some(JsonError::at(
            path,
            format!("@type {type_url:?} is not a type URL (type.googleapis.com/NAME)"),
        ));
    }
    let Some(payload) = any_payload(object, pool) else {
        return Some(JsonError::at(
            path,
            format!(
                "unknown @type {type_url:?}: {} is not a message type shunt knows",
                type_name_of_url(type_url)
            ),
        ));
    };
    if any_payload_is_well_known(&payload) {
        if let Some(key) = object.keys().find(|key| *key != "@type" && *key != "value") {
            return Some(path.with(Step::Field(key.clone()), |path| {
                JsonError::at(
                    path,
                    format!(
                        "unknown field (an Any of {} has only \"value\")",
                        payload.full_name()
                    ),
                )
            }));
        }
        return object.get("value").and_then(|inner| {
            path.with(Step::Field("value".into()), |path| {
                locate(inner, &payload, pool, path)
            })
        });
    }
    let mut rest = object.clone();
    rest.remove("@type");
    locate(&Value::Object(rest), &payload, pool, path)
}

/// Tries the whole value as a message of type `desc`.
fn check_whole(value: &Value, desc: &MessageDescriptor, path: &Path) -> Option<JsonError> {
    let err = DynamicMessage::deserialize_with_options(desc.clone(), value, &strict()).err()?;
    Some(JsonError::at(path, describe(desc.full_name(), value, &err)))
}

/// Tries `probe` (an object holding only this field) as a message of type `parent`.
fn check_field(
    probe: &Value,
    field: &FieldDescriptor,
    value: &Value,
    parent: &MessageDescriptor,
    path: &Path,
) -> Option<JsonError> {
    let err = DynamicMessage::deserialize_with_options(parent.clone(), probe, &strict()).err()?;
    let type_name = match field.kind() {
        Kind::Message(desc) => desc.full_name().to_owned(),
        Kind::Enum(desc) => desc.full_name().to_owned(),
        kind => format!("{kind:?}").to_lowercase(),
    };
    Some(JsonError::at(path, describe(&type_name, value, &err)))
}

/// prost-reflect's message, with the value shown and clearer words for the common cases.
fn describe(type_name: &str, value: &Value, err: &serde_json::Error) -> String {
    let shown = shorten(value);
    match type_name {
        "google.protobuf.Duration" => format!(
            "invalid duration {shown}: expected a string of seconds ending in \"s\", like \"5s\" or \"0.25s\""
        ),
        "google.protobuf.Timestamp" => {
            format!("invalid timestamp {shown}: expected RFC 3339, like \"2024-01-01T00:00:00Z\"")
        }
        _ => format!("invalid {type_name} {shown}: {err}"),
    }
}

fn shorten(value: &Value) -> String {
    let text = value.to_string();
    if text.chars().count() <= 60 {
        return text;
    }
    let head: String = text.chars().take(57).collect();
    format!("{head}...")
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// The first `Any` (depth first) whose type the pool lacks.
fn unknown_any(
    message: &DynamicMessage,
    pool: &DescriptorPool,
    path: &mut Path,
) -> Option<JsonError> {
    if message.descriptor().full_name() == ANY {
        let type_url = match message.get_field_by_name("type_url").as_deref() {
            Some(ProtoValue::String(url)) => url.clone(),
            _ => String::new(),
        };
        let Some(desc) = pool.get_message_by_name(type_name_of_url(&type_url)) else {
            return Some(JsonError::at(
                path,
                format!("an Any of type {type_url:?}, which shunt cannot write as JSON"),
            ));
        };
        let bytes = match message.get_field_by_name("value").as_deref() {
            Some(ProtoValue::Bytes(bytes)) => bytes.clone(),
            _ => Default::default(),
        };
        return match DynamicMessage::decode(desc, bytes) {
            Ok(payload) => unknown_any(&payload, pool, path),
            Err(err) => Some(JsonError::at(path, format!("undecodable Any: {err}"))),
        };
    }
    for (field, value) in message.fields() {
        let found = path.with(Step::Field(field.name().to_owned()), |path| {
            each_message(value, path, &mut |item, path| unknown_any(item, pool, path))
        });
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Calls `f` on every message directly inside a field's value (itself, list items, map
/// values), with the path extended to it; stops at the first `Some`.
pub fn each_message<T>(
    value: &ProtoValue,
    path: &mut Path,
    f: &mut impl FnMut(&DynamicMessage, &mut Path) -> Option<T>,
) -> Option<T> {
    match value {
        ProtoValue::Message(message) => f(message, path),
        ProtoValue::List(items) => items.iter().enumerate().find_map(|(index, item)| {
            path.with(Step::Index(index), |path| each_message(item, path, f))
        }),
        ProtoValue::Map(entries) => {
            let mut entries: Vec<_> = entries.iter().collect();
            entries.sort_by_key(|(key, _)| map_key_text(key));
            entries.into_iter().find_map(|(key, item)| {
                path.with(Step::Key(map_key_text(key)), |path| {
                    each_message(item, path, f)
                })
            })
        }
        _ => None,
    }
}

fn map_key_text(key: &MapKey) -> String {
    match key {
        MapKey::Bool(b) => b.to_string(),
        MapKey::I32(n) => n.to_string(),
        MapKey::I64(n) => n.to_string(),
        MapKey::U32(n) => n.to_string(),
        MapKey::U64(n) => n.to_string(),
        MapKey::String(s) => s.clone(),
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;
    use envoy_types::pb::envoy::config::cluster::v3::Cluster;
    use serde_json::json;

    use super::*;

    fn error_of(value: Value) -> String {
        from_json::<Bootstrap>(value).unwrap_err().to_string()
    }

    #[test]
    fn reads_any_by_type_and_writes_it_back_with_type() {
        let input = json!({
            "static_resources": {"listeners": [{
                "name": "l",
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": 10000}},
                "filter_chains": [{"filters": [{
                    "name": "tcp",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                        "stat_prefix": "tcp",
                        "cluster": "backend"
                    }
                }]}]
            }]}
        });
        let (bootstrap, leniencies) = from_json::<Bootstrap>(input.clone()).unwrap();
        assert!(leniencies.is_empty());
        assert_eq!(to_json(&bootstrap).unwrap(), input);
    }

    #[test]
    fn camel_case_keys_are_read_too() {
        let (cluster, _) =
            from_json::<Cluster>(json!({"name": "c", "connectTimeout": "1.5s"})).unwrap();
        let timeout = cluster.connect_timeout.unwrap();
        assert_eq!((timeout.seconds, timeout.nanos), (1, 500_000_000));
    }

    #[test]
    fn a_bad_duration_is_named_by_its_path() {
        let err = error_of(json!({"static_resources": {"clusters": [
            {"name": "a"}, {"name": "b"}, {"name": "c", "connect_timeout": "5"}
        ]}}));
        assert!(
            err.starts_with("static_resources.clusters[2].connect_timeout: invalid duration \"5\""),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_field_is_named_by_its_path() {
        let err = error_of(json!({"admin": {"adress": {}}}));
        assert!(err.starts_with("admin.adress: unknown field"), "{err}");
    }

    #[test]
    fn a_wrong_type_is_named_by_its_path() {
        let err = error_of(json!({"static_resources": {"clusters": [
            {"name": "c", "per_connection_buffer_limit_bytes": "lots"}
        ]}}));
        assert!(
            err.starts_with("static_resources.clusters[0].per_connection_buffer_limit_bytes: invalid google.protobuf.UInt32Value \"lots\""),
            "{err}"
        );
    }

    #[test]
    fn errors_inside_an_any_keep_their_path() {
        let err = error_of(json!({"static_resources": {"listeners": [{
            "name": "l",
            "filter_chains": [{"filters": [{
                "name": "tcp",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
                    "idle_timeout": "forever"
                }
            }]}]
        }]}}));
        assert!(
            err.starts_with(
                "static_resources.listeners[0].filter_chains[0].filters[0].typed_config.idle_timeout: invalid duration"
            ),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_type_is_named_by_its_path() {
        let err = error_of(json!({"stats_sinks": [{
            "name": "x",
            "typed_config": {"@type": "type.googleapis.com/acme.NoSuchSink"}
        }]}));
        assert!(
            err.starts_with(
                "stats_sinks[0].typed_config: unknown @type \"type.googleapis.com/acme.NoSuchSink\""
            ),
            "{err}"
        );
    }

    #[test]
    fn map_keys_appear_in_brackets() {
        let err = error_of(json!({"static_resources": {"clusters": [{
            "name": "c",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "common_http_protocol_options": {"idle_timeout": 3}
                }
            }
        }]}}));
        assert!(
            err.starts_with("static_resources.clusters[0].typed_extension_protocol_options[\"envoy.extensions.upstreams.http.v3.HttpProtocolOptions\"].common_http_protocol_options.idle_timeout: invalid duration 3"),
            "{err}"
        );
    }

    #[test]
    fn two_members_of_a_oneof_are_reported_at_their_message() {
        let err = error_of(json!({"static_resources": {"clusters": [
            {"name": "c", "type": "STATIC", "cluster_type": {"name": "x"}}
        ]}}));
        assert!(err.starts_with("static_resources.clusters[0]: "), "{err}");
    }

    #[test]
    fn a_single_value_for_a_list_is_accepted_and_reported() {
        let (bootstrap, leniencies) = from_json::<Bootstrap>(json!({
            "static_resources": {"clusters": {"name": "only"}}
        }))
        .unwrap();
        assert_eq!(bootstrap.static_resources.unwrap().clusters[0].name, "only");
        assert_eq!(leniencies.len(), 1);
        assert_eq!(leniencies[0].path, "static_resources.clusters");
    }

    #[test]
    fn writing_an_any_of_an_unknown_type_names_it() {
        let bootstrap = Bootstrap {
            bootstrap_extensions: vec![
                envoy_types::pb::envoy::config::core::v3::TypedExtensionConfig {
                    name: "x".into(),
                    typed_config: Some(envoy_types::pb::google::protobuf::Any {
                        type_url: "type.googleapis.com/acme.Unknown".into(),
                        value: vec![],
                    }),
                },
            ],
            ..Default::default()
        };
        let err = to_json(&bootstrap).unwrap_err().to_string();
        assert!(
            err.starts_with("bootstrap_extensions[0].typed_config: an Any of type"),
            "{err}"
        );
    }
}
