//! `Communicator`: a group of ranks and every collective over it.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use ccl_algorithms::{
    tuner, Action, Algorithm, BufId, Builder, Call, Choice, IoBuffers, Links, Region, Schedule,
    Spec, Tuner,
};
use ccl_core::{
    op, work_pair, CollectiveKind, DataType, Element, Error, Fingerprint, Link, ReduceOp, Result,
    Spin, Store, Work,
};
use ccl_rendezvous::{
    config::TransportChoice, Config, FileStore, HashStore, PrefixStore, Rendezvous, TcpStore,
};
use ccl_transport_tcp::{connect_mesh, route_to, TcpOptions};

use crate::{
    board::BoardCall,
    engine::{Buffers, Engine, Job, Plan},
};

/// Largest piece one send or receive moves; larger buffers are pipelined in pieces.
const PIECE_BYTES: usize = 512 * 1024;
/// The same when every peer is reached through shared memory: each piece costs
/// a hand-shake between the two processes (measured on a 2-core VM: 4 MiB
/// pieces give 256 MiB allreduce 1.2–1.3× the bus bandwidth of 512 KiB ones).
const SHM_PIECE_BYTES: usize = 4 << 20;
/// Allreduces up to this size use recursive doubling (log2 n rounds); larger ones the ring.
const SMALL_ALLREDUCE_BYTES: usize = 64 * 1024;
/// Largest call that the board runs where the tuning table is silent.
const DEFAULT_BOARD_BYTES: u64 = 16 * 1024;
/// Schedules kept per communicator for repeated calls.
const SCHEDULE_CACHE: usize = 64;

/// How a communicator connects, beyond rank, size and store.
#[derive(Clone, Debug)]
pub struct Options {
    /// Deadline of every wait (set-up and each call).
    pub timeout: Duration,
    /// TCP sockets per peer.
    pub nsocks: usize,
    /// Network interface whose address links use.
    pub interface: Option<String>,
    /// Local address links use when no interface is named (default: loopback).
    pub local_ip: Option<std::net::IpAddr>,
    /// Algorithm overrides, as `CCL_ALGO` spells them: `ring`, or
    /// `allreduce=rd,broadcast=tree`. `None`: chosen by size.
    pub algo: Option<String>,
    /// How long a thread waiting for a peer polls before it sleeps
    /// (`CCL_SPIN_US`). Polling saves the kernel's wake-up on small messages
    /// but takes a CPU. `None`: [`Spin::OWN_CPU_WINDOW`] when this host's
    /// ranks have a CPU each (counted over the CPUs they may run on, so
    /// ranks pinned one to a core count as such), [`Spin::SHARED_CPU_WINDOW`]
    /// when they outnumber them, and then they also yield between polls.
    pub spin_window: Option<Duration>,
    /// Which transport links use: shared memory between ranks of one host
    /// and TCP between hosts (`Auto`), or one of them for every pair.
    pub transport: TransportChoice,
    /// Shared memory per pair of ranks on one host.
    pub shm_bytes: usize,
    /// Let shared-memory links read peers' memory directly (`CCL_SHM_CMA`).
    pub shm_cma: bool,
    /// Ranks with equal host ids may share memory (`None`: detected).
    pub host_id: Option<String>,
    /// The job secret (`CCL_JOB_SECRET`): TCP links prove it to each other
    /// and it goes into the communicator id. `None`: unauthenticated.
    pub secret: Option<ccl_core::JobSecret>,
    /// Check every collective's arguments across ranks first (`CCL_DEBUG_CHECKS`).
    pub debug_checks: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            timeout: ccl_core::DEFAULT_TIMEOUT,
            nsocks: 1,
            interface: None,
            local_ip: None,
            algo: None,
            spin_window: None,
            transport: TransportChoice::Auto,
            shm_bytes: ccl_rendezvous::config::DEFAULT_SHM_BYTES,
            shm_cma: true,
            host_id: None,
            secret: None,
            debug_checks: false,
        }
    }
}

/// Parses `CCL_ALGO`: one algorithm for every collective that has it, or
/// `kind=algorithm` pairs separated by commas.
fn parse_algo(spec: &str) -> Result<HashMap<CollectiveKind, Choice>> {
    let bad = |m: String| Error::Config(format!("CCL_ALGO={spec:?}: {m}"));
    let mut map = HashMap::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('=') {
            Some((kind, algo)) => {
                let kind: CollectiveKind = kind.trim().parse().map_err(bad)?;
                let algo: Choice = algo.trim().parse().map_err(bad)?;
                if !algo.algorithm.implements(kind) {
                    return Err(bad(format!("{} does not implement {kind}", algo.algorithm)));
                }
                map.insert(kind, algo);
            }
            None => {
                let algo: Choice = part.parse().map_err(bad)?;
                let kinds: Vec<CollectiveKind> = CollectiveKind::ALL
                    .into_iter()
                    .filter(|&k| algo.algorithm.implements(k))
                    .collect();
                if kinds.is_empty() {
                    return Err(bad(format!("{algo} implements no collective")));
                }
                map.extend(kinds.into_iter().map(|k| (k, algo)));
            }
        }
    }
    Ok(map)
}

impl Options {
    /// The knobs of a [`Config`] read from the environment.
    pub fn from_config(config: &Config) -> Options {
        let local_ip = match &config.rendezvous {
            Rendezvous::Tcp { host, port, .. } => route_to(host, *port),
            _ => None,
        };
        Options {
            timeout: config.timeout,
            nsocks: config.nsocks,
            interface: config.socket_ifname.clone(),
            local_ip,
            algo: config.algo.clone(),
            spin_window: config.spin,
            transport: config.transport,
            shm_bytes: config.shm_bytes,
            shm_cma: config.shm_cma,
            host_id: config.host_id.clone(),
            secret: config.job_secret.clone(),
            debug_checks: config.debug_checks,
        }
    }
}

/// Logs the first fallback from shared memory to TCP in this process.
static SHM_FALLBACK_LOGGED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The other ranks on this rank's host, and how a waiting thread polls.
///
/// Every rank publishes its host identity and the CPUs it may run on. Ranks
/// with equal identities share a host; they outnumber its CPUs when there
/// are more of them than CPUs in the union of their sets (ranks pinned one
/// to a CPU each do not, four ranks on two CPUs do).
fn host_mates(
    rank: usize,
    world_size: usize,
    store: &dyn Store,
    options: &Options,
) -> Result<(Vec<usize>, Spin)> {
    let host = options
        .host_id
        .clone()
        .unwrap_or_else(ccl_transport_shm::host_id);
    let mine = ccl_core::allowed_cpus().unwrap_or_default();
    let mut cpus: std::collections::BTreeSet<usize> = mine.iter().copied().collect();
    if world_size > 1 {
        let list: Vec<String> = mine.iter().map(usize::to_string).collect();
        store.set(&format!("host/{rank}"), host.as_bytes())?;
        store.set(&format!("cpus/{rank}"), list.join(",").as_bytes())?;
    }
    let deadline = Instant::now() + options.timeout;
    let mut local = Vec::new();
    for p in (0..world_size).filter(|&p| p != rank) {
        let left = || deadline.saturating_duration_since(Instant::now());
        let theirs = store.get(&format!("host/{p}"), left())?;
        if theirs == host.as_bytes() {
            local.push(p);
            let list = store.get(&format!("cpus/{p}"), left())?;
            cpus.extend(
                String::from_utf8_lossy(&list)
                    .split(',')
                    .filter_map(|c| c.parse::<usize>().ok()),
            );
        } else if options.transport == TransportChoice::Shm {
            return Err(Error::Config(format!(
                "CCL_TRANSPORT=shm, but rank {p} is on another host than rank {rank} ({} and {host})",
                String::from_utf8_lossy(&theirs)
            )));
        }
    }
    let (ranks, cpus) = (local.len() + 1, cpus.len().max(1));
    let spin = Spin::for_host(ranks, cpus, options.spin_window);
    tracing::info!(
        rank,
        "{ranks} ranks on this host, on {cpus} CPUs between them: {}, waits poll for {:?}",
        if spin.yield_between {
            "they share CPUs"
        } else {
            "a CPU each"
        },
        spin.window
    );
    Ok((local, spin))
}

/// Sets up shared-memory links to the peers on this host, `local` (as the
/// transport choice allows): one entry per rank, `None` where TCP is to be
/// used. A pair that cannot use shared memory falls back to TCP (logged
/// once), or fails the set-up if shared memory was required.
#[allow(clippy::too_many_arguments)]
fn connect_shared_memory(
    rank: usize,
    world_size: usize,
    comm: u64,
    store: &dyn Store,
    options: &Options,
    local: Vec<usize>,
    spin: Spin,
    runtime: &tokio::runtime::Runtime,
) -> Result<Vec<Option<Arc<dyn Link>>>> {
    let mut links: Vec<Option<Arc<dyn Link>>> = vec![None; world_size];
    if options.transport == TransportChoice::Tcp {
        return Ok(links);
    }
    let shm = ccl_transport_shm::ShmOptions {
        bytes: options.shm_bytes,
        cma: options.shm_cma,
        timeout: options.timeout,
        spin,
        ..Default::default()
    };
    let _runtime = runtime.enter();
    let results = ccl_transport_shm::connect(rank, comm, store, &local, &shm)?;
    for (p, result) in local.into_iter().zip(results) {
        match result {
            Ok(link) => links[p] = Some(link),
            Err(why) if options.transport == TransportChoice::Shm => {
                return Err(Error::Config(format!(
                    "CCL_TRANSPORT=shm, but rank {rank} cannot share memory with rank {p}: {why}"
                )))
            }
            Err(why) => {
                if !SHM_FALLBACK_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::warn!(
                        rank,
                        peer = p,
                        "shared memory unavailable, using TCP: {why}"
                    );
                }
            }
        }
    }
    Ok(links)
}

/// Fails clearly, before any link is made, if two processes claim `rank` or
/// the ranks disagree on the world size (instead of a timeout later).
/// Returns the rank whose process serves the store, if one does.
fn check_membership(
    rank: usize,
    world_size: usize,
    store: &dyn Store,
    timeout: Duration,
) -> Result<Option<usize>> {
    let claims = store.add(&format!("member/{rank}/claims"), 1)?;
    if claims > 1 {
        return Err(Error::Config(format!(
            "rank {rank} is claimed by {claims} processes (RANK or its equivalent is wrong)"
        )));
    }
    if store.served_here() {
        store.set("store-host", rank.to_string().as_bytes())?;
    }
    store.set(
        &format!("member/{rank}/world"),
        world_size.to_string().as_bytes(),
    )?;
    let deadline = Instant::now() + timeout;
    for r in (0..world_size).filter(|&r| r != rank) {
        let left = deadline.saturating_duration_since(Instant::now());
        let theirs = store.get(&format!("member/{r}/world"), left)?;
        if theirs != world_size.to_string().as_bytes() {
            return Err(Error::Config(format!(
                "rank {r} was started with world size {}, rank {rank} with {world_size}",
                String::from_utf8_lossy(&theirs)
            )));
        }
    }
    // Set, if at all, before its rank's world size, which every rank has read.
    Ok(store
        .try_get("store-host")?
        .and_then(|v| String::from_utf8(v).ok()?.parse().ok()))
}

/// The last step of set-up: every other rank tells rank 0 that it is done
/// with the store, and rank 0 waits for that. Rank 0 may host the store, so it
/// must not run ahead (and exit, say) while others still read their set-up keys.
fn finish_setup(
    rank: usize,
    world_size: usize,
    store: &dyn Store,
    timeout: Duration,
) -> Result<()> {
    if rank != 0 {
        return store.set(&format!("setup-done/{rank}"), b"");
    }
    let keys: Vec<String> = (1..world_size).map(|r| format!("setup-done/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    store.wait(&keys, timeout)
}

/// The board of a communicator whose ranks all share this host, or `None`
/// (logged once) if some rank cannot map it.
fn connect_board(
    rank: usize,
    world_size: usize,
    comm: u64,
    store: &dyn Store,
    options: &Options,
    spin: Spin,
) -> Result<Option<ccl_transport_shm::Board>> {
    let board = ccl_transport_shm::connect_board(
        rank,
        world_size,
        comm,
        store,
        std::path::Path::new(ccl_transport_shm::SHM_DIR),
        options.timeout,
        spin,
    )?;
    Ok(match board {
        Ok(b) => Some(b),
        Err(why) => {
            if !SHM_FALLBACK_LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    rank,
                    "shared-memory board unavailable, small collectives use the links: {why}"
                );
            }
            None
        }
    })
}

/// The store where the ranks of `config`'s job meet: for a TCP store at
/// `MASTER_ADDR:MASTER_PORT`, rank 0 serves it and the others connect, or,
/// with `CCL_STORE_EXTERNAL=1`, every rank connects to a store that someone
/// else serves (one that outlives jobs, say). Waits at most `timeout`.
pub fn rendezvous_store(config: &Config, timeout: Duration) -> Result<Arc<dyn Store>> {
    let secret = config.job_secret.as_ref();
    Ok(match &config.rendezvous {
        Rendezvous::Tcp {
            host,
            port,
            external: false,
        } if config.rank == 0 => {
            Arc::new(TcpStore::serve_with_secret(host, *port, timeout, secret)?)
        }
        Rendezvous::Tcp { host, port, .. } => {
            Arc::new(TcpStore::connect_with_secret(host, *port, timeout, secret)?)
        }
        Rendezvous::File(dir) => Arc::new(FileStore::new(dir)?),
        Rendezvous::Local => Arc::new(HashStore::new()),
    })
}

/// A communicator's id on the wire: a stable 64-bit hash (FNV-1a) of its
/// store prefix, mixed with a tag of the job secret so that two jobs differ.
fn comm_id(prefix: &str, secret: Option<&ccl_core::JobSecret>) -> u64 {
    let id = prefix.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    match secret {
        Some(s) => {
            let tag = ccl_rendezvous::auth::tag(s, prefix.as_bytes());
            id ^ u64::from_le_bytes([
                tag[0], tag[1], tag[2], tag[3], tag[4], tag[5], tag[6], tag[7],
            ])
        }
        None => id,
    }
}

/// What a cached schedule depends on besides the communicator: kind, algorithm, count, root, finalize.
type ScheduleKey = (CollectiveKind, Choice, usize, usize, bool);

/// One call's arguments, before they become a schedule.
#[derive(Clone, Copy, Debug)]
struct Request {
    kind: CollectiveKind,
    dtype: DataType,
    count: usize,
    op: ReduceOp,
    root: usize,
}

/// A group of ranks that run collectives together.
///
/// Calls run in the order they are issued on each rank, and every rank must
/// issue the same calls in the same order (as with NCCL and MPI). Blocking
/// methods borrow buffers; `i`-prefixed methods take ownership, return a
/// [`Work`] at once, and hand the buffers back when it completes.
/// A `Communicator` may be shared between threads.
pub struct Communicator {
    rank: usize,
    world_size: usize,
    store: Arc<dyn Store>,
    prefix: String,
    options: Options,
    engine: Option<Engine>,
    comm: u64,
    /// Collective sequence number; taken under `submit_lock` so that numbers follow queue order.
    seq: AtomicU64,
    submit_lock: Mutex<()>,
    /// Point-to-point sequence numbers per (peer, direction).
    p2p_seq: Mutex<HashMap<(usize, bool), u64>>,
    splits: AtomicU64,
    schedules: Mutex<HashMap<ScheduleKey, Arc<Schedule>>>,
    algo: HashMap<CollectiveKind, Choice>,
    /// Largest piece a schedule moves at once.
    piece_bytes: usize,
    /// The tuning table's lines for this world size and kind of links.
    tuned: Tuner,
    /// Deadline of each call from now on, in nanoseconds ([`Communicator::set_timeout`]).
    timeout_ns: AtomicU64,
    shm_peers: usize,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(rank {} of {}, '{}')",
            self.rank, self.world_size, self.prefix
        )
    }
}

impl Communicator {
    /// Joins the job described by the environment (torchrun, OpenMPI, PMI or
    /// Slurm variables, `MASTER_ADDR`/`MASTER_PORT` or `CCL_STORE_PATH`, and `CCL_*` knobs).
    pub fn from_env() -> Result<Communicator> {
        let config = Config::from_env()?;
        Communicator::from_config(&config)
    }

    /// Joins the job that `config` describes.
    pub fn from_config(config: &Config) -> Result<Communicator> {
        crate::init_tracing(config.debug.as_deref());
        let store = rendezvous_store(config, config.timeout)?;
        Communicator::new(
            config.rank,
            config.world_size,
            store,
            Options::from_config(config),
        )
    }

    /// Builds rank `rank` of a communicator of `world_size` ranks that meet through `store`.
    /// Every rank calls this; it returns once this rank is connected to all others.
    /// Calling it again on every rank with the same store (after a failure
    /// broke the previous communicator, say) builds a fresh communicator.
    pub fn new(
        rank: usize,
        world_size: usize,
        store: Arc<dyn Store>,
        options: Options,
    ) -> Result<Communicator> {
        // Each communicator built from one store gets keys of its own, so
        // that a new one (after a failure, say) meets no stale keys: the
        // k-th communicator a rank builds from the store uses `ccl.k`.
        let key = |r: usize| format!("ccl-incarnation/{r}");
        let k = store.add(&key(rank), 1)?;
        if k > 1 {
            // Every rank must be building its k-th one too.
            let deadline = Instant::now() + options.timeout;
            for r in (0..world_size).filter(|&r| r != rank) {
                let stuck = |theirs: String| {
                    Error::Config(format!(
                        "rank {rank} builds its communicator #{k} from this store, but rank {r} \
                         {theirs}: two processes claim rank {rank}, or the ranks build \
                         different numbers of communicators"
                    ))
                };
                loop {
                    let theirs = store
                        .add(&key(r), 0)
                        .map_err(|e| stuck(format!("could not be asked ({e})")))?;
                    if theirs >= k {
                        break;
                    }
                    if Instant::now() >= deadline {
                        return Err(stuck(format!("only #{theirs} after {:?}", options.timeout)));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        let prefix = match k {
            1 => "ccl".to_string(),
            k => format!("ccl.{k}"),
        };
        Communicator::with_prefix(rank, world_size, store, prefix, options)
    }

    fn with_prefix(
        rank: usize,
        world_size: usize,
        store: Arc<dyn Store>,
        prefix: String,
        options: Options,
    ) -> Result<Communicator> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not below world size {world_size}"
            )));
        }
        if options.nsocks == 0 {
            return Err(Error::InvalidArgument("nsocks must be at least 1".into()));
        }
        let algo = options
            .algo
            .as_deref()
            .map(parse_algo)
            .transpose()?
            .unwrap_or_default();
        let started = Instant::now();
        let comm = comm_id(&prefix, options.secret.as_ref());
        let scoped: Arc<dyn Store> = Arc::new(PrefixStore::new(store.clone(), prefix.clone()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::io("creating the I/O runtime", e))?;
        let tcp = TcpOptions {
            nsocks: options.nsocks,
            interface: options.interface.clone(),
            local_ip: options.local_ip,
            timeout: options.timeout,
            secret: options.secret.clone(),
        };
        let store_host = if world_size > 1 {
            check_membership(rank, world_size, &*scoped, options.timeout)?
        } else {
            None
        };
        let mut nshm = 0;
        // The TCP mesh first: its listening ports open as soon as the
        // membership check passes, whatever the host exchange waits for.
        let mut links = if world_size > 1 {
            runtime.block_on(connect_mesh(rank, world_size, comm, &*scoped, &tcp))?
        } else {
            vec![None]
        };
        let (local, spin) = host_mates(rank, world_size, &*scoped, &options)?;
        if world_size > 1 {
            let shm = connect_shared_memory(
                rank, world_size, comm, &*scoped, &options, local, spin, &runtime,
            )?;
            nshm = shm.iter().flatten().count();
            for (link, shm) in links.iter_mut().zip(shm) {
                if shm.is_some() {
                    *link = shm;
                }
            }
            tracing::info!(
                rank,
                world_size,
                prefix,
                "connected to {} peers ({nshm} through shared memory) in {:?}",
                world_size - 1,
                started.elapsed()
            );
        }
        let spin = Spin {
            repoll: world_size > 1 && nshm == world_size - 1,
            ..spin
        };
        let board = if spin.repoll {
            connect_board(rank, world_size, comm, &*scoped, &options, spin)?
        } else {
            None
        };
        if world_size > 1 {
            finish_setup(rank, world_size, &*scoped, options.timeout)?;
        }
        let engine = Engine::start(
            rank,
            runtime,
            links,
            (scoped, store_host),
            spin,
            board,
            options.debug_checks,
        )?;
        Ok(Communicator {
            timeout_ns: AtomicU64::new(options.timeout.as_nanos().min(u64::MAX as u128) as u64),
            rank,
            world_size,
            store,
            prefix,
            options,
            engine: Some(engine),
            comm,
            seq: AtomicU64::new(0),
            submit_lock: Mutex::new(()),
            p2p_seq: Mutex::new(HashMap::new()),
            splits: AtomicU64::new(0),
            schedules: Mutex::new(HashMap::new()),
            algo,
            shm_peers: nshm,
            tuned: Tuner::builtin().narrowed(
                world_size,
                if world_size > 1 && nshm == world_size - 1 {
                    Links::SharedMemory
                } else {
                    Links::Network
                },
            ),
            piece_bytes: if world_size > 1 && nshm == world_size - 1 {
                SHM_PIECE_BYTES
            } else {
                PIECE_BYTES
            },
        })
    }

    /// How many peers this rank reaches through shared memory (the rest through TCP).
    pub fn shared_memory_peers(&self) -> usize {
        self.shm_peers
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The error that broke this communicator, if a call failed.
    /// A broken communicator fails every call; build a new one to go on.
    pub fn broken(&self) -> Option<Error> {
        self.engine.as_ref().and_then(Engine::broken_cause)
    }

    /// Aborts the communicator, like `ncclCommAbort`: calls running or
    /// queued on it (from any thread) fail at once, every later call fails
    /// with [`Error::Broken`], and every peer is told, so that their calls on
    /// this communicator fail naming this rank instead of waiting for it.
    /// Build a new communicator (from the same store) to go on.
    pub fn abort(&self) {
        self.engine().abort();
    }

    /// Sets the deadline of every call issued from now on (the default is
    /// `Options::timeout`, `CCL_TIMEOUT`): a call still running when it
    /// passes fails with [`Error::Timeout`] naming the ranks it waited for,
    /// and breaks the communicator. Every rank should set the same value.
    pub fn set_timeout(&self, timeout: Duration) {
        let ns = timeout.as_nanos().min(u64::MAX as u128) as u64;
        self.timeout_ns.store(ns, Ordering::Relaxed);
    }

    /// The deadline of calls issued now.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    fn engine(&self) -> &Engine {
        self.engine
            .as_ref()
            .expect("engine lives as long as the communicator")
    }

    // ---- validation -------------------------------------------------------

    fn check_root(&self, root: usize, call: &str) -> Result<()> {
        if root >= self.world_size {
            return Err(Error::InvalidArgument(format!(
                "{call}: root {root} is not below world size {}",
                self.world_size
            )));
        }
        Ok(())
    }

    fn check_op(&self, op: ReduceOp, dtype: DataType, call: &str) -> Result<()> {
        op.validate(dtype).map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("{call}: {m}")),
            e => e,
        })
    }

    fn check_len(&self, call: &str, what: &str, got: usize, want: usize) -> Result<()> {
        if got != want {
            return Err(Error::InvalidArgument(format!(
                "{call} on rank {}: {what} has {got} elements, expected {want}",
                self.rank
            )));
        }
        Ok(())
    }

    fn split_count(&self, call: &str, len: usize) -> Result<usize> {
        if len % self.world_size != 0 {
            return Err(Error::InvalidArgument(format!(
                "{call} on rank {}: buffer of {len} elements does not divide into {} equal blocks",
                self.rank, self.world_size
            )));
        }
        Ok(len / self.world_size)
    }

    // ---- submission -------------------------------------------------------

    /// The algorithm a call of `kind` on `count` elements of `dtype` uses:
    /// the `CCL_ALGO` override if any; else what the tuning table measured
    /// best for this size, world size and kind of links; else the board for
    /// calls up to 16 KiB, board-direct for larger allreduces and reduces,
    /// where there is a board; recursive doubling for other small
    /// allreduces, and the first algorithm of every other collective. The
    /// board algorithms are only ever chosen where there is a board (every
    /// rank on this host).
    pub fn algorithm_for(&self, kind: CollectiveKind, count: usize, dtype: DataType) -> Algorithm {
        self.choice_for(kind, count, dtype).algorithm
    }

    /// [`Communicator::algorithm_for`] with the piece size the table or
    /// `CCL_ALGO` asked for (`ring/128K`); `None` is this communicator's
    /// default for its links.
    pub fn choice_for(&self, kind: CollectiveKind, count: usize, dtype: DataType) -> Choice {
        let has_board = self.engine().has_board();
        let can = |a: Algorithm| match a {
            Algorithm::Board | Algorithm::BoardDirect => has_board && a.implements(kind),
            _ => true,
        };
        let bytes = tuner::buffer_bytes(kind, count, dtype.size(), self.world_size);
        let chosen = match self.algo.get(&kind) {
            Some(&c) => Some(c),
            None => self.tuned.choose(kind, bytes),
        };
        if let Some(c) = chosen.filter(|c| can(c.algorithm)) {
            return c;
        }
        let algorithm = if bytes <= DEFAULT_BOARD_BYTES && can(Algorithm::Board) {
            Algorithm::Board
        } else if can(Algorithm::BoardDirect) && Algorithm::BoardDirect.implements(kind) {
            Algorithm::BoardDirect
        } else {
            match kind {
                CollectiveKind::AllReduce if count * dtype.size() <= SMALL_ALLREDUCE_BYTES => {
                    Algorithm::RecursiveDoubling
                }
                _ => Algorithm::for_kind(kind)
                    .first()
                    .copied()
                    .unwrap_or(Algorithm::Ring),
            }
        };
        algorithm.into()
    }

    fn schedule(&self, req: &Request, choice: Choice) -> Result<Arc<Schedule>> {
        let finalize = req.op == ReduceOp::Avg;
        let key = (req.kind, choice, req.count, req.root, finalize);
        let mut cache = self.schedules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = cache.get(&key) {
            return Ok(s.clone());
        }
        let spec = Spec {
            kind: req.kind,
            rank: self.rank,
            world_size: self.world_size,
            count: req.count,
            root: req.root,
            finalize,
            piece_elems: (choice.piece_bytes.unwrap_or(self.piece_bytes) / req.dtype.size()).max(1),
        };
        let schedule = Arc::new(spec.build(choice.algorithm).map_err(Error::Internal)?);
        if cache.len() >= SCHEDULE_CACHE {
            cache.clear();
        }
        cache.insert(key, schedule.clone());
        Ok(schedule)
    }

    fn fingerprint(req: &Request) -> Fingerprint {
        let fp = Fingerprint::new(req.kind, req.dtype, req.count).with_root(req.root);
        match req.kind {
            CollectiveKind::AllReduce | CollectiveKind::Reduce | CollectiveKind::ReduceScatter => {
                fp.with_op(req.op)
            }
            _ => fp,
        }
    }

    /// Runs (`inline`, when nothing is queued) or queues a collective; `done`
    /// gets the result once `io` is no longer touched.
    fn submit(
        &self,
        req: Request,
        io: IoBuffers<'static>,
        done: Box<dyn FnOnce(Result<()>) + Send>,
        inline: bool,
    ) {
        let choice = self.choice_for(req.kind, req.count, req.dtype);
        let plan = match Self::board_call(&req, choice) {
            Some(b) => Plan::Board(b),
            None => match self.schedule(&req, choice) {
                Ok(s) => Plan::Schedule(s),
                Err(e) => return done(Err(e)),
            },
        };
        self.enqueue(req, choice, plan, io, done, inline);
    }

    /// Takes the call's sequence number and hands the job to the engine.
    fn enqueue(
        &self,
        req: Request,
        choice: Choice,
        plan: Plan,
        io: IoBuffers<'static>,
        done: Box<dyn FnOnce(Result<()>) + Send>,
        inline: bool,
    ) {
        // Sequence numbers must follow execution order: keep the lock while
        // the job is queued (or, inline, runs).
        let _order = self.submit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let call = self.next_call(&req, choice);
        self.engine().submit(
            Job {
                plan,
                call,
                io,
                deadline: self.timeout(),
                lane: None,
                done,
            },
            inline,
        );
    }

    /// The board call `req` makes with `choice`, if a board algorithm.
    fn board_call(req: &Request, choice: Choice) -> Option<BoardCall> {
        matches!(choice.algorithm, Algorithm::Board | Algorithm::BoardDirect).then(|| BoardCall {
            kind: req.kind,
            dtype: req.dtype,
            count: req.count,
            op: req.op,
            root: req.root,
            direct: choice.algorithm == Algorithm::BoardDirect,
        })
    }

    /// Takes the next sequence number for `req` (under `submit_lock`) and
    /// logs the choice.
    fn next_call(&self, req: &Request, choice: Choice) -> Call {
        let call = Call {
            comm: self.comm,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            fingerprint: Self::fingerprint(req),
            rank: self.rank,
            world_size: self.world_size,
            op: req.op,
        };
        tracing::debug!(rank = self.rank, call = %call.name(), algorithm = %choice, "collective");
        call
    }

    /// Runs `req` on `io` and waits for it: a board call straight on this
    /// thread when the engine is idle, anything else as a job.
    fn run_blocking(&self, req: Request, io: IoBuffers<'_>) -> Result<()> {
        let choice = self.choice_for(req.kind, req.count, req.dtype);
        if let Some(board_call) = Self::board_call(&req, choice) {
            let _order = self.submit_lock.lock().unwrap_or_else(|p| p.into_inner());
            let call = || self.next_call(&req, choice);
            if let Some(result) =
                self.engine()
                    .run_board_now(&board_call, call, &io, self.timeout())
            {
                return result;
            }
        }
        self.run_borrowed(io, |io, done| self.submit(req, io, done, true))
    }

    /// Queues a point-to-point transfer (`send` true: to `peer`, else from `peer`).
    fn submit_p2p(
        &self,
        dtype: DataType,
        count: usize,
        peer: usize,
        send: bool,
        io: IoBuffers<'static>,
        done: Box<dyn FnOnce(Result<()>) + Send>,
    ) {
        let region = Region::new(if send { BufId::Input } else { BufId::Output }, 0, count);
        let mut b = Builder::new();
        b.push(if send {
            Action::Send { peer, src: region }
        } else {
            Action::Recv { peer, dst: region }
        });
        let schedule = Arc::new(b.finish());
        let _order = self.submit_lock.lock().unwrap_or_else(|p| p.into_inner());
        let seq = {
            let mut seqs = self.p2p_seq.lock().unwrap_or_else(|p| p.into_inner());
            let s = seqs.entry((peer, send)).or_insert(0);
            *s += 1;
            *s
        };
        let call = Call {
            comm: self.comm,
            seq,
            fingerprint: Fingerprint::new(CollectiveKind::SendRecv, dtype, count),
            rank: self.rank,
            world_size: self.world_size,
            op: ReduceOp::Sum,
        };
        self.engine().submit(
            Job {
                plan: Plan::Schedule(schedule),
                call,
                io,
                deadline: self.timeout(),
                lane: Some((peer, send)),
                done,
            },
            false,
        );
    }

    /// Runs a call on borrowed memory and waits for it.
    fn run_borrowed(
        &self,
        io: IoBuffers<'_>,
        start: impl FnOnce(IoBuffers<'static>, Box<dyn FnOnce(Result<()>) + Send>),
    ) -> Result<()> {
        let (work, completer) = work_pair::<()>();
        // SAFETY: the borrow outlives every access to it: we block below until
        // the engine reports completion, which it does only after the
        // execution touching `io` has finished or been dropped (every job has
        // a deadline; a job dropped unrun completes with an error).
        let io: IoBuffers<'static> =
            unsafe { std::mem::transmute::<IoBuffers<'_>, IoBuffers<'static>>(io) };
        start(io, Box::new(move |r| completer.complete(r)));
        work.wait()
    }

    fn blocking<T: Element>(
        &self,
        req: Request,
        input: Option<&[T]>,
        output: &mut [T],
    ) -> Result<()> {
        let out: &mut [u8] = bytemuck::cast_slice_mut(output);
        let io = match input {
            Some(i) => IoBuffers::separate(bytemuck::cast_slice(i), out),
            None => IoBuffers::in_place(out),
        };
        self.run_blocking(req, io)
    }

    /// Runs `req` with `input` (or in place) and `output` given as sub-slices of
    /// one buffer: `input_range` and `output_range` in elements of `buf`.
    fn blocking_within<T: Element>(
        &self,
        req: Request,
        buf: &mut [T],
        input_range: std::ops::Range<usize>,
        output_range: std::ops::Range<usize>,
    ) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        let s = T::DTYPE.size();
        let base = bytes.as_mut_ptr();
        // SAFETY: both ranges lie within `buf`, borrowed mutably for this call;
        // the schedules for these calls read the input part only before the
        // output part overlapping it is written (see ccl-algorithms' tests).
        let io = unsafe {
            IoBuffers::from_raw(
                base.add(input_range.start * s),
                input_range.len() * s,
                base.add(output_range.start * s),
                output_range.len() * s,
            )
        };
        self.run_blocking(req, io)
    }

    /// Pre-multiplies a copy of the input for `PreMulSum`; other ops need none.
    fn premultiplied<T: Element>(op: ReduceOp, input: &[T]) -> Result<Option<Vec<T>>> {
        if !matches!(op, ReduceOp::PreMulSum(_)) {
            return Ok(None);
        }
        let mut v = input.to_vec();
        op::prescale(op, T::DTYPE, bytemuck::cast_slice_mut(&mut v))?;
        Ok(Some(v))
    }

    fn req<T: Element>(kind: CollectiveKind, count: usize, op: ReduceOp, root: usize) -> Request {
        Request {
            kind,
            dtype: T::DTYPE,
            count,
            op,
            root,
        }
    }

    // ---- allreduce --------------------------------------------------------

    /// Reduces `buf` across all ranks, in place: every rank gets the result.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.check_op(op, T::DTYPE, "allreduce")?;
        let req = Self::req::<T>(CollectiveKind::AllReduce, buf.len(), op, 0);
        match Self::premultiplied(op, buf)? {
            Some(scaled) => self.blocking(req, Some(&scaled), buf),
            None => self.blocking(req, None, buf),
        }
    }

    /// Reduces `input` across all ranks into `output` (same length).
    pub fn allreduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_op(op, T::DTYPE, "allreduce")?;
        self.check_len("allreduce", "output", output.len(), input.len())?;
        let req = Self::req::<T>(CollectiveKind::AllReduce, input.len(), op, 0);
        match Self::premultiplied(op, input)? {
            Some(scaled) => self.blocking(req, Some(&scaled), output),
            None => self.blocking(req, Some(input), output),
        }
    }

    // ---- broadcast --------------------------------------------------------

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root, "broadcast")?;
        self.blocking(
            Self::req::<T>(CollectiveKind::Broadcast, buf.len(), ReduceOp::Sum, root),
            None,
            buf,
        )
    }

    /// Copies `root`'s `input` into every rank's `output`; `input` is read on the root only.
    pub fn broadcast_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "broadcast")?;
        let input = if self.rank == root {
            self.check_len("broadcast", "output", output.len(), input.len())?;
            input
        } else {
            &[]
        };
        self.blocking(
            Self::req::<T>(CollectiveKind::Broadcast, output.len(), ReduceOp::Sum, root),
            Some(input),
            output,
        )
    }

    // ---- reduce -----------------------------------------------------------

    /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' `buf` is left as it was.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root(root, "reduce")?;
        self.check_op(op, T::DTYPE, "reduce")?;
        let req = Self::req::<T>(CollectiveKind::Reduce, buf.len(), op, root);
        let scaled = Self::premultiplied(op, buf)?;
        if self.rank == root {
            return match scaled {
                Some(s) => self.blocking(req, Some(&s), buf),
                None => self.blocking(req, None, buf),
            };
        }
        let input = scaled.unwrap_or_else(|| buf.to_vec());
        self.blocking(req, Some(&input), &mut [])
    }

    /// Reduces every rank's `input` into `root`'s `output` (ignored on other ranks).
    pub fn reduce_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "reduce")?;
        self.check_op(op, T::DTYPE, "reduce")?;
        let req = Self::req::<T>(CollectiveKind::Reduce, input.len(), op, root);
        let output: &mut [T] = if self.rank == root {
            self.check_len("reduce", "output", output.len(), input.len())?;
            output
        } else {
            &mut []
        };
        match Self::premultiplied(op, input)? {
            Some(s) => self.blocking(req, Some(&s), output),
            None => self.blocking(req, Some(input), output),
        }
    }

    // ---- allgather --------------------------------------------------------

    /// Gathers every rank's `input` into `output` (world_size × input length), in rank order.
    pub fn allgather_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.check_len(
            "allgather",
            "output",
            output.len(),
            input.len() * self.world_size,
        )?;
        self.blocking(
            Self::req::<T>(CollectiveKind::AllGather, input.len(), ReduceOp::Sum, 0),
            Some(input),
            output,
        )
    }

    /// In-place allgather: `buf` holds world_size blocks, this rank's contribution in block `rank`.
    pub fn allgather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let c = self.split_count("allgather", buf.len())?;
        let req = Self::req::<T>(CollectiveKind::AllGather, c, ReduceOp::Sum, 0);
        let len = buf.len();
        self.blocking_within(req, buf, self.rank * c..(self.rank + 1) * c, 0..len)
    }

    // ---- reduce-scatter ---------------------------------------------------

    /// Reduces `input` (world_size blocks of `output`'s length) across ranks; block `rank` of the result lands in `output`.
    pub fn reduce_scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_op(op, T::DTYPE, "reduce-scatter")?;
        self.check_len(
            "reduce-scatter",
            "input",
            input.len(),
            output.len() * self.world_size,
        )?;
        let req = Self::req::<T>(CollectiveKind::ReduceScatter, output.len(), op, 0);
        match Self::premultiplied(op, input)? {
            Some(s) => self.blocking(req, Some(&s), output),
            None => self.blocking(req, Some(input), output),
        }
    }

    /// In-place reduce-scatter: `buf` holds world_size blocks; block `rank` receives this rank's share of the result.
    pub fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.check_op(op, T::DTYPE, "reduce-scatter")?;
        let c = self.split_count("reduce-scatter", buf.len())?;
        let req = Self::req::<T>(CollectiveKind::ReduceScatter, c, op, 0);
        let mine = self.rank * c..(self.rank + 1) * c;
        match Self::premultiplied(op, buf)? {
            Some(s) => self.blocking(req, Some(&s), &mut buf[mine]),
            None => {
                let len = buf.len();
                self.blocking_within(req, buf, 0..len, mine)
            }
        }
    }

    // ---- all-to-all -------------------------------------------------------

    /// Sends block p of `input` to rank p; block p of `output` comes from rank p.
    pub fn alltoall_into<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.check_len("alltoall", "output", output.len(), input.len())?;
        let c = self.split_count("alltoall", input.len())?;
        self.blocking(
            Self::req::<T>(CollectiveKind::AllToAll, c, ReduceOp::Sum, 0),
            Some(input),
            output,
        )
    }

    /// In-place all-to-all on world_size blocks.
    pub fn alltoall<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let c = self.split_count("alltoall", buf.len())?;
        self.blocking(
            Self::req::<T>(CollectiveKind::AllToAll, c, ReduceOp::Sum, 0),
            None,
            buf,
        )
    }

    // ---- gather / scatter -------------------------------------------------

    /// Gathers every rank's `input` into `root`'s `output` (world_size × input length; ignored elsewhere).
    pub fn gather_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "gather")?;
        let output: &mut [T] = if self.rank == root {
            self.check_len(
                "gather",
                "output",
                output.len(),
                input.len() * self.world_size,
            )?;
            output
        } else {
            &mut []
        };
        self.blocking(
            Self::req::<T>(CollectiveKind::Gather, input.len(), ReduceOp::Sum, root),
            Some(input),
            output,
        )
    }

    /// In-place gather: on the root `buf` holds world_size blocks with the root's own in block `root`;
    /// elsewhere `buf` is this rank's contribution.
    pub fn gather<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root, "gather")?;
        if self.rank != root {
            return self.blocking(
                Self::req::<T>(CollectiveKind::Gather, buf.len(), ReduceOp::Sum, root),
                Some(buf),
                &mut [],
            );
        }
        let c = self.split_count("gather", buf.len())?;
        let len = buf.len();
        self.blocking_within(
            Self::req::<T>(CollectiveKind::Gather, c, ReduceOp::Sum, root),
            buf,
            root * c..(root + 1) * c,
            0..len,
        )
    }

    /// Sends block p of `root`'s `input` (world_size × output length; ignored elsewhere) to rank p's `output`.
    pub fn scatter_into<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root(root, "scatter")?;
        let input: &[T] = if self.rank == root {
            self.check_len(
                "scatter",
                "input",
                input.len(),
                output.len() * self.world_size,
            )?;
            input
        } else {
            &[]
        };
        self.blocking(
            Self::req::<T>(CollectiveKind::Scatter, output.len(), ReduceOp::Sum, root),
            Some(input),
            output,
        )
    }

    /// In-place scatter: on the root `buf` holds world_size blocks and keeps block `root`;
    /// elsewhere `buf` receives this rank's block.
    pub fn scatter<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root, "scatter")?;
        if self.rank != root {
            return self.blocking(
                Self::req::<T>(CollectiveKind::Scatter, buf.len(), ReduceOp::Sum, root),
                Some(&[]),
                buf,
            );
        }
        let c = self.split_count("scatter", buf.len())?;
        let len = buf.len();
        self.blocking_within(
            Self::req::<T>(CollectiveKind::Scatter, c, ReduceOp::Sum, root),
            buf,
            0..len,
            root * c..(root + 1) * c,
        )
    }

    // ---- barrier ----------------------------------------------------------

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.blocking::<u8>(
            Self::req::<u8>(CollectiveKind::Barrier, 0, ReduceOp::Sum, 0),
            None,
            &mut [],
        )
    }

    // ---- point to point ---------------------------------------------------

    fn check_peer(&self, peer: usize, call: &str) -> Result<()> {
        if peer >= self.world_size || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "{call} on rank {}: peer {peer} must be another rank below {}",
                self.rank, self.world_size
            )));
        }
        Ok(())
    }

    /// Sends `buf` to rank `dst`, which must call [`Communicator::recv`] with the same length.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.check_peer(dst, "send")?;
        let io = IoBuffers::separate(bytemuck::cast_slice(buf), &mut []);
        self.run_borrowed(io, |io, done| {
            self.submit_p2p(T::DTYPE, buf.len(), dst, true, io, done)
        })
    }

    /// Receives into `buf` from rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.check_peer(src, "recv")?;
        let n = buf.len();
        let io = IoBuffers::separate(&[], bytemuck::cast_slice_mut(buf));
        self.run_borrowed(io, |io, done| {
            self.submit_p2p(T::DTYPE, n, src, false, io, done)
        })
    }

    // ---- asynchronous forms -----------------------------------------------

    /// Queues a call on owned buffers; the `Work` yields `finish(input, output)`.
    fn launch<T: Element, R: Send + 'static>(
        &self,
        req: Request,
        input: Option<Vec<T>>,
        mut output: Vec<T>,
        finish: impl FnOnce(Option<Vec<T>>, Vec<T>) -> R + Send + 'static,
    ) -> Work<R> {
        let (work, completer) = work_pair::<R>();
        let out: &mut [u8] = bytemuck::cast_slice_mut(&mut output);
        let (out_ptr, out_len) = (out.as_mut_ptr(), out.len());
        let (in_ptr, in_len) = match &input {
            Some(i) => {
                let b: &[u8] = bytemuck::cast_slice(i);
                (b.as_ptr(), b.len())
            }
            None => (out_ptr as *const u8, out_len),
        };
        // SAFETY: the vectors' heap memory does not move when the vectors are
        // moved into the completion closure, which keeps them alive until the
        // engine is done with the buffers.
        let io = unsafe { IoBuffers::from_raw(in_ptr, in_len, out_ptr, out_len) };
        let done =
            Box::new(move |r: Result<()>| completer.complete(r.map(|()| finish(input, output))));
        self.submit(req, io, done, false);
        work
    }

    /// Asynchronous [`Communicator::allreduce`] on an owned buffer.
    pub fn iallreduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        if let Err(e) = self.check_op(op, T::DTYPE, "allreduce") {
            return Work::ready(Err(e));
        }
        let req = Self::req::<T>(CollectiveKind::AllReduce, buf.len(), op, 0);
        match Self::premultiplied(op, &buf) {
            Ok(scaled) => self.launch(req, scaled, buf, |_, out| out),
            Err(e) => Work::ready(Err(e)),
        }
    }

    /// Whether an allreduce of `count` elements of `dtype` runs on the board
    /// here, so that [`Communicator::iallreduce_on`] can take several buffers.
    pub(crate) fn allreduces_on_board(&self, count: usize, dtype: DataType) -> bool {
        let choice = self.choice_for(CollectiveKind::AllReduce, count, dtype);
        self.engine().has_board()
            && matches!(choice.algorithm, Algorithm::Board | Algorithm::BoardDirect)
    }

    /// Asynchronous in-place allreduce of `bufs` taken end to end as one
    /// buffer, with neither packing nor unpacking: board-direct reads and
    /// writes each buffer where it lies. For communicators where
    /// [`Communicator::allreduces_on_board`] holds; elsewhere it fails.
    pub(crate) fn iallreduce_on<T: Element>(
        &self,
        mut bufs: Vec<Vec<T>>,
        op: ReduceOp,
    ) -> Work<Vec<Vec<T>>> {
        let count = bufs.iter().map(Vec::len).sum();
        if let Err(e) = self.check_op(op, T::DTYPE, "allreduce") {
            return Work::ready(Err(e));
        }
        if !self.engine().has_board() {
            return Work::ready(Err(Error::Internal(
                "an allreduce on several buffers needs the shared-memory board".into(),
            )));
        }
        if matches!(op, ReduceOp::PreMulSum(_)) {
            // The buffers are the call's own: scale them where they lie.
            for b in &mut bufs {
                if let Err(e) = op::prescale(op, T::DTYPE, bytemuck::cast_slice_mut(b)) {
                    return Work::ready(Err(e));
                }
            }
        }
        let req = Self::req::<T>(CollectiveKind::AllReduce, count, op, 0);
        let board_call = BoardCall {
            kind: req.kind,
            dtype: req.dtype,
            count,
            op,
            root: 0,
            direct: true,
        };
        let buffers = Buffers(
            bufs.iter_mut()
                .map(|b| {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(b);
                    (bytes.as_mut_ptr(), bytes.len())
                })
                .collect(),
        );
        let (work, completer) = work_pair();
        // The vectors' heap memory does not move when the vectors move into
        // the completion, which keeps them alive until the engine is done.
        let done = Box::new(move |r: Result<()>| completer.complete(r.map(|()| bufs)));
        // SAFETY: an empty region; the job's memory is `buffers`.
        let io = unsafe { IoBuffers::from_raw(std::ptr::null(), 0, std::ptr::null_mut(), 0) };
        let plan = Plan::BoardOn(board_call, buffers);
        self.enqueue(req, Algorithm::BoardDirect.into(), plan, io, done, false);
        work
    }

    /// Asynchronous [`Communicator::broadcast`] on an owned buffer.
    pub fn ibroadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root, "broadcast") {
            return Work::ready(Err(e));
        }
        self.launch(
            Self::req::<T>(CollectiveKind::Broadcast, buf.len(), ReduceOp::Sum, root),
            None,
            buf,
            |_, out| out,
        )
    }

    /// Asynchronous reduce: the root gets the result; other ranks get their input back.
    pub fn ireduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self
            .check_root(root, "reduce")
            .and_then(|()| self.check_op(op, T::DTYPE, "reduce"))
        {
            return Work::ready(Err(e));
        }
        let req = Self::req::<T>(CollectiveKind::Reduce, buf.len(), op, root);
        let scaled = match Self::premultiplied(op, &buf) {
            Ok(s) => s,
            Err(e) => return Work::ready(Err(e)),
        };
        if self.rank == root {
            self.launch(req, scaled, buf, |_, out| out)
        } else {
            let input = scaled.unwrap_or_else(|| buf.clone());
            self.launch(req, Some(input), Vec::new(), move |_, _| buf)
        }
    }

    /// Asynchronous allgather: returns world_size × input length elements.
    pub fn iallgather<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let output = vec![T::zeroed(); input.len() * self.world_size];
        self.launch(
            Self::req::<T>(CollectiveKind::AllGather, input.len(), ReduceOp::Sum, 0),
            Some(input),
            output,
            |_, out| out,
        )
    }

    /// Asynchronous reduce-scatter: returns this rank's block of the reduced `input`.
    pub fn ireduce_scatter<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let checked = self
            .check_op(op, T::DTYPE, "reduce-scatter")
            .and_then(|()| self.split_count("reduce-scatter", input.len()));
        let c = match checked {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        let req = Self::req::<T>(CollectiveKind::ReduceScatter, c, op, 0);
        let input = match Self::premultiplied(op, &input) {
            Ok(s) => s.unwrap_or(input),
            Err(e) => return Work::ready(Err(e)),
        };
        self.launch(req, Some(input), vec![T::zeroed(); c], |_, out| out)
    }

    /// Asynchronous all-to-all: returns the received blocks.
    pub fn ialltoall<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let c = match self.split_count("alltoall", input.len()) {
            Ok(c) => c,
            Err(e) => return Work::ready(Err(e)),
        };
        let output = vec![T::zeroed(); input.len()];
        self.launch(
            Self::req::<T>(CollectiveKind::AllToAll, c, ReduceOp::Sum, 0),
            Some(input),
            output,
            |_, out| out,
        )
    }

    /// Asynchronous gather: the root gets world_size × input length elements, others an empty vector.
    pub fn igather<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root, "gather") {
            return Work::ready(Err(e));
        }
        let out_len = if self.rank == root {
            input.len() * self.world_size
        } else {
            0
        };
        let req = Self::req::<T>(CollectiveKind::Gather, input.len(), ReduceOp::Sum, root);
        self.launch(req, Some(input), vec![T::zeroed(); out_len], |_, out| out)
    }

    /// Asynchronous scatter of `count` elements per rank: `input` (world_size × count) is read on the root only.
    pub fn iscatter<T: Element>(&self, input: Vec<T>, count: usize, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root, "scatter") {
            return Work::ready(Err(e));
        }
        let input = if self.rank == root {
            if let Err(e) = self.check_len("scatter", "input", input.len(), count * self.world_size)
            {
                return Work::ready(Err(e));
            }
            input
        } else {
            Vec::new()
        };
        self.launch(
            Self::req::<T>(CollectiveKind::Scatter, count, ReduceOp::Sum, root),
            Some(input),
            vec![T::zeroed(); count],
            |_, out| out,
        )
    }

    /// Asynchronous barrier.
    pub fn ibarrier(&self) -> Work<()> {
        self.launch::<u8, ()>(
            Self::req::<u8>(CollectiveKind::Barrier, 0, ReduceOp::Sum, 0),
            None,
            Vec::new(),
            |_, _| (),
        )
    }

    /// Asynchronous send; the `Work` hands the buffer back.
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(dst, "send") {
            return Work::ready(Err(e));
        }
        let (work, completer) = work_pair();
        let bytes: &[u8] = bytemuck::cast_slice(&buf);
        // SAFETY: as in `launch`: `buf` moves into the closure, its heap memory stays put.
        let io = unsafe {
            IoBuffers::from_raw(
                bytes.as_ptr(),
                bytes.len(),
                std::ptr::NonNull::<u8>::dangling().as_ptr(),
                0,
            )
        };
        let n = buf.len();
        self.submit_p2p(
            T::DTYPE,
            n,
            dst,
            true,
            io,
            Box::new(move |r: Result<()>| completer.complete(r.map(|()| buf))),
        );
        work
    }

    /// Asynchronous receive into an owned buffer of the expected length.
    pub fn irecv<T: Element>(&self, mut buf: Vec<T>, src: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(src, "recv") {
            return Work::ready(Err(e));
        }
        let (work, completer) = work_pair();
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        // SAFETY: as in `launch`.
        let io = unsafe {
            IoBuffers::from_raw(
                std::ptr::NonNull::<u8>::dangling().as_ptr(),
                0,
                bytes.as_mut_ptr(),
                bytes.len(),
            )
        };
        let n = buf.len();
        self.submit_p2p(
            T::DTYPE,
            n,
            src,
            false,
            io,
            Box::new(move |r: Result<()>| completer.complete(r.map(|()| buf))),
        );
        work
    }

    // ---- sub-communicators ------------------------------------------------

    /// Splits this communicator (MPI_Comm_split): ranks passing the same
    /// `color` form a new communicator, ordered by `key` then by rank here.
    /// Ranks passing `None` take part but get `None` back. Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * self.world_size];
        self.allgather_into(&mine, &mut all)?;
        let split = self.splits.fetch_add(1, Ordering::Relaxed);
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..self.world_size)
            .filter(|&r| all[2 * r] == i64::from(color))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| {
                Error::Internal("this rank is missing from its own split group".into())
            })?;
        let prefix = format!("{}/split{split}/color{color}", self.prefix);
        Communicator::with_prefix(
            new_rank,
            members.len(),
            self.store.clone(),
            prefix,
            self.options.clone(),
        )
        .map(Some)
    }

    /// A sub-communicator of the listed ranks (torch's `new_group`), ordered as listed.
    /// Every rank must call it with the same list; ranks not listed get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.world_size) {
            return Err(Error::InvalidArgument(format!(
                "new_group: rank {bad} is not below world size {}",
                self.world_size
            )));
        }
        let position = ranks.iter().position(|&r| r == self.rank);
        self.split(position.map(|_| 0), position.unwrap_or(0) as i64)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Closing the queue lets the progress thread finish what is queued and exit.
        self.engine.take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_overrides() {
        let get = |m: &HashMap<CollectiveKind, Choice>, k| m.get(&k).map(|c| c.to_string());
        let m = parse_algo("ring").unwrap();
        assert_eq!(get(&m, CollectiveKind::AllReduce).as_deref(), Some("ring"));
        assert_eq!(get(&m, CollectiveKind::AllGather).as_deref(), Some("ring"));
        assert_eq!(get(&m, CollectiveKind::Broadcast), None);
        let m = parse_algo("allreduce=rd, broadcast=tree, allgather=ring/256K").unwrap();
        assert_eq!(get(&m, CollectiveKind::AllReduce).as_deref(), Some("rd"));
        assert_eq!(get(&m, CollectiveKind::Broadcast).as_deref(), Some("tree"));
        assert_eq!(
            m.get(&CollectiveKind::AllGather)
                .and_then(|c| c.piece_bytes),
            Some(256 << 10)
        );
        for bad in [
            "bogus",
            "allreduce=tree",
            "nothing=ring",
            "dissemination=ring",
            "allreduce=ring/0",
            "allreduce=board/1M",
        ] {
            assert!(matches!(parse_algo(bad), Err(Error::Config(_))), "{bad}");
        }
    }

    #[test]
    fn size_picks_the_allreduce_algorithm() {
        let comm = Communicator::new(0, 1, Arc::new(HashStore::new()), Options::default()).unwrap();
        assert_eq!(
            comm.algorithm_for(CollectiveKind::AllReduce, 2, DataType::F32),
            Algorithm::RecursiveDoubling
        );
        // Larger sizes take what the measured table says for the nearest
        // world size it has, over network links (one rank has no board).
        let big = 1usize << 20;
        let table = tuner::Tuner::builtin()
            .narrowed(1, Links::Network)
            .choose(
                CollectiveKind::AllReduce,
                tuner::buffer_bytes(CollectiveKind::AllReduce, big, 4, 1),
            )
            .expect("the table has allreduce over tcp");
        assert_ne!(table.algorithm, Algorithm::RecursiveDoubling);
        assert_eq!(
            comm.choice_for(CollectiveKind::AllReduce, big, DataType::F32),
            table
        );
        assert_eq!(
            comm.algorithm_for(CollectiveKind::Broadcast, 2, DataType::F32),
            Algorithm::BinomialTree
        );
        let forced = Options {
            algo: Some("allreduce=ring".into()),
            ..Options::default()
        };
        let comm = Communicator::new(0, 1, Arc::new(HashStore::new()), forced).unwrap();
        assert_eq!(
            comm.algorithm_for(CollectiveKind::AllReduce, 2, DataType::F32),
            Algorithm::Ring
        );
    }
}
