//! How far a floating-point reduction by ccl may lie from MPI's.
//!
//! Neither ccl nor MPI promises an order of evaluation: ccl reduces along a
//! ring, a binomial tree or recursive doubling (with a fold for non-powers
//! of two), OpenMPI along whatever its tuned component picks. So for general
//! inputs the two results may differ, and the harness asserts, element by
//! element, `|ccl − mpi| ≤ bound`, with the bound derived here.
//! (Integers, min/max, data movement and the "exact" float inputs — small
//! integers, so that every partial result is representable — are compared
//! bit for bit instead.)
//!
//! # Model
//!
//! Let `n` be the number of ranks, `x_1..x_n` the terms of one output
//! element (after pre-multiplication for premulsum: both sides scale
//! identically, each term rounded once, so the terms are the same bits),
//! `s = Σ x_i` the exact sum and `S = Σ |x_i|`. Write `γ_k(u) = k·u/(1−k·u)`.
//!
//! * Any evaluation of a sum of `n` terms as a binary tree of `n − 1`
//!   additions, each rounded with unit roundoff `u`, has
//!   `|ŝ − s| ≤ γ_{n−1}(u) · S` (Higham, *Accuracy and Stability of
//!   Numerical Algorithms*, §4.2: every term passes through at most `n − 1`
//!   roundings). Rings, trees and recursive doubling are all such trees.
//!   Underflow adds nothing: a sum that lands in the subnormal range is
//!   exact (and for f16/bf16 the terms are multiples of the type's
//!   smallest subnormal, so every f32 partial sum below the type's normal
//!   range is too).
//! * A product of `n` terms in any order has `|p̂ − p| ≤ γ_{n−1}(u) · |p|`
//!   (inputs are drawn in `±[0.5, 2)`, so nothing over- or underflows).
//!
//! Unit roundoffs: `u = 2^−24` (f32), `2^−53` (f64). ccl reduces f16/bf16 by
//! widening to f32, combining, and rounding back: a double rounding, so
//! each step has unit `u_c = u_h + 2^−24·(1 + u_h)` with `u_h = 2^−11` (f16)
//! or `2^−8` (bf16). MPI has no 16-bit floats: the reference reduces the
//! widened inputs in f32 (`u_m = 2^−24`) and rounds the result once to the
//! 16-bit type (`u_o = u_h`; `u_o = 0` for f32/f64, where `u_c = u_m = u`).
//!
//! # Bounds (per output element)
//!
//! * **sum, premulsum**: ccl within `γ_{n−1}(u_c)·S` of `s`; MPI within
//!   `γ_{n−1}(u_m)·S`, and its final rounding moves it by at most
//!   `u_o·(1 + γ_{n−1}(u_m))·S`. By the triangle inequality
//!
//!   `|ccl − mpi| ≤ (γ_{n−1}(u_c) + γ_{n−1}(u_m) + u_o·(1 + γ_{n−1}(u_m))) · S`.
//!
//!   For f32 with 8 ranks that is `≈ 14·2^−24·S ≈ 8.3e−7·S`: `(n−1)·u·S`
//!   for each side.
//! * **avg** (ccl: sum, then one division by `n` rounded to the type — for
//!   16-bit types an f32 division rounded back, unit `u_c`; reference: MPI's
//!   sum divided by `n` the same way): each side is within its sum bound of
//!   `s`, divided by `n`, plus one division rounding of relative size `u_c`
//!   on a value at most `(1 + γ)·S/n`, plus at most one smallest subnormal
//!   `η` if the quotient underflows:
//!
//!   `|ccl − mpi| ≤ (γ_{n−1}(u_c) + γ_{n−1}(u_m) + u_c·(2 + γ_{n−1}(u_c) + γ_{n−1}(u_m))) · S/n + 2η`.
//! * **prod**: with `P = Π|x_i| ≤ |mpi_acc| / (1 − γ_{n−1}(u_m))` (`mpi_acc`
//!   being MPI's result before rounding to a 16-bit type):
//!
//!   `|ccl − mpi| ≤ (γ_{n−1}(u_c) + γ_{n−1}(u_m)) · P + u_o·|mpi_acc|`.
//!
//! `S` is itself computed by MPI (a sum of `|x_i|` in f64 along the same
//! collective), with relative error below `(n−1)·2^−53`, and the bound is
//! evaluated in f64: both errors are below `1e−14` relative, covered by a
//! relative slack of `1e−6` on the bound ([`SLACK`]), which is far too small
//! to hide a real discrepancy. With one rank the f32/f64 sum and avg bounds
//! are 0: results must be identical.

use ccl::DataType;

/// Relative slack on every bound, for evaluating it (and `S`) in f64.
pub const SLACK: f64 = 1.0 + 1e-6;

/// `γ_k(u) = k·u / (1 − k·u)`.
pub fn gamma(k: usize, u: f64) -> f64 {
    let ku = k as f64 * u;
    assert!(ku < 0.5, "γ_{k}({u}) is meaningless");
    ku / (1.0 - ku)
}

/// Unit roundoffs of one reduction of `dtype`: ccl's combining step, MPI's
/// (in f32 for the 16-bit types), and the reference's rounding to the output
/// type; and `η`, the type's smallest positive subnormal.
#[derive(Clone, Copy, Debug)]
pub struct Units {
    pub combine: f64,
    pub reference: f64,
    pub output: f64,
    pub eta: f64,
}

/// The [`Units`] of a floating-point `dtype` (`None` for integers).
pub fn units(dtype: DataType) -> Option<Units> {
    let u32_ = 2f64.powi(-24);
    let half = |uh: f64, eta: f64| Units {
        combine: uh + u32_ * (1.0 + uh),
        reference: u32_,
        output: uh,
        eta,
    };
    Some(match dtype {
        DataType::F64 => {
            let u = 2f64.powi(-53);
            Units {
                combine: u,
                reference: u,
                output: 0.0,
                eta: 2f64.powi(-1074),
            }
        }
        DataType::F32 => Units {
            combine: u32_,
            reference: u32_,
            output: 0.0,
            eta: 2f64.powi(-149),
        },
        DataType::F16 => half(2f64.powi(-11), 2f64.powi(-24)),
        DataType::Bf16 => half(2f64.powi(-8), 2f64.powi(-133)),
        _ => return None,
    })
}

fn gammas(dtype: DataType, n: usize) -> (Units, f64, f64) {
    let u = units(dtype).expect("bounds are for floating-point types");
    let k = n.saturating_sub(1);
    (u, gamma(k, u.combine), gamma(k, u.reference))
}

/// Bound on `|ccl − mpi|` for a sum (or premulsum) of `n` terms whose absolute values sum to `abs_sum`.
pub fn sum(dtype: DataType, n: usize, abs_sum: f64) -> f64 {
    let (u, gc, gm) = gammas(dtype, n);
    SLACK * (gc + gm + u.output * (1.0 + gm)) * abs_sum
}

/// Bound on `|ccl − mpi|` for an average of `n` terms whose absolute values sum to `abs_sum`.
pub fn avg(dtype: DataType, n: usize, abs_sum: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let (u, gc, gm) = gammas(dtype, n);
    SLACK * ((gc + gm + u.combine * (2.0 + gc + gm)) * abs_sum / n as f64 + 2.0 * u.eta)
}

/// Bound on `|ccl − mpi|` for a product of `n` terms, MPI's (unrounded) result being `mpi_acc`.
pub fn prod(dtype: DataType, n: usize, mpi_acc: f64) -> f64 {
    let (u, gc, gm) = gammas(dtype, n);
    let p = mpi_acc.abs() / (1.0 - gm);
    SLACK * ((gc + gm) * p + u.output * mpi_acc.abs())
}

#[cfg(test)]
mod tests {
    //! The bounds against simulation: ccl-like evaluations (random binary
    //! trees, 16-bit types rounded after every step) against MPI-like ones
    //! (left to right in f32 or the type itself, rounded once at the end).
    use super::*;
    use crate::rng::Rng;
    use half::{bf16, f16};

    /// Reduces `xs` along a random binary tree with `step`.
    fn tree<T: Copy>(rng: &mut Rng, xs: &[T], step: &impl Fn(T, T) -> T) -> T {
        let mut v = xs.to_vec();
        while v.len() > 1 {
            let i = rng.index(v.len());
            let a = v.swap_remove(i);
            let j = rng.index(v.len());
            v[j] = step(a, v[j]);
        }
        v[0]
    }

    fn terms(rng: &mut Rng, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| (2.0 * rng.unit() - 1.0) * scale * 2f64.powi(rng.range(-4, 4) as i32))
            .collect()
    }

    #[test]
    fn sums_and_averages_of_every_type_stay_within_the_bound() {
        let mut rng = Rng::new(42);
        let mut worst = [0f64; 4];
        for trial in 0..20_000 {
            let n = 1 + trial % 8;
            // Terms as the type holds them (rounded once), as both sides see them.
            let raw = terms(&mut rng, n, 1.0);
            let cases: [(DataType, Vec<f64>, f64, f64); 4] = {
                let f32s: Vec<f32> = raw.iter().map(|&x| x as f32).collect();
                let c32 = tree(&mut rng, &f32s, &|a: f32, b: f32| a + b) as f64;
                let m32 = f32s.iter().fold(0f32, |a, &b| a + b) as f64;
                let c64 = tree(&mut rng, &raw, &|a: f64, b: f64| a + b);
                let m64 = raw.iter().fold(0f64, |a, &b| a + b);
                let h: Vec<f16> = raw.iter().map(|&x| f16::from_f64(x)).collect();
                let ch = tree(&mut rng, &h, &|a: f16, b: f16| {
                    f16::from_f32(a.to_f32() + b.to_f32())
                })
                .to_f64();
                let mh = f16::from_f32(h.iter().fold(0f32, |a, b| a + b.to_f32())).to_f64();
                let b: Vec<bf16> = raw.iter().map(|&x| bf16::from_f64(x)).collect();
                let cb = tree(&mut rng, &b, &|a: bf16, b: bf16| {
                    bf16::from_f32(a.to_f32() + b.to_f32())
                })
                .to_f64();
                let mb = bf16::from_f32(b.iter().fold(0f32, |a, b| a + b.to_f32())).to_f64();
                [
                    (
                        DataType::F32,
                        f32s.iter().map(|&x| x as f64).collect(),
                        c32,
                        m32,
                    ),
                    (DataType::F64, raw.clone(), c64, m64),
                    (
                        DataType::F16,
                        h.iter().map(|x| x.to_f64()).collect(),
                        ch,
                        mh,
                    ),
                    (
                        DataType::Bf16,
                        b.iter().map(|x| x.to_f64()).collect(),
                        cb,
                        mb,
                    ),
                ]
            };
            for (k, (d, xs, c, m)) in cases.iter().enumerate() {
                let s: f64 = xs.iter().map(|x| x.abs()).sum();
                let b = sum(*d, n, s);
                assert!((c - m).abs() <= b, "{d} n={n}: {c} vs {m}, bound {b}");
                if b > 0.0 {
                    worst[k] = worst[k].max((c - m).abs() / b);
                }
            }
        }
        // The bound is not vacuous: real differences come within a few
        // percent of it at least once (it is a worst case, so not closer).
        for (k, w) in worst.iter().enumerate() {
            assert!(*w > 0.01, "type {k}: worst ratio {w}");
            assert!(*w <= 1.0);
        }
    }

    #[test]
    fn half_average_within_bound() {
        let mut rng = Rng::new(7);
        for trial in 0..20_000 {
            let n = 2 + trial % 7;
            let h: Vec<f16> = terms(&mut rng, n, 1.0)
                .iter()
                .map(|&x| f16::from_f64(x))
                .collect();
            let cs = tree(&mut rng, &h, &|a: f16, b: f16| {
                f16::from_f32(a.to_f32() + b.to_f32())
            });
            let c = f16::from_f32(cs.to_f32() / n as f32).to_f64();
            let ms = h.iter().fold(0f32, |a, b| a + b.to_f32());
            let m = f16::from_f32(ms / n as f32).to_f64();
            let s: f64 = h.iter().map(|x| x.to_f64().abs()).sum();
            let b = avg(DataType::F16, n, s);
            assert!((c - m).abs() <= b, "n={n}: {c} vs {m}, bound {b}");
        }
    }

    #[test]
    fn products_within_bound() {
        let mut rng = Rng::new(9);
        for trial in 0..20_000 {
            let n = 1 + trial % 8;
            let xs: Vec<f32> = (0..n)
                .map(|_| {
                    let m = 0.5 + 1.5 * rng.unit();
                    (if rng.chance(1, 2) { -m } else { m }) as f32
                })
                .collect();
            let c = tree(&mut rng, &xs, &|a: f32, b: f32| a * b) as f64;
            let m = xs.iter().fold(1f32, |a, &b| a * b) as f64;
            assert!((c - m).abs() <= prod(DataType::F32, n, m));
            let h: Vec<bf16> = xs.iter().map(|&x| bf16::from_f32(x)).collect();
            let c = tree(&mut rng, &h, &|a: bf16, b: bf16| {
                bf16::from_f32(a.to_f32() * b.to_f32())
            })
            .to_f64();
            let acc = h.iter().fold(1f32, |a, b| a * b.to_f32());
            let m = bf16::from_f32(acc).to_f64();
            assert!((c - m).abs() <= prod(DataType::Bf16, n, acc as f64));
        }
    }

    #[test]
    fn one_rank_must_match_exactly() {
        for d in [DataType::F16, DataType::Bf16, DataType::F32, DataType::F64] {
            assert_eq!(avg(d, 1, 5.0), 0.0);
            // Sum over one rank: ccl returns the input; the reference rounds
            // an f32 copy of it back, exactly.
            assert!(sum(d, 1, 5.0) <= units(d).unwrap().output * 5.0 * SLACK);
        }
    }
}
