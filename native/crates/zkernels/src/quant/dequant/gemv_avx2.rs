//! [`super::gemv`]'s INT4 body on AVX2+FMA: each 8-byte run of codes (16 columns) is
//! widened to two 8-lane float vectors of dequantized values `(q - z) · s` (low nibbles
//! = even columns, high = odd; bit-equal to `dequantize`'s) and multiply-added with up to
//! [`PASS`] activation rows, split per 16-column run into 8 even then 8 odd columns by
//! the caller. [`PASS`] is 4, not the AVX-512 body's 8: `2 · PASS` accumulators and the
//! widened run must fit AVX2's 16 vector registers.

use super::gemv::{PackedWeight, SharedOut, WeightFormat};
use std::arch::x86_64::*;

/// Activation rows one pass over the weight block dots with each widened run.
const PASS: usize = 4;
/// Bytes ahead of the codes being read that each eighth run prefetches.
const PREFETCH: usize = 4096;

/// Weight rows `j0..j1` against the `m` split activation rows `xs`, [`PASS`] rows a pass.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `w` is INT4 with `k % 32 == 0` and `group % 32 == 0`,
/// `xs` holds `m · k` floats and `out` `m · n`, of which columns `j0..j1` are this call's.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(
    xs: &[f32],
    w: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    out: SharedOut<f32>,
    m: usize,
    j0: usize,
    j1: usize,
) {
    let mut i0 = 0;
    while i0 < m {
        let r = (m - i0).min(PASS);
        let args = (xs, w, bias, out, i0, j0, j1);
        match r {
            1 => pass::<1>(args),
            2 => pass::<2>(args),
            3 => pass::<3>(args),
            _ => pass::<4>(args),
        }
        i0 += r;
    }
}

type PassArgs<'a, 'w> = (
    &'a [f32],
    &'a PackedWeight<'w>,
    Option<&'a [f32]>,
    SharedOut<f32>,
    usize,
    usize,
    usize,
);

/// The sum of the 8 lanes of `v`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Activation rows `i0..i0 + R` against weight rows `j0..j1` (`2 R` FMA chains).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pass<const R: usize>((xs, w, bias, out, i0, j0, j1): PassArgs<'_, '_>) {
    let (n, k, group) = (w.n, w.k, w.group);
    let groups = k.div_ceil(group);
    let per_tensor = w.scale.len() == groups && n != 1;
    let offset = match w.format {
        WeightFormat::Int4 { offset } => offset as f32,
        WeightFormat::Fp6 => 0.0,
    };
    let nibble = _mm256_set1_epi32(15);
    let bytes_per_row = k / 2;
    let xp = xs.as_ptr().add(i0 * k);
    for j in j0..j1 {
        let srow = if per_tensor { 0 } else { j * groups };
        let codes = w.data.as_ptr().add(j * bytes_per_row);
        let mut even = [_mm256_setzero_ps(); R];
        let mut odd = [_mm256_setzero_ps(); R];
        for g in 0..groups {
            let s = _mm256_set1_ps(w.scale[srow + g]);
            let z = _mm256_set1_ps(w.zero.map_or(offset, |z| z[srow + g]));
            for run in (g * group / 16)..(((g + 1) * group).min(k) / 16) {
                if run % 8 == 0 {
                    // A hint only: the address may lie past the weight (never read).
                    let ahead = codes.wrapping_add(run * 8 + PREFETCH);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                }
                let b = _mm_loadl_epi64(codes.add(run * 8).cast());
                let v = _mm256_cvtepu8_epi32(b);
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
                let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
                let wl = _mm256_mul_ps(_mm256_sub_ps(lo, z), s);
                let wh = _mm256_mul_ps(_mm256_sub_ps(hi, z), s);
                for i in 0..R {
                    let x = xp.add(i * k + run * 16);
                    even[i] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(x), even[i]);
                    odd[i] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(x.add(8)), odd[i]);
                }
            }
        }
        for i in 0..R {
            let y = hsum(_mm256_add_ps(even[i], odd[i])) + bias.map_or(0.0, |b| b[j]);
            // SAFETY: column j of row i0 + i belongs to this block alone.
            *out.get().add((i0 + i) * n + j) = y;
        }
    }
}
