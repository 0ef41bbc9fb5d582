//! The `Link` trait: a reliable, ordered, framed channel to one peer.

use std::{cell::Cell, future::Future, pin::Pin, time::Duration};

use crate::{op, AbortNotice, AlignedBuf, DataType, FrameHeader, ReduceOp, Result};

/// How a thread waiting for a peer behaves before it sleeps in the kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Spin {
    /// How long to keep polling (zero: sleep at once).
    pub window: Duration,
    /// Yield the core between polls, for when the ranks outnumber the cores.
    pub yield_between: bool,
    /// Poll again at once, without the runtime, while spinning: for when
    /// every link lives in memory and needs no socket readiness.
    pub repoll: bool,
}

impl Spin {
    /// Polling window when every rank of a host has a CPU of its own. A
    /// rank that sleeps gives its CPU up, and on a virtual machine the
    /// hypervisor may not run it again for milliseconds after the peer's
    /// wake-up; polling this long catches a peer delayed by an interrupt or
    /// by the hypervisor before that happens.
    pub const OWN_CPU_WINDOW: Duration = Duration::from_millis(1);
    /// Polling window when a host's ranks outnumber its CPUs: the others
    /// need the CPU.
    pub const SHARED_CPU_WINDOW: Duration = Duration::from_micros(50);

    /// How a waiting thread of one of `ranks` ranks of a host polls when the
    /// host's ranks may run on `cpus` CPUs between them: it yields between
    /// polls, and stops sooner, when they outnumber the CPUs. `window`, when
    /// given, replaces the default window.
    pub fn for_host(ranks: usize, cpus: usize, window: Option<Duration>) -> Spin {
        let shared = ranks > cpus;
        Spin {
            window: window.unwrap_or(if shared {
                Spin::SHARED_CPU_WINDOW
            } else {
                Spin::OWN_CPU_WINDOW
            }),
            yield_between: shared,
            repoll: false,
        }
    }
}

/// The CPUs this process may run on (its affinity mask), in increasing order.
pub fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    use nix::sched::{sched_getaffinity, CpuSet};
    let set = sched_getaffinity(nix::unistd::Pid::from_raw(0))?;
    Ok((0..CpuSet::count())
        .filter(|&c| set.is_set(c).unwrap_or(false))
        .collect())
}

thread_local! {
    static REPOLLING: Cell<bool> = const { Cell::new(false) };
}

/// True while the thread polling a link future will poll it again at once,
/// without a trip through the runtime (see [`poll_repolling`]). A link that
/// waits on memory may then return `Pending` in its spin window without
/// arranging a wake-up, which saves two system calls per poll.
pub fn repolling() -> bool {
    REPOLLING.with(Cell::get)
}

/// Runs `poll` with [`repolling`] true. The caller must poll once more with it
/// false before it lets the task sleep, so that every waiter registers a wake-up.
pub fn poll_repolling<R>(poll: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            REPOLLING.with(|r| r.set(false));
        }
    }
    REPOLLING.with(|r| r.set(true));
    let _reset = Reset;
    poll()
}

/// A boxed future returned by [`Link`] methods.
pub type LinkFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// What to reduce a received payload with: `into = local ⊕ received`
/// (`local` defaults to `into` itself).
#[derive(Clone, Copy, Debug)]
pub struct Reduction<'a> {
    pub op: ReduceOp,
    pub dtype: DataType,
    pub local: Option<&'a [u8]>,
}

/// A reliable, ordered, bidirectional channel between this rank and one peer.
///
/// One `send` and one receive may be in flight at the same time (from the same
/// task, joined); two concurrent sends, or two concurrent receives, on one
/// link are not allowed. A receive names the header it expects and checks the
/// header that arrives against it (see [`FrameHeader::check_received`]); an
/// abort frame from the peer turns into [`crate::Error::PeerLost`] naming the
/// rank that failed first. Errors leave `call` empty; the caller fills it in.
pub trait Link: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;

    /// The rank at the other end.
    fn peer(&self) -> usize;

    /// Sends one frame: `header` (whose `len` must equal `data.len()`) and `data`.
    fn send<'a>(&'a self, header: FrameHeader, data: &'a [u8]) -> LinkFuture<'a, ()>;

    /// Receives one frame whose header must match `expect`, payload straight into `into`.
    fn recv<'a>(&'a self, expect: FrameHeader, into: &'a mut [u8]) -> LinkFuture<'a, ()>;

    /// Receives one frame and reduces it into `into`.
    ///
    /// The default receives into scratch memory, then reduces; transports that
    /// can read the payload in place (shared memory) or in pieces (TCP) override it.
    fn recv_reduce<'a>(
        &'a self,
        expect: FrameHeader,
        into: &'a mut [u8],
        reduction: Reduction<'a>,
    ) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let mut scratch = AlignedBuf::zeroed(into.len());
            self.recv(expect, scratch.as_mut_slice()).await?;
            op::reduce(
                reduction.op,
                reduction.dtype,
                into,
                reduction.local,
                scratch.as_slice(),
            )
        })
    }

    /// Best effort, bounded in time: tells the peer that this rank gives up and
    /// why, then closes the link so that nothing waits on it any more.
    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()>;
}

impl std::fmt::Debug for dyn Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Link({} -> {})", self.rank(), self.peer())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_that_outnumber_their_cpus_yield_and_poll_briefly() {
        let own = Spin::for_host(2, 2, None);
        assert_eq!(
            (own.window, own.yield_between),
            (Spin::OWN_CPU_WINDOW, false)
        );
        let shared = Spin::for_host(4, 2, None);
        assert_eq!(
            (shared.window, shared.yield_between),
            (Spin::SHARED_CPU_WINDOW, true)
        );
        let set = Spin::for_host(4, 2, Some(Duration::from_micros(7)));
        assert_eq!(
            (set.window, set.yield_between),
            (Duration::from_micros(7), true)
        );
        assert!(!allowed_cpus().expect("sched_getaffinity").is_empty());
    }
}
