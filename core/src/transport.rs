//! Transports: what makes [`Link`]s between the ranks of a communicator.
//!
//! A communicator keeps a list of transports in order of preference (NCCL's
//! transport table). At set-up every rank publishes a [`PeerInfo`]; for each
//! pair of ranks the first transport that [can connect](Transport::can_connect)
//! them is tried, and a pair it fails for (on both sides alike) falls to the
//! next. A transport works in two phases, as NCCL's setup and connect do:
//! [`Transport::prepare`] runs on every rank before the pairs are known (a
//! listening socket opens and its address is published), then
//! [`Connector::connect`] makes the links to the peers it was given. A
//! transport whose links reach every rank may also offer
//! [`GroupMemory`](crate::GroupMemory) for the whole communicator.

use std::{fmt, sync::Arc, time::Duration};

use crate::{GroupMemory, JobSecret, Link, LinkFuture, Result, Spin, Store};

/// What the engine and the tuner tell apart about a kind of link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LinkClass {
    /// The name the tuning table keys its lines by (`shm`, `tcp`).
    pub name: &'static str,
    /// Largest piece one message of a schedule moves by default: each piece
    /// costs a hand-shake on some links, a pipeline stage on others.
    pub piece_bytes: usize,
    /// When a thread that waits on the links may poll them again at once,
    /// without the runtime ([`crate::Repoll`]).
    pub repoll: RepollWhen,
    /// The links move data on a thread of their own (QUIC's runtime): a
    /// waiting caller sleeps at once, since polling would only take the CPU
    /// that thread needs (unless `CCL_SPIN_US` asks for a window).
    pub progress_thread: bool,
}

/// When the links of a class may be polled again at once ([`LinkClass::repoll`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RepollWhen {
    /// Never: the links need the runtime to make progress.
    Never,
    /// Only when every rank of the host has a CPU of its own: the links make
    /// some progress without the runtime (a TCP link reads a small message
    /// straight from its socket), but polling them again at once takes CPU
    /// that ranks sharing a core need.
    OwnCpu,
    /// Always: the links live in memory and need no runtime.
    Always,
}

impl RepollWhen {
    /// Whether to repoll, given whether the host's ranks share CPUs.
    pub fn allows(self, cpus_shared: bool) -> bool {
        match self {
            RepollWhen::Never => false,
            RepollWhen::OwnCpu => !cpus_shared,
            RepollWhen::Always => true,
        }
    }
}

/// What a rank tells the others about itself before links are made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Ranks with equal host identities share memory (and a kernel).
    pub host: String,
    /// The rank's process id.
    pub pid: u32,
    /// The CPUs the rank may run on.
    pub cpus: Vec<usize>,
}

impl PeerInfo {
    /// Encodes as `pid cpu,cpu,... host` (the host last: it may hold spaces).
    pub fn encode(&self) -> String {
        let cpus: Vec<String> = self.cpus.iter().map(usize::to_string).collect();
        format!("{} {} {}", self.pid, cpus.join(","), self.host)
    }

    /// Decodes what [`PeerInfo::encode`] made; an error message otherwise.
    pub fn decode(bytes: &[u8]) -> std::result::Result<PeerInfo, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "peer info is not UTF-8".to_string())?;
        let bad = || format!("malformed peer info {text:?}");
        let mut fields = text.splitn(3, ' ');
        let pid = fields.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let cpus = fields
            .next()
            .ok_or_else(bad)?
            .split(',')
            .filter(|c| !c.is_empty())
            .map(|c| c.parse().map_err(|_| bad()))
            .collect::<std::result::Result<_, _>>()?;
        let host = fields.next().ok_or_else(bad)?.to_string();
        Ok(PeerInfo { host, pid, cpus })
    }
}

/// The ranks that take turns on `rank`'s CPUs: those of its host pinned to
/// exactly its CPUs, where more ranks are pinned there than there are CPUs
/// and the host's ranks are not all on the same CPUs (then none was pinned
/// apart from the others). Data between two of them is written and read on
/// the same CPU, one rank after the other.
pub fn cpu_mates(everyone: &[PeerInfo], rank: usize) -> Vec<usize> {
    let Some(me) = everyone.get(rank) else {
        return Vec::new();
    };
    let on_host = |p: &PeerInfo| p.host == me.host;
    let same = |p: &PeerInfo| on_host(p) && p.cpus == me.cpus;
    let pinned_apart = everyone.iter().any(|p| on_host(p) && p.cpus != me.cpus);
    let crowded = everyone.iter().filter(|p| same(p)).count() > me.cpus.len();
    if me.cpus.is_empty() || !pinned_apart || !crowded {
        return Vec::new();
    }
    (0..everyone.len())
        .filter(|&p| p != rank && same(&everyone[p]))
        .collect()
}

/// What a transport is given to set up the links of one rank.
#[derive(Clone)]
pub struct Setup {
    pub rank: usize,
    pub world_size: usize,
    /// The communicator's id, in every frame and handshake.
    pub comm: u64,
    /// The rendezvous store, scoped to the communicator.
    pub store: Arc<dyn Store>,
    /// Deadline of the whole set-up.
    pub timeout: Duration,
    /// The job secret connections prove (`None`: unauthenticated).
    pub secret: Option<JobSecret>,
}

impl fmt::Debug for Setup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Setup(rank {} of {}, comm {:#x})",
            self.rank, self.world_size, self.comm
        )
    }
}

/// A link to one peer, or why this transport cannot connect the pair.
pub type PairResult = std::result::Result<Arc<dyn Link>, String>;

/// A way to connect ranks (see the module docs).
pub trait Transport: Send + Sync {
    /// Its name, as `CCL_TRANSPORT` and the logs spell it.
    fn name(&self) -> &'static str;

    /// The class of the links it makes.
    fn class(&self) -> LinkClass;

    /// Whether it can connect ranks `a` and `b`, from what they published.
    /// Must give the same answer for `(a, b)` as for `(b, a)`.
    fn can_connect(&self, a: &PeerInfo, b: &PeerInfo) -> bool;

    /// The first phase, on every rank, before the pairs it will connect
    /// are known: whatever peers reach this rank by is opened and published.
    /// Runs inside the communicator's runtime, which drives the links.
    fn prepare(&self, setup: &Setup) -> Result<Box<dyn Connector>>;

    /// Memory shared by every rank, when this transport can connect every
    /// pair of the communicator; called on every rank then, after the links.
    /// `Ok(None)`, the same on every rank, when it has none or some rank
    /// cannot map it. Waiting threads poll as `spin` says.
    fn connect_group(&self, setup: &Setup, spin: Spin) -> Result<Option<Arc<dyn GroupMemory>>> {
        let _ = (setup, spin);
        Ok(None)
    }
}

/// The second phase of a transport's set-up (see [`Transport::prepare`]).
pub trait Connector: Send {
    /// Connects to `peers`, each of which calls this with this rank among
    /// its peers; `everyone` is what each rank published (by rank); threads
    /// waiting on the links poll as `spin` says. One
    /// result per peer, in order: a pair that cannot use the transport fails
    /// on both sides alike with a reason (and falls to the next transport);
    /// an `Err` fails the whole set-up.
    fn connect<'a>(
        self: Box<Self>,
        peers: &'a [usize],
        everyone: &'a [PeerInfo],
        spin: Spin,
    ) -> LinkFuture<'a, Vec<PairResult>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repolling_tcp_needs_a_cpu_per_rank() {
        for shared in [false, true] {
            assert!(RepollWhen::Always.allows(shared));
            assert!(!RepollWhen::Never.allows(shared));
        }
        assert!(RepollWhen::OwnCpu.allows(false));
        assert!(!RepollWhen::OwnCpu.allows(true));
    }

    #[test]
    fn cpu_mates_are_ranks_pinned_together_on_too_few_cpus() {
        let info = |host: &str, cpus: &[usize]| PeerInfo {
            host: host.into(),
            pid: 1,
            cpus: cpus.to_vec(),
        };
        // Four ranks bound round-robin to two CPUs.
        let round_robin = [
            info("a", &[0]),
            info("a", &[1]),
            info("a", &[0]),
            info("a", &[1]),
        ];
        assert_eq!(cpu_mates(&round_robin, 0), [2]);
        assert_eq!(cpu_mates(&round_robin, 3), [1]);
        // The same on another host does not count.
        let hosts = [
            info("a", &[0]),
            info("b", &[1]),
            info("b", &[0]),
            info("a", &[1]),
        ];
        assert!(cpu_mates(&hosts, 0).is_empty());
        // Unpinned: every rank may run anywhere, none was placed with another.
        let unpinned = [info("a", &[0, 1]), info("a", &[0, 1]), info("a", &[0, 1])];
        assert!(cpu_mates(&unpinned, 0).is_empty());
        // Two ranks on two CPUs of their own each have one.
        let pairs = [
            info("a", &[0, 1]),
            info("a", &[0, 1]),
            info("a", &[2, 3]),
            info("a", &[2, 3]),
        ];
        assert!(cpu_mates(&pairs, 0).is_empty());
        let three = [
            info("a", &[0, 1]),
            info("a", &[0, 1]),
            info("a", &[0, 1]),
            info("a", &[2]),
        ];
        assert_eq!(cpu_mates(&three, 1), [0, 2]);
        // A CPU set the kernel did not report is no evidence.
        let unknown = [info("a", &[]), info("a", &[]), info("a", &[0])];
        assert!(cpu_mates(&unknown, 0).is_empty());
    }

    #[test]
    fn peer_info_round_trips() {
        for info in [
            PeerInfo {
                host: "node 7/boot/net:[1]".into(),
                pid: 42,
                cpus: vec![0, 3],
            },
            PeerInfo {
                host: String::new(),
                pid: 1,
                cpus: vec![],
            },
        ] {
            assert_eq!(PeerInfo::decode(info.encode().as_bytes()), Ok(info));
        }
        for bad in [&b"x 1 h"[..], b"1 a,b h", b"1", b"\xff"] {
            assert!(PeerInfo::decode(bad).is_err());
        }
    }
}
