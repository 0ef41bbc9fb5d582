//! Shared-memory links for ccl between ranks on one host.
//!
//! Each pair of ranks shares one segment in `/dev/shm` holding a ring per
//! direction ([`link`] describes the layout and protocol). Messages stream
//! through the ring (the two sides copy at once), except those of at least
//! [`REF_MIN`] bytes in a [`SharedBuffer`]: the receiver reads them straight
//! out of the sender's memory through its mapping, so they are copied once. A
//! receive-and-reduce reduces either as it arrives. Waiting ranks
//! poll briefly, then sleep on a doorbell socket until a peer wakes them.
//!
//! [`ShmTransport`] is the transport's entry in a communicator's list: it
//! connects ranks with the same host identity, and when every rank shares
//! the host it also offers the [`Board`], one segment of group memory for
//! the whole communicator. Its connector sets up the segments through the
//! rendezvous store. The lower rank of a pair creates the segment and
//! offers it; the higher rank maps it, unlinks the file and answers; so a
//! crash leaves nothing in `/dev/shm` beyond the moment of set-up. Any
//! failure of a pair (no `/dev/shm`, a full one) is reported for that pair,
//! the same on both sides, so that the pair falls to the next transport.

mod board;
mod cma;
mod doorbell;
mod link;
mod region;
mod segment;

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Instant,
};

use ccl_core::{
    Connector, Error, GroupMemory, Link, LinkClass, LinkFuture, PairResult, PeerInfo, RepollWhen,
    Result, Setup, Spin, Transport,
};
use ccl_rendezvous::Config;
use nix::unistd::Pid;

pub use board::{board_slot_bytes, connect_board, Board, HEADS, INLINE, SMALL};
pub use link::REF_MIN;
pub use region::SharedBuffer;

use doorbell::{Bell, Doorbell};
use link::{ShmLink, CMA_OK, CONTROL};
use segment::Segment;

/// Where segments live.
pub const SHM_DIR: &str = "/dev/shm";

/// Default of `CCL_SHM_BYTES`: 1 MiB per pair. Large messages stream
/// through rings this small while both sides copy, and the rings stay in
/// the caches: on a 2-core VM, 4 MiB per pair made 2-rank sendrecv of
/// 0.5–8 MiB 1.5–1.8× slower and a ring allreduce of 4–64 MiB 1.2–2.4×
/// slower.
pub const DEFAULT_BYTES: usize = 1 << 20;

/// The class of shared-memory links: each message of a schedule costs a
/// hand-shake between two processes, so pieces are large (measured on a
/// 2-core VM: 4 MiB pieces give 256 MiB allreduce 1.2–1.3× the bus
/// bandwidth of 512 KiB ones), and the links progress in memory.
pub const CLASS: LinkClass = LinkClass {
    name: "shm",
    piece_bytes: 4 << 20,
    repoll: RepollWhen::Always,
    progress_thread: false,
};

/// How shared-memory links are set up.
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// Bytes of shared memory per pair (both rings and the control page),
    /// `CCL_SHM_BYTES`.
    pub bytes: usize,
    /// Directory of the segments (a tmpfs).
    pub dir: PathBuf,
    /// When ranks read each other's memory directly (`CCL_SHM_CMA`).
    pub cma: DirectReads,
}

/// When ranks read (and write) each other's memory directly rather than
/// copying through the rings and the board's slots (`CCL_SHM_CMA`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirectReads {
    /// Never (`0`).
    Never,
    /// Where the kernel allows it, except that the board copies memory
    /// outside shared buffers through the kernel only where board set-up
    /// timed that copy as paying (`auto`, the default; see
    /// [`GroupMemory::kernel_copies_pay`]).
    Timed,
    /// Only out of shared buffers, through their mappings, as where the
    /// timing finds the kernel's copies slow (`mapped`).
    Mapped,
    /// Wherever the kernel allows it (`1`).
    Always,
}

impl DirectReads {
    /// The value of `CCL_SHM_CMA`: `auto` (or unset), `mapped`, `1` or `0`.
    fn from_config(config: &Config) -> Result<DirectReads> {
        match config.knob("CCL_SHM_CMA").map(str::trim) {
            None | Some("auto") => Ok(DirectReads::Timed),
            Some("mapped") => Ok(DirectReads::Mapped),
            Some("1") => Ok(DirectReads::Always),
            Some("0") => Ok(DirectReads::Never),
            Some(v) => Err(Error::Config(format!(
                "CCL_SHM_CMA={v:?}: expected 0, 1, auto or mapped"
            ))),
        }
    }
}

impl Default for ShmOptions {
    fn default() -> ShmOptions {
        ShmOptions {
            bytes: DEFAULT_BYTES,
            dir: PathBuf::from(SHM_DIR),
            cma: DirectReads::Timed,
        }
    }
}

impl ShmOptions {
    /// The options `CCL_SHM_BYTES` (64 KiB to 1 GiB) and `CCL_SHM_CMA` set.
    pub fn from_config(config: &Config) -> Result<ShmOptions> {
        Ok(ShmOptions {
            bytes: config.knob_number("CCL_SHM_BYTES", DEFAULT_BYTES, 64 * 1024..=1 << 30)?,
            cma: DirectReads::from_config(config)?,
            ..ShmOptions::default()
        })
    }
}

/// Shared memory between ranks of one host (see the crate docs).
#[derive(Clone, Debug, Default)]
pub struct ShmTransport {
    options: ShmOptions,
}

impl ShmTransport {
    /// The transport with these options.
    pub fn new(options: ShmOptions) -> ShmTransport {
        ShmTransport { options }
    }

    /// The transport with the options `config` sets ([`ShmOptions::from_config`]).
    pub fn from_config(config: &Config) -> Result<ShmTransport> {
        Ok(ShmTransport::new(ShmOptions::from_config(config)?))
    }
}

/// Logs the first board that could not be set up in this process.
static BOARD_REFUSED: AtomicBool = AtomicBool::new(false);

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn class(&self) -> LinkClass {
        CLASS
    }

    fn can_connect(&self, a: &PeerInfo, b: &PeerInfo) -> bool {
        a.host == b.host
    }

    fn prepare(&self, setup: &Setup) -> Result<Box<dyn Connector>> {
        Ok(Box::new(ShmConnector {
            setup: setup.clone(),
            options: self.options.clone(),
        }))
    }

    fn connect_group(&self, setup: &Setup, spin: Spin) -> Result<Option<Arc<dyn GroupMemory>>> {
        let board = connect_board(
            setup.rank,
            setup.world_size,
            setup.comm,
            &*setup.store,
            &self.options.dir,
            setup.timeout,
            spin,
            self.options.cma,
        )?;
        Ok(match board {
            Ok(b) => Some(Arc::new(b)),
            Err(why) => {
                if !BOARD_REFUSED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        rank = setup.rank,
                        "shared-memory board unavailable, collectives use the links: {why}"
                    );
                }
                None
            }
        })
    }
}

/// The second phase of [`ShmTransport`]'s set-up.
struct ShmConnector {
    setup: Setup,
    options: ShmOptions,
}

impl Connector for ShmConnector {
    fn connect<'a>(
        self: Box<Self>,
        peers: &'a [usize],
        _: &'a [PeerInfo],
        spin: Spin,
    ) -> LinkFuture<'a, Vec<PairResult>> {
        // Runs when polled, inside the runtime whose reactor serves the links.
        Box::pin(async move { connect(&self.setup, peers, &self.options, spin) })
    }
}

/// What one side of a pair tells the other through the store.
struct Offer {
    pid: i32,
    bell: String,
    /// Address of the segment in the sender's memory (to probe cross-memory attach).
    base: u64,
    path: String,
}

impl Offer {
    fn encode(&self) -> String {
        format!(
            "ok {} {} {:x} {}",
            self.pid, self.bell, self.base, self.path
        )
    }

    /// Parses `ok pid bell base path`, or returns the reason of `err reason`.
    fn decode(v: &[u8]) -> std::result::Result<Offer, String> {
        let s = std::str::from_utf8(v).map_err(|_| "offer is not UTF-8".to_string())?;
        if let Some(reason) = s.strip_prefix("err ") {
            return Err(reason.to_string());
        }
        let mut f = s.splitn(5, ' ');
        let bad = || format!("malformed offer {s:?}");
        if f.next() != Some("ok") {
            return Err(bad());
        }
        let pid = f.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let bell = f.next().ok_or_else(bad)?.to_string();
        let base = f
            .next()
            .and_then(|b| u64::from_str_radix(b, 16).ok())
            .ok_or_else(bad)?;
        let path = f.next().unwrap_or("").to_string();
        Ok(Offer {
            pid,
            bell,
            base,
            path,
        })
    }
}

/// Segments created by this process so far (part of their names).
pub(crate) static SEGMENTS: AtomicU64 = AtomicU64::new(0);

/// Sets up shared-memory links from `setup.rank` to each of `peers` (ranks
/// of this host), through the communicator's store. Every peer must call
/// this with this rank among its peers. Must run inside a tokio runtime,
/// whose reactor then serves the links.
///
/// Returns one result per peer, in the order of `peers`. A pair that cannot
/// use shared memory fails on both sides with a reason; a store failure or the
/// deadline fails the whole call.
fn connect(
    setup: &Setup,
    peers: &[usize],
    opts: &ShmOptions,
    spin: Spin,
) -> Result<Vec<PairResult>> {
    if peers.is_empty() {
        return Ok(Vec::new());
    }
    let (rank, comm, store) = (setup.rank, setup.comm, &*setup.store);
    let deadline = Instant::now() + setup.timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let cap = link::capacity(opts.bytes);
    if cap < 4096 {
        return Err(Error::InvalidArgument(format!(
            "{} bytes of shared memory per pair is too little",
            opts.bytes
        )));
    }
    let len = CONTROL + 2 * cap;
    let bell =
        Arc::new(Doorbell::bind(comm).map_err(|e| Error::io("binding the doorbell socket", e))?);
    let pid = std::process::id() as i32;
    let key = |a: usize, b: usize, what: &str| format!("shm/{a}-{b}/{what}");

    // The link to `p` over a segment both have mapped, once `p` told how to
    // reach it: probes whether this side can read p's memory (the sender
    // looks at that word before sending by reference).
    let link_to = |p: usize, seg: Segment, o: &Offer| -> Result<Arc<dyn Link>> {
        let peer_bell = Bell::new(&o.bell)
            .map_err(|e| Error::io(format!("rank {rank}: doorbell of rank {p}"), e))?;
        let can_read =
            opts.cma != DirectReads::Never && cma::probe(Pid::from_raw(o.pid), o.base, link::MAGIC);
        seg.word(link::side(usize::from(rank > p)) + CMA_OK)
            .store(if can_read { 1 } else { 2 }, Ordering::Release);
        Ok(Arc::new(ShmLink::new(
            rank,
            p,
            comm,
            seg,
            cap,
            bell.clone(),
            peer_bell,
            Pid::from_raw(o.pid),
            spin,
        )))
    };

    // 1. Offer a segment to every higher peer.
    let mut created: Vec<Option<std::result::Result<Segment, String>>> = Vec::new();
    for &p in peers {
        if p < rank {
            created.push(None);
            continue;
        }
        let name = format!(
            "ccl-{pid}-{}-{comm:016x}-{rank}-{p}",
            SEGMENTS.fetch_add(1, Ordering::Relaxed)
        );
        let seg = Segment::create(&opts.dir, &name, len)
            .map_err(|e| format!("creating {}: {e}", opts.dir.join(&name).display()));
        let offer = match &seg {
            Ok(s) => {
                link::init(s, cap);
                Offer {
                    pid,
                    bell: bell.name().to_string(),
                    base: s.base() as u64,
                    path: s.path().display().to_string(),
                }
                .encode()
            }
            Err(e) => format!("err {e}"),
        };
        store.set(&key(rank, p, "offer"), offer.as_bytes())?;
        created.push(Some(seg));
    }

    // 2. Take the offers of lower peers and answer.
    let mut results: Vec<Option<PairResult>> = (0..peers.len()).map(|_| None).collect();
    for (i, &p) in peers.iter().enumerate() {
        if p > rank {
            continue;
        }
        let offer = store.get(&key(p, rank, "offer"), left())?;
        let opened = Offer::decode(&offer).and_then(|o| {
            let seg = Segment::open(Path::new(&o.path), len)
                .map_err(|e| format!("rank {rank} opening {}: {e}", o.path))?;
            seg.unlink();
            link::check(&seg, cap)?;
            Ok((seg, o))
        });
        let answer = match &opened {
            Ok((seg, _)) => Offer {
                pid,
                bell: bell.name().to_string(),
                base: seg.base() as u64,
                path: String::new(),
            }
            .encode(),
            Err(e) => format!("err {e}"),
        };
        store.set(&key(p, rank, "answer"), answer.as_bytes())?;
        results[i] = Some(match opened {
            Ok((seg, o)) => Ok(link_to(p, seg, &o)?),
            Err(e) => Err(e),
        });
    }

    // 3. Read the answers of higher peers; the file goes in every case.
    for (i, &p) in peers.iter().enumerate() {
        let Some(seg) = created[i].take() else {
            continue;
        };
        let answer = store.get(&key(rank, p, "answer"), left());
        if let Ok(s) = &seg {
            s.unlink();
        }
        let answer = Offer::decode(&answer?);
        results[i] = Some(match (seg, answer) {
            (Ok(seg), Ok(o)) => Ok(link_to(p, seg, &o)?),
            (Err(e), _) | (_, Err(e)) => Err(e),
        });
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every peer is lower or higher"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `CCL_SHM_CMA` takes `auto` (also unset or empty), `mapped`, `1` and
    /// `0`; anything else is an error naming it and what it takes.
    #[test]
    fn direct_reads_follow_ccl_shm_cma() {
        let with = |v: Option<&str>| {
            let vars = v.map(|v| ("CCL_SHM_CMA", v));
            DirectReads::from_config(&Config::from_vars(vars).unwrap())
        };
        for (v, want) in [
            (None, DirectReads::Timed),
            (Some(""), DirectReads::Timed),
            (Some("auto"), DirectReads::Timed),
            (Some("mapped"), DirectReads::Mapped),
            (Some("1"), DirectReads::Always),
            (Some("0"), DirectReads::Never),
        ] {
            assert_eq!(with(v).unwrap(), want, "{v:?}");
        }
        let e = with(Some("yes")).unwrap_err().to_string();
        assert!(
            e.contains("CCL_SHM_CMA=\"yes\"") && e.contains("auto or mapped"),
            "{e}"
        );
    }
}
