//! The board algorithms: every collective on group memory, one post per
//! rank per chunk, and board-direct allreduce and reduce. They run on the
//! caller's thread, without the executor or the runtime.
//!
//! A call goes in chunks, one board round each, so that a chunk fits a slot.
//! The data of a call is laid out as blocks of one rank's part: one block
//! (allreduce, reduce, broadcast: the buffer; allgather, gather: the rank's
//! part) or n blocks (reduce-scatter, all-to-all, scatter: one per rank).
//! Chunk `c` covers the same bytes `c·piece..` of every block.
//!
//! [`Algorithm::Board`](crate::Algorithm::Board): each rank posts
//! its chunk once (of n blocks, all but its own, which it takes from its
//! input), reads what it needs from the others' posts, and computes its
//! result locally (a reduction in rank order, so every rank gets the same
//! bits; a reduce-scatter's block starts from the rank's own input). A
//! rank checks the header of every post it reads, so that a rank that made
//! another call is a mismatch; where a rank reads nobody's posts (a
//! broadcast's root, a reduce's other ranks) it returns once it posted, and
//! the ranks that read it report the mismatch (`BoardCall::reads`).
//!
//! [`Algorithm::BoardDirect`](crate::Algorithm::BoardDirect)
//! (allreduce, reduce): a chunk is cut into n shares. Each rank posts the
//! shares of the others, reduces its own share (1/n of the elements) from
//! its input and every other rank's post, publishes the result in its slot,
//! in the place of the share it did not post (a second phase), and the
//! ranks that want the result copy the others' shares out of the slots.
//! Each byte is reduced once on the whole host, by one rank; per rank,
//! (n−1)/n of the buffer is posted, 1/n reduced and (n−1)/n copied out,
//! with no per-message hand-shake. Where the output is streamed (below),
//! the share is reduced right in the slot, and copied out with the others.
//!
//! Where every buffer a reduction reads or writes across ranks lies in a
//! shared buffer (`ccl::SharedBuffer`, which each rank maps), the ranks
//! reduce straight out of each other's inputs instead of posting them
//! (`BoardCall::reduce_mapped`).
//!
//! Where the outputs of all ranks together reach the memory's
//! [`GroupMemory::stream_min`] (64 MiB on the shared-memory board), every
//! byte a rank writes into its output goes there with streaming stores,
//! which do not first read the line they write: results are computed where
//! the cache holds them (a board-direct slot, else scratch) and streamed
//! out from there.

use std::time::Duration;

use ccl_core::{
    kernels, AlignedBuf, Call, CollectiveKind, Deadline, Error, GroupMemory, MemoryKind, Region,
    Remote, Result,
};

use super::Round;
use crate::IoBuffers;

/// The largest block that several ranks read straight out of its owner's
/// buffer (allgather, broadcast, more than two ranks). Beyond the caches
/// each reader fetches it from memory again, while a post is fetched once
/// and its readers find it in cache: on a 2-core VM, 4 ranks, allgather of
/// 64 MiB reached 2.2 GB/s by direct reads against 2.7–3.0 through posts,
/// and broadcast from 1 MiB 10–30% less.
pub(crate) const SHARED_DIRECT_MAX: usize = 512 * 1024;

/// The largest block of a gather of more than two ranks copied directly
/// (where it was measured, at 2 ranks before the senders wrote a share of
/// their blocks themselves, posts won beyond it: a 64 MiB gather on a 2-core
/// VM took 14.9–16.3 ms direct against 13.5–13.9, as through posts the
/// senders copy into their slots while the root copies out). A 2-rank
/// gather or broadcast has none: with the shares (`BoardCall::read_share`)
/// a gather was even with posts from 32 to 256 MiB while the VM's cores
/// shared a cache, and 4–5 times faster while they did not (32 MiB: 1.5–1.8
/// ms against 7.4; posts are read from the writer's cache), and a broadcast
/// was faster direct up to 128 MiB. Beyond it, blocks in shared buffers are
/// still read directly (`BoardCall::posts_unless_shared`): 4 ranks' gather
/// of 128 MiB took 4.7–5.0 ms through the mappings against 6.3–6.7 through
/// posts.
pub(crate) const GATHER_DIRECT_MAX: usize = 8 << 20;

/// Round trips of empty posts that time how near two ranks' cores are.
const PROBE_ROUNDS: usize = 16;

/// The longest round trip of empty posts between two ranks whose cores
/// share a cache: 160–250 ns on the project's VM while they did, 530–630
/// while they did not.
const NEAR_NS: u64 = 400;

/// Whether a collective moves data without reducing it.
fn moves(kind: CollectiveKind) -> bool {
    matches!(
        kind,
        CollectiveKind::AllGather
            | CollectiveKind::Gather
            | CollectiveKind::AllToAll
            | CollectiveKind::Broadcast
            | CollectiveKind::Scatter
    )
}

/// The largest chunk of a board call, except board-direct's where the
/// outputs reach [`GroupMemory::stream_min`] and calls that move blocks of
/// at least [`SLOT_CHUNKS_MIN`] (those fill the slot). A chunk is posted and
/// read back on the other ranks while it stays in the caches. On a 2-core
/// VM, 1 MiB chunks instead made the broadcast of 8 and 64 MiB 3–14% slower
/// at 2 and 4 ranks, and board-direct's allreduce of 2 MiB at 4 ranks 11%
/// slower (medians of 3–6 alternating runs).
const CHUNK_MAX: usize = 256 * 1024;

/// The smallest call (the larger of the root's input and output) of a
/// collective that moves blocks whose chunks fill the slot, where the
/// ranks have CPUs of their own; [`SLOT_CHUNKS_MIN_SHARING_CPUS`] where
/// they share them. On a 2-vCPU AMD EPYC VM (2 MiB of L2 per core) a chunk
/// read by the other core while it lies in the writer's L2 crossed at 8–10
/// GB/s, one of 1 MiB (pushed out to the L3 by the next) at 26–40: medians
/// of 4 alternating runs of 2, 8 and 32 MiB, 256 KiB chunks against 1 MiB,
/// 2 ranks (µs): broadcast 252/146, 1489/808, 6567/4649; all-to-all
/// 165/105, 1202/868, 4850/3801; scatter 168/105, 785/382, 4008/3210;
/// allgather 140/76, 1026/698, 4059/4057; gather 465/508, 1805/1436,
/// 7048/6844 (docs/compare/chunks/).
const SLOT_CHUNKS_MIN: usize = 2 << 20;

/// [`SLOT_CHUNKS_MIN`] where the ranks outnumber their CPUs. On that VM, 4
/// ranks, 256 KiB chunks against 1 MiB: 2 MiB all-to-all 363/437 µs and
/// scatter 192/320 (broadcast 313/227); 8 and 32 MiB all-to-all 3010/2853,
/// 10606/9402, broadcast 2482/1811, 9357/7225, scatter 990/878, 5076/4683,
/// gather 542/733, 2900/2764.
const SLOT_CHUNKS_MIN_SHARING_CPUS: usize = 8 << 20;

/// The share of the slot that a call of one block a round (broadcast,
/// allgather, gather) fills, where [`SLOT_CHUNKS_MIN`] says it fills it:
/// half, so that a round's copies (the input into the post and into the
/// output, the peer's post out) stay within a core's 2 MiB of L2. On a
/// 2-vCPU AMD EPYC VM of CPU family 26 (Zen 5), the whole slot against
/// half, medians of 6 alternating runs at 2 ranks (µs), 2, 8, 32 and 128
/// MiB: allgather 74/64, 460/290, 3037/2813, 11,941/11,430 (17,431/12,458
/// while the cores were far); broadcast 88/79, 531/469, 3339/3127,
/// 12,697/13,399; gather 62/57, 301/233, 1854/1930, 8366/7801; at 4 ranks,
/// 8 MiB: allgather 1166/888, broadcast 1047/876, gather 370/262. A
/// quarter was no faster than half. Calls of n blocks a round (all-to-all,
/// scatter) already post (n − 1)/n of the slot at most, and were even or
/// slower with half of that (docs/compare/zen5/chunks/).
const ONE_BLOCK_SLOT_SHARE: usize = 2;

/// The largest allreduce run as [`BoardCall::small_allreduce`] (where it
/// fits a slot, and is not streamed): one chunk, below mapped reductions.
const SMALL_ALLREDUCE_MAX: usize = 2048;

/// The largest broadcast run as [`BoardCall::small_broadcast`] (where it
/// fits a slot, and is not streamed): one chunk, below direct reads.
const SMALL_BROADCAST_MAX: usize = 2048;

/// The parts of one post, each at its offset in the payload: on the stack
/// up to 8 (a call of up to 9 ranks posts without an allocation).
type Parts<'a> = smallvec::SmallVec<[(usize, &'a [u8]); 8]>;

/// One board call: the call and whether it runs as board-direct.
pub(super) struct BoardCall<'a> {
    pub call: &'a Call,
    /// Run as [`Algorithm::BoardDirect`](crate::Algorithm::BoardDirect)
    /// (allreduce and reduce), not as one post per rank.
    pub direct: bool,
}

impl BoardCall<'_> {
    /// Runs the call on `mem`, reading `io`'s input and writing its output
    /// (host memory, one buffer each or, for board-direct allreduce in
    /// place, several taken end to end), within `timeout`.
    pub(super) fn run(
        &self,
        mem: &dyn GroupMemory,
        io: &IoBuffers<'_>,
        timeout: Duration,
    ) -> Result<()> {
        if io.kind() != MemoryKind::Host {
            return Err(Error::Unsupported(format!(
                "{}: the board reads and writes host memory, and the buffers lie in {}",
                self.call.name(),
                io.kind()
            )));
        }
        let (inputs, outputs) = (Pieces(io.input_pieces()), Pieces(io.output_pieces()));
        if let Some(result) = self.small(mem, inputs, outputs, timeout) {
            return result;
        }
        self.chunks(mem, inputs, outputs, timeout)
    }

    /// Runs a small allreduce or broadcast ([`Self::small_allreduce`],
    /// [`Self::small_broadcast`]: one buffer each, of the lengths the call
    /// needs) before `chunks` weighs its other paths; `None` for any other
    /// call, which `chunks` runs or refuses.
    fn small(
        &self,
        mem: &dyn GroupMemory,
        inputs: Pieces<'_>,
        outputs: Pieces<'_>,
        timeout: Duration,
    ) -> Option<Result<()>> {
        let coll = &self.call.coll;
        let max = match coll.kind {
            CollectiveKind::AllReduce if !self.direct => SMALL_ALLREDUCE_MAX,
            CollectiveKind::Broadcast if !self.direct => SMALL_BROADCAST_MAX,
            _ => return None,
        };
        let part = coll.count * coll.dtype.size();
        if part > max.min(mem.slot_bytes()) || streams(mem, part) {
            return None;
        }
        let (input, output) = (inputs.one()?, outputs.one()?);
        let need_in = if self.posts(self.call.rank) { part } else { 0 };
        if input.1 < need_in || output.1 < part {
            return None;
        }
        Some(match coll.kind {
            CollectiveKind::AllReduce => self.small_allreduce(mem, input, output, part, timeout),
            _ => self.small_broadcast(mem, input, output, part, timeout),
        })
    }

    /// Blocks per rank and bytes per block (see the module docs).
    fn layout(&self, n: usize) -> (usize, usize) {
        let coll = &self.call.coll;
        let part = coll.count * coll.dtype.size();
        match coll.kind {
            CollectiveKind::ReduceScatter | CollectiveKind::AllToAll | CollectiveKind::Scatter => {
                (n, part)
            }
            CollectiveKind::Barrier => (1, 0),
            _ => (1, part),
        }
    }

    /// Whether rank `r` posts data (roots alone do for broadcast, scatter).
    fn posts(&self, r: usize) -> bool {
        match self.call.coll.kind {
            CollectiveKind::Broadcast | CollectiveKind::Scatter => r == self.call.coll.root,
            CollectiveKind::Barrier => false,
            _ => true,
        }
    }

    /// Whether rank `me` reads rank `r`'s posts, and so checks its calls:
    /// a broadcast's or scatter's root reads nobody's and the others only
    /// the root's; a reduce's or gather's root reads everybody's and the
    /// others nobody's (board-direct: everybody reads everybody's). A rank
    /// that reads nobody's returns once it posted, as an MPI root does, and
    /// may run ahead of the others (see the group memory's `begin`); a call
    /// that does not match is reported on the ranks that read it.
    fn reads(&self, me: usize, r: usize) -> bool {
        let root = self.call.coll.root;
        match self.call.coll.kind {
            CollectiveKind::Broadcast | CollectiveKind::Scatter => me != root && r == root,
            CollectiveKind::Reduce | CollectiveKind::Gather if !self.direct => me == root,
            _ => true,
        }
    }

    /// Whether the chunks of a call that moves blocks fill the slot
    /// ([`SLOT_CHUNKS_MIN`]): the same answer on every rank.
    fn fills_slots(&self, mem: &dyn GroupMemory, n: usize) -> bool {
        let (input, output) = self.needs(self.call.coll.root, n);
        let min = match mem.ranks_share_cpus() {
            true => SLOT_CHUNKS_MIN_SHARING_CPUS,
            false => SLOT_CHUNKS_MIN,
        };
        moves(self.call.coll.kind) && input.max(output) >= min
    }

    /// Bytes of input and output this rank needs, for the checks up front.
    fn needs(&self, me: usize, n: usize) -> (usize, usize) {
        let (blocks, part) = self.layout(n);
        let at_root = |x: usize| if me == self.call.coll.root { x } else { 0 };
        let input = if self.posts(me) { blocks * part } else { 0 };
        let output = match self.call.coll.kind {
            CollectiveKind::AllReduce
            | CollectiveKind::Broadcast
            | CollectiveKind::ReduceScatter
            | CollectiveKind::Scatter => part,
            CollectiveKind::Reduce => at_root(part),
            CollectiveKind::AllGather | CollectiveKind::AllToAll => n * part,
            CollectiveKind::Gather => at_root(n * part),
            CollectiveKind::Barrier | CollectiveKind::SendRecv => 0,
        };
        (input, output)
    }

    fn chunks(
        &self,
        mem: &dyn GroupMemory,
        inputs: Pieces<'_>,
        outputs: Pieces<'_>,
        timeout: Duration,
    ) -> Result<()> {
        let (call, coll) = (self.call, &self.call.coll);
        let (n, me) = (call.world_size, call.rank);
        let es = coll.dtype.size();
        let direct = self.direct
            && matches!(
                coll.kind,
                CollectiveKind::AllReduce | CollectiveKind::Reduce
            );
        if self.direct && !direct {
            return Err(Error::Internal(format!(
                "{} cannot run as board-direct",
                call.name()
            )));
        }
        let (blocks, part) = self.layout(n);
        let (need_in, need_out) = self.needs(me, n);
        if inputs.len() < need_in || outputs.len() < need_out {
            return Err(Error::Internal(format!(
                "{}: buffers of {} and {} bytes, the board call needs {need_in} and {need_out}",
                call.name(),
                inputs.len(),
                outputs.len()
            )));
        }
        // Only board-direct works on several buffers; the rest want one.
        let (input, output) = match (inputs.one(), outputs.one()) {
            (Some(i), Some(o)) => (i, o),
            _ if direct => (inputs.first(), outputs.first()),
            _ => {
                return Err(Error::Internal(format!(
                    "{} cannot run on several buffers",
                    call.name()
                )))
            }
        };
        let in_place = std::ptr::eq(input.0, output.0);
        let several = inputs.one().is_none();
        // SAFETY (for every slice below): the engine hands this call its
        // buffers alone. Each chunk of the input is read in full (posted)
        // before the same chunk of the output, which may be the same memory
        // (in place), is written, and later chunks of the input are not
        // written before they are posted: in-place layouts put this rank's
        // input block where its own output goes.
        let inp = |at: usize, len: usize| unsafe { slice(input.0.add(at), len) };
        let out = |at: usize, len: usize| unsafe { slice_mut(output.0.add(at), len) };
        // Outputs beyond the caches: board-direct's chunks fill the slot, an
        // allgather goes through posts (at 2 ranks while their cores are
        // near), and outputs are written with streaming stores. Chunks and
        // paths must agree on every rank, so this goes by the root's output
        // (a reduce's other ranks have none).
        let large = streams(mem, self.needs(coll.root, n).1);
        let chunk = if direct && large {
            mem.slot_bytes()
        } else if self.fills_slots(mem, n) {
            match blocks {
                // Never below the chunk of smaller calls (slots shrink
                // beyond 16 ranks).
                1 => (mem.slot_bytes() / ONE_BLOCK_SLOT_SHARE).max(mem.slot_bytes().min(CHUNK_MAX)),
                _ => mem.slot_bytes(),
            }
        } else {
            mem.slot_bytes().min(CHUNK_MAX)
        };
        let piece = (chunk / blocks / es * es).max(es);
        // Where a reduction to be streamed out is computed first.
        let mut scratch = Vec::new();
        let deadline = Deadline::after(timeout);
        // In place, the collectives that read their output as input find its
        // lines in the cache, where a plain store is cheaper than a streaming one.
        let overlap = several
            || (input.0 as usize) < output.0 as usize + output.1
                && (output.0 as usize) < input.0 as usize + input.1;
        let reads_output = overlap
            && matches!(
                coll.kind,
                CollectiveKind::AllReduce
                    | CollectiveKind::Reduce
                    | CollectiveKind::ReduceScatter
                    | CollectiveKind::AllToAll
            );
        let stream = !reads_output && need_out > 0 && large;
        if self.may_reduce_mapped(mem, part, piece)
            && self.reduce_mapped(mem, input, output, several, piece, stream, &deadline)?
        {
            return Ok(());
        }
        // Calls that would read through posts for the size of their blocks,
        // or because the kernel's copies do not pay, ask first whether the
        // blocks lie in shared buffers (and a 2-rank allgather whether the
        // cores are far; see `shared_or_far`).
        let direct_reads = match self.posts_unless_shared(mem, part, large) {
            Some(probe) => self.shared_or_far(mem, input, output, probe, &deadline)?,
            None => self.reads_directly(mem, part, large).then_some(true),
        };
        if let Some(writes) = direct_reads {
            return self.read_directly(mem, input, output, stream, writes, &deadline);
        }
        let mut off = 0;
        let mut step = u32::from(direct);
        loop {
            let len = piece.min(part - off);
            let posted = |r: usize| if self.posts(r) { blocks * len } else { 0 };
            let round = Round::begin(mem, call.header(step, 0), &deadline)?;
            let elems = len / es;
            // Bytes of rank p's share of a chunk (board-direct).
            let share = |p: usize| (p * elems / n * es, (p + 1) * elems / n * es);
            if direct {
                // The others reduce every share but this rank's own, which
                // it reduces straight from its input.
                let (lo, hi) = share(me);
                let mut parts = Parts::new();
                for (at, from) in [(0, lo), (hi, len - hi)] {
                    // SAFETY: see above.
                    unsafe {
                        inputs.each(off + at, from, |rel, p, l| {
                            parts.push((at + rel, slice(p, l)))
                        })
                    };
                }
                round.post_at(len, &parts)?;
            } else if self.posts(me) && blocks == 1 {
                // The common case, without an allocation per round.
                round.post(inp(off, len))?;
            } else if self.posts(me) {
                // Of n blocks (reduce-scatter, all-to-all, scatter), a rank
                // takes its own from its input: it posts the others.
                let parts: Parts<'_> = (0..blocks)
                    .filter(|&b| b != me)
                    .map(|b| (b * len, inp(b * part + off, len)))
                    .collect();
                round.post_at(blocks * len, &parts)?;
            } else {
                round.post(&[])?;
            }
            let is_root = me == coll.root;
            // The header of every post this rank reads is checked before
            // any output is written, which a reduction of two posts below
            // does by itself (it reads both before it writes).
            let reduces_both = !direct
                && n == 2
                && (coll.kind == CollectiveKind::AllReduce
                    || coll.kind == CollectiveKind::Reduce && is_root);
            if !reduces_both {
                for r in (0..n).filter(|&r| self.reads(me, r)) {
                    round.read(r, posted(r))?;
                }
            }
            match coll.kind {
                CollectiveKind::AllReduce | CollectiveKind::Reduce if direct => {
                    let (lo, hi) = share(me);
                    let wants = coll.kind == CollectiveKind::AllReduce || is_root;
                    // A result that is not streamed out is reduced straight
                    // into the output and published as a copy. Otherwise
                    // it is reduced in this rank's slot, in the place of the
                    // share it did not post, and copied out from there.
                    let in_output = wants && !stream;
                    round.post_reduced(lo, hi - lo, &mut |slot| {
                        if in_output {
                            let mut mine = Vec::new();
                            // SAFETY: see above.
                            unsafe {
                                outputs.each(off + lo, hi - lo, |rel, p, l| {
                                    mine.push((rel, slice_mut(p, l)))
                                })
                            };
                            for (rel, out) in mine {
                                // In place the output holds the input's share.
                                let own = (!in_place).then(|| inp(off + lo + rel, out.len()));
                                let range = lo + rel..lo + rel + out.len();
                                self.reduce_share(&round, me, n, len, out, own, range)?;
                                slot[rel..rel + out.len()].copy_from_slice(out);
                            }
                            return Ok(());
                        }
                        let own = if several {
                            // The share of an input of several buffers (in
                            // place) is gathered from them first.
                            // SAFETY: see above.
                            unsafe {
                                inputs.each(off + lo, hi - lo, |rel, p, l| {
                                    slot[rel..rel + l].copy_from_slice(slice(p, l))
                                })
                            };
                            None
                        } else {
                            Some(inp(off + lo, hi - lo))
                        };
                        self.reduce_share(&round, me, n, len, slot, own, lo..hi)
                    })?;
                    // Every share not in the output yet, from the slots.
                    for p in (0..n).filter(|&p| wants && (p != me || !in_output)) {
                        let (plo, phi) = share(p);
                        let mut result = Ok(());
                        // SAFETY: see above.
                        unsafe {
                            outputs.each(off + plo, phi - plo, |rel, to, l| {
                                if result.is_ok() {
                                    result =
                                        round.read_reduced(p, plo + rel, l).and_then(|theirs| {
                                            kernels::copy(slice_mut(to, l), theirs, stream)
                                        });
                                }
                            })
                        };
                        result?;
                    }
                }
                CollectiveKind::AllReduce | CollectiveKind::Reduce
                    if coll.kind == CollectiveKind::AllReduce || is_root =>
                {
                    self.reduce_all(&round, n, out(off, len), stream.then_some(&mut scratch))?
                }
                CollectiveKind::ReduceScatter => {
                    // This rank's block from its input and the others' posts;
                    // in place the output holds it already.
                    let at = me * part + off;
                    let range = me * len..(me + 1) * len;
                    if stream {
                        scratch.resize(len, 0);
                        let own = Some(inp(at, len));
                        self.reduce_share(&round, me, n, n * len, &mut scratch, own, range)?;
                        kernels::copy(out(off, len), &scratch, true)?;
                    } else {
                        let holds =
                            std::ptr::eq(input.0.wrapping_add(at), output.0.wrapping_add(off));
                        let own = (!holds).then(|| inp(at, len));
                        self.reduce_share(&round, me, n, n * len, out(off, len), own, range)?;
                    }
                }
                // This rank's own block comes from its input, not back out of
                // its post: in place it is where it belongs already, and a
                // streaming store there would only evict it.
                CollectiveKind::Broadcast if is_root => {
                    kernels::copy(out(off, len), inp(off, len), stream)?
                }
                CollectiveKind::Broadcast => {
                    kernels::copy(out(off, len), round.read(coll.root, len)?, stream)?
                }
                CollectiveKind::Scatter if is_root => {
                    kernels::copy(out(off, len), inp(me * part + off, len), stream)?
                }
                CollectiveKind::Scatter => kernels::copy(
                    out(off, len),
                    &round.read(coll.root, n * len)?[me * len..(me + 1) * len],
                    stream,
                )?,
                CollectiveKind::AllGather | CollectiveKind::Gather
                    if coll.kind == CollectiveKind::AllGather || is_root =>
                {
                    for r in 0..n {
                        let from = match r == me {
                            true => inp(off, len),
                            false => round.read(r, len)?,
                        };
                        kernels::copy(out(r * part + off, len), from, stream)?;
                    }
                }
                CollectiveKind::AllToAll => {
                    for r in 0..n {
                        let from = match r == me {
                            true => inp(me * part + off, len),
                            false => &round.read(r, n * len)?[me * len..(me + 1) * len],
                        };
                        kernels::copy(out(r * part + off, len), from, stream)?;
                    }
                }
                // Non-roots of reduce and gather only post; a barrier only
                // checks the headers.
                _ => {}
            }
            off += len;
            step += 1;
            if off >= part {
                return Ok(());
            }
        }
    }

    /// A small allreduce (of at most [`SMALL_ALLREDUCE_MAX`] bytes and a
    /// slot, not streamed, one buffer each): one round, as [`Self::chunks`]
    /// runs it, without the choices that come out the same for every such
    /// call (one chunk, no mapped reduction). On its latency the whole
    /// call path counts: on a 2-vCPU AMD EPYC VM, 2 ranks' 8 B allreduce
    /// took a median of 0.19 µs against 0.205 through `chunks`.
    fn small_allreduce(
        &self,
        mem: &dyn GroupMemory,
        input: (*mut u8, usize),
        output: (*mut u8, usize),
        len: usize,
        timeout: Duration,
    ) -> Result<()> {
        let n = self.call.world_size;
        let deadline = Deadline::after(timeout);
        let round = Round::begin(mem, self.call.header(0, 0), &deadline)?;
        // SAFETY: as in `chunks`; the input is posted in full before the
        // output, which may be the same memory, is written.
        round.post(unsafe { slice(input.0, len) })?;
        // Every post's header is checked before the output is written,
        // which the reduction of two posts does by itself.
        if n > 2 {
            for r in 0..n {
                round.read(r, len)?;
            }
        }
        self.reduce_all(&round, n, unsafe { slice_mut(output.0, len) }, None)
    }

    /// A small broadcast (of at most [`SMALL_BROADCAST_MAX`] bytes and a
    /// slot, not streamed, one buffer each): one round, as [`Self::chunks`]
    /// would run it, without the choices that come out the same for every
    /// such call. The root returns once it posted and runs ahead of the others
    /// (the group memory's `begin`), so a run of broadcasts goes at the pace
    /// of the slower side's call path, not of a round trip: on a 2-vCPU AMD
    /// EPYC VM, 2 ranks' 8 B broadcast took 1,250 instructions a call on the
    /// root and 1,400 on the other rank against 1,610 and 1,940 through
    /// `chunks` (callgrind, with the board's inline look in `begin`), and a
    /// median of 0.18 µs against 0.225.
    fn small_broadcast(
        &self,
        mem: &dyn GroupMemory,
        input: (*mut u8, usize),
        output: (*mut u8, usize),
        len: usize,
        timeout: Duration,
    ) -> Result<()> {
        let root = self.call.coll.root;
        let deadline = Deadline::after(timeout);
        let round = Round::begin(mem, self.call.header(0, 0), &deadline)?;
        // SAFETY: as in `chunks`; in place the root's output is its input,
        // which it only posts.
        if self.call.rank == root {
            round.post(unsafe { slice(input.0, len) })?;
            if std::ptr::eq(input.0, output.0) {
                return Ok(());
            }
            let (inp, out) = unsafe { (slice(input.0, len), slice_mut(output.0, len)) };
            out.copy_from_slice(inp);
            return Ok(());
        }
        round.post(&[])?;
        let theirs = round.read(root, len)?;
        unsafe { slice_mut(output.0, len) }.copy_from_slice(theirs);
        Ok(())
    }

    /// Whether the call copies its blocks straight out of the other ranks'
    /// buffers: it moves data without reducing it, in blocks of at least
    /// the size from which the memory offers direct reads and at most the
    /// limits above, where the kernel's copies pay (the same answer on
    /// every rank). Not an allgather whose outputs are `large` (streamed):
    /// while the ranks' cores share a cache
    /// every rank's copies out of the posts stream, which the kernel's
    /// copies do not, and on a 2-core VM 2 ranks' allgather of a 128 MiB
    /// buffer took 15.2–17.7 ms through posts against 17.0–24.4 by direct
    /// reads (docs/DESIGN.md has the far side); all-to-all and scatter lost
    /// through posts. Calls that this keeps to posts may still read
    /// directly ([`Self::posts_unless_shared`]).
    fn reads_directly(&self, mem: &dyn GroupMemory, part: usize, large: bool) -> bool {
        let kind = self.call.coll.kind;
        let max = match kind {
            CollectiveKind::AllGather if large => 0,
            CollectiveKind::AllGather | CollectiveKind::Broadcast if self.call.world_size > 2 => {
                SHARED_DIRECT_MAX
            }
            CollectiveKind::Gather if self.call.world_size > 2 => GATHER_DIRECT_MAX,
            _ => usize::MAX,
        };
        moves(kind)
            && part > 0
            && part <= max
            && mem.direct_min().is_some_and(|min| part >= min)
            && mem.kernel_copies_pay()
    }

    /// Where [`Self::reads_directly`] keeps a call that moves blocks to
    /// posts though they may be read directly: an allgather, broadcast or
    /// gather for the size of its blocks (above 2 ranks, or an allgather of
    /// large outputs), and any such call where the kernel's copies do not pay
    /// ([`GroupMemory::kernel_copies_pay`]). Then `Some(probe)`, `probe`
    /// telling whether to probe the cores (a 2-rank allgather whose ranks
    /// have CPUs of their own, where the kernel's copies pay); the same
    /// answer on every rank.
    fn posts_unless_shared(&self, mem: &dyn GroupMemory, part: usize, large: bool) -> Option<bool> {
        let (kind, n) = (self.call.coll.kind, self.call.world_size);
        let pay = mem.kernel_copies_pay();
        let could = mem.direct_min().is_some_and(|min| part >= min)
            && moves(kind)
            && (!pay
                || matches!(
                    kind,
                    CollectiveKind::AllGather | CollectiveKind::Broadcast | CollectiveKind::Gather
                ));
        if !could || self.reads_directly(mem, part, large) {
            return None;
        }
        let probe = pay && n == 2 && kind == CollectiveKind::AllGather && !mem.ranks_share_cpus();
        Some(probe)
    }

    /// Whether a call that [`Self::posts_unless_shared`] keeps to posts
    /// reads directly after all (`Some`): where every input it reads lies in
    /// a shared buffer, which the reading ranks copy with their own loads and
    /// streaming stores, or (`probe`) where the ranks' cores are far now.
    /// Inside `Some`, whether the sources may write shares of their blocks
    /// into the destinations' outputs ([`Self::read_directly`]): where the
    /// kernel's copies pay or those outputs are shared too.
    /// On a 2-core VM through shared buffers: 2 ranks' allgather of 128
    /// MiB took 10.3 ms against 15.4 through posts; 4 ranks' broadcast of
    /// 8 MiB 1.1–1.2 ms against 4.7–5.0, allgather of 8 MiB 0.8–1.5 against
    /// 2.2–2.9, of 128 MiB 22.9–24.6 against 25.5–27.0.
    ///
    /// Every rank posts whether its input and its output are shared, and
    /// reads the answers of the ranks whose inputs the call reads (a
    /// broadcast's or scatter's root; the others of a gather; every rank of
    /// an allgather or all-to-all) or whose outputs the sources would write
    /// (a broadcast's or scatter's other ranks; a gather's root). The
    /// probe: both ranks post and read [`PROBE_ROUNDS`] empty rounds, which
    /// run in lockstep: two rounds
    /// take about the time a post takes to reach the other core and back.
    /// Rank 0 times them in pairs and posts whether the fastest pair took
    /// less than [`NEAR_NS`] (the fastest, as a rank may be interrupted);
    /// both ranks go direct where it did not.
    fn shared_or_far(
        &self,
        mem: &dyn GroupMemory,
        input: (*mut u8, usize),
        output: (*mut u8, usize),
        probe: bool,
        deadline: &Deadline,
    ) -> Result<Option<bool>> {
        let (header, me, n) = (self.call.header(0, 0), self.call.rank, self.call.world_size);
        let (kind, root) = (self.call.coll.kind, self.call.coll.root);
        let shared = |(at, len): (*mut u8, usize)| u8::from(mem.region(at as u64, len).id != 0);
        let mine = [shared(input), shared(output)];
        let round = Round::begin(mem, header, deadline)?;
        round.post(&mine)?;
        let (mut inputs, mut outputs) = (true, true);
        for r in 0..n {
            let read = match kind {
                CollectiveKind::Broadcast | CollectiveKind::Scatter => r == root,
                CollectiveKind::Gather => r != root,
                _ => true,
            };
            let written = match kind {
                CollectiveKind::Broadcast | CollectiveKind::Scatter => r != root,
                CollectiveKind::Gather => r == root,
                _ => false,
            };
            if !read && !written {
                continue;
            }
            let theirs = match r == me {
                true => mine,
                false => {
                    let said = round.read(r, 2)?;
                    [said[0], said[1]]
                }
            };
            inputs &= !read || theirs[0] == 1;
            outputs &= !written || theirs[1] == 1;
        }
        let writes = mem.kernel_copies_pay() || outputs;
        if inputs || !probe {
            return Ok(inputs.then_some(writes));
        }
        let other = 1 - me;
        let exchange = |say: &[u8]| -> Result<Option<u8>> {
            let round = Round::begin(mem, header, deadline)?;
            round.post(say)?;
            Ok(round.read(other, say.len())?.first().copied())
        };
        let mut fastest = u64::MAX;
        for _ in 0..PROBE_ROUNDS / 2 {
            let t = std::time::Instant::now();
            exchange(&[])?;
            exchange(&[])?;
            fastest = fastest.min(t.elapsed().as_nanos() as u64);
        }
        let near = u8::from(fastest < NEAR_NS);
        let theirs = exchange(&[near])?;
        let far = if me == 0 { Some(near) } else { theirs } == Some(0);
        Ok(far.then_some(writes))
    }

    /// Moves the call's blocks in one round of direct copies: every rank
    /// posts the address and length of its input and output, copies the
    /// blocks it needs out of the others' inputs straight into its output,
    /// says it is done (the round's second phase), and returns once every
    /// rank that reads its input or writes its output has said so. Where
    /// a block's source would otherwise wait idle (a broadcast's or
    /// scatter's root, a gather's other ranks), the source writes a share
    /// of the block into the destination's output while the destination
    /// reads the rest, two cores copying where one did (see
    /// [`Self::read_share`]), if `writes`. With `stream`, what a rank copies
    /// within its own memory goes out with streaming stores.
    fn read_directly(
        &self,
        mem: &dyn GroupMemory,
        input: (*mut u8, usize),
        output: (*mut u8, usize),
        stream: bool,
        writes: bool,
        deadline: &Deadline,
    ) -> Result<()> {
        let (call, coll) = (self.call, &self.call.coll);
        let (n, me, root) = (call.world_size, call.rank, coll.root);
        let part = self.layout(n).1;
        let round = Round::begin(mem, call.header(0, 0), deadline)?;
        // The root decides how the blocks between it and each other rank
        // are split, and posts it (see `read_share`): no split where the
        // ranks share CPUs, as the other side is not idle there.
        let split = match me == root && writes && !mem.ranks_share_cpus() {
            true => self.read_share(part, n, input.0, output.0),
            false => part,
        };
        let mine = BufferPost::new(mem, input, output, split as u64);
        round.post(&mine.0)?;
        let in_place = std::ptr::eq(input.0, output.0);
        // SAFETY (for both): as in `chunks`. Blocks this rank writes are
        // ones no peer reads: every rank reads inputs only, and an input
        // that is the output as well (all-to-all in place) is written only
        // once every reader is done.
        let inp = |at: usize, len: usize| unsafe { slice(input.0.add(at), len) };
        let out = |at: usize, len: usize| unsafe { slice_mut(output.0.add(at), len) };
        // This rank's own block first, while the others post: (where it
        // goes in the output, where it lies in the input).
        let own = match coll.kind {
            CollectiveKind::AllGather => Some((me * part, 0)),
            CollectiveKind::Gather if me == root => Some((me * part, 0)),
            CollectiveKind::AllToAll if !in_place => Some((me * part, me * part)),
            CollectiveKind::Broadcast if me == root => Some((0, 0)),
            CollectiveKind::Scatter if me == root => Some((0, me * part)),
            _ => None,
        };
        if let Some((to, from)) = own {
            kernels::copy(out(to, part), inp(from, part), stream)?;
        }
        // The block that goes from rank `src` to rank `dst`: (block of src's
        // input, where it goes in dst's output), if any.
        let moved = |src: usize, dst: usize| match coll.kind {
            CollectiveKind::AllGather => Some((0, src * part)),
            CollectiveKind::Gather if dst == root => Some((0, src * part)),
            CollectiveKind::AllToAll => Some((dst, src * part)),
            CollectiveKind::Broadcast if src == root => Some((0, 0)),
            CollectiveKind::Scatter if src == root => Some((dst, 0)),
            _ => None,
        };
        // Per peer, the bytes at the start of each block between the two
        // that the block's destination reads; its source writes the rest.
        let mut shares = vec![part; n];
        // Peers still read an all-to-all's buffer in place: its blocks wait
        // here until they are done.
        let mut held = match coll.kind {
            CollectiveKind::AllToAll if in_place => vec![0u8; n * part],
            _ => Vec::new(),
        };
        // Peers in turn from the next rank on, so that they do not all read
        // the same rank at once. Each rank's header is checked (a rank that
        // made another call is a mismatch) before its addresses are used.
        for r in (1..n).map(|k| (me + k) % n) {
            let theirs = BufferPost::read(&round, r)?;
            shares[r] = match (me == root, r == root) {
                (true, _) => split,
                (_, true) => theirs.word() as usize,
                _ => part,
            };
            let share = shares[r];
            if share > part {
                return Err(Error::Protocol {
                    rank: me,
                    peer: r,
                    call: String::new(),
                    msg: format!("it splits blocks of {part} bytes at byte {share}"),
                });
            }
            if let Some((block, at)) = moved(r, me) {
                let from = theirs.input(me, r, block * part, part)?;
                let to = match held.is_empty() {
                    true => out(at, share),
                    false => &mut held[at..at + share],
                };
                mem.read_direct(r, from, to, stream)?;
            }
            if let Some((block, at)) = moved(me, r).filter(|_| share < part) {
                let to = theirs.output(me, r, at, part)?.offset(share);
                let from = inp(block * part + share, part - share);
                mem.write_direct(r, to, from, stream)?;
            }
        }
        round.post_reduced(0, 0, &mut |_| Ok(()))?;
        // Every rank that reads this rank's input, or writes its output.
        let touches =
            |r: usize| moved(me, r).is_some() || shares[r] < part && moved(r, me).is_some();
        for r in (0..n).filter(|&r| r != me && touches(r)) {
            round.read_reduced(r, 0, 0)?;
        }
        if !held.is_empty() {
            for r in (0..n).filter(|&r| r != me) {
                kernels::copy(out(r * part, part), &held[r * part..(r + 1) * part], stream)?;
            }
        }
        Ok(())
    }

    /// Whether a reduction first asks whether every buffer it would read
    /// or write across ranks lies in a shared buffer
    /// ([`Self::reduce_mapped`]): where the memory offers direct reads and
    /// the call takes more than one round of posts, so that the question's
    /// round adds little (on a 2-core VM, own buffers, 2 and 4 ranks, 256
    /// KiB to 8 MiB: no change beyond the noise), and where the reduction
    /// can keep the bits of the posts' (board-direct's, a reduce-scatter's,
    /// or any of two ranks). The same answer on every rank.
    fn may_reduce_mapped(&self, mem: &dyn GroupMemory, part: usize, piece: usize) -> bool {
        let (kind, n) = (self.call.coll.kind, self.call.world_size);
        matches!(
            kind,
            CollectiveKind::AllReduce | CollectiveKind::ReduceScatter | CollectiveKind::Reduce
        ) && (self.direct || kind == CollectiveKind::ReduceScatter || n == 2)
            && n > 1
            && part > piece
            && mem.direct_min().is_some()
    }

    /// Reduces straight out of the other ranks' buffers where they all lie
    /// in shared buffers, which each rank maps; `Ok(false)` where some do
    /// not (the same answer on every rank, after one round).
    ///
    /// Every rank posts its buffers ([`BufferPost`]) and whether those the
    /// others reach are shared: every input, an allreduce's outputs (the
    /// others copy results out of them) and a reduce's root's output (the
    /// others write theirs into it). Each rank then reduces its share of
    /// each chunk of `piece` bytes, cut as board-direct cuts it (a
    /// reduce-scatter: its block): its own input, then the others' in rank
    /// order, where they lie (copied first where a mapping fails), into its
    /// output (a reduce's other ranks: into scratch, then into the root's
    /// output), and says so in the round's second phase. An allreduce's
    /// ranks then copy each other share out of its owner's output
    /// (`stream`: with streaming stores) and say they are done in one more
    /// round. A rank returns once no peer reads or writes its buffers any
    /// more. Each element is reduced once, by the rank and in the order
    /// that the posts' reduction would use, so the bits are the same.
    ///
    /// On a 2-core VM (`compare` runs, docs/compare/shared/): 2 ranks'
    /// allreduce of 2 MiB took 60 µs against 103 through posts, of 128
    /// MiB 12.3 ms against 14.5; 4 ranks' of 2 MiB 204 µs against 417, of
    /// 128 MiB 27.4 ms against 31.3; 2 ranks' reduce-scatter of 2 MiB 37 µs
    /// against 65. Copying each chunk's shares once the whole buffer was
    /// reduced instead made 4 ranks' allreduce of 128 MiB 8–12% slower.
    #[allow(clippy::too_many_arguments)]
    fn reduce_mapped(
        &self,
        mem: &dyn GroupMemory,
        input: (*mut u8, usize),
        output: (*mut u8, usize),
        several: bool,
        piece: usize,
        stream: bool,
        deadline: &Deadline,
    ) -> Result<bool> {
        let (call, coll) = (self.call, &self.call.coll);
        let (n, me, root, es) = (call.world_size, call.rank, coll.root, coll.dtype.size());
        let kind = coll.kind;
        let part = self.layout(n).1;
        let reached = match kind {
            CollectiveKind::AllReduce => true,
            CollectiveKind::Reduce => me == root,
            _ => false,
        };
        let mine = BufferPost::new(mem, input, output, 0);
        let shared = !several && mine.shared(0) && (!reached || mine.shared(2));
        let mine = mine.with_word(u64::from(shared));
        let round = Round::begin(mem, call.header(0, 0), deadline)?;
        round.post(&mine.0)?;
        let mut posts = Vec::with_capacity(n);
        for r in 0..n {
            posts.push(match r == me {
                true => mine,
                false => BufferPost::read(&round, r)?,
            });
        }
        if posts.iter().any(|p| p.word() != 1) {
            return Ok(false);
        }
        tracing::debug!(call = %call.name(), "reducing straight out of shared buffers");
        // SAFETY (for both): as in `chunks`. A rank writes only its own
        // share of its output (the root's, of a reduce), which no peer
        // reads before the second phase says it is there, and, in an
        // allreduce, the others' shares once their owners said they are
        // done reading its input there.
        let inp = |at: usize, len: usize| unsafe { slice(input.0.add(at), len) };
        let out = |at: usize, len: usize| unsafe { slice_mut(output.0.add(at), len) };
        // Rank p's share of the chunk of `len` bytes at `off` of each block,
        // as board-direct cuts it (a reduce-scatter: rank p's block): bytes
        // of each input, and where they go in the output.
        let share = |p: usize, off: usize, len: usize| match kind {
            CollectiveKind::ReduceScatter => (p * part + off, p * part + off + len, off),
            _ => {
                let elems = len / es;
                let lo = off + p * elems / n * es;
                (lo, off + (p + 1) * elems / n * es, lo)
            }
        };
        let chunks = || {
            (0..part)
                .step_by(piece)
                .map(move |off| (off, piece.min(part - off)))
        };
        let to_root = kind == CollectiveKind::Reduce && me != root;
        let others = || (1..n).map(move |k| (me + k) % n);
        let (mut scratch, mut copied) = (AlignedBuf::zeroed(0), AlignedBuf::zeroed(0));
        for (off, len) in chunks() {
            let (lo, hi, to) = share(me, off, len);
            let dst = match to_root {
                true => {
                    scratch.reserve_len(hi - lo);
                    &mut scratch.as_mut_slice()[..hi - lo]
                }
                false => out(to, hi - lo),
            };
            // In place the output holds this rank's input there already.
            let own =
                (!std::ptr::eq(input.0.wrapping_add(lo), dst.as_ptr())).then(|| inp(lo, hi - lo));
            for (k, p) in (0..n).filter(|&p| p != me).enumerate() {
                let from = posts[p].input(me, p, lo, hi - lo)?;
                let first = if k == 0 { own } else { None };
                let mut reduce =
                    |theirs: &[u8]| kernels::reduce(coll.op, coll.dtype, dst, first, theirs);
                if !mem.read_mapped(p, from, hi - lo, &mut reduce)? {
                    copied.reserve_len(hi - lo);
                    let theirs = &mut copied.as_mut_slice()[..hi - lo];
                    mem.read_direct(p, from, theirs, false)?;
                    reduce(theirs)?;
                }
            }
            kernels::finalize(coll.op, coll.dtype, dst, n)?;
            if to_root {
                let to = posts[root].output(me, root, to, hi - lo)?;
                mem.write_direct(root, to, dst, false)?;
            }
            if kind == CollectiveKind::AllReduce {
                // The chunk's other shares, while they are in the caches:
                // a round per chunk says each rank's share is there (and
                // that the rank is done with the chunk before).
                let reduced = Round::begin(mem, call.header(0, 0), deadline)?;
                reduced.post(&[])?;
                for p in others() {
                    reduced.read(p, 0)?;
                    let (lo, hi, _) = share(p, off, len);
                    if hi > lo {
                        let from = posts[p].output(me, p, lo, hi - lo)?;
                        mem.read_direct(p, from, out(lo, hi - lo), stream)?;
                    }
                }
            }
        }
        // Done: once every peer is, no peer reads or writes this rank's
        // buffers any more.
        if kind == CollectiveKind::AllReduce {
            let done = Round::begin(mem, call.header(0, 0), deadline)?;
            done.post(&[])?;
            for p in others() {
                done.read(p, 0)?;
            }
        } else {
            round.post_reduced(0, 0, &mut |_| Ok(()))?;
            for p in others() {
                round.read_reduced(p, 0, 0)?;
            }
        }
        Ok(true)
    }

    /// Bytes at the start of a `part`-byte block that its destination reads
    /// itself (a multiple of 64, so that the two copies share no cache
    /// line), where the root has `input` and `output`; the source writes
    /// the rest. Where the sources or the destinations of a call would wait
    /// idle otherwise, both copy: the root of a broadcast, scatter or
    /// gather copies part/n of each block it sends or receives, and each
    /// other rank the rest, so that every rank copies about (n − 1)/n of a
    /// block; a root that also copies its own block (out of place) takes
    /// half that share, as such a copy, within its memory, took about half
    /// the time of one between processes. On a 2-core VM, 2 ranks, 20
    /// calls: a broadcast of 8 MiB in place took 0.50–0.59 ms against
    /// 0.95–1.02 with the destination reading all, out of place 0.79–1.08
    /// against 1.12–1.45; of 2 MiB in place 96–106 µs against 156–162 (3
    /// alternating runs each). Where ranks share CPUs the other side is not
    /// idle: 4 ranks on 2 CPUs broadcast 32 KiB in 18–21 µs split against
    /// 14–17 unsplit.
    fn read_share(&self, part: usize, n: usize, input: *mut u8, output: *mut u8) -> usize {
        let coll = &self.call.coll;
        let (input, output, block) = (input as usize, output as usize, coll.root * part);
        let in_place = match coll.kind {
            CollectiveKind::Broadcast => input == output,
            CollectiveKind::Scatter => output == input + block,
            CollectiveKind::Gather => input == output + block,
            _ => false,
        };
        let root = match in_place {
            true => part / n,
            false => part / (2 * n),
        };
        let reads = match coll.kind {
            CollectiveKind::Broadcast | CollectiveKind::Scatter => part - root,
            CollectiveKind::Gather => root,
            _ => return part,
        };
        reads / 64 * 64
    }

    /// The reduction of a share that this rank alone reduces (board-direct,
    /// reduce-scatter): `out = own ⊕ posted_r[range]` over the other ranks
    /// in rank order (`own`: this rank's input share; `None`: `out` holds
    /// it already), where every rank posted `len` bytes, then the op's
    /// last step. Every op is commutative, so the reduction may start from
    /// this rank's input; one rank alone reduces each share, so every rank
    /// gets the same bits.
    #[allow(clippy::too_many_arguments)]
    fn reduce_share(
        &self,
        round: &Round<'_>,
        me: usize,
        n: usize,
        len: usize,
        out: &mut [u8],
        own: Option<&[u8]>,
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let coll = &self.call.coll;
        let mut others = (0..n).filter(|&r| r != me);
        match others.next() {
            None => {
                if let Some(own) = own {
                    kernels::copy(out, own, false)?;
                }
            }
            Some(first) => {
                let posted = &round.read(first, len)?[range.clone()];
                kernels::reduce(coll.op, coll.dtype, out, own, posted)?;
                for r in others {
                    let posted = &round.read(r, len)?[range.clone()];
                    kernels::reduce(coll.op, coll.dtype, out, None, posted)?;
                }
            }
        }
        kernels::finalize(coll.op, coll.dtype, out, n)
    }

    /// `out = Σ_r posted_r` in rank order, where each of the `n` ranks
    /// posted `out.len()` bytes, then the op's last step; with `stream`,
    /// reduced in that scratch and streamed to `out`.
    fn reduce_all(
        &self,
        round: &Round<'_>,
        n: usize,
        out: &mut [u8],
        stream: Option<&mut Vec<u8>>,
    ) -> Result<()> {
        if let Some(scratch) = stream {
            scratch.resize(out.len(), 0);
            self.reduce_all(round, n, scratch, None)?;
            return kernels::copy(out, scratch, true);
        }
        let (coll, len) = (&self.call.coll, out.len());
        let first = round.read(0, len)?;
        if n == 1 {
            kernels::copy(out, first, false)?;
        } else {
            kernels::reduce(coll.op, coll.dtype, out, Some(first), round.read(1, len)?)?;
        }
        for r in 2..n {
            kernels::reduce(coll.op, coll.dtype, out, None, round.read(r, len)?)?;
        }
        kernels::finalize(coll.op, coll.dtype, out, n)
    }
}

/// What a rank posts of its buffers for the others to read or write
/// directly: the input's and the output's address and length, one word of
/// the call's, and the shared regions holding the two (the peers copy a
/// region's bytes themselves), as nine little-endian words.
#[derive(Clone, Copy)]
struct BufferPost([u8; 72]);

impl BufferPost {
    fn new(
        mem: &dyn GroupMemory,
        input: (*mut u8, usize),
        output: (*mut u8, usize),
        word: u64,
    ) -> BufferPost {
        let (in_region, out_region) = (
            mem.region(input.0 as u64, input.1),
            mem.region(output.0 as u64, output.1),
        );
        let mut post = [0u8; 72];
        for (i, word) in [
            input.0 as u64,
            input.1 as u64,
            output.0 as u64,
            output.1 as u64,
            word,
            in_region.id,
            in_region.base,
            out_region.id,
            out_region.base,
        ]
        .into_iter()
        .enumerate()
        {
            post[8 * i..8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
        BufferPost(post)
    }

    /// Rank `r`'s post in `round`.
    fn read(round: &Round<'_>, r: usize) -> Result<BufferPost> {
        let posted = round.read(r, 72)?;
        Ok(BufferPost(posted.try_into().expect("72 bytes")))
    }

    fn at(&self, i: usize) -> u64 {
        u64::from_le_bytes(self.0[8 * i..8 * i + 8].try_into().expect("8 bytes"))
    }

    /// The call's word.
    fn word(&self) -> u64 {
        self.at(4)
    }

    /// The same post with the call's word `word`.
    fn with_word(mut self, word: u64) -> BufferPost {
        self.0[32..40].copy_from_slice(&word.to_le_bytes());
        self
    }

    /// Whether the input (`0`) or output (`2`) lies in a shared region.
    fn shared(&self, which: usize) -> bool {
        self.at(5 + which) != 0
    }

    /// Where bytes `from..from + len` of the input (`which` 0) or output
    /// (2) of rank `peer` lie; an error, from rank `me`, where the buffer
    /// it posted is shorter.
    fn remote(
        &self,
        which: usize,
        me: usize,
        peer: usize,
        from: usize,
        len: usize,
    ) -> Result<Remote> {
        let (have, end) = (self.at(which + 1), (from + len) as u64);
        if end > have {
            let what = if which == 0 { "input" } else { "output" };
            return Err(Error::Protocol {
                rank: me,
                peer,
                call: String::new(),
                msg: format!("its {what} has {have} bytes, {end} needed"),
            });
        }
        let at = Remote {
            addr: self.at(which),
            region: Region {
                id: self.at(5 + which),
                base: self.at(6 + which),
            },
        };
        Ok(at.offset(from))
    }

    /// [`Self::remote`] of the input.
    fn input(&self, me: usize, peer: usize, from: usize, len: usize) -> Result<Remote> {
        self.remote(0, me, peer, from, len)
    }

    /// [`Self::remote`] of the output.
    fn output(&self, me: usize, peer: usize, from: usize, len: usize) -> Result<Remote> {
        self.remote(2, me, peer, from, len)
    }
}

/// The memory of a board call: buffers taken end to end as one (a single
/// buffer, or the tensors of a bucket).
#[derive(Clone, Copy)]
struct Pieces<'a>(&'a [(*mut u8, usize)]);

impl Pieces<'_> {
    fn len(&self) -> usize {
        self.0.iter().map(|&(_, len)| len).sum()
    }

    /// The one buffer, if there is only one.
    fn one(&self) -> Option<(*mut u8, usize)> {
        match self.0 {
            [one] => Some(*one),
            _ => None,
        }
    }

    /// The first buffer (an empty one if there is none).
    fn first(&self) -> (*mut u8, usize) {
        self.0.first().copied().unwrap_or((std::ptr::null_mut(), 0))
    }

    /// Calls `f(offset from at, address, bytes)` on each piece of bytes
    /// `at..at + len`.
    fn each(&self, at: usize, len: usize, mut f: impl FnMut(usize, *mut u8, usize)) {
        let end = at + len;
        let mut start = 0;
        for &(ptr, plen) in self.0 {
            let (lo, hi) = (start.max(at), (start + plen).min(end));
            if lo < hi {
                f(lo - at, ptr.wrapping_add(lo - start), hi - lo);
            }
            start += plen;
            if start >= end {
                break;
            }
        }
    }
}

/// Whether a call whose ranks write `output` bytes each is large: where
/// their outputs together, taken as `output` times the ranks, reach the
/// memory's [`GroupMemory::stream_min`].
fn streams(mem: &dyn GroupMemory, output: usize) -> bool {
    output > 0 && mem.world_size().saturating_mul(output) >= mem.stream_min()
}

/// # Safety
/// `ptr` must be valid for reads of `len` bytes for the returned lifetime.
unsafe fn slice<'a>(ptr: *const u8, len: usize) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    std::slice::from_raw_parts(ptr, len)
}

/// # Safety
/// `ptr` must be valid for writes of `len` bytes, and not otherwise accessed,
/// for the returned lifetime.
unsafe fn slice_mut<'a>(ptr: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(ptr, len)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ccl_core::{Call, Collective, CollectiveKind, DataType, Deadline};

    use super::BoardCall;
    use crate::tests::mem_group;

    /// Where the probe finds two ranks' cores far, a 2-rank allgather of
    /// large outputs reads directly and streams its own block: every rank
    /// gets every block.
    #[test]
    fn a_far_allgather_reads_directly_with_streamed_outputs() {
        let part = 3 << 16;
        let members = mem_group::group(2, 1 << 16, Some(1), true, 1, false);
        let outputs: Vec<Vec<u8>> = std::thread::scope(|s| {
            let running: Vec<_> = members
                .iter()
                .enumerate()
                .map(|(rank, mem)| {
                    s.spawn(move || {
                        let call = Call {
                            comm: 7,
                            seq: 1,
                            rank,
                            world_size: 2,
                            coll: Collective::new(CollectiveKind::AllGather, DataType::U8, part),
                        };
                        let mut input: Vec<u8> = (0..part).map(|i| (i * 7 + rank) as u8).collect();
                        let mut output = vec![0u8; 2 * part];
                        let deadline = Deadline::after(Duration::from_secs(60));
                        BoardCall {
                            call: &call,
                            direct: false,
                        }
                        .read_directly(
                            mem,
                            (input.as_mut_ptr(), part),
                            (output.as_mut_ptr(), 2 * part),
                            true,
                            true,
                            &deadline,
                        )
                        .unwrap();
                        output
                    })
                })
                .collect();
            running.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let want: Vec<u8> = (0..2)
            .flat_map(|rank| (0..part).map(move |i| (i * 7 + rank) as u8))
            .collect();
        for (rank, out) in outputs.iter().enumerate() {
            assert!(*out == want, "rank {rank}");
        }
    }
}
