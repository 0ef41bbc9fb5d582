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
//! * **Completion channels** are named pipes (`wake-<pid>-<n>`). A queue
//!   pair's file says which channel is its own and whether it is armed; a
//!   write with immediate into an armed queue disarms it and writes a byte
//!   into that pipe, which wakes its owner. A queue with completions still
//!   held for the clock, or writes not yet completed, refuses to arm (they
//!   arrive only by polling), and so does every queue of a process not yet
//!   published as idle or with queues on another channel (another
//!   communicator, whose arrivals a sleeper would not count).
//! * **Faults** (`CCL_RDMA_SIM_FAULTS`, comma-separated): `reorder`
//!   interleaves write and receive completions at random (each queue stays
//!   in order, as in RC); `delay=N` holds every completion for N polls;
//!   `access-error-after=N` fails the N-th write with immediate of the
//!   NIC with a remote access error.
//! * **A clock** ([`modelled_ns`]): every write is stamped with when it
//!   would arrive on a modelled link of [`LINE_BYTES_PER_NS`] (100 Gbit/s)
//!   and [`LATENCY_NS`] (2 µs) latency, each queue pair's sends sharing one
//!   port. A completion is handed out only once the process's clock has
//!   reached its stamp (each queue in order). Computation and copies in
//!   memory cost nothing in the model.
//! * **The clocks agree** as in a conservative parallel discrete-event
//!   simulation. Each process publishes its clock in `clock-<pid>`. When
//!   every queue it polls has had nothing due for a few polls, its clock
//!   moves on to the earliest event it holds, but never past a connected
//!   peer's clock plus the latency: a write the peer has not posted yet
//!   arrives no earlier. Held there, the clock moves to that bound, and the
//!   poll waits a little for the peers to move. Processes that are all idle
//!   would hold each other in steps of the latency; so each also publishes
//!   whether it is idle, its next event, and how many writes with immediate
//!   it has put in queues and counted in its own. When a read of every
//!   connected process, taken twice the same, finds the counts even (nothing
//!   in flight), the bound is the earliest time any of them acts next plus
//!   the latency. A clock held for [`STALL_LIMIT`] of real time (a peer
//!   that stopped polling) moves on anyway, and once a peer's process is
//!   gone the clock runs free: the model can then only be pessimistic,
//!   never faster than the line.

use std::{
    collections::VecDeque,
    fs::{File, OpenOptions},
    io::{self, Read, Write as _},
    num::NonZeroUsize,
    os::{
        fd::{AsRawFd, RawFd},
        unix::fs::OpenOptionsExt,
    },
    path::{Path, PathBuf},
    ptr::NonNull,
    sync::{
        atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering},
        Arc, Mutex, OnceLock, Weak,
    },
    time::{Duration, Instant},
};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

use crate::verbs::{Channel, Completion, Endpoint, QueuePair, Region, Status, Verbs, Write};

/// Modelled line rate: 100 Gbit/s is 12.5 bytes per nanosecond.
pub const LINE_BYTES_PER_NS: f64 = 12.5;
/// Modelled one-way latency.
pub const LATENCY_NS: u64 = 2_000;
/// Modelled time until a write to a peer that stopped answering fails.
pub const RETRY_TIMEOUT_NS: u64 = 470_000_000;

const REGIONS: usize = 4096;
const CQ_LEN: usize = 16384;
const QP_HEAD: usize = 128;
const POSTED: usize = 0;
const TAKEN: usize = 1;
const CQ_HEAD: usize = 2;
const CQ_TAIL: usize = 3;
const CLOSED: usize = 4;
/// Completions this process has counted as arrived in the queue (its
/// `RECEIVED`), and the earliest stamp it holds taken in but not handed out.
const COUNTED: usize = 5;
const HELD_MIN: usize = 6;
/// Whether the owner sleeps until the next write with immediate arrives,
/// and the number of its completion channel.
const ARMED: usize = 7;
const CHANNEL: usize = 8;

/// This process's modelled clock, in nanoseconds, published for its peers
/// in `clock-<pid>` under the first fabric directory it opened.
static CLOCK_FILE: OnceLock<Map> = OnceLock::new();
/// The clock before any NIC is open (nothing moves it).
static CLOCK_UNPUBLISHED: AtomicU64 = AtomicU64::new(0);
/// Polls in a row that found nothing due, and the earliest event they saw.
static IDLE_POLLS: AtomicU32 = AtomicU32::new(0);
static NEXT_EVENT: AtomicU64 = AtomicU64::new(u64::MAX);
/// Empty polls after which the clock moves to the earliest event held (the
/// process has nothing due on any queue it waits on).
const IDLE_POLLS_BEFORE_JUMP: u32 = 8;
/// Real time a poll held back by peers' clocks waits for them to move.
const HELD_SPIN: Duration = Duration::from_micros(200);
/// Real time peers' clocks may hold this process's back before it moves on.
pub const STALL_LIMIT: Duration = Duration::from_millis(50);
/// Since when a peer's clock has held this process's clock back.
static STALLED_SINCE: Mutex<Option<Instant>> = Mutex::new(None);
/// Every connected queue pair of this process: its own file and the peer's side.
static PAIRS: Mutex<Vec<(Weak<Map>, Weak<RemoteQp>)>> = Mutex::new(Vec::new());
static NEXT_QPN: AtomicU32 = AtomicU32::new(1);

/// Words of a process's published clock file: its clock; a version, odd
/// while the words after it change; whether it is idle (polled with nothing
/// due) and its next event then; writes with immediate it has put in peers'
/// queues; completions it has taken from its own queues.
const CLOCK_WORD: usize = 0;
const VERSION: usize = 1;
const IDLE: usize = 2;
const NEXT: usize = 3;
const SENT: usize = 4;
const RECEIVED: usize = 5;
const CLOCK_FILE_LEN: usize = 64;

/// This process's clock word.
fn clock() -> &'static AtomicU64 {
    CLOCK_FILE
        .get()
        .map_or(&CLOCK_UNPUBLISHED, |m| m.word(CLOCK_WORD))
}

/// Changes this process's published state with `change` (between two
/// steps of its version, so that a reader sees all of it or none).
fn publish(change: impl FnOnce(&Map)) {
    static WRITER: Mutex<()> = Mutex::new(());
    let Some(m) = CLOCK_FILE.get() else {
        return;
    };
    let _one_writer = WRITER.lock().unwrap_or_else(|p| p.into_inner());
    let v = m.word(VERSION).load(Ordering::Relaxed);
    m.word(VERSION).store(v + 1, Ordering::Relaxed);
    fence(Ordering::Release);
    change(m);
    m.word(VERSION).store(v + 2, Ordering::Release);
}

/// Publishes that this process may act now (at its clock).
fn publish_busy() {
    if CLOCK_FILE
        .get()
        .is_some_and(|m| m.word(IDLE).load(Ordering::Relaxed) != 0)
    {
        publish(|m| m.word(IDLE).store(0, Ordering::Relaxed));
    }
}

/// Publishes that this process is idle until `next`, its next event.
fn publish_idle(next: u64) {
    if CLOCK_FILE.get().is_some_and(|m| {
        m.word(IDLE).load(Ordering::Relaxed) == 0 || m.word(NEXT).load(Ordering::Relaxed) != next
    }) {
        publish(|m| {
            m.word(NEXT).store(next, Ordering::Relaxed);
            m.word(IDLE).store(1, Ordering::Relaxed);
        });
    }
}

/// A process's published state, read whole: `(version, clock, idle, next,
/// sent, received)`, or `None` while it changes.
fn read_published(m: &Map) -> Option<(u64, u64, bool, u64, u64, u64)> {
    let v = m.word(VERSION).load(Ordering::Acquire);
    if v % 2 == 1 {
        return None;
    }
    let w = |i: usize| m.word(i).load(Ordering::Relaxed);
    let state = (
        v,
        w(CLOCK_WORD),
        w(IDLE) != 0,
        w(NEXT),
        w(SENT),
        w(RECEIVED),
    );
    fence(Ordering::Acquire);
    (m.word(VERSION).load(Ordering::Relaxed) == v).then_some(state)
}

/// Moves this process's clock to `t` if that is later.
fn advance(t: u64) {
    clock().fetch_max(t, Ordering::AcqRel);
}

/// The modelled time of this process (see the module docs).
pub fn modelled_ns() -> u64 {
    clock().load(Ordering::Acquire)
}

/// The latest time this process's clock may reach without passing what a
/// live peer could still send, and the earliest completion that peers have
/// already put in this process's queues but no poll has taken yet. The
/// peers' clocks are read first: a write a peer posted before its clock
/// reached the value read is then in the queue read after.
fn conservative_bound() -> (u64, u64) {
    let live = live_pairs();
    let mut bound = u64::MAX;
    for (own, remote) in &live {
        let Some(peer_clock) = holding_back(own, remote) else {
            continue;
        };
        if FREE_RUNNING.load(Ordering::Relaxed) {
            continue;
        }
        let t = peer_clock.word(CLOCK_WORD).load(Ordering::Acquire);
        bound = bound.min(t.saturating_add(LATENCY_NS));
    }
    let mut pending = u64::MAX;
    for (own, _) in &live {
        let head = count_arrived(own);
        let tail = own.word(CQ_TAIL).load(Ordering::Relaxed);
        if tail < head {
            let e = QP_HEAD / 8 + (tail as usize % CQ_LEN) * 4;
            pending = pending.min(own.word(e + 1).load(Ordering::Relaxed));
        }
        pending = pending.min(own.word(HELD_MIN).load(Ordering::Relaxed));
    }
    (bound, pending)
}

/// The pairs of this process whose queue pairs both still exist (the
/// others are forgotten).
fn live_pairs() -> Vec<(Arc<Map>, Arc<RemoteQp>)> {
    let mut pairs = PAIRS.lock().unwrap_or_else(|p| p.into_inner());
    pairs.retain(|(own, remote)| own.strong_count() > 0 && remote.strong_count() > 0);
    pairs
        .iter()
        .filter_map(|(own, remote)| Some((own.upgrade()?, remote.upgrade()?)))
        .collect()
}

/// The published clock of the peer of pair (`own`, `remote`) if that peer
/// can hold this process's clock back: another process, whose clock is
/// known, with neither side of the pair closed.
fn holding_back<'a>(own: &Map, remote: &'a RemoteQp) -> Option<&'a Map> {
    let open = own.word(CLOSED).load(Ordering::Acquire) == 0
        && remote.qp.word(CLOSED).load(Ordering::Acquire) == 0;
    let other = remote.pid != std::process::id() as i32;
    remote.clock.as_ref().filter(|_| open && other)
}

/// Counts in `RECEIVED` the completions that reached queue `qp` since it
/// was last counted (the writer counted each in its `SENT` before); its head.
fn count_arrived(qp: &Map) -> u64 {
    let head = qp.word(CQ_HEAD).load(Ordering::Acquire);
    let before = qp.word(COUNTED).fetch_max(head, Ordering::AcqRel);
    if head > before {
        publish(|m| {
            m.word(RECEIVED).fetch_add(head - before, Ordering::Relaxed);
            m.word(IDLE).store(0, Ordering::Relaxed);
        });
    }
    head
}

/// When every connected process is idle or its clock is known and no write
/// with immediate is in flight between them (what they put in queues
/// equals what they took), read twice the same so that all of it held at
/// one instant: the earliest that any of them can act, plus the latency.
/// An idle process acts next at its next event or on a completion from
/// another, so this is the time before which none can reach this process,
/// even when each holds the others' clocks back (see the module docs).
fn snapshot_bound() -> Option<u64> {
    let own = CLOCK_FILE.get()?;
    let mut peers: Vec<Arc<RemoteQp>> = Vec::new();
    for (o, r) in live_pairs() {
        if holding_back(&o, &r).is_some() && !peers.iter().any(|p| p.pid == r.pid) {
            peers.push(r);
        }
    }
    let maps: Vec<&Map> = std::iter::once(own)
        .chain(peers.iter().filter_map(|p| p.clock.as_ref()))
        .collect();
    let first: Vec<_> = maps
        .iter()
        .map(|m| read_published(m))
        .collect::<Option<_>>()?;
    let same = maps
        .iter()
        .zip(&first)
        .all(|(m, f)| m.word(VERSION).load(Ordering::Acquire) == f.0);
    let (sent, received) = first
        .iter()
        .fold((0u64, 0u64), |(s, r), f| (s + f.4, r + f.5));
    if !same || sent != received {
        return None;
    }
    first[1..]
        .iter()
        .map(|&(_, clock, idle, next, _, _)| if idle { next.max(clock) } else { clock })
        .min()
        .map(|t| t.saturating_add(LATENCY_NS))
}

/// Whether a peer of this process was found gone: its clock then runs free
/// (a job that lost a rank is failing; its timing no longer matters, and the
/// survivors' counts of what is in flight no longer add up).
static FREE_RUNNING: AtomicBool = AtomicBool::new(false);

/// Lets this process's clock run free if a peer's process is gone.
fn check_for_gone_peers() {
    let pairs = PAIRS.lock().unwrap_or_else(|p| p.into_inner());
    if pairs
        .iter()
        .filter_map(|(_, r)| r.upgrade())
        .any(|r| !alive(r.pid))
    {
        FREE_RUNNING.store(true, Ordering::Relaxed);
    }
}

/// Whether peers' clocks have held this process's next event back for
/// longer than [`STALL_LIMIT`] (`held`: they hold it now; otherwise the
/// count starts again).
fn stalled_too_long(held: bool) -> bool {
    let mut since = STALLED_SINCE.lock().unwrap_or_else(|p| p.into_inner());
    if !held {
        *since = None;
        return false;
    }
    since.get_or_insert_with(Instant::now).elapsed() > STALL_LIMIT
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
        publish_clock(dir)?;
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

/// Creates this process's published clock under `dir`, once.
fn publish_clock(dir: &Path) -> Result<(), String> {
    static CREATING: Mutex<()> = Mutex::new(());
    let _guard = CREATING.lock().unwrap_or_else(|p| p.into_inner());
    if CLOCK_FILE.get().is_none() {
        let path = dir.join(format!("clock-{}", std::process::id()));
        let map = Map::create(&path, CLOCK_FILE_LEN)
            .map_err(|e| format!("simulated fabric: {}: {e}", path.display()))?;
        map.word(CLOCK_WORD)
            .store(CLOCK_UNPUBLISHED.load(Ordering::Relaxed), Ordering::Release);
        let _ = CLOCK_FILE.set(map);
    }
    Ok(())
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
    type Channel = SimChannel;

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

    /// The simulated NIC moves bytes by address in the processes' memory, so
    /// it takes GPU memory only where that is host memory posing as a GPU's
    /// (ccl's CUDA stand-in, `CCL_CUDA_STAND_IN=1`), which is how the tests
    /// run GPUDirect transfers here.
    fn device_memory(&self) -> Result<(), String> {
        Ok(())
    }

    fn register_device(&self, addr: u64, len: usize) -> Result<Region, String> {
        self.register(addr, len)
    }

    /// Writes land wherever the address maps now, as with on-demand paging.
    fn follows_remaps(&self) -> bool {
        true
    }

    fn channel(&self) -> Result<SimChannel, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let number = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = self
            .0
            .dir
            .join(format!("wake-{}-{number}", std::process::id()));
        let failed =
            |e: &dyn std::fmt::Display| format!("simulated fabric: {}: {e}", path.display());
        nix::unistd::mkfifo(
            &path,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .map_err(|e| failed(&e))?;
        // Open for writing too, so that the pipe never reads as closed.
        let pipe = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| failed(&e));
        match pipe {
            Ok(pipe) => Ok(SimChannel { number, pipe, path }),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    fn queue_pair(&self, channel: &SimChannel) -> Result<SimQp, String> {
        let qpn = NEXT_QPN.fetch_add(1, Ordering::Relaxed);
        let path = self.0.dir.join(format!("qp-{}-{qpn}", std::process::id()));
        let file = Map::create(&path, QP_HEAD + CQ_LEN * 32)
            .map_err(|e| format!("simulated fabric: {}: {e}", path.display()))?;
        file.word(CHANNEL)
            .store(u64::from(channel.number), Ordering::Relaxed);
        Ok(SimQp {
            nic: self.0.clone(),
            qpn,
            file: Arc::new(file),
            remote: None,
            egress_free: 0,
            local: VecDeque::new(),
            held: VecDeque::new(),
            failed: false,
            rng: 0x9e37_79b9_7f4a_7c15 ^ u64::from(qpn),
        })
    }
}

/// A completion channel of the simulated fabric: a named pipe (see the
/// module docs), removed on drop.
pub struct SimChannel {
    number: u32,
    pipe: File,
    path: PathBuf,
}

impl AsRawFd for SimChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.pipe.as_raw_fd()
    }
}

impl Channel for SimChannel {
    fn drain(&self) {
        let mut buf = [0u8; 256];
        while matches!((&self.pipe).read(&mut buf), Ok(n) if n > 0) {}
    }
}

impl Drop for SimChannel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The peer's side, mapped.
struct RemoteQp {
    pid: i32,
    qp: Map,
    table: Map,
    /// The peer process's published clock (none if it published none).
    clock: Option<Map>,
    /// The pipe of the peer's completion channel, opened at its first notice.
    wake: OnceLock<Option<File>>,
    dir: PathBuf,
}

impl RemoteQp {
    /// Wakes the peer if it sleeps on this queue: called after a completion
    /// was put in it.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.qp.word(ARMED).swap(0, Ordering::SeqCst) == 0 {
            return;
        }
        let channel = self.qp.word(CHANNEL).load(Ordering::Relaxed);
        let pipe = self.wake.get_or_init(|| {
            // Read-write, so that the pipe never lacks a reader: a write after
            // its owner exited fills it instead of raising SIGPIPE.
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(self.dir.join(format!("wake-{}-{channel}", self.pid)))
                .ok()
        });
        // A full pipe is readable already; a closed one has no sleeper.
        if let Some(mut pipe) = pipe.as_ref() {
            let _ = pipe.write(&[1]);
        }
    }
}

/// A simulated RC queue pair (see the module docs).
pub struct SimQp {
    nic: Arc<NicInner>,
    qpn: u32,
    file: Arc<Map>,
    remote: Option<Arc<RemoteQp>>,
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
        let now = clock().load(Ordering::Acquire);
        let wire = (len as f64 / LINE_BYTES_PER_NS).ceil() as u64;
        let done = (*egress_free).max(now) + wire;
        *egress_free = done;
        (done + LATENCY_NS, done + 2 * LATENCY_NS)
    }

    /// Carries out a write; its status and when the writer learns it (a
    /// failure too is known only after a round trip).
    fn execute(&mut self, w: &Write) -> (Status, u64) {
        let (status, stamp) = self.attempt(w);
        let now = clock().load(Ordering::Acquire);
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
        if w.len == 0 && !alive(remote.pid) {
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
            // Counted before it can arrive, so that the count of what the
            // processes sent never trails the count of what arrived.
            publish(|m| {
                m.word(SENT).fetch_add(1, Ordering::Relaxed);
            });
            let head = remote.qp.word(CQ_HEAD).load(Ordering::Relaxed);
            let e = QP_HEAD / 8 + (head as usize % CQ_LEN) * 4;
            remote
                .qp
                .word(e)
                .store(u64::from(imm) << 32 | w.len as u64, Ordering::Relaxed);
            remote.qp.word(e + 1).store(arrival, Ordering::Relaxed);
            remote.qp.word(CQ_HEAD).store(head + 1, Ordering::Release);
            remote.notify();
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
        let remote = Arc::new(RemoteQp {
            pid: pid as i32,
            qp: open(&qp_path, QP_HEAD + CQ_LEN * 32)?,
            table: open(&nic_path, REGIONS * 32)?,
            clock: Map::open(&self.nic.dir.join(format!("clock-{pid}")), CLOCK_FILE_LEN).ok(),
            wake: OnceLock::new(),
            dir: self.nic.dir.clone(),
        });
        PAIRS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((Arc::downgrade(&self.file), Arc::downgrade(&remote)));
        self.remote = Some(remote);
        Ok(())
    }

    fn post_write(&mut self, write: &Write) -> Result<(), String> {
        publish_busy();
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
        if self.local.len() == 1
            && !self
                .held
                .iter()
                .any(|h| matches!(h.0, Completion::Write { .. }))
        {
            // The first write completion waiting here.
            self.file.word(HELD_MIN).fetch_min(stamp, Ordering::Relaxed);
        }
        Ok(())
    }

    fn post_recv(&mut self) -> Result<(), String> {
        self.file.word(POSTED).fetch_add(1, Ordering::Release);
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        self.take(out);
        // Each queue hands out in order: what comes first in each.
        let first = |write: bool| {
            self.held
                .iter()
                .find(|h| matches!(h.0, Completion::Write { .. }) == write)
                .map_or(u64::MAX, |h| h.1)
        };
        let held_min = first(true).min(first(false));
        self.file.word(HELD_MIN).store(held_min, Ordering::Relaxed);
    }

    fn arm(&mut self) -> bool {
        let arrived = || {
            self.file.word(CQ_HEAD).load(Ordering::SeqCst)
                != self.file.word(CQ_TAIL).load(Ordering::Relaxed)
        };
        // Only a process its peers see as idle may sleep: their clocks then
        // need no poll of its own to move on (see the module docs).
        let idle = CLOCK_FILE
            .get()
            .is_none_or(|m| m.word(IDLE).load(Ordering::Acquire) != 0);
        if !idle
            || !self.local.is_empty()
            || !self.held.is_empty()
            || arrived()
            || self.other_channels()
        {
            return false;
        }
        self.file.word(ARMED).store(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Nothing arrived before the writer could see the queue armed.
        !arrived()
    }
}

impl SimQp {
    /// Whether this process has live queue pairs to other processes on
    /// another channel (another communicator): a sleeper would not count
    /// what reaches them, and those processes' clocks would wait for that
    /// count (see the module docs).
    fn other_channels(&self) -> bool {
        let (mine, me) = (
            self.file.word(CHANNEL).load(Ordering::Relaxed),
            std::process::id() as i32,
        );
        live_pairs().iter().any(|(own, remote)| {
            remote.pid != me && own.word(CHANNEL).load(Ordering::Relaxed) != mine
        })
    }

    /// Takes in what arrived and hands out what the clock has reached.
    fn take(&mut self, out: &mut Vec<Completion>) {
        let head = count_arrived(&self.file);
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
        let now = clock().load(Ordering::Acquire);
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
            }
            if IDLE_POLLS.fetch_add(1, Ordering::Relaxed) + 1 >= IDLE_POLLS_BEFORE_JUMP {
                // Every queue this process polled had nothing due.
                IDLE_POLLS.store(0, Ordering::Relaxed);
                if self.move_clock(now) {
                    return self.take(out);
                }
            }
            return;
        }
        IDLE_POLLS.store(0, Ordering::Relaxed);
        NEXT_EVENT.store(u64::MAX, Ordering::Relaxed);
        stalled_too_long(false);
        publish_busy();
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
            advance(stamp);
            out.push(c);
        }
    }
}

impl SimQp {
    /// Moves the clock, which stands at `now` with nothing due, to the
    /// earliest event this process holds, within the conservative bound (see
    /// the module docs); whether it moved to an event.
    fn move_clock(&self, now: u64) -> bool {
        let spinning = Instant::now();
        let mut now = now;
        loop {
            let (bound, elsewhere) = conservative_bound();
            let own = NEXT_EVENT.load(Ordering::Relaxed);
            publish_idle(own.min(elsewhere));
            // Something already due on a queue that nobody polls now waits
            // for its poll; it does not stop the clock.
            let event = if elsewhere > now {
                own.min(elsewhere)
            } else {
                own
            };
            let mut held = event != u64::MAX && event > bound;
            let bound = match held.then(snapshot_bound).flatten() {
                Some(b) => {
                    held = event > b;
                    b.max(bound)
                }
                None => bound,
            };
            if event != u64::MAX && (!held || stalled_too_long(true)) {
                if held {
                    check_for_gone_peers();
                    stalled_too_long(false);
                }
                NEXT_EVENT.store(u64::MAX, Ordering::Relaxed);
                advance(event);
                return true;
            }
            if !held {
                stalled_too_long(false);
            }
            if bound != u64::MAX && bound > now {
                advance(bound);
                now = bound;
            }
            if !held || spinning.elapsed() > HELD_SPIN {
                if held {
                    IDLE_POLLS.store(IDLE_POLLS_BEFORE_JUMP - 1, Ordering::Relaxed);
                }
                return false;
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for SimQp {
    fn drop(&mut self) {
        self.file.word(CLOSED).store(1, Ordering::Release);
        // What reached it counts as arrived, so that the processes' counts
        // of what is in flight stay even.
        count_arrived(&self.file);
    }
}
