//! ccl against OpenMPI under real `mpirun`, for every world size in CI.
//!
//! Runs `mpirun -np N ccl-mpi-reference` for N in `CCL_REF_NP` (default
//! 1,2,3,4,5,7,8) with the seeds of `CCL_REF_SEED`/`CCL_REF_SEEDS` (default
//! 1,2,3), each bounded in time (`CCL_REF_DEADLINE` seconds per world size,
//! default 600: the whole process group is killed past it), and asserts that
//! every rank finished and matched. Prints, per world size and in total, the
//! number of calls compared and the time taken.
//!
//! Without MPI (no `mpirun`, or the harness built without `mpicc`) the test
//! fails: it never passes without comparing anything. `scripts/test` installs MPI.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use ccl_mpi_reference::{
    large_from_env, mpirun, run_bounded, seeds_from_env, world_sizes_from_env, CCL_TIMEOUT,
};

const BIN: &str = env!("CARGO_BIN_EXE_ccl-mpi-reference");

fn no_mpi(why: &str) -> ! {
    panic!("{why}: the MPI reference needs OpenMPI (scripts/test installs openmpi-bin and libopenmpi-dev)");
}

/// `key=value` of the harness's SUMMARY line.
fn field<'a>(summary: &'a str, key: &str) -> Option<&'a str> {
    summary
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Fails the test, saying why, when MPI is missing.
fn require_mpi() {
    if cfg!(ccl_no_mpi) {
        no_mpi("the harness was built without mpicc");
    }
    if std::process::Command::new("mpirun")
        .arg("--version")
        .output()
        .is_err()
    {
        no_mpi("mpirun is not on PATH");
    }
}

/// The harness catches a wrong result: rank 0 corrupts one (`CCL_REF_CORRUPT`),
/// and the run must fail, naming the seed, the call, the rank, the index and
/// both values, with a command line to rerun it.
#[test]
fn a_corrupted_result_is_reported() {
    require_mpi();
    let vars = vec![
        ("CCL_REF_SEEDS", "7".to_string()),
        ("CCL_REF_LARGE", "0".into()),
        ("CCL_REF_CORRUPT", "40".into()),
        ("CCL_TIMEOUT", CCL_TIMEOUT.into()),
    ];
    let port = ccl::free_port().expect("a free port for the store");
    let cmd = mpirun(Path::new(BIN), 3, port, &vars, Duration::from_secs(110));
    let out = run_bounded(cmd, Duration::from_secs(120)).expect("spawn mpirun");
    let text = format!("{}{}", out.stdout, out.stderr);
    assert_eq!(out.code, Some(1), "{text}");
    let fail = text
        .lines()
        .find(|l| l.starts_with("FAIL seed=7 call #"))
        .unwrap_or_else(|| panic!("no FAIL line:\n{text}"));
    for want in [
        "on world (3 ranks)",
        "(world rank 0)",
        "first difference",
        "at index 0: ccl ",
        ", MPI ",
    ] {
        assert!(fail.contains(want), "{want:?} missing from: {fail}");
    }
    assert!(
        text.contains("rerun: CCL_REF_SEED=7 CCL_REF_NP=3"),
        "{text}"
    );
    for r in 0..3 {
        assert!(text.contains(&format!("rank {r}: FAILED")), "{text}");
    }
}

#[test]
fn ccl_matches_openmpi_under_mpirun() {
    require_mpi();
    let seeds = seeds_from_env().unwrap();
    let sizes = world_sizes_from_env().unwrap();
    let deadline = Duration::from_secs(
        std::env::var("CCL_REF_DEADLINE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(600),
    );
    let seed_list = seeds
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut vars = vec![
        ("CCL_REF_SEEDS", seed_list.clone()),
        (
            "CCL_REF_LARGE",
            if large_from_env() { "1" } else { "0" }.into(),
        ),
        (
            "CCL_TIMEOUT",
            std::env::var("CCL_TIMEOUT").unwrap_or_else(|_| CCL_TIMEOUT.into()),
        ),
    ];
    for k in ["CCL_ALGO", "CCL_NSOCKS"] {
        if let Ok(v) = std::env::var(k) {
            vars.push((k, v));
        }
    }
    let start = Instant::now();
    let mut total_calls = 0u64;
    let mut failures = Vec::new();
    for &np in &sizes {
        let port = ccl::free_port().expect("a free port for the store");
        // mpirun's own --timeout a little before ours, so that it reports.
        let cmd = mpirun(
            Path::new(BIN),
            np,
            port,
            &vars,
            deadline.saturating_sub(Duration::from_secs(10)),
        );
        let shown = format!("{cmd:?}");
        let out = run_bounded(cmd, deadline).expect("spawn mpirun");
        let summary = out
            .stdout
            .lines()
            .find(|l| l.starts_with("SUMMARY"))
            .unwrap_or("");
        let missing: Vec<usize> = (0..np)
            .filter(|r| !out.stdout.lines().any(|l| l == format!("rank {r}: ok")))
            .collect();
        let calls: u64 = field(summary, "calls")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        total_calls += calls;
        println!(
            "np={np}: {calls} calls compared (splits {}, elements {}, within a bound {}; worst error/bound {}) in {:.1?}{}",
            field(summary, "splits").unwrap_or("?"),
            field(summary, "elements").unwrap_or("?"),
            field(summary, "bounded").unwrap_or("?"),
            field(summary, "worst_err_over_bound").unwrap_or("?"),
            out.elapsed,
            if out.timed_out { " (KILLED at the deadline)" } else { "" }
        );
        if out.code != Some(0) || !missing.is_empty() || out.timed_out || calls == 0 {
            // Everything the ranks said, for the failure report.
            let shown_out: String = out
                .stdout
                .lines()
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("\n");
            eprintln!(
                "---- np={np}: exit {:?}, ranks not ok: {missing:?}\n{shown}\n---- stdout\n{shown_out}\n---- stderr\n{}",
                out.code, out.stderr
            );
            failures.push(np);
        }
    }
    println!(
        "ccl vs OpenMPI: {total_calls} calls compared over world sizes {sizes:?}, seeds {seed_list}, in {:.1?}",
        start.elapsed()
    );
    assert!(
        failures.is_empty(),
        "ccl differs from OpenMPI (or failed) with world sizes {failures:?}; see the FAIL lines above. \
         Rerun one: CCL_REF_NP=<n> CCL_REF_SEED=<seed> cargo test -p ccl-mpi-reference --test mpirun -- --nocapture"
    );
}
