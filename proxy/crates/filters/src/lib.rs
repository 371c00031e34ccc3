//! What a listener's filter chain runs: network filters (`network`) and `tcp_proxy`
//! (`tcp`), and the HTTP connection manager with its HTTP filters and router (`http`);
//! what filters of both kinds share is in `common`; the tracers the connection manager
//! reports spans to are in `tracers`.

#![forbid(unsafe_code)]

pub mod common;
pub mod http;
pub mod network;
pub mod tcp;
pub mod tracers;
