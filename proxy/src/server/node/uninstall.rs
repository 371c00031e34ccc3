//! `shunt node uninstall`: node mode taken off a node. Only with nobody owning the
//! node's state (the agent stopped): every pin under the bpffs root goes (each pod's
//! `sk_lookup` link, the node's cgroup links, the maps: a link detaches and a map is
//! freed with its last pin), then the state records, the CNI and hand-over sockets,
//! and last the lock. `shunt node uninstall-cni` is separate.

use anyhow::Context;

use super::UninstallArgs;
use shunt_node::owner::{self, Acquired, Owner};

pub fn run(args: &UninstallArgs) -> anyhow::Result<()> {
    let state_dir = &args.enroll.state_dir;
    let owner = match Owner::acquire(state_dir)? {
        Acquired::Owner(owner) => owner,
        Acquired::Busy(by) => anyhow::bail!(
            "{by}: stop it first (uninstalling takes every pod's capture away, and it \
             still serves them)"
        ),
    };
    let pins = shunt_capture::node::uninstall_all(&args.bpffs)
        .with_context(|| format!("removing the capture pinned under {}", args.bpffs.display()))?;
    eprintln!(
        "shunt node: removed {pins} pins under {} (every pod's capture and the node's \
         programs)",
        args.bpffs.display()
    );
    let mut records = 0;
    for entry in
        std::fs::read_dir(state_dir).with_context(|| format!("reading {}", state_dir.display()))?
    {
        let path = entry?.path();
        if path == owner::lock_path(state_dir) {
            continue;
        }
        if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        }
        .with_context(|| format!("removing {}", path.display()))?;
        records += 1;
    }
    for socket in [&args.enroll.cni_socket] {
        match std::fs::remove_file(socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", socket.display()));
            }
            _ => {}
        }
    }
    eprintln!(
        "shunt node: removed {records} entries of {} and {}",
        state_dir.display(),
        args.enroll.cni_socket.display()
    );
    // The lock last: until here nobody could start on a half-removed node.
    let lock = owner::lock_path(state_dir);
    std::fs::remove_file(&lock).with_context(|| format!("removing {}", lock.display()))?;
    drop(owner);
    let _ = std::fs::remove_dir(state_dir);
    Ok(())
}
