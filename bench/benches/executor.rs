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
use futures::future::join;

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
                let [out0, out1] = &mut outputs;
                let call = |rank| Call {
                    comm: 1,
                    seq,
                    rank,
                    world_size: 2,
                    coll,
                };
                let (c0, c1) = (call(0), call(1));
                let (mut scratch0, mut scratch1) = (None, None);
                let run0 = execute(
                    &schedules[0],
                    IoBuffers::host(inputs[0].as_slice(), out0.as_mut_slice()),
                    &links[0],
                    &c0,
                    &mut scratch0,
                    deadline,
                );
                let run1 = execute(
                    &schedules[1],
                    IoBuffers::host(inputs[1].as_slice(), out1.as_mut_slice()),
                    &links[1],
                    &c1,
                    &mut scratch1,
                    deadline,
                );
                let (r0, r1) = rt.block_on(join(run0, run1));
                r0.and(r1).expect("allreduce");
            })
        });
    }
    group.finish();
}

criterion_group!(benches, executor);
criterion_main!(benches);
