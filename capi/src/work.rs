//! `cclWork_t`: calls started in a group that ended with
//! `cclGroupEndAsync`, tested and waited for from any thread.

use std::{
    ffi::{c_double, c_int},
    sync::Mutex,
    time::{Duration, Instant},
};

use ccl::{Error, Result, Work};

use crate::{
    comm::{comms, out},
    errors::{entry, record},
    handles::Table,
    types::{cclComm_t, cclResult_t, cclWork_t},
};

/// A started call and the communicator it runs on (for its error message).
pub(crate) struct Pending {
    work: Work<()>,
    comm: usize,
}

pub(crate) fn pending(work: Work<()>, comm: cclComm_t) -> Pending {
    Pending {
        work,
        comm: comm as usize,
    }
}

impl Pending {
    /// Hands a device call to its communicator, which keeps it until it
    /// completes; the error at once if it failed already (recorded).
    pub(crate) fn queue_on(self, state: &crate::comm::CommState) -> Result<()> {
        state
            .queued(self.work)
            .inspect_err(|e| record(Some(state), e))
    }
}

/// Waits for `p`; a failure is recorded on its communicator.
fn finish(p: Pending) -> Result<()> {
    p.work
        .wait()
        .inspect_err(|e| record(comms().get(p.comm).as_deref(), e))
}

/// Waits for every call, in order; the first failure.
pub(crate) fn wait_all(calls: Vec<Pending>) -> Result<()> {
    calls.into_iter().map(finish).fold(Ok(()), Result::and)
}

/// The calls behind a `cclWork_t`: those still running, and the first
/// failure of those done.
struct WorkState(Mutex<(Vec<Pending>, Result<()>)>);

static WORKS: Table<WorkState> = Table::new();

/// A handle on `calls`.
pub(crate) fn hand_out(calls: Vec<Pending>) -> cclWork_t {
    WORKS.insert(WorkState(Mutex::new((calls, Ok(()))))) as cclWork_t
}

fn lookup(work: cclWork_t) -> Result<std::sync::Arc<WorkState>> {
    WORKS.get(work as usize).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{work:p} is no live cclWork_t (freed, or never made)"
        ))
    })
}

impl WorkState {
    /// Waits for the calls that are done, or, with `wait`, for all of them
    /// until `until`; true if none is left running.
    fn settle(&self, wait: bool, until: Option<Instant>) -> Result<bool> {
        let mut st = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (calls, first) = &mut *st;
        let mut left = Vec::new();
        for mut p in calls.drain(..) {
            let done = if !wait {
                p.work.is_completed()
            } else if let Some(at) = until {
                match p
                    .work
                    .wait_timeout(at.saturating_duration_since(Instant::now()))
                {
                    Some(r) => {
                        *first = std::mem::replace(first, Ok(()))
                            .and(r.inspect_err(|e| record(comms().get(p.comm).as_deref(), e)));
                        continue;
                    }
                    None => false,
                }
            } else {
                true
            };
            if done {
                *first = std::mem::replace(first, Ok(())).and(finish(p));
            } else {
                left.push(p);
            }
        }
        *calls = left;
        first.clone()?;
        Ok(calls.is_empty())
    }
}

/// Writes to `done` whether every call of `work` completed (1) or not (0);
/// returns the first failure among those that did. Thread-safe.
#[no_mangle]
pub extern "C" fn cclWorkTest(work: cclWork_t, done: *mut c_int) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let done = out(done, "done")?;
        *done = 0;
        *done = c_int::from(lookup(work)?.settle(false, None)?);
        Ok(())
    })
}

/// Waits for every call of `work`; returns the first failure. Thread-safe.
#[no_mangle]
pub extern "C" fn cclWorkWait(work: cclWork_t) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        lookup(work)?.settle(true, None).map(drop)
    })
}

/// Waits at most `seconds` for the calls of `work`; writes to `done` whether
/// all completed. Returns the first failure among those that did.
#[no_mangle]
pub extern "C" fn cclWorkWaitTimeout(
    work: cclWork_t,
    seconds: c_double,
    done: *mut c_int,
) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        let done = out(done, "done")?;
        *done = 0;
        let limit = Duration::try_from_secs_f64(seconds)
            .map_err(|_| Error::InvalidArgument(format!("{seconds} seconds is no duration")))?;
        let until = Instant::now() + limit;
        *done = c_int::from(lookup(work)?.settle(true, Some(until))?);
        Ok(())
    })
}

/// Frees `work`, whose calls must have completed (a running call still
/// uses its buffers: wait first).
#[no_mangle]
pub extern "C" fn cclWorkFree(work: cclWork_t) -> cclResult_t {
    entry(std::ptr::null_mut(), || {
        if !lookup(work)?.settle(false, None).unwrap_or(true) {
            return Err(Error::InvalidArgument(format!(
                "{work:p} still runs: wait for it before freeing it"
            )));
        }
        WORKS
            .remove(work as usize)
            .map(drop)
            .ok_or_else(|| Error::InvalidArgument(format!("{work:p} is no live cclWork_t")))
    })
}
