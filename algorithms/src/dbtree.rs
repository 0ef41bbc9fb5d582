//! Double binary tree allreduce, as in NCCL 2.4: two binary trees over the
//! ranks, each carrying half of the buffer. In each tree the half is reduced
//! up to the root piece by piece, finalized there, and broadcast back down,
//! so reduction, the turn at the root and the broadcast all pipeline.
//!
//! Tree 1 is the in-order binary tree over positions 1..=n (rank = position
//! − 1): the root is the position divisible by the largest power of two, and
//! each subtree is built the same way over the positions on either side.
//! Even positions are interior and odd ones leaves, so the interior ranks of
//! tree 1 are the odd ranks. Tree 2 is tree 1 shifted by one rank, so its
//! interior ranks are even: every rank is interior in at most one tree and
//! sends and receives about as much in total as any other. (NCCL's trees
//! hang the same shape under rank 0 and mirror the second tree when n is
//! even; for odd n that leaves rank 0 interior in both.)
//!
//! Every element is reduced and finalized at one tree root and then copied,
//! so every rank ends with bitwise the same result.

use crate::schedule::{pieces, split_even, Action, BufId, Builder, Region, Schedule};

/// A rank's place in one tree.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Node {
    parent: Option<usize>,
    children: Vec<usize>,
}

/// The root of the in-order tree over positions `lo..=hi`: the one position
/// divisible by the largest power of two (two multiples of that power would
/// have one of twice it between them).
fn subtree_root(lo: usize, hi: usize) -> usize {
    let mut bit = 1 << hi.ilog2();
    loop {
        let x = lo.div_ceil(bit) * bit;
        if x <= hi {
            return x;
        }
        bit >>= 1;
    }
}

/// Position `x`'s place in the in-order tree over positions 1..=n.
fn in_order(x: usize, n: usize) -> Node {
    let (mut lo, mut hi, mut parent) = (1, n, None);
    loop {
        let r = subtree_root(lo, hi);
        if r == x {
            let left = (lo < x).then(|| subtree_root(lo, x - 1));
            let right = (x < hi).then(|| subtree_root(x + 1, hi));
            return Node {
                parent,
                children: left.into_iter().chain(right).collect(),
            };
        }
        parent = Some(r);
        if x < r {
            hi = r - 1;
        } else {
            lo = r + 1;
        }
    }
}

/// `rank`'s place in tree `t` (0 or 1) of `n` ranks.
fn node(rank: usize, n: usize, t: usize) -> Node {
    let to_rank = |pos: usize| (pos - 1 + t) % n;
    let Node { parent, children } = in_order((rank + n - t) % n + 1, n);
    Node {
        parent: parent.map(to_rank),
        children: children.into_iter().map(to_rank).collect(),
    }
}

/// Pushes one piece's reduction towards the root of tree `node`: the own
/// input combined with each child's partial result, then sent to the parent
/// (or, at the root, finalized).
fn reduce_piece(b: &mut Builder, node: &Node, out: Region, finalize: bool) {
    let input = Region::new(BufId::Input, out.offset, out.len);
    if node.children.is_empty() {
        match node.parent {
            Some(p) => b.push(Action::Send {
                peer: p,
                src: input,
            }),
            None => b.push(Action::Copy {
                src: input,
                dst: out,
            }),
        };
    }
    for (i, &c) in node.children.iter().enumerate() {
        let local = (i == 0).then_some(input);
        b.push(Action::RecvReduce {
            peer: c,
            dst: out,
            local,
        });
    }
    match node.parent {
        Some(p) if !node.children.is_empty() => {
            b.push(Action::Send { peer: p, src: out });
        }
        None if finalize => {
            b.push(Action::Finalize { dst: out });
        }
        _ => {}
    }
}

/// Pushes one piece's broadcast down tree `node`.
fn broadcast_piece(b: &mut Builder, node: &Node, out: Region) {
    if let Some(p) = node.parent {
        b.push(Action::Recv { peer: p, dst: out });
    }
    for &c in &node.children {
        b.push(Action::Send { peer: c, src: out });
    }
}

/// Double binary tree allreduce of `count` elements: tree t reduces and
/// broadcasts half t.
///
/// Both trees share links, and ops on one link run in the order they were
/// pushed, so the order matters for overlap (not for correctness): piece k is
/// reduced in step k and broadcast in step k + `lag`, where `lag` (twice the
/// tree depth) is about the time piece k takes to reach the root and come
/// back. Every rank pushes in the same order, so each link's messages line up.
pub fn allreduce(rank: usize, n: usize, count: usize, piece: usize, finalize: bool) -> Schedule {
    let mut b = Builder::new();
    let trees = [node(rank, n, 0), node(rank, n, 1)];
    let halves: Vec<Vec<Region>> = split_even(count, 2)
        .into_iter()
        .map(|h| pieces(Region::new(BufId::Output, h.start, h.len()), piece))
        .collect();
    let lag = 2 * (n.ilog2() as usize + 1);
    let steps = halves.iter().map(Vec::len).max().unwrap_or(0);
    for step in 0..steps + lag {
        for (tree, half) in trees.iter().zip(&halves) {
            if let Some(&out) = half.get(step) {
                reduce_piece(&mut b, tree, out, finalize);
            }
        }
        for (tree, half) in trees.iter().zip(&halves) {
            if let Some(&out) = step.checked_sub(lag).and_then(|k| half.get(k)) {
                broadcast_piece(&mut b, tree, out);
            }
        }
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_shapes() {
        // positions 1..=13 (NCCL's picture without its rank 0)
        assert_eq!(
            in_order(8, 13),
            Node {
                parent: None,
                children: vec![4, 12]
            }
        );
        assert_eq!(
            in_order(12, 13),
            Node {
                parent: Some(8),
                children: vec![10, 13]
            }
        );
        assert_eq!(
            in_order(13, 13),
            Node {
                parent: Some(12),
                children: vec![]
            }
        );
        assert_eq!(
            in_order(6, 7),
            Node {
                parent: Some(4),
                children: vec![5, 7]
            }
        );
        // two ranks: each is the other's root
        assert_eq!(node(1, 2, 0).children, vec![0]);
        assert_eq!(node(0, 2, 1).children, vec![1]);
        assert_eq!(node(0, 1, 1).parent, None);
    }

    /// Both trees span every rank, parents and children agree, no rank is
    /// interior in both, and no node has more than two children.
    #[test]
    fn two_trees_for_every_size() {
        for n in 1..=64 {
            let mut interior = vec![0; n];
            for t in 0..2 {
                let nodes: Vec<Node> = (0..n).map(|r| node(r, n, t)).collect();
                let roots: Vec<usize> = (0..n).filter(|&r| nodes[r].parent.is_none()).collect();
                assert_eq!(roots.len(), 1, "n={n} tree {t}");
                for (r, nd) in nodes.iter().enumerate() {
                    assert!(nd.children.len() <= 2);
                    for &c in &nd.children {
                        assert_eq!(nodes[c].parent, Some(r), "n={n} tree {t}");
                    }
                    if let Some(p) = nd.parent {
                        assert!(nodes[p].children.contains(&r), "n={n} tree {t}");
                    }
                    interior[r] += usize::from(!nd.children.is_empty());
                    // the root is reachable within ⌊log2 n⌋ steps
                    let (mut up, mut depth) = (r, 0);
                    while let Some(p) = nodes[up].parent {
                        up = p;
                        depth += 1;
                    }
                    assert!(up == roots[0] && depth <= n.ilog2(), "n={n} tree {t}");
                }
            }
            assert!(interior.iter().all(|&i| i <= 1), "n={n}: {interior:?}");
        }
    }
}
