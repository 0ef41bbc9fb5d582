//! What launchers of local ranks share (`ccl-run`, and `ccl-bench` when it
//! starts its own ranks).

use std::{io, os::unix::process::CommandExt, process::Command};

use nix::sys::signal::Signal;

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
