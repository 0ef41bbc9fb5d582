//! `compare-mpi`: ccl and OpenMPI side by side on the same collective, sizes and ranks.
//!
//! For every size, three fresh launches run one after the other: ccl (this
//! program in local mode, over TCP), OpenMPI with its defaults (shared memory
//! between local ranks) and OpenMPI forced onto TCP over loopback. Alternating
//! per size keeps slow drifts of a noisy machine from favouring one side. The
//! OpenMPI benchmark is bench/mpi/ccl_mpi_bench.c, compiled here (embedded in
//! this binary) with mpicc into the target directory on first use.

use std::{
    fmt::Write as _,
    io::Read,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use ccl::{Config, DataType, Launcher, ReduceOp};
use ccl_run::Bind;
use serde::{Deserialize, Serialize};

use crate::{
    args::{self, CompareArgs, Plan},
    coll::Coll,
    plot::{self, Series},
    report::{self, Report, Row, Versions},
    size::format_size,
};

/// The OpenMPI benchmark's source, compiled at run time.
const MPI_SOURCE: &str = include_str!("../mpi/ccl_mpi_bench.c");

/// mpirun arguments that force OpenMPI onto TCP over loopback.
pub const TCP_ARGS: [&str; 8] = [
    "--mca",
    "pml",
    "ob1",
    "--mca",
    "btl",
    "tcp,self",
    "--mca",
    "btl_tcp_if_include",
];

/// One OpenMPI measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MpiRow {
    pub size_bytes: u64,
    pub count: u64,
    pub time_us: f64,
    /// Median iteration (the slowest rank's time).
    #[serde(default)]
    pub median_time_us: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
}

/// One size of a comparison.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompareRow {
    pub size_bytes: u64,
    pub ccl: Row,
    pub mpi_shm: MpiRow,
    pub mpi_tcp: MpiRow,
    /// OpenMPI time / ccl time (= ccl busbw / OpenMPI busbw); above 1, ccl is faster.
    pub ratio_shm: f64,
    pub ratio_tcp: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompareConfig {
    pub collective: String,
    pub ranks: usize,
    pub dtype: String,
    pub op: String,
    pub root: i64,
    pub inplace: bool,
    pub iters: usize,
    pub warmup: usize,
    pub sizes_requested: Vec<u64>,
    pub mpirun_shm: Vec<String>,
    pub mpirun_tcp: Vec<String>,
    pub ccl_transport: String,
    pub time_definition: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompareReport {
    pub tool: String,
    pub config: CompareConfig,
    pub rows: Vec<CompareRow>,
    /// Geometric means of the ratios over the sizes.
    pub geomean_ratio_shm: f64,
    pub geomean_ratio_tcp: f64,
    pub versions: Versions,
    pub unix_time: u64,
}

fn usage(msg: &str) -> i32 {
    eprintln!("ccl-bench: {msg}");
    2
}

fn fail(msg: &str) -> i32 {
    eprintln!("ccl-bench: compare-mpi: {msg}");
    1
}

/// The types the OpenMPI benchmark has (MPI has no f16/bf16).
fn check_mpi_types(plan: &Plan) -> Result<(), String> {
    if matches!(plan.dtype, DataType::F16 | DataType::Bf16) {
        return Err(format!(
            "compare-mpi: --dtype {} has no MPI type (use i8, u8, i32, u32, i64, u64, f32 or f64)",
            plan.dtype
        ));
    }
    if plan.coll.has_op() && matches!(plan.op, ReduceOp::Avg | ReduceOp::PreMulSum(_)) {
        return Err(format!(
            "compare-mpi: --op {} has no MPI equivalent (use sum, prod, min, max, band, bor or bxor)",
            plan.op
        ));
    }
    Ok(())
}

/// Runs `cmd` to completion (at most `limit`), returning (success, stdout, stderr).
fn run_captured(mut cmd: Command, limit: Duration) -> Result<(bool, String, String), String> {
    let what = format!("{:?}", cmd.get_program());
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("cannot run {what}: {e}"))?;
    let mut out_pipe = child.stdout.take().expect("piped");
    let mut err_pipe = child.stderr.take().expect("piped");
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out_pipe.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return Err(format!("cannot wait for {what}: {e}")),
        }
    };
    let out = out_thread.join().unwrap_or_default();
    let err = err_thread.join().unwrap_or_default();
    match status {
        Some(s) => Ok((s.success(), out, err)),
        None => Err(format!(
            "{what} did not finish within {:.0} s; killed it",
            limit.as_secs_f64()
        )),
    }
}

fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Where the OpenMPI benchmark is built: next to this executable (the
/// target directory), else in the temporary directory.
fn build_dir() -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("ccl-bench-mpi")));
    if let Some(d) = beside {
        if std::fs::create_dir_all(&d).is_ok() {
            return d;
        }
    }
    let d = std::env::temp_dir().join("ccl-bench-mpi");
    let _ = std::fs::create_dir_all(&d);
    d
}

/// A short hash of the source, naming the binary built from it.
fn source_tag() -> String {
    let h = MPI_SOURCE.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Builds (once per source version) the OpenMPI benchmark; returns its path.
pub fn build_mpi_bench(mpicc: &str) -> Result<PathBuf, String> {
    let dir = build_dir();
    let bin = dir.join(format!("ccl_mpi_bench-{}", source_tag()));
    if bin.is_file() {
        return Ok(bin);
    }
    let pid = std::process::id();
    let src = dir.join(format!("ccl_mpi_bench-{pid}.c"));
    let tmp = dir.join(format!("ccl_mpi_bench-{pid}.tmp"));
    std::fs::write(&src, MPI_SOURCE).map_err(|e| format!("cannot write {}: {e}", src.display()))?;
    let out = Command::new(mpicc)
        .arg("-O2")
        .arg("-o")
        .arg(&tmp)
        .arg(&src)
        .stdin(Stdio::null())
        .output();
    let _ = std::fs::remove_file(&src);
    let out = match out {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "{mpicc} not found: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) or pass --mpicc PATH"
            ))
        }
        Err(e) => return Err(format!("cannot run {mpicc}: {e}")),
    };
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "{mpicc} failed to build the OpenMPI benchmark: {}",
            tail(&String::from_utf8_lossy(&out.stderr), 5)
        ));
    }
    std::fs::rename(&tmp, &bin).map_err(|e| format!("cannot move {}: {e}", tmp.display()))?;
    Ok(bin)
}

/// `mpirun --version`'s "Open MPI 4.1.4", or an error saying how to get it.
fn mpirun_version(mpirun: &str) -> Result<String, String> {
    let out = Command::new(mpirun)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => format!(
                "{mpirun} not found: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) or pass --mpirun PATH"
            ),
            _ => format!("cannot run {mpirun}: {e}"),
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let first = text.lines().next().unwrap_or("").trim();
    if !out.status.success() || !first.contains("Open MPI") {
        return Err(format!(
            "{mpirun} is not OpenMPI's mpirun (its --version said {first:?})"
        ));
    }
    // "mpirun (Open MPI) 4.1.4"
    let version = first.rsplit(' ').next().unwrap_or(first);
    Ok(format!("Open MPI {version}"))
}

fn is_root_user() -> bool {
    nix::unistd::geteuid().is_root()
}

/// mpirun's arguments before the program, for a variant: OpenMPI's defaults,
/// plus `--oversubscribe` when there are more ranks than cores, the binding
/// ccl's ranks get (`--bind-to core`, with `:overload-allowed` when
/// oversubscribed, places rank r on the (r mod cores)-th core as ccl-bench
/// does; OpenMPI's own default would not bind at all when oversubscribed), and
/// `--allow-run-as-root` for root.
fn mpirun_args(n: usize, bind: Bind, tcp: bool) -> Vec<String> {
    let mut v = vec!["-np".to_string(), n.to_string()];
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > cores {
        v.push("--oversubscribe".into());
    }
    v.push("--bind-to".into());
    v.push(match (bind, n > cores) {
        (Bind::None, _) => "none".into(),
        (Bind::Core, false) => "core".into(),
        (Bind::Core, true) => "core:overload-allowed".into(),
    });
    if is_root_user() {
        v.push("--allow-run-as-root".into());
    }
    if tcp {
        v.extend(TCP_ARGS.iter().map(|s| s.to_string()));
        v.push("lo".into());
    }
    v
}

/// Parses the one result row of the OpenMPI benchmark's table (and the
/// statistics line `-v` prints after it).
fn parse_mpi_row(stdout: &str) -> Option<MpiRow> {
    let mut lines = stdout.lines();
    let line = lines
        .by_ref()
        .find(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() < 10 {
        return None;
    }
    let time_us: f64 = f[6].parse().ok()?;
    let median_time_us = lines
        .next()
        .and_then(|l| l.split("median ").nth(1))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(time_us);
    Some(MpiRow {
        size_bytes: f[0].parse().ok()?,
        count: f[1].parse().ok()?,
        time_us,
        median_time_us,
        algbw_gbps: f[7].parse().ok()?,
        busbw_gbps: f[8].parse().ok()?,
    })
}

struct Runner<'a> {
    plan: &'a Plan,
    n: usize,
    exe: PathBuf,
    bin: PathBuf,
    mpirun: String,
    limit: Duration,
}

impl Runner<'_> {
    fn size_args(&self, bytes: u64) -> Vec<String> {
        if self.plan.coll == Coll::Barrier {
            Vec::new()
        } else {
            vec!["--size".into(), format!("{bytes}B")]
        }
    }

    fn ccl(&self, bytes: u64) -> Result<Row, String> {
        let p = self.plan;
        let json = std::env::temp_dir().join(format!(
            "ccl-bench-compare-{}-{bytes}.json",
            std::process::id()
        ));
        let mut cmd = Command::new(&self.exe);
        cmd.arg(p.coll.name())
            .args(self.size_args(bytes))
            .args(["--ranks", &self.n.to_string()])
            .args(["--bind", p.bind.name()])
            .args(["--dtype", p.dtype.name()])
            .args(["--op", &p.op.to_string()])
            .args(["--root", &p.root.to_string()])
            .args(["--iters", &p.iters.to_string()])
            .args(["--warmup", &p.warmup.to_string()])
            .args(["--timeout", &format!("{}s", p.timeout.as_secs_f64())])
            .arg("--json")
            .arg(&json);
        if p.inplace {
            cmd.arg("--inplace");
        }
        let result = run_captured(cmd, self.limit);
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

    fn mpi(&self, bytes: u64, tcp: bool) -> Result<MpiRow, String> {
        let p = self.plan;
        let mut cmd = Command::new(&self.mpirun);
        cmd.args(mpirun_args(self.n, p.bind, tcp))
            .arg(&self.bin)
            .arg(p.coll.name())
            .args([
                "-b",
                &bytes.max(1).to_string(),
                "-e",
                &bytes.max(1).to_string(),
            ])
            .args(["-n", &p.iters.to_string(), "-w", &p.warmup.to_string()])
            .args(["-d", p.dtype.name(), "-o", p.op.name()])
            .args(["-r", &p.root.to_string(), "-v"]);
        if p.inplace {
            cmd.arg("-i");
        }
        let variant = if tcp { "OpenMPI tcp" } else { "OpenMPI shm" };
        let (ok, out, err) = run_captured(cmd, self.limit)?;
        if !ok {
            let why = if err.trim().is_empty() { &out } else { &err };
            return Err(format!(
                "the {variant} run of {} failed: {}",
                format_size(bytes),
                tail(why, 6)
            ));
        }
        parse_mpi_row(&out).ok_or_else(|| {
            format!(
                "the {variant} run of {} printed no result row: {}",
                format_size(bytes),
                tail(&out, 4)
            )
        })
    }
}

fn ratio(mpi_us: f64, ccl_us: f64) -> f64 {
    if ccl_us > 0.0 {
        mpi_us / ccl_us
    } else {
        0.0
    }
}

fn geomean(v: impl Iterator<Item = f64>) -> f64 {
    let (mut s, mut k) = (0.0, 0);
    for x in v.filter(|x| *x > 0.0) {
        s += x.ln();
        k += 1;
    }
    if k == 0 {
        0.0
    } else {
        (s / k as f64).exp()
    }
}

fn head_lines() -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "#  {:>12} {:>13} {:>11} {:>11} {:>11} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "size",
        "ccl algo",
        "ccl time",
        "shm time",
        "tcp time",
        "ccl busbw",
        "shm busbw",
        "tcp busbw",
        "ccl/shm",
        "ccl/tcp"
    );
    let _ = write!(
        s,
        "#  {:>12} {:>13} {:>11} {:>11} {:>11} {:>10} {:>10} {:>10} {:>8} {:>8}",
        "(B)", "", "(us)", "(us)", "(us)", "(GB/s)", "(GB/s)", "(GB/s)", "(speed)", "(speed)"
    );
    s.lines().map(str::trim_end).collect::<Vec<_>>().join("\n")
}

fn row_line(r: &CompareRow) -> String {
    format!(
        "   {:>12} {:>13} {:>11.2} {:>11.2} {:>11.2} {:>10.3} {:>10.3} {:>10.3} {:>8.2} {:>8.2}",
        r.size_bytes,
        r.ccl.algo,
        r.ccl.time_us,
        r.mpi_shm.time_us,
        r.mpi_tcp.time_us,
        r.ccl.busbw_gbps,
        r.mpi_shm.busbw_gbps,
        r.mpi_tcp.busbw_gbps,
        r.ratio_shm,
        r.ratio_tcp
    )
}

fn to_csv(rep: &CompareReport) -> String {
    let c = &rep.config;
    let mut s = String::from(
        "collective,ranks,dtype,op,root,inplace,iters,warmup,size_bytes,count,ccl_algo,\
         ccl_time_us,mpi_shm_time_us,mpi_tcp_time_us,ccl_median_us,mpi_shm_median_us,\
         mpi_tcp_median_us,ccl_busbw_gbps,mpi_shm_busbw_gbps,\
         mpi_tcp_busbw_gbps,ratio_shm,ratio_tcp,ccl_version,openmpi_version\n",
    );
    for r in &rep.rows {
        let fields = [
            c.collective.clone(),
            c.ranks.to_string(),
            c.dtype.clone(),
            c.op.clone(),
            c.root.to_string(),
            c.inplace.to_string(),
            c.iters.to_string(),
            c.warmup.to_string(),
            r.size_bytes.to_string(),
            r.ccl.count.to_string(),
            r.ccl.algo.clone(),
            format!("{:.3}", r.ccl.time_us),
            format!("{:.3}", r.mpi_shm.time_us),
            format!("{:.3}", r.mpi_tcp.time_us),
            format!("{:.3}", r.ccl.median_time_us),
            format!("{:.3}", r.mpi_shm.median_time_us),
            format!("{:.3}", r.mpi_tcp.median_time_us),
            format!("{:.6}", r.ccl.busbw_gbps),
            format!("{:.6}", r.mpi_shm.busbw_gbps),
            format!("{:.6}", r.mpi_tcp.busbw_gbps),
            format!("{:.4}", r.ratio_shm),
            format!("{:.4}", r.ratio_tcp),
            rep.versions.ccl.clone(),
            rep.versions.openmpi.clone().unwrap_or_default(),
        ];
        let line: Vec<String> = fields.iter().map(|f| report::csv_field(f)).collect();
        s.push_str(&line.join(","));
        s.push('\n');
    }
    s
}

/// Runs `compare-mpi`; returns the exit status.
pub fn compare(a: CompareArgs) -> i32 {
    let plan = match args::common_plan(a.collective, &a.sizes, &a.common)
        .and_then(|p| check_mpi_types(&p).map(|()| p))
    {
        Ok(p) => p,
        Err(m) => return usage(&m),
    };
    match Config::from_env() {
        Ok(c) if c.launcher != Launcher::None => {
            return usage("compare-mpi starts its own ranks: run it without a launcher")
        }
        Err(e) => return usage(&e.to_string()),
        Ok(_) => {}
    }
    let n = plan.ranks.unwrap_or_else(args::default_ranks);
    if let Err(m) = plan.check_world(n) {
        return usage(&m);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail(&format!("cannot find its own executable: {e}")),
    };
    let version = match mpirun_version(&a.mpirun) {
        Ok(v) => v,
        Err(m) => return fail(&m),
    };
    let bin = match build_mpi_bench(&a.mpicc) {
        Ok(b) => b,
        Err(m) => return fail(&m),
    };
    let runs = (plan.iters + plan.warmup + 2) as u32;
    let runner = Runner {
        plan: &plan,
        n,
        exe,
        bin,
        mpirun: a.mpirun.clone(),
        limit: plan
            .timeout
            .saturating_mul(runs)
            .max(Duration::from_secs(60)),
    };

    let coll = plan.coll;
    let mut head = format!(
        "# ccl-bench compare-mpi {}: {n} ranks on 1 host, dtype {}",
        coll.name(),
        plan.dtype
    );
    if coll.has_op() {
        head += &format!(", op {}", plan.op);
    }
    if coll.has_root() {
        head += &format!(", root {}", plan.root);
    }
    println!(
        "{head}, {}, iters {}, warmup {}",
        if plan.inplace {
            "in-place"
        } else {
            "out-of-place"
        },
        plan.iters,
        plan.warmup
    );
    println!(
        "# ccl {} (transport auto, algo auto, ranks {}) vs {version}: shm = mpirun {}; tcp = mpirun {}",
        env!("CARGO_PKG_VERSION"),
        ccl_run::describe_binding(plan.bind, n, &plan.bind.cpus().unwrap_or_default()),
        mpirun_args(n, plan.bind, false).join(" "),
        mpirun_args(n, plan.bind, true).join(" ")
    );
    println!(
        "# each size: a fresh ccl run, then OpenMPI shm, then OpenMPI tcp; time = mean over iterations of the slowest rank"
    );
    println!(
        "# ccl/shm, ccl/tcp = OpenMPI time / ccl time (= ccl busbw / OpenMPI busbw): above 1, ccl is faster"
    );
    println!("#\n{}", head_lines());

    let mut rows = Vec::new();
    for &bytes in &plan.sizes {
        let r = runner.ccl(bytes).and_then(|ccl| {
            let shm = runner.mpi(bytes, false)?;
            let tcp = runner.mpi(bytes, true)?;
            Ok((ccl, shm, tcp))
        });
        let (ccl, shm, tcp) = match r {
            Ok(x) => x,
            Err(m) => return fail(&m),
        };
        if ccl.size_bytes != shm.size_bytes && coll != Coll::Barrier {
            return fail(&format!(
                "ccl and OpenMPI measured different sizes ({} and {} bytes)",
                ccl.size_bytes, shm.size_bytes
            ));
        }
        let row = CompareRow {
            size_bytes: ccl.size_bytes,
            ratio_shm: ratio(shm.time_us, ccl.time_us),
            ratio_tcp: ratio(tcp.time_us, ccl.time_us),
            ccl,
            mpi_shm: shm,
            mpi_tcp: tcp,
        };
        println!("{}", row_line(&row));
        println!(
            "#    median iteration (us): ccl {:.2}, shm {:.2}, tcp {:.2}",
            row.ccl.median_time_us, row.mpi_shm.median_time_us, row.mpi_tcp.median_time_us
        );
        rows.push(row);
    }
    let gs = geomean(rows.iter().map(|r| r.ratio_shm));
    let gt = geomean(rows.iter().map(|r| r.ratio_tcp));
    println!("# geometric mean over sizes: ccl/shm {gs:.2}, ccl/tcp {gt:.2}");
    let avg =
        |f: &dyn Fn(&CompareRow) -> f64| rows.iter().map(f).sum::<f64>() / rows.len().max(1) as f64;
    println!(
        "# Avg bus bandwidth    : ccl {:.3}, OpenMPI shm {:.3}, OpenMPI tcp {:.3} GB/s",
        avg(&|r| r.ccl.busbw_gbps),
        avg(&|r| r.mpi_shm.busbw_gbps),
        avg(&|r| r.mpi_tcp.busbw_gbps)
    );

    let mut versions = Versions::current();
    versions.openmpi = Some(version);
    let rep = CompareReport {
        tool: "ccl-bench compare-mpi".into(),
        config: CompareConfig {
            collective: coll.name().into(),
            ranks: n,
            dtype: plan.dtype.name().into(),
            op: if coll.has_op() {
                plan.op.to_string()
            } else {
                "none".into()
            },
            root: if coll.has_root() {
                plan.root as i64
            } else {
                -1
            },
            inplace: plan.inplace,
            iters: plan.iters,
            warmup: plan.warmup,
            sizes_requested: plan.sizes.clone(),
            mpirun_shm: mpirun_args(n, plan.bind, false),
            mpirun_tcp: mpirun_args(n, plan.bind, true),
            ccl_transport: "auto".into(),
            time_definition: report::TIME_DEFINITION.into(),
        },
        rows,
        geomean_ratio_shm: gs,
        geomean_ratio_tcp: gt,
        versions,
        unix_time: report::unix_time(),
    };
    let write = || -> Result<(), String> {
        if let Some(p) = &plan.json {
            report::write_file(p, &report::to_json(&rep))?;
        }
        if let Some(p) = &plan.csv {
            report::write_file(p, &to_csv(&rep))?;
        }
        if let Some(p) = &plan.plot {
            let pick = |f: &dyn Fn(&CompareRow) -> f64| -> Vec<(u64, f64)> {
                rep.rows.iter().map(|r| (r.size_bytes, f(r))).collect()
            };
            let series = [
                Series {
                    label: "ccl (defaults: shared memory)".into(),
                    points: pick(&|r| r.ccl.busbw_gbps),
                },
                Series {
                    label: "OpenMPI shm (defaults)".into(),
                    points: pick(&|r| r.mpi_shm.busbw_gbps),
                },
                Series {
                    label: "OpenMPI tcp (loopback)".into(),
                    points: pick(&|r| r.mpi_tcp.busbw_gbps),
                },
            ];
            let title = format!("{}: ccl vs OpenMPI, {n} ranks, {}", coll.name(), plan.dtype);
            plot::plot_busbw(p, &title, &series)?;
        }
        Ok(())
    };
    if let Err(m) = write() {
        return fail(&m);
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_mpi_table() {
        let out = "# ccl_mpi_bench allreduce: 2 ranks\n#  size ...\n\
                   \x20      1048576       262144    f32    sum    -1        mpi       391.26    2.680    2.680     N/A\n\
                   #  per iteration (slowest rank): median 380.50 us, min 370.00 us, max 500.00 us\n\
                   # Avg bus bandwidth    : 2.680 GB/s\n";
        let r = parse_mpi_row(out).unwrap();
        assert_eq!(r.size_bytes, 1 << 20);
        assert_eq!(r.count, 262144);
        assert_eq!(r.time_us, 391.26);
        assert_eq!(r.busbw_gbps, 2.68);
        assert_eq!(r.median_time_us, 380.5);
    }

    #[test]
    fn ratios() {
        assert_eq!(ratio(200.0, 100.0), 2.0);
        assert!((geomean([2.0, 8.0].into_iter()) - 4.0).abs() < 1e-12);
    }

    #[test]
    fn source_is_embedded() {
        assert!(MPI_SOURCE.contains("MPI_Allreduce"));
    }
}
