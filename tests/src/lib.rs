//! Harness for ccl's multi-process tests: launches N real processes of a
//! worker binary with torchrun-style variables and collects what they did;
//! runs ranks as threads of the test process; finds the real launchers
//! (torchrun, mpirun) and runs them under a deadline.

use std::{
    io::Read,
    process::{Child, Command, Stdio},
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use ccl::{Communicator, Error, HashStore, Options, Store};

pub mod loopback;
pub mod netns;

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

/// How many times [`launch_each`] starts a job again whose store port another
/// process took between the pick and rank 0's bind.
const PORT_TAKEN_RETRIES: usize = 3;

/// [`launch`] with variables that differ per rank: `env(rank)`.
///
/// The store port is picked free ([`ccl::free_port`]), but another process
/// (a `ccl-run` of a concurrent test picks its own) may bind it before rank
/// 0 does: where rank 0 fails to bind that port (not one `env` gives it),
/// the job is killed and started again on another port, up to [`PORT_TAKEN_RETRIES`] times, saying so on stderr.
pub fn launch_each<'a>(
    program: &str,
    args: &[&str],
    n: usize,
    env: impl Fn(usize) -> Vec<(&'a str, String)>,
    deadline: Duration,
) -> Vec<RankOutput> {
    let mut retries = 0;
    loop {
        let port = ccl::free_port().expect("a free port for the store");
        match launch_on(port, program, args, n, &env, deadline) {
            Launched::PortTaken(_) if retries < PORT_TAKEN_RETRIES => {
                retries += 1;
                eprintln!(
                    "launch {program}: store port {port} was taken before rank 0 bound it; \
                     starting again on another ({retries} of {PORT_TAKEN_RETRIES})"
                );
            }
            Launched::PortTaken(out) | Launched::Ran(out) => return out,
        }
    }
}

/// What [`launch_on`] saw.
#[derive(Debug)]
pub enum Launched {
    /// Every rank ran to its end (or was killed at the deadline).
    Ran(Vec<RankOutput>),
    /// Rank 0 could not bind the store port; the other ranks were killed.
    PortTaken(Vec<RankOutput>),
}

/// Whether rank 0's output says it could not bind `port`, the store port
/// the launch picked (a test may give the ranks another, taken on purpose).
fn store_port_taken(text: &str, port: &str) -> bool {
    text.lines().any(|l| {
        l.contains("store server: binding")
            && l.contains(&format!(":{port}: "))
            && l.contains("Address already in use")
    })
}

/// [`launch_each`] once, on store port `port`.
pub fn launch_on<'a>(
    port: u16,
    program: &str,
    args: &[&str],
    n: usize,
    env: &impl Fn(usize) -> Vec<(&'a str, String)>,
    deadline: Duration,
) -> Launched {
    let port = port.to_string();
    let start = Instant::now();
    type Drains = Option<(thread::JoinHandle<String>, thread::JoinHandle<String>)>;
    let mut children: Vec<(Child, Drains)> = (0..n)
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
            let out = child.stdout.take().unwrap();
            let err = child.stderr.take().unwrap();
            (child, Some((drain(out), drain(err))))
        })
        .collect();
    let pids: Vec<u32> = children.iter().map(|(c, _)| c.id()).collect();
    let mut status: Vec<Option<(Option<i32>, Duration)>> = vec![None; n];
    // Rank 0's output, read as soon as it exited with an error.
    let mut first: Option<(String, String)> = None;
    let mut port_taken = false;
    while status.iter().any(Option::is_none) {
        for (rank, (child, _)) in children.iter_mut().enumerate() {
            if status[rank].is_none() {
                if let Ok(Some(s)) = child.try_wait() {
                    status[rank] = Some((s.code(), start.elapsed()));
                }
            }
        }
        if first.is_none() && status[0].is_some_and(|(code, _)| code != Some(0)) {
            let (o, e) = children[0].1.take().unwrap();
            let out = (o.join().unwrap_or_default(), e.join().unwrap_or_default());
            port_taken = store_port_taken(&format!("{}{}", out.0, out.1), &port);
            first = Some(out);
        }
        if port_taken || start.elapsed() > deadline {
            for (rank, (child, _)) in children.iter_mut().enumerate() {
                if status[rank].is_none() {
                    let _ = child.kill();
                    let _ = child.wait();
                    status[rank] = Some((None, start.elapsed()));
                }
            }
        }
        thread::sleep(Duration::from_millis(5));
    }
    let out = children
        .into_iter()
        .zip(status)
        .zip(pids)
        .enumerate()
        .map(|(rank, (((_, drains), s), pid))| {
            let (code, elapsed) = s.unwrap();
            let (stdout, stderr) = match drains {
                Some((o, e)) => (o.join().unwrap_or_default(), e.join().unwrap_or_default()),
                None => first.take().unwrap_or_default(),
            };
            RankOutput {
                rank,
                pid,
                code,
                stdout,
                stderr,
                elapsed,
            }
        })
        .collect();
    match port_taken {
        true => Launched::PortTaken(out),
        false => Launched::Ran(out),
    }
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

/// True under CI (`CI=true` or `1`): there a missing launcher fails a test.
pub fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

/// For a test that cannot run here because `why`: fails it under CI, and
/// elsewhere prints that it is skipped and why, returning `None`.
pub fn unavailable<T>(why: &str) -> Option<T> {
    assert!(
        !is_ci(),
        "{why}: under CI every launcher this test needs must be installed"
    );
    eprintln!("skipped: {why}");
    None
}

/// The Python virtual environment with torch that `CCL_TEST_VENV` names
/// (`bin/python` and `bin/torchrun` in it, and `torch.distributed`
/// importable), or [`unavailable`].
pub fn torch_venv() -> Option<std::path::PathBuf> {
    let Some(venv) = std::env::var_os("CCL_TEST_VENV") else {
        return unavailable("CCL_TEST_VENV (a Python virtual environment with torch) is not set");
    };
    let venv = std::path::PathBuf::from(venv);
    for tool in ["python", "torchrun"] {
        if !venv.join("bin").join(tool).is_file() {
            return unavailable(&format!("{} has no bin/{tool}", venv.display()));
        }
    }
    let import = Command::new(venv.join("bin/python"))
        .args(["-c", "import torch.distributed"])
        .output();
    match import {
        Ok(o) if o.status.success() => Some(venv),
        Ok(o) => unavailable(&format!(
            "{}/bin/python cannot import torch.distributed: {}",
            venv.display(),
            String::from_utf8_lossy(&o.stderr)
        )),
        Err(e) => unavailable(&format!("{}/bin/python: {e}", venv.display())),
    }
}

/// True when this process runs as root (mpirun then needs `--allow-run-as-root`).
pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// Whether OpenMPI's `mpirun` is on `PATH`; [`unavailable`] if not.
pub fn have_mpirun() -> bool {
    match Command::new("mpirun").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => {
            unavailable::<()>("mpirun (OpenMPI) is not on PATH");
            false
        }
    }
}

/// What a command run by [`run_bounded`] did.
#[derive(Debug)]
pub struct Outcome {
    /// Exit code; `None` when killed (by the deadline, or a signal).
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
}

impl Outcome {
    /// Everything it printed.
    pub fn text(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Reads `pipe` to its end on a thread of its own.
fn drain(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut s = String::new();
        let _ = pipe.read_to_string(&mut s);
        s
    })
}

/// Runs `cmd` in a process group of its own to completion, or kills the
/// whole group (a launcher and every rank it started) past `deadline`.
pub fn run_bounded(mut cmd: Command, deadline: Duration) -> Outcome {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let start = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let group = nix::unistd::Pid::from_raw(child.id() as i32);
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let (o, e) = (drain(out), drain(err));
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for the child") {
            break s;
        }
        if start.elapsed() > deadline {
            timed_out = true;
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
            break child.wait().expect("wait for the killed child");
        }
        thread::sleep(Duration::from_millis(20));
    };
    // Whatever the launcher left running in its group goes too, so that
    // the pipes close.
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    Outcome {
        code: status.code(),
        stdout: o.join().unwrap_or_default(),
        stderr: e.join().unwrap_or_default(),
        timed_out,
    }
}

/// Checks the output of `examples/data_parallel.rs` run as `n` ranks: every
/// rank printed its loss lines ("rank r/n step s loss l"), all ranks the
/// same ones, and the loss fell. Panics with `out` otherwise.
pub fn assert_data_parallel_output(out: &str, n: usize) {
    let mut losses: Vec<Vec<(usize, f64)>> = vec![Vec::new(); n];
    for line in out.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["rank", who, "step", step, "loss", loss] = words[..] {
            let (rank, world) = who.split_once('/').expect("rank r/n");
            assert_eq!(world, n.to_string(), "{line}\n{out}");
            let rank: usize = rank.parse().unwrap();
            losses[rank].push((step.parse().unwrap(), loss.parse().unwrap()));
        }
    }
    assert!(losses[0].len() >= 7, "too few loss lines of rank 0:\n{out}");
    for (r, l) in losses.iter().enumerate() {
        assert_eq!(
            l, &losses[0],
            "rank {r} saw other losses than rank 0:\n{out}"
        );
    }
    let (first, last) = (losses[0][0].1, losses[0].last().unwrap().1);
    assert!(
        last < first / 100.0,
        "loss did not fall: {first} -> {last}\n{out}"
    );
}
