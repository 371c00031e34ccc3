//! `cargo xtask demo`: shunt shown to a person, on a node built in this machine's
//! namespaces and removed again. By default the whole mission ([`mesh`]: node mode,
//! CNI, a control plane, mTLS, routing, RBAC, DNS, metrics); `--passthrough` shows
//! capture alone with two sidecar pods ([`passthrough`]).

mod cni;
mod mesh;
mod mesh_config;
mod passthrough;

use anyhow::Result;

use crate::pods::Backend;

pub fn run(passthrough: bool, backend: Backend) -> Result<()> {
    if passthrough {
        passthrough::run(backend)
    } else {
        anyhow::ensure!(
            backend == Backend::Ebpf,
            "node mode captures with eBPF; `--backend iptables` goes with `--passthrough`"
        );
        mesh::run()
    }
}
