//! shunt: an eBPF-accelerated transparent proxy for service meshes: the program
//! (`server`: `shunt proxy`, `shunt agent`, `shunt node`) over the proxy's crates, which
//! it re-exports under their module names. The crates and their layers are in
//! `docs/ARCHITECTURE.md` ("Crates and layers"). The kernel side (eBPF capture, the
//! iptables fallback, `shunt inspect`) is the `shunt-capture` crate.

// Every `unsafe` says why it is sound.
#![deny(clippy::undocumented_unsafe_blocks)]

pub use shunt_admin as admin;
pub use shunt_agent as agent;
pub use shunt_config as config;
pub use shunt_core::{
    access_log, event, formatter, istio_stats, peer, set_filter_state, stats, stream_info,
};
pub use shunt_dns as dns;
pub use shunt_filters::{self as filters, http, network, tcp};
pub use shunt_listener as listener;
pub use shunt_memory as memory;
pub use shunt_node as node;
pub use shunt_tls as tls;
pub use shunt_upstream as upstream;
pub use shunt_xds as xds;
pub use shunt_xds::snapshot;

pub mod server;
