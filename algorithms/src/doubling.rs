//! Recursive doubling allreduce: ⌈log2 n⌉ rounds of whole-buffer exchange, for
//! small messages where latency, not bandwidth, decides.
//!
//! In round k rank v exchanges its partial result with v ^ 2^k and both
//! reduce. Every rank combines the same operands in the same tree, and the ops
//! are commutative, so every rank ends with bitwise the same result. When n is
//! not a power of two, the standard fold applies: of the first 2·rem ranks
//! (rem = n − 2^⌊log2 n⌋) each even rank hands its input to the odd rank after
//! it, sits out the rounds, and gets the result back at the end.

use crate::schedule::{pieces, Action, BufId, Builder, Region, Schedule};

/// Recursive-doubling allreduce of `count` elements.
pub fn allreduce(rank: usize, n: usize, count: usize, piece: usize, finalize: bool) -> Schedule {
    let mut b = Builder::new();
    let input = Region::new(BufId::Input, 0, count);
    let output = Region::new(BufId::Output, 0, count);
    let p = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let rem = n - p;
    let each = |b: &mut Builder, r: Region, f: &mut dyn FnMut(&mut Builder, Region, usize)| {
        for (i, pc) in pieces(r, piece).into_iter().enumerate() {
            f(b, pc, i * piece);
        }
    };
    // Fold: even ranks below 2·rem give their input away and wait for the result.
    if rank < 2 * rem && rank % 2 == 0 {
        each(&mut b, input, &mut |b, pc, _| {
            b.push(Action::Send {
                peer: rank + 1,
                src: pc,
            });
        });
        each(&mut b, output, &mut |b, pc, _| {
            b.push(Action::Recv {
                peer: rank + 1,
                dst: pc,
            });
        });
        return b.finish();
    }
    if rank < 2 * rem {
        each(&mut b, output, &mut |b, pc, off| {
            let local = Region::new(BufId::Input, off, pc.len);
            b.push(Action::RecvReduce {
                peer: rank - 1,
                dst: pc,
                local: Some(local),
            });
        });
    } else {
        b.push(Action::Copy {
            src: input,
            dst: output,
        });
    }
    let v = if rank < 2 * rem { rank / 2 } else { rank - rem };
    let real = |w: usize| if w < rem { 2 * w + 1 } else { w + rem };
    // Partial results alternate between the output and scratch, so that a
    // round's send and receive never touch the same memory.
    b.scratch(count);
    let scratch = Region::new(BufId::Scratch, 0, count);
    let mut cur = output;
    let mut mask = 1;
    while mask < p {
        let peer = real(v ^ mask);
        let next = if cur.buf == BufId::Output {
            scratch
        } else {
            output
        };
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
    if cur.buf == BufId::Scratch {
        b.push(Action::Copy {
            src: scratch,
            dst: output,
        });
    }
    if finalize {
        each(&mut b, output, &mut |b, pc, _| {
            b.push(Action::Finalize { dst: pc });
        });
    }
    if rank < 2 * rem {
        each(&mut b, output, &mut |b, pc, _| {
            b.push(Action::Send {
                peer: rank - 1,
                src: pc,
            });
        });
    }
    b.finish()
}
