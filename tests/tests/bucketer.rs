//! The bucketer (`ccl::Bucketer`): fused allreduce of many tensors, with ranks
//! as threads of this process and as real processes. Integer results are
//! checked exactly, floats against the unfused result; ready orders are
//! random (seeded) and differ between ranks; caps go from "every tensor
//! alone" to "one bucket"; `no_sync` accumulation; misuse gives errors.

use std::{sync::Arc, thread, time::Duration};

use ccl::{
    Algorithm, Bucketer, CollectiveKind, Communicator, DataType, HashStore, Options, ReduceOp,
    Store, TensorId,
};
use ccl_tests::{assert_all_ok, invalid, launch};

#[path = "../src/bucketer_scenario.rs"]
mod scenario;

const WORKER: &str = env!("CARGO_BIN_EXE_bucketer_worker");

/// Runs `f(comm)` on `n` ranks, each a thread with its own communicator.
fn with_ranks<T: Send + 'static>(
    n: usize,
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let options = Options {
        timeout: Duration::from_secs(60),
        ..Options::default()
    };
    ccl_tests::with_ranks(n, options, f)
}

#[test]
fn threads_integers_exact_and_floats_match_unfused() {
    for n in [1, 2, 3, 4] {
        for seed in [1, 2] {
            let results = with_ranks(n, move |comm| scenario::all(&comm, seed));
            for (r, res) in results.into_iter().enumerate() {
                if let Err(e) = res {
                    panic!("{n} ranks, seed {seed}, rank {r}: {e}");
                }
            }
        }
    }
}

#[test]
fn processes_integers_exact_and_floats_match_unfused() {
    let env = vec![("CCL_TIMEOUT", "60s".to_string())];
    for n in [2, 3, 4] {
        let out = launch(WORKER, &["3"], n, &env, Duration::from_secs(240));
        assert_all_ok(&out, &format!("bucketer with {n} processes"));
        for o in &out {
            assert!(o.stdout.contains("bucketer ok"), "{}", o.stdout);
        }
    }
}

#[test]
fn processes_over_tcp() {
    let env = vec![
        ("CCL_TIMEOUT", "60s".to_string()),
        ("CCL_TRANSPORT", "tcp".to_string()),
    ];
    let out = launch(WORKER, &["4"], 3, &env, Duration::from_secs(240));
    assert_all_ok(&out, "bucketer over TCP with 3 processes");
}

#[test]
fn buckets_follow_registration_order_and_cap() {
    with_ranks(1, |comm| {
        // f32 tensors of 10, 10, 10, 100, 5 elements and an i32 of 5, cap 100 B.
        let mut b = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(100);
        assert_eq!(b.cap_bytes(), 100);
        let lens = [10, 10, 10, 100, 5];
        let ids: Vec<TensorId> = lens
            .iter()
            .map(|&l| b.register::<f32>(l).unwrap())
            .collect();
        let int = b.register::<i32>(5).unwrap();
        let f = |i: usize| TensorId(i);
        assert_eq!(
            b.buckets(),
            vec![
                vec![f(0), f(1)], // 80 B; the third would make 120
                vec![f(2)],       // closed by the 400 B tensor
                vec![f(3)],       // larger than cap: alone
                vec![f(4)],       // f32, after the large one
                vec![int],        // its own type's bucket
            ]
        );
        let _ = ids;
        // Default cap: 25 MiB, everything of one type together.
        let mut b = Bucketer::new(&comm, ReduceOp::Sum);
        assert_eq!(b.cap_bytes(), ccl::DEFAULT_BUCKET_CAP_BYTES);
        let a = b.register::<f32>(3).unwrap();
        let i = b.register::<i64>(3).unwrap();
        let c = b.register::<f32>(3).unwrap();
        assert_eq!(b.buckets(), vec![vec![a, c], vec![i]]);
    });
}

#[test]
fn misuse_gives_errors_and_leaves_the_step_usable() {
    with_ranks(2, |comm| {
        let mut b = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(64);
        let a = b.register::<i32>(4).unwrap();
        let c = b.register::<i32>(20).unwrap();
        let d = b.register::<f64>(2).unwrap();
        assert!(invalid(b.ready(TensorId(9), vec![0i32; 4])).contains("unknown tensor 9"));
        assert!(invalid(b.ready(a, vec![0i32; 5])).contains("4 elements"));
        assert!(invalid(b.ready(a, vec![0i64; 4])).contains("registered as i32"));
        b.ready(a, vec![1i32; 4]).unwrap();
        assert!(invalid(b.ready(a, vec![1i32; 4])).contains("already marked ready"));
        assert!(invalid(b.register::<i32>(1)).contains("after the buckets were formed"));
        assert!(invalid(b.set_no_sync(true)).contains("middle of a step"));
        let early = invalid(b.finish().wait());
        assert!(early.contains("2 tensors not ready"), "{early}");
        // The step goes on.
        b.ready(d, vec![0.5f64; 2]).unwrap();
        b.ready(c, vec![2i32; 20]).unwrap();
        let mut out = b.finish().wait().unwrap();
        assert_eq!(out.take::<i32>(a).unwrap(), vec![2; 4]);
        assert!(invalid(out.take::<i32>(a)).contains("already taken"));
        assert!(invalid(out.take::<i32>(d)).contains("not a tensor of i32"));
        assert_eq!(out.take::<f64>(d).unwrap(), vec![1.0; 2]);
        assert_eq!(out.take::<i32>(c).unwrap(), vec![4; 20]);
        assert!(invalid(out.take::<i32>(TensorId(3))).contains("unknown"));

        // Explicit buckets: every tensor once, one element type each.
        let mut b = Bucketer::new(&comm, ReduceOp::Max);
        let x = b.register::<u8>(3).unwrap();
        let y = b.register::<f32>(3).unwrap();
        let z = b.register::<u8>(1).unwrap();
        assert!(invalid(b.with_buckets(&[vec![x, y], vec![z]])).contains("mixes element types"));
        assert!(invalid(b.with_buckets(&[vec![x, z]])).contains("tensor 1 is in no bucket"));
        assert!(invalid(b.with_buckets(&[vec![x, z], vec![y, x]])).contains("more than one"));
        assert!(invalid(b.with_buckets(&[vec![x, z], vec![]])).contains("empty"));
        b.with_buckets(&[vec![z, x], vec![y]]).unwrap();
        assert_eq!(b.buckets(), vec![vec![z, x], vec![y]]);
        let r = comm.rank() as u8;
        b.ready(y, vec![r as f32; 3]).unwrap();
        b.ready(x, vec![r; 3]).unwrap();
        b.ready(z, vec![10 - r]).unwrap();
        let out = b.finish().wait().unwrap();
        assert_eq!(format!("{out:?}"), "Reduced(3 of 3 tensors left)");
        let mut out = out;
        assert_eq!(out.take::<u8>(x).unwrap(), vec![1; 3]);
        assert_eq!(out.take::<u8>(z).unwrap(), vec![10]);
        assert_eq!(out.take::<f32>(y).unwrap(), vec![1.0; 3]);

        // An op the element type does not support.
        let mut b = Bucketer::new(&comm, ReduceOp::BitAnd);
        assert!(invalid(b.register::<f32>(1)).contains("not defined"));
    });
}

#[test]
fn results_come_back_in_the_callers_own_buffers() {
    with_ranks(2, |comm| {
        let mut b = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(1 << 10);
        let small = b.register::<u64>(8).unwrap();
        let big = b.register::<u64>(1 << 12).unwrap(); // alone: reduced without a copy
        let (vs, vb) = (vec![1u64; 8], vec![3u64; 1 << 12]);
        let (ps, pb) = (vs.as_ptr(), vb.as_ptr());
        b.ready(big, vb).unwrap();
        b.ready(small, vs).unwrap();
        let mut out = b.finish().wait().unwrap();
        let (rs, rb) = (
            out.take::<u64>(small).unwrap(),
            out.take::<u64>(big).unwrap(),
        );
        assert_eq!((rs.as_ptr(), rb.as_ptr()), (ps, pb));
        assert_eq!(rs, vec![2; 8]);
        assert_eq!(rb, vec![6; 1 << 12]);
        assert_eq!(b.steps(), 1);
    });
}

#[test]
fn no_tensors_and_async_finish() {
    with_ranks(2, |comm| {
        let mut b = Bucketer::new(&comm, ReduceOp::Sum);
        assert!(b.is_empty());
        assert!(b.finish().wait().unwrap().is_empty());
        let mut b = Bucketer::new(&comm, ReduceOp::Avg);
        let t = b.register::<f64>(1000).unwrap();
        b.ready(t, vec![comm.rank() as f64; 1000]).unwrap();
        let w = b.finish();
        let mut out = futures_lite_block_on(w).unwrap();
        assert_eq!(out.take::<f64>(t).unwrap(), vec![0.5; 1000]);
    });
}

/// Awaits a `Work` on a small tokio runtime (the `Work` is a `Future`).
fn futures_lite_block_on<T>(w: ccl::Work<T>) -> ccl::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(w)
}

#[test]
fn zero_copy_views_mixed_with_owned_vecs() {
    with_ranks(3, |comm| {
        let (r, n) = (comm.rank() as i64, comm.world_size() as i64);
        let mut b = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(4 << 10);
        let lens = [100usize, 700, 3, 2000, 50, 900, 1];
        let ids: Vec<TensorId> = lens
            .iter()
            .map(|&l| b.register::<i64>(l).unwrap())
            .collect();
        let val = |r: i64, s: i64, t: usize, i: usize| r * 1000 + s * 100 + t as i64 + i as i64;
        let mut rng = scenario::Rng::new(99 + r as u64);
        let sum_ranks = |s: i64, t: usize, i: usize| (0..n).map(|q| val(q, s, t, i)).sum::<i64>();
        for s in 0..3i64 {
            let mut order: Vec<usize> = (0..lens.len()).collect();
            rng.shuffle(&mut order);
            for &t in &order {
                if t % 2 == 0 {
                    let v = b.view_mut::<i64>(ids[t]).unwrap();
                    for (i, x) in v.iter_mut().enumerate() {
                        *x = val(r, s, t, i);
                    }
                    b.mark_ready(ids[t]).unwrap();
                    assert!(invalid(b.view_mut::<i64>(ids[t])).contains("already marked"));
                } else {
                    b.ready(ids[t], (0..lens[t]).map(|i| val(r, s, t, i)).collect())
                        .unwrap();
                }
            }
            let mut out = b.finish().wait().unwrap();
            for t in 0..lens.len() {
                let got: Vec<i64> = if t % 2 == 0 {
                    assert!(invalid(out.take::<i64>(ids[t])).contains("in place"));
                    b.view::<i64>(ids[t]).unwrap().to_vec()
                } else {
                    out.take(ids[t]).unwrap()
                };
                let want: Vec<i64> = (0..lens[t]).map(|i| sum_ranks(s, t, i)).collect();
                assert_eq!(got, want, "step {s} tensor {t}");
            }
        }
        // no_sync in place: add into the views for two steps, then reduce.
        b.set_no_sync(true).unwrap();
        for &id in &ids {
            b.view_mut::<i64>(id).unwrap().fill(0);
        }
        for s in 0..3i64 {
            if s == 2 {
                b.set_no_sync(false).unwrap();
            }
            for &id in &ids {
                for x in b.view_mut::<i64>(id).unwrap() {
                    *x += r + s;
                }
                b.mark_ready(id).unwrap();
            }
            b.finish().wait().unwrap();
        }
        let want = (0..n).map(|q| 3 * q + 3).sum::<i64>();
        for &id in &ids {
            assert!(b.view::<i64>(id).unwrap().iter().all(|&x| x == want));
        }
        assert!(invalid(b.view::<f32>(ids[0])).contains("registered as i64"));
    });
}

#[test]
fn a_view_of_a_bucket_being_reduced_is_an_error() {
    // Rank 1 joins only once rank 0 has looked.
    let looked = Arc::new(std::sync::Barrier::new(2));
    with_ranks(2, move |comm| {
        let mut b = Bucketer::new(&comm, ReduceOp::Sum);
        let t = b.register::<u32>(16).unwrap();
        if comm.rank() == 1 {
            looked.wait();
        }
        b.view_mut::<u32>(t).unwrap().fill(1);
        b.mark_ready(t).unwrap();
        let work = b.finish();
        if comm.rank() == 0 {
            // Rank 1 has not joined yet, so the bucket cannot be back.
            let seen = b.view::<u32>(t).map(<[u32]>::to_vec);
            looked.wait();
            let seen = invalid(seen);
            assert!(seen.contains("still being reduced"), "{seen}");
        }
        work.wait().unwrap();
        assert_eq!(b.view::<u32>(t).unwrap(), &[2u32; 16][..]);
    });
}

#[test]
fn a_rank_that_never_comes_fails_the_set_within_the_deadline() {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let options = Options {
        timeout: Duration::from_secs(3),
        ..Options::default()
    };
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let (store, options) = (store.clone(), options.clone());
            thread::spawn(move || {
                let comm = Communicator::new(rank, 2, store, options).expect("communicator");
                if rank == 1 {
                    // Joins, then never hands anything over.
                    thread::sleep(Duration::from_secs(6));
                    return None;
                }
                let mut b = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(1 << 10);
                let ids: Vec<TensorId> = (0..4).map(|_| b.register::<f32>(300).unwrap()).collect();
                for id in ids {
                    b.ready(id, vec![1.0f32; 300]).unwrap();
                }
                let started = std::time::Instant::now();
                let r = b.finish().wait();
                Some((r.map(|_| ()), started.elapsed()))
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let (r, took) = results[0].clone().expect("rank 0 reports");
    assert!(r.is_err(), "the set must fail without its peer");
    assert!(took < Duration::from_secs(10), "failed only after {took:?}");
}

/// Owned tensors reduced where they lie (one host, so on the board), with a
/// pre-multiplied sum whose scalar differs per rank, across chunk and share
/// boundaries: a 1.2 MiB bucket of odd-sized tensors over 3 ranks.
#[test]
fn owned_tensors_reduced_in_place_with_a_premultiplied_sum() {
    with_ranks(3, |comm| {
        let r = comm.rank();
        let mut b = Bucketer::new(&comm, ReduceOp::PreMulSum(r as f64 + 1.0));
        let lens = [1usize, 40_001, 77, 65_536, 3, 48_000];
        let ids: Vec<TensorId> = lens
            .iter()
            .map(|&l| b.register::<f64>(l).unwrap())
            .collect();
        assert_eq!(b.buckets().len(), 1);
        let total = lens.iter().sum();
        assert_eq!(
            comm.algorithm_for(CollectiveKind::AllReduce, total, DataType::F64),
            Algorithm::BoardDirect,
            "the bucket must run on the board for this test to reach the in-place path"
        );
        let val = |q: usize, t: usize, i: usize| ((q * 7 + t * 3 + i) % 1000) as f64;
        for step in 0..2 {
            let mut order: Vec<usize> = (0..lens.len()).collect();
            scenario::Rng::new(5 + r as u64 + step).shuffle(&mut order);
            for &t in &order {
                b.ready(ids[t], (0..lens[t]).map(|i| val(r, t, i)).collect())
                    .unwrap();
            }
            let mut out = b.finish().wait().unwrap();
            for (t, &len) in lens.iter().enumerate() {
                let got: Vec<f64> = out.take(ids[t]).unwrap();
                assert_eq!(got.len(), len);
                for (i, g) in got.iter().enumerate() {
                    let want: f64 = (0..3).map(|q| (q as f64 + 1.0) * val(q, t, i)).sum();
                    assert_eq!(*g, want, "rank {r} step {step} tensor {t} element {i}");
                }
            }
        }
    });
}
