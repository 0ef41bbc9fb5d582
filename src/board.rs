//! Collectives on the shared-memory board, when every rank of a
//! communicator runs on this host.
//!
//! Small calls ([`Algorithm::Board`](ccl_algorithms::Algorithm::Board)):
//! each rank posts its payload once, reads what the others posted, and
//! computes its result locally. Every rank reduces in rank order, so all of
//! them get the same bits.
//!
//! Allreduce of any size ([`Algorithm::BoardDirect`](ccl_algorithms::Algorithm::BoardDirect)):
//! chunk by chunk of a slot, each rank posts its chunk, reduces block
//! `rank` of it (1/n of the elements) from every rank's post in rank order,
//! publishes that block, and copies every other rank's block. Each byte is
//! reduced once on the whole host, by one rank, and moves through memory
//! about three times per rank (post, reduce, copy out), with no per-message
//! hand-shake.
//!
//! This runs on the caller's thread, without the executor or the runtime.

use std::time::Duration;

use ccl_algorithms::{Call, IoBuffers};
use ccl_core::{op, CollectiveKind, DataType, Error, FrameHeader, ReduceOp, Result};
use ccl_transport_shm::Board;

/// The arguments of one board call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BoardCall {
    pub kind: CollectiveKind,
    pub dtype: DataType,
    pub count: usize,
    pub op: ReduceOp,
    pub root: usize,
    /// Run as [`Algorithm::BoardDirect`](ccl_algorithms::Algorithm::BoardDirect)
    /// (allreduce only), not as one post per rank.
    pub direct: bool,
}

/// Whether a call of `kind` on `count` elements of `dtype` (counted as the
/// collective counts them) over `n` ranks fits board slots of `slot` bytes
/// (for allgather, gather and the like the whole output must fit).
pub(crate) fn fits(
    kind: CollectiveKind,
    count: usize,
    dtype: DataType,
    n: usize,
    slot: usize,
) -> bool {
    let bytes = count * dtype.size();
    match kind {
        CollectiveKind::AllReduce | CollectiveKind::Reduce | CollectiveKind::Broadcast => {
            bytes <= slot
        }
        CollectiveKind::AllGather
        | CollectiveKind::Gather
        | CollectiveKind::ReduceScatter
        | CollectiveKind::Scatter
        | CollectiveKind::AllToAll => bytes * n <= slot,
        CollectiveKind::Barrier => true,
        CollectiveKind::SendRecv => false,
    }
}

impl BoardCall {
    /// Runs the call on `board` for `call`, reading `io`'s input and writing
    /// its output, within `timeout`.
    pub(crate) fn run(
        &self,
        board: &Board,
        call: &Call,
        io: &IoBuffers<'_>,
        timeout: Duration,
    ) -> Result<()> {
        let run = if self.direct {
            self.allreduce_direct(board, call, io, timeout)
        } else {
            self.exchange(board, call, io, timeout)
        };
        run.map_err(|e| e.in_call(&call.name()))
    }

    /// [`Algorithm::BoardDirect`](ccl_algorithms::Algorithm::BoardDirect)
    /// (see the module docs). Chunks go as board calls numbered from step 1,
    /// so that a rank running the one-post board (step 0) is a mismatch.
    fn allreduce_direct(
        &self,
        board: &Board,
        call: &Call,
        io: &IoBuffers<'_>,
        timeout: Duration,
    ) -> Result<()> {
        if self.kind != CollectiveKind::AllReduce {
            return Err(Error::Internal(format!(
                "{} cannot run as board-direct",
                call.name()
            )));
        }
        let (n, me) = (call.world_size, call.rank);
        let es = self.dtype.size();
        let total = self.count * es;
        let (input, output) = io.raw_parts();
        if input.1 < total || output.1 < total {
            return Err(Error::Internal(format!(
                "{}: buffers of {} and {} bytes for {total}",
                call.name(),
                input.1,
                output.1
            )));
        }
        let chunk = (board.slot_bytes() / es * es).max(es);
        let started = std::time::Instant::now();
        let mut off = 0;
        let mut step = 1u32;
        loop {
            let len = chunk.min(total - off);
            let elems = len / es;
            // Element range of rank p's block, in bytes.
            let block = |p: usize| (p * elems / n * es, (p + 1) * elems / n * es);
            let header = FrameHeader::data(call.comm, call.seq, step, 0, call.fingerprint);
            let round = board.begin(header, timeout.saturating_sub(started.elapsed()))?;
            // SAFETY: the engine hands this call its buffers alone. This
            // chunk of the input is read in full (posted) before its part of
            // the output, which may be the same memory, is written; later
            // chunks of the input are not touched.
            round.post(unsafe { slice(input.0.add(off), len) })?;
            let (lo, hi) = block(me);
            // SAFETY: as above; no other slice of this range is alive.
            let mine = unsafe { slice_mut(output.0.add(off + lo), hi - lo) };
            self.reduce_all(&round, n, len, mine, lo..hi)?;
            round.post_reduced(lo, mine)?;
            for p in (0..n).filter(|&p| p != me) {
                let (plo, phi) = block(p);
                let from = round.read_reduced(p, plo, phi - plo)?;
                // SAFETY: as above.
                copy(
                    unsafe { slice_mut(output.0.add(off + plo), phi - plo) },
                    from,
                );
            }
            off += len;
            step += 1;
            if off >= total {
                return Ok(());
            }
        }
    }

    fn exchange(
        &self,
        board: &Board,
        call: &Call,
        io: &IoBuffers<'_>,
        timeout: Duration,
    ) -> Result<()> {
        let (n, me) = (call.world_size, call.rank);
        let es = self.dtype.size();
        let part = self.count * es;
        let (input, output) = io.raw_parts();
        let header = FrameHeader::data(call.comm, call.seq, 0, 0, call.fingerprint);
        let round = board.begin(header, timeout)?;
        // SAFETY: the engine hands this call its buffers alone; the input is
        // read in full (posted) before anything writes the output, which may
        // overlap it for in-place calls.
        let input = unsafe { slice(input.0, input.1) };
        let is_root = me == self.root;
        // What each rank posts, and how many bytes it reads from each rank.
        let posts = |r: usize| -> usize {
            match self.kind {
                CollectiveKind::AllReduce | CollectiveKind::Reduce => part,
                CollectiveKind::Broadcast if r == self.root => part,
                CollectiveKind::Scatter if r == self.root => part * n,
                CollectiveKind::AllGather | CollectiveKind::Gather => part,
                CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => part * n,
                _ => 0,
            }
        };
        let mine = posts(me);
        if input.len() < mine {
            return Err(Error::Internal(format!(
                "{}: input has {} bytes, the board call posts {mine}",
                call.name(),
                input.len()
            )));
        }
        round.post(&input[..mine])?;
        // Every rank's header, also where this call needs no data from it: a
        // rank that made another call (another root, say) is a mismatch here,
        // not a silent success.
        for r in 0..n {
            round.read(r, posts(r))?;
        }
        let out_len = |len: usize| -> Result<&mut [u8]> {
            if output.1 < len {
                return Err(Error::Internal(format!(
                    "{}: output has {} bytes, the board call writes {len}",
                    call.name(),
                    output.1
                )));
            }
            // SAFETY: as above; the input is not read any more.
            Ok(unsafe { slice_mut(output.0, len) })
        };
        match self.kind {
            CollectiveKind::AllReduce => self.reduce_all(&round, n, part, out_len(part)?, 0..part),
            CollectiveKind::Reduce if is_root => {
                self.reduce_all(&round, n, part, out_len(part)?, 0..part)
            }
            CollectiveKind::ReduceScatter => self.reduce_all(
                &round,
                n,
                part * n,
                out_len(part)?,
                me * part..(me + 1) * part,
            ),
            CollectiveKind::Broadcast => {
                let from = round.read(self.root, part)?;
                copy(out_len(part)?, from);
                Ok(())
            }
            CollectiveKind::Scatter => {
                let from = round.read(self.root, part * n)?;
                copy(out_len(part)?, &from[me * part..(me + 1) * part]);
                Ok(())
            }
            CollectiveKind::AllGather | CollectiveKind::Gather
                if self.kind == CollectiveKind::AllGather || is_root =>
            {
                let out = out_len(part * n)?;
                for r in 0..n {
                    copy(&mut out[r * part..(r + 1) * part], round.read(r, part)?);
                }
                Ok(())
            }
            CollectiveKind::AllToAll => {
                let out = out_len(part * n)?;
                for r in 0..n {
                    let from = round.read(r, part * n)?;
                    copy(
                        &mut out[r * part..(r + 1) * part],
                        &from[me * part..(me + 1) * part],
                    );
                }
                Ok(())
            }
            CollectiveKind::Barrier => {
                for r in 0..n {
                    round.read(r, 0)?;
                }
                Ok(())
            }
            // Non-roots of reduce and gather only post.
            _ => Ok(()),
        }
    }

    /// `out = Σ_r posted_r[range]` in rank order, where every rank posted
    /// `len` bytes, then the op's last step.
    fn reduce_all(
        &self,
        round: &ccl_transport_shm::Round<'_>,
        n: usize,
        len: usize,
        out: &mut [u8],
        range: std::ops::Range<usize>,
    ) -> Result<()> {
        let first = &round.read(0, len)?[range.clone()];
        if n == 1 {
            copy(out, first);
        } else {
            let second = &round.read(1, len)?[range.clone()];
            op::reduce(self.op, self.dtype, out, Some(first), second)?;
        }
        for r in 2..n {
            op::reduce(
                self.op,
                self.dtype,
                out,
                None,
                &round.read(r, len)?[range.clone()],
            )?;
        }
        op::finalize(self.op, self.dtype, out, n)
    }
}

/// Before a call that runs over the links on a communicator with a board:
/// every rank posts the call's header and checks everybody else's, so that
/// ranks that made different calls (which may take different paths, or
/// wait on each other forever, as broadcasts with different roots do) get
/// [`Error::Mismatch`] instead of a timeout.
pub(crate) fn announce(board: &Board, call: &Call, timeout: Duration) -> Result<()> {
    let header = FrameHeader::data(call.comm, call.seq, 0, 0, call.fingerprint);
    let check = || {
        let round = board.begin(header, timeout)?;
        round.post(&[])?;
        for r in 0..call.world_size {
            round.read(r, 0)?;
        }
        Ok(())
    };
    check().map_err(|e: Error| e.in_call(&call.name()))
}

/// Copies unless source and destination are the same memory (in place).
fn copy(to: &mut [u8], from: &[u8]) {
    if to.as_ptr() != from.as_ptr() {
        to.copy_from_slice(from);
    }
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
