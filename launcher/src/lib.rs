//! What launchers of local ranks share (`ccl-run`, and `ccl-bench` when it
//! starts its own ranks).

use std::{io, os::unix::process::CommandExt, process::Command};

pub use ccl_core::allowed_cpus;

use nix::{
    sched::{sched_setaffinity, CpuSet},
    sys::signal::Signal,
    unistd::Pid,
};

/// Makes the process `cmd` starts receive SIGKILL when this process dies, so
/// that no rank outlives its launcher, even one killed with SIGKILL.
pub fn die_with_parent(cmd: &mut Command) -> &mut Command {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs between fork and exec and only makes
    // async-signal-safe system calls (prctl, getppid); it does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // If the parent died before prctl took effect, no signal will come.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
    cmd
}

/// Environment variable carrying the per-job shared secret.
pub const SECRET_VAR: &str = "CCL_JOB_SECRET";

/// The job secret for ranks this process starts: `None` if a non-empty
/// `CCL_JOB_SECRET` is already set (the ranks inherit it), else 32 fresh
/// random bytes from the OS, hex encoded (64 characters).
pub fn job_secret() -> Result<Option<String>, rand::Error> {
    use rand::RngCore;
    match std::env::var_os(SECRET_VAR) {
        Some(v) if !v.is_empty() => Ok(None),
        _ => {
            let mut bytes = [0u8; 32];
            rand::rngs::OsRng.try_fill_bytes(&mut bytes)?;
            Ok(Some(bytes.iter().map(|b| format!("{b:02x}")).collect()))
        }
    }
}

/// Where a launcher places its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Bind {
    /// Leave placement to the kernel's scheduler.
    None,
    /// Pin each rank to one CPU, round robin over the CPUs the launcher may
    /// use (`mpirun --bind-to core`): local rank r runs on the (r mod n)-th.
    Core,
}

impl Bind {
    /// The flag's value: "none" or "core".
    pub fn name(self) -> &'static str {
        match self {
            Bind::None => "none",
            Bind::Core => "core",
        }
    }

    /// The CPUs ranks are pinned to, round robin ([`cpu_of`]): those this
    /// process may use under [`Bind::Core`], none under [`Bind::None`].
    pub fn cpus(self) -> io::Result<Vec<usize>> {
        match self {
            Bind::None => Ok(Vec::new()),
            Bind::Core => allowed_cpus(),
        }
    }
}

/// The CPU local rank `local_rank` is pinned to under [`Bind::Core`].
pub fn cpu_of(local_rank: usize, cpus: &[usize]) -> Option<usize> {
    (!cpus.is_empty()).then(|| cpus[local_rank % cpus.len()])
}

/// Makes the process `cmd` starts run on `cpu` only; where that cannot be
/// done, spawning fails with the error.
pub fn pin_to_cpu(cmd: &mut Command, cpu: usize) -> &mut Command {
    // SAFETY: the closure runs between fork and exec; it fills a CpuSet on
    // the stack and makes one async-signal-safe system call
    // (sched_setaffinity); it does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            let mut set = CpuSet::new();
            set.set(cpu)?;
            sched_setaffinity(Pid::from_raw(0), &set)?;
            Ok(())
        });
    }
    cmd
}

/// "CPUs 0 1 0 1" for ranks pinned under [`Bind::Core`], else "not bound".
pub fn describe_binding(bind: Bind, ranks: usize, cpus: &[usize]) -> String {
    match bind {
        Bind::None => "not bound".into(),
        Bind::Core => {
            let list: Vec<String> = (0..ranks)
                .filter_map(|r| cpu_of(r, cpus).map(|c| c.to_string()))
                .collect();
            format!("bound to CPUs {}", list.join(" "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_go_round_robin_over_the_allowed_cpus() {
        let cpus = [2, 5, 7];
        let placed: Vec<Option<usize>> = (0..5).map(|r| cpu_of(r, &cpus)).collect();
        assert_eq!(placed, [Some(2), Some(5), Some(7), Some(2), Some(5)]);
        assert_eq!(cpu_of(0, &[]), None);
        assert_eq!(
            describe_binding(Bind::Core, 4, &cpus),
            "bound to CPUs 2 5 7 2"
        );
        assert_eq!(describe_binding(Bind::None, 4, &cpus), "not bound");
    }

    #[test]
    fn a_pinned_child_runs_on_its_cpu_only() {
        let cpus = allowed_cpus().expect("sched_getaffinity");
        let cpu = *cpus.last().expect("some CPU is allowed");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "grep Cpus_allowed_list /proc/self/status"]);
        let out = pin_to_cpu(&mut cmd, cpu).output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            text.split_whitespace().last(),
            Some(cpu.to_string().as_str()),
            "{text}"
        );
    }
}
