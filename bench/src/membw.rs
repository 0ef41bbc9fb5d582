//! The machine's memory bound, measured in the same run as a comparison: a
//! copy (the faster of `dst.copy_from_slice(src)` and a copy with streaming
//! stores, [`ccl_core::kernels::copy_streaming`]) and a plain `a += b` over
//! f32, on as many threads as there are ranks, each pinned where that rank is.
//!
//! Rates are aggregate over the threads and count the bytes of the
//! destination per second (a copy of 64 MiB at 10 GB/s reads 64 MiB and
//! writes 64 MiB in 6.7 ms). [`bound_busbw`] turns them into the bus
//! bandwidth a collective would reach if it did only its unavoidable memory
//! work at those rates (the single-copy model in bench/README.md).

use std::{
    sync::{Arc, Barrier},
    time::Instant,
};

use nix::{
    sched::{sched_setaffinity, CpuSet},
    unistd::Pid,
};
use serde::{Deserialize, Serialize};

use crate::coll::Coll;

/// One measurement of both kernels.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct MemBw {
    /// Bytes copied per second, all threads together (1e9): the faster of a
    /// plain copy and a streaming one.
    pub copy_gbps: f64,
    /// Bytes of `a` updated by `a += b` per second, all threads together (1e9).
    pub add_gbps: f64,
}

impl MemBw {
    /// The better of two measurements, kernel by kernel.
    pub fn max(self, o: MemBw) -> MemBw {
        MemBw {
            copy_gbps: self.copy_gbps.max(o.copy_gbps),
            add_gbps: self.add_gbps.max(o.add_gbps),
        }
    }
}

/// Passes over the buffers per timed repetition, and repetitions (the best counts).
const PASSES: usize = 4;
const REPS: usize = 3;

pub(crate) fn pin_current_thread(cpu: usize) {
    let mut set = CpuSet::new();
    if set.set(cpu).is_ok() {
        // Best effort: an unpinned thread only measures a less steady rate.
        let _ = sched_setaffinity(Pid::from_raw(0), &set);
    }
}

/// The kernels measured.
#[derive(Clone, Copy)]
enum Kernel {
    Copy,
    StreamingCopy,
    Add,
}

/// Runs `kernel` on `threads` threads at once (thread t pinned to
/// `cpus[t % len]` when `cpus` is not empty), each on its own buffers of
/// `bytes`; returns the aggregate rate in GB/s of destination bytes, the best
/// of [`REPS`] repetitions of [`PASSES`] passes.
fn measure(threads: usize, cpus: &[usize], bytes: usize, kernel: Kernel) -> f64 {
    let elems = (bytes / 4).max(1);
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let barrier = barrier.clone();
            let cpu = (!cpus.is_empty()).then(|| cpus[t % cpus.len()]);
            std::thread::spawn(move || {
                if let Some(c) = cpu {
                    pin_current_thread(c);
                }
                // Touched here, on this thread's CPU, so that first-touch
                // places the pages as a rank's would be.
                let src = vec![1.0f32; elems];
                let mut dst = vec![0.5f32; elems];
                let mut times = Vec::with_capacity(REPS);
                for _ in 0..=REPS {
                    barrier.wait();
                    let t0 = Instant::now();
                    for _ in 0..PASSES {
                        match kernel {
                            Kernel::Add => {
                                for (a, b) in dst.iter_mut().zip(&src) {
                                    *a += *b;
                                }
                            }
                            Kernel::Copy => dst.copy_from_slice(&src),
                            Kernel::StreamingCopy => {
                                let (to, from) = (
                                    bytemuck::cast_slice_mut(&mut dst),
                                    bytemuck::cast_slice(&src),
                                );
                                // Equal lengths: the one error cannot happen.
                                let _ = ccl_core::kernels::copy_streaming(to, from);
                            }
                        }
                        std::hint::black_box(&mut dst);
                    }
                    times.push(t0.elapsed().as_secs_f64());
                }
                times.remove(0); // the first repetition warms up
                times
            })
        })
        .collect();
    let per_thread: Vec<Vec<f64>> = handles
        .into_iter()
        .map(|h| h.join().unwrap_or_default())
        .collect();
    // A repetition lasts as long as its slowest thread.
    (0..REPS)
        .filter_map(|r| {
            let t = per_thread
                .iter()
                .filter_map(|v| v.get(r))
                .fold(0f64, |a, &b| a.max(b));
            (t > 0.0).then(|| (threads * PASSES * elems * 4) as f64 / t / 1e9)
        })
        .fold(0f64, f64::max)
}

/// Measures copy (plain and streaming, the faster counts) and `a += b` on
/// `threads` threads placed on `cpus`.
pub fn measure_both(threads: usize, cpus: &[usize], bytes: usize) -> MemBw {
    let copy = measure(threads, cpus, bytes, Kernel::Copy);
    MemBw {
        copy_gbps: copy.max(measure(threads, cpus, bytes, Kernel::StreamingCopy)),
        add_gbps: measure(threads, cpus, bytes, Kernel::Add),
    }
}

/// The busbw (GB/s, nccl-tests' factors) that `coll` on `n` ranks would reach
/// doing only its unavoidable memory work at the rates `m`, every rank reading
/// its peers' buffers directly (one copy): for a buffer of S bytes,
/// allreduce adds (n-1)S and copies (n-1)S, reduce-scatter adds (n-1)S,
/// allgather and alltoall copy (n-1)S from peers and, out of place, each
/// rank's own block into its output too (S in all), gather, scatter and
/// sendrecv copy (n-1)S (sendrecv nS), broadcast copies (n-1)S, reduce adds
/// (n-1)S. `None` for barrier and a single rank.
pub fn bound_busbw(coll: Coll, n: usize, in_place: bool, m: MemBw) -> Option<f64> {
    if n < 2 || m.copy_gbps <= 0.0 || m.add_gbps <= 0.0 {
        return None;
    }
    let nf = n as f64;
    let (c, a) = (m.copy_gbps, m.add_gbps);
    Some(match coll {
        Coll::Allreduce => 2.0 / (nf * (1.0 / a + 1.0 / c)),
        Coll::ReduceScatter => a / nf,
        Coll::Allgather | Coll::Alltoall if !in_place => c * (nf - 1.0) / (nf * nf),
        Coll::Allgather | Coll::Alltoall | Coll::Gather | Coll::Scatter | Coll::Sendrecv => c / nf,
        Coll::Broadcast => c / (nf - 1.0),
        Coll::Reduce => a / (nf - 1.0),
        Coll::Barrier => return None,
    })
}

/// The formula [`bound_busbw`] uses, in words, for the table's header.
pub fn bound_formula(coll: Coll, in_place: bool) -> &'static str {
    match coll {
        Coll::Allreduce => "2 / (n (1/add + 1/copy))",
        Coll::ReduceScatter => "add / n",
        Coll::Allgather | Coll::Alltoall if !in_place => "copy (n-1) / n^2",
        Coll::Allgather | Coll::Alltoall | Coll::Gather | Coll::Scatter | Coll::Sendrecv => {
            "copy / n"
        }
        Coll::Broadcast => "copy / (n-1)",
        Coll::Reduce => "add / (n-1)",
        Coll::Barrier => "none",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_follow_the_model() {
        let m = MemBw {
            copy_gbps: 10.0,
            add_gbps: 10.0,
        };
        // 2 ranks: allreduce = 2/(2 (0.1 + 0.1)) = 5.
        let bound = |coll, n, in_place| bound_busbw(coll, n, in_place, m);
        assert!((bound(Coll::Allreduce, 2, false).unwrap() - 5.0).abs() < 1e-9);
        // In place: 3S of 4S copied from peers in 3S / 10 s, busbw 4S/(3S/10) · 3/4.
        assert!((bound(Coll::Allgather, 4, true).unwrap() - 2.5).abs() < 1e-9);
        // Out of place the own blocks add S: 4S copied, busbw 4S/(4S/10) · 3/4.
        assert!((bound(Coll::Allgather, 4, false).unwrap() - 1.875).abs() < 1e-9);
        assert!((bound(Coll::Alltoall, 2, false).unwrap() - 2.5).abs() < 1e-9);
        assert!((bound(Coll::Broadcast, 3, true).unwrap() - 5.0).abs() < 1e-9);
        assert_eq!(bound(Coll::Barrier, 2, false), None);
        assert_eq!(bound(Coll::Allreduce, 1, false), None);
    }

    #[test]
    fn measures_something() {
        let m = measure_both(1, &[], 1 << 20);
        assert!(m.copy_gbps > 0.0 && m.add_gbps > 0.0, "{m:?}");
    }
}
