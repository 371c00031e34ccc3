//! The programs' aya-log records (`ebpf/src/log.rs`: a map too full to hold a record,
//! a pod config missing, fail-open and fail-closed fallbacks) in this process's log, at
//! their levels, target `shunt::ebpf`.
//!
//! Two channels leave the kernel, each for its reader: aya-log carries the few events
//! an operator must hear about without asking, to the log of the process that owns the
//! programs (node mode's `shunt node`, or in a sidecar pod its proxy); decision events
//! (`events.rs`) carry every decision, only while someone asks (`shunt inspect
//! --follow`), because a log line per connection would cost every connection.
//!
//! A thread polls the ring; records are formatted by aya-log and handed to `tracing`.

use std::{
    os::fd::AsRawFd,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::Context;
use aya::Ebpf;
use aya_log::EbpfLogger;
use shunt_common::pins;

/// Forwards the programs' log records until dropped.
pub struct KernelLog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl KernelLog {
    /// The records of the programs `bpf` loaded (their ring is pinned by the loader).
    pub fn start(bpf: &mut Ebpf) -> anyhow::Result<KernelLog> {
        let logger = EbpfLogger::init_with_logger(bpf, TracingLog)
            .context("opening the programs' aya-log ring (AYA_LOGS)")?;
        Ok(Self::spawn(logger))
    }

    /// In a sidecar pod: the records of the programs `shunt capture` attached to this
    /// pod (found through a link pinned in its folder under `root`), if any.
    pub fn for_this_pod(root: &Path) -> anyhow::Result<Option<KernelLog>> {
        let pod = crate::netns::netns_inode().context("reading /proc/self/ns/net")?;
        let dir = crate::bpffs::pod_dir(root, pod);
        if !dir.join(pins::AYA_LOGS).exists() {
            return Ok(None);
        }
        let link = dir.join(crate::ebpf::NETNS_PROGRAM);
        let prog = crate::link::pinned_prog_id(&link)
            .with_context(|| format!("reading {}", link.display()))?;
        let logger = EbpfLogger::init_from_id_with_logger(prog, TracingLog)
            .with_context(|| format!("opening the aya-log ring of program {prog}"))?;
        Ok(Some(Self::spawn(logger)))
    }

    fn spawn(mut logger: EbpfLogger<TracingLog>) -> KernelLog {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("shunt-ebpf-log".into())
            .spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    wait_readable(logger.as_raw_fd(), Duration::from_millis(250));
                    // aya-log panics on a record it cannot parse (another build's
                    // programs): say so and go on with the next.
                    let flushed =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| logger.flush()));
                    if flushed.is_err() {
                        tracing::error!(target: "shunt::ebpf", "an aya-log record could not be read");
                    }
                }
            })
            .ok();
        KernelLog { stop, thread }
    }
}

impl Drop for KernelLog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wait_readable(fd: i32, timeout: Duration) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
}

/// aya-log's `log` records as `tracing` events at the same level.
struct TracingLog;

impl log::Log for TracingLog {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }

    fn log(&self, record: &log::Record) {
        let program = record.target();
        let message = record.args();
        match record.level() {
            log::Level::Error => tracing::error!(target: "shunt::ebpf", program, "{message}"),
            log::Level::Warn => tracing::warn!(target: "shunt::ebpf", program, "{message}"),
            log::Level::Info => tracing::info!(target: "shunt::ebpf", program, "{message}"),
            log::Level::Debug => tracing::debug!(target: "shunt::ebpf", program, "{message}"),
            log::Level::Trace => tracing::trace!(target: "shunt::ebpf", program, "{message}"),
        }
    }

    fn flush(&self) {}
}
