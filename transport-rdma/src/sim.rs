//! A simulated RDMA fabric: a **test double** for hardware that no machine
//! of this project has. It implements [`Verbs`] between processes of one
//! host so that the protocol core, the links and every collective run, and
//! fail, across real processes without a NIC. It is chosen only by
//! `CCL_RDMA_SIM=<dir>` and never stands in for a device in production.
//!
//! How it stands in for the hardware:
//!
//! * **Registered memory** is a table per process in a file under `<dir>`
//!   (`nic-<pid>`: address, length and a generation per key). A write whose
//!   key is unknown, stale or too short fails with a remote access error, as
//!   a NIC would refuse it.
//! * **The wire** is cross-memory attach: the writing process copies from its
//!   registered memory straight into the peer's (`process_vm_writev`), the
//!   one copy a NIC's DMA makes.
//! * **Queue pairs** are files (`qp-<pid>-<qpn>`) holding the count of
//!   posted receives and a completion ring that the peer's writes with
//!   immediate fill. A write with immediate and no receive posted waits,
//!   then fails with receiver-not-ready, as RC's RNR retries do.
//! * **A lost peer**: a write to a process that is gone, or to a queue pair
//!   that was destroyed or went into the error state (which drops what
//!   arrives, as hardware does), fails with retry-exceeded; after an error
//!   every later work request is flushed.
//! * **Faults** (`CCL_RDMA_SIM_FAULTS`, comma-separated): `reorder`
//!   interleaves write and receive completions at random (each queue stays
//!   in order, as in RC); `delay=N` holds every completion for N polls;
//!   `access-error-after=N` fails the N-th write with immediate of the
//!   NIC with a remote access error.
//! * **A clock** ([`modelled_ns`]): every write is stamped with when it
//!   would arrive on a modelled link of [`LINE_BYTES_PER_NS`] (100 Gbit/s)
//!   and [`LATENCY_NS`] (2 µs) latency, each queue pair's sends sharing one
//!   port. A completion is handed out only once the process's clock has
//!   reached its stamp (each queue in order); when every queue the process
//!   polls has nothing due, the clock moves on to the earliest event it
//!   holds. Computation and copies in memory cost nothing in the model.
//!   The processes' clocks are not synchronised: a peer that posts a write
//!   later in real time than its modelled time may find the receiver's
//!   clock already past it, which makes the model pessimistic, never
//!   faster than the line.

use std::{
    collections::VecDeque,
    fs::OpenOptions,
    io,
    num::NonZeroUsize,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    ptr::NonNull,
    sync::{
        atomic::{AtomicU32, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use crate::verbs::{Completion, Endpoint, QueuePair, Region, Status, Verbs, Write};

/// Modelled line rate: 100 Gbit/s is 12.5 bytes per nanosecond.
pub const LINE_BYTES_PER_NS: f64 = 12.5;
/// Modelled one-way latency.
pub const LATENCY_NS: u64 = 2_000;
/// Modelled time until a write to a peer that stopped answering fails.
pub const RETRY_TIMEOUT_NS: u64 = 470_000_000;

const REGIONS: usize = 4096;
const CQ_LEN: usize = 16384;
const QP_HEAD: usize = 64;
const POSTED: usize = 0;
const TAKEN: usize = 1;
const CQ_HEAD: usize = 2;
const CQ_TAIL: usize = 3;
const CLOSED: usize = 4;

/// This process's modelled clock, in nanoseconds.
static CLOCK: AtomicU64 = AtomicU64::new(0);
/// Polls in a row that found nothing due, and the earliest event they saw.
static IDLE_POLLS: AtomicU32 = AtomicU32::new(0);
static NEXT_EVENT: AtomicU64 = AtomicU64::new(u64::MAX);
/// Empty polls after which the clock moves to the earliest event held (the
/// process has nothing due on any queue it waits on).
const IDLE_POLLS_BEFORE_JUMP: u32 = 8;
static NEXT_QPN: AtomicU32 = AtomicU32::new(1);

/// The modelled time of this process (see the module docs).
pub fn modelled_ns() -> u64 {
    CLOCK.load(Ordering::Relaxed)
}

/// A file mapped shared, of u64 words.
struct Map {
    ptr: NonNull<std::ffi::c_void>,
    len: usize,
    /// Removed on drop (the owner's files).
    owned: Option<PathBuf>,
}

// SAFETY: shared memory accessed through atomics only.
unsafe impl Send for Map {}
unsafe impl Sync for Map {}

impl Map {
    fn create(path: &Path, len: usize) -> io::Result<Map> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(len as u64)?;
        let mut m = Map::of_file(&file, len)?;
        m.owned = Some(path.to_path_buf());
        Ok(m)
    }

    fn open(path: &Path, len: usize) -> io::Result<Map> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} is not {len} bytes", path.display()),
            ));
        }
        Map::of_file(&file, len)
    }

    fn of_file(file: &std::fs::File, len: usize) -> io::Result<Map> {
        let size = NonZeroUsize::new(len).ok_or(io::ErrorKind::InvalidInput)?;
        // SAFETY: a fresh shared mapping of a whole file.
        let ptr = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                file,
                0,
            )
        }?;
        Ok(Map {
            ptr,
            len,
            owned: None,
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i * 8 + 8 <= self.len);
        // SAFETY: in bounds, page-aligned base, so 8-aligned.
        unsafe { &*(self.ptr.as_ptr() as *const AtomicU64).add(i) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: our mapping, unmapped once.
        let _ = unsafe { munmap(self.ptr, self.len) };
        if let Some(p) = &self.owned {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Which faults the fabric injects (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    pub reorder: bool,
    pub delay: u32,
    pub access_error_after: Option<u64>,
}

impl Faults {
    /// Parses `reorder,delay=N,access-error-after=N` (empty: none).
    pub fn parse(spec: &str) -> Result<Faults, String> {
        let mut f = Faults::default();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').unwrap_or((item, ""));
            let num = || {
                v.parse::<u64>()
                    .map_err(|_| format!("CCL_RDMA_SIM_FAULTS: {item:?} needs a number"))
            };
            match k {
                "reorder" => f.reorder = true,
                "delay" => f.delay = num()? as u32,
                "access-error-after" => f.access_error_after = Some(num()?),
                _ => return Err(format!("CCL_RDMA_SIM_FAULTS: unknown fault {item:?}")),
            }
        }
        Ok(f)
    }
}

/// This process's simulated NIC (see the module docs).
pub struct SimNic(Arc<NicInner>);

struct NicInner {
    dir: PathBuf,
    /// Its number in this process (its table is `nic-<pid>-<number>`).
    number: u32,
    table: Map,
    alloc: Mutex<()>,
    faults: Faults,
    /// Writes with immediate posted (for `access-error-after`).
    imm_writes: AtomicU64,
}

impl SimNic {
    /// The NIC of this process on the fabric in `dir` (a directory every
    /// rank of the job can reach).
    pub fn open(dir: &Path, faults: Faults) -> Result<SimNic, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let number = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("nic-{}-{number}", std::process::id()));
        let table = Map::create(&path, REGIONS * 32)
            .map_err(|e| format!("simulated fabric: {}: {e}", path.display()))?;
        Ok(SimNic(Arc::new(NicInner {
            dir: dir.to_path_buf(),
            number,
            table,
            alloc: Mutex::new(()),
            faults,
            imm_writes: AtomicU64::new(0),
        })))
    }
}

/// Whether `rkey` lets a peer write `[addr, addr + len)` of the memory
/// registered in `table`.
fn allows(table: &Map, rkey: u32, addr: u64, len: usize) -> bool {
    let i = (rkey & 0xfff) as usize;
    let state = table.word(i * 4).load(Ordering::Acquire);
    let (start, size) = (
        table.word(i * 4 + 1).load(Ordering::Relaxed),
        table.word(i * 4 + 2).load(Ordering::Relaxed),
    );
    state & 1 == 1
        && (state >> 1) as u32 & 0xfffff == rkey >> 12
        && table.word(i * 4).load(Ordering::Acquire) == state
        && addr >= start
        && addr.saturating_add(len as u64) <= start + size
}

impl Verbs for SimNic {
    type Qp = SimQp;

    fn name(&self) -> String {
        format!("sim:{}", self.0.dir.display())
    }

    fn register(&self, addr: u64, len: usize) -> Result<Region, String> {
        let nic = &self.0;
        let _guard = nic.alloc.lock().unwrap_or_else(|p| p.into_inner());
        let i = (0..REGIONS)
            .find(|&i| nic.table.word(i * 4).load(Ordering::Relaxed) & 1 == 0)
            .ok_or("simulated NIC: every memory key is in use")?;
        let generation = (nic.table.word(i * 4).load(Ordering::Relaxed) >> 1) + 1;
        nic.table.word(i * 4 + 1).store(addr, Ordering::Relaxed);
        nic.table
            .word(i * 4 + 2)
            .store(len as u64, Ordering::Relaxed);
        nic.table
            .word(i * 4)
            .store(generation << 1 | 1, Ordering::Release);
        let key = ((generation as u32 & 0xfffff) << 12) | i as u32;
        Ok(Region {
            addr,
            len,
            lkey: key,
            rkey: key,
        })
    }

    fn deregister(&self, region: &Region) {
        let i = (region.rkey & 0xfff) as usize;
        let w = self.0.table.word(i * 4);
        let state = w.load(Ordering::Relaxed);
        if state & 1 == 1 && (state >> 1) as u32 & 0xfffff == region.rkey >> 12 {
            w.store(state & !1, Ordering::Release);
        }
    }

    /// Writes land wherever the address maps now, as with on-demand paging.
    fn follows_remaps(&self) -> bool {
        true
    }

    fn queue_pair(&self) -> Result<SimQp, String> {
        let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed);
        let path = self.0.dir.join(format!("qp-{}-{qpn}", std::process::id()));
        let file = Map::create(&path, QP_HEAD + CQ_LEN * 32)
            .map_err(|e| format!("simulated fabric: {}: {e}", path.display()))?;
        Ok(SimQp {
            nic: self.0.clone(),
            qpn,
            file,
            remote: None,
            egress_free: 0,
            local: VecDeque::new(),
            held: VecDeque::new(),
            failed: false,
            rng: 0x9e37_79b9_7f4a_7c15 ^ u64::from(qpn),
        })
    }
}

/// The peer's side, mapped.
struct RemoteQp {
    pid: i32,
    qp: Map,
    table: Map,
}

/// A simulated RC queue pair (see the module docs).
pub struct SimQp {
    nic: Arc<NicInner>,
    qpn: u32,
    file: Map,
    remote: Option<RemoteQp>,
    /// When this queue pair's path is free again, in modelled time.
    egress_free: u64,
    local: VecDeque<(Completion, u64)>,
    held: VecDeque<(Completion, u64, u32)>,
    failed: bool,
    rng: u64,
}

/// Whether process `pid` is alive (neither gone nor a zombie).
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit(')')
                .next()
                .and_then(|s| s.split_whitespace().next()),
            Some("Z" | "X")
        ),
        Err(_) => false,
    }
}

impl SimQp {
    /// Modelled (arrival at the peer, acknowledgement here) of `len` bytes sent now.
    fn model(egress_free: &mut u64, len: usize) -> (u64, u64) {
        let now = CLOCK.load(Ordering::Relaxed);
        let wire = (len as f64 / LINE_BYTES_PER_NS).ceil() as u64;
        let done = (*egress_free).max(now) + wire;
        *egress_free = done;
        (done + LATENCY_NS, done + 2 * LATENCY_NS)
    }

    /// Carries out a write; its status and when the writer learns it (a
    /// failure too is known only after a round trip).
    fn execute(&mut self, w: &Write) -> (Status, u64) {
        let (status, stamp) = self.attempt(w);
        let now = CLOCK.load(Ordering::Relaxed);
        match status {
            Status::Success => (status, stamp),
            // A NIC gives up on a peer that stopped answering only after its
            // retries (the glue sets 7 of about 67 ms each).
            Status::RetryExceeded => (status, now + RETRY_TIMEOUT_NS),
            _ => (status, now + 2 * LATENCY_NS),
        }
    }

    /// Carries out a write; its status and, on success, its modelled acknowledgement.
    fn attempt(&mut self, w: &Write) -> (Status, u64) {
        let Some(remote) = self.remote.as_ref() else {
            return (Status::Other("queue pair is not connected".into()), 0);
        };
        if remote.qp.word(CLOSED).load(Ordering::Acquire) != 0 {
            return (Status::RetryExceeded, 0);
        }
        if w.len == 0 && w.imm.is_none() && !alive(remote.pid) {
            return (Status::RetryExceeded, 0);
        }
        if w.imm.is_some() {
            let n = self.nic.imm_writes.fetch_add(1, Ordering::Relaxed) + 1;
            if self.nic.faults.access_error_after == Some(n) {
                return (Status::RemoteAccess, 0);
            }
        }
        if w.len > 0 {
            if !allows(&remote.table, w.remote.rkey, w.remote.addr, w.len) {
                return (Status::RemoteAccess, 0);
            }
            let mut done = 0;
            while done < w.len {
                let local = [io::IoSlice::new(
                    // SAFETY: the protocol posts writes from memory it registered and keeps.
                    unsafe {
                        std::slice::from_raw_parts(
                            (w.addr as usize + done) as *const u8,
                            w.len - done,
                        )
                    },
                )];
                let far = [nix::sys::uio::RemoteIoVec {
                    base: w.remote.addr as usize + done,
                    len: w.len - done,
                }];
                match nix::sys::uio::process_vm_writev(
                    nix::unistd::Pid::from_raw(remote.pid),
                    &local,
                    &far,
                ) {
                    Ok(0) | Err(_) if !alive(remote.pid) => return (Status::RetryExceeded, 0),
                    Ok(0) => return (Status::Other("simulated DMA wrote nothing".into()), 0),
                    Ok(n) => done += n,
                    Err(e) => return (Status::Other(format!("simulated DMA failed: {e}")), 0),
                }
            }
        }
        let (arrival, ack) = SimQp::model(&mut self.egress_free, w.len);
        if let Some(imm) = w.imm {
            let started = Instant::now();
            while remote.qp.word(TAKEN).load(Ordering::Relaxed)
                >= remote.qp.word(POSTED).load(Ordering::Acquire)
            {
                if started.elapsed() > Duration::from_secs(2) || !alive(remote.pid) {
                    return (Status::RnrRetryExceeded, 0);
                }
                std::thread::yield_now();
            }
            remote.qp.word(TAKEN).fetch_add(1, Ordering::Relaxed);
            let head = remote.qp.word(CQ_HEAD).load(Ordering::Relaxed);
            let e = QP_HEAD / 8 + (head as usize % CQ_LEN) * 4;
            remote
                .qp
                .word(e)
                .store(u64::from(imm) << 32 | w.len as u64, Ordering::Relaxed);
            remote.qp.word(e + 1).store(arrival, Ordering::Relaxed);
            remote.qp.word(CQ_HEAD).store(head + 1, Ordering::Release);
        }
        (Status::Success, ack)
    }

    fn random(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }
}

impl QueuePair for SimQp {
    fn endpoint(&self) -> Endpoint {
        let mut gid = [0u8; 16];
        gid[..4].copy_from_slice(&std::process::id().to_le_bytes());
        gid[4..8].copy_from_slice(&self.nic.number.to_le_bytes());
        Endpoint {
            qpn: self.qpn,
            lid: 0,
            gid,
            psn: self.qpn.wrapping_mul(0x9e37_79b1) & 0xff_ffff,
            mtu: 4096,
        }
    }

    fn connect(&mut self, remote: &Endpoint) -> Result<(), String> {
        let pid = u32::from_le_bytes([remote.gid[0], remote.gid[1], remote.gid[2], remote.gid[3]]);
        let nic = u32::from_le_bytes([remote.gid[4], remote.gid[5], remote.gid[6], remote.gid[7]]);
        let qp_path = self.nic.dir.join(format!("qp-{pid}-{}", remote.qpn));
        let nic_path = self.nic.dir.join(format!("nic-{pid}-{nic}"));
        let open = |p: &Path, len| {
            Map::open(p, len).map_err(|e| format!("simulated fabric: {}: {e}", p.display()))
        };
        self.remote = Some(RemoteQp {
            pid: pid as i32,
            qp: open(&qp_path, QP_HEAD + CQ_LEN * 32)?,
            table: open(&nic_path, REGIONS * 32)?,
        });
        Ok(())
    }

    fn post_write(&mut self, write: &Write) -> Result<(), String> {
        let (status, stamp) = if self.failed {
            (Status::Flushed, 0)
        } else {
            self.execute(write)
        };
        if status != Status::Success && !self.failed {
            self.failed = true;
            self.file.word(CLOSED).store(1, Ordering::Release);
        }
        self.local.push_back((
            Completion::Write {
                id: write.id,
                status,
            },
            stamp,
        ));
        Ok(())
    }

    fn post_recv(&mut self) -> Result<(), String> {
        self.file.word(POSTED).fetch_add(1, Ordering::Release);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        let head = self.file.word(CQ_HEAD).load(Ordering::Acquire);
        let mut tail = self.file.word(CQ_TAIL).load(Ordering::Relaxed);
        let mut fresh: Vec<(Completion, u64)> = self.local.drain(..).collect();
        while tail < head {
            let e = QP_HEAD / 8 + (tail as usize % CQ_LEN) * 4;
            let word = self.file.word(e).load(Ordering::Relaxed);
            let stamp = self.file.word(e + 1).load(Ordering::Relaxed);
            fresh.push((
                Completion::Recv {
                    imm: (word >> 32) as u32,
                    len: (word & 0xffff_ffff) as usize,
                    status: Status::Success,
                },
                stamp,
            ));
            tail += 1;
        }
        self.file.word(CQ_TAIL).store(tail, Ordering::Relaxed);
        let delay = self.nic.faults.delay;
        self.held
            .extend(fresh.into_iter().map(|(c, s)| (c, s, delay)));
        // What the modelled clock has reached, each queue in order.
        let now = CLOCK.load(Ordering::Relaxed);
        let mut out_now: Vec<(Completion, u64)> = Vec::new();
        let mut kept = VecDeque::new();
        let (mut writes_wait, mut recvs_wait) = (false, false);
        for (c, stamp, polls) in self.held.drain(..) {
            let wait = match c {
                Completion::Write { .. } => &mut writes_wait,
                Completion::Recv { .. } => &mut recvs_wait,
            };
            if !*wait && polls == 0 && stamp <= now {
                out_now.push((c, stamp));
            } else {
                *wait = true;
                kept.push_back((c, stamp, polls.saturating_sub(1)));
            }
        }
        self.held = kept;
        if out_now.is_empty() {
            // The next event of each queue, once its delay is over.
            let first = |write: bool| {
                self.held
                    .iter()
                    .find(|h| matches!(h.0, Completion::Write { .. }) == write)
                    .filter(|h| h.2 == 0)
                    .map(|h| h.1)
            };
            if let Some(next) = first(true).into_iter().chain(first(false)).min() {
                NEXT_EVENT.fetch_min(next, Ordering::Relaxed);
                if IDLE_POLLS.fetch_add(1, Ordering::Relaxed) + 1 >= IDLE_POLLS_BEFORE_JUMP {
                    // Every queue this process polled had nothing due: its
                    // clock moves on to the earliest event it holds.
                    IDLE_POLLS.store(0, Ordering::Relaxed);
                    CLOCK.fetch_max(
                        NEXT_EVENT.swap(u64::MAX, Ordering::Relaxed),
                        Ordering::Relaxed,
                    );
                    return self.poll(out);
                }
            }
            return;
        }
        IDLE_POLLS.store(0, Ordering::Relaxed);
        NEXT_EVENT.store(u64::MAX, Ordering::Relaxed);
        if self.nic.faults.reorder {
            let (mut writes, mut recvs): (VecDeque<_>, VecDeque<_>) = out_now
                .drain(..)
                .partition(|(c, _)| matches!(c, Completion::Write { .. }));
            while !writes.is_empty() || !recvs.is_empty() {
                let pick_write = recvs.is_empty() || (!writes.is_empty() && self.random() & 1 == 0);
                let next = if pick_write {
                    writes.pop_front()
                } else {
                    recvs.pop_front()
                };
                out_now.extend(next);
            }
        }
        for (c, stamp) in out_now {
            CLOCK.fetch_max(stamp, Ordering::Relaxed);
            out.push(c);
        }
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        self.file.word(CLOSED).store(1, Ordering::Release);
    }
}
