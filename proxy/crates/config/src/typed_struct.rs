//! `udpa.type.v1.TypedStruct` / `xds.type.v3.TypedStruct`: an extension's config given
//! as JSON (a `Struct`) with the real type's URL beside it, as istiod writes Istio's own
//! filters. [`unwrap`] turns one into an `Any` of the real type through the descriptor
//! pool, so an extension decodes its config the same way whichever form it came in.

use std::borrow::Cow;

use envoy_types::pb::google::protobuf::Any;
use prost_reflect::{DynamicMessage, Value};

use super::diagnostic::{Diagnostics, JsonPath};
use super::json::type_name_of_url;
use super::pool::pool;

/// The type names of the two `TypedStruct`s.
pub const TYPED_STRUCTS: &[&str] = &["udpa.type.v1.TypedStruct", "xds.type.v3.TypedStruct"];

/// `any` itself, or the typed config inside it when it is a `TypedStruct`. Errors (an
/// unknown inner type, a value that does not fit it) go to `problems` at `path`.
pub fn unwrap<'a>(
    any: &'a Any,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Cow<'a, Any>> {
    let outer = type_name_of_url(&any.type_url);
    if !TYPED_STRUCTS.contains(&outer) {
        return Some(Cow::Borrowed(any));
    }
    match convert(any, outer) {
        Ok(inner) => Some(Cow::Owned(inner)),
        Err(err) => {
            problems.error(path, err);
            None
        }
    }
}

fn convert(any: &Any, outer: &str) -> Result<Any, String> {
    let pool = pool().map_err(|e| e.to_string())?;
    let desc = pool
        .get_message_by_name(outer)
        .ok_or_else(|| format!("{outer} is not in the descriptor pool"))?;
    let typed_struct = DynamicMessage::decode(desc, any.value.as_slice())
        .map_err(|e| format!("{outer} does not decode: {e}"))?;
    let type_url = match typed_struct.get_field_by_name("type_url").as_deref() {
        Some(Value::String(url)) => url.clone(),
        _ => String::new(),
    };
    let inner_name = type_name_of_url(&type_url);
    let inner_desc = pool
        .get_message_by_name(inner_name)
        .ok_or_else(|| format!("{outer} wraps {inner_name:?}, a type shunt does not know"))?;
    // The Struct as JSON, then read as the inner type's proto3 JSON.
    let json = match typed_struct.get_field_by_name("value").as_deref() {
        Some(Value::Message(value)) => {
            serde_json::to_value(value).map_err(|e| format!("{outer}.value: {e}"))?
        }
        _ => serde_json::Value::Object(Default::default()),
    };
    let inner = DynamicMessage::deserialize(inner_desc, json)
        .map_err(|e| format!("{outer}.value is not a valid {inner_name}: {e}"))?;
    Ok(Any {
        type_url: format!("type.googleapis.com/{inner_name}"),
        value: prost::Message::encode_to_vec(&inner),
    })
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
    use prost::Message;

    use super::*;
    use crate::json::from_json;

    #[test]
    fn a_typed_struct_becomes_the_type_inside() {
        let (any, _) = from_json::<Any>(serde_json::json!({
            "@type": "type.googleapis.com/udpa.type.v1.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "value": {"suppress_envoy_headers": true}
        }))
        .unwrap();
        let mut problems = Diagnostics::default();
        let inner = unwrap(&any, &JsonPath::new("p"), &mut problems).unwrap();
        assert_eq!(
            inner.type_url,
            "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        );
        assert!(
            Router::decode(inner.value.as_slice())
                .unwrap()
                .suppress_envoy_headers
        );
    }

    #[test]
    fn a_bad_typed_struct_is_an_error_at_its_path() {
        let (any, _) = from_json::<Any>(serde_json::json!({
            "@type": "type.googleapis.com/xds.type.v3.TypedStruct",
            "type_url": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
            "value": {"no_such_field": 1}
        }))
        .unwrap();
        let mut problems = Diagnostics::default();
        assert!(unwrap(&any, &JsonPath::new("a.b"), &mut problems).is_none());
        assert_eq!(problems.errors.len(), 1);
        assert_eq!(problems.errors[0].path, "a.b");
    }
}
