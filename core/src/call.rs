//! One call, untyped: [`Collective`] is what every rank must agree on
//! (kind, element type, count, op with its scalar, root); [`Call`] is one
//! rank's issue of it on a communicator (id, sequence number, rank, size).
//! Everything below the typed API — the board, the schedule builders, the
//! executor, the wire — works from these two.

use std::fmt;

use crate::{CollectiveKind, DataType, Error, Fingerprint, FrameHeader, ReduceOp, Result};

/// A collective call's arguments, the same on every rank (but for the
/// pre-multiplied sum's scalar, which each rank chooses).
///
/// `count` is per the collective's definition: the buffer length for
/// allreduce, broadcast and reduce; what each rank contributes for allgather
/// and gather; what each rank receives for reduce-scatter and scatter; what
/// each pair exchanges for all-to-all; the message length for send/recv.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Collective {
    pub kind: CollectiveKind,
    pub dtype: DataType,
    pub count: usize,
    /// The reduction (ignored by collectives that do not reduce).
    pub op: ReduceOp,
    /// The root of broadcast, reduce, gather and scatter; the peer of a send
    /// or receive; 0 otherwise.
    pub root: usize,
}

impl Collective {
    /// A call of `kind` on `count` elements of `dtype`, with `Sum` and root 0.
    pub fn new(kind: CollectiveKind, dtype: DataType, count: usize) -> Collective {
        Collective {
            kind,
            dtype,
            count,
            op: ReduceOp::Sum,
            root: 0,
        }
    }

    /// With a reduction op.
    pub fn with_op(self, op: ReduceOp) -> Collective {
        Collective { op, ..self }
    }

    /// With a root (or, for send/recv, a peer).
    pub fn with_root(self, root: usize) -> Collective {
        Collective { root, ..self }
    }

    /// Whether this collective reduces (its op matters).
    #[inline]
    pub fn reduces(&self) -> bool {
        matches!(
            self.kind,
            CollectiveKind::AllReduce | CollectiveKind::Reduce | CollectiveKind::ReduceScatter
        )
    }

    /// Whether this collective has a root.
    #[inline]
    pub fn rooted(&self) -> bool {
        matches!(
            self.kind,
            CollectiveKind::Broadcast
                | CollectiveKind::Reduce
                | CollectiveKind::Gather
                | CollectiveKind::Scatter
        )
    }

    /// Whether the op has a last step after the reduction (average).
    #[inline]
    pub fn finalizes(&self) -> bool {
        self.reduces() && self.op == ReduceOp::Avg
    }

    /// What goes on the wire: the op only where it reduces, the root only
    /// where there is one (a send's peer differs between its two sides).
    #[inline]
    pub fn fingerprint(&self) -> Fingerprint {
        let fp = Fingerprint::new(self.kind, self.dtype, self.count);
        let fp = if self.reduces() {
            fp.with_op(self.op)
        } else {
            fp
        };
        if self.rooted() {
            fp.with_root(self.root)
        } else {
            fp
        }
    }

    /// Elements of (input, output) that rank `rank` of `world_size` passes.
    /// A rank whose role uses no input or output (a broadcast receiver's
    /// input, a reduce non-root's output) passes 0 there.
    #[inline]
    pub fn buffer_elems(&self, rank: usize, world_size: usize) -> (usize, usize) {
        let (n, c) = (world_size, self.count);
        let at_root = |x: usize| if rank == self.root { x } else { 0 };
        match self.kind {
            CollectiveKind::AllReduce => (c, c),
            CollectiveKind::Broadcast => (at_root(c), c),
            CollectiveKind::Reduce => (c, at_root(c)),
            CollectiveKind::AllGather => (c, n * c),
            CollectiveKind::ReduceScatter => (n * c, c),
            CollectiveKind::AllToAll => (n * c, n * c),
            CollectiveKind::Gather => (c, at_root(n * c)),
            CollectiveKind::Scatter => (at_root(n * c), c),
            CollectiveKind::Barrier => (0, 0),
            CollectiveKind::SendRecv => (c, c),
        }
    }

    /// Bytes of the whole buffer, as the tuning table counts them: the count
    /// times the element size, times the world size where the count is per rank.
    #[inline]
    pub fn buffer_bytes(&self, world_size: usize) -> u64 {
        let per_rank = matches!(
            self.kind,
            CollectiveKind::AllGather
                | CollectiveKind::ReduceScatter
                | CollectiveKind::AllToAll
                | CollectiveKind::Gather
                | CollectiveKind::Scatter
        );
        let ranks = if per_rank { world_size } else { 1 };
        (self.count * self.dtype.size() * ranks) as u64
    }

    /// Checks the arguments on rank `rank` of `world_size`: the root (or
    /// peer) exists, the op applies to the element type. Errors name the call.
    #[inline]
    pub fn validate(&self, rank: usize, world_size: usize) -> Result<()> {
        let root_ok = match self.kind {
            CollectiveKind::SendRecv => self.root < world_size && self.root != rank,
            _ => self.root < world_size,
        };
        if root_ok && (!self.reduces() || self.op.validate(self.dtype).is_ok()) {
            return Ok(());
        }
        Err(self.invalid(rank, world_size))
    }

    /// Why [`Collective::validate`] refused the call (kept off the call path).
    #[cold]
    #[inline(never)]
    fn invalid(&self, rank: usize, world_size: usize) -> Error {
        let bad = |m: String| Error::InvalidArgument(format!("{self} on rank {rank}: {m}"));
        if self.kind == CollectiveKind::SendRecv {
            if self.root >= world_size || self.root == rank {
                return bad(format!(
                    "peer {} must be another rank below {world_size}",
                    self.root
                ));
            }
        } else if self.root >= world_size {
            return bad(format!(
                "root {} is not below world size {world_size}",
                self.root
            ));
        }
        match self.op.validate(self.dtype) {
            Err(Error::InvalidArgument(m)) => bad(m),
            Err(e) => e,
            Ok(()) => Error::Internal(format!("{self} was refused without a reason")),
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.fingerprint(), f)
    }
}

/// One rank's issue of a [`Collective`] on a communicator: what goes into
/// every frame header and error message of the call.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// Communicator id.
    pub comm: u64,
    /// Sequence number of the call on the communicator (per peer and
    /// direction for send/recv).
    pub seq: u64,
    pub rank: usize,
    pub world_size: usize,
    pub coll: Collective,
}

impl Call {
    /// The header of message `step` of this call, `len` bytes long.
    #[inline]
    pub fn header(&self, step: u32, len: usize) -> FrameHeader {
        FrameHeader::data(self.comm, self.seq, step, len, self.coll.fingerprint())
    }

    /// The call as error messages name it: `allreduce(f32×1024, sum)#7`.
    pub fn name(&self) -> String {
        self.header(0, 0).call_name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_keep_only_what_ranks_share() {
        let ar =
            Collective::new(CollectiveKind::AllReduce, DataType::F32, 8).with_op(ReduceOp::Avg);
        assert_eq!(ar.fingerprint().op, ReduceOp::Avg.tag());
        assert_eq!(ar.to_string(), "allreduce(f32×8, avg)");
        let bc = Collective::new(CollectiveKind::Broadcast, DataType::U8, 3).with_root(2);
        assert_eq!((bc.fingerprint().op, bc.fingerprint().root), (0, 2));
        // The two sides of a send name each other: the peer stays off the wire.
        let send = Collective::new(CollectiveKind::SendRecv, DataType::I32, 4).with_root(1);
        assert_eq!(send.fingerprint(), send.with_root(0).fingerprint());
        assert!(ar.finalizes() && !bc.finalizes());
    }

    #[test]
    fn validation_names_the_call() {
        let e = Collective::new(CollectiveKind::Reduce, DataType::F32, 1)
            .with_root(4)
            .validate(0, 4)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("reduce(f32×1, sum, root 4) on rank 0"),
            "{e}"
        );
        let band_on_float =
            Collective::new(CollectiveKind::AllReduce, DataType::F32, 1).with_op(ReduceOp::BitAnd);
        assert!(band_on_float.validate(0, 2).is_err());
        let to_self = Collective::new(CollectiveKind::SendRecv, DataType::U8, 1).with_root(1);
        assert!(to_self.validate(1, 2).is_err() && to_self.validate(0, 2).is_ok());
        assert_eq!(
            Collective::new(CollectiveKind::AllGather, DataType::F64, 10).buffer_bytes(3),
            240
        );
    }
}
