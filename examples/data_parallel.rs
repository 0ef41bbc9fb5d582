//! A data-parallel training step, as a framework would run it.
//!
//! Each rank holds its own shard of a synthetic linear-regression data set,
//! computes the gradient of the mean squared error on that shard, averages
//! the gradient across ranks with allreduce, and takes the same step. Every
//! rank prints the same, decreasing loss.
//!
//! ```text
//! cargo build --release --example data_parallel
//! ccl-run -n 4 target/release/examples/data_parallel
//! ```

use ccl::{Communicator, ReduceOp};

const DIM: usize = 16;
const SAMPLES_PER_RANK: usize = 256;
const STEPS: usize = 60;
const LEARNING_RATE: f32 = 0.05;

/// A small deterministic generator (xorshift), so the example needs no dependencies.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn main() -> ccl::Result<()> {
    let comm = Communicator::from_env()?;
    let (rank, world) = (comm.rank(), comm.world_size());

    // The true weights are the same everywhere; each rank's samples differ.
    let mut truth_rng = Rng(42);
    let truth: Vec<f32> = (0..DIM).map(|_| truth_rng.next()).collect();
    let mut rng = Rng(1000 + rank as u64);
    let xs: Vec<[f32; DIM]> = (0..SAMPLES_PER_RANK)
        .map(|_| std::array::from_fn(|_| rng.next()))
        .collect();
    let ys: Vec<f32> = xs
        .iter()
        .map(|x| dot(x, &truth) + 0.01 * rng.next())
        .collect();

    let mut w = vec![0.0f32; DIM];
    for step in 0..STEPS {
        // Local gradient of 1/2 mean (x·w - y)^2, plus the local loss sum in the last slot.
        let mut grad = vec![0.0f32; DIM + 1];
        for (x, y) in xs.iter().zip(&ys) {
            let err = dot(x, &w) - y;
            for (g, xi) in grad.iter_mut().zip(x) {
                *g += err * xi / SAMPLES_PER_RANK as f32;
            }
            grad[DIM] += 0.5 * err * err / SAMPLES_PER_RANK as f32;
        }
        // Average gradients (and losses) over all ranks: every rank gets the same numbers.
        comm.allreduce(&mut grad, ReduceOp::Avg)?;
        for (wi, g) in w.iter_mut().zip(&grad) {
            *wi -= LEARNING_RATE * 10.0 * g;
        }
        if step % 10 == 0 || step == STEPS - 1 {
            println!("rank {rank}/{world} step {step:3} loss {:.6}", grad[DIM]);
        }
    }
    comm.barrier()?;
    Ok(())
}

fn dot(a: &[f32; DIM], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}
