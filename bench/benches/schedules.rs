//! Schedule building (`ccl_algorithms::Algorithm::schedule`): every collective and
//! algorithm, small and large counts, 2 to 64 ranks.
//!
//! `cargo bench -p ccl-bench --bench schedules` (add a filter such as `allreduce/ring`).

use std::{hint::black_box, time::Duration};

use ccl_algorithms::{Algorithm, Layout};
use ccl_core::{Collective, CollectiveKind, DataType};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

/// The piece size the communicator uses (512 KiB of f32).
const PIECE_ELEMS: usize = (512 << 10) / 4;

fn schedules(c: &mut Criterion) {
    for kind in CollectiveKind::ALL {
        let algos = Algorithm::for_kind(kind);
        if algos.is_empty() {
            continue;
        }
        let mut group = c.benchmark_group(kind.name());
        group
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_millis(800))
            .sample_size(20);
        for &algo in algos {
            for world_size in [2usize, 8, 64] {
                for count in [1024usize, 64 << 20] {
                    let coll = Collective::new(kind, DataType::F32, count);
                    let rank = world_size / 2;
                    let id = BenchmarkId::new(algo.name(), format!("n{world_size}/c{count}"));
                    group.bench_with_input(id, &coll, |b, coll| {
                        b.iter(|| {
                            algo.schedule(
                                black_box(coll),
                                rank,
                                world_size,
                                PIECE_ELEMS,
                                Layout::OutOfPlace,
                            )
                            .expect("valid call")
                        })
                    });
                }
            }
        }
        group.finish();
    }
}

criterion_group!(benches, schedules);
criterion_main!(benches);
