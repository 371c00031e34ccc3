//! The node agent's life once it has the node: serving, offering the node to a
//! successor for the whole of its run, handing it over (the upgrade), stopping.
//!
//! An upgrade, in order: the new process finds the lock held and asks the owner for
//! the node; the owner stops taking CNI requests (they queue in the socket's backlog)
//! and sends its lock, the CNI socket and every pod's sockets; the new process serves
//! them all (accepting beside the old one for a moment, on the same sockets, so no
//! connect is refused) and says so; the owner then stops accepting, drains and exits,
//! leaving the CNI socket and the pins to its successor. If the successor fails at any
//! point the owner takes its CNI requests again and carries on.

use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use super::{EnrollArgs, Enrollers, start_enrollers};
use shunt_node::owner::{self, Owner};
use shunt_node::serve::NodePods;
use shunt_node::serve::handover::{self, Handed, NodeFds, Offer};

/// How this process came to the node.
pub enum Start {
    /// Nobody owned it.
    Fresh(Owner),
    /// Taken from its owner, not served yet.
    TakeOver(Handed),
}

/// Why serving ended.
enum Ended {
    Signal(&'static str),
    /// To the successor on this connection, which now waits for the flows.
    HandedOver(usize, socket2::Socket),
}

/// Serves the node until a signal stops it or a successor takes it over.
pub fn run(
    start: Start,
    pods: Arc<NodePods>,
    args: &EnrollArgs,
    ready_file: Option<&Path>,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<()> {
    let (owner, cni) = match start {
        Start::Fresh(owner) => (owner, None),
        Start::TakeOver(mut handed) => {
            let lock = handed
                .lock
                .take()
                .context("the old process did not hand its lock over")?;
            let cni = handed.cni.take().map(UnixListener::from);
            let (taken, flows) = handed
                .adopt_into(&pods)
                .context("serving the handed pods")?;
            tracing::info!(pods = taken, "took the node over");
            let resuming = pods.clone();
            std::thread::Builder::new()
                .name("node-flows".into())
                .spawn(move || flows.resume_into(&resuming))
                .context("starting the thread that resumes handed flows")?;
            (Owner::adopt(lock)?, cni)
        }
    };
    let mut enrollers = start_enrollers(args, pods.clone(), cni)?;
    tracing::info!(
        "shunt node: enrolling on {}{}",
        args.cni_socket.display(),
        args.zds_socket
            .as_ref()
            .map(|z| format!(" and istio-cni's {}", z.display()))
            .unwrap_or_default()
    );
    let offer = Offer::open(&owner::handover_path(&args.state_dir))?;
    let successors = offer_for_life(offer)?;
    if let Some(path) = ready_file {
        std::fs::write(path, format!("{}\n", std::process::id()))
            .with_context(|| format!("writing the ready file {}", path.display()))?;
    }
    let ended = runtime.block_on(serve(&pods, &owner, &mut enrollers, successors))?;
    if let Some(path) = ready_file {
        let _ = std::fs::remove_file(path);
    }
    match ended {
        Ended::Signal(name) => {
            tracing::info!("{name}: stopping; pods stay recorded, captured per their policy");
            drop(enrollers);
        }
        Ended::HandedOver(n, conn) => {
            tracing::info!(pods = n, "handed the node over: draining and exiting");
            enrollers.cni.release();
            drop(enrollers);
            match handover::let_go(&pods, &conn) {
                Ok(flows) => tracing::info!(flows, "handed the established flows over"),
                Err(err) => tracing::warn!("handing the established flows over: {err:#}"),
            }
        }
    }
    Ok(())
}

/// Accepts successors for as long as the process runs, one at a time, on a thread of
/// its own (accepting blocks).
fn offer_for_life(offer: Offer) -> anyhow::Result<tokio::sync::mpsc::Receiver<socket2::Socket>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    std::thread::Builder::new()
        .name("node-handover".into())
        .spawn(move || {
            while let Ok(conn) = offer.accept() {
                if tx.blocking_send(conn).is_err() {
                    return;
                }
            }
        })
        .context("starting the hand-over thread")?;
    Ok(rx)
}

async fn serve(
    pods: &Arc<NodePods>,
    owner: &Owner,
    enrollers: &mut Enrollers,
    mut successors: tokio::sync::mpsc::Receiver<socket2::Socket>,
) -> anyhow::Result<Ended> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    loop {
        tokio::select! {
            _ = term.recv() => return Ok(Ended::Signal("SIGTERM")),
            _ = int.recv() => return Ok(Ended::Signal("SIGINT")),
            Some(conn) = successors.recv() => {
                match hand_over(pods, owner, enrollers, conn).await {
                    Ok((n, conn)) => return Ok(Ended::HandedOver(n, conn)),
                    Err(err) => {
                        tracing::warn!("a successor's take-over failed; carrying on: {err:#}");
                        enrollers.cni.resume().context("taking CNI requests again")?;
                    }
                }
            }
        }
    }
}

/// Hands the node to the successor on `conn` (blocking, off the runtime's workers).
async fn hand_over(
    pods: &Arc<NodePods>,
    owner: &Owner,
    enrollers: &mut Enrollers,
    conn: socket2::Socket,
) -> anyhow::Result<(usize, socket2::Socket)> {
    tracing::info!("a successor asks for the node");
    // Requests queue in the socket's backlog until the successor accepts them.
    enrollers.cni.pause();
    let lock = owner.as_fd().try_clone_to_owned()?;
    let cni = enrollers.cni.listener().as_fd().try_clone_to_owned()?;
    let pods = pods.clone();
    tokio::task::spawn_blocking(move || {
        // The successor has a while to serve what it took.
        conn.set_read_timeout(Some(HANDOVER_TIMEOUT))?;
        let node = NodeFds {
            lock: Some(lock.as_fd()),
            cni: Some(cni.as_fd()),
        };
        let n = handover::hand_over(&conn, node, &pods)?;
        Ok((n, conn))
    })
    .await
    .context("the hand-over's thread")?
}

/// How long a successor has to start serving what it was handed.
const HANDOVER_TIMEOUT: Duration = Duration::from_secs(60);
