//! The facade's contract, with ranks as threads of this process talking over
//! real TCP sockets: bad arguments are rejected before anything is sent (the
//! communicator stays usable), `Work` handles behave, and deadlines hold.

use std::{
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use ccl::{Communicator, Error, HashStore, Options, ReduceOp, Store};
use ccl_tests::{invalid, with_ranks};

#[test]
fn bad_arguments_are_rejected_before_anything_is_sent() {
    let options = Options {
        timeout: Duration::from_secs(20),
        ..Options::default()
    };
    let results = with_ranks(3, options, |comm| {
        let n = comm.world_size();
        let mut messages = vec![
            invalid(comm.allreduce(&mut [1.0f32; 4], ReduceOp::BitAnd)),
            invalid(comm.allreduce_into(&[1i32; 4], &mut [0i32; 5], ReduceOp::Sum)),
            invalid(comm.broadcast(&mut [0u8; 4], n)),
            invalid(comm.reduce(&mut [0u8; 4], ReduceOp::Sum, 7)),
            invalid(comm.allgather_into(&[1u64; 2], &mut [0u64; 5])),
            invalid(comm.allgather(&mut [0u64; 5])),
            invalid(comm.reduce_scatter_into(&[1u32; 5], &mut [0u32; 2], ReduceOp::Sum)),
            invalid(comm.alltoall(&mut [0i64; 4])),
            invalid(comm.scatter_into(&[1u8; 2], &mut [0u8; 1], n)),
            invalid(comm.gather(&mut [0u8; 4], n + 1)),
            invalid(comm.send(&[1u8], comm.rank())),
            invalid(comm.recv(&mut [1u8], n)),
            invalid(
                comm.iallreduce(vec![ccl::bf16::ONE], ReduceOp::BitXor)
                    .wait(),
            ),
            invalid(comm.allreduce(&mut [1u8; 2], ReduceOp::PreMulSum(0.5))),
            invalid(comm.new_group(&[0, n])),
        ];
        // Nothing was sent: the communicator still works and agrees with the others.
        let mut v = vec![comm.rank() as u32 + 1; 3];
        comm.allreduce(&mut v, ReduceOp::Sum)
            .expect("allreduce after rejected calls");
        messages.push(format!("{v:?}"));
        messages
    });
    for (rank, m) in results.iter().enumerate() {
        assert_eq!(m.last().unwrap(), "[6, 6, 6]", "rank {rank}");
        assert!(m[0].contains("band") && m[0].contains("f32"), "{}", m[0]);
        assert!(m[2].contains("root 3"), "{}", m[2]);
    }
}

#[test]
fn work_handles_run_in_the_background_and_in_order() {
    let results = with_ranks(2, Options::default(), |comm| {
        let mut works: Vec<_> = (0..20)
            .map(|i| comm.iallreduce(vec![i as i64; 1000], ReduceOp::Sum))
            .collect();
        let mut first = works.remove(0);
        let got = first
            .wait_timeout(Duration::from_secs(30))
            .expect("completes")
            .expect("succeeds");
        let rest: Vec<Vec<i64>> = works.into_iter().map(|w| w.wait().unwrap()).collect();
        (got, rest)
    });
    for (first, rest) in results {
        assert_eq!(first, vec![0; 1000]);
        for (i, v) in rest.iter().enumerate() {
            assert_eq!(v[0], 2 * (i as i64 + 1));
        }
    }
}

#[test]
fn wait_timeout_returns_while_a_peer_is_late_and_the_call_then_completes() {
    // Rank 1 calls only once rank 0 has looked.
    let looked = Arc::new(std::sync::Barrier::new(2));
    let results = with_ranks(2, Options::default(), move |comm| {
        if comm.rank() == 1 {
            looked.wait();
        }
        let mut w = comm.iallreduce(vec![1u8; 8], ReduceOp::Sum);
        let early = if comm.rank() == 0 {
            let early = w.wait_timeout(Duration::from_millis(50)).is_none();
            looked.wait();
            early
        } else {
            true
        };
        (early, w.wait().unwrap())
    });
    for (early, v) in results {
        assert!(
            early,
            "wait_timeout should have returned None while rank 1 was late"
        );
        assert_eq!(v, vec![2u8; 8]);
    }
}

#[test]
fn a_missing_rank_is_a_timeout_not_a_hang() {
    // Set-up keeps the default deadline: only the call has 500 ms.
    let results = with_ranks(2, Options::default(), |comm| {
        comm.set_timeout(Duration::from_millis(500));
        let start = Instant::now();
        // Only rank 0 calls; rank 1 goes straight to its end.
        let r = if comm.rank() == 0 {
            comm.allreduce(&mut [1.0f64; 4], ReduceOp::Sum)
        } else {
            Ok(())
        };
        let broken_after = comm.broken().is_some();
        (r, start.elapsed(), broken_after)
    });
    let (r0, took, broken) = &results[0];
    match r0 {
        Err(Error::Timeout { context, .. }) => assert!(
            context.contains("rank 0") && context.contains("allreduce"),
            "{context}"
        ),
        Err(Error::PeerLost { peer: 1, .. }) => {} // rank 1 exited and closed its links first
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(*took < Duration::from_secs(5), "took {took:?}");
    assert!(broken);
}

#[test]
fn world_of_one_needs_no_peers() {
    let comm = Communicator::new(0, 1, Arc::new(HashStore::new()), Options::default()).unwrap();
    let mut v = vec![1.5f32, 2.5];
    comm.allreduce(&mut v, ReduceOp::Avg).unwrap();
    assert_eq!(v, vec![1.5, 2.5]);
    let mut out = vec![0.0f32; 2];
    comm.allgather_into(&v, &mut out).unwrap();
    assert_eq!(out, v);
    comm.barrier().unwrap();
    assert!(Communicator::new(1, 1, Arc::new(HashStore::new()), Options::default()).is_err());
}

#[test]
fn blocking_calls_from_inside_an_async_runtime_do_not_panic() {
    let results = with_ranks(2, Options::default(), |comm| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // Inside a runtime ccl cannot drive its own runtime on this thread:
        // a small call runs on the board inline, and a failed one settles on
        // a helper thread; others are queued.
        let v = rt.block_on(async {
            let mut v = vec![1u32; 4];
            comm.allreduce(&mut v, ReduceOp::Sum).map(|()| v)
        });
        let w = rt.block_on(comm.iallreduce(vec![2u32; 4], ReduceOp::Max));
        // Ranks that disagree on the length: a mismatch, on the board.
        let len = 4 + comm.rank();
        let bad = rt.block_on(async { comm.allreduce(&mut vec![1u32; len], ReduceOp::Sum) });
        (v.unwrap(), w.unwrap(), bad)
    });
    for (v, w, bad) in results {
        assert_eq!(v, vec![2; 4]);
        assert_eq!(w, vec![2; 4]);
        let e = bad.expect_err("calls of different lengths");
        assert!(matches!(e, ccl::Error::Mismatch { .. }), "{e}");
    }
}

#[test]
fn abort_stops_a_waiting_call_and_tells_the_peers() {
    let options = Options {
        timeout: Duration::from_secs(60),
        ..Options::default()
    };
    // Small (the shared-memory board) and large (links) messages.
    for len in [4usize, 1 << 20] {
        let results = with_ranks(3, options.clone(), move |comm| {
            let comm = Arc::new(comm);
            comm.barrier().expect("barrier");
            let started = Instant::now();
            if comm.rank() == 1 {
                // Rank 1 waits in a call that rank 2 never makes, then aborts from another thread.
                let aborter = {
                    let comm = comm.clone();
                    thread::spawn(move || {
                        thread::sleep(Duration::from_millis(300));
                        comm.abort();
                    })
                };
                let r = comm.allreduce(&mut vec![1.0f32; len], ReduceOp::Sum);
                aborter.join().unwrap();
                let later = comm.barrier();
                return (comm.rank(), r.map(|_| ()), later, started.elapsed());
            }
            if comm.rank() == 2 {
                thread::sleep(Duration::from_millis(1500));
            }
            let r = comm.allreduce(&mut vec![1.0f32; len], ReduceOp::Sum);
            let later = comm.barrier();
            (comm.rank(), r.map(|_| ()), later, started.elapsed())
        });
        for (rank, r, later, took) in results {
            if rank == 1 {
                let e = r.expect_err("the aborted call failed");
                assert!(e.to_string().contains("abort"), "rank 1, {len} floats: {e}");
                assert!(
                    matches!(later, Err(Error::Broken { .. })),
                    "rank 1: later call gave {later:?}"
                );
            } else {
                // The peers' allreduce may still complete with what rank 1
                // contributed before it aborted; if not, it names rank 1.
                if let Err(e) = &r {
                    assert!(
                        e.to_string().contains("rank 1"),
                        "rank {rank}, {len} floats: {e}"
                    );
                }
                let e = later.expect_err("a call that needs the aborted rank failed");
                assert!(
                    e.to_string().contains("rank 1"),
                    "rank {rank}, {len} floats: {e}"
                );
            }
            assert!(took < Duration::from_secs(10), "rank {rank} took {took:?}");
        }
    }
}

#[test]
fn a_new_communicator_from_the_same_store_works_after_a_failure() {
    let options = Options {
        timeout: Duration::from_secs(30),
        ..Options::default()
    };
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let handles: Vec<_> = (0..3)
        .map(|rank| {
            let (store, options) = (store.clone(), options.clone());
            thread::spawn(move || {
                let first = Communicator::new(rank, 3, store.clone(), options.clone()).unwrap();
                // Rank 0 passes a different count: the first communicator breaks.
                let mut v = vec![1.0f32; 8 + usize::from(rank == 0)];
                assert!(first.allreduce(&mut v, ReduceOp::Sum).is_err());
                assert!(first.broken().is_some());
                drop(first);
                let second = Communicator::new(rank, 3, store, options).unwrap();
                let mut v = vec![(rank + 1) as f32; 1000];
                second.allreduce(&mut v, ReduceOp::Sum).unwrap();
                assert!(v.iter().all(|&x| x == 6.0), "rank {rank}: {:?}", &v[..4]);
            })
        })
        .collect();
    for h in handles {
        h.join().expect("rank thread");
    }
}

#[test]
fn a_timeout_names_the_rank_that_did_not_arrive() {
    let options = Options {
        timeout: Duration::from_secs(60),
        transport: Some("tcp".into()),
        ..Options::default()
    };
    let results = with_ranks(2, options, |comm| {
        // The deadline of the calls from now on, shorter than the default.
        comm.set_timeout(Duration::from_secs(1));
        assert_eq!(comm.timeout(), Duration::from_secs(1));
        if comm.rank() == 1 {
            thread::sleep(Duration::from_secs(3));
        }
        let started = Instant::now();
        let r = comm.allreduce(&mut vec![1.0f32; 1 << 20], ReduceOp::Sum);
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        r
    });
    match &results[0] {
        Err(Error::Timeout { context, what, .. }) => {
            assert!(
                context.contains("allreduce") && context.contains('#'),
                "{context}"
            );
            assert!(what.contains("[1]"), "{what}");
        }
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
    assert!(results[1].is_err());
}

/// The untyped call path that bindings use: memory refs are checked (kind,
/// lengths, the in-place layouts) before anything is sent, errors carry
/// their stable codes, and valid calls give the typed methods' results.
#[test]
fn the_untyped_call_path_checks_memory_and_layout() {
    use ccl::{BufMut, BufRef, Collective, CollectiveKind, DataType, ErrorCode, MemoryKind};
    let results = with_ranks(2, Options::default(), |comm| {
        let (r, n) = (comm.rank(), comm.world_size());
        let sum4 = Collective::new(CollectiveKind::AllReduce, DataType::U32, 4);
        let mut codes = Vec::new();
        // Device memory in a build without GPU support; and memory of two kinds.
        let mut host = [0u8; 16];
        let gpu = MemoryKind::Device { ordinal: 0 };
        // SAFETY: refused before anything dereferences them.
        let (input, output) = unsafe {
            (
                BufRef::from_raw(gpu, host.as_ptr(), 16),
                BufMut::from_raw(gpu, host.as_mut_ptr(), 16),
            )
        };
        let e = comm.run(&sum4, input, output).unwrap_err();
        assert!(e.to_string().contains("GPU 0"), "{e}");
        codes.push(e.code());
        // SAFETY: as above.
        let input = unsafe { BufRef::from_raw(gpu, host.as_ptr(), 16) };
        let e = comm
            .run(&sum4, input, BufMut::from_host(&mut [0u8; 16]))
            .unwrap_err();
        assert!(
            e.to_string().contains("the input lies in memory of GPU 0"),
            "{e}"
        );
        codes.push(e.code());
        // A short output.
        let e = comm
            .run(
                &sum4,
                BufRef::from_host(&[0u8; 16]),
                BufMut::from_host(&mut [0u8; 12]),
            )
            .unwrap_err();
        assert!(
            e.to_string().contains("output has 3 elements, expected 4"),
            "{e}"
        );
        codes.push(e.code());
        // Input and output overlapping other than in place.
        let mut buf = [0u32; 8];
        let base = buf.as_mut_ptr().cast::<u8>();
        // SAFETY: both within `buf`; the call refuses them before touching them.
        let (input, output) = unsafe {
            (
                BufRef::from_raw(MemoryKind::Host, base, 16),
                BufMut::from_raw(MemoryKind::Host, base.add(4), 16),
            )
        };
        let e = comm.run(&sum4, input, output).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        codes.push(e.code());
        // Send/recv go through their own entry points.
        let p2p = Collective::new(CollectiveKind::SendRecv, DataType::U8, 0);
        let e = comm
            .run(&p2p, BufRef::from_host(&[]), BufMut::from_host(&mut []))
            .unwrap_err();
        codes.push(e.code());
        // A valid allreduce, and an allgather in place (this rank's block
        // of the output is its input).
        let mine = [r as u32 + 1; 4];
        let mut sum = [0u32; 4];
        comm.run(
            &sum4,
            BufRef::from_host(bytemuck::cast_slice(&mine)),
            BufMut::from_host(bytemuck::cast_slice_mut(&mut sum)),
        )
        .unwrap();
        let mut all = vec![0u64; 2 * n];
        all[2 * r..2 * r + 2].copy_from_slice(&[r as u64 * 10; 2]);
        let gather = Collective::new(CollectiveKind::AllGather, DataType::U64, 2);
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut all);
        let base = bytes.as_mut_ptr();
        // SAFETY: this rank's block lies within `all`, borrowed for the call.
        let (input, output) = unsafe {
            (
                BufRef::from_raw(MemoryKind::Host, base.add(16 * r), 16),
                BufMut::from_raw(MemoryKind::Host, base, bytes.len()),
            )
        };
        comm.run(&gather, input, output).unwrap();
        (codes, sum, all)
    });
    for (codes, sum, all) in results {
        assert_eq!(
            codes,
            [
                ErrorCode::Unsupported,
                ErrorCode::InvalidArgument,
                ErrorCode::InvalidArgument,
                ErrorCode::InvalidArgument,
                ErrorCode::InvalidArgument
            ]
        );
        assert_eq!(sum, [3; 4]);
        assert_eq!(all, [0, 0, 10, 10]);
    }
}
