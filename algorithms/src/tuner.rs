//! The tuner: which algorithm to run for a collective of a given size, world
//! size and kind of links, from a table measured by `ccl-bench tune` and
//! checked in as `algorithms/tuning.table`.
//!
//! The table has one line per (collective, links, ranks, size range):
//!
//! ```text
//! # collective  links  ranks  up_to_bytes  algorithm
//! allreduce     shm    2      16384        board
//! allreduce     shm    2      -            ring
//! ```
//!
//! A line covers buffer sizes above the previous line's `up_to_bytes` (of the
//! same collective, links and ranks) up to its own; `-` means no limit. Sizes
//! count the whole buffer as `ccl-bench` does ([`buffer_bytes`]). For a world
//! size the table lacks, the nearest measured one (in log scale) answers.

use std::sync::OnceLock;

use ccl_core::CollectiveKind;

use crate::Choice;

/// How a communicator's ranks are linked, as far as the tuner tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Links {
    /// Every peer through shared memory (all ranks on one host).
    SharedMemory,
    /// Some peer over the network.
    Network,
}

impl Links {
    /// The table's name: `shm` or `tcp`.
    pub fn name(self) -> &'static str {
        match self {
            Links::SharedMemory => "shm",
            Links::Network => "tcp",
        }
    }
}

/// One line of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub collective: CollectiveKind,
    pub links: Links,
    pub ranks: usize,
    /// Largest buffer (bytes) this line covers; `None`: any size.
    pub up_to_bytes: Option<u64>,
    pub choice: Choice,
}

/// A parsed tuning table.
#[derive(Clone, Debug, Default)]
pub struct Tuner {
    entries: Vec<Entry>,
}

/// Bytes of the whole buffer of a call, as the table counts them: the
/// collective's count times the element size, times the world size for the
/// collectives whose count is per rank.
pub fn buffer_bytes(kind: CollectiveKind, count: usize, elem: usize, ranks: usize) -> u64 {
    let per_rank = matches!(
        kind,
        CollectiveKind::AllGather
            | CollectiveKind::ReduceScatter
            | CollectiveKind::AllToAll
            | CollectiveKind::Gather
            | CollectiveKind::Scatter
    );
    (count * elem * if per_rank { ranks } else { 1 }) as u64
}

/// The table this build carries.
const BUILTIN: &str = include_str!("../tuning.table");

impl Tuner {
    /// The table checked into the repository (parsed once).
    pub fn builtin() -> &'static Tuner {
        static TUNER: OnceLock<Tuner> = OnceLock::new();
        TUNER.get_or_init(|| {
            Tuner::parse(BUILTIN).unwrap_or_else(|e| {
                tracing::error!("algorithms/tuning.table: {e}; using the default algorithms");
                Tuner::default()
            })
        })
    }

    /// Parses a table; errors name the line.
    pub fn parse(text: &str) -> Result<Tuner, String> {
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |m: String| format!("line {}: {m}: {line:?}", i + 1);
            let f: Vec<&str> = line.split_whitespace().collect();
            let [collective, links, ranks, up_to, algorithm] = f[..] else {
                return Err(bad("expected 5 fields".into()));
            };
            let collective: CollectiveKind = collective.parse().map_err(bad)?;
            let links = match links {
                "shm" => Links::SharedMemory,
                "tcp" => Links::Network,
                other => return Err(bad(format!("links '{other}' is not shm or tcp"))),
            };
            let ranks: usize = ranks
                .parse()
                .ok()
                .filter(|&r| r > 0)
                .ok_or_else(|| bad("ranks is not a positive number".into()))?;
            let up_to_bytes = match up_to {
                "-" => None,
                n => Some(
                    n.parse()
                        .map_err(|_| bad("up_to_bytes is not a number".into()))?,
                ),
            };
            let choice: Choice = algorithm.parse().map_err(bad)?;
            if !choice.algorithm.implements(collective) {
                return Err(bad(format!(
                    "{} does not implement {collective}",
                    choice.algorithm
                )));
            }
            entries.push(Entry {
                collective,
                links,
                ranks,
                up_to_bytes,
                choice,
            });
        }
        Ok(Tuner { entries })
    }

    /// The lines that answer for `ranks` ranks linked by `links` (the
    /// nearest measured world size of each collective): what a communicator
    /// keeps, so that [`Tuner::pick`] scans a few lines per call.
    pub fn narrowed(&self, ranks: usize, links: Links) -> Tuner {
        let mut entries = Vec::new();
        for kind in CollectiveKind::ALL {
            let lines = || {
                self.entries
                    .iter()
                    .filter(move |e| e.collective == kind && e.links == links)
            };
            let distance = |r: usize| ((r as f64).log2() - (ranks as f64).log2()).abs();
            if let Some(nearest) = lines()
                .map(|e| e.ranks)
                .min_by(|&a, &b| distance(a).total_cmp(&distance(b)).then(b.cmp(&a)))
            {
                entries.extend(lines().filter(|e| e.ranks == nearest).copied());
            }
        }
        Tuner { entries }
    }

    /// Every line, in table order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The measured best choice for `kind` over a buffer of `bytes` (see
    /// [`buffer_bytes`]) on `ranks` ranks linked by `links`, if the table
    /// covers that collective and kind of links.
    pub fn pick(
        &self,
        kind: CollectiveKind,
        bytes: u64,
        ranks: usize,
        links: Links,
    ) -> Option<Choice> {
        self.narrowed(ranks, links).choose(kind, bytes)
    }

    /// [`Tuner::pick`] on a table already [narrowed](Tuner::narrowed) to one
    /// world size and kind of links.
    pub fn choose(&self, kind: CollectiveKind, bytes: u64) -> Option<Choice> {
        let mut last = None;
        for e in self.entries.iter().filter(|e| e.collective == kind) {
            match e.up_to_bytes {
                Some(limit) if bytes > limit => last = Some(e.choice),
                _ => return Some(e.choice),
            }
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Algorithm;

    const TABLE: &str = "\
# a comment
allreduce shm 2 16384 board
allreduce shm 2 -     ring   # trailing comment
allreduce tcp 2 65536 rd
allreduce tcp 2 -     ring/128K
allreduce tcp 8 65536 rd
allreduce tcp 8 -     dbtree
";

    #[test]
    fn picks_by_size_ranks_and_links() {
        let t = Tuner::parse(TABLE).unwrap();
        let ar = CollectiveKind::AllReduce;
        assert_eq!(
            t.pick(ar, 8, 2, Links::SharedMemory),
            Some(Algorithm::Board.into())
        );
        assert_eq!(
            t.pick(ar, 16384, 2, Links::SharedMemory),
            Some(Algorithm::Board.into())
        );
        assert_eq!(
            t.pick(ar, 16385, 2, Links::SharedMemory),
            Some(Algorithm::Ring.into())
        );
        assert_eq!(
            t.pick(ar, 1 << 20, 8, Links::Network),
            Some(Algorithm::DoubleBinaryTree.into())
        );
        // 6 ranks: 8 is nearer than 2 in log scale; 3 ranks: 2 is.
        assert_eq!(
            t.pick(ar, 1 << 20, 6, Links::Network),
            Some(Algorithm::DoubleBinaryTree.into())
        );
        assert_eq!(
            t.pick(ar, 1 << 20, 3, Links::Network),
            Some(Choice {
                algorithm: Algorithm::Ring,
                piece_bytes: Some(128 << 10)
            })
        );
        // 4 ranks sits halfway: the larger world size answers.
        assert_eq!(
            t.pick(ar, 1 << 20, 4, Links::Network),
            Some(Algorithm::DoubleBinaryTree.into())
        );
        assert_eq!(
            t.pick(CollectiveKind::Broadcast, 8, 2, Links::Network),
            None
        );
    }

    #[test]
    fn bad_lines_are_named() {
        for bad in [
            "allreduce shm 2 16384",
            "allreduce udp 2 - ring",
            "allreduce shm 0 - ring",
            "allreduce shm 2 lots ring",
            "allreduce shm 2 - chain",
            "frobnicate shm 2 - ring",
            "sendrecv shm 2 - board",
            "allreduce shm 2 - ring/0",
            "allreduce shm 2 - board/1M",
        ] {
            let e = Tuner::parse(&format!("# x\n{bad}\n")).unwrap_err();
            assert!(e.starts_with("line 2:"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_builtin_table_parses() {
        let t = Tuner::parse(BUILTIN).unwrap();
        assert!(!t.entries().is_empty());
    }

    #[test]
    fn buffer_bytes_count_the_whole_buffer() {
        assert_eq!(buffer_bytes(CollectiveKind::AllReduce, 10, 4, 3), 40);
        assert_eq!(buffer_bytes(CollectiveKind::AllGather, 10, 4, 3), 120);
    }
}
