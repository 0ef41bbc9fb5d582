//! Group memory: memory every rank of a communicator reads and writes
//! directly (a shared-memory segment when all of them run on one host), on
//! which the group algorithms of `ccl-algorithms` run without messages.
//!
//! The memory is a series of rounds. In each round every rank posts a
//! payload once (with the call's frame header, which readers check against
//! their own), may publish a second part later in the round (a result it
//! computed from the others' posts), and reads what it needs of the others'.
//! Whatever a rank reads in round `b` stays valid until it posts a later
//! round: its peers reuse that memory only then. A rank may start rounds
//! ahead of peers whose posts it does not read, as far as the memory keeps
//! rounds apart (the shared-memory board: 32 small rounds, two large ones).

use std::{
    cell::Cell,
    time::{Duration, Instant},
};

use crate::{FrameHeader, Result};

/// A region of host memory that its process shares with the other
/// processes of its host, which map it and copy it with loads and stores
/// rather than through the kernel: its identity in that process (`id`; 0:
/// no region) and the address it starts at there.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Region {
    /// The region's identity in its process; 0 for no region.
    pub id: u64,
    /// Where the region starts in its process.
    pub base: u64,
}

/// A buffer that another rank posted for direct copies: its address in
/// that rank's process and the shared region holding it, if any.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remote {
    /// The buffer's address in its process.
    pub addr: u64,
    /// The shared region holding it ([`Region::default`]: none).
    pub region: Region,
}

impl Remote {
    /// `bytes` bytes further on, in the same region (wrapping: a peer's
    /// garbage address fails where it is used, not here).
    pub fn offset(self, bytes: usize) -> Remote {
        Remote {
            addr: self.addr.wrapping_add(bytes as u64),
            ..self
        }
    }
}

/// Memory shared by every rank of one communicator (see the module docs).
///
/// Waits end with an error naming the rank waited for when that rank left
/// or died, when this rank aborted, or at `deadline`; errors leave `call`
/// empty, for the caller to fill in.
pub trait GroupMemory: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;

    /// Ranks sharing the memory.
    fn world_size(&self) -> usize;

    /// Payload bytes one rank can post in a round.
    fn slot_bytes(&self) -> usize;

    /// Starts this rank's next round, once the other ranks have gone far
    /// enough (posted the round before, or one some rounds back where the
    /// memory keeps several rounds' headers) that the memory it posts its
    /// header into is free; returns the round's number. A rank may thus
    /// start rounds ahead of peers whose posts it does not read.
    fn begin(&self, deadline: &Deadline) -> Result<u64>;

    /// Posts this rank's payload of round `round`: `len` bytes of which this
    /// rank writes `parts`, each at its offset, with `header` (its `len`
    /// field taken as `len`). Readers read only the parts; the rest may be
    /// published by [`GroupMemory::post_reduced`]. May first wait, until
    /// `deadline`, for readers of an earlier round to finish with the memory.
    /// Every rank posts once in every round it begins (a rank with nothing
    /// to say posts no bytes): ranks whose next round waits for this one
    /// may otherwise wait until their deadline.
    fn post(
        &self,
        round: u64,
        header: &FrameHeader,
        len: usize,
        parts: &[(usize, &[u8])],
        deadline: &Deadline,
    ) -> Result<()>;

    /// Waits for rank `rank` to post round `round` and returns its payload
    /// of `len` bytes, after checking that its header is `expect` with that
    /// length (another call is [`crate::Error::Mismatch`]). Once this rank
    /// posted in the round, `expect` is the header it posted with (but for
    /// the length): the memory may check against that one.
    fn read(
        &self,
        round: u64,
        rank: usize,
        expect: &FrameHeader,
        len: usize,
        deadline: &Deadline,
    ) -> Result<&[u8]>;

    /// The second phase of round `round`: lends bytes `offset..offset + len`
    /// of this rank's payload (a range no peer reads in the first phase) to
    /// `write`, which computes its result there, then publishes them. Where
    /// `write` fails, nothing is published and its error is returned. May
    /// first wait as [`GroupMemory::post`] does.
    fn post_reduced(
        &self,
        round: u64,
        offset: usize,
        len: usize,
        write: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        deadline: &Deadline,
    ) -> Result<()>;

    /// Waits for rank `rank` to publish its second phase of round `round`
    /// and returns bytes `offset..offset + len` of its payload.
    fn read_reduced(
        &self,
        round: u64,
        rank: usize,
        offset: usize,
        len: usize,
        deadline: &Deadline,
    ) -> Result<&[u8]>;

    /// The smallest block, in bytes, that group algorithms copy straight
    /// out of another rank's buffer ([`GroupMemory::read_direct`], at an
    /// address that rank posted) rather than through its posts: one copy
    /// instead of two. `None` where some rank cannot; the same on every rank.
    fn direct_min(&self) -> Option<usize>;

    /// Whether [`GroupMemory::read_direct`] and [`GroupMemory::write_direct`]
    /// are worth calling on memory outside shared regions (a region of id
    /// 0), which they copy through the kernel: where that copy is slow
    /// against the posts' two plain copies, group algorithms read directly
    /// only out of shared regions. Meaningful where
    /// [`GroupMemory::direct_min`] offers direct reads; the same on every rank.
    fn kernel_copies_pay(&self) -> bool;

    /// The shared region of this process that holds the `len` bytes at
    /// `addr`, for the other ranks to map ([`Remote`]); the default region
    /// (none) where there is none.
    fn region(&self, addr: u64, len: usize) -> Region;

    /// Copies `into.len()` bytes at `from` in rank `rank`'s memory into
    /// `into`; with `stream`, with stores that bypass the caches where the
    /// copy is this rank's own (a mapped region's). The caller makes sure,
    /// through posts, that the memory stays valid and unchanged until it
    /// has read it.
    fn read_direct(&self, rank: usize, from: Remote, into: &mut [u8], stream: bool) -> Result<()>;

    /// Lends the `len` bytes at `from` in rank `rank`'s memory to `read`
    /// where this rank maps them (they lie in a peer's shared region), so
    /// that they are reduced where they lie: `Ok(true)` once `read` returned,
    /// `Ok(false)` without calling it where this rank does not map them (the
    /// caller copies them with [`GroupMemory::read_direct`]). The caller
    /// makes sure, as for that, that the memory stays valid and unchanged.
    fn read_mapped(
        &self,
        rank: usize,
        from: Remote,
        len: usize,
        read: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool>;

    /// Copies `from` to `to` in rank `rank`'s memory, where
    /// [`GroupMemory::direct_min`] offers direct reads (`stream` as for
    /// [`GroupMemory::read_direct`]). The caller makes sure, through posts,
    /// that rank `rank` posted that memory for this rank to write and
    /// touches it only once this rank says it is done.
    fn write_direct(&self, rank: usize, to: Remote, from: &[u8], stream: bool) -> Result<()>;

    /// The smallest output of a call, summed over the ranks, that group
    /// algorithms write with streaming stores, which bypass the caches
    /// ([`crate::kernels::copy_streaming`]): an output that large is not
    /// read again from a cache, and a streaming store does not first read
    /// the line it writes. `usize::MAX`: never.
    fn stream_min(&self) -> usize;

    /// Whether the ranks of this memory outnumber the CPUs they may run on
    /// (their waits yield to each other), so that no rank sits idle while
    /// another copies.
    fn ranks_share_cpus(&self) -> bool;

    /// Tells the other ranks that this rank gave up because of rank `blame`:
    /// those waiting for it fail at once, naming that rank.
    fn abort(&self, blame: usize);

    /// The rank that rank `rank` gave up because of ([`GroupMemory::abort`]),
    /// if it did: still readable after its process exited, so a rank that
    /// sees it gone names the rank that failed first, store or no store.
    fn blame_of(&self, rank: usize) -> Option<usize>;
}

/// The deadline of a call that may wait several times: its timeout counts
/// from the first time the call has to wait, so that a call that never
/// waits reads no clock.
#[derive(Debug)]
pub struct Deadline {
    timeout: Duration,
    at: Cell<Option<Instant>>,
}

impl Deadline {
    /// A deadline `timeout` after the first wait.
    #[inline]
    pub fn after(timeout: Duration) -> Deadline {
        Deadline {
            timeout,
            at: Cell::new(None),
        }
    }

    /// The timeout, counted from the first wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// When the call times out, given that it waits at `now`.
    pub fn at(&self, now: Instant) -> Instant {
        match self.at.get() {
            Some(at) => at,
            None => {
                let at = now
                    .checked_add(self.timeout)
                    .unwrap_or(now + Duration::from_secs(1 << 30));
                self.at.set(Some(at));
                at
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_counts_from_the_first_wait() {
        let d = Deadline::after(Duration::from_secs(3));
        let first = Instant::now();
        let at = d.at(first);
        assert_eq!(at, first + Duration::from_secs(3));
        assert_eq!(d.at(first + Duration::from_secs(1)), at);
        assert!(Deadline::after(Duration::MAX).at(first) > first);
    }
}
