//! The executor: runs any [`Schedule`] over links.
//!
//! Ops are grouped into queues, one per link direction (sends to p, receives
//! from p) plus one for local ops. Each queue runs its ops in order, each op
//! first waiting for its dependencies; all queues run concurrently inside one
//! task. So while piece k is being reduced, piece k+1 is already arriving and
//! piece k-1 is on its way out: the pipelining falls out of the dependencies.
//!
//! On the first error, receives and ops not yet started are cancelled, but a
//! send already writing may finish its frame (for at most [`SEND_DRAIN`]), so
//! that the link is left between frames and can still carry an abort notice.

use std::{
    collections::BTreeMap,
    future::{poll_fn, Future},
    marker::PhantomData,
    pin::pin,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    task::Poll,
    time::Duration,
};

use ccl_core::{
    op, repolling, AlignedBuf, DataType, Error, Fingerprint, FrameHeader, Link, ReduceOp,
    Reduction, Result,
};
use futures::{
    future::{select, Either},
    task::AtomicWaker,
};

/// How long sends already writing may go on after another op failed.
pub const SEND_DRAIN: Duration = Duration::from_secs(1);

use crate::schedule::{Action, BufId, Region, Schedule};

/// The identity of a call: what goes into every frame header.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Communicator id.
    pub comm: u64,
    /// Sequence number of the call on the communicator.
    pub seq: u64,
    pub fingerprint: Fingerprint,
    pub rank: usize,
    pub world_size: usize,
    pub op: ReduceOp,
}

impl Call {
    fn dtype(&self) -> DataType {
        self.fingerprint.dtype
    }

    /// The call as error messages name it.
    pub fn name(&self) -> String {
        FrameHeader::data(self.comm, self.seq, 0, 0, self.fingerprint).call_name()
    }
}

/// The caller's input and output memory for one execution.
///
/// Input and output are disjoint, the same memory, or, for in-place calls
/// whose input and output differ in size, one lies inside the other at the
/// block the collective defines (this rank's block of an allgather output, of
/// a reduce-scatter input, of a gather/scatter root buffer). Schedules copy or
/// reduce a region onto itself by skipping the copy or the second operand.
pub struct IoBuffers<'a> {
    input: *const u8,
    input_len: usize,
    output: *mut u8,
    output_len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: IoBuffers is a pair of byte regions handed to one execution at a
// time; sending it to another thread is as safe as sending the borrows.
unsafe impl Send for IoBuffers<'_> {}
unsafe impl Sync for IoBuffers<'_> {}

impl<'a> IoBuffers<'a> {
    /// One buffer that is both input and output.
    pub fn in_place(buf: &'a mut [u8]) -> IoBuffers<'a> {
        IoBuffers {
            input: buf.as_ptr(),
            input_len: buf.len(),
            output: buf.as_mut_ptr(),
            output_len: buf.len(),
            _borrow: PhantomData,
        }
    }

    /// Separate input and output.
    pub fn separate(input: &'a [u8], output: &'a mut [u8]) -> IoBuffers<'a> {
        IoBuffers {
            input: input.as_ptr(),
            input_len: input.len(),
            output: output.as_mut_ptr(),
            output_len: output.len(),
            _borrow: PhantomData,
        }
    }

    /// Buffers from raw parts.
    ///
    /// # Safety
    /// Both regions must stay valid, and be touched by nobody else, until the
    /// execution that receives them has finished or been dropped. They must
    /// overlap only as described on [`IoBuffers`].
    pub unsafe fn from_raw(
        input: *const u8,
        input_len: usize,
        output: *mut u8,
        output_len: usize,
    ) -> IoBuffers<'static> {
        IoBuffers {
            input,
            input_len,
            output,
            output_len,
            _borrow: PhantomData,
        }
    }
}

impl IoBuffers<'_> {
    /// The input (address and length) and the output (address and length),
    /// for code that runs a call without a schedule.
    pub fn raw_parts(&self) -> ((*const u8, usize), (*mut u8, usize)) {
        ((self.input, self.input_len), (self.output, self.output_len))
    }
}

/// Resolved memory of an execution: input, output and scratch.
struct Memory<'a> {
    io: IoBuffers<'a>,
    scratch: *mut u8,
    scratch_len: usize,
    elem: usize,
}

// SAFETY: the raw pointers are only dereferenced for regions that the schedule's
// dependencies keep from being written while anything else touches them.
unsafe impl Send for Memory<'_> {}
unsafe impl Sync for Memory<'_> {}

impl Memory<'_> {
    fn base(&self, buf: BufId) -> (*mut u8, usize) {
        match buf {
            BufId::Input => (self.io.input as *mut u8, self.io.input_len),
            BufId::Output => (self.io.output, self.io.output_len),
            BufId::Scratch => (self.scratch, self.scratch_len),
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
        // SAFETY: checked against the buffer length before execution starts.
        unsafe { self.base(r.buf).0.add(r.offset * self.elem) }
    }

    /// # Safety
    /// No op that writes an overlapping region runs at the same time (the schedule's dependencies).
    unsafe fn slice(&self, r: &Region) -> &[u8] {
        if r.len == 0 {
            return &[];
        }
        std::slice::from_raw_parts(self.ptr(r), r.len * self.elem)
    }

    /// # Safety
    /// No other op touches an overlapping region at the same time (the schedule's dependencies).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, r: &Region) -> &mut [u8] {
        if r.len == 0 {
            return &mut [];
        }
        std::slice::from_raw_parts_mut(self.ptr(r), r.len * self.elem)
    }
}

struct Exec<'a> {
    schedule: &'a Schedule,
    links: &'a [Option<Arc<dyn Link>>],
    call: &'a Call,
    mem: Memory<'a>,
    done: Vec<AtomicBool>,
    /// The task that runs every queue (all queues run in one task, so one
    /// waker is enough), woken when an op finishes or fails.
    progress: AtomicWaker,
    /// The first error; once set, every queue stops.
    failure: Mutex<Option<Error>>,
    failed: AtomicBool,
}

/// Which queue an op runs in.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Queue {
    Local,
    SendTo(usize),
    RecvFrom(usize),
}

fn queue_of(a: &Action) -> Queue {
    match *a {
        Action::Send { peer, .. } => Queue::SendTo(peer),
        Action::Recv { peer, .. } | Action::RecvReduce { peer, .. } => Queue::RecvFrom(peer),
        Action::Copy { .. } | Action::Finalize { .. } => Queue::Local,
    }
}

impl Exec<'_> {
    /// Waits until `ready()` or a failure; true if ready.
    async fn wait_until(&self, ready: impl Fn() -> bool) -> bool {
        poll_fn(|cx| {
            if self.failed.load(Ordering::Acquire) {
                return Poll::Ready(false);
            }
            if ready() {
                return Poll::Ready(true);
            }
            self.progress.register(cx.waker());
            Poll::Pending
        })
        .await
    }

    /// Lets waiting queues look again. A thread that polls again at once
    /// anyway ([`repolling`]) needs no wake-up, which would cost system calls.
    fn notify(&self) {
        if !repolling() {
            self.progress.wake();
        }
    }

    fn fail(&self, e: Error) {
        let mut first = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some(e);
        }
        self.failed.store(true, Ordering::Release);
        self.progress.wake();
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
        FrameHeader::data(
            self.call.comm,
            self.call.seq,
            step,
            len,
            self.call.fingerprint,
        )
    }

    async fn run_queue(&self, ops: &[usize]) {
        for (step, &i) in ops.iter().enumerate() {
            let op = &self.schedule.ops[i];
            let deps_done = || {
                op.deps
                    .iter()
                    .all(|&d| self.done[d as usize].load(Ordering::Acquire))
            };
            if !self.wait_until(deps_done).await {
                return;
            }
            if let Err(e) = self.run_op(op, step as u32).await {
                return self.fail(e);
            }
            self.done[i].store(true, Ordering::Release);
            self.notify();
        }
    }

    /// Runs one op; `Ok` also when a failure elsewhere cancelled it.
    async fn run_op(&self, op: &crate::schedule::Op, step: u32) -> Result<()> {
        {
            // SAFETY (all slices below): the dependencies just awaited order
            // this op after every op that conflicts with its regions.
            match op.action {
                Action::Send { peer, src } => {
                    let data = unsafe { self.mem.slice(&src) };
                    self.link(peer)?
                        .send(self.header(step, data.len()), data)
                        .await?;
                }
                Action::Recv { peer, dst } => {
                    let into = unsafe { self.mem.slice_mut(&dst) };
                    let link = self.link(peer)?;
                    self.unless_failed(link.recv(self.header(step, into.len()), into))
                        .await
                        .transpose()?;
                }
                Action::RecvReduce { peer, dst, local } => {
                    let local = local.filter(|l| self.mem.ptr(l) != self.mem.ptr(&dst));
                    let into = unsafe { self.mem.slice_mut(&dst) };
                    let local = local.map(|l| unsafe { self.mem.slice(&l) });
                    let reduction = Reduction {
                        op: self.call.op,
                        dtype: self.call.dtype(),
                        local,
                    };
                    let link = self.link(peer)?;
                    self.unless_failed(link.recv_reduce(
                        self.header(step, into.len()),
                        into,
                        reduction,
                    ))
                    .await
                    .transpose()?;
                }
                Action::Copy { src, dst } => {
                    if self.mem.ptr(&src) != self.mem.ptr(&dst) {
                        let from = unsafe { self.mem.slice(&src) };
                        unsafe { self.mem.slice_mut(&dst) }.copy_from_slice(from);
                    }
                }
                Action::Finalize { dst } => {
                    let buf = unsafe { self.mem.slice_mut(&dst) };
                    op::finalize(self.call.op, self.call.dtype(), buf, self.call.world_size)?;
                }
            }
        }
        Ok(())
    }
}

/// Runs `schedule` over `links` (indexed by rank; `None` for this rank) on `io`,
/// using `scratch` (grown as needed) for temporary data.
///
/// Errors name the call. Dropping the returned future stops the execution;
/// the links may then be mid-message, so the caller must not reuse them.
pub async fn execute(
    schedule: &Schedule,
    io: IoBuffers<'_>,
    links: &[Option<Arc<dyn Link>>],
    call: &Call,
    scratch: &mut AlignedBuf,
) -> Result<()> {
    execute_within(schedule, io, links, call, scratch, None).await
}

/// [`execute`] under a deadline: past it, fails with [`Error::Timeout`]
/// naming the ranks this rank still waited for (to send data, or to take it).
pub async fn execute_within(
    schedule: &Schedule,
    io: IoBuffers<'_>,
    links: &[Option<Arc<dyn Link>>],
    call: &Call,
    scratch: &mut AlignedBuf,
    deadline: Option<Duration>,
) -> Result<()> {
    run(schedule, io, links, call, scratch, deadline).await
}

async fn run(
    schedule: &Schedule,
    io: IoBuffers<'_>,
    links: &[Option<Arc<dyn Link>>],
    call: &Call,
    scratch: &mut AlignedBuf,
    deadline: Option<Duration>,
) -> Result<()> {
    let elem = call.dtype().size();
    scratch.reserve_len(schedule.scratch_elems * elem);
    let mem = Memory {
        io,
        scratch: scratch.as_mut_slice().as_mut_ptr(),
        scratch_len: scratch.len(),
        elem,
    };
    let mut queues: BTreeMap<Queue, Vec<usize>> = BTreeMap::new();
    for (i, op) in schedule.ops.iter().enumerate() {
        let a = &op.action;
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
        queues.entry(queue_of(a)).or_default().push(i);
    }
    let exec = Exec {
        schedule,
        links,
        call,
        mem,
        done: (0..schedule.ops.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
        progress: AtomicWaker::new(),
        failure: Mutex::new(None),
        failed: AtomicBool::new(false),
    };
    // Every queue is polled on every wake-up of the one task (not only the
    // queue that was woken, as `join_all` does past 30 futures): a queue may
    // wait on another's progress, and `progress` holds a single waker.
    let mut running: Vec<_> = queues
        .values()
        .map(|q| Some(Box::pin(exec.run_queue(q))))
        .collect();
    let all = poll_fn(|cx| {
        let mut pending = false;
        for slot in running.iter_mut() {
            if let Some(queue) = slot {
                match queue.as_mut().poll(cx) {
                    Poll::Ready(()) => *slot = None,
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    });
    let drain = async {
        exec.wait_until(|| false).await;
        tokio::time::sleep(SEND_DRAIN).await;
    };
    let limit = async {
        match deadline {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    // Everything finishes (successfully, or with the sends drained after a
    // failure), or the drain time runs out first, or the deadline.
    if let Either::Right(_) = select(select(pin!(all), pin!(drain)), pin!(limit)).await {
        let waiting = |send: bool| -> Vec<usize> {
            queues
                .iter()
                .filter(|(_, ops)| ops.iter().any(|&i| !exec.done[i].load(Ordering::Acquire)))
                .filter_map(|(q, _)| match *q {
                    Queue::RecvFrom(p) if !send => Some(p),
                    Queue::SendTo(p) if send => Some(p),
                    _ => None,
                })
                .collect()
        };
        let (from, to) = (waiting(false), waiting(true));
        return Err(Error::Timeout {
            context: format!("rank {}: {}", call.rank, call.name()),
            what: format!(
                "data from rank(s) {from:?} and rank(s) {to:?} to take this rank's \
                 (they did not make this call, or are stuck)"
            ),
            after: deadline.unwrap_or_default(),
        });
    }
    let failure = exec
        .failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    match failure {
        Some(e) => Err(e.in_call(&call.name())),
        None => Ok(()),
    }
}
