//! Shared-memory links for ccl between ranks on one host.
//!
//! Each pair of ranks shares one segment in `/dev/shm` holding a ring per
//! direction ([`link`] describes the layout and protocol). Small messages are
//! copied through the ring; large ones are read straight out of the sender's
//! memory with `process_vm_readv` (cross-memory attach), so they are copied
//! once, and a receive-and-reduce reduces them as they arrive. Waiting ranks
//! poll briefly, then sleep on a doorbell socket until a peer wakes them.
//!
//! [`connect`] sets up the segments through the rendezvous store. The lower
//! rank of a pair creates the segment and offers it; the higher rank maps it,
//! unlinks the file and answers; so a crash leaves nothing in `/dev/shm`
//! beyond the moment of set-up. Any failure of a pair (no `/dev/shm`, a full
//! one) is reported for that pair, the same on both sides, so that the caller
//! can fall back to another transport.

mod board;
mod doorbell;
mod link;
mod segment;
mod window;

use std::{
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use ccl_core::{Error, Link, Result, Spin, Store};
use nix::{sys::uio::RemoteIoVec, unistd::Pid};

pub use board::{board_slot_bytes, connect_board, Board, Deadline, Round};
pub use link::REF_MIN;

use doorbell::{Bell, Doorbell};
use link::{ShmLink, CMA_OK, CONTROL};
use segment::Segment;

/// Where segments live.
pub const SHM_DIR: &str = "/dev/shm";

/// How shared-memory links are set up.
#[derive(Clone, Debug)]
pub struct ShmOptions {
    /// Bytes of shared memory per pair (both rings and the control page).
    pub bytes: usize,
    /// Directory of the segments (a tmpfs).
    pub dir: PathBuf,
    /// Deadline of the set-up.
    pub timeout: Duration,
    /// How waiting threads poll before they sleep.
    pub spin: Spin,
    /// Read large messages straight from the peer's memory where the kernel
    /// allows it (`false`: always copy through the ring).
    pub cma: bool,
}

impl Default for ShmOptions {
    fn default() -> ShmOptions {
        ShmOptions {
            bytes: ccl_rendezvous::config::DEFAULT_SHM_BYTES,
            dir: PathBuf::from(SHM_DIR),
            timeout: ccl_core::DEFAULT_TIMEOUT,
            spin: Spin {
                window: Duration::from_micros(50),
                yield_between: false,
                repoll: false,
            },
            cma: true,
        }
    }
}

/// Identifies the host (and namespaces) this process runs in: ranks with the
/// same identity can share memory and read each other's memory.
///
/// Hostname and boot id name the machine; the network, mount and PID
/// namespaces are part of it, so ranks in separate network namespaces (how
/// tests simulate several hosts) count as separate hosts.
pub fn host_id() -> String {
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

/// Logs the first refusal of cross-memory attach in this process.
static CMA_REFUSED: AtomicBool = AtomicBool::new(false);

/// Whether this process can read `peer`'s segment at `base` through
/// cross-memory attach (ptrace policy may forbid it): reads the magic word.
fn probe_cma(peer: Pid, base: u64) -> bool {
    let mut word = [0u8; 8];
    let ok =
        process_vm_read(peer, base, &mut word).is_ok() && u64::from_le_bytes(word) == link::MAGIC;
    if !ok && !CMA_REFUSED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "cross-memory attach to pid {peer} refused (ptrace policy?): large shared-memory messages are copied twice"
        );
    }
    ok
}

fn process_vm_read(pid: Pid, addr: u64, into: &mut [u8]) -> nix::Result<usize> {
    let len = into.len();
    nix::sys::uio::process_vm_readv(
        pid,
        &mut [std::io::IoSliceMut::new(into)],
        &[RemoteIoVec {
            base: addr as usize,
            len,
        }],
    )
}

/// The outcome for one peer: a link, or why shared memory cannot be used with it.
pub type PairResult = std::result::Result<Arc<dyn Link>, String>;

/// Sets up shared-memory links from `rank` to each of `peers` (ranks of this
/// host), through `store` (scoped to the communicator `comm`). Every peer must
/// call this with `rank` among its peers. Must run inside a tokio runtime,
/// whose reactor then serves the links.
///
/// Returns one result per peer, in the order of `peers`. A pair that cannot
/// use shared memory fails on both sides with a reason; a store failure or the
/// deadline fails the whole call.
pub fn connect(
    rank: usize,
    comm: u64,
    store: &dyn Store,
    peers: &[usize],
    opts: &ShmOptions,
) -> Result<Vec<PairResult>> {
    if peers.is_empty() {
        return Ok(Vec::new());
    }
    let deadline = Instant::now() + opts.timeout;
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
        let can_read = opts.cma && probe_cma(Pid::from_raw(o.pid), o.base);
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
            opts.spin,
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
