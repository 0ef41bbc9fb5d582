//! The board: one segment shared by every rank of a communicator when all of
//! them run on one host, for small collectives without links.
//!
//! Each rank owns an area with [`HEADS`] heads and two payload slots. For
//! its `b`-th board call a rank copies its payload into head `b % HEADS`
//! (up to [`INLINE`] bytes on the call number's line, so that a small call
//! moves one cache line from each rank to each other; up to [`SMALL`] bytes
//! in the head's small payload) or else into payload slot `b % 2`, then
//! publishes `b` in the head's first word; the others
//! wait for that word and read the payload. Next to the call number lies a
//! digest of the call's frame header, which must match the digest of the
//! call the reader makes (the full header, for the error message, lies on
//! the head's second line). One write and n − 1 reads of a cache line per
//! rank replace the messages of a recursive-doubling allreduce.
//!
//! A rank starts a call only after finishing the one before, so a peer that
//! published call `c` reads nothing of calls before `c`. Before a rank
//! reuses a head it waits until every peer has published call
//! `b − HEADS + 1`, and before it writes a payload slot, until every peer has
//! published `b − 1`. A rank whose calls read nothing from some peers (a
//! broadcast's root, the other ranks of a reduce) thus runs up to
//! `HEADS − 1` calls of up to [`SMALL`] bytes ahead of them, as an MPI broadcast's root returns
//! before its data arrives: where two ranks share a CPU, a run of small
//! broadcasts costs a switch between them every few calls, not every call.
//!
//! A call may have a second phase: a rank overwrites a part of its payload
//! slot that no peer reads (its result for the part of the payload it
//! reduced) and publishes `b` in the head's second line; the others wait
//! for that word and copy the part ([`Round::post_reduced`],
//! [`Round::read_reduced`]).
//!
//! Layout (little-endian words):
//!
//! ```text
//! 0                        magic, ranks, slot bytes
//! 64 + r·area              rank r: sleepers u32, wake u32, left u32, pid u32, blame u32,
//!                          direct u32, base u64, fastest kernel copy ns u32, fastest
//!                          plain copy ns u32
//! 64 + r·area + 64·(1 + h)         head h, first line: call number u64, header
//!                                   digest u64, inline payload (48 bytes)
//! 64 + r·area + 64·(1 + HEADS + h)  head h, second line: reduced call number u64,
//!                                   frame header (56 bytes)
//! 64 + r·area + 64·(1 + 2·HEADS)    head 0's small payload (SMALL bytes), then head 1's, ...
//! ... + SMALL·HEADS                 payload slot 0 (slot bytes): larger payloads, reduced parts
//! ... + slot bytes                  payload slot 1
//! ```
//!
//! The first lines of the heads lie one after the other, so that a rank
//! reading a peer's run of calls reads consecutive lines.
//!
//! A waiter polls for the spin window (adapted as [`SpinWindow`] says), then sleeps on the futex word `wake`
//! of the rank it waits for, after counting itself in `sleepers`; a rank that
//! publishes wakes that word only when someone sleeps on it. Sleeps last at
//! most [`SLICE`], after which the waiter checks that the peer's process
//! still exists (a pidfd) and the deadline.
//!
//! `base` is where the rank mapped the board, and `direct` whether it can
//! read every peer's memory by cross-memory attach (1), can but found the
//! kernel's copies slow (3), or cannot (2), which it learns at set-up by
//! reading each peer's magic word at the peer's `base` and timing a copy.
//! Where every rank can, [`GroupMemory::direct_min`] offers the group
//! algorithms single copies out of and into each other's buffers: through
//! the kernel where no rank found its copies slow
//! ([`GroupMemory::kernel_copies_pay`]), and, for a buffer in a peer's
//! [`crate::SharedBuffer`], with this rank's own loads and stores in its
//! mapping of that buffer.

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    sync::{
        atomic::{fence, AtomicU32, AtomicU64, Ordering},
        Mutex,
    },
    time::{Duration, Instant},
};

use ccl_core::{
    frame::HEADER_LEN, kernels, Deadline, Error, FrameHeader, GroupMemory, Region, Remote, Result,
    Spin, SpinWindow, Store,
};

use nix::unistd::Pid;

use crate::{
    cma::{self, Fault},
    region::{self, PeerRegions},
    segment::Segment,
    DirectReads,
};

const MAGIC: u64 = u64::from_le_bytes(*b"CCLBRD04");
const HEAD: usize = 64;
const LINE: usize = 64;
/// Longest sleep before the waiter checks on the peer and the deadline.
const SLICE: Duration = Duration::from_millis(50);
/// Polls between two looks at the clock while spinning.
const POLLS_PER_CLOCK: u32 = 64;

// Offsets in a rank's control line.
const SLEEPERS: usize = 0;
const WAKE: usize = 4;
const LEFT: usize = 8;
const PID: usize = 12;
/// The rank the leaving rank blames for its failure, plus one (0: none).
const BLAME: usize = 16;
/// Whether the rank can read every peer's memory: 0 not known yet, then
/// [`CAN_READ`], [`READS_SLOWLY`] or [`CANNOT_READ`].
const DIRECT: usize = 20;
/// Where the rank mapped the board (u64).
const BASE: usize = 24;
/// The fastest of the rank's timed copies through the kernel, in ns (u32;
/// 0 where it did not time them, [`DirectReads::Timed`]).
const KERNEL_NS: usize = 32;
/// The fastest of its timed plain copies, in ns (u32; 0 where not timed).
const PLAIN_NS: usize = 36;

/// Value of `direct`: the rank reads every peer's memory.
const CAN_READ: u32 = 1;
/// Value of `direct`: it cannot read some peer's memory.
const CANNOT_READ: u32 = 2;
/// Value of `direct`: it can, but will not copy memory outside shared
/// buffers through the kernel (`CCL_SHM_CMA=mapped`, or a timed copy failed).
const READS_SLOWLY: u32 = 3;

/// Bytes of this rank's slots that board set-up copies out of a peer's
/// mapping of them through the kernel, and out of its own plainly, to time
/// the two ([`DirectReads::Timed`]): past the L2 of the hosts measured.
/// Less above 16 ranks, whose two slots are smaller (1 MiB at 32 ranks,
/// where the ratio below was as at 2 MiB; 512 KiB at 64, not measured).
const TIMED_BYTES: usize = 2 << 20;
/// The most times a plain copy that the kernel's copy may take for the
/// board to copy memory outside shared buffers through the kernel: a post
/// takes two plain copies and the syscall-free wake-up, a direct read one
/// kernel copy. On a 2-vCPU AMD EPYC VM the kernel's copy of 2 MiB took 4.0–4.4
/// times a plain one (256 KiB: 8.5 times, the kernel pinning each page
/// first), and posts beat direct reads in all five moving collectives at
/// most sizes (docs/compare/latest/cma.txt); on the 2-vCPU Xeon VM where the
/// direct reads were tuned, `process_vm_readv` of 64 MiB took 1.7–2.2
/// times `memcpy` (docs/DESIGN.md), and on a 2-vCPU Xeon VM of 2026-12-02
/// the kernel's copy of 2 MiB took 1.35–2.4 times a plain one (once 3.3 times
/// in 132 ranks' timings, 4 ranks on the 2 vCPUs; hence
/// [`kernel_copies_pay`] pools the ranks' timings) and direct reads beat
/// posts (docs/compare/intel/cma.txt).
const KERNEL_COPY_MAX: u64 = 3;

/// Whether the kernel's copies pay, from each timing rank's fastest copy
/// through the kernel and plainly (ns; `(0, 0)` for a rank that did not
/// time): the fastest kernel copy any rank saw takes at most
/// [`KERNEL_COPY_MAX`] times the fastest plain copy any rank saw. The ranks
/// time on one host, where another process (a rank sharing the CPU) only
/// slows a copy, so the fastest of all is the least disturbed; a single
/// disturbed rank cannot turn the kernel's copies off for all. True where
/// no rank timed.
fn kernel_copies_pay(timings: impl IntoIterator<Item = (u32, u32)>) -> bool {
    let (kernel, plain) = timings
        .into_iter()
        .filter(|&(k, p)| k > 0 && p > 0)
        .fold((u32::MAX, u32::MAX), |(k, p), (tk, tp)| {
            (k.min(tk), p.min(tp))
        });
    kernel == u32::MAX || u64::from(kernel) <= u64::from(plain) * KERNEL_COPY_MAX
}

/// The smallest block that group algorithms copy straight out of a peer's
/// buffer, where every rank can: below it the posts, which need no system
/// call, are as fast or faster (on a 2-core VM, 8 KiB blocks were faster
/// direct in some collectives and slower in others, 16 KiB ones faster in
/// all but one, which tied).
const DIRECT_MIN: usize = 16 * 1024;

/// The smallest block that group algorithms copy straight out of a peer's
/// shared buffer where the kernel's copies do not pay: they first take a
/// round to ask whether the blocks lie in shared buffers. On a 2-vCPU AMD
/// EPYC VM, 2 ranks: that round cost own buffers 0.1–0.4 µs of 0.5–1.1 at
/// 32 KiB, and shared buffers gained 1 µs of 2–3 at 128 KiB but little at
/// 32 KiB.
const SHARED_DIRECT_MIN: usize = 128 * 1024;

/// The same where the host's ranks outnumber its CPUs, and a round costs
/// wake-ups: on that VM, 4 ranks at 128 KiB, the round cost own buffers
/// about 2 µs of 9–14 and shared buffers gained nothing or lost (gather
/// 7.4–7.7 µs against 4.2–4.3 through posts); at 512 KiB shared buffers
/// took 10–34 µs against 13–48.
const SHARED_DIRECT_MIN_SHARING_CPUS: usize = 512 * 1024;

/// The smallest output of a call, over all the ranks of the board (which
/// share a host), that group algorithms write with streaming stores
/// ([`GroupMemory::stream_min`]). Beyond the caches such stores move a
/// third less through memory; within them they send the next reader of the
/// output to memory. On a 2-vCPU Xeon VM (whose 260 MiB L3 the host shares
/// with other guests), 20 calls each, 3 runs: 2 ranks' broadcast of 32 MiB
/// took 5.8–7.6 ms streamed against 8.3–11.7, of 16 MiB 2.9–3.3 against
/// 2.7–3.6; 4 ranks' allgather of 16 MiB 3.6–4.3 against 3.7–7.5, of 8 MiB
/// (40 calls) 2.4–2.7 against 1.9–2.3.
const STREAM_MIN: usize = 64 << 20;

/// Value of `left`: the rank aborted the communicator.
const ABORTED: u32 = 1;
/// Value of `left`: the rank dropped the communicator.
const CLOSED: u32 = 2;

/// Largest payload of a slot. Board-direct's chunks fill it: each chunk is
/// a round with two waits on every rank, and on a 2-core VM 1 MiB chunks
/// took a 64 MiB allreduce from 20.4 to 17.2 ms at 2 ranks and from 45.6
/// to 42.9 at 4 (medians of 3 alternating runs) against 256 KiB. The other
/// board calls post at most `CHUNK_MAX` of ccl-algorithms a round.
const MAX_SLOT_BYTES: usize = 1 << 20;
/// Smallest payload of a slot.
const MIN_SLOT_BYTES: usize = 16 * 1024;
/// Largest board: the slots of all ranks together.
const MAX_BOARD_BYTES: usize = 32 << 20;

/// Payload bytes per slot of a board for `n` ranks: 1 MiB, less for more
/// than 16 ranks so that the board stays within 32 MiB, never below 16 KiB.
pub fn board_slot_bytes(n: usize) -> usize {
    let fair = MAX_BOARD_BYTES / (2 * n.max(1)) / 4096 * 4096;
    fair.clamp(MIN_SLOT_BYTES, MAX_SLOT_BYTES)
}

/// A board shared by every rank of one communicator (see the module docs).
pub struct Board {
    rank: usize,
    n: usize,
    seg: Segment,
    slot: usize,
    /// Board calls made so far by this rank.
    calls: AtomicU64,
    /// A digest of this rank's calls before its current one, folded into
    /// every digest it posts or expects: a rank that reads a peer's post
    /// thus also checks the calls in which neither read the other's.
    history: AtomicU64,
    /// The digest terms of the current call ([`terms`]), for `history`.
    current: AtomicU64,
    /// The call whose header `current` holds the terms of: a read in that
    /// call expects the same header but for the length, so its digest needs
    /// only the length's term.
    current_of: AtomicU64,
    /// The latest call each peer is known to have published (only this
    /// rank's driving thread uses it); `u64::MAX` for this rank.
    seen: Vec<AtomicU64>,
    /// The last call whose payload slot [`Board::payload_free`] found free.
    payload_free_for: AtomicU64,
    /// Readable once peer `p` exits; `None` for this rank or without pidfds.
    exits: Vec<Option<OwnedFd>>,
    spin: Spin,
    window: SpinWindow,
    /// Every rank can read every other's memory (see the module docs).
    direct: bool,
    /// Every rank found the kernel's copies fast enough to use on memory
    /// outside shared buffers ([`GroupMemory::kernel_copies_pay`]).
    kernel_copies_pay: bool,
    /// The peers' shared buffers this rank mapped.
    peer_regions: PeerRegions,
}

impl std::fmt::Debug for Board {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Board(rank {} of {})", self.rank, self.n)
    }
}

/// Heads per rank: how many board calls a rank may run ahead of a peer
/// whose posts it does not read. On a 2-vCPU VM with 4 ranks on 2 CPUs, a
/// broadcast of 8 B took 3.27 µs with two (every call a barrier of the
/// four), 1.14 with 8 heads, 0.76 with 32, 0.67 with 64 and 0.62 with 128;
/// a 2-rank allreduce of 8 B, which cycles through the heads, took 461 ns
/// with two and with 32, 475 with 64 and 492 with 128 (medians of 4
/// alternating runs).
pub const HEADS: usize = 32;
/// Largest payload posted in a head's small payload: a small call that
/// does not fit the call-number line runs ahead as far as one that does.
pub const SMALL: usize = 2048;
/// Bytes of a head: the call-number line, the reduced line, a small payload.
const HEAD_BYTES: usize = 2 * LINE + SMALL;
/// Offset of the header digest in the call-number line.
const DIGEST: usize = 8;
/// Offset of an inline payload in the call-number line.
const INLINE_AT: usize = 16;
/// Largest payload posted on the call-number line itself.
pub const INLINE: usize = LINE - INLINE_AT;
/// Offset of the full frame header in a head's second line.
const HEADER_AT: usize = 8;

/// Seeds of the digest terms, one per word of an encoded frame header.
const SEEDS: [u64; HEADER_LEN / 8] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
    0x4528_21e6_38d0_1377,
    0xbe54_66cf_34e9_0c6c,
    0xc0ac_29b7_c97c_50dd,
];

/// Word `i` of an encoded frame header through the bijection of its own
/// (offset by its seed, multiplied by an odd constant).
fn term(i: usize, word: u64) -> u64 {
    (word ^ SEEDS[i]).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The term of the payload's length, the header's last word.
fn len_term(len: u64) -> u64 {
    term(HEADER_LEN / 8 - 1, len)
}

/// The terms of an encoded frame header's digest: its first six words
/// (the call), their terms folded with xor, and its last (the payload's
/// length). The products are independent: no chain of multiplies before a
/// post is published.
fn terms(header: &[u8; HEADER_LEN]) -> (u64, u64) {
    let word = |i: usize| u64::from_le_bytes(header[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    let call = (0..HEADER_LEN / 8 - 1).fold(0, |h, i| h ^ term(i, word(i)));
    (call, len_term(word(HEADER_LEN / 8 - 1)))
}

/// The murmur3 finalizer: a bijection that mixes every bit into every other.
fn finish(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The digest published with a post: of its encoded frame header and of
/// `history`, the poster's calls before it ([`Board::begin`]). Equal
/// headers after equal histories give equal digests; headers that differ in
/// one word always differ; anything else collides with a chance of about
/// 2⁻⁶⁴.
fn digest(header: &[u8; HEADER_LEN], history: u64) -> u64 {
    let (call, len) = terms(header);
    finish(call ^ len ^ history)
}

fn area(slot: usize) -> usize {
    LINE + HEADS * HEAD_BYTES + 2 * slot
}

fn board_len(n: usize, slot: usize) -> usize {
    HEAD + n * area(slot)
}

fn futex(word: &AtomicU32, op: i32, val: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: a futex call on a live, aligned 32-bit word of a shared mapping
    // (no FUTEX_PRIVATE_FLAG: waiters live in other processes).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op,
            val,
            ts_ptr,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether the process behind `fd` (a pidfd) has exited.
fn exited(fd: &OwnedFd) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no wait.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

fn pidfd(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a fresh descriptor that nothing else owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Board {
    fn control(&self, r: usize) -> usize {
        HEAD + r * area(self.slot)
    }

    fn word32(&self, r: usize, what: usize) -> &AtomicU32 {
        let off = self.control(r) + what;
        // SAFETY: inside rank r's control line, 4-byte aligned; shared words
        // are only accessed atomically.
        unsafe { &*self.seg.base().add(off).cast::<AtomicU32>() }
    }

    /// Offset of rank `r`'s head for call `round` (its call-number word).
    fn head_at(&self, r: usize, round: u64) -> usize {
        self.control(r) + LINE + (round % HEADS as u64) as usize * LINE
    }

    /// Offset of rank `r`'s second head line for call `round`.
    fn second_at(&self, r: usize, round: u64) -> usize {
        self.head_at(r, round) + HEADS * LINE
    }

    /// Offset of rank `r`'s small payload for call `round`.
    fn small_at(&self, r: usize, round: u64) -> usize {
        self.control(r) + LINE + 2 * HEADS * LINE + (round % HEADS as u64) as usize * SMALL
    }

    /// Offset of rank `r`'s payload slot for call `round`.
    fn slot_at(&self, r: usize, round: u64) -> usize {
        self.control(r) + LINE + HEADS * HEAD_BYTES + (round % 2) as usize * self.slot
    }

    /// Offset of a payload of `len` bytes that rank `r` posted for call `round`.
    fn payload_at(&self, r: usize, round: u64, len: usize) -> usize {
        if len <= INLINE {
            self.head_at(r, round) + INLINE_AT
        } else if len <= SMALL {
            self.small_at(r, round)
        } else {
            self.slot_at(r, round)
        }
    }

    /// Board call number whose reduced part rank `r` last published in the
    /// head of call `round`.
    fn reduced(&self, r: usize, round: u64) -> u64 {
        self.seg.load(self.second_at(r, round))
    }

    /// Waits until every peer has published call `round` or a later one.
    /// A peer not known to have gone that far is first looked for in its
    /// head of this rank's latest call: found there, it needs no look for
    /// the next `HEADS − 1` calls, which leaves the lines it writes in its
    /// own cache meanwhile.
    fn wait_all_published(&self, round: u64, deadline: &Deadline) -> Result<()> {
        let latest = self.calls.load(Ordering::Relaxed);
        for p in (0..self.n).filter(|&p| p != self.rank) {
            if self.seen[p].load(Ordering::Relaxed) >= round {
                continue;
            }
            if latest > round && self.published(p, latest) >= latest {
                self.seen[p].store(latest, Ordering::Relaxed);
                continue;
            }
            self.wait_for(p, deadline, || self.published(p, round) >= round)?;
            self.seen[p].store(round, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Waits until no peer reads this rank's payload slot of call `round`
    /// any more (every peer published the call before it).
    fn payload_free(&self, round: u64, deadline: &Deadline) -> Result<()> {
        if round < 2 || self.payload_free_for.load(Ordering::Relaxed) == round {
            return Ok(());
        }
        self.wait_all_published(round - 1, deadline)?;
        self.payload_free_for.store(round, Ordering::Relaxed);
        Ok(())
    }

    /// Wakes the ranks sleeping on this rank's futex word, if any.
    fn wake_sleepers(&self) {
        fence(Ordering::SeqCst);
        if self.word32(self.rank, SLEEPERS).load(Ordering::Relaxed) > 0 {
            let wake = self.word32(self.rank, WAKE);
            wake.fetch_add(1, Ordering::SeqCst);
            futex(wake, libc::FUTEX_WAKE, i32::MAX as u32, None);
        }
    }

    /// Board call number last published in rank `r`'s head of call `round`.
    fn published(&self, r: usize, round: u64) -> u64 {
        self.seg.load(self.head_at(r, round))
    }

    /// Maps every rank's control line and heads into this process now, by
    /// reading a word of each of their pages: otherwise the first calls
    /// that reach the heads' small payloads take a page fault for each page
    /// of each rank, which a run of a few calls counts in full (on a 2-vCPU
    /// VM a 2-rank allreduce of 128 B took 1.6 µs a call over 15 calls,
    /// 0.25 µs over 20,000).
    fn map_heads(&self) {
        const PAGE: usize = 4096;
        for r in 0..self.n {
            let start = self.control(r);
            let end = start + LINE + HEADS * HEAD_BYTES;
            for at in (start..end).step_by(PAGE).chain([end - 8]) {
                self.seg.load(at & !7);
            }
        }
    }

    /// Marks this rank as gone (`why`) and wakes every rank sleeping on it.
    fn leave(&self, why: u32) {
        self.word32(self.rank, LEFT).store(why, Ordering::Release);
        let wake = self.word32(self.rank, WAKE);
        wake.fetch_add(1, Ordering::SeqCst);
        futex(wake, libc::FUTEX_WAKE, i32::MAX as u32, None);
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        if self.word32(self.rank, LEFT).load(Ordering::Acquire) == 0 {
            self.leave(CLOSED);
        }
    }
}

impl Board {
    /// What this rank tells the others about direct reads: whether it can
    /// read every peer's memory (unless `cma` is [`DirectReads::Never`]),
    /// and whether it copies memory outside shared buffers through the
    /// kernel (never with [`DirectReads::Mapped`]). Where `cma` is
    /// [`DirectReads::Timed`] it also times the kernel's copies
    /// ([`Self::time_kernel_copy`]) and leaves the result beside its answer
    /// for [`kernel_copies_pay`].
    fn direct_reads_here(&self, cma: DirectReads) -> u32 {
        let can = cma != DirectReads::Never
            && (0..self.n)
                .filter(|&p| p != self.rank)
                .all(|p| cma::probe(self.pid(p), self.seg.load(self.control(p) + BASE), MAGIC));
        match (can, cma) {
            (false, _) => CANNOT_READ,
            (true, DirectReads::Mapped) => READS_SLOWLY,
            (true, DirectReads::Timed) if self.n > 1 => match self.kernel_copy_timing() {
                Some((kernel, plain)) => {
                    let ns = |d: Duration| u32::try_from(d.as_nanos()).unwrap_or(u32::MAX).max(1);
                    self.word32(self.rank, KERNEL_NS)
                        .store(ns(kernel), Ordering::Relaxed);
                    self.word32(self.rank, PLAIN_NS)
                        .store(ns(plain), Ordering::Relaxed);
                    CAN_READ
                }
                None => READS_SLOWLY,
            },
            (true, _) => CAN_READ,
        }
    }

    /// Tells the others what this rank found about direct reads (`mine`,
    /// [`Self::direct_reads_here`]) and returns whether every rank can read
    /// and whether the kernel's copies pay: every rank copies through the
    /// kernel, and the timings of those that timed say so
    /// ([`kernel_copies_pay`]).
    fn agree_on_direct_reads(&self, mine: u32, deadline: &Deadline) -> Result<(bool, bool)> {
        self.word32(self.rank, DIRECT)
            .store(mine, Ordering::Release);
        self.wake_sleepers();
        let (mut all, mut fast) = (mine != CANNOT_READ, mine == CAN_READ);
        for p in (0..self.n).filter(|&p| p != self.rank) {
            let theirs = || self.word32(p, DIRECT).load(Ordering::Acquire);
            self.wait_for(p, deadline, || theirs() != 0)?;
            all &= theirs() != CANNOT_READ;
            fast &= theirs() == CAN_READ;
        }
        let timed: Vec<(u32, u32)> = (0..self.n)
            .map(|p| {
                let word = |what| self.word32(p, what).load(Ordering::Relaxed);
                (word(KERNEL_NS), word(PLAIN_NS))
            })
            .collect();
        let pay = all && fast && kernel_copies_pay(timed.iter().copied());
        tracing::debug!(
            rank = self.rank,
            all,
            pay,
            "direct reads agreed; ranks' fastest kernel and plain copies (ns): {timed:?}"
        );
        Ok((all, pay))
    }

    /// [`Self::time_kernel_copy`]'s timings, taken once per process and
    /// copy length: the boards after the first (sub-communicators) reuse
    /// them (the copies took about 1 ms on a 2-vCPU AMD EPYC VM). A copy that
    /// failed is not kept: another peer may allow it.
    fn kernel_copy_timing(&self) -> Option<(Duration, Duration)> {
        type Timed = Vec<(usize, (Duration, Duration))>;
        static TIMED: Mutex<Timed> = Mutex::new(Vec::new());
        let len = self.timed_len();
        let mut timed = TIMED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, t)) = timed.iter().find(|(l, _)| *l == len) {
            return Some(t);
        }
        let t = self.time_kernel_copy()?;
        timed.push((len, t));
        Some(t)
    }

    /// Bytes [`Self::time_kernel_copy`] copies.
    fn timed_len(&self) -> usize {
        TIMED_BYTES.min(2 * self.slot)
    }

    /// How long copying this rank's slots takes through the kernel, out of
    /// the next rank's mapping of them, and plainly: the fastest of four
    /// copies each (the first warms the pages and caches); `None` where a
    /// copy through the kernel fails. Nobody writes the slots yet (no rank
    /// posts before every rank has told whether it can read).
    fn time_kernel_copy(&self) -> Option<(Duration, Duration)> {
        let peer = (self.rank + 1) % self.n;
        let at = self.slot_at(self.rank, 0);
        let len = self.timed_len();
        let remote = self.seg.load(self.control(peer) + BASE) + at as u64;
        // SAFETY: this rank's two slots, inside the segment; see above.
        let slots = unsafe { std::slice::from_raw_parts(self.seg.base().add(at), len) };
        let mut into = vec![0u8; len];
        let (mut kernel, mut plain) = (Duration::MAX, Duration::MAX);
        for _ in 0..4 {
            let t = Instant::now();
            if cma::read(self.pid(peer), remote, &mut into).is_err() {
                return None;
            }
            kernel = kernel.min(t.elapsed());
            let t = Instant::now();
            into.copy_from_slice(std::hint::black_box(slots));
            plain = plain.min(t.elapsed());
        }
        tracing::debug!(
            rank = self.rank,
            ?kernel,
            ?plain,
            "the kernel's copy of {len} bytes of the board timed"
        );
        Some((kernel, plain))
    }

    /// Rank `r`'s process.
    fn pid(&self, r: usize) -> Pid {
        Pid::from_raw(self.word32(r, PID).load(Ordering::Acquire) as i32)
    }

    /// The error of a direct read or write of rank `r`'s memory that failed.
    /// `len` bytes at `at` of rank `r`'s memory, in this rank's mapping of
    /// the peer's shared buffer there, if `at` lies in one.
    fn window(&self, r: usize, at: Remote, len: usize) -> Option<region::Window> {
        if at.region.id == 0 || len == 0 {
            return None;
        }
        self.peer_regions.window(r, self.pid(r).as_raw(), at, len)
    }

    fn cma_error(&self, r: usize, fault: Fault) -> Error {
        match fault {
            Fault::Exited => Error::PeerLost {
                rank: self.rank,
                peer: r,
                call: String::new(),
                cause: "its process exited".into(),
            },
            // A peer that gave up may have freed the buffer it posted.
            Fault::Refused(msg) => self.departed(r).unwrap_or(Error::Protocol {
                rank: self.rank,
                peer: r,
                call: String::new(),
                msg,
            }),
        }
    }

    /// The error that names why rank `p` is gone, if it is: it aborted (the
    /// rank it blamed is named where that is a third rank), dropped the
    /// communicator, or its process exited.
    fn departed(&self, p: usize) -> Option<Error> {
        let left = self.word32(p, LEFT).load(Ordering::Acquire);
        let blame = self.word32(p, BLAME).load(Ordering::Relaxed) as usize;
        let lost = |peer: usize, cause: String| Error::PeerLost {
            rank: self.rank,
            peer,
            call: String::new(),
            cause,
        };
        let cause = match left {
            ABORTED if blame > 0 && blame - 1 != p && blame - 1 != self.rank => {
                return Some(lost(blame - 1, format!("rank {p} gave up because of it")));
            }
            ABORTED if blame == self.rank + 1 => {
                "it aborted the communicator because of this rank (a call of this rank's that did not match its own, say)"
            }
            ABORTED => "it aborted the communicator",
            CLOSED => "it dropped the communicator",
            _ if self.exits[p].as_ref().is_some_and(exited) => "its process exited",
            _ => return None,
        };
        Some(lost(p, cause.to_string()))
    }

    /// Waits until `ready()`, which rank `p` makes true: polls for the spin
    /// window, then sleeps on p's futex word in slices. Fails if p left, its
    /// process exited, this rank aborted, or the deadline passed.
    fn wait_for(&self, p: usize, deadline: &Deadline, ready: impl Fn() -> bool) -> Result<()> {
        if ready() {
            return Ok(());
        }
        let bd = self;
        // The clock is read first after POLLS_PER_CLOCK polls (in a VM a
        // read costs as much as a small call's other work): the spin window
        // and the deadline start then.
        let mut started: Option<(Instant, Instant)> = None;
        let window = bd.window.get();
        let mut asleep: Option<Instant> = None;
        let mut polls = 0u32;
        loop {
            if ready() {
                match asleep {
                    None => bd.window.caught(),
                    Some(t) => bd.window.slept(t.elapsed()),
                }
                return Ok(());
            }
            polls += 1;
            if polls % POLLS_PER_CLOCK != 0 {
                if bd.spin.yield_between {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            let now = Instant::now();
            let (started, at) = *started.get_or_insert_with(|| (now, deadline.at(now)));
            if now.duration_since(started) < window {
                continue;
            }
            let departed = bd.departed(p);
            // A peer publishes before it leaves or exits, so it may have
            // finished this call and gone since the last poll.
            if departed.is_some() && ready() {
                return Ok(());
            }
            if bd.word32(bd.rank, LEFT).load(Ordering::Acquire) != 0 {
                return Err(Error::Broken {
                    rank: bd.rank,
                    cause: "this rank left the shared-memory board (aborted)".into(),
                });
            }
            if let Some(e) = departed {
                return Err(e);
            }
            if now >= at {
                return Err(Error::Timeout {
                    context: format!("rank {}", bd.rank),
                    what: format!(
                        "rank {p} on the shared-memory board (it did not make this call, or is stuck)"
                    ),
                    after: deadline.timeout(),
                });
            }
            asleep.get_or_insert(now);
            let wake = bd.word32(p, WAKE);
            let sleepers = bd.word32(p, SLEEPERS);
            sleepers.fetch_add(1, Ordering::SeqCst);
            let seen = wake.load(Ordering::SeqCst);
            if !ready() && bd.word32(p, LEFT).load(Ordering::Acquire) == 0 {
                let nap = SLICE.min(at.saturating_duration_since(now));
                futex(wake, libc::FUTEX_WAIT, seen, Some(nap));
            }
            sleepers.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl GroupMemory for Board {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn slot_bytes(&self) -> usize {
        self.slot
    }

    fn begin(&self, deadline: &Deadline) -> Result<u64> {
        let b = self.calls.load(Ordering::Relaxed) + 1;
        // The head of call b was last used for call b - HEADS.
        if let Some(after) = (b + 1).checked_sub(HEADS as u64).filter(|&c| c > 0) {
            // Mostly known already: the look is not a call.
            if self.seen.iter().any(|s| s.load(Ordering::Relaxed) < after) {
                self.wait_all_published(after, deadline)?;
            }
        }
        // Only the rank's own (one) driving thread makes calls.
        if b > 1 {
            let before = self.history.load(Ordering::Relaxed);
            let call = self.current.load(Ordering::Relaxed);
            self.history.store(finish(before ^ call), Ordering::Relaxed);
        }
        self.calls.store(b, Ordering::Relaxed);
        Ok(b)
    }

    fn post(
        &self,
        round: u64,
        header: &FrameHeader,
        len: usize,
        parts: &[(usize, &[u8])],
        deadline: &Deadline,
    ) -> Result<()> {
        let end = parts.iter().map(|(at, p)| at + p.len()).max().unwrap_or(0);
        if len > self.slot || end > len {
            return Err(Error::Internal(format!(
                "a {len}-byte payload with parts up to byte {end} does not fit a {}-byte board slot",
                self.slot
            )));
        }
        if len > SMALL {
            self.payload_free(round, deadline)?;
        }
        let at = self.head_at(self.rank, round);
        let header = FrameHeader {
            len: len as u64,
            ..*header
        }
        .encode();
        let (call, of_len) = terms(&header);
        self.current.store(call, Ordering::Relaxed);
        self.current_of.store(round, Ordering::Relaxed);
        let sum = finish(call ^ of_len ^ self.history.load(Ordering::Relaxed));
        let payload = self.payload_at(self.rank, round, len);
        // SAFETY: this rank's own head and payload, which no peer reads
        // until the call number below is published (peers finished their
        // previous use, see `begin` and `payload_free`); every part lies
        // inside the payload (checked above).
        unsafe {
            let base = self.seg.base();
            let second = self.second_at(self.rank, round);
            std::ptr::copy_nonoverlapping(
                header.as_ptr(),
                base.add(second + HEADER_AT),
                HEADER_LEN,
            );
            for (offset, part) in parts {
                let to = base.add(payload + offset);
                std::ptr::copy_nonoverlapping(part.as_ptr(), to, part.len());
            }
        }
        self.seg.word(at + DIGEST).store(sum, Ordering::Relaxed);
        self.seg.word(at).store(round, Ordering::Release);
        self.wake_sleepers();
        Ok(())
    }

    fn read(
        &self,
        round: u64,
        r: usize,
        header: &FrameHeader,
        len: usize,
        deadline: &Deadline,
    ) -> Result<&[u8]> {
        if r != self.rank && self.seen[r].load(Ordering::Relaxed) < round {
            self.wait_for(r, deadline, || self.published(r, round) >= round)?;
            self.seen[r].store(round, Ordering::Relaxed);
        }
        let at = self.head_at(r, round);
        let expect = || FrameHeader {
            len: len as u64,
            ..*header
        };
        let history = self.history.load(Ordering::Relaxed);
        let want = match self.current_of.load(Ordering::Relaxed) == round {
            true => finish(self.current.load(Ordering::Relaxed) ^ len_term(len as u64) ^ history),
            false => digest(&expect().encode(), history),
        };
        debug_assert_eq!(
            want,
            digest(&expect().encode(), history),
            "read with another header than posted"
        );
        if self.seg.load(at + DIGEST) != want {
            // SAFETY: the head was published for this call and its owner
            // does not write it again before this rank publishes its next call.
            let head = unsafe {
                std::slice::from_raw_parts(
                    self.seg.base().add(self.second_at(r, round) + HEADER_AT),
                    HEADER_LEN,
                )
            };
            let got = FrameHeader::decode(head).map_err(|msg| Error::Protocol {
                rank: self.rank,
                peer: r,
                call: String::new(),
                msg,
            })?;
            expect().check_received(&got, self.rank, r)?;
            if got == expect() {
                return Err(Error::Mismatch {
                    rank: self.rank,
                    peer: r,
                    ours: got.call_name(),
                    theirs: format!(
                        "{} after an earlier call that did not match this rank's (one in which neither read the other's data)",
                        got.call_name()
                    ),
                });
            }
            return Err(Error::Protocol {
                rank: self.rank,
                peer: r,
                call: String::new(),
                msg: "the board header and its digest disagree".into(),
            });
        }
        // SAFETY: as above; the digests say that the owner posted `len`
        // bytes, at most the slot size.
        Ok(unsafe {
            std::slice::from_raw_parts(
                self.seg.base().add(self.payload_at(r, round, len)),
                len.min(self.slot),
            )
        })
    }

    fn post_reduced(
        &self,
        round: u64,
        offset: usize,
        len: usize,
        write: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        deadline: &Deadline,
    ) -> Result<()> {
        if offset + len > self.slot {
            return Err(Error::Internal(format!(
                "reduced bytes {offset}..{} do not fit a {}-byte board slot",
                offset + len,
                self.slot
            )));
        }
        if len > 0 {
            self.payload_free(round, deadline)?;
        }
        // SAFETY: this rank's own payload slot (checked above), free (see
        // `payload_free`); the caller hands over a range that peers do not
        // read until the reduced number below is published.
        let part = unsafe {
            let to = self.seg.base().add(self.slot_at(self.rank, round) + offset);
            if len == 0 {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(to, len)
            }
        };
        write(part)?;
        self.seg
            .word(self.second_at(self.rank, round))
            .store(round, Ordering::Release);
        self.wake_sleepers();
        Ok(())
    }

    fn read_reduced(
        &self,
        round: u64,
        r: usize,
        offset: usize,
        len: usize,
        deadline: &Deadline,
    ) -> Result<&[u8]> {
        if offset + len > self.slot {
            return Err(Error::Internal(format!(
                "bytes {offset}..{} do not fit a {}-byte board slot",
                offset + len,
                self.slot
            )));
        }
        if r != self.rank {
            self.wait_for(r, deadline, || self.reduced(r, round) >= round)?;
        }
        // SAFETY: published for this call; its owner does not write the slot
        // again before this rank publishes its next call (see `payload_free`).
        Ok(unsafe {
            std::slice::from_raw_parts(self.seg.base().add(self.slot_at(r, round) + offset), len)
        })
    }

    fn direct_min(&self) -> Option<usize> {
        let min = match (self.kernel_copies_pay, self.spin.yield_between) {
            (true, _) => DIRECT_MIN,
            (false, false) => SHARED_DIRECT_MIN,
            (false, true) => SHARED_DIRECT_MIN_SHARING_CPUS,
        };
        self.direct.then_some(min)
    }

    fn kernel_copies_pay(&self) -> bool {
        self.kernel_copies_pay
    }

    fn stream_min(&self) -> usize {
        STREAM_MIN
    }

    fn ranks_share_cpus(&self) -> bool {
        self.spin.yield_between
    }

    fn region(&self, addr: u64, len: usize) -> Region {
        region::region_of(addr, len)
    }

    fn read_direct(&self, r: usize, from: Remote, into: &mut [u8], stream: bool) -> Result<()> {
        if let Some(window) = self.window(r, from, into.len()) {
            // SAFETY: the peer posted these bytes for this rank to read and
            // leaves them unchanged until it is done (the caller's posts).
            return kernels::copy(into, unsafe { window.bytes() }, stream);
        }
        cma::read(self.pid(r), from.addr, into).map_err(|fault| self.cma_error(r, fault))
    }

    fn read_mapped(
        &self,
        r: usize,
        from: Remote,
        len: usize,
        read: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        let Some(window) = self.window(r, from, len) else {
            return Ok(false);
        };
        // SAFETY: as in `read_direct`.
        read(unsafe { window.bytes() })?;
        Ok(true)
    }

    fn write_direct(&self, r: usize, to: Remote, from: &[u8], stream: bool) -> Result<()> {
        if let Some(window) = self.window(r, to, from.len()) {
            // SAFETY: the peer posted these bytes for this rank to write and
            // touches them only once it is done (the caller's posts).
            return kernels::copy(unsafe { window.bytes_mut() }, from, stream);
        }
        cma::write(self.pid(r), to.addr, from).map_err(|fault| self.cma_error(r, fault))
    }

    fn abort(&self, blame: usize) {
        self.word32(self.rank, BLAME)
            .store(blame as u32 + 1, Ordering::Relaxed);
        self.leave(ABORTED);
    }

    fn blame_of(&self, rank: usize) -> Option<usize> {
        if rank >= self.n || self.word32(rank, LEFT).load(Ordering::Acquire) != ABORTED {
            return None;
        }
        let blame = self.word32(rank, BLAME).load(Ordering::Relaxed) as usize;
        blame.checked_sub(1)
    }
}

/// Sets up the board of a communicator of `n` ranks that all run on this
/// host, with slots of [`board_slot_bytes`].
///
/// Rank 0 creates the segment and offers it through `store`; the others map
/// it; every rank reports through the store, and once all have, rank 0
/// unlinks the file. Returns `Ok(Err(reason))`, the same on every rank, when
/// some rank cannot use the board; `Err` when the store fails. Unless `cma`
/// is [`DirectReads::Never`], the ranks then probe whether each can read
/// every other's memory and (`Timed`) time the kernel's copies.
#[allow(clippy::too_many_arguments)]
pub fn connect_board(
    rank: usize,
    n: usize,
    comm: u64,
    store: &dyn Store,
    dir: &Path,
    timeout: Duration,
    spin: Spin,
    cma: DirectReads,
) -> Result<std::result::Result<Board, String>> {
    let slot = board_slot_bytes(n);
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let len = board_len(n, slot);
    let mapped: std::result::Result<(Segment, PathBuf), String> = if rank == 0 {
        let name = format!(
            "ccl-{}-{}-{comm:016x}-board",
            std::process::id(),
            crate::SEGMENTS.fetch_add(1, Ordering::Relaxed)
        );
        let made = Segment::create(dir, &name, len)
            .map_err(|e| format!("creating {}: {e}", dir.join(&name).display()));
        let offer = match &made {
            Ok(seg) => {
                seg.word(8).store(n as u64, Ordering::Relaxed);
                seg.word(16).store(slot as u64, Ordering::Relaxed);
                seg.word(0).store(MAGIC, Ordering::Release);
                format!("ok {}", seg.path().display())
            }
            Err(e) => format!("err {e}"),
        };
        store.set("board/offer", offer.as_bytes())?;
        made.map(|s| {
            let path = s.path().to_path_buf();
            (s, path)
        })
    } else {
        let offer = store.get("board/offer", left())?;
        let offer = String::from_utf8_lossy(&offer).into_owned();
        match offer.split_once(' ') {
            Some(("ok", path)) => Segment::open(Path::new(path), len)
                .map_err(|e| format!("rank {rank} opening {path}: {e}"))
                .and_then(|seg| {
                    let (magic, ranks, bytes) = (seg.load(0), seg.load(8), seg.load(16));
                    if magic != MAGIC || ranks != n as u64 || bytes != slot as u64 {
                        return Err(format!(
                            "board {path} has magic {magic:#x}, {ranks} ranks, {bytes}-byte slots"
                        ));
                    }
                    Ok((seg, PathBuf::from(path)))
                }),
            Some(("err", why)) => Err(why.to_string()),
            _ => Err(format!("malformed board offer {offer:?}")),
        }
    };
    let verdict = match &mapped {
        Ok((seg, _)) => {
            let pid_at = HEAD + rank * area(slot) + PID;
            // SAFETY: this rank's pid word, 4-byte aligned, inside the segment.
            let pid = unsafe { &*seg.base().add(pid_at).cast::<AtomicU32>() };
            pid.store(std::process::id(), Ordering::Release);
            seg.word(HEAD + rank * area(slot) + BASE)
                .store(seg.base() as u64, Ordering::Release);
            "ok".to_string()
        }
        Err(e) => format!("err {e}"),
    };
    store.set(&format!("board/{rank}"), verdict.as_bytes())?;
    let mut failure = None;
    for r in 0..n {
        let v = store.get(&format!("board/{r}"), left());
        let v = match v {
            Ok(v) => v,
            Err(e) => {
                if let Ok((seg, _)) = &mapped {
                    if rank == 0 {
                        seg.unlink();
                    }
                }
                return Err(e);
            }
        };
        if v != b"ok" && failure.is_none() {
            failure = Some(format!(
                "rank {r}: {}",
                String::from_utf8_lossy(v.strip_prefix(b"err ").unwrap_or(&v))
            ));
        }
    }
    let (seg, _path) = match mapped {
        Ok(m) => m,
        Err(e) => return Ok(Err(e)),
    };
    if rank == 0 {
        seg.unlink();
    }
    if let Some(f) = failure {
        return Ok(Err(f));
    }
    let mut board = Board {
        rank,
        n,
        seg,
        slot,
        calls: AtomicU64::new(0),
        history: AtomicU64::new(0),
        current: AtomicU64::new(0),
        current_of: AtomicU64::new(0),
        seen: (0..n)
            .map(|p| AtomicU64::new(if p == rank { u64::MAX } else { 0 }))
            .collect(),
        payload_free_for: AtomicU64::new(0),
        exits: Vec::new(),
        spin,
        window: SpinWindow::new(spin.window),
        direct: false,
        kernel_copies_pay: false,
        peer_regions: PeerRegions::default(),
    };
    board.exits = (0..n)
        .map(|p| {
            (p != rank)
                .then(|| pidfd(board.word32(p, PID).load(Ordering::Acquire)))
                .flatten()
        })
        .collect();
    // Timed first: its copies evict the caches that the heads were just
    // brought into (a 2-rank allgather of 128 B took 0.28–0.32 µs a call
    // over 23 calls with the heads mapped first, 0.19–0.22 mapped after).
    let mine = board.direct_reads_here(cma);
    board.map_heads();
    (board.direct, board.kernel_copies_pay) =
        board.agree_on_direct_reads(mine, &Deadline::after(left()))?;
    Ok(Ok(board))
}

#[cfg(test)]
mod tests {
    use std::{cell::Cell, sync::Arc, thread};

    use ccl_core::{CollectiveKind, DataType, Fingerprint};
    use ccl_rendezvous::HashStore;

    use super::*;

    /// Two boards of one communicator, as two ranks would hold them, with
    /// direct reads wherever the kernel allows them.
    fn pair(spin: Spin) -> (Board, Board) {
        pair_with(spin, [DirectReads::Always; 2])
    }

    /// The same, where rank r reads directly as `cma[r]` says.
    fn pair_with(spin: Spin, cma: [DirectReads; 2]) -> (Board, Board) {
        let store = Arc::new(HashStore::new());
        let connect = move |rank: usize, store: Arc<HashStore>| {
            connect_board(
                rank,
                2,
                9,
                &*store,
                Path::new(crate::SHM_DIR),
                SLICE * 100,
                spin,
                cma[rank],
            )
            .expect("store")
            .expect("board")
        };
        let other = {
            let store = store.clone();
            thread::spawn(move || connect(1, store))
        };
        let zero = connect(0, store);
        (zero, other.join().expect("rank 1"))
    }

    /// Whether this process has the page at `addr` in its page table
    /// (`/proc/self/pagemap`, bit 63).
    fn page_present(addr: *const u8) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open("/proc/self/pagemap").expect("pagemap");
        f.seek(SeekFrom::Start((addr as u64 / 4096) * 8))
            .expect("seek");
        let mut entry = [0u8; 8];
        f.read_exact(&mut entry).expect("a pagemap entry");
        u64::from_le_bytes(entry) >> 63 == 1
    }

    /// Every page of every rank's heads is mapped once the board is
    /// connected, so that no call takes a page fault on one; a payload
    /// slot, which no call has used yet, is not (so the check can fail).
    #[test]
    fn every_page_of_the_heads_is_mapped_from_the_start() {
        let boards = pair(Spin::default());
        for board in [&boards.0, &boards.1] {
            for r in 0..2 {
                let start = board.control(r);
                let end = start + LINE + HEADS * HEAD_BYTES;
                for at in (start..end).step_by(4096).chain([end - 1]) {
                    // SAFETY: inside the mapping.
                    let addr = unsafe { board.seg.base().add(at) };
                    assert!(page_present(addr), "rank {r}'s head byte {}", at - start);
                }
                // SAFETY: inside the mapping (a slot is at least 1 MiB here).
                let slot = unsafe { board.seg.base().add(board.slot_at(r, 0) + 8192) };
                assert!(!page_present(slot), "rank {r}'s slot is mapped already");
            }
        }
    }

    /// Direct reads are offered where every rank can make them, and then
    /// read a peer's memory; an address the peer never mapped is an error
    /// naming that peer. One rank without them (`CCL_SHM_CMA=0`) turns
    /// them off for both.
    #[test]
    fn direct_reads_need_every_rank_and_read_the_peers_memory() {
        let (zero, one) = pair(Spin::default());
        assert_eq!(zero.direct_min(), Some(DIRECT_MIN));
        assert_eq!(one.direct_min(), Some(DIRECT_MIN));
        assert!(zero.kernel_copies_pay() && one.kernel_copies_pay());
        let theirs: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut got = vec![0u8; theirs.len()];
        let at = |addr: u64| Remote {
            addr,
            region: Region::default(),
        };
        zero.read_direct(1, at(theirs.as_ptr() as u64), &mut got, false)
            .expect("a direct read");
        assert!(got == theirs);
        let mut written = vec![0u8; theirs.len()];
        one.write_direct(0, at(written.as_mut_ptr() as u64), &theirs, false)
            .expect("a direct write");
        assert!(std::hint::black_box(&written) == &theirs);
        for e in [
            zero.read_direct(1, at(8), &mut got, false),
            zero.write_direct(1, at(8), &theirs, true),
        ] {
            match e {
                Err(Error::Protocol {
                    rank: 0,
                    peer: 1,
                    msg,
                    ..
                }) => {
                    assert!(msg.contains("0x8"), "{msg}")
                }
                other => panic!("a read or write at address 8: {other:?}"),
            }
        }
        // A shared buffer's bytes are copied through the reader's mapping
        // of it: at an address given relative to a made-up base, which the
        // kernel could not read, they arrive all the same.
        let mut shared = crate::SharedBuffer::new(theirs.len()).unwrap();
        shared.as_bytes_mut().copy_from_slice(&theirs);
        let start = shared.as_bytes().as_ptr() as u64;
        let made_up = Remote {
            addr: 0x1000 + 4096,
            region: Region {
                base: 0x1000,
                ..zero.region(start, 1)
            },
        };
        assert_ne!(made_up.region.id, 0, "the buffer is a region");
        let mut got = vec![0u8; 8192];
        for stream in [false, true] {
            got.fill(0);
            zero.read_direct(1, made_up, &mut got, stream).unwrap();
            assert!(got[..] == theirs[4096..4096 + 8192], "stream {stream}");
        }
        one.write_direct(0, made_up, &[9; 64], true).unwrap();
        assert_eq!(shared.as_bytes()[4096..4096 + 64], [9; 64]);
        // Lent where they lie, to be reduced there; memory outside a shared
        // buffer is not lent (the caller copies it).
        let mut lent = Vec::new();
        let mapped = zero.read_mapped(1, made_up.offset(64), 128, &mut |b| {
            lent.extend_from_slice(b);
            Ok(())
        });
        assert!(mapped.unwrap());
        assert!(lent[..] == theirs[4096 + 64..4096 + 192]);
        let own = at(theirs.as_ptr() as u64);
        assert!(!zero.read_mapped(1, own, 128, &mut |_| Ok(())).unwrap());
        assert!(
            zero.read_direct(1, made_up.offset(theirs.len()), &mut got, false)
                .is_err(),
            "past the buffer's end, the kernel is asked and refuses"
        );
        for cma in [
            [DirectReads::Always, DirectReads::Never],
            [DirectReads::Never, DirectReads::Timed],
        ] {
            let (zero, one) = pair_with(Spin::default(), cma);
            assert_eq!(
                (zero.direct_min(), one.direct_min()),
                (None, None),
                "{cma:?}"
            );
        }
    }

    /// Where the ranks time the kernel's copies, they read directly and
    /// agree on whether to copy memory outside shared buffers through the
    /// kernel, whatever each found; a rank that finds them slow (timing, or
    /// `mapped`) turns them off for a rank that uses them wherever it can.
    #[test]
    fn ranks_that_time_the_kernels_copies_agree_on_them() {
        let (zero, one) = pair_with(Spin::default(), [DirectReads::Mapped, DirectReads::Always]);
        for board in [&zero, &one] {
            assert!(!board.kernel_copies_pay());
            assert!(board.direct_min().is_some_and(|min| min > DIRECT_MIN));
        }
        for cma in [
            [DirectReads::Timed; 2],
            [DirectReads::Timed, DirectReads::Always],
        ] {
            let (zero, one) = pair_with(Spin::default(), cma);
            assert!(zero.direct_min().is_some(), "{cma:?}");
            assert_eq!(zero.direct_min(), one.direct_min(), "{cma:?}");
            assert_eq!(
                zero.direct_min() == Some(DIRECT_MIN),
                zero.kernel_copies_pay(),
                "{cma:?}: shared buffers alone are read from larger blocks"
            );
            assert_eq!(zero.kernel_copies_pay(), one.kernel_copies_pay(), "{cma:?}");
            let said = |r: usize| zero.word32(r, DIRECT).load(Ordering::Acquire);
            assert_ne!(said(0), CANNOT_READ, "{cma:?}");
            if cma[1] == DirectReads::Always {
                assert_eq!(said(1), CAN_READ, "a rank that does not time says it reads");
            }
            let timed = |r: usize| {
                let word = |what| zero.word32(r, what).load(Ordering::Acquire);
                (word(KERNEL_NS), word(PLAIN_NS))
            };
            assert!(timed(0).0 > 0 && timed(0).1 > 0, "{cma:?}: rank 0 timed");
            assert_eq!(
                timed(1) == (0, 0),
                cma[1] == DirectReads::Always,
                "{cma:?}: rank 1 timed only under auto"
            );
            assert_eq!(
                zero.kernel_copies_pay(),
                said(0) == CAN_READ
                    && said(1) == CAN_READ
                    && kernel_copies_pay([timed(0), timed(1)]),
                "{cma:?}: ranks said {} and {}, timed {:?} and {:?}",
                said(0),
                said(1),
                timed(0),
                timed(1)
            );
        }
    }

    /// A process times the kernel's copies once: its later boards (a
    /// sub-communicator's) tell the same timings, to the nanosecond.
    #[test]
    fn a_process_times_the_kernels_copies_once() {
        let timed = |board: &Board| {
            let word = |what| board.word32(0, what).load(Ordering::Acquire);
            (word(KERNEL_NS), word(PLAIN_NS))
        };
        let (first, _one) = pair_with(Spin::default(), [DirectReads::Timed; 2]);
        let (second, _one) = pair_with(Spin::default(), [DirectReads::Timed; 2]);
        assert!(timed(&first).0 > 0, "{:?}", timed(&first));
        assert_eq!(timed(&first), timed(&second));
    }

    /// The ranks' fastest copies decide together: one rank whose copies a
    /// CPU mate slowed does not turn the kernel's copies off for all, and
    /// ranks that did not time have no say.
    #[test]
    fn the_fastest_copies_of_all_ranks_decide_whether_the_kernels_pay() {
        // A Xeon VM's 4 ranks, one disturbed (µs: kernel, plain).
        assert!(kernel_copies_pay([
            (668, 200),
            (380, 219),
            (265, 173),
            (282, 173)
        ]));
        // An AMD VM's 2 ranks: the kernel's copies 4 times as long.
        assert!(!kernel_copies_pay([(700, 170), (720, 175)]));
        // The line: 3 times the fastest plain copy of any rank.
        assert!(kernel_copies_pay([(600, 200), (0, 0)]));
        assert!(!kernel_copies_pay([(601, 200), (0, 0)]));
        assert!(!kernel_copies_pay([(601, 300), (700, 200)]));
        assert!(kernel_copies_pay([(0, 0), (0, 0)]));
        assert!(kernel_copies_pay([]));
    }

    #[test]
    fn a_rank_that_gave_up_leaves_its_blame_readable() {
        let (zero, one) = pair(Spin::default());
        assert_eq!(zero.blame_of(1), None);
        one.abort(5);
        assert_eq!(zero.blame_of(1), Some(5));
        assert_eq!(zero.blame_of(0), None);
        assert_eq!(zero.blame_of(9), None);
        drop(one);
        assert_eq!(zero.blame_of(1), Some(5), "after the rank's board is gone");
    }

    /// A change in any field of a header changes its digest.
    #[test]
    fn every_header_field_is_in_the_digest() {
        let fp = Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, 2);
        let base = FrameHeader::data(9, 5, 0, 8, fp);
        let variants = [
            FrameHeader { comm: 10, ..base },
            FrameHeader { seq: 6, ..base },
            // The same words in other places.
            FrameHeader {
                comm: base.seq,
                seq: base.comm,
                ..base
            },
            FrameHeader { step: 1, ..base },
            FrameHeader { len: 12, ..base },
            FrameHeader::data(
                9,
                5,
                0,
                8,
                Fingerprint::new(CollectiveKind::AllReduce, DataType::F32, 3),
            ),
            FrameHeader::data(
                9,
                5,
                0,
                8,
                Fingerprint::new(CollectiveKind::AllReduce, DataType::I32, 2),
            ),
            FrameHeader::data(
                9,
                5,
                0,
                8,
                Fingerprint::new(CollectiveKind::Reduce, DataType::F32, 2),
            ),
            FrameHeader::data(9, 5, 0, 8, fp.with_root(1)),
        ];
        let d = digest(&base.encode(), 0);
        assert_eq!(d, digest(&base.encode(), 0));
        for v in variants {
            assert_ne!(digest(&v.encode(), 0), d, "{v:?}");
        }
        assert_ne!(digest(&base.encode(), 1), d, "another history");
    }

    /// The peer publishes and leaves between a poll and the look at whether
    /// it is gone: the wait succeeds, as the data is there.
    #[test]
    fn a_peer_that_published_then_left_is_not_lost() {
        let spin = Spin {
            window: Duration::ZERO,
            yield_between: false,
            repoll: false,
        };
        let (zero, one) = pair(spin);
        let deadline = Deadline::after(SLICE * 20);
        zero.begin(&deadline).expect("begin");
        // wait_for polls once, then POLLS_PER_CLOCK times before it looks at
        // the peer: the last of those polls fails, and the peer leaves.
        let polls = Cell::new(0u32);
        let last_failing_poll = POLLS_PER_CLOCK + 1;
        let waited = zero.wait_for(1, &deadline, || {
            polls.set(polls.get() + 1);
            if polls.get() == last_failing_poll {
                one.leave(CLOSED);
            }
            polls.get() > last_failing_poll
        });
        assert!(waited.is_ok(), "{waited:?}");
        assert_eq!(polls.get(), last_failing_poll + 1, "looked again once");
        // Without the data, the same departure is a lost peer.
        let never = zero.wait_for(1, &deadline, || false);
        assert!(
            matches!(never, Err(Error::PeerLost { peer: 1, .. })),
            "{never:?}"
        );
    }
}
