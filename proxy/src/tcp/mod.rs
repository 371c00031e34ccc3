//! TCP proxying (`tcp_proxy`).
