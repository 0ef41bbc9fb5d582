//! Collectives on [`ccl::SharedBuffer`]s, which the other local ranks map
//! and copy (or reduce) with their own loads and stores: every collective
//! but the barrier, in place and out of place, and send/recv, at block sizes from the
//! smallest direct copy to streamed outputs; with only some ranks' buffers
//! shared; and on buffers
//! freed and allocated again in between (the same addresses, and
//! descriptors, holding other data), which must never be read through a
//! stale mapping.

use ccl::{Communicator, ReduceOp, SharedBuffer};

use crate::checks::Checker;

/// A buffer of `len` u32: shared, or a vector.
enum Buf {
    Shared(SharedBuffer),
    Vec(Vec<u32>),
}

impl Buf {
    fn new(len: usize, shared: bool) -> Buf {
        match shared {
            true => Buf::Shared(SharedBuffer::new(len * 4).expect("a shared buffer")),
            false => Buf::Vec(vec![0; len]),
        }
    }

    fn get(&mut self) -> &mut [u32] {
        match self {
            Buf::Shared(b) => b.as_mut_slice(),
            Buf::Vec(v) => v,
        }
    }
}

/// Element `i` of rank `r`'s input, in pass `salt`.
fn value(salt: u32, r: usize, i: usize) -> u32 {
    salt << 28 | (r as u32) << 24 | (i as u32 & 0xff_ffff)
}

/// Element `i` of the sum of every rank's input, in pass `salt`.
fn summed(salt: u32, n: usize, i: usize) -> u32 {
    (0..n).fold(0u32, |s, r| s.wrapping_add(value(salt, r, i)))
}

/// Runs every collective on shared buffers, in the passes above.
pub(crate) fn shared(comm: &Communicator, ck: &mut Checker) {
    let (n, me) = (comm.world_size(), comm.rank());
    // 16 KiB blocks (the smallest direct copy), odd ones of 1.2 MB, and
    // 16 MiB ones (a 2-rank allgather of them is streamed).
    for (salt, block) in [(1, 4096), (2, 300_007), (3, 4 << 20)] {
        for inplace in [false, true] {
            calls(comm, ck, salt, block, inplace, |_| true);
        }
    }
    // Rank 0's buffers are its own memory, the others' shared.
    calls(comm, ck, 4, 4 << 20, false, |r| r != 0);
    // Freed and allocated again: another region, maybe at the same address.
    for salt in [5, 6, 7] {
        calls(comm, ck, salt, 300_007, false, |_| true);
    }
    println!("rank {me} of {n}: shared buffers checked");
}

/// Every collective once on blocks of `block` u32, the buffers of rank `r`
/// shared where `shared(r)`.
fn calls(
    comm: &Communicator,
    ck: &mut Checker,
    salt: u32,
    block: usize,
    inplace: bool,
    shared: impl Fn(usize) -> bool,
) {
    let (n, me) = (comm.world_size(), comm.rank());
    let mine = shared(me);
    let what =
        |coll: &str| format!("{coll} of {block} u32 blocks, in place {inplace}, salt {salt}");
    let root = (salt as usize) % n;
    // allgather: block r of the output from rank r.
    let mut out = Buf::new(n * block, mine);
    let gathered = |i: usize| value(salt, i / block, i % block);
    let r = if inplace {
        let o = out.get();
        for i in 0..block {
            o[me * block + i] = value(salt, me, i);
        }
        comm.allgather(o)
    } else {
        let mut input = Buf::new(block, mine);
        let inp = input.get();
        for (i, x) in inp.iter_mut().enumerate() {
            *x = value(salt, me, i);
        }
        comm.allgather_into(inp, out.get())
    };
    if ck.ok(&what("allgather"), r).is_some() {
        ck.vec(&what("allgather"), out.get(), gathered, n * block);
    }
    // all-to-all: rank r's block p goes to rank p's block r; element i of
    // rank r's input is value(r, i), so block r of this rank's output is
    // value(r, me·block + i).
    let mut input = Buf::new(n * block, mine);
    for (i, x) in input.get().iter_mut().enumerate() {
        *x = value(salt, me, i);
    }
    let mut out = Buf::new(n * block, mine);
    let r = match inplace {
        true => comm.alltoall(input.get()),
        false => comm.alltoall_into(input.get(), out.get()),
    };
    let result = match inplace {
        true => input.get(),
        false => out.get(),
    };
    if ck.ok(&what("alltoall"), r).is_some() {
        let want = |i: usize| value(salt, i / block, me * block + i % block);
        ck.vec(&what("alltoall"), result, want, n * block);
    }
    // broadcast from `root`.
    let mut buf = Buf::new(block, mine);
    let mut out = Buf::new(block, mine);
    if me == root {
        for (i, x) in buf.get().iter_mut().enumerate() {
            *x = value(salt, root, i);
        }
    }
    let r = match inplace {
        true => comm.broadcast(buf.get(), root),
        false => comm.broadcast_into(buf.get(), out.get(), root),
    };
    let result = match inplace {
        true => buf.get(),
        false => out.get(),
    };
    if ck.ok(&what("broadcast"), r).is_some() {
        ck.vec(&what("broadcast"), result, |i| value(salt, root, i), block);
    }
    // gather to `root`: block r from rank r.
    let mut input = Buf::new(block, mine);
    for (i, x) in input.get().iter_mut().enumerate() {
        *x = value(salt, me, i);
    }
    let mut out = Buf::new(n * block, mine);
    let r = if inplace && me == root {
        let o = out.get();
        o[me * block..(me + 1) * block].copy_from_slice(input.get());
        comm.gather(o, root)
    } else if inplace {
        comm.gather(input.get(), root)
    } else {
        comm.gather_into(input.get(), out.get(), root)
    };
    if ck.ok(&what("gather"), r).is_some() && me == root {
        ck.vec(&what("gather"), out.get(), gathered, n * block);
    }
    // allreduce (sum, wrapping) of one block.
    let mut input = Buf::new(block, mine);
    for (i, x) in input.get().iter_mut().enumerate() {
        *x = value(salt, me, i);
    }
    let mut out = Buf::new(block, mine);
    let r = match inplace {
        true => comm.allreduce(input.get(), ReduceOp::Sum),
        false => comm.allreduce_into(input.get(), out.get(), ReduceOp::Sum),
    };
    let result = match inplace {
        true => input.get(),
        false => out.get(),
    };
    if ck.ok(&what("allreduce"), r).is_some() {
        ck.vec(&what("allreduce"), result, |i| summed(salt, n, i), block);
    }
    // reduce-scatter: block r of the sum to rank r (in place, at block r).
    let mut input = Buf::new(n * block, mine);
    for (i, x) in input.get().iter_mut().enumerate() {
        *x = value(salt, me, i);
    }
    let mut out = Buf::new(block, mine);
    let r = match inplace {
        true => comm.reduce_scatter(input.get(), ReduceOp::Sum),
        false => comm.reduce_scatter_into(input.get(), out.get(), ReduceOp::Sum),
    };
    let result = match inplace {
        true => &mut input.get()[me * block..(me + 1) * block],
        false => out.get(),
    };
    if ck.ok(&what("reduce_scatter"), r).is_some() {
        let want = |i: usize| summed(salt, n, me * block + i);
        ck.vec(&what("reduce_scatter"), result, want, block);
    }
    // reduce to `root`.
    let mut input = Buf::new(block, mine);
    for (i, x) in input.get().iter_mut().enumerate() {
        *x = value(salt, me, i);
    }
    let mut out = Buf::new(block, mine);
    let r = match inplace {
        true => comm.reduce(input.get(), ReduceOp::Sum, root),
        false => comm.reduce_into(input.get(), out.get(), ReduceOp::Sum, root),
    };
    let result = match inplace {
        true => input.get(),
        false => out.get(),
    };
    if ck.ok(&what("reduce"), r).is_some() && me == root {
        ck.vec(&what("reduce"), result, |i| summed(salt, n, i), block);
    }
    // A shift around the ring (send and receive at once).
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let mut input = Buf::new(block, mine);
    for (i, x) in input.get().iter_mut().enumerate() {
        *x = value(salt, me, i);
    }
    let mut out = Buf::new(block, mine);
    let r = comm.sendrecv(input.get(), next, out.get(), prev);
    if ck.ok(&what("send/recv"), r).is_some() {
        ck.vec(
            &what("send/recv"),
            out.get(),
            |i| value(salt, prev, i),
            block,
        );
    }
    // scatter from `root`: block r of its input to rank r.
    let mut input = Buf::new(n * block, mine);
    if me == root {
        for (i, x) in input.get().iter_mut().enumerate() {
            *x = value(salt, root, i);
        }
    }
    let mut out = Buf::new(block, mine);
    let r = match (inplace, me == root) {
        (true, true) => comm.scatter(input.get(), root),
        (true, false) => comm.scatter(out.get(), root),
        (false, _) => comm.scatter_into(input.get(), out.get(), root),
    };
    let result = match (inplace, me == root) {
        (true, true) => &mut input.get()[me * block..(me + 1) * block],
        _ => out.get(),
    };
    if ck.ok(&what("scatter"), r).is_some() {
        let want = |i: usize| value(salt, root, me * block + i);
        ck.vec(&what("scatter"), result, want, block);
    }
}
