//! `ccl-bench bucketer`: fused allreduce of many tensors ([`ccl::Bucketer`])
//! against one allreduce of their total size and one allreduce per tensor.
//!
//! Every rank makes the same `--tensors` f32 tensors with seeded sizes drawn
//! log-uniformly between `--min-size` and `--max-size` (a gradient set has
//! many small tensors and a few large ones). Each timed iteration runs, in
//! turn: the bucketer (tensors handed over in a random order that differs per
//! rank and per iteration, then `finish().wait()`), one allreduce of a buffer
//! of the total size, one `iallreduce` per tensor then a wait for all, and one
//! blocking `allreduce` per tensor. A time is the slowest rank's, averaged
//! over iterations; rank 0 prints the times and the two ratios the issue
//! targets (fused / one allreduce ≤ 1.2; separate / fused ≥ 5). The
//! bucketer is timed in both its forms: owned `Vec`s (reduced where they lie
//! when every rank shares the host and the board carries the bucket, else
//! copied into the buckets and back), and in place (`view_mut` + `mark_ready`, no copy; the gradients
//! are written into the buckets before the clock starts, as the other forms'
//! inputs are filled before it).

use std::{
    ffi::OsString,
    time::{Instant, SystemTime},
};

use ccl::{Bucketer, Communicator, Config, Launcher, Options, ReduceOp, TensorId};

use crate::{
    args::{self, BucketerArgs},
    spawn,
};

/// xorshift64*, the same on every rank.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
    }
}

/// Tensor lengths in f32 elements: log-uniform in [min, max] bytes.
pub fn tensor_lens(n: usize, min: u64, max: u64, seed: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed);
    let (lo, hi) = ((min.max(4) as f64).ln(), (max.max(min).max(4) as f64).ln());
    (0..n)
        .map(|_| {
            let bytes = (lo + (hi - lo) * rng.unit()).exp();
            (bytes / 4.0).round().max(1.0) as usize
        })
        .collect()
}

/// Runs the subcommand: spawns local ranks, or is one rank of a launched job.
pub fn main(args: BucketerArgs, started: SystemTime) -> i32 {
    if args.min_size > args.max_size {
        eprintln!("ccl-bench: --min-size is larger than --max-size (see ccl-bench --help)");
        return 2;
    }
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ccl-bench: {e}");
            return 2;
        }
    };
    if config.launcher == Launcher::None {
        let n = args.ranks.unwrap_or_else(args::default_ranks);
        let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
        return spawn::run_local(n, &argv, args.placement.bind, started);
    }
    if let Some(r) = args.ranks.filter(|&r| r != config.world_size) {
        if config.rank == 0 {
            eprintln!(
                "ccl-bench: --ranks {r} does not match the launcher's world size {}",
                config.world_size
            );
        }
        return 2;
    }
    match run_rank(&args, &config) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ccl-bench: rank {}: {e}", config.rank);
            1
        }
    }
}

/// Seconds of the slowest rank.
fn slowest(comm: &Communicator, secs: f64) -> ccl::Result<f64> {
    let mut v = [secs];
    comm.allreduce(&mut v, ReduceOp::Max)?;
    Ok(v[0])
}

fn run_rank(args: &BucketerArgs, config: &Config) -> Result<(), Box<dyn std::error::Error>> {
    let timeout = args::timeout(args.timeout)?;
    ccl::init_tracing(config.debug.as_deref());
    let store = ccl::rendezvous_store(config, timeout)?;
    let mut options = Options::from_config(config)?;
    options.timeout = timeout;
    options.transport = args::transport(&args.transport);
    let comm = Communicator::new(config.rank, config.world_size, store, options)?;
    let (rank, n) = (comm.rank(), comm.world_size());

    let lens = tensor_lens(args.tensors, args.min_size, args.max_size, args.seed);
    let total: usize = lens.iter().sum();
    let mut bucketer = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(args.cap as usize);
    let ids: Vec<TensorId> = lens
        .iter()
        .map(|&l| bucketer.register::<f32>(l))
        .collect::<ccl::Result<_>>()?;
    let buckets = bucketer.buckets().len();
    // The zero-copy form: gradients live in the buckets.
    let mut inplace = Bucketer::new(&comm, ReduceOp::Sum).with_cap_bytes(args.cap as usize);
    for &l in &lens {
        inplace.register::<f32>(l)?;
    }
    let mut tensors: Vec<Vec<f32>> = lens.iter().map(|&l| vec![1.0f32; l]).collect();
    let mut whole = vec![1.0f32; total];
    let mut order: Vec<usize> = (0..lens.len()).collect();
    let mut rng = Rng::new(args.seed ^ ((rank as u64 + 1) << 32));

    if rank == 0 {
        println!(
            "# ccl-bench bucketer: {n} ranks, transport {}, {} f32 tensors of {}-{} \
             (log-uniform, seed {}), total {} in {buckets} buckets of at most {}, \
             iters {}, warmup {}",
            args.transport,
            lens.len(),
            crate::size::format_size(args.min_size),
            crate::size::format_size(args.max_size),
            args.seed,
            crate::size::format_size(total as u64 * 4),
            crate::size::format_size(args.cap),
            args.iters,
            args.warmup
        );
        println!("# time = mean over iterations of the slowest rank");
    }
    // [fused, one allreduce, separate iallreduce, separate allreduce, fused in place]
    let mut sums = [0.0f64; 5];
    comm.barrier()?;
    for it in 0..args.warmup + args.iters {
        let timed = it >= args.warmup;
        let mut times = [0.0f64; 5];

        // 1. Fused through the bucketer, in a random ready order.
        rng.shuffle(&mut order);
        comm.barrier()?;
        let t0 = Instant::now();
        for &t in &order {
            bucketer.ready(ids[t], std::mem::take(&mut tensors[t]))?;
        }
        let mut out = bucketer.finish().wait()?;
        times[0] = t0.elapsed().as_secs_f64();
        for (t, id) in ids.iter().enumerate() {
            tensors[t] = out.take(*id)?;
        }

        // 1b. Fused in place: gradients written into the buckets (untimed,
        // as the other forms' inputs), then marked ready in a random order.
        for id in &ids {
            inplace.view_mut::<f32>(*id)?.fill(1.0);
        }
        rng.shuffle(&mut order);
        comm.barrier()?;
        let t0 = Instant::now();
        for &t in &order {
            inplace.mark_ready(ids[t])?;
        }
        inplace.finish().wait()?;
        times[4] = t0.elapsed().as_secs_f64();

        // 2. One allreduce of the total size.
        comm.barrier()?;
        let t0 = Instant::now();
        comm.allreduce(&mut whole, ReduceOp::Sum)?;
        times[1] = t0.elapsed().as_secs_f64();

        // 3. One iallreduce per tensor, then wait for all.
        comm.barrier()?;
        let t0 = Instant::now();
        let works: Vec<_> = tensors
            .drain(..)
            .map(|v| comm.iallreduce(v, ReduceOp::Sum))
            .collect();
        for w in works {
            tensors.push(w.wait()?);
        }
        times[2] = t0.elapsed().as_secs_f64();

        // 4. One blocking allreduce per tensor.
        comm.barrier()?;
        let t0 = Instant::now();
        for v in &mut tensors {
            comm.allreduce(v, ReduceOp::Sum)?;
        }
        times[3] = t0.elapsed().as_secs_f64();

        // Keep the values small (they double per allreduce at 2 ranks).
        for v in tensors.iter_mut().chain(std::iter::once(&mut whole)) {
            v.fill(1.0);
        }
        for (i, t) in times.iter().enumerate() {
            let s = slowest(&comm, *t)?;
            if timed {
                sums[i] += s;
            }
        }
    }
    if rank == 0 {
        let ms: Vec<f64> = sums.iter().map(|s| s / args.iters as f64 * 1e3).collect();
        let gbs = |t_ms: f64| total as f64 * 4.0 / (t_ms / 1e3) / 1e9;
        let rows = [
            (format!("fused, owned Vecs ({buckets} buckets)"), ms[0]),
            ("fused in place (view_mut + mark_ready)".to_string(), ms[4]),
            ("one allreduce of the total".to_string(), ms[1]),
            (
                format!("{} separate iallreduces, waited", lens.len()),
                ms[2],
            ),
            (
                format!("{} separate blocking allreduces", lens.len()),
                ms[3],
            ),
        ];
        for (label, t) in rows {
            println!("  {label:<42}{t:>10.3} ms  algbw {:>7.3} GB/s", gbs(t));
        }
        let separate = ms[2].min(ms[3]);
        println!(
            "# fused / one allreduce           = {:.3}  (owned Vecs; target <= 1.2)",
            ms[0] / ms[1]
        );
        println!(
            "# fused in place / one allreduce  = {:.3}  (zero copy; target <= 1.2)",
            ms[4] / ms[1]
        );
        println!(
            "# separate / fused                = {:.2}  (faster of the two separate forms; target >= 5)",
            separate / ms[0]
        );
        println!(
            "# separate / fused in place       = {:.2}",
            separate / ms[4]
        );
        println!(
            "# separate / one allreduce        = {:.2}  (the most any fusion can gain)",
            separate / ms[1]
        );
    }
    Ok(())
}
