//! Recursive doubling allreduce: ⌈log2 n⌉ rounds of whole-buffer exchange, for
//! small messages where latency, not bandwidth, decides.
//!
//! In round k rank v exchanges its partial result with v ^ 2^k and both
//! reduce. Every rank combines the same operands in the same tree, and the ops
//! are commutative, so every rank ends with bitwise the same result. When n is
//! not a power of two, the standard [`Fold`] applies: of the first 2·rem ranks
//! (rem = n − 2^⌊log2 n⌋) each even rank hands its input to the odd rank after
//! it, sits out the rounds, and gets the result back at the end.

use std::ops::Range;

use crate::schedule::{pieces, Action, BufId, Builder, Region, Schedule};

/// How `n` ranks fold onto `p`, the largest power of two not above `n`: of
/// the first `2·rem` ranks (`rem = n − p`), each even rank hands its data to
/// the odd rank after it and sits out; the `p` survivors are numbered `0..p`
/// (their virtual ranks) in rank order.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fold {
    /// Survivors: a power of two.
    pub p: usize,
    /// Ranks that sit out.
    pub rem: usize,
}

/// What a rank does in a [`Fold`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// Hands its data to `partner` and gets its result from it.
    Idle { partner: usize },
    /// Survivor `v`; `partner` is the rank folded onto it, if any.
    Survivor { v: usize, partner: Option<usize> },
}

impl Fold {
    /// The fold of `n ≥ 1` ranks.
    pub fn new(n: usize) -> Fold {
        let p = if n.is_power_of_two() {
            n
        } else {
            n.next_power_of_two() / 2
        };
        Fold { p, rem: n - p }
    }

    /// What `rank` does.
    pub fn role(&self, rank: usize) -> Role {
        if rank >= 2 * self.rem {
            Role::Survivor {
                v: rank - self.rem,
                partner: None,
            }
        } else if rank % 2 == 0 {
            Role::Idle { partner: rank + 1 }
        } else {
            Role::Survivor {
                v: rank / 2,
                partner: Some(rank - 1),
            }
        }
    }

    /// The rank that survivor `v` is.
    pub fn real(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }

    /// The ranks whose data survivor `v` carries: itself and the rank folded onto it.
    pub fn members(&self, v: usize) -> Range<usize> {
        if v < self.rem {
            2 * v..2 * v + 2
        } else {
            v + self.rem..v + self.rem + 1
        }
    }
}

/// An allreduce of `count` elements around `core`, an allreduce among the
/// survivors of the [`Fold`] of `n` ranks.
///
/// `core(b, fold, v, src)` builds survivor `v`'s part: its operand is `src`
/// (the input, or the output when a folded rank's input was reduced into it)
/// and it must leave the finished result, finalized, in the output. Ranks
/// that sit out send their input away and receive that result.
pub(crate) fn folded_allreduce(
    rank: usize,
    n: usize,
    count: usize,
    piece: usize,
    core: impl FnOnce(&mut Builder, &Fold, usize, BufId),
) -> Schedule {
    let mut b = Builder::new();
    let input = Region::new(BufId::Input, 0, count);
    let output = Region::new(BufId::Output, 0, count);
    let fold = Fold::new(n);
    match fold.role(rank) {
        Role::Idle { partner } => {
            b.send_pieces(partner, input, piece);
            b.recv_pieces(partner, output, piece);
        }
        Role::Survivor { v, partner } => {
            let src = match partner {
                Some(q) => {
                    b.recv_reduce_pieces(q, output, Some(input), piece);
                    BufId::Output
                }
                None => BufId::Input,
            };
            core(&mut b, &fold, v, src);
            if let Some(q) = partner {
                b.send_pieces(q, output, piece);
            }
        }
    }
    b.finish()
}

/// The rounds of recursive doubling among the survivors of `fold`, as
/// survivor `v`: each round sends the partial result `cur` to `v ^ 2^k` and
/// reduces what comes back with it into the other of `a` and `b` (so that a
/// round's send and receive never touch the same memory). All four regions
/// are the same length; `a` and `b` are different memory. Returns the region
/// that holds the result.
pub(crate) fn doubling_rounds(
    b: &mut Builder,
    fold: &Fold,
    v: usize,
    mut cur: Region,
    (first, second): (Region, Region),
    piece: usize,
) -> Region {
    let mut mask = 1;
    while mask < fold.p {
        let peer = fold.real(v ^ mask);
        let next = if cur == first { second } else { first };
        let sends = pieces(cur, piece);
        let recvs = pieces(next, piece);
        for (s, (d, l)) in sends.iter().zip(recvs.iter().zip(pieces(cur, piece))) {
            b.push(Action::Send { peer, src: *s });
            b.push(Action::RecvReduce {
                peer,
                dst: *d,
                local: Some(l),
            });
        }
        cur = next;
        mask <<= 1;
    }
    cur
}

/// Recursive-doubling allreduce of `count` elements.
pub fn allreduce(rank: usize, n: usize, count: usize, piece: usize, finalize: bool) -> Schedule {
    folded_allreduce(rank, n, count, piece, |b, fold, v, src| {
        let output = Region::new(BufId::Output, 0, count);
        let scratch = Region::new(BufId::Scratch, 0, count);
        if fold.p > 1 {
            b.scratch(count);
        }
        let cur = Region::new(src, 0, count);
        let cur = doubling_rounds(b, fold, v, cur, (scratch, output), piece);
        if cur != output {
            b.push(Action::Copy {
                src: cur,
                dst: output,
            });
        }
        if finalize {
            b.finalize_pieces(output, piece);
        }
    })
}

/// Reduce-scatter by recursive doubling: the whole input (`n * count`
/// elements) is allreduced by [`doubling_rounds`] in scratch, and rank r
/// keeps block r. Each round moves the whole buffer, so this is for small
/// buffers, where it needs the same log2 n rounds as recursive halving but
/// pairs the ranks nearest in rank order first (as the allreduce does).
pub fn reduce_scatter(
    rank: usize,
    n: usize,
    count: usize,
    piece: usize,
    finalize: bool,
) -> Schedule {
    let mut b = Builder::new();
    let fold = Fold::new(n);
    let all = n * count;
    let input = Region::new(BufId::Input, 0, all);
    let out = Region::new(BufId::Output, 0, count);
    match fold.role(rank) {
        Role::Idle { partner } => {
            b.send_pieces(partner, input, piece);
            b.recv_pieces(partner, out, piece);
        }
        Role::Survivor { v, partner } => {
            let halves = (
                Region::new(BufId::Scratch, 0, all),
                Region::new(BufId::Scratch, all, all),
            );
            if n > 1 {
                b.scratch(2 * all);
            }
            let cur = match partner {
                Some(q) => {
                    b.recv_reduce_pieces(q, halves.0, Some(input), piece);
                    halves.0
                }
                None => input,
            };
            let cur = doubling_rounds(&mut b, &fold, v, cur, halves, piece);
            b.push(Action::Copy {
                src: cur.sub(rank * count, count),
                dst: out,
            });
            if let Some(q) = partner {
                b.send_pieces(q, cur.sub(q * count, count), piece);
            }
        }
    }
    if finalize {
        b.finalize_pieces(out, piece);
    }
    b.finish()
}

#[cfg(test)]
mod tests {
    use super::{reduce_scatter, Fold, Role};
    use crate::schedule::{Action, BufId};

    /// At a power of two: one whole-buffer exchange with v ^ 1, v ^ 2, v ^ 4
    /// (nearest first), then the own block copied out of scratch.
    #[test]
    fn reduce_scatter_rounds() {
        for rank in 0..8 {
            let s = reduce_scatter(rank, 8, 10, 1 << 20, false);
            let sends: Vec<(usize, usize)> = s
                .ops
                .iter()
                .filter_map(|op| match op.action {
                    Action::Send { peer, src } => Some((peer, src.len)),
                    _ => None,
                })
                .collect();
            assert_eq!(sends, [1, 2, 4].map(|m| (rank ^ m, 80)), "rank {rank}");
            let Some(Action::Copy { src, dst }) = s.ops.last().map(|op| op.action) else {
                panic!("rank {rank} does not end with its block's copy");
            };
            assert_eq!(
                (src.buf, src.offset, src.len, dst.buf, dst.offset),
                // Three rounds from the input end in scratch's first half.
                (BufId::Scratch, rank * 10, 10, BufId::Output, 0)
            );
            assert_eq!(s.scratch_elems, 160);
        }
    }

    #[test]
    fn fold_roles() {
        let f = Fold::new(6);
        assert_eq!((f.p, f.rem), (4, 2));
        let roles: Vec<Role> = (0..6).map(|r| f.role(r)).collect();
        assert_eq!(roles[0], Role::Idle { partner: 1 });
        assert_eq!(
            roles[3],
            Role::Survivor {
                v: 1,
                partner: Some(2)
            }
        );
        assert_eq!(
            roles[5],
            Role::Survivor {
                v: 3,
                partner: None
            }
        );
        for v in 0..f.p {
            assert!(f.members(v).contains(&f.real(v)));
            assert!(matches!(f.role(f.real(v)), Role::Survivor { v: w, .. } if w == v));
        }
        let f = Fold::new(8);
        assert_eq!((f.p, f.rem, f.real(5), f.members(5)), (8, 0, 5, 5..6));
    }
}
