//! `ccl.Work`: a call started with `async_op=True`. It keeps the arrays of
//! the call alive until the call is done, even if Python drops the `Work`.

use std::{
    sync::Mutex,
    time::{Duration, Instant},
};

use ccl::Work as CclWork;
use pyo3::{exceptions::PyValueError, prelude::*};

use crate::{to_py, TimeoutError};

enum State {
    /// Running; `keep` holds the capsules of its arrays. `work` is out
    /// while a thread waits on it.
    Running {
        work: Option<CclWork<()>>,
        keep: Vec<Py<PyAny>>,
    },
    /// Done, with the result every `wait` reports.
    Done(ccl::Result<()>),
}

/// A collective or transfer in progress.
#[pyclass(module = "ccl._ccl", frozen)]
pub struct Work {
    state: Mutex<State>,
}

impl Work {
    pub fn new(work: CclWork<()>, keep: Vec<Py<PyAny>>) -> Work {
        Work {
            state: Mutex::new(State::Running {
                work: Some(work),
                keep,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl Work {
    /// Waits until the call is done (at most `timeout` seconds, else raises
    /// `ccl.TimeoutError` and the call goes on). Raises the call's error.
    /// The GIL is released while waiting.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let limit = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t)),
            Some(t) => {
                return Err(PyValueError::new_err(format!(
                    "timeout {t} is not a number of seconds"
                )))
            }
            None => None,
        };
        let started = Instant::now();
        loop {
            // The lock is never held while detached from the interpreter.
            let taken = match &mut *self.lock() {
                State::Done(result) => return result.clone().map_err(to_py),
                State::Running { work, .. } => work.take(),
            };
            let left = limit.map(|l| l.saturating_sub(started.elapsed()));
            let outcome = match taken {
                Some(mut work) => py.detach(|| {
                    let slice = left.unwrap_or(Duration::from_secs(3600));
                    match work.wait_timeout(slice) {
                        Some(result) => (None, Some(result)),
                        None => (Some(work), None),
                    }
                }),
                // Another thread waits on it: look again shortly.
                None => {
                    py.detach(|| std::thread::sleep(Duration::from_millis(1)));
                    (None, None)
                }
            };
            let mut st = self.lock();
            match outcome {
                (_, Some(result)) => {
                    // Done: the arrays may go.
                    *st = State::Done(result.clone());
                    return result.map_err(to_py);
                }
                (Some(work), None) => {
                    if let State::Running { work: slot, .. } = &mut *st {
                        *slot = Some(work);
                    }
                }
                (None, None) => {}
            }
            if left.is_some_and(|l| l.is_zero()) {
                return Err(TimeoutError::new_err(format!(
                    "the call is still running after {}s",
                    timeout.unwrap_or(0.0)
                )));
            }
        }
    }

    /// True once the call is done (successfully or not).
    fn is_completed(&self) -> bool {
        match &*self.lock() {
            State::Done(_) => true,
            State::Running { work, .. } => work.as_ref().is_some_and(|w| w.is_completed()),
        }
    }

    /// `await work` waits in the event loop's default executor.
    fn __await__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, PyAny>> {
        let py = slf.py();
        let coroutine = py.import("ccl._aio")?.call_method1("wait_async", (slf,))?;
        coroutine.call_method0("__await__")
    }

    fn __repr__(&self) -> String {
        let state = match &*self.lock() {
            State::Done(_) => "done",
            State::Running { .. } => "running",
        };
        format!("<ccl.Work {state}>")
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(|p| p.into_inner()),
            State::Done(Ok(())),
        );
        if let State::Running {
            work: Some(work),
            keep,
        } = state
        {
            if work.is_completed() {
                return;
            }
            // Dropped while running: the memory must outlive the call, so
            // a thread waits for it before letting the arrays go.
            std::thread::spawn(move || {
                let _ = work.wait();
                // Without the GIL: PyO3 queues the release for the next
                // thread that holds it (this thread never enters Python).
                drop(keep);
            });
        }
    }
}
