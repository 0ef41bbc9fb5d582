//! How long a waiter polls before it sleeps, adapted to how its waits end:
//! used by the shared-memory links and board, and by the thread that drives
//! a communicator's runtime (the socket transports' waits).
//!
//! With a fixed window two ranks can fall into a lock-step that costs a
//! wake-up on every message: when waking a sleeper takes longer than the
//! window (about 60 µs on a small VM against a 50 µs window), rank A wakes
//! B and starts waiting, B takes longer to wake than A spins, so A sleeps
//! too and B must wake it in turn, and so on, call after call. The window
//! therefore doubles after a sleep that ended soon (the peer came shortly
//! after this rank gave up), up to [`MAX_GROWTH`] times the configured one,
//! so the next wait outlasts the peer's wake-up and the lock-step breaks.
//! It shrinks back slowly while waits end in the spin, and at once after a
//! long sleep (an idle peer), so idle ranks still burn no CPU.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// The window grows to at most this multiple of the configured one.
const MAX_GROWTH: u64 = 32;
/// A sleep shorter than this many windows counts as ending soon.
const SOON: u64 = 8;
/// Each wait that ends in the spin takes this fraction of the growth away.
const DECAY: u64 = 16;

/// A spin window shared by the waits of one link, board or communicator (see
/// the module docs).
#[derive(Debug)]
pub struct SpinWindow {
    base_ns: u64,
    now_ns: AtomicU64,
}

impl SpinWindow {
    /// Starts at `base`; a zero `base` never spins.
    pub fn new(base: Duration) -> SpinWindow {
        let base_ns = base.as_nanos().min(u64::MAX as u128) as u64;
        SpinWindow {
            base_ns,
            now_ns: AtomicU64::new(base_ns),
        }
    }

    /// How long the next wait polls.
    pub fn get(&self) -> Duration {
        Duration::from_nanos(self.now_ns.load(Ordering::Relaxed))
    }

    /// A wait ended while polling: the window shrinks a little toward the base.
    pub fn caught(&self) {
        let now = self.now_ns.load(Ordering::Relaxed);
        if now > self.base_ns {
            let less = ((now - self.base_ns) / DECAY).max(1);
            self.now_ns.store(now - less, Ordering::Relaxed);
        }
    }

    /// A wait ended after sleeping for `slept`: the window doubles if the
    /// sleep was short, and goes back to the base if it was long.
    pub fn slept(&self, slept: Duration) {
        let now = self.now_ns.load(Ordering::Relaxed);
        let slept = slept.as_nanos().min(u64::MAX as u128) as u64;
        let next = if slept < SOON.saturating_mul(now) {
            now.saturating_mul(2)
                .min(self.base_ns.saturating_mul(MAX_GROWTH))
        } else {
            self.base_ns
        };
        self.now_ns.store(next, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn short_sleeps_grow_the_window_to_the_cap() {
        let w = SpinWindow::new(50 * US);
        w.slept(60 * US);
        assert_eq!(w.get(), 100 * US);
        for _ in 0..20 {
            w.slept(60 * US);
        }
        assert_eq!(w.get(), 50 * US * MAX_GROWTH as u32);
    }

    #[test]
    fn a_long_sleep_resets_and_catches_shrink_slowly() {
        let w = SpinWindow::new(50 * US);
        w.slept(60 * US);
        w.slept(60 * US);
        assert_eq!(w.get(), 200 * US);
        w.caught();
        assert!(w.get() < 200 * US && w.get() > 180 * US, "{:?}", w.get());
        for _ in 0..1000 {
            w.caught();
        }
        assert_eq!(w.get(), 50 * US);
        w.slept(60 * US);
        w.slept(Duration::from_secs(1));
        assert_eq!(w.get(), 50 * US);
    }

    #[test]
    fn a_zero_window_never_spins() {
        let w = SpinWindow::new(Duration::ZERO);
        w.slept(US);
        w.caught();
        assert_eq!(w.get(), Duration::ZERO);
    }
}
