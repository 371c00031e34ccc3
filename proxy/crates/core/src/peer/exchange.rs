//! The TCP metadata exchange istio-proxy's `envoy.tcp.metadataexchange` filter speaks on a
//! connection whose ALPN negotiated `istio-peer-exchange`: before any payload, each side
//! writes
//!
//! ```text
//! magic 0x3D230467 (u32, big endian) | length (u32, big endian) | Any(Struct), length bytes
//! ```
//!
//! where the `Struct` holds the sender's node metadata under `x-envoy-peer-metadata` and its
//! node id under `x-envoy-peer-metadata-id`. The payload follows right after, so a reader
//! takes exactly the header's bytes and hands the rest on.

use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Any, Struct, Value};
use prost::Message;

use super::{LocalNode, NodeMetadata};
use crate::proto::{STRUCT_TYPE_URL, encode_any, encode_struct};

/// The ALPN protocol that asks for the exchange.
pub const PROTOCOL: &str = "istio-peer-exchange";
/// The exchange header's first 4 bytes (big endian).
pub const MAGIC: u32 = 0x3D23_0467;
/// Magic and length.
pub const PREFIX_LEN: usize = 8;
/// The key of the node metadata in the exchanged `Struct` (and the HTTP header name).
pub const METADATA_KEY: &str = "x-envoy-peer-metadata";
/// The key of the node id.
pub const METADATA_ID_KEY: &str = "x-envoy-peer-metadata-id";
/// The largest metadata a peer may send. istio-proxy sets no bound; a few KiB is what a
/// pod with many labels sends, and a bound keeps a hostile peer from making us buffer
/// gigabytes before the first payload byte.
pub const MAX_METADATA_LEN: usize = 1 << 20;

/// Why a peer's exchange header was not accepted. istio-proxy then marks the peer
/// unknown and passes the bytes on untouched; so does shunt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExchangeError {
    #[error(
        "istio-peer-exchange: the peer's first bytes are not the exchange header (magic \
         {found:#010x}, want {MAGIC:#010x}): it has no metadata exchange filter"
    )]
    BadMagic { found: u32 },
    #[error(
        "istio-peer-exchange: the peer announces {length} bytes of metadata, more than the \
         {MAX_METADATA_LEN} accepted"
    )]
    TooLarge { length: usize },
    #[error("istio-peer-exchange: the peer's metadata is not a protobuf Any: {reason}")]
    NotAny { reason: String },
    #[error("istio-peer-exchange: the peer's metadata is a {type_url}, want {STRUCT_TYPE_URL}")]
    NotStruct { type_url: String },
    #[error("istio-peer-exchange: the peer's metadata Struct does not parse: {reason}")]
    BadStruct { reason: String },
}

/// What the peer told about itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerExchange {
    /// `x-envoy-peer-metadata`, when present (istio-proxy always sends it).
    pub metadata: Option<NodeMetadata>,
    /// `x-envoy-peer-metadata-id`: the peer's node id.
    pub id: Option<String>,
}

/// The result of reading a buffer that starts where the exchange header should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded {
    /// Not all of the header is there yet: at least `want` bytes in total are needed.
    NeedMore { want: usize },
    /// The header, and how many bytes of the buffer it took.
    Done {
        peer: Box<PeerExchange>,
        consumed: usize,
    },
}

/// The bytes `node` writes first on an `istio-peer-exchange` connection.
pub fn encode(node: &LocalNode) -> Vec<u8> {
    let mut data = Struct::default();
    data.fields.insert(
        METADATA_KEY.to_owned(),
        Value {
            kind: Some(Kind::StructValue(node.metadata.to_struct())),
        },
    );
    if !node.id.is_empty() {
        data.fields.insert(
            METADATA_ID_KEY.to_owned(),
            Value {
                kind: Some(Kind::StringValue(node.id.clone())),
            },
        );
    }
    let any = encode_any(STRUCT_TYPE_URL, &encode_struct(&data));
    let mut out = Vec::with_capacity(PREFIX_LEN + any.len());
    out.extend_from_slice(&MAGIC.to_be_bytes());
    // Bounded by the node's own metadata, which is far below 4 GiB.
    out.extend_from_slice(&(any.len() as u32).to_be_bytes());
    out.extend_from_slice(&any);
    out
}

/// The whole length (prefix included) of the header `buf` starts with, when it starts
/// with the exchange's magic and announces an acceptable length: what to drop of a
/// header whose body does not parse.
pub fn announced_len(buf: &[u8]) -> Option<usize> {
    let prefix: [u8; PREFIX_LEN] = buf.get(..PREFIX_LEN)?.try_into().ok()?;
    let magic = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
    let length = u32::from_be_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
    (magic == MAGIC && length <= MAX_METADATA_LEN).then_some(PREFIX_LEN + length)
}

/// Reads the exchange header at the start of `buf`, the bytes a peer sent first.
pub fn decode(buf: &[u8]) -> Result<Decoded, ExchangeError> {
    if buf.len() < 4 {
        return Ok(Decoded::NeedMore { want: PREFIX_LEN });
    }
    let magic = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if magic != MAGIC {
        return Err(ExchangeError::BadMagic { found: magic });
    }
    if buf.len() < PREFIX_LEN {
        return Ok(Decoded::NeedMore { want: PREFIX_LEN });
    }
    let length = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if length > MAX_METADATA_LEN {
        return Err(ExchangeError::TooLarge { length });
    }
    let want = PREFIX_LEN + length;
    let Some(payload) = buf.get(PREFIX_LEN..want) else {
        return Ok(Decoded::NeedMore { want });
    };
    let any = Any::decode(payload).map_err(|err| ExchangeError::NotAny {
        reason: err.to_string(),
    })?;
    if any.type_url != STRUCT_TYPE_URL {
        return Err(ExchangeError::NotStruct {
            type_url: any.type_url,
        });
    }
    let data = Struct::decode(any.value.as_slice()).map_err(|err| ExchangeError::BadStruct {
        reason: err.to_string(),
    })?;
    let metadata = match data.fields.get(METADATA_KEY).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StructValue(s)) => Some(NodeMetadata::from_struct(s)),
        Some(_) => Some(NodeMetadata::default()),
        None => None,
    };
    let id = match data
        .fields
        .get(METADATA_ID_KEY)
        .and_then(|v| v.kind.as_ref())
    {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        Some(_) => Some(String::new()),
        None => None,
    };
    Ok(Decoded::Done {
        peer: Box::new(PeerExchange { metadata, id }),
        consumed: want,
    })
}
