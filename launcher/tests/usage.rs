//! Command-line errors: one clear line on stderr, exit status 2.

mod common;

use common::{ccl_run, run};

fn assert_usage_error(args: &[&str], needle: &str) {
    let mut cmd = ccl_run();
    cmd.args(args);
    let done = run(cmd);
    assert_eq!(done.code(), Some(2), "stderr: {}", done.stderr);
    assert_eq!(done.stdout, "");
    let lines: Vec<&str> = done.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "stderr: {}", done.stderr);
    assert!(lines[0].starts_with("ccl-run: "), "{}", lines[0]);
    assert!(lines[0].contains(needle), "{}", lines[0]);
}

#[test]
fn zero_ranks_is_rejected() {
    assert_usage_error(&["-n", "0", "true"], "at least 1");
}

#[test]
fn missing_program_is_rejected() {
    assert_usage_error(&["-n", "2"], "missing program");
    assert_usage_error(&["-n", "2", "--"], "missing program");
}

#[test]
fn program_not_found_is_rejected() {
    assert_usage_error(
        &["-n", "3", "ccl-run-test-no-such-program"],
        "'ccl-run-test-no-such-program': program not found",
    );
}

#[test]
fn non_executable_program_is_rejected() {
    let dir = common::TempDir::new();
    let file = dir.path().join("not-executable");
    std::fs::write(&file, "#!/bin/sh\n").unwrap();
    assert_usage_error(&["-n", "2", file.to_str().unwrap()], "permission denied");
}

#[test]
fn clap_errors_exit_2() {
    for args in [
        &["true"][..],
        &["-n", "x", "true"],
        &["-n", "1", "--grace", "-1", "true"],
        &["-n", "1", "--master-port", "0", "true"],
    ] {
        let mut cmd = ccl_run();
        cmd.args(args);
        let done = run(cmd);
        assert_eq!(done.code(), Some(2), "{args:?}: {}", done.stderr);
        assert!(
            done.stderr.starts_with("error:"),
            "{args:?}: {}",
            done.stderr
        );
    }
}

#[test]
fn help_describes_the_options() {
    let mut cmd = ccl_run();
    cmd.arg("--help");
    let done = run(cmd);
    assert_eq!(done.code(), Some(0));
    for needle in [
        "--nproc-per-node",
        "--master-addr",
        "--master-port",
        "--grace",
        "--no-tag-output",
        "CCL_JOB_SECRET",
    ] {
        assert!(done.stdout.contains(needle), "help lacks {needle}");
    }
}
