//! Pinned host staging: a collective on device memory run as a pipeline of
//! host collectives over any link.
//!
//! A call is cut into chunks (elements `a..b` of every rank's block). For
//! each chunk, a copy stream moves its pieces from the device into a slot of
//! pinned host memory ([`Staging::stage_in`], ending in an event that gates
//! the host collective), the communicator runs the host collective of the
//! chunk from that slot into the slot's output, and then a second copy
//! stream moves the result back ([`Staging::stage_out`]) and counts the
//! chunk as done in a word of pinned memory. Slots are reused in turn: the
//! copy-in stream waits for that word before it overwrites a slot, so that
//! up to [`DEPTH`] chunks are in flight, their copies, transfers and
//! reductions overlapping. The caller's stream takes part at both ends: the
//! first copy waits for the work already queued on it, and it waits (on the
//! GPU, for the word) for the last chunk before any later work runs. A
//! reduction may instead have the host collectives only move data and
//! reduce what they gathered on the GPU, on the copy-out stream
//! ([`Staging::reduce`]).

use std::{
    sync::{Arc, Mutex, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

use ccl_core::{BufMut, BufRef, Collective, DataType, Error, Event, ReduceOp, Result, Scratch};

use crate::gpu::{Flags, Gpu, GpuEvent, Stream};

/// Slots of pinned memory, so chunks in flight at once.
pub const DEPTH: usize = 4;

/// How many chunks may be queued on the copy-in stream beyond those whose
/// copies back are queued. A chunk's copies wait on the GPU for its slot to
/// come free, so queued chunks hold the copy-in stream; the driver blocks a
/// thread that queues onto a full stream, and were that the caller while the
/// engine needs the driver to queue the copies back that free the slots,
/// neither would go on (a 16384-chunk send hung so on an H200). Later chunks
/// wait on the host, in order, and whoever queues a copy back queues those
/// whose turn it is: the caller never waits. Twice the slots: chunks past
/// those wait for a slot anyway.
pub const AHEAD: u64 = 2 * DEPTH as u64;

/// How a call's buffers are cut into chunks on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Blocks of `count` elements in the input and output (0, 1 or n).
    pub blocks_in: usize,
    pub blocks_out: usize,
    /// Elements of a block.
    pub count: usize,
    /// Bytes of an element.
    pub elem: usize,
    /// Elements of a block in each chunk (the last may have fewer).
    pub per_chunk: usize,
}

impl Layout {
    /// The layout of `coll` on `rank` of `world_size`, in chunks of at most
    /// `chunk_bytes` of input or output.
    pub fn new(coll: &Collective, rank: usize, world_size: usize, chunk_bytes: usize) -> Layout {
        let (need_in, need_out) = coll.buffer_elems(rank, world_size);
        let blocks = |elems: usize| elems.checked_div(coll.count).unwrap_or(0);
        let (blocks_in, blocks_out) = (blocks(need_in), blocks(need_out));
        // Every rank must cut alike: size chunks by the whole buffer's
        // blocks (n where the count is per rank), not by this rank's.
        let elem = coll.dtype.size();
        let widest = (coll.buffer_bytes(world_size) as usize)
            .checked_div(coll.count * elem)
            .unwrap_or(1);
        let per_chunk = (chunk_bytes / (elem * widest)).max(1);
        Layout {
            blocks_in,
            blocks_out,
            count: coll.count,
            elem,
            per_chunk,
        }
    }

    /// How many chunks (at least one, so that every rank makes the call).
    pub fn chunks(&self) -> usize {
        self.count.div_ceil(self.per_chunk).max(1)
    }

    /// The elements of every block that chunk `k` covers.
    pub fn chunk(&self, k: usize) -> Span {
        let from = (k * self.per_chunk).min(self.count);
        Span {
            from,
            len: self.per_chunk.min(self.count - from),
        }
    }
}

/// Elements `from..from + len` of every block: one chunk of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    from: usize,
    len: usize,
}

impl Span {
    /// Elements of each block in this chunk: the `count` of its collective.
    pub fn count(&self) -> usize {
        self.len
    }
}

/// A chunk staged in: its collective's host buffers and the event after
/// which they hold the input.
#[derive(Clone)]
pub struct Chunk {
    /// Its number among all chunks of the communicator.
    id: u32,
    /// Elements of each block it covers.
    span: Span,
    slot: usize,
    /// The copy-in stream passed the chunk's copies (or what failed).
    pub gate: Arc<dyn Event>,
    /// That event on the GPU, where the copies were queued: the chunk is
    /// counted as done only after it, even when its collective failed
    /// before, so that the caller's stream is never released while a copy
    /// still reads the caller's memory.
    copied: Arc<OnceLock<Arc<GpuEvent>>>,
}

impl Chunk {
    /// Elements of each block in this chunk: the `count` of its collective.
    pub fn count(&self) -> usize {
        self.span.len
    }
}

/// One pinned slot: a chunk's collective reads `input` and writes `output`;
/// a reduction takes what arrived in `output` to `device` memory to reduce.
struct Slot {
    input: Scratch,
    output: Scratch,
    device: Scratch,
}

/// What the copy streams and slots serve: one communicator's device calls
/// on one GPU.
pub struct Staging {
    gpu: Arc<dyn Gpu>,
    copy_in: Stream,
    copy_out: Stream,
    slots: Vec<Slot>,
    /// Word 0: how many chunks were staged out (wrapping).
    done: Arc<Flags>,
    chunk_bytes: usize,
    /// Chunks staged in so far; held for a whole call so that its chunks
    /// are numbered (and their collectives queued) without interleaving.
    next: Mutex<u64>,
    /// What waits its turn for the copy-in stream ([`AHEAD`]).
    flow: Mutex<Flow>,
    /// Takes a caller's start event while copy-in work waits its turn, so
    /// that the copy-in stream can wait for it in that turn.
    entry: Stream,
}

/// Work for the copy-in stream that waits on the host for its turn.
type Deferred = Box<dyn FnOnce(&Staging) + Send>;

/// The copies back queued so far, and the copy-in work waiting for them.
#[derive(Default)]
struct Flow {
    queued_out: u64,
    /// In order; each runs once `queued_out` reaches its number and all
    /// before it ran.
    backlog: std::collections::VecDeque<(u64, Deferred)>,
}

/// A failed step, as the gate of its chunk: the chunk's collective fails
/// with it (and so does the call on every rank).
struct Failed(Error);

impl Event for Failed {
    fn query(&self) -> Result<bool> {
        Err(self.0.clone())
    }

    fn synchronize(&self, _: Option<std::time::Duration>) -> Result<bool> {
        Err(self.0.clone())
    }
}

/// A gate known only later: the event a chunk's second host collective
/// waits for, set when its first one ends (or why it cannot happen).
#[derive(Default)]
pub struct Later(std::sync::OnceLock<Arc<dyn Event>>);

impl Later {
    /// Sets the gate (once; a second call is ignored).
    pub fn set(&self, gate: Result<Arc<dyn Event>>) {
        let _ = self
            .0
            .set(gate.unwrap_or_else(|e| Arc::new(Failed(e)) as Arc<dyn Event>));
    }
}

impl Event for Later {
    fn query(&self) -> Result<bool> {
        match self.0.get() {
            Some(gate) => gate.query(),
            None => Ok(false),
        }
    }

    fn synchronize(&self, timeout: Option<Duration>) -> Result<bool> {
        let start = Instant::now();
        while !self.query()? {
            if timeout.is_some_and(|t| start.elapsed() >= t) {
                return Ok(false);
            }
            std::thread::yield_now();
        }
        Ok(true)
    }
}

/// The word reaching a value: chunk `value - 1` is back on the device. It
/// fails with a timeout naming `call` once `deadline` passes (a chunk's
/// copies never ran: the caller's stream is stuck behind earlier work).
struct StagedOut {
    done: Arc<Flags>,
    value: u32,
    deadline: Instant,
    timeout: Duration,
    call: String,
}

impl StagedOut {
    fn reached(&self) -> bool {
        let now = self.done.word(0).load(std::sync::atomic::Ordering::Acquire);
        now.wrapping_sub(self.value) as i32 >= 0
    }

    fn timed_out(&self) -> Error {
        Error::Timeout {
            context: self.call.clone(),
            what: "the GPU to copy the call's chunks back (is the stream blocked by earlier work?)"
                .into(),
            after: self.timeout,
        }
    }
}

impl Event for StagedOut {
    fn query(&self) -> Result<bool> {
        if self.reached() {
            return Ok(true);
        }
        if Instant::now() >= self.deadline {
            return Err(self.timed_out());
        }
        Ok(false)
    }

    fn synchronize(&self, timeout: Option<Duration>) -> Result<bool> {
        let start = Instant::now();
        loop {
            if self.query()? {
                return Ok(true);
            }
            let waited = start.elapsed();
            if timeout.is_some_and(|t| waited >= t) {
                return Ok(false);
            }
            // Chunks come back within microseconds of each other; a long
            // wait is for the caller's own work, so back off to sleeping.
            if waited < Duration::from_millis(10) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

/// A device call being staged: holds the numbering of chunks until dropped.
pub struct Launch<'a> {
    staging: &'a Staging,
    next: MutexGuard<'a, u64>,
}

impl Staging {
    /// Copy streams, slots of pinned memory and a word that counts chunks
    /// on `gpu`, for calls among `world_size` ranks cut in `chunk_bytes`;
    /// with `reduce_on_gpu`, device scratch beside each slot for
    /// [`Staging::reduce`].
    pub fn new(
        gpu: Arc<dyn Gpu>,
        world_size: usize,
        chunk_bytes: usize,
        reduce_on_gpu: bool,
    ) -> Result<Staging> {
        // A chunk has at least one element of every block (8 bytes at most
        // each), and a reduction's chunk is cut in n equal pieces.
        let slot_bytes = chunk_bytes.max(8 * world_size) + 8 * world_size;
        let device = if reduce_on_gpu { slot_bytes } else { 0 };
        Staging::with_slots(gpu, [slot_bytes, slot_bytes, device], chunk_bytes)
    }

    /// Staging for one direction of point-to-point transfers (`send`: the
    /// slots hold what is sent, else what is received), in chunks of
    /// `chunk_bytes`. A lane of its own, so that a send waiting for its
    /// receiver never holds up a receive (nor the reverse).
    pub fn for_transfers(gpu: Arc<dyn Gpu>, chunk_bytes: usize, send: bool) -> Result<Staging> {
        let slot_bytes = chunk_bytes.max(8);
        let sides = if send {
            [slot_bytes, 0, 0]
        } else {
            [0, slot_bytes, 0]
        };
        Staging::with_slots(gpu, sides, chunk_bytes)
    }

    /// [`DEPTH`] slots of `[input, output, device]` bytes.
    fn with_slots(gpu: Arc<dyn Gpu>, bytes: [usize; 3], chunk_bytes: usize) -> Result<Staging> {
        let alloc = |len: usize| match len {
            0 => Ok(Scratch::host(0)),
            _ => gpu.alloc_staging(len),
        };
        let mut slots = Vec::with_capacity(DEPTH);
        for _ in 0..DEPTH {
            slots.push(Slot {
                input: alloc(bytes[0])?,
                output: alloc(bytes[1])?,
                device: match bytes[2] {
                    0 => Scratch::host(0),
                    len => gpu.alloc_device(len)?,
                },
            });
        }
        Ok(Staging {
            copy_in: Stream::new(gpu.clone())?,
            copy_out: Stream::new(gpu.clone())?,
            entry: Stream::new(gpu.clone())?,
            done: Arc::new(Flags::new(&*gpu, 1)?),
            gpu,
            slots,
            chunk_bytes,
            next: Mutex::new(0),
            flow: Mutex::default(),
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    /// Bytes of a chunk.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Starts staging a call: its first copy will wait for the work queued
    /// on `user` so far.
    pub fn launch(&self, user: &Stream) -> Result<Launch<'_>> {
        self.launch_after(&user.record()?)
    }

    /// Starts staging a call whose first copy waits for `start` (recorded
    /// on the caller's stream).
    pub fn launch_after(&self, start: &GpuEvent) -> Result<Launch<'_>> {
        let next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let mut flow = self.flow.lock().unwrap_or_else(|p| p.into_inner());
        if flow.backlog.is_empty() {
            drop(flow);
            self.copy_in.wait(start)?;
        } else {
            // The copy-in stream must not wait for the caller's stream
            // (which waits for earlier calls) before their chunks are queued.
            self.entry.wait(start)?;
            let started = self.entry.record()?;
            flow.backlog.push_back((
                0,
                Box::new(move |staging: &Staging| {
                    if let Err(e) = staging.copy_in.wait(&started) {
                        tracing::error!(
                            "staging: the copy-in stream cannot wait for a call's start: {e}"
                        );
                    }
                }),
            ));
        }
        Ok(Launch {
            staging: self,
            next,
        })
    }

    /// Runs `op` now if nothing waits before it and the copies back of
    /// `need` chunks are queued; else queues it to run in its turn.
    fn in_turn(&self, need: u64, op: Deferred) {
        let mut flow = self.flow.lock().unwrap_or_else(|p| p.into_inner());
        if flow.backlog.is_empty() && flow.queued_out >= need {
            // Only the caller staging a call adds work, so none can be
            // added before this runs.
            drop(flow);
            op(self);
        } else {
            flow.backlog.push_back((need, op));
        }
    }

    /// Counts a queued copy back, and runs the copy-in work whose turn it is
    /// (under the lock: in order, whoever counts).
    fn queued_out(&self) {
        let mut flow = self.flow.lock().unwrap_or_else(|p| p.into_inner());
        flow.queued_out += 1;
        while flow
            .backlog
            .front()
            .is_some_and(|(need, _)| *need <= flow.queued_out)
        {
            if let Some((_, op)) = flow.backlog.pop_front() {
                op(self);
            }
        }
    }

    /// Reduces on the GPU what chunk `chunk`'s host collective gathered in
    /// its slot's output: `inputs` runs of `count` elements of `dtype`, one
    /// per rank at a stride of `stride` elements, folded in rank order with
    /// `op` into the device memory `out`. With `back`, the result is also
    /// copied into the slot's input (for a host collective to pass on). On
    /// the copy-out stream; the event returned follows it.
    ///
    /// # Safety
    /// `out` must be device memory of `count` elements, valid and otherwise
    /// untouched until the event; the slot's output must hold the runs.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        chunk: &Chunk,
        (op, dtype): (ReduceOp, DataType),
        inputs: usize,
        stride: usize,
        count: usize,
        out: *mut u8,
        back: bool,
    ) -> Result<GpuEvent> {
        let slot = &self.slots[chunk.slot];
        let (elem, stream) = (dtype.size(), self.copy_out.raw());
        let dev = slot.device.buf().as_ptr().cast_mut();
        let bytes = inputs * stride * elem;
        if bytes > slot.device.buf().len() || bytes > slot.output.buf().len() {
            return Err(Error::Internal(format!(
                "a staged reduction of {bytes} bytes in slots of {}",
                slot.device.buf().len()
            )));
        }
        if count > 0 {
            self.gpu
                .copy(stream, dev, slot.output.buf().as_ptr(), bytes)?;
            let from: Vec<*const u8> = (0..inputs)
                .map(|i| dev.add(i * stride * elem).cast_const())
                .collect();
            self.gpu.reduce(stream, op, dtype, out, &from, count)?;
            if back {
                let host = slot.input.buf().as_ptr().cast_mut();
                self.gpu.copy(stream, host, out, count * elem)?;
            }
        }
        self.copy_out.record()
    }

    /// Copies chunk `chunk`'s result from its slot into the device memory
    /// `output` (laid out as `layout` says) when `ok`, and counts the chunk
    /// as done either way, so that nothing waits for it forever.
    ///
    /// # Safety
    /// `output` must be the call's device output, valid until the copy-out
    /// stream has passed the copies.
    pub unsafe fn stage_out(
        &self,
        layout: &Layout,
        chunk: &Chunk,
        output: *mut u8,
        ok: bool,
    ) -> Result<()> {
        let slot = &self.slots[chunk.slot];
        let staged_in = match chunk.copied.get() {
            Some(event) => self.copy_out.wait(event),
            None => Ok(()),
        };
        let copied = if ok && staged_in.is_ok() {
            pieces(layout, &chunk.span, layout.blocks_out).try_for_each(|(dev, host, len)| {
                self.gpu.copy(
                    self.copy_out.raw(),
                    output.add(dev),
                    slot.output.buf().as_ptr().add(host),
                    len,
                )
            })
        } else {
            Ok(())
        };
        let counted = self.gpu.write_word(
            self.copy_out.raw(),
            self.done.device_address(0),
            chunk.id.wrapping_add(1),
        );
        self.queued_out();
        staged_in.and(copied).and(counted)
    }
}

/// A chunk's gate from the event after its copies (kept in `copied` for
/// [`Staging::stage_out`]), or from why they could not be queued.
fn copied_at(copied: &OnceLock<Arc<GpuEvent>>, event: Result<GpuEvent>) -> Result<Arc<dyn Event>> {
    event.map(|event| {
        let event = Arc::new(event);
        let _ = copied.set(event.clone());
        event as Arc<dyn Event>
    })
}

/// The copies of one side of a chunk: (offset in the device buffer, offset
/// in the slot, bytes) of each of `blocks` blocks, none when it is empty.
pub(crate) fn pieces(
    layout: &Layout,
    span: &Span,
    blocks: usize,
) -> impl Iterator<Item = (usize, usize, usize)> {
    let (elem, count, from, len) = (layout.elem, layout.count, span.from, span.len);
    let blocks = if len == 0 { 0 } else { blocks };
    (0..blocks).map(move |b| ((b * count + from) * elem, b * len * elem, len * elem))
}

impl Launch<'_> {
    /// Stages in chunk `k` of a call: its pieces of the device memory
    /// `input` (laid out as `layout` says) are copied into a free slot. A
    /// failure is not returned but becomes the chunk's gate, so that every
    /// chunk's collective is still made (and fails) as on the other ranks.
    ///
    /// # Safety
    /// `input` must be the call's device input, valid and unwritten until
    /// the chunk's gate has happened.
    pub unsafe fn stage_in(&mut self, layout: &Layout, input: *const u8, k: usize) -> Chunk {
        let (total, chunk, later) = self.next_chunk(layout.chunk(k));
        let (id, slot) = (chunk.id, chunk.slot);
        let (layout, span, copied) = (*layout, chunk.span, chunk.copied.clone());
        let input = input as usize;
        let copy_in = move |staging: &Staging| {
            let (gpu, stream) = (&staging.gpu, staging.copy_in.raw());
            let staged = (|| {
                if total >= DEPTH as u64 {
                    // The slot's previous chunk must be back on the device.
                    let value = id.wrapping_sub(DEPTH as u32).wrapping_add(1);
                    gpu.wait_word(stream, staging.done.device_address(0), value)?;
                }
                let host = staging.slots[slot].input.buf().as_ptr().cast_mut();
                for (dev, at, bytes) in pieces(&layout, &span, layout.blocks_in) {
                    let from = (input as *const u8).wrapping_add(dev);
                    // SAFETY: the caller's input, valid until the gate
                    // (this function's contract), and the slot's memory.
                    unsafe { gpu.copy(stream, host.add(at), from, bytes)? };
                }
                staging.copy_in.record()
            })();
            later.set(copied_at(&copied, staged));
        };
        let need = (total + 1).saturating_sub(AHEAD);
        self.staging.in_turn(need, Box::new(copy_in));
        chunk
    }

    /// A chunk that moves the call's device memory as it is, through a link
    /// that takes it (GPUDirect RDMA): nothing is copied, and its gate is
    /// the copy-in stream reaching it, after the caller's earlier work.
    /// [`Staging::stage_out`] (`ok` false: nothing to copy back) counts it
    /// as done, in turn with staged chunks.
    pub fn direct(&mut self) -> Chunk {
        let (total, chunk, later) = self.next_chunk(Span { from: 0, len: 0 });
        let copied = chunk.copied.clone();
        let reached =
            move |staging: &Staging| later.set(copied_at(&copied, staging.copy_in.record()));
        let need = (total + 1).saturating_sub(AHEAD);
        self.staging.in_turn(need, Box::new(reached));
        chunk
    }

    /// The call's next chunk (its number among all), covering `span`, and
    /// its gate to set.
    fn next_chunk(&mut self, span: Span) -> (u64, Chunk, Arc<Later>) {
        let total = *self.next;
        *self.next += 1;
        let later = Arc::new(Later::default());
        let chunk = Chunk {
            id: total as u32,
            span,
            slot: (total % DEPTH as u64) as usize,
            gate: later.clone(),
            copied: Arc::default(),
        };
        (total, chunk, later)
    }

    /// The slot of chunk `chunk`: its input and output host memory, and
    /// the bytes each holds.
    pub fn slot(&self, chunk: &Chunk) -> (*mut u8, *mut u8, usize) {
        let slot = &self.staging.slots[chunk.slot];
        (
            slot.input.buf().as_ptr().cast_mut(),
            slot.output.buf().as_ptr().cast_mut(),
            slot.input.buf().len().min(slot.output.buf().len()),
        )
    }

    /// The host memory chunk `chunk`'s collective reads and writes.
    ///
    /// # Safety
    /// Only for that collective, after the chunk's gate and until
    /// [`Staging::stage_out`] of the chunk.
    pub unsafe fn host_buffers(
        &self,
        layout: &Layout,
        chunk: &Chunk,
    ) -> (BufRef<'static>, BufMut<'static>) {
        let slot = &self.staging.slots[chunk.slot];
        let bytes = |blocks: usize| blocks * chunk.span.len * layout.elem;
        (
            BufRef::from_raw(
                ccl_core::MemoryKind::Host,
                slot.input.buf().as_ptr(),
                bytes(layout.blocks_in),
            ),
            BufMut::from_raw(
                ccl_core::MemoryKind::Host,
                slot.output.buf().as_ptr().cast_mut(),
                bytes(layout.blocks_out),
            ),
        )
    }

    /// Ends the call's staging: `user` waits (on the GPU) until its last
    /// chunk is back on the device (or why it cannot); the event returned
    /// happens then, either way, or fails with a timeout naming `call`
    /// after `timeout`.
    pub fn finish(
        self,
        user: &Stream,
        timeout: Duration,
        call: String,
    ) -> (Arc<dyn Event>, Result<()>) {
        let value = (*self.next) as u32;
        let staging = self.staging;
        let gated = staging
            .gpu
            .wait_word(user.raw(), staging.done.device_address(0), value);
        let staged = Arc::new(StagedOut {
            done: staging.done.clone(),
            value,
            deadline: Instant::now() + timeout,
            timeout,
            call,
        });
        (staged, gated)
    }
}
