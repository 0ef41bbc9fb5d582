//! The protocol core: one state machine per peer over the [`Verbs`] trait,
//! with no I/O of its own and no waiting (the link drives it, the way
//! quinn drives quinn-proto).
//!
//! Every message is an RDMA write with immediate into memory the peer
//! registered; the 32-bit immediate says what it is:
//!
//! ```text
//! bits 28..32  kind: 1 eager, 2 RTS, 3 CTS, 4 FIN, 5 credit, 6 abort, 7 bye
//! bits 16..28  slots of the sender's ring the writer freed since it last said so
//! bits  0..16  the slot written (eager, RTS, CTS, abort)
//! ```
//!
//! * **Eager** (payload up to the eager limit, a slot less 64 bytes): the
//!   sender copies header and payload into a registered staging slot and
//!   writes them into the next slot of the peer's receive ring. The receive
//!   copies (or reduces) straight out of the ring.
//! * **Credits**: each side may have at most `slots` messages in the peer's
//!   ring that the peer has not consumed. Consumed slots are returned in the
//!   immediate of the next message, or by a credit message (a write of no
//!   bytes) once half the ring is free or when the side waits.
//! * **Rendezvous** (larger payloads): the sender writes an RTS (the header);
//!   the receiver registers its destination (through the [`RegCache`]) and
//!   writes a CTS (address, key, length) as soon as its receive starts, which
//!   may be before the RTS arrives; the sender then writes the payload
//!   straight from its buffer into the receiver's, with FIN as immediate. No
//!   copy on either side; a receive-and-reduce lands in registered scratch
//!   and reduces from there.
//! * **Keepalive**: a side that waits writes no bytes to the peer now and
//!   then; a peer that is gone turns it into a retry-exceeded completion.
//! * **Bye**: a side that closes ([`Peer::close`]) writes `BYE` after its
//!   last message and waits until every write it posted has completed, so
//!   that what its eager sends handed over reaches the peer before its
//!   process may exit and tear the queue pair down. The peer then writes
//!   nothing more to it (no credits, no keepalives), forgives the failure of
//!   a credit, keepalive or slot message it wrote before it knew, and fails
//!   an operation that still needs the closed side, saying so.
//!
//! Every other completion error becomes an [`Error`] naming the peer, and
//! the peer stays failed: later operations get the same error.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use ccl_core::{frame::HEADER_LEN, AbortNotice, Error, FrameHeader, Result};

use crate::{
    counters::COUNTERS,
    regcache::RegCache,
    verbs::{Completion, QueuePair, Region, Remote, Status, Verbs, Write},
};

/// Bytes a slot keeps in front of an eager payload (the header, padded).
pub const SLOT_HEAD: usize = 64;
/// Largest single RDMA write (the verbs limit is 2 GiB).
const MAX_WRITE: usize = 1 << 30;

/// Message kinds, in the immediate's top bits.
const EAGER: u32 = 1;
const RTS: u32 = 2;
const CTS: u32 = 3;
const FIN: u32 = 4;
const CREDIT: u32 = 5;
const ABORT: u32 = 6;
const BYE: u32 = 7;
/// The slot field of a message that carries no slot.
const NO_SLOT: u32 = 0xffff;
/// Most credits one immediate returns.
const MAX_CREDITS: usize = 0xfff;

/// The immediate of a message.
fn imm(kind: u32, credits: usize, slot: u32) -> u32 {
    kind << 28 | (credits as u32 & 0xfff) << 16 | (slot & 0xffff)
}

/// Sizes of the eager protocol, the same on both sides of a pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingConfig {
    /// Slots per receive ring (`CCL_RDMA_SLOTS`), 2 to 4095.
    pub slots: usize,
    /// Bytes per slot (`CCL_RDMA_SLOT_BYTES`); payloads up to this less
    /// [`SLOT_HEAD`] go eagerly.
    pub slot_bytes: usize,
    /// How often a waiting side checks that the peer is still there.
    pub keepalive: Duration,
}

impl Default for RingConfig {
    fn default() -> RingConfig {
        RingConfig {
            slots: 16,
            slot_bytes: 64 * 1024,
            keepalive: Duration::from_millis(500),
        }
    }
}

impl RingConfig {
    /// Largest payload sent eagerly.
    pub fn eager_limit(&self) -> usize {
        self.slot_bytes - SLOT_HEAD
    }
}

/// Memory this side owns and registered (rings, scratch).
pub(crate) struct Owned {
    buf: Vec<u64>,
    pub(crate) region: Region,
}

impl Owned {
    pub(crate) fn new<V: Verbs>(verbs: &V, len: usize) -> std::result::Result<Owned, String> {
        let buf = vec![0u64; len.div_ceil(8).max(1)];
        let region = verbs.register(buf.as_ptr() as u64, len.max(1))?;
        Ok(Owned { buf, region })
    }

    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    fn bytes(&self, at: usize, len: usize) -> &[u8] {
        &bytemuck_bytes(&self.buf)[at..at + len]
    }

    fn bytes_mut(&mut self, at: usize, len: usize) -> &mut [u8] {
        let all = self.buf.as_mut_ptr() as *mut u8;
        assert!(at + len <= self.buf.len() * 8);
        // SAFETY: in bounds of the vector, borrowed mutably through `self`.
        unsafe { std::slice::from_raw_parts_mut(all.add(at), len) }
    }
}

fn bytemuck_bytes(words: &[u64]) -> &[u8] {
    // SAFETY: any u64 is 8 initialised bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, words.len() * 8) }
}

/// What a work request was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purpose {
    Staging,
    Data,
    Bare,
}

/// A message that arrived for the receive path.
#[derive(Clone, Copy, Debug)]
enum Inbound {
    Eager { slot: usize, len: usize },
    Rts { slot: usize, len: usize },
    Fin { len: usize },
}

/// An advertised destination.
#[derive(Clone, Copy, Debug)]
struct Cts {
    remote: Remote,
    len: u64,
}

/// What the peer told us when connecting (see `setup`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PeerRing {
    pub(crate) remote: Remote,
}

/// The protocol state towards one peer.
pub struct Peer<V: Verbs> {
    rank: usize,
    peer: usize,
    cfg: RingConfig,
    verbs: Arc<V>,
    cache: Arc<Mutex<RegCache>>,
    qp: V::Qp,
    ring: Owned,
    staging: Owned,
    scratch: Option<Owned>,
    remote_ring: Remote,
    /// Slots of the peer's ring this side may still write.
    credits: usize,
    /// Slots of this side's ring consumed and not yet returned.
    to_return: usize,
    /// Slot messages written (the next goes to slot `sent % slots`).
    sent: u64,
    /// Slot messages received (the next arrives in slot `received % slots`).
    received: u64,
    /// Staging slots whose write has not completed.
    staging_busy: usize,
    /// Work requests posted, with what for, oldest first.
    posted: std::collections::VecDeque<(u64, Purpose)>,
    next_id: u64,
    /// Id of the last data write that completed.
    data_done: u64,
    inbound: std::collections::VecDeque<Inbound>,
    cts: std::collections::VecDeque<Cts>,
    completions: Vec<Completion>,
    last_probe: Instant,
    error: Option<Error>,
    /// Whether `error` came only from this side cancelling a receive: the
    /// queue pair still works, so an abort notice can still be sent.
    cancelled: bool,
    /// This side said bye ([`Peer::close`]).
    closed: bool,
    /// The peer said bye: it sends and reads nothing more.
    peer_closed: bool,
}

/// A send in progress (see [`Peer::poll_send`]).
pub struct SendOp {
    header: FrameHeader,
    addr: u64,
    len: usize,
    /// The data is GPU memory: the NIC reads it (GPUDirect RDMA), never
    /// the CPU, so it always goes by rendezvous.
    device: bool,
    state: SendState,
}

enum SendState {
    Start,
    RtsSent,
    Writing { id: u64, region: Region },
    Done,
}

impl SendOp {
    /// A send of `header` and `data`, which must stay valid until it is done
    /// or the peer has failed.
    pub fn new(header: FrameHeader, data: &[u8]) -> SendOp {
        SendOp {
            header,
            addr: data.as_ptr() as u64,
            len: data.len(),
            device: false,
            state: SendState::Start,
        }
    }

    /// A send of `header` and `len` bytes of GPU memory at `addr`, which
    /// must stay valid until it is done or the peer has failed; the
    /// receiver must receive into GPU memory too.
    pub fn device(header: FrameHeader, addr: u64, len: usize) -> SendOp {
        SendOp {
            header,
            addr,
            len,
            device: true,
            state: SendState::Start,
        }
    }

    /// Whether a write from the caller's memory may still be under way.
    pub fn in_flight(&self) -> bool {
        matches!(self.state, SendState::RtsSent | SendState::Writing { .. })
    }
}

/// Where a receive puts what arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Straight into the caller's memory (a large payload is written there).
    Direct,
    /// Handed to the caller's sink (a receive-and-reduce): eager payloads
    /// from the ring, large ones from registered scratch.
    Sink,
}

/// A receive in progress (see [`Peer::poll_recv`]).
pub struct RecvOp {
    expect: FrameHeader,
    addr: u64,
    len: usize,
    target: Target,
    /// The destination is GPU memory (see [`SendOp::device`]).
    device: bool,
    state: RecvState,
}

enum RecvState {
    Start,
    CtsSent { region: Option<Region>, rts: bool },
    Done,
}

impl RecvOp {
    /// A receive of a frame that must match `expect` into `into` (which
    /// must stay valid until it is done or the peer has failed).
    pub fn new(expect: FrameHeader, into: &mut [u8]) -> RecvOp {
        RecvOp {
            expect,
            addr: into.as_mut_ptr() as u64,
            len: into.len(),
            target: Target::Direct,
            device: false,
            state: RecvState::Start,
        }
    }

    /// A receive of a frame that must match `expect` into `len` bytes of
    /// GPU memory at `addr` (valid until it is done or the peer has
    /// failed), written there by the sender's NIC; the sender must send
    /// from GPU memory too.
    pub fn device(expect: FrameHeader, addr: u64, len: usize) -> RecvOp {
        RecvOp {
            expect,
            addr,
            len,
            target: Target::Direct,
            device: true,
            state: RecvState::Start,
        }
    }

    /// A receive of a frame of `len` bytes that must match `expect`,
    /// handed to the sink of [`Peer::poll_recv`] where it lies.
    pub fn sink(expect: FrameHeader, len: usize) -> RecvOp {
        RecvOp {
            expect,
            addr: 0,
            len,
            target: Target::Sink,
            device: false,
            state: RecvState::Start,
        }
    }
}

impl<V: Verbs> Peer<V> {
    /// The state towards `peer` over a connected `qp`, with this side's
    /// `ring` (registered, `cfg.slots × cfg.slot_bytes`, its address given
    /// to the peer) and the peer's ring at `remote`.
    pub(crate) fn new(
        (rank, peer): (usize, usize),
        cfg: RingConfig,
        verbs: Arc<V>,
        cache: Arc<Mutex<RegCache>>,
        mut qp: V::Qp,
        ring: Owned,
        remote: PeerRing,
    ) -> std::result::Result<Peer<V>, String> {
        let staging = Owned::new(&*verbs, cfg.slots * cfg.slot_bytes)?;
        // Every message in the ring, plus every credit message (each returns
        // at least one slot), plus an abort and a bye.
        for _ in 0..2 * cfg.slots + 3 {
            qp.post_recv()?;
        }
        Ok(Peer {
            rank,
            peer,
            cfg,
            verbs,
            cache,
            qp,
            ring,
            staging,
            scratch: None,
            remote_ring: remote.remote,
            credits: cfg.slots,
            to_return: 0,
            sent: 0,
            received: 0,
            staging_busy: 0,
            posted: Default::default(),
            next_id: 1,
            data_done: 0,
            inbound: Default::default(),
            cts: Default::default(),
            completions: Vec::new(),
            last_probe: Instant::now(),
            error: None,
            cancelled: false,
            closed: false,
            peer_closed: false,
        })
    }

    /// The error the peer failed with, if it did.
    pub fn failed(&self) -> Option<&Error> {
        self.error.as_ref()
    }

    fn lost(&self, cause: String) -> Error {
        Error::peer_lost(self.rank, self.peer, cause, false)
    }

    fn protocol(&self, msg: String) -> Error {
        Error::protocol(self.rank, self.peer, msg)
    }

    /// Records the first failure and returns it.
    fn fail(&mut self, e: Error) -> Error {
        self.error.get_or_insert(e).clone()
    }

    fn check(&self) -> Result<()> {
        match &self.error {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// The error a completion with `status` means.
    fn completion_error(&self, status: &Status) -> Error {
        match status {
            Status::RetryExceeded => self.lost(format!(
                "RDMA {status}: rank {}'s NIC no longer answers",
                self.peer
            )),
            Status::Flushed => self.lost(format!(
                "RDMA {status}: the queue pair to rank {} failed earlier",
                self.peer
            )),
            Status::RemoteAccess => self.protocol(format!(
                "RDMA {status}: rank {} refused a write into its memory",
                self.peer
            )),
            other => self.protocol(format!("RDMA completion failed: {other}")),
        }
    }

    fn post(&mut self, mut write: Write, purpose: Purpose) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        write.id = id;
        self.qp
            .post_write(&write)
            .map_err(|e| self.lost(format!("posting an RDMA write failed: {e}")))
            .map_err(|e| self.fail(e))?;
        self.posted.push_back((id, purpose));
        Ok(id)
    }

    fn take_credits(&mut self) -> usize {
        let n = self.to_return.min(MAX_CREDITS);
        self.to_return -= n;
        n
    }

    /// Whether a slot message can be written now.
    fn can_post_slot(&self) -> bool {
        self.credits > 0 && self.staging_busy < self.cfg.slots
    }

    /// Writes `parts` into the peer's next slot, through a staging slot.
    fn post_slot(&mut self, kind: u32, parts: &[&[u8]]) -> Result<()> {
        let slot = (self.sent % self.cfg.slots as u64) as usize;
        let at = slot * self.cfg.slot_bytes;
        let mut len = 0;
        for p in parts {
            self.staging.bytes_mut(at + len, p.len()).copy_from_slice(p);
            len += p.len();
        }
        let credits = self.take_credits();
        self.post(
            Write {
                id: 0,
                addr: self.staging.addr() + at as u64,
                len,
                lkey: self.staging.region.lkey,
                remote: Remote {
                    addr: self.remote_ring.addr + at as u64,
                    rkey: self.remote_ring.rkey,
                },
                imm: Some(imm(kind, credits, slot as u32)),
            },
            Purpose::Staging,
        )?;
        self.credits -= 1;
        self.sent += 1;
        self.staging_busy += 1;
        Ok(())
    }

    /// A write of no bytes with immediate `kind` (credits, an abort without room).
    fn post_bare(&mut self, kind: u32) -> Result<()> {
        let credits = self.take_credits();
        self.post(
            Write {
                id: 0,
                addr: 0,
                len: 0,
                lkey: 0,
                remote: self.remote_ring,
                imm: Some(imm(kind, credits, NO_SLOT)),
            },
            Purpose::Bare,
        )?;
        Ok(())
    }

    /// Polls the completion queue and takes in what arrived; returns the
    /// first failure. Returns consumed slots once half the ring is free.
    pub fn progress(&mut self) -> Result<()> {
        self.check()?;
        let mut done = std::mem::take(&mut self.completions);
        self.qp.poll(&mut done);
        // A bye anywhere in the batch forgives the failed writes before it
        // too: it is the peer's last message, and its failures may come
        // first where the completion queues interleave.
        let bye = |c: &Completion| match c {
            Completion::Recv { imm, status, .. } => *status == Status::Success && imm >> 28 == BYE,
            Completion::Write { .. } => false,
        };
        if done.iter().any(bye) {
            self.peer_closed = true;
        }
        let mut result = Ok(());
        for c in done.drain(..) {
            match (&result, c) {
                (Ok(()), c) => result = self.complete(c),
                // Once a write has failed, messages that arrived in the same
                // batch still count: an abort notice among them names the
                // rank that failed first, which a survivor should report
                // rather than the neighbour that left after it.
                (Err(_), c @ Completion::Recv { imm, .. }) => {
                    let abort = imm >> 28 == ABORT;
                    if let Err(e) = self.complete(c) {
                        if abort {
                            result = Err(e);
                        }
                        break;
                    }
                }
                (Err(_), Completion::Write { .. }) => {}
            }
        }
        self.completions = done;
        if let Err(e) = result {
            return Err(self.fail(e));
        }
        if self.to_return >= (self.cfg.slots / 2).max(1) && self.talking() {
            self.post_bare(CREDIT)?;
        }
        Ok(())
    }

    /// Writes posted and not yet completed.
    #[cfg(test)]
    pub(crate) fn writes_in_flight(&self) -> usize {
        self.posted.len()
    }

    /// Whether neither side said bye: only then does this side write
    /// credits and keepalives.
    fn talking(&self) -> bool {
        !self.closed && !self.peer_closed
    }

    /// The error of an operation that needs a peer that said bye.
    fn peer_left(&mut self) -> Error {
        let e = self.lost(format!(
            "rank {} closed its communicator (or its process exited) before this \
             rank's messages to or from it were done",
            self.peer
        ));
        self.fail(e)
    }

    /// Says bye to the peer and waits, polling until `until`, for every
    /// write posted to it to complete (see the module docs). Does nothing
    /// on a failed pair, or one the peer closed first.
    pub fn close(&mut self, until: Instant) {
        if self.closed || self.peer_closed || self.error.is_some() {
            return;
        }
        self.closed = true;
        if self.post_bare(BYE).is_err() {
            return;
        }
        while !self.posted.is_empty() && Instant::now() < until {
            if self.progress().is_err() || self.peer_closed {
                break;
            }
            std::thread::yield_now();
        }
        self.fail(Error::closed_here(self.rank, self.peer));
    }

    /// Arms the queue pair's completion queue (see [`QueuePair::arm`]).
    pub fn arm(&mut self) -> bool {
        self.qp.arm()
    }

    /// Called when the caller is about to wait: returns every consumed slot
    /// (so that a peer waiting for credits never waits on this side), and
    /// checks now and then that the peer is still there.
    pub fn idle(&mut self) -> Result<()> {
        self.check()?;
        if !self.talking() {
            return Ok(());
        }
        if self.to_return > 0 {
            self.post_bare(CREDIT)?;
        }
        if self.last_probe.elapsed() >= self.cfg.keepalive {
            self.last_probe = Instant::now();
            self.post(
                Write {
                    id: 0,
                    addr: 0,
                    len: 0,
                    lkey: 0,
                    remote: self.remote_ring,
                    imm: None,
                },
                Purpose::Bare,
            )?;
        }
        Ok(())
    }

    fn complete(&mut self, c: Completion) -> Result<()> {
        match c {
            Completion::Write { id, status } => {
                let Some(i) = self.posted.iter().position(|&(p, _)| p == id) else {
                    if status != Status::Success {
                        return Err(self.completion_error(&status));
                    }
                    return Err(self.protocol(format!("completion of unknown work request {id}")));
                };
                let purpose = self.posted[i].1;
                // Once the peer said bye, only a payload that may not have
                // reached it still matters.
                if status != Status::Success && !(self.peer_closed && purpose != Purpose::Data) {
                    return Err(self.completion_error(&status));
                }
                self.posted.remove(i);
                match purpose {
                    Purpose::Staging => self.staging_busy -= 1,
                    Purpose::Data => self.data_done = self.data_done.max(id),
                    Purpose::Bare => {}
                }
                Ok(())
            }
            Completion::Recv { status, .. } if status != Status::Success && self.peer_closed => {
                Ok(())
            }
            Completion::Recv { imm, len, status } => {
                if status != Status::Success {
                    return Err(self.completion_error(&status));
                }
                self.qp
                    .post_recv()
                    .map_err(|e| self.lost(format!("posting an RDMA receive failed: {e}")))?;
                self.arrived(imm, len)
            }
        }
    }

    /// Takes in a write with immediate `imm` of `len` bytes.
    fn arrived(&mut self, imm: u32, len: usize) -> Result<()> {
        let (kind, credits, slot) = (imm >> 28, (imm >> 16) as usize & 0xfff, imm & 0xffff);
        self.credits += credits;
        if self.credits > self.cfg.slots {
            return Err(self.protocol(format!(
                "returned more credits than the ring has ({} of {})",
                self.credits, self.cfg.slots
            )));
        }
        let slotted = matches!(kind, EAGER | RTS | CTS) || (kind == ABORT && slot != NO_SLOT);
        if slotted {
            let want = (self.received % self.cfg.slots as u64) as u32;
            if slot != want || len > self.cfg.slot_bytes {
                return Err(self.protocol(format!(
                    "message of {len} bytes in slot {slot}, expected slot {want} of at most {} bytes",
                    self.cfg.slot_bytes
                )));
            }
            self.received += 1;
        }
        let slot = slot as usize;
        match kind {
            EAGER => self.inbound.push_back(Inbound::Eager { slot, len }),
            RTS => self.inbound.push_back(Inbound::Rts { slot, len }),
            FIN => self.inbound.push_back(Inbound::Fin { len }),
            CREDIT => {}
            BYE => self.peer_closed = true,
            CTS => {
                let b = self.ring.bytes(slot * self.cfg.slot_bytes, len.min(24));
                if b.len() != 24 {
                    return Err(self.protocol(format!("CTS of {len} bytes")));
                }
                let word = |i: usize| {
                    let mut w = [0u8; 8];
                    w.copy_from_slice(&b[i..i + 8]);
                    u64::from_le_bytes(w)
                };
                let cts = Cts {
                    remote: Remote {
                        addr: word(0),
                        rkey: word(8) as u32,
                    },
                    len: word(16),
                };
                self.cts.push_back(cts);
                self.to_return += 1;
            }
            ABORT => {
                let notice = if slot == NO_SLOT as usize {
                    AbortNotice {
                        failed_rank: self.peer as u32,
                        reason: "it aborted the link".into(),
                    }
                } else {
                    AbortNotice::decode(self.ring.bytes(slot * self.cfg.slot_bytes, len))
                        .map_err(|e| self.protocol(format!("malformed abort notice: {e}")))?
                };
                return Err(notice.into_error(self.rank, self.peer));
            }
            k => return Err(self.protocol(format!("unknown message kind {k}"))),
        }
        Ok(())
    }

    /// Advances a send; `Ok(true)` once the caller's memory is no longer used.
    pub fn poll_send(&mut self, op: &mut SendOp) -> Result<bool> {
        self.check()?;
        // A peer that said bye reads nothing more; a payload being written
        // is known only from its completion.
        if self.peer_closed && !matches!(op.state, SendState::Writing { .. } | SendState::Done) {
            return Err(self.peer_left());
        }
        loop {
            match op.state {
                SendState::Done => return Ok(true),
                SendState::Start => {
                    if !self.can_post_slot() {
                        return Ok(false);
                    }
                    let head = op.header.encode();
                    if !self.by_rendezvous(op.len, op.device) {
                        // SAFETY: the op's data is valid while the op is (see `SendOp::new`).
                        let data =
                            unsafe { std::slice::from_raw_parts(op.addr as *const u8, op.len) };
                        let pad = [0u8; SLOT_HEAD - HEADER_LEN];
                        self.post_slot(EAGER, &[&head, &pad, data])?;
                        COUNTERS.add_eager(op.len);
                        op.state = SendState::Done;
                    } else {
                        self.post_slot(RTS, &[&head])?;
                        op.state = SendState::RtsSent;
                    }
                }
                SendState::RtsSent => {
                    let Some(cts) = self.cts.pop_front() else {
                        return Ok(false);
                    };
                    if cts.len != op.len as u64 {
                        let e = self.protocol(format!(
                            "rank {} offered {} bytes for a {}-byte message {} of {}",
                            self.peer,
                            cts.len,
                            op.len,
                            op.header.step,
                            op.header.call_name()
                        ));
                        return Err(self.fail(e));
                    }
                    let region = self.acquire(op.addr, op.len, op.device)?;
                    let mut at = 0;
                    let mut id = 0;
                    while at < op.len {
                        let n = (op.len - at).min(MAX_WRITE);
                        let last = at + n == op.len;
                        let credits = if last { self.take_credits() } else { 0 };
                        id = self.post(
                            Write {
                                id: 0,
                                addr: op.addr + at as u64,
                                len: n,
                                lkey: region.lkey,
                                remote: Remote {
                                    addr: cts.remote.addr + at as u64,
                                    rkey: cts.remote.rkey,
                                },
                                imm: last.then(|| imm(FIN, credits, NO_SLOT)),
                            },
                            Purpose::Data,
                        )?;
                        at += n;
                    }
                    COUNTERS.add_zero_copy_sent(op.len);
                    if op.device {
                        COUNTERS.add_device(op.len);
                    }
                    op.state = SendState::Writing { id, region };
                }
                SendState::Writing { id, region } => {
                    if self.data_done < id {
                        return Ok(false);
                    }
                    self.release(&region);
                    op.state = SendState::Done;
                }
            }
        }
    }

    /// Gives up a send that did not finish (its future was dropped): the
    /// pair can no longer tell where the next message begins.
    pub fn cancel_send(&mut self, op: &mut SendOp) {
        if let SendState::Writing { region, .. } = op.state {
            self.release(&region);
        }
        if op.in_flight() {
            let e = self.lost("a send to it was cancelled in the middle of a message".into());
            self.fail(e);
        }
        op.state = SendState::Done;
    }

    /// Advances a receive; `Ok(true)` once it is done. `sink` gets the
    /// payload where it lies when it is not written straight into the
    /// destination (an eager receive, or any receive with [`Target::Sink`]).
    pub fn poll_recv(
        &mut self,
        op: &mut RecvOp,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        let done = self.advance_recv(op, sink)?;
        // The bye came after everything the peer sent: what is not here
        // now never comes.
        if !done && self.peer_closed {
            return Err(self.peer_left());
        }
        Ok(done)
    }

    /// [`Peer::poll_recv`] as far as what arrived allows.
    fn advance_recv(
        &mut self,
        op: &mut RecvOp,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<bool> {
        self.check()?;
        let large = self.by_rendezvous(op.len, op.device);
        loop {
            match op.state {
                RecvState::Done => return Ok(true),
                RecvState::Start if !large => {
                    let Some(inbound) = self.inbound.pop_front() else {
                        return Ok(false);
                    };
                    let (slot, len) = match inbound {
                        Inbound::Eager { slot, len } => (slot, len),
                        Inbound::Rts { slot, len } => {
                            let got = self.header_in(slot, len)?;
                            op.expect
                                .check_received(&got, self.rank, self.peer)
                                .map_err(|e| self.fail(e))?;
                            let e = self.protocol(format!(
                                "rank {} offers {} bytes by rendezvous (a large message, or one \
                                 from GPU memory) where this rank receives {} bytes eagerly into \
                                 host memory: both sides of a transfer must use the same kind of \
                                 memory",
                                self.peer, got.len, op.len
                            ));
                            return Err(self.fail(e));
                        }
                        Inbound::Fin { .. } => {
                            let e = self.protocol("payload written without an offer".into());
                            return Err(self.fail(e));
                        }
                    };
                    let got = self.header_in(slot, len)?;
                    op.expect
                        .check_received(&got, self.rank, self.peer)
                        .map_err(|e| self.fail(e))?;
                    if len != SLOT_HEAD + op.len {
                        let e = self.protocol(format!(
                            "eager message of {len} bytes for a {}-byte payload",
                            op.len
                        ));
                        return Err(self.fail(e));
                    }
                    let at = slot * self.cfg.slot_bytes + SLOT_HEAD;
                    let payload = self.ring.bytes(at, op.len);
                    let r = match op.target {
                        Target::Sink => sink(payload),
                        Target::Direct => {
                            // SAFETY: the op's memory is valid while it is (see `RecvOp::new`).
                            unsafe { std::slice::from_raw_parts_mut(op.addr as *mut u8, op.len) }
                                .copy_from_slice(payload);
                            Ok(())
                        }
                    };
                    COUNTERS.add_eager(op.len);
                    self.to_return += 1;
                    r.map_err(|e| self.fail(e))?;
                    op.state = RecvState::Done;
                }
                RecvState::Start => {
                    if !self.can_post_slot() || self.peer_closed {
                        return Ok(false);
                    }
                    let (dest, region) = match op.target {
                        Target::Direct => {
                            let region = self.acquire(op.addr, op.len, op.device)?;
                            (
                                Remote {
                                    addr: op.addr,
                                    rkey: region.rkey,
                                },
                                Some(region),
                            )
                        }
                        Target::Sink => {
                            let scratch = self.scratch(op.len)?;
                            (scratch, None)
                        }
                    };
                    let mut cts = [0u8; 24];
                    cts[0..8].copy_from_slice(&dest.addr.to_le_bytes());
                    cts[8..16].copy_from_slice(&u64::from(dest.rkey).to_le_bytes());
                    cts[16..24].copy_from_slice(&(op.len as u64).to_le_bytes());
                    self.post_slot(CTS, &[&cts])?;
                    op.state = RecvState::CtsSent { region, rts: false };
                }
                RecvState::CtsSent { region, rts } => {
                    let Some(&inbound) = self.inbound.front() else {
                        return Ok(false);
                    };
                    match (inbound, rts) {
                        (Inbound::Eager { slot, len } | Inbound::Rts { slot, len }, false) => {
                            self.inbound.pop_front();
                            let got = self.header_in(slot, len)?;
                            self.to_return += 1;
                            op.expect
                                .check_received(&got, self.rank, self.peer)
                                .map_err(|e| self.fail(e))?;
                            if !matches!(inbound, Inbound::Rts { .. }) {
                                let e = self.protocol(format!(
                                    "eager message for a {} receive (both sides of a transfer \
                                     must use the same kind of memory)",
                                    if op.device { "GPU-memory" } else { "large" }
                                ));
                                return Err(self.fail(e));
                            }
                            op.state = RecvState::CtsSent { region, rts: true };
                        }
                        (Inbound::Fin { len }, true) => {
                            self.inbound.pop_front();
                            if len != op.len {
                                let e = self.protocol(format!(
                                    "{len} bytes written for a {}-byte message",
                                    op.len
                                ));
                                return Err(self.fail(e));
                            }
                            if let Some(region) = region {
                                self.release(&region);
                                COUNTERS.add_zero_copy_received(op.len);
                                if op.device {
                                    COUNTERS.add_device(op.len);
                                }
                            } else if let Some(s) = &self.scratch {
                                sink(s.bytes(0, op.len)).map_err(|e| self.fail(e))?;
                            }
                            op.state = RecvState::Done;
                        }
                        _ => {
                            let e = self.protocol(format!(
                                "unexpected {inbound:?} during a rendezvous (RTS seen: {rts})"
                            ));
                            return Err(self.fail(e));
                        }
                    }
                }
            }
        }
    }

    /// Gives up a receive that did not finish: a destination already
    /// offered to the peer is deregistered, so a late write fails at the
    /// peer instead of landing in memory that may be gone.
    pub fn cancel_recv(&mut self, op: &mut RecvOp) {
        if let RecvState::CtsSent { region, .. } = op.state {
            let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(region) = region {
                cache.release(&*self.verbs, &region);
                cache.invalidate(&*self.verbs, op.addr, op.len);
            }
            drop(cache);
            let e =
                self.lost("a receive from it was cancelled after its buffer was offered".into());
            if self.error.is_none() {
                self.cancelled = true;
            }
            self.fail(e);
        }
        op.state = RecvState::Done;
    }

    /// Whether a message of `len` bytes (from or into GPU memory: `device`)
    /// goes by rendezvous: above the eager limit, and every non-empty one
    /// of GPU memory, which the CPU never touches. Both sides decide alike.
    fn by_rendezvous(&self, len: usize, device: bool) -> bool {
        len > self.cfg.eager_limit() || (device && len > 0)
    }

    /// A registration of `[addr, addr + len)` (GPU memory: `device`) from the cache.
    fn acquire(&mut self, addr: u64, len: usize, device: bool) -> Result<Region> {
        let got = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .acquire(&*self.verbs, addr, len, device);
        got.map_err(|e| self.protocol(format!("registering {len} bytes: {e}")))
            .map_err(|e| self.fail(e))
    }

    /// Gives a registration back to the cache.
    fn release(&self, region: &Region) {
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .release(&*self.verbs, region);
    }

    /// Registered scratch of at least `len` bytes.
    fn scratch(&mut self, len: usize) -> Result<Remote> {
        if self.scratch.as_ref().is_none_or(|s| s.region.len < len) {
            if let Some(old) = self.scratch.take() {
                self.verbs.deregister(&old.region);
            }
            let s = Owned::new(&*self.verbs, len)
                .map_err(|e| self.protocol(format!("registering {len} bytes of scratch: {e}")))
                .map_err(|e| self.fail(e))?;
            self.scratch = Some(s);
        }
        let s = self.scratch.as_ref().map(|s| s.region);
        let region = s.ok_or_else(|| Error::Internal("scratch vanished".into()))?;
        Ok(Remote {
            addr: region.addr,
            rkey: region.rkey,
        })
    }

    fn header_in(&mut self, slot: usize, len: usize) -> Result<FrameHeader> {
        if len < HEADER_LEN {
            let e = self.protocol(format!("message of {len} bytes has no header"));
            return Err(self.fail(e));
        }
        let bytes = self.ring.bytes(slot * self.cfg.slot_bytes, HEADER_LEN);
        FrameHeader::decode(bytes)
            .map_err(|m| self.protocol(m))
            .map_err(|e| self.fail(e))
    }

    /// Tells the peer that this side gives up, best effort, and fails the
    /// pair for later operations.
    pub fn abort(&mut self, notice: &AbortNotice) {
        // A pair failed only by this side's cancelled receive still reaches
        // the peer, which must learn why (the rank that failed first).
        // A peer that said bye is not there to read it.
        if (self.error.is_none() || self.cancelled) && !self.peer_closed {
            self.cancelled = false;
            let mut bytes = notice.encode();
            bytes.truncate(self.cfg.slot_bytes);
            let _ = self.progress();
            let _ = if self.can_post_slot() {
                self.post_slot(ABORT, &[&bytes])
            } else {
                self.post_bare(ABORT)
            };
        }
        let e = self.lost("this rank aborted the link".into());
        self.fail(e);
    }
}

impl<V: Verbs> Drop for Peer<V> {
    fn drop(&mut self) {
        self.verbs.deregister(&self.ring.region);
        self.verbs.deregister(&self.staging.region);
        if let Some(s) = &self.scratch {
            self.verbs.deregister(&s.region);
        }
    }
}
