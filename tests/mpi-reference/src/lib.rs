//! OpenMPI as the reference for every result ccl produces.
//!
//! The harness binary (`src/main.rs`) runs as every rank of a real
//! `mpirun -np N` job: it joins ccl from OpenMPI's environment
//! (`Communicator::from_env()`), runs the seeded sequence of [`plan`] through
//! MPI (via the C shim `src/shim.c`, compiled by `build.rs` with `mpicc`) and
//! through ccl on identical inputs, and compares the results on every rank:
//! bit for bit, or within [`bound`] for floating-point sums, averages and
//! products of random inputs. The integration test (`tests/mpirun.rs`)
//! launches it for every world size. This library holds what needs no MPI:
//! the generator, the plan, the error bounds, the environment and the
//! `mpirun` command line.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

pub mod bound;
pub mod plan;
pub mod rng;

/// Seeds run in CI (each world size runs all of them).
pub const DEFAULT_SEEDS: [u64; 3] = [1, 2, 3];
/// World sizes run in CI.
pub const WORLD_SIZES: [usize; 7] = [1, 2, 3, 4, 5, 7, 8];
/// `CCL_TIMEOUT` given to every rank: a hung call fails instead of hanging.
pub const CCL_TIMEOUT: &str = "60s";

fn list<T: std::str::FromStr>(var: &str, v: &str) -> Result<Vec<T>, String> {
    let items: Result<Vec<T>, _> = v
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect();
    match items {
        Ok(items) if !items.is_empty() => Ok(items),
        _ => Err(format!(
            "{var}={v:?} is not a comma-separated list of numbers"
        )),
    }
}

/// `CCL_REF_SEED` (one seed, to rerun a failure), else `CCL_REF_SEEDS`
/// (comma-separated), else [`DEFAULT_SEEDS`].
pub fn seeds_from_env() -> Result<Vec<u64>, String> {
    for var in ["CCL_REF_SEED", "CCL_REF_SEEDS"] {
        if let Ok(v) = std::env::var(var) {
            return list(var, &v);
        }
    }
    Ok(DEFAULT_SEEDS.to_vec())
}

/// `CCL_REF_NP` (comma-separated world sizes), else [`WORLD_SIZES`].
pub fn world_sizes_from_env() -> Result<Vec<usize>, String> {
    match std::env::var("CCL_REF_NP") {
        Ok(v) => {
            let n: Vec<usize> = list("CCL_REF_NP", &v)?;
            if n.contains(&0) {
                return Err("CCL_REF_NP: world sizes start at 1".into());
            }
            Ok(n)
        }
        Err(_) => Ok(WORLD_SIZES.to_vec()),
    }
}

/// `CCL_REF_LARGE=0` leaves out the large (≥ 16 Mi elements) calls.
pub fn large_from_env() -> bool {
    std::env::var("CCL_REF_LARGE").map_or(true, |v| v.trim() != "0")
}

/// True under CI (`CI=true`): there a missing MPI is a failure, never a skip.
pub fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// True when this process runs as root (mpirun then needs `--allow-run-as-root`).
pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The `mpirun` command that runs `bin` as `np` ranks on this machine.
///
/// Shared memory (`vader`, without single-copy, which containers often
/// forbid) and `ob1`; ranks yield when idle and are not bound, since the job
/// is oversubscribed on small machines and ccl's own threads need the cores
/// too. `vars` are exported to every rank with `-x`; torchrun-style
/// variables, which ccl would read before OpenMPI's, are removed.
pub fn mpirun(
    bin: &Path,
    np: usize,
    port: u16,
    vars: &[(&str, String)],
    timeout: Duration,
) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-np", &np.to_string(), "--oversubscribe"]);
    if is_root() {
        cmd.arg("--allow-run-as-root");
    }
    cmd.args([
        "--bind-to",
        "none",
        "--mca",
        "pml",
        "ob1",
        "--mca",
        "btl",
        "self,vader",
        "--mca",
        "btl_vader_single_copy_mechanism",
        "none",
        // OpenMPI 4.1's AVX reductions saturate 8- and 16-bit integer sums
        // (open-mpi/ompi#8045, "wontfix"); the portable C ones wrap, as
        // two's complement arithmetic (and ccl) does.
        "--mca",
        "op",
        "^avx",
        "--mca",
        "mpi_yield_when_idle",
        "1",
        "--timeout",
        &timeout.as_secs().max(1).to_string(),
    ]);
    let mut all = vec![
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ];
    all.extend(vars.iter().cloned());
    for (k, v) in all {
        cmd.args(["-x", &format!("{k}={v}")]);
    }
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "CCL_STORE_PATH",
    ] {
        cmd.env_remove(k);
    }
    cmd.arg(bin);
    cmd
}

/// What one `mpirun` did.
#[derive(Debug)]
pub struct Outcome {
    /// Exit code; `None` when killed (by us on the deadline, or a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub timed_out: bool,
}

/// Runs `cmd` (in a process group of its own) to completion, or kills the
/// whole group once `deadline` has passed.
pub fn run_bounded(mut cmd: Command, deadline: Duration) -> std::io::Result<Outcome> {
    use std::{io::Read, os::unix::process::CommandExt, process::Stdio};
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd.spawn()?;
    let pgid = child.id();
    let mut out = child.stdout.take().expect("piped stdout");
    let mut err = child.stderr.take().expect("piped stderr");
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() > deadline {
            timed_out = true;
            // The whole group: mpirun and every rank it started.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pgid}")])
                .status();
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(Outcome {
        code: status.code(),
        stdout: o.join().unwrap_or_default(),
        stderr: e.join().unwrap_or_default(),
        elapsed: start.elapsed(),
        timed_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_parse() {
        assert_eq!(list::<u64>("X", "1, 2,3").unwrap(), vec![1, 2, 3]);
        assert!(list::<u64>("X", "").is_err());
        assert!(list::<u64>("X", "a").is_err());
    }

    #[test]
    fn bounded_run_kills_on_deadline() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 30 & sleep 30"]);
        let o = run_bounded(cmd, Duration::from_millis(300)).unwrap();
        assert!(o.timed_out && o.elapsed < Duration::from_secs(10));
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo hi; exit 3"]);
        let o = run_bounded(cmd, Duration::from_secs(10)).unwrap();
        assert_eq!((o.code, o.stdout.as_str()), (Some(3), "hi\n"));
    }
}
