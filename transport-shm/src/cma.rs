//! Cross-memory attach: copying straight out of another process's memory
//! with `process_vm_readv`, one copy where a shared segment takes two. The
//! kernel allows it where ptrace would be allowed (same user, and a Yama or
//! seccomp policy that does not forbid it), so every user probes first.

use std::{
    io::IoSliceMut,
    sync::atomic::{AtomicBool, Ordering},
};

use nix::{
    errno::Errno,
    sys::uio::{process_vm_readv, RemoteIoVec},
    unistd::Pid,
};

/// Why a read of another process's memory failed.
#[derive(Debug)]
pub(crate) enum Fault {
    /// The process exited.
    Exited,
    /// The kernel copied nothing or refused (an address outside the
    /// process's mappings, or a policy that forbids it).
    Refused(String),
}

/// Copies `into.len()` bytes at `addr` of process `pid` into `into`.
pub(crate) fn read(pid: Pid, addr: u64, into: &mut [u8]) -> Result<(), Fault> {
    let mut done = 0;
    while done < into.len() {
        let remote = RemoteIoVec {
            base: addr as usize + done,
            len: into.len() - done,
        };
        match process_vm_readv(pid, &mut [IoSliceMut::new(&mut into[done..])], &[remote]) {
            Ok(0) => return Err(Fault::Refused(format!("no bytes at address {addr:#x}"))),
            Ok(n) => done += n,
            Err(Errno::EINTR) => {}
            Err(Errno::ESRCH) => return Err(Fault::Exited),
            Err(e) => {
                return Err(Fault::Refused(format!(
                    "reading {} bytes at {addr:#x} of its memory: {e}",
                    into.len()
                )))
            }
        }
    }
    Ok(())
}

/// Logs the first refusal of cross-memory attach in this process.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether this process can read `pid`'s memory: the 8 bytes at `addr`
/// must read as `magic` (a segment's magic word where that process mapped
/// it). A refusal is logged once per process.
pub(crate) fn probe(pid: Pid, addr: u64, magic: u64) -> bool {
    let mut word = [0u8; 8];
    let ok = read(pid, addr, &mut word).is_ok() && u64::from_le_bytes(word) == magic;
    if !ok && !REFUSED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "cross-memory attach to pid {pid} refused (ptrace policy?): large shared-memory messages are copied twice"
        );
    }
    ok
}
