//! How the thread that drives a communicator's runtime polls: for a while
//! without letting the runtime sleep, since on small messages sleeping in
//! the kernel and being woken costs more than the message itself.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    thread,
    time::Instant,
};

use ccl_core::{take_yield, Repoll, Spin, SpinWindow};

/// Polls a future without letting the runtime sleep for up to the spin
/// window after each real wake-up: while it is pending and inside the window
/// it wakes itself (yielding the core first if asked to), so the runtime
/// checks the sockets without blocking and polls again. Past the window it
/// returns `Pending` like any future and the thread sleeps.
///
/// The window adapts as the communicator's [`SpinWindow`] says: a sleep that
/// ended soon (the peer came shortly after this thread gave up) widens it, a
/// call that finished without sleeping narrows it back a little. A wake the
/// future gave itself ([`ccl_core::yield_once`]: a long copy between its
/// pieces) is work, not a wait: it neither counts as a sleep nor uses the
/// window up, which starts again after it. With ranks
/// that share CPUs, a fixed 50 µs window let the ranks of a 4-rank
/// reduce-scatter over TCP fall into sleeping and waking each other on every
/// call (waking a sleeping rank takes about 60 µs on a small VM).
pub(super) struct Polling<'w, F> {
    inner: F,
    spin: Spin,
    window: &'w SpinWindow,
    until: Instant,
    /// The last wake-up was our own.
    self_woken: bool,
    /// When the last poll let the thread sleep, until the poll after it.
    asleep: Option<Instant>,
    /// Some poll let the thread sleep.
    slept: bool,
}

impl<'w, F: Future + Unpin> Polling<'w, F> {
    pub(super) fn new(inner: F, spin: Spin, window: &'w SpinWindow) -> Polling<'w, F> {
        Polling {
            inner,
            spin,
            window,
            until: Instant::now(),
            self_woken: false,
            asleep: None,
            slept: false,
        }
    }

    /// The future finished: a wait that ended without sleeping narrows the window.
    fn done(&self, v: F::Output) -> Poll<F::Output> {
        if !self.slept {
            self.window.caught();
        }
        Poll::Ready(v)
    }
}

impl<F: Future + Unpin> Future for Polling<'_, F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        if self.spin.window.is_zero() {
            return Pin::new(&mut self.inner).poll(cx);
        }
        if !self.self_woken {
            let now = Instant::now();
            if let Some(asleep) = self.asleep.take() {
                self.window.slept(now - asleep);
            }
            self.until = now + self.window.get();
        }
        self.self_woken = false;
        let spin = self.spin;
        if let Some(v) = repoll(&mut self.inner, spin) {
            return self.done(v);
        }
        take_yield();
        match Pin::new(&mut self.inner).poll(cx) {
            Poll::Ready(v) => self.done(v),
            Poll::Pending => {
                // A future that yielded woke the task itself: it was working,
                // not waiting, so the window starts again at the next poll.
                let yielded = take_yield();
                let now = Instant::now();
                if yielded || now < self.until {
                    if self.spin.yield_between {
                        thread::yield_now();
                    }
                    if !yielded {
                        self.self_woken = true;
                        cx.waker().wake_by_ref();
                    }
                } else {
                    self.asleep = Some(now);
                    self.slept = true;
                }
                Poll::Pending
            }
        }
    }
}

/// Repolls `inner` ([`Repoll`]) up to [`REPOLLS`] times when `spin` allows
/// repolls: links in memory need no runtime to make progress, so a small call
/// often finishes here, before the trip through the runtime. `None`: still
/// pending; poll it with a real waker before the thread may sleep.
///
/// [`Polling`] starts each poll with this; a caller that runs a call inline
/// starts with it too, outside `block_on` (skipping its entry and exit),
/// having entered the runtime's context for the timers and tasks a poll may
/// create.
pub(super) fn repoll<F: Future + Unpin>(inner: &mut F, spin: Spin) -> Option<F::Output> {
    if !spin.repoll || spin.window.is_zero() {
        return None;
    }
    poll_without_runtime(inner, spin, REPOLLS)
}

/// Polls `inner` once, as a repoll ([`Repoll`]), whatever `spin` says: a
/// call whose data is at hand (a send a socket takes at once, a message
/// already received) finishes without a trip through the runtime, whose
/// entry and exit cost more than such a call. A caller that runs a call
/// inline starts with this when repolls are off.
pub(super) fn try_once<F: Future + Unpin>(inner: &mut F, spin: Spin) -> Option<F::Output> {
    poll_without_runtime(inner, spin, 1)
}

fn poll_without_runtime<F: Future + Unpin>(
    inner: &mut F,
    spin: Spin,
    polls: usize,
) -> Option<F::Output> {
    let waker = Repoll::waker();
    let mut repoll = Context::from_waker(&waker);
    for i in 0..polls {
        if i > 0 {
            if spin.yield_between {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if let Poll::Ready(v) = Pin::new(&mut *inner).poll(&mut repoll) {
            return Some(v);
        }
    }
    None
}

/// How often [`Polling`] polls a future again at once (links in memory only)
/// before it goes through the runtime, which checks sockets and timers.
const REPOLLS: usize = 32;

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::oneshot;

    use super::*;

    const WINDOW: Duration = Duration::from_millis(20);

    /// Polls a receiver whose value a thread sends after `after`, through
    /// [`Polling`] with `window`, on a current-thread runtime.
    fn wait_for_a_peer(window: &SpinWindow, after: Duration) {
        let (tx, rx) = oneshot::channel::<()>();
        let peer = thread::spawn(move || {
            thread::sleep(after);
            let _ = tx.send(());
        });
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let spin = Spin {
            window: WINDOW,
            yield_between: true,
            repoll: false,
        };
        rt.block_on(Polling::new(rx, spin, window))
            .expect("the peer sends");
        peer.join().expect("peer thread");
    }

    #[test]
    fn a_sleep_that_ends_soon_widens_the_window_and_a_wait_in_it_narrows_it() {
        let window = SpinWindow::new(WINDOW);
        // Polls 20 ms, then sleeps about 40 ms: less than 8 windows, so soon.
        wait_for_a_peer(&window, 3 * WINDOW);
        assert_eq!(window.get(), 2 * WINDOW);
        // Within the (wider) window: polled to the end, no sleep.
        wait_for_a_peer(&window, WINDOW / 10);
        assert!(window.get() < 2 * WINDOW, "{:?}", window.get());
        assert!(window.get() > WINDOW, "{:?}", window.get());
    }

    #[test]
    fn work_that_yields_past_the_window_neither_widens_it_nor_sleeps() {
        let window = SpinWindow::new(WINDOW);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let spin = Spin {
            window: WINDOW,
            yield_between: false,
            repoll: false,
        };
        // Three windows of work in pieces, as a long copy runs, then a peer
        // that comes within the window.
        let work = Box::pin(async {
            let start = Instant::now();
            let mut pieces = 0;
            while start.elapsed() < 3 * WINDOW {
                ccl_core::yield_once().await;
                pieces += 1;
            }
            let (tx, rx) = oneshot::channel::<()>();
            let peer = thread::spawn(move || {
                thread::sleep(WINDOW / 10);
                let _ = tx.send(());
            });
            rx.await.expect("the peer sends");
            peer.join().expect("peer thread");
            pieces
        });
        let pieces = rt.block_on(Polling::new(work, spin, &window));
        assert!(pieces > 1, "{pieces}");
        assert_eq!(window.get(), WINDOW);
    }

    #[test]
    fn a_long_sleep_puts_the_window_back() {
        let window = SpinWindow::new(WINDOW);
        wait_for_a_peer(&window, 3 * WINDOW);
        assert_eq!(window.get(), 2 * WINDOW);
        // Polls 40 ms, then sleeps about 460 ms: more than 8 windows of 40 ms.
        wait_for_a_peer(&window, 25 * WINDOW);
        assert_eq!(window.get(), WINDOW);
    }
}
