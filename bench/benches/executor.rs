//! The executor's fixed cost per call: an 8 B allreduce (recursive doubling)
//! between 2 ranks that are tasks of one thread, over links through memory,
//! with and without a deadline. No socket and no other process is involved,
//! so this isolates what a small call over TCP pays in user space besides its
//! system calls.
//!
//! `cargo bench -p ccl-bench --bench executor`

use std::time::Duration;

use ccl_algorithms::{execute, Algorithm, IoBuffers, Layout};
use ccl_core::{loopback::mesh, AlignedBuf, Call, Collective, CollectiveKind, DataType};
use criterion::{criterion_group, criterion_main, Criterion};
use futures::future::join_all;

fn executor(c: &mut Criterion) {
    let coll = Collective::new(CollectiveKind::AllReduce, DataType::F32, 2);
    let links = mesh(2, false);
    let schedules: Vec<_> = (0..2)
        .map(|rank| {
            Algorithm::RecursiveDoubling
                .schedule(&coll, rank, 2, 1 << 17, Layout::OutOfPlace)
                .expect("valid call")
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("executor");
    group
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for (name, deadline) in [
        ("allreduce-8B-2ranks", None),
        (
            "allreduce-8B-2ranks-deadline",
            Some(Duration::from_secs(60)),
        ),
    ] {
        let mut seq = 0;
        let inputs = [AlignedBuf::zeroed(8), AlignedBuf::zeroed(8)];
        let mut outputs = [AlignedBuf::zeroed(8), AlignedBuf::zeroed(8)];
        group.bench_function(name, |b| {
            b.iter(|| {
                seq += 1;
                let calls = [0, 1].map(|rank| Call {
                    comm: 1,
                    seq,
                    rank,
                    world_size: 2,
                    coll,
                });
                let mut scratch = [None, None];
                let runs = outputs.iter_mut().zip(&mut scratch).enumerate().map(
                    |(rank, (out, scratch))| {
                        let io = IoBuffers::host(inputs[rank].as_slice(), out.as_mut_slice());
                        execute(
                            &schedules[rank],
                            io,
                            &links[rank],
                            &calls[rank],
                            scratch,
                            deadline,
                        )
                    },
                );
                for result in rt.block_on(join_all(runs)) {
                    result.expect("allreduce");
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, executor);
criterion_main!(benches);
