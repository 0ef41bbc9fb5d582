//! Pipelined chain (linear pipeline): broadcast and reduce along the ranks
//! root, root+1, …, root+n−1 (mod n).
//!
//! The buffer is cut into segments (pieces); a rank forwards segment k while
//! it receives segment k+1, so once the pipeline is full every link carries
//! data at once. The time is about (n − 2 + segments) segment transfers:
//! better than a tree for large buffers, worse for small ones.

use crate::{
    schedule::{Action, BufId, Builder, Region, Schedule},
    tree::edge_piece,
};

/// The ranks before and after `rank` in the chain that starts at `root`.
fn neighbours(rank: usize, n: usize, root: usize) -> (Option<usize>, Option<usize>) {
    let pos = (rank + n - root) % n;
    let before = (pos > 0).then(|| (rank + n - 1) % n);
    let after = (pos + 1 < n).then(|| (rank + 1) % n);
    (before, after)
}

/// Broadcast of `count` elements from `root` down the chain.
pub fn broadcast(rank: usize, n: usize, root: usize, count: usize, piece: usize) -> Schedule {
    let mut b = Builder::new();
    let input = Region::new(BufId::Input, 0, count);
    let output = Region::new(BufId::Output, 0, count);
    let (before, after) = neighbours(rank, n, root);
    let forward = match before {
        None => {
            b.push(Action::Copy {
                src: input,
                dst: output,
            });
            input
        }
        Some(p) => {
            b.recv_pieces(
                p,
                output,
                edge_piece(p, after.is_none(), root, count, piece),
            );
            output
        }
    };
    if let Some(next) = after {
        let leaf = neighbours(next, n, root).1.is_none();
        b.send_pieces(next, forward, edge_piece(rank, leaf, root, count, piece));
    }
    b.finish()
}

/// Reduce of `count` elements up the chain to `root`: the last rank sends its
/// input, each rank on the way adds its own, intermediate ranks accumulate in
/// scratch.
pub fn reduce(
    rank: usize,
    n: usize,
    root: usize,
    count: usize,
    piece: usize,
    finalize: bool,
) -> Schedule {
    let mut b = Builder::new();
    let input = Region::new(BufId::Input, 0, count);
    let (before, after) = neighbours(rank, n, root);
    let acc = match (before, after) {
        (None, _) => Region::new(BufId::Output, 0, count),
        (Some(_), None) => input,
        (Some(_), Some(_)) => {
            b.scratch(count);
            Region::new(BufId::Scratch, 0, count)
        }
    };
    match after {
        Some(next) => b.recv_reduce_pieces(next, acc, Some(input), piece),
        None if before.is_none() => {
            b.push(Action::Copy {
                src: input,
                dst: acc,
            });
        }
        None => {}
    }
    match before {
        Some(p) => b.send_pieces(p, acc, piece),
        None if finalize => b.finalize_pieces(acc, piece),
        None => {}
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_order() {
        assert_eq!(neighbours(2, 5, 2), (None, Some(3)));
        assert_eq!(neighbours(4, 5, 2), (Some(3), Some(0)));
        assert_eq!(neighbours(1, 5, 2), (Some(0), None));
        assert_eq!(neighbours(0, 1, 0), (None, None));
    }

    /// The root sends whole only where the next rank is the chain's last.
    #[test]
    fn the_root_sends_whole_to_the_last_rank_only() {
        let sends = |s: &Schedule| {
            s.ops
                .iter()
                .filter(|op| matches!(op.action, Action::Send { .. }))
                .count()
        };
        assert_eq!(sends(&broadcast(0, 2, 0, 10, 3)), 1);
        assert_eq!(sends(&broadcast(0, 3, 0, 10, 3)), 4);
        assert_eq!(sends(&broadcast(1, 3, 0, 10, 3)), 4);
    }

    /// Every segment is forwarded separately, so rank k can pass segment 0 on
    /// as soon as it has it.
    #[test]
    fn segments_are_forwarded_one_by_one() {
        let s = broadcast(1, 4, 0, 10, 3);
        assert_eq!(s.ops.len(), 8);
        for k in 0..4 {
            let (recv, send) = (&s.ops[k], &s.ops[4 + k]);
            assert!(matches!(recv.action, Action::Recv { peer: 0, .. }));
            assert!(matches!(send.action, Action::Send { peer: 2, .. }));
            assert_eq!(send.deps, vec![k as u32]);
        }
    }
}
