//! Polls that promise another poll at once.
//!
//! A thread that drives futures whose progress needs no runtime (links that
//! live in memory) may poll them again at once, a few times, before it lets
//! the runtime check sockets and timers or sleep. Those polls carry
//! [`Repoll::waker`], a waker that wakes nobody, since the poller comes back
//! anyway. A future polled with it ([`Repoll::is`]) may return `Pending`
//! without arranging a wake-up, which saves the system calls of a self-wake
//! on every poll. The poller must poll once more with its real waker before
//! it lets the task sleep, so that every waiter registers a wake-up.

use std::{
    ptr,
    task::{Context, RawWaker, RawWakerVTable, Waker},
};

/// The repoll signal, carried by the waker of a poll (see the module docs).
pub struct Repoll;

static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, ignore, ignore, ignore);

fn clone(_: *const ()) -> RawWaker {
    RawWaker::new(ptr::null(), &VTABLE)
}

fn ignore(_: *const ()) {}

impl Repoll {
    /// The waker of a repoll: waking it does nothing.
    pub fn waker() -> Waker {
        // SAFETY: every function of the table ignores the (null) data pointer.
        unsafe { Waker::from_raw(clone(ptr::null())) }
    }

    /// Whether this poll is a repoll: the poller will poll again at once.
    pub fn is(cx: &Context<'_>) -> bool {
        ptr::eq(cx.waker().vtable(), &VTABLE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_repoll_waker_says_repoll() {
        let waker = Repoll::waker();
        assert!(Repoll::is(&Context::from_waker(&waker)));
        assert!(Repoll::is(&Context::from_waker(&waker.clone())));
        assert!(!Repoll::is(&Context::from_waker(Waker::noop())));
        waker.wake_by_ref();
        waker.wake();
    }
}
