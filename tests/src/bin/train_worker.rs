//! One rank of the training helpers' multi-process tests (`ccl::train`):
//! joins from the launcher's variables, then
//!
//! 1. `synchronize`: every rank fills tensors of three element types (one
//!    larger than a broadcast's cap) with values of its own, synchronizes
//!    them and an optimizer's momentum from the last rank, and checks that
//!    it holds the root's values, bit for bit;
//! 2. regression: a few epochs of `DistributedOptimizer` + `Sgd` (momentum)
//!    on a linear regression, each rank on its shuffled share of the data,
//!    checked against one process running the same steps on the whole data.
//!
//! It prints a checksum of the synchronized tensors and the final
//! parameters' bits, which the test compares across ranks, and exits 0 only
//! if every check passed.

use std::process::exit;

use ccl::train::{self, DistributedData, DistributedOptimizer, Optimizer, Sgd};
use ccl::Communicator;

/// Samples of the regression: divisible by 1, 2, 3 and 4 ranks, so that the
/// mean of the ranks' mean gradients is the whole data's.
const SAMPLES: usize = 120;
const DIM: usize = 4;
const EPOCHS: u64 = 8;

fn main() {
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("init failed: {e}");
            exit(3);
        }
    };
    let rank = comm.rank();
    println!(
        "rank {rank}/{}: host_rank {}/{}",
        train::total_workers(&comm),
        comm.host_rank(),
        comm.host_size()
    );
    let result = synchronize(&comm).and_then(|()| regression(&comm));
    match result {
        Ok(()) => println!("rank {rank}: train ok"),
        Err(e) => {
            println!("rank {rank}: train FAILED: {e}");
            exit(1);
        }
    }
}

/// A value that depends on the rank that made it, the tensor and the index.
fn value(rank: usize, tensor: usize, i: usize) -> f64 {
    (rank * 1_000_003 + tensor * 7919 + i) as f64 * 0.25 - 1e5
}

fn fill<T>(rank: usize, lens: &[usize], of: impl Fn(f64) -> T) -> Vec<Vec<T>> {
    lens.iter()
        .enumerate()
        .map(|(t, &len)| (0..len).map(|i| of(value(rank, t, i))).collect())
        .collect()
}

fn check<T: PartialEq + std::fmt::Debug>(
    what: &str,
    got: &[Vec<T>],
    want: &[Vec<T>],
) -> Result<(), String> {
    for (t, (g, w)) in got.iter().zip(want).enumerate() {
        if let Some(i) = (0..w.len()).find(|&i| g[i] != w[i]) {
            return Err(format!(
                "{what} tensor {t}[{i}]: {:?}, the root has {:?}",
                g[i], w[i]
            ));
        }
    }
    Ok(())
}

/// FNV-1a over the bytes of the tensors.
fn checksum(hash: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(hash, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn synchronize(comm: &Communicator) -> Result<(), String> {
    let (rank, root) = (comm.rank(), comm.world_size() - 1);
    // The fourth f32 tensor is larger than a broadcast's cap (25 MiB).
    let f32_lens = [1, 3, 1000, 6_600_000, 17, 0, 5];
    let f64_lens = [2, 100];
    let i32_lens = [10];
    let mut floats = fill(rank, &f32_lens, |v| v as f32);
    let mut doubles = fill(rank, &f64_lens, |v| v);
    let mut ints = fill(rank, &i32_lens, |v| v as i32);
    let err = |e: ccl::Error| e.to_string();
    train::synchronize(comm, &mut slices(&mut floats), root).map_err(err)?;
    train::synchronize(comm, &mut slices(&mut doubles), root).map_err(err)?;
    train::synchronize(comm, &mut slices(&mut ints), root).map_err(err)?;
    check("f32", &floats, &fill(root, &f32_lens, |v| v as f32))?;
    check("f64", &doubles, &fill(root, &f64_lens, |v| v))?;
    check("i32", &ints, &fill(root, &i32_lens, |v| v as i32))?;

    // Momentum that differs between ranks (one local step on gradients of
    // each rank's own), then made the root's.
    let mut sgd = Sgd::<f32>::new(0.1).with_momentum(0.9);
    let mut params = fill(rank, &[3, 4], |v| v as f32);
    let grads = fill(rank, &[3, 4], |v| (v * 1e-3) as f32);
    sgd.step(&mut slices(&mut params), &refs(&grads))
        .map_err(err)?;
    train::synchronize(comm, &mut sgd.state(), root).map_err(err)?;
    let momentum: Vec<Vec<f32>> = sgd.state().iter().map(|v| v.to_vec()).collect();
    check(
        "momentum",
        &momentum,
        &fill(root, &[3, 4], |v| (v * 1e-3) as f32),
    )?;

    let mut hash = 0xcbf2_9ce4_8422_2325;
    for t in &floats {
        hash = checksum(hash, bytemuck::cast_slice(t));
    }
    for t in &doubles {
        hash = checksum(hash, bytemuck::cast_slice(t));
    }
    for t in &ints {
        hash = checksum(hash, bytemuck::cast_slice(t));
    }
    let elements: usize = [&f32_lens[..], &f64_lens, &i32_lens].concat().iter().sum();
    println!(
        "rank {rank}: synchronized {elements} elements from rank {root}, checksum {hash:016x}"
    );
    Ok(())
}

fn slices<T>(tensors: &mut [Vec<T>]) -> Vec<&mut [T]> {
    tensors.iter_mut().map(Vec::as_mut_slice).collect()
}

fn refs<T>(tensors: &[Vec<T>]) -> Vec<&[T]> {
    tensors.iter().map(Vec::as_slice).collect()
}

/// A deterministic value in [-1, 1) for each `i`, the same on every rank.
fn pseudo(i: u64) -> f32 {
    let h = i
        .wrapping_add(1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(29);
    (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
}

struct Sample {
    x: [f32; DIM],
    y: f32,
}

/// Gradients of 1/2 mean (x·w + b - y)^2 over `samples` with respect to w and b.
fn gradients<'a>(
    samples: impl Iterator<Item = &'a Sample>,
    count: usize,
    w: &[f32],
    b: f32,
) -> [Vec<f32>; 2] {
    let (mut gw, mut gb) = (vec![0.0f32; DIM], 0.0f32);
    for s in samples {
        let err = s.x.iter().zip(w).map(|(x, w)| x * w).sum::<f32>() + b - s.y;
        for (g, x) in gw.iter_mut().zip(&s.x) {
            *g += err * x / count as f32;
        }
        gb += err / count as f32;
    }
    [gw, vec![gb]]
}

fn regression(comm: &Communicator) -> Result<(), String> {
    let rank = comm.rank();
    let err = |e: ccl::Error| e.to_string();
    let mut draws = 0u64..;
    let mut next = || pseudo(draws.next().unwrap_or_default());
    let truth: Vec<f32> = (0..DIM).map(|_| next()).collect();
    let samples: Vec<Sample> = (0..SAMPLES)
        .map(|_| {
            let x: [f32; DIM] = std::array::from_fn(|_| next());
            let y = x.iter().zip(&truth).map(|(x, t)| x * t).sum::<f32>() + 0.5 + 0.01 * next();
            Sample { x, y }
        })
        .collect();
    // Each rank starts elsewhere; synchronize makes it rank 0's start.
    let start = |r: usize| -> Vec<Vec<f32>> { vec![vec![r as f32 + 0.5; DIM], vec![-(r as f32)]] };
    let mut params = start(rank);
    train::synchronize(comm, &mut slices(&mut params), 0).map_err(err)?;

    let sgd = || Sgd::<f32>::new(0.3).with_momentum(0.5);
    let mut opt = DistributedOptimizer::new(comm, sgd());
    let mut share = DistributedData::new(comm, &samples).shuffle(11);
    let (mut alone, mut reference) = (sgd(), start(0));
    for epoch in 0..EPOCHS {
        share.set_epoch(epoch);
        let grads = gradients(share.iter(), share.len(), &params[0], params[1][0]);
        opt.step(&mut slices(&mut params), &refs(&grads))
            .map_err(err)?;
        // One process on the whole data, in order.
        let whole = gradients(samples.iter(), SAMPLES, &reference[0], reference[1][0]);
        alone
            .step(&mut slices(&mut reference), &refs(&whole))
            .map_err(err)?;
    }
    let flat = |p: &[Vec<f32>]| p.concat();
    let (got, want) = (flat(&params), flat(&reference));
    let diff = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0f32, f32::max);
    let moved = want
        .iter()
        .zip(flat(&start(0)))
        .map(|(w, s)| (w - s).abs())
        .fold(0.0f32, f32::max);
    let bits: Vec<String> = got.iter().map(|v| format!("{:08x}", v.to_bits())).collect();
    println!(
        "rank {rank}: regression max diff {diff:e}, params {}",
        bits.join(" ")
    );
    if diff > 1e-5 || moved < 0.1 {
        return Err(format!(
            "after {EPOCHS} steps the parameters are {got:?}, one process on the whole data has {want:?} (moved {moved})"
        ));
    }
    Ok(())
}
