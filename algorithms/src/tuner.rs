//! The tuner: which algorithm to run for a collective of a given size, world
//! size and class of links, from a table measured by `ccl-bench tune` and
//! checked in as `algorithms/tuning.table`, with `CCL_ALGO`'s overrides and
//! the defaults where the table is silent.
//!
//! The table has one line per (collective, links, ranks, size range), where
//! links is the name of a class of links ([`ccl_core::LinkClass`]):
//!
//! ```text
//! # collective  links  ranks  up_to_bytes  algorithm
//! allreduce     shm    2      16384        board
//! allreduce     shm    2      -            ring
//! ```
//!
//! A line covers buffer sizes above the previous line's `up_to_bytes` (of the
//! same collective, links and ranks) up to its own; `-` means no limit. Sizes
//! count the whole buffer as `ccl-bench` does ([`Collective::buffer_bytes`]).
//! For a world size the table lacks, the nearest measured one (in log scale)
//! answers.

use std::{collections::HashMap, sync::OnceLock};

use ccl_core::{Collective, CollectiveKind};

use crate::{Algorithm, Choice};

/// Largest call that the board runs where the table is silent.
const DEFAULT_BOARD_BYTES: u64 = 16 * 1024;
/// Allreduces up to this size use recursive doubling (log2 n rounds) where
/// the table is silent and there is no group memory.
const SMALL_ALLREDUCE_BYTES: u64 = 64 * 1024;

/// One line of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub collective: CollectiveKind,
    /// The class of links it was measured over ([`ccl_core::LinkClass::name`]).
    pub links: String,
    pub ranks: usize,
    /// Largest buffer (bytes) this line covers; `None`: any size.
    pub up_to_bytes: Option<u64>,
    pub choice: Choice,
}

/// A parsed tuning table.
#[derive(Clone, Debug, Default)]
pub struct Table {
    entries: Vec<Entry>,
}

/// The table this build carries.
const BUILTIN: &str = include_str!("../tuning.table");

impl Table {
    /// The table checked into the repository (parsed once).
    pub fn builtin() -> &'static Table {
        static TABLE: OnceLock<Table> = OnceLock::new();
        TABLE.get_or_init(|| {
            Table::parse(BUILTIN).unwrap_or_else(|e| {
                tracing::error!("algorithms/tuning.table: {e}; using the default algorithms");
                Table::default()
            })
        })
    }

    /// Parses a table; errors name the line.
    pub fn parse(text: &str) -> Result<Table, String> {
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
            let class_name = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
            if !links.chars().all(class_name) {
                return Err(bad(format!(
                    "links '{links}' is not a link class name (lower-case letters, digits, -)"
                )));
            }
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
                links: links.to_string(),
                ranks,
                up_to_bytes,
                choice,
            });
        }
        Ok(Table { entries })
    }

    /// The lines that answer for `ranks` ranks linked by links of class
    /// `links` (the nearest measured world size of each collective): what a
    /// communicator keeps, so that [`Table::choose`] scans a few lines per call.
    pub fn narrowed(&self, ranks: usize, links: &str) -> Table {
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
                entries.extend(lines().filter(|e| e.ranks == nearest).cloned());
            }
        }
        Table { entries }
    }

    /// Every line, in table order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The measured best choice for `kind` over a buffer of `bytes` (see
    /// [`Collective::buffer_bytes`]) on `ranks` ranks linked by `links`, if
    /// the table covers that collective and class of links.
    pub fn pick(
        &self,
        kind: CollectiveKind,
        bytes: u64,
        ranks: usize,
        links: &str,
    ) -> Option<Choice> {
        self.narrowed(ranks, links).choose(kind, bytes)
    }

    /// [`Table::pick`] on a table already [narrowed](Table::narrowed) to one
    /// world size and class of links.
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

/// Algorithms forced per collective, as `CCL_ALGO` spells them: one
/// algorithm for every collective that has it (`ring`), or
/// `kind=algorithm` pairs separated by commas (`allreduce=rd,allgather=ring/1M`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overrides(HashMap<CollectiveKind, Choice>);

impl Overrides {
    /// The forced choice for `kind`, if any.
    pub fn get(&self, kind: CollectiveKind) -> Option<Choice> {
        self.0.get(&kind).copied()
    }
}

impl std::str::FromStr for Overrides {
    type Err = String;
    fn from_str(spec: &str) -> Result<Overrides, String> {
        let bad = |m: String| format!("CCL_ALGO={spec:?}: {m}");
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
        Ok(Overrides(map))
    }
}

/// A communicator's tuner: picks the algorithm of each call from the
/// overrides, the table's lines for its world size and links, and the
/// defaults where both are silent.
///
/// Every one of those rules is a choice per collective that changes only at
/// a size limit (a table line's, or a default's), so the tuner works them out
/// once, at construction, as a few size ranges per collective
/// ([`Tuner::choose`] then reads the range of the call's size).
#[derive(Clone, Debug)]
pub struct Tuner {
    /// For each collective (by its wire code), the choice for each range of
    /// buffer sizes: `(up_to_bytes, choice)` in increasing order, the last
    /// up to `u64::MAX`.
    ranges: Vec<Vec<(u64, Choice)>>,
    world_size: usize,
    group_memory: bool,
}

impl Tuner {
    /// The tuner of a communicator of `world_size` ranks whose links are of
    /// class `links`, with or without group memory.
    pub fn new(
        table: &Table,
        overrides: Overrides,
        world_size: usize,
        links: &str,
        group_memory: bool,
    ) -> Tuner {
        let rules = Rules {
            table: table.narrowed(world_size, links),
            overrides,
            group_memory,
        };
        let mut ranges = vec![Vec::new(); CollectiveKind::ALL.len() + 1];
        for kind in CollectiveKind::ALL {
            let mut limits: Vec<u64> = rules
                .table
                .entries
                .iter()
                .filter(|e| e.collective == kind)
                .filter_map(|e| e.up_to_bytes)
                .chain([DEFAULT_BOARD_BYTES, SMALL_ALLREDUCE_BYTES, u64::MAX])
                .collect();
            limits.sort_unstable();
            limits.dedup();
            let mut kind_ranges: Vec<(u64, Choice)> = Vec::with_capacity(limits.len());
            for up_to in limits {
                let choice = rules.choose(kind, up_to);
                match kind_ranges.last_mut() {
                    Some(last) if last.1 == choice => last.0 = up_to,
                    _ => kind_ranges.push((up_to, choice)),
                }
            }
            ranges[kind as usize] = kind_ranges;
        }
        Tuner {
            ranges,
            world_size,
            group_memory,
        }
    }

    /// Whether the communicator has group memory (the board algorithms).
    pub fn has_group_memory(&self) -> bool {
        self.group_memory
    }

    /// The choice for `coll`: the override if any; else what the table
    /// measured best for this size; else the board for calls up to 16 KiB
    /// and board-direct for larger allreduces and reduces, where there is
    /// group memory; recursive doubling for other allreduces up to 64 KiB;
    /// the first algorithm of the collective otherwise. A group algorithm
    /// is never chosen without group memory.
    #[inline]
    pub fn choose(&self, coll: &Collective) -> Choice {
        let bytes = coll.buffer_bytes(self.world_size);
        let ranges = &self.ranges[coll.kind as usize];
        // The last range reaches u64::MAX: the fallback is never taken.
        ranges
            .iter()
            .find(|(up_to, _)| bytes <= *up_to)
            .map_or(Algorithm::Ring.into(), |(_, c)| *c)
    }
}

/// The rules [`Tuner::choose`] follows, as [`Tuner::new`] works them out.
struct Rules {
    table: Table,
    overrides: Overrides,
    group_memory: bool,
}

impl Rules {
    /// The choice for a `kind` call over a buffer of `bytes`.
    fn choose(&self, kind: CollectiveKind, bytes: u64) -> Choice {
        let can = |a: Algorithm| a.implements(kind) && (!a.on_group_memory() || self.group_memory);
        let chosen = self
            .overrides
            .get(kind)
            .or_else(|| self.table.choose(kind, bytes));
        if let Some(c) = chosen.filter(|c| can(c.algorithm)) {
            return c;
        }
        let algorithm = if bytes <= DEFAULT_BOARD_BYTES && can(Algorithm::Board) {
            Algorithm::Board
        } else if can(Algorithm::BoardDirect) {
            Algorithm::BoardDirect
        } else if kind == CollectiveKind::AllReduce && bytes <= SMALL_ALLREDUCE_BYTES {
            Algorithm::RecursiveDoubling
        } else {
            Algorithm::for_kind(kind)
                .first()
                .copied()
                .unwrap_or(Algorithm::Ring)
        };
        algorithm.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ccl_core::DataType;

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
        let t = Table::parse(TABLE).unwrap();
        let ar = CollectiveKind::AllReduce;
        assert_eq!(t.pick(ar, 8, 2, "shm"), Some(Algorithm::Board.into()));
        assert_eq!(t.pick(ar, 16384, 2, "shm"), Some(Algorithm::Board.into()));
        assert_eq!(t.pick(ar, 16385, 2, "shm"), Some(Algorithm::Ring.into()));
        assert_eq!(
            t.pick(ar, 1 << 20, 8, "tcp"),
            Some(Algorithm::DoubleBinaryTree.into())
        );
        // 6 ranks: 8 is nearer than 2 in log scale; 3 ranks: 2 is.
        assert_eq!(
            t.pick(ar, 1 << 20, 6, "tcp"),
            Some(Algorithm::DoubleBinaryTree.into())
        );
        assert_eq!(
            t.pick(ar, 1 << 20, 3, "tcp"),
            Some(Choice {
                algorithm: Algorithm::Ring,
                piece_bytes: Some(128 << 10)
            })
        );
        // 4 ranks sits halfway: the larger world size answers.
        assert_eq!(
            t.pick(ar, 1 << 20, 4, "tcp"),
            Some(Algorithm::DoubleBinaryTree.into())
        );
        assert_eq!(t.pick(CollectiveKind::Broadcast, 8, 2, "tcp"), None);
    }

    #[test]
    fn bad_lines_are_named() {
        for bad in [
            "allreduce shm 2 16384",
            "allreduce SHM 2 - ring",
            "allreduce shm 0 - ring",
            "allreduce shm 2 lots ring",
            "allreduce shm 2 - chain",
            "frobnicate shm 2 - ring",
            "sendrecv shm 2 - board",
            "allreduce shm 2 - ring/0",
            "allreduce shm 2 - board/1M",
        ] {
            let e = Table::parse(&format!("# x\n{bad}\n")).unwrap_err();
            assert!(e.starts_with("line 2:"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_builtin_table_parses() {
        let t = Table::parse(BUILTIN).unwrap();
        assert!(!t.entries().is_empty());
    }

    #[test]
    fn overrides_parse() {
        let get = |o: &Overrides, k| o.get(k).map(|c| c.to_string());
        let o: Overrides = "ring".parse().unwrap();
        assert_eq!(get(&o, CollectiveKind::AllReduce).as_deref(), Some("ring"));
        assert_eq!(get(&o, CollectiveKind::AllGather).as_deref(), Some("ring"));
        assert_eq!(get(&o, CollectiveKind::Broadcast), None);
        let o: Overrides = "allreduce=rd, broadcast=tree, allgather=ring/256K"
            .parse()
            .unwrap();
        assert_eq!(get(&o, CollectiveKind::AllReduce).as_deref(), Some("rd"));
        assert_eq!(get(&o, CollectiveKind::Broadcast).as_deref(), Some("tree"));
        assert_eq!(
            o.get(CollectiveKind::AllGather).and_then(|c| c.piece_bytes),
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
            let e = bad.parse::<Overrides>().unwrap_err();
            assert!(e.starts_with("CCL_ALGO="), "{bad}: {e}");
        }
    }

    #[test]
    fn the_ranges_answer_as_the_rules_at_every_size() {
        let table = Table::builtin();
        // Element counts of u8 up to 2^50, whose buffers (times the ranks)
        // stay far from overflowing.
        let mut sizes: Vec<u64> = (0..50)
            .flat_map(|b| [1u64 << b, (1 << b) + 1, (1 << b) - 1])
            .collect();
        sizes.extend(
            table
                .entries()
                .iter()
                .filter_map(|e| e.up_to_bytes)
                .flat_map(|l| [l - 1, l, l + 1]),
        );
        let overrides: [Overrides; 2] = [
            Overrides::default(),
            "allreduce=ring/1M,broadcast=board".parse().unwrap(),
        ];
        for links in ["shm", "tcp", "loopback"] {
            for world_size in [2, 3, 4, 8, 64] {
                for group_memory in [false, true] {
                    for o in &overrides {
                        let tuner = Tuner::new(table, o.clone(), world_size, links, group_memory);
                        let rules = Rules {
                            table: table.narrowed(world_size, links),
                            overrides: o.clone(),
                            group_memory,
                        };
                        for kind in CollectiveKind::ALL {
                            for &bytes in &sizes {
                                let coll = Collective {
                                    kind,
                                    count: bytes as usize,
                                    dtype: DataType::U8,
                                    op: ccl_core::ReduceOp::Sum,
                                    root: 0,
                                };
                                let bytes = coll.buffer_bytes(world_size);
                                assert_eq!(
                                    tuner.choose(&coll),
                                    rules.choose(kind, bytes),
                                    "{kind} of {bytes} B, {world_size} ranks over {links}, \
                                     group memory {group_memory}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn overrides_then_the_table_then_the_defaults() {
        let table = Table::parse(TABLE).unwrap();
        let ar = |count: usize| Collective::new(CollectiveKind::AllReduce, DataType::F32, count);
        let tcp = Tuner::new(&table, Overrides::default(), 2, "tcp", false);
        assert_eq!(tcp.choose(&ar(2)).algorithm, Algorithm::RecursiveDoubling);
        assert_eq!(tcp.choose(&ar(1 << 20)).to_string(), "ring/128K");
        // The table is silent on broadcast: its first algorithm.
        let bc = Collective::new(CollectiveKind::Broadcast, DataType::F32, 2);
        assert_eq!(tcp.choose(&bc).algorithm, Algorithm::BinomialTree);
        // A class the table has no line for: the defaults.
        let other = Tuner::new(&table, Overrides::default(), 2, "loopback", false);
        assert_eq!(other.choose(&ar(1 << 20)).algorithm, Algorithm::Ring);
        // With group memory, the defaults prefer the board.
        let group = Tuner::new(&table, Overrides::default(), 2, "loopback", true);
        assert_eq!(group.choose(&bc).algorithm, Algorithm::Board);
        assert_eq!(group.choose(&ar(1 << 20)).algorithm, Algorithm::BoardDirect);
        // The table's board line is ignored without group memory.
        let shm = Tuner::new(&table, Overrides::default(), 2, "shm", false);
        assert_eq!(shm.choose(&ar(2)).algorithm, Algorithm::RecursiveDoubling);
        // An override wins over the table, where it can run.
        let forced = Tuner::new(&table, "allreduce=direct".parse().unwrap(), 2, "tcp", false);
        assert_eq!(forced.choose(&ar(1 << 20)).algorithm, Algorithm::Direct);
        let board = Tuner::new(&table, "board".parse().unwrap(), 2, "tcp", false);
        assert_eq!(board.choose(&ar(2)).algorithm, Algorithm::RecursiveDoubling);
    }
}
