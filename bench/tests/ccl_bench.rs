//! ccl-bench end to end: the real binary, real processes, real sockets.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_ccl-bench");

/// A variable every process of one test run inherits, to find strays by.
const MARK_VAR: &str = "CCL_BENCH_TEST_MARK";

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// A fresh marker and scratch directory for one run.
fn scratch(name: &str) -> (String, PathBuf) {
    let mark = format!(
        "{name}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let dir = std::env::temp_dir().join(format!("ccl-bench-test-{mark}"));
    std::fs::create_dir_all(&dir).unwrap();
    (mark, dir)
}

/// A clean environment: no launcher variables from whoever runs the tests.
fn command(mark: &str) -> Command {
    let mut cmd = Command::new(BIN);
    for (k, _) in std::env::vars() {
        if k.starts_with("OMPI_")
            || k.starts_with("PMI_")
            || k.starts_with("SLURM_")
            || k.starts_with("CCL_")
            || [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
            ]
            .contains(&k.as_str())
        {
            cmd.env_remove(k);
        }
    }
    cmd.env(MARK_VAR, mark).stdin(Stdio::null());
    cmd
}

fn run(mark: &str, args: &[&str]) -> Output {
    command(mark).args(args).output().expect("ccl-bench runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Processes still alive that carry `mark` in their environment.
fn live_with_mark(mark: &str) -> Vec<u32> {
    let needle = format!("{MARK_VAR}={mark}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|kv| kv == needle.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

/// Asserts that no process of the run is left (after a short grace for kills to land).
fn assert_no_strays(mark: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = live_with_mark(mark);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "stray processes of {mark}: {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_json(path: &Path) -> Value {
    let t = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("{}: {e}\n{t}", path.display()))
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "{} is not a PNG",
        path.display()
    );
    assert!(
        bytes.len() > 10_000,
        "{} is suspiciously small",
        path.display()
    );
}

/// Runs ccl-bench with `args` (a `--check` run) under a fresh mark and
/// returns its stdout, once it exited 0, found no wrong element and left no
/// process behind; `what` names the run in a failure.
fn checks_clean(scratch_name: &str, what: &str, args: &[&str]) -> String {
    let (mark, _) = scratch(scratch_name);
    let out = run(&mark, args);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{what}: {stdout}\n{}",
        text(&out.stderr)
    );
    assert!(
        stdout.contains("# Out of bounds values : 0 OK"),
        "{what}: {stdout}"
    );
    assert_no_strays(&mark);
    stdout
}

#[test]
fn allreduce_1mb_checks_clean() {
    let (mark, _) = scratch("one");
    let out = run(
        &mark,
        &[
            "allreduce",
            "--size",
            "1MB",
            "--ranks",
            "2",
            "--check",
            "--iters",
            "3",
        ],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let row = stdout
        .lines()
        .find(|l| !l.starts_with('#'))
        .expect("a result row");
    let f: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(f[0], "1048576", "256MB-style units are binary: {row}");
    assert_eq!(f[1], "262144");
    assert_eq!(f[2], "f32");
    assert_eq!(f[9], "0", "#wrong: {row}");
    assert!(stdout.contains("# ccl-bench allreduce: 2 ranks on 1 host"));
    assert!(stdout.contains("# setup: "), "{stdout}");
    // The CPUs of ranks 0 and 1 (the first two allowed) and their round trip.
    let line = stdout
        .lines()
        .find(|l| {
            l.starts_with("# core-to-core round trip, measured before the ranks started: CPUs ")
        })
        .unwrap_or_else(|| panic!("a core-to-core line\n{stdout}"));
    let ns: f64 = line
        .strip_suffix(" ns")
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("a round trip in ns: {line}"));
    assert!(ns > 0.0, "{line}");
    assert!(stdout.contains("# Avg bus bandwidth"));
    assert!(stdout.contains("# Out of bounds values : 0 OK"));
    assert_no_strays(&mark);
}

/// Every collective, 2 and 3 ranks, f32 and i32, a short sweep, every iteration checked.
/// Every collective ccl-bench runs.
const COLLECTIVES: [&str; 10] = [
    "allreduce",
    "broadcast",
    "reduce",
    "allgather",
    "reduce-scatter",
    "alltoall",
    "gather",
    "scatter",
    "sendrecv",
    "barrier",
];

#[test]
fn every_collective_checks_clean() {
    let mut jobs = Vec::new();
    for coll in COLLECTIVES {
        for ranks in ["2", "3"] {
            for dtype in ["f32", "i32"] {
                jobs.push((coll, ranks, dtype));
            }
        }
    }
    // A few at a time: the machine has 2 cores.
    let failures: Vec<String> = jobs
        .chunks(4)
        .flat_map(|chunk| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&(coll, ranks, dtype)| {
                    std::thread::spawn(move || check_one(coll, ranks, dtype))
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap().err())
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn check_one(coll: &str, ranks: &str, dtype: &str) -> Result<(), String> {
    let (mark, dir) = scratch(coll);
    let json = dir.join("r.json");
    let root = if ranks == "3" { "2" } else { "1" };
    let out = run(
        &mark,
        &[
            coll,
            "-b",
            "8B",
            "-e",
            "64KB",
            "-f",
            "8",
            "--ranks",
            ranks,
            "--dtype",
            dtype,
            "--root",
            root,
            "--check",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let what = format!("{coll} ranks {ranks} {dtype}");
    if !out.status.success() {
        return Err(format!(
            "{what}: failed\n{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        ));
    }
    let v = read_json(&json);
    let rows = v["rows"].as_array().ok_or(format!("{what}: no rows"))?;
    let want_rows = if coll == "barrier" { 1 } else { 2 };
    if rows.len() < want_rows {
        return Err(format!("{what}: {} rows", rows.len()));
    }
    for r in rows {
        if r["wrong"] != 0 {
            return Err(format!("{what}: wrong elements in {r}"));
        }
        if r["dtype"] != dtype {
            return Err(format!("{what}: dtype in {r}"));
        }
    }
    if v["config"]["ranks"] != ranks.parse::<u64>().unwrap() {
        return Err(format!("{what}: config {}", v["config"]));
    }
    assert_no_strays(&mark);
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

/// Calls whose outputs together reach 64 MiB, which the shared-memory board
/// writes with streaming stores: every collective, in place and out of
/// place, 2 and 3 ranks (uneven shares), checked; reduce also as
/// board-direct, where only the root has an output.
#[test]
fn large_board_calls_with_streaming_stores_check_clean() {
    let jobs = COLLECTIVES
        .into_iter()
        .filter(|c| !["sendrecv", "barrier"].contains(c))
        .map(|c| (c, "auto"))
        .chain([("reduce", "board-direct")]);
    for (coll, algo) in jobs {
        for ranks in ["2", "3"] {
            for inplace in [false, true] {
                let mut args = vec![
                    coll,
                    "--size",
                    "64MB",
                    "--ranks",
                    ranks,
                    "--transport",
                    "shm",
                    "--root",
                    "1",
                    "--algo",
                    algo,
                    "--check",
                    "--iters",
                    "2",
                    "--warmup",
                    "0",
                ];
                if inplace {
                    args.push("--inplace");
                }
                let what = format!("{coll} ({algo}) ranks {ranks} in place {inplace}");
                let stdout = checks_clean("stream", &what, &args);
                assert!(
                    stdout.contains("board"),
                    "{what}: not on the board: {stdout}"
                );
            }
        }
    }
}

/// `--shared-buffers`: every collective and sendrecv on buffers the peers
/// map, 2 and 3 ranks, in place and out of place, from the smallest
/// by-reference message to reductions of several board chunks, checked.
#[test]
fn shared_buffers_check_clean() {
    for coll in COLLECTIVES.into_iter().filter(|&c| c != "barrier") {
        for ranks in ["2", "3"] {
            for inplace in [false, true] {
                if inplace && coll == "sendrecv" {
                    continue;
                }
                let mut args = vec![
                    coll,
                    "-b",
                    "64KB",
                    "-e",
                    "4MB",
                    "-f",
                    "8",
                    "--ranks",
                    ranks,
                    "--transport",
                    "shm",
                    "--root",
                    "1",
                    "--shared-buffers",
                    "--check",
                    "--iters",
                    "2",
                    "--warmup",
                    "1",
                ];
                if inplace {
                    args.push("--inplace");
                }
                checks_clean(
                    "shared",
                    &format!("{coll} ranks {ranks} in place {inplace}"),
                    &args,
                );
            }
        }
    }
}

#[test]
fn in_place_forms_check_clean() {
    for coll in [
        "allreduce",
        "allgather",
        "reduce-scatter",
        "alltoall",
        "gather",
        "scatter",
    ] {
        let (mark, _) = scratch("inplace");
        let out = run(
            &mark,
            &[
                coll,
                "-b",
                "64B",
                "-e",
                "4KB",
                "-f",
                "8",
                "--ranks",
                "3",
                "--root",
                "1",
                "--inplace",
                "--check",
                "--iters",
                "2",
                "--warmup",
                "0",
                "--dtype",
                "u8",
            ],
        );
        let stdout = text(&out.stdout);
        assert!(
            out.status.success(),
            "{coll}: {stdout}\n{}",
            text(&out.stderr)
        );
        assert!(stdout.contains("in-place"), "{stdout}");
        assert!(
            stdout.contains("# Out of bounds values : 0 OK"),
            "{coll}: {stdout}"
        );
    }
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let (mark, dir) = scratch("bad");
    let missing = dir.join("no/such/dir/x.json");
    let cases: Vec<Vec<String>> = [
        vec!["allreduc"],
        vec!["frobnicate", "--size", "1MB"],
        vec!["allreduce", "--size", "12XB"],
        vec!["allreduce", "--size", "-5MB"],
        vec!["allreduce", "--size", "0"],
        vec!["allreduce", "--min-size", "0B"],
        vec!["allreduce", "--size", "MB"],
        vec!["allreduce", "--ranks", "0"],
        vec!["allreduce", "--ranks", "-2"],
        vec!["allreduce", "--dtype", "f32", "--op", "band"],
        vec!["reduce", "--dtype", "bf16", "--op", "bxor"],
        vec!["broadcast", "--ranks", "2", "--root", "2"],
        vec!["scatter", "--ranks", "3", "--root", "7"],
        vec!["allreduce", "--iters", "0"],
        vec!["allreduce", "--factor", "1"],
        vec!["allreduce", "--min-size", "1MB", "--max-size", "1KB"],
        vec!["allreduce", "--transport", "ib"],
        vec!["allreduce", "--algo", "tree"],
        vec!["allreduce", "--dtype", "f128"],
        vec!["allreduce", "--timeout", "soon"],
        vec!["allreduce", "--plot", "x.svg"],
        vec!["sendrecv", "--ranks", "1"],
        vec!["allreduce", "--json", missing.to_str().unwrap()],
        vec!["compare-mpi", "frobnicate"],
        vec!["compare-mpi", "allreduce", "--dtype", "f16"],
        vec!["compare", "allreduce", "--peers", "nccl"],
        vec!["compare", "allreduce", "--transport", "ib"],
        vec!["compare", "gather"],
        vec!["compare", "allreduce", "--peers", "gloo", "--dtype", "u32"],
        vec![
            "compare",
            "allreduce",
            "--peers",
            "oneccl",
            "--op",
            "band",
            "--dtype",
            "i32",
        ],
    ]
    .into_iter()
    .map(|v| v.into_iter().map(String::from).collect())
    .collect();
    for args in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let start = Instant::now();
        let out = run(&mark, &args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("ccl-bench: "), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{args:?} was slow"
        );
    }
    // A bad environment for the ranks is caught before any is started.
    let out = command(&mark)
        .env("CCL_NSOCKS", "0")
        .args(["allreduce", "--size", "8B"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr).lines().count(), 1);
    assert_no_strays(&mark);
}

#[test]
fn reports_are_written_and_well_formed() {
    let (mark, dir) = scratch("files");
    let (json, csv, png) = (dir.join("r.json"), dir.join("r.csv"), dir.join("r.png"));
    let out = run(
        &mark,
        &[
            "allreduce",
            "-b",
            "1KB",
            "-e",
            "256KB",
            "-f",
            "4",
            "--ranks",
            "2",
            "--algo",
            "all",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--json",
            json.to_str().unwrap(),
            "--csv",
            csv.to_str().unwrap(),
            "--plot",
            png.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = read_json(&json);
    let rows = v["rows"].as_array().unwrap();
    // 1K, 4K, 16K, 64K, 256K, each with every allreduce algorithm in turn:
    // the schedules (the ring also with 128 KiB and 1 MiB pieces), then the
    // board algorithms (two local ranks share memory).
    let every: Vec<&str> = ccl_algorithms::Algorithm::for_kind(ccl::CollectiveKind::AllReduce)
        .iter()
        .flat_map(|a| match a.name() {
            "ring" => vec!["ring", "ring/128K", "ring/1M"],
            name => vec![name],
        })
        .chain(["board", "board-direct"])
        .collect();
    assert_eq!(rows.len(), 5 * every.len(), "{rows:?}");
    let algos: Vec<&str> = rows.iter().map(|r| r["algo"].as_str().unwrap()).collect();
    assert_eq!(algos[..every.len()], every[..]);
    for r in rows {
        let t = |k: &str| r[k].as_f64().unwrap();
        assert!(t("time_us") > 0.0);
        assert!(t("busbw_gbps") > 0.0);
        assert_eq!(r["wrong"], Value::Null);
        // The slowest rank's loop is no longer than the sum of each
        // iteration's slowest rank, and no rank's loop is longer than it
        // (a thousandth of a microsecond of rounding allowed).
        assert!(t("time_us") <= t("iteration_mean_us") + 1e-3, "{r}");
        assert!(t("time_us_rank0") <= t("time_us") + 1e-3, "{r}");
        assert!(t("min_time_us") <= t("median_time_us"), "{r}");
        assert!(t("median_time_us") <= t("max_time_us"), "{r}");
    }
    let c = &v["config"];
    assert_eq!(c["ranks"], 2);
    assert_eq!(c["transport"], "auto");
    assert_eq!(c["algo_requested"], "all");
    assert_eq!(c["hosts"].as_array().unwrap().len(), 1);
    assert!(v["versions"]["ccl"].is_string());
    assert!(v["versions"]["rustc"]
        .as_str()
        .unwrap()
        .starts_with("rustc"));
    assert!(v["setup_s"].as_f64().unwrap() > 0.0);
    assert!(v["peak_busbw_gbps"].as_f64().unwrap() >= v["avg_busbw_gbps"].as_f64().unwrap());

    let csv = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 1 + rows.len(), "{csv}");
    let cols = lines[0].split(',').count();
    assert!(lines[0].starts_with("collective,ranks,"));
    for l in &lines[1..] {
        assert_eq!(l.split(',').count(), cols, "{l}");
        assert!(l.starts_with("allreduce,2,1,"), "{l}");
    }
    assert_png(&png);
    assert_no_strays(&mark);
}

#[test]
fn algo_all_over_tcp_leaves_out_the_board() {
    let (mark, dir) = scratch("tcp-all");
    let json = dir.join("r.json");
    let out = run(
        &mark,
        &[
            "allreduce",
            "-s",
            "8B",
            "--ranks",
            "2",
            "--transport",
            "tcp",
            "--algo",
            "all",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v = read_json(&json);
    let algos: Vec<&str> = v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["algo"].as_str().unwrap())
        .collect();
    assert!(
        algos.contains(&"ring") && algos.contains(&"rd"),
        "{algos:?}"
    );
    assert!(!algos.iter().any(|a| a.starts_with("board")), "{algos:?}");
    let mut unique = algos.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        algos.len(),
        "an algorithm ran twice: {algos:?}"
    );
}

#[test]
fn a_dying_rank_is_named_and_the_rest_stopped() {
    let (mark, _) = scratch("die");
    let start = Instant::now();
    let out = command(&mark)
        .env("CCL_BENCH_TEST_DIE_RANK", "1")
        .args([
            "allreduce",
            "--size",
            "64KB",
            "--ranks",
            "3",
            "--timeout",
            "20s",
        ])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert_ne!(out.status.code(), Some(2));
    assert!(
        stderr.contains("ccl-bench: rank 1 exited with status 3"),
        "{stderr}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert_no_strays(&mark);
}

/// Under a launcher (here torchrun-style variables set by the test), each
/// process is one rank; when one dies the others fail promptly, naming it.
#[test]
fn under_a_launcher_each_process_is_a_rank() {
    let launch = |mark: &str, die: Option<&str>, extra: &[&str]| {
        // Below the ephemeral range, and fresh for each job (see `ccl::free_port`).
        let port = ccl::free_port().unwrap();
        let children: Vec<_> = (0..3)
            .map(|rank| {
                let mut cmd = command(mark);
                cmd.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", "3")
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .args(["broadcast", "--size", "64KB", "--root", "2", "--check"])
                    .args(["--iters", "3", "--timeout", "20s"])
                    .args(extra)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
                if let Some(d) = die {
                    cmd.env("CCL_BENCH_TEST_DIE_RANK", d);
                }
                cmd.spawn().unwrap()
            })
            .collect();
        children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect::<Vec<_>>()
    };
    let (mark, _) = scratch("launcher");
    let outs = launch(&mark, None, &[]);
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}: {}", text(&o.stderr));
    }
    let table = text(&outs[0].stdout);
    assert!(table.contains("3 ranks on 1 host"), "{table}");
    assert!(table.contains("torchrun-style"), "{table}");
    assert!(table.contains("# Out of bounds values : 0 OK"), "{table}");
    assert!(outs[1].stdout.is_empty() && outs[2].stdout.is_empty());

    let start = Instant::now();
    let outs = launch(&mark, Some("2"), &[]);
    assert!(start.elapsed() < Duration::from_secs(15));
    for (r, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "rank {r} succeeded");
        if r != 2 {
            let e = text(&o.stderr);
            assert!(e.contains("lost rank 2"), "rank {r}: {e}");
        }
    }

    // --ranks must agree with the launcher.
    let outs = launch(&mark, None, &["--ranks", "4"]);
    for o in &outs {
        assert_eq!(o.status.code(), Some(2));
    }
    assert_eq!(text(&outs[0].stderr).lines().count(), 1);
    assert!(
        outs[1].stderr.is_empty(),
        "only rank 0 reports usage errors"
    );
    assert_no_strays(&mark);
}

/// OpenMPI side by side. OpenMPI is part of the test environment
/// (scripts/test installs it): without mpirun this test fails, it never skips.
#[test]
fn compare_mpi_runs_openmpi() {
    let (mark, dir) = scratch("mpi");
    let (json, png) = (dir.join("c.json"), dir.join("c.png"));
    let out = run(
        &mark,
        &[
            "compare-mpi",
            "allreduce",
            "--size",
            "64KB",
            "--ranks",
            "2",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            png.to_str().unwrap(),
        ],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "compare-mpi failed (is OpenMPI installed?)\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("Open MPI"), "{stdout}");
    let v = read_json(&json);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["size_bytes"], 65536);
    for k in ["ratio_shm", "ratio_tcp"] {
        assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
    }
    for k in ["mpi_shm", "mpi_tcp"] {
        assert_eq!(r[k]["size_bytes"], 65536, "{k}: {r}");
        assert!(r[k]["busbw_gbps"].as_f64().unwrap() > 0.0, "{k}: {r}");
    }
    assert!(v["versions"]["openmpi"]
        .as_str()
        .unwrap()
        .starts_with("Open MPI"));
    assert_png(&png);
    assert_no_strays(&mark);
}

/// Broadcast is compared in its one-buffer form, ccl's too: every peer's
/// broadcast has one buffer, and ccl's out-of-place form would also copy the
/// root's input to its output.
#[test]
fn compare_runs_broadcast_in_place() {
    let (mark, dir) = scratch("bcast");
    let json = dir.join("bcast.json");
    let out = run(
        &mark,
        &[
            "compare",
            "broadcast",
            "-b",
            "4KB",
            "-e",
            "4KB",
            "--ranks",
            "2",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--peers",
            "openmpi",
            "--membw-size",
            "1MB",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("in-place"), "{stdout}");
    assert_eq!(read_json(&json)["config"]["inplace"], true);
    assert_no_strays(&mark);
}

/// Every peer of `compare` must run: OpenMPI, MPICH, oneCCL (its wheels in
/// target/oneccl) and Gloo (torch in target/venv), as scripts/test installs
/// them. A missing peer fails this test; it is never skipped.
#[test]
fn compare_runs_every_peer() {
    let (mark, dir) = scratch("peers");
    for (link, sizes) in [
        ("shm", ["-b", "8", "-e", "64KB"]),
        ("tcp", ["-b", "64KB", "-e", "64KB"]),
    ] {
        let (json, csv, png) = (
            dir.join(format!("{link}.json")),
            dir.join(format!("{link}.csv")),
            dir.join(format!("{link}.png")),
        );
        let mut args = vec!["compare", "allreduce"];
        args.extend(sizes);
        args.extend([
            "-f", "8192", "--ranks", "2", "--iters", "3", "--warmup", "1",
        ]);
        args.extend(["--transport", link, "--membw-size", "4MB"]);
        args.extend([
            "--json",
            json.to_str().unwrap(),
            "--csv",
            csv.to_str().unwrap(),
        ]);
        args.extend(["--plot", png.to_str().unwrap()]);
        let out = run(&mark, &args);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(
            out.status.success(),
            "compare over {link} failed (are all four peers installed? scripts/test installs them)\n{stdout}\n{stderr}"
        );
        let v = read_json(&json);
        assert_eq!(v["config"]["transport"], link);
        let peers: Vec<&str> = v["config"]["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect();
        assert_eq!(peers, ["openmpi", "mpich", "oneccl", "gloo"], "{v}");
        for p in v["config"]["peers"].as_array().unwrap() {
            assert!(!p["version"].as_str().unwrap().is_empty(), "{p}");
        }
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), if link == "shm" { 2 } else { 1 }, "{v}");
        for r in rows {
            assert!(r["ccl"]["busbw_gbps"].as_f64().unwrap() > 0.0, "{r}");
            let ps = r["peers"].as_array().unwrap();
            assert_eq!(ps.len(), 4, "{r}");
            for p in ps {
                assert_eq!(p["size_bytes"], r["size_bytes"], "{r}");
                assert!(p["busbw_gbps"].as_f64().unwrap() > 0.0, "{p}");
            }
            assert!(r["ratio_to_best"].as_f64().unwrap() > 0.0, "{r}");
            // A core-to-core round trip before every job, one per round.
            assert!(r["core_to_core_ns"].as_f64().unwrap() > 0.0, "{r}");
            let ccl_probes = r["ccl_round_core_to_core_ns"].as_array().unwrap();
            assert_eq!(ccl_probes.len(), 1, "{r}");
            for p in ps {
                assert_eq!(
                    p["round_core_to_core_ns"].as_array().unwrap().len(),
                    1,
                    "{p}"
                );
            }
        }
        assert!(stdout.contains("# c2c over the run: median "), "{stdout}");
        let m = &v["memory"];
        assert!(m["best"]["copy_gbps"].as_f64().unwrap() > 0.0, "{m}");
        assert!(m["bound_busbw_gbps"].as_f64().unwrap() > 0.0, "{m}");
        // Over TCP plain streams bound it too; over shm they are not measured.
        let t = &v["tcp"];
        if link == "tcp" {
            assert!(t["best_gbps"].as_f64().unwrap() > 0.0, "{t}");
            for pattern in ["ring_gbps", "one_gbps"] {
                assert!(t["before"][pattern].as_f64().unwrap() > 0.0, "{t}");
            }
            assert!(t["bound_busbw_gbps"].as_f64().unwrap() > 0.0, "{t}");
            assert!(
                !t["after"]["congestion"].as_str().unwrap().is_empty(),
                "{t}"
            );
            for r in rows {
                assert!(r["ccl_of_tcp_bound"].as_f64().unwrap() > 0.0, "{r}");
            }
            assert!(
                stdout.contains("# TCP bound of allreduce at 2 ranks"),
                "{stdout}"
            );
        } else {
            assert!(t.is_null(), "{t}");
        }
        let csv_text = std::fs::read_to_string(&csv).unwrap();
        assert_eq!(csv_text.lines().count(), 1 + rows.len() * 5, "{csv_text}");
        assert_png(&png);
    }
    // A peer that is not there fails the run (exit 1), naming it.
    let out = run(
        &mark,
        &[
            "compare",
            "allreduce",
            "--size",
            "8B",
            "--peers",
            "oneccl",
            "--oneccl",
            dir.join("no-oneccl").to_str().unwrap(),
        ],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("ccl-bench: compare: oneccl: "),
        "{stderr}"
    );
    assert_no_strays(&mark);
}

#[test]
fn tune_writes_a_table_the_tuner_reads() {
    let (mark, dir) = scratch("tune");
    let table = dir.join("tuning.table");
    let out = run(
        &mark,
        &[
            "tune",
            "--world-sizes",
            "2,3",
            "--links",
            "shm",
            "--collectives",
            "allreduce,broadcast",
            "-b",
            "8",
            "-e",
            "256K",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
            "--out",
            table.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let text = std::fs::read_to_string(&table).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let tuner = ccl_algorithms::Table::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    for kind in [
        ccl::CollectiveKind::AllReduce,
        ccl::CollectiveKind::Broadcast,
    ] {
        for n in [2, 3] {
            let lines: Vec<_> = tuner
                .entries()
                .iter()
                .filter(|e| e.collective == kind && e.ranks == n)
                .collect();
            assert!(!lines.is_empty(), "no {kind} lines for {n} ranks:\n{text}");
            assert_eq!(lines.last().unwrap().up_to_bytes, None, "{text}");
        }
    }
}

/// `--device cuda` on the stand-in GPU (`CCL_CUDA_STAND_IN=1`, host memory
/// posing as device memory): every collective, in place and out of place,
/// through CUDA IPC and through host staging, checked, with the device and
/// its copy bandwidth in the header.
#[test]
fn device_buffers_check_clean_on_the_stand_in() {
    for coll in COLLECTIVES.into_iter().filter(|&c| c != "barrier") {
        for (inplace, ipc) in [(false, "1"), (true, "1"), (false, "0"), (true, "0")] {
            if inplace && coll == "sendrecv" {
                continue; // it has no in-place form
            }
            let (mark, _) = scratch("device");
            let mut args = vec![
                coll, "--device", "cuda", "-b", "8B", "-e", "1MB", "-f", "32", "--ranks", "3",
                "--root", "1", "--check", "--iters", "2", "--warmup", "1",
            ];
            if inplace {
                args.push("--inplace");
            }
            let out = command(&mark)
                .env("CCL_CUDA_STAND_IN", "1")
                .env("CCL_CUDA_CHUNK", "65536")
                .env("CCL_CUDA_IPC_CHUNK", "65536")
                .env("CCL_CUDA_IPC", ipc)
                .args(&args)
                .output()
                .expect("ccl-bench runs");
            let stdout = text(&out.stdout);
            let what = format!("{coll} inplace {inplace} IPC {ipc}");
            assert!(
                out.status.success(),
                "{what}: {stdout}\n{}",
                text(&out.stderr)
            );
            assert!(
                stdout.contains("# device: stand-in GPU 0")
                    && stdout.contains("device-to-device copy"),
                "{what}: {stdout}"
            );
            assert!(
                stdout.contains("# Out of bounds values : 0 OK"),
                "{what}: {stdout}"
            );
            assert_no_strays(&mark);
        }
    }
}

/// Without a CUDA driver `--device cuda` stops with the reason, naming the library.
#[test]
fn device_cuda_without_a_driver_says_why() {
    if std::env::var("CCL_REQUIRE_CUDA").is_ok_and(|v| v == "1") {
        return; // a GPU machine: the driver is there
    }
    let (mark, _) = scratch("nocuda");
    let out = run(
        &mark,
        &["allreduce", "--device", "cuda", "--size", "1KB", "-N", "2"],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("CUDA is not available") && stderr.contains("libcuda.so"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_no_strays(&mark);
}
