//! Every schedule, run over in-memory links for every world size 1..=16,
//! checked against results computed directly.

#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use std::{sync::Arc, time::Duration};

use ccl_core::{
    AbortNotice, AlignedBuf, CollectiveKind, DataType, Error, Fingerprint, FrameHeader, FrameKind,
    Link, LinkFuture, ReduceOp, Result,
};
use futures::future::join_all;
use tokio::sync::{mpsc, oneshot, Mutex};

use crate::{execute, Algorithm, Call, IoBuffers, Spec};

/// A frame, and on a rendezvous link the sender's wait for it to be taken.
type Frame = (FrameHeader, Vec<u8>, Option<oneshot::Sender<()>>);

/// A link through memory: one unbounded channel per direction.
struct MemLink {
    rank: usize,
    peer: usize,
    /// Sends complete only once the peer has received the frame, as on
    /// shared memory for large messages: a schedule whose receives wait, in a
    /// cycle, for sends on the same pairs hangs here.
    rendezvous: bool,
    tx: mpsc::UnboundedSender<Frame>,
    rx: Mutex<mpsc::UnboundedReceiver<Frame>>,
}

impl MemLink {
    fn lost(&self) -> Error {
        Error::PeerLost {
            rank: self.rank,
            peer: self.peer,
            call: String::new(),
            cause: "channel closed".into(),
        }
    }
}

impl Link for MemLink {
    fn rank(&self) -> usize {
        self.rank
    }
    fn peer(&self) -> usize {
        self.peer
    }
    fn send<'a>(&'a self, header: FrameHeader, data: &'a [u8]) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            assert_eq!(header.len as usize, data.len());
            let (taken_tx, taken) = if self.rendezvous {
                let (tx, rx) = oneshot::channel();
                (Some(tx), Some(rx))
            } else {
                (None, None)
            };
            self.tx
                .send((header, data.to_vec(), taken_tx))
                .map_err(|_| self.lost())?;
            if let Some(taken) = taken {
                taken.await.map_err(|_| self.lost())?;
            }
            Ok(())
        })
    }
    fn recv<'a>(&'a self, expect: FrameHeader, into: &'a mut [u8]) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let (h, data, taken) = self
                .rx
                .lock()
                .await
                .recv()
                .await
                .ok_or_else(|| self.lost())?;
            if h.kind == FrameKind::Abort {
                return Err(AbortNotice::decode(&data)
                    .unwrap()
                    .into_error(self.rank, self.peer));
            }
            expect.check_received(&h, self.rank, self.peer)?;
            into.copy_from_slice(&data);
            if let Some(taken) = taken {
                let _ = taken.send(());
            }
            Ok(())
        })
    }
    fn abort<'a>(&'a self, notice: &'a AbortNotice) -> LinkFuture<'a, ()> {
        Box::pin(async move {
            let _ = self.tx.send((notice.header(0), notice.encode(), None));
            Ok(())
        })
    }
}

fn mesh(n: usize, rendezvous: bool) -> Vec<Vec<Option<Arc<dyn Link>>>> {
    let mut links: Vec<Vec<Option<Arc<dyn Link>>>> =
        (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
    for a in 0..n {
        for b in a + 1..n {
            let (ab_tx, ab_rx) = mpsc::unbounded_channel();
            let (ba_tx, ba_rx) = mpsc::unbounded_channel();
            links[a][b] = Some(Arc::new(MemLink {
                rank: a,
                peer: b,
                rendezvous,
                tx: ab_tx,
                rx: Mutex::new(ba_rx),
            }));
            links[b][a] = Some(Arc::new(MemLink {
                rank: b,
                peer: a,
                rendezvous,
                tx: ba_tx,
                rx: Mutex::new(ab_rx),
            }));
        }
    }
    links
}

/// Distinct value that rank r contributes at index i.
fn val(r: usize, i: usize) -> u64 {
    (r as u64 + 1) * 1_000_003 + i as u64 * 7
}

/// How a rank lays out its buffers for a run.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Layout {
    OutOfPlace,
    /// The input is the same memory as (a part of) the output, or the output of the input,
    /// at the offset the collective defines for in-place calls.
    InPlace,
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
    )
}

/// Runs one collective on every rank over `links`; returns each rank's output.
/// A run that has not finished within a minute is a hang, and panics.
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
) -> Vec<Vec<u8>> {
    let esz = dtype.size();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let all = join_all((0..n).map(|rank| {
        let links = &links[rank];
        let input = inputs[rank].clone();
        async move {
            let spec = Spec {
                kind,
                rank,
                world_size: n,
                count,
                root,
                finalize: op == ReduceOp::Avg,
                piece_elems: piece,
            };
            let (in_elems, out_elems) = spec.buffer_elems();
            assert_eq!(input.len(), in_elems * esz, "{kind} input length");
            let schedule = spec.build(algorithm).unwrap();
            let fp = Fingerprint::new(kind, dtype, count)
                .with_op(op)
                .with_root(root);
            let call = Call {
                comm: 7,
                seq: 1,
                fingerprint: fp,
                rank,
                world_size: n,
                op,
            };
            let mut scratch = AlignedBuf::zeroed(0);
            // Keep memory aligned: copy into an AlignedBuf large enough for both layouts.
            let total = in_elems.max(out_elems) * esz;
            let mut mem = AlignedBuf::zeroed(total + in_elems * esz);
            let in_place_offset = match kind {
                CollectiveKind::AllGather | CollectiveKind::Gather => rank * count,
                _ => 0,
            };
            // A rank with no input or no output has nothing to share.
            let layout = if in_elems == 0 || out_elems == 0 {
                Layout::OutOfPlace
            } else {
                layout
            };
            match layout {
                Layout::OutOfPlace => {
                    let (out, inp) = mem.as_mut_slice().split_at_mut(total);
                    inp.copy_from_slice(&input);
                    let io = IoBuffers::separate(inp, &mut out[..out_elems * esz]);
                    execute(&schedule, io, links, &call, &mut scratch).await?;
                    Ok(out[..out_elems * esz].to_vec())
                }
                Layout::InPlace => {
                    let buf = &mut mem.as_mut_slice()[..total];
                    let (in_off, out_off) = match kind {
                        // the output is block `rank` of the input
                        CollectiveKind::ReduceScatter | CollectiveKind::Scatter => {
                            (0, rank * count * esz)
                        }
                        _ => (in_place_offset * esz, 0),
                    };
                    buf[in_off..in_off + input.len()].copy_from_slice(&input);
                    let base = buf.as_mut_ptr();
                    // SAFETY: both regions lie inside `buf`, which outlives the execution.
                    let io = unsafe {
                        IoBuffers::from_raw(
                            base.add(in_off),
                            input.len(),
                            base.add(out_off),
                            out_elems * esz,
                        )
                    };
                    execute(&schedule, io, links, &call, &mut scratch).await?;
                    Ok(buf[out_off..out_off + out_elems * esz].to_vec())
                }
            }
        }
    }));
    let results: Vec<Result<Vec<u8>>> = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(60), all).await })
        .unwrap_or_else(|_| panic!("{kind} {algorithm} n={n} count={count} root={root} hangs"));
    results
        .into_iter()
        .enumerate()
        .map(|(r, x)| {
            x.unwrap_or_else(|e| panic!("{kind} n={n} count={count} root={root} rank {r}: {e}"))
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

/// Checks one collective with every algorithm for every world size, count,
/// root and layout with u64 sum, over plain and rendezvous links.
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
                let inputs: Vec<Vec<u8>> = (0..n)
                    .map(|r| {
                        let spec = Spec {
                            kind,
                            rank: r,
                            world_size: n,
                            count,
                            root,
                            finalize: false,
                            piece_elems: 1,
                        };
                        let len = spec.buffer_elems().0;
                        bytes(&(0..len).map(|i| val(r, i)).collect::<Vec<_>>())
                    })
                    .collect();
                let variants = Algorithm::for_kind(kind).iter().flat_map(|&a| {
                    [Layout::OutOfPlace, Layout::InPlace]
                        .into_iter()
                        .flat_map(move |l| [(a, l, false), (a, l, true)])
                });
                for (algorithm, layout, rendezvous) in variants {
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
                    );
                    for (r, out) in outs.iter().enumerate() {
                        assert_eq!(
                            u64s(out),
                            expected(n, count, root, r),
                            "{kind} {algorithm} n={n} count={count} root={root} rank={r} {layout:?} rendezvous={rendezvous}"
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
    for n in 1..=16 {
        let outs = run(
            Algorithm::Dissemination,
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
                .flat_map(|k| Algorithm::for_kind(k).iter().map(move |&a| (k, a)));
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
            for &algorithm in Algorithm::for_kind(CollectiveKind::ReduceScatter) {
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
        for &algorithm in Algorithm::for_kind(CollectiveKind::AllReduce) {
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
        for &algorithm in Algorithm::for_kind(CollectiveKind::AllReduce) {
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
                    fingerprint: Fingerprint::new(CollectiveKind::AllReduce, DataType::U64, 4),
                    rank,
                    world_size: 2,
                    op: ReduceOp::Sum,
                };
                let mut buf = AlignedBuf::zeroed(32);
                let io = IoBuffers::in_place(buf.as_mut_slice());
                execute(&schedule, io, links, &call, &mut AlignedBuf::zeroed(0)).await
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
            let spec = Spec {
                kind: CollectiveKind::AllReduce,
                rank,
                world_size: 2,
                count,
                root: 0,
                finalize: false,
                piece_elems: 64,
            };
            let schedule = spec.build(Algorithm::Ring).unwrap();
            let fp = Fingerprint::new(CollectiveKind::AllReduce, DataType::U64, count)
                .with_op(ReduceOp::Sum);
            let call = Call {
                comm: 1,
                seq: 3,
                fingerprint: fp,
                rank,
                world_size: 2,
                op: ReduceOp::Sum,
            };
            let mut inp = AlignedBuf::zeroed(count * 8);
            let mut out = AlignedBuf::zeroed(count * 8);
            let io = IoBuffers::separate(inp.as_mut_slice(), out.as_mut_slice());
            execute(&schedule, io, links, &call, &mut AlignedBuf::zeroed(0)).await
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

#[test]
fn bad_schedules_are_rejected_before_running() {
    let spec = Spec {
        kind: CollectiveKind::AllReduce,
        rank: 0,
        world_size: 2,
        count: 8,
        root: 0,
        finalize: false,
        piece_elems: 64,
    };
    let schedule = spec.build(Algorithm::Ring).unwrap();
    let call = Call {
        comm: 1,
        seq: 1,
        fingerprint: Fingerprint::new(CollectiveKind::AllReduce, DataType::U64, 8),
        rank: 0,
        world_size: 2,
        op: ReduceOp::Sum,
    };
    let mut small = vec![0u8; 8];
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let e = rt
        .block_on(execute(
            &schedule,
            IoBuffers::in_place(&mut small),
            &mesh(2, false)[0],
            &call,
            &mut AlignedBuf::zeroed(0),
        ))
        .unwrap_err();
    assert!(matches!(e, Error::Internal(_)), "{e}");
    assert!(Spec { root: 5, ..spec }.build(Algorithm::Ring).is_err());
    assert!(spec.build(Algorithm::BinomialTree).is_err());
}
