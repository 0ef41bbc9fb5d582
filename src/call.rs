//! The one untyped call path. Every call — the typed Rust methods, and the
//! C and Python bindings — comes here as a [`Collective`] and memory that
//! knows where it lives ([`BufRef`], [`BufMut`]): it is checked (arguments,
//! lengths, layout, memory kind) before anything is sent, a pre-multiplied
//! sum scales a copy of its input, and then it runs on this thread (a group
//! algorithm with nothing queued) or goes to the engine as a job.

use std::ptr::NonNull;

use ccl_algorithms::{Algorithm, Choice, IoBuffers};
use ccl_core::{
    work_pair, BufMut, BufRef, Call, Collective, CollectiveKind, DataType, Error, Kernels,
    MemoryKind, ReduceOp, Result, Scratch, Work, HOST_KERNELS,
};

use crate::{
    engine::{Before, Done, Job, Plan},
    Communicator,
};

/// The "kernels" of GPU memory that a link moves as it is (GPUDirect RDMA):
/// a transfer's buffers carry their kind to the link, and nothing here may
/// touch their bytes, so every operation is refused.
struct MovedByLinks(MemoryKind);

impl MovedByLinks {
    /// The one value for `kind`, made at its first use (one per GPU).
    fn of(kind: MemoryKind) -> &'static dyn Kernels {
        static MADE: std::sync::Mutex<Vec<&'static MovedByLinks>> =
            std::sync::Mutex::new(Vec::new());
        let mut made = MADE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = made.iter().find(|k| k.0 == kind) {
            return *k;
        }
        let k: &'static MovedByLinks = Box::leak(Box::new(MovedByLinks(kind)));
        made.push(k);
        k
    }

    fn refuse(&self, what: &str) -> Error {
        Error::Internal(format!(
            "{what} on {}, which only a link moves here (GPUDirect RDMA)",
            self.0
        ))
    }
}

impl Kernels for MovedByLinks {
    fn kind(&self) -> MemoryKind {
        self.0
    }

    fn reduce(
        &self,
        _: ReduceOp,
        _: DataType,
        _: BufMut<'_>,
        _: Option<BufRef<'_>>,
        _: BufRef<'_>,
    ) -> Result<()> {
        Err(self.refuse("a reduction"))
    }

    fn prescale(&self, _: ReduceOp, _: DataType, _: BufMut<'_>) -> Result<()> {
        Err(self.refuse("a scaling"))
    }

    fn finalize(&self, _: ReduceOp, _: DataType, _: BufMut<'_>, _: usize) -> Result<()> {
        Err(self.refuse("a division"))
    }

    fn copy(&self, _: BufMut<'_>, _: BufRef<'_>) -> Result<()> {
        Err(self.refuse("a copy"))
    }

    /// Empty scratch only: a transfer's schedule asks for none.
    fn alloc(&self, len: usize) -> Result<Scratch> {
        if len > 0 {
            return Err(self.refuse("scratch"));
        }
        // SAFETY: no bytes to access.
        Ok(unsafe { Scratch::from_raw(self.0, NonNull::dangling().as_ptr(), 0, Box::new(())) })
    }
}

/// The kernels for memory of `kind`.
fn kernels_for(kind: MemoryKind) -> Result<&'static dyn Kernels> {
    match kind {
        MemoryKind::Host => Ok(&HOST_KERNELS),
        kind => Err(Error::Unsupported(format!(
            "buffers in {kind}: device memory goes through launch_on_stream, ordered on a stream"
        ))),
    }
}

/// A call's memory, checked and ready for the engine: its buffers (with
/// the lifetime erased; see [`Communicator::prepare`]) and the scaled copy
/// of the input that a pre-multiplied sum reads, which must live as long.
pub(crate) struct Prepared {
    pub io: IoBuffers<'static>,
    pub scaled: Option<Scratch>,
}

/// The error of a call with bad arguments (kept off the call path).
#[cold]
#[inline(never)]
fn invalid(coll: &Collective, rank: usize, what: std::fmt::Arguments<'_>) -> Error {
    Error::InvalidArgument(format!("{coll} on rank {rank}: {what}"))
}

/// The error of a buffer of `bytes` where `want` elements were expected.
#[cold]
#[inline(never)]
fn bad_len(coll: &Collective, rank: usize, what: &str, bytes: usize, want: usize) -> Error {
    let size = coll.dtype.size();
    let got = if bytes % size == 0 {
        format!("{} elements", bytes / size)
    } else {
        format!("{bytes} bytes, not whole {} elements", coll.dtype)
    };
    invalid(
        coll,
        rank,
        format_args!("{what} has {got}, expected {want}"),
    )
}

/// Whether two regions share a byte.
fn overlap(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

impl Communicator {
    /// Runs the collective `coll` with `input` and `output` and returns when
    /// it is done, like the typed methods (which call it).
    ///
    /// Lengths are in bytes and must be what the collective needs on this
    /// rank ([`Collective::buffer_elems`] elements of `coll.dtype`); a buffer
    /// the rank's role does not use (a broadcast's input off the root, a
    /// reduce's or gather's output off the root) is ignored, whatever it is. Input and output may be the same memory, or lie one in
    /// the other at this rank's block (allgather and gather: the input in
    /// the output; reduce-scatter and scatter: the output in the input);
    /// any other overlap is an error. Both lie in one kind of memory.
    pub fn run(&self, coll: &Collective, input: BufRef<'_>, output: BufMut<'_>) -> Result<()> {
        // SAFETY: the borrows outlive the call: this returns only when the
        // engine no longer touches the memory.
        let prepared = unsafe { self.prepare(coll, input, output)? };
        let inner = &self.inner;
        let choice = inner.selection.choice(coll);
        if choice.algorithm.on_group_memory() {
            let call = || self.next_call(coll, choice);
            if let Some(result) =
                inner
                    .engine
                    .run_group_now(choice.algorithm, call, &prepared.io, self.timeout())
            {
                return result;
            }
        }
        let Prepared { io, scaled } = prepared;
        let make = self.job(coll, choice, io, None)?;
        let result = match inner.engine.run_now(make) {
            Ok(result) => result,
            Err(make) => {
                let (work, completer) = work_pair::<()>();
                inner
                    .engine
                    .submit(|| make(Box::new(move |r| completer.complete(r))));
                work.wait()
            }
        };
        drop(scaled);
        result
    }

    /// Queues the collective `coll` with `input` and `output` (as
    /// [`Communicator::run`] describes them) and returns at once.
    ///
    /// # Safety
    /// The memory must stay valid, and be neither written (input) nor
    /// accessed (output) by anyone else, until the returned `Work` completes.
    pub unsafe fn launch(
        &self,
        coll: &Collective,
        input: BufRef<'_>,
        output: BufMut<'_>,
    ) -> Work<()> {
        self.launch_then(coll, input, output, || ())
    }

    /// Sends `data` (elements of `dtype`) to rank `peer`, which receives it
    /// with [`Communicator::recv_raw`] (or `recv`) of the same length.
    pub fn send_raw(&self, dtype: DataType, peer: usize, data: BufRef<'_>) -> Result<()> {
        // SAFETY: waited for before the borrow ends.
        let mem = unsafe { BufMut::from_raw(data.kind(), data.as_ptr().cast_mut(), data.len()) };
        unsafe { self.launch_transfer(dtype, peer, true, mem, || ()) }.wait()
    }

    /// Receives into `into` (elements of `dtype`) from rank `peer`.
    pub fn recv_raw(&self, dtype: DataType, peer: usize, into: BufMut<'_>) -> Result<()> {
        // SAFETY: waited for before the borrow ends.
        unsafe { self.launch_transfer(dtype, peer, false, into, || ()) }.wait()
    }

    /// Queues a send of `data` to `peer`.
    ///
    /// # Safety
    /// As for [`Communicator::launch`].
    pub unsafe fn launch_send(&self, dtype: DataType, peer: usize, data: BufRef<'_>) -> Work<()> {
        let mem = BufMut::from_raw(data.kind(), data.as_ptr().cast_mut(), data.len());
        self.launch_transfer(dtype, peer, true, mem, || ())
    }

    /// Queues a receive into `into` from `peer`.
    ///
    /// # Safety
    /// As for [`Communicator::launch`].
    pub unsafe fn launch_recv(&self, dtype: DataType, peer: usize, into: BufMut<'_>) -> Work<()> {
        self.launch_transfer(dtype, peer, false, into, || ())
    }

    // ---- inside the call path ----------------------------------------------

    /// [`Communicator::launch`], whose `Work` yields `finish()` (which may
    /// hand back the owners of the memory).
    ///
    /// # Safety
    /// As for [`Communicator::launch`].
    pub(crate) unsafe fn launch_then<R: Send + 'static>(
        &self,
        coll: &Collective,
        input: BufRef<'_>,
        output: BufMut<'_>,
        finish: impl FnOnce() -> R + Send + 'static,
    ) -> Work<R> {
        let Prepared { io, scaled } = match self.prepare(coll, input, output) {
            Ok(p) => p,
            Err(e) => return Work::ready(Err(e)),
        };
        let (work, completer) = work_pair();
        let done: Done = Box::new(move |r| {
            drop(scaled);
            completer.complete(r.map(|()| finish()))
        });
        let choice = self.inner.selection.choice(coll);
        self.submit(coll, choice, io, None, done);
        work
    }

    /// Checks a call's arguments and memory (see [`Communicator::run`]) and
    /// makes its buffers: a pre-multiplied sum reads a scaled copy of the
    /// input.
    ///
    /// # Safety
    /// The returned buffers outlive `input` and `output`: the caller keeps
    /// the memory valid and untouched until the engine is done with them.
    pub(crate) unsafe fn prepare(
        &self,
        coll: &Collective,
        input: BufRef<'_>,
        output: BufMut<'_>,
    ) -> Result<Prepared> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        if coll.kind == CollectiveKind::SendRecv {
            return Err(invalid(
                coll,
                rank,
                format_args!("point-to-point transfers go through send and recv"),
            ));
        }
        coll.validate(rank, n)?;
        // A buffer this rank's role does not use is ignored (a broadcast's
        // input off the root, a reduce's output off the root), as NCCL does.
        let (need_in, need_out) = coll.buffer_elems(rank, n);
        let (input, mut output) = match (need_in, need_out) {
            (0, 0) => (BufRef::from_host(&[]), BufMut::from_host(&mut [])),
            (0, _) => (
                BufRef::from_raw(output.kind(), NonNull::dangling().as_ptr(), 0),
                output,
            ),
            (_, 0) => (
                input,
                BufMut::from_raw(input.kind(), NonNull::dangling().as_ptr(), 0),
            ),
            _ => (input, output),
        };
        if input.kind() != output.kind() {
            return Err(invalid(
                coll,
                rank,
                format_args!(
                    "the input lies in {} and the output in {}",
                    input.kind(),
                    output.kind()
                ),
            ));
        }
        let kernels = kernels_for(output.kind())?;
        let size = coll.dtype.size();
        let in_place =
            input.as_ptr() == output.as_mut_ptr().cast_const() && input.len() == output.len();
        if output.len() != need_out * size {
            return Err(bad_len(coll, rank, "output", output.len(), need_out));
        }
        if input.len() != need_in * size && !in_place {
            return Err(bad_len(coll, rank, "input", input.len(), need_in));
        }
        // Overlap only in the layouts the schedules are written for.
        let (i, o) = (
            (input.as_ptr() as usize, input.len()),
            (output.as_mut_ptr() as usize, output.len()),
        );
        let nested = || {
            let block = rank * coll.count * size;
            match coll.kind {
                CollectiveKind::AllGather | CollectiveKind::Gather => i.0 == o.0 + block,
                CollectiveKind::ReduceScatter | CollectiveKind::Scatter => o.0 == i.0 + block,
                _ => false,
            }
        };
        if !in_place && overlap(i, o) && !nested() {
            return Err(invalid(
                coll,
                rank,
                format_args!("input and output overlap, other than in place"),
            ));
        }
        let scaled = match coll.op {
            ReduceOp::PreMulSum(_) if coll.reduces() && !input.is_empty() => {
                let mut copy = kernels.alloc(input.len())?;
                kernels.copy(copy.buf_mut(), input)?;
                kernels.prescale(coll.op, coll.dtype, copy.buf_mut())?;
                Some(copy)
            }
            _ => None,
        };
        let from = scaled.as_ref().map_or(input, Scratch::buf);
        let io = IoBuffers::from_raw(
            from.as_ptr(),
            from.len(),
            output.as_mut_ptr(),
            output.len(),
            kernels,
        );
        Ok(Prepared { io, scaled })
    }

    /// Takes the call's sequence number and logs the choice (called by the
    /// engine under its queue lock, so that numbers follow queue order).
    pub(crate) fn next_call(&self, coll: &Collective, choice: Choice) -> Call {
        let inner = &self.inner;
        let call = Call {
            comm: inner.comm,
            // Only the engine's queue lock holder numbers calls: a load and a
            // store, where a read-modify-write would cost a locked instruction.
            seq: {
                let seq = inner.seq.load(std::sync::atomic::Ordering::Relaxed);
                inner
                    .seq
                    .store(seq + 1, std::sync::atomic::Ordering::Relaxed);
                seq
            },
            rank: inner.rank,
            world_size: inner.world_size,
            coll: *coll,
        };
        tracing::debug!(rank = inner.rank, call = %call.name(), algorithm = %choice, "collective");
        call
    }

    /// Plans `coll` with `choice` and queues it for the engine, which runs
    /// `before` first (if any); `done` gets the result once `io` is no
    /// longer touched.
    pub(crate) fn submit(
        &self,
        coll: &Collective,
        choice: Choice,
        io: IoBuffers<'static>,
        before: Option<Before>,
        done: Done,
    ) {
        match self.job(coll, choice, io, before) {
            Ok(make) => self.inner.engine.submit(|| make(done)),
            Err(e) => done(Err(e)),
        }
    }

    /// Plans `coll` with `choice`; what makes its job, given what receives
    /// the result. Making it takes the call's sequence number, so the engine
    /// does that under its queue lock.
    fn job<'s>(
        &'s self,
        coll: &'s Collective,
        choice: Choice,
        io: IoBuffers<'static>,
        before: Option<Before>,
    ) -> Result<impl FnOnce(Done) -> Job + 's> {
        let plan = self.inner.selection.plan(coll, choice, io.layout())?;
        let deadline = self.timeout();
        Ok(move |done| Job {
            plan,
            call: self.next_call(coll, choice),
            io,
            deadline,
            lane: None,
            before,
            done,
        })
    }

    /// Queues a point-to-point transfer of `mem` (`send`: to `peer`, else
    /// from `peer`); its `Work` yields `finish()`.
    ///
    /// # Safety
    /// As for [`Communicator::launch`].
    pub(crate) unsafe fn launch_transfer<R: Send + 'static>(
        &self,
        dtype: DataType,
        peer: usize,
        send: bool,
        mem: BufMut<'_>,
        finish: impl FnOnce() -> R + Send + 'static,
    ) -> Work<R> {
        let (work, completer) = work_pair();
        let done: Done = Box::new(move |r| completer.complete(r.map(|()| finish())));
        self.submit_transfer(dtype, peer, send, mem, None, done);
        work
    }

    /// Checks a point-to-point transfer of `mem` and queues it on its lane,
    /// to start after `before` (if any); `done` gets its result, or the
    /// reason it was refused.
    ///
    /// # Safety
    /// As for [`Communicator::launch`], until `done` is called.
    pub(crate) unsafe fn submit_transfer(
        &self,
        dtype: DataType,
        peer: usize,
        send: bool,
        mut mem: BufMut<'_>,
        before: Option<Before>,
        done: Done,
    ) {
        let inner = &self.inner;
        let size = dtype.size();
        let coll =
            Collective::new(CollectiveKind::SendRecv, dtype, mem.len() / size).with_root(peer);
        let checked = coll.validate(inner.rank, inner.world_size).and_then(|()| {
            if mem.len() % size != 0 {
                return Err(Error::InvalidArgument(format!(
                    "{coll} on rank {}: {} bytes are not whole {dtype} elements",
                    inner.rank,
                    mem.len()
                )));
            }
            match mem.kind() {
                kind @ MemoryKind::Device { .. } if inner.device_links.get(peer) == Some(&true) => {
                    Ok(MovedByLinks::of(kind))
                }
                kind => kernels_for(kind),
            }
        });
        let kernels = match checked {
            Ok(k) => k,
            Err(e) => return done(Err(e)),
        };
        let (ptr, len) = (mem.as_mut_ptr(), mem.len());
        let io = if send {
            IoBuffers::from_raw(ptr, len, std::ptr::NonNull::dangling().as_ptr(), 0, kernels)
        } else {
            IoBuffers::from_raw(std::ptr::NonNull::dangling().as_ptr(), 0, ptr, len, kernels)
        };
        let schedule = std::sync::Arc::new(ccl_algorithms::transfer(peer, coll.count, send));
        let deadline = self.timeout();
        // Numbered under the engine's queue lock, in queue order.
        let next_call = || {
            let mut seqs = inner.p2p_seq.lock().unwrap_or_else(|p| p.into_inner());
            let seq = seqs.entry((peer, send)).or_insert(0);
            *seq += 1;
            Call {
                comm: inner.comm,
                seq: *seq,
                rank: inner.rank,
                world_size: inner.world_size,
                coll,
            }
        };
        inner.engine.submit(|| Job {
            plan: Plan::Schedule(schedule),
            call: next_call(),
            io,
            deadline,
            lane: Some((peer, send)),
            before,
            done,
        });
    }

    /// Whether an allreduce of `count` elements of `dtype` runs on group
    /// memory here, so that [`Communicator::launch_allreduce_on`] can take
    /// several buffers.
    pub(crate) fn allreduces_on_group(&self, count: usize, dtype: DataType) -> bool {
        let coll = Collective::new(CollectiveKind::AllReduce, dtype, count);
        self.inner.selection.has_group_memory()
            && self
                .inner
                .selection
                .choice(&coll)
                .algorithm
                .on_group_memory()
    }

    /// An in-place allreduce of host buffers taken end to end as one
    /// (`pieces`: address and bytes), with neither packing nor unpacking:
    /// board-direct reads and writes each where it lies. For communicators
    /// where [`Communicator::allreduces_on_group`] holds; elsewhere it fails.
    ///
    /// # Safety
    /// As for [`Communicator::launch`], for every piece; pieces must not overlap.
    pub(crate) unsafe fn launch_allreduce_on<R: Send + 'static>(
        &self,
        dtype: DataType,
        op: ReduceOp,
        pieces: Vec<(*mut u8, usize)>,
        finish: impl FnOnce() -> R + Send + 'static,
    ) -> Work<R> {
        let count = pieces.iter().map(|&(_, len)| len).sum::<usize>() / dtype.size();
        let coll = Collective::new(CollectiveKind::AllReduce, dtype, count).with_op(op);
        let checked = coll
            .validate(self.inner.rank, self.inner.world_size)
            .and_then(|()| {
                if self.inner.selection.has_group_memory() {
                    Ok(())
                } else {
                    Err(Error::Internal(
                        "an allreduce on several buffers needs group memory".into(),
                    ))
                }
            });
        if let Err(e) = checked {
            return Work::ready(Err(e));
        }
        if matches!(op, ReduceOp::PreMulSum(_)) {
            // The buffers are the call's own: scale them where they lie.
            for &(ptr, len) in &pieces {
                let buf = BufMut::from_raw(MemoryKind::Host, ptr, len);
                if let Err(e) = HOST_KERNELS.prescale(op, dtype, buf) {
                    return Work::ready(Err(e));
                }
            }
        }
        let io = IoBuffers::pieces_in_place(pieces, &HOST_KERNELS);
        let (work, completer) = work_pair();
        let done: Done = Box::new(move |r| completer.complete(r.map(|()| finish())));
        self.submit(&coll, Algorithm::BoardDirect.into(), io, None, done);
        work
    }
}
