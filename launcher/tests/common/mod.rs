//! Helpers shared by the `ccl-run` integration tests: running the real
//! binary with a hard time limit, temp dirs for pid files, and liveness
//! checks for the processes the ranks started.

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Hard limit for any single `ccl-run` invocation in the tests.
pub const LIMIT: Duration = Duration::from_secs(10);

/// A `Command` for the `ccl-run` binary built by cargo, with a clean
/// `CCL_JOB_SECRET`.
pub fn ccl_run() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ccl-run"));
    cmd.env_remove("CCL_JOB_SECRET");
    cmd
}

/// The result of a finished `ccl-run`.
pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Finished {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

/// A running `ccl-run` whose output is being collected. Dropping it SIGKILLs
/// the launcher (its ranks then die of PR_SET_PDEATHSIG).
pub struct Running {
    pub child: Child,
    started: Instant,
    out: Option<JoinHandle<String>>,
    err: Option<JoinHandle<String>>,
}

fn collect<R: Read + Send + 'static>(mut r: R) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Starts `cmd` with piped stdout/stderr (stdin closed).
pub fn start(mut cmd: Command) -> Running {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd.spawn().expect("failed to start ccl-run");
    let out = collect(child.stdout.take().unwrap());
    let err = collect(child.stderr.take().unwrap());
    Running {
        child,
        started,
        out: Some(out),
        err: Some(err),
    }
}

impl Running {
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// Waits for the launcher to exit; panics (after SIGKILLing it) if it
    /// takes longer than `limit`.
    pub fn wait(mut self, limit: Duration) -> Finished {
        let deadline = self.started + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("ccl-run did not exit within {limit:?}");
            }
            thread::sleep(Duration::from_millis(10));
        };
        let elapsed = self.started.elapsed();
        // The launcher is gone, so its pipes close unless a rank escaped;
        // don't let that hang the test either.
        let stdout = join_bounded(self.out.take().unwrap(), deadline);
        let stderr = join_bounded(self.err.take().unwrap(), deadline);
        Finished {
            status,
            stdout,
            stderr,
            elapsed,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn join_bounded(h: JoinHandle<String>, deadline: Instant) -> String {
    while !h.is_finished() {
        if Instant::now() >= deadline + Duration::from_secs(2) {
            panic!("output pipe of ccl-run still open after it exited");
        }
        thread::sleep(Duration::from_millis(10));
    }
    h.join().unwrap()
}

/// Runs `cmd` to completion within [`LIMIT`].
pub fn run(cmd: Command) -> Finished {
    start(cmd).wait(LIMIT)
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let dir = std::env::temp_dir().join(format!(
            "ccl-run-test-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Shell-quoted path, for embedding in `sh -c` scripts.
    pub fn sh(&self) -> String {
        format!("'{}'", self.0.display())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// All pids written (one per line) to files named `pid*` in `dir`.
pub fn read_pids(dir: &Path) -> Vec<Pid> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        if !entry.file_name().to_string_lossy().starts_with("pid") {
            continue;
        }
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        pids.extend(
            text.split_whitespace()
                .filter_map(|s| s.parse::<i32>().ok())
                .map(Pid::from_raw),
        );
    }
    pids
}

/// Polls until at least `n` pids have been written into `dir`.
pub fn wait_for_pids(dir: &Path, n: usize, limit: Duration) -> Vec<Pid> {
    let deadline = Instant::now() + limit;
    loop {
        let pids = read_pids(dir);
        if pids.len() >= n {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} pids written within {limit:?}",
            pids.len()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether `pid` is a live (non-zombie) process. Orphans are reparented to
/// PID 1, which in containers may never reap them, so zombies count as dead.
pub fn alive(pid: Pid) -> bool {
    if kill(pid, None::<Signal>).is_err() {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // Format: "pid (comm) S ..." where comm may contain spaces/parens.
        Ok(stat) => match stat.rfind(')') {
            Some(i) => !stat[i + 1..].trim_start().starts_with(['Z', 'X']),
            None => true,
        },
        Err(_) => false,
    }
}

/// Asserts every pid is dead within `limit`; SIGKILLs survivors so that a
/// failing test does not leak processes.
pub fn assert_all_dead(pids: &[Pid], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
    let survivors: Vec<Pid> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &p in &survivors {
        let _ = kill(p, Signal::SIGKILL);
    }
    assert!(survivors.is_empty(), "processes survived: {survivors:?}");
}
