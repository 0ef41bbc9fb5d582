//! Fused 16-bit float kernels for AVX2 and F16C: eight elements at a time
//! are widened to f32, combined and rounded back in registers, with the same
//! values as the portable `kernel_half` (IEEE rounding to nearest, ties to
//! even; a NaN stays a NaN, quieted).

use std::arch::x86_64::{
    __m128i, __m256, _mm256_add_epi32, _mm256_add_ps, _mm256_and_si256, _mm256_blendv_epi8,
    _mm256_castps_si256, _mm256_castsi256_ps, _mm256_castsi256_si128, _mm256_cmp_ps,
    _mm256_cvtepu16_epi32, _mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_max_ps, _mm256_min_ps,
    _mm256_mul_ps, _mm256_or_si256, _mm256_packus_epi32, _mm256_permute4x64_epi64,
    _mm256_set1_epi32, _mm256_slli_epi32, _mm256_srli_epi32, _mm_loadu_si128, _mm_storeu_si128,
    _CMP_UNORD_Q, _MM_FROUND_TO_NEAREST_INT,
};

use half::{bf16, f16};

use super::{kernel_half, Combine};

/// Eight f16 at `p`, widened.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load_f16(p: *const f16) -> __m256 {
    // SAFETY: the caller reads 8 elements at `p` (unaligned).
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast::<__m128i>())) }
}

/// Rounds `v` to eight f16 at `p`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn store_f16(p: *mut f16, v: __m256) {
    let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
    // SAFETY: the caller writes 8 elements at `p` (unaligned).
    unsafe { _mm_storeu_si128(p.cast::<__m128i>(), h) }
}

/// Eight bf16 at `p`, widened. A signalling NaN is not quieted here,
/// unlike in [`Half::widen`]: the op's result is a NaN all the same, and
/// [`store_bf16`] quiets it.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load_bf16(p: *const bf16) -> __m256 {
    // SAFETY: the caller reads 8 elements at `p` (unaligned).
    let w = _mm256_cvtepu16_epi32(unsafe { _mm_loadu_si128(p.cast::<__m128i>()) });
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
}

/// Rounds `v` to eight bf16 at `p`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn store_bf16(p: *mut bf16, v: __m256) {
    let x = _mm256_castps_si256(v);
    let high = _mm256_srli_epi32::<16>(x);
    let odd = _mm256_and_si256(high, _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd);
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
    let quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x0040));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    let r = _mm256_blendv_epi8(rounded, quiet, nan);
    // Every lane holds at most 0xffff, so packing does not saturate;
    // the permutation puts lanes 0-3 and 4-7 next to each other.
    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_packus_epi32(r, r));
    // SAFETY: the caller writes 8 elements at `p` (unaligned).
    unsafe { _mm_storeu_si128(p.cast::<__m128i>(), _mm256_castsi256_si128(packed)) }
}

macro_rules! fused {
    ($name:ident, $t:ty, $load:ident, $store:ident) => {
        /// `dst = a ⊕ b` (`a = dst` when `None`) over the common length.
        ///
        /// # Safety
        /// The CPU must have AVX2 and F16C.
        #[target_feature(enable = "avx2,f16c")]
        pub unsafe fn $name(c: Combine, dst: &mut [$t], a: Option<&[$t]>, b: &[$t]) {
            let n = dst.len().min(b.len()).min(a.map_or(usize::MAX, <[$t]>::len));
            let whole = n / 8 * 8;
            let (d, bp) = (dst.as_mut_ptr(), b.as_ptr());
            let ap = a.map_or(d.cast_const(), <[$t]>::as_ptr);
            macro_rules! each {
                ($x:ident, $y:ident => $e:expr) => {
                    for i in (0..whole).step_by(8) {
                        // SAFETY: i + 8 <= whole <= n, within every
                        // slice; dst is read before it is written.
                        unsafe {
                            let ($x, $y) = ($load(ap.add(i)), $load(bp.add(i)));
                            $store(d.add(i), $e);
                        }
                    }
                };
            }
            match c {
                Combine::Sum => each!(x, y => _mm256_add_ps(x, y)),
                Combine::Prod => each!(x, y => _mm256_mul_ps(x, y)),
                // As the scalar kernels: y if y < x (else x), y if y > x.
                Combine::Min => each!(x, y => _mm256_min_ps(y, x)),
                Combine::Max => each!(x, y => _mm256_max_ps(y, x)),
                // Rejected by `ReduceOp::validate` before any kernel runs.
                Combine::And | Combine::Or | Combine::Xor => {}
            }
            kernel_half(c, &mut dst[whole..n], a.map(|a| &a[whole..n]), &b[whole..n]);
        }
    };
}

fused!(kernel_f16, f16, load_f16, store_f16);
fused!(kernel_bf16, bf16, load_bf16, store_bf16);
