//! The protobuf descriptor pool behind every proto3 JSON conversion: Envoy's v3 API as
//! envoy-types compiled it, plus the few types real configs carry that envoy-types lacks.
//!
//! Why a pool at all: the Rust types from envoy-types carry no reflection, and an `Any` in
//! JSON names its payload by `@type`, so reading or writing one needs a lookup from type
//! name to schema. `prost-reflect` does that with this pool.
//!
//! Where the descriptors come from:
//! - envoy-types builds `src/generated/types.bin` (a `FileDescriptorSet`) but does not
//!   export it, and shunt has no build step that could find it in the dependency's
//!   source. `descriptors/envoy-types.desc` is that file with the source code info (the
//!   comments, 80% of its size) removed; a test checks it against the envoy-types in
//!   Cargo.lock and rewrites it with `SHUNT_UPDATE_DESCRIPTORS=1`.
//! - `protos/` holds shunt's own minimal declarations (field names and numbers are the
//!   wire contract) of the types found missing by loading the corpus: `TypedStruct`
//!   (udpa and xds), xds `IPMatcher`, the configs of Istio's own filters that istiod
//!   sends, and Istio's DNS `NameTable` (`istio/nds.proto`, Istio's file as the shared
//!   corpus has it), which `/config_dump` shows, and workload discovery's
//!   `istio.workload.Workload` and bootstrap extension (`istio/workload.proto`).
//!   They are parsed at start-up with `protox-parse` (pure Rust, no protoc, no
//!   build step) and linked by prost-reflect against the envoy-types files they import.
//!   To add a type: add a `.proto` under `protos/` and list it in [`EXTRA_PROTOS`].

use std::sync::Mutex;
use std::time::{Duration, Instant};

use prost_reflect::DescriptorPool;

/// envoy-types' descriptor set without source code info; see the module doc.
static ENVOY_TYPES_DESCRIPTORS: &[u8] = include_bytes!("descriptors/envoy-types.desc");

/// Declarations of types real configs use that envoy-types lacks, by file name. Types
/// from cncf/xds keep their upstream file name, so an envoy-types that starts shipping
/// them simply wins (see [`build`]).
const EXTRA_PROTOS: &[(&str, &str)] = &[
    (
        "udpa/type/v1/typed_struct.proto",
        include_str!("protos/udpa/type/v1/typed_struct.proto"),
    ),
    (
        "xds/type/v3/typed_struct.proto",
        include_str!("protos/xds/type/v3/typed_struct.proto"),
    ),
    (
        "xds/type/matcher/v3/ip.proto",
        include_str!("protos/xds/type/matcher/v3/ip.proto"),
    ),
    (
        "shunt/istio/metadata_exchange.proto",
        include_str!("protos/istio/metadata_exchange.proto"),
    ),
    (
        "shunt/istio/stats.proto",
        include_str!("protos/istio/stats.proto"),
    ),
    (
        "shunt/istio/peer_metadata.proto",
        include_str!("protos/istio/peer_metadata.proto"),
    ),
    (
        "shunt/istio/alpn.proto",
        include_str!("protos/istio/alpn.proto"),
    ),
    (
        "shunt/istio/authn.proto",
        include_str!("protos/istio/authn.proto"),
    ),
    (
        "shunt/istio/connect.proto",
        include_str!("protos/istio/connect.proto"),
    ),
    (
        "shunt/istio/connect_baggage.proto",
        include_str!("protos/istio/connect_baggage.proto"),
    ),
    // Istio's workload discovery: its bootstrap extension and the `Workload` resource.
    (
        "shunt/istio/workload.proto",
        include_str!("protos/istio/workload.proto"),
    ),
    // Istio's DNS name table, for `/config_dump`.
    (
        "shunt/istio/nds.proto",
        include_str!("protos/istio/nds.proto"),
    ),
];

/// The embedded descriptors did not build a pool: a defect of this build, not of input.
#[derive(Debug, Clone, thiserror::Error)]
#[error("building the protobuf descriptor pool: {0}")]
pub struct PoolError(String);

impl PoolError {
    pub(super) fn missing(name: &str) -> Self {
        PoolError(format!("{name} is not in the pool"))
    }
}

/// The pool, kept between uses until [`release_if_idle`] drops it.
struct Cached {
    pool: DescriptorPool,
    last_used: Instant,
}

static CACHE: Mutex<Option<Cached>> = Mutex::new(None);

/// The process-wide pool, built on first use. A `DescriptorPool` is a shared handle:
/// cloning it is cheap, and its memory goes once the cache and every clone are dropped.
pub fn pool() -> Result<DescriptorPool, PoolError> {
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(cached) = cache.as_mut() {
        cached.last_used = Instant::now();
        return Ok(cached.pool.clone());
    }
    let pool = build()?;
    *cache = Some(Cached {
        pool: pool.clone(),
        last_used: Instant::now(),
    });
    Ok(pool)
}

/// Drops the cached pool if nothing asked for it for `idle`, and hands the freed heap
/// back to the kernel. Why: Envoy's whole API as descriptors is about 15 MiB of heap, which
/// a serving proxy only needs to read JSON (at start) and write it (`/config_dump`);
/// the next use builds it again, in tens of milliseconds. Returns whether it dropped it.
pub fn release_if_idle(idle: Duration) -> bool {
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let stale = cache
        .as_ref()
        .is_some_and(|cached| cached.last_used.elapsed() >= idle);
    if stale {
        *cache = None;
        drop(cache);
        trim_heap();
    }
    stale
}

/// Returns free heap pages to the kernel (glibc keeps them otherwise).
fn trim_heap() {
    shunt_memory::trim_heap();
}

fn build() -> Result<DescriptorPool, PoolError> {
    let mut pool = DescriptorPool::decode(ENVOY_TYPES_DESCRIPTORS)
        .map_err(|err| PoolError(format!("envoy-types descriptors: {err}")))?;
    for (name, source) in EXTRA_PROTOS {
        let file =
            protox_parse::parse(name, source).map_err(|err| PoolError(format!("{name}: {err}")))?;
        let package = file.package().to_owned();
        let already_there = file.message_type.iter().any(|message| {
            let full_name = format!("{package}.{}", message.name());
            pool.get_message_by_name(&full_name).is_some()
        });
        if already_there {
            continue;
        }
        pool.add_file_descriptor_proto(file)
            .map_err(|err| PoolError(format!("{name}: {err}")))?;
    }
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_knows_envoy_types_and_the_added_types() {
        let pool = pool().expect("pool builds");
        for name in [
            "envoy.config.bootstrap.v3.Bootstrap",
            "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "udpa.type.v1.TypedStruct",
            "xds.type.v3.TypedStruct",
            "xds.type.matcher.v3.IPMatcher",
            "envoy.tcp.metadataexchange.config.MetadataExchange",
            "stats.PluginConfig",
            "io.istio.http.peer_metadata.Config",
            "istio.envoy.config.filter.http.alpn.v2alpha1.FilterConfig",
            "io.istio.http.connect_authority.Config",
            "io.istio.http.connect_baggage.Config",
            "istio.workload.Workload",
            "istio.workload.BootstrapExtension",
        ] {
            assert!(pool.get_message_by_name(name).is_some(), "{name} missing");
        }
        let ip = pool
            .get_message_by_name("xds.type.matcher.v3.IPMatcher.IPRangeMatcher")
            .unwrap();
        let on_match = ip.get_field_by_name("on_match").unwrap();
        assert_eq!(
            on_match.kind().as_message().unwrap().full_name(),
            "xds.type.matcher.v3.Matcher.OnMatch",
            "imports link to envoy-types' own xds files"
        );
    }

    /// The copy in `descriptors/` must be exactly envoy-types' set minus source code info,
    /// for the envoy-types version in Cargo.lock. After upgrading envoy-types, run
    /// `SHUNT_UPDATE_DESCRIPTORS=1 cargo test -p shunt vendored_descriptors` to refresh it.
    #[test]
    fn vendored_descriptors_match_envoy_types() {
        let original = std::fs::read(envoy_types_descriptor_path()).expect("read types.bin");
        let stripped = strip_source_code_info(&original);
        if stripped.as_slice() == ENVOY_TYPES_DESCRIPTORS {
            return;
        }
        if std::env::var_os("SHUNT_UPDATE_DESCRIPTORS").is_some() {
            let dest = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/src/descriptors/envoy-types.desc"
            );
            std::fs::write(dest, &stripped).expect("write descriptors");
            panic!("rewrote {dest}; rebuild and run the tests again");
        }
        panic!(
            "src/config/descriptors/envoy-types.desc is not envoy-types' types.bin: run \
             SHUNT_UPDATE_DESCRIPTORS=1 cargo test -p shunt vendored_descriptors"
        );
    }

    /// Finds envoy-types' sources through `cargo metadata`, so the check follows Cargo.lock.
    /// Filtered to the host platform, so that it needs no crate that was never downloaded.
    fn envoy_types_descriptor_path() -> std::path::PathBuf {
        let run = |program: String, args: &[&str]| {
            let output = std::process::Command::new(&program)
                .args(args)
                .output()
                .unwrap_or_else(|err| panic!("running {program}: {err}"));
            assert!(
                output.status.success(),
                "{program} {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            String::from_utf8(output.stdout).expect("UTF-8 output")
        };
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
        let version = run(rustc, &["-vV"]);
        let host = version
            .lines()
            .find_map(|line| line.strip_prefix("host: "))
            .expect("rustc -vV names the host");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
        let metadata = run(
            cargo,
            &[
                "metadata",
                "--format-version=1",
                "--offline",
                "--filter-platform",
                host,
                "--manifest-path",
                manifest,
            ],
        );
        let metadata: serde_json::Value =
            serde_json::from_str(&metadata).expect("cargo metadata JSON");
        let manifest = metadata["packages"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|package| package["name"] == "envoy-types")
            .and_then(|package| package["manifest_path"].as_str())
            .expect("envoy-types in cargo metadata");
        std::path::Path::new(manifest)
            .parent()
            .unwrap()
            .join("src/generated/types.bin")
    }

    /// Drops field 9 (`source_code_info`) of every `FileDescriptorProto` in a
    /// `FileDescriptorSet`, copying everything else byte for byte so that custom options
    /// (validation rules, annotations) survive, which a decode through prost-types would
    /// not keep.
    fn strip_source_code_info(set: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(set.len());
        for field in wire_fields(set) {
            assert_eq!(
                (field.number, field.body.is_some()),
                (1, true),
                "a set holds files"
            );
            let file: Vec<u8> = wire_fields(field.body.unwrap())
                .filter(|inner| inner.number != 9)
                .flat_map(|inner| inner.raw.iter().copied())
                .collect();
            put_varint(&mut out, (1 << 3) | 2);
            put_varint(&mut out, file.len() as u64);
            out.extend_from_slice(&file);
        }
        out
    }

    struct WireField<'a> {
        number: u64,
        /// The whole field, key included.
        raw: &'a [u8],
        /// The payload of a length-delimited field.
        body: Option<&'a [u8]>,
    }

    fn wire_fields(mut bytes: &[u8]) -> impl Iterator<Item = WireField<'_>> {
        std::iter::from_fn(move || {
            if bytes.is_empty() {
                return None;
            }
            let start = bytes;
            let key = take_varint(&mut bytes);
            let body = match key & 7 {
                0 => {
                    take_varint(&mut bytes);
                    None
                }
                1 => {
                    bytes = &bytes[8..];
                    None
                }
                2 => {
                    let len = take_varint(&mut bytes) as usize;
                    let (body, rest) = bytes.split_at(len);
                    bytes = rest;
                    Some(body)
                }
                5 => {
                    bytes = &bytes[4..];
                    None
                }
                other => panic!("wire type {other} in a descriptor"),
            };
            let raw = &start[..start.len() - bytes.len()];
            Some(WireField {
                number: key >> 3,
                raw,
                body,
            })
        })
    }

    fn take_varint(bytes: &mut &[u8]) -> u64 {
        let mut value = 0;
        for shift in (0..64).step_by(7) {
            let byte = bytes[0];
            *bytes = &bytes[1..];
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                break;
            }
        }
        value
    }

    fn put_varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }
}
