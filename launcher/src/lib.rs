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
