//! The RDMA link: drives one peer's protocol state ([`Peer`]) from the
//! link's futures. A waiting future polls the completion queue for the spin
//! window; then it arms the completion queues of the communicator's pairs
//! (`ibv_req_notify_cq`), polls once more, and sleeps on their completion
//! channel's file descriptor, registered with the runtime, until a
//! completion, a local abort, or [`MAX_SLEEP`] (the keep-alive probes and
//! the pairs' checks still run); the queues are armed again after that
//! last poll, which may have posted work (credits, a keep-alive probe).
//! Where a queue cannot be armed (writes in the glue's backlog, which only a
//! poll posts; the simulated fabric holding completions for its clock), a
//! pair is being polled by another future, or the descriptor cannot be
//! registered, it naps in short, growing steps (up to 1 ms) between polls
//! instead. The engine's runtime is current-thread, so no waiter of another
//! thread can take a notice between this one's arming and its sleep.
//! A dropped send or receive is cancelled in the protocol, which fails the
//! pair if it was in the middle of a message. A dropped link says bye to
//! its peer and waits (at most [`LINGER`]) until its writes have completed;
//! an `atexit` hook does the same for the pairs of a process that exits
//! without dropping its communicator (see `proto`'s module docs). Each time
//! a waiting future polls its pair it takes in the other pairs' completions
//! too: an eager send is done once posted, so its write can fail while the
//! rank waits on another peer, and that failure must end the wait (the peer
//! it starved is waiting too).

use std::{
    future::{poll_fn, Future},
    os::fd::{AsRawFd, RawFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard, OnceLock, TryLockError, Weak,
    },
    task::Poll,
    time::{Duration, Instant},
};

use tokio::{
    io::{unix::AsyncFd, Interest},
    sync::Notify,
};

use ccl_core::{
    AbortNotice, BufMut, BufRef, Error, FrameHeader, Link, LinkFuture, MemoryKind, Reduction,
    Result, Spin,
};

use crate::{
    counters::COUNTERS,
    proto::{Peer, RecvOp, SendOp},
    verbs::{Channel, Verbs},
};

/// Longest nap between two polls of a waiting future that cannot sleep on
/// the completion channel.
const MAX_NAP: Duration = Duration::from_millis(1);
/// Longest sleep on the completion channel before the pairs are polled
/// again (well within the keep-alive interval).
pub(crate) const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Longest a closing pair waits for its writes to complete (a peer that is
/// gone takes the NIC's retries, about half a second, to say so).
const LINGER: Duration = Duration::from_secs(2);

/// A pair that can say bye ([`Peer::close`]), for the exit hook.
trait Closing: Send + Sync {
    fn close(&self, until: Instant);
}

impl<V: Verbs> Closing for Mutex<Peer<V>> {
    fn close(&self, until: Instant) {
        // The engine's thread may be polling it: wait, but not past `until`.
        loop {
            match self.try_lock() {
                Ok(mut peer) => return peer.close(until),
                Err(TryLockError::Poisoned(p)) => return p.into_inner().close(until),
                Err(TryLockError::WouldBlock) if Instant::now() < until => std::thread::yield_now(),
                Err(TryLockError::WouldBlock) => return,
            }
        }
    }
}

/// Every pair of this process that may still be open, with the process
/// that made it (a child forked later inherits the list, not the pairs).
static OPEN_PAIRS: Mutex<Vec<(u32, Weak<dyn Closing>)>> = Mutex::new(Vec::new());

/// At process exit: says bye on every pair still open, as dropping its
/// link would, so that a rank that exits without dropping its communicator
/// has its last eager sends delivered and its peers know it left.
extern "C" fn close_at_exit() {
    let me = std::process::id();
    let open: Vec<Arc<dyn Closing>> = OPEN_PAIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|(pid, _)| *pid == me)
        .filter_map(|(_, pair)| pair.upgrade())
        .collect();
    let until = Instant::now() + LINGER;
    for pair in open {
        pair.close(until);
    }
}

/// Has `state` closed at process exit if it is still open then.
pub(crate) fn close_at_exit_if_open<V: Verbs>(state: &PeerState<V>) {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a function that takes nothing and returns nothing,
    // as atexit expects.
    AT_EXIT.call_once(|| unsafe {
        libc::atexit(close_at_exit);
    });
    let state: Arc<dyn Closing> = state.clone();
    let mut open = OPEN_PAIRS.lock().unwrap_or_else(|p| p.into_inner());
    open.retain(|(_, pair)| pair.strong_count() > 0);
    open.push((std::process::id(), Arc::downgrade(&state)));
}

/// What the waiting futures of one communicator's links sleep on.
pub(crate) struct Sleeper<V: Verbs> {
    /// The channel's descriptor registered with the runtime at first use;
    /// `None` if that failed (waits then nap). Dropped before the channel.
    fd: OnceLock<Option<AsyncFd<RawFd>>>,
    /// Set when waiting on the descriptor failed (the runtime's I/O driver
    /// is gone): waits nap from then on.
    failed: AtomicBool,
    channel: V::Channel,
    /// Wakes every sleeper when this rank aborts a link or a dropped call
    /// fails a pair.
    aborted: Notify,
}

impl<V: Verbs> Sleeper<V> {
    pub(crate) fn new(channel: V::Channel) -> Sleeper<V> {
        Sleeper {
            fd: OnceLock::new(),
            failed: AtomicBool::new(false),
            channel,
            aborted: Notify::new(),
        }
    }

    /// The channel's descriptor in the current runtime, if it can be used.
    /// The runtime must have I/O enabled, as the communicator's has.
    fn fd(&self) -> Option<&AsyncFd<RawFd>> {
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        if let Some(fd) = self.fd.get() {
            return fd.as_ref();
        }
        // Registered only from within a runtime (the engine's).
        tokio::runtime::Handle::try_current().ok()?;
        self.fd
            .get_or_init(|| {
                // SAFETY: the channel's descriptor stays open and the same
                // until the channel drops, after this field.
                unsafe {
                    AsyncFd::register_with_interest(self.channel.as_raw_fd(), Interest::READABLE)
                }
                .inspect_err(|e| {
                    tracing::debug!("rdma: completion channel unusable, waits nap: {e}")
                })
                .ok()
            })
            .as_ref()
    }
}

/// The protocol state of one pair, shared with the rank's other links.
pub(crate) type PeerState<V> = Arc<Mutex<Peer<V>>>;

/// A link to one peer over an RC queue pair.
pub(crate) struct RdmaLink<V: Verbs> {
    rank: usize,
    peer: usize,
    state: PeerState<V>,
    /// Every pair this rank connected in the same set-up, this one included.
    pairs: Arc<[Weak<Mutex<Peer<V>>>]>,
    spin: Spin,
    /// Both sides register GPU memory: device buffers go through as they are.
    gpudirect: bool,
    sleeper: Arc<Sleeper<V>>,
}

impl<V: Verbs> RdmaLink<V> {
    pub(crate) fn new(
        (rank, peer): (usize, usize),
        state: PeerState<V>,
        pairs: Arc<[Weak<Mutex<Peer<V>>>]>,
        spin: Spin,
        gpudirect: bool,
        sleeper: Arc<Sleeper<V>>,
    ) -> RdmaLink<V> {
        RdmaLink {
            rank,
            peer,
            state,
            pairs,
            spin,
            gpudirect,
            sleeper,
        }
    }

    /// Whether `kind` is GPU memory this link moves as it is; host memory
    /// is `Ok(false)`, other memory an error saying why not.
    fn device(&self, kind: MemoryKind) -> Result<bool> {
        match kind {
            MemoryKind::Host => Ok(false),
            MemoryKind::Device { .. } if self.gpudirect => Ok(true),
            kind => Err(Error::Unsupported(format!(
                "the RDMA link from rank {} to rank {} moves {kind} only through GPUDirect \
                 RDMA, which this pair does not use (a side without nvidia-peermem, or \
                 CCL_RDMA_GPUDIRECT=0)",
                self.rank, self.peer
            ))),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Peer<V>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes in the completions of the other pairs that nobody is driving
    /// now; returns the first failure among them.
    fn progress_others(&self) -> Result<()> {
        for other in self.pairs.iter().filter_map(Weak::upgrade) {
            if Arc::ptr_eq(&other, &self.state) {
                continue;
            }
            let mut peer = match other.try_lock() {
                Ok(peer) => peer,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            peer.progress()?;
        }
        Ok(())
    }

    /// Arms the completion queue of every pair of this rank; false if one
    /// cannot be armed, or is being polled by another future now.
    fn arm_all(&self) -> bool {
        self.pairs
            .iter()
            .filter_map(Weak::upgrade)
            .all(|pair| match pair.try_lock() {
                Ok(mut peer) => peer.arm(),
                Err(TryLockError::Poisoned(p)) => p.into_inner().arm(),
                Err(TryLockError::WouldBlock) => false,
            })
    }

    /// Runs `step` after each poll of the completion queue until it says
    /// done; waits as the module docs say.
    async fn drive(&self, mut step: impl FnMut(&mut Peer<V>) -> Result<bool>) -> Result<()> {
        let mut started = Instant::now();
        let mut nap = Duration::from_micros(20);
        let mut napping: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        // Armed: the abort notice is waited for from before the last poll.
        let mut armed = None;
        let mut sleeping = None;
        poll_fn(|cx| loop {
            // Every poll of this future polls the pair, whatever woke it.
            {
                let mut peer = self.lock();
                let done = peer
                    .progress()
                    .and_then(|()| step(&mut peer))
                    .and_then(|done| {
                        if done {
                            Ok(true)
                        } else {
                            peer.idle().map(|()| false)
                        }
                    });
                match done {
                    Ok(true) => return Poll::Ready(Ok(())),
                    Err(e) => return Poll::Ready(Err(e)),
                    Ok(false) => {}
                }
            }
            // Completions of other pairs are taken in while this one waits:
            // a failure there ends this wait, and what they finished frees
            // their resources without waiting for a call on them.
            if let Err(e) = self.progress_others() {
                return Poll::Ready(Err(e));
            }
            if started.elapsed() < self.spin.window {
                if self.spin.yield_between {
                    std::thread::yield_now();
                }
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            if sleeping.is_none() && napping.is_none() {
                match (armed.take(), self.sleeper.fd()) {
                    // Armed and polled once more, with nothing new: sleep.
                    // Armed again: the last poll may have posted work.
                    (Some(aborted), Some(fd)) if self.arm_all() => {
                        COUNTERS.add_sleep();
                        sleeping = Some((
                            Box::pin(tokio::time::sleep(MAX_SLEEP)),
                            Box::pin(fd.readable()),
                            aborted,
                        ));
                    }
                    (None, Some(_)) if self.arm_all() => {
                        armed = Some(Box::pin(self.sleeper.aborted.notified()));
                        continue;
                    }
                    _ => napping = Some(Box::pin(tokio::time::sleep(nap))),
                }
            }
            if let Some((timer, readable, aborted)) = sleeping.as_mut() {
                if let Poll::Ready(ready) = readable.as_mut().poll(cx) {
                    self.sleeper.channel.drain();
                    match ready {
                        Ok(mut guard) => {
                            guard.clear_ready();
                            COUNTERS.add_wakeup();
                        }
                        Err(e) => {
                            tracing::debug!("rdma: waiting on the completion channel: {e}");
                            self.sleeper.failed.store(true, Ordering::Relaxed);
                        }
                    }
                    // A completion came: spin again for the ones after it.
                    started = Instant::now();
                    nap = Duration::from_micros(20);
                } else if timer.as_mut().poll(cx).is_pending()
                    && aborted.as_mut().poll(cx).is_pending()
                {
                    return Poll::Pending;
                }
                sleeping = None;
                continue;
            }
            if let Some(s) = napping.as_mut() {
                match s.as_mut().poll(cx) {
                    Poll::Ready(()) => {
                        napping = None;
                        nap = (nap * 2).min(MAX_NAP);
                        COUNTERS.add_nap();
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await
    }
}

impl<V: Verbs> Drop for RdmaLink<V> {
    fn drop(&mut self) {
        self.lock().close(Instant::now() + LINGER);
    }
}

/// A send that cancels itself in the protocol if dropped before done.
struct Sending<'l, V: Verbs> {
    link: &'l RdmaLink<V>,
    op: SendOp,
    done: bool,
}

impl<V: Verbs> Drop for Sending<'_, V> {
    fn drop(&mut self) {
        if !self.done {
            self.link.lock().cancel_send(&mut self.op);
            // Other waiters on the pair see its failure now, not at their
            // next timeout.
            self.link.sleeper.aborted.notify_waiters();
        }
    }
}

/// A receive that cancels itself in the protocol if dropped before done.
struct Receiving<'l, V: Verbs> {
    link: &'l RdmaLink<V>,
    op: RecvOp,
    done: bool,
}

impl<V: Verbs> Drop for Receiving<'_, V> {
    fn drop(&mut self) {
        if !self.done {
            self.link.lock().cancel_recv(&mut self.op);
            self.link.sleeper.aborted.notify_waiters();
        }
    }
}

impl<V: Verbs> Link for RdmaLink<V> {
    fn rank(&self) -> usize {
        self.rank
    }

    fn peer(&self) -> usize {
        self.peer
    }

    fn send<'a>(&'a self, header: FrameHeader, data: BufRef<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            // An empty message carries no bytes of any kind (and its
            // address may be null).
            let op = match (self.device(data.kind())?, data.len()) {
                (true, 0) => SendOp::new(header, &[]),
                (true, len) => SendOp::device(header, data.as_ptr() as u64, len),
                (false, _) => SendOp::new(header, data.host()?),
            };
            let mut s = Sending {
                link: self,
                op,
                done: false,
            };
            let op = &mut s.op;
            self.drive(|p| p.poll_send(op)).await?;
            s.done = true;
            Ok(())
        })
    }

    fn recv<'a>(&'a self, expect: FrameHeader, mut into: BufMut<'a>) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let op = match (self.device(into.kind())?, into.len()) {
                (true, 0) => RecvOp::new(expect, &mut []),
                (true, len) => RecvOp::device(expect, into.as_mut_ptr() as u64, len),
                (false, _) => RecvOp::new(expect, into.host()?),
            };
            let mut r = Receiving {
                link: self,
                op,
                done: false,
            };
            let op = &mut r.op;
            self.drive(|p| p.poll_recv(op, &mut |_| Ok(()))).await?;
            r.done = true;
            Ok(())
        })
    }

    fn recv_reduce<'a>(
        &'a self,
        expect: FrameHeader,
        mut into: BufMut<'a>,
        reduction: Reduction<'a>,
    ) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            if self.device(into.kind())? {
                // Into device scratch through the NIC, then the GPU's kernels.
                let mut scratch = reduction.kernels.alloc(into.len())?;
                self.recv(expect, scratch.buf_mut()).await?;
                return reduction.apply(into.reborrow(), 0, scratch.buf());
            }
            into.reborrow().host()?;
            let mut r = Receiving {
                link: self,
                op: RecvOp::sink(expect, into.len()),
                done: false,
            };
            let op = &mut r.op;
            let mut reduce =
                |got: &[u8]| reduction.apply(into.reborrow(), 0, BufRef::from_host(got));
            self.drive(|p| p.poll_recv(op, &mut reduce)).await?;
            r.done = true;
            Ok(())
        })
    }

    fn takes_device_memory(&self) -> bool {
        self.gpudirect
    }

    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            self.lock().abort(notice);
            self.sleeper.aborted.notify_waiters();
            Ok(())
        })
    }
}
