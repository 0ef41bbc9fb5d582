//! Recursive halving and recursive doubling among the survivors of a [`Fold`]:
//! Rabenseifner's allreduce (reduce-scatter by recursive halving, then
//! allgather by recursive doubling), and each half on its own as a
//! reduce-scatter and an allgather.
//!
//! The data is cut into one block per survivor (contiguous, possibly uneven
//! or empty). In recursive halving survivor v holds a run of 2m blocks,
//! sends the half that does not contain block v to v ^ m and reduces the half
//! that does with what v ^ m sends back, for m = p/2, p/4, …, 1; it ends with
//! block v reduced over everyone. Recursive doubling runs the same exchanges
//! in reverse order without reducing. At a power of two each rank sends
//! 2(n−1)/n of the buffer for an allreduce, like the ring, in 2·log2 n steps
//! instead of 2(n−1); a fold adds a whole-buffer step on each side. Every block is reduced (and finalized) on one rank only and then
//! copied, so every rank ends with bitwise the same result.

use std::ops::Range;

use crate::{
    doubling::{folded_allreduce, Fold, Role},
    schedule::{split_even, Action, BufId, Builder, Layout, Region, Schedule},
};

/// Where a vector of elements lives: element `x` is element `x − base` of `buf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Space {
    buf: BufId,
    base: usize,
}

impl Space {
    const fn at_zero(buf: BufId) -> Space {
        Space { buf, base: 0 }
    }

    fn at(self, r: Range<usize>) -> Region {
        Region::new(self.buf, r.start - self.base, r.len())
    }
}

/// The elements of the consecutive blocks `blocks`.
fn span(bounds: &[Range<usize>], blocks: Range<usize>) -> Range<usize> {
    bounds[blocks.start].start..bounds[blocks.end - 1].end
}

/// The blocks survivor `v` keeps and gives away when it halves a run of 2m
/// blocks: (keep, give).
fn halves(v: usize, m: usize) -> (Range<usize>, Range<usize>) {
    let lo = v & !(2 * m - 1);
    let (low, high) = (lo..lo + m, lo + m..lo + 2 * m);
    if v & m == 0 {
        (low, high)
    } else {
        (high, low)
    }
}

/// Recursive halving: survivor `v` ends with block `v` of `bounds` reduced
/// over all survivors. Its operand is `src` until the first exchange, partial
/// results go to `acc`. Returns where block `v` then is (`src` when there is
/// only one survivor).
fn halve(
    b: &mut Builder,
    fold: &Fold,
    v: usize,
    bounds: &[Range<usize>],
    src: Space,
    acc: Space,
    piece: usize,
) -> Space {
    let mut held = src;
    let mut m = fold.p / 2;
    while m > 0 {
        let (keep, give) = halves(v, m);
        let peer = fold.real(v ^ m);
        let (keep, give) = (span(bounds, keep), span(bounds, give));
        b.send_pieces(peer, held.at(give), piece);
        b.recv_reduce_pieces(peer, acc.at(keep.clone()), Some(held.at(keep)), piece);
        held = acc;
        m /= 2;
    }
    held
}

/// Recursive doubling: survivor `v` holds block `v` of `bounds` in `buf` and
/// ends with every block. The first round sends `first` where given (the
/// same data as block `v`, elsewhere: the input of an allgather, so that
/// the send need not wait for the copy of the block into the output).
fn double(
    b: &mut Builder,
    fold: &Fold,
    v: usize,
    bounds: &[Range<usize>],
    buf: Space,
    piece: usize,
    first: Option<Region>,
) {
    let mut m = 1;
    while m < fold.p {
        let (mine, theirs) = halves(v, m);
        let peer = fold.real(v ^ m);
        let send = match first {
            Some(r) if m == 1 => r,
            _ => buf.at(span(bounds, mine)),
        };
        b.send_pieces(peer, send, piece);
        b.recv_pieces(peer, buf.at(span(bounds, theirs)), piece);
        m *= 2;
    }
}

/// The elements each survivor stands for when every rank has a block of `count`.
fn rank_blocks(fold: &Fold, count: usize) -> Vec<Range<usize>> {
    (0..fold.p)
        .map(|v| {
            let m = fold.members(v);
            m.start * count..m.end * count
        })
        .collect()
}

/// Rabenseifner allreduce of `count` elements: recursive halving, the own
/// block finalized, recursive doubling.
pub fn allreduce(rank: usize, n: usize, count: usize, piece: usize, finalize: bool) -> Schedule {
    folded_allreduce(rank, n, count, piece, |b, fold, v, src| {
        let bounds = split_even(count, fold.p);
        let out = Space::at_zero(BufId::Output);
        let held = halve(b, fold, v, &bounds, Space::at_zero(src), out, piece);
        let mine = out.at(bounds[v].clone());
        if held != out {
            b.push(Action::Copy {
                src: held.at(bounds[v].clone()),
                dst: mine,
            });
        }
        if finalize {
            b.finalize_pieces(mine, piece);
        }
        double(b, fold, v, &bounds, out, piece, None);
    })
}

/// Reduce-scatter by recursive halving: the input holds `n * count`
/// elements, rank r ends with block r.
///
/// Partial results go to scratch (half the input, or all of it on a rank
/// that a folded rank's input was reduced into); the input is never written.
pub fn reduce_scatter(
    rank: usize,
    n: usize,
    count: usize,
    piece: usize,
    finalize: bool,
) -> Schedule {
    let mut b = Builder::new();
    let fold = Fold::new(n);
    let input = Space::at_zero(BufId::Input);
    let block = |r: usize| r * count..(r + 1) * count;
    let out = Region::new(BufId::Output, 0, count);
    match fold.role(rank) {
        Role::Idle { partner } => {
            b.send_pieces(partner, input.at(0..n * count), piece);
            b.recv_pieces(partner, out, piece);
        }
        Role::Survivor { v, partner } => {
            let bounds = rank_blocks(&fold, count);
            let (src, acc) = match partner {
                Some(q) => {
                    let all = Space::at_zero(BufId::Scratch);
                    b.scratch(n * count);
                    b.recv_reduce_pieces(
                        q,
                        all.at(0..n * count),
                        Some(input.at(0..n * count)),
                        piece,
                    );
                    (all, all)
                }
                None if fold.p > 1 => {
                    // Everything after the first exchange lies in the half kept then.
                    let kept = span(&bounds, halves(v, fold.p / 2).0);
                    b.scratch(kept.len());
                    let acc = Space {
                        buf: BufId::Scratch,
                        base: kept.start,
                    };
                    (input, acc)
                }
                None => (input, input),
            };
            let held = halve(&mut b, &fold, v, &bounds, src, acc, piece);
            b.push(Action::Copy {
                src: held.at(block(rank)),
                dst: out,
            });
            if let Some(q) = partner {
                b.send_pieces(q, held.at(block(q)), piece);
            }
        }
    }
    if finalize {
        b.finalize_pieces(out, piece);
    }
    b.finish()
}

/// Allgather by recursive doubling: each rank contributes `count` elements;
/// the output holds `n * count`. Out of place (`layout`), the first round's
/// send from the input does not wait for the block's copy into the output.
pub fn allgather(rank: usize, n: usize, count: usize, piece: usize, layout: Layout) -> Schedule {
    let mut b = Builder::for_layout(layout);
    let fold = Fold::new(n);
    let out = Space::at_zero(BufId::Output);
    let block = |r: usize| out.at(r * count..(r + 1) * count);
    let input = Region::new(BufId::Input, 0, count);
    match fold.role(rank) {
        Role::Idle { partner } => {
            b.send_pieces(partner, input, piece);
            b.recv_pieces(partner, out.at(0..n * count), piece);
        }
        Role::Survivor { v, partner } => {
            b.push(Action::Copy {
                src: input,
                dst: block(rank),
            });
            if let Some(q) = partner {
                b.recv_pieces(q, block(q), piece);
            }
            // Without a folded partner the first round sends this rank's
            // block alone, which the input holds.
            let first = partner.is_none().then_some(input);
            double(
                &mut b,
                &fold,
                v,
                &rank_blocks(&fold, count),
                out,
                piece,
                first,
            );
            if let Some(q) = partner {
                b.send_pieces(q, out.at(0..n * count), piece);
            }
        }
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halving_partners() {
        assert_eq!(halves(5, 4), (4..8, 0..4));
        assert_eq!(halves(5, 2), (4..6, 6..8));
        assert_eq!(halves(5, 1), (5..6, 4..5));
        assert_eq!(halves(0, 1), (0..1, 1..2));
    }

    /// log2 n steps each way at a power of two: every send is one message
    /// when pieces are large, to v ^ 4, v ^ 2, v ^ 1, then back.
    #[test]
    fn rabenseifner_steps() {
        for rank in 0..8 {
            let s = allreduce(rank, 8, 1000, 1 << 20, false);
            let sends: Vec<(usize, usize)> = s
                .ops
                .iter()
                .filter_map(|op| match op.action {
                    Action::Send { peer, src } => Some((peer, src.len)),
                    _ => None,
                })
                .collect();
            let peers: Vec<usize> = sends.iter().map(|s| s.0).collect();
            assert_eq!(peers, [4, 2, 1, 1, 2, 4].map(|m| rank ^ m), "rank {rank}");
            let sent: usize = sends.iter().map(|s| s.1).sum();
            assert_eq!(sent, 2 * 1000 * 7 / 8, "rank {rank}");
            assert_eq!(s.scratch_elems, 0);
        }
        // A rank that sits out sends once and receives once; its partner adds two steps.
        let s = allreduce(0, 6, 100, 1 << 20, false);
        assert_eq!(s.ops.len(), 2);
        let s = allreduce(1, 6, 100, 1 << 20, false);
        let sends = s
            .ops
            .iter()
            .filter(|op| matches!(op.action, Action::Send { .. }))
            .count();
        assert_eq!(sends, 2 * 2 + 1);
    }

    /// Out of place, a survivor without a folded partner (and every rank of
    /// a ring) sends its first round from its input, not waiting for its block's copy into the
    /// output; at 2 ranks nothing waits for that copy (so the executor may
    /// stream it). A
    /// survivor that carries a folded rank sends both blocks from the output.
    #[test]
    fn allgather_sends_its_first_round_from_the_input() {
        let first_send = |s: &Schedule| {
            s.ops
                .iter()
                .find_map(|op| match op.action {
                    Action::Send { src, .. } => Some(src),
                    _ => None,
                })
                .expect("a send")
        };
        let copy_waited_for = |s: &Schedule| {
            let at = s
                .ops
                .iter()
                .position(|op| matches!(op.action, Action::Copy { .. }))
                .expect("the own block's copy") as u32;
            s.ops.iter().any(|op| op.deps.contains(&at))
        };
        for (rank, n) in [(0, 2), (1, 2), (2, 4), (4, 5)] {
            let s = allgather(rank, n, 10, 1 << 20, Layout::OutOfPlace);
            assert_eq!(
                first_send(&s),
                Region::new(BufId::Input, 0, 10),
                "rank {rank} of {n}"
            );
            assert_eq!(copy_waited_for(&s), n > 2, "rank {rank} of {n}");
        }
        let s = allgather(1, 3, 10, 1 << 20, Layout::OutOfPlace);
        assert_eq!(first_send(&s), Region::new(BufId::Output, 0, 20));
        // The ring's own block goes out in its first step only.
        for (rank, n) in [(0, 2), (1, 3), (3, 5)] {
            let s = crate::ring::allgather(rank, n, 10, 1 << 20, Layout::OutOfPlace);
            assert_eq!(
                first_send(&s),
                Region::new(BufId::Input, 0, 10),
                "ring, rank {rank} of {n}"
            );
            assert!(!copy_waited_for(&s), "ring, rank {rank} of {n}");
        }
    }
}
