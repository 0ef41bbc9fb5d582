//! The executor: runs any [`Schedule`] over links.
//!
//! Ops are grouped into lanes (worked out when the schedule is built), one
//! per link direction (sends to p, receives from p) plus one for local ops.
//! Each lane runs its ops in order, each op first waiting for its
//! dependencies; all lanes run concurrently inside one task. So while piece
//! k is being reduced, piece k+1 is already arriving and piece k-1 is on its
//! way out: the pipelining falls out of the dependencies. An op finishes
//! only while the task polls its lane, so a lane that waits for another's
//! op needs no waker: after a pass over the lanes in which some op finished
//! or failed, the task polls every lane again, until a pass changes nothing.
//!
//! On the first error, receives and ops not yet started are cancelled, but a
//! send already writing may finish its frame (for at most [`SEND_DRAIN`]), so
//! that the link is left between frames and can still carry an abort notice.

use std::{
    future::{poll_fn, Future},
    pin::{pin, Pin},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    task::Poll,
    time::{Duration, Instant},
};

use ccl_core::{
    kernels, yield_once, BufMut, BufRef, Call, Error, FrameHeader, Kernels, Link, MemoryKind,
    Reduction, Repoll, Result, Scratch,
};
use futures::future::{select, Either};
use smallvec::SmallVec;

/// How long sends already writing may go on after another op failed.
pub const SEND_DRAIN: Duration = Duration::from_secs(1);

use crate::{
    schedule::{Action, BufId, Lane, Region, Schedule},
    IoBuffers,
};

/// Resolved memory of an execution: input, output and scratch, all of one
/// kind, and the kernels for it.
struct Memory {
    input: (*mut u8, usize),
    output: (*mut u8, usize),
    scratch: (*mut u8, usize),
    kind: MemoryKind,
    kernels: &'static dyn Kernels,
    elem: usize,
}

// SAFETY: the raw pointers are only dereferenced for regions that the schedule's
// dependencies keep from being written while anything else touches them.
unsafe impl Send for Memory {}
unsafe impl Sync for Memory {}

impl Memory {
    fn base(&self, buf: BufId) -> (*mut u8, usize) {
        match buf {
            BufId::Input => self.input,
            BufId::Output => self.output,
            BufId::Scratch => self.scratch,
        }
    }

    fn check(&self, r: &Region) -> Result<()> {
        let (_, len) = self.base(r.buf);
        if (r.offset + r.len) * self.elem > len {
            return Err(Error::Internal(format!(
                "schedule region {r:?} is outside its {len}-byte buffer"
            )));
        }
        Ok(())
    }

    fn ptr(&self, r: &Region) -> *mut u8 {
        self.base(r.buf).0.wrapping_add(r.offset * self.elem)
    }

    /// # Safety
    /// No op that writes an overlapping region runs at the same time (the schedule's dependencies).
    unsafe fn read(&self, r: &Region) -> BufRef<'_> {
        BufRef::from_raw(self.kind, self.ptr(r), r.len * self.elem)
    }

    /// # Safety
    /// No other op touches an overlapping region at the same time (the schedule's dependencies).
    unsafe fn write(&self, r: &Region) -> BufMut<'_> {
        BufMut::from_raw(self.kind, self.ptr(r), r.len * self.elem)
    }
}

/// The smallest copy that [`Exec::copy_plan`] streams, with streaming stores,
/// where nothing in the call reads it again: one that leaves the L2 and
/// half an L3 of 32 MiB. On a 2-vCPU AMD EPYC VM (Zen 5), 2 ranks over TCP,
/// the own block's copy of a 128 MiB allgather and all-to-all (64 MiB)
/// streamed took the calls from a median of 27.3 to 24.3–24.9 ms and 27.4
/// to 23.0–25.0 (40 alternating runs); 32 MiB calls (16 MiB copies) gained
/// 8–10% (16 runs), and 4 MiB copies were within the noise.
const STREAM_COPY_MIN: usize = 16 << 20;

/// Ops of a schedule whose done flags live in the execution itself; a
/// larger schedule's go to the heap. On the root of a 2-rank 8 B broadcast
/// over TCP their allocation and free took about 245 of some 4,300
/// instructions a call (callgrind).
const INLINE_OPS: usize = 64;

struct Exec<'a> {
    schedule: &'a Schedule,
    links: &'a [Option<Arc<dyn Link>>],
    call: &'a Call,
    mem: Memory,
    done: SmallVec<[AtomicBool; INLINE_OPS]>,
    /// Ops finished or failed so far: a pass over the lanes that changes it
    /// is followed by another.
    progress: AtomicU64,
    /// The first error; once set, every lane stops.
    failure: Mutex<Option<Error>>,
    failed: AtomicBool,
    /// More than one lane runs: a long copy lets the others run between its
    /// pieces (set once that is known, before the lanes start).
    yields: AtomicBool,
}

impl Exec<'_> {
    /// Waits until `ready()` or a failure; true if ready. `ready()` turns
    /// true only when an op of this task finishes, after which `execute`
    /// polls every lane again: no waker is registered.
    async fn wait_until(&self, ready: impl Fn() -> bool) -> bool {
        poll_fn(|_| {
            if self.failed.load(Ordering::Acquire) {
                return Poll::Ready(false);
            }
            if ready() {
                return Poll::Ready(true);
            }
            Poll::Pending
        })
        .await
    }

    /// Lets waiting lanes look again: the pass over the lanes under way is
    /// followed by another. Only this task's poll gets here, so a load and
    /// a store do.
    fn notify(&self) {
        let n = self.progress.load(Ordering::Relaxed);
        self.progress.store(n + 1, Ordering::Relaxed);
    }

    /// The call's result once every lane is done: its first error, if any.
    fn outcome(&self, call: &Call) -> Result<()> {
        let failure = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match failure {
            Some(e) => Err(e.in_call(&call.name())),
            None => Ok(()),
        }
    }

    fn fail(&self, e: Error) {
        let mut first = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some(e);
        }
        self.failed.store(true, Ordering::Release);
        self.notify();
    }

    /// Runs `f` unless a failure happens first.
    async fn unless_failed<T>(&self, f: impl Future<Output = Result<T>>) -> Option<Result<T>> {
        match select(pin!(f), pin!(self.wait_until(|| false))).await {
            Either::Left((r, _)) => Some(r),
            Either::Right(_) => None,
        }
    }

    fn link(&self, peer: usize) -> Result<&dyn Link> {
        self.links
            .get(peer)
            .and_then(|l| l.as_deref())
            .ok_or_else(|| {
                Error::Internal(format!("rank {}: no link to rank {peer}", self.call.rank))
            })
    }

    fn header(&self, step: u32, len: usize) -> FrameHeader {
        self.call.header(step, len)
    }

    async fn run_lane(&self, ops: &[u32]) {
        for (step, &i) in ops.iter().enumerate() {
            let i = i as usize;
            let op = &self.schedule.ops[i];
            let deps_done = || {
                op.deps
                    .iter()
                    .all(|&d| self.done[d as usize].load(Ordering::Acquire))
            };
            if !self.wait_until(deps_done).await {
                return;
            }
            if let Err(e) = self.run_op(i, op, step as u32).await {
                return self.fail(e);
            }
            self.done[i].store(true, Ordering::Release);
            self.notify();
        }
    }

    /// Whether no later op of the schedule waits for op `i`: nothing reads
    /// what it writes before the caller does, and nothing waits for it to end.
    fn left_for_the_caller(&self, i: usize) -> bool {
        !self.schedule.ops[i + 1..]
            .iter()
            .any(|op| op.deps.contains(&(i as u32)))
    }

    /// How op `i`, a copy of `src`, runs: in pieces of how many elements
    /// (all of `src` for one piece), and whether streamed. A copy of host
    /// memory that no later op waits for ([`Self::left_for_the_caller`])
    /// goes in pieces of [`COPY_PIECE`] bytes where other lanes run, letting
    /// them run between pieces: a rank's sockets move data while it copies
    /// its own block (the local lane is polled first, and would otherwise
    /// copy all of it before the first send). From [`STREAM_COPY_MIN`] bytes
    /// such a copy is also streamed ([`kernels::copy_streaming`]). A copy
    /// that ops wait for runs whole, at once.
    fn copy_plan(&self, i: usize, src: Region) -> (usize, bool) {
        let mem = &self.mem;
        let bytes = src.len * mem.elem;
        let yields = self.yields.load(Ordering::Relaxed);
        let aside = mem.kind == MemoryKind::Host
            && (yields && bytes > COPY_PIECE || bytes >= STREAM_COPY_MIN)
            && self.left_for_the_caller(i);
        let piece = match aside && yields {
            true => (COPY_PIECE / mem.elem).max(1),
            false => src.len,
        };
        (piece, aside && bytes >= STREAM_COPY_MIN)
    }

    /// Copies `src` into `dst` at once, streamed or not.
    ///
    /// # Safety
    /// As [`Memory::write`] for `dst` and [`Memory::read`] for `src`.
    unsafe fn copy_now(&self, src: Region, dst: Region, stream: bool) -> Result<()> {
        let mem = &self.mem;
        // SAFETY: as the caller promises.
        let (to, from) = unsafe { (mem.write(&dst), mem.read(&src)) };
        match stream {
            true => kernels::copy_streaming(to.host()?, from.host()?),
            false => mem.kernels.copy(to, from),
        }
    }

    /// Copies `src` into `dst` in pieces of `piece` elements, letting the
    /// other lanes run between them ([`yield_once`]).
    async fn copy_in_pieces(
        &self,
        src: Region,
        dst: Region,
        piece: usize,
        stream: bool,
    ) -> Result<()> {
        let mut at = 0;
        while at < src.len {
            let len = piece.min(src.len - at);
            // SAFETY: parts of the op's regions (see `run_op`).
            unsafe { self.copy_now(src.sub(at, len), dst.sub(at, len), stream)? };
            at += len;
            if at < src.len {
                yield_once().await;
            }
        }
        Ok(())
    }

    /// Runs op `i`, `op`; `Ok` also when a failure elsewhere cancelled it.
    async fn run_op(&self, i: usize, op: &crate::schedule::Op, step: u32) -> Result<()> {
        let (coll, mem) = (&self.call.coll, &self.mem);
        // SAFETY (every region below): the dependencies just awaited order
        // this op after every op that conflicts with its regions.
        match op.action {
            Action::Send { peer, src } => {
                let data = unsafe { mem.read(&src) };
                self.link(peer)?
                    .send(self.header(step, data.len()), data)
                    .await?;
            }
            Action::Recv { peer, dst } => {
                let into = unsafe { mem.write(&dst) };
                let header = self.header(step, into.len());
                let link = self.link(peer)?;
                self.unless_failed(link.recv(header, into))
                    .await
                    .transpose()?;
            }
            Action::RecvReduce { peer, dst, local } => {
                let local = local.filter(|l| mem.ptr(l) != mem.ptr(&dst));
                let into = unsafe { mem.write(&dst) };
                let reduction = Reduction {
                    op: coll.op,
                    dtype: coll.dtype,
                    local: local.map(|l| unsafe { mem.read(&l) }),
                    kernels: mem.kernels,
                };
                let header = self.header(step, into.len());
                let link = self.link(peer)?;
                self.unless_failed(link.recv_reduce(header, into, reduction))
                    .await
                    .transpose()?;
            }
            Action::Copy { src, dst } => {
                if mem.ptr(&src) != mem.ptr(&dst) {
                    match self.copy_plan(i, src) {
                        // Boxed: held across its awaits, its state would
                        // grow every op's future (and every small call's
                        // moves of it).
                        (piece, stream) if piece < src.len => {
                            Box::pin(self.copy_in_pieces(src, dst, piece, stream)).await?
                        }
                        (_, stream) => unsafe { self.copy_now(src, dst, stream)? },
                    }
                }
            }
            Action::Finalize { dst } => {
                let buf = unsafe { mem.write(&dst) };
                mem.kernels
                    .finalize(coll.op, coll.dtype, buf, self.call.world_size)?;
            }
        }
        Ok(())
    }
}

/// Bytes of each piece of a host copy that [`Exec::copy_plan`] lets the other
/// lanes run between. On a 2-vCPU AMD EPYC VM (Zen 5), 2 ranks over TCP,
/// with the own block's copy in pieces and streamed and the allgathers'
/// first send from the input, against whole copies after which the first
/// send went out (medians of 24 alternating runs): allgather of 8, 32 and
/// 128 MiB 0.93, 0.91, 0.86 of the time, all-to-all 0.96, 0.92, 0.88; at 4
/// ranks all-to-all of 32 and 128 MiB 0.95, 0.92, allgather 1.00–1.05.
/// Pieces of 64 KiB did about as well, of 1 MiB no better than whole
/// copies in the 128 MiB allgather.
pub(crate) const COPY_PIECE: usize = 256 * 1024;

/// Resolves `deadline` after it is made (never without one). The runtime's
/// timer is armed at the first poll with a real waker: a call that finishes
/// within repolls ([`Repoll`], whose poller promises a real poll before it
/// lets the task sleep) never touches the timer, whose registration and
/// removal (each under the timer wheel's lock) a small call would otherwise
/// pay every time.
fn limit(deadline: Option<Duration>) -> impl Future<Output = ()> {
    let at = deadline.map(|d| Instant::now() + d);
    async move {
        let Some(at) = at else {
            return std::future::pending().await;
        };
        // Until the first real poll: a repoll may return `Pending` unarmed.
        poll_fn(|cx| match Repoll::is(cx) {
            true => Poll::Pending,
            false => Poll::Ready(()),
        })
        .await;
        tokio::time::sleep_until(at.into()).await
    }
}

/// Runs `schedule` over `links` (indexed by rank; `None` for this rank) on
/// `io`, using `scratch` (replaced by larger scratch of the buffers' kind as
/// needed) for temporary data. Past `deadline`, fails with [`Error::Timeout`]
/// naming the ranks this rank still waited for (to send data, or to take it).
///
/// Errors name the call. Dropping the returned future stops the execution;
/// the links may then be mid-message, so the caller must not reuse them.
pub async fn execute(
    schedule: &Schedule,
    io: IoBuffers<'_>,
    links: &[Option<Arc<dyn Link>>],
    call: &Call,
    scratch: &mut Option<Scratch>,
    deadline: Option<Duration>,
) -> Result<()> {
    let elem = call.coll.dtype.size();
    let kernels = io.kernels();
    let need = schedule.scratch_elems * elem;
    let fits = |s: &Scratch| s.len() >= need && s.kind() == kernels.kind();
    if !scratch.as_ref().is_some_and(fits) {
        *scratch = Some(kernels.alloc(need)?);
    }
    let Some(scratch) = scratch.as_mut() else {
        return Err(Error::Internal("no scratch memory".into()));
    };
    let mut scratch_buf = scratch.buf_mut();
    let (input, output) = io.contiguous()?;
    let mem = Memory {
        input,
        output,
        scratch: (scratch_buf.as_mut_ptr(), scratch_buf.len()),
        kind: kernels.kind(),
        kernels,
        elem,
    };
    // A copy onto itself (in place) does nothing: it is done before the call
    // starts, and a lane of nothing else does not run.
    let mut done = SmallVec::with_capacity(schedule.ops.len());
    let mut all_live = true;
    for (i, op) in schedule.ops.iter().enumerate() {
        let a = &op.action;
        let nothing = matches!(*a, Action::Copy { src, dst } if mem.ptr(&src) == mem.ptr(&dst));
        all_live &= !nothing;
        done.push(AtomicBool::new(nothing));
        match *a {
            Action::Send { src: r, .. }
            | Action::Recv { dst: r, .. }
            | Action::Finalize { dst: r } => mem.check(&r)?,
            Action::RecvReduce { dst, local, .. } => {
                mem.check(&dst)?;
                if let Some(l) = local {
                    mem.check(&l)?;
                }
            }
            Action::Copy { src, dst } => {
                mem.check(&src)?;
                mem.check(&dst)?;
            }
        }
        if op.deps.iter().any(|&d| d as usize >= i) {
            return Err(Error::Internal(format!("op {i} depends on a later op")));
        }
    }
    let exec = Exec {
        schedule,
        links,
        call,
        mem,
        done,
        progress: AtomicU64::new(0),
        failure: Mutex::new(None),
        failed: AtomicBool::new(false),
        yields: AtomicBool::new(false),
    };
    let live = |ops: &[u32]| {
        all_live
            || ops
                .iter()
                .any(|&i| !exec.done[i as usize].load(Ordering::Relaxed))
    };
    let mut lanes = schedule.lanes.iter().filter(|(_, ops)| live(ops));
    if let (first, None) = (lanes.next(), lanes.next()) {
        // One lane runs its ops in order: none waits for another lane, and
        // a failure ends the lane, so no other lane's sends are left to
        // drain. Neither the lanes' allocation nor the passes over them
        // below: about 490 and 350 instructions of the root's and the other
        // rank's calls of a 2-rank 8 B broadcast over TCP in place (callgrind).
        let lane = first.map(|(_, ops)| exec.run_lane(ops));
        if let Some(lane) = lane {
            if let Either::Right(_) = select(pin!(lane), pin!(limit(deadline))).await {
                return Err(timeout(schedule, &exec, call, deadline));
            }
        }
        return exec.outcome(call);
    }
    exec.yields.store(true, Ordering::Relaxed);
    // Every lane is polled on every wake-up of the one task (not only the
    // lane that was woken, as `join_all` does past 30 futures), and again
    // after any pass in which an op finished: a lane may wait on another's
    // progress, and nothing wakes it for that (see `Exec::wait_until`). A
    // waking would cost the runtime a turn (an `epoll_wait`) per finished op
    // that another lane waits on, as a tree's inner rank forwards what it
    // received. The lanes' futures share one allocation.
    let mut running: Pin<Box<[Option<_>]>> = schedule
        .lanes
        .iter()
        .map(|(_, ops)| live(ops).then(|| exec.run_lane(ops)))
        .collect::<Box<[_]>>()
        .into();
    let all = poll_fn(|cx| loop {
        let seen = exec.progress.load(Ordering::Relaxed);
        let mut pending = false;
        for i in 0..running.len() {
            // SAFETY: the slice is pinned and never moved; this pins one element in place.
            let mut slot = unsafe { running.as_mut().map_unchecked_mut(|s| &mut s[i]) };
            if let Some(lane) = slot.as_mut().as_pin_mut() {
                match lane.poll(cx) {
                    Poll::Ready(()) => slot.set(None),
                    Poll::Pending => pending = true,
                }
            }
        }
        if !pending {
            return Poll::Ready(());
        }
        if exec.progress.load(Ordering::Relaxed) == seen {
            return Poll::Pending;
        }
    });
    let drain = async {
        exec.wait_until(|| false).await;
        tokio::time::sleep(SEND_DRAIN).await;
    };
    let limit = limit(deadline);
    // Everything finishes (successfully, or with the sends drained after a
    // failure), or the drain time runs out first, or the deadline.
    if let Either::Right(_) = select(select(pin!(all), pin!(drain)), pin!(limit)).await {
        return Err(timeout(schedule, &exec, call, deadline));
    }
    exec.outcome(call)
}

/// The error of a call that ran past its `deadline`: it names the ranks
/// this rank still waited for.
fn timeout(schedule: &Schedule, exec: &Exec<'_>, call: &Call, deadline: Option<Duration>) -> Error {
    let waiting = |send: bool| -> Vec<usize> {
        schedule
            .lanes
            .iter()
            .filter(|(_, ops)| {
                ops.iter()
                    .any(|&i| !exec.done[i as usize].load(Ordering::Acquire))
            })
            .filter_map(|(lane, _)| match *lane {
                Lane::RecvFrom(p) if !send => Some(p),
                Lane::SendTo(p) if send => Some(p),
                _ => None,
            })
            .collect()
    };
    let (from, to) = (waiting(false), waiting(true));
    Error::Timeout {
        context: format!("rank {}: {}", call.rank, call.name()),
        what: format!(
            "data from rank(s) {from:?} and rank(s) {to:?} to take this rank's \
             (they did not make this call, or are stuck)"
        ),
        after: deadline.unwrap_or_default(),
    }
}
