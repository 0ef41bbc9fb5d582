//! The other libraries ccl is compared with, and what running any of them
//! takes: building a peer's benchmark from source embedded in this binary,
//! starting its ranks (under its own launcher, or as local processes placed
//! as ccl-bench places its own), and reading back the one table row every
//! peer benchmark prints in the same format (bench/mpi/ccl_mpi_bench.c's).
//!
//! Peers: OpenMPI and MPICH (bench/mpi/ccl_mpi_bench.c built with each one's
//! mpicc, run by each one's mpirun), oneCCL (bench/peers/ccl_oneccl_bench.cpp
//! built against the headers and library of its wheels, ranks started here
//! with oneCCL's launcher-less variables) and Gloo through torch.distributed
//! (bench/peers/ccl_gloo_bench.py in a Python environment with torch, ranks
//! started here with torchrun's variables).

use std::{
    ffi::OsString,
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use ccl_run::Bind;
use serde::{Deserialize, Serialize};

use crate::{
    args::Plan,
    coll::Coll,
    report::{Report, Row},
    size::format_size,
};

/// The MPI benchmark's source (OpenMPI and MPICH).
pub const MPI_SOURCE: &str = include_str!("../mpi/ccl_mpi_bench.c");
/// The oneCCL benchmark's source.
pub const ONECCL_SOURCE: &str = include_str!("../peers/ccl_oneccl_bench.cpp");
/// The Gloo benchmark (torch.distributed).
pub const GLOO_SOURCE: &str = include_str!("../peers/ccl_gloo_bench.py");

/// One peer's measurement of one size: the row its benchmark printed.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PeerRow {
    pub size_bytes: u64,
    pub count: u64,
    pub time_us: f64,
    /// Median iteration (the slowest rank's time).
    #[serde(default)]
    pub median_time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

/// Why a job gave no result.
#[derive(Debug)]
pub enum JobError {
    /// It was still running at its limit and was killed.
    TimedOut(String),
    /// Anything else: it could not start or be waited for, it failed, or it
    /// printed no result.
    Failed(String),
}

impl From<String> for JobError {
    fn from(message: String) -> Self {
        JobError::Failed(message)
    }
}

impl From<JobError> for String {
    fn from(e: JobError) -> Self {
        match e {
            JobError::TimedOut(m) | JobError::Failed(m) => m,
        }
    }
}

/// Runs every command of a job at once to completion (at most `limit`):
/// returns whether all succeeded, the first one's stdout, and every one's
/// stderr. The first failure stops the others (killed), as ccl-bench's own
/// ranks; commands are killed with this process too.
pub fn run_group(
    mut cmds: Vec<Command>,
    limit: Duration,
) -> Result<(bool, String, String), JobError> {
    let what = cmds
        .first()
        .map_or_else(String::new, |c| format!("{:?}", c.get_program()));
    let mut children: Vec<Child> = Vec::with_capacity(cmds.len());
    let mut readers = Vec::new();
    let kill_all = |children: &mut Vec<Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    for (i, cmd) in cmds.iter_mut().enumerate() {
        cmd.stdin(Stdio::null())
            .stdout(if i == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped());
        ccl_run::die_with_parent(cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(format!("cannot run {:?}: {e}", cmd.get_program()).into());
            }
        };
        let pipes: Vec<Box<dyn Read + Send>> = [
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn Read + Send>),
        ]
        .into_iter()
        .flatten()
        .collect();
        for (k, mut pipe) in pipes.into_iter().enumerate() {
            let is_out = i == 0 && k == 0;
            readers.push((
                is_out,
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = pipe.read_to_string(&mut s);
                    s
                }),
            ));
        }
        children.push(child);
    }
    let deadline = Instant::now() + limit;
    let mut done = vec![false; children.len()];
    let ok = loop {
        let mut failed = false;
        for (c, d) in children.iter_mut().zip(done.iter_mut()) {
            if *d {
                continue;
            }
            match c.try_wait() {
                Ok(Some(s)) => {
                    *d = true;
                    failed |= !s.success();
                }
                Ok(None) => {}
                Err(e) => {
                    kill_all(&mut children);
                    return Err(format!("cannot wait for {what}: {e}").into());
                }
            }
        }
        if failed {
            kill_all(&mut children);
            break false;
        }
        if done.iter().all(|d| *d) {
            break true;
        }
        if Instant::now() >= deadline {
            kill_all(&mut children);
            return Err(JobError::TimedOut(format!(
                "{what} did not finish within {:.0} s; killed it",
                limit.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let (mut out, mut err) = (String::new(), String::new());
    for (is_out, r) in readers {
        let text = r.join().unwrap_or_default();
        if is_out {
            out = text;
        } else {
            err.push_str(&text);
        }
    }
    Ok((ok, out, err))
}

/// Runs `cmd` to completion (at most `limit`), returning (success, stdout, stderr).
pub fn run_captured(cmd: Command, limit: Duration) -> Result<(bool, String, String), JobError> {
    run_group(vec![cmd], limit)
}

/// The last `lines` non-empty lines of `s`.
pub fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Where peer benchmarks are built: next to this executable (the target
/// directory), else in the temporary directory.
fn build_dir() -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("ccl-bench-peers")));
    if let Some(d) = beside {
        if std::fs::create_dir_all(&d).is_ok() {
            return d;
        }
    }
    let d = std::env::temp_dir().join("ccl-bench-peers");
    let _ = std::fs::create_dir_all(&d);
    d
}

/// A short hash of `parts`, naming what is built from them.
fn tag(parts: &[&str]) -> String {
    let h = parts
        .iter()
        .flat_map(|p| p.bytes().chain([0]))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{h:016x}")
}

/// Writes `source` next to where `name` is built (once per source and
/// compiler command); returns the program's path.
pub fn build(
    name: &str,
    source: &str,
    ext: &str,
    compiler: &str,
    flags: &[String],
    missing: &str,
) -> Result<PathBuf, String> {
    let dir = build_dir();
    let mut parts = vec![source, compiler];
    parts.extend(flags.iter().map(String::as_str));
    let bin = dir.join(format!("{name}-{}", tag(&parts)));
    if bin.is_file() {
        return Ok(bin);
    }
    let pid = std::process::id();
    let src = dir.join(format!("{name}-{pid}.{ext}"));
    let tmp = dir.join(format!("{name}-{pid}.tmp"));
    std::fs::write(&src, source).map_err(|e| format!("cannot write {}: {e}", src.display()))?;
    let out = Command::new(compiler)
        .arg("-O2")
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .args(flags)
        .stdin(Stdio::null())
        .output();
    let _ = std::fs::remove_file(&src);
    let out = match out {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("{compiler} not found: {missing}"))
        }
        Err(e) => return Err(format!("cannot run {compiler}: {e}")),
    };
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "{compiler} failed to build {name}: {}",
            tail(&String::from_utf8_lossy(&out.stderr), 5)
        ));
    }
    std::fs::rename(&tmp, &bin).map_err(|e| format!("cannot move {}: {e}", tmp.display()))?;
    Ok(bin)
}

/// Writes a script (once per content) where peer benchmarks are built.
fn write_script(name: &str, source: &str) -> Result<PathBuf, String> {
    let path = build_dir().join(format!("{name}-{}.py", tag(&[source])));
    if !path.is_file() {
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        std::fs::write(&tmp, source)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(path)
}

/// Parses the one result row of a peer benchmark's table (and the
/// statistics line `-v` prints after it). Other lines are skipped: oneCCL
/// writes its warnings to stdout.
pub fn parse_row(stdout: &str) -> Option<PeerRow> {
    let mut lines = stdout.lines();
    let (f, time_us) = lines.by_ref().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let numeric = f.first()?.parse::<u64>().is_ok();
        let time_us: f64 = f.get(6)?.parse().ok()?;
        (numeric && f.len() >= 10).then_some((f, time_us))
    })?;
    let median_time_us = lines
        .next()
        .and_then(|l| l.split("median ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(time_us);
    Some(PeerRow {
        size_bytes: f[0].parse().ok()?,
        count: f[1].parse().ok()?,
        time_us,
        median_time_us,
        algbw_gbps: f[7].parse().ok()?,
        busbw_gbps: f[8].parse().ok()?,
    })
}

/// The `# library: ...` line a peer benchmark prints.
pub fn parse_library(stdout: &str) -> Option<String> {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("# library: "))
        .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// The arguments of a peer benchmark for one size (the same for every peer).
pub fn bench_args(plan: &Plan, bytes: u64) -> Vec<String> {
    let b = bytes.max(1).to_string();
    let mut v: Vec<String> = vec![
        plan.coll.name().into(),
        "-b".into(),
        b.clone(),
        "-e".into(),
        b,
    ];
    for (flag, value) in [
        ("-n", plan.iters.to_string()),
        ("-w", plan.warmup.to_string()),
        ("-d", plan.dtype.name().to_string()),
        ("-o", plan.op.name().to_string()),
        ("-r", plan.root.to_string()),
    ] {
        v.push(flag.into());
        v.push(value);
    }
    v.push("-v".into());
    if plan.inplace {
        v.push("-i".into());
    }
    v
}

/// Runs `cmds` (one job) and reads its row; `who` names it in errors.
pub fn run_bench(
    who: &str,
    cmds: Vec<Command>,
    bytes: u64,
    limit: Duration,
) -> Result<(PeerRow, Option<String>), JobError> {
    let (ok, out, err) = run_group(cmds, limit)?;
    if !ok {
        let why = if err.trim().is_empty() { &out } else { &err };
        return Err(format!(
            "the {who} run of {} failed: {}",
            format_size(bytes),
            tail(why, 6)
        )
        .into());
    }
    let row = parse_row(&out).ok_or_else(|| {
        format!(
            "the {who} run of {} printed no result row: {}",
            format_size(bytes),
            tail(&out, 4)
        )
    })?;
    Ok((row, parse_library(&out)))
}

/// One fresh ccl run of one size: ccl-bench itself in local mode.
pub fn run_ccl(
    plan: &Plan,
    n: usize,
    transport: &str,
    bytes: u64,
    limit: Duration,
) -> Result<Row, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find its own executable: {e}"))?;
    let json = std::env::temp_dir().join(format!(
        "ccl-bench-compare-{}-{bytes}.json",
        std::process::id()
    ));
    let mut cmd = Command::new(exe);
    cmd.arg(plan.coll.name());
    if plan.coll != Coll::Barrier {
        cmd.args(["--size", &format!("{bytes}B")]);
    }
    cmd.args(["--ranks", &n.to_string()])
        .args(["--bind", plan.bind.name()])
        .args(["--transport", transport])
        .args(["--dtype", plan.dtype.name()])
        .args(["--op", &plan.op.to_string()])
        .args(["--root", &plan.root.to_string()])
        .args(["--iters", &plan.iters.to_string()])
        .args(["--warmup", &plan.warmup.to_string()])
        .args(["--timeout", &format!("{}s", plan.timeout.as_secs_f64())])
        .arg("--json")
        .arg(&json);
    if plan.inplace {
        cmd.arg("--inplace");
    }
    if plan.shared_buffers {
        cmd.arg("--shared-buffers");
    }
    let result = run_captured(cmd, limit);
    let text = std::fs::read_to_string(&json);
    let _ = std::fs::remove_file(&json);
    let (ok, _out, err) = result?;
    if !ok {
        return Err(format!(
            "the ccl run of {} failed: {}",
            format_size(bytes),
            tail(&err, 5)
        ));
    }
    let report: Report = text
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| {
            format!(
                "the ccl run of {} wrote no usable JSON: {e}",
                format_size(bytes)
            )
        })?;
    report
        .rows
        .into_iter()
        .next()
        .ok_or_else(|| format!("the ccl run of {} reported no row", format_size(bytes)))
}

fn is_root_user() -> bool {
    nix::unistd::geteuid().is_root()
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |c| c.get())
}

/// How OpenMPI moves data between the local ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OmpiNet {
    /// OpenMPI's own choice (shared memory between local ranks).
    Defaults,
    /// ob1 with the shared-memory BTL only (`vader`) and `self`.
    Shm,
    /// ob1 with the TCP BTL over loopback and `self`.
    Tcp,
}

/// OpenMPI's mpirun arguments before the program: `--oversubscribe` when
/// there are more ranks than cores, the binding ccl's ranks get
/// (`--bind-to core`, with `:overload-allowed` when oversubscribed, places
/// rank r on the (r mod cores)-th core as ccl-bench does; OpenMPI's own
/// default would not bind at all when oversubscribed), `--allow-run-as-root`
/// for root, and the BTLs of `net`.
pub fn ompi_args(n: usize, bind: Bind, net: OmpiNet) -> Vec<String> {
    let mut v = vec!["-np".to_string(), n.to_string()];
    let over = n > cores();
    if over {
        v.push("--oversubscribe".into());
    }
    v.push("--bind-to".into());
    v.push(match (bind, over) {
        (Bind::None, _) => "none".into(),
        (Bind::Core, false) => "core".into(),
        (Bind::Core, true) => "core:overload-allowed".into(),
    });
    if is_root_user() {
        v.push("--allow-run-as-root".into());
    }
    let btl: &[&str] = match net {
        OmpiNet::Defaults => &[],
        OmpiNet::Shm => &["--mca", "pml", "ob1", "--mca", "btl", "self,vader"],
        OmpiNet::Tcp => &[
            "--mca",
            "pml",
            "ob1",
            "--mca",
            "btl",
            "tcp,self",
            "--mca",
            "btl_tcp_if_include",
            "lo",
        ],
    };
    v.extend(btl.iter().map(|s| s.to_string()));
    v
}

/// The links `compare` forces every library onto.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Link {
    /// Shared memory between the local ranks
    Shm,
    /// TCP over loopback
    Tcp,
}

impl Link {
    pub fn name(self) -> &'static str {
        match self {
            Link::Shm => "shm",
            Link::Tcp => "tcp",
        }
    }
}

/// A library ccl is compared with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PeerKind {
    /// OpenMPI (mpicc.openmpi, mpirun.openmpi)
    Openmpi,
    /// MPICH (mpicc.mpich, mpirun.mpich)
    Mpich,
    /// Intel oneCCL, from its PyPI wheels
    Oneccl,
    /// Gloo, through torch.distributed
    Gloo,
}

impl PeerKind {
    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Openmpi => "openmpi",
            PeerKind::Mpich => "mpich",
            PeerKind::Oneccl => "oneccl",
            PeerKind::Gloo => "gloo",
        }
    }

    /// Whether the peer's benchmark has the plan's collective, type and op.
    pub fn supports(self, plan: &Plan) -> Result<(), String> {
        let name = self.name();
        // oneCCL and the Gloo script have no gather, scatter or sendrecv.
        let missing = matches!(self, PeerKind::Oneccl | PeerKind::Gloo)
            && matches!(plan.coll, Coll::Gather | Coll::Scatter | Coll::Sendrecv);
        if missing {
            return Err(format!("the {name} benchmark has no {}", plan.coll.name()));
        }
        let dtypes: &[&str] = match self {
            PeerKind::Openmpi | PeerKind::Mpich | PeerKind::Oneccl => {
                &["i8", "u8", "i32", "u32", "i64", "u64", "f32", "f64"]
            }
            PeerKind::Gloo => &["i8", "u8", "i32", "i64", "f32", "f64"],
        };
        if !dtypes.contains(&plan.dtype.name()) {
            return Err(format!(
                "--dtype {}: {name} has no such type here (it has: {})",
                plan.dtype,
                dtypes.join(", ")
            ));
        }
        let ops: &[&str] = match self {
            PeerKind::Openmpi | PeerKind::Mpich => {
                &["sum", "prod", "min", "max", "band", "bor", "bxor"]
            }
            PeerKind::Oneccl | PeerKind::Gloo => &["sum", "prod", "min", "max"],
        };
        if plan.coll.has_op() && !ops.contains(&plan.op.name()) {
            return Err(format!(
                "--op {}: {name} has no such op here (it has: {})",
                plan.op,
                ops.join(", ")
            ));
        }
        if plan.inplace
            && matches!(self, PeerKind::Oneccl | PeerKind::Gloo)
            && !matches!(plan.coll, Coll::Allreduce | Coll::Reduce | Coll::Broadcast)
        {
            return Err(format!(
                "--inplace: the {name} benchmark has in-place forms of allreduce, reduce and broadcast only"
            ));
        }
        Ok(())
    }
}

/// Where each peer's tools are.
#[derive(Clone, Debug)]
pub struct PeerTools {
    pub openmpi_mpicc: String,
    pub openmpi_mpirun: String,
    pub mpich_mpicc: String,
    pub mpich_mpirun: String,
    /// The environment oneCCL's wheels are installed in (lib/, include/).
    pub oneccl: PathBuf,
    /// A Python with torch.
    pub python: PathBuf,
}

/// A peer ready to run: its benchmark built, its launch settled.
pub struct Peer {
    pub kind: PeerKind,
    /// The benchmark (a program, or the Gloo script).
    program: PathBuf,
    /// The launcher and its arguments before the program (MPI peers), or
    /// the interpreter (Gloo); empty when the ranks are started here.
    launcher: Vec<String>,
    /// Variables every rank gets.
    env: Vec<(String, String)>,
    /// How the ranks are started, in words, for the header and the JSON.
    pub launch: String,
    /// The library's own words for its version, once it has run.
    pub version: Option<String>,
}

/// The directory this program was built into, one level up (`target/`).
pub fn target_dir() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()?
        .parent()?
        .parent()
        .map(Path::to_path_buf)
}

fn set_unless_given(env: &mut Vec<(String, String)>, key: &str, value: String) {
    if std::env::var_os(key).is_none() {
        env.push((key.into(), value));
    }
}

fn env_words(env: &[(String, String)]) -> String {
    env.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Peer {
    /// Builds the peer's benchmark and settles how it is launched for
    /// `n` ranks placed as `bind` says over `link`.
    pub fn prepare(
        kind: PeerKind,
        tools: &PeerTools,
        n: usize,
        bind: Bind,
        link: Link,
    ) -> Result<Peer, String> {
        let cpus = bind
            .cpus()
            .map_err(|e| format!("--bind core: cannot read the CPUs it may use: {e}"))?;
        let mut env: Vec<(String, String)> = Vec::new();
        let (program, launcher, launch) = match kind {
            PeerKind::Openmpi => {
                let bin = build(
                    "ccl_mpi_bench-openmpi",
                    MPI_SOURCE,
                    "c",
                    &tools.openmpi_mpicc,
                    &[],
                    "install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) or pass --openmpi-mpicc",
                )?;
                let net = match link {
                    Link::Shm => OmpiNet::Shm,
                    Link::Tcp => OmpiNet::Tcp,
                };
                let mut l = vec![tools.openmpi_mpirun.clone()];
                l.extend(ompi_args(n, bind, net));
                let words = l.join(" ");
                (bin, l, words)
            }
            PeerKind::Mpich => {
                let bin = build(
                    "ccl_mpi_bench-mpich",
                    MPI_SOURCE,
                    "c",
                    &tools.mpich_mpicc,
                    &[],
                    "install MPICH (apt-get install mpich libmpich-dev) or pass --mpich-mpicc",
                )?;
                // Hydra binds rank r to core r (round robin when oversubscribed).
                let mut l = vec![tools.mpich_mpirun.clone(), "-n".into(), n.to_string()];
                l.push("-bind-to".into());
                l.push(match bind {
                    Bind::Core => "core".into(),
                    Bind::None => "none".into(),
                });
                if link == Link::Tcp {
                    // ch4: no shared memory between local ranks; UCX over TCP on loopback.
                    env.push(("MPIR_CVAR_NOLOCAL".into(), "1".into()));
                    env.push(("UCX_TLS".into(), "tcp,self".into()));
                    env.push(("UCX_NET_DEVICES".into(), "lo".into()));
                }
                let words = format!("{} {}", env_words(&env), l.join(" "));
                (bin, l, words.trim().to_string())
            }
            PeerKind::Oneccl => {
                let root = &tools.oneccl;
                let (inc, lib) = (root.join("include"), root.join("lib"));
                if !inc.join("oneapi").join("ccl.hpp").is_file() {
                    return Err(format!(
                        "oneCCL is not installed in {} (no include/oneapi/ccl.hpp): \
                         python3 -m venv {0} && {0}/bin/pip install oneccl==2022.1.2 oneccl-devel==2022.1.2, or pass --oneccl DIR",
                        root.display()
                    ));
                }
                let flags = vec![
                    "-std=c++17".to_string(),
                    format!("-I{}", inc.display()),
                    format!("-L{}", lib.display()),
                    "-lccl".into(),
                    format!("-Wl,-rpath,{}", lib.display()),
                ];
                let bin = build(
                    "ccl_oneccl_bench",
                    ONECCL_SOURCE,
                    "cpp",
                    "c++",
                    &flags,
                    "install a C++ compiler (apt-get install g++)",
                )?;
                // oneCCL's own environment, kept to its processes: its
                // libraries (libccl.so is oneCCL's; ccl's is libcclrs) and
                // libfabric's providers from the wheels.
                let lib_s = lib.display().to_string();
                env.push(("LD_LIBRARY_PATH".into(), lib_s.clone()));
                env.push(("FI_PROVIDER_PATH".into(), lib_s));
                env.push(("CCL_ROOT".into(), root.display().to_string()));
                env.push(("CCL_PROCESS_LAUNCHER".into(), "none".into()));
                env.push(("CCL_LOCAL_SIZE".into(), n.to_string()));
                match link {
                    // Intra-node messages through libfabric's shm provider.
                    Link::Shm => env.push(("CCL_ATL_SHM".into(), "1".into())),
                    Link::Tcp => {
                        env.push(("FI_PROVIDER".into(), "tcp".into()));
                        env.push(("FI_TCP_IFACE".into(), "lo".into()));
                    }
                }
                // Each rank has one CPU: progress in the calling thread (a
                // worker thread on the same CPU made every call ~10 ms).
                set_unless_given(&mut env, "CCL_WORKER_OFFLOAD", "0".into());
                if !cpus.is_empty() {
                    let list: Vec<String> = (0..n)
                        .filter_map(|r| ccl_run::cpu_of(r, &cpus).map(|c| c.to_string()))
                        .collect();
                    set_unless_given(&mut env, "CCL_WORKER_AFFINITY", list.join(","));
                }
                let words = format!(
                    "{n} local processes ({}), {}",
                    ccl_run::describe_binding(bind, n, &cpus),
                    env_words(&env)
                );
                (bin, Vec::new(), words)
            }
            PeerKind::Gloo => {
                let script = write_script("ccl_gloo_bench", GLOO_SOURCE)?;
                let py = tools.python.display().to_string();
                let probe = Command::new(&tools.python)
                    .args([
                        "-c",
                        "import torch.distributed as d; assert d.is_gloo_available()",
                    ])
                    .stdin(Stdio::null())
                    .output();
                match probe {
                    Ok(o) if o.status.success() => {}
                    Ok(o) => {
                        return Err(format!(
                            "{py} has no torch with gloo: {} (python3 -m venv target/venv && target/venv/bin/pip install torch, or pass --python)",
                            tail(&String::from_utf8_lossy(&o.stderr), 2)
                        ))
                    }
                    Err(e) => {
                        return Err(format!(
                            "cannot run {py}: {e} (python3 -m venv target/venv && target/venv/bin/pip install torch, or pass --python)"
                        ))
                    }
                }
                env.push(("MASTER_ADDR".into(), "127.0.0.1".into()));
                env.push(("GLOO_SOCKET_IFNAME".into(), "lo".into()));
                set_unless_given(&mut env, "OMP_NUM_THREADS", "1".into());
                let words = format!(
                    "{n} local processes of {py} ({}), env:// rendezvous, {} (gloo has TCP only)",
                    ccl_run::describe_binding(bind, n, &cpus),
                    env_words(&env)
                );
                (script, vec![py, "-u".into()], words)
            }
        };
        Ok(Peer {
            kind,
            program,
            launcher,
            env,
            launch,
            version: None,
        })
    }

    /// The commands of one run of `args` on `n` ranks placed as `bind` says,
    /// and the file to remove after it (oneCCL's KVS address).
    fn commands(
        &self,
        n: usize,
        bind: Bind,
        args: &[String],
    ) -> Result<(Vec<Command>, Option<PathBuf>), String> {
        match self.kind {
            PeerKind::Openmpi | PeerKind::Mpich => {
                let mut cmd = Command::new(&self.launcher[0]);
                cmd.args(&self.launcher[1..])
                    .arg(&self.program)
                    .args(args)
                    .envs(self.env.iter().map(|(k, v)| (k, v)));
                Ok((vec![cmd], None))
            }
            PeerKind::Oneccl | PeerKind::Gloo => {
                let cpus = bind
                    .cpus()
                    .map_err(|e| format!("--bind core: cannot read the CPUs it may use: {e}"))?;
                let port = ccl::free_port()
                    .map_err(|e| format!("cannot find a free port for the rendezvous: {e}"))?;
                let kvs = std::env::temp_dir().join(format!(
                    "ccl-bench-oneccl-{}-{port}.kvs",
                    std::process::id()
                ));
                let mut cmds = Vec::with_capacity(n);
                for r in 0..n {
                    let mut cmd = match self.launcher.split_first() {
                        Some((first, rest)) => {
                            let mut c = Command::new(first);
                            c.args(rest).arg(&self.program);
                            c
                        }
                        None => Command::new(&self.program),
                    };
                    cmd.args(args)
                        .envs(self.env.iter().map(|(k, v)| (k, v)))
                        .env("RANK", r.to_string())
                        .env("WORLD_SIZE", n.to_string())
                        .env("LOCAL_RANK", r.to_string())
                        .env("LOCAL_WORLD_SIZE", n.to_string())
                        .env("MASTER_PORT", port.to_string())
                        .env("CCL_LOCAL_RANK", r.to_string())
                        .env("CCL_BENCH_KVS_FILE", OsString::from(kvs.as_os_str()));
                    if let Some(cpu) = ccl_run::cpu_of(r, &cpus) {
                        ccl_run::pin_to_cpu(&mut cmd, cpu);
                    }
                    cmds.push(cmd);
                }
                Ok((cmds, Some(kvs)))
            }
        }
    }

    /// One fresh run of one size.
    pub fn run(
        &mut self,
        plan: &Plan,
        n: usize,
        bytes: u64,
        limit: Duration,
    ) -> Result<PeerRow, JobError> {
        let (cmds, scratch) = self.commands(n, plan.bind, &bench_args(plan, bytes))?;
        let result = run_bench(self.kind.name(), cmds, bytes, limit);
        if let Some(f) = scratch {
            // Whatever happened (rank 0 writes it, then renames it).
            let _ = std::fs::remove_file(&f);
            let _ = std::fs::remove_file(f.with_extension("kvs.tmp"));
        }
        let (mut row, version) = result?;
        // The printed bandwidths have three decimals (0.000 at 8 B): derive
        // them from the time instead, as ccl-bench does.
        if row.time_us > 0.0 {
            row.algbw_gbps = row.size_bytes as f64 / (row.time_us * 1e3);
            row.busbw_gbps = row.algbw_gbps * plan.coll.bus_factor(n);
        }
        if self.version.is_none() {
            self.version = version;
        }
        Ok(row)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_past_its_limit_is_killed_and_told_apart() {
        let started = Instant::now();
        let mut sleep = Command::new("sleep");
        sleep.arg("30");
        match run_group(
            vec![sleep, Command::new("true")],
            Duration::from_millis(200),
        ) {
            Err(JobError::TimedOut(m)) => assert!(m.contains("did not finish"), "{m}"),
            other => panic!("expected a time-out, got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(10));
        let (ok, _, _) = run_group(vec![Command::new("false")], Duration::from_secs(10)).unwrap();
        assert!(!ok);
        match run_captured(Command::new("/nonexistent/peer"), Duration::from_secs(1)) {
            Err(JobError::Failed(m)) => assert!(m.contains("cannot run"), "{m}"),
            other => panic!("expected a failure to start, got {other:?}"),
        }
    }

    #[test]
    fn parses_a_peer_table() {
        let out = "2026:11:25-08:54:01:14818 |CCL_WARN| value of CCL_WORKER_OFFLOAD changed\n\
                   # ccl_mpi_bench allreduce: 2 ranks\n# library: Open MPI v4.1.4\n#  size ...\n\
                   \x20      1048576       262144    f32    sum    -1        mpi       391.26    2.680    2.680     N/A\n\
                   #  per iteration (slowest rank): median 380.50 us, min 370.00 us, max 500.00 us\n\
                   # Avg bus bandwidth    : 2.680 GB/s\n";
        let r = parse_row(out).unwrap();
        assert_eq!(r.size_bytes, 1 << 20);
        assert_eq!(r.count, 262144);
        assert_eq!(r.time_us, 391.26);
        assert_eq!(r.busbw_gbps, 2.68);
        assert_eq!(r.median_time_us, 380.5);
        assert_eq!(parse_library(out).as_deref(), Some("Open MPI v4.1.4"));
    }

    #[test]
    fn sources_are_embedded() {
        assert!(MPI_SOURCE.contains("MPI_Allreduce"));
        assert!(ONECCL_SOURCE.contains("ccl::allreduce"));
        assert!(GLOO_SOURCE.contains("init_process_group(\"gloo\")"));
    }

    #[test]
    fn openmpi_is_forced_onto_the_link() {
        let shm = ompi_args(2, Bind::Core, OmpiNet::Shm).join(" ");
        assert!(shm.contains("--mca btl self,vader"), "{shm}");
        let tcp = ompi_args(2, Bind::Core, OmpiNet::Tcp).join(" ");
        assert!(
            tcp.contains("--mca btl tcp,self --mca btl_tcp_if_include lo"),
            "{tcp}"
        );
        assert!(!ompi_args(2, Bind::None, OmpiNet::Defaults).contains(&"--mca".to_string()));
    }
}
