//! Bootstrap: how the ranks of a new communicator meet through the store
//! before any link exists. The store of a job, the key prefix of each
//! communicator built from it, the membership check, what every rank tells
//! the others about itself (its host and CPUs), how a waiting thread polls,
//! the communicator id, and the last hand-shake of the set-up.

use std::{
    collections::BTreeSet,
    sync::Arc,
    time::{Duration, Instant},
};

use ccl_core::{Error, JobSecret, PeerInfo, Result, Spin, Store};
use ccl_rendezvous::{
    Config, FileStore, HashStore, PrefixStore, Rendezvous, TcpStore, TorchTcpStore,
};

/// The store where the ranks of `config`'s job meet: for a TCP store at
/// `MASTER_ADDR:MASTER_PORT`, rank 0 serves it and the others connect, or,
/// with `CCL_STORE_EXTERNAL=1`, every rank connects to a store that someone
/// else serves (one that outlives jobs, say). Under torchrun's agent store
/// every rank connects to torch's store, and ccl's keys lie under the run's
/// prefix. Waits at most `timeout`.
pub fn rendezvous_store(config: &Config, timeout: Duration) -> Result<Arc<dyn Store>> {
    let secret = config.job_secret.as_ref();
    let store: Arc<dyn Store> = match &config.rendezvous {
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
        Rendezvous::TorchAgent { host, port, prefix } => Arc::new(PrefixStore::new(
            Arc::new(TorchTcpStore::connect(host, *port, timeout)?),
            prefix.clone(),
        )),
        Rendezvous::File(dir) => Arc::new(FileStore::new(dir)?),
        Rendezvous::JobDir(dir) => Arc::new(FileStore::for_job(dir)?),
        Rendezvous::Local => Arc::new(HashStore::new()),
    };
    tracing::info!(
        rank = config.rank,
        "rendezvous through {}",
        store.describe()
    );
    Ok(store)
}

/// The key prefix of the communicator `rank` builds now from `store`: each
/// communicator built from one store gets keys of its own, so that a new one
/// (after a failure, say) meets no stale keys. The k-th communicator a rank
/// builds uses `ccl.k` (the first, `ccl`), and every rank must be building
/// its k-th one too.
pub(crate) fn incarnation(
    rank: usize,
    world_size: usize,
    store: &dyn Store,
    timeout: Duration,
) -> Result<String> {
    let key = |r: usize| format!("ccl-incarnation/{r}");
    let k = store.add(&key(rank), 1)?;
    if k > 1 {
        let deadline = Instant::now() + timeout;
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
                    return Err(stuck(format!("only #{theirs} after {timeout:?}")));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
    Ok(match k {
        1 => "ccl".to_string(),
        k => format!("ccl.{k}"),
    })
}

/// A communicator's id on the wire: a stable 64-bit hash (FNV-1a) of its
/// store prefix, mixed with a tag of the job secret so that two jobs differ.
pub(crate) fn comm_id(prefix: &str, secret: Option<&JobSecret>) -> u64 {
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

/// Fails clearly, before any link is made, if two processes claim `rank` or
/// the ranks disagree on the world size (instead of a timeout later).
/// Returns the rank whose process serves the store, if one does.
pub(crate) fn check_membership(
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

/// Identifies the host (and namespaces) this process runs in: ranks with the
/// same identity can share memory and read each other's memory.
///
/// Hostname and boot id name the machine; the network, mount and PID
/// namespaces are part of it, so ranks in separate network namespaces (how
/// tests simulate several hosts) count as separate hosts.
pub(crate) fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    let link = |p: &str| std::fs::read_link(p).map(|l| l.display().to_string());
    format!(
        "{}/{}/{}/{}/{}",
        read("/proc/sys/kernel/hostname").unwrap_or_default(),
        read("/proc/sys/kernel/random/boot_id").unwrap_or_default(),
        link("/proc/self/ns/net").unwrap_or_default(),
        link("/proc/self/ns/mnt").unwrap_or_default(),
        link("/proc/self/ns/pid").unwrap_or_default(),
    )
}

/// This rank's [`PeerInfo`]: its host identity (`host`, else detected), its
/// process and the CPUs it may run on.
pub(crate) fn this_rank(host: Option<&str>) -> PeerInfo {
    PeerInfo {
        host: host.map_or_else(host_id, str::to_string),
        pid: std::process::id(),
        cpus: ccl_core::allowed_cpus().unwrap_or_default(),
    }
}

/// Publishes `mine` and reads every rank's [`PeerInfo`], by rank.
pub(crate) fn exchange(
    rank: usize,
    world_size: usize,
    store: &dyn Store,
    mine: PeerInfo,
    timeout: Duration,
) -> Result<Vec<PeerInfo>> {
    if world_size == 1 {
        return Ok(vec![mine]);
    }
    store.set(&format!("peer/{rank}"), mine.encode().as_bytes())?;
    let deadline = Instant::now() + timeout;
    let mut all = Vec::with_capacity(world_size);
    for p in 0..world_size {
        if p == rank {
            all.push(mine.clone());
            continue;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let bytes = store.get(&format!("peer/{p}"), left)?;
        all.push(PeerInfo::decode(&bytes).map_err(|m| Error::Store {
            addr: store.describe(),
            msg: format!("rank {p}'s peer info: {m}"),
        })?);
    }
    Ok(all)
}

/// How a waiting thread of `rank` polls: the ranks of its host outnumber
/// their CPUs when there are more of them than CPUs in the union of the
/// sets they may run on (ranks pinned one to a CPU each do not, four ranks
/// on two CPUs do). `window`, when given, replaces the default window.
pub(crate) fn spin_for(rank: usize, peers: &[PeerInfo], window: Option<Duration>) -> Spin {
    let host = &peers[rank].host;
    let mates: Vec<&PeerInfo> = peers.iter().filter(|p| &p.host == host).collect();
    let cpus: BTreeSet<usize> = mates.iter().flat_map(|p| p.cpus.iter().copied()).collect();
    let (ranks, cpus) = (mates.len(), cpus.len().max(1));
    let spin = Spin::for_host(ranks, cpus, window);
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
    spin
}

/// The ranks listed by locality: those of one host together (hosts in the
/// order of their first rank), and among them those that may run on the
/// same CPUs together, each group in rank order. Schedules that care where
/// their messages go are built over it ([`ccl_algorithms::Algorithm::schedule_in_order`]).
/// Ranks launched host by host, one to a CPU or unpinned, keep their order.
pub(crate) fn locality_order(peers: &[PeerInfo]) -> Vec<usize> {
    let host_of = |r: usize| {
        peers
            .iter()
            .position(|p| p.host == peers[r].host)
            .unwrap_or(r)
    };
    let mut order: Vec<usize> = (0..peers.len()).collect();
    order.sort_by(|&a, &b| (host_of(a), &peers[a].cpus, a).cmp(&(host_of(b), &peers[b].cpus, b)));
    order
}

/// `rank`'s index among the ranks that share its host (in rank order), and
/// how many share it.
pub(crate) fn place_on_host(rank: usize, peers: &[PeerInfo]) -> (usize, usize) {
    let host = &peers[rank].host;
    let on_host = |p: &&PeerInfo| &p.host == host;
    (
        peers[..rank].iter().filter(on_host).count(),
        peers.iter().filter(on_host).count(),
    )
}

/// The last step of set-up: every other rank tells rank 0 that it is done
/// with the store, and rank 0 waits for that. Rank 0 may host the store, so it
/// must not run ahead (and exit, say) while others still read their set-up keys.
pub(crate) fn finish(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn info(host: &str, cpus: &[usize]) -> PeerInfo {
        PeerInfo {
            host: host.into(),
            pid: 1,
            cpus: cpus.to_vec(),
        }
    }

    /// Ranks pinned one to a CPU each do not share; more ranks than the
    /// union of their CPUs do; ranks of another host do not count.
    #[test]
    fn cpus_are_counted_over_the_host_s_ranks() {
        let pinned = [info("a", &[0]), info("a", &[1]), info("b", &[0])];
        assert!(!spin_for(0, &pinned, None).yield_between);
        let crowded = [info("a", &[0, 1]), info("a", &[0, 1]), info("a", &[1])];
        assert!(spin_for(2, &crowded, None).yield_between);
        let set = spin_for(0, &pinned, Some(Duration::from_micros(3)));
        assert_eq!(set.window, Duration::from_micros(3));
    }

    #[test]
    fn a_rank_s_place_counts_the_ranks_of_its_host() {
        let peers = [
            info("a", &[0]),
            info("b", &[0]),
            info("a", &[1]),
            info("b", &[1]),
        ];
        let places: Vec<_> = (0..4).map(|r| place_on_host(r, &peers)).collect();
        assert_eq!(places, [(0, 2), (0, 2), (1, 2), (1, 2)]);
    }

    /// Hosts in the order of their first rank, CPU mates together, rank
    /// order within a group; launches host by host, pinned one to a CPU or
    /// not pinned, keep their order.
    #[test]
    fn locality_orders_ranks_by_host_then_cpus() {
        let round_robin = [
            info("a", &[0]),
            info("a", &[1]),
            info("a", &[0]),
            info("a", &[1]),
        ];
        assert_eq!(locality_order(&round_robin), [0, 2, 1, 3]);
        let hosts = [
            info("b", &[0, 1]),
            info("a", &[0, 1]),
            info("b", &[0, 1]),
            info("a", &[0, 1]),
        ];
        assert_eq!(locality_order(&hosts), [0, 2, 1, 3]);
        let packed = [
            info("a", &[0]),
            info("a", &[1]),
            info("b", &[0]),
            info("b", &[1]),
        ];
        assert_eq!(locality_order(&packed), [0, 1, 2, 3]);
        let unpinned = [info("a", &[0, 1]), info("a", &[0, 1]), info("a", &[0, 1])];
        assert_eq!(locality_order(&unpinned), [0, 1, 2]);
    }

    #[test]
    fn ids_differ_by_prefix_and_secret() {
        let s = JobSecret::new("x").unwrap();
        assert_ne!(comm_id("ccl", None), comm_id("ccl.2", None));
        assert_ne!(comm_id("ccl", None), comm_id("ccl", Some(&s)));
        assert_eq!(comm_id("ccl", Some(&s)), comm_id("ccl", Some(&s)));
    }

    #[test]
    fn every_rank_learns_every_rank_s_info() {
        let store: Arc<dyn Store> = Arc::new(HashStore::new());
        let ranks: Vec<_> = (0..3)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let mine = info(&format!("host{r}"), &[r]);
                    exchange(r, 3, &*store, mine, Duration::from_secs(10)).unwrap()
                })
            })
            .collect();
        for t in ranks {
            let all = t.join().unwrap();
            let hosts: Vec<&str> = all.iter().map(|p| p.host.as_str()).collect();
            assert_eq!(hosts, ["host0", "host1", "host2"]);
        }
    }
}
