//! Event-loop helpers (Envoy's `Event::Dispatcher` is where its timers and wake-ups
//! live).

pub mod counted;
pub mod deferred_write;
pub mod workers;
pub mod write;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

/// `future`, polled only once it asked to be: after its first poll, only when the
/// waker it was given fired. For the rare ends a connection's task waits on beside
/// its work (the drain signals): the task wakes for every byte of its work, and each
/// of those polls would otherwise poll these again, each a lock and a few hundred
/// instructions (`callgrind`), though nothing happened to them. It allocates once, so
/// it pays for waits that outlive many polls. Pin a future that is not `Unpin` first
/// (`std::pin::pin!`).
pub fn when_woken<F: Future + Unpin>(future: F) -> WhenWoken<F> {
    WhenWoken {
        future,
        signal: None,
    }
}

/// See [`when_woken`].
pub struct WhenWoken<F> {
    future: F,
    /// `None` until the first poll.
    signal: Option<Arc<Signal>>,
}

/// The waker the inner future holds: it notes that it fired and wakes the task.
struct Signal {
    fired: AtomicBool,
    task: Mutex<Waker>,
}

impl Wake for Signal {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .wake_by_ref();
    }
}

impl<F: Future + Unpin> Future for WhenWoken<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let signal = match &mut this.signal {
            Some(signal) => {
                // The task may have moved to another waker (another task polls it now).
                let mut task = signal.task.lock().unwrap_or_else(|e| e.into_inner());
                if !task.will_wake(cx.waker()) {
                    task.clone_from(cx.waker());
                    // Its own waker may have been missed meanwhile: poll once to be sure.
                    signal.fired.store(true, Ordering::Relaxed);
                }
                drop(task);
                signal
            }
            None => this.signal.insert(Arc::new(Signal {
                // The first poll always polls.
                fired: AtomicBool::new(true),
                task: Mutex::new(cx.waker().clone()),
            })),
        };
        // Cleared before the poll, so a wake during it is not lost.
        if !signal.fired.swap(false, Ordering::Acquire) {
            return Poll::Pending;
        }
        let waker = Waker::from(signal.clone());
        Pin::new(&mut this.future).poll(&mut Context::from_waker(&waker))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// A future that counts its polls and is ready once `ready` is set; each poll
    /// keeps the waker it got, to be fired by the test.
    struct Probe {
        polls: Arc<AtomicUsize>,
        ready: Arc<AtomicBool>,
        waker: Arc<Mutex<Option<Waker>>>,
    }

    impl Future for Probe {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            *self.waker.lock().unwrap() = Some(cx.waker().clone());
            if self.ready.load(Ordering::SeqCst) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }

    /// A [`Probe`] behind [`when_woken`], with its poll count, readiness and waker.
    #[allow(clippy::type_complexity)]
    fn gated_probe() -> (
        WhenWoken<Probe>,
        Arc<AtomicUsize>,
        Arc<AtomicBool>,
        Arc<Mutex<Option<Waker>>>,
    ) {
        let (polls, ready, waker): (Arc<AtomicUsize>, Arc<AtomicBool>, _) = Default::default();
        let probe = Probe {
            polls: Arc::clone(&polls),
            ready: Arc::clone(&ready),
            waker: Arc::clone(&waker),
        };
        (when_woken(probe), polls, ready, waker)
    }

    struct CountingWaker(AtomicUsize);
    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_inner_future_is_polled_first_and_then_only_after_its_waker_fired() {
        let (mut gated, polls, ready, inner_waker) = gated_probe();
        let task = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);

        assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
        assert_eq!(polls.load(Ordering::SeqCst), 1, "the first poll reaches it");
        // The task is woken for other work: the inner future is left alone.
        for _ in 0..5 {
            assert!(Pin::new(&mut gated).poll(&mut cx).is_pending());
        }
        assert_eq!(polls.load(Ordering::SeqCst), 1);

        // Its event happens: the task is woken, and the next poll reaches it.
        ready.store(true, Ordering::SeqCst);
        inner_waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(task.0.load(Ordering::SeqCst), 1, "the task was woken");
        assert!(Pin::new(&mut gated).poll(&mut cx).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_new_task_waker_polls_the_inner_future_once_and_is_the_one_woken() {
        let (mut gated, polls, _ready, inner_waker) = gated_probe();
        let first = Waker::from(Arc::new(CountingWaker(AtomicUsize::new(0))));
        assert!(
            Pin::new(&mut gated)
                .poll(&mut Context::from_waker(&first))
                .is_pending()
        );
        let second_task = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let second = Waker::from(second_task.clone());
        assert!(
            Pin::new(&mut gated)
                .poll(&mut Context::from_waker(&second))
                .is_pending()
        );
        assert_eq!(
            polls.load(Ordering::SeqCst),
            2,
            "polled again for the new waker"
        );
        inner_waker.lock().unwrap().take().unwrap().wake();
        assert_eq!(
            second_task.0.load(Ordering::SeqCst),
            1,
            "the new waker was woken"
        );
    }

    #[tokio::test]
    async fn a_wake_during_its_own_poll_is_not_lost() {
        // `yield_now` wakes its waker from inside its poll, then is ready on the next.
        let gated = when_woken(Box::pin(tokio::task::yield_now()));
        tokio::time::timeout(std::time::Duration::from_secs(5), gated)
            .await
            .expect("the self-wake led to a second poll");
    }
}
