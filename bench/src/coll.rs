//! The collectives ccl-bench measures, and what nccl-tests' conventions say about each.

use ccl::{Algorithm, Choice, CollectiveKind};

/// A collective (a subcommand of ccl-bench and an argument of `compare-mpi`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Coll {
    Allreduce,
    Broadcast,
    Reduce,
    Allgather,
    ReduceScatter,
    Alltoall,
    Gather,
    Scatter,
    Sendrecv,
    Barrier,
}

impl Coll {
    pub const ALL: [Coll; 10] = [
        Coll::Allreduce,
        Coll::Broadcast,
        Coll::Reduce,
        Coll::Allgather,
        Coll::ReduceScatter,
        Coll::Alltoall,
        Coll::Gather,
        Coll::Scatter,
        Coll::Sendrecv,
        Coll::Barrier,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Coll::Allreduce => "allreduce",
            Coll::Broadcast => "broadcast",
            Coll::Reduce => "reduce",
            Coll::Allgather => "allgather",
            Coll::ReduceScatter => "reduce-scatter",
            Coll::Alltoall => "alltoall",
            Coll::Gather => "gather",
            Coll::Scatter => "scatter",
            Coll::Sendrecv => "sendrecv",
            Coll::Barrier => "barrier",
        }
    }

    pub const fn kind(self) -> CollectiveKind {
        match self {
            Coll::Allreduce => CollectiveKind::AllReduce,
            Coll::Broadcast => CollectiveKind::Broadcast,
            Coll::Reduce => CollectiveKind::Reduce,
            Coll::Allgather => CollectiveKind::AllGather,
            Coll::ReduceScatter => CollectiveKind::ReduceScatter,
            Coll::Alltoall => CollectiveKind::AllToAll,
            Coll::Gather => CollectiveKind::Gather,
            Coll::Scatter => CollectiveKind::Scatter,
            Coll::Sendrecv => CollectiveKind::SendRecv,
            Coll::Barrier => CollectiveKind::Barrier,
        }
    }

    /// Takes a root rank.
    pub const fn has_root(self) -> bool {
        matches!(
            self,
            Coll::Broadcast | Coll::Reduce | Coll::Gather | Coll::Scatter
        )
    }

    /// Takes a reduction op.
    pub const fn has_op(self) -> bool {
        matches!(self, Coll::Allreduce | Coll::Reduce | Coll::ReduceScatter)
    }

    /// The size is the whole buffer of n per-rank parts (nccl-tests' convention).
    pub const fn split(self) -> bool {
        matches!(
            self,
            Coll::Allgather | Coll::ReduceScatter | Coll::Alltoall | Coll::Gather | Coll::Scatter
        )
    }

    /// busbw = algbw × this (nccl-tests' PERFORMANCE.md).
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Coll::Allreduce => 2.0 * (n - 1.0) / n,
            c if c.split() => (n - 1.0) / n,
            _ => 1.0,
        }
    }

    /// Elements per rank (the count each call takes) for a requested size:
    /// rounded down to whole elements (and whole per-rank parts), at least one.
    pub fn per_rank_count(self, bytes: u64, elem: usize, n: usize) -> usize {
        if self == Coll::Barrier {
            return 0;
        }
        let mut count = bytes / elem as u64;
        if self.split() {
            count /= n as u64;
        }
        count.max(1) as usize
    }

    /// The size in bytes the table reports for a per-rank count: the whole buffer.
    pub fn total_bytes(self, count: usize, elem: usize, n: usize) -> u64 {
        let b = (count * elem) as u64;
        if self.split() {
            b * n as u64
        } else {
            b
        }
    }

    /// What `--algo all` runs for this collective (nothing to choose for
    /// sendrecv): its schedules, the ring also with pieces of
    /// [`RING_PIECES`] besides the links' default, then the shared-memory
    /// board algorithms, which run only where every rank shares the host
    /// (the table names what ran instead otherwise; `--transport tcp`
    /// leaves them out).
    pub fn algorithms(self) -> Vec<Choice> {
        let kind = self.kind();
        let schedules = Algorithm::for_kind(kind);
        let mut all: Vec<Choice> = Vec::new();
        for &a in schedules {
            all.push(a.into());
            if a == Algorithm::Ring {
                all.extend(RING_PIECES.iter().map(|&p| Choice {
                    algorithm: a,
                    piece_bytes: Some(p),
                }));
            }
        }
        let boards = [Algorithm::Board, Algorithm::BoardDirect]
            .into_iter()
            .filter(|a| !schedules.is_empty() && a.implements(kind));
        all.extend(boards.map(Choice::from));
        all
    }
}

/// Ring piece sizes `--algo all` measures besides the default of the links
/// (512 KiB over TCP, 4 MiB over shared memory).
pub const RING_PIECES: [usize; 2] = [128 << 10, 1 << 20];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors() {
        assert_eq!(Coll::Allreduce.bus_factor(4), 1.5);
        assert_eq!(Coll::Allgather.bus_factor(4), 0.75);
        assert_eq!(Coll::Broadcast.bus_factor(4), 1.0);
        assert_eq!(Coll::Sendrecv.bus_factor(4), 1.0);
    }

    #[test]
    fn counts_round_to_whole_parts() {
        assert_eq!(Coll::Allreduce.per_rank_count(256 << 20, 4, 3), 64 << 20);
        assert_eq!(Coll::Allgather.per_rank_count(100, 4, 3), 8);
        assert_eq!(Coll::Allgather.total_bytes(8, 4, 3), 96);
        assert_eq!(Coll::Alltoall.per_rank_count(8, 4, 8), 1);
        assert_eq!(Coll::Barrier.per_rank_count(8, 4, 8), 0);
    }

    #[test]
    fn names_match_ccl_kinds() {
        for c in Coll::ALL {
            assert_eq!(c.kind().name(), c.name());
        }
    }
}
