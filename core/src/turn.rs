//! A future that gives the rest of its task a turn, and tells its poller so.
//!
//! A long piece of work inside a call (a host copy of many megabytes) may
//! stop between its parts so that the call's other lanes, and through the
//! runtime its sockets, get to run: [`yield_once`] returns `Pending` once,
//! having woken its task. The thread that drives the call counts how long
//! it has waited for peers to decide when to sleep ([`crate::SpinWindow`]);
//! a wake the task gave itself is progress, not a wait, and [`take_yield`]
//! lets that thread tell the two apart.

use std::{cell::Cell, future::poll_fn, task::Poll};

thread_local! {
    /// A future polled on this thread yielded through [`yield_once`] since
    /// [`take_yield`] last looked.
    static YIELDED: Cell<bool> = const { Cell::new(false) };
}

/// Returns `Pending` once, having woken its task and marked this thread's
/// poll as a yield ([`take_yield`]), then `Ready`.
///
/// Not `tokio::task::yield_now`, which would take tokio's `rt` feature into
/// the crates below the runtime and defers its wake-up to a runtime context,
/// which a call driven without the runtime's loop (repolls,
/// [`crate::Repoll`]) does not pass through.
pub async fn yield_once() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        YIELDED.with(|y| y.set(true));
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

/// Whether a future polled on this thread yielded through [`yield_once`]
/// since the last call; clears the mark. A poller takes it before a poll
/// (dropping marks left by polls that were not its own) and after it: a
/// `Pending` with the mark set means the task woke itself to go on working.
pub fn take_yield() -> bool {
    YIELDED.with(|y| y.replace(false))
}

#[cfg(test)]
mod tests {
    use std::{
        future::Future,
        pin::pin,
        sync::{
            atomic::{AtomicUsize, Ordering},
            Arc,
        },
        task::{Context, Wake, Waker},
    };

    use super::*;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_yield_wakes_its_task_once_and_marks_the_thread() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut fut = pin!(yield_once());
        assert!(!take_yield());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(count.0.load(Ordering::Relaxed), 1);
        assert!(take_yield());
        assert!(!take_yield(), "taking the mark clears it");
        assert!(fut.as_mut().poll(&mut cx).is_ready());
        assert_eq!(count.0.load(Ordering::Relaxed), 1);
        assert!(!take_yield(), "finishing is not a yield");
    }

    #[test]
    fn the_mark_belongs_to_the_thread_that_polled() {
        let mut fut = pin!(yield_once());
        assert!(fut
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending());
        let elsewhere = std::thread::spawn(take_yield).join().expect("thread");
        assert!(!elsewhere);
        assert!(take_yield());
    }
}
