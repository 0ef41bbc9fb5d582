//! How every entry point runs: a panic is caught and becomes
//! `cclInternalError` (none crosses the boundary), and a failure's message
//! is kept for `cclGetLastError`: on the communicator the call named, and
//! for the calling thread.

use std::{
    cell::RefCell,
    ffi::{c_char, CString},
    panic::{catch_unwind, AssertUnwindSafe},
    sync::LazyLock,
};

use ccl::{Error, ErrorCode, Result};

use crate::{
    comm::{comms, CommState},
    types::{cclComm_t, cclResult_t, cclSuccess, code, error_code},
};

thread_local! {
    /// The message of this thread's last failure.
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

/// A message as C reads it (any NUL inside becomes a space).
fn c_message(e: &Error) -> CString {
    CString::new(e.to_string().replace('\0', " ")).unwrap_or_default()
}

/// Runs the body of an entry point. A failure (or a panic) is recorded for
/// this thread and, when `comm` is a live communicator, on it too.
pub(crate) fn entry(comm: cclComm_t, body: impl FnOnce() -> Result<()>) -> cclResult_t {
    let outcome = catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        Err(Error::Internal(format!("caught at the C boundary: {what}")))
    });
    match outcome {
        Ok(()) => cclSuccess,
        Err(e) => {
            record(comms().get(comm as usize).as_deref(), &e);
            code(&e)
        }
    }
}

/// Keeps `e`'s message for this thread and for `comm`.
pub(crate) fn record(comm: Option<&CommState>, e: &Error) {
    let msg = c_message(e);
    if let Some(c) = comm {
        *c.last_error.lock().unwrap_or_else(|p| p.into_inner()) = msg.clone();
    }
    LAST.with(|l| *l.borrow_mut() = msg);
}

/// The message of the last failure on `comm` (or, for a null or dead
/// handle, of this thread's last failure); an empty string if none.
pub(crate) fn last_error(comm: cclComm_t) -> *const c_char {
    match comms().get(comm as usize) {
        // The string lives in the communicator, which stays allocated while
        // the table or a caller holds it; it changes on its next failure.
        Some(c) => c
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ptr(),
        None => LAST.with(|l| l.borrow().as_ptr()),
    }
}

/// A short description of `code`, as a C string that lives forever.
pub(crate) fn describe(result: cclResult_t) -> *const c_char {
    static TEXTS: LazyLock<Vec<CString>> = LazyLock::new(|| {
        ErrorCode::ALL
            .iter()
            .map(|c| CString::new(c.describe()).unwrap_or_default())
            .collect()
    });
    match (result, error_code(result)) {
        (cclSuccess, _) => c"no error".as_ptr(),
        (_, Some(c)) => TEXTS[c as usize - 1].as_ptr(),
        (_, None) => c"unknown result code".as_ptr(),
    }
}
