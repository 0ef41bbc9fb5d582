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

use ccl_core::{Repoll, Spin};

/// Polls a future without letting the runtime sleep for up to the spin
/// window after each real wake-up: while it is pending and inside the window
/// it wakes itself (yielding the core first if asked to), so the runtime
/// checks the sockets without blocking and polls again. Past the window it
/// returns `Pending` like any future and the thread sleeps.
pub(super) struct Polling<F> {
    inner: F,
    spin: Spin,
    until: Instant,
    /// The last wake-up was our own.
    self_woken: bool,
}

impl<F: Future + Unpin> Polling<F> {
    pub(super) fn new(inner: F, spin: Spin) -> Polling<F> {
        Polling {
            inner,
            spin,
            until: Instant::now(),
            self_woken: false,
        }
    }
}

impl<F: Future + Unpin> Future for Polling<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        if self.spin.window.is_zero() {
            return Pin::new(&mut self.inner).poll(cx);
        }
        if !self.self_woken {
            self.until = Instant::now() + self.spin.window;
        }
        self.self_woken = false;
        let spin = self.spin;
        if let Some(v) = repoll(&mut self.inner, spin) {
            return Poll::Ready(v);
        }
        match Pin::new(&mut self.inner).poll(cx) {
            Poll::Ready(v) => Poll::Ready(v),
            Poll::Pending => {
                if Instant::now() < self.until {
                    if self.spin.yield_between {
                        thread::yield_now();
                    }
                    self.self_woken = true;
                    cx.waker().wake_by_ref();
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
    let waker = Repoll::waker();
    let mut repoll = Context::from_waker(&waker);
    for _ in 0..REPOLLS {
        if let Poll::Ready(v) = Pin::new(&mut *inner).poll(&mut repoll) {
            return Some(v);
        }
        if spin.yield_between {
            thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    None
}

/// How often [`Polling`] polls a future again at once (links in memory only)
/// before it goes through the runtime, which checks sockets and timers.
const REPOLLS: usize = 32;
