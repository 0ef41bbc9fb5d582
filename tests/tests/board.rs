//! The shared-memory board algorithms with ranks as threads of this process
//! (one host, so they get a real board in `/dev/shm`): world sizes up to 16,
//! counts around the world size and around the board's chunk, every op, in
//! place and out of place, against results computed here.

use std::{
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use ccl::{Algorithm, CollectiveKind, Communicator, DataType, HashStore, Options, ReduceOp, Store};
use ccl_tests::with_ranks;

fn options(algo: &str) -> Options {
    Options {
        timeout: Duration::from_secs(60),
        algo: Some(algo.into()),
        spin_window: Some(Duration::from_micros(20)),
        ..Options::default()
    }
}

/// Rank `r`'s element `i`: small integers, so that every op is exact.
fn value(r: usize, i: usize) -> i64 {
    ((r * 7 + i * 3) % 11) as i64 - 5
}

/// The reduction of every rank's element `i` under `op`, in rank order.
fn expected(op: ReduceOp, n: usize, i: usize) -> i64 {
    let xs = (0..n).map(|r| value(r, i));
    match op {
        ReduceOp::Sum => xs.sum(),
        ReduceOp::Avg => xs.sum::<i64>() / n as i64,
        ReduceOp::Prod => xs.product(),
        ReduceOp::Min => xs.min().unwrap(),
        ReduceOp::Max => xs.max().unwrap(),
        ReduceOp::BitAnd => xs.fold(-1, |a, x| a & x),
        ReduceOp::BitOr => xs.fold(0, |a, x| a | x),
        ReduceOp::BitXor => xs.fold(0, |a, x| a ^ x),
        _ => unreachable!("{op:?}"),
    }
}

const OPS: [ReduceOp; 8] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::BitAnd,
    ReduceOp::BitOr,
    ReduceOp::BitXor,
];

/// Runs allreduce with `algo` on `n` thread ranks over every count and op,
/// in place and out of place; returns each rank's list of wrong results.
fn allreduce_everywhere(n: usize, algo: &str, counts: Vec<usize>) {
    let want = algo.split('=').nth(1).unwrap().to_string();
    let wrong = with_ranks(n, options(algo), move |comm: Communicator| {
        let r = comm.rank();
        let mut wrong = Vec::new();
        for &count in &counts {
            if n > 1 {
                let chosen = comm.algorithm_for(CollectiveKind::AllReduce, count, DataType::I64);
                assert_eq!(chosen.name(), want, "rank {r}, count {count}: no board?");
            }
            for op in OPS {
                let input: Vec<i64> = (0..count).map(|i| value(r, i)).collect();
                let mut inplace = input.clone();
                let mut out = vec![0i64; count];
                comm.allreduce(&mut inplace, op).expect("allreduce");
                comm.allreduce_into(&input, &mut out, op)
                    .expect("allreduce_into");
                let bad = (0..count)
                    .find(|&i| inplace[i] != expected(op, n, i) || out[i] != expected(op, n, i));
                if let Some(i) = bad {
                    wrong.push(format!(
                        "count {count} {op:?}: element {i} is {} in place, {} out of place, want {}",
                        inplace[i],
                        out[i],
                        expected(op, n, i)
                    ));
                }
            }
        }
        wrong
    });
    for (rank, w) in wrong.iter().enumerate() {
        assert!(w.is_empty(), "{algo}, {n} ranks, rank {rank}: {w:#?}");
    }
}

#[test]
fn board_direct_allreduce_is_exact_for_every_world_size_count_and_op() {
    // A board chunk is 256 KiB: 32768 i64 elements.
    let chunk = 32768;
    for n in [1usize, 2, 3, 4, 5, 7, 8, 16] {
        let mut counts = vec![0, 1, n.saturating_sub(1), n, n + 1, 97, chunk - 1];
        if n <= 8 {
            counts.extend([chunk, chunk + n + 1, 3 * chunk + 5]);
        }
        allreduce_everywhere(n, "allreduce=board-direct", counts);
    }
}

#[test]
fn board_allreduce_is_exact_for_every_world_size_count_and_op() {
    for n in [2, 3, 5, 8, 16] {
        allreduce_everywhere(n, "allreduce=board", vec![0, 1, n - 1, n, n + 1, 97, 2048]);
    }
}

#[test]
fn ranks_that_pick_different_board_algorithms_fail_instead_of_hanging() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let ranks: Vec<_> = ["allreduce=board", "allreduce=board-direct"]
        .into_iter()
        .enumerate()
        .map(|(rank, algo)| {
            let store = store.clone();
            thread::spawn(move || {
                let comm = Communicator::new(rank, 2, store, options(algo)).expect("communicator");
                let started = Instant::now();
                let mut v = vec![1i64; 100];
                (comm.allreduce(&mut v, ReduceOp::Sum), started.elapsed())
            })
        })
        .collect();
    for (rank, t) in ranks.into_iter().enumerate() {
        let (result, took) = t.join().expect("rank thread");
        let e = result.expect_err("different board algorithms cannot agree");
        assert!(
            e.to_string().contains("expected message"),
            "rank {rank}: {e}"
        );
        assert!(took < Duration::from_secs(30), "rank {rank} took {took:?}");
    }
}

/// Every collective through the board algorithms that `algo` (a `CCL_ALGO`
/// value) forces, in place and out of place, on `n` thread ranks; panics
/// naming the first wrong result.
fn every_collective_through(n: usize, algo: &str, counts: Vec<usize>) {
    let results = with_ranks(n, options(algo), move |comm: Communicator| {
        let me = comm.rank();
        let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<i64>();
        let mut wrong = Vec::new();
        let mut check = |what: &str, got: &[i64], want: &dyn Fn(usize) -> i64| {
            if let Some(i) = (0..got.len()).find(|&i| got[i] != want(i)) {
                wrong.push(format!(
                    "{what}: element {i} is {}, want {}",
                    got[i],
                    want(i)
                ));
            }
        };
        for (k, &c) in counts.iter().enumerate() {
            // Every root in turn, across the counts and the world sizes.
            let root = (n - 1 + k) % n;
            let kinds = [
                CollectiveKind::Broadcast,
                CollectiveKind::Reduce,
                CollectiveKind::AllGather,
                CollectiveKind::ReduceScatter,
                CollectiveKind::AllToAll,
                CollectiveKind::Gather,
                CollectiveKind::Scatter,
            ];
            for kind in kinds.into_iter().filter(|_| n > 1) {
                let used = comm.algorithm_for(kind, c, DataType::I64);
                assert!(
                    matches!(used, Algorithm::Board | Algorithm::BoardDirect),
                    "{kind} of {c} ran {used}"
                );
            }
            let mine: Vec<i64> = (0..c).map(|i| value(me, i)).collect();
            // n blocks of c: block b holds elements b·c.. of this rank's values.
            let blocks: Vec<i64> = (0..n * c).map(|i| value(me, i)).collect();
            let w = |what: &str| format!("{what} of {c}");

            let mut b: Vec<i64> = if me == root {
                mine.clone()
            } else {
                vec![-1; c]
            };
            comm.broadcast(&mut b, root).expect("broadcast");
            check(&w("broadcast"), &b, &|i| value(root, i));

            let mut r = vec![0i64; if me == root { c } else { 0 }];
            comm.reduce_into(&mine, &mut r, ReduceOp::Sum, root)
                .expect("reduce_into");
            check(&w("reduce_into"), &r, &sum);
            let mut r = mine.clone();
            comm.reduce(&mut r, ReduceOp::Sum, root).expect("reduce");
            if me == root {
                check(&w("reduce"), &r, &sum);
            }

            let mut g = vec![0i64; n * c];
            comm.allgather_into(&mine, &mut g).expect("allgather_into");
            check(&w("allgather_into"), &g, &|i| {
                value(i / c.max(1), i % c.max(1))
            });
            let mut g = vec![-1i64; n * c];
            g[me * c..(me + 1) * c].copy_from_slice(&mine);
            comm.allgather(&mut g).expect("allgather");
            check(&w("allgather"), &g, &|i| value(i / c.max(1), i % c.max(1)));

            let mut s = vec![0i64; c];
            comm.reduce_scatter_into(&blocks, &mut s, ReduceOp::Sum)
                .expect("reduce_scatter_into");
            check(&w("reduce_scatter_into"), &s, &|i| sum(me * c + i));
            let mut s = blocks.clone();
            comm.reduce_scatter(&mut s, ReduceOp::Sum)
                .expect("reduce_scatter");
            check(&w("reduce_scatter"), &s[me * c..(me + 1) * c], &|i| {
                sum(me * c + i)
            });

            let want_a2a = |i: usize| value(i / c.max(1), me * c + i % c.max(1));
            let mut a = vec![0i64; n * c];
            comm.alltoall_into(&blocks, &mut a).expect("alltoall_into");
            check(&w("alltoall_into"), &a, &want_a2a);
            let mut a = blocks.clone();
            comm.alltoall(&mut a).expect("alltoall");
            check(&w("alltoall"), &a, &want_a2a);

            let mut g = vec![0i64; if me == root { n * c } else { 0 }];
            comm.gather_into(&mine, &mut g, root).expect("gather_into");
            check(&w("gather_into"), &g, &|i| {
                value(i / c.max(1), i % c.max(1))
            });

            let input = if me == root {
                blocks.clone()
            } else {
                Vec::new()
            };
            let mut s = vec![0i64; c];
            comm.scatter_into(&input, &mut s, root)
                .expect("scatter_into");
            check(&w("scatter_into"), &s, &|i| value(root, me * c + i));
            let mut s = if me == root {
                blocks.clone()
            } else {
                vec![-1; c]
            };
            comm.scatter(&mut s, root).expect("scatter");
            let s = if me == root {
                &s[me * c..(me + 1) * c]
            } else {
                &s[..]
            };
            check(&w("scatter"), s, &|i| value(root, me * c + i));

            comm.barrier().expect("barrier");
        }
        wrong
    });
    for (rank, w) in results.iter().enumerate() {
        assert!(w.is_empty(), "{algo}, {n} ranks, rank {rank}: {w:#?}");
    }
}

#[test]
fn every_collective_through_the_board_in_chunks() {
    // A chunk is 256 KiB: 32768 i64 of a one-block layout, 32768/n of an
    // n-block one (reduce-scatter, all-to-all, scatter).
    for n in [2usize, 3, 4, 5, 8] {
        every_collective_through(n, "board", vec![0, 1, n + 1, 4099, 40_000, 2, 9]);
    }
    every_collective_through(3, "board,reduce=board-direct", vec![1, 40_000]);
}

#[test]
fn every_collective_through_the_board_in_chunks_that_fill_the_slot() {
    // Calls that move blocks fill the 1 MiB slot from 2 MiB where the ranks
    // have CPUs of their own (2 ranks on this machine's 2 CPUs), from 8 MiB
    // where they share them: 300,001 i64 are 2.4 MB a block (at 4 ranks
    // 9.6 MB of all-to-all, scatter, gather and allgather), not a multiple
    // of the chunk.
    for n in [2usize, 4] {
        every_collective_through(n, "board", vec![300_001]);
    }
}
