//! The typed API: every collective in place, out of place and
//! asynchronously on owned `Vec`s, for any [`Element`] type. The methods are
//! generated (`in_place!`, `out_of_place!`, `launch_in_place!`) or written
//! as one line over four generic forms, which turn slices into the untyped
//! call of `call.rs`.

use std::ops::Range;

use ccl_core::{
    BufMut, BufRef, Collective, CollectiveKind, Element, Error, MemoryKind, ReduceOp, Result, Work,
};

use crate::Communicator;

/// A blocking collective in place: `fn name(&self, buf, args...)`.
macro_rules! in_place {
    ($(#[$doc:meta])* $name:ident, $kind:ident $(, $arg:ident: $ty:ty => $with:ident)*) => {
        $(#[$doc])*
        pub fn $name<T: Element>(&self, buf: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            self.in_place(of::<T>(CollectiveKind::$kind)$(.$with($arg))*, buf)
        }
    };
}

/// A blocking collective out of place: `fn name(&self, input, output, args...)`.
macro_rules! out_of_place {
    ($(#[$doc:meta])* $name:ident, $kind:ident $(, $arg:ident: $ty:ty => $with:ident)*) => {
        $(#[$doc])*
        pub fn $name<T: Element>(&self, input: &[T], output: &mut [T] $(, $arg: $ty)*) -> Result<()> {
            self.out_of_place(of::<T>(CollectiveKind::$kind)$(.$with($arg))*, input, output)
        }
    };
}

/// An asynchronous collective in place on an owned buffer, which the `Work` hands back.
macro_rules! launch_in_place {
    ($(#[$doc:meta])* $name:ident, $kind:ident $(, $arg:ident: $ty:ty => $with:ident)*) => {
        $(#[$doc])*
        pub fn $name<T: Element>(&self, buf: Vec<T> $(, $arg: $ty)*) -> Work<Vec<T>> {
            self.launch_in_place(of::<T>(CollectiveKind::$kind)$(.$with($arg))*, buf)
        }
    };
}

/// The template of a call of `kind` on `T` (its count is filled in from the buffers).
fn of<T: Element>(kind: CollectiveKind) -> Collective {
    Collective::new(kind, T::DTYPE, 0)
}

impl Communicator {
    /// `template` (a [`Collective`] of count 0) with the count that one
    /// buffer of `len` elements holds in place, as the typed methods count
    /// it: `world_size` blocks of it where the collective has a block per
    /// rank (allgather, reduce-scatter, all-to-all; gather and scatter at
    /// the root), else all of it.
    pub fn count_in_place(&self, template: Collective, len: usize) -> Result<Collective> {
        let (rank, n) = (self.rank(), self.world_size());
        let blocks = match template.kind {
            CollectiveKind::AllGather
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllToAll => n,
            CollectiveKind::Gather | CollectiveKind::Scatter if rank == template.root => n,
            _ => 1,
        };
        if len % blocks != 0 {
            return Err(Error::InvalidArgument(format!(
                "{} on rank {rank}: buffer of {len} elements does not divide into {n} equal blocks",
                template.kind
            )));
        }
        Ok(Collective {
            count: len / blocks,
            ..template
        })
    }

    /// `template` (a [`Collective`] of count 0) with the count of an
    /// out-of-place call on `input_len` and `output_len` elements: the
    /// output's where every rank has one and not every rank an input
    /// (broadcast) or the output is one rank's block (reduce-scatter,
    /// scatter), one of `world_size` blocks of the input for all-to-all,
    /// the input's otherwise.
    pub fn count_out_of_place(
        &self,
        template: Collective,
        input_len: usize,
        output_len: usize,
    ) -> Result<Collective> {
        let count = match template.kind {
            CollectiveKind::Broadcast | CollectiveKind::ReduceScatter | CollectiveKind::Scatter => {
                output_len
            }
            CollectiveKind::AllToAll => return self.count_in_place(template, input_len),
            _ => input_len,
        };
        Ok(Collective { count, ..template })
    }

    /// Where input and output lie in one buffer of a call in place, in
    /// elements: this rank's block of the output is its input (allgather,
    /// gather), its block of the input is its output (reduce-scatter,
    /// scatter), or both start at the buffer (the rest).
    pub fn in_place_ranges(&self, coll: &Collective) -> (Range<usize>, Range<usize>) {
        let rank = self.rank();
        let (ni, no) = coll.buffer_elems(rank, self.world_size());
        let block = rank * coll.count;
        match coll.kind {
            CollectiveKind::AllGather | CollectiveKind::Gather if no > 0 => {
                (block..block + ni, 0..no)
            }
            CollectiveKind::ReduceScatter | CollectiveKind::Scatter if ni > 0 => {
                (0..ni, block..block + no)
            }
            _ => (0..ni, 0..no),
        }
    }

    /// A call in place on `buf`.
    fn in_place<T: Element>(&self, template: Collective, buf: &mut [T]) -> Result<()> {
        let coll = self.count_in_place(template, buf.len())?;
        let (input, output) = self.in_place_ranges(&coll);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let (base, s) = (bytes.as_mut_ptr(), T::DTYPE.size());
        // SAFETY: both ranges lie within `buf`, borrowed mutably for this
        // blocking call, overlapping only in the layouts the call accepts.
        let (input, output) = unsafe {
            (
                BufRef::from_raw(MemoryKind::Host, base.add(input.start * s), input.len() * s),
                BufMut::from_raw(
                    MemoryKind::Host,
                    base.add(output.start * s),
                    output.len() * s,
                ),
            )
        };
        self.run(&coll, input, output)
    }

    /// A call from `input` into `output`.
    fn out_of_place<T: Element>(
        &self,
        template: Collective,
        input: &[T],
        output: &mut [T],
    ) -> Result<()> {
        let coll = self.count_out_of_place(template, input.len(), output.len())?;
        self.run(
            &coll,
            BufRef::from_host(bytemuck::cast_slice(input)),
            BufMut::from_host(bytemuck::cast_slice_mut(output)),
        )
    }

    /// An asynchronous call in place on `buf`, which the `Work` hands back.
    fn launch_in_place<T: Element>(&self, template: Collective, mut buf: Vec<T>) -> Work<Vec<T>> {
        let coll = match self.count_in_place(template, buf.len()) {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        let (input, output) = self.in_place_ranges(&coll);
        let (base, s) = (buf.as_mut_ptr().cast::<u8>(), T::DTYPE.size());
        // SAFETY: both ranges lie within `buf`'s heap memory, which does not
        // move when `buf` moves into the completion; that keeps it alive and
        // untouched until the engine is done with it.
        unsafe {
            let input =
                BufRef::from_raw(MemoryKind::Host, base.add(input.start * s), input.len() * s);
            let output = BufMut::from_raw(
                MemoryKind::Host,
                base.add(output.start * s),
                output.len() * s,
            );
            self.launch_then(&coll, input, output, move || buf)
        }
    }

    /// An asynchronous call from `input` into a new output of `output_len`
    /// elements, which the `Work` yields.
    fn launch_out_of_place<T: Element>(
        &self,
        template: Collective,
        input: Vec<T>,
        output_len: usize,
    ) -> Work<Vec<T>> {
        let mut output = vec![T::zeroed(); output_len];
        let coll = match self.count_out_of_place(template, input.len(), output_len) {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        let input_bytes: &[u8] = bytemuck::cast_slice(&input);
        let output_bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut output);
        // SAFETY: the vectors' heap memory does not move when they move into
        // the completion, which keeps them alive until the engine is done.
        unsafe {
            let input_buf =
                BufRef::from_raw(MemoryKind::Host, input_bytes.as_ptr(), input_bytes.len());
            let output_buf = BufMut::from_raw(
                MemoryKind::Host,
                output_bytes.as_mut_ptr(),
                output_bytes.len(),
            );
            self.launch_then(&coll, input_buf, output_buf, move || {
                drop(input);
                output
            })
        }
    }

    in_place! {
        /// Reduces `buf` across all ranks, in place: every rank gets the result.
        allreduce, AllReduce, op: ReduceOp => with_op
    }
    out_of_place! {
        /// Reduces `input` across all ranks into `output` (same length).
        allreduce_into, AllReduce, op: ReduceOp => with_op
    }
    launch_in_place! {
        /// Asynchronous [`Communicator::allreduce`] on an owned buffer.
        iallreduce, AllReduce, op: ReduceOp => with_op
    }

    in_place! {
        /// Copies `root`'s `buf` into every rank's `buf`.
        broadcast, Broadcast, root: usize => with_root
    }
    out_of_place! {
        /// Copies `root`'s `input` into every rank's `output`; `input` is read on the root only.
        broadcast_into, Broadcast, root: usize => with_root
    }
    launch_in_place! {
        /// Asynchronous [`Communicator::broadcast`] on an owned buffer.
        ibroadcast, Broadcast, root: usize => with_root
    }

    in_place! {
        /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' `buf` is left as it was.
        reduce, Reduce, op: ReduceOp => with_op, root: usize => with_root
    }
    out_of_place! {
        /// Reduces every rank's `input` into `root`'s `output` (ignored on other ranks).
        reduce_into, Reduce, op: ReduceOp => with_op, root: usize => with_root
    }
    launch_in_place! {
        /// Asynchronous reduce: the root gets the result; other ranks get their input back.
        ireduce, Reduce, op: ReduceOp => with_op, root: usize => with_root
    }

    in_place! {
        /// In-place allgather: `buf` holds world_size blocks, this rank's contribution in block `rank`.
        allgather, AllGather
    }
    out_of_place! {
        /// Gathers every rank's `input` into `output` (world_size × input length), in rank order.
        allgather_into, AllGather
    }

    /// Asynchronous allgather: returns world_size × input length elements.
    pub fn iallgather<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let len = input.len() * self.world_size();
        self.launch_out_of_place(of::<T>(CollectiveKind::AllGather), input, len)
    }

    in_place! {
        /// In-place reduce-scatter: `buf` holds world_size blocks; block `rank` receives this rank's share of the result.
        reduce_scatter, ReduceScatter, op: ReduceOp => with_op
    }
    out_of_place! {
        /// Reduces `input` (world_size blocks of `output`'s length) across ranks; block `rank` of the result lands in `output`.
        reduce_scatter_into, ReduceScatter, op: ReduceOp => with_op
    }

    /// Asynchronous reduce-scatter: returns this rank's block of the reduced `input`.
    pub fn ireduce_scatter<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let block = input.len() / self.world_size();
        let template = of::<T>(CollectiveKind::ReduceScatter).with_op(op);
        self.launch_out_of_place(template, input, block)
    }

    in_place! {
        /// In-place all-to-all on world_size blocks.
        alltoall, AllToAll
    }
    out_of_place! {
        /// Sends block p of `input` to rank p; block p of `output` comes from rank p.
        alltoall_into, AllToAll
    }

    /// Asynchronous all-to-all: returns the received blocks.
    pub fn ialltoall<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let len = input.len();
        self.launch_out_of_place(of::<T>(CollectiveKind::AllToAll), input, len)
    }

    in_place! {
        /// In-place gather: on the root `buf` holds world_size blocks with the root's own in block `root`;
        /// elsewhere `buf` is this rank's contribution.
        gather, Gather, root: usize => with_root
    }
    out_of_place! {
        /// Gathers every rank's `input` into `root`'s `output` (world_size × input length; ignored elsewhere).
        gather_into, Gather, root: usize => with_root
    }

    /// Asynchronous gather: the root gets world_size × input length elements, others an empty vector.
    pub fn igather<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Vec<T>> {
        let blocks = if self.rank() == root {
            self.world_size()
        } else {
            0
        };
        let len = input.len() * blocks;
        self.launch_out_of_place(of::<T>(CollectiveKind::Gather).with_root(root), input, len)
    }

    in_place! {
        /// In-place scatter: on the root `buf` holds world_size blocks and keeps block `root`;
        /// elsewhere `buf` receives this rank's block.
        scatter, Scatter, root: usize => with_root
    }
    out_of_place! {
        /// Sends block p of `root`'s `input` (world_size × output length; ignored elsewhere) to rank p's `output`.
        scatter_into, Scatter, root: usize => with_root
    }

    /// Asynchronous scatter of `count` elements per rank: `input` (world_size × count) is read on the root only.
    pub fn iscatter<T: Element>(&self, input: Vec<T>, count: usize, root: usize) -> Work<Vec<T>> {
        self.launch_out_of_place(
            of::<T>(CollectiveKind::Scatter).with_root(root),
            input,
            count,
        )
    }

    // ---- barrier ----------------------------------------------------------

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.out_of_place::<u8>(of::<u8>(CollectiveKind::Barrier), &[], &mut [])
    }

    /// Asynchronous barrier.
    pub fn ibarrier(&self) -> Work<()> {
        let coll = of::<u8>(CollectiveKind::Barrier);
        // SAFETY: no memory.
        unsafe {
            self.launch_then(
                &coll,
                BufRef::from_host(&[]),
                BufMut::from_host(&mut []),
                || (),
            )
        }
    }

    // ---- point to point ---------------------------------------------------

    /// Sends `buf` to rank `dst`, which must call [`Communicator::recv`] with the same length.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.send_raw(T::DTYPE, dst, BufRef::from_host(bytemuck::cast_slice(buf)))
    }

    /// Receives into `buf` from rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.recv_raw(
            T::DTYPE,
            src,
            BufMut::from_host(bytemuck::cast_slice_mut(buf)),
        )
    }

    /// Sends `send` to rank `dst` while receiving into `recv` from rank
    /// `src`, both at once (MPI's `Sendrecv`): ranks that all send before
    /// they receive, as in a shift around a ring, do not wait on each other.
    pub fn sendrecv<T: Element>(
        &self,
        send: &[T],
        dst: usize,
        recv: &mut [T],
        src: usize,
    ) -> Result<()> {
        let data = BufRef::from_host(bytemuck::cast_slice(send));
        let into = BufMut::from_host(bytemuck::cast_slice_mut(recv));
        // SAFETY: both are waited for, whatever the outcome, before the
        // borrows end.
        let (received, sent) = unsafe {
            (
                self.launch_recv(T::DTYPE, src, into),
                self.launch_send(T::DTYPE, dst, data),
            )
        };
        // The send first: waiting for the receive first made a 2-rank
        // exchange of 2 MiB take 275-279 µs against 165-187.
        let (s, r) = (sent.wait(), received.wait());
        r.and(s)
    }

    /// Asynchronous send; the `Work` hands the buffer back.
    pub fn isend<T: Element>(&self, mut buf: Vec<T>, dst: usize) -> Work<Vec<T>> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        // SAFETY: as in `launch_in_place`: `buf` moves into the completion,
        // its heap memory stays put.
        unsafe {
            let mem = BufMut::from_raw(MemoryKind::Host, bytes.as_mut_ptr(), bytes.len());
            self.launch_transfer(T::DTYPE, dst, true, mem, move || buf)
        }
    }

    /// Asynchronous receive into an owned buffer of the expected length.
    pub fn irecv<T: Element>(&self, mut buf: Vec<T>, src: usize) -> Work<Vec<T>> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        // SAFETY: as in `isend`.
        unsafe {
            let mem = BufMut::from_raw(MemoryKind::Host, bytes.as_mut_ptr(), bytes.len());
            self.launch_transfer(T::DTYPE, src, false, mem, move || buf)
        }
    }
}
