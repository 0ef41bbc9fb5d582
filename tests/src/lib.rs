//! Harness for ccl's multi-process tests: launches N real processes of a
//! worker binary with torchrun-style variables and collects what they did;
//! and runs ranks as threads of the test process.

use std::{
    io::Read,
    process::{Child, Command, Stdio},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use ccl::{Communicator, Error, HashStore, Options, Store};

pub mod loopback;

/// Runs `f(comm)` on `n` ranks, each a thread of this process with its own
/// communicator (all on one host, so they share memory as processes would).
pub fn with_ranks<T: Send + 'static>(
    n: usize,
    options: Options,
    f: impl Fn(Communicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(HashStore::new());
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (store, f, options) = (store.clone(), f.clone(), options.clone());
            thread::spawn(move || {
                f(Communicator::new(rank, n, store, options).expect("communicator"))
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread panicked"))
        .collect()
}

/// The message of an invalid-argument error; panics on anything else.
pub fn invalid<T: std::fmt::Debug>(r: ccl::Result<T>) -> String {
    match r {
        Err(Error::InvalidArgument(m)) => m,
        other => panic!("expected an invalid-argument error, got {other:?}"),
    }
}

/// What one rank's process did.
#[derive(Debug)]
pub struct RankOutput {
    pub rank: usize,
    /// Process id.
    pub pid: u32,
    /// Exit code; `None` if killed by a signal.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// When it exited, counted from the launch.
    pub elapsed: Duration,
}

impl RankOutput {
    /// Everything the rank printed.
    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs `program args` as ranks 0..n with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `MASTER_ADDR`, `MASTER_PORT` set, plus `env`. Kills every rank still running
/// after `deadline` and reports it as killed.
pub fn launch(
    program: &str,
    args: &[&str],
    n: usize,
    env: &[(&str, String)],
    deadline: Duration,
) -> Vec<RankOutput> {
    launch_each(program, args, n, |_| env.to_vec(), deadline)
}

/// [`launch`] with variables that differ per rank: `env(rank)`.
pub fn launch_each<'a>(
    program: &str,
    args: &[&str],
    n: usize,
    env: impl Fn(usize) -> Vec<(&'a str, String)>,
    deadline: Duration,
) -> Vec<RankOutput> {
    let port = ccl::free_port()
        .expect("a free port for the store")
        .to_string();
    let start = Instant::now();
    let mut children: Vec<(
        Child,
        thread::JoinHandle<String>,
        thread::JoinHandle<String>,
    )> = (0..n)
        .map(|rank| {
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in env(rank) {
                cmd.env(k, v);
            }
            let mut child = cmd
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
            let mut out = child.stdout.take().unwrap();
            let mut err = child.stderr.take().unwrap();
            let o = thread::spawn(move || {
                let mut s = String::new();
                let _ = out.read_to_string(&mut s);
                s
            });
            let e = thread::spawn(move || {
                let mut s = String::new();
                let _ = err.read_to_string(&mut s);
                s
            });
            (child, o, e)
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(|(c, _, _)| c.id()).collect();
    let mut status: Vec<Option<(Option<i32>, Duration)>> = vec![None; n];
    while status.iter().any(Option::is_none) {
        for (rank, (child, _, _)) in children.iter_mut().enumerate() {
            if status[rank].is_none() {
                if let Ok(Some(s)) = child.try_wait() {
                    status[rank] = Some((s.code(), start.elapsed()));
                }
            }
        }
        if start.elapsed() > deadline {
            for (rank, (child, _, _)) in children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    status[rank] = Some((None, start.elapsed()));
                }
            }
        }
        thread::sleep(Duration::from_millis(5));
    }
    children
        .into_iter()
        .zip(status)
        .zip(pids)
        .enumerate()
        .map(|(rank, (((_, o, e), s), pid))| {
            let (code, elapsed) = s.unwrap();
            RankOutput {
                rank,
                pid,
                code,
                stdout: o.join().unwrap_or_default(),
                stderr: e.join().unwrap_or_default(),
                elapsed,
            }
        })
        .collect()
}

/// Panics with every rank's output unless all ranks exited 0.
pub fn assert_all_ok(outputs: &[RankOutput], what: &str) {
    if outputs.iter().all(|o| o.code == Some(0)) {
        return;
    }
    let mut msg = format!("{what}: not every rank succeeded\n");
    for o in outputs {
        msg += &format!(
            "--- rank {} exit {:?} after {:?}\n{}\n",
            o.rank,
            o.code,
            o.elapsed,
            o.text()
        );
    }
    panic!("{msg}");
}

/// Shared-memory segments of these processes still in `/dev/shm`.
pub fn leftovers(outputs: &[RankOutput]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .expect("/dev/shm")
        .filter_map(|f| f.ok()?.file_name().into_string().ok())
        .filter(|f| {
            outputs
                .iter()
                .any(|o| f.starts_with(&format!("ccl-{}-", o.pid)))
        })
        .collect()
}

/// Panics if any rank panicked.
pub fn no_panic(outputs: &[RankOutput]) {
    for o in outputs {
        assert!(
            !o.text().contains("panicked"),
            "rank {} panicked:\n{}",
            o.rank,
            o.text()
        );
    }
}

/// `ccl-run`, which `cargo test --workspace` builds beside this crate's
/// binaries; `beside` is one of them (`env!("CARGO_BIN_EXE_...")`).
pub fn ccl_run(beside: &str) -> std::path::PathBuf {
    let path = std::path::PathBuf::from(beside).with_file_name("ccl-run");
    assert!(
        path.exists(),
        "{} is missing: run the workspace's tests (cargo test --workspace, or -p ccl-run) so that ccl-run is built",
        path.display()
    );
    path
}
