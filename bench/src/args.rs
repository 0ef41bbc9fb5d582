//! The command line of every subcommand, and its validation into a
//! [`Plan`]. The subcommands' modules depend on this one, never the reverse.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use ccl::{Algorithm, Choice, DataType, ReduceOp};
use clap::{Args, Parser, Subcommand};

use crate::{
    coll::Coll,
    peers::{Link, PeerKind},
    size,
};
use ccl_run::Bind;

/// Default sweep when no size is given.
pub const DEFAULT_MIN_SIZE: u64 = 8;
pub const DEFAULT_MAX_SIZE: u64 = 32 << 20;
/// Default deadline of every call when neither --timeout nor CCL_TIMEOUT is set.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Most ranks ccl-bench spawns by default, and at all.
pub const DEFAULT_MAX_RANKS: usize = 8;
pub const MAX_RANKS: usize = 256;

const AFTER_HELP: &str = "\
Sizes: 8B, 64KB, 256MB, 1GiB... K, M and G are powers of two however written
(256MB = 256MiB = 268435456 bytes, as in nccl-tests). The size is the whole
buffer: for allgather, reduce-scatter, alltoall, gather and scatter that is
n x the per-rank part.

Without a launcher ccl-bench starts --ranks local processes of itself
(torchrun-style variables, a free MASTER_PORT). Under ccl-run, mpirun, srun or
torchrun (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_*) each process joins
as one rank; mpirun on several hosts and PMI also need MASTER_ADDR and
MASTER_PORT (or CCL_STORE_PATH).

Exit status: 0 on success, 1 if a run failed (a rank died, a call failed or
timed out, --check found wrong results), 2 for bad arguments.";

#[derive(Parser, Debug)]
#[command(
    name = "ccl-bench",
    version,
    about = "nccl-tests-style benchmarks of ccl's collectives (and OpenMPI side by side)",
    after_help = AFTER_HELP,
    subcommand_required = true,
    arg_required_else_help = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Every rank gets the reduction of every rank's buffer
    Allreduce(BenchArgs),
    /// The root's buffer is copied to every rank
    Broadcast(BenchArgs),
    /// The root gets the reduction of every rank's buffer
    Reduce(BenchArgs),
    /// Every rank gets every rank's part, in rank order
    Allgather(BenchArgs),
    /// Every rank gets its part of the reduction
    ReduceScatter(BenchArgs),
    /// Part p of every rank's buffer goes to rank p
    Alltoall(BenchArgs),
    /// The root gets every rank's part
    Gather(BenchArgs),
    /// Part p of the root's buffer goes to rank p
    Scatter(BenchArgs),
    /// Ring exchange: each rank sends to rank+1 and receives from rank-1 at once
    Sendrecv(BenchArgs),
    /// Every rank waits for all others (sizes are ignored)
    Barrier(BenchArgs),
    /// Run ccl and its peers (OpenMPI, MPICH, oneCCL, Gloo) interleaved on the same collective, sizes, ranks and links
    Compare(PeersArgs),
    /// Run ccl and OpenMPI (shared memory, and TCP) alternately on the same sizes and ranks
    CompareMpi(CompareArgs),
    /// Fused allreduce of many tensors (ccl::Bucketer) against one allreduce of their total and one per tensor
    Bucketer(BucketerArgs),
    /// Measure every algorithm and write the tuning table ccl picks algorithms from
    Tune(TuneArgs),
}

/// A subcommand that is not one collective's benchmark.
pub enum Other {
    Compare(Box<PeersArgs>),
    CompareMpi(Box<CompareArgs>),
    Bucketer(BucketerArgs),
    Tune(Box<TuneArgs>),
}

impl Cmd {
    /// The collective and arguments of a benchmark subcommand.
    pub fn bench(self) -> Result<(Coll, BenchArgs), Other> {
        Ok(match self {
            Cmd::Allreduce(a) => (Coll::Allreduce, a),
            Cmd::Broadcast(a) => (Coll::Broadcast, a),
            Cmd::Reduce(a) => (Coll::Reduce, a),
            Cmd::Allgather(a) => (Coll::Allgather, a),
            Cmd::ReduceScatter(a) => (Coll::ReduceScatter, a),
            Cmd::Alltoall(a) => (Coll::Alltoall, a),
            Cmd::Gather(a) => (Coll::Gather, a),
            Cmd::Scatter(a) => (Coll::Scatter, a),
            Cmd::Sendrecv(a) => (Coll::Sendrecv, a),
            Cmd::Barrier(a) => (Coll::Barrier, a),
            Cmd::Compare(a) => return Err(Other::Compare(Box::new(a))),
            Cmd::CompareMpi(a) => return Err(Other::CompareMpi(Box::new(a))),
            Cmd::Bucketer(a) => return Err(Other::Bucketer(a)),
            Cmd::Tune(a) => return Err(Other::Tune(Box::new(a))),
        })
    }
}

fn size_arg(s: &str) -> Result<u64, String> {
    size::parse_size(s)
}

fn ranks_arg(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of ranks"))?;
    if n == 0 {
        return Err("must be at least 1".into());
    }
    if n > MAX_RANKS {
        return Err(format!("at most {MAX_RANKS} ranks"));
    }
    Ok(n)
}

fn iters_arg(s: &str) -> Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number"))?;
    if n == 0 {
        return Err("must be at least 1".into());
    }
    Ok(n)
}

fn count_arg(s: &str) -> Result<usize, String> {
    s.trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a whole number"))
}

fn factor_arg(s: &str) -> Result<f64, String> {
    let f: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number"))?;
    if !(f.is_finite() && f > 1.0) {
        return Err("must be a number above 1".into());
    }
    Ok(f)
}

fn timeout_arg(s: &str) -> Result<Duration, String> {
    ccl::config::parse_duration(s)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("'{s}' is not a positive duration like 30, 30s, 500ms or 10m"))
}

fn dtype_arg(s: &str) -> Result<DataType, String> {
    s.parse()
}

fn op_arg(s: &str) -> Result<ReduceOp, String> {
    s.parse()
}

/// Message sizes: one, or a sweep.
#[derive(Args, Debug, Clone)]
pub struct SizeArgs {
    /// One message size (e.g. 256MB; K/M/G are powers of two)
    #[arg(short = 's', long, value_name = "SIZE", value_parser = size_arg,
          allow_hyphen_values = true, conflicts_with_all = ["min_size", "max_size"])]
    pub size: Option<u64>,
    /// First size of a sweep [default: 8B]
    #[arg(short = 'b', long, value_name = "SIZE", value_parser = size_arg, allow_hyphen_values = true)]
    pub min_size: Option<u64>,
    /// Last size of a sweep [default: 32MB]
    #[arg(short = 'e', long, value_name = "SIZE", value_parser = size_arg, allow_hyphen_values = true)]
    pub max_size: Option<u64>,
    /// Each size of a sweep is the previous one times this
    #[arg(short = 'f', long, value_name = "X", default_value = "2", value_parser = factor_arg,
          allow_hyphen_values = true)]
    pub factor: f64,
}

impl SizeArgs {
    pub fn sizes(&self) -> Result<Vec<u64>, String> {
        match self.size {
            Some(s) => Ok(vec![s]),
            None => size::sweep(
                self.min_size.unwrap_or(DEFAULT_MIN_SIZE),
                self.max_size
                    .unwrap_or(DEFAULT_MAX_SIZE.max(self.min_size.unwrap_or(0))),
                self.factor,
            ),
        }
    }
}

/// Where ccl-bench's local ranks run (`--bind`).
#[derive(Args, Debug, Clone, Copy)]
pub struct Placement {
    /// Local ranks: pin rank r to the (r mod n)-th of the n CPUs allowed (core, as mpirun's default), or leave them to the scheduler (none)
    #[arg(
        long,
        value_name = "HOW",
        value_enum,
        default_value = "core",
        hide_possible_values = true
    )]
    pub bind: Bind,
}

/// Flags shared by the benchmarks and compare-mpi.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Ranks to start locally [default: 2, or the number of cores up to 8]; under a launcher, must match it
    #[arg(short = 'N', long, value_name = "N", value_parser = ranks_arg, allow_hyphen_values = true)]
    pub ranks: Option<usize>,
    #[command(flatten)]
    pub placement: Placement,
    /// Element type: i8 u8 i32 u32 i64 u64 f16 bf16 f32 f64
    #[arg(short = 'd', long, value_name = "TYPE", default_value = "f32", value_parser = dtype_arg)]
    pub dtype: DataType,
    /// Reduction op: sum prod min max avg band bor bxor premulsum(X)
    #[arg(short = 'o', long, value_name = "OP", default_value = "sum", value_parser = op_arg)]
    pub op: ReduceOp,
    /// Root rank of broadcast, reduce, gather and scatter
    #[arg(short = 'r', long, value_name = "RANK", default_value = "0", value_parser = count_arg,
          allow_hyphen_values = true)]
    pub root: usize,
    /// Timed iterations per size
    #[arg(short = 'n', long, value_name = "N", default_value = "20", value_parser = iters_arg,
          allow_hyphen_values = true)]
    pub iters: usize,
    /// Untimed iterations before the timed ones
    #[arg(short = 'w', long, value_name = "N", default_value = "5", value_parser = count_arg,
          allow_hyphen_values = true)]
    pub warmup: usize,
    /// Use the in-place form of the collective (output in the input buffer)
    #[arg(long)]
    pub inplace: bool,
    /// Deadline of every call and of the set-up (e.g. 30s, 2m) [default: CCL_TIMEOUT, else 60s]
    #[arg(long, value_name = "DURATION", value_parser = timeout_arg)]
    pub timeout: Option<Duration>,
    /// Write every figure and the run's configuration as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write every figure and the run's configuration as CSV
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Draw bus bandwidth against size (PNG)
    #[arg(long, value_name = "FILE.png")]
    pub plot: Option<PathBuf>,
}

/// Flags of a benchmark subcommand.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub sizes: SizeArgs,
    #[command(flatten)]
    pub common: CommonArgs,
    /// Transport: auto (shared memory between ranks of one host, RDMA or TCP between hosts), one of shm, rdma, tcp, quic, or a list tried in order per pair (shm,quic)
    #[arg(short = 't', long, value_name = "NAME", default_value = "auto")]
    pub transport: String,
    /// Algorithm: auto (ccl's choice), all (each in turn), or one of the collective's algorithms, for a schedule optionally with its piece size (ring/128K)
    #[arg(short = 'a', long, value_name = "ALGO", default_value = "auto")]
    pub algo: String,
    /// Verify every iteration's result against independently computed values
    #[arg(short = 'c', long)]
    pub check: bool,
    /// Where the buffers live: host, or cuda (GPU memory, calls ordered on a stream; CCL_CUDA_STAND_IN=1 imitates a GPU in host memory)
    #[arg(long, value_name = "KIND", default_value = "host", value_parser = ["host", "cuda"])]
    pub device: String,
    /// The GPU of every rank with --device cuda (several ranks may share one)
    #[arg(long, value_name = "ORDINAL", default_value = "0")]
    pub gpu: u32,
    /// Host buffers from ccl::SharedBuffer, which the other local ranks map and copy directly
    #[arg(long)]
    pub shared_buffers: bool,
}

/// What compare and compare-mpi measure.
#[derive(Args, Debug, Clone)]
pub struct CompareTarget {
    /// The collective to compare
    #[arg(value_enum, value_name = "COLLECTIVE")]
    pub collective: Coll,
    #[command(flatten)]
    pub sizes: SizeArgs,
    #[command(flatten)]
    pub common: CommonArgs,
}

impl CompareTarget {
    /// The validated plan of the comparison. Broadcast is compared in
    /// place: every peer's broadcast has one buffer (MPI_Bcast, oneCCL's
    /// and torch's), while ccl's out-of-place form also copies the root's
    /// input to its output.
    pub fn plan(&self) -> Result<Plan, String> {
        let mut plan = common_plan(self.collective, &self.sizes, &self.common)?;
        if plan.coll == Coll::Broadcast {
            plan.inplace = true;
        }
        Ok(plan)
    }

    /// How many local ranks a comparison that starts its own (`what`)
    /// runs with `plan`: refused under a launcher.
    pub fn local_ranks(plan: &Plan, what: &str) -> Result<usize, String> {
        match ccl::Config::from_env() {
            Ok(c) if c.launcher != ccl::Launcher::None => {
                return Err(format!(
                    "{what} starts its own ranks: run it without a launcher"
                ))
            }
            Err(e) => return Err(e.to_string()),
            Ok(_) => {}
        }
        let n = plan.ranks.unwrap_or_else(default_ranks);
        plan.check_world(n)?;
        Ok(n)
    }
}

/// Flags of compare-mpi.
#[derive(Args, Debug, Clone)]
pub struct CompareArgs {
    #[command(flatten)]
    pub target: CompareTarget,
    /// mpirun to launch OpenMPI with
    #[arg(long, value_name = "PATH", default_value = "mpirun")]
    pub mpirun: String,
    /// mpicc to build the OpenMPI benchmark with (into the target directory)
    #[arg(long, value_name = "PATH", default_value = "mpicc")]
    pub mpicc: String,
}

/// Flags of `compare`.
#[derive(Args, Debug, Clone)]
pub struct PeersArgs {
    #[command(flatten)]
    pub target: CompareTarget,
    /// Peers to run beside ccl, comma-separated (each must be installed and run, or the comparison fails)
    #[arg(
        long,
        value_name = "PEER,...",
        value_enum,
        value_delimiter = ',',
        default_value = "openmpi,mpich,oneccl,gloo"
    )]
    pub peers: Vec<PeerKind>,
    /// Links every library is forced onto: shm (shared memory between the local ranks) or tcp (loopback); Gloo has TCP only
    #[arg(
        short = 't',
        long,
        value_name = "LINK",
        value_enum,
        default_value = "shm"
    )]
    pub transport: Link,
    /// ccl's buffers from ccl::SharedBuffer, which the other local ranks map and copy directly (the peers' stay their own)
    #[arg(long)]
    pub shared_buffers: bool,
    /// Rounds per size: each runs ccl and every peer once, in an order rotated per round; the median round counts
    #[arg(long, value_name = "N", default_value = "1", value_parser = positive_arg)]
    pub rounds: usize,
    /// Buffer per thread of the memory-bound measurement (copy and a += b)
    #[arg(long, value_name = "SIZE", default_value = "64MB", value_parser = size_arg)]
    pub membw_size: u64,
    /// OpenMPI's mpicc
    #[arg(long, value_name = "PATH", default_value = "mpicc.openmpi")]
    pub openmpi_mpicc: String,
    /// OpenMPI's mpirun
    #[arg(long, value_name = "PATH", default_value = "mpirun.openmpi")]
    pub openmpi_mpirun: String,
    /// MPICH's mpicc
    #[arg(long, value_name = "PATH", default_value = "mpicc.mpich")]
    pub mpich_mpicc: String,
    /// MPICH's mpirun (Hydra)
    #[arg(long, value_name = "PATH", default_value = "mpirun.mpich")]
    pub mpich_mpirun: String,
    /// Where oneCCL's wheels are installed (a venv: include/, lib/) [default: TARGET/oneccl]
    #[arg(long, value_name = "DIR")]
    pub oneccl: Option<PathBuf>,
    /// A Python with torch, for Gloo [default: TARGET/venv/bin/python]
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
}

/// One benchmark run, validated.
#[derive(Clone, Debug)]
pub struct Plan {
    pub coll: Coll,
    /// Requested sizes in bytes (`[0]` for barrier).
    pub sizes: Vec<u64>,
    pub dtype: DataType,
    pub op: ReduceOp,
    pub root: usize,
    pub iters: usize,
    pub warmup: usize,
    pub inplace: bool,
    pub check: bool,
    /// One entry per algorithm to run; `None` is ccl's own choice.
    pub algos: Vec<Option<Choice>>,
    pub algo_requested: String,
    pub transport: String,
    /// `--device cuda`: the GPU's ordinal; `None`: host memory.
    pub gpu: Option<u32>,
    /// Host buffers from `ccl::SharedBuffer` (`--shared-buffers`).
    pub shared_buffers: bool,
    pub timeout: Duration,
    pub ranks: Option<usize>,
    pub bind: Bind,
    pub json: Option<PathBuf>,
    pub csv: Option<PathBuf>,
    pub plot: Option<PathBuf>,
}

/// Checks that `path` names a PNG file in an existing directory.
pub fn check_plot_path(path: &Path) -> Result<(), String> {
    let png = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !png {
        return Err(format!(
            "--plot {}: only PNG is supported (name the file FILE.png)",
            path.display()
        ));
    }
    check_output_dir("--plot", path)
}

/// Checks that the directory `path` will be written in exists.
pub fn check_output_dir(flag: &str, path: &Path) -> Result<(), String> {
    if path.as_os_str().is_empty() {
        return Err(format!("{flag}: empty file name"));
    }
    if path.is_dir() {
        return Err(format!("{flag} {}: is a directory", path.display()));
    }
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() && !dir.is_dir() => Err(format!(
            "{flag} {}: directory {} does not exist",
            path.display(),
            dir.display()
        )),
        _ => Ok(()),
    }
}

/// The default number of local ranks: 2, or the number of cores up to 8.
pub fn default_ranks() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    cores.clamp(2, DEFAULT_MAX_RANKS)
}

/// The timeout: --timeout, else CCL_TIMEOUT, else [`DEFAULT_TIMEOUT`].
pub fn timeout(flag: Option<Duration>) -> Result<Duration, String> {
    if let Some(t) = flag {
        return Ok(t);
    }
    match std::env::var("CCL_TIMEOUT") {
        Ok(v) => ccl::config::parse_duration(&v)
            .filter(|d| !d.is_zero())
            .ok_or_else(|| format!("CCL_TIMEOUT={v:?} is not a duration like 600, 30s or 10m")),
        Err(_) => Ok(DEFAULT_TIMEOUT),
    }
}

/// The transport `--transport` names: `None` for auto (each pair takes the
/// first transport that can connect it).
pub fn transport(name: &str) -> Option<String> {
    let name = name.trim().to_ascii_lowercase();
    (name != "auto").then_some(name)
}

/// Checks the op against the dtype (for collectives that reduce).
pub fn check_op(coll: Coll, op: ReduceOp, dtype: DataType) -> Result<(), String> {
    if !coll.has_op() {
        return Ok(());
    }
    op.validate(dtype).map_err(|e| {
        let m = e.to_string();
        let m = m.strip_prefix("invalid argument: ").unwrap_or(&m);
        format!("--op {op} with --dtype {dtype}: {m}")
    })
}

fn algos(coll: Coll, requested: &str) -> Result<Vec<Option<Choice>>, String> {
    let have = coll.algorithms();
    let names: Vec<String> = ["auto".to_string(), "all".to_string()]
        .into_iter()
        .chain(
            have.iter()
                .filter(|c| c.piece_bytes.is_none())
                .map(|c| c.to_string()),
        )
        .collect();
    match requested.to_ascii_lowercase().as_str() {
        "auto" => Ok(vec![None]),
        "all" if have.is_empty() => Ok(vec![None]),
        "all" => Ok(have.iter().map(|a| Some(*a)).collect()),
        name => {
            let choice: Choice = name.parse().map_err(|e| {
                format!(
                    "--algo {requested}: {e} ({} has: {}; a schedule takes a piece size as in ring/128K)",
                    coll.name(),
                    names.join(", ")
                )
            })?;
            if !have.iter().any(|c| c.algorithm == choice.algorithm) {
                return Err(format!(
                    "--algo {requested}: {} has no {} algorithm (it has: {})",
                    coll.name(),
                    choice.algorithm,
                    names.join(", ")
                ));
            }
            Ok(vec![Some(choice)])
        }
    }
}

/// Validation shared by the benchmarks and compare-mpi.
pub fn common_plan(coll: Coll, sizes: &SizeArgs, c: &CommonArgs) -> Result<Plan, String> {
    let sizes = if coll == Coll::Barrier {
        vec![0]
    } else {
        sizes.sizes()?
    };
    check_op(coll, c.op, c.dtype)?;
    if coll == Coll::Sendrecv && c.inplace {
        return Err("sendrecv has no in-place form (drop --inplace)".into());
    }
    for (flag, path) in [("--json", &c.json), ("--csv", &c.csv)] {
        if let Some(p) = path {
            check_output_dir(flag, p)?;
        }
    }
    if let Some(p) = &c.plot {
        check_plot_path(p)?;
    }
    Ok(Plan {
        coll,
        sizes,
        dtype: c.dtype,
        op: c.op,
        root: c.root,
        iters: c.iters,
        warmup: c.warmup,
        inplace: c.inplace,
        check: false,
        algos: vec![None],
        algo_requested: "auto".into(),
        transport: "tcp".into(),
        gpu: None,
        shared_buffers: false,
        timeout: timeout(c.timeout)?,
        ranks: c.ranks,
        bind: c.placement.bind,
        json: c.json.clone(),
        csv: c.csv.clone(),
        plot: c.plot.clone(),
    })
}

/// Validates a benchmark subcommand (everything that does not depend on the number of ranks).
pub fn plan(coll: Coll, a: &BenchArgs) -> Result<Plan, String> {
    let mut plan = common_plan(coll, &a.sizes, &a.common)?;
    let transport = a.transport.to_ascii_lowercase();
    let known = ["tcp", "shm", "rdma", "quic"];
    if transport != "auto" && !transport.split(',').all(|t| known.contains(&t.trim())) {
        return Err(format!(
            "--transport {}: not available (expected auto, or one or a list of shm, rdma, tcp, quic)",
            a.transport
        ));
    }
    plan.algos = algos(coll, &a.algo)?;
    if transport != "auto" && !transport.contains("shm") && plan.algos.len() > 1 {
        // `all` without shared memory: no board, so the board algorithms
        // would only measure the fallback again.
        plan.algos.retain(|c| {
            !c.is_some_and(|c| matches!(c.algorithm, Algorithm::Board | Algorithm::BoardDirect))
        });
    }
    plan.transport = transport;
    plan.algo_requested = a.algo.to_ascii_lowercase();
    plan.check = a.check;
    if a.device == "cuda" {
        plan.gpu = Some(a.gpu);
    }
    if a.shared_buffers {
        if plan.gpu.is_some() {
            return Err("--shared-buffers: host buffers only (not --device cuda)".into());
        }
        plan.shared_buffers = true;
    }
    Ok(plan)
}

impl Plan {
    /// ", op sum, root 0": the op and root, where the collective has them.
    pub fn op_root_words(&self) -> String {
        let mut s = String::new();
        if self.coll.has_op() {
            s += &format!(", op {}", self.op);
        }
        if self.coll.has_root() {
            s += &format!(", root {}", self.root);
        }
        s
    }

    /// The op as reports show it: its name, or `none` for collectives without one.
    pub fn op_label(&self) -> String {
        if self.coll.has_op() {
            self.op.to_string()
        } else {
            "none".into()
        }
    }

    /// The root as reports show it: its rank, or -1 for collectives without one.
    pub fn root_label(&self) -> i64 {
        if self.coll.has_root() {
            self.root as i64
        } else {
            -1
        }
    }

    /// "in-place" or "out-of-place".
    pub fn form(&self) -> &'static str {
        if self.inplace {
            "in-place"
        } else {
            "out-of-place"
        }
    }

    /// Validation that needs the number of ranks.
    pub fn check_world(&self, n: usize) -> Result<(), String> {
        if self.coll.has_root() && self.root >= n {
            return Err(format!(
                "--root {} is not below the number of ranks ({n})",
                self.root
            ));
        }
        if self.coll == Coll::Sendrecv && n < 2 {
            return Err("sendrecv needs at least 2 ranks".into());
        }
        Ok(())
    }
}

/// A whole number of at least 1.
fn positive_arg(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("'{s}' is not a whole number")),
    }
}

/// Flags of `ccl-bench bucketer`.
#[derive(Args, Debug, Clone)]
pub struct BucketerArgs {
    /// Number of tensors
    #[arg(long, value_name = "N", default_value = "1000", value_parser = positive_arg)]
    pub tensors: usize,
    /// Smallest tensor
    #[arg(short = 'b', long, value_name = "SIZE", default_value = "4KB", value_parser = size_arg)]
    pub min_size: u64,
    /// Largest tensor
    #[arg(short = 'e', long, value_name = "SIZE", default_value = "1MB", value_parser = size_arg)]
    pub max_size: u64,
    /// Seed of the tensor sizes and of the ready orders
    #[arg(long, value_name = "N", default_value = "1")]
    pub seed: u64,
    /// Bucket capacity
    #[arg(long, value_name = "SIZE", default_value = "25MB", value_parser = size_arg)]
    pub cap: u64,
    /// Ranks to start locally [default: 2, or the number of cores up to 8]; under a launcher, must match it
    #[arg(short = 'N', long, value_name = "N", value_parser = positive_arg)]
    pub ranks: Option<usize>,
    #[command(flatten)]
    pub placement: Placement,
    /// Timed iterations
    #[arg(short = 'n', long, value_name = "N", default_value = "10", value_parser = positive_arg)]
    pub iters: usize,
    /// Untimed iterations before the timed ones
    #[arg(short = 'w', long, value_name = "N", default_value = "2")]
    pub warmup: usize,
    /// Transport: auto, tcp, shm or quic
    #[arg(short = 't', long, value_name = "NAME", default_value = "auto")]
    pub transport: String,
    /// Deadline of every call and of the set-up [default: CCL_TIMEOUT, else 60s]
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| ccl::config::parse_duration(s)
          .filter(|d| !d.is_zero()).ok_or_else(|| format!("'{s}' is not a positive duration")))]
    pub timeout: Option<Duration>,
}

/// Flags of `tune`.
#[derive(Args, Debug, Clone)]
pub struct TuneArgs {
    /// World sizes to measure, comma-separated
    #[arg(
        long = "world-sizes",
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "2,4,8"
    )]
    pub world_sizes: Vec<usize>,
    /// Kinds of links to measure: shm (every rank on this host through shared memory), tcp
    #[arg(
        long,
        value_name = "KIND,...",
        value_delimiter = ',',
        default_value = "shm,tcp"
    )]
    pub links: Vec<String>,
    /// Collectives to measure [default: every one but sendrecv]
    #[arg(long, value_name = "NAME,...", value_delimiter = ',', value_enum)]
    pub collectives: Vec<Coll>,
    #[command(flatten)]
    pub sizes: SizeArgs,
    /// Timed iterations per size and algorithm
    #[arg(short = 'n', long, value_name = "N", default_value = "10")]
    pub iters: usize,
    /// Untimed iterations before the timed ones
    #[arg(short = 'w', long, value_name = "N", default_value = "3")]
    pub warmup: usize,
    /// Runs of each sweep; every point takes the median over them
    #[arg(long, value_name = "N", default_value = "1")]
    pub repeats: usize,
    #[command(flatten)]
    pub placement: Placement,
    /// Write the table here (e.g. algorithms/tuning.table) instead of to stdout
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// With --out: keep the lines of that file which this run does not
    /// measure (other collectives, kinds of links or world sizes)
    #[arg(long, requires = "out")]
    pub merge: bool,
    /// Measure as for a table, but print how much slower the choices of this
    /// table are than the fastest algorithm at each point
    #[arg(long, value_name = "TABLE", conflicts_with = "out")]
    pub check: Option<PathBuf>,
}
