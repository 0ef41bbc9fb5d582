//! Ring algorithms: allreduce (reduce-scatter then allgather), allgather and
//! reduce-scatter. Each rank sends to `rank + 1` and receives from `rank - 1`;
//! blocks are cut into pieces so that forwarding piece k overlaps receiving
//! and reducing piece k + 1. Bandwidth-optimal: each rank sends
//! 2(n-1)/n of the buffer for allreduce.

use crate::schedule::{pieces, split_even, Action, BufId, Builder, Layout, Region, Schedule};

fn right(rank: usize, n: usize) -> usize {
    (rank + 1) % n
}

fn left(rank: usize, n: usize) -> usize {
    (rank + n - 1) % n
}

/// Block index `rank - k` modulo `n`.
fn block(rank: usize, k: usize, n: usize) -> usize {
    (rank + n * (k / n + 1) - k) % n
}

/// One ring step: send `sends` to the right while receiving `recvs` from the
/// left, piece by piece. The lists may differ in length (blocks of uneven size).
fn step(b: &mut Builder, to: usize, from: usize, sends: Vec<Region>, recvs: Vec<Action>) {
    for i in 0..sends.len().max(recvs.len()) {
        if let Some(&src) = sends.get(i) {
            b.push(Action::Send { peer: to, src });
        }
        if let Some(&r) = recvs.get(i) {
            debug_assert_eq!(r.peer(), Some(from));
            b.push(r);
        }
    }
}

/// Ring allreduce of `count` elements; `finalize` marks ops (avg) that need a last step.
pub fn allreduce(rank: usize, n: usize, count: usize, piece: usize, finalize: bool) -> Schedule {
    let mut b = Builder::new();
    let inp = |r: std::ops::Range<usize>| Region::new(BufId::Input, r.start, r.len());
    let out = |r: std::ops::Range<usize>| Region::new(BufId::Output, r.start, r.len());
    if n == 1 {
        b.push(Action::Copy {
            src: inp(0..count),
            dst: out(0..count),
        });
        return b.finish();
    }
    let blocks = split_even(count, n);
    let (to, from) = (right(rank, n), left(rank, n));
    // Reduce-scatter: at step s send block rank-s, receive and reduce block rank-s-1.
    for s in 0..n - 1 {
        let send_block = blocks[block(rank, s, n)].clone();
        let recv_block = blocks[block(rank, s + 1, n)].clone();
        let send_src = if s == 0 {
            inp(send_block)
        } else {
            out(send_block)
        };
        let recvs = pieces(out(recv_block), piece)
            .into_iter()
            .map(|dst| Action::RecvReduce {
                peer: from,
                dst,
                local: Some(Region::new(BufId::Input, dst.offset, dst.len)),
            })
            .collect();
        step(&mut b, to, from, pieces(send_src, piece), recvs);
    }
    // This rank now holds block rank+1 fully reduced.
    let mine = blocks[right(rank, n)].clone();
    if finalize {
        for p in pieces(out(mine), piece) {
            b.push(Action::Finalize { dst: p });
        }
    }
    // Allgather: at step s send block rank+1-s, receive block rank-s.
    for s in 0..n - 1 {
        let send_block = blocks[block(right(rank, n), s, n)].clone();
        let recv_block = blocks[block(rank, s, n)].clone();
        let recvs = pieces(out(recv_block), piece)
            .into_iter()
            .map(|dst| Action::Recv { peer: from, dst })
            .collect();
        step(&mut b, to, from, pieces(out(send_block), piece), recvs);
    }
    b.finish()
}

/// Ring allgather: each rank contributes `count` elements; output holds
/// `n * count`. The first step sends the rank's block from its input: out
/// of place (`layout`), no op then waits for its copy into the output.
pub fn allgather(rank: usize, n: usize, count: usize, piece: usize, layout: Layout) -> Schedule {
    let mut b = Builder::for_layout(layout);
    let blk = |i: usize| Region::new(BufId::Output, i * count, count);
    let input = Region::new(BufId::Input, 0, count);
    b.push(Action::Copy {
        src: input,
        dst: blk(rank),
    });
    let (to, from) = (right(rank, n), left(rank, n));
    for s in 0..n.saturating_sub(1) {
        let recvs = pieces(blk(block(rank, s + 1, n)), piece)
            .into_iter()
            .map(|dst| Action::Recv { peer: from, dst })
            .collect();
        let sent = if s == 0 {
            input
        } else {
            blk(block(rank, s, n))
        };
        step(&mut b, to, from, pieces(sent, piece), recvs);
    }
    b.finish()
}

/// Ring reduce-scatter: input holds `n * count` elements, rank r ends with block r.
///
/// Partial sums travel through two scratch blocks used in turn, so the
/// caller's input is never written; the last step reduces into the output.
pub fn reduce_scatter(
    rank: usize,
    n: usize,
    count: usize,
    piece: usize,
    finalize: bool,
) -> Schedule {
    let mut b = Builder::new();
    let inp = |i: usize| Region::new(BufId::Input, i * count, count);
    let out = Region::new(BufId::Output, 0, count);
    if n == 1 {
        b.push(Action::Copy {
            src: inp(0),
            dst: out,
        });
    } else {
        b.scratch(2 * count);
        let slot = |s: usize| Region::new(BufId::Scratch, (s % 2) * count, count);
        let (to, from) = (right(rank, n), left(rank, n));
        // At step s send the partial of block rank-s-1, receive block rank-s-2.
        for s in 0..n - 1 {
            let send = if s == 0 {
                inp(block(rank, 1, n))
            } else {
                slot(s - 1)
            };
            let recv_blk = block(rank, s + 2, n);
            let dst = if s == n - 2 { out } else { slot(s) };
            let recvs = pieces(dst, piece)
                .into_iter()
                .zip(pieces(inp(recv_blk), piece))
                .map(|(dst, local)| Action::RecvReduce {
                    peer: from,
                    dst,
                    local: Some(local),
                })
                .collect();
            step(&mut b, to, from, pieces(send, piece), recvs);
        }
    }
    if finalize {
        for p in pieces(out, piece) {
            b.push(Action::Finalize { dst: p });
        }
    }
    b.finish()
}
