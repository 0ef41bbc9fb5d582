//! The host kernels: reduction ops applied to byte buffers in this
//! process's memory, and [`HostKernels`](crate::HostKernels), which offers them to the executor
//! and the links for host memory.
//!
//! Kernels take byte slices plus a [`DataType`] so that the executor and the
//! transports stay untyped; each kernel casts once and then runs a plain loop
//! over typed slices that the compiler vectorises. Integer sums and products
//! wrap (as MPI's do). `f16`/`bf16` are widened to `f32` for each step and
//! rounded once, so a reduction over n ranks rounds n-1 times, never more.
//! Each kernel is compiled twice, for the x86-64 baseline and for AVX2+F16C
//! ([`x86`] holds the fused 16-bit float kernels), and chosen at run time.

use half::{bf16, f16, slice::HalfFloatSliceExt};

use crate::{DataType, Error, ReduceOp, Result};

mod stream;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use stream::{copy, copy_streaming};

/// The binary combining step of an op (`Avg` and `PreMulSum` combine by summing).
#[derive(Clone, Copy)]
enum Combine {
    Sum,
    Prod,
    Min,
    Max,
    And,
    Or,
    Xor,
}

fn combine_of(op: ReduceOp) -> Combine {
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::PreMulSum(_) => Combine::Sum,
        ReduceOp::Prod => Combine::Prod,
        ReduceOp::Min => Combine::Min,
        ReduceOp::Max => Combine::Max,
        ReduceOp::BitAnd => Combine::And,
        ReduceOp::BitOr => Combine::Or,
        ReduceOp::BitXor => Combine::Xor,
    }
}

/// Applies a binary function elementwise: `dst[i] = f(a[i], b[i])`, where `a`
/// is `dst` itself when `None`.
#[inline(always)]
fn zip_apply<T: Copy>(dst: &mut [T], a: Option<&[T]>, b: &[T], f: impl Fn(T, T) -> T) {
    match a {
        None => {
            for (d, s) in dst.iter_mut().zip(b) {
                *d = f(*d, *s);
            }
        }
        Some(a) => {
            for ((d, x), y) in dst.iter_mut().zip(a).zip(b) {
                *d = f(*x, *y);
            }
        }
    }
}

macro_rules! int_kernel {
    ($name:ident, $t:ty) => {
        #[inline(always)]
        fn $name(c: Combine, dst: &mut [$t], a: Option<&[$t]>, b: &[$t]) {
            match c {
                Combine::Sum => zip_apply(dst, a, b, |x, y| x.wrapping_add(y)),
                Combine::Prod => zip_apply(dst, a, b, |x, y| x.wrapping_mul(y)),
                Combine::Min => zip_apply(dst, a, b, |x, y| if y < x { y } else { x }),
                Combine::Max => zip_apply(dst, a, b, |x, y| if y > x { y } else { x }),
                Combine::And => zip_apply(dst, a, b, |x, y| x & y),
                Combine::Or => zip_apply(dst, a, b, |x, y| x | y),
                Combine::Xor => zip_apply(dst, a, b, |x, y| x ^ y),
            }
        }
    };
}

macro_rules! float_kernel {
    ($name:ident, $t:ty) => {
        #[inline(always)]
        fn $name(c: Combine, dst: &mut [$t], a: Option<&[$t]>, b: &[$t]) {
            match c {
                Combine::Sum => zip_apply(dst, a, b, |x, y| x + y),
                Combine::Prod => zip_apply(dst, a, b, |x, y| x * y),
                Combine::Min => zip_apply(dst, a, b, |x, y| if y < x { y } else { x }),
                Combine::Max => zip_apply(dst, a, b, |x, y| if y > x { y } else { x }),
                // Rejected by `ReduceOp::validate` before any kernel runs.
                Combine::And | Combine::Or | Combine::Xor => {}
            }
        }
    };
}

int_kernel!(kernel_i8, i8);
int_kernel!(kernel_u8, u8);
int_kernel!(kernel_i32, i32);
int_kernel!(kernel_u32, u32);
int_kernel!(kernel_i64, i64);
int_kernel!(kernel_u64, u64);
float_kernel!(kernel_f32, f32);
float_kernel!(kernel_f64, f64);

/// Elements of a 16-bit float block widened to f32 at a time (fits in L1).
const HALF_BLOCK: usize = 256;

/// A 16-bit float that widens to f32 and rounds back, one slice at a time.
trait Half: Copy {
    fn widen(from: &[Self], to: &mut [f32]);
    fn narrow(from: &[f32], to: &mut [Self]);
}

impl Half for f16 {
    #[inline(always)]
    fn widen(from: &[f16], to: &mut [f32]) {
        from.convert_to_f32_slice(to)
    }
    #[inline(always)]
    fn narrow(from: &[f32], to: &mut [f16]) {
        to.convert_from_f32_slice(from)
    }
}

/// bf16 by hand, with the same rounding as `half` (to nearest, ties to
/// even; NaN stays NaN), as plain integer code that the compiler vectorizes.
impl Half for bf16 {
    #[inline(always)]
    fn widen(from: &[bf16], to: &mut [f32]) {
        for (t, f) in to.iter_mut().zip(from) {
            let x = f.to_bits();
            // A signalling NaN comes out quiet.
            let quiet = if x & 0x7fff > 0x7f80 { 0x0040 } else { 0 };
            *t = f32::from_bits(((x | quiet) as u32) << 16);
        }
    }
    #[inline(always)]
    fn narrow(from: &[f32], to: &mut [bf16]) {
        for (t, f) in to.iter_mut().zip(from) {
            let x = f.to_bits();
            let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
            let nan = (x >> 16) as u16 | 0x0040;
            *t = bf16::from_bits(if f.is_nan() { nan } else { rounded });
        }
    }
}

/// Reduces 16-bit floats by widening blocks to f32, combining, and rounding once.
#[inline(always)]
fn kernel_half<H: Half>(c: Combine, dst: &mut [H], a: Option<&[H]>, b: &[H]) {
    let mut fa = [0f32; HALF_BLOCK];
    let mut fb = [0f32; HALF_BLOCK];
    let mut start = 0;
    while start < dst.len() {
        let end = (start + HALF_BLOCK).min(dst.len());
        let n = end - start;
        match a {
            Some(a) => H::widen(&a[start..end], &mut fa[..n]),
            None => H::widen(&dst[start..end], &mut fa[..n]),
        }
        H::widen(&b[start..end], &mut fb[..n]);
        let (x, y) = (&mut fa[..n], &fb[..n]);
        kernel_f32(c, x, None, y);
        H::narrow(x, &mut dst[start..end]);
        start = end;
    }
}

/// Casts a byte slice to `T`, or reports which argument was misaligned.
fn typed<'a, T: bytemuck::Pod>(bytes: &'a [u8], what: &str) -> Result<&'a [T]> {
    bytemuck::try_cast_slice(bytes)
        .map_err(|e| Error::Internal(format!("{what} buffer cannot be viewed as elements: {e:?}")))
}

fn typed_mut<'a, T: bytemuck::Pod>(bytes: &'a mut [u8], what: &str) -> Result<&'a mut [T]> {
    bytemuck::try_cast_slice_mut(bytes)
        .map_err(|e| Error::Internal(format!("{what} buffer cannot be viewed as elements: {e:?}")))
}

/// `dst = a ⊕ b` elementwise, with `a = dst` when `a` is `None`.
///
/// All slices must have the same length, a multiple of the element size, and
/// be aligned for the element type. `Avg` and `PreMulSum` combine by summing;
/// their pre/post steps are [`prescale`] and [`finalize`].
#[inline]
pub fn reduce(
    op: ReduceOp,
    dtype: DataType,
    dst: &mut [u8],
    a: Option<&[u8]>,
    b: &[u8],
) -> Result<()> {
    if b.len() != dst.len() || a.is_some_and(|a| a.len() != dst.len()) {
        return Err(Error::Internal(format!(
            "reduce length mismatch: dst {} a {:?} b {}",
            dst.len(),
            a.map(<[u8]>::len),
            b.len()
        )));
    }
    if dst.is_empty() {
        return Ok(());
    }
    let c = combine_of(op);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: this CPU has the features the function is compiled for.
        return unsafe { reduce_avx2(c, dtype, dst, a, b) };
    }
    reduce_with(c, dtype, dst, a, b)
}

/// [`reduce_with`] compiled for AVX2 (twice the vector width of the x86-64
/// baseline) and F16C, for the CPUs that have them; f16 and bf16 run fused
/// vector kernels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_avx2(
    c: Combine,
    dtype: DataType,
    dst: &mut [u8],
    a: Option<&[u8]>,
    b: &[u8],
) -> Result<()> {
    macro_rules! half {
        ($kernel:path, $t:ty) => {{
            let a: Option<&[$t]> = match a {
                Some(a) => Some(typed(a, "first operand")?),
                None => None,
            };
            let (dst, b) = (
                typed_mut::<$t>(dst, "destination")?,
                typed(b, "second operand")?,
            );
            // SAFETY: this function runs only where the CPU has AVX2 and F16C.
            unsafe { $kernel(c, dst, a, b) };
            Ok(())
        }};
    }
    match dtype {
        DataType::F16 => half!(x86::kernel_f16, f16),
        DataType::Bf16 => half!(x86::kernel_bf16, bf16),
        _ => reduce_with(c, dtype, dst, a, b),
    }
}

/// The kernel for `dtype`, inlined into each caller so that it is compiled
/// for the caller's target features.
#[inline(always)]
fn reduce_with(
    c: Combine,
    dtype: DataType,
    dst: &mut [u8],
    a: Option<&[u8]>,
    b: &[u8],
) -> Result<()> {
    macro_rules! go {
        ($k:ident, $t:ty) => {{
            let a: Option<&[$t]> = match a {
                Some(a) => Some(typed(a, "first operand")?),
                None => None,
            };
            $k(
                c,
                typed_mut::<$t>(dst, "destination")?,
                a,
                typed(b, "second operand")?,
            )
        }};
    }
    match dtype {
        DataType::I8 => go!(kernel_i8, i8),
        DataType::U8 => go!(kernel_u8, u8),
        DataType::I32 => go!(kernel_i32, i32),
        DataType::U32 => go!(kernel_u32, u32),
        DataType::I64 => go!(kernel_i64, i64),
        DataType::U64 => go!(kernel_u64, u64),
        DataType::F16 => go!(kernel_half, f16),
        DataType::Bf16 => go!(kernel_half, bf16),
        DataType::F32 => go!(kernel_f32, f32),
        DataType::F64 => go!(kernel_f64, f64),
    }
    Ok(())
}

/// `PreMulSum`'s first step: `buf[i] *= scalar` for this rank's own input.
/// Does nothing for the other ops.
pub fn prescale(op: ReduceOp, dtype: DataType, buf: &mut [u8]) -> Result<()> {
    let ReduceOp::PreMulSum(s) = op else {
        return Ok(());
    };
    if buf.is_empty() {
        return Ok(());
    }
    // Integer products wrap, so the scalar is taken modulo 2^bits: exact for
    // any whole f64 (one of magnitude 2^127 or more is a multiple of 2^75).
    let wrapped: u128 = if s.abs() < 2f64.powi(127) {
        s as i128 as u128
    } else {
        0
    };
    macro_rules! int {
        ($t:ty) => {{
            let k = wrapped as $t;
            typed_mut::<$t>(buf, "buffer")?
                .iter_mut()
                .for_each(|x| *x = x.wrapping_mul(k));
        }};
    }
    match dtype {
        DataType::I8 => int!(i8),
        DataType::U8 => int!(u8),
        DataType::I32 => int!(i32),
        DataType::U32 => int!(u32),
        DataType::I64 => int!(i64),
        DataType::U64 => int!(u64),
        DataType::F16 => map_half::<f16>(typed_mut(buf, "buffer")?, |x| x * s as f32),
        DataType::Bf16 => map_half::<bf16>(typed_mut(buf, "buffer")?, |x| x * s as f32),
        DataType::F32 => typed_mut::<f32>(buf, "buffer")?
            .iter_mut()
            .for_each(|x| *x *= s as f32),
        DataType::F64 => typed_mut::<f64>(buf, "buffer")?
            .iter_mut()
            .for_each(|x| *x *= s),
    }
    Ok(())
}

/// `Avg`'s last step: divides a fully reduced buffer by `world_size`.
/// Does nothing for the other ops.
#[inline]
pub fn finalize(op: ReduceOp, dtype: DataType, buf: &mut [u8], world_size: usize) -> Result<()> {
    if op != ReduceOp::Avg || world_size <= 1 || buf.is_empty() {
        return Ok(());
    }
    divide(dtype, buf, world_size)
}

/// Divides every element of `buf` by `n` (`Avg`'s last step).
fn divide(dtype: DataType, buf: &mut [u8], n: usize) -> Result<()> {
    macro_rules! int {
        ($t:ty) => {{
            let d = n as $t;
            typed_mut::<$t>(buf, "buffer")?
                .iter_mut()
                .for_each(|x| *x /= d);
        }};
    }
    match dtype {
        DataType::I8 => int!(i8),
        DataType::U8 => int!(u8),
        DataType::I32 => int!(i32),
        DataType::U32 => int!(u32),
        DataType::I64 => int!(i64),
        DataType::U64 => int!(u64),
        DataType::F16 => map_half::<f16>(typed_mut(buf, "buffer")?, |x| x / n as f32),
        DataType::Bf16 => map_half::<bf16>(typed_mut(buf, "buffer")?, |x| x / n as f32),
        DataType::F32 => typed_mut::<f32>(buf, "buffer")?
            .iter_mut()
            .for_each(|x| *x /= n as f32),
        DataType::F64 => typed_mut::<f64>(buf, "buffer")?
            .iter_mut()
            .for_each(|x| *x /= n as f64),
    }
    Ok(())
}

fn map_half<H: Half>(buf: &mut [H], f: impl Fn(f32) -> f32) {
    let mut tmp = [0f32; HALF_BLOCK];
    for chunk in buf.chunks_mut(HALF_BLOCK) {
        let t = &mut tmp[..chunk.len()];
        H::widen(chunk, t);
        t.iter_mut().for_each(|x| *x = f(*x));
        H::narrow(t, chunk);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: bytemuck::Pod>(v: &[T]) -> &[u8] {
        bytemuck::cast_slice(v)
    }

    #[test]
    fn int_ops() {
        let b = [3i32, -4, 5, i32::MAX];
        for (op, want) in [
            (ReduceOp::Sum, [4i32, -2, 8, i32::MIN + 3]),
            (ReduceOp::Prod, [3, -8, 15, i32::MAX.wrapping_mul(4)]),
            (ReduceOp::Min, [1, -4, 3, 4]),
            (ReduceOp::Max, [3, 2, 5, i32::MAX]),
            (ReduceOp::BitAnd, [1 & 3, 2 & -4, 3 & 5, 4 & i32::MAX]),
            (ReduceOp::BitOr, [1 | 3, 2 | -4, 3 | 5, 4 | i32::MAX]),
            (ReduceOp::BitXor, [1 ^ 3, 2 ^ -4, 3 ^ 5, 4 ^ i32::MAX]),
        ] {
            let mut d = [1i32, 2, 3, 4];
            reduce(
                op,
                DataType::I32,
                bytemuck::cast_slice_mut(&mut d),
                None,
                bytes(&b),
            )
            .unwrap();
            assert_eq!(d, want, "{op}");
        }
    }

    #[test]
    fn three_operand_form_leaves_inputs() {
        let a = [1.5f64, -2.0];
        let b = [2.0f64, 8.0];
        let mut d = [0f64; 2];
        reduce(
            ReduceOp::Max,
            DataType::F64,
            bytemuck::cast_slice_mut(&mut d),
            Some(bytes(&a)),
            bytes(&b),
        )
        .unwrap();
        assert_eq!(d, [2.0, 8.0]);
        assert_eq!(a, [1.5, -2.0]);
    }

    /// The hand-written bf16 conversions agree with `half` bit for bit:
    /// every bf16 widens exactly, and f32s round alike (ties, subnormals,
    /// infinities, NaNs, and a spread of random bit patterns).
    /// 65k f32s of random bits, and the special values.
    fn awkward_singles() -> Vec<f32> {
        let mut x = 0x9e37_79b9u32;
        let mut singles: Vec<f32> = (0..1 << 16)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                f32::from_bits(x)
            })
            .collect();
        singles.extend([
            0.0,
            -0.0,
            1.0,
            f32::MIN_POSITIVE / 3.0,
            f32::MAX,
            f32::INFINITY,
        ]);
        singles.extend([f32::NEG_INFINITY, f32::NAN, f32::from_bits(0x7f80_0001)]);
        singles
    }

    /// The fused AVX2 kernels give the portable kernels' results bit for bit
    /// (a NaN for a NaN), for every op, both forms, every f16 and bf16 value against a spread of
    /// others (NaNs, infinities, subnormals, ties), and a tail of odd length.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_half_kernels_match_the_portable_ones() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c"))
        {
            eprintln!("this CPU has no AVX2 and F16C, so reductions do not use these kernels");
            return;
        }
        type Fused<H> = unsafe fn(Combine, &mut [H], Option<&[H]>, &[H]);
        fn check<H: Half + bytemuck::Pod + std::fmt::Debug>(
            name: &str,
            bits: impl Fn(u16) -> H,
            fused: Fused<H>,
        ) {
            let a: Vec<H> = (0..=u16::MAX).chain(0..5).map(&bits).collect();
            let b: Vec<H> = (0..a.len() as u32)
                .map(|i| bits((i.wrapping_mul(40_503) ^ 0x5bd1) as u16))
                .collect();
            let as_bits = |v: &[H]| -> Vec<u16> { bytemuck::cast_slice(v).to_vec() };
            for c in [Combine::Sum, Combine::Prod, Combine::Min, Combine::Max] {
                let mut want = a.clone();
                kernel_half(c, &mut want, None, &b);
                let (mut got, mut three) = (a.clone(), vec![bits(0); a.len()]);
                // SAFETY: the CPU has AVX2 and F16C (checked above).
                unsafe {
                    fused(c, &mut got, None, &b);
                    fused(c, &mut three, Some(&a), &b);
                }
                // NaN ⊕ NaN may keep either operand's payload: any NaN will do.
                let nan = |v: &[H]| {
                    let mut wide = vec![0f32; v.len()];
                    H::widen(v, &mut wide);
                    wide.iter().map(|x| x.is_nan()).collect::<Vec<bool>>()
                };
                let want_nan = nan(&want);
                for (form, got) in [("in place", &got), ("three operands", &three)] {
                    let (w, g, got_nan) = (as_bits(&want), as_bits(got), nan(got));
                    let first =
                        (0..w.len()).find(|&i| w[i] != g[i] && !(want_nan[i] && got_nan[i]));
                    assert!(
                        first.is_none(),
                        "{name} {form}: element {first:?}: {:?} ⊕ {:?}: want {:?}, got {:?}",
                        first.map(|i| a[i]),
                        first.map(|i| b[i]),
                        first.map(|i| want[i]),
                        first.map(|i| got[i]),
                    );
                }
            }
        }
        check("f16", f16::from_bits, x86::kernel_f16);
        check("bf16", bf16::from_bits, x86::kernel_bf16);
    }

    /// The hand-written bf16 conversions agree with `half` bit for bit:
    /// every bf16 widens exactly, and f32s round alike (ties, subnormals,
    /// overflow, NaN).
    #[test]
    fn bf16_conversions_match_half() {
        let every: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let mut wide = vec![0f32; every.len()];
        bf16::widen(&every, &mut wide);
        for (h, w) in every.iter().zip(&wide) {
            assert_eq!(h.to_f32().to_bits(), w.to_bits(), "{h:?}");
        }
        let mut singles = awkward_singles();
        singles.extend((0..64).map(|i| f32::from_bits(0x3f80_8000 + (i << 16))));
        let mut narrow = vec![bf16::ZERO; singles.len()];
        bf16::narrow(&singles, &mut narrow);
        for (f, n) in singles.iter().zip(&narrow) {
            assert_eq!(
                bf16::from_f32(*f).to_bits(),
                n.to_bits(),
                "{f:e} ({:#x})",
                f.to_bits()
            );
        }
    }

    #[test]
    fn half_rounds_once_per_step() {
        // 1 + 2^-11 is not representable in f16, but 2048 + 1 + 1 stepwise
        // must match f32 arithmetic rounded once per step.
        let mut d: Vec<f16> = (0..1000).map(|i| f16::from_f32(i as f32 * 0.37)).collect();
        let b: Vec<f16> = (0..1000)
            .map(|i| f16::from_f32(1.0 - i as f32 * 0.11))
            .collect();
        let want: Vec<f16> = d
            .iter()
            .zip(&b)
            .map(|(x, y)| f16::from_f32(x.to_f32() + y.to_f32()))
            .collect();
        reduce(
            ReduceOp::Sum,
            DataType::F16,
            bytemuck::cast_slice_mut(&mut d),
            None,
            bytes(&b),
        )
        .unwrap();
        assert_eq!(d, want);
        let mut d: Vec<bf16> = (0..700).map(|i| bf16::from_f32(i as f32 * 1.3)).collect();
        let b: Vec<bf16> = (0..700)
            .map(|i| bf16::from_f32(-(i as f32) * 0.7))
            .collect();
        let want: Vec<bf16> = d
            .iter()
            .zip(&b)
            .map(|(x, y)| bf16::from_f32(x.to_f32().min(y.to_f32())))
            .collect();
        reduce(
            ReduceOp::Min,
            DataType::Bf16,
            bytemuck::cast_slice_mut(&mut d),
            None,
            bytes(&b),
        )
        .unwrap();
        assert_eq!(d, want);
    }

    #[test]
    fn prescale_and_finalize() {
        let mut v = [2.0f32, 4.0];
        prescale(
            ReduceOp::PreMulSum(0.5),
            DataType::F32,
            bytemuck::cast_slice_mut(&mut v),
        )
        .unwrap();
        assert_eq!(v, [1.0, 2.0]);
        finalize(
            ReduceOp::Avg,
            DataType::F32,
            bytemuck::cast_slice_mut(&mut v),
            4,
        )
        .unwrap();
        assert_eq!(v, [0.25, 0.5]);
        let mut i = [7i64, -7];
        finalize(
            ReduceOp::Avg,
            DataType::I64,
            bytemuck::cast_slice_mut(&mut i),
            2,
        )
        .unwrap();
        assert_eq!(i, [3, -3]);
        finalize(
            ReduceOp::Sum,
            DataType::I64,
            bytemuck::cast_slice_mut(&mut i),
            2,
        )
        .unwrap();
        assert_eq!(i, [3, -3]);
    }

    #[test]
    fn integer_prescale_wraps_like_the_integer_product() {
        let mut v = [3u64];
        prescale(
            ReduceOp::PreMulSum(2f64.powi(64)),
            DataType::U64,
            bytemuck::cast_slice_mut(&mut v),
        )
        .unwrap();
        assert_eq!(v, [0]);
        let mut w = [3i32];
        prescale(
            ReduceOp::PreMulSum(1e19),
            DataType::I32,
            bytemuck::cast_slice_mut(&mut w),
        )
        .unwrap();
        assert_eq!(
            w,
            [3i32.wrapping_mul((10_000_000_000_000_000_000u128 % (1u128 << 32)) as u32 as i32)]
        );
        let mut x = [5i8];
        prescale(
            ReduceOp::PreMulSum(-3.0),
            DataType::I8,
            bytemuck::cast_slice_mut(&mut x),
        )
        .unwrap();
        assert_eq!(x, [-15]);
        let mut y = [7u8];
        prescale(
            ReduceOp::PreMulSum(1.5e30),
            DataType::U8,
            bytemuck::cast_slice_mut(&mut y),
        )
        .unwrap();
        assert_eq!(y, [7u8.wrapping_mul((1.5e30f64 as u128 % 256) as u8)]);
    }

    #[test]
    fn misaligned_and_mismatched_buffers_are_errors() {
        let mut d = crate::AlignedBuf::zeroed(16);
        let b = crate::AlignedBuf::zeroed(16);
        let e = reduce(
            ReduceOp::Sum,
            DataType::F64,
            &mut d.as_mut_slice()[1..9],
            None,
            &b.as_slice()[..8],
        );
        assert!(matches!(e, Err(Error::Internal(_))), "{e:?}");
        assert!(reduce(
            ReduceOp::Sum,
            DataType::U8,
            &mut d.as_mut_slice()[..9],
            None,
            &b.as_slice()[..8]
        )
        .is_err());
        assert!(reduce(
            ReduceOp::Sum,
            DataType::F64,
            &mut d.as_mut_slice()[..8],
            None,
            &b.as_slice()[..8]
        )
        .is_ok());
    }
}
