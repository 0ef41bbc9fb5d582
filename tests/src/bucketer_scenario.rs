//! The bucketer's end-to-end checks, shared by the thread tests
//! (tests/bucketer.rs) and the multi-process worker (bin/bucketer_worker.rs),
//! which both include this file with `#[path]`.
//!
//! Every rank registers the same tensors (seeded mixed sizes and element
//! types), hands them over in its own seeded random order, and checks the
//! results: integers exactly against sums computed here, floats against the
//! unfused result (one allreduce per tensor), `no_sync` steps against the sum
//! over the accumulated steps.

#![allow(dead_code)]

use ccl::{Bucketer, Communicator, Element, ReduceOp, TensorId};

/// xorshift64*: small, seeded, the same on every platform.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Element types the integer checks use, converted from small integers.
pub trait Small: Element {
    fn small(v: u64) -> Self;
}
impl Small for i64 {
    fn small(v: u64) -> Self {
        v as i64
    }
}
impl Small for i32 {
    fn small(v: u64) -> Self {
        v as i32
    }
}
impl Small for u8 {
    fn small(v: u64) -> Self {
        v as u8
    }
}

/// The value rank `r` contributes at element `i` of tensor `t` in step `s`:
/// small enough that sums over 16 ranks and a few steps fit in a u8.
fn value(r: usize, s: usize, t: usize, i: usize) -> u64 {
    ((r * 5 + s * 3 + t * 7 + i) % 4) as u64
}

fn expected(n: usize, steps: &[usize], t: usize, i: usize) -> u64 {
    (0..n)
        .flat_map(|r| steps.iter().map(move |&s| value(r, s, t, i)))
        .sum()
}

/// The tensors of the integer checks: (element type tag 0..3, length).
fn int_tensors(seed: u64) -> Vec<(usize, usize)> {
    let mut rng = Rng::new(seed);
    let mut v: Vec<(usize, usize)> = (0..37).map(|_| (rng.below(3), rng.below(3000))).collect();
    v.push((0, 0)); // an empty tensor
    v.insert(5, (1, 40_000)); // larger than most caps
    v
}

fn make<T: Small>(r: usize, s: usize, t: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| T::small(value(r, s, t, i))).collect()
}

fn hand_over(
    b: &mut Bucketer,
    ids: &[TensorId],
    spec: &[(usize, usize)],
    r: usize,
    s: usize,
    rng: &mut Rng,
) -> Result<(), String> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    rng.shuffle(&mut order);
    for t in order {
        let (ty, len) = spec[t];
        let res = match ty {
            0 => b.ready(ids[t], make::<i64>(r, s, t, len)),
            1 => b.ready(ids[t], make::<i32>(r, s, t, len)),
            _ => b.ready(ids[t], make::<u8>(r, s, t, len)),
        };
        res.map_err(|e| format!("ready(tensor {t}) in step {s}: {e}"))?;
    }
    Ok(())
}

fn check_ints(
    out: &mut ccl::Reduced,
    ids: &[TensorId],
    spec: &[(usize, usize)],
    n: usize,
    steps: &[usize],
    what: &str,
) -> Result<usize, String> {
    fn cmp<T: Small>(
        got: ccl::Result<Vec<T>>,
        n: usize,
        steps: &[usize],
        t: usize,
        what: &str,
    ) -> Result<usize, String> {
        let got = got.map_err(|e| format!("{what}: take(tensor {t}): {e}"))?;
        for (i, g) in got.iter().enumerate() {
            let want = T::small(expected(n, steps, t, i));
            if *g != want {
                return Err(format!(
                    "{what}: tensor {t} element {i}: got {g:?}, expected {want:?}"
                ));
            }
        }
        Ok(got.len())
    }
    let mut checked = 0;
    for (t, &(ty, _)) in spec.iter().enumerate() {
        checked += match ty {
            0 => cmp::<i64>(out.take(ids[t]), n, steps, t, what)?,
            1 => cmp::<i32>(out.take(ids[t]), n, steps, t, what)?,
            _ => cmp::<u8>(out.take(ids[t]), n, steps, t, what)?,
        };
    }
    Ok(checked)
}

fn register(b: &mut Bucketer, spec: &[(usize, usize)]) -> Result<Vec<TensorId>, String> {
    spec.iter()
        .map(|&(ty, len)| match ty {
            0 => b.register::<i64>(len),
            1 => b.register::<i32>(len),
            _ => b.register::<u8>(len),
        })
        .collect::<ccl::Result<_>>()
        .map_err(|e| format!("register: {e}"))
}

/// Integer tensors of three element types, exact sums, under caps from
/// "every tensor alone" to "everything in one bucket per type"; then
/// `no_sync` accumulation over `k` steps. Returns the number of elements checked.
pub fn integers(comm: &Communicator, seed: u64) -> Result<usize, String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let spec = int_tensors(seed);
    let mut checked = 0;
    for cap in [0usize, 1000, 16 << 10, 100 << 10, 25 << 20] {
        let mut b = Bucketer::new(comm, ReduceOp::Sum).with_cap_bytes(cap);
        let ids = register(&mut b, &spec)?;
        let buckets = b.buckets();
        for ids in &buckets {
            let bytes: usize = ids
                .iter()
                .map(|id| spec[id.0].1 * [8, 4, 1][spec[id.0].0])
                .sum();
            if ids.len() > 1 && bytes > cap {
                return Err(format!("cap {cap}: a bucket of {bytes} bytes: {ids:?}"));
            }
            if ids.iter().any(|id| spec[id.0].0 != spec[ids[0].0].0) {
                return Err(format!("cap {cap}: a bucket mixes element types: {ids:?}"));
            }
        }
        let mut rng = Rng::new(seed ^ ((r as u64 + 1) * 1000) ^ cap as u64);
        for s in 0..2 {
            hand_over(&mut b, &ids, &spec, r, s, &mut rng)?;
            let mut out = b
                .finish()
                .wait()
                .map_err(|e| format!("cap {cap} step {s}: {e}"))?;
            checked += check_ints(
                &mut out,
                &ids,
                &spec,
                n,
                &[s],
                &format!("cap {cap} step {s}"),
            )?;
        }
        // no_sync: steps 2, 3, 4 accumulate, step 5 reduces the sum of all four.
        b.set_no_sync(true).map_err(|e| e.to_string())?;
        for s in 2..5 {
            hand_over(&mut b, &ids, &spec, r, s, &mut rng)?;
            let mut out = b
                .finish()
                .wait()
                .map_err(|e| format!("no_sync step {s}: {e}"))?;
            // Handed back unchanged: this rank's own values.
            for (t, &(ty, len)) in spec.iter().enumerate() {
                if ty == 0 {
                    let got: Vec<i64> = out.take(ids[t]).map_err(|e| e.to_string())?;
                    if got != make::<i64>(r, s, t, len) {
                        return Err(format!("no_sync step {s}: tensor {t} came back changed"));
                    }
                }
            }
        }
        b.set_no_sync(false).map_err(|e| e.to_string())?;
        hand_over(&mut b, &ids, &spec, r, 5, &mut rng)?;
        let mut out = b.finish().wait().map_err(|e| format!("sync step: {e}"))?;
        checked += check_ints(
            &mut out,
            &ids,
            &spec,
            n,
            &[2, 3, 4, 5],
            &format!("cap {cap}, sync after 3 no_sync steps"),
        )?;
        // And the accumulator starts afresh.
        hand_over(&mut b, &ids, &spec, r, 6, &mut rng)?;
        let mut out = b.finish().wait().map_err(|e| format!("step 6: {e}"))?;
        checked += check_ints(&mut out, &ids, &spec, n, &[6], &format!("cap {cap} step 6"))?;
    }
    Ok(checked)
}

/// f32 tensors of random values: the fused average must match one allreduce
/// per tensor, within the rounding of a different summation order.
pub fn floats(comm: &Communicator, seed: u64) -> Result<usize, String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let mut rng = Rng::new(seed ^ 0xF10A7);
    let lens: Vec<usize> = (0..60)
        .map(|_| {
            let bits = 4 + rng.below(12);
            1 + rng.below(1 << bits)
        })
        .collect();
    let mut checked = 0;
    for cap in [64usize << 10, 25 << 20] {
        let mut b = Bucketer::new(comm, ReduceOp::Avg).with_cap_bytes(cap);
        let ids: Vec<TensorId> = lens
            .iter()
            .map(|&l| b.register::<f32>(l))
            .collect::<ccl::Result<_>>()
            .map_err(|e| e.to_string())?;
        let mut vrng = Rng::new(seed ^ ((r as u64 + 7) * 31) ^ cap as u64);
        let grads: Vec<Vec<f32>> = lens
            .iter()
            .map(|&l| (0..l).map(|_| vrng.unit() * 100.0).collect())
            .collect();
        let mut unfused = grads.clone();
        for g in &mut unfused {
            comm.allreduce(g, ReduceOp::Avg)
                .map_err(|e| format!("unfused allreduce: {e}"))?;
        }
        let mut order: Vec<usize> = (0..lens.len()).collect();
        vrng.shuffle(&mut order);
        for &t in &order {
            b.ready(ids[t], grads[t].clone())
                .map_err(|e| format!("ready: {e}"))?;
        }
        let mut out = b.finish().wait().map_err(|e| format!("fused: {e}"))?;
        for (t, want) in unfused.iter().enumerate() {
            let got: Vec<f32> = out.take(ids[t]).map_err(|e| e.to_string())?;
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                // Sums of n values of magnitude <= 100, in another order.
                let tol = 100.0 * n as f32 * f32::EPSILON * 4.0;
                if (g - w).abs() > tol {
                    return Err(format!(
                        "cap {cap}: tensor {t} element {i}: fused {g}, unfused {w}"
                    ));
                }
            }
            checked += got.len();
        }
    }
    Ok(checked)
}

/// Everything, as one scenario.
pub fn all(comm: &Communicator, seed: u64) -> Result<usize, String> {
    Ok(integers(comm, seed)? + floats(comm, seed)?)
}
