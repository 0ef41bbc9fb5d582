//! The transport registry: which transports a communicator may use, in
//! order of preference, and how its ranks pick one per pair (NCCL's
//! transport table and `canConnect`).
//!
//! Every transport this build carries has one line in [`BUILTIN`], behind
//! the Cargo feature of its crate; programs may put transports of their own
//! before them ([`Transports::with_first`]). At set-up each rank prepares
//! every candidate transport (a TCP listener opens), exchanges
//! [`PeerInfo`] with the others, then connects each pair with the first
//! transport that [can](Transport::can_connect); a pair the transport fails
//! for (alike on both sides) falls to the next one. `CCL_TRANSPORT` names
//! the one transport every pair must use, or lists the candidates in order
//! (`shm,quic`: shared memory within a host, QUIC between hosts).

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use ccl_core::{
    Connector, Error, GroupMemory, Link, LinkClass, PeerInfo, Result, Setup, Spin, Transport,
};
use ccl_rendezvous::Config;

/// Makes a transport with the options `config` sets.
type Make = fn(&Config) -> Result<Arc<dyn Transport>>;

/// The transports this build carries, most preferred first: one line each.
const BUILTIN: &[Make] = &[
    #[cfg(feature = "shm")]
    |c| Ok(Arc::new(ccl_transport_shm::ShmTransport::from_config(c)?)),
    #[cfg(feature = "rdma")]
    |c| Ok(Arc::new(ccl_transport_rdma::RdmaTransport::from_config(c)?)),
    #[cfg(feature = "tcp")]
    |c| Ok(Arc::new(ccl_transport_tcp::TcpTransport::from_config(c)?)),
    #[cfg(feature = "quic")]
    |c| Ok(Arc::new(ccl_transport_quic::QuicTransport::from_config(c)?)),
];

/// Transports used only when `CCL_TRANSPORT` names them: in `auto` they are
/// not even prepared. QUIC costs more CPU than TCP on a clean network; a job
/// whose hosts talk over a network it does not trust lists it
/// (`CCL_TRANSPORT=shm,quic`).
const FORCED_ONLY: &[&str] = &["quic"];

/// The transports a communicator may use, most preferred first.
#[derive(Clone)]
pub struct Transports(Vec<Arc<dyn Transport>>);

impl Transports {
    /// The transports this build carries (features `shm`, `rdma`, `tcp`,
    /// `quic`), with the options `config` sets (`CCL_NSOCKS`,
    /// `CCL_SHM_BYTES`, `CCL_RDMA_DEVICE`, ...).
    pub fn from_config(config: &Config) -> Result<Transports> {
        BUILTIN.iter().map(|make| make(config)).collect()
    }

    /// The transports this build carries, with their default options.
    pub fn builtin() -> Result<Transports> {
        Transports::from_config(&Config::from_vars(std::iter::empty::<(String, String)>())?)
    }

    /// No transport at all (a communicator of one rank needs none).
    pub fn none() -> Transports {
        Transports(Vec::new())
    }

    /// These transports with `transport` tried before all of them.
    pub fn with_first(mut self, transport: Arc<dyn Transport>) -> Transports {
        self.0.insert(0, transport);
        self
    }

    /// The transports' names, most preferred first.
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|t| t.name()).collect()
    }

    /// The candidates for a set-up: all of them (but those used only when
    /// named), the one named by `chosen` (`CCL_TRANSPORT=quic`: every pair
    /// must use it), or those it lists in order (`CCL_TRANSPORT=shm,quic`:
    /// each pair takes the first of them that connects it).
    pub(crate) fn candidates(&self, chosen: Option<&str>) -> Result<Candidates> {
        let Some(list) = chosen else {
            return Ok(Candidates {
                transports: self
                    .0
                    .iter()
                    .filter(|t| !FORCED_ONLY.contains(&t.name()))
                    .cloned()
                    .collect(),
                forced: false,
            });
        };
        let names: Vec<&str> = list.split(',').map(str::trim).collect();
        let transports = names
            .iter()
            .map(|&name| {
                self.0
                    .iter()
                    .find(|t| t.name() == name)
                    .cloned()
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "CCL_TRANSPORT={list}: no transport named {name:?} (this build has {})",
                            self.names().join(", ")
                        ))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Candidates {
            transports,
            forced: names.len() == 1,
        })
    }
}

impl FromIterator<Arc<dyn Transport>> for Transports {
    fn from_iter<I: IntoIterator<Item = Arc<dyn Transport>>>(iter: I) -> Transports {
        Transports(iter.into_iter().collect())
    }
}

impl fmt::Debug for Transports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Transports({})", self.names().join(", "))
    }
}

/// The transports a set-up tries, most preferred first.
pub(crate) struct Candidates {
    transports: Vec<Arc<dyn Transport>>,
    /// Named by `CCL_TRANSPORT`: every pair must use it.
    forced: bool,
}

impl Candidates {
    /// The first phase of a set-up: prepares every candidate transport.
    pub(crate) fn prepare(self, setup: &Setup) -> Result<Prepared> {
        let Candidates {
            transports: candidates,
            forced,
        } = self;
        if candidates.is_empty() && setup.world_size > 1 {
            return Err(Error::Config(
                "this build carries no transport (enable the `tcp` or `shm` feature)".into(),
            ));
        }
        // A rank alone prepares nothing (its candidates still name its class).
        let connectors = candidates
            .iter()
            .filter(|_| setup.world_size > 1)
            .map(|t| t.prepare(setup))
            .collect::<Result<Vec<_>>>()?;
        Ok(Prepared {
            setup: setup.clone(),
            candidates,
            connectors,
            forced,
        })
    }
}

/// The class of a communicator that has no transport (one rank, no
/// candidates): the tuner has no lines for it and uses its defaults.
const NO_LINKS: LinkClass = LinkClass {
    name: "none",
    piece_bytes: 512 * 1024,
    repoll: ccl_core::RepollWhen::Never,
    progress_thread: false,
};

/// Logs the first fallback from one transport to the next in this process.
static FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

/// The transports of a set-up, prepared (see [`Transports::prepare`]).
pub(crate) struct Prepared {
    setup: Setup,
    candidates: Vec<Arc<dyn Transport>>,
    connectors: Vec<Box<dyn Connector>>,
    forced: bool,
}

/// What a set-up connected.
pub(crate) struct Connected {
    /// Per rank: the link to it (`None` for this rank).
    pub links: Vec<Option<Arc<dyn Link>>>,
    /// The transports that link this rank to a peer, with how many peers
    /// each, most preferred first.
    pub used: Vec<(&'static str, usize)>,
    /// The class the tuner and the engine treat this rank's links as: the
    /// least preferred class in use (for one rank, of the candidates).
    pub class: LinkClass,
    /// Memory shared by every rank, from the first transport that can
    /// connect every pair, if it offers some.
    pub group: Option<Arc<dyn GroupMemory>>,
}

impl Prepared {
    /// The second phase: connects every pair with the first transport that
    /// can and does, given what every rank published (`peers`, by rank).
    /// Runs the transports' connectors on `runtime`, whose reactor serves
    /// the links. Waiting threads poll as `spin` says.
    pub(crate) fn connect(
        self,
        peers: &[PeerInfo],
        spin: Spin,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<Connected> {
        let Prepared {
            setup,
            candidates,
            connectors,
            forced,
        } = self;
        let (rank, n) = (setup.rank, setup.world_size);
        let me = &peers[rank];
        let mut links: Vec<Option<Arc<dyn Link>>> = vec![None; n];
        let mut remaining: Vec<usize> = (0..n).filter(|&p| p != rank).collect();
        let mut used = Vec::new();
        let mut class = candidates.last().map(|t| t.class());
        for (transport, connector) in candidates.iter().zip(connectors) {
            let name = transport.name();
            let (mine, others): (Vec<usize>, Vec<usize>) = remaining
                .iter()
                .partition(|&&p| transport.can_connect(me, &peers[p]));
            if forced {
                if let Some(&p) = others.first() {
                    return Err(Error::Config(format!(
                        "CCL_TRANSPORT={name}, but {name} cannot connect rank {rank} and rank {p} \
                         (hosts {} and {})",
                        me.host, peers[p].host
                    )));
                }
            }
            let results = runtime.block_on(connector.connect(&mine, peers, spin))?;
            let mut linked = 0;
            remaining = others;
            for (p, result) in mine.into_iter().zip(results) {
                match result {
                    Ok(link) => {
                        links[p] = Some(link);
                        linked += 1;
                    }
                    Err(why) if forced => {
                        return Err(Error::Config(format!(
                        "CCL_TRANSPORT={name}, but rank {rank} cannot use it with rank {p}: {why}"
                    )))
                    }
                    Err(why) => {
                        if !FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                rank,
                                peer = p,
                                "{name} unavailable, trying the next transport: {why}"
                            );
                        }
                        remaining.push(p);
                    }
                }
            }
            remaining.sort_unstable();
            if linked > 0 {
                used.push((name, linked));
                class = Some(transport.class());
            }
        }
        if !remaining.is_empty() {
            let names: Vec<&str> = candidates.iter().map(|t| t.name()).collect();
            return Err(Error::Config(format!(
                "rank {rank}: no transport connects it to rank(s) {remaining:?} (tried {})",
                names.join(", ")
            )));
        }
        // Every rank picks the same transport: every pair is asked.
        let connects_all = |t: &&Arc<dyn Transport>| {
            peers
                .iter()
                .enumerate()
                .all(|(i, a)| peers[i + 1..].iter().all(|b| t.can_connect(a, b)))
        };
        let group = match candidates.iter().find(connects_all) {
            Some(t) if n > 1 => t.connect_group(&setup, spin)?,
            _ => None,
        };
        Ok(Connected {
            links,
            used,
            class: class.unwrap_or(NO_LINKS),
            group,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(c: &Candidates) -> Vec<&'static str> {
        c.transports.iter().map(|t| t.name()).collect()
    }

    #[test]
    #[cfg(all(feature = "shm", feature = "tcp", feature = "quic"))]
    fn ccl_transport_names_one_or_lists_candidates_in_order() {
        let all = Transports::builtin().unwrap();
        let auto = all.candidates(None).unwrap();
        assert!(!auto.forced);
        assert!(!names(&auto).contains(&"quic"), "QUIC only when named");
        let one = all.candidates(Some("tcp")).unwrap();
        assert_eq!((names(&one), one.forced), (vec!["tcp"], true));
        let list = all.candidates(Some("shm, quic")).unwrap();
        assert_eq!((names(&list), list.forced), (vec!["shm", "quic"], false));
        let Err(Error::Config(e)) = all.candidates(Some("shm,carrier-pigeon")) else {
            panic!("an unknown name must be refused");
        };
        assert!(e.contains("\"carrier-pigeon\""), "{e}");
    }
}
