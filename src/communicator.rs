//! [`Communicator`]: a group of ranks, how it is built (from the
//! environment, a store, or by splitting another), and what it tells about
//! itself. Its calls are in `call.rs` (untyped) and `api.rs` (typed).

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use ccl_algorithms::{Algorithm, Choice, Overrides, Table, Tuner};
use ccl_core::{Collective, CollectiveKind, DataType, Error, Result, Setup, Store};
use ccl_rendezvous::{Config, PrefixStore};

use crate::{
    bootstrap, engine::Engine, rendezvous_store, selection::Selection, Options, Transports,
};

/// A group of ranks that run collectives together.
///
/// Calls run in the order they are issued on each rank, and every rank must
/// issue the same calls in the same order (as with NCCL and MPI). Blocking
/// methods borrow buffers; `i`-prefixed methods take ownership, return a
/// [`Work`](crate::Work) at once, and hand the buffers back when it completes.
/// A `Communicator` is a handle: clones share one communicator, which lives
/// until the last clone is dropped, and it may be used from any thread.
#[derive(Clone)]
pub struct Communicator {
    pub(crate) inner: Arc<Inner>,
}

/// The communicator behind the handles.
pub(crate) struct Inner {
    pub(crate) rank: usize,
    pub(crate) world_size: usize,
    /// This rank's index among the ranks of its host, and how many they are.
    host_rank: usize,
    host_size: usize,
    /// The store it was built from (unscoped), for sub-communicators.
    store: Arc<dyn Store>,
    prefix: String,
    pub(crate) options: Options,
    /// The communicator's id on the wire.
    pub(crate) comm: u64,
    pub(crate) engine: Engine,
    pub(crate) selection: Selection,
    /// Collective sequence number; taken under the engine's queue lock, so
    /// that numbers follow queue order.
    pub(crate) seq: AtomicU64,
    /// Point-to-point sequence numbers per (peer, this rank sends).
    pub(crate) p2p_seq: Mutex<HashMap<(usize, bool), u64>>,
    splits: AtomicU64,
    /// Deadline of each call from now on, in nanoseconds ([`Communicator::set_timeout`]).
    timeout_ns: AtomicU64,
    /// The transports that link this rank to its peers, with how many peers each.
    used: Vec<(&'static str, usize)>,
    /// Pinned host staging for device calls, made at the first one.
    #[cfg(feature = "cuda")]
    pub(crate) staging: Mutex<Option<Arc<ccl_transport_cuda_ipc::staging::Staging>>>,
    /// Pinned host staging for device transfers, per (peer, this rank sends).
    #[cfg(feature = "cuda")]
    pub(crate) transfer_staging:
        Mutex<HashMap<(usize, bool), Arc<ccl_transport_cuda_ipc::staging::Staging>>>,
    /// The CUDA IPC group for device calls: `None` until the first one,
    /// then whether it is used.
    #[cfg(feature = "cuda")]
    pub(crate) ipc: Mutex<Option<Option<Arc<ccl_transport_cuda_ipc::ipc::IpcGroup>>>>,
    /// Per rank: whether the link to it takes GPU memory as it is
    /// (GPUDirect RDMA), so that device transfers skip staging.
    pub(crate) device_links: Vec<bool>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = &self.inner;
        write!(
            f,
            "Communicator(rank {} of {}, '{}')",
            i.rank, i.world_size, i.prefix
        )
    }
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u64::MAX as u128) as u64
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
        let options = Options::from_config(config)?;
        let store = rendezvous_store(config, config.timeout)?;
        Communicator::new(config.rank, config.world_size, store, options)
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
        let prefix = bootstrap::incarnation(rank, world_size, &*store, options.timeout)?;
        Communicator::with_prefix(rank, world_size, store, prefix, options)
    }

    /// Builds the communicator whose keys in `store` lie under `prefix`:
    /// membership, the transports' first phase, the exchange of what each
    /// rank is, the links, group memory, then the engine.
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
        let overrides: Overrides = match &options.algo {
            Some(spec) => spec.parse().map_err(Error::Config)?,
            None => Overrides::default(),
        };
        let candidates = match &options.transports {
            Some(t) => t.candidates(options.transport.as_deref())?,
            None => Transports::builtin()?.candidates(options.transport.as_deref())?,
        };
        let started = Instant::now();
        let comm = bootstrap::comm_id(&prefix, options.secret.as_ref());
        let scoped: Arc<dyn Store> = Arc::new(PrefixStore::new(store.clone(), prefix.clone()));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::io("creating the I/O runtime", e))?;
        let store_host = if world_size > 1 {
            bootstrap::check_membership(rank, world_size, &*scoped, options.timeout)?
        } else {
            None
        };
        let setup = Setup {
            rank,
            world_size,
            comm,
            store: scoped.clone(),
            timeout: options.timeout,
            secret: options.secret.clone(),
        };
        // The transports' first phase before the exchange: a TCP port opens
        // as soon as the membership check passes.
        let prepared = {
            let _runtime = runtime.enter();
            candidates.prepare(&setup)?
        };
        let mine = bootstrap::this_rank(options.host_id.as_deref());
        // The exchange waits for every rank: meanwhile the runtime serves
        // the transports' listeners (a TCP port answers, strangers too).
        let exchange = {
            let (store, timeout) = (scoped.clone(), options.timeout);
            move || bootstrap::exchange(rank, world_size, &*store, mine, timeout)
        };
        let peers = runtime
            .block_on(async { tokio::task::spawn_blocking(exchange).await })
            .map_err(|e| Error::Internal(format!("the exchange of peer info failed: {e}")))??;
        let spin = bootstrap::spin_for(rank, &peers, options.spin_window);
        let (host_rank, host_size) = bootstrap::place_on_host(rank, &peers);
        let connected = prepared.connect(&peers, spin, &runtime)?;
        if world_size > 1 {
            let used: Vec<String> = connected
                .used
                .iter()
                .map(|(name, n)| format!("{n} through {name}"))
                .collect();
            tracing::info!(
                rank,
                world_size,
                prefix,
                "connected to {} peers ({}) in {:?}",
                world_size - 1,
                used.join(", "),
                started.elapsed()
            );
            bootstrap::finish(rank, world_size, &*scoped, options.timeout)?;
        }
        let spin = ccl_core::Spin {
            repoll: world_size > 1 && connected.class.repoll.allows(spin.yield_between),
            window: match options.spin_window {
                None if connected.class.progress_thread => Duration::ZERO,
                _ => spin.window,
            },
            ..spin
        };
        let tuner = Tuner::new(
            Table::builtin(),
            overrides,
            world_size,
            connected.class.name,
            connected.group.is_some(),
        );
        let order = bootstrap::locality_order(&peers);
        let selection = Selection::new(rank, world_size, tuner, connected.class, order);
        let device_links = connected
            .links
            .iter()
            .map(|l| l.as_ref().is_some_and(|l| l.takes_device_memory()))
            .collect();
        let engine = Engine::start(
            rank,
            runtime,
            connected.links,
            (scoped, store_host),
            spin,
            connected.group,
            options.debug_checks,
        )?;
        Ok(Communicator {
            inner: Arc::new(Inner {
                timeout_ns: AtomicU64::new(nanos(options.timeout)),
                rank,
                world_size,
                host_rank,
                host_size,
                store,
                prefix,
                options,
                comm,
                engine,
                selection,
                seq: AtomicU64::new(0),
                p2p_seq: Mutex::new(HashMap::new()),
                splits: AtomicU64::new(0),
                used: connected.used,
                #[cfg(feature = "cuda")]
                staging: Mutex::new(None),
                #[cfg(feature = "cuda")]
                transfer_staging: Mutex::new(HashMap::new()),
                #[cfg(feature = "cuda")]
                ipc: Mutex::new(None),
                device_links,
            }),
        })
    }

    /// This rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.world_size
    }

    /// This rank's index among the ranks of this communicator on its host
    /// (torch's `LOCAL_RANK`, for picking a GPU), in rank order. Ranks share
    /// a host when their host identities match: hostname, boot id and
    /// namespaces, or `CCL_HOST_ID` where set, as for shared memory.
    pub fn host_rank(&self) -> usize {
        self.inner.host_rank
    }

    /// How many ranks of this communicator run on this rank's host
    /// (torch's `LOCAL_WORLD_SIZE`); see [`Communicator::host_rank`].
    pub fn host_size(&self) -> usize {
        self.inner.host_size
    }

    /// The transports that link this rank to its peers, most preferred
    /// first, with how many peers each (`[("shm", 3)]`).
    pub fn transports_used(&self) -> &[(&'static str, usize)] {
        &self.inner.used
    }

    /// The error that broke this communicator, if a call failed.
    /// A broken communicator fails every call; build a new one to go on.
    pub fn broken(&self) -> Option<Error> {
        self.inner.engine.broken_cause()
    }

    /// Aborts the communicator, like `ncclCommAbort`: calls running or
    /// queued on it (from any thread) fail at once, every later call fails
    /// with [`Error::Broken`], and every peer is told, so that their calls on
    /// this communicator fail naming this rank instead of waiting for it.
    /// Build a new communicator (from the same store) to go on.
    pub fn abort(&self) {
        self.inner.engine.abort();
    }

    /// Sets the deadline of every call issued from now on (the default is
    /// `Options::timeout`, `CCL_TIMEOUT`): a call still running when it
    /// passes fails with [`Error::Timeout`] naming the ranks it waited for,
    /// and breaks the communicator. Every rank should set the same value.
    pub fn set_timeout(&self, timeout: Duration) {
        self.inner
            .timeout_ns
            .store(nanos(timeout), Ordering::Relaxed);
    }

    /// The deadline of calls issued now.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.inner.timeout_ns.load(Ordering::Relaxed))
    }

    /// The algorithm a call of `kind` on `count` elements of `dtype` uses
    /// (see [`Communicator::choice_for`]).
    pub fn algorithm_for(&self, kind: CollectiveKind, count: usize, dtype: DataType) -> Algorithm {
        self.choice_for(kind, count, dtype).algorithm
    }

    /// What the tuner chooses for a call of `kind` on `count` elements of
    /// `dtype`: the `CCL_ALGO` override if any; else what the tuning table
    /// measured best for this size, world size and class of links; else the
    /// defaults (see [`Tuner::choose`]). The piece size is `None` where the
    /// communicator's default for its links applies.
    pub fn choice_for(&self, kind: CollectiveKind, count: usize, dtype: DataType) -> Choice {
        self.inner
            .selection
            .choice(&Collective::new(kind, dtype, count))
    }

    // ---- sub-communicators ------------------------------------------------

    /// Splits this communicator (MPI_Comm_split): ranks passing the same
    /// `color` form a new communicator, ordered by `key` then by rank here.
    /// Ranks passing `None` take part but get `None` back. Every rank must call it.
    pub fn split(&self, color: Option<u32>, key: i64) -> Result<Option<Communicator>> {
        let inner = &self.inner;
        let mine = [color.map_or(-1, i64::from), key];
        let mut all = vec![0i64; 2 * inner.world_size];
        self.allgather_into(&mine, &mut all)?;
        let split = inner.splits.fetch_add(1, Ordering::Relaxed);
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(i64, usize)> = (0..inner.world_size)
            .filter(|&r| all[2 * r] == i64::from(color))
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == inner.rank)
            .ok_or_else(|| {
                Error::Internal("this rank is missing from its own split group".into())
            })?;
        let prefix = format!("{}/split{split}/color{color}", inner.prefix);
        Communicator::with_prefix(
            new_rank,
            members.len(),
            inner.store.clone(),
            prefix,
            inner.options.clone(),
        )
        .map(Some)
    }

    /// A sub-communicator of the listed ranks (torch's `new_group`), ordered as listed.
    /// Every rank must call it with the same list; ranks not listed get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Communicator>> {
        let n = self.inner.world_size;
        if let Some(&bad) = ranks.iter().find(|&&r| r >= n) {
            return Err(Error::InvalidArgument(format!(
                "new_group: rank {bad} is not below world size {n}"
            )));
        }
        let position = ranks.iter().position(|&r| r == self.inner.rank);
        self.split(position.map(|_| 0), position.unwrap_or(0) as i64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccl_rendezvous::HashStore;

    #[test]
    fn size_picks_the_allreduce_algorithm() {
        let one = || Communicator::new(0, 1, Arc::new(HashStore::new()), Options::default());
        let comm = one().unwrap();
        assert_eq!(
            comm.algorithm_for(CollectiveKind::AllReduce, 2, DataType::F32),
            Algorithm::RecursiveDoubling
        );
        // Larger sizes take what the measured table says for the nearest
        // world size it has, over the least preferred class of links (one
        // rank has neither links nor group memory).
        let big = 1usize << 20;
        let table = Table::builtin()
            .pick(CollectiveKind::AllReduce, (big * 4) as u64, 1, "tcp")
            .expect("the table has allreduce over tcp");
        assert_ne!(table.algorithm, Algorithm::RecursiveDoubling);
        assert_eq!(
            comm.choice_for(CollectiveKind::AllReduce, big, DataType::F32),
            table
        );
        let small_broadcast = Table::builtin()
            .pick(CollectiveKind::Broadcast, 8, 1, "tcp")
            .expect("the table has broadcast over tcp");
        assert!(Algorithm::for_kind(CollectiveKind::Broadcast).contains(&small_broadcast.algorithm));
        assert_eq!(
            comm.choice_for(CollectiveKind::Broadcast, 2, DataType::F32),
            small_broadcast
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
        let bad = Options {
            algo: Some("allreduce=tree".into()),
            ..Options::default()
        };
        assert!(matches!(
            Communicator::new(0, 1, Arc::new(HashStore::new()), bad),
            Err(Error::Config(_))
        ));
    }
}
