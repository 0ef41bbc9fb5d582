//! Every schedule, run over in-memory links, and every group algorithm, run
//! on group memory in the heap, for every world size 1..=16, checked
//! against results computed directly.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

pub(crate) mod mem_group;
mod on_group;

use std::{sync::Arc, time::Duration};

use ccl_core::{
    AlignedBuf, Call, Collective, CollectiveKind, DataType, Error, Link, ReduceOp, Result,
    HOST_KERNELS,
};
use futures::future::join_all;

use crate::{execute, group, Algorithm, IoBuffers, Layout};
use ccl_core::loopback::mesh;

/// Distinct value that rank r contributes at index i.
fn val(r: usize, i: usize) -> u64 {
    (r as u64 + 1) * 1_000_003 + i as u64 * 7
}

/// Runs one collective on every rank; returns each rank's output.
fn run(
    algorithm: Algorithm,
    kind: CollectiveKind,
    n: usize,
    count: usize,
    root: usize,
    op: ReduceOp,
    piece: usize,
    layout: Layout,
    dtype: DataType,
    inputs: &[Vec<u8>],
) -> Vec<Vec<u8>> {
    run_on(
        &mesh(n, false),
        algorithm,
        kind,
        n,
        count,
        root,
        op,
        piece,
        layout,
        dtype,
        inputs,
        &(0..n).collect::<Vec<_>>(),
    )
}

/// Bytes per slot of the in-memory group memory: small, so that the
/// group algorithms go through many chunks.
const GROUP_SLOT_BYTES: usize = 256;

/// One rank's memory for a run: input and output at their offsets of one
/// aligned buffer (the same memory in place).
struct RankMemory {
    mem: AlignedBuf,
    input: (usize, usize),
    output: (usize, usize),
}

impl RankMemory {
    /// Lays out `input` (and room for the output) as `layout` says.
    fn new(coll: &Collective, rank: usize, n: usize, layout: Layout, input: &[u8]) -> RankMemory {
        let esz = coll.dtype.size();
        let (in_elems, out_elems) = coll.buffer_elems(rank, n);
        assert_eq!(input.len(), in_elems * esz, "{} input length", coll.kind);
        let total = in_elems.max(out_elems) * esz;
        // A rank with no input or no output has nothing to share.
        let layout = if in_elems == 0 || out_elems == 0 {
            Layout::OutOfPlace
        } else {
            layout
        };
        let (in_off, out_off) = match (layout, coll.kind) {
            (Layout::OutOfPlace, _) => (total, 0),
            // the output is block `rank` of the input
            (Layout::InPlace, CollectiveKind::ReduceScatter | CollectiveKind::Scatter) => {
                (0, rank * coll.count * esz)
            }
            // the input is block `rank` of the output
            (Layout::InPlace, CollectiveKind::AllGather | CollectiveKind::Gather) => {
                (rank * coll.count * esz, 0)
            }
            (Layout::InPlace, _) => (0, 0),
        };
        let mut mem = AlignedBuf::zeroed(total + in_elems * esz);
        mem.as_mut_slice()[in_off..in_off + input.len()].copy_from_slice(input);
        RankMemory {
            mem,
            input: (in_off, input.len()),
            output: (out_off, out_elems * esz),
        }
    }

    fn io(&mut self) -> IoBuffers<'_> {
        let base = self.mem.as_mut_slice().as_mut_ptr();
        // SAFETY: both regions lie inside `mem`, borrowed for the returned
        // lifetime, overlapping only as IoBuffers allows.
        unsafe {
            IoBuffers::from_raw(
                base.add(self.input.0),
                self.input.1,
                base.add(self.output.0),
                self.output.1,
                &HOST_KERNELS,
            )
        }
    }

    fn output(&self) -> Vec<u8> {
        let (at, len) = self.output;
        self.mem.as_slice()[at..at + len].to_vec()
    }
}

/// Runs one collective on every rank, as a schedule over `links` or, for a
/// group algorithm, on group memory in the heap with ranks as threads
/// (through posts alone, with direct reads, with every buffer shared, and
/// writing every output with streaming stores, which must all agree);
/// returns each rank's output. Schedules are built for the ranks listed by
/// locality in `order` ([`Algorithm::schedule_in_order`]). A run that has
/// not finished within a minute is a hang, and panics.
fn run_on(
    links: &[Vec<Option<Arc<dyn Link>>>],
    algorithm: Algorithm,
    kind: CollectiveKind,
    n: usize,
    count: usize,
    root: usize,
    op: ReduceOp,
    piece: usize,
    layout: Layout,
    dtype: DataType,
    inputs: &[Vec<u8>],
    order: &[usize],
) -> Vec<Vec<u8>> {
    let coll = Collective::new(kind, dtype, count)
        .with_op(op)
        .with_root(root);
    let call = |rank: usize| Call {
        comm: 7,
        seq: 1,
        rank,
        world_size: n,
        coll,
    };
    let what = format!("{kind} {algorithm} n={n} count={count} root={root}");
    let limit = Duration::from_secs(60);
    let on_group = |direct_min: Option<usize>, kernel: bool, stream_min: usize, mapped: bool| {
        let mut memory: Vec<RankMemory> = (0..n)
            .map(|r| RankMemory::new(&coll, r, n, layout, &inputs[r]))
            .collect();
        let members = mem_group::group(n, GROUP_SLOT_BYTES, direct_min, kernel, stream_min, mapped);
        let results = run_members(algorithm, &members, &mut memory, &call, limit);
        outputs(&what, results, &memory)
    };
    if algorithm.on_group_memory() {
        let posted = on_group(None, false, usize::MAX, false);
        // (direct reads from, the kernel's copies pay, shared buffers)
        let ways = [
            (Some(1), true, false),
            (Some(1), true, true),
            (Some(1), false, false),
            (Some(1), false, true),
        ];
        for (direct_min, kernel, mapped) in ways {
            let got = on_group(direct_min, kernel, usize::MAX, mapped);
            assert!(
                posted == got,
                "{what}: direct reads changed the results (the kernel's copies pay: {kernel}, shared buffers {mapped})"
            );
        }
        // (The ways where the kernel's copies do not pay read shared buffers
        // as those where they do, and own buffers through posts.)
        for (direct_min, kernel, mapped) in [(None, false, false)]
            .into_iter()
            .chain(ways[..2].iter().copied())
        {
            let streamed = on_group(direct_min, kernel, 1, mapped);
            assert!(
                posted == streamed,
                "{what}: streaming stores changed the results (direct reads {direct_min:?}, the kernel's copies pay: {kernel}, shared buffers {mapped})"
            );
        }
        return posted;
    }
    let mut memory: Vec<RankMemory> = (0..n)
        .map(|r| RankMemory::new(&coll, r, n, layout, &inputs[r]))
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let all = join_all(memory.iter_mut().enumerate().map(|(rank, mem)| {
        let links = &links[rank];
        async move {
            let io = mem.io();
            let schedule = algorithm
                .schedule_in_order(&coll, rank, n, piece, io.layout(), order)
                .unwrap();
            execute(&schedule, io, links, &call(rank), &mut None, None).await
        }
    }));
    let results = rt
        .block_on(async { tokio::time::timeout(limit, all).await })
        .unwrap_or_else(|_| panic!("{what} hangs"));
    outputs(&what, results, &memory)
}

/// Runs `call(rank)` with the group algorithm `algorithm` on every rank's
/// handle of `members`, on the rank's `memory`, as threads, within `limit`;
/// each rank's result.
fn run_members(
    algorithm: Algorithm,
    members: &[mem_group::MemGroup],
    memory: &mut [RankMemory],
    call: &(dyn Fn(usize) -> Call + Sync),
    limit: Duration,
) -> Vec<Result<()>> {
    std::thread::scope(|s| {
        let running: Vec<_> = members
            .iter()
            .zip(memory.iter_mut())
            .enumerate()
            .map(|(rank, (member, mem))| {
                s.spawn(move || group::run(algorithm, member, &call(rank), &mem.io(), limit))
            })
            .collect();
        running.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// Each rank's output, once every rank succeeded (else a panic naming the
/// run and the rank; a timeout is a hang).
fn outputs(what: &str, results: Vec<Result<()>>, memory: &[RankMemory]) -> Vec<Vec<u8>> {
    results
        .into_iter()
        .zip(memory)
        .enumerate()
        .map(|(r, (x, mem))| match x {
            Ok(()) => mem.output(),
            Err(Error::Timeout { .. }) => panic!("{what} hangs"),
            Err(e) => panic!("{what} rank {r}: {e}"),
        })
        .collect()
}

fn u64s(b: &[u8]) -> Vec<u64> {
    bytemuck::pod_collect_to_vec(b)
}

fn bytes(v: &[u64]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

fn counts(n: usize) -> Vec<usize> {
    let mut c = vec![0, 1, n.saturating_sub(1), n, n + 1, 97, 2003];
    c.sort_unstable();
    c.dedup();
    c
}

fn piece_for(count: usize) -> usize {
    if count > 100 {
        64
    } else {
        3
    }
}

/// Every algorithm of `kind`: its schedules, and the group algorithms.
fn algorithms_for(kind: CollectiveKind) -> Vec<Algorithm> {
    Algorithm::ALL
        .into_iter()
        .filter(|a| a.implements(kind))
        .collect()
}

/// Orders of the ranks by locality to build schedules for: as numbered,
/// and for broadcast and reduce (whose binomial trees follow the order) also
/// the even ranks before the odd ones (ranks r on CPU r mod 2) and backwards.
fn orders_for(kind: CollectiveKind, n: usize) -> Vec<Vec<usize>> {
    let numbered: Vec<usize> = (0..n).collect();
    if !matches!(kind, CollectiveKind::Broadcast | CollectiveKind::Reduce) {
        return vec![numbered];
    }
    let by_parity = (0..n).step_by(2).chain((1..n).step_by(2)).collect();
    let backwards = (0..n).rev().collect();
    vec![numbered, by_parity, backwards]
}

/// Checks one collective with every algorithm for every world size, count,
/// root, layout and order of the ranks ([`orders_for`]) with u64 sum,
/// schedules over plain and rendezvous links.
fn check_kind(kind: CollectiveKind, expected: impl Fn(usize, usize, usize, usize) -> Vec<u64>) {
    for n in 1..=16 {
        for count in counts(n) {
            let roots: Vec<usize> = match kind {
                CollectiveKind::Broadcast
                | CollectiveKind::Reduce
                | CollectiveKind::Gather
                | CollectiveKind::Scatter => (0..n).collect(),
                _ => vec![0],
            };
            for &root in &roots {
                let coll = Collective::new(kind, DataType::U64, count).with_root(root);
                let inputs: Vec<Vec<u8>> = (0..n)
                    .map(|r| {
                        let len = coll.buffer_elems(r, n).0;
                        bytes(&(0..len).map(|i| val(r, i)).collect::<Vec<_>>())
                    })
                    .collect();
                // Schedules over plain and rendezvous links; group
                // algorithms on group memory (no links).
                let variants = algorithms_for(kind).into_iter().flat_map(|a| {
                    let links: &[bool] = if a.on_group_memory() {
                        &[false]
                    } else {
                        &[false, true]
                    };
                    [Layout::OutOfPlace, Layout::InPlace]
                        .into_iter()
                        .flat_map(move |l| links.iter().map(move |&r| (a, l, r)))
                });
                let orders = orders_for(kind, n);
                let variants = variants.flat_map(|v| orders.iter().map(move |o| (v, o)));
                for ((algorithm, layout, rendezvous), order) in variants {
                    let outs = run_on(
                        &mesh(n, rendezvous),
                        algorithm,
                        kind,
                        n,
                        count,
                        root,
                        ReduceOp::Sum,
                        piece_for(count),
                        layout,
                        DataType::U64,
                        &inputs,
                        order,
                    );
                    for (r, out) in outs.iter().enumerate() {
                        assert_eq!(
                            u64s(out),
                            expected(n, count, root, r),
                            "{kind} {algorithm} n={n} count={count} root={root} rank={r} {layout:?} rendezvous={rendezvous} order={order:?}"
                        );
                    }
                }
            }
        }
    }
}

fn sum_at(n: usize, i: usize) -> u64 {
    (0..n).map(|r| val(r, i)).fold(0u64, u64::wrapping_add)
}

#[test]
fn allreduce_all_sizes() {
    check_kind(CollectiveKind::AllReduce, |n, c, _, _| {
        (0..c).map(|i| sum_at(n, i)).collect()
    });
}

#[test]
fn broadcast_all_sizes_and_roots() {
    check_kind(CollectiveKind::Broadcast, |_, c, root, _| {
        (0..c).map(|i| val(root, i)).collect()
    });
}

#[test]
fn reduce_all_sizes_and_roots() {
    check_kind(CollectiveKind::Reduce, |n, c, root, r| {
        if r == root {
            (0..c).map(|i| sum_at(n, i)).collect()
        } else {
            vec![]
        }
    });
}

#[test]
fn allgather_all_sizes() {
    check_kind(CollectiveKind::AllGather, |n, c, _, _| {
        (0..n)
            .flat_map(|p| (0..c).map(move |i| val(p, i)))
            .collect()
    });
}

/// Copies of several pieces ([`COPY_PIECE`](crate::executor::COPY_PIECE)),
/// between which the other lanes run, and of a part piece at the end: the
/// own block of an allgather and an all-to-all, every algorithm, both
/// layouts, 2 and 3 ranks.
#[test]
fn copies_of_several_pieces_arrive_whole() {
    let count = 5 * crate::executor::COPY_PIECE / 2 / 8 + 3;
    for kind in [CollectiveKind::AllGather, CollectiveKind::AllToAll] {
        for n in [2, 3] {
            let coll = Collective::new(kind, DataType::U64, count);
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    let len = coll.buffer_elems(r, n).0;
                    bytes(&(0..len).map(|i| val(r, i)).collect::<Vec<_>>())
                })
                .collect();
            let algorithms = algorithms_for(kind)
                .into_iter()
                .filter(|a| !a.on_group_memory());
            for algorithm in algorithms {
                for layout in [Layout::OutOfPlace, Layout::InPlace] {
                    let outs = run(
                        algorithm,
                        kind,
                        n,
                        count,
                        0,
                        ReduceOp::Sum,
                        1 << 20,
                        layout,
                        DataType::U64,
                        &inputs,
                    );
                    for (r, out) in outs.iter().enumerate() {
                        let want: Vec<u64> = (0..n)
                            .flat_map(|p| {
                                let from = if kind == CollectiveKind::AllToAll {
                                    r * count
                                } else {
                                    0
                                };
                                (0..count).map(move |i| val(p, from + i))
                            })
                            .collect();
                        assert!(
                            u64s(out) == want,
                            "{kind} {algorithm} n={n} rank={r} {layout:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_all_sizes() {
    check_kind(CollectiveKind::ReduceScatter, |n, c, _, r| {
        (0..c).map(|i| sum_at(n, r * c + i)).collect()
    });
}

#[test]
fn alltoall_all_sizes() {
    check_kind(CollectiveKind::AllToAll, |n, c, _, r| {
        (0..n)
            .flat_map(|p| (0..c).map(move |i| val(p, r * c + i)))
            .collect()
    });
}

#[test]
fn gather_all_sizes_and_roots() {
    check_kind(CollectiveKind::Gather, |n, c, root, r| {
        if r == root {
            (0..n)
                .flat_map(|p| (0..c).map(move |i| val(p, i)))
                .collect()
        } else {
            vec![]
        }
    });
}

#[test]
fn scatter_all_sizes_and_roots() {
    check_kind(CollectiveKind::Scatter, |_, c, root, r| {
        (0..c).map(|i| val(root, r * c + i)).collect()
    });
}

#[test]
fn barrier_all_sizes() {
    for (n, algorithm) in (1..=16).flat_map(|n| {
        algorithms_for(CollectiveKind::Barrier)
            .into_iter()
            .map(move |a| (n, a))
    }) {
        let outs = run(
            algorithm,
            CollectiveKind::Barrier,
            n,
            0,
            0,
            ReduceOp::Sum,
            1,
            Layout::OutOfPlace,
            DataType::U8,
            &vec![vec![]; n],
        );
        assert!(outs.iter().all(Vec::is_empty));
    }
}

/// Every op through the reducing collectives, on i32 and f64.
#[test]
fn every_op_reduces_correctly() {
    for n in [1, 2, 3, 5, 8] {
        let count = 37;
        let ival = |r: usize, i: usize| ((r * 31 + i * 17) % 23) as i32 - 11;
        for op in ReduceOp::ALL
            .into_iter()
            .filter(|o| !matches!(o, ReduceOp::PreMulSum(_)))
        {
            let want: Vec<i32> = (0..count)
                .map(|i| {
                    let xs = (0..n).map(|r| ival(r, i));
                    match op {
                        ReduceOp::Sum => xs.sum(),
                        ReduceOp::Avg => xs.sum::<i32>() / n as i32,
                        ReduceOp::Prod => xs.fold(1i32, i32::wrapping_mul),
                        ReduceOp::Min => xs.min().unwrap(),
                        ReduceOp::Max => xs.max().unwrap(),
                        ReduceOp::BitAnd => xs.fold(-1, |a, b| a & b),
                        ReduceOp::BitOr => xs.fold(0, |a, b| a | b),
                        ReduceOp::BitXor => xs.fold(0, |a, b| a ^ b),
                        ReduceOp::PreMulSum(_) => unreachable!(),
                    }
                })
                .collect();
            let inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    bytemuck::cast_slice(&(0..count).map(|i| ival(r, i)).collect::<Vec<i32>>())
                        .to_vec()
                })
                .collect();
            let reducing = [CollectiveKind::AllReduce, CollectiveKind::Reduce]
                .into_iter()
                .flat_map(|k| algorithms_for(k).into_iter().map(move |a| (k, a)));
            for (kind, algorithm) in reducing {
                let outs = run(
                    algorithm,
                    kind,
                    n,
                    count,
                    n - 1,
                    op,
                    5,
                    Layout::OutOfPlace,
                    DataType::I32,
                    &inputs,
                );
                let got: Vec<i32> = bytemuck::pod_collect_to_vec(&outs[n - 1]);
                assert_eq!(got, want, "{kind} {algorithm} {op} n={n}");
            }
            let rs_inputs: Vec<Vec<u8>> = (0..n)
                .map(|r| {
                    bytemuck::cast_slice(
                        &(0..n * count)
                            .map(|i| ival(r, i % count))
                            .collect::<Vec<i32>>(),
                    )
                    .to_vec()
                })
                .collect();
            for algorithm in algorithms_for(CollectiveKind::ReduceScatter) {
                let outs = run(
                    algorithm,
                    CollectiveKind::ReduceScatter,
                    n,
                    count,
                    0,
                    op,
                    5,
                    Layout::OutOfPlace,
                    DataType::I32,
                    &rs_inputs,
                );
                for out in &outs {
                    assert_eq!(
                        bytemuck::pod_collect_to_vec::<u8, i32>(out),
                        want,
                        "reduce-scatter {algorithm} {op} n={n}"
                    );
                }
            }
        }
        let finputs: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                bytemuck::cast_slice(
                    &(0..count)
                        .map(|i| (r * i) as f64 + 0.5)
                        .collect::<Vec<f64>>(),
                )
                .to_vec()
            })
            .collect();
        for algorithm in algorithms_for(CollectiveKind::AllReduce) {
            let outs = run(
                algorithm,
                CollectiveKind::AllReduce,
                n,
                count,
                0,
                ReduceOp::Avg,
                4,
                Layout::InPlace,
                DataType::F64,
                &finputs,
            );
            for out in outs {
                let got: Vec<f64> = bytemuck::pod_collect_to_vec(&out);
                for (i, g) in got.iter().enumerate() {
                    let want = (0..n).map(|r| (r * i) as f64 + 0.5).sum::<f64>() / n as f64;
                    assert!(
                        (g - want).abs() < 1e-9,
                        "avg {algorithm} n={n} i={i}: {g} vs {want}"
                    );
                }
            }
        }
    }
}

/// Floating-point sums depend on the order of the operands; an allreduce must
/// still leave every rank with the same bytes.
#[test]
fn allreduce_results_are_bitwise_identical() {
    for n in 1..=16 {
        let count = 97;
        let x = |r: usize, i: usize| ((r * 7 + 1) as f32).sqrt() * 0.1 + (i as f32) / 3.0;
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|r| {
                bytemuck::cast_slice(&(0..count).map(|i| x(r, i)).collect::<Vec<f32>>()).to_vec()
            })
            .collect();
        for algorithm in algorithms_for(CollectiveKind::AllReduce) {
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let outs = run(
                    algorithm,
                    CollectiveKind::AllReduce,
                    n,
                    count,
                    0,
                    op,
                    4,
                    Layout::OutOfPlace,
                    DataType::F32,
                    &inputs,
                );
                let want: f32 = (0..n).map(|r| x(r, 5)).sum::<f32>()
                    / if op == ReduceOp::Avg { n as f32 } else { 1.0 };
                let got: Vec<f32> = bytemuck::pod_collect_to_vec(&outs[0]);
                assert!((got[5] - want).abs() < 1e-4, "{algorithm} {op} n={n}");
                for (r, out) in outs.iter().enumerate() {
                    assert_eq!(out, &outs[0], "{algorithm} {op} n={n} rank {r}");
                }
            }
        }
    }
}

/// The rendezvous harness catches what it is for: two ranks that each
/// receive into the memory they are sending wait for each other forever.
#[test]
fn rendezvous_links_expose_receives_that_wait_for_sends() {
    use crate::{Action, BufId, Builder, Region};
    let out = Region::new(BufId::Output, 0, 4);
    let hangs = |rendezvous: bool| {
        let links = mesh(2, rendezvous);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let all = join_all((0..2).map(|rank| {
            let links = &links[rank];
            async move {
                let mut b = Builder::new();
                b.push(Action::Send {
                    peer: 1 - rank,
                    src: out,
                });
                b.push(Action::Recv {
                    peer: 1 - rank,
                    dst: out,
                });
                let schedule = b.finish();
                let call = Call {
                    comm: 1,
                    seq: 1,
                    rank,
                    world_size: 2,
                    coll: Collective::new(CollectiveKind::AllReduce, DataType::U64, 4),
                };
                let mut buf = AlignedBuf::zeroed(32);
                let io = IoBuffers::host_in_place(buf.as_mut_slice());
                execute(&schedule, io, links, &call, &mut None, None).await
            }
        }));
        rt.block_on(async { tokio::time::timeout(Duration::from_millis(300), all).await })
            .is_err()
    };
    assert!(!hangs(false));
    assert!(hangs(true));
}

#[test]
fn mismatched_calls_are_reported() {
    let links = mesh(2, false);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let outs: Vec<Result<()>> = rt.block_on(join_all((0..2).map(|rank| {
        let links = &links[rank];
        async move {
            let count = 4 + rank;
            let coll = Collective::new(CollectiveKind::AllReduce, DataType::U64, count);
            let schedule = Algorithm::Ring
                .schedule(&coll, rank, 2, 64, Layout::OutOfPlace)
                .unwrap();
            let call = Call {
                comm: 1,
                seq: 3,
                rank,
                world_size: 2,
                coll,
            };
            let inp = AlignedBuf::zeroed(count * 8);
            let mut out = AlignedBuf::zeroed(count * 8);
            let io = IoBuffers::host(inp.as_slice(), out.as_mut_slice());
            execute(&schedule, io, links, &call, &mut None, None).await
        }
    })));
    for (rank, r) in outs.into_iter().enumerate() {
        match r {
            Err(Error::Mismatch {
                rank: me,
                peer,
                ours,
                theirs,
            }) => {
                assert_eq!((me, peer), (rank, 1 - rank));
                assert!(
                    ours.contains(&format!("u64×{}", 4 + rank))
                        && theirs.contains(&format!("u64×{}", 5 - rank)),
                    "{ours} / {theirs}"
                );
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

/// Rank 0's schedule (in place) and call of an allreduce of `count` u64
/// between 2 ranks.
fn rank0_of_two(algorithm: Algorithm, count: usize) -> (crate::Schedule, Call) {
    let coll = Collective::new(CollectiveKind::AllReduce, DataType::U64, count);
    let schedule = algorithm
        .schedule(&coll, 0, 2, 64, Layout::InPlace)
        .unwrap();
    let call = Call {
        comm: 1,
        seq: 1,
        rank: 0,
        world_size: 2,
        coll,
    };
    (schedule, call)
}

#[test]
fn bad_schedules_are_rejected_before_running() {
    let (schedule, call) = rank0_of_two(Algorithm::Ring, 8);
    let coll = call.coll;
    let mut small = vec![0u8; 8];
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let e = rt
        .block_on(execute(
            &schedule,
            IoBuffers::host_in_place(&mut small),
            &mesh(2, false)[0],
            &call,
            &mut None,
            None,
        ))
        .unwrap_err();
    assert!(matches!(e, Error::Internal(_)), "{e}");
    assert!(Algorithm::Ring
        .schedule(&coll.with_root(5), 0, 2, 64, Layout::InPlace)
        .is_err());
    assert!(Algorithm::BinomialTree
        .schedule(&coll, 0, 2, 64, Layout::InPlace)
        .is_err());
    assert!(Algorithm::Board
        .schedule(&coll, 0, 2, 64, Layout::InPlace)
        .is_err());
}

/// Repolls ([`ccl_core::Repoll`]) arm no timer, but the deadline still counts
/// from the call: a call first repolled past its deadline fails at its first
/// real poll, naming the rank it waited for.
#[test]
fn the_deadline_counts_from_the_call_through_repolls() {
    use std::{future::Future, task::Context, time::Instant};
    let (schedule, call) = rank0_of_two(Algorithm::RecursiveDoubling, 4);
    let links = mesh(2, false);
    let mut data = vec![0u8; 32];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let deadline = Duration::from_millis(100);
    let _entered = rt.enter();
    let mut scratch = None;
    let mut run = Box::pin(execute(
        &schedule,
        IoBuffers::host_in_place(&mut data),
        &links[0],
        &call,
        &mut scratch,
        Some(deadline),
    ));
    // Rank 1 never calls: every repoll finds nothing.
    let waker = ccl_core::Repoll::waker();
    let start = Instant::now();
    while start.elapsed() < deadline + Duration::from_millis(50) {
        assert!(run
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending());
        std::thread::sleep(Duration::from_millis(5));
    }
    let real = Instant::now();
    match rt.block_on(run) {
        Err(Error::Timeout { context, what, .. }) => {
            assert!(context.contains("rank 0"), "{context}");
            assert!(what.contains("rank(s) [1]"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        real.elapsed() < Duration::from_millis(50),
        "the timeout came {:?} after the first real poll",
        real.elapsed()
    );
}

/// A rank that forwards what it receives (the middle of a chain broadcast,
/// in pieces) finishes in one poll once its data is there: after the
/// receive of a piece, the lane that sends it is polled again in the same
/// poll, with no waking of the task in between.
#[test]
fn a_forwarding_rank_finishes_in_one_poll_once_its_data_is_there() {
    use std::{future::Future, task::Context};
    let n = 3;
    let coll = Collective::new(CollectiveKind::Broadcast, DataType::U8, 64).with_root(0);
    let links = mesh(n, false);
    let schedule = |rank| {
        Algorithm::Chain
            .schedule(&coll, rank, n, 16, Layout::InPlace)
            .unwrap()
    };
    let call = |rank| Call {
        comm: 1,
        seq: 1,
        rank,
        world_size: n,
        coll,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let sent: Vec<u8> = (0..64).collect();
    let mut root = sent.clone();
    let run = |rank: usize, data: &mut [u8]| {
        rt.block_on(execute(
            &schedule(rank),
            IoBuffers::host_in_place(data),
            &links[rank],
            &call(rank),
            &mut None,
            None,
        ))
    };
    // The loopback links hold the root's pieces until rank 1 takes them.
    run(0, &mut root).unwrap();
    let mut middle = vec![0u8; 64];
    let (middle_schedule, middle_call, mut scratch) = (schedule(1), call(1), None);
    let one_poll = {
        let mut forward = Box::pin(execute(
            &middle_schedule,
            IoBuffers::host_in_place(&mut middle),
            &links[1],
            &middle_call,
            &mut scratch,
            None,
        ));
        let waker = futures::task::noop_waker();
        forward.as_mut().poll(&mut Context::from_waker(&waker))
    };
    match one_poll {
        std::task::Poll::Ready(r) => r.unwrap(),
        std::task::Poll::Pending => panic!("rank 1 still waits after one poll with its data there"),
    }
    assert_eq!(middle, sent);
    let mut last = vec![0u8; 64];
    run(2, &mut last).unwrap();
    assert_eq!(last, sent);
}

/// A 2-rank broadcast runs one lane on each rank where the root's copy of
/// its input onto its output does nothing (in place); out of place the root
/// still copies while it sends. A rank whose one lane waits for data that
/// never comes fails at the deadline, naming the rank it waited for.
#[test]
fn one_lane_calls_copy_where_needed_and_time_out_naming_the_peer() {
    let coll = Collective::new(CollectiveKind::Broadcast, DataType::U8, 64).with_root(0);
    let schedule = |rank| {
        Algorithm::Chain
            .schedule(&coll, rank, 2, 16, Layout::InPlace)
            .unwrap()
    };
    let call = |rank| Call {
        comm: 1,
        seq: 1,
        rank,
        world_size: 2,
        coll,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let (root, other) = (schedule(0), schedule(1));
    assert_eq!(root.lanes.len(), 2, "the root's copy and its sends");
    let sent: Vec<u8> = (0..64).collect();
    for in_place in [true, false] {
        let links = mesh(2, false);
        let mut input = sent.clone();
        let mut output = vec![0u8; 64];
        let io = match in_place {
            true => IoBuffers::host_in_place(&mut input),
            false => IoBuffers::host(&input, &mut output),
        };
        rt.block_on(execute(&root, io, &links[0], &call(0), &mut None, None))
            .unwrap();
        if !in_place {
            assert_eq!(output, sent, "the root's output out of place");
        }
        let mut got = vec![0u8; 64];
        let io = IoBuffers::host_in_place(&mut got);
        rt.block_on(execute(&other, io, &links[1], &call(1), &mut None, None))
            .unwrap();
        assert_eq!(got, sent, "in place: {in_place}");
    }
    let links = mesh(2, false);
    let mut got = vec![0u8; 64];
    let deadline = Some(Duration::from_millis(100));
    let io = IoBuffers::host_in_place(&mut got);
    match rt.block_on(execute(
        &other,
        io,
        &links[1],
        &call(1),
        &mut None,
        deadline,
    )) {
        Err(Error::Timeout { context, what, .. }) => {
            assert!(context.contains("rank 1"), "{context}");
            assert!(what.contains("rank(s) [0]"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
}
