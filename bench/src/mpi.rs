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
    process::{Command, Stdio},
    time::Duration,
};

use ccl::{DataType, ReduceOp};
use serde::{Deserialize, Serialize};

use crate::{
    args::{CompareArgs, CompareTarget, Plan},
    coll::Coll,
    peers::{self, OmpiNet, PeerRow},
    plot::{self, Series},
    report::{self, Row, Versions},
};

/// One OpenMPI measurement (the row its benchmark printed).
pub type MpiRow = PeerRow;

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

struct Runner<'a> {
    plan: &'a Plan,
    n: usize,
    bin: std::path::PathBuf,
    mpirun: String,
    limit: Duration,
}

impl Runner<'_> {
    fn ccl(&self, bytes: u64) -> Result<Row, String> {
        peers::run_ccl(self.plan, self.n, "auto", bytes, self.limit)
    }

    fn mpi(&self, bytes: u64, tcp: bool) -> Result<MpiRow, String> {
        let net = if tcp { OmpiNet::Tcp } else { OmpiNet::Defaults };
        let mut cmd = Command::new(&self.mpirun);
        cmd.args(peers::ompi_args(self.n, self.plan.bind, net))
            .arg(&self.bin)
            .args(peers::bench_args(self.plan, bytes));
        let variant = if tcp { "OpenMPI tcp" } else { "OpenMPI shm" };
        peers::run_bench(variant, vec![cmd], bytes, self.limit)
            .map(|(row, _)| row)
            .map_err(String::from)
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
    let plan = match a
        .target
        .plan()
        .and_then(|p| check_mpi_types(&p).map(|()| p))
    {
        Ok(p) => p,
        Err(m) => return usage(&m),
    };
    let n = match CompareTarget::local_ranks(&plan, "compare-mpi") {
        Ok(n) => n,
        Err(m) => return usage(&m),
    };
    let version = match mpirun_version(&a.mpirun) {
        Ok(v) => v,
        Err(m) => return fail(&m),
    };
    let bin = match peers::build(
        "ccl_mpi_bench",
        peers::MPI_SOURCE,
        "c",
        &a.mpicc,
        &[],
        "install OpenMPI (apt-get install openmpi-bin libopenmpi-dev) or pass --mpicc PATH",
    ) {
        Ok(b) => b,
        Err(m) => return fail(&m),
    };
    let runs = (plan.iters + plan.warmup + 2) as u32;
    let runner = Runner {
        plan: &plan,
        n,
        bin,
        mpirun: a.mpirun.clone(),
        limit: plan
            .timeout
            .saturating_mul(runs)
            .max(Duration::from_secs(60)),
    };

    let coll = plan.coll;
    println!(
        "# ccl-bench compare-mpi {}: {n} ranks on 1 host, dtype {}{}, {}, iters {}, warmup {}",
        coll.name(),
        plan.dtype,
        plan.op_root_words(),
        plan.form(),
        plan.iters,
        plan.warmup
    );
    println!(
        "# ccl {} (transport auto, algo auto, ranks {}) vs {version}: shm = mpirun {}; tcp = mpirun {}",
        env!("CARGO_PKG_VERSION"),
        ccl_run::describe_binding(plan.bind, n, &plan.bind.cpus().unwrap_or_default()),
        peers::ompi_args(n, plan.bind, OmpiNet::Defaults).join(" "),
        peers::ompi_args(n, plan.bind, OmpiNet::Tcp).join(" ")
    );
    println!(
        "# each size: a fresh ccl run, then OpenMPI shm, then OpenMPI tcp; time = the slowest rank's timed loop / iterations"
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
            op: plan.op_label(),
            root: plan.root_label(),
            inplace: plan.inplace,
            iters: plan.iters,
            warmup: plan.warmup,
            sizes_requested: plan.sizes.clone(),
            mpirun_shm: peers::ompi_args(n, plan.bind, OmpiNet::Defaults),
            mpirun_tcp: peers::ompi_args(n, plan.bind, OmpiNet::Tcp),
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
    fn ratios() {
        assert_eq!(ratio(200.0, 100.0), 2.0);
        assert!((geomean([2.0, 8.0].into_iter()) - 4.0).abs() < 1e-12);
    }
}
