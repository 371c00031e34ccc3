//! shunt's foundations: what every other part of the proxy uses. The stats store, the
//! event-loop helpers, what filters share about a connection and a stream, access logs
//! and Envoy's substitution formatter, `set_filter_state` values, Istio's peer identity
//! and its exchange formats, and Istio's standard metrics.

// Every `unsafe` says why it is sound (the event loop's vectored and deferred writes).
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod access_log;
pub mod event;
pub mod formatter;
pub mod interned;
pub mod istio_stats;
pub mod peer;
pub mod proto;
pub mod set_filter_state;
pub mod stats;
pub mod stream_info;
