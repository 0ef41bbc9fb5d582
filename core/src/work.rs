//! `Work`: the handle every asynchronous call returns.
//!
//! A `Work` completes on a host thread (its [`Completer`]), and may in
//! addition wait for an [`Event`]: something that happens outside the host
//! threads, such as a CUDA event recorded on a stream after the call's
//! device work. Then it is complete once both have happened.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use crate::{Error, Result};

struct State<T> {
    result: Option<Result<T>>,
    done: bool,
    waker: Option<Waker>,
    /// Threads blocked in `wait`: only then is the condition variable
    /// signalled (a signal costs a system call even when nobody waits).
    sleepers: usize,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    cond: Condvar,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panic while holding this lock cannot leave the state torn (only
        // plain assignments happen under it), so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Something that happens outside the host threads, which a [`Work`] can
/// wait for: a CUDA event on a stream, say.
pub trait Event: Send + Sync {
    /// Whether it has happened; an error if what it stands for failed.
    fn query(&self) -> Result<bool>;

    /// Blocks until it happens (`Ok(true)`) or `timeout` passes (`Ok(false)`;
    /// `None`: no limit).
    fn synchronize(&self, timeout: Option<Duration>) -> Result<bool>;
}

/// The result of an operation that runs in the background.
///
/// Await it, or call [`Work::wait`] / [`Work::wait_timeout`] from synchronous
/// code. Dropping a `Work` does not cancel the operation.
#[must_use = "a Work does nothing unless waited on; its result carries errors"]
pub struct Work<T> {
    shared: Arc<Shared<T>>,
    /// Must have happened too before the result is handed out.
    event: Option<Arc<dyn Event>>,
    /// While awaited: the thread that waits for the event wakes this task.
    event_waiter: Option<Arc<Mutex<Option<Waker>>>>,
}

/// The producing side of a [`Work`]: completes it exactly once.
///
/// If dropped without completing, the `Work` fails with an internal error
/// rather than waiting forever.
pub struct Completer<T> {
    shared: Option<Arc<Shared<T>>>,
}

/// A new pending `Work` and the `Completer` that finishes it.
pub fn work_pair<T>() -> (Work<T>, Completer<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            result: None,
            done: false,
            waker: None,
            sleepers: 0,
        }),
        cond: Condvar::new(),
    });
    (
        Work {
            shared: shared.clone(),
            event: None,
            event_waiter: None,
        },
        Completer {
            shared: Some(shared),
        },
    )
}

impl<T> Completer<T> {
    /// Finishes the `Work` with `result` and wakes whoever waits on it.
    pub fn complete(mut self, result: Result<T>) {
        self.finish(result);
    }

    fn finish(&mut self, result: Result<T>) {
        if let Some(shared) = self.shared.take() {
            let (waker, sleepers) = {
                let mut st = shared.lock();
                st.result = Some(result);
                st.done = true;
                (st.waker.take(), st.sleepers)
            };
            if sleepers > 0 {
                shared.cond.notify_all();
            }
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        self.finish(Err(Error::Internal(
            "operation dropped before it completed".into(),
        )));
    }
}

impl<T> Work<T> {
    /// A `Work` that is already complete.
    pub fn ready(result: Result<T>) -> Work<T> {
        let (w, c) = work_pair();
        c.complete(result);
        w
    }

    /// This `Work`, completing only once `event` has happened too (and
    /// failing if the event reports a failure).
    pub fn after(mut self, event: Arc<dyn Event>) -> Work<T> {
        self.event = Some(event);
        self
    }

    /// True once the operation finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.shared.lock().done
            && self
                .event
                .as_ref()
                .is_none_or(|e| e.query().unwrap_or(true))
    }

    /// Blocks until the operation finishes and returns its result.
    ///
    /// Must not be called from inside an async runtime's worker thread; await instead.
    pub fn wait(self) -> Result<T> {
        let result = {
            let mut st = self.shared.lock();
            while !st.done {
                st.sleepers += 1;
                st = self.shared.cond.wait(st).unwrap_or_else(|p| p.into_inner());
                st.sleepers -= 1;
            }
            take(&mut st)
        };
        match &self.event {
            Some(event) => event.synchronize(None).and(result),
            None => result,
        }
    }

    /// Waits at most `timeout`. `None` means the operation is still running:
    /// the communicator is untouched and this `Work` can be waited on again.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<Result<T>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        while !st.done {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            st.sleepers += 1;
            st = self
                .shared
                .cond
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            st.sleepers -= 1;
        }
        if let Some(event) = &self.event {
            let left = deadline.saturating_duration_since(Instant::now());
            match event.synchronize(Some(left)) {
                Ok(false) => return None,
                Ok(true) => {}
                Err(e) => return Some(Err(e)),
            }
        }
        Some(take(&mut st))
    }
}

fn take<T>(st: &mut State<T>) -> Result<T> {
    st.result.take().unwrap_or_else(|| {
        Err(Error::InvalidArgument(
            "the result of this Work was already taken".into(),
        ))
    })
}

impl<T> Future for Work<T> {
    type Output = Result<T>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let mut st = self.shared.lock();
        if !st.done {
            st.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        drop(st);
        let Some(event) = self.event.clone() else {
            return Poll::Ready(take(&mut self.shared.lock()));
        };
        match event.query() {
            Err(e) => return Poll::Ready(Err(e)),
            Ok(true) => return Poll::Ready(take(&mut self.shared.lock())),
            Ok(false) => {}
        }
        // An event wakes no task: a thread waits for it and wakes this one.
        if let Some(waiter) = &self.event_waiter {
            *waiter.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let waiter = Arc::new(Mutex::new(Some(cx.waker().clone())));
        self.event_waiter = Some(waiter.clone());
        let spawned = std::thread::Builder::new()
            .name("ccl-event-wait".into())
            .spawn(move || {
                let _ = event.synchronize(None);
                if let Some(w) = waiter.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    w.wake();
                }
            });
        match spawned {
            Ok(_) => Poll::Pending,
            Err(e) => Poll::Ready(Err(Error::io("starting a thread to wait for an event", e))),
        }
    }
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work(completed: {})", self.is_completed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_from_another_thread() {
        let (w, c) = work_pair::<u32>();
        assert!(!w.is_completed());
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            c.complete(Ok(7));
        });
        assert_eq!(w.wait().unwrap(), 7);
        t.join().unwrap();
    }

    #[test]
    fn wait_timeout_keeps_the_work() {
        let (mut w, c) = work_pair::<u32>();
        assert!(w.wait_timeout(Duration::from_millis(5)).is_none());
        c.complete(Ok(1));
        assert!(w.is_completed());
        assert_eq!(w.wait_timeout(Duration::ZERO).unwrap().unwrap(), 1);
        assert!(w.wait_timeout(Duration::ZERO).unwrap().is_err());
    }

    #[test]
    fn dropped_completer_fails_the_work() {
        let (w, c) = work_pair::<()>();
        drop(c);
        assert!(matches!(w.wait(), Err(Error::Internal(_))));
    }

    /// An event set from another thread, or failed.
    struct Flag(Mutex<Option<Result<()>>>, Condvar);

    impl Flag {
        fn new() -> Arc<Flag> {
            Arc::new(Flag(Mutex::new(None), Condvar::new()))
        }
        fn set(&self, r: Result<()>) {
            *self.0.lock().unwrap() = Some(r);
            self.1.notify_all();
        }
    }

    impl Event for Flag {
        fn query(&self) -> Result<bool> {
            self.0
                .lock()
                .unwrap()
                .clone()
                .transpose()
                .map(|r| r.is_some())
        }
        fn synchronize(&self, timeout: Option<Duration>) -> Result<bool> {
            let limit = timeout.unwrap_or(Duration::from_secs(60));
            let (st, _) = self
                .1
                .wait_timeout_while(self.0.lock().unwrap(), limit, |s| s.is_none())
                .unwrap();
            st.clone().transpose().map(|r| r.is_some())
        }
    }

    #[test]
    fn a_work_after_an_event_completes_once_both_happened() {
        let flag = Flag::new();
        let (w, c) = work_pair::<u32>();
        let mut w = w.after(flag.clone());
        c.complete(Ok(5));
        assert!(!w.is_completed(), "the host part alone is not enough");
        assert!(w.wait_timeout(Duration::from_millis(5)).is_none());
        let f = flag.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            f.set(Ok(()));
        });
        assert_eq!(w.wait().unwrap(), 5);
        t.join().unwrap();

        // Awaited: a helper thread waits for the event and wakes the task.
        let flag = Flag::new();
        let w = Work::ready(Ok("x")).after(flag.clone());
        let f = flag.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            f.set(Ok(()));
        });
        assert_eq!(futures::executor::block_on(w).unwrap(), "x");
        t.join().unwrap();

        // A failed event fails the work.
        let flag = Flag::new();
        flag.set(Err(Error::Internal("stream failed".into())));
        let w = Work::ready(Ok(1)).after(flag);
        assert!(w.is_completed());
        assert!(matches!(w.wait(), Err(Error::Internal(_))));
    }

    #[test]
    fn await_works() {
        let (w, c) = work_pair::<&str>();
        let t = std::thread::spawn(move || c.complete(Ok("done")));
        assert_eq!(futures::executor::block_on(w).unwrap(), "done");
        t.join().unwrap();
        assert!(futures::executor::block_on(Work::ready(Ok(3))).is_ok());
    }
}
