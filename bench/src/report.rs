//! What a run reports: the nccl-tests-style table on stdout, and the same
//! figures with the run's configuration as JSON and CSV.

use std::{fmt::Write as _, io::Write as _, path::Path};

use serde::{Deserialize, Serialize};

use crate::{c2c::Probe, size::format_size};

/// How the time column is defined (also written into the JSON).
pub const TIME_DEFINITION: &str =
    "the slowest rank's time for the whole loop of timed iterations (from a barrier to its last call's return, as nccl-tests times it), over the iterations";

/// One size (and algorithm) of a run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Row {
    /// The whole buffer in bytes (n × per-rank part for split collectives).
    pub size_bytes: u64,
    /// Elements in `size_bytes`.
    pub count: u64,
    /// Elements each rank passes to the call.
    pub count_per_rank: u64,
    pub dtype: String,
    /// The reduction op, or "none".
    pub op: String,
    /// The root rank, or -1 for collectives without one.
    pub root: i64,
    pub algo: String,
    /// See [`TIME_DEFINITION`].
    pub time_us: f64,
    /// Rank 0's own loop time over the iterations (nccl-tests averages
    /// this over the ranks).
    pub time_us_rank0: f64,
    /// Median iteration (the slowest rank's time from the end of its previous
    /// call to the end of this one): robust to a noisy machine.
    #[serde(default)]
    pub median_time_us: f64,
    /// Fastest and slowest iteration (each the slowest rank's time).
    pub min_time_us: f64,
    pub max_time_us: f64,
    /// The mean over iterations of the slowest rank's time for that
    /// iteration: `time_us` until 2026-11-27, kept to compare the two.
    #[serde(default)]
    pub iteration_mean_us: f64,
    /// Bytes per second (1e9) of `size_bytes` over `time_us`.
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    /// Elements wrong over all ranks and iterations; `None` without `--check`.
    pub wrong: Option<u64>,
}

/// The run's configuration.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunConfig {
    pub collective: String,
    pub ranks: usize,
    /// Distinct hosts, in order of first rank.
    pub hosts: Vec<String>,
    /// Each rank's host.
    pub rank_hosts: Vec<String>,
    pub launcher: String,
    pub transport: String,
    pub dtype: String,
    pub op: String,
    pub root: i64,
    pub algo_requested: String,
    pub inplace: bool,
    pub check: bool,
    /// Host buffers from `ccl::SharedBuffer` (`--shared-buffers`).
    #[serde(default)]
    pub shared_buffers: bool,
    pub iters: usize,
    pub warmup: usize,
    pub timeout_s: f64,
    pub nsocks: usize,
    pub sizes_requested: Vec<u64>,
    /// The round trip between the CPUs of ranks 0 and 1, measured before
    /// ccl-bench started its ranks (absent under other launchers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_to_core: Option<Probe>,
    pub time_definition: String,
    pub size_definition: String,
}

/// Versions of what ran.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Versions {
    pub ccl_bench: String,
    pub ccl: String,
    pub rustc: String,
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub openmpi: Option<String>,
}

impl Versions {
    pub fn current() -> Versions {
        Versions {
            ccl_bench: env!("CARGO_PKG_VERSION").to_string(),
            // ccl-bench builds against the workspace's ccl, which shares its version.
            ccl: env!("CARGO_PKG_VERSION").to_string(),
            rustc: env!("CCL_BENCH_RUSTC").to_string(),
            os: os_release(),
            openmpi: None,
        }
    }
}

fn os_release() -> String {
    let uname = nix::sys::utsname::uname();
    match uname {
        Ok(u) => format!(
            "{} {} {}",
            u.sysname().to_string_lossy(),
            u.release().to_string_lossy(),
            u.machine().to_string_lossy()
        ),
        Err(_) => std::env::consts::OS.to_string(),
    }
}

/// A whole run, as `--json` writes it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub tool: String,
    pub config: RunConfig,
    /// Spawn (local mode) + rendezvous + connect, seconds.
    pub setup_s: f64,
    pub rows: Vec<Row>,
    pub avg_busbw_gbps: f64,
    pub peak_busbw_gbps: f64,
    pub peak_size_bytes: u64,
    pub versions: Versions,
    pub unix_time: u64,
}

/// Seconds since the epoch.
pub fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Average and peak busbw, and the size of the peak.
pub fn summary(rows: &[Row]) -> (f64, f64, u64) {
    if rows.is_empty() {
        return (0.0, 0.0, 0);
    }
    let avg = rows.iter().map(|r| r.busbw_gbps).sum::<f64>() / rows.len() as f64;
    let peak = rows
        .iter()
        .max_by(|a, b| a.busbw_gbps.total_cmp(&b.busbw_gbps))
        .expect("rows is not empty");
    (avg, peak.busbw_gbps, peak.size_bytes)
}

/// The two heading lines of the table.
pub fn table_head() -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "#  {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>12} {:>8} {:>8} {:>7}",
        "size", "count", "type", "redop", "root", "algo", "time", "algbw", "busbw", "#wrong"
    );
    let _ = write!(
        s,
        "#  {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>12} {:>8} {:>8} {:>7}",
        "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    );
    s.lines().map(str::trim_end).collect::<Vec<_>>().join("\n")
}

/// One line of the table.
pub fn table_row(r: &Row) -> String {
    let wrong = r.wrong.map_or_else(|| "N/A".to_string(), |w| w.to_string());
    format!(
        "   {:>12} {:>12} {:>6} {:>6} {:>5} {:>13} {:>12.2} {:>8.3} {:>8.3} {:>7}",
        r.size_bytes,
        r.count,
        r.dtype,
        r.op,
        r.root,
        r.algo,
        r.time_us,
        r.algbw_gbps,
        r.busbw_gbps,
        wrong
    )
}

/// The closing lines: average and peak bus bandwidth, and wrong elements.
pub fn table_tail(rows: &[Row]) -> String {
    let (avg, peak, at) = summary(rows);
    let mut s = String::new();
    let _ = writeln!(s, "# Out of bounds values : {}", wrong_total(rows));
    let _ = writeln!(s, "# Avg bus bandwidth    : {avg:.3} GB/s");
    let _ = write!(
        s,
        "# Peak bus bandwidth   : {peak:.3} GB/s (at {})",
        format_size(at)
    );
    s
}

fn wrong_total(rows: &[Row]) -> String {
    if rows.iter().all(|r| r.wrong.is_none()) {
        return "N/A (run with --check to verify results)".into();
    }
    let total: u64 = rows.iter().filter_map(|r| r.wrong).sum();
    format!("{total} {}", if total == 0 { "OK" } else { "FAILED" })
}

/// Writes `text` to `path`, naming the file in the error.
pub fn write_file(path: &Path, text: &str) -> Result<(), String> {
    let mut f = std::fs::File::create(path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.flush())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

pub fn to_json<T: Serialize>(value: &T) -> String {
    let mut s = serde_json::to_string_pretty(value).expect("reports serialize");
    s.push('\n');
    s
}

/// Quotes a CSV field if it needs it.
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// One CSV line per row, each with the run's configuration.
pub fn to_csv(report: &Report) -> String {
    let c = &report.config;
    let mut s = String::from(
        "collective,ranks,hosts,launcher,transport,dtype,op,root,algo_requested,algo,inplace,check,\
         iters,warmup,size_bytes,count,count_per_rank,time_us,time_us_rank0,median_time_us,min_time_us,max_time_us,iteration_mean_us,\
         algbw_gbps,busbw_gbps,wrong,setup_s,ccl_version,ccl_bench_version,rustc,os\n",
    );
    for r in &report.rows {
        let fields = [
            c.collective.clone(),
            c.ranks.to_string(),
            c.hosts.len().to_string(),
            c.launcher.clone(),
            c.transport.clone(),
            r.dtype.clone(),
            r.op.clone(),
            r.root.to_string(),
            c.algo_requested.clone(),
            r.algo.clone(),
            c.inplace.to_string(),
            c.check.to_string(),
            c.iters.to_string(),
            c.warmup.to_string(),
            r.size_bytes.to_string(),
            r.count.to_string(),
            r.count_per_rank.to_string(),
            format!("{:.3}", r.time_us),
            format!("{:.3}", r.time_us_rank0),
            format!("{:.3}", r.median_time_us),
            format!("{:.3}", r.min_time_us),
            format!("{:.3}", r.max_time_us),
            format!("{:.3}", r.iteration_mean_us),
            format!("{:.6}", r.algbw_gbps),
            format!("{:.6}", r.busbw_gbps),
            r.wrong.map_or_else(String::new, |w| w.to_string()),
            format!("{:.6}", report.setup_s),
            report.versions.ccl.clone(),
            report.versions.ccl_bench.clone(),
            report.versions.rustc.clone(),
            report.versions.os.clone(),
        ];
        let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
        s.push_str(&line.join(","));
        s.push('\n');
    }
    s
}
