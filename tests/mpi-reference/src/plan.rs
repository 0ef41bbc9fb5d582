//! The seeded sequence of calls that every rank issues, to MPI and to ccl.
//!
//! A plan is a pure function of (seed, world size, whether large calls are
//! in): every rank builds the same one. It covers every collective × every
//! data type × every op valid for it, every root of every rooted collective,
//! counts 0 and 1 for every collective, primes, counts that do not divide by
//! the world size and counts around ccl's size thresholds, in-place and
//! out-of-place at random, sub-communicators from `split` (with `None` ↔
//! `MPI_UNDEFINED`, tied keys, one nested split) and from `new_group`, and
//! three large calls (≥ 16 Mi elements) per seed.

use std::fmt;

use ccl::{DataType, ReduceOp};

use crate::rng::Rng;

/// Element count of the large calls: 2^24 + 43, a prime above 16 Mi.
pub const LARGE_COUNT: usize = (1 << 24) + 43;

/// Small primes, for counts.
const SMALL_PRIMES: [usize; 25] = [
    2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97,
];
/// Larger primes around the powers of two (pieces, thresholds, chunking).
const PRIMES: [usize; 10] = [127, 251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521];

/// A collective (or point-to-point pattern) the sequence calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
    Barrier,
    /// Every rank sends to `rank + shift` and receives from `rank - shift`.
    SendRecv,
}

impl Kind {
    pub const ALL: [Kind; 10] = [
        Kind::AllReduce,
        Kind::Broadcast,
        Kind::Reduce,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::AllToAll,
        Kind::Gather,
        Kind::Scatter,
        Kind::Barrier,
        Kind::SendRecv,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "allreduce",
            Kind::Broadcast => "broadcast",
            Kind::Reduce => "reduce",
            Kind::AllGather => "allgather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::AllToAll => "alltoall",
            Kind::Gather => "gather",
            Kind::Scatter => "scatter",
            Kind::Barrier => "barrier",
            Kind::SendRecv => "send/recv",
        }
    }

    /// Takes a reduction op.
    pub const fn is_reduction(self) -> bool {
        matches!(self, Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter)
    }

    /// Takes a root.
    pub const fn is_rooted(self) -> bool {
        matches!(
            self,
            Kind::Broadcast | Kind::Reduce | Kind::Gather | Kind::Scatter
        )
    }

    /// Its count is per block: some buffer holds `size × count` elements.
    pub const fn is_blocked(self) -> bool {
        matches!(
            self,
            Kind::AllGather | Kind::ReduceScatter | Kind::AllToAll | Kind::Gather | Kind::Scatter
        )
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How floating-point inputs are drawn (integers are always uniform over all bit patterns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    /// Small integers (and integer pre-multiplication scalars): every order of
    /// evaluation is exact, so results must match MPI bit for bit.
    Exact,
    /// Random magnitudes and signs (and fractional scalars): sums, averages and
    /// products are checked within the bound of [`crate::bound`].
    Random,
}

/// One call of the sequence.
#[derive(Clone, Debug)]
pub struct Call {
    /// Position in the whole sequence (pre-order, splits included), as failures print it.
    pub index: usize,
    pub kind: Kind,
    pub dtype: DataType,
    /// Sum for the calls that take no op; for premulsum every rank derives its own scalar.
    pub op: ReduceOp,
    /// Elements per rank, or per block for [`Kind::is_blocked`] calls.
    pub count: usize,
    /// Reduced modulo the communicator's size.
    pub root: u32,
    pub in_place: bool,
    pub regime: Regime,
    /// Free random bits: send/recv shift and style, what non-roots pass as ignored buffers.
    pub variant: u32,
    /// Seed of every rank's inputs.
    pub data: u64,
}

impl Call {
    pub fn root_in(&self, size: usize) -> usize {
        self.root as usize % size
    }

    /// Send/recv: the shift (`1..size`) for a communicator of `size > 1` ranks.
    pub fn shift_in(&self, size: usize) -> usize {
        1 + (self.variant as usize >> 2) % (size - 1)
    }

    /// The call as failures print it, for a communicator of `size` ranks.
    pub fn describe(&self, size: usize) -> String {
        let mut s = format!("{} dtype={}", self.kind, self.dtype);
        if self.kind.is_reduction() {
            s += &format!(" op={}", self.op.name());
        }
        if self.kind != Kind::Barrier {
            s += &format!(" count={}", self.count);
            if self.kind.is_blocked() {
                s += " per block";
            }
        }
        if self.kind.is_rooted() {
            s += &format!(" root={}", self.root_in(size));
        }
        match self.kind {
            Kind::Barrier => {}
            Kind::SendRecv if size > 1 => {
                s += &format!(
                    " shift={} {}",
                    self.shift_in(size),
                    if self.variant & 1 == 0 {
                        "blocking"
                    } else {
                        "isend"
                    }
                )
            }
            Kind::SendRecv => {}
            _ => {
                s += if self.in_place {
                    " in-place"
                } else {
                    " out-of-place"
                }
            }
        }
        if self.dtype.is_float() && self.kind.is_reduction() {
            s += match self.regime {
                Regime::Exact => " inputs=exact",
                Regime::Random => " inputs=random",
            };
        }
        s
    }
}

/// One step of the sequence.
#[derive(Clone, Debug)]
pub enum Step {
    Call(Call),
    /// `split(colors[r], keys[r])` on the current communicator (entries
    /// indexed by rank in it), then `body` on the new communicators.
    Split {
        index: usize,
        colors: Vec<Option<u32>>,
        keys: Vec<i32>,
        body: Vec<Step>,
    },
    /// `new_group(ranks)` on the world, then `body` on the group.
    Group {
        index: usize,
        ranks: Vec<usize>,
        body: Vec<Step>,
    },
}

/// The ops valid for `dtype`.
pub fn ops_for(dtype: DataType) -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|op| !(dtype.is_float() && op.is_bitwise()))
        .collect()
}

fn random_count(rng: &mut Rng, kind: Kind, dtype: DataType, n: usize) -> usize {
    let c = match rng.below(100) {
        0..=8 => 0,
        9..=17 => 1,
        18..=41 => rng.pick(&SMALL_PRIMES),
        42..=63 => rng.range(2, 1000) as usize,
        64..=79 => rng.pick(&PRIMES),
        80..=89 => {
            // Around ccl's size thresholds (64 KiB: allreduce algorithm;
            // 512 KiB: pipelining pieces), per rank or per block, and (not
            // for blocked calls, already n times larger) times the world size.
            let bytes: usize = rng.pick(&[64 << 10, 512 << 10]);
            let mut base = bytes / dtype.size();
            if !kind.is_blocked() && rng.chance(1, 2) {
                base *= n;
            }
            return (base as i64 + rng.range(-1, 1)) as usize;
        }
        _ => rng.range(1, 300_000) as usize,
    };
    if kind.is_blocked() && c > 1000 {
        (c / n).max(1)
    } else {
        c
    }
}

fn make(rng: &mut Rng, kind: Kind, dtype: DataType, op: ReduceOp, n: usize) -> Call {
    Call {
        index: 0,
        kind,
        dtype,
        op: if kind.is_reduction() {
            op
        } else {
            ReduceOp::Sum
        },
        count: random_count(rng, kind, dtype, n),
        root: rng.below(1 << 16) as u32,
        in_place: rng.chance(1, 2),
        regime: if rng.chance(1, 2) {
            Regime::Exact
        } else {
            Regime::Random
        },
        variant: rng.next_u64() as u32,
        data: rng.next_u64(),
    }
}

fn random_call(rng: &mut Rng, n: usize) -> Call {
    let kind = rng.pick(&Kind::ALL);
    let dtype = rng.pick(&DataType::ALL);
    let op = rng.pick(&ops_for(dtype));
    make(rng, kind, dtype, op, n)
}

fn random_body(rng: &mut Rng, n: usize, len: usize) -> Vec<Step> {
    (0..len).map(|_| Step::Call(random_call(rng, n))).collect()
}

fn random_split(rng: &mut Rng, n: usize, body: Vec<Step>) -> Step {
    let palette = [0u32, 1, 7, 1_000_000];
    let ncolors = 1 + rng.index(3);
    let colors = (0..n)
        .map(|_| (!rng.chance(1, 5)).then(|| palette[rng.index(ncolors)]))
        .collect();
    let keys = (0..n).map(|_| rng.range(-2, 2) as i32).collect();
    Step::Split {
        index: 0,
        colors,
        keys,
        body,
    }
}

fn number(steps: &mut [Step], next: &mut usize) {
    for s in steps {
        match s {
            Step::Call(c) => {
                c.index = *next;
                *next += 1;
            }
            Step::Split { index, body, .. } | Step::Group { index, body, .. } => {
                *index = *next;
                *next += 1;
                number(body, next);
            }
        }
    }
}

/// The sequence for `seed` on a world of `n` ranks.
pub fn plan(seed: u64, n: usize, large: bool) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut calls = Vec::new();
    // Every reduction × dtype × op.
    for kind in [Kind::AllReduce, Kind::Reduce, Kind::ReduceScatter] {
        for dtype in DataType::ALL {
            for op in ops_for(dtype) {
                calls.push(make(&mut rng, kind, dtype, op, n));
            }
        }
    }
    // Every data movement × dtype.
    for kind in [
        Kind::Broadcast,
        Kind::AllGather,
        Kind::AllToAll,
        Kind::Gather,
        Kind::Scatter,
        Kind::SendRecv,
    ] {
        if kind == Kind::SendRecv && n == 1 {
            continue;
        }
        for dtype in DataType::ALL {
            calls.push(make(&mut rng, kind, dtype, ReduceOp::Sum, n));
        }
    }
    // Every root of every rooted collective.
    for kind in [Kind::Broadcast, Kind::Reduce, Kind::Gather, Kind::Scatter] {
        for root in 0..n {
            let mut c = random_call(&mut rng, n);
            let op = rng.pick(&ops_for(c.dtype));
            c = Call {
                kind,
                op: if kind.is_reduction() {
                    op
                } else {
                    ReduceOp::Sum
                },
                root: root as u32,
                ..c
            };
            calls.push(c);
        }
    }
    // Counts 0 and 1 for every collective.
    for kind in Kind::ALL {
        if kind == Kind::Barrier || (kind == Kind::SendRecv && n == 1) {
            continue;
        }
        for count in [0, 1] {
            let c = random_call(&mut rng, n);
            let op = rng.pick(&ops_for(c.dtype));
            calls.push(Call {
                kind,
                count,
                op: if kind.is_reduction() {
                    op
                } else {
                    ReduceOp::Sum
                },
                ..c
            });
        }
    }
    for _ in 0..3 {
        calls.push(make(
            &mut rng,
            Kind::Barrier,
            DataType::U8,
            ReduceOp::Sum,
            n,
        ));
    }
    let mut steps: Vec<Step> = calls.into_iter().map(Step::Call).collect();
    rng.shuffle(&mut steps);

    // Sub-communicators: two splits (the second with a nested split) and a group.
    let inner = random_body(&mut rng, n, 6);
    let mut nested_body = random_body(&mut rng, n, 8);
    nested_body.push(random_split(&mut rng, n, inner));
    nested_body.extend(random_body(&mut rng, n, 4));
    let first_body = random_body(&mut rng, n, 12);
    let mut subs = vec![
        random_split(&mut rng, n, first_body),
        random_split(&mut rng, n, nested_body),
    ];
    let mut ranks: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut ranks);
    ranks.truncate(1 + rng.index(n));
    subs.push(Step::Group {
        index: 0,
        ranks,
        body: random_body(&mut rng, n, 12),
    });
    // Three large calls per seed: seeds 1, 2, 3 (CI's) cover all eight kinds.
    if large {
        let kinds = [
            Kind::AllReduce,
            Kind::ReduceScatter,
            Kind::Broadcast,
            Kind::AllGather,
            Kind::Reduce,
            Kind::AllToAll,
            Kind::Gather,
            Kind::Scatter,
        ];
        for j in 0..3 {
            let at = (3 * seed.wrapping_sub(1) + j) % kinds.len() as u64;
            let kind = kinds[at as usize];
            let dtype = rng.pick(&[DataType::U8, DataType::I8, DataType::F16, DataType::Bf16]);
            let op = rng.pick(&[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg]);
            let mut c = make(&mut rng, kind, dtype, op, n);
            c.count = if kind.is_blocked() {
                LARGE_COUNT.div_ceil(n)
            } else {
                LARGE_COUNT
            };
            c.regime = Regime::Exact;
            subs.push(Step::Call(c));
        }
    }
    for s in subs {
        let at = rng.index(steps.len() + 1);
        steps.insert(at, s);
    }
    let mut next = 0;
    number(&mut steps, &mut next);
    steps
}

/// Number of calls in `steps`, sub-communicator bodies included.
pub fn count_calls(steps: &[Step]) -> usize {
    steps
        .iter()
        .map(|s| match s {
            Step::Call(_) => 1,
            Step::Split { body, .. } | Step::Group { body, .. } => count_calls(body),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn flat(steps: &[Step], out: &mut Vec<Call>) {
        for s in steps {
            match s {
                Step::Call(c) => out.push(c.clone()),
                Step::Split { body, .. } | Step::Group { body, .. } => flat(body, out),
            }
        }
    }

    #[test]
    fn deterministic_and_covering() {
        for n in [1, 2, 3, 5, 8] {
            let a = plan(3, n, true);
            let b = plan(3, n, true);
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
            let mut calls = Vec::new();
            flat(&a, &mut calls);
            let combos: HashSet<(Kind, DataType, u8)> = calls
                .iter()
                .map(|c| (c.kind, c.dtype, c.op.tag()))
                .collect();
            for kind in [Kind::AllReduce, Kind::Reduce, Kind::ReduceScatter] {
                for d in DataType::ALL {
                    for op in ops_for(d) {
                        assert!(combos.contains(&(kind, d, op.tag())), "{kind} {d} {op}");
                    }
                }
            }
            for kind in [Kind::Broadcast, Kind::Reduce, Kind::Gather, Kind::Scatter] {
                for root in 0..n {
                    assert!(calls.iter().any(|c| c.kind == kind && c.root_in(n) == root));
                }
            }
            assert!(calls
                .iter()
                .any(|c| c.count >= 1 << 24 || c.count * n >= 1 << 24));
            assert!(calls.iter().any(|c| c.in_place) && calls.iter().any(|c| !c.in_place));
            // CI's seeds make every kind but barrier and send/recv large.
            let mut large = HashSet::new();
            for seed in crate::DEFAULT_SEEDS {
                let mut calls = Vec::new();
                flat(&plan(seed, n, true), &mut calls);
                large.extend(
                    calls
                        .iter()
                        .filter(|c| c.count.max(c.count * n) >= 1 << 24)
                        .map(|c| c.kind),
                );
            }
            assert_eq!(large.len(), 8, "{large:?}");
            // Indices are unique and follow the order.
            let idx: Vec<usize> = calls.iter().map(|c| c.index).collect();
            assert!(idx.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
