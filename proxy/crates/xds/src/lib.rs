//! xDS: configuration from a control plane (istiod through its agent, or any Envoy v3
//! management server), as Envoy takes it.
//!
//! - [`source`] reads the bootstrap's `dynamic_resources` into streams: one ADS stream,
//!   or one per type, state of the world or Delta.
//! - [`local`] holds the xDS servers of this process (`shunt agent`'s), which a stream
//!   to their socket path calls instead of connecting.
//! - [`stream`] keeps each gRPC stream connected (TCP or Unix socket), reconnecting with
//!   jittered exponential back-off, and hands responses to the manager.
//! - [`manager`] owns the accepted resources. Each response is judged resource by
//!   resource, as Envoy does: the new resources are compiled with everything else into a
//!   snapshot; one that does not compile goes back to its last good version, the others
//!   are served; the response is ACKed, or NACKed naming what was refused, which keeps
//!   its error state in `/config_dump`. It follows Envoy's order: clusters first,
//!   an EDS cluster warms until its endpoints arrive (or `initial_fetch_timeout`), and
//!   listeners are asked for once the first clusters are in.

#![forbid(unsafe_code)]

pub mod grpc;
pub mod local;
pub mod manager;
pub mod snapshot;
pub mod source;
pub mod stream;
pub mod type_url;
pub mod wire;

pub use manager::{Manager, interned_resources};
pub use type_url::TypeUrl;
