//! `ccl-bench tune`: measures every algorithm of every collective on this
//! machine (one `ccl-bench <collective> --algo all` run per world size and
//! kind of links) and writes the tuning table that ccl's tuner reads
//! (`algorithms/tuning.table`, see `ccl_algorithms::tuner`).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use clap::Args;

use crate::{
    cli::SizeArgs,
    coll::Coll,
    report::{unix_time, Report},
};

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
    /// Write the table here (e.g. algorithms/tuning.table) instead of to stdout
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// Runs the sweeps and writes the table; returns the exit status.
pub fn tune(args: TuneArgs) -> i32 {
    match run(&args) {
        Ok(table) => match &args.out {
            Some(path) => match std::fs::write(path, table) {
                Ok(()) => {
                    eprintln!("ccl-bench tune: wrote {}", path.display());
                    0
                }
                Err(e) => {
                    eprintln!("ccl-bench tune: writing {}: {e}", path.display());
                    1
                }
            },
            None => {
                print!("{table}");
                0
            }
        },
        Err(e) => {
            eprintln!("ccl-bench tune: {e}");
            1
        }
    }
}

fn run(args: &TuneArgs) -> Result<String, String> {
    for l in &args.links {
        if l != "shm" && l != "tcp" {
            return Err(format!("--links {l}: expected shm or tcp"));
        }
    }
    if args.world_sizes.iter().any(|&n| n < 2) {
        return Err("--world-sizes: every world size must be at least 2".into());
    }
    let sizes = args.sizes.sizes()?;
    let (first, last) = (sizes[0], sizes[sizes.len() - 1]);
    let collectives: Vec<Coll> = if args.collectives.is_empty() {
        Coll::ALL
            .into_iter()
            .filter(|c| *c != Coll::Sendrecv)
            .collect()
    } else {
        args.collectives.clone()
    };
    let exe = std::env::current_exe().map_err(|e| format!("finding ccl-bench itself: {e}"))?;
    let dir = std::env::temp_dir().join(format!("ccl-bench-tune-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut table = header(args);
    for coll in &collectives {
        for links in &args.links {
            for &n in &args.world_sizes {
                let json = dir.join(format!("{}-{links}-{n}.json", coll.name()));
                let mut cmd = Command::new(&exe);
                cmd.arg(coll.name())
                    .args([
                        "--ranks",
                        &n.to_string(),
                        "--transport",
                        links,
                        "--algo",
                        "all",
                    ])
                    .args(["-b", &first.to_string(), "-e", &last.to_string()])
                    .args(["-f", &args.sizes.factor.to_string()])
                    .args([
                        "-n",
                        &args.iters.to_string(),
                        "-w",
                        &args.warmup.to_string(),
                    ])
                    .arg("--json")
                    .arg(&json)
                    .stdout(Stdio::null());
                eprintln!("ccl-bench tune: {} over {links}, {n} ranks", coll.name());
                let status = cmd
                    .status()
                    .map_err(|e| format!("running {}: {e}", exe.display()))?;
                if !status.success() {
                    return Err(format!(
                        "{} over {links} with {n} ranks failed ({status})",
                        coll.name()
                    ));
                }
                let text = std::fs::read_to_string(&json)
                    .map_err(|e| format!("{}: {e}", json.display()))?;
                let report: Report =
                    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", json.display()))?;
                for (up_to, algo) in best_ranges(&report) {
                    let up_to = up_to.map_or("-".to_string(), |b| b.to_string());
                    let _ = writeln!(
                        table,
                        "{:<15} {links:<4} {n:<3} {up_to:>11} {algo}",
                        coll.name()
                    );
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(table)
}

fn header(args: &TuneArgs) -> String {
    let cmd: Vec<String> = std::env::args().skip(1).collect();
    let host = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!(
        "# ccl tuning table: the fastest algorithm per collective, kind of links, world size\n\
         # and buffer size (bytes, the whole buffer as ccl-bench counts it), as measured by\n\
         #   ccl-bench {}\n\
         # on {host} ({cores} cores), unix time {}, {} timed iterations per point.\n\
         # A line covers sizes above the previous line's up_to_bytes up to its own.\n\
         # collective   links ranks up_to_bytes algorithm\n",
        cmd.join(" "),
        unix_time(),
        args.iters
    )
}

/// An algorithm keeps winning sizes while it is within this factor of the
/// fastest, so that noise does not cut the table into flapping ranges.
const KEEP_WITHIN: f64 = 1.05;

/// The fastest algorithm at each measured size (by median time), merged into
/// ranges: each range ends at the last size its algorithm won; the last range
/// is open.
fn best_ranges(report: &Report) -> Vec<(Option<u64>, String)> {
    let mut times: BTreeMap<u64, Vec<(f64, String)>> = BTreeMap::new();
    for row in &report.rows {
        let t = if row.median_time_us > 0.0 {
            row.median_time_us
        } else {
            row.time_us
        };
        times
            .entry(row.size_bytes)
            .or_default()
            .push((t, row.algo.clone()));
    }
    let mut ranges: Vec<(Option<u64>, String)> = Vec::new();
    for (size, at) in times {
        let Some((fastest, winner)) = at
            .iter()
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(t, a)| (*t, a.clone()))
        else {
            continue;
        };
        let incumbent = ranges.last().map(|(_, a)| a.clone());
        let keep = incumbent.as_ref().is_some_and(|inc| {
            at.iter()
                .any(|(t, a)| a == inc && *t <= fastest * KEEP_WITHIN)
        });
        match ranges.last_mut() {
            Some((up_to, _)) if keep => *up_to = Some(size),
            Some((up_to, a)) if *a == winner => *up_to = Some(size),
            _ => ranges.push((Some(size), winner)),
        }
    }
    if let Some(last) = ranges.last_mut() {
        last.0 = None;
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Row;

    fn row(size: u64, algo: &str, t: f64) -> Row {
        Row {
            size_bytes: size,
            algo: algo.into(),
            median_time_us: t,
            time_us: t,
            ..Row::default()
        }
    }

    #[test]
    fn ranges_follow_the_winner_with_a_margin() {
        let rows = vec![
            row(8, "board", 1.0),
            row(8, "rd", 3.0),
            row(64, "board", 2.0),
            row(64, "rd", 1.96), // within 5 %: board keeps it
            row(512, "board", 9.0),
            row(512, "rd", 4.0),
            row(4096, "rd", 8.0),
            row(4096, "ring", 5.0),
        ];
        let report = Report {
            rows,
            ..Report::default()
        };
        assert_eq!(
            best_ranges(&report),
            vec![
                (Some(64), "board".to_string()),
                (Some(512), "rd".to_string()),
                (None, "ring".to_string())
            ]
        );
    }
}
