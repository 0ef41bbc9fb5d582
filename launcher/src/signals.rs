//! Async-signal-safe bookkeeping for the signals that ask `ccl-run` to stop.
//!
//! The handler only touches atomics; the supervisor loop in `main.rs` polls
//! [`first`] and [`count`] and does the real work (forwarding SIGTERM to the
//! ranks, escalating to SIGKILL) outside of signal context.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

/// Signals that make `ccl-run` stop all ranks and exit with `128 + signal`.
pub const STOP_SIGNALS: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

/// Number of the first stop signal received (0 = none yet).
static FIRST: AtomicI32 = AtomicI32::new(0);
/// Total number of stop signals received so far.
static COUNT: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_stop_signal(sig: nix::libc::c_int) {
    // Only lock-free atomics here: this runs in signal context.
    let _ = FIRST.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
    COUNT.fetch_add(1, Ordering::SeqCst);
}

/// Installs the handler for [`STOP_SIGNALS`].
///
/// `SA_RESTART` keeps the output reader threads' blocking reads from failing
/// with `EINTR`. Handlers (unlike ignored dispositions) are reset to the
/// default by `execve`, so the ranks start with default signal behaviour.
pub fn install() -> nix::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_stop_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in STOP_SIGNALS {
        // SAFETY: the handler only performs async-signal-safe atomic operations.
        unsafe { sigaction(sig, &action)? };
    }
    Ok(())
}

/// The first stop signal received, if any.
pub fn first() -> Option<Signal> {
    match FIRST.load(Ordering::SeqCst) {
        0 => None,
        n => Signal::try_from(n).ok(),
    }
}

/// How many stop signals have been received; a change while ranks are being
/// stopped means "stop waiting for the grace period, kill them now".
pub fn count() -> usize {
    COUNT.load(Ordering::SeqCst)
}
