//! The data plane's workers, as Envoy's (`WorkerImpl`): each one event loop on a thread
//! of its own (a current-thread runtime), every listener accepting on each of them, and
//! a connection served from its accept to its close on the worker that accepted it,
//! with what it hands on in process (the same-node fast path, its upstream requests).
//!
//! Why not one multi-threaded runtime: its workers share their tasks, and a task woken
//! by another (a request by its response, the two ends of an in-process pipe) is often
//! run by the other thread, which is unparked for it. At 1000 HTTP requests/s through
//! node mode that was 4.6 wake-ups and 11.5 system calls per request against 3.0 and
//! 7.1 with a single worker, and 0.18 against 0.11 vCPU per 1000 requests
//! (`cargo xtask bench mesh --wakeups`). Each worker here also holds its connections'
//! small writes to the end of its run of ready tasks ([`super::deferred_write`]).
//!
//! A process without workers (the tests' runtimes) accepts on its current runtime.

use std::cell::Cell;
use std::io;
use std::sync::OnceLock;

use tokio::runtime::{Handle, Runtime};

/// How many tasks a worker polls before it asks epoll for new events. tokio's default
/// (61) picks up I/O in the middle of a burst of ready streams, so a downstream h2
/// connection's responses leave in several sends spread over the burst, and each can
/// find the client asleep and wake it. At 256 a worker mostly runs what is ready and
/// then waits, as Envoy's (libevent) and haproxy's loops do: under `bench http`'s h2
/// load the wake-ups shunt causes fell from 0.105 to 0.065 per request (haproxy's
/// level) and its downstream sends from 0.155 to 0.13; 128 gave 0.07, 512 and 1024
/// no fewer than 256.
const EVENT_INTERVAL: u32 = 256;

/// How far ahead a worker's timer wheel always holds a deadline (see [`tick`]).
const TICK: std::time::Duration = std::time::Duration::from_secs(1);

/// The process's workers, once started.
static WORKERS: OnceLock<Vec<Handle>> = OnceLock::new();

thread_local! {
    /// Which worker this thread runs.
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// One worker's runtime: a current-thread event loop whose connections hold their small
/// writes to the end of each run (`deferred_write`). Whoever drives it with `block_on`
/// is that worker.
pub fn runtime() -> io::Result<Runtime> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .event_interval(EVENT_INTERVAL)
        .enable_all()
        .build()?;
    runtime.spawn(super::deferred_write::flusher());
    runtime.spawn(tick());
    Ok(runtime)
}

/// Keeps a deadline at most [`TICK`] away in the worker's timer wheel. tokio's timer
/// unparks its event loop (a write to its eventfd, then one more `epoll_wait`) whenever
/// a timer is set sooner than the soonest it held when the loop last parked, even from
/// the loop's own thread; with nothing sooner in the wheel, that was every stream's
/// timeouts, about 4 system calls per request through node mode. With this deadline
/// there, only timers under a second unpark it; an idle worker wakes once a second.
async fn tick() {
    loop {
        tokio::time::sleep(TICK).await;
    }
}

/// Starts the process's workers: `first`, driven by the calling thread (which then
/// runs it with `block_on`), if given, and `threads` more, each on a thread of its own
/// that runs `on_thread_start` first. Once per process.
pub fn start(first: Option<&Runtime>, threads: usize, on_thread_start: fn()) -> io::Result<()> {
    let mut handles = Vec::with_capacity(threads + 1);
    if let Some(first) = first {
        handles.push(first.handle().clone());
        CURRENT.set(Some(0));
    }
    for _ in 0..threads {
        let id = handles.len();
        let runtime = runtime()?;
        handles.push(runtime.handle().clone());
        std::thread::Builder::new()
            .name(format!("shunt-worker-{id}"))
            .spawn(move || {
                CURRENT.set(Some(id));
                on_thread_start();
                runtime.block_on(std::future::pending::<()>());
            })
            .map_err(|err| io::Error::other(format!("starting worker thread {id}: {err}")))?;
    }
    WORKERS
        .set(handles)
        .map_err(|_| io::Error::other("the workers were already started"))
}

/// The process's workers; none when it has not started any (a listener then accepts on
/// the runtime it is added on).
pub fn handles() -> &'static [Handle] {
    WORKERS.get().map_or(&[], Vec::as_slice)
}

/// The worker this thread runs, if it is one.
pub fn current() -> Option<usize> {
    CURRENT.get()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_runs_its_tasks_on_its_own_thread_and_knows_itself() {
        // The one test of this process that starts workers: they are once per process.
        let first = runtime().unwrap();
        start(Some(&first), 2, || {}).unwrap();
        assert!(start(None, 1, || {}).is_err(), "started once only");
        assert_eq!(handles().len(), 3);
        assert_eq!(current(), Some(0));
        let mut threads = Vec::new();
        for (id, handle) in handles().iter().enumerate().skip(1) {
            let (seen, thread) = first
                .block_on(handle.spawn(async { (current(), std::thread::current().id()) }))
                .unwrap();
            assert_eq!(seen, Some(id), "worker {id} knows itself");
            assert_ne!(thread, std::thread::current().id());
            threads.push(thread);
        }
        assert_ne!(
            threads[0], threads[1],
            "each worker has a thread of its own"
        );
        // A task spawned from a worker's task stays on that worker.
        let stays = first
            .block_on(handles()[2].spawn(async { tokio::spawn(async { current() }).await }))
            .unwrap()
            .unwrap();
        assert_eq!(stays, Some(2));
    }
}
