//! Buffers of one benchmark case, and the results they must hold, computed
//! here independently of ccl's kernels.
//!
//! Data moved unchanged (broadcast, allgather, alltoall, gather, scatter,
//! sendrecv) differ per rank and per element, so that a block landing in the
//! wrong place is caught. Data that are reduced are small integers (1..=7, or
//! 1 and 2 for products) so that results are exact in every type, bf16 included,
//! for any sensible number of ranks; integer sums and products wrap as ccl's
//! (and MPI's) do. Floating-point results are compared with a relative
//! tolerance of a few units in the last place of the type, integers exactly.

use ccl::{bf16, f16, Element, ReduceOp};

use crate::coll::Coll;

/// An element type ccl-bench can fill, reduce on its own, and compare.
pub trait Val: Element + Copy {
    /// How many distinct non-zero values [`moved`] cycles through.
    const PERIOD: u64;
    /// An integer, exact if the type can hold it; wraps (integers) or cycles
    /// within the exactly representable range (floats) otherwise.
    fn int(v: u64) -> Self;
    /// `a ⊕ b` as ccl defines `op` for this type (`Avg` and `PreMulSum` combine by summing).
    fn combine(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `PreMulSum`'s scaling of a rank's own input.
    fn prescale(self, op: ReduceOp) -> Self;
    /// `Avg`'s division by the number of ranks.
    fn finalize(self, op: ReduceOp, n: usize) -> Self;
    /// True if `got` is an acceptable result where `want` is expected.
    fn close(got: Self, want: Self) -> bool;
}

macro_rules! int_val {
    ($($t:ty),*) => {$(
        impl Val for $t {
            const PERIOD: u64 = u64::MAX >> (64 - <$t>::BITS);
            fn int(v: u64) -> Self {
                v as $t
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => a.wrapping_add(b),
                    ReduceOp::Prod => a.wrapping_mul(b),
                    ReduceOp::Min => a.min(b),
                    ReduceOp::Max => a.max(b),
                    ReduceOp::BitAnd => a & b,
                    ReduceOp::BitOr => a | b,
                    ReduceOp::BitXor => a ^ b,
                }
            }
            fn prescale(self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::PreMulSum(s) => self.wrapping_mul(s as i64 as $t),
                    _ => self,
                }
            }
            fn finalize(self, op: ReduceOp, n: usize) -> Self {
                let d = n as $t;
                if op == ReduceOp::Avg && n > 1 && d != 0 {
                    self / d
                } else {
                    self
                }
            }
            fn close(got: Self, want: Self) -> bool {
                got == want
            }
        }
    )*};
}

int_val!(i8, u8, i32, u32, i64, u64);

/// Floats through `f32` (as ccl's kernels widen f16 and bf16) or `f64`.
macro_rules! float_val {
    ($t:ty, $wide:ty, $to:expr, $from:expr, $exact:expr, $tol:expr) => {
        impl Val for $t {
            const PERIOD: u64 = $exact - 1;
            fn int(v: u64) -> Self {
                $from((v % $exact) as $wide)
            }
            fn combine(op: ReduceOp, a: Self, b: Self) -> Self {
                let (x, y): ($wide, $wide) = ($to(a), $to(b));
                $from(match op {
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => {
                        if y < x {
                            y
                        } else {
                            x
                        }
                    }
                    ReduceOp::Max => {
                        if y > x {
                            y
                        } else {
                            x
                        }
                    }
                    // Sum, Avg, PreMulSum; bitwise ops are rejected for floats up front.
                    _ => x + y,
                })
            }
            fn prescale(self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::PreMulSum(s) => $from($to(self) * s as $wide),
                    _ => self,
                }
            }
            fn finalize(self, op: ReduceOp, n: usize) -> Self {
                if op == ReduceOp::Avg && n > 1 {
                    $from($to(self) / n as $wide)
                } else {
                    self
                }
            }
            fn close(got: Self, want: Self) -> bool {
                let (g, w) = ($to(got) as f64, $to(want) as f64);
                (g - w).abs() <= $tol * w.abs().max(1.0)
            }
        }
    };
}

float_val!(f32, f32, |x: f32| x, |x: f32| x, 1 << 24, 1e-6);
float_val!(f64, f64, |x: f64| x, |x: f64| x, 1 << 53, 1e-12);
float_val!(f16, f32, |x: f16| x.to_f32(), f16::from_f32, 1 << 11, 2e-3);
float_val!(
    bf16,
    f32,
    |x: bf16| x.to_f32(),
    bf16::from_f32,
    1 << 8,
    1.6e-2
);

/// A value moved unchanged: distinct per rank and per element, never zero
/// (zero is the poison that outputs start with).
fn moved<T: Val>(rank: usize, i: usize) -> T {
    T::int(1 + (rank as u64 * 1_000_003 + i as u64) % T::PERIOD)
}

/// A value that is reduced: a small integer, exact in every type.
fn reduced<T: Val>(op: ReduceOp, rank: usize, i: usize) -> T {
    let v = if op == ReduceOp::Prod {
        1 + u64::from((i + rank) % 7 == 0)
    } else {
        ((i + 3 * rank) % 7) as u64 + 1
    };
    T::int(v)
}

/// The reduction of element `i` over `n` ranks.
fn reduction<T: Val>(op: ReduceOp, n: usize, i: usize) -> T {
    let mut acc = reduced::<T>(op, 0, i).prescale(op);
    for q in 1..n {
        acc = T::combine(op, acc, reduced::<T>(op, q, i).prescale(op));
    }
    acc.finalize(op, n)
}

/// Where in the output the result lands, and what it must be.
type Expect<T> = Option<(usize, Vec<T>)>;

/// A buffer of a case: a vector, or ccl's shared memory
/// (`--shared-buffers`), which the other local ranks copy directly.
pub enum Host<T> {
    Vec(Vec<T>),
    /// `.1` elements at the start of the buffer.
    Shared(ccl::SharedBuffer, usize),
}

impl<T: Val> Host<T> {
    /// `v` itself, or a copy of it in a new shared buffer (an empty `v`
    /// stays a vector: a shared buffer has at least one byte).
    fn new(v: Vec<T>, shared: bool) -> ccl::Result<Host<T>> {
        if !shared || v.is_empty() {
            return Ok(Host::Vec(v));
        }
        let mut buf = ccl::SharedBuffer::new(std::mem::size_of_val(&v[..]))?;
        buf.as_mut_slice::<T>().copy_from_slice(&v);
        Ok(Host::Shared(buf, v.len()))
    }
}

impl<T: Val> std::ops::Deref for Host<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Host::Vec(v) => v,
            Host::Shared(b, len) => &b.as_slice::<T>()[..*len],
        }
    }
}

impl<T: Val> std::ops::DerefMut for Host<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Host::Vec(v) => v,
            Host::Shared(b, len) => &mut b.as_mut_slice::<T>()[..*len],
        }
    }
}

/// Everything one rank needs to run (and check) one collective at one size.
pub struct Case<T> {
    pub input: Host<T>,
    pub output: Host<T>,
    /// With checking: what `output` holds before each iteration.
    pub reset: Option<Vec<T>>,
    /// With checking: where in `output` the result lands, and what it must be.
    pub expect: Expect<T>,
}

/// Arguments of [`Case::new`].
#[derive(Clone, Copy, Debug)]
pub struct CaseSpec {
    pub coll: Coll,
    pub rank: usize,
    pub world: usize,
    pub count: usize,
    pub op: ReduceOp,
    pub root: usize,
    pub inplace: bool,
    pub check: bool,
    /// Buffers in ccl's shared memory (`--shared-buffers`).
    pub shared: bool,
}

impl<T: Val> Case<T> {
    pub fn new(s: CaseSpec) -> ccl::Result<Case<T>> {
        let CaseSpec {
            coll,
            rank,
            world: n,
            count: c,
            op,
            root,
            inplace,
            check,
            shared,
        } = s;
        let is_root = rank == root;
        let mv = |r: usize, range: std::ops::Range<usize>| -> Vec<T> {
            range.map(|i| moved::<T>(r, i)).collect()
        };
        let rv = |r: usize, range: std::ops::Range<usize>| -> Vec<T> {
            range.map(|i| reduced::<T>(op, r, i)).collect()
        };
        let red = |range: std::ops::Range<usize>| -> Vec<T> {
            range.map(|i| reduction::<T>(op, n, i)).collect()
        };
        // Blocks q = 0..n of c elements each, block q from `f(q, i)`.
        let blocks = |f: &dyn Fn(usize, usize) -> T| -> Vec<T> {
            (0..n)
                .flat_map(|q| (0..c).map(move |i| (q, i)))
                .map(|(q, i)| f(q, i))
                .collect()
        };
        let poison = |len: usize| vec![T::int(0); len];
        let none = Vec::new;
        // (input, initial output, expected result as (offset, values) or None)
        let (input, output, expect): (Vec<T>, Vec<T>, Expect<T>) = match coll {
            Coll::Allreduce => {
                let e = check.then(|| (0, red(0..c)));
                if inplace {
                    (none(), rv(rank, 0..c), e)
                } else {
                    (rv(rank, 0..c), poison(c), e)
                }
            }
            Coll::Broadcast => {
                let e = check.then(|| (0, mv(root, 0..c)));
                match (inplace, is_root) {
                    (true, true) => (none(), mv(root, 0..c), e),
                    (true, false) => (none(), poison(c), e),
                    (false, true) => (mv(root, 0..c), poison(c), e),
                    (false, false) => (none(), poison(c), e),
                }
            }
            Coll::Reduce => {
                let e = if !check {
                    None
                } else if is_root {
                    Some((0, red(0..c)))
                } else if inplace {
                    // Other ranks' buffers are left as they were.
                    Some((0, rv(rank, 0..c)))
                } else {
                    None
                };
                match (inplace, is_root) {
                    (true, _) => (none(), rv(rank, 0..c), e),
                    (false, true) => (rv(rank, 0..c), poison(c), e),
                    (false, false) => (rv(rank, 0..c), none(), e),
                }
            }
            Coll::Allgather => {
                let e = check.then(|| (0, blocks(&|q, i| moved::<T>(q, i))));
                if inplace {
                    let mut out = poison(n * c);
                    out[rank * c..(rank + 1) * c].copy_from_slice(&mv(rank, 0..c));
                    (none(), out, e)
                } else {
                    (mv(rank, 0..c), poison(n * c), e)
                }
            }
            Coll::ReduceScatter => {
                let mine = || red(rank * c..(rank + 1) * c);
                if inplace {
                    (
                        none(),
                        rv(rank, 0..n * c),
                        check.then(|| (rank * c, mine())),
                    )
                } else {
                    (rv(rank, 0..n * c), poison(c), check.then(|| (0, mine())))
                }
            }
            Coll::Alltoall => {
                let e = check.then(|| (0, blocks(&|q, i| moved::<T>(q, rank * c + i))));
                if inplace {
                    (none(), mv(rank, 0..n * c), e)
                } else {
                    (mv(rank, 0..n * c), poison(n * c), e)
                }
            }
            Coll::Gather => {
                let e = (check && is_root).then(|| (0, blocks(&|q, i| moved::<T>(q, i))));
                match (inplace, is_root) {
                    (true, true) => {
                        let mut out = poison(n * c);
                        out[root * c..(root + 1) * c].copy_from_slice(&mv(root, 0..c));
                        (none(), out, e)
                    }
                    (true, false) => (none(), mv(rank, 0..c), e),
                    (false, true) => (mv(rank, 0..c), poison(n * c), e),
                    (false, false) => (mv(rank, 0..c), none(), e),
                }
            }
            Coll::Scatter => {
                let mine = || mv(root, rank * c..(rank + 1) * c);
                match (inplace, is_root) {
                    (true, true) => (
                        none(),
                        mv(root, 0..n * c),
                        check.then(|| (root * c, mine())),
                    ),
                    (true, false) => (none(), poison(c), check.then(|| (0, mine()))),
                    (false, true) => (mv(root, 0..n * c), poison(c), check.then(|| (0, mine()))),
                    (false, false) => (none(), poison(c), check.then(|| (0, mine()))),
                }
            }
            Coll::Sendrecv => {
                let prev = (rank + n - 1) % n;
                (
                    mv(rank, 0..c),
                    poison(c),
                    check.then(|| (0, mv(prev, 0..c))),
                )
            }
            Coll::Barrier => (none(), none(), None),
        };
        let mut output = output;
        if let Some((off, want)) = &expect {
            // Where the output starts as poison, make sure poison is not the answer.
            let (p0, p1) = (T::int(0), T::int(1));
            for (o, w) in output[*off..*off + want.len()].iter_mut().zip(want) {
                if *o == p0 && *w == p0 {
                    *o = p1;
                }
            }
        }
        let reset = check.then(|| output.clone());
        Ok(Case {
            input: Host::new(input, shared)?,
            output: Host::new(output, shared)?,
            reset,
            expect,
        })
    }

    /// With checking: puts `output` back as it was before the first iteration.
    pub fn prepare(&mut self) {
        if let Some(r) = &self.reset {
            self.output.copy_from_slice(r);
        }
    }

    /// With checking: the number of elements of the result that are wrong.
    pub fn wrong(&self) -> u64 {
        let Some((off, want)) = &self.expect else {
            return 0;
        };
        let got = &self.output[*off..*off + want.len()];
        got.iter()
            .zip(want)
            .filter(|(g, w)| !T::close(**g, **w))
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_are_exact_in_small_types() {
        for n in 1..=16 {
            for i in 0..14 {
                let want: u64 = (0..n).map(|r| ((i + 3 * r) % 7) as u64 + 1).sum();
                assert_eq!(reduction::<bf16>(ReduceOp::Sum, n, i).to_f32() as u64, want);
                assert_eq!(reduction::<f16>(ReduceOp::Sum, n, i).to_f32() as u64, want);
                assert_eq!(reduction::<i8>(ReduceOp::Sum, n, i) as u64, want);
            }
        }
        assert_eq!(reduction::<f32>(ReduceOp::Avg, 2, 0), 2.5);
        assert_eq!(reduction::<i32>(ReduceOp::Avg, 2, 0), 2);
        assert_eq!(reduction::<i32>(ReduceOp::PreMulSum(3.0), 2, 0), 15);
        assert_eq!(reduction::<u8>(ReduceOp::Max, 3, 0), 7);
    }

    #[test]
    fn moved_values_are_never_poison() {
        fn check<T: Val>() {
            for r in 0..4 {
                for i in (0..70_000).chain([1 << 24, (1 << 24) - 1]) {
                    assert!(moved::<T>(r, i) != T::int(0), "{:?} {r} {i}", T::DTYPE);
                }
            }
        }
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u64>();
        check::<f16>();
        check::<bf16>();
        check::<f32>();
    }

    #[test]
    fn a_correct_result_has_no_wrong_elements() {
        let spec = CaseSpec {
            coll: Coll::Allreduce,
            rank: 0,
            world: 1,
            count: 100,
            op: ReduceOp::Sum,
            root: 0,
            inplace: false,
            check: true,
            shared: false,
        };
        for shared in [false, true] {
            let mut case = Case::<f32>::new(CaseSpec { shared, ..spec }).unwrap();
            assert_eq!(matches!(case.input, Host::Shared(..)), shared);
            assert_eq!(case.wrong(), 100, "poison is never the answer");
            let input = case.input.to_vec();
            case.output.copy_from_slice(&input);
            assert_eq!(case.wrong(), 0);
            case.output[7] += 1.0;
            assert_eq!(case.wrong(), 1);
            case.prepare();
            assert_eq!(case.wrong(), 100);
        }
    }
}
