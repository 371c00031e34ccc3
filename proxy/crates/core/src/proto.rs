//! `google.protobuf.Struct` and `Any` encoded as istio-proxy encodes them: protobuf's
//! deterministic serialization, map entries in key order, each entry with its key and
//! value written even when empty. prost writes the same message with map entries in hash
//! order and empty values left out: equal to a parser, but not byte for byte. The peer
//! exchange's bytes are compared in tests against istio-proxy's, and metadata kept
//! encoded (`interned::EncodedMetadata`) is compared and shared by its bytes.

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value};
use prost::encoding::{WireType, encode_key, encode_varint};

/// The type URL of a `Struct` inside an `Any`.
pub const STRUCT_TYPE_URL: &str = "type.googleapis.com/google.protobuf.Struct";

/// The deterministic encoding of `value`.
pub fn encode_struct(value: &Struct) -> Vec<u8> {
    let mut out = Vec::new();
    let mut keys: Vec<&String> = value.fields.keys().collect();
    keys.sort();
    for key in keys {
        map_entry(1, key, &encode_value(&value.fields[key]), &mut out);
    }
    out
}

/// An entry of the map field `tag`: its key (field 1) and its value's encoding (field 2).
pub fn map_entry(tag: u32, key: &str, value: &[u8], out: &mut Vec<u8>) {
    let mut entry = Vec::new();
    bytes_field(1, key.as_bytes(), &mut entry);
    bytes_field(2, value, &mut entry);
    bytes_field(tag, &entry, out);
}

/// An `Any` holding `payload` as a `type_url` message (fields left out when empty, as
/// protobuf writes proto3 scalars).
pub fn encode_any(type_url: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    if !type_url.is_empty() {
        bytes_field(1, type_url.as_bytes(), &mut out);
    }
    if !payload.is_empty() {
        bytes_field(2, payload, &mut out);
    }
    out
}

fn encode_value(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    match &value.kind {
        None => {}
        Some(Kind::NullValue(n)) => {
            encode_key(1, WireType::Varint, &mut out);
            encode_varint(*n as u64, &mut out);
        }
        Some(Kind::NumberValue(n)) => {
            encode_key(2, WireType::SixtyFourBit, &mut out);
            out.extend_from_slice(&n.to_le_bytes());
        }
        Some(Kind::StringValue(s)) => bytes_field(3, s.as_bytes(), &mut out),
        Some(Kind::BoolValue(b)) => {
            encode_key(4, WireType::Varint, &mut out);
            encode_varint(u64::from(*b), &mut out);
        }
        Some(Kind::StructValue(s)) => bytes_field(5, &encode_struct(s), &mut out),
        Some(Kind::ListValue(l)) => bytes_field(6, &encode_list(l), &mut out),
    }
    out
}

fn encode_list(list: &ListValue) -> Vec<u8> {
    let mut out = Vec::new();
    for value in &list.values {
        bytes_field(1, &encode_value(value), &mut out);
    }
    out
}

fn bytes_field(tag: u32, bytes: &[u8], out: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    #[test]
    fn entries_are_in_key_order_and_parse_back() {
        let value = Struct {
            fields: [
                ("b".to_owned(), text("")),
                ("a".to_owned(), text("x")),
                (
                    "c".to_owned(),
                    Value {
                        kind: Some(Kind::ListValue(ListValue {
                            values: vec![
                                Value {
                                    kind: Some(Kind::NumberValue(1.5)),
                                },
                                Value {
                                    kind: Some(Kind::BoolValue(true)),
                                },
                            ],
                        })),
                    },
                ),
            ]
            .into_iter()
            .collect(),
        };
        let bytes = encode_struct(&value);
        // "a" first; "b" keeps its empty string value (a set oneof is always written).
        assert_eq!(
            &bytes[..19],
            &[
                0x0a, 0x08, 0x0a, 0x01, b'a', 0x12, 0x03, 0x1a, 0x01, b'x', //
                0x0a, 0x07, 0x0a, 0x01, b'b', 0x12, 0x02, 0x1a, 0x00
            ]
        );
        assert_eq!(Struct::decode(bytes.as_slice()).unwrap(), value);
    }
}
