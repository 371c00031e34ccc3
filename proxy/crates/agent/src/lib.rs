//! pilot-agent's jobs, as a library: the Envoy bootstrap pilot-agent would write
//! ([`bootstrap`]), the workload certificate from the mesh CA or mounted files ([`ca`]),
//! the SDS server that hands it to a proxy ([`sds`]), and the status server on
//! 15020/15021 with the kubelet's rewritten probes ([`status`]), and the xDS proxy
//! that holds istiod's connection for a supervised Envoy ([`xds_proxy`]). `shunt agent` itself
//! (start-up order, the in-process proxy or a supervised Envoy, drain) is the program's
//! business: `server/agent.rs`.

#![forbid(unsafe_code)]

pub mod bootstrap;
pub mod ca;
pub mod sds;
pub mod status;
pub mod xds_proxy;
