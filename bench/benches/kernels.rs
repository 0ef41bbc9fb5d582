//! Reduction kernels (`ccl_core::kernels::reduce`): every data type, sum and max,
//! on a cache-resident and a memory-sized buffer, reported in bytes/s of the
//! destination buffer.
//!
//! `cargo bench -p ccl-bench --bench kernels` (add a filter such as `sum/f32`).

use std::{hint::black_box, time::Duration};

use ccl_core::{kernels, AlignedBuf, DataType, ReduceOp};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// 64 KiB (fits in L2) and 16 MiB (does not fit in any cache here).
const SIZES: [usize; 2] = [64 << 10, 16 << 20];

fn kernels(c: &mut Criterion) {
    for ccl_op in [ReduceOp::Sum, ReduceOp::Max] {
        let mut group = c.benchmark_group(format!("reduce/{}", ccl_op.name()));
        group
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sample_size(20);
        for dtype in DataType::ALL {
            for bytes in SIZES {
                let mut dst = AlignedBuf::zeroed(bytes);
                let src = AlignedBuf::zeroed(bytes);
                group.throughput(Throughput::Bytes(bytes as u64));
                group.bench_with_input(
                    BenchmarkId::new(dtype.name(), format!("{}KiB", bytes >> 10)),
                    &bytes,
                    |b, _| {
                        b.iter(|| {
                            kernels::reduce(
                                ccl_op,
                                dtype,
                                black_box(dst.as_mut_slice()),
                                None,
                                black_box(src.as_slice()),
                            )
                            .expect("aligned buffers of equal length")
                        })
                    },
                );
            }
        }
        group.finish();
    }
}

criterion_group!(benches, kernels);
criterion_main!(benches);
