//! One rank of a benchmark: connect, run every size (and algorithm), and on
//! rank 0 print the table and write the reports.

use std::{
    io::IsTerminal,
    sync::Arc,
    time::{Instant, SystemTime},
};

use ccl::{
    bf16, f16, Communicator, Config, DataType, Launcher, Options, PrefixStore, ReduceOp, Store,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::{
    args::{self, Plan},
    c2c,
    coll::Coll,
    data::{Case, CaseSpec, Val},
    device::{DeviceCase, OnGpu},
    plot::{self, Series},
    report::{self, Report, Row, RunConfig, Versions},
    size::format_size,
    spawn,
};

/// Test hook: the rank named here exits (status 3) during its first timed iteration.
pub const DIE_RANK_VAR: &str = "CCL_BENCH_TEST_DIE_RANK";

type BoxError = Box<dyn std::error::Error>;

/// Runs this process's rank of `plan`; returns the exit status.
pub fn run(plan: &Plan, config: &Config, started: SystemTime) -> i32 {
    let result = match plan.dtype {
        DataType::I8 => run_typed::<i8>(plan, config, started),
        DataType::U8 => run_typed::<u8>(plan, config, started),
        DataType::I32 => run_typed::<i32>(plan, config, started),
        DataType::U32 => run_typed::<u32>(plan, config, started),
        DataType::I64 => run_typed::<i64>(plan, config, started),
        DataType::U64 => run_typed::<u64>(plan, config, started),
        DataType::F16 => run_typed::<f16>(plan, config, started),
        DataType::Bf16 => run_typed::<bf16>(plan, config, started),
        DataType::F32 => run_typed::<f32>(plan, config, started),
        DataType::F64 => run_typed::<f64>(plan, config, started),
    };
    match result {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("ccl-bench: rank {}: {e}", config.rank);
            1
        }
    }
}

fn launcher_name(l: Launcher) -> &'static str {
    match l {
        Launcher::Torchrun => "torchrun-style (RANK/WORLD_SIZE)",
        Launcher::OpenMpi => "OpenMPI (mpirun)",
        Launcher::Pmi => "PMI",
        Launcher::Slurm => "Slurm (srun)",
        Launcher::None => "none",
    }
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into())
}

/// Every rank's host name, in rank order.
fn hosts(comm: &Communicator) -> Result<Vec<String>, BoxError> {
    const LEN: usize = 64;
    let mut mine = [0u8; LEN];
    let h = hostname();
    let b = &h.as_bytes()[..h.len().min(LEN)];
    mine[..b.len()].copy_from_slice(b);
    let mut all = vec![0u8; LEN * comm.world_size()];
    comm.allgather_into(&mine, &mut all)?;
    Ok(all
        .chunks(LEN)
        .map(|c| {
            let end = c.iter().position(|&x| x == 0).unwrap_or(LEN);
            String::from_utf8_lossy(&c[..end]).into_owned()
        })
        .collect())
}

fn distinct(hosts: &[String]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for h in hosts {
        if !v.contains(h) {
            v.push(h.clone());
        }
    }
    v
}

/// Runs one call of the collective on `case`.
fn run_once<T: Val>(
    comm: &Communicator,
    plan: &Plan,
    case: &mut Case<T>,
) -> Result<(), ccl::Error> {
    let (op, root) = (plan.op, plan.root);
    let (i, o) = (&case.input, &mut case.output);
    match (plan.coll, plan.inplace) {
        (Coll::Allreduce, false) => comm.allreduce_into(i, o, op),
        (Coll::Allreduce, true) => comm.allreduce(o, op),
        (Coll::Broadcast, false) => comm.broadcast_into(i, o, root),
        (Coll::Broadcast, true) => comm.broadcast(o, root),
        (Coll::Reduce, false) => comm.reduce_into(i, o, op, root),
        (Coll::Reduce, true) => comm.reduce(o, op, root),
        (Coll::Allgather, false) => comm.allgather_into(i, o),
        (Coll::Allgather, true) => comm.allgather(o),
        (Coll::ReduceScatter, false) => comm.reduce_scatter_into(i, o, op),
        (Coll::ReduceScatter, true) => comm.reduce_scatter(o, op),
        (Coll::Alltoall, false) => comm.alltoall_into(i, o),
        (Coll::Alltoall, true) => comm.alltoall(o),
        (Coll::Gather, false) => comm.gather_into(i, o, root),
        (Coll::Gather, true) => comm.gather(o, root),
        (Coll::Scatter, false) => comm.scatter_into(i, o, root),
        (Coll::Scatter, true) => comm.scatter(o, root),
        (Coll::Sendrecv, _) => {
            let n = comm.world_size();
            let (next, prev) = ((comm.rank() + 1) % n, (comm.rank() + n - 1) % n);
            comm.sendrecv(i, next, o, prev)
        }
        (Coll::Barrier, _) => comm.barrier(),
    }
}

/// What one size and algorithm measured on this rank.
struct Measured {
    /// Per iteration, the slowest rank's time (rank 0 only).
    slowest: Vec<f64>,
    /// The slowest rank's time for the whole loop, over the iterations
    /// (rank 0 only; see [`report::TIME_DEFINITION`]).
    loop_time: f64,
    /// This rank's own time for the loop, over the iterations.
    mine: f64,
    /// Wrong elements over all ranks (rank 0 only; with --check).
    wrong: u64,
}

/// The GPU a run's buffers live on (`--device cuda`), and a case's there.
type OnDevice<'a> = Option<(&'a OnGpu, &'a DeviceCase)>;

/// One call of the collective, on the host or on the device.
fn call<T: Val>(
    comm: &Communicator,
    plan: &Plan,
    case: &mut Case<T>,
    device: OnDevice<'_>,
) -> Result<(), ccl::Error> {
    match device {
        Some((gpu, dev)) => gpu.run_once::<T>(comm, plan, dev),
        None => run_once(comm, plan, case),
    }
}

/// With checking: puts the case's buffers back (also in device memory).
fn prepare<T: Val>(case: &mut Case<T>, device: OnDevice<'_>) -> Result<(), BoxError> {
    case.prepare();
    match device {
        Some((gpu, dev)) => gpu.upload(dev, case),
        None => Ok(()),
    }
}

fn measure<T: Val>(
    comm: &Communicator,
    plan: &Plan,
    case: &mut Case<T>,
    device: OnDevice<'_>,
    die: bool,
) -> Result<Measured, BoxError> {
    for _ in 0..plan.warmup {
        if plan.check {
            prepare(case, device)?;
        }
        call(comm, plan, case, device)?;
    }
    // Timed as nccl-tests does: the whole loop, from the barrier to the last
    // call's return. One clock read after each call also gives every
    // iteration its time (from the end of the previous one, or with
    // checking from the barrier before it), worked out after the loop: in
    // it, a rank only stores the reading, into memory written beforehand.
    let now = Instant::now();
    let mut ends = vec![now; plan.iters];
    let mut starts = vec![now; if plan.check { plan.iters } else { 0 }];
    let mut wrong = 0u64;
    comm.barrier()?;
    let first = Instant::now();
    for i in 0..plan.iters {
        if plan.check {
            prepare(case, device)?;
            // Checking takes each rank a different time: start together.
            comm.barrier()?;
            starts[i] = Instant::now();
        }
        if die {
            eprintln!(
                "ccl-bench: rank {}: exiting on purpose ({DIE_RANK_VAR})",
                comm.rank()
            );
            std::process::exit(3);
        }
        call(comm, plan, case, device)?;
        ends[i] = Instant::now();
        if plan.check {
            if let Some((gpu, dev)) = device {
                gpu.download(dev, case)?;
            }
            wrong += case.wrong();
        }
    }
    // No rank goes on (to the next size, or out of the run to tear down)
    // before every rank has finished its loop: where ranks share CPUs, a rank
    // that went on would take the CPU from one still timing its calls.
    comm.barrier()?;
    let times: Vec<f64> = (0..plan.iters)
        .map(|i| {
            let start = match (plan.check, i) {
                (true, _) => starts[i],
                (false, 0) => first,
                (false, _) => ends[i - 1],
            };
            (ends[i] - start).as_secs_f64()
        })
        .collect();
    let mine = times.iter().sum::<f64>() / plan.iters as f64;
    let root = comm.rank() == 0;
    let mut slowest = vec![0f64; if root { plan.iters } else { 0 }];
    comm.reduce_into(&times, &mut slowest, ReduceOp::Max, 0)?;
    let mut loop_time = [0f64; 1];
    comm.reduce_into(&[mine], &mut loop_time, ReduceOp::Max, 0)?;
    let mut total = [0u64];
    comm.reduce_into(&[wrong], &mut total, ReduceOp::Sum, 0)?;
    Ok(Measured {
        slowest,
        loop_time: loop_time[0],
        mine,
        wrong: total[0],
    })
}

/// The algorithm a call used (with its piece size if one was asked for),
/// as the table shows it.
fn algo_label(comm: &Communicator, plan: &Plan, count: usize) -> String {
    if plan.gpu.is_some() {
        // How device calls run (known once the first has run).
        let mut coll = ccl::Collective::new(plan.coll.kind(), plan.dtype, count);
        if plan.coll.has_op() {
            coll = coll.with_op(plan.op);
        }
        comm.device_route(&coll).unwrap_or("cuda").into()
    } else if plan.coll == Coll::Sendrecv {
        "p2p".into()
    } else {
        comm.choice_for(plan.coll.kind(), count, plan.dtype)
            .to_string()
    }
}

fn header(
    plan: &Plan,
    n: usize,
    hosts: &[String],
    launcher: &str,
    config: &Config,
    transport: &str,
) -> String {
    let nh = distinct(hosts);
    let host_word = if nh.len() == 1 { "host" } else { "hosts" };
    let mut s = format!(
        "# ccl-bench {}: {n} ranks on {} {host_word} ({}), transport {}, dtype {}{}",
        plan.coll.name(),
        nh.len(),
        nh.join(", "),
        transport,
        plan.dtype,
        plan.op_root_words(),
    );
    s += &format!(
        ", algo {}, {}, iters {}, warmup {}, check {}, timeout {}s\n",
        plan.algo_requested,
        plan.form(),
        plan.iters,
        plan.warmup,
        if plan.check { "on" } else { "off" },
        plan.timeout.as_secs_f64()
    );
    if plan.coll != Coll::Barrier {
        let (lo, hi) = (plan.sizes[0], plan.sizes[plan.sizes.len() - 1]);
        if lo == hi {
            s += &format!("# size {} (", format_size(lo));
        } else {
            s += &format!(
                "# sizes {} .. {} ({} sizes; ",
                format_size(lo),
                format_size(hi),
                plan.sizes.len()
            );
        }
        s += "size = whole buffer";
        if plan.coll.split() {
            s += &format!(" = {n} x per-rank part");
        }
        s += "; K/M/G = 2^10/2^20/2^30)\n";
    }
    let factor = match plan.coll {
        Coll::Allreduce => "2(n-1)/n",
        c if c.split() => "(n-1)/n",
        _ => "1",
    };
    s += &format!(
        "# time = the slowest rank's timed loop / iterations (as nccl-tests times); algbw = size / time (GB/s = 1e9 B/s); \
         busbw = algbw x {factor}\n"
    );
    s += &format!(
        "# ccl-bench {} (ccl {}, {}), launcher: {launcher}, CCL_NSOCKS {}\n",
        env!("CARGO_PKG_VERSION"),
        env!("CARGO_PKG_VERSION"),
        env!("CCL_BENCH_RUSTC"),
        config.knob("CCL_NSOCKS").unwrap_or("1")
    );
    s
}

fn run_typed<T: Val>(plan: &Plan, config: &Config, started: SystemTime) -> Result<bool, BoxError> {
    let (rank, n) = (config.rank, config.world_size);
    let spawned_at: Option<u128> = std::env::var(spawn::T0_VAR)
        .ok()
        .and_then(|v| v.parse().ok());
    let core_to_core = std::env::var(spawn::CORE_TO_CORE_VAR)
        .ok()
        .and_then(|v| c2c::Probe::from_env(&v));
    let launcher = if spawned_at.is_some() {
        let placement = std::env::var(spawn::PLACEMENT_VAR).unwrap_or_default();
        format!("ccl-bench (local processes {placement})")
    } else {
        launcher_name(config.launcher).to_string()
    };

    // ---- set-up: rendezvous and one communicator per algorithm ----------
    ccl::init_tracing(config.debug.as_deref());
    let store = ccl::rendezvous_store(config, plan.timeout)?;
    let mut comms = Vec::with_capacity(plan.algos.len());
    for (i, algo) in plan.algos.iter().enumerate() {
        let mut options = Options::from_config(config)?;
        options.timeout = plan.timeout;
        options.transport = args::transport(&plan.transport);
        options.algo = match algo {
            None => config.algo.clone(),
            Some(a) => Some(format!("{}={a}", plan.coll.kind().name())),
        };
        let scoped: Arc<dyn Store> =
            Arc::new(PrefixStore::new(store.clone(), format!("ccl-bench/{i}")));
        comms.push(Communicator::new(rank, n, scoped, options)?);
    }
    for c in &comms {
        c.barrier()?;
    }
    let ready = SystemTime::now();
    // Setup: from the parent's start (local mode) or each rank's own start.
    let from = spawned_at.unwrap_or_else(|| spawn::epoch_ns(started));
    let mut spans = [
        spawn::epoch_ns(ready).saturating_sub(from) as f64 / 1e9,
        spawn::epoch_ns(started).saturating_sub(from) as f64 / 1e9,
    ];
    comms[0].allreduce(&mut spans, ReduceOp::Max)?;
    let [setup_s, spawn_s] = spans;
    let hosts = hosts(&comms[0])?;
    // How many ranks reach every other rank through shared memory.
    let through_shm = comms[0]
        .transports_used()
        .iter()
        .find(|(name, _)| *name == "shm")
        .map_or(0, |(_, n)| *n);
    let mut shm_peers = [through_shm as u64];
    comms[0].allreduce(&mut shm_peers, ReduceOp::Min)?;
    // And what rank 0 links through, so that RDMA (or its absence) shows.
    let others: Vec<String> = comms[0]
        .transports_used()
        .iter()
        .filter(|(name, _)| *name != "shm")
        .map(|(name, k)| format!(", rank 0: {k} through {name}"))
        .collect();
    let transport = format!(
        "{} ({} of {} peers through shared memory{})",
        plan.transport,
        shm_peers[0],
        n - 1,
        others.concat()
    );
    let is_root = rank == 0;
    let die = std::env::var(DIE_RANK_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        == Some(rank);

    // `--device cuda`: the GPU, and the ceiling its copies set, measured now.
    let gpu = match plan.gpu {
        Some(ordinal) => Some(OnGpu::open(ordinal)?),
        None => None,
    };
    let gpu_line = match &gpu {
        Some(g) => {
            let probe = plan
                .sizes
                .iter()
                .max()
                .map_or(1 << 20, |&b| b.clamp(1 << 20, 1 << 30));
            let copy = g.copy_bandwidth(probe as usize)?;
            format!(
                "# device: {}, calls ordered on a stream; device-to-device copy {copy:.1} GB/s \
                 (bytes read + written, {} copies, measured in this run)\n",
                g.name(),
                format_size(probe)
            )
        }
        None => String::new(),
    };
    if is_root {
        print!("{}", header(plan, n, &hosts, &launcher, config, &transport));
        print!("{gpu_line}");
        if spawned_at.is_some() {
            println!(
                "# setup: {setup_s:.3} s (spawn {spawn_s:.3} s, rendezvous + connect {:.3} s) for {n} ranks",
                setup_s - spawn_s
            );
        } else {
            println!(
                "# setup: {setup_s:.3} s (rendezvous + connect, from process start; launcher not included) for {n} ranks"
            );
        }
        if let Some(p) = core_to_core {
            println!(
                "# core-to-core round trip, measured before the ranks started: {}",
                p.describe()
            );
        }
        println!("#\n{}", report::table_head());
    }

    // ---- the sizes -------------------------------------------------------
    let elem = T::DTYPE.size();
    let mut cases: Vec<(usize, u64)> = Vec::new();
    for &req in &plan.sizes {
        let count = plan.coll.per_rank_count(req, elem, n);
        let bytes = plan.coll.total_bytes(count, elem, n);
        if cases.last().is_none_or(|&(c, _)| c != count) || plan.coll == Coll::Barrier {
            cases.push((count, bytes));
        }
    }
    let steps = (cases.len() * comms.len()) as u64;
    let bar = if is_root && steps > 1 && std::io::stderr().is_terminal() {
        let b = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} sizes [{elapsed}] {msg}")
                .expect("valid template"),
        );
        b
    } else {
        ProgressBar::hidden()
    };

    let bus = plan.coll.bus_factor(n);
    let mut rows: Vec<Row> = Vec::new();
    let mut all_ok = true;
    for &(count, bytes) in &cases {
        let mut case = Case::<T>::new(CaseSpec {
            coll: plan.coll,
            rank,
            world: n,
            count,
            op: plan.op,
            root: plan.root,
            inplace: plan.inplace,
            check: plan.check,
            shared: plan.shared_buffers,
        })?;
        let dev = match &gpu {
            Some(g) => Some(g.case(&case)?),
            None => None,
        };
        let device = gpu.as_ref().zip(dev.as_ref());
        for comm in &comms {
            bar.set_message(format!(
                "{} {}",
                format_size(bytes),
                algo_label(comm, plan, count)
            ));
            let m = measure(comm, plan, &mut case, device, die).map_err(|e| {
                format!("{} of {} failed: {e}", plan.coll.name(), format_size(bytes))
            })?;
            bar.inc(1);
            if !is_root {
                continue;
            }
            let time = m.loop_time;
            let algbw = if time > 0.0 {
                bytes as f64 / 1e9 / time
            } else {
                0.0
            };
            let row = Row {
                size_bytes: bytes,
                count: bytes / elem as u64,
                count_per_rank: count as u64,
                dtype: plan.dtype.name().into(),
                op: plan.op_label(),
                root: plan.root_label(),
                algo: algo_label(comm, plan, count),
                time_us: time * 1e6,
                time_us_rank0: m.mine * 1e6,
                median_time_us: median(&m.slowest) * 1e6,
                min_time_us: m.slowest.iter().copied().fold(f64::INFINITY, f64::min) * 1e6,
                max_time_us: m.slowest.iter().copied().fold(0.0, f64::max) * 1e6,
                iteration_mean_us: m.slowest.iter().sum::<f64>() / plan.iters as f64 * 1e6,
                algbw_gbps: algbw,
                busbw_gbps: algbw * bus,
                wrong: plan.check.then_some(m.wrong),
            };
            if row.wrong.is_some_and(|w| w > 0) {
                all_ok = false;
            }
            bar.suspend(|| println!("{}", report::table_row(&row)));
            rows.push(row);
        }
    }
    bar.finish_and_clear();
    drop(comms);
    if !is_root {
        return Ok(true);
    }
    println!("{}", report::table_tail(&rows));

    let (avg, peak, at) = report::summary(&rows);
    let report = Report {
        tool: "ccl-bench".into(),
        config: RunConfig {
            collective: plan.coll.name().into(),
            ranks: n,
            hosts: distinct(&hosts),
            rank_hosts: hosts.clone(),
            launcher,
            transport: plan.transport.clone(),
            dtype: plan.dtype.name().into(),
            op: plan.op_label(),
            root: plan.root_label(),
            algo_requested: plan.algo_requested.clone(),
            inplace: plan.inplace,
            check: plan.check,
            shared_buffers: plan.shared_buffers,
            iters: plan.iters,
            warmup: plan.warmup,
            timeout_s: plan.timeout.as_secs_f64(),
            nsocks: config.knob_number("CCL_NSOCKS", 1, 1..=64)?,
            sizes_requested: plan.sizes.clone(),
            core_to_core,
            time_definition: report::TIME_DEFINITION.into(),
            size_definition: "bytes of the whole buffer (n x per-rank part for allgather, \
                              reduce-scatter, alltoall, gather, scatter)"
                .into(),
        },
        setup_s,
        rows,
        avg_busbw_gbps: avg,
        peak_busbw_gbps: peak,
        peak_size_bytes: at,
        versions: Versions::current(),
        unix_time: report::unix_time(),
    };
    if let Some(p) = &plan.json {
        report::write_file(p, &report::to_json(&report))?;
    }
    if let Some(p) = &plan.csv {
        report::write_file(p, &report::to_csv(&report))?;
    }
    if let Some(p) = &plan.plot {
        let series = series_by_choice(plan, &report.rows);
        let title = format!(
            "ccl-bench {}: {n} ranks, {}, {}",
            plan.coll.name(),
            plan.dtype,
            plan.transport
        );
        plot::plot_busbw(p, &title, &series)?;
    }
    if !all_ok {
        eprintln!("ccl-bench: --check found wrong results");
    }
    Ok(all_ok)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// One plot line per algorithm run (with `auto`, one line named after the algorithms it chose).
fn series_by_choice(plan: &Plan, rows: &[Row]) -> Vec<Series> {
    let k = plan.algos.len();
    plan.algos
        .iter()
        .enumerate()
        .map(|(i, algo)| {
            let mine: Vec<&Row> = rows.iter().skip(i).step_by(k).collect();
            let label = match algo {
                Some(a) => a.to_string(),
                None => {
                    let used = distinct(&mine.iter().map(|r| r.algo.clone()).collect::<Vec<_>>());
                    format!("ccl auto ({})", used.join(", "))
                }
            };
            Series {
                label,
                points: mine.iter().map(|r| (r.size_bytes, r.busbw_gbps)).collect(),
            }
        })
        .collect()
}
