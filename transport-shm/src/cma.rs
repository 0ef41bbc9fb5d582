//! Cross-memory attach: copying straight out of (`process_vm_readv`) or
//! into (`process_vm_writev`) another process's memory, one copy where a
//! shared segment takes two. The kernel allows it where ptrace would be
//! allowed (same user, and a Yama or seccomp policy that does not forbid
//! it), so every user probes first.

use std::{
    io::{IoSlice, IoSliceMut},
    sync::atomic::{AtomicBool, Ordering},
};

use nix::{
    errno::Errno,
    sys::uio::{process_vm_readv, process_vm_writev, RemoteIoVec},
    unistd::Pid,
};

/// Why a read or write of another process's memory failed.
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
    let len = into.len();
    transfer(addr, len, "reading", |done, remote| {
        process_vm_readv(pid, &mut [IoSliceMut::new(&mut into[done..])], &[remote])
    })
}

/// Copies `from` to `addr` of process `pid`.
pub(crate) fn write(pid: Pid, addr: u64, from: &[u8]) -> Result<(), Fault> {
    transfer(addr, from.len(), "writing", |done, remote| {
        process_vm_writev(pid, &[IoSlice::new(&from[done..])], &[remote])
    })
}

/// Moves `len` bytes at `addr` of another process by calls of `step(done,
/// remote)`, each moving the bytes from `done` on, until all have moved.
fn transfer(
    addr: u64,
    len: usize,
    what: &str,
    mut step: impl FnMut(usize, RemoteIoVec) -> nix::Result<usize>,
) -> Result<(), Fault> {
    let mut done = 0;
    while done < len {
        let remote = RemoteIoVec {
            base: addr as usize + done,
            len: len - done,
        };
        match step(done, remote) {
            Ok(0) => return Err(Fault::Refused(format!("no bytes at address {addr:#x}"))),
            Ok(n) => done += n,
            Err(Errno::EINTR) => {}
            Err(Errno::ESRCH) => return Err(Fault::Exited),
            Err(e) => {
                return Err(Fault::Refused(format!(
                    "{what} {len} bytes at {addr:#x} of its memory: {e}"
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
