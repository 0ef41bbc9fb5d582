//! `ccl-bench bucketer` end to end: local ranks as real processes.

use std::{
    io::Read,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

const BIN: &str = env!("CARGO_BIN_EXE_ccl-bench");

/// Runs ccl-bench with `args` and no launcher variables; kills it after 120 s.
fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let mut cmd = Command::new(BIN);
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "CCL_STORE_PATH",
    ] {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ccl-bench starts");
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code(), out, err)
}

#[test]
fn prints_the_three_times_and_the_ratios() {
    let (code, out, err) = run(&[
        "bucketer",
        "--tensors",
        "40",
        "-b",
        "1KB",
        "-e",
        "64KB",
        "--cap",
        "256KB",
        "--ranks",
        "2",
        "-n",
        "2",
        "-w",
        "1",
        "--timeout",
        "60s",
    ]);
    assert_eq!(code, Some(0), "{out}\n{err}");
    for needle in [
        "40 f32 tensors of 1 KiB-64 KiB",
        "fused, owned Vecs",
        "fused in place",
        "one allreduce of the total",
        "40 separate iallreduces",
        "40 separate blocking allreduces",
        "# fused / one allreduce",
        "# separate / fused ",
        "# separate / one allreduce",
    ] {
        assert!(out.contains(needle), "missing '{needle}' in:\n{out}");
    }
    // Only rank 0 prints.
    assert_eq!(
        out.matches("one allreduce of the total").count(),
        1,
        "{out}"
    );
}

#[test]
fn bad_arguments_exit_2() {
    let (code, _, err) = run(&["bucketer", "-b", "1MB", "-e", "4KB"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--min-size is larger than --max-size"),
        "{err}"
    );
    let (code, _, err) = run(&["bucketer", "--tensors", "0"]);
    assert_eq!(code, Some(2), "{err}");
}
