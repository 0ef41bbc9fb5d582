//! The RDMA link: drives one peer's protocol state ([`Peer`]) from the
//! link's futures. A waiting future polls the completion queue for the spin
//! window, then sleeps in short, growing steps (up to 1 ms) between polls.
//! A dropped send or receive is cancelled in the protocol, which fails the
//! pair if it was in the middle of a message. Each time a waiting future
//! polls its pair it takes in the other pairs' completions too: an eager
//! send is done once posted, so its write can fail while the rank waits on
//! another peer, and that failure must end the wait (the peer it starved is
//! waiting too).

use std::{
    future::{poll_fn, Future},
    sync::{Arc, Mutex, MutexGuard, TryLockError, Weak},
    task::Poll,
    time::{Duration, Instant},
};

use ccl_core::{
    AbortNotice, BufMut, BufRef, Error, FrameHeader, Link, LinkFuture, MemoryKind, Reduction,
    Result, Spin,
};

use crate::{
    proto::{Peer, RecvOp, SendOp},
    verbs::Verbs,
};

/// Longest sleep between two polls of a waiting future.
const MAX_NAP: Duration = Duration::from_millis(1);

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
}

impl<V: Verbs> RdmaLink<V> {
    pub(crate) fn new(
        (rank, peer): (usize, usize),
        state: PeerState<V>,
        pairs: Arc<[Weak<Mutex<Peer<V>>>]>,
        spin: Spin,
        gpudirect: bool,
    ) -> RdmaLink<V> {
        RdmaLink {
            rank,
            peer,
            state,
            pairs,
            spin,
            gpudirect,
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

    /// Runs `step` after each poll of the completion queue until it says done.
    async fn drive(&self, mut step: impl FnMut(&mut Peer<V>) -> Result<bool>) -> Result<()> {
        let started = Instant::now();
        let mut nap = Duration::from_micros(20);
        let mut sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
        poll_fn(|cx| loop {
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
            let s = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(nap)));
            match s.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    sleep = None;
                    nap = (nap * 2).min(MAX_NAP);
                }
                Poll::Pending => return Poll::Pending,
            }
        })
        .await
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
            Ok(())
        })
    }
}
