//! Collectives on GPU memory, ordered on the caller's stream as NCCL's are.
//!
//! A device call is checked (arguments, lengths, and where its memory
//! really lives, asked of the driver). Where every rank is on this host it
//! runs through CUDA IPC, wholly on the caller's stream
//! ([`ccl_transport_cuda_ipc::ipc`]). Elsewhere it is staged: cut into chunks, each
//! copied into pinned host memory on the GPU's copy stream, reduced or moved
//! by a host collective over this communicator's links, and copied back
//! ([`ccl_transport_cuda_ipc::staging`]). The chunks' collectives are queued
//! at once, in order, each gated on its copy; the caller's stream waits on
//! the GPU for the last chunk, and the returned `Work` completes then too.

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use ccl_core::{
    frame::HEADER_LEN, work_pair, BufMut, BufRef, Call, Collective, CollectiveKind, DataType,
    Element, Error, Event, FrameHeader, MemoryKind, ReduceOp, Result, Work,
};
use ccl_transport_cuda_ipc::{
    cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut},
    ipc::{self, Direct, IpcDone, IpcGroup, DESCRIPTION_BYTES, HANDLE_BYTES},
    staging::{Chunk, Later, Launch, Layout, Staging, DEPTH},
    Gpu, GpuEvent, Stream,
};

use crate::{call::Prepared, engine::Before, Communicator};

/// How many chunks late a staged allreduce queues each chunk's second host
/// collective (the allgather of what the GPU reduced), so that the links
/// move later chunks while the GPU reduces. At most `DEPTH - 1`: chunk
/// `k`'s second collective must come before chunk `k + DEPTH`'s first,
/// which waits for chunk `k`'s slot; one less gives that slot a chunk's
/// time to come free.
const SECOND_LAG: usize = DEPTH - 2;

/// A staged call's parts still to report (each chunk, and its launch), the
/// first error among them, and the completer the last one uses.
struct Outcome {
    left: usize,
    error: Option<Error>,
    completer: Option<ccl_core::Completer<()>>,
}

/// One side of a point-to-point transfer of device memory, for
/// [`Communicator::launch_transfers_on_stream`].
pub struct Transfer<'a> {
    dtype: DataType,
    peer: usize,
    send: bool,
    mem: BufMut<'a>,
}

impl<'a> Transfer<'a> {
    /// A send of `data` (elements of `dtype`) to rank `peer`.
    pub fn send(dtype: DataType, peer: usize, data: BufRef<'a>) -> Transfer<'a> {
        // SAFETY: the memory of `data`, borrowed as long; a send only reads it.
        let mem = unsafe { BufMut::from_raw(data.kind(), data.as_ptr().cast_mut(), data.len()) };
        Transfer {
            dtype,
            peer,
            send: true,
            mem,
        }
    }

    /// A receive from rank `peer` into `into` (elements of `dtype`).
    pub fn recv(dtype: DataType, peer: usize, into: BufMut<'a>) -> Transfer<'a> {
        Transfer {
            dtype,
            peer,
            send: false,
            mem: into,
        }
    }
}

impl Communicator {
    /// Queues the collective `coll` on device memory, in the order of
    /// `stream`: it starts after the work already queued on `stream`, and
    /// work queued on `stream` afterwards sees its result. The returned
    /// `Work` completes when the result is in `output` as well.
    ///
    /// `input` and `output` are as for [`Communicator::run`], in the memory
    /// of `stream`'s GPU ([`MemoryKind::Device`]). Host memory passed as
    /// device memory, or the reverse, is an error (the driver is asked).
    ///
    /// ```no_run
    /// use ccl::{cuda, BufMut, BufRef, Collective, CollectiveKind, Communicator, DataType, MemoryKind, ReduceOp};
    /// let comm = Communicator::from_env()?;
    /// let gpu = cuda::open(0)?;
    /// let stream = cuda::Stream::new(gpu.clone())?;
    /// let n = 1 << 20;
    /// let grad = gpu.alloc_device(n * 4)?;
    /// let on_gpu = MemoryKind::Device { ordinal: 0 };
    /// let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, n).with_op(ReduceOp::Sum);
    /// // SAFETY: `grad` stays allocated, and is touched only through `stream`, until the Work completes.
    /// let work = unsafe {
    ///     let at = grad.buf().as_ptr().cast_mut();
    ///     let (input, output) = (BufRef::from_raw(on_gpu, at, n * 4), BufMut::from_raw(on_gpu, at, n * 4));
    ///     comm.launch_on_stream(&coll, input, output, &stream)
    /// };
    /// work.wait()?;
    /// # Ok::<(), ccl::Error>(())
    /// ```
    ///
    /// # Safety
    /// The memory must stay valid, and be neither written (input) nor
    /// accessed (output) other than through work ordered after this call on
    /// `stream`, until the returned `Work` completes.
    pub unsafe fn launch_on_stream(
        &self,
        coll: &Collective,
        input: BufRef<'_>,
        output: BufMut<'_>,
        stream: &Stream,
    ) -> Work<()> {
        match self.stage(coll, input, output, stream) {
            Ok(work) => work,
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// [`Communicator::launch_on_stream`] in place on `buf`, counted and
    /// laid out as the typed methods do (`template` has count 0; see
    /// [`Communicator::count_in_place`] and [`Communicator::in_place_ranges`]).
    ///
    /// # Safety
    /// As for [`Communicator::launch_on_stream`].
    pub unsafe fn launch_in_place_on_stream(
        &self,
        template: Collective,
        mut buf: BufMut<'_>,
        stream: &Stream,
    ) -> Work<()> {
        let size = template.dtype.size();
        let coll = match self.count_in_place(template, buf.len() / size) {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        let (input, output) = self.in_place_ranges(&coll);
        let (kind, at) = (buf.kind(), buf.as_mut_ptr());
        let input = BufRef::from_raw(kind, at.add(input.start * size), input.len() * size);
        let output = BufMut::from_raw(kind, at.add(output.start * size), output.len() * size);
        self.launch_on_stream(&coll, input, output, stream)
    }

    /// [`Communicator::launch_on_stream`] from `input` into `output`,
    /// counted as the typed methods do ([`Communicator::count_out_of_place`];
    /// `template` has count 0).
    ///
    /// # Safety
    /// As for [`Communicator::launch_on_stream`].
    pub unsafe fn launch_out_of_place_on_stream(
        &self,
        template: Collective,
        input: BufRef<'_>,
        output: BufMut<'_>,
        stream: &Stream,
    ) -> Work<()> {
        let size = template.dtype.size();
        match self.count_out_of_place(template, input.len() / size, output.len() / size) {
            Ok(coll) => self.launch_on_stream(&coll, input, output, stream),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Queues a send of the device memory `data` (elements of `dtype`) to
    /// rank `peer`, in the order of `stream`; `peer` receives it into
    /// device memory of the same length ([`Communicator::launch_recv_on_stream`]).
    /// Transfers are staged through pinned host memory in chunks of
    /// `CCL_CUDA_CHUNK`, each a message of its own, on a lane per peer and
    /// direction: both sides must be device transfers, cut alike (the same
    /// `CCL_CUDA_CHUNK` on every rank), or the receiver reports a mismatch.
    /// Like NCCL's, a transfer
    /// holds up later work on `stream` until it is done: a rank that both
    /// sends and receives on one stream (an exchange) queues them together
    /// with [`Communicator::launch_transfers_on_stream`].
    ///
    /// # Safety
    /// As for [`Communicator::launch_on_stream`]: `data` stays valid and
    /// unwritten until the returned `Work` completes.
    pub unsafe fn launch_send_on_stream(
        &self,
        dtype: DataType,
        peer: usize,
        data: BufRef<'_>,
        stream: &Stream,
    ) -> Work<()> {
        let mut works =
            self.launch_transfers_on_stream(vec![Transfer::send(dtype, peer, data)], stream);
        works.remove(0)
    }

    /// Queues a receive from rank `peer` into the device memory `into`, in
    /// the order of `stream` (see [`Communicator::launch_send_on_stream`]).
    ///
    /// # Safety
    /// As for [`Communicator::launch_on_stream`]: `into` stays valid and
    /// untouched until the returned `Work` completes.
    pub unsafe fn launch_recv_on_stream(
        &self,
        dtype: DataType,
        peer: usize,
        into: BufMut<'_>,
        stream: &Stream,
    ) -> Work<()> {
        let mut works =
            self.launch_transfers_on_stream(vec![Transfer::recv(dtype, peer, into)], stream);
        works.remove(0)
    }

    /// Queues transfers of device memory together, as NCCL's calls between
    /// `ncclGroupStart` and `ncclGroupEnd`: they all start after the work
    /// queued on `stream` so far, none waits for another, and work queued
    /// on `stream` afterwards sees every one's result. One `Work` per
    /// transfer, in order.
    ///
    /// # Safety
    /// As for [`Communicator::launch_on_stream`], for every transfer's memory.
    pub unsafe fn launch_transfers_on_stream(
        &self,
        transfers: Vec<Transfer<'_>>,
        stream: &Stream,
    ) -> Vec<Work<()>> {
        match stream.record() {
            Ok(start) => self.launch_transfers_after(transfers, &start, stream),
            Err(e) => transfers
                .iter()
                .map(|_| Work::ready(Err(e.clone())))
                .collect(),
        }
    }

    /// [`Communicator::launch_transfers_on_stream`] after `start`, an event
    /// recorded on `stream` earlier: transfers of several communicators on
    /// one stream (an NCCL group over them) share one start, so that none
    /// waits for another's.
    ///
    /// # Safety
    /// As for [`Communicator::launch_on_stream`], for every transfer's memory.
    pub unsafe fn launch_transfers_after(
        &self,
        transfers: Vec<Transfer<'_>>,
        start: &GpuEvent,
        stream: &Stream,
    ) -> Vec<Work<()>> {
        transfers
            .into_iter()
            .map(|t| {
                self.stage_transfer(t, start, stream)
                    .unwrap_or_else(|e| Work::ready(Err(e)))
            })
            .collect()
    }

    /// Checks a device transfer and queues its chunks on their lane, the
    /// first after `start`.
    unsafe fn stage_transfer(
        &self,
        t: Transfer<'_>,
        start: &GpuEvent,
        stream: &Stream,
    ) -> Result<Work<()>> {
        let Transfer {
            dtype,
            peer,
            send,
            mut mem,
        } = t;
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let gpu = stream.gpu();
        let size = dtype.size();
        let coll =
            Collective::new(CollectiveKind::SendRecv, dtype, mem.len() / size).with_root(peer);
        let bad = |what: String| Error::InvalidArgument(format!("{coll} on rank {rank}: {what}"));
        coll.validate(rank, n)?;
        if mem.len() % size != 0 {
            return Err(bad(format!(
                "{} bytes are not whole {dtype} elements",
                mem.len()
            )));
        }
        let (ptr, len) = (mem.as_mut_ptr(), mem.len());
        if len > 0 {
            let what = if send { "input" } else { "output" };
            on_device(gpu, what, mem.kind(), ptr).map_err(bad)?;
        }
        let staging = self.transfer_staging(gpu, peer, send)?;
        let whole = Layout::new(&coll, rank, n, staging.chunk_bytes());
        let layout = match send {
            true => Layout {
                blocks_out: 0,
                ..whole
            },
            false => Layout {
                blocks_in: 0,
                ..whole
            },
        };
        let mut launch = staging.launch_after(start)?;
        let call = format!("{coll} with rank {peer} on rank {rank}");
        if self.inner.device_links.get(peer) == Some(&true) {
            // The link takes the GPU memory as it is (GPUDirect RDMA): one
            // chunk, no copies, ordered on the stream like staged ones.
            let (work, outcome) = Outcome::new(1);
            let chunk = launch.direct();
            let before = Before {
                gate: chunk.gate.clone(),
                what: "the caller's stream to reach the transfer",
                then: None,
            };
            let done = moved_directly(&staging, layout, chunk, !send, &outcome);
            self.submit_transfer(dtype, peer, send, mem, Some(before), done);
            return Ok(self.finish(launch, stream, &outcome, work, call));
        }
        let chunks = layout.chunks();
        let (work, outcome) = Outcome::new(chunks);
        for k in 0..chunks {
            let chunk = launch.stage_in(&layout, ptr, k);
            let (host_in, host_out) = launch.host_buffers(&layout, &chunk);
            let host = match send {
                true => {
                    BufMut::from_raw(MemoryKind::Host, host_in.as_ptr().cast_mut(), host_in.len())
                }
                false => host_out,
            };
            let before = staged_in(chunk.gate.clone(), None);
            let done = staged_out(&staging, layout, chunk, ptr as usize, &outcome, true);
            self.submit_transfer(dtype, peer, send, host, Some(before), done);
        }
        Ok(self.finish(launch, stream, &outcome, work, call))
    }

    /// The collective `template` (count 0; its element type is `T`'s) in
    /// place on cudarc's `buf`, queued on cudarc's `stream`, counted and
    /// laid out as [`Communicator::launch_in_place_on_stream`] does. Safe as
    /// cudarc's own copies are: the call is recorded on `stream` as a use of
    /// `buf`, so that cudarc orders later uses of `buf`, and its free,
    /// after it. The `Work` completes when the stream has done it.
    pub fn launch_in_place_on_cudarc<T: Element>(
        &self,
        template: Collective,
        buf: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Work<()> {
        let launched = self.cudarc_stream(stream).map(|(ours, kind)| {
            let bytes = buf.len() * size_of::<T>();
            let (ptr, _recorded) = buf.device_ptr_mut(stream);
            let template = Collective {
                dtype: T::DTYPE,
                ..template
            };
            // SAFETY: `buf`'s memory, whose later uses cudarc orders after
            // this call (`_recorded` records it on `stream` when dropped).
            unsafe {
                let buf = BufMut::from_raw(kind, ptr as *mut u8, bytes);
                self.launch_in_place_on_stream(template, buf, &ours)
            }
        });
        launched.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    /// The collective `template` (count 0) from cudarc's `input` into its
    /// `output`, queued on cudarc's `stream`; as
    /// [`Communicator::launch_in_place_on_cudarc`].
    pub fn launch_on_cudarc<T: Element>(
        &self,
        template: Collective,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Work<()> {
        let launched = self.cudarc_stream(stream).map(|(ours, kind)| {
            let bytes = |n: usize| n * size_of::<T>();
            let (from, to) = (bytes(input.len()), bytes(output.len()));
            let (input, _read) = input.device_ptr(stream);
            let (output, _written) = output.device_ptr_mut(stream);
            let template = Collective {
                dtype: T::DTYPE,
                ..template
            };
            // SAFETY: as in `launch_in_place_on_cudarc`, for both slices.
            unsafe {
                let input = BufRef::from_raw(kind, input as *const u8, from);
                let output = BufMut::from_raw(kind, output as *mut u8, to);
                self.launch_out_of_place_on_stream(template, input, output, &ours)
            }
        });
        launched.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    /// Sends cudarc's `data` to rank `peer`, queued on cudarc's `stream`
    /// (see [`Communicator::launch_send_on_stream`]: a rank that also
    /// receives uses another stream for that).
    pub fn launch_send_on_cudarc<T: Element>(
        &self,
        peer: usize,
        data: &CudaSlice<T>,
        stream: &CudaStream,
    ) -> Work<()> {
        let launched = self.cudarc_stream(stream).map(|(ours, kind)| {
            let bytes = data.len() * size_of::<T>();
            let (ptr, _read) = data.device_ptr(stream);
            // SAFETY: as in `launch_in_place_on_cudarc`.
            unsafe {
                let data = BufRef::from_raw(kind, ptr as *const u8, bytes);
                self.launch_send_on_stream(T::DTYPE, peer, data, &ours)
            }
        });
        launched.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    /// Receives into cudarc's `into` from rank `peer`, queued on cudarc's
    /// `stream` (see [`Communicator::launch_send_on_cudarc`]).
    pub fn launch_recv_on_cudarc<T: Element>(
        &self,
        peer: usize,
        into: &mut CudaSlice<T>,
        stream: &CudaStream,
    ) -> Work<()> {
        let launched = self.cudarc_stream(stream).map(|(ours, kind)| {
            let bytes = into.len() * size_of::<T>();
            let (ptr, _written) = into.device_ptr_mut(stream);
            // SAFETY: as in `launch_in_place_on_cudarc`.
            unsafe {
                let into = BufMut::from_raw(kind, ptr as *mut u8, bytes);
                self.launch_recv_on_stream(T::DTYPE, peer, into, &ours)
            }
        });
        launched.unwrap_or_else(|e| Work::ready(Err(e)))
    }

    /// cudarc's `stream` as ccl's, and the memory kind of its GPU.
    fn cudarc_stream(&self, stream: &CudaStream) -> Result<(Stream, MemoryKind)> {
        let gpu = ccl_transport_cuda_ipc::open(stream.context().ordinal() as u32)?;
        let kind = MemoryKind::Device {
            ordinal: gpu.ordinal(),
        };
        // SAFETY: cudarc's stream of that GPU (its primary context, as
        // ccl's), alive for this call, which queues all it needs on it now.
        Ok((
            unsafe { Stream::borrow_raw(gpu, stream.cu_stream() as u64) },
            kind,
        ))
    }

    /// How this communicator runs device calls like `coll`, once its first
    /// device call has settled it (`None` before): `"cuda-ipc-direct"`
    /// (allreduces between the ranks' own buffers, where every rank's can be
    /// exported), `"cuda-ipc"` (through the IPC slots) or `"staged"` (through
    /// pinned host memory; always for sends and receives).
    pub fn device_route(&self, coll: &Collective) -> Option<&'static str> {
        if coll.kind == CollectiveKind::SendRecv {
            return Some("staged");
        }
        let ipc = self.inner.ipc.lock().unwrap_or_else(|p| p.into_inner());
        Some(match &*ipc {
            None => return None,
            Some(None) => "staged",
            Some(Some(_)) if self.goes_direct(coll) => "cuda-ipc-direct",
            Some(Some(_)) => "cuda-ipc",
        })
    }

    /// Whether an IPC call of `coll` runs between the ranks' own buffers.
    fn goes_direct(&self, coll: &Collective) -> bool {
        coll.kind == CollectiveKind::AllReduce
            && !matches!(coll.op, ReduceOp::PreMulSum(_))
            && coll.count * coll.dtype.size() >= self.inner.options.cuda_ipc_direct
    }

    /// Checks a device call and queues its chunks.
    unsafe fn stage(
        &self,
        coll: &Collective,
        input: BufRef<'_>,
        mut output: BufMut<'_>,
        stream: &Stream,
    ) -> Result<Work<()>> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let gpu = stream.gpu();
        let bad = |what: String| Error::InvalidArgument(format!("{coll} on rank {rank}: {what}"));
        if coll.kind == CollectiveKind::SendRecv {
            return Err(bad(
                "point-to-point transfers go through launch_send_on_stream and \
                 launch_recv_on_stream"
                    .into(),
            ));
        }
        coll.validate(rank, n)?;
        let (need_in, need_out) = coll.buffer_elems(rank, n);
        let size = coll.dtype.size();
        let buffers = [
            ("input", input.kind(), input.as_ptr(), input.len(), need_in),
            (
                "output",
                output.kind(),
                output.as_mut_ptr().cast_const(),
                output.len(),
                need_out,
            ),
        ];
        for (what, kind, ptr, len, need) in buffers {
            if need == 0 {
                continue;
            }
            if len != need * size {
                return Err(bad(format!(
                    "the {what} has {len} bytes, expected {need} elements of {} ({} bytes)",
                    coll.dtype,
                    need * size
                )));
            }
            on_device(gpu, what, kind, ptr).map_err(bad)?;
        }
        if let Some(group) = self.ipc_group(gpu)? {
            let (from, to) = (input.as_ptr(), output.as_mut_ptr());
            let count = match self
                .goes_direct(coll)
                .then(|| self.map_buffers(coll, &group, from, to))
                .transpose()?
            {
                Some(Some(bufs)) => {
                    tracing::debug!(rank, call = %coll, "between the ranks' own buffers");
                    group.enqueue_allreduce(coll, &bufs, stream)?
                }
                _ => group.enqueue(coll, from, to, stream)?,
            };
            let timeout = self.timeout();
            let weak = Arc::downgrade(&self.inner);
            let done = IpcDone {
                event: Arc::new(stream.record()?),
                group,
                count,
                deadline: Instant::now() + timeout,
                timeout,
                call: format!("{coll} on rank {rank}"),
                on_timeout: Box::new(move || {
                    if let Some(inner) = weak.upgrade() {
                        Communicator { inner }.abort();
                    }
                }),
            };
            return Ok(Work::ready(Ok(())).after(Arc::new(done)));
        }
        let staging = self.staging(gpu)?;
        let (input, output) = (input.as_ptr() as usize, output.as_mut_ptr() as usize);
        if self.inner.options.cuda_staged_gpu_reduce && reduces_on_gpu(coll, n) {
            return self.stage_reduction(coll, &staging, input, output, stream);
        }
        let layout = Layout::new(coll, rank, n, staging.chunk_bytes());
        let mut launch = staging.launch(stream)?;
        let chunks = layout.chunks();
        let (work, outcome) = Outcome::new(chunks);
        for k in 0..chunks {
            let chunk = launch.stage_in(&layout, input as *const u8, k);
            let (host_in, host_out) = launch.host_buffers(&layout, &chunk);
            // A pre-multiplied sum scales the staged input in place once it
            // is there, and sums; the rest run as they are.
            let prescale = matches!(coll.op, ReduceOp::PreMulSum(_)).then_some(coll.op);
            let sub = Collective {
                count: chunk.count(),
                op: prescale.map_or(coll.op, |_| ReduceOp::Sum),
                ..*coll
            };
            // The chunk's arguments follow from the call's, checked above;
            // were they refused, the chunk still reports (and is counted).
            let back = staged_out(&staging, layout, chunk.clone(), output, &outcome, true);
            let scale = (host_in.as_ptr() as usize, host_in.len());
            let then = prescaling(prescale, sub.dtype, scale);
            let before = staged_in(chunk.gate.clone(), then);
            self.submit_staged(&sub, (host_in, host_out), before, back);
        }
        let call = format!("{coll} on rank {rank}");
        Ok(self.finish(launch, stream, &outcome, work, call))
    }

    /// A staged reduction: the hosts only move data and the GPU reduces.
    /// Per chunk, a host collective brings every rank's part of what this
    /// rank reduces into the slot (an all-to-all of the chunk cut in n
    /// pieces; a gather to the root for a reduce), the copy-out stream
    /// takes it to the device and reduces it in rank order into the
    /// output, and for an allreduce a second host collective (an
    /// allgather of the reduced pieces, gated on that reduction) brings
    /// back the rest, which goes to the device as any staged result.
    unsafe fn stage_reduction(
        &self,
        coll: &Collective,
        staging: &Arc<Staging>,
        input: usize,
        output: usize,
        stream: &Stream,
    ) -> Result<Work<()>> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let (kind, dtype, elem) = (coll.kind, coll.dtype, coll.dtype.size());
        // A reduce's root receives n chunks at once.
        let chunk_bytes = match kind {
            CollectiveKind::Reduce => staging.chunk_bytes() / n,
            _ => staging.chunk_bytes(),
        };
        let layout = Layout::new(coll, rank, n, chunk_bytes.max(elem));
        // Loading kernels may wait for the context's streams, and the
        // caller's will wait for this call's chunks: load them first.
        staging.gpu().prepare_kernels()?;
        let mut launch = staging.launch(stream)?;
        let chunks = layout.chunks();
        tracing::debug!(rank, call = %coll, chunks, "staged, reduced on the GPU");
        let (work, outcome) = Outcome::new(chunks);
        // A pre-multiplied sum scales the staged input on the host, then sums.
        let prescale = matches!(coll.op, ReduceOp::PreMulSum(_)).then_some(coll.op);
        let op = prescale.map_or(coll.op, |_| ReduceOp::Sum);
        // An allreduce's second collectives, queued SECOND_LAG chunks
        // late: the engine runs collectives in turn, and one that waits for
        // the GPU's reduction would leave the links idle meanwhile.
        let mut seconds = std::collections::VecDeque::new();
        for k in 0..chunks {
            let chunk = launch.stage_in(&layout, input as *const u8, k);
            let (slot_in, slot_out, slot_bytes) = launch.slot(&chunk);
            let len = chunk.count();
            let start = (k * layout.per_chunk) * elem;
            // What this rank reduces: `count` elements into `out`, from n
            // runs `stride` apart in the slot, brought by `first`.
            let (first, stride, count, out) = match kind {
                CollectiveKind::AllReduce => {
                    let piece = len.div_ceil(n);
                    let mine = piece.min(len.saturating_sub(rank * piece));
                    let first = Collective::new(CollectiveKind::AllToAll, dtype, piece);
                    (first, piece, mine, output + start + rank * piece * elem)
                }
                CollectiveKind::ReduceScatter => {
                    let first = Collective::new(CollectiveKind::AllToAll, dtype, len);
                    (first, len, len, output + start)
                }
                _ => {
                    let first =
                        Collective::new(CollectiveKind::Gather, dtype, len).with_root(coll.root);
                    let count = if rank == coll.root { len } else { 0 };
                    (first, len, count, output + start)
                }
            };
            let (need_in, need_out) = first.buffer_elems(rank, n);
            let second = (kind == CollectiveKind::AllReduce)
                .then(|| Collective::new(CollectiveKind::AllGather, dtype, stride));
            let done_at = staged_out(
                staging,
                layout,
                chunk.clone(),
                output,
                &outcome,
                second.is_some(),
            );
            if (need_in.max(need_out) * elem).max(stride * n * elem) > slot_bytes {
                done_at(Err(Error::Internal(format!(
                    "{coll} on rank {rank}: a staged chunk of {len} elements outgrows its slot"
                ))));
                continue;
            }
            let bytes = |elems: usize| elems * elem;
            let io_first = (
                BufRef::from_raw(MemoryKind::Host, slot_in, bytes(need_in)),
                BufMut::from_raw(MemoryKind::Host, slot_out, bytes(need_out)),
            );
            let staged = (slot_in as usize, bytes(layout.blocks_in * len));
            let then = prescaling(prescale, dtype, staged);
            let reduce = {
                let (staging, chunk) = (staging.clone(), chunk.clone());
                // SAFETY: the call's device output, valid until its Work completes.
                move |back: bool| unsafe {
                    staging.reduce(&chunk, (op, dtype), n, stride, count, out as *mut u8, back)
                }
            };
            let first_in = staged_in(chunk.gate.clone(), then);
            match second {
                // The reduced pieces go round; the chunk ends after the second.
                Some(second) => {
                    let later = Arc::new(Later::default());
                    let gate = later.clone();
                    let after_first = Box::new(move |result: Result<()>| {
                        let reduced = result.and_then(|()| reduce(true));
                        gate.set(reduced.map(|event| Arc::new(event) as Arc<dyn Event>));
                    });
                    self.submit_staged(&first, io_first, first_in, after_first);
                    let io_second = (
                        BufRef::from_raw(MemoryKind::Host, slot_in, bytes(stride)),
                        BufMut::from_raw(MemoryKind::Host, slot_out, bytes(stride * n)),
                    );
                    let gate = Before {
                        gate: later,
                        what: "the GPU to reduce the staged chunk",
                        then: None,
                    };
                    seconds.push_back((second, io_second, gate, done_at));
                }
                // The reduction is the result; the chunk ends after it.
                None => {
                    let after_first = Box::new(move |result: Result<()>| {
                        done_at(result.and_then(|()| reduce(false).map(drop)))
                    });
                    self.submit_staged(&first, io_first, first_in, after_first);
                }
            }
            while seconds.len() > SECOND_LAG {
                if let Some((second, io, gate, done_at)) = seconds.pop_front() {
                    self.submit_staged(&second, io, gate, done_at);
                }
            }
        }
        for (second, io, gate, done_at) in seconds {
            self.submit_staged(&second, io, gate, done_at);
        }
        let call = format!("{coll} on rank {rank}");
        Ok(self.finish(launch, stream, &outcome, work, call))
    }

    /// Ends a staged call's launch: the caller's stream waits for its last
    /// chunk, and the launch reports to the outcome (a failure to make the
    /// stream wait fails the call, once its chunks are done with the memory).
    fn finish(
        &self,
        launch: Launch<'_>,
        stream: &Stream,
        outcome: &Mutex<Outcome>,
        work: Work<()>,
        call: String,
    ) -> Work<()> {
        let (staged, gated) = launch.finish(stream, self.timeout(), call);
        Outcome::report(outcome, gated);
        work.after(staged)
    }

    /// Queues the host collective of a staged chunk on `io`, after `before`.
    fn submit_staged(
        &self,
        coll: &Collective,
        (input, output): (BufRef<'static>, BufMut<'static>),
        before: Before,
        done: Box<dyn FnOnce(Result<()>) + Send>,
    ) {
        // SAFETY: the slot's memory, which only this chunk uses until done.
        match unsafe { self.prepare(coll, input, output) } {
            Ok(Prepared { io, scaled }) => {
                let choice = self.inner.selection.choice(coll);
                let done = Box::new(move |result: Result<()>| {
                    drop(scaled);
                    done(result)
                });
                self.submit(coll, choice, io, Some(before), done);
            }
            Err(e) => done(Err(e)),
        }
    }

    /// Every rank's buffers of a direct IPC call, mapped here: `None` (on
    /// every rank alike) where some rank's cannot be exported (memory of
    /// the stream-ordered allocator, say), and the call goes through slots.
    fn map_buffers(
        &self,
        coll: &Collective,
        group: &IpcGroup,
        input: *const u8,
        output: *mut u8,
    ) -> Result<Option<Direct>> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        let described = group.describe(input, output).unwrap_or_else(|e| {
            tracing::debug!(rank, "buffers not exportable ({e}); through slots");
            [0; DESCRIPTION_BYTES]
        });
        // With the call's header, so that ranks that made different calls
        // fail, naming both, before any reads another's buffer.
        let call = Call {
            comm: self.inner.comm,
            seq: 0,
            rank,
            world_size: n,
            coll: *coll,
        };
        let header = call.header(0, 0);
        let each = DESCRIPTION_BYTES + HEADER_LEN;
        let mut mine = described.to_vec();
        mine.extend_from_slice(&header.encode());
        let mut every = vec![0u8; each * n];
        self.allgather_into(&mine, &mut every)?;
        let mut all: Vec<[u8; DESCRIPTION_BYTES]> = Vec::with_capacity(n);
        for (peer, theirs) in every.chunks(each).enumerate() {
            let (description, their_header) = theirs.split_at(DESCRIPTION_BYTES);
            let got = FrameHeader::decode(their_header).map_err(|msg| Error::Protocol {
                rank,
                peer,
                call: call.name(),
                msg,
            })?;
            header.check_received(&got, rank, peer)?;
            all.push(description.try_into().expect("whole descriptions"));
        }
        // A handle is never empty: an empty one is a rank that could not export.
        let exportable = all
            .iter()
            .all(|d| d[0] != 0 && d[DESCRIPTION_BYTES / 2] != 0);
        if !exportable {
            return Ok(None);
        }
        group.map(&all, input, output).map(Some)
    }

    /// The IPC group of this communicator's GPUs, made at the first device
    /// call where every rank is on this host (and `CCL_CUDA_IPC` is not 0):
    /// `None` if it is not to be used, which every rank then agrees on.
    fn ipc_group(&self, gpu: &Arc<dyn Gpu>) -> Result<Option<Arc<IpcGroup>>> {
        let inner = &self.inner;
        let mut slot = inner.ipc.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(group) = &*slot {
            return Ok(group.clone());
        }
        let (rank, n) = (inner.rank, inner.world_size);
        let eligible = inner.options.cuda_ipc
            && self.host_size() == n
            && n <= ccl_transport_cuda_ipc::kernels::MAX_INPUTS;
        // Every rank must take the same path: agree first, then on success.
        let mut all = [u8::from(eligible)];
        self.allreduce(&mut all, ReduceOp::Min)?;
        let mut group = None;
        if all[0] == 1 {
            let exchange = |mine: [u8; HANDLE_BYTES]| {
                let mut every = vec![0u8; HANDLE_BYTES * n];
                self.allgather_into(&mine, &mut every)?;
                Ok(every
                    .chunks(HANDLE_BYTES)
                    .map(|c| c.try_into().expect("whole handles"))
                    .collect())
            };
            let made = IpcGroup::new(gpu.clone(), rank, n, inner.options.cuda_ipc_chunk, exchange);
            let mut ok = [u8::from(made.is_ok())];
            self.allreduce(&mut ok, ReduceOp::Min)?;
            match made {
                Ok(g) if ok[0] == 1 => {
                    tracing::info!(rank, "device calls read peers' GPU memory through CUDA IPC");
                    self.warn_of_turns(gpu)?;
                    group = Some(Arc::new(g));
                }
                Ok(_) => tracing::info!(
                    rank,
                    "CUDA IPC refused on another rank; staging through host memory"
                ),
                Err(e) => {
                    tracing::info!(rank, "CUDA IPC refused ({e}); staging through host memory")
                }
            }
        }
        *slot = Some(group.clone());
        Ok(group)
    }

    /// Tells (from the lowest rank of each) of ranks that share a GPU
    /// which runs their work by turns: a call then waits for the others'
    /// time slices (figures in docs/DESIGN.md).
    fn warn_of_turns(&self, gpu: &Arc<dyn Gpu>) -> Result<()> {
        let (rank, n) = (self.inner.rank, self.inner.world_size);
        // Every rank takes part; one whose driver cannot tell says unknown.
        let mine = ipc::sharing(gpu.as_ref()).unwrap_or([2; ipc::SHARING_BYTES]);
        let mut every = vec![0u8; ipc::SHARING_BYTES * n];
        self.allgather_into(&mine, &mut every)?;
        let all: Vec<[u8; ipc::SHARING_BYTES]> = every
            .chunks(ipc::SHARING_BYTES)
            .map(|c| c.try_into().expect("whole descriptions"))
            .collect();
        for ranks in ipc::taking_turns(&all) {
            if ranks[0] == rank {
                tracing::warn!(
                    rank,
                    "ranks {ranks:?} share {} without MPS: the GPU runs their work by \
                     turns, and every device call waits for the others' time slices; \
                     start the MPS server (nvidia-cuda-mps-control -d) for the job",
                    gpu.name()
                );
            }
        }
        Ok(())
    }

    /// The staging of device transfers to (`send`) or from `peer` on
    /// `gpu`, made at the first one.
    fn transfer_staging(
        &self,
        gpu: &Arc<dyn Gpu>,
        peer: usize,
        send: bool,
    ) -> Result<Arc<Staging>> {
        let inner = &self.inner;
        let mut lanes = inner
            .transfer_staging
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(s) = lanes.get(&(peer, send)) {
            return same_gpu(s, gpu, inner.rank);
        }
        let chunk = inner.options.cuda_chunk;
        let s = Arc::new(Staging::for_transfers(gpu.clone(), chunk, send)?);
        lanes.insert((peer, send), s.clone());
        Ok(s)
    }

    /// This communicator's staging on `gpu`, made at the first device call.
    fn staging(&self, gpu: &Arc<dyn Gpu>) -> Result<Arc<Staging>> {
        let inner = &self.inner;
        let mut slot = inner.staging.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = &*slot {
            return same_gpu(s, gpu, inner.rank);
        }
        let s = Arc::new(Staging::new(
            gpu.clone(),
            inner.world_size,
            inner.options.cuda_chunk,
            inner.options.cuda_staged_gpu_reduce,
        )?);
        *slot = Some(s.clone());
        Ok(s)
    }
}

/// `staging` itself, if it is on `gpu`: a communicator's device calls all
/// run on one GPU.
fn same_gpu(staging: &Arc<Staging>, gpu: &Arc<dyn Gpu>, rank: usize) -> Result<Arc<Staging>> {
    if staging.gpu().ordinal() != gpu.ordinal() {
        return Err(Error::InvalidArgument(format!(
            "rank {rank}: this communicator's device calls run on {}, not {}",
            staging.gpu().name(),
            gpu.name()
        )));
    }
    Ok(staging.clone())
}

/// Checks that a call's `what` buffer at `ptr`, passed as memory of `kind`,
/// is memory of `gpu` (the driver is asked); why not, if it is not.
fn on_device(
    gpu: &Arc<dyn Gpu>,
    what: &str,
    kind: MemoryKind,
    ptr: *const u8,
) -> std::result::Result<(), String> {
    let device = MemoryKind::Device {
        ordinal: gpu.ordinal(),
    };
    if kind != device {
        return Err(format!(
            "the {what} lies in {kind}, but the stream is of {}",
            gpu.name()
        ));
    }
    match gpu.kind_of(ptr) {
        Ok(actual) if actual == kind => Ok(()),
        Ok(actual) => Err(format!(
            "the {what} at {ptr:p} was passed as {kind}, but the driver says it is {actual}"
        )),
        Err(e) => Err(format!(
            "the driver cannot tell where the {what} at {ptr:p} lies: {e}"
        )),
    }
}

/// The step that scales a chunk's staged input (`staged`: its address and
/// bytes) in place for a pre-multiplied sum, `prescale`, if it is one.
fn prescaling(
    prescale: Option<ReduceOp>,
    dtype: DataType,
    staged: (usize, usize),
) -> Option<Box<dyn FnOnce() -> Result<()> + Send>> {
    let op = prescale?;
    Some(Box::new(move || {
        // SAFETY: the chunk's staged input, which only this job uses now.
        let staged = unsafe { std::slice::from_raw_parts_mut(staged.0 as *mut u8, staged.1) };
        ccl_core::kernels::prescale(op, dtype, staged)
    }))
}

/// What a chunk's host job waits for: its input in host memory (`gate`),
/// and then `then`.
fn staged_in(gate: Arc<dyn Event>, then: Option<Box<dyn FnOnce() -> Result<()> + Send>>) -> Before {
    Before {
        gate,
        what: "the GPU to copy the call's input into host memory",
        then,
    }
}

/// What a chunk's host job calls when done: its result goes back to the
/// device `output` (with `copies`, if it has one) and into the call's
/// outcome.
fn staged_out(
    staging: &Arc<Staging>,
    layout: Layout,
    chunk: Chunk,
    output: usize,
    outcome: &Arc<Mutex<Outcome>>,
    copies: bool,
) -> Box<dyn FnOnce(Result<()>) + Send> {
    let (staging, outcome) = (staging.clone(), outcome.clone());
    Box::new(move |result: Result<()>| {
        let ok = result.is_ok() && copies;
        // SAFETY: the call's device output, valid until its Work completes,
        // which waits for this copy.
        let out = unsafe { staging.stage_out(&layout, &chunk, output as *mut u8, ok) };
        Outcome::report(&outcome, result.and(out));
    })
}

/// What a transfer that moved device memory straight through its link
/// calls when done: after a receive, the NIC's writes are made visible to
/// the GPU (`received`); then the chunk counts as done on the stream.
fn moved_directly(
    staging: &Arc<Staging>,
    layout: Layout,
    chunk: Chunk,
    received: bool,
    outcome: &Arc<Mutex<Outcome>>,
) -> Box<dyn FnOnce(Result<()>) + Send> {
    let gpu = staging.gpu().clone();
    let counted = staged_out(staging, layout, chunk, 0, outcome, false);
    Box::new(move |result: Result<()>| {
        let result = match received && result.is_ok() {
            true => gpu.flush_remote_writes(),
            false => result,
        };
        counted(result)
    })
}

/// Whether a staged call of `coll` among `n` ranks reduces on the GPU: the
/// reductions, where one kernel takes every rank's data.
fn reduces_on_gpu(coll: &Collective, n: usize) -> bool {
    matches!(
        coll.kind,
        CollectiveKind::AllReduce | CollectiveKind::ReduceScatter | CollectiveKind::Reduce
    ) && n <= ccl_transport_cuda_ipc::kernels::MAX_INPUTS
}

impl Outcome {
    /// A call's `Work`, and the outcome its `chunks` chunks and its launch
    /// report to: it completes when all have.
    fn new(chunks: usize) -> (Work<()>, Arc<Mutex<Outcome>>) {
        let (work, completer) = work_pair::<()>();
        let outcome = Outcome {
            left: chunks + 1,
            error: None,
            completer: Some(completer),
        };
        (work, Arc::new(Mutex::new(outcome)))
    }

    /// One part's result; the last part completes the call.
    fn report(outcome: &Mutex<Outcome>, result: Result<()>) {
        let mut o = outcome.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = result {
            o.error.get_or_insert(e);
        }
        o.left = o.left.saturating_sub(1);
        if o.left == 0 {
            if let Some(c) = o.completer.take() {
                c.complete(o.error.take().map_or(Ok(()), Err));
            }
        }
    }
}
