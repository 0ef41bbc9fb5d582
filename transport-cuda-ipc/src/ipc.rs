//! Collectives among the GPUs of one host through CUDA IPC, entirely on the
//! caller's stream: no host thread takes part once a call is enqueued.
//!
//! Each rank owns device scratch memory, exported once (`cuIpcGetMemHandle`)
//! and mapped by every peer (`cuIpcOpenMemHandle`; the stand-in maps a
//! memfd), made of a header and a slot. A call is cut into chunks as for
//! staging ([`Layout`]). For each chunk every rank's stream copies its input
//! pieces into its own slot (scaled, for a pre-multiplied sum), meets the
//! others at a barrier, builds its output pieces straight from the peers'
//! slots (copies, or one reduction kernel over all slots, in rank order so
//! that every rank gets the same bits), and meets them again, so that no
//! slot is overwritten while a peer reads it. A barrier is stream-ordered
//! too: each rank writes its count of barriers into its header word
//! (`cuStreamWriteValue32`) and waits for every peer's to reach it
//! (`cuStreamWaitValue32`). Several ranks on one GPU work alike.
//!
//! Large allreduces skip the slots ([`IpcGroup::enqueue_allreduce`]): the
//! ranks describe their own buffers to each other (one host allgather per
//! call), map them once per allocation, and reduce and copy between them.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use ccl_core::{Collective, CollectiveKind, Error, Event, ReduceOp, Result, Scratch};

use crate::{
    gpu::{Gpu, Stream},
    staging::{pieces, Layout},
};

/// Bytes before the slot in each rank's scratch: word 0 counts barriers.
const HEADER: usize = 256;

/// Where an output piece of a chunk comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// Piece `piece` of every rank's slot, reduced.
    Reduce { piece: usize },
    /// Piece `piece` of rank `rank`'s slot.
    Copy { rank: usize, piece: usize },
}

/// The source of output piece `b` of `rank` for a collective of `kind`.
fn source(kind: CollectiveKind, rank: usize, root: usize, b: usize) -> Source {
    match kind {
        CollectiveKind::AllReduce | CollectiveKind::Reduce => Source::Reduce { piece: 0 },
        CollectiveKind::ReduceScatter => Source::Reduce { piece: rank },
        CollectiveKind::Broadcast => Source::Copy {
            rank: root,
            piece: 0,
        },
        CollectiveKind::Scatter => Source::Copy {
            rank: root,
            piece: rank,
        },
        CollectiveKind::AllGather | CollectiveKind::Gather => Source::Copy { rank: b, piece: 0 },
        CollectiveKind::AllToAll => Source::Copy {
            rank: b,
            piece: rank,
        },
        CollectiveKind::Barrier | CollectiveKind::SendRecv => Source::Copy { rank, piece: b },
    }
}

/// The ranks of one host whose GPUs read each other's scratch.
pub struct IpcGroup {
    gpu: Arc<dyn Gpu>,
    rank: usize,
    world_size: usize,
    _mine: Scratch,
    /// The peers' scratch, mapped here (kept for as long as the group).
    _peers: Vec<Scratch>,
    /// Device address of every rank's scratch, this rank's included.
    bases: Vec<u64>,
    slot_bytes: usize,
    /// Barriers enqueued so far (the same count on every rank).
    barriers: Mutex<u32>,
    /// The peers' user buffers mapped here, by (rank, handle): mapped once,
    /// kept while the group lives (an allocation freed by its owner stays
    /// mapped here, which keeps its memory from the driver until then).
    mapped: Mutex<HashMap<(usize, Vec<u8>), Scratch>>,
}

/// Bytes of one rank's description of its buffers for a direct call:
/// for input and output, a handle (length-prefixed), the allocation's
/// length and the buffer's offset in it.
pub const DESCRIPTION_BYTES: usize = 2 * (1 + 79 + 16);

/// Where every rank's input and output of a direct call lie, as mapped here.
pub struct Direct {
    inputs: Vec<*const u8>,
    outputs: Vec<*mut u8>,
}

/// A handle as it travels: its length, then its bytes, padded.
pub const HANDLE_BYTES: usize = 128;

impl IpcGroup {
    /// Allocates and exports this rank's scratch (a header and a slot of
    /// `slot_bytes`), hands its handle to `exchange`, which must return
    /// every rank's (an allgather over the communicator), and maps the peers'.
    pub fn new(
        gpu: Arc<dyn Gpu>,
        rank: usize,
        world_size: usize,
        slot_bytes: usize,
        exchange: impl FnOnce([u8; HANDLE_BYTES]) -> Result<Vec<[u8; HANDLE_BYTES]>>,
    ) -> Result<IpcGroup> {
        let slot_bytes = slot_bytes.max(8 * world_size);
        // Every rank takes part in the exchange, even one that failed to
        // export (it sends an empty handle), so that none waits for it.
        let exported = gpu.alloc_device(HEADER + slot_bytes).and_then(|mine| {
            let handle = gpu.export(mine.buf().as_ptr())?.handle;
            if handle.is_empty() || handle.len() >= HANDLE_BYTES {
                return Err(Error::Internal(format!(
                    "an IPC handle of {} bytes",
                    handle.len()
                )));
            }
            Ok((mine, handle))
        });
        let mut sent = [0u8; HANDLE_BYTES];
        if let Ok((_, handle)) = &exported {
            sent[0] = handle.len() as u8;
            sent[1..=handle.len()].copy_from_slice(handle);
        }
        let all = exchange(sent)?;
        let (mine, _) = exported?;
        let mut peers = Vec::new();
        let mut bases = Vec::with_capacity(world_size);
        for (p, h) in all.iter().enumerate() {
            if p == rank {
                bases.push(mine.buf().as_ptr() as u64);
                continue;
            }
            let len = h[0] as usize;
            if len == 0 {
                return Err(Error::Unsupported(format!(
                    "rank {rank}: rank {p} could not export its GPU memory for IPC"
                )));
            }
            let mapped = gpu.import(&h[1..=len], HEADER + slot_bytes).map_err(|e| {
                Error::Unsupported(format!(
                    "rank {rank}: cannot map rank {p}'s GPU memory through IPC: {e}"
                ))
            })?;
            bases.push(mapped.buf().as_ptr() as u64);
            peers.push(mapped);
        }
        Ok(IpcGroup {
            gpu,
            rank,
            world_size,
            _mine: mine,
            _peers: peers,
            bases,
            slot_bytes,
            barriers: Mutex::new(0),
            mapped: Mutex::new(HashMap::new()),
        })
    }

    /// Describes this rank's `input` and `output` (device memory) for the
    /// peers of a direct call ([`IpcGroup::map`] takes every rank's).
    pub fn describe(&self, input: *const u8, output: *mut u8) -> Result<[u8; DESCRIPTION_BYTES]> {
        let mut d = [0u8; DESCRIPTION_BYTES];
        for (half, at) in [input, output.cast_const()].into_iter().enumerate() {
            let e = self.gpu.export(at)?;
            let part = &mut d[half * DESCRIPTION_BYTES / 2..][..DESCRIPTION_BYTES / 2];
            if e.handle.len() > 79 {
                return Err(Error::Internal(format!(
                    "an IPC handle of {} bytes",
                    e.handle.len()
                )));
            }
            part[0] = e.handle.len() as u8;
            part[1..=e.handle.len()].copy_from_slice(&e.handle);
            part[80..88].copy_from_slice(&(e.len as u64).to_le_bytes());
            part[88..96].copy_from_slice(&(e.offset as u64).to_le_bytes());
        }
        Ok(d)
    }

    /// Maps every rank's buffers from their descriptions (in rank order),
    /// reusing the mappings of allocations seen before.
    pub fn map(
        &self,
        all: &[[u8; DESCRIPTION_BYTES]],
        input: *const u8,
        output: *mut u8,
    ) -> Result<Direct> {
        let mut mapped = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        let mut direct = Direct {
            inputs: Vec::with_capacity(all.len()),
            outputs: Vec::with_capacity(all.len()),
        };
        for (p, d) in all.iter().enumerate() {
            if p == self.rank {
                direct.inputs.push(input);
                direct.outputs.push(output);
                continue;
            }
            for half in 0..2 {
                let part = &d[half * DESCRIPTION_BYTES / 2..][..DESCRIPTION_BYTES / 2];
                let handle = part[1..=(part[0] as usize).min(79)].to_vec();
                let number = |at: usize| {
                    u64::from_le_bytes(part[at..at + 8].try_into().expect("8 bytes")) as usize
                };
                let (len, offset) = (number(80), number(88));
                let key = (p, handle);
                if !mapped.contains_key(&key) {
                    let m = self.gpu.import(&key.1, len).map_err(|e| {
                        Error::Unsupported(format!(
                            "rank {}: cannot map rank {p}'s buffer through IPC: {e}",
                            self.rank
                        ))
                    })?;
                    mapped.insert(key.clone(), m);
                }
                let base = mapped[&key].buf().as_ptr() as usize;
                if half == 0 {
                    direct.inputs.push((base + offset) as *const u8);
                } else {
                    direct.outputs.push((base + offset) as *mut u8);
                }
            }
        }
        Ok(direct)
    }

    /// Enqueues an allreduce (not a pre-multiplied sum) straight between
    /// the ranks' own buffers, in two steps: each rank reduces its slice of
    /// every rank's input into its output, then copies every other slice
    /// from the output of the rank that reduced it. In place works too (a
    /// rank writes only what no peer reads in that step). Returns the
    /// barrier count of its last barrier.
    ///
    /// # Safety
    /// `direct` must come from [`IpcGroup::map`] for this call, whose
    /// buffers stay valid until the stream passes it.
    pub unsafe fn enqueue_allreduce(
        &self,
        coll: &Collective,
        direct: &Direct,
        stream: &Stream,
    ) -> Result<u32> {
        let (rank, n) = (self.rank, self.world_size);
        let size = coll.dtype.size();
        let slice = |r: usize| (r * coll.count / n, (r + 1) * coll.count / n);
        let mut count = self.barriers.lock().unwrap_or_else(|p| p.into_inner());
        let (gpu, raw) = (&self.gpu, stream.raw());
        // Every rank's input is ready and output free.
        self.barrier(stream, &mut count)?;
        let (a, b) = slice(rank);
        let inputs: Vec<*const u8> = direct.inputs.iter().map(|p| p.add(a * size)).collect();
        gpu.reduce(
            raw,
            coll.op,
            coll.dtype,
            direct.outputs[rank].add(a * size),
            &inputs,
            b - a,
        )?;
        self.barrier(stream, &mut count)?;
        for q in (0..n).filter(|&q| q != rank) {
            let (a, b) = slice(q);
            let from = direct.outputs[q].add(a * size).cast_const();
            gpu.copy(
                raw,
                direct.outputs[rank].add(a * size),
                from,
                (b - a) * size,
            )?;
        }
        // No peer reads this rank's buffers any more once all are here.
        self.barrier(stream, &mut count)?;
        Ok(*count)
    }

    /// Bytes of a slot, the most a chunk stages.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot(&self, rank: usize) -> *mut u8 {
        (self.bases[rank] as usize + HEADER) as *mut u8
    }

    /// Enqueues a barrier on `stream`: this rank arrives, then waits for all.
    fn barrier(&self, stream: &Stream, count: &mut u32) -> Result<()> {
        *count = count.wrapping_add(1);
        self.gpu
            .write_word(stream.raw(), self.bases[self.rank], *count)?;
        for (p, &base) in self.bases.iter().enumerate() {
            if p != self.rank {
                self.gpu.wait_word(stream.raw(), base, *count)?;
            }
        }
        Ok(())
    }

    /// Enqueues `coll` (checked by the caller) from device memory `input`
    /// into `output` on `stream`; returns the barrier count its last
    /// barrier reaches, for [`IpcGroup::behind`] and [`IpcGroup::release`].
    ///
    /// # Safety
    /// `input` and `output` must be the call's device buffers (laid out as
    /// the collective says for this rank), valid until the stream passes
    /// the call.
    pub unsafe fn enqueue(
        &self,
        coll: &Collective,
        input: *const u8,
        output: *mut u8,
        stream: &Stream,
    ) -> Result<u32> {
        let (rank, n) = (self.rank, self.world_size);
        let layout = Layout::new(coll, rank, n, self.slot_bytes);
        let scale = matches!(coll.op, ReduceOp::PreMulSum(_)) && coll.reduces();
        let mut count = self.barriers.lock().unwrap_or_else(|p| p.into_inner());
        let (gpu, raw) = (&self.gpu, stream.raw());
        for k in 0..layout.chunks() {
            let chunk = layout.chunk(k);
            let mine = self.slot(rank);
            for (dev, at, bytes) in pieces(&layout, &chunk, layout.blocks_in) {
                let (to, from) = (mine.add(at), input.add(dev));
                if scale {
                    gpu.scale(raw, coll.op, coll.dtype, to, from, bytes / layout.elem)?;
                } else {
                    gpu.copy(raw, to, from, bytes)?;
                }
            }
            self.barrier(stream, &mut count)?;
            let piece_bytes = chunk.count() * layout.elem;
            for (b, (dev, _, bytes)) in pieces(&layout, &chunk, layout.blocks_out).enumerate() {
                let to = output.add(dev);
                match source(coll.kind, rank, coll.root, b) {
                    Source::Reduce { piece } => {
                        let inputs: Vec<*const u8> = (0..n)
                            .map(|p| self.slot(p).add(piece * piece_bytes).cast_const())
                            .collect();
                        gpu.reduce(raw, coll.op, coll.dtype, to, &inputs, bytes / layout.elem)?;
                    }
                    Source::Copy { rank: q, piece } => {
                        gpu.copy(raw, to, self.slot(q).add(piece * piece_bytes), bytes)?;
                    }
                }
            }
            self.barrier(stream, &mut count)?;
        }
        Ok(*count)
    }

    /// The peers whose streams have not reached barrier `count`.
    pub fn behind(&self, count: u32) -> Vec<usize> {
        (0..self.world_size)
            .filter(|&p| p != self.rank)
            .filter(|&p| {
                self.gpu
                    .read_word(self.bases[p])
                    .is_ok_and(|w| (w.wrapping_sub(count) as i32) < 0)
            })
            .collect()
    }

    /// After a failure: lets this rank's stream pass every barrier up to
    /// `count` (the peers' words, as this rank sees them, jump ahead). The
    /// results are then undefined and the communicator must not be used.
    pub fn release(&self, count: u32) {
        for (p, &base) in self.bases.iter().enumerate() {
            if p != self.rank {
                let _ = self.gpu.set_word(base, count);
            }
        }
    }
}

/// The end of a call on the IPC path, which a `Work` waits for: its event,
/// under the call's deadline.
pub struct IpcDone {
    pub event: Arc<dyn Event>,
    pub group: Arc<IpcGroup>,
    /// The barrier count the call's last barrier reaches.
    pub count: u32,
    pub deadline: std::time::Instant,
    /// The call's whole deadline, as errors state it.
    pub timeout: std::time::Duration,
    /// Names the call in errors (`allreduce(...) on rank 0`).
    pub call: String,
    /// Runs once the deadline has passed (to abort the communicator).
    pub on_timeout: Box<dyn Fn() + Send + Sync>,
}

impl IpcDone {
    fn timed_out(&self) -> Error {
        let behind = self.group.behind(self.count);
        self.group.release(self.count);
        (self.on_timeout)();
        Error::Timeout {
            context: self.call.clone(),
            what: format!("ranks {behind:?} to reach the call on their GPU streams"),
            after: self.timeout,
        }
    }
}

impl Event for IpcDone {
    fn query(&self) -> Result<bool> {
        if self.event.query()? {
            return Ok(true);
        }
        if std::time::Instant::now() >= self.deadline {
            return Err(self.timed_out());
        }
        Ok(false)
    }

    fn synchronize(&self, timeout: Option<std::time::Duration>) -> Result<bool> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        let wait = timeout.map_or(left, |t| t.min(left));
        if self.event.synchronize(Some(wait))? {
            return Ok(true);
        }
        if std::time::Instant::now() >= self.deadline {
            return Err(self.timed_out());
        }
        Ok(false)
    }
}

/// Bytes of a rank's [`sharing`] description.
pub const SHARING_BYTES: usize = 17;

/// What a rank tells the others of its GPU: its UUID, then 1 if the work
/// of several processes runs there side by side, 0 if by turns, 2 unknown.
pub fn sharing(gpu: &dyn Gpu) -> Result<[u8; SHARING_BYTES]> {
    let mut d = [0u8; SHARING_BYTES];
    d[..16].copy_from_slice(&gpu.uuid()?);
    d[16] = match gpu.side_by_side() {
        Some(true) => 1,
        Some(false) => 0,
        None => 2,
    };
    Ok(d)
}

/// The ranks (by every rank's [`sharing`], in rank order) that share a GPU
/// which takes their work by turns: each call then waits for the others'
/// time slices. One list per such GPU, lowest rank first.
pub fn taking_turns(all: &[[u8; SHARING_BYTES]]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (rank, d) in all.iter().enumerate() {
        match groups.iter_mut().find(|g| all[g[0]][..16] == d[..16]) {
            Some(g) => g.push(rank),
            None => groups.push(vec![rank]),
        }
    }
    groups.retain(|g| g.len() > 1 && g.iter().any(|&r| all[r][16] == 0));
    groups
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(id: u8, side_by_side: u8) -> [u8; SHARING_BYTES] {
        let mut d = [id; SHARING_BYTES];
        d[16] = side_by_side;
        d
    }

    #[test]
    fn ranks_sharing_a_time_sliced_gpu_are_named() {
        // One GPU each: nothing to say, whatever the mode.
        assert!(taking_turns(&[gpu(1, 0), gpu(2, 0)]).is_empty());
        // Two ranks on GPU 1 by turns, two on GPU 2 under MPS, one unknown.
        let all = [gpu(1, 0), gpu(2, 1), gpu(1, 0), gpu(2, 1), gpu(3, 2)];
        assert_eq!(taking_turns(&all), vec![vec![0, 2]]);
        // Unknown is not reported.
        assert!(taking_turns(&[gpu(4, 2), gpu(4, 2)]).is_empty());
        let stand_in = crate::StandInGpu::new(0).unwrap();
        let d = sharing(&stand_in).unwrap();
        assert!(taking_turns(&[d, d]).is_empty());
    }
}
