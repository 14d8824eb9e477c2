//! Register helpers the AVX2+FMA kernel bodies share: loads that widen bfloat16 to f32
//! exactly, bf16 rounding as [`crate::bf16::f32_to_bf16`] does, and horizontal sums.
//!
//! Each is `#[target_feature(enable = "avx2,fma")]` and `#[inline]`, so it inlines into
//! any caller compiled with those features (the AVX2 and AVX-512 variants alike).
//!
//! # Safety
//! Every function here needs a CPU with AVX2 and FMA; the loads and stores read or
//! write 8 elements at the pointer.

use crate::bf16::Elem;
use std::arch::x86_64::*;

/// 8 elements at `p` as f32; bfloat16 widened exactly (zero-extend, shift left 16).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn load8<E: Elem>(p: *const E) -> __m256 {
    if E::BF16 {
        let h = _mm_loadu_si128(p.cast());
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    } else {
        _mm256_loadu_ps(p.cast())
    }
}

/// bf16 bits of each lane, rounded to nearest even (NaN quietened), in the low half of
/// the lane with a zero high half.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn round_bf16(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000));
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    _mm256_srli_epi32::<16>(_mm256_blendv_epi8(r, quiet, nan))
}

/// 16 bf16 values, `lo`'s then `hi`'s.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn pack_bf16(lo: __m256, hi: __m256) -> __m256i {
    // Every lane is at most 0xffff, so the unsigned saturating pack is exact; it
    // works per 128-bit half, giving lo[0..4] hi[0..4] lo[4..8] hi[4..8].
    let packed = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
    _mm256_permute4x64_epi64::<0b11_01_10_00>(packed)
}

/// `v`'s 8 lanes rounded to `E` (bf16 to nearest even, as [`Elem::from_f32`]), stored at `p`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn store8<E: Elem>(p: *mut E, v: __m256) {
    if E::BF16 {
        let r = round_bf16(v);
        // Lanes hold at most 0xffff: the saturating pack is exact; per 128-bit half it
        // gives r[0..4] r[0..4] r[4..8] r[4..8], and the permute brings r[4..8] down.
        let packed = _mm256_permute4x64_epi64::<0b00_00_10_00>(_mm256_packus_epi32(r, r));
        _mm_storeu_si128(p.cast(), _mm256_castsi256_si128(packed));
    } else {
        _mm256_storeu_ps(p.cast(), v);
    }
}

/// The sum of the 8 lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The sum of the 8 int32 lanes of `v` (wrapping).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{bf16_to_f32, f32_to_bf16};

    fn have_avx2() -> bool {
        crate::simd::detected() >= crate::simd::SimdLevel::Avx2
    }

    #[test]
    fn loads_and_stores_round_like_the_scalar_conversions() {
        if !have_avx2() {
            return;
        }
        let x: [f32; 8] = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            -2.5e-3,
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::MAX,
            -0.0,
            123.456,
        ];
        let mut b = [0u16; 8];
        let mut f = [0f32; 8];
        // SAFETY: AVX2 checked above; every buffer holds 8 elements.
        let (sum, bits) = unsafe {
            let v = load8(x.as_ptr());
            store8(b.as_mut_ptr(), v);
            store8(f.as_mut_ptr(), load8(b.as_ptr()));
            let ints = _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, -8);
            (hsum(_mm256_set1_ps(0.5)), hsum_epi32(ints))
        };
        for i in 0..8 {
            let want = f32_to_bf16(x[i]);
            assert_eq!(b[i], want, "lane {i}");
            assert_eq!(f[i].to_bits(), bf16_to_f32(want).to_bits(), "lane {i}");
        }
        assert_eq!((sum, bits), (4.0, 20));
    }
}
