//! The shared-memory board algorithms with ranks as threads of this process
//! (one host, so they get a real board in `/dev/shm`): world sizes up to 16,
//! counts around the world size and around the board's chunk, every op, in
//! place and out of place, against results computed here.

use std::{
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use ccl::{CollectiveKind, Communicator, DataType, HashStore, Options, ReduceOp, Spin, Store};
use ccl_tests::with_ranks;

fn options(algo: &str) -> Options {
    Options {
        timeout: Duration::from_secs(60),
        algo: Some(algo.into()),
        spin: Spin {
            window: Duration::from_micros(20),
            yield_between: true,
            repoll: false,
        },
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
