//! The pod harness: a small "node" for integration tests.
//!
//! A [`Node`] is a bridge living in its own network namespace; every [`Pod`] is a
//! network namespace with its own cgroup (v2), joined to the bridge by a veth pair and
//! given an IPv4 and an IPv6 address. Processes are started inside a pod with
//! [`Pod::command`]. Dropping the `Node` kills every process started in its pods and
//! removes the cgroups and network namespaces; `Node::new` first sweeps what earlier,
//! dead test processes left behind (names carry the owning pid).
//!
//! Nothing is created in the caller's network namespace, and traffic stays inside the
//! namespaces the harness creates. Needs root.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! use harness::{Node, testapp_bin, wait_for_port};
//! use std::time::Duration;
//! let mut node = Node::new()?;
//! let client = node.add_pod("client")?;
//! let server = node.add_pod("server")?;
//! let _srv = server.command(testapp_bin()).args(["serve", "--listen", "0.0.0.0:8080"]).spawn()?;
//! wait_for_port(&server, "0.0.0.0:8080".parse()?, Duration::from_secs(5))?;
//! let out = client.command(testapp_bin()).arg("call").arg(format!("{}:8080", server.ipv4())).output()?;
//! assert!(out.status.success());
//! # Ok(()) }
//! ```

pub mod ads;
mod bins;
pub mod ca;
mod cgroup;
mod limits;
mod netns;
mod node;
mod pod;
mod ports;
mod process;
mod report;

pub use bins::{shunt_bin, testapp_bin, try_shunt_bin, try_testapp_bin};
pub use cgroup::cgroup2_mount;
pub use limits::raise_open_files_limit;
pub use netns::run_in_netns;
pub use node::Node;
pub use pod::Pod;
pub use ports::{tcp_listeners, wait_for_port};
pub use process::{PodCommand, PodProcess};
pub use report::{Call, access_log, access_log_entry};
