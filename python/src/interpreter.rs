//! Calls into Python from ccl's own threads (a Python store, letting go of
//! a call's arrays), made safe against interpreter exit: once the
//! interpreter starts exiting, a thread that tries to take the GIL is ended
//! by CPython with `pthread_exit`, whose unwinding aborts the process when
//! it meets a frame that cannot unwind (C++ `noexcept`, Rust `extern "C"`).
//! So an `atexit` hook (`ccl._ccl._at_exit`, registered by the package)
//! closes the door first and waits for the threads already inside.

use std::{
    sync::atomic::{AtomicBool, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use pyo3::prelude::*;

static EXITING: AtomicBool = AtomicBool::new(false);
static INSIDE: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` with the interpreter attached, unless it is exiting (`None`).
pub fn attach<T>(f: impl for<'py> FnOnce(Python<'py>) -> T) -> Option<T> {
    INSIDE.fetch_add(1, Ordering::SeqCst);
    let result = (!EXITING.load(Ordering::SeqCst)).then(|| Python::attach(f));
    INSIDE.fetch_sub(1, Ordering::SeqCst);
    result
}

/// Called at interpreter exit: no thread of ccl's enters Python from now
/// on; waits (at most two seconds, the GIL released) for those inside.
#[pyfunction]
pub fn _at_exit(py: Python<'_>) {
    EXITING.store(true, Ordering::SeqCst);
    py.detach(|| {
        let deadline = Instant::now() + Duration::from_secs(2);
        while INSIDE.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}
