//! Algorithms where ranks talk to their peers directly: one-shot allreduce,
//! pairwise all-to-all, linear gather and scatter, and the dissemination barrier.

use crate::schedule::{pieces, split_even, Action, BufId, Builder, Layout, Region, Schedule};

/// Direct allreduce: rank r owns block r of the buffer. It receives block r
/// from every peer and reduces it (peers in the order r+1, r+2, ..., so each
/// block is reduced by one rank, in one order, and every rank gets the same
/// bits), then sends the reduced block to every peer and receives theirs.
/// Two steps instead of the ring's 2(n−1), moving the same bytes; over shared
/// memory each receive reads the peer's buffer in place (cross-memory attach).
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
    let peers: Vec<usize> = (1..n).map(|s| (rank + s) % n).collect();
    let sent: Vec<Vec<Region>> = (0..n)
        .map(|p| pieces(inp(blocks[p].clone()), piece))
        .collect();
    let mine = pieces(out(blocks[rank].clone()), piece);
    let most = sent.iter().map(Vec::len).max().unwrap_or(0);
    // Reduce-scatter: every peer's part of block `rank`, reduced into the output.
    for k in 0..most {
        for &p in &peers {
            if let Some(&src) = sent[p].get(k) {
                b.push(Action::Send { peer: p, src });
            }
        }
        if let Some(&dst) = mine.get(k) {
            for (i, &q) in peers.iter().enumerate() {
                let local = (i == 0).then(|| Region::new(BufId::Input, dst.offset, dst.len));
                b.push(Action::RecvReduce {
                    peer: q,
                    dst,
                    local,
                });
            }
            if finalize {
                b.push(Action::Finalize { dst });
            }
        }
    }
    // Allgather: the reduced block to every peer, theirs from every peer.
    let theirs: Vec<Vec<Region>> = (0..n)
        .map(|p| pieces(out(blocks[p].clone()), piece))
        .collect();
    let most = theirs.iter().map(Vec::len).max().unwrap_or(0);
    for k in 0..most {
        for &p in &peers {
            if let Some(&src) = mine.get(k) {
                b.push(Action::Send { peer: p, src });
            }
            if let Some(&dst) = theirs[p].get(k) {
                b.push(Action::Recv { peer: p, dst });
            }
        }
    }
    b.finish()
}

/// All-to-all: block p of the input goes to rank p; block p of the output comes from rank p.
///
/// At step s rank r sends to r+s and receives from r-s, so every pair talks at
/// once without contention. A receive never waits for a send, which matters
/// on links where a send completes only once the peer has taken the data
/// (TCP past its socket buffers, shared memory by reference, RDMA): out of
/// place blocks arrive straight in the output; in place they arrive in
/// scratch memory and are copied to the output once the block they
/// overwrite has been sent.
///
/// With `in_steps` false every step runs at once; with it true a step starts
/// once the step before it has sent and received its block (OpenMPI's
/// pairwise), which keeps fewer transfers in flight.
pub fn alltoall(rank: usize, n: usize, count: usize, layout: Layout, in_steps: bool) -> Schedule {
    let mut b = Builder::for_layout(layout);
    let inp = |i: usize| Region::new(BufId::Input, i * count, count);
    let out = |i: usize| Region::new(BufId::Output, i * count, count);
    let tmp = |i: usize| Region::new(BufId::Scratch, i * count, count);
    let land = |i: usize| match layout {
        Layout::OutOfPlace => out(i),
        Layout::InPlace => tmp(i),
    };
    b.push(Action::Copy {
        src: inp(rank),
        dst: out(rank),
    });
    let mut step_before: Vec<u32> = Vec::new();
    for s in 1..n {
        let (to, from) = ((rank + s) % n, (rank + n - s) % n);
        let send = b.push_after(
            Action::Send {
                peer: to,
                src: inp(to),
            },
            &step_before,
        );
        let recv = b.push_after(
            Action::Recv {
                peer: from,
                dst: land(from),
            },
            &step_before,
        );
        if in_steps {
            step_before = vec![send, recv];
        }
    }
    if layout == Layout::OutOfPlace {
        return b.finish();
    }
    b.scratch(n * count);
    for s in 1..n {
        let from = (rank + n - s) % n;
        b.push(Action::Copy {
            src: tmp(from),
            dst: out(from),
        });
    }
    b.finish()
}

/// Gather: every rank's `count` elements land in block `rank` of the root's output.
pub fn gather(rank: usize, n: usize, root: usize, count: usize) -> Schedule {
    let mut b = Builder::new();
    let input = Region::new(BufId::Input, 0, count);
    if rank == root {
        b.push(Action::Copy {
            src: input,
            dst: Region::new(BufId::Output, root * count, count),
        });
        for p in (0..n).filter(|&p| p != root) {
            b.push(Action::Recv {
                peer: p,
                dst: Region::new(BufId::Output, p * count, count),
            });
        }
    } else {
        b.push(Action::Send {
            peer: root,
            src: input,
        });
    }
    b.finish()
}

/// Scatter: block p of the root's input goes to rank p's output.
pub fn scatter(rank: usize, n: usize, root: usize, count: usize) -> Schedule {
    let mut b = Builder::new();
    let output = Region::new(BufId::Output, 0, count);
    if rank == root {
        for p in (0..n).filter(|&p| p != root) {
            b.push(Action::Send {
                peer: p,
                src: Region::new(BufId::Input, p * count, count),
            });
        }
        b.push(Action::Copy {
            src: Region::new(BufId::Input, root * count, count),
            dst: output,
        });
    } else {
        b.push(Action::Recv {
            peer: root,
            dst: output,
        });
    }
    b.finish()
}

/// Dissemination barrier: in round k rank r signals r+2^k and waits for r-2^k;
/// after ⌈log2 n⌉ rounds every rank has heard, transitively, from every other.
pub fn barrier(rank: usize, n: usize) -> Schedule {
    let mut b = Builder::new();
    let empty = Region::new(BufId::Scratch, 0, 0);
    let mut prev: Option<u32> = None;
    let mut dist = 1;
    while dist < n {
        let after: Vec<u32> = prev.into_iter().collect();
        b.push_after(
            Action::Send {
                peer: (rank + dist) % n,
                src: empty,
            },
            &after,
        );
        prev = Some(b.push_after(
            Action::Recv {
                peer: (rank + n - dist) % n,
                dst: empty,
            },
            &after,
        ));
        dist *= 2;
    }
    b.finish()
}

/// A point-to-point transfer of `count` elements: the input to `peer`
/// (`send`), or from `peer` into the output.
pub fn transfer(peer: usize, count: usize, send: bool) -> Schedule {
    let mut b = Builder::new();
    b.push(if send {
        Action::Send {
            peer,
            src: Region::new(BufId::Input, 0, count),
        }
    } else {
        Action::Recv {
            peer,
            dst: Region::new(BufId::Output, 0, count),
        }
    });
    b.finish()
}
