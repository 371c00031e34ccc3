//! What a listener's filter chain runs: network filters and `tcp_proxy` (`tcp`), and
//! the HTTP connection manager with its HTTP filters and router (`http`).

#![forbid(unsafe_code)]

pub mod http;
pub mod network;
pub mod tcp;
