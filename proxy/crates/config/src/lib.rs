//! Configuration: Envoy v3 bootstraps in, checked Envoy types out.
//!
//! A bootstrap (`-c FILE`, `--config-yaml`) is read as proto3 JSON or YAML into
//! envoy-types' `Bootstrap` ([`load`]), through a descriptor pool ([`pool`]) so that
//! `Any` fields resolve by `@type`, with every error naming the file and the JSON path
//! ([`json`]). Validation ([`validate`]) then reports what shunt cannot serve as written,
//! notably extensions it does not implement ([`extensions`]: the walk; what is
//! implemented is handed in by the crates that implement it).
//!
//! [`shunt_xds::snapshot::compile`] then builds the immutable snapshot a proxy serves from
//! these types; `--mode validate` runs it too, so the report names everything shunt
//! cannot serve, and the xDS sources are checked as the client would open them.

#![forbid(unsafe_code)]

pub mod convert;
mod diagnostic;
pub mod extensions;
pub mod health_ports;
mod json;
pub mod load;
mod pool;
pub mod references;
mod resources;
pub mod typed_struct;
mod validate;

use envoy_types::pb::envoy::config::bootstrap::v3::Bootstrap;

pub use diagnostic::{
    CompileError, Diagnostic, Diagnostics, JsonPath, Parts, Reported, Severity, compile_each,
};
pub use json::any_to_json;
pub use load::{Loaded, Options};
pub use resources::{
    Resources, Tracked, UpdateFailure, address_text, endpoints_of, http_connection_managers,
    socket_addr,
};
pub use validate::{Report, Summary};

/// What `shunt proxy` does with a bootstrap (Envoy's `--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Mode {
    /// Run the proxy.
    #[default]
    Serve,
    /// Load and check the bootstrap, print a summary, and exit: 0 if it is valid.
    Validate,
}

/// The bootstrap as proto3 JSON with `@type` in every `Any` and proto field names, the
/// form of Envoy's `/config_dump`.
#[cfg_attr(
    not(test),
    allow(
        dead_code,
        reason = "used by tests; the admin API writes messages with message_to_json"
    )
)]
pub fn to_json(bootstrap: &Bootstrap) -> Result<serde_json::Value, json::JsonError> {
    json::to_json(bootstrap)
}

/// A config digest, to tell an unchanged resource from a changed one cheaply.
pub fn digest<M: prost::Message>(message: &M) -> u64 {
    xxhash_rust::xxh64::xxh64(&message.encode_to_vec(), 0)
}

/// Any Envoy message as proto3 JSON, written as [`to_json`] writes the bootstrap: what the
/// admin API answers (`/config_dump`, `/clusters?format=json`, `/server_info`).
pub fn message_to_json<M: prost::Message + prost::Name>(
    message: &M,
) -> Result<serde_json::Value, json::JsonError> {
    json::to_json(message)
}

/// Proto3 JSON read as message `M` through the same pool (`@type` resolved).
#[cfg_attr(not(test), allow(dead_code, reason = "tests read admin output back"))]
pub fn message_from_json<M: prost::Message + prost::Name + Default>(
    value: serde_json::Value,
) -> Result<M, json::JsonError> {
    json::from_json(value).map(|(message, _)| message)
}

/// The descriptor pool behind the JSON conversions, for reflection over Envoy's types
/// (the admin API's redaction of sensitive fields and its field masks).
pub fn descriptor_pool() -> Result<prost_reflect::DescriptorPool, pool::PoolError> {
    pool::pool()
}

/// Drops the descriptor pool once unused for `idle` (see [`pool::release_if_idle`]).
pub fn release_idle_pool(idle: std::time::Duration) -> bool {
    pool::release_if_idle(idle)
}

/// Returns glibc's free heap to the kernel once it holds `min_free` bytes (see
/// [`shunt_memory::trim_free_heap`]).
pub fn trim_free_heap(min_free: usize) -> Option<usize> {
    shunt_memory::trim_free_heap(min_free)
}

/// Asks the process's periodic trim to return what a rebuild freed (see
/// [`shunt_memory::trim_soon`]).
pub fn trim_soon() {
    shunt_memory::trim_soon()
}

/// The process's periodic trim (see [`shunt_memory::periodic_trim`]).
pub fn periodic_trim(min_free: usize) -> Option<usize> {
    shunt_memory::periodic_trim(min_free)
}

/// Loads and validates the bootstrap the options name, its extensions against what the
/// build `implemented` (`shunt_xds::snapshot::extensions::IMPLEMENTED`).
pub fn check(
    options: &Options,
    implemented: &extensions::Implemented,
) -> anyhow::Result<(Loaded, Report)> {
    let loaded = load::load(options)?;
    let report = validate::validate(
        &loaded.bootstrap,
        options,
        implemented,
        loaded.findings.clone(),
    )?;
    Ok((loaded, report))
}

#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;
