//! The algorithms: those that build a [`Schedule`] for one rank's part of
//! a call, and the group algorithms that run on [group memory](crate::group).

use std::fmt;

use ccl_core::{Collective, CollectiveKind};

use crate::{
    chain, dbtree, direct, doubling, halving, ring,
    schedule::{Layout, Schedule},
    tree,
};

/// An algorithm that can build schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring: allreduce (reduce-scatter + allgather), allgather, reduce-scatter.
    Ring,
    /// Recursive doubling: allreduce of small messages in ⌈log2 n⌉ rounds,
    /// and reduce-scatter as that allreduce keeping one block; allgather in
    /// ⌈log2 n⌉ steps of doubling size.
    RecursiveDoubling,
    /// Binomial tree: broadcast, reduce.
    BinomialTree,
    /// Pairwise exchange: all-to-all, every step at once.
    Pairwise,
    /// Pairwise exchange in steps: all-to-all, each step once the one
    /// before it has finished.
    PairwiseInSteps,
    /// Root talks to every rank directly: gather, scatter.
    Linear,
    /// Dissemination: barrier.
    Dissemination,
    /// Rabenseifner: allreduce by recursive-halving reduce-scatter, then
    /// recursive-doubling allgather.
    Rabenseifner,
    /// Recursive halving: reduce-scatter in ⌈log2 n⌉ steps of halving size.
    RecursiveHalving,
    /// Pipelined chain: broadcast, reduce.
    Chain,
    /// Double binary tree (NCCL): allreduce, half the buffer through each tree.
    DoubleBinaryTree,
    /// Direct: each rank reduces its block from every peer, then sends it to
    /// every peer (allreduce in two steps; suits shared memory).
    Direct,
    /// The board: on group memory (every rank on one host), every
    /// collective but send/recv, chunk by chunk: each rank posts its data
    /// once and reads what it needs from the others'. A group algorithm
    /// ([`crate::group`]), not a schedule.
    Board,
    /// Direct on the board (allreduce, reduce; group memory): chunk by
    /// chunk, each rank posts its chunk, reduces its 1/n of it from every
    /// rank's post, publishes that, and the ranks that want the result copy
    /// the others' parts. A group algorithm, not a schedule.
    BoardDirect,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 14] = [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::BinomialTree,
        Algorithm::Pairwise,
        Algorithm::PairwiseInSteps,
        Algorithm::Linear,
        Algorithm::Dissemination,
        Algorithm::Rabenseifner,
        Algorithm::RecursiveHalving,
        Algorithm::Chain,
        Algorithm::DoubleBinaryTree,
        Algorithm::Direct,
        Algorithm::Board,
        Algorithm::BoardDirect,
    ];

    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "rd",
            Algorithm::BinomialTree => "tree",
            Algorithm::Pairwise => "pairwise",
            Algorithm::PairwiseInSteps => "pairwise-steps",
            Algorithm::Linear => "linear",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Rabenseifner => "rabenseifner",
            Algorithm::RecursiveHalving => "rh",
            Algorithm::Chain => "chain",
            Algorithm::DoubleBinaryTree => "dbtree",
            Algorithm::Direct => "direct",
            Algorithm::Board => "board",
            Algorithm::BoardDirect => "board-direct",
        }
    }

    /// The schedule algorithms that implement `kind` (none for send/recv,
    /// which needs no schedule builder); the first is the default.
    /// [`Algorithm::Board`] and [`Algorithm::BoardDirect`] are not among
    /// them: they need a board.
    pub fn for_kind(kind: CollectiveKind) -> &'static [Algorithm] {
        match kind {
            CollectiveKind::AllReduce => &[
                Algorithm::Ring,
                Algorithm::RecursiveDoubling,
                Algorithm::Rabenseifner,
                Algorithm::DoubleBinaryTree,
                Algorithm::Direct,
            ],
            CollectiveKind::AllGather => &[Algorithm::Ring, Algorithm::RecursiveDoubling],
            CollectiveKind::ReduceScatter => &[
                Algorithm::Ring,
                Algorithm::RecursiveHalving,
                Algorithm::RecursiveDoubling,
            ],
            CollectiveKind::Broadcast | CollectiveKind::Reduce => {
                &[Algorithm::BinomialTree, Algorithm::Chain]
            }
            CollectiveKind::AllToAll => &[Algorithm::Pairwise, Algorithm::PairwiseInSteps],
            CollectiveKind::Gather | CollectiveKind::Scatter => &[Algorithm::Linear],
            CollectiveKind::Barrier => &[Algorithm::Dissemination],
            CollectiveKind::SendRecv => &[],
        }
    }

    /// Whether this is a group algorithm, which runs on group memory
    /// rather than as a schedule over links.
    pub fn on_group_memory(self) -> bool {
        matches!(self, Algorithm::Board | Algorithm::BoardDirect)
    }

    /// Whether this algorithm can run `kind`. The group algorithms also
    /// need group memory (every rank on one host).
    pub fn implements(self, kind: CollectiveKind) -> bool {
        match self {
            Algorithm::Board => kind != CollectiveKind::SendRecv,
            Algorithm::BoardDirect => {
                matches!(kind, CollectiveKind::AllReduce | CollectiveKind::Reduce)
            }
            a => Algorithm::for_kind(kind).contains(&a),
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                format!(
                    "unknown algorithm '{s}' (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// What the tuner picks for a call: an algorithm and, for a schedule, the
/// largest piece (bytes) one of its messages moves; `None` leaves the piece
/// to the communicator (its default for the kind of links). Written `ring`,
/// or `ring/128K` (K and M are 2^10 and 2^20, as in sizes elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Choice {
    pub algorithm: Algorithm,
    pub piece_bytes: Option<usize>,
}

impl From<Algorithm> for Choice {
    fn from(algorithm: Algorithm) -> Choice {
        Choice {
            algorithm,
            piece_bytes: None,
        }
    }
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.algorithm.name())?;
        match self.piece_bytes {
            None => Ok(()),
            Some(b) if b >= 1 << 20 && b % (1 << 20) == 0 => write!(f, "/{}M", b >> 20),
            Some(b) if b >= 1 << 10 && b % (1 << 10) == 0 => write!(f, "/{}K", b >> 10),
            Some(b) => write!(f, "/{b}"),
        }
    }
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (name, piece) = match s.split_once('/') {
            Some((name, piece)) => (name, Some(piece)),
            None => (s, None),
        };
        let algorithm: Algorithm = name.trim().parse()?;
        let Some(piece) = piece else {
            return Ok(algorithm.into());
        };
        if matches!(algorithm, Algorithm::Board | Algorithm::BoardDirect) {
            return Err(format!("{s}: {algorithm} has no piece size"));
        }
        let piece = piece.trim();
        let (digits, unit) = match piece.as_bytes().last() {
            Some(b'K' | b'k') => (&piece[..piece.len() - 1], 1 << 10),
            Some(b'M' | b'm') => (&piece[..piece.len() - 1], 1 << 20),
            _ => (piece, 1),
        };
        let bytes = digits
            .parse::<usize>()
            .ok()
            .and_then(|d| d.checked_mul(unit))
            .filter(|&b| b > 0)
            .ok_or_else(|| format!("{s}: the piece size is not a positive size like 128K"))?;
        Ok(Choice {
            algorithm,
            piece_bytes: Some(bytes),
        })
    }
}

impl Algorithm {
    /// [`Algorithm::schedule`] for ranks listed by locality in `order` (a
    /// permutation of the ranks, those that share a host, and among them a
    /// CPU, next to each other): a binomial broadcast or reduce is built over
    /// that order, so that the messages of its largest subtrees go between
    /// groups and the others within them, and the ranks that forward lie
    /// away from the root's group. Where ranks share CPUs, that spreads the
    /// sends over the CPUs (4 ranks on 2 CPUs, rank r on CPU r mod 2: the
    /// root with a leaf on one CPU and the forwarder on the other, instead
    /// of the root and its forwarder on one). Other schedules are built over
    /// the ranks as they are numbered.
    pub fn schedule_in_order(
        self,
        coll: &Collective,
        rank: usize,
        world_size: usize,
        piece_elems: usize,
        layout: Layout,
        order: &[usize],
    ) -> Result<Schedule, String> {
        let reordered = matches!(
            coll.kind,
            CollectiveKind::Broadcast | CollectiveKind::Reduce
        ) && self == Algorithm::BinomialTree;
        if !reordered || order.iter().copied().eq(0..world_size) {
            return self.schedule(coll, rank, world_size, piece_elems, layout);
        }
        let mut sorted = order.to_vec();
        sorted.sort_unstable();
        if !sorted.into_iter().eq(0..world_size) {
            return Err(format!("{order:?} does not order the {world_size} ranks"));
        }
        let position = |r: usize| order.iter().position(|&o| o == r);
        let (Some(at), Some(root_at)) = (position(rank), position(coll.root)) else {
            return Err(format!("{order:?} lacks rank {rank} or root {}", coll.root));
        };
        let placed = coll.with_root(root_at);
        Ok(self
            .schedule(&placed, at, world_size, piece_elems, layout)?
            .relabel(order))
    }

    /// Rank `rank` of `world_size`'s schedule for `coll` on buffers of
    /// `layout`, moving at most `piece_elems` elements per message.
    /// Schedules are in elements: the same one serves every element type and
    /// op (but whether the op finalizes).
    pub fn schedule(
        self,
        coll: &Collective,
        rank: usize,
        world_size: usize,
        piece_elems: usize,
        layout: Layout,
    ) -> Result<Schedule, String> {
        let (r, n, c, p, root) = (rank, world_size, coll.count, piece_elems, coll.root);
        let finalize = coll.finalizes();
        if n == 0 || r >= n || root >= n {
            return Err(format!(
                "rank {r}, root {root} and world size {n} are inconsistent"
            ));
        }
        Ok(match (coll.kind, self) {
            (CollectiveKind::AllReduce, Algorithm::Ring) => ring::allreduce(r, n, c, p, finalize),
            (CollectiveKind::AllReduce, Algorithm::RecursiveDoubling) => {
                doubling::allreduce(r, n, c, p, finalize)
            }
            (CollectiveKind::AllReduce, Algorithm::Rabenseifner) => {
                halving::allreduce(r, n, c, p, finalize)
            }
            (CollectiveKind::AllReduce, Algorithm::DoubleBinaryTree) => {
                dbtree::allreduce(r, n, c, p, finalize)
            }
            (CollectiveKind::AllReduce, Algorithm::Direct) => {
                direct::allreduce(r, n, c, p, finalize)
            }
            (CollectiveKind::AllGather, Algorithm::Ring) => ring::allgather(r, n, c, p, layout),
            (CollectiveKind::AllGather, Algorithm::RecursiveDoubling) => {
                halving::allgather(r, n, c, p, layout)
            }
            (CollectiveKind::ReduceScatter, Algorithm::Ring) => {
                ring::reduce_scatter(r, n, c, p, finalize)
            }
            (CollectiveKind::ReduceScatter, Algorithm::RecursiveHalving) => {
                halving::reduce_scatter(r, n, c, p, finalize)
            }
            (CollectiveKind::ReduceScatter, Algorithm::RecursiveDoubling) => {
                doubling::reduce_scatter(r, n, c, p, finalize)
            }
            (CollectiveKind::Broadcast, Algorithm::BinomialTree) => {
                tree::broadcast(r, n, root, c, p)
            }
            (CollectiveKind::Reduce, Algorithm::BinomialTree) => {
                tree::reduce(r, n, root, c, p, finalize)
            }
            (CollectiveKind::Broadcast, Algorithm::Chain) => chain::broadcast(r, n, root, c, p),
            (CollectiveKind::Reduce, Algorithm::Chain) => chain::reduce(r, n, root, c, p, finalize),
            (CollectiveKind::AllToAll, Algorithm::Pairwise) => {
                direct::alltoall(r, n, c, layout, false)
            }
            (CollectiveKind::AllToAll, Algorithm::PairwiseInSteps) => {
                direct::alltoall(r, n, c, layout, true)
            }
            (CollectiveKind::Gather, Algorithm::Linear) => direct::gather(r, n, root, c),
            (CollectiveKind::Scatter, Algorithm::Linear) => direct::scatter(r, n, root, c),
            (CollectiveKind::Barrier, Algorithm::Dissemination) => direct::barrier(r, n),
            (kind, algorithm) => {
                return Err(format!("algorithm {algorithm} does not implement {kind}"))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Action;
    use ccl_core::DataType;

    /// Who `rank` sends to in its schedule for `coll`, built over `order`.
    fn sends(algorithm: Algorithm, coll: &Collective, rank: usize, order: &[usize]) -> Vec<usize> {
        let schedule = algorithm
            .schedule_in_order(coll, rank, order.len(), 64, Layout::InPlace, order)
            .unwrap();
        schedule
            .ops
            .iter()
            .filter_map(|op| match op.action {
                Action::Send { peer, .. } => Some(peer),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_binomial_broadcast_over_a_locality_order_forwards_away_from_the_root() {
        let coll = Collective::new(CollectiveKind::Broadcast, DataType::F32, 2);
        let tree = Algorithm::BinomialTree;
        // As numbered: 0 sends to 2 and 1, and 2 (the root's CPU mate when
        // rank r runs on CPU r mod 2) forwards to 3.
        let numbered = [0, 1, 2, 3];
        assert_eq!(sends(tree, &coll, 0, &numbered), [2, 1]);
        assert_eq!(sends(tree, &coll, 2, &numbered), [3]);
        // CPU mates together: the first message goes to the other CPU,
        // whose rank forwards there.
        let by_cpu = [0, 2, 1, 3];
        assert_eq!(sends(tree, &coll, 0, &by_cpu), [1, 2]);
        assert_eq!(sends(tree, &coll, 1, &by_cpu), [3]);
        assert!(sends(tree, &coll, 2, &by_cpu).is_empty());
        assert!(sends(tree, &coll, 3, &by_cpu).is_empty());
        // Rooted elsewhere, the tree hangs from the root's place in the order.
        let at3 = coll.with_root(3);
        assert_eq!(sends(tree, &at3, 3, &by_cpu), [2, 0]);
        // A reduce's tree is the broadcast's, its messages going up.
        let reduce = Collective::new(CollectiveKind::Reduce, DataType::F32, 2);
        assert_eq!(sends(tree, &reduce, 3, &by_cpu), [1]);
        assert_eq!(sends(tree, &reduce, 1, &by_cpu), [0]);
        assert_eq!(sends(tree, &reduce, 2, &by_cpu), [0]);
        // Other collectives and algorithms keep the numbering.
        assert_eq!(sends(Algorithm::Chain, &coll, 0, &by_cpu), [1]);
        assert!(tree
            .schedule_in_order(&coll, 0, 4, 64, Layout::InPlace, &[0, 1, 1, 3])
            .is_err());
    }

    #[test]
    fn names_parse_and_every_algorithm_has_a_collective() {
        for a in Algorithm::ALL {
            assert_eq!(a.name().parse::<Algorithm>(), Ok(a));
            assert_eq!(a.name().to_uppercase().parse::<Algorithm>(), Ok(a));
            assert!(
                a.on_group_memory()
                    || CollectiveKind::ALL
                        .into_iter()
                        .any(|k| Algorithm::for_kind(k).contains(&a)),
                "{a}"
            );
        }
        assert!("bogus".parse::<Algorithm>().is_err());
    }

    /// The first algorithm of a collective is its default; new ones go after it.
    #[test]
    fn choices_parse_and_print() {
        for (text, piece) in [
            ("ring", None),
            ("ring/128K", Some(128 << 10)),
            ("ring/4M", Some(4 << 20)),
            ("rd/1000", Some(1000)),
        ] {
            let c: Choice = text.parse().unwrap();
            assert_eq!(c.piece_bytes, piece, "{text}");
            assert_eq!(c.to_string(), text);
        }
        assert_eq!(
            "ring/1024".parse::<Choice>().unwrap().to_string(),
            "ring/1K"
        );
        for bad in [
            "ring/",
            "ring/0",
            "ring/x",
            "board/1M",
            "nope/1M",
            "ring/99999999999999999999M",
        ] {
            assert!(bad.parse::<Choice>().is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_stay() {
        let first = |k| Algorithm::for_kind(k).first().copied();
        use CollectiveKind as K;
        assert_eq!(first(K::AllReduce), Some(Algorithm::Ring));
        assert_eq!(first(K::AllGather), Some(Algorithm::Ring));
        assert_eq!(first(K::ReduceScatter), Some(Algorithm::Ring));
        assert_eq!(first(K::Broadcast), Some(Algorithm::BinomialTree));
        assert_eq!(first(K::Reduce), Some(Algorithm::BinomialTree));
    }
}
