//! RDMA links for ccl: InfiniBand and RoCE through verbs, between hosts.
//!
//! The crate is split the way quinn is: a protocol core with no I/O
//! ([`proto`]: eager messages into pre-registered rings under credit-based
//! flow control, rendezvous writes straight between registered user
//! buffers, completion errors turned into errors naming the peer) over a
//! small [`Verbs`] trait; a link ([`link`]) that drives it from the
//! engine's futures; the set-up exchange through the authenticated store
//! ([`setup`]); a registration cache ([`regcache`]). Two things implement
//! [`Verbs`]: the glue to a real NIC (`ibv`, on `ibverbs-sys`, the raw
//! bindings of the `ibverbs` project, behind the feature `ibverbs` since it
//! links libibverbs), and
//! [`sim`], a simulated fabric between processes of one host, which is a
//! test double for hardware this project does not have, chosen only by
//! `CCL_RDMA_SIM`.
//!
//! Selection follows NCCL: the transport comes after shared memory and
//! before TCP, so pairs on different hosts use RDMA when a device is
//! present and usable and TCP otherwise. `CCL_TRANSPORT=rdma` forces it; on
//! a machine without a device that fails with "no RDMA device" and what was
//! checked. `CCL_RDMA_DEVICE` picks a device (`name` or `name:port`),
//! `CCL_RDMA_GID_INDEX` the GID of a RoCE port. A build without the
//! `ibverbs` feature finds devices but reports them unusable, saying why.
//!
//! GPU memory (GPUDirect RDMA) is registered with
//! [`Verbs::register_device`] (on a real NIC through `nvidia-peermem`) and
//! always goes by rendezvous, so that the CPU never touches it; a pair uses
//! it only where both sides can (`CCL_RDMA_GPUDIRECT`, default on), and
//! its links then take device buffers as they are. Otherwise the link
//! refuses GPU memory with `Unsupported` and device calls stage through
//! host memory above it.

mod counters;
#[cfg(feature = "ibverbs")]
pub mod ibv;
mod link;
pub mod proto;
pub mod regcache;
pub mod setup;
pub mod sim;
pub mod verbs;

#[cfg(test)]
mod tests;

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use ccl_core::{
    Connector, Error, LinkClass, LinkFuture, PairResult, PeerInfo, RepollWhen, Result, Setup, Spin,
    Transport,
};
use ccl_rendezvous::Config;

pub use counters::{CounterValues, Counters, COUNTERS};
pub use proto::RingConfig;
pub use verbs::Verbs;

use link::{RdmaLink, Sleeper};
use proto::{Owned, Peer, PeerRing};
use regcache::RegCache;
use setup::Offer;
use sim::{Faults, SimNic};

/// The class of RDMA links: each message above the eager limit costs a
/// round trip (the receiver's offer), so pieces are 1 MiB.
pub const CLASS: LinkClass = LinkClass {
    name: "rdma",
    piece_bytes: 1 << 20,
    repoll: RepollWhen::Never,
    progress_thread: false,
};

/// Registrations the cache keeps per NIC.
const CACHE_ENTRIES: usize = 64;

/// Where the kernel lists RDMA devices.
pub const SYSFS_DEVICES: &str = "/sys/class/infiniband";

/// How RDMA links are set up.
#[derive(Clone, Debug, Default)]
pub struct RdmaOptions {
    /// Eager ring sizes (`CCL_RDMA_SLOTS`, `CCL_RDMA_SLOT_BYTES`).
    pub ring: RingConfig,
    /// The device to use (`CCL_RDMA_DEVICE`, `name` or `name:port`); the
    /// first one otherwise.
    pub device: Option<String>,
    /// The GID index of a RoCE port (`CCL_RDMA_GID_INDEX`); else a RoCE v2
    /// GID with an IPv4 address, as NCCL picks.
    pub gid_index: Option<u32>,
    /// The simulated fabric's directory (`CCL_RDMA_SIM`, tests only) and its faults
    /// (`CCL_RDMA_SIM_FAULTS`).
    pub sim: Option<(PathBuf, Faults)>,
    /// `CCL_TRANSPORT=rdma`: a rank without a device fails at once, in its
    /// own set-up, instead of after the others have published theirs.
    pub forced: bool,
    /// Device transfers move GPU memory straight through the NIC where
    /// both sides can register it (`CCL_RDMA_GPUDIRECT`, default on).
    pub gpudirect: bool,
}

impl RdmaOptions {
    /// The options the `CCL_RDMA_*` knobs set.
    pub fn from_config(config: &Config) -> Result<RdmaOptions> {
        let d = RingConfig::default();
        let faults = Faults::parse(config.knob("CCL_RDMA_SIM_FAULTS").unwrap_or(""))
            .map_err(Error::Config)?;
        Ok(RdmaOptions {
            ring: RingConfig {
                slots: config.knob_number("CCL_RDMA_SLOTS", d.slots, 2..=4095)?,
                slot_bytes: config.knob_number(
                    "CCL_RDMA_SLOT_BYTES",
                    d.slot_bytes,
                    4096..=16 << 20,
                )?,
                keepalive: d.keepalive,
            },
            device: config.knob("CCL_RDMA_DEVICE").map(str::to_string),
            gid_index: match config.knob("CCL_RDMA_GID_INDEX") {
                Some(_) => Some(config.knob_number("CCL_RDMA_GID_INDEX", 0, 0..=255)? as u32),
                None => None,
            },
            sim: config
                .knob("CCL_RDMA_SIM")
                .map(|dir| (PathBuf::from(dir), faults)),
            forced: config.knob("CCL_TRANSPORT") == Some("rdma"),
            gpudirect: config.knob_flag("CCL_RDMA_GPUDIRECT", true)?,
        })
    }
}

/// What this rank links through.
#[derive(Clone)]
enum Backend {
    /// The simulated fabric (tests).
    Sim(Arc<SimNic>),
    /// A NIC through libibverbs.
    #[cfg(feature = "ibverbs")]
    Device(Arc<ibv::IbvNic>),
    /// No usable device, and why (what was checked).
    Missing(String),
}

/// RDMA between ranks (see the crate docs).
#[derive(Clone)]
pub struct RdmaTransport {
    options: RdmaOptions,
    backend: Backend,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.backend {
            Backend::Sim(nic) => write!(f, "RdmaTransport({})", nic.name()),
            #[cfg(feature = "ibverbs")]
            Backend::Device(nic) => write!(f, "RdmaTransport({})", nic.name()),
            Backend::Missing(why) => write!(f, "RdmaTransport(unavailable: {why})"),
        }
    }
}

impl RdmaTransport {
    /// The transport with these options: the simulated fabric if they name
    /// one, else the device found on this machine, if any.
    pub fn new(options: RdmaOptions) -> Result<RdmaTransport> {
        let backend = match &options.sim {
            Some((dir, faults)) => {
                Backend::Sim(Arc::new(SimNic::open(dir, *faults).map_err(Error::Config)?))
            }
            None => {
                let wanted = options.device.as_deref();
                match probe(Path::new(SYSFS_DEVICES), wanted) {
                    Ok(device) => open_device(&device, wanted, options.gid_index),
                    Err(checked) => Backend::Missing(checked),
                }
            }
        };
        Ok(RdmaTransport { options, backend })
    }

    /// The transport with the options `config` sets ([`RdmaOptions::from_config`]).
    pub fn from_config(config: &Config) -> Result<RdmaTransport> {
        RdmaTransport::new(RdmaOptions::from_config(config)?)
    }

    /// The device links go through, or why there is none.
    pub fn device(&self) -> std::result::Result<String, String> {
        match &self.backend {
            Backend::Sim(nic) => Ok(nic.name()),
            #[cfg(feature = "ibverbs")]
            Backend::Device(nic) => Ok(nic.name()),
            Backend::Missing(why) => Err(why.clone()),
        }
    }
}

/// The backend for `device`, which [`probe`] found (`wanted` may add a port).
#[cfg(feature = "ibverbs")]
fn open_device(device: &str, wanted: Option<&str>, gid_index: Option<u32>) -> Backend {
    match ibv::IbvNic::open(Some(wanted.unwrap_or(device)), gid_index) {
        Ok(nic) => Backend::Device(Arc::new(nic)),
        Err(why) => Backend::Missing(why),
    }
}

/// Without the glue, a device found is reported unusable, saying why.
#[cfg(not(feature = "ibverbs"))]
fn open_device(device: &str, _: Option<&str>, _: Option<u32>) -> Backend {
    Backend::Missing(format!(
        "found RDMA device {device}, but this build of ccl has no ibverbs glue \
         (rebuild with the cargo feature `ibverbs`)"
    ))
}

/// Directories searched for `libibverbs.so.1`.
const LIB_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/lib/x86_64-linux-gnu",
    "/lib64",
];

/// The RDMA device to use (`wanted`, or the first listed under `sysfs`) if
/// one exists and libibverbs is installed; else "no RDMA device" and what
/// was checked.
pub fn probe(sysfs: &Path, wanted: Option<&str>) -> std::result::Result<String, String> {
    // `name:port` names a device by its name.
    let wanted = wanted.map(|w| w.split_once(':').map_or(w, |(name, _)| name));
    let mut checked = Vec::new();
    let devices: Vec<String> = match std::fs::read_dir(sysfs) {
        Ok(entries) => {
            let mut d: Vec<String> = entries
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect();
            d.sort();
            d
        }
        Err(e) => {
            checked.push(format!("{}: {e}", sysfs.display()));
            Vec::new()
        }
    };
    if checked.is_empty() && devices.is_empty() {
        checked.push(format!("{}: lists no device", sysfs.display()));
    }
    let device = match wanted {
        Some(w) if devices.iter().any(|d| d == w) => Some(w.to_string()),
        Some(w) => {
            if !devices.is_empty() {
                checked.push(format!(
                    "CCL_RDMA_DEVICE={w}: not among {}",
                    devices.join(", ")
                ));
            }
            None
        }
        None => devices.first().cloned(),
    };
    let lib = LIB_DIRS
        .iter()
        .map(|d| Path::new(d).join("libibverbs.so.1"))
        .find(|p| p.exists());
    if lib.is_none() {
        checked.push(format!("libibverbs.so.1: not in {}", LIB_DIRS.join(", ")));
    }
    match (device, lib) {
        (Some(device), Some(_)) => Ok(device),
        _ => Err(format!("no RDMA device (checked {})", checked.join("; "))),
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn class(&self) -> LinkClass {
        CLASS
    }

    /// Any pair may try: whether both ranks have a device is settled
    /// through the store, so that a pair fails alike on both sides.
    fn can_connect(&self, _: &PeerInfo, _: &PeerInfo) -> bool {
        true
    }

    fn prepare(&self, setup: &Setup) -> Result<Box<dyn Connector>> {
        let status = match &self.backend {
            Backend::Sim(_) => "ok".to_string(),
            #[cfg(feature = "ibverbs")]
            Backend::Device(_) => "ok".to_string(),
            Backend::Missing(why) if self.options.forced => {
                return Err(Error::Config(format!(
                    "CCL_TRANSPORT=rdma, but rank {} cannot use it: {why}",
                    setup.rank
                )))
            }
            Backend::Missing(why) => format!("none {why}"),
        };
        setup
            .store
            .set(&format!("rdma/{}", setup.rank), status.as_bytes())?;
        Ok(Box::new(RdmaConnector {
            setup: setup.clone(),
            transport: self.clone(),
        }))
    }
}

/// The second phase of [`RdmaTransport`]'s set-up.
struct RdmaConnector {
    setup: Setup,
    transport: RdmaTransport,
}

impl Connector for RdmaConnector {
    fn connect<'a>(
        self: Box<Self>,
        peers: &'a [usize],
        _: &'a [PeerInfo],
        spin: Spin,
    ) -> LinkFuture<'a, Vec<PairResult>> {
        Box::pin(async move {
            match &self.transport.backend {
                Backend::Sim(nic) => {
                    connect(&self.setup, &self.transport.options, nic, peers, spin)
                }
                #[cfg(feature = "ibverbs")]
                Backend::Device(nic) => {
                    connect(&self.setup, &self.transport.options, nic, peers, spin)
                }
                Backend::Missing(why) => Ok(peers.iter().map(|_| Err(why.clone())).collect()),
            }
        })
    }
}

/// One side of a pair while it connects.
struct Half<V: Verbs> {
    qp: V::Qp,
    ring: Owned,
}

/// Connects to every peer in `peers` over `verbs`.
fn connect<V: Verbs>(
    setup: &Setup,
    options: &RdmaOptions,
    verbs: &Arc<V>,
    peers: &[usize],
    spin: Spin,
) -> Result<Vec<PairResult>> {
    let (rank, store, cfg) = (setup.rank, &setup.store, options.ring);
    let secret = setup.secret.as_ref();
    // User buffers keep their registrations across calls only where a
    // registration follows the address space (see `Verbs::follows_remaps`).
    let keep = if verbs.follows_remaps() {
        CACHE_ENTRIES
    } else {
        0
    };
    let cache = Arc::new(Mutex::new(RegCache::new(keep)));
    // Without a completion channel no pair of this rank can be made.
    let channel = verbs
        .channel()
        .map_err(|e| format!("completion channel: {e}"));
    let gpudirect = options.gpudirect
        && verbs
            .device_memory()
            .inspect_err(|why| tracing::debug!(rank, "rdma: no GPUDirect RDMA: {why}"))
            .is_ok();
    // Publish this side of every pair whose peer can use RDMA.
    let mut halves: Vec<std::result::Result<Half<V>, String>> = Vec::new();
    for &p in peers {
        let status = store.get(&format!("rdma/{p}"), setup.timeout)?;
        let half = match status.strip_prefix(b"none ") {
            Some(why) => Err(format!(
                "rank {p} cannot use RDMA: {}",
                String::from_utf8_lossy(why)
            )),
            None => (|| {
                let qp = verbs.queue_pair(channel.as_ref().map_err(Clone::clone)?)?;
                let ring = Owned::new(&**verbs, cfg.slots * cfg.slot_bytes)?;
                Ok(Half { qp, ring })
            })(),
        };
        let line = match &half {
            Ok(h) => Offer {
                comm: setup.comm,
                from: rank,
                to: p,
                endpoint: verbs::QueuePair::endpoint(&h.qp),
                ring: verbs::Remote {
                    addr: h.ring.region.addr,
                    rkey: h.ring.region.rkey,
                },
                slots: cfg.slots,
                slot_bytes: cfg.slot_bytes,
                gpudirect,
            }
            .encode(secret),
            Err(why) => format!("none {why}"),
        };
        store.set(&format!("rdma/{rank}-{p}"), line.as_bytes())?;
        halves.push(half);
    }
    // Take the peers' sides, connect, and agree on the verdict.
    let mut verdicts = Vec::new();
    for (&p, half) in peers.iter().zip(halves) {
        let line = store.get(&format!("rdma/{p}-{rank}"), setup.timeout)?;
        let pair = half.and_then(|mut h| {
            let offer = Offer::accept(&line, secret, (setup.comm, p, rank), &cfg)?;
            verbs::QueuePair::connect(&mut h.qp, &offer.endpoint)?;
            let ring = PeerRing { remote: offer.ring };
            let peer = Peer::new(
                (rank, p),
                cfg,
                verbs.clone(),
                cache.clone(),
                h.qp,
                h.ring,
                ring,
            )?;
            Ok((peer, gpudirect && offer.gpudirect))
        });
        let verdict = match &pair {
            Ok(_) => "ok".to_string(),
            Err(why) => format!("refused {why}"),
        };
        store.set(&format!("rdma/{rank}-{p}/ready"), verdict.as_bytes())?;
        verdicts.push(pair);
    }
    let mut states = Vec::new();
    for (&p, pair) in peers.iter().zip(verdicts) {
        let theirs = store.get(&format!("rdma/{p}-{rank}/ready"), setup.timeout)?;
        let state = match (pair, theirs.strip_prefix(b"refused ")) {
            (Ok((peer, gdr)), None) => {
                let state = Arc::new(Mutex::new(peer));
                link::close_at_exit_if_open(&state);
                Ok((state, gdr))
            }
            (Err(why), _) => Err(why),
            (Ok(_), Some(why)) => Err(format!(
                "rank {p} refused this rank's RDMA set-up: {}",
                String::from_utf8_lossy(why)
            )),
        };
        states.push(state);
    }
    let sleeper = channel.ok().map(|c| Arc::new(Sleeper::new(c)));
    let pairs: Arc<[_]> = states
        .iter()
        .filter_map(|s| s.as_ref().ok().map(|(state, _)| Arc::downgrade(state)))
        .collect();
    let results: Vec<PairResult> = peers
        .iter()
        .zip(states)
        .map(|(&p, state)| {
            // A pair was made only with the channel.
            let sleeper = sleeper.clone().ok_or("no completion channel");
            state.and_then(|(state, gpudirect)| {
                let link =
                    RdmaLink::new((rank, p), state, pairs.clone(), spin, gpudirect, sleeper?);
                Ok(Arc::new(link) as Arc<dyn ccl_core::Link>)
            })
        })
        .collect();
    let linked = results.iter().filter(|r| r.is_ok()).count();
    let direct = results
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|l| l.takes_device_memory()))
        .count();
    tracing::debug!(
        rank,
        device = %verbs.name(),
        "rdma: {linked} of {} peers linked, {direct} of them with GPUDirect RDMA",
        peers.len()
    );
    Ok(results)
}
