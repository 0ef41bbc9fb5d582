//! A transport of the tests' own, to show (and keep honest) that a new
//! transport needs its own module and one registration line, and nothing
//! else: ranks that are threads of one process reach each other through its
//! memory ([`ccl_core::loopback`] links). A program registers it with
//! `Transports::builtin()?.with_first(Arc::new(Loopback))`.
//!
//! Pairing: for each pair, the lower rank makes the link, leaves the higher
//! rank's end in a table of this process under a fresh id, and publishes the
//! id through the communicator's store; the higher rank reads the id and
//! takes its end. Every wait has the set-up's deadline.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, LazyLock, Mutex,
    },
    time::Instant,
};

use ccl_core::{
    loopback, Connector, Error, Link, LinkClass, LinkFuture, PairResult, PeerInfo, Result, Setup,
    Spin, Transport,
};

/// Ranks of one process, through its memory.
#[derive(Clone, Copy, Debug, Default)]
pub struct Loopback;

/// Links made by a lower rank, waiting for the higher rank to take them.
static WAITING: LazyLock<Mutex<HashMap<u64, Arc<dyn Link>>>> = LazyLock::new(Default::default);
/// Ids of the links in [`WAITING`].
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl Transport for Loopback {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn class(&self) -> LinkClass {
        LinkClass {
            name: "loopback",
            piece_bytes: 1 << 20,
            repoll: ccl_core::RepollWhen::Always,
            progress_thread: false,
        }
    }

    fn can_connect(&self, a: &PeerInfo, b: &PeerInfo) -> bool {
        a.host == b.host && a.pid == b.pid
    }

    fn prepare(&self, setup: &Setup) -> Result<Box<dyn Connector>> {
        Ok(Box::new(Pairing(setup.clone())))
    }
}

/// The second phase: pairs up with each peer through the store.
struct Pairing(Setup);

impl Connector for Pairing {
    fn connect<'a>(
        self: Box<Self>,
        peers: &'a [usize],
        _: &'a [PeerInfo],
        _: Spin,
    ) -> LinkFuture<'a, Vec<PairResult>> {
        Box::pin(async move { peers.iter().map(|&p| self.pair_with(p).map(Ok)).collect() })
    }
}

impl Pairing {
    fn pair_with(&self, peer: usize) -> Result<Arc<dyn Link>> {
        let Setup {
            rank,
            ref store,
            timeout,
            ..
        } = self.0;
        let key = format!("loopback/{}-{}", rank.min(peer), rank.max(peer));
        let waiting = || WAITING.lock().unwrap_or_else(|p| p.into_inner());
        if rank < peer {
            let (mine, theirs) = loopback::pair(rank, peer, false);
            let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
            waiting().insert(id, theirs);
            store.set(&key, id.to_string().as_bytes())?;
            return Ok(mine);
        }
        let started = Instant::now();
        let id = store.get(&key, timeout)?;
        let id: u64 = String::from_utf8_lossy(&id)
            .parse()
            .map_err(|_| Error::Store {
                addr: store.describe(),
                msg: format!("'{key}' holds no link id"),
            })?;
        waiting().remove(&id).ok_or_else(|| Error::Timeout {
            context: format!("rank {rank}: loopback set-up"),
            what: format!("rank {peer}'s end of link {id} in this process"),
            after: started.elapsed(),
        })
    }
}
