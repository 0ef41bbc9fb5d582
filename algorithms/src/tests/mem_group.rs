//! Group memory in this process's heap, for testing the group algorithms
//! with ranks as threads, kept as the shared-memory board keeps it: per rank
//! [`HEADS`] heads, each with a header, a small payload and the numbers of
//! the round it was posted (and its second phase published) for, and two
//! payload slots for larger payloads and second phases. Ranks run ahead of
//! peers they do not read as far as the board lets them (fewer heads here, so
//! that tests reuse them often). A waiter sleeps on a condition variable
//! that every publication notifies.

use std::{
    cell::UnsafeCell,
    sync::{
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
        Arc, Condvar, Mutex,
    },
    time::{Duration, Instant},
};

use ccl_core::{Deadline, Error, FrameHeader, GroupMemory, Region, Remote, Result};

/// Heads per rank.
const HEADS: u64 = 3;
/// Largest payload kept in a head.
const SMALL: usize = 48;

/// One rank's head of one round modulo [`HEADS`].
struct Head {
    header: Mutex<Option<FrameHeader>>,
    small: UnsafeCell<[u8; SMALL]>,
    posted: AtomicU64,
    reduced: AtomicU64,
}

struct Shared {
    n: usize,
    slot_bytes: usize,
    /// What [`GroupMemory::direct_min`] answers.
    direct_min: Option<usize>,
    /// What [`GroupMemory::kernel_copies_pay`] answers: where not, a direct
    /// read or write outside a shared region is an error.
    kernel_copies: bool,
    /// What [`GroupMemory::stream_min`] answers.
    stream_min: usize,
    /// Every buffer counts as lying in a shared region, which
    /// [`GroupMemory::read_mapped`] lends.
    mapped: bool,
    /// Byte ranges that count as lying in a shared region besides
    /// ([`MemGroup::share`]).
    shared_ranges: Mutex<Vec<(u64, u64)>>,
    /// `heads[rank][round % HEADS]`.
    heads: Vec<Vec<Head>>,
    /// `payloads[rank][round % 2]`.
    payloads: Vec<[UnsafeCell<Vec<u8>>; 2]>,
    /// Rank that aborted, plus one, and whom it blamed.
    aborted: AtomicUsize,
    blamed: AtomicUsize,
    /// Notified on every publication.
    changed: (Mutex<u64>, Condvar),
}

// SAFETY: a payload is written only by its owner before it publishes the
// round (and in the second phase, in ranges nobody reads before that
// publication), and read only after; a rank writes a head or payload slot
// only once every reader finished the round that used it before.
unsafe impl Sync for Shared {}

/// One rank's handle on group memory in the heap.
pub(crate) struct MemGroup {
    shared: Arc<Shared>,
    rank: usize,
    rounds: AtomicU64,
    /// The last round whose payload slot this rank found free.
    payload_free_for: AtomicU64,
    left: AtomicBool,
    /// Bytes of payload this rank posted.
    posted_bytes: AtomicU64,
}

/// Group memory for `n` ranks with `slot_bytes` per slot, offering direct
/// reads of blocks from `direct_min` bytes (ranks share this address
/// space, so a direct read is a plain copy), outside shared regions only
/// with `kernel_copies`, and streaming stores for outputs from `stream_min`
/// bytes, and with `mapped`, every buffer in a shared region (lent where it
/// lies): one handle per rank.
pub(crate) fn group(
    n: usize,
    slot_bytes: usize,
    direct_min: Option<usize>,
    kernel_copies: bool,
    stream_min: usize,
    mapped: bool,
) -> Vec<MemGroup> {
    let head = || Head {
        header: Mutex::new(None),
        small: UnsafeCell::new([0; SMALL]),
        posted: AtomicU64::new(0),
        reduced: AtomicU64::new(0),
    };
    let payload = || UnsafeCell::new(vec![0; slot_bytes]);
    let shared = Arc::new(Shared {
        n,
        slot_bytes,
        direct_min,
        kernel_copies,
        stream_min,
        mapped,
        shared_ranges: Mutex::new(Vec::new()),
        heads: (0..n)
            .map(|_| (0..HEADS).map(|_| head()).collect())
            .collect(),
        payloads: (0..n).map(|_| [payload(), payload()]).collect(),
        aborted: AtomicUsize::new(0),
        blamed: AtomicUsize::new(0),
        changed: (Mutex::new(0), Condvar::new()),
    });
    (0..n)
        .map(|rank| MemGroup {
            shared: shared.clone(),
            rank,
            rounds: AtomicU64::new(0),
            payload_free_for: AtomicU64::new(0),
            left: AtomicBool::new(false),
            posted_bytes: AtomicU64::new(0),
        })
        .collect()
}

impl MemGroup {
    /// Counts the `len` bytes at `at` as lying in a shared region (for
    /// every rank), as a buffer from `ccl::SharedBuffer` does.
    pub(crate) fn share(&self, at: *const u8, len: usize) {
        let at = at as u64;
        self.shared
            .shared_ranges
            .lock()
            .unwrap()
            .push((at, at + len as u64));
    }

    /// Bytes of payload this rank posted so far.
    pub(crate) fn posted_bytes(&self) -> u64 {
        self.posted_bytes.load(Ordering::Relaxed)
    }

    fn head(&self, rank: usize, round: u64) -> &Head {
        &self.shared.heads[rank][(round % HEADS) as usize]
    }

    /// Waits until every peer has posted round `round` or a later one.
    fn wait_all_posted(&self, round: u64, deadline: &Deadline) -> Result<()> {
        for p in (0..self.shared.n).filter(|&p| p != self.rank) {
            let head = self.head(p, round);
            self.wait_for(p, deadline, || head.posted.load(Ordering::Acquire) >= round)?;
        }
        Ok(())
    }

    /// Waits until no peer reads this rank's payload slot of `round`.
    fn payload_free(&self, round: u64, deadline: &Deadline) -> Result<()> {
        if round >= 2 && self.payload_free_for.load(Ordering::Relaxed) != round {
            self.wait_all_posted(round - 1, deadline)?;
            self.payload_free_for.store(round, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Fails unless this memory offers direct reads and writes of `rank`.
    /// An error unless this memory offers direct access to rank `rank`'s
    /// memory at `at`.
    fn offers_direct(&self, rank: usize, at: Remote) -> Result<()> {
        let kernel = at.region.id == 0;
        if self.shared.direct_min.is_none()
            || rank >= self.shared.n
            || kernel && !self.shared.kernel_copies
        {
            return Err(Error::Internal(format!(
                "rank {}: direct access to rank {rank} (through the kernel: {kernel}), which this group memory does not offer",
                self.rank
            )));
        }
        Ok(())
    }

    fn notify(&self) {
        let (lock, cond) = &self.shared.changed;
        *lock.lock().unwrap() += 1;
        cond.notify_all();
    }

    /// Waits until `ready()`, which rank `p` makes true.
    fn wait_for(&self, p: usize, deadline: &Deadline, ready: impl Fn() -> bool) -> Result<()> {
        let at = deadline.at(Instant::now());
        let (lock, cond) = &self.shared.changed;
        loop {
            let generation = lock.lock().unwrap();
            if ready() {
                return Ok(());
            }
            let aborted = self.shared.aborted.load(Ordering::Acquire);
            if aborted == p + 1 {
                // As the board: name the rank it blamed, unless that is
                // this rank (or p itself).
                let blamed = self.shared.blamed.load(Ordering::Acquire);
                let peer = if blamed == self.rank { p } else { blamed };
                return Err(Error::PeerLost {
                    rank: self.rank,
                    peer,
                    call: String::new(),
                    cause: format!("rank {p} aborted"),
                });
            }
            if self.left.load(Ordering::Acquire) {
                return Err(Error::Broken {
                    rank: self.rank,
                    cause: "this rank aborted".into(),
                });
            }
            let left = at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    context: format!("rank {}", self.rank),
                    what: format!("rank {p} in group memory"),
                    after: deadline.timeout(),
                });
            }
            let nap = left.min(Duration::from_millis(20));
            drop(cond.wait_timeout(generation, nap).unwrap());
        }
    }

    /// Writes `parts` at their offsets of this rank's `len`-byte payload of `round`.
    fn write(&self, round: u64, len: usize, parts: &[(usize, &[u8])]) -> Result<()> {
        // SAFETY: this rank's own payload, which nobody reads until the
        // publication that follows (see `Shared`).
        let payload: &mut [u8] = unsafe {
            match len <= SMALL {
                true => &mut *self.head(self.rank, round).small.get(),
                false => &mut *self.shared.payloads[self.rank][(round % 2) as usize].get(),
            }
        };
        for (at, part) in parts {
            payload
                .get_mut(*at..at + part.len())
                .ok_or_else(|| Error::Internal(format!("part at {at} outside the slot")))?
                .copy_from_slice(part);
        }
        Ok(())
    }

    /// Bytes `at..at + len` of rank `rank`'s payload slot of `round`, or
    /// of its head's small payload (`small`).
    fn payload(
        &self,
        rank: usize,
        round: u64,
        small: bool,
        at: usize,
        len: usize,
    ) -> Result<&[u8]> {
        // SAFETY: published for this round, and not written again before
        // this rank posts its next round (see `Shared`).
        let payload: &[u8] = unsafe {
            match small {
                true => &*self.head(rank, round).small.get(),
                false => &*self.shared.payloads[rank][(round % 2) as usize].get(),
            }
        };
        payload
            .get(at..at + len)
            .ok_or_else(|| Error::Internal(format!("bytes {at}..{} outside the slot", at + len)))
    }
}

impl GroupMemory for MemGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.n
    }

    fn slot_bytes(&self) -> usize {
        self.shared.slot_bytes
    }

    fn begin(&self, deadline: &Deadline) -> Result<u64> {
        let b = self.rounds.load(Ordering::Relaxed) + 1;
        // The head of round b was last used for round b - HEADS.
        if b > HEADS {
            self.wait_all_posted(b + 1 - HEADS, deadline)?;
        }
        self.rounds.store(b, Ordering::Relaxed);
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
        if len > self.shared.slot_bytes || parts.iter().any(|(at, p)| at + p.len() > len) {
            return Err(Error::Internal(format!(
                "a {len}-byte post does not fit a {}-byte slot",
                self.shared.slot_bytes
            )));
        }
        if len > SMALL {
            self.payload_free(round, deadline)?;
        }
        self.write(round, len, parts)?;
        self.posted_bytes.fetch_add(len as u64, Ordering::Relaxed);
        let head = self.head(self.rank, round);
        *head.header.lock().unwrap() = Some(FrameHeader {
            len: len as u64,
            ..*header
        });
        head.posted.store(round, Ordering::Release);
        self.notify();
        Ok(())
    }

    fn read(
        &self,
        round: u64,
        rank: usize,
        header: &FrameHeader,
        len: usize,
        deadline: &Deadline,
    ) -> Result<&[u8]> {
        let head = self.head(rank, round);
        self.wait_for(rank, deadline, || {
            head.posted.load(Ordering::Acquire) >= round
        })?;
        let got = head.header.lock().unwrap().expect("posted with a header");
        let expect = FrameHeader {
            len: len as u64,
            ..*header
        };
        expect.check_received(&got, self.rank, rank)?;
        self.payload(rank, round, len <= SMALL, 0, len)
    }

    fn post_reduced(
        &self,
        round: u64,
        offset: usize,
        len: usize,
        write: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        deadline: &Deadline,
    ) -> Result<()> {
        if len > 0 {
            self.payload_free(round, deadline)?;
        }
        // SAFETY: this rank's own payload, whose range `offset..offset +
        // len` nobody reads until the publication that follows (see `Shared`).
        let payload = unsafe { &mut *self.shared.payloads[self.rank][(round % 2) as usize].get() };
        let part = payload.get_mut(offset..offset + len).ok_or_else(|| {
            Error::Internal(format!("bytes {offset}..{} outside the slot", offset + len))
        })?;
        write(part)?;
        self.head(self.rank, round)
            .reduced
            .store(round, Ordering::Release);
        self.notify();
        Ok(())
    }

    fn read_reduced(
        &self,
        round: u64,
        rank: usize,
        offset: usize,
        len: usize,
        deadline: &Deadline,
    ) -> Result<&[u8]> {
        let head = self.head(rank, round);
        self.wait_for(rank, deadline, || {
            head.reduced.load(Ordering::Acquire) >= round
        })?;
        self.payload(rank, round, false, offset, len)
    }

    fn direct_min(&self) -> Option<usize> {
        self.shared.direct_min
    }

    fn kernel_copies_pay(&self) -> bool {
        self.shared.kernel_copies
    }

    fn stream_min(&self) -> usize {
        self.shared.stream_min
    }

    fn ranks_share_cpus(&self) -> bool {
        false
    }

    fn region(&self, addr: u64, len: usize) -> Region {
        let end = addr + len as u64;
        let in_range = || {
            self.shared
                .shared_ranges
                .lock()
                .unwrap()
                .iter()
                .any(|&(lo, hi)| lo <= addr && end <= hi)
        };
        match self.shared.mapped || in_range() {
            true => Region { id: 1, base: 0 },
            false => Region::default(),
        }
    }

    fn read_direct(&self, rank: usize, from: Remote, into: &mut [u8], _stream: bool) -> Result<()> {
        self.offers_direct(rank, from)?;
        let addr = from.addr;
        // SAFETY: ranks are threads of this process, and the algorithm
        // posted `addr` as a buffer of at least this length that stays
        // unchanged until this rank tells it is done reading.
        let from = unsafe { std::slice::from_raw_parts(addr as usize as *const u8, into.len()) };
        into.copy_from_slice(from);
        Ok(())
    }

    fn read_mapped(
        &self,
        rank: usize,
        from: Remote,
        len: usize,
        read: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        if from.region.id == 0 {
            return Ok(false);
        }
        self.offers_direct(rank, from)?;
        // SAFETY: as in `read_direct`.
        read(unsafe { std::slice::from_raw_parts(from.addr as usize as *const u8, len) })?;
        Ok(true)
    }

    fn write_direct(&self, rank: usize, to: Remote, from: &[u8], _stream: bool) -> Result<()> {
        self.offers_direct(rank, to)?;
        let addr = to.addr;
        // SAFETY: ranks are threads of this process, and the algorithm
        // posted `addr` as a buffer of at least this length that its owner
        // leaves alone until this rank tells it is done writing.
        let to = unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, from.len()) };
        to.copy_from_slice(from);
        Ok(())
    }

    fn abort(&self, blame: usize) {
        self.shared.blamed.store(blame, Ordering::Release);
        self.shared.aborted.store(self.rank + 1, Ordering::Release);
        self.left.store(true, Ordering::Release);
        self.notify();
    }

    fn blame_of(&self, rank: usize) -> Option<usize> {
        (self.shared.aborted.load(Ordering::Acquire) == rank + 1)
            .then(|| self.shared.blamed.load(Ordering::Acquire))
    }
}
