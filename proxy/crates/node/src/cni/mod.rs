//! The `shunt-cni` plugin (the `shunt` binary run under that name) and its installation
//! on a node.

pub mod install;
pub mod plugin;
