//! Local mode: ccl-bench starts N processes of itself as ranks and watches them.
//!
//! Each rank gets torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK,
//! LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT) and connects to
//! the rendezvous store that ccl-bench itself serves there
//! (CCL_STORE_EXTERNAL=1): bound before any rank starts, its port cannot be
//! taken by another process between being picked and being bound. It stays in
//! ccl-bench's process group (so Ctrl-C reaches every rank) and is killed by
//! the kernel if ccl-bench dies (PR_SET_PDEATHSIG). One thread per rank waits
//! for it; the first rank to exit with a failure is reported
//! ("rank R exited with status S") and every other rank is killed at once.
//! A rank is only ever signalled while it is known not to have been reaped,
//! so a recycled pid is never hit.

use std::{
    ffi::OsString,
    io,
    net::Ipv4Addr,
    os::unix::process::ExitStatusExt,
    process::{Command, ExitStatus, Stdio},
    sync::{mpsc, Arc, Mutex},
    time::{Instant, SystemTime},
};

use ccl::{JobSecret, TcpStoreServer};
use ccl_run::Bind;

use crate::c2c;
use nix::{
    sys::{
        signal::{kill, Signal},
        wait::{waitid, Id, WaitPidFlag},
    },
    unistd::Pid,
};

/// Set in the ranks ccl-bench starts: when the parent started (ns since the epoch).
pub const T0_VAR: &str = "CCL_BENCH_SPAWN_T0";

/// Set in the ranks ccl-bench starts: where they run ("bound to CPUs 0 1").
pub const PLACEMENT_VAR: &str = "CCL_BENCH_PLACEMENT";

/// Set in the ranks ccl-bench starts: the core-to-core round trip between
/// the CPUs of ranks 0 and 1, measured before they started ([`c2c::Probe::to_env`]).
pub const CORE_TO_CORE_VAR: &str = "CCL_BENCH_CORE_TO_CORE";

/// Nanoseconds since the epoch.
pub fn epoch_ns(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// The variables rank `rank` of `n` gets.
pub fn rank_env(rank: usize, n: usize, port: u16, t0: SystemTime) -> Vec<(String, String)> {
    vec![
        ("RANK".into(), rank.to_string()),
        ("LOCAL_RANK".into(), rank.to_string()),
        ("WORLD_SIZE".into(), n.to_string()),
        ("LOCAL_WORLD_SIZE".into(), n.to_string()),
        ("GROUP_RANK".into(), "0".into()),
        ("MASTER_ADDR".into(), "127.0.0.1".into()),
        ("MASTER_PORT".into(), port.to_string()),
        ("CCL_STORE_EXTERNAL".into(), "1".into()),
        (T0_VAR.into(), epoch_ns(t0).to_string()),
    ]
}

/// Serves the ranks' store on a port of the loopback interface that the
/// kernel picks, requiring `secret` (the ranks' `CCL_JOB_SECRET`: the
/// generated one, else the inherited one) of every client.
fn serve_store(secret: Option<&str>) -> ccl::Result<TcpStoreServer> {
    let inherited = std::env::var(ccl_run::SECRET_VAR).ok();
    let secret = match secret.or(inherited.as_deref().filter(|s| !s.is_empty())) {
        Some(s) => Some(JobSecret::new(s)?),
        None => None,
    };
    TcpStoreServer::bind_with_secret((Ipv4Addr::LOCALHOST, 0).into(), secret.as_ref())
}

/// "exited with status 3" / "was killed by signal SIGKILL".
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => match Signal::try_from(s) {
            Ok(sig) => format!("was killed by signal {}", sig.as_str()),
            Err(_) => format!("was killed by signal {s}"),
        },
        _ => "ended in an unknown way".into(),
    }
}

struct Ranks {
    pids: Vec<Pid>,
    /// True once a rank has exited (it may not be reaped yet, but will never be signalled).
    exited: Vec<bool>,
}

impl Ranks {
    fn kill_running(&self) {
        for (pid, exited) in self.pids.iter().zip(&self.exited) {
            if !exited {
                let _ = kill(*pid, Signal::SIGKILL);
            }
        }
    }
}

/// Starts `n` ranks of this program with `args`, placed as `bind` says, and
/// waits for them. Returns ccl-bench's exit status: 0 if every rank
/// succeeded, else 1.
pub fn run_local(n: usize, args: &[OsString], bind: Bind, t0: SystemTime) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ccl-bench: cannot find its own executable to start ranks: {e}");
            return 1;
        }
    };
    let secret = match ccl_run::job_secret() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ccl-bench: cannot generate {}: {e}", ccl_run::SECRET_VAR);
            return 1;
        }
    };
    // Lives until every rank has exited.
    let store = match serve_store(secret.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ccl-bench: cannot serve the ranks' rendezvous store: {e}");
            return 1;
        }
    };
    let port = store.local_addr().port();
    let cpus = match bind.cpus() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("ccl-bench: --bind core: cannot read the CPUs it may use: {e}");
            return 1;
        }
    };
    let placement = ccl_run::describe_binding(bind, n, &cpus);
    // Unpinned ranks run anywhere: the probe takes the first two CPUs allowed.
    let probing = Instant::now();
    let probe = match (n, cpus.is_empty()) {
        (1, _) => None,
        (_, false) => c2c::pair(&cpus),
        (_, true) => ccl_run::allowed_cpus().ok().and_then(|c| c2c::pair(&c)),
    }
    .map(c2c::Probe::measure);
    // The set-up time the ranks report leaves the probe out.
    let t0 = t0 + probing.elapsed();
    let ranks = Arc::new(Mutex::new(Ranks {
        pids: Vec::with_capacity(n),
        exited: Vec::with_capacity(n),
    }));
    let (tx, rx) = mpsc::channel::<(usize, io::Result<ExitStatus>)>();
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(args)
            .envs(rank_env(rank, n, port, t0))
            .env(PLACEMENT_VAR, &placement);
        if let Some(p) = probe {
            cmd.env(CORE_TO_CORE_VAR, p.to_env());
        }
        if let Some(cpu) = ccl_run::cpu_of(rank, &cpus) {
            ccl_run::pin_to_cpu(&mut cmd, cpu);
        }
        if let Some(secret) = &secret {
            cmd.env(ccl_run::SECRET_VAR, secret);
        }
        cmd.stdin(Stdio::null());
        ccl_run::die_with_parent(&mut cmd);
        // Spawned under the lock so that a kill never misses a rank being added.
        let mut guard = ranks.lock().unwrap_or_else(|p| p.into_inner());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("ccl-bench: cannot start rank {rank}: {e}");
                guard.kill_running();
                drop(guard);
                drop(tx);
                while rx.recv().is_ok() {}
                return 1;
            }
        };
        let pid = Pid::from_raw(child.id() as i32);
        guard.pids.push(pid);
        guard.exited.push(false);
        drop(guard);
        let (tx, ranks) = (tx.clone(), ranks.clone());
        std::thread::spawn(move || {
            // Wait without reaping, mark the rank exited, then reap: a pid is
            // signalled only while it cannot have been recycled.
            let _ = waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT);
            ranks.lock().unwrap_or_else(|p| p.into_inner()).exited[rank] = true;
            let _ = tx.send((rank, child.wait()));
        });
    }
    drop(tx);
    let mut code = 0;
    let mut done = 0;
    while let Ok((rank, status)) = rx.recv() {
        done += 1;
        if let Ok(s) = &status {
            if s.signal() == Some(Signal::SIGPIPE as i32) && code == 0 {
                // Whoever read the output went away (`| head`): stop quietly.
                code = 128 + Signal::SIGPIPE as i32;
                ranks
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .kill_running();
                continue;
            }
        }
        let failure = match status {
            Ok(s) if s.success() => None,
            // Stopped by us after an earlier failure: not news.
            Ok(s) if code != 0 && s.signal().is_some() => None,
            Ok(s) => Some(describe(s)),
            Err(e) => Some(format!("could not be waited for: {e}")),
        };
        if let Some(what) = failure {
            // A survivor can notice a dead rank and exit before the dead
            // rank's own exit is seen here, so every rank that failed on its
            // own is reported, not only the first.
            if code != 0 {
                eprintln!("ccl-bench: rank {rank} {what}");
            } else {
                let rest = if done < n {
                    "; stopping the other ranks"
                } else {
                    ""
                };
                eprintln!("ccl-bench: rank {rank} {what}{rest}");
                code = 1;
                ranks
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .kill_running();
            }
        }
    }
    code
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ccl::{Store, TcpStore};

    use super::*;

    #[test]
    fn the_ranks_store_is_bound_before_they_start_and_asks_for_their_secret() {
        let store = serve_store(Some("s3cret")).expect("serving the store");
        let port = store.local_addr().port();
        // Held from now on: no other process can bind the port the ranks get.
        let taken = std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, port));
        assert!(taken.is_err(), "port {port} is free again: {taken:?}");
        let env = rank_env(0, 2, port, SystemTime::now());
        assert!(env.contains(&("MASTER_PORT".into(), port.to_string())));
        // Rank 0 connects like the others instead of serving.
        assert!(env.contains(&("CCL_STORE_EXTERNAL".into(), "1".into())));
        let wait = Duration::from_secs(10);
        let secret = |s: &str| JobSecret::new(s).expect("a secret");
        let rank = TcpStore::connect_with_secret("127.0.0.1", port, wait, Some(&secret("s3cret")))
            .expect("a client with the job's secret");
        rank.set("k", b"v").expect("set");
        let stranger = TcpStore::connect_with_secret(
            "127.0.0.1",
            port,
            Duration::from_secs(2),
            Some(&secret("guess")),
        )
        .and_then(|s| s.get("k", Duration::from_secs(2)));
        assert!(stranger.is_err(), "a wrong secret was served: {stranger:?}");
    }
}
