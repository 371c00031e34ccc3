//! The HCM's `custom_tags` (Envoy's `Tracing::CustomTag`): a literal, an environment
//! variable (read once, at compile time, as Envoy does), a request header, or a value of
//! the request's dynamic metadata (Istio's dry-run RBAC tags). A tag with no value and
//! no default is left off.

use envoy_types::pb::envoy::r#type::metadata::v3::{
    metadata_key::path_segment::Segment, metadata_kind::Kind as MetadataKind,
};
use envoy_types::pb::envoy::r#type::tracing::v3::{CustomTag as EnvoyTag, custom_tag::Type};
use hyper::HeaderMap;
use hyper::header::HeaderName;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stream_info::Metadata;

#[derive(Debug, Clone, PartialEq)]
pub struct CustomTag {
    pub tag: String,
    pub value: TagValue,
}

#[derive(Debug, Clone, PartialEq)]
pub enum TagValue {
    /// A literal, or an environment variable's value (or its default) as read at compile.
    Fixed(Option<String>),
    RequestHeader {
        name: HeaderName,
        default: Option<String>,
    },
    /// The request's dynamic metadata at `namespace`, `path`.
    Metadata {
        namespace: String,
        path: Vec<String>,
        default: Option<String>,
    },
}

impl CustomTag {
    /// The tag's value from the request's headers, if any.
    pub fn from_request(&self, headers: &HeaderMap) -> Option<String> {
        match &self.value {
            TagValue::Fixed(value) => value.clone(),
            TagValue::RequestHeader { name, default } => headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .or_else(|| default.clone()),
            TagValue::Metadata { .. } => None,
        }
    }

    /// The tag's value from the stream's dynamic metadata at its end (metadata tags only).
    pub fn from_metadata(&self, metadata: Option<&Metadata>) -> Option<String> {
        let TagValue::Metadata {
            namespace,
            path,
            default,
        } = &self.value
        else {
            return None;
        };
        let value = metadata.and_then(|m| m.value(namespace, path));
        match value {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Null) | None => default.clone(),
            Some(other) => Some(other.to_string()),
        }
    }

    pub fn is_metadata(&self) -> bool {
        matches!(self.value, TagValue::Metadata { .. })
    }
}

fn non_empty(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

pub fn compile(tags: &[EnvoyTag], path: &JsonPath, problems: &mut Diagnostics) -> Vec<CustomTag> {
    let mut out = Vec::new();
    for (i, tag) in tags.iter().enumerate() {
        let path = path.index(i);
        if tag.tag.is_empty() {
            problems.error(path.field("tag"), "is required");
            continue;
        }
        let value = match &tag.r#type {
            Some(Type::Literal(literal)) => TagValue::Fixed(Some(literal.value.clone())),
            Some(Type::Environment(env)) => TagValue::Fixed(
                std::env::var(&env.name)
                    .ok()
                    .filter(|v| !v.is_empty())
                    .or_else(|| non_empty(&env.default_value)),
            ),
            Some(Type::RequestHeader(header)) => {
                match HeaderName::from_bytes(header.name.to_ascii_lowercase().as_bytes()) {
                    Ok(name) => TagValue::RequestHeader {
                        name,
                        default: non_empty(&header.default_value),
                    },
                    Err(_) => {
                        problems.error(
                            path.field("request_header").field("name"),
                            format!("{:?} is not a header name", header.name),
                        );
                        continue;
                    }
                }
            }
            Some(Type::Metadata(metadata)) => {
                let kind = metadata.kind.as_ref().and_then(|k| k.kind.as_ref());
                if !matches!(kind, Some(MetadataKind::Request(_))) {
                    problems.error(
                        path.field("metadata").field("kind"),
                        "only request metadata is implemented",
                    );
                    continue;
                }
                let key = metadata.metadata_key.clone().unwrap_or_default();
                let path_keys = key
                    .path
                    .iter()
                    .filter_map(|s| match &s.segment {
                        Some(Segment::Key(k)) => Some(k.clone()),
                        _ => None,
                    })
                    .collect();
                TagValue::Metadata {
                    namespace: key.key,
                    path: path_keys,
                    default: non_empty(&metadata.default_value),
                }
            }
            Some(Type::Value(_)) => {
                problems.error(
                    path.field("value"),
                    "formatter custom tags are not implemented",
                );
                continue;
            }
            None => {
                problems.error(
                    &path,
                    "a custom tag needs literal, environment, request_header or metadata",
                );
                continue;
            }
        };
        out.push(CustomTag {
            tag: tag.tag.clone(),
            value,
        });
    }
    out
}
