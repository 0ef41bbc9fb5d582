//! The worker's checks of every collective on one element type: in place,
//! out of place and asynchronous, against values computed here from plain
//! numbers independently of ccl.

use ccl::{bf16, f16, Communicator, Element, ReduceOp};

use crate::calls::Calls;

/// An element type the checks can build from and compare with plain numbers.
pub(crate) trait TestElem: Element + Copy {
    /// Wrapping conversion for integers, nearest for floats.
    fn from_i64(v: i64) -> Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    const FLOAT: bool;
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self { v as $t }
            fn from_f64(v: f64) -> Self { v as i64 as $t }
            fn to_f64(self) -> f64 { self as f64 }
            const FLOAT: bool = false;
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

macro_rules! float_elem {
    ($($t:ty: $from:expr, $to:expr),*) => {$(
        impl TestElem for $t {
            fn from_i64(v: i64) -> Self { $from(v as f64) }
            fn from_f64(v: f64) -> Self { $from(v) }
            fn to_f64(self) -> f64 { $to(self) }
            const FLOAT: bool = true;
        }
    )*};
}
float_elem!(f32: |v: f64| v as f32, |x: f32| x as f64, f64: |v: f64| v, |x: f64| x,
            f16: f16::from_f64, f16::to_f64, bf16: bf16::from_f64, bf16::to_f64);

/// What rank `r` contributes at index `i` for `op`: small integers, so that every
/// order of summation is exact in every type, and products stay in range.
fn value(op: ReduceOp, r: usize, i: usize) -> i64 {
    match op {
        ReduceOp::Prod => 1 + ((r + i) % 2) as i64,
        _ => 1 + ((r * 7 + i * 3) % 5) as i64,
    }
}

/// The scalar rank `r` passes for a pre-multiplied sum: different on every rank.
fn scalar(r: usize) -> f64 {
    (r + 1) as f64
}

fn op_for_rank(op: ReduceOp, r: usize) -> ReduceOp {
    match op {
        ReduceOp::PreMulSum(_) => ReduceOp::PreMulSum(scalar(r)),
        op => op,
    }
}

/// The reduction of every rank's value at index `i`, computed directly.
fn expected<T: TestElem>(op: ReduceOp, n: usize, i: usize) -> T {
    let vs = (0..n).map(|r| value(op, r, i));
    match op {
        ReduceOp::Sum => T::from_i64(vs.sum()),
        ReduceOp::Prod => T::from_i64(vs.product()),
        ReduceOp::Min => T::from_i64(vs.min().unwrap()),
        ReduceOp::Max => T::from_i64(vs.max().unwrap()),
        ReduceOp::Avg if T::FLOAT => T::from_f64(vs.sum::<i64>() as f64 / n as f64),
        ReduceOp::Avg => T::from_i64(vs.sum::<i64>() / n as i64),
        ReduceOp::BitAnd => T::from_i64(vs.fold(-1, |a, b| a & b)),
        ReduceOp::BitOr => T::from_i64(vs.fold(0, |a, b| a | b)),
        ReduceOp::BitXor => T::from_i64(vs.fold(0, |a, b| a ^ b)),
        ReduceOp::PreMulSum(_) => {
            T::from_i64((0..n).map(|r| scalar(r) as i64 * value(op, r, i)).sum())
        }
    }
}

/// Equal, allowing one rounding of difference for floats (average divides once).
fn same<T: TestElem>(a: T, b: T) -> bool {
    if T::FLOAT {
        let (x, y) = (a.to_f64(), b.to_f64());
        x == y
            || (x - y).abs() <= 1e-2 * y.abs().max(1.0) && std::mem::size_of::<T>() == 2
            || (x - y).abs() <= 1e-6 * y.abs().max(1.0)
    } else {
        a == b
    }
}

pub(crate) struct Checker {
    pub(crate) rank: usize,
    pub(crate) failures: usize,
    pub(crate) checks: usize,
}

impl Checker {
    pub(crate) fn vec<T: TestElem>(
        &mut self,
        what: &str,
        got: &[T],
        want: impl Fn(usize) -> T,
        len: usize,
    ) {
        self.checks += 1;
        if got.len() != len {
            self.fail(format!("{what}: length {} instead of {len}", got.len()));
            return;
        }
        if let Some(i) = (0..len).find(|&i| !same(got[i], want(i))) {
            self.fail(format!(
                "{what}: index {i}: got {:?}, want {:?}",
                got[i],
                want(i)
            ));
        }
    }

    pub(crate) fn ok<T>(&mut self, what: &str, r: ccl::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.fail(format!("{what}: error: {e}"));
                None
            }
        }
    }

    pub(crate) fn fail(&mut self, msg: String) {
        self.failures += 1;
        if self.failures <= 20 {
            eprintln!("rank {}: FAIL {msg}", self.rank);
        }
    }
}

fn reducing_ops<T: TestElem>() -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .filter(|op| op.validate(T::DTYPE).is_ok())
        .collect()
}

/// What rank `src` holds at index `i` in the data-movement checks.
fn origin<T: TestElem>(src: usize, i: usize) -> T {
    T::from_i64(((src * 31 + i) % 100) as i64)
}

/// What rank `src` sends rank `dst` at index `i` in the all-to-all checks.
fn addressed<T: TestElem>(src: usize, dst: usize, i: usize) -> T {
    T::from_i64(((src * 13 + dst * 5 + i) % 100) as i64)
}

/// Every blocking collective on `T`, in place and out of place, through
/// `comm` (the host's typed methods, or device memory).
pub(crate) fn check_calls<T: TestElem>(comm: &impl Calls, ck: &mut Checker, counts: &[usize]) {
    let (r, n) = (comm.rank(), comm.world_size());
    let name = T::DTYPE.name();
    for &c in counts {
        // Reductions, every op, in place and out of place.
        for op in reducing_ops::<T>() {
            let my_op = op_for_rank(op, r);
            let input: Vec<T> = (0..c).map(|i| T::from_i64(value(op, r, i))).collect();
            let tag = format!("{name} {op} count {c}");
            let mut buf = input.clone();
            if ck
                .ok(&format!("allreduce {tag}"), comm.allreduce(&mut buf, my_op))
                .is_some()
            {
                ck.vec(
                    &format!("allreduce {tag}"),
                    &buf,
                    |i| expected::<T>(op, n, i),
                    c,
                );
            }
            let mut out = vec![T::zeroed(); c];
            if ck
                .ok(
                    &format!("allreduce_into {tag}"),
                    comm.allreduce_into(&input, &mut out, my_op),
                )
                .is_some()
            {
                ck.vec(
                    &format!("allreduce_into {tag}"),
                    &out,
                    |i| expected::<T>(op, n, i),
                    c,
                );
            }
            let root = n - 1;
            let mut buf = input.clone();
            if ck
                .ok(&format!("reduce {tag}"), comm.reduce(&mut buf, my_op, root))
                .is_some()
            {
                let want = |i| {
                    if r == root {
                        expected::<T>(op, n, i)
                    } else {
                        input[i]
                    }
                };
                ck.vec(&format!("reduce {tag}"), &buf, want, c);
            }
            let mut out = vec![T::zeroed(); if r == root { c } else { 0 }];
            if ck
                .ok(
                    &format!("reduce_into {tag}"),
                    comm.reduce_into(&input, &mut out, my_op, root),
                )
                .is_some()
                && r == root
            {
                ck.vec(
                    &format!("reduce_into {tag}"),
                    &out,
                    |i| expected::<T>(op, n, i),
                    c,
                );
            }
            // reduce-scatter: block b of every rank's input holds the values of indices b*c..
            let rs_in: Vec<T> = (0..n * c).map(|i| T::from_i64(value(op, r, i))).collect();
            let mut out = vec![T::zeroed(); c];
            if ck
                .ok(
                    &format!("reduce_scatter_into {tag}"),
                    comm.reduce_scatter_into(&rs_in, &mut out, my_op),
                )
                .is_some()
            {
                ck.vec(
                    &format!("reduce_scatter_into {tag}"),
                    &out,
                    |i| expected::<T>(op, n, r * c + i),
                    c,
                );
            }
            let mut buf = rs_in.clone();
            if ck
                .ok(
                    &format!("reduce_scatter {tag}"),
                    comm.reduce_scatter(&mut buf, my_op),
                )
                .is_some()
            {
                ck.vec(
                    &format!("reduce_scatter {tag}"),
                    &buf[r * c..(r + 1) * c],
                    |i| expected::<T>(op, n, r * c + i),
                    c,
                );
            }
        }
        // Data movement; values name their origin rank and index.
        let tag = format!("{name} count {c}");
        let v = origin::<T>;
        let mine: Vec<T> = (0..c).map(|i| v(r, i)).collect();
        for root in 0..n {
            let mut buf = if r == root {
                mine.clone()
            } else {
                vec![T::zeroed(); c]
            };
            if ck
                .ok(
                    &format!("broadcast {tag} root {root}"),
                    comm.broadcast(&mut buf, root),
                )
                .is_some()
            {
                ck.vec(
                    &format!("broadcast {tag} root {root}"),
                    &buf,
                    |i| v(root, i),
                    c,
                );
            }
            let mut out = vec![T::zeroed(); c];
            if ck
                .ok(
                    &format!("broadcast_into {tag} root {root}"),
                    comm.broadcast_into(&mine, &mut out, root),
                )
                .is_some()
            {
                ck.vec(
                    &format!("broadcast_into {tag} root {root}"),
                    &out,
                    |i| v(root, i),
                    c,
                );
            }
            let mut out = vec![T::zeroed(); if r == root { n * c } else { 0 }];
            if ck
                .ok(
                    &format!("gather_into {tag} root {root}"),
                    comm.gather_into(&mine, &mut out, root),
                )
                .is_some()
                && r == root
            {
                ck.vec(
                    &format!("gather_into {tag} root {root}"),
                    &out,
                    |i| v(i / c.max(1), i % c.max(1)),
                    n * c,
                );
            }
            let mut buf = if r == root {
                let mut b = vec![T::zeroed(); n * c];
                b[root * c..(root + 1) * c].copy_from_slice(&mine);
                b
            } else {
                mine.clone()
            };
            if ck
                .ok(
                    &format!("gather {tag} root {root}"),
                    comm.gather(&mut buf, root),
                )
                .is_some()
                && r == root
            {
                ck.vec(
                    &format!("gather {tag} root {root}"),
                    &buf,
                    |i| v(i / c.max(1), i % c.max(1)),
                    n * c,
                );
            }
            // scatter: the root's block p is what rank p should get: v(p, i)
            let all: Vec<T> = (0..n * c).map(|i| v(i / c.max(1), i % c.max(1))).collect();
            let mut out = vec![T::zeroed(); c];
            if ck
                .ok(
                    &format!("scatter_into {tag} root {root}"),
                    comm.scatter_into(&all, &mut out, root),
                )
                .is_some()
            {
                ck.vec(
                    &format!("scatter_into {tag} root {root}"),
                    &out,
                    |i| v(r, i),
                    c,
                );
            }
            let mut buf = if r == root {
                all.clone()
            } else {
                vec![T::zeroed(); c]
            };
            if ck
                .ok(
                    &format!("scatter {tag} root {root}"),
                    comm.scatter(&mut buf, root),
                )
                .is_some()
            {
                let got = if r == root {
                    &buf[root * c..(root + 1) * c]
                } else {
                    &buf[..]
                };
                ck.vec(&format!("scatter {tag} root {root}"), got, |i| v(r, i), c);
            }
        }
        let mut out = vec![T::zeroed(); n * c];
        if ck
            .ok(
                &format!("allgather_into {tag}"),
                comm.allgather_into(&mine, &mut out),
            )
            .is_some()
        {
            ck.vec(
                &format!("allgather_into {tag}"),
                &out,
                |i| v(i / c.max(1), i % c.max(1)),
                n * c,
            );
        }
        let mut buf = vec![T::zeroed(); n * c];
        buf[r * c..(r + 1) * c].copy_from_slice(&mine);
        if ck
            .ok(&format!("allgather {tag}"), comm.allgather(&mut buf))
            .is_some()
        {
            ck.vec(
                &format!("allgather {tag}"),
                &buf,
                |i| v(i / c.max(1), i % c.max(1)),
                n * c,
            );
        }
        // all-to-all: block p of rank r's input is meant for p: value names (r, p, i)
        let a2a = addressed::<T>;
        let input: Vec<T> = (0..n * c)
            .map(|k| a2a(r, k / c.max(1), k % c.max(1)))
            .collect();
        let mut out = vec![T::zeroed(); n * c];
        if ck
            .ok(
                &format!("alltoall_into {tag}"),
                comm.alltoall_into(&input, &mut out),
            )
            .is_some()
        {
            ck.vec(
                &format!("alltoall_into {tag}"),
                &out,
                |k| a2a(k / c.max(1), r, k % c.max(1)),
                n * c,
            );
        }
        let mut buf = input.clone();
        if ck
            .ok(&format!("alltoall {tag}"), comm.alltoall(&mut buf))
            .is_some()
        {
            ck.vec(
                &format!("alltoall {tag}"),
                &buf,
                |k| a2a(k / c.max(1), r, k % c.max(1)),
                n * c,
            );
        }
    }
}

/// Every collective on `T` through the host's typed methods: the blocking
/// ones, then the asynchronous ones, several in flight at once.
pub(crate) fn check_type<T: TestElem>(comm: &Communicator, ck: &mut Checker, counts: &[usize]) {
    check_calls::<T>(comm, ck, counts);
    let (r, n) = (comm.rank(), comm.world_size());
    let name = T::DTYPE.name();
    for &c in counts {
        let tag = format!("{name} count {c}");
        let v = origin::<T>;
        let a2a = addressed::<T>;
        let mine: Vec<T> = (0..c).map(|i| v(r, i)).collect();
        let input: Vec<T> = (0..n * c)
            .map(|k| a2a(r, k / c.max(1), k % c.max(1)))
            .collect();
        let sum_in: Vec<T> = (0..c)
            .map(|i| T::from_i64(value(ReduceOp::Sum, r, i)))
            .collect();
        let w1 = comm.iallreduce(sum_in.clone(), ReduceOp::Sum);
        let w2 = comm.ibroadcast(
            if r == 0 {
                mine.clone()
            } else {
                vec![T::zeroed(); c]
            },
            0,
        );
        let w3 = comm.iallgather(mine.clone());
        let w4 = comm.ireduce_scatter(
            (0..n * c)
                .map(|i| T::from_i64(value(ReduceOp::Sum, r, i)))
                .collect(),
            ReduceOp::Sum,
        );
        let w5 = comm.ialltoall(input.clone());
        let w6 = comm.igather(mine.clone(), n - 1);
        let w7 = comm.iscatter(
            if r == 0 {
                (0..n * c).map(|i| v(i / c.max(1), i % c.max(1))).collect()
            } else {
                vec![]
            },
            c,
            0,
        );
        let w8 = comm.ireduce(sum_in.clone(), ReduceOp::Max, 0);
        let w9 = comm.ibarrier();
        // A blocking call made while those are queued runs after them.
        let mut behind = sum_in.clone();
        if ck
            .ok(
                "allreduce behind queued calls",
                comm.allreduce(&mut behind, ReduceOp::Sum),
            )
            .is_some()
        {
            ck.vec(
                &format!("allreduce behind queued calls {tag}"),
                &behind,
                |i| expected::<T>(ReduceOp::Sum, n, i),
                c,
            );
        }
        if let Some(x) = ck.ok("iallreduce", w1.wait()) {
            ck.vec(
                &format!("iallreduce {tag}"),
                &x,
                |i| expected::<T>(ReduceOp::Sum, n, i),
                c,
            );
        }
        if let Some(x) = ck.ok("ibroadcast", w2.wait()) {
            ck.vec(&format!("ibroadcast {tag}"), &x, |i| v(0, i), c);
        }
        if let Some(x) = ck.ok("iallgather", w3.wait()) {
            ck.vec(
                &format!("iallgather {tag}"),
                &x,
                |i| v(i / c.max(1), i % c.max(1)),
                n * c,
            );
        }
        if let Some(x) = ck.ok("ireduce_scatter", w4.wait()) {
            ck.vec(
                &format!("ireduce_scatter {tag}"),
                &x,
                |i| expected::<T>(ReduceOp::Sum, n, r * c + i),
                c,
            );
        }
        if let Some(x) = ck.ok("ialltoall", w5.wait()) {
            ck.vec(
                &format!("ialltoall {tag}"),
                &x,
                |k| a2a(k / c.max(1), r, k % c.max(1)),
                n * c,
            );
        }
        if let Some(x) = ck.ok("igather", w6.wait()) {
            let len = if r == n - 1 { n * c } else { 0 };
            ck.vec(
                &format!("igather {tag}"),
                &x,
                |i| v(i / c.max(1), i % c.max(1)),
                len,
            );
        }
        if let Some(x) = ck.ok("iscatter", w7.wait()) {
            ck.vec(&format!("iscatter {tag}"), &x, |i| v(r, i), c);
        }
        if let Some(x) = ck.ok("ireduce", w8.wait()) {
            let want = |i| {
                if r == 0 {
                    expected::<T>(ReduceOp::Max, n, i)
                } else {
                    sum_in[i]
                }
            };
            ck.vec(&format!("ireduce {tag}"), &x, want, c);
        }
        ck.ok("ibarrier", w9.wait());
        ck.ok("barrier", comm.barrier());
    }
}
