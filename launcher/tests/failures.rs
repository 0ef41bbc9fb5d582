//! Failure handling and signals: a failing rank stops the others, signals to
//! `ccl-run` stop everything, and no rank (or its helpers) survives.

mod common;

use std::time::Duration;

use common::{assert_all_dead, ccl_run, start, wait_for_pids, TempDir, LIMIT};
use nix::sys::signal::{kill, Signal};

/// Shell snippet: write this shell's pid to `$DIR/pid.$RANK`, then sleep in
/// place (`exec`), so the rank process itself is the sleeper.
fn exec_sleeper(dir: &TempDir) -> String {
    format!("echo $$ > {d}/pid.$RANK; exec sleep 30", d = dir.sh())
}

/// Shell snippet: start `sleep` as a *grandchild* of ccl-run and wait for
/// it; both pids are recorded. Only process-group signalling reaches it.
fn grandchild_sleeper(dir: &TempDir) -> String {
    format!(
        "sleep 30 & echo $! > {d}/pidg.$RANK; echo $$ > {d}/pid.$RANK; wait",
        d = dir.sh()
    )
}

/// Shell snippet: wait (at most ~5 s) until `n` pid files exist in `dir`.
fn await_pid_files(dir: &TempDir, n: usize) -> String {
    format!(
        "i=0; while [ $(ls {d} | wc -l) -lt {n} ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done",
        d = dir.sh()
    )
}

fn ccl_run_sh(n: usize, extra: &[&str], script: &str) -> std::process::Command {
    let mut cmd = ccl_run();
    cmd.arg("-n").arg(n.to_string()).args(extra);
    cmd.args(["--", "sh", "-c", script]);
    cmd
}

#[test]
fn failing_rank_stops_the_others() {
    let dir = TempDir::new();
    // Ranks 0,1 sleep directly, rank 3 via a grandchild, rank 2 fails with 3
    // once the four pid files (pid.0, pid.1, pid.3, pidg.3) exist.
    let script = format!(
        "case $RANK in 2) {wait}; exit 3;; 3) {g};; *) {e};; esac",
        wait = await_pid_files(&dir, 4),
        g = grandchild_sleeper(&dir),
        e = exec_sleeper(&dir),
    );
    let done = start(ccl_run_sh(4, &[], &script)).wait(LIMIT);
    assert_eq!(done.code(), Some(3), "stderr: {}", done.stderr);
    assert!(
        done.stderr
            .contains("ccl-run: rank 2 exited with status 3; stopping the other ranks"),
        "stderr: {}",
        done.stderr
    );
    assert!(
        done.elapsed < Duration::from_secs(4),
        "took {:?}",
        done.elapsed
    );
    let pids = common::read_pids(dir.path());
    assert_eq!(pids.len(), 4, "{pids:?}");
    assert_all_dead(&pids, Duration::from_secs(2));
}

#[test]
fn rank_killed_by_signal_is_reported() {
    let dir = TempDir::new();
    let script = format!(
        "if [ $RANK = 1 ]; then {wait}; kill -KILL $$; fi; {e}",
        wait = await_pid_files(&dir, 2),
        e = exec_sleeper(&dir),
    );
    let done = start(ccl_run_sh(3, &[], &script)).wait(LIMIT);
    assert_eq!(done.code(), Some(128 + 9), "stderr: {}", done.stderr);
    assert!(
        done.stderr
            .contains("ccl-run: rank 1 was killed by signal SIGKILL; stopping the other ranks"),
        "stderr: {}",
        done.stderr
    );
    assert!(
        done.elapsed < Duration::from_secs(4),
        "took {:?}",
        done.elapsed
    );
    let pids = common::read_pids(dir.path());
    assert_eq!(pids.len(), 2);
    assert_all_dead(&pids, Duration::from_secs(2));
}

#[test]
fn reports_the_first_failure_not_the_ranks_it_stopped() {
    let dir = TempDir::new();
    // Rank 0 turns the launcher's SIGTERM into exit status 7; rank 1 fails
    // first with 5, so 5 is what must be reported.
    let script = format!(
        "if [ $RANK = 1 ]; then {wait}; exit 5; fi; \
         trap 'exit 7' TERM; sleep 30 & echo $$ > {d}/pid.0; wait",
        wait = await_pid_files(&dir, 1),
        d = dir.sh(),
    );
    let done = start(ccl_run_sh(2, &[], &script)).wait(LIMIT);
    assert_eq!(done.code(), Some(5), "stderr: {}", done.stderr);
    assert!(
        done.stderr.contains("rank 1 exited with status 5"),
        "{}",
        done.stderr
    );
    assert!(!done.stderr.contains("rank 0"), "{}", done.stderr);
}

#[test]
fn ranks_ignoring_sigterm_are_killed_after_the_grace_period() {
    let dir = TempDir::new();
    let script = format!(
        "trap '' TERM; if [ $RANK = 0 ]; then {wait}; exit 4; fi; {e}",
        wait = await_pid_files(&dir, 2),
        e = exec_sleeper(&dir),
    );
    let done = start(ccl_run_sh(3, &["--grace", "1"], &script)).wait(LIMIT);
    assert_eq!(done.code(), Some(4), "stderr: {}", done.stderr);
    assert!(
        done.stderr.contains("rank 0 exited with status 4"),
        "{}",
        done.stderr
    );
    assert!(
        done.stderr.contains("rank(s) 1, 2 still running") && done.stderr.contains("SIGKILL"),
        "stderr: {}",
        done.stderr
    );
    assert!(
        done.elapsed >= Duration::from_millis(900) && done.elapsed < Duration::from_secs(5),
        "took {:?}",
        done.elapsed
    );
    assert_all_dead(&common::read_pids(dir.path()), Duration::from_secs(2));
}

/// Starts 3 sleeping ranks (one via a grandchild), sends `sig` to ccl-run and
/// checks the exit status and that nothing survives.
fn stop_with_signal(sig: Signal, expected_code: i32) {
    let dir = TempDir::new();
    let script = format!(
        "if [ $RANK = 2 ]; then {g}; else {e}; fi",
        g = grandchild_sleeper(&dir),
        e = exec_sleeper(&dir),
    );
    let running = start(ccl_run_sh(3, &[], &script));
    let pids = wait_for_pids(dir.path(), 4, Duration::from_secs(5));
    kill(running.pid(), sig).unwrap();
    let done = running.wait(LIMIT);
    assert_eq!(done.code(), Some(expected_code), "stderr: {}", done.stderr);
    assert!(
        done.stderr.contains(&format!(
            "ccl-run: received {}; stopping all ranks",
            sig.as_str()
        )),
        "stderr: {}",
        done.stderr
    );
    assert!(
        done.elapsed < Duration::from_secs(5),
        "took {:?}",
        done.elapsed
    );
    assert_all_dead(&pids, Duration::from_secs(2));
}

#[test]
fn sigint_stops_all_ranks() {
    stop_with_signal(Signal::SIGINT, 130);
}

#[test]
fn sigterm_stops_all_ranks() {
    stop_with_signal(Signal::SIGTERM, 143);
}

#[test]
fn second_sigint_skips_the_grace_period() {
    let dir = TempDir::new();
    let script = format!("trap '' TERM; {e}", e = exec_sleeper(&dir));
    let running = start(ccl_run_sh(2, &["--grace", "30"], &script));
    let pids = wait_for_pids(dir.path(), 2, Duration::from_secs(5));
    kill(running.pid(), Signal::SIGINT).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    kill(running.pid(), Signal::SIGINT).unwrap();
    let done = running.wait(LIMIT);
    assert_eq!(done.code(), Some(130), "stderr: {}", done.stderr);
    assert!(
        done.stderr.contains("received another signal"),
        "{}",
        done.stderr
    );
    assert!(
        done.elapsed < Duration::from_secs(5),
        "took {:?}",
        done.elapsed
    );
    assert_all_dead(&pids, Duration::from_secs(2));
}

#[test]
fn sigkill_of_the_launcher_leaves_no_ranks() {
    let dir = TempDir::new();
    let running = start(ccl_run_sh(3, &[], &exec_sleeper(&dir)));
    let pids = wait_for_pids(dir.path(), 3, Duration::from_secs(5));
    kill(running.pid(), Signal::SIGKILL).unwrap();
    let done = running.wait(LIMIT);
    assert_eq!(done.status.code(), None);
    // PR_SET_PDEATHSIG delivers SIGKILL to every rank.
    assert_all_dead(&pids, Duration::from_secs(2));
}
