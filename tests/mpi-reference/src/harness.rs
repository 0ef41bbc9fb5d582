//! Runs the plan on this rank: every call through MPI, then through ccl on
//! the same inputs, and compares what this rank got.
//!
//! After every call all ranks agree (one `MPI_Allreduce` of a status on the
//! world) on whether it failed anywhere, so that they stop together: after
//! [`MAX_FAILING_CALLS`] failing calls in a seed, or at once when ccl
//! returned an error or a split disagreed with MPI's.
//!
//! This file is longer than the others (about 1,150 lines) on purpose:
//! `Runner` keeps, for every collective, the MPI call and the ccl call side
//! by side, so that one screen shows both getting the same arguments and
//! the comparison of their results.

use std::time::Instant;

use ccl::{bf16, f16, Communicator, Config, DataType, Element, Launcher, ReduceOp};
use ccl_mpi_reference::{
    bound, large_from_env,
    plan::{self, Call, Kind, Regime, Step},
    rng::Rng,
    seeds_from_env,
};

use crate::mpi::{self, dt, Comm, WORLD};

/// A seed stops (on every rank) after this many failing calls.
const MAX_FAILING_CALLS: u64 = 10;
/// Failure lines printed per rank.
const MAX_PRINTED: usize = 40;

/// An element type as the harness generates, widens, scales and compares it.
trait Elem: Element + Copy {
    /// Shim data type that moves these elements bit for bit.
    const MOVE: i32;
    /// Shim data type that MPI reduces them in (f32 for the 16-bit floats).
    const ACC: i32;
    type Acc: Element + Copy;
    fn from_bits(b: u64) -> Self;
    fn bits(self) -> u64;
    fn to_f64(self) -> f64;
    /// An input for a reduction by `op`.
    fn gen(rng: &mut Rng, regime: Regime, op: ReduceOp) -> Self;
    /// A premulsum scalar: whole for integers and exact inputs; else `k/1024`,
    /// `|k| ≤ 2048`, so that `x·s` is exact in f64 (f32 for 16-bit floats)
    /// and rounding it to the type is one unambiguous rounding.
    fn scalar(rng: &mut Rng, regime: Regime) -> f64;
    /// `x·s` rounded once to the type (integers: exactly, modulo 2^bits).
    fn premul(self, s: f64) -> Self;
    fn widen(self) -> Self::Acc;
    fn narrow(a: Self::Acc) -> Self;
    fn acc_f64(a: Self::Acc) -> f64;
    /// Average's division in the reduction type (integers truncate).
    fn acc_div(a: Self::Acc, n: usize) -> Self::Acc;
}

macro_rules! int_elem {
    ($($t:ty => $code:expr),*) => {$(
        impl Elem for $t {
            const MOVE: i32 = $code;
            const ACC: i32 = $code;
            type Acc = $t;
            fn from_bits(b: u64) -> Self { b as $t }
            fn bits(self) -> u64 { self as u64 }
            fn to_f64(self) -> f64 { self as f64 }
            fn gen(rng: &mut Rng, _: Regime, _: ReduceOp) -> Self { rng.next_u64() as $t }
            fn scalar(rng: &mut Rng, _: Regime) -> f64 { int_scalar(rng) }
            fn premul(self, s: f64) -> Self { (self as u64).wrapping_mul(mod_2_64(s)) as $t }
            fn widen(self) -> Self { self }
            fn narrow(a: Self) -> Self { a }
            fn acc_f64(a: Self) -> f64 { a as f64 }
            fn acc_div(a: Self, n: usize) -> Self { a / n as $t }
        }
    )*};
}
int_elem!(i8 => 1, u8 => 2, i32 => 3, u32 => 4, i64 => 5, u64 => 6);

/// An integer premulsum scalar: mostly small, sometimes large (the product
/// is taken modulo 2^bits, so large ones test the wrapping).
fn int_scalar(rng: &mut Rng) -> f64 {
    let large = [
        4_294_967_299.0,             // 2^32 + 3
        -1_099_511_627_781.0,        // -(2^40 + 5)
        4_611_686_018_427_387_904.0, // 2^62
        -9_007_199_254_740_992.0,    // -(2^53)
    ];
    let huge = [
        9_223_372_036_854_775_808.0,  // 2^63
        18_446_744_073_709_551_616.0, // 2^64
        1e19,
        -1e19,
        1.5e30,
    ];
    match rng.below(8) {
        0 => rng.pick(&huge),
        1 => rng.pick(&large),
        _ => rng.range(-5, 5) as f64,
    }
}

/// A whole number modulo 2^64 (two's complement for negative ones), exactly.
fn mod_2_64(s: f64) -> u64 {
    debug_assert_eq!(s.fract(), 0.0);
    if s.abs() < 2f64.powi(127) {
        s as i128 as u64
    } else {
        0 // a whole f64 of magnitude ≥ 2^127 is a multiple of 2^75
    }
}

/// A float input: small integers (exact), or random signs and magnitudes.
fn float_value(rng: &mut Rng, regime: Regime, op: ReduceOp) -> f64 {
    match (regime, op) {
        (Regime::Exact, ReduceOp::Prod) => rng.range(-2, 2) as f64,
        (Regime::Exact, _) => rng.range(-8, 8) as f64,
        (Regime::Random, ReduceOp::Prod) => {
            let m = 0.5 + 1.5 * rng.unit();
            if rng.chance(1, 2) {
                -m
            } else {
                m
            }
        }
        (Regime::Random, _) => (2.0 * rng.unit() - 1.0) * 2f64.powi(rng.range(-4, 4) as i32),
    }
}

fn float_scalar(rng: &mut Rng, regime: Regime) -> f64 {
    match regime {
        Regime::Exact => rng.range(-3, 3) as f64,
        Regime::Random => rng.range(-2048, 2048) as f64 / 1024.0,
    }
}

macro_rules! float_elem {
    ($t:ty, $bits:ty, $code:expr, $acc:ty, $acc_code:expr,
     from_f64 = $from:expr, to_f64 = $to:expr, widen = $widen:expr, narrow = $narrow:expr) => {
        impl Elem for $t {
            const MOVE: i32 = $code;
            const ACC: i32 = $acc_code;
            type Acc = $acc;
            fn from_bits(b: u64) -> Self {
                <$t>::from_bits(b as $bits)
            }
            fn bits(self) -> u64 {
                self.to_bits() as u64
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn gen(rng: &mut Rng, regime: Regime, op: ReduceOp) -> Self {
                let v: $t = $from(float_value(rng, regime, op));
                // No negative zeros from rounding tiny values: min/max of ±0 depends on order.
                if $to(v) == 0.0 {
                    $from(0.0)
                } else {
                    v
                }
            }
            fn scalar(rng: &mut Rng, regime: Regime) -> f64 {
                float_scalar(rng, regime)
            }
            fn premul(self, s: f64) -> Self {
                $from($to(self) * s)
            }
            fn widen(self) -> $acc {
                $widen(self)
            }
            fn narrow(a: $acc) -> Self {
                $narrow(a)
            }
            fn acc_f64(a: $acc) -> f64 {
                a as f64
            }
            fn acc_div(a: $acc, n: usize) -> $acc {
                a / n as $acc
            }
        }
    };
}
float_elem!(
    f32,
    u32,
    9,
    f32,
    9,
    from_f64 = |v: f64| v as f32,
    to_f64 = |x: f32| x as f64,
    widen = |x: f32| x,
    narrow = |a: f32| a
);
float_elem!(
    f64,
    u64,
    10,
    f64,
    10,
    from_f64 = |v: f64| v,
    to_f64 = |x: f64| x,
    widen = |x: f64| x,
    narrow = |a: f64| a
);
float_elem!(
    f16,
    u16,
    7,
    f32,
    dt::F32,
    from_f64 = f16::from_f64,
    to_f64 = f16::to_f64,
    widen = f16::to_f32,
    narrow = f16::from_f32
);
float_elem!(
    bf16,
    u16,
    8,
    f32,
    dt::F32,
    from_f64 = bf16::from_f64,
    to_f64 = bf16::to_f64,
    widen = bf16::to_f32,
    narrow = bf16::from_f32
);

fn random_bits<T: Elem>(rng: &mut Rng, len: usize) -> Vec<T> {
    (0..len).map(|_| T::from_bits(rng.next_u64())).collect()
}

fn zeroed<T: Element>(len: usize) -> Vec<T> {
    vec![T::zeroed(); len]
}

/// FNV-1a over the elements' bits.
fn hash<T: Elem>(v: &[T]) -> u64 {
    v.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ x.bits()).wrapping_mul(0x0100_0000_01b3)
    })
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// What a call came to on this rank (ordered: the worst wins).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Ok = 0,
    Mismatch = 1,
    /// ccl returned an error, or a split disagreed: the sequence cannot go on.
    Fatal = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    Continue,
    /// Too many failing calls: this seed stops.
    Stop,
    /// Nothing more can run.
    Fatal,
}

/// The same group of ranks as seen by ccl and by MPI.
struct Pair<'a> {
    ccl: &'a Communicator,
    mpi: Comm,
    rank: usize,
    size: usize,
    label: String,
}

/// A sub-communicator this rank belongs to.
struct Sub {
    ccl: Communicator,
    mpi: Comm,
    label: String,
}

impl Sub {
    fn pair(&self) -> Pair<'_> {
        Pair {
            ccl: &self.ccl,
            mpi: self.mpi,
            rank: self.ccl.rank(),
            size: self.ccl.world_size(),
            label: self.label.clone(),
        }
    }

    fn free(self) -> Result<(), String> {
        self.mpi.free()
    }
}

/// Counters, summed (or maxed) over ranks at the end.
#[derive(Default)]
struct Stats {
    /// Distinct calls compared (counted by rank 0 of the communicator they ran on).
    calls: u64,
    /// Splits and groups compared (counted by rank 0 of the parent).
    splits: u64,
    /// (call, rank) pairs compared.
    rank_calls: u64,
    /// Elements compared.
    elements: u64,
    /// Of which within a bound rather than bit for bit.
    bounded: u64,
    /// Largest |ccl − mpi| / bound seen, for f16, bf16, f32, f64.
    worst: [f64; 4],
}

fn float_slot(d: DataType) -> usize {
    match d {
        DataType::F16 => 0,
        DataType::Bf16 => 1,
        DataType::F32 => 2,
        _ => 3,
    }
}

struct Runner {
    wrank: usize,
    seed: u64,
    stats: Stats,
    /// Failing calls so far in this seed (agreed by all ranks).
    failing: u64,
    failing_total: u64,
    printed: usize,
    /// `CCL_REF_CORRUPT=K`: world rank 0 corrupts the first non-empty result
    /// of a call at index K or later, to show that the harness catches it.
    corrupt: Option<usize>,
}

/// An extra comparison a call makes besides its result.
type Extra<T> = Option<(&'static str, Vec<T>, Vec<T>)>;

impl Runner {
    fn say(&mut self, p: &Pair, what: &str, msg: &str) {
        if self.printed < MAX_PRINTED {
            println!(
                "FAIL seed={} {what} on {}: rank {} of {} (world rank {}): {msg}",
                self.seed, p.label, p.rank, p.size, self.wrank
            );
        } else if self.printed == MAX_PRINTED {
            println!(
                "FAIL ... (world rank {}: further failures not printed)",
                self.wrank
            );
        }
        self.printed += 1;
    }

    fn call_name(c: &Call, p: &Pair) -> String {
        format!("call #{} {}", c.index, c.describe(p.size))
    }

    /// Compares what ccl gave with MPI's (bit for bit, or within `bound[i]`).
    fn expect<T: Elem>(
        &mut self,
        p: &Pair,
        c: &Call,
        what: &str,
        got: &[T],
        want: &[T],
        bound: Option<&[f64]>,
    ) -> Status {
        if got.len() != want.len() {
            let m = format!(
                "{what}: ccl gave {} elements, MPI {}",
                got.len(),
                want.len()
            );
            self.say(p, &Self::call_name(c, p), &m);
            return Status::Mismatch;
        }
        self.stats.elements += got.len() as u64;
        let Some(bound) = bound else {
            let Some(i) = (0..got.len()).find(|&i| got[i].bits() != want[i].bits()) else {
                return Status::Ok;
            };
            let mask = u64::MAX >> (64 - 8 * std::mem::size_of::<T>());
            let m = format!(
                "{what}: first difference at index {i}: ccl {:?} (bits {:#x}), MPI {:?} (bits {:#x})",
                got[i],
                got[i].bits() & mask,
                want[i],
                want[i].bits() & mask
            );
            self.say(p, &Self::call_name(c, p), &m);
            return Status::Mismatch;
        };
        self.stats.bounded += got.len() as u64;
        let slot = float_slot(T::DTYPE);
        let mut first = None;
        for i in 0..got.len() {
            let (g, w) = (got[i].to_f64(), want[i].to_f64());
            if got[i].bits() == want[i].bits() {
                continue;
            }
            let err = (g - w).abs();
            if err.is_nan() || err > bound[i] {
                first.get_or_insert(i);
            } else if bound[i] > 0.0 {
                self.stats.worst[slot] = self.stats.worst[slot].max(err / bound[i]);
            }
        }
        let Some(i) = first else {
            return Status::Ok;
        };
        let m = format!(
            "{what}: first difference beyond the bound at index {i}: ccl {:?}, MPI {:?}, |difference| {:e} > bound {:e}",
            got[i],
            want[i],
            (got[i].to_f64() - want[i].to_f64()).abs(),
            bound[i]
        );
        self.say(p, &Self::call_name(c, p), &m);
        Status::Mismatch
    }

    fn ccl_error(&mut self, p: &Pair, what: &str, e: &ccl::Error) -> Status {
        self.say(p, what, &format!("ccl returned an error: {e}"));
        Status::Fatal
    }

    /// Every rank learns the worst status; returns what to do next.
    fn settle(&mut self, local: Status) -> Result<Flow, String> {
        let mut s = [local as i32];
        WORLD.allreduce(None, &mut s, dt::I32, mpi::op::MAX)?;
        Ok(match s[0] {
            0 => Flow::Continue,
            1 => {
                self.failing += 1;
                self.failing_total += 1;
                if self.failing >= MAX_FAILING_CALLS {
                    Flow::Stop
                } else {
                    Flow::Continue
                }
            }
            _ => {
                self.failing_total += 1;
                Flow::Fatal
            }
        })
    }

    fn steps(&mut self, pair: Option<&Pair>, steps: &[Step]) -> Result<Flow, String> {
        for step in steps {
            let flow = match step {
                Step::Call(c) => {
                    let local = match pair {
                        Some(p) => self.call(p, c).map_err(|e| {
                            format!(
                                "seed={} {} on {}: rank {}: {e}",
                                self.seed,
                                Self::call_name(c, p),
                                p.label,
                                p.rank
                            )
                        })?,
                        None => Status::Ok,
                    };
                    self.settle(local)?
                }
                Step::Split {
                    index,
                    colors,
                    keys,
                    body,
                } => {
                    let (local, sub) = match pair {
                        Some(p) => {
                            let (color, key) = (colors[p.rank], keys[p.rank]);
                            let what = format!("step #{index} split(color {color:?}, key {key})");
                            let mpi = p.mpi.split(color, key)?;
                            let ccl = p.ccl.split(color, i64::from(key));
                            let label = format!(
                                "{} / split #{index} color {}",
                                p.label,
                                color.map_or("none".into(), |c| c.to_string())
                            );
                            self.sub(p, &what, mpi, ccl, label)?
                        }
                        None => (Status::Ok, None),
                    };
                    self.enter(local, sub, body)?
                }
                Step::Group { index, ranks, body } => {
                    let (local, sub) = match pair {
                        Some(p) => {
                            let what = format!("step #{index} new_group({ranks:?})");
                            let pos = ranks.iter().position(|&r| r == p.rank);
                            let mpi = p.mpi.split(pos.map(|_| 0), pos.unwrap_or(0) as i32)?;
                            let ccl = p.ccl.new_group(ranks);
                            let label = format!("{} / group #{index}", p.label);
                            self.sub(p, &what, mpi, ccl, label)?
                        }
                        None => (Status::Ok, None),
                    };
                    self.enter(local, sub, body)?
                }
            };
            if flow != Flow::Continue {
                return Ok(flow);
            }
        }
        Ok(Flow::Continue)
    }

    /// Settles a split, runs its body on the sub-communicator, frees it.
    fn enter(&mut self, local: Status, sub: Option<Sub>, body: &[Step]) -> Result<Flow, String> {
        let mut flow = self.settle(local)?;
        if flow == Flow::Continue {
            let pair = sub.as_ref().map(Sub::pair);
            flow = self.steps(pair.as_ref(), body)?;
        }
        if let Some(s) = sub {
            s.free()?;
        }
        Ok(flow)
    }

    /// Compares a sub-communicator from ccl with MPI's.
    fn sub(
        &mut self,
        p: &Pair,
        what: &str,
        mpi: Option<Comm>,
        ccl: ccl::Result<Option<Communicator>>,
        label: String,
    ) -> Result<(Status, Option<Sub>), String> {
        if p.rank == 0 {
            self.stats.splits += 1;
        }
        let ccl = match ccl {
            Ok(c) => c,
            Err(e) => {
                if let Some(m) = mpi {
                    m.free()?;
                }
                return Ok((self.ccl_error(p, what, &e), None));
            }
        };
        match (mpi, ccl) {
            (None, None) => Ok((Status::Ok, None)),
            (Some(m), Some(c)) => {
                let (mr, ms) = (m.rank()?, m.size()?);
                let st = if (c.rank(), c.world_size()) == (mr, ms) {
                    Status::Ok
                } else {
                    let msg = format!(
                        "ccl made rank {} of {}, MPI rank {mr} of {ms}",
                        c.rank(),
                        c.world_size()
                    );
                    self.say(p, what, &msg);
                    Status::Fatal
                };
                let label = format!("{label} ({ms} ranks)");
                Ok((
                    st,
                    Some(Sub {
                        ccl: c,
                        mpi: m,
                        label,
                    }),
                ))
            }
            (m, c) => {
                let msg = format!(
                    "ccl {} a communicator, MPI {}",
                    if c.is_some() { "made" } else { "did not make" },
                    if m.is_some() { "did" } else { "did not" }
                );
                self.say(p, what, &msg);
                if let Some(m) = m {
                    m.free()?;
                }
                Ok((Status::Fatal, None))
            }
        }
    }

    fn call(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        match c.dtype {
            DataType::I8 => self.call_t::<i8>(p, c),
            DataType::U8 => self.call_t::<u8>(p, c),
            DataType::I32 => self.call_t::<i32>(p, c),
            DataType::U32 => self.call_t::<u32>(p, c),
            DataType::I64 => self.call_t::<i64>(p, c),
            DataType::U64 => self.call_t::<u64>(p, c),
            DataType::F16 => self.call_t::<f16>(p, c),
            DataType::Bf16 => self.call_t::<bf16>(p, c),
            DataType::F32 => self.call_t::<f32>(p, c),
            DataType::F64 => self.call_t::<f64>(p, c),
        }
    }

    fn call_t<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        if c.kind == Kind::SendRecv && p.size == 1 {
            return Ok(Status::Ok); // no peer: nothing to compare, not counted
        }
        if p.rank == 0 {
            self.stats.calls += 1;
        }
        self.stats.rank_calls += 1;
        match c.kind {
            Kind::AllReduce | Kind::Reduce | Kind::ReduceScatter => self.reduction::<T>(p, c),
            Kind::Broadcast => self.broadcast::<T>(p, c),
            Kind::AllGather => self.allgather::<T>(p, c),
            Kind::AllToAll => self.alltoall::<T>(p, c),
            Kind::Gather => self.gather::<T>(p, c),
            Kind::Scatter => self.scatter::<T>(p, c),
            Kind::Barrier => {
                p.mpi.barrier()?;
                Ok(match p.ccl.barrier() {
                    Ok(()) => Status::Ok,
                    Err(e) => self.ccl_error(p, &Self::call_name(c, p), &e),
                })
            }
            Kind::SendRecv => self.sendrecv::<T>(p, c),
        }
    }

    /// The result check common to every call: ccl's error, or its result
    /// (and an extra buffer) against MPI's.
    #[allow(clippy::too_many_arguments)]
    fn verdict<T: Elem>(
        &mut self,
        p: &Pair,
        c: &Call,
        what: &str,
        got: ccl::Result<Vec<T>>,
        want: &[T],
        bound: Option<&[f64]>,
        extra: Extra<T>,
    ) -> Status {
        let mut got = match got {
            Ok(g) => g,
            Err(e) => return self.ccl_error(p, &Self::call_name(c, p), &e),
        };
        if self.wrank == 0 && !got.is_empty() && self.corrupt.is_some_and(|k| c.index >= k) {
            // Self-check (`CCL_REF_CORRUPT`): flip the top exponent bit (or
            // the second-highest bit of an integer) of one result.
            let top = 1u64 << (8 * std::mem::size_of::<T>() - 2);
            got[0] = T::from_bits(got[0].bits() ^ top);
            self.corrupt = None;
        }
        let mut st = self.expect(p, c, what, &got, want, bound);
        if let Some((what, g, w)) = extra {
            st = st.max(self.expect(p, c, what, &g, &w, None));
        }
        st
    }

    fn streams(&self, c: &Call) -> (Rng, Rng) {
        (
            Rng::derive(c.data, self.wrank as u64, 0),
            Rng::derive(c.data, self.wrank as u64, 2),
        )
    }

    fn reduction<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (n, r, count) = (p.size, p.rank, c.count);
        let root = c.root_in(n);
        let here = r == root;
        let len = if c.kind == Kind::ReduceScatter {
            n * count
        } else {
            count
        };
        let (mut gen, mut junk) = self.streams(c);
        let x: Vec<T> = (0..len).map(|_| T::gen(&mut gen, c.regime, c.op)).collect();
        let avg = c.op == ReduceOp::Avg;
        let (op, terms, what) = match c.op {
            ReduceOp::PreMulSum(_) => {
                let s = T::scalar(&mut Rng::derive(c.data, self.wrank as u64, 1), c.regime);
                (
                    ReduceOp::PreMulSum(s),
                    x.iter().map(|v| v.premul(s)).collect(),
                    format!("result (this rank's premulsum scalar: {s})"),
                )
            }
            op => (op, x.clone(), "result".to_string()),
        };
        let acc: Vec<T::Acc> = terms.iter().map(|v| v.widen()).collect();
        let mop = match c.op {
            ReduceOp::Avg | ReduceOp::PreMulSum(_) => mpi::op::SUM,
            op => i32::from(op.tag()),
        };
        let out_len = if c.kind == Kind::Reduce && !here {
            0
        } else {
            count
        };

        // The reference, in the reduction type.
        let m = p.mpi;
        let reference: Vec<T::Acc> = match (c.kind, c.in_place) {
            (Kind::AllReduce, true) => {
                let mut b = acc.clone();
                m.allreduce(None, &mut b, T::ACC, mop)?;
                b
            }
            (Kind::AllReduce, false) => {
                let mut o = zeroed(count);
                m.allreduce(Some(&acc), &mut o, T::ACC, mop)?;
                o
            }
            (Kind::Reduce, true) if here => {
                let mut b = acc.clone();
                m.reduce(None, &mut b, count, T::ACC, mop, root)?;
                b
            }
            (Kind::Reduce, _) => {
                let mut o = zeroed(out_len);
                m.reduce(Some(&acc), &mut o, count, T::ACC, mop, root)?;
                o
            }
            (_, true) => {
                let mut b = acc.clone();
                m.reduce_scatter_block(None, &mut b, count, T::ACC, mop)?;
                b.truncate(count);
                b
            }
            (_, false) => {
                let mut o = zeroed(count);
                m.reduce_scatter_block(Some(&acc), &mut o, count, T::ACC, mop)?;
                o
            }
        };
        let want: Vec<T> = reference
            .iter()
            .map(|&a| T::narrow(if avg { T::acc_div(a, n) } else { a }))
            .collect();

        // The bound, for random float inputs to sums, averages and products.
        let bound: Option<Vec<f64>> = match c.op {
            _ if !c.dtype.is_float() || c.regime == Regime::Exact => None,
            ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => {
                let abs: Vec<f64> = terms.iter().map(|t| t.to_f64().abs()).collect();
                let mut s = zeroed::<f64>(out_len);
                match c.kind {
                    Kind::AllReduce => m.allreduce(Some(&abs), &mut s, dt::F64, mpi::op::SUM)?,
                    Kind::Reduce => {
                        m.reduce(Some(&abs), &mut s, count, dt::F64, mpi::op::SUM, root)?
                    }
                    _ => {
                        m.reduce_scatter_block(Some(&abs), &mut s, count, dt::F64, mpi::op::SUM)?
                    }
                }
                Some(
                    s.iter()
                        .map(|&s| {
                            if avg {
                                bound::avg(c.dtype, n, s)
                            } else {
                                bound::sum(c.dtype, n, s)
                            }
                        })
                        .collect(),
                )
            }
            ReduceOp::Prod => Some(
                reference
                    .iter()
                    .map(|&a| bound::prod(c.dtype, n, T::acc_f64(a)))
                    .collect(),
            ),
            _ => None,
        };

        // ccl.
        let mut extra: Extra<T> = None;
        let got: ccl::Result<Vec<T>> = match (c.kind, c.in_place) {
            (Kind::AllReduce, true) => {
                let mut b = x.clone();
                p.ccl.allreduce(&mut b, op).map(|()| b)
            }
            (Kind::AllReduce, false) => {
                let mut o = random_bits(&mut junk, count);
                p.ccl.allreduce_into(&x, &mut o, op).map(|()| o)
            }
            (Kind::Reduce, true) => {
                let mut b = x.clone();
                p.ccl.reduce(&mut b, op, root).map(|()| {
                    if here {
                        b
                    } else {
                        extra = Some(("non-root buffer (must be left as it was)", b, x.clone()));
                        Vec::new()
                    }
                })
            }
            (Kind::Reduce, false) => {
                let mut o = if here || c.variant & 2 == 0 {
                    random_bits(&mut junk, count)
                } else {
                    Vec::new()
                };
                let before = o.clone();
                p.ccl.reduce_into(&x, &mut o, op, root).map(|()| {
                    if here {
                        o
                    } else {
                        extra = Some(("non-root output (must be left as it was)", o, before));
                        Vec::new()
                    }
                })
            }
            (_, true) => {
                let mut b = x.clone();
                p.ccl
                    .reduce_scatter(&mut b, op)
                    .map(|()| b[r * count..(r + 1) * count].to_vec())
            }
            (_, false) => {
                let mut o = random_bits(&mut junk, count);
                p.ccl.reduce_scatter_into(&x, &mut o, op).map(|()| o)
            }
        };

        // Allreduce: every rank must get the very same bits from ccl.
        let mut consistent = true;
        if c.kind == Kind::AllReduce {
            let h = got.as_ref().map_or(0, |g| hash(g));
            let (mut lo, mut hi) = ([h], [h]);
            m.allreduce(None, &mut lo, dt::U64, mpi::op::MIN)?;
            m.allreduce(None, &mut hi, dt::U64, mpi::op::MAX)?;
            consistent = lo == hi;
        }
        let mut st = self.verdict(p, c, &what, got, &want, bound.as_deref(), extra);
        if !consistent && st != Status::Fatal {
            self.say(
                p,
                &Self::call_name(c, p),
                "ccl's allreduce results are not bitwise identical on every rank",
            );
            st = st.max(Status::Mismatch);
        }
        Ok(st)
    }

    fn broadcast<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (count, root) = (c.count, c.root_in(p.size));
        let here = p.rank == root;
        let (mut gen, mut junk) = self.streams(c);
        let x: Vec<T> = random_bits(&mut gen, count);
        let init = if here {
            x.clone()
        } else {
            random_bits(&mut junk, count)
        };
        let mut want = init.clone();
        p.mpi.bcast(&mut want, T::MOVE, root)?;
        let got = if c.in_place {
            let mut b = init;
            p.ccl.broadcast(&mut b, root).map(|()| b)
        } else {
            let input = if here {
                x
            } else if c.variant & 2 == 0 {
                Vec::new()
            } else {
                random_bits(&mut junk, count)
            };
            let mut o = random_bits(&mut junk, count);
            p.ccl.broadcast_into(&input, &mut o, root).map(|()| o)
        };
        Ok(self.verdict(p, c, "result", got, &want, None, None))
    }

    fn allgather<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (n, r, count) = (p.size, p.rank, c.count);
        let (mut gen, mut junk) = self.streams(c);
        let x: Vec<T> = random_bits(&mut gen, count);
        let mut base: Vec<T> = random_bits(&mut junk, n * count);
        base[r * count..(r + 1) * count].copy_from_slice(&x);
        let (want, got) = if c.in_place {
            let mut w = base.clone();
            p.mpi.allgather(None, &mut w, count, T::MOVE)?;
            let mut b = base;
            (w, p.ccl.allgather(&mut b).map(|()| b))
        } else {
            let mut w = random_bits(&mut junk, n * count);
            p.mpi.allgather(Some(&x), &mut w, count, T::MOVE)?;
            let mut o = random_bits(&mut junk, n * count);
            (w, p.ccl.allgather_into(&x, &mut o).map(|()| o))
        };
        Ok(self.verdict(p, c, "result", got, &want, None, None))
    }

    fn alltoall<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (n, count) = (p.size, c.count);
        let (mut gen, mut junk) = self.streams(c);
        let x: Vec<T> = random_bits(&mut gen, n * count);
        let (want, got) = if c.in_place {
            let mut w = x.clone();
            p.mpi.alltoall(None, &mut w, count, T::MOVE)?;
            let mut b = x;
            (w, p.ccl.alltoall(&mut b).map(|()| b))
        } else {
            let mut w = random_bits(&mut junk, n * count);
            p.mpi.alltoall(Some(&x), &mut w, count, T::MOVE)?;
            let mut o = random_bits(&mut junk, n * count);
            (w, p.ccl.alltoall_into(&x, &mut o).map(|()| o))
        };
        Ok(self.verdict(p, c, "result", got, &want, None, None))
    }

    fn gather<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (n, count, root) = (p.size, c.count, c.root_in(p.size));
        let here = p.rank == root;
        let (mut gen, mut junk) = self.streams(c);
        let x: Vec<T> = random_bits(&mut gen, count);
        let with_own = |junk: &mut Rng| {
            let mut b: Vec<T> = random_bits(junk, n * count);
            b[root * count..(root + 1) * count].copy_from_slice(&x);
            b
        };
        let want = if c.in_place && here {
            let mut w = with_own(&mut junk);
            p.mpi.gather(None, &mut w, count, T::MOVE, root)?;
            w
        } else {
            let mut w = if here {
                random_bits(&mut junk, n * count)
            } else {
                Vec::new()
            };
            p.mpi.gather(Some(&x), &mut w, count, T::MOVE, root)?;
            w
        };
        let mut extra: Extra<T> = None;
        let got = match (c.in_place, here) {
            (true, true) => {
                let mut b = with_own(&mut junk);
                p.ccl.gather(&mut b, root).map(|()| b)
            }
            (true, false) => {
                let mut b = x.clone();
                p.ccl.gather(&mut b, root).map(|()| {
                    extra = Some(("non-root buffer (must be left as it was)", b, x.clone()));
                    Vec::new()
                })
            }
            (false, true) => {
                let mut o = random_bits(&mut junk, n * count);
                p.ccl.gather_into(&x, &mut o, root).map(|()| o)
            }
            (false, false) => {
                let mut o = if c.variant & 2 == 0 {
                    Vec::new()
                } else {
                    random_bits(&mut junk, n * count)
                };
                let before = o.clone();
                p.ccl.gather_into(&x, &mut o, root).map(|()| {
                    extra = Some(("non-root output (must be left as it was)", o, before));
                    Vec::new()
                })
            }
        };
        Ok(self.verdict(p, c, "result", got, &want, None, extra))
    }

    fn scatter<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (n, count, root) = (p.size, c.count, c.root_in(p.size));
        let here = p.rank == root;
        let (mut gen, mut junk) = self.streams(c);
        let y: Vec<T> = random_bits(&mut gen, n * count);
        let mine = root * count..(root + 1) * count;
        let want = if c.in_place && here {
            p.mpi.scatter(&y, None, count, T::MOVE, root)?;
            y[mine.clone()].to_vec()
        } else {
            let mut w = random_bits(&mut junk, count);
            let send: &[T] = if here { &y } else { &[] };
            p.mpi.scatter(send, Some(&mut w), count, T::MOVE, root)?;
            w
        };
        let mut extra: Extra<T> = None;
        let got = match (c.in_place, here) {
            (true, true) => {
                let mut b = y.clone();
                p.ccl.scatter(&mut b, root).map(|()| {
                    let own = b[mine].to_vec();
                    extra = Some(("root's buffer (must be left as it was)", b, y));
                    own
                })
            }
            (true, false) => {
                let mut b = random_bits(&mut junk, count);
                p.ccl.scatter(&mut b, root).map(|()| b)
            }
            (false, _) => {
                let input = if here {
                    y
                } else if c.variant & 2 == 0 {
                    Vec::new()
                } else {
                    random_bits(&mut junk, n * count)
                };
                let mut o = random_bits(&mut junk, count);
                p.ccl.scatter_into(&input, &mut o, root).map(|()| o)
            }
        };
        Ok(self.verdict(p, c, "result", got, &want, None, extra))
    }

    fn sendrecv<T: Elem>(&mut self, p: &Pair, c: &Call) -> Result<Status, String> {
        let (n, r, count) = (p.size, p.rank, c.count);
        let s = c.shift_in(n);
        let (dst, src) = ((r + s) % n, (r + n - s) % n);
        let (mut gen, mut junk) = self.streams(c);
        let x: Vec<T> = random_bits(&mut gen, count);
        let mut want = random_bits(&mut junk, count);
        p.mpi.sendrecv(&x, dst, &mut want, src, T::MOVE)?;
        let mut o: Vec<T> = random_bits(&mut junk, count);
        let res = if c.variant & 1 == 0 {
            // Blocking: in each cycle of r → r + s one rank (r < gcd) sends
            // first, the others receive first, so that nobody waits on a cycle.
            if r < gcd(n, s) {
                p.ccl.send(&x, dst).and_then(|()| p.ccl.recv(&mut o, src))
            } else {
                p.ccl.recv(&mut o, src).and_then(|()| p.ccl.send(&x, dst))
            }
        } else {
            let w = p.ccl.isend(x, dst);
            let rr = p.ccl.recv(&mut o, src);
            let ws = w.wait();
            rr.and(ws.map(drop))
        };
        Ok(self.verdict(p, c, "result", res.map(|()| o), &want, None, None))
    }
}

fn run() -> Result<i32, String> {
    let (wrank, wsize) = (WORLD.rank()?, WORLD.size()?);
    let seeds = seeds_from_env()?;
    let large = large_from_env();
    let config = Config::from_env().map_err(|e| format!("rank {wrank}: ccl's config: {e}"))?;
    if (config.launcher, config.rank, config.world_size) != (Launcher::OpenMpi, wrank, wsize) {
        return Err(format!(
            "ccl read {:?} rank {} of {} from the environment; MPI says rank {wrank} of {wsize}",
            config.launcher, config.rank, config.world_size
        ));
    }
    let joining = Instant::now();
    let world = Communicator::from_env().map_err(|e| format!("rank {wrank}: joining ccl: {e}"))?;
    if (world.rank(), world.world_size()) != (wrank, wsize) {
        return Err(format!(
            "ccl joined as rank {} of {}; MPI says rank {wrank} of {wsize}",
            world.rank(),
            world.world_size()
        ));
    }
    if wrank == 0 {
        println!(
            "ccl-mpi-reference: {wsize} ranks, seeds {seeds:?}, large calls {}, ccl joined in {:.0?}",
            if large { "on" } else { "off" },
            joining.elapsed()
        );
    }
    let mut runner = Runner {
        wrank,
        seed: 0,
        stats: Stats::default(),
        failing: 0,
        failing_total: 0,
        printed: 0,
        corrupt: std::env::var("CCL_REF_CORRUPT")
            .ok()
            .and_then(|v| v.parse().ok()),
    };
    let start = Instant::now();
    let mut failed_seeds = Vec::new();
    for &seed in &seeds {
        runner.seed = seed;
        runner.failing = 0;
        let steps = plan::plan(seed, wsize, large);
        let pair = Pair {
            ccl: &world,
            mpi: WORLD,
            rank: wrank,
            size: wsize,
            label: format!("world ({wsize} ranks)"),
        };
        let before = runner.failing_total;
        let flow = runner.steps(Some(&pair), &steps)?;
        if runner.failing_total > before {
            failed_seeds.push(seed);
        }
        if flow == Flow::Fatal {
            break;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    WORLD.barrier()?;
    drop(world);

    let s = &runner.stats;
    let mut sums = [s.calls, s.splits, s.rank_calls, s.elements, s.bounded];
    WORLD.allreduce(None, &mut sums, dt::U64, mpi::op::SUM)?;
    let mut worst = s.worst;
    WORLD.allreduce(None, &mut worst, dt::F64, mpi::op::MAX)?;
    let mut time = [elapsed];
    WORLD.allreduce(None, &mut time, dt::F64, mpi::op::MAX)?;
    let ok = runner.failing_total == 0;
    if wrank == 0 {
        println!(
            "SUMMARY np={wsize} seeds={} calls={} splits={} rank_calls={} elements={} bounded={} \
             worst_err_over_bound=f16:{:.3},bf16:{:.3},f32:{:.3},f64:{:.3} time={:.2}s failing_calls={}",
            seeds
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(","),
            sums[0],
            sums[1],
            sums[2],
            sums[3],
            sums[4],
            worst[0],
            worst[1],
            worst[2],
            worst[3],
            time[0],
            runner.failing_total
        );
        if !ok {
            let seed = failed_seeds.first().copied().unwrap_or(seeds[0]);
            println!(
                "rerun: CCL_REF_SEED={seed} CCL_REF_NP={wsize} cargo test -p ccl-mpi-reference --test mpirun -- --nocapture"
            );
        }
    }
    println!(
        "rank {wrank}: {}",
        if ok {
            "ok".to_string()
        } else {
            format!(
                "FAILED ({} failing calls, seeds {failed_seeds:?})",
                runner.failing_total
            )
        }
    );
    Ok(if ok { 0 } else { 1 })
}

pub fn main() -> i32 {
    if let Err(e) = mpi::init() {
        eprintln!("ccl-mpi-reference: {e}");
        return 3;
    }
    let code = match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ccl-mpi-reference: {e}");
            mpi::abort(3)
        }
    };
    if let Err(e) = mpi::finalize() {
        eprintln!("ccl-mpi-reference: {e}");
        return 3;
    }
    code
}
