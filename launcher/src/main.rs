//! `ccl-run`: launch N local ranks of a program with torchrun-style
//! environment variables (standalone, single-node mode).
//!
//! Lifecycle:
//! 1. Parse and validate the command line (usage errors exit with 2).
//! 2. Pick `MASTER_PORT` (a free local port unless given) and the job secret.
//! 3. Spawn one process per rank, each in its own process group, with
//!    `PR_SET_PDEATHSIG=SIGKILL` so that it dies if `ccl-run` dies, and with
//!    its stdout/stderr tagged `[rank R] ` by reader threads.
//! 4. Supervise: if every rank exits 0, exit 0. On the first failing rank, or
//!    on SIGINT/SIGTERM/SIGHUP to `ccl-run`, send SIGTERM to every rank's
//!    process group, wait up to the grace period, SIGKILL what is left and
//!    exit non-zero.

mod output;
mod signals;

use std::ffi::OsString;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use clap::Parser;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

/// Exit status for usage errors and failures to launch the ranks.
const EXIT_USAGE: i32 = 2;

/// How often the supervisor polls the ranks and the signal flags.
const POLL_INTERVAL: Duration = Duration::from_millis(10);

/// After the ranks have exited, how long to wait for their output pipes to
/// reach EOF. Only matters when some descendant escaped the rank's process
/// group and still holds the pipe open.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

use ccl_run::{Bind, SECRET_VAR};

/// Launch N local ranks of a program with torchrun-style environment variables.
#[derive(Parser, Debug)]
#[command(
    name = "ccl-run",
    version,
    override_usage = "ccl-run -n N [OPTIONS] [--] PROG [ARGS]...",
    about = "Launch N local ranks of a program with torchrun-style environment variables",
    after_help = "\
Each rank gets RANK, LOCAL_RANK (0..N-1), WORLD_SIZE, LOCAL_WORLD_SIZE (= N), GROUP_RANK=0,
MASTER_ADDR, MASTER_PORT and CCL_JOB_SECRET (a fresh random 64-hex-digit secret per launch,
unless CCL_JOB_SECRET is already set to a non-empty value). The ranks' stdin is /dev/null.

If a rank fails, or ccl-run receives SIGINT/SIGTERM/SIGHUP, all ranks get SIGTERM, then
SIGKILL after the grace period (a second signal to ccl-run skips the wait).

Exit status: 0 if all ranks exit 0; the first failing rank's exit code, or 128+signal if it
was killed by a signal; 128+signal if ccl-run itself was interrupted (130 for SIGINT, 143
for SIGTERM); 2 for usage errors or when the program cannot be started."
)]
struct Cli {
    /// Number of ranks (local processes) to launch.
    #[arg(short = 'n', long = "nproc-per-node", value_name = "N")]
    nproc: usize,

    /// Address of the rank-0 host, exported as MASTER_ADDR.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    master_addr: String,

    /// Port exported as MASTER_PORT [default: a free port on 127.0.0.1].
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    master_port: Option<u16>,

    /// Seconds to wait after SIGTERM before SIGKILLing ranks that are still running.
    #[arg(long, value_name = "SECS", default_value = "5", value_parser = parse_grace)]
    grace: Duration,

    /// Pin rank r to the (r mod n)-th of the n CPUs ccl-run may use (core), as
    /// `mpirun --bind-to core` does, or leave placement to the kernel (none).
    #[arg(
        long,
        value_name = "HOW",
        value_enum,
        default_value = "none",
        hide_possible_values = true
    )]
    bind: Bind,

    /// Prefix every line of the ranks' stdout/stderr with "[rank R] " (default).
    #[arg(long = "tag-output", overrides_with = "no_tag_output")]
    tag_output: bool,

    /// Pass the ranks' stdout/stderr through unmodified.
    #[arg(long = "no-tag-output", overrides_with = "tag_output")]
    no_tag_output: bool,

    /// Program to run in every rank (put `--` before it if it starts with `-`).
    #[arg(value_name = "PROG")]
    program: Option<OsString>,

    /// Arguments passed to PROG unchanged (they may start with `-`).
    #[arg(
        value_name = "ARGS",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    args: Vec<OsString>,
}

/// Parses `--grace`: a non-negative, finite number of seconds (fractions allowed).
fn parse_grace(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs)
        .map_err(|_| format!("'{s}' must be a non-negative, finite number of seconds"))
}

/// How a rank process ended.
#[derive(Clone, Copy, Debug)]
enum RankExit {
    /// Exited normally with this status code.
    Code(i32),
    /// Terminated by this signal number.
    Signal(i32),
    /// `waitpid` itself failed; should not happen.
    Unknown,
}

impl RankExit {
    fn from_status(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => RankExit::Code(code),
            (None, Some(sig)) => RankExit::Signal(sig),
            (None, None) => RankExit::Unknown,
        }
    }

    fn success(self) -> bool {
        matches!(self, RankExit::Code(0))
    }

    /// The exit status `ccl-run` uses when this rank is the first failure.
    fn launcher_exit_code(self) -> i32 {
        match self {
            RankExit::Code(code) if code != 0 => code,
            RankExit::Signal(sig) => 128 + sig,
            _ => 1,
        }
    }

    /// Human readable description, e.g. "exited with status 3".
    fn describe(self) -> String {
        match self {
            RankExit::Code(code) => format!("exited with status {code}"),
            RankExit::Signal(sig) => format!("was killed by signal {}", signal_name(sig)),
            RankExit::Unknown => "ended in an unknown way (wait failed)".to_string(),
        }
    }
}

/// `SIGKILL`-style name for a signal number, or `signal N` if unknown.
fn signal_name(sig: i32) -> String {
    Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

/// One launched rank.
struct Rank {
    rank: usize,
    child: Child,
    /// The rank's process group (it is the group leader, so pgid == pid).
    pgid: Pid,
    /// Set once the process has been reaped.
    exit: Option<RankExit>,
}

impl Rank {
    fn running(&self) -> bool {
        self.exit.is_none()
    }

    /// Non-blocking reap: records `exit` if the process has ended.
    fn poll(&mut self) {
        if self.running() {
            self.exit = match self.child.try_wait() {
                Ok(Some(status)) => Some(RankExit::from_status(status)),
                Ok(None) => None,
                Err(_) => Some(RankExit::Unknown),
            };
        }
    }

    /// Sends `sig` to the rank's whole process group (so helpers it started,
    /// e.g. the children of a shell, get it too). Errors such as ESRCH (the
    /// group is already gone) are expected and ignored.
    fn signal_group(&self, sig: Signal) {
        // Never call killpg with 0 or 1: those mean "our own group" / "all".
        if self.pgid.as_raw() > 1 && killpg(self.pgid, sig).is_ok() {
            return;
        }
        if self.running() {
            let _ = kill(self.pgid, sig);
        }
    }
}

/// Why the supervisor stopped waiting for the ranks.
enum Outcome {
    /// Every rank exited with status 0.
    AllSucceeded,
    /// This rank was the first to fail.
    RankFailed(usize, RankExit),
    /// `ccl-run` received this stop signal.
    Interrupted(Signal),
}

fn main() {
    let cli = Cli::parse();
    let code = run(cli);
    std::process::exit(code);
}

/// Runs the whole launch and returns `ccl-run`'s exit status.
fn run(cli: Cli) -> i32 {
    if cli.nproc == 0 {
        eprintln!("ccl-run: -n/--nproc-per-node must be at least 1 (got 0)");
        return EXIT_USAGE;
    }
    let Some(program) = cli.program.as_ref() else {
        eprintln!(
            "ccl-run: missing program to run (usage: ccl-run -n N [OPTIONS] [--] PROG [ARGS]...)"
        );
        return EXIT_USAGE;
    };
    let tag_output = !cli.no_tag_output;

    let master_port = match cli.master_port {
        Some(port) => port,
        None => match ccl_rendezvous::free_port() {
            Ok(port) => port,
            Err(e) => {
                eprintln!("ccl-run: could not find a free port for MASTER_PORT: {e}");
                return EXIT_USAGE;
            }
        },
    };
    // Keep a non-empty inherited secret; otherwise generate a fresh one.
    let secret = match ccl_run::job_secret() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ccl-run: could not generate {SECRET_VAR}: {e}");
            return EXIT_USAGE;
        }
    };

    if let Err(e) = signals::install() {
        eprintln!("ccl-run: could not install signal handlers: {e}");
        return EXIT_USAGE;
    }

    // Reader threads hold clones of `done_tx`; the channel disconnects once
    // they have all finished.
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let mut ranks: Vec<Rank> = Vec::with_capacity(cli.nproc);
    let base_env = RankEnv {
        world_size: cli.nproc,
        master_addr: &cli.master_addr,
        master_port,
        secret: secret.as_deref(),
    };

    let cpus = match cli.bind.cpus() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ccl-run: --bind core: cannot read the CPUs it may use: {e}");
            return EXIT_USAGE;
        }
    };

    for rank in 0..cli.nproc {
        let mut cmd = Command::new(program);
        cmd.args(&cli.args);
        base_env.apply(&mut cmd, rank);
        if let Some(cpu) = ccl_run::cpu_of(rank, &cpus) {
            ccl_run::pin_to_cpu(&mut cmd, cpu);
        }
        match spawn_rank(cmd, rank, tag_output, &done_tx) {
            Ok(r) => ranks.push(r),
            Err(e) => {
                eprintln!("{}", launch_error_message(program, rank, &e));
                stop_all(&mut ranks, cli.grace);
                drop(done_tx);
                drain_output(&done_rx);
                return EXIT_USAGE;
            }
        }
    }
    drop(done_tx);

    let code = match supervise(&mut ranks) {
        Outcome::AllSucceeded => 0,
        Outcome::RankFailed(rank, exit) => {
            let others = ranks.iter().any(Rank::running);
            let tail = if others {
                "; stopping the other ranks"
            } else {
                ""
            };
            eprintln!("ccl-run: rank {rank} {}{tail}", exit.describe());
            stop_all(&mut ranks, cli.grace);
            exit.launcher_exit_code()
        }
        Outcome::Interrupted(sig) => {
            eprintln!("ccl-run: received {}; stopping all ranks", sig.as_str());
            stop_all(&mut ranks, cli.grace);
            128 + sig as i32
        }
    };
    drain_output(&done_rx);
    code
}

/// The torchrun-style variables shared by all ranks.
struct RankEnv<'a> {
    world_size: usize,
    master_addr: &'a str,
    master_port: u16,
    /// `None` when the inherited `CCL_JOB_SECRET` is kept.
    secret: Option<&'a str>,
}

impl RankEnv<'_> {
    /// Sets the environment of rank `rank` (on top of the inherited one).
    fn apply(&self, cmd: &mut Command, rank: usize) {
        cmd.env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", self.world_size.to_string())
            .env("LOCAL_WORLD_SIZE", self.world_size.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", self.master_addr)
            .env("MASTER_PORT", self.master_port.to_string());
        if let Some(secret) = self.secret {
            cmd.env(SECRET_VAR, secret);
        }
    }
}

/// Spawns one rank and, when tagging, its two output reader threads.
///
/// The child is made the leader of a new process group (so the whole group can
/// be signalled) and gets `PR_SET_PDEATHSIG=SIGKILL`, so it is killed even if
/// `ccl-run` itself is SIGKILLed. Spawning must happen on the main thread:
/// the parent-death signal fires when the *thread* that forked exits.
fn spawn_rank(
    mut cmd: Command,
    rank: usize,
    tag_output: bool,
    done: &Sender<()>,
) -> io::Result<Rank> {
    cmd.stdin(Stdio::null()).process_group(0);
    if tag_output {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    ccl_run::die_with_parent(&mut cmd);

    let mut child = cmd.spawn()?;
    let pgid = Pid::from_raw(child.id() as i32);
    if let Err(e) = start_taggers(child.stdout.take(), child.stderr.take(), rank, done) {
        let _ = killpg(pgid, Signal::SIGKILL);
        let _ = child.wait();
        return Err(e);
    }
    Ok(Rank {
        rank,
        child,
        pgid,
        exit: None,
    })
}

/// Starts the reader threads for whichever pipes exist.
fn start_taggers(
    stdout: Option<std::process::ChildStdout>,
    stderr: Option<std::process::ChildStderr>,
    rank: usize,
    done: &Sender<()>,
) -> io::Result<()> {
    if let Some(out) = stdout {
        output::spawn_tagger(out, rank, output::Target::Stdout, done.clone())?;
    }
    if let Some(err) = stderr {
        output::spawn_tagger(err, rank, output::Target::Stderr, done.clone())?;
    }
    Ok(())
}

/// One-line description of a failure to start `program` for `rank`.
fn launch_error_message(program: &OsString, rank: usize, e: &io::Error) -> String {
    let prog = program.to_string_lossy();
    match e.kind() {
        io::ErrorKind::NotFound => format!("ccl-run: cannot run '{prog}': program not found"),
        io::ErrorKind::PermissionDenied => {
            format!("ccl-run: cannot run '{prog}': permission denied")
        }
        _ => format!("ccl-run: cannot start rank {rank} ('{prog}'): {e}"),
    }
}

/// Waits until all ranks succeed, one fails, or a stop signal arrives.
///
/// Ranks are polled every [`POLL_INTERVAL`]; if several fail within the same
/// interval, the lowest rank among them is reported.
fn supervise(ranks: &mut [Rank]) -> Outcome {
    loop {
        if let Some(sig) = signals::first() {
            return Outcome::Interrupted(sig);
        }
        let mut failed = None;
        for r in ranks.iter_mut() {
            r.poll();
            if let Some(exit) = r.exit {
                if !exit.success() && failed.is_none() {
                    failed = Some((r.rank, exit));
                }
            }
        }
        if let Some((rank, exit)) = failed {
            return Outcome::RankFailed(rank, exit);
        }
        if ranks.iter().all(|r| !r.running()) {
            return Outcome::AllSucceeded;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// Stops every rank: SIGTERM to each rank's process group, wait up to
/// `grace` for the ranks to exit (cut short by another stop signal), then
/// SIGKILL every group (which also catches stragglers left behind by ranks
/// that did exit) and reap the ranks.
fn stop_all(ranks: &mut [Rank], grace: Duration) {
    let signals_before = signals::count();
    for r in ranks.iter().filter(|r| r.running()) {
        r.signal_group(Signal::SIGTERM);
    }
    let deadline = Instant::now() + grace;
    loop {
        ranks.iter_mut().for_each(Rank::poll);
        let left: Vec<String> = ranks
            .iter()
            .filter(|r| r.running())
            .map(|r| r.rank.to_string())
            .collect();
        if left.is_empty() {
            break;
        }
        if signals::count() != signals_before {
            eprintln!(
                "ccl-run: received another signal; killing rank(s) {}",
                left.join(", ")
            );
            break;
        }
        if Instant::now() >= deadline {
            eprintln!(
                "ccl-run: rank(s) {} still running {:.1}s after SIGTERM; sending SIGKILL",
                left.join(", "),
                grace.as_secs_f64()
            );
            break;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    for r in ranks.iter() {
        r.signal_group(Signal::SIGKILL);
    }
    for r in ranks.iter_mut().filter(|r| r.running()) {
        r.exit = Some(match r.child.wait() {
            Ok(status) => RankExit::from_status(status),
            Err(_) => RankExit::Unknown,
        });
    }
}

/// Waits (at most [`DRAIN_TIMEOUT`]) for the reader threads to forward the
/// remaining output and exit.
fn drain_output(done: &mpsc::Receiver<()>) {
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match done.recv_timeout(left) {
            Ok(()) => continue,
            Err(RecvTimeoutError::Disconnected) | Err(RecvTimeoutError::Timeout) => return,
        }
    }
}
