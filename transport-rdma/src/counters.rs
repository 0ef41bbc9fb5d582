//! Process-wide counters of what the RDMA links moved and how, and of how
//! their futures waited, read by the tests (zero copies above the eager
//! limit; sleeping on the completion channel) and by `ccl-bench`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Bytes moved by this process's RDMA links, by path.
#[derive(Debug, Default)]
pub struct Counters {
    eager: AtomicU64,
    zero_copy_sent: AtomicU64,
    zero_copy_received: AtomicU64,
    device: AtomicU64,
    sleeps: AtomicU64,
    wakeups: AtomicU64,
    naps: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterValues {
    /// Payload bytes copied through the eager rings (once on each side).
    pub eager_bytes: u64,
    /// Payload bytes written by the NIC straight from the caller's memory.
    pub zero_copy_sent: u64,
    /// Payload bytes the peer's NIC wrote straight into the caller's memory.
    pub zero_copy_received: u64,
    /// Of the zero-copy bytes sent and received, those in GPU memory
    /// (GPUDirect RDMA).
    pub device_bytes: u64,
    /// Times a waiting future slept on the completion channel.
    pub sleeps: u64,
    /// Of those, the times the channel woke it (a completion, or a notice
    /// another waiter took first); the rest timed out or saw a local abort.
    pub wakeups: u64,
    /// Short naps of waiting futures that could not sleep on the channel.
    pub naps: u64,
}

/// This process's counters.
pub static COUNTERS: Counters = Counters {
    eager: AtomicU64::new(0),
    zero_copy_sent: AtomicU64::new(0),
    zero_copy_received: AtomicU64::new(0),
    device: AtomicU64::new(0),
    sleeps: AtomicU64::new(0),
    wakeups: AtomicU64::new(0),
    naps: AtomicU64::new(0),
};

impl Counters {
    pub(crate) fn add_eager(&self, n: usize) {
        self.eager.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn add_zero_copy_sent(&self, n: usize) {
        self.zero_copy_sent.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn add_zero_copy_received(&self, n: usize) {
        self.zero_copy_received.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn add_device(&self, n: usize) {
        self.device.fetch_add(n as u64, Relaxed);
    }

    pub(crate) fn add_sleep(&self) {
        self.sleeps.fetch_add(1, Relaxed);
    }

    pub(crate) fn add_wakeup(&self) {
        self.wakeups.fetch_add(1, Relaxed);
    }

    pub(crate) fn add_nap(&self) {
        self.naps.fetch_add(1, Relaxed);
    }

    /// The values now.
    pub fn get(&self) -> CounterValues {
        CounterValues {
            eager_bytes: self.eager.load(Relaxed),
            zero_copy_sent: self.zero_copy_sent.load(Relaxed),
            zero_copy_received: self.zero_copy_received.load(Relaxed),
            device_bytes: self.device.load(Relaxed),
            sleeps: self.sleeps.load(Relaxed),
            wakeups: self.wakeups.load(Relaxed),
            naps: self.naps.load(Relaxed),
        }
    }
}
