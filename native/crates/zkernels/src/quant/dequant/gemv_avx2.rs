//! [`super::gemv`]'s body on AVX2+FMA, INT4 and FP6: each 16-column run of a weight row is
//! widened to two 8-lane float vectors of dequantized values (even columns, odd columns;
//! bit-equal to `dequantize`'s) and multiply-added with up to [`MAX_PASS`] activation rows,
//! split per 16-column run into 8 even then 8 odd columns by the caller.
//!
//! - INT4: the run's 8 bytes of codes, low nibbles = even columns, high = odd, as
//!   `(q - z) · s`.
//! - FP6 e3m2: the same 8 bytes of the 4-bit plane and the run's 4 bytes (one u32) of the
//!   2-bit plane, where column `c`'s two bits sit at bit `2c`: even column `2u` at `4u`,
//!   odd `2u + 1` at `4u + 2`, so one variable shift per vector puts each lane's pair at the
//!   bottom. The code is decoded as `fp6_value` does (exponent and mantissa moved into a
//!   float32 with the exponent rebiased, subnormal codes fixed by an exact `2f - 1/4`, no
//!   subnormal float32 in the arithmetic), then multiplied by `s`: `fp6_value(code) · s`.
//!
//! Up to 4 rows a pass keep two FMA chains per row (even, odd); 5 to 8 rows one chain per
//! row (the even then the odd product), so `R` accumulators, the widened run and the
//! constants fit AVX2's 16 vector registers and a decode step of up to 8 rows reads the
//! weight once.

use super::gemv::{PackedWeight, SharedOut, WeightFormat};
use crate::avx2::hsum;
use std::arch::x86_64::*;

/// Most activation rows one pass over the weight block dots with each widened run.
const MAX_PASS: usize = 8;
/// Rows up to which a pass keeps two FMA chains (even and odd columns) per row.
const TWO_CHAINS: usize = 4;
/// Bytes ahead of the codes being read that each eighth run prefetches.
const PREFETCH: usize = 4096;
/// [`super::weight::FP6_REBIAS`] as the lane type.
const REBIAS: i32 = super::weight::FP6_REBIAS as i32;

/// Weight rows `j0..j1` against the `m` split activation rows `xs`, [`MAX_PASS`] rows a pass.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `k % 16 == 0` and `group % 16 == 0`, `xs` holds
/// `m · k` floats and `out` `m · n`, of which columns `j0..j1` are this call's.
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
    let fp6 = w.format == WeightFormat::Fp6;
    let mut i0 = 0;
    while i0 < m {
        let r = (m - i0).min(MAX_PASS);
        let args = (xs, w, bias, out, i0, j0, j1);
        if fp6 {
            pass_of::<true>(r, args);
        } else {
            pass_of::<false>(r, args);
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

/// [`pass`] for `r` (1 to [`MAX_PASS`]) rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pass_of<const FP6: bool>(r: usize, args: PassArgs<'_, '_>) {
    match r {
        1 => pass::<1, FP6>(args),
        2 => pass::<2, FP6>(args),
        3 => pass::<3, FP6>(args),
        4 => pass::<4, FP6>(args),
        5 => pass::<5, FP6>(args),
        6 => pass::<6, FP6>(args),
        7 => pass::<7, FP6>(args),
        _ => pass::<8, FP6>(args),
    }
}

/// FP6 values of a run's even and odd columns (before the scale): `p4` its 8 bytes of
/// the 4-bit plane, `p2` its 4 bytes of the 2-bit plane.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fp6_run(p4: *const u8, p2: *const u8) -> (__m256, __m256) {
    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p4.cast()));
    let two = _mm256_set1_epi32(p2.cast::<i32>().read_unaligned());
    // As `fp6_value`: exponent and mantissa rebiased into a normal float32, `2f - 1/4`
    // where the code is subnormal, then the sign.
    let bits = |four: __m256i, shifts: __m256i| {
        let t = _mm256_srlv_epi32(two, shifts);
        let exp_mant = _mm256_or_si256(
            _mm256_slli_epi32::<21>(four),
            _mm256_and_si256(_mm256_slli_epi32::<25>(t), _mm256_set1_epi32(1 << 25)),
        );
        let f = _mm256_castsi256_ps(_mm256_add_epi32(exp_mant, _mm256_set1_epi32(REBIAS)));
        let sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(4 << 21), exp_mant);
        let fixed = _mm256_fmsub_ps(f, _mm256_set1_ps(2.0), _mm256_set1_ps(0.25));
        let v = _mm256_blendv_ps(f, fixed, _mm256_castsi256_ps(sub));
        let sign = _mm256_and_si256(_mm256_slli_epi32::<30>(t), _mm256_set1_epi32(i32::MIN));
        _mm256_or_ps(v, _mm256_castsi256_ps(sign))
    };
    let even = bits(
        _mm256_and_si256(v, _mm256_set1_epi32(15)),
        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28),
    );
    let odd = bits(
        _mm256_srli_epi32::<4>(v),
        _mm256_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30),
    );
    (even, odd)
}

/// Activation rows `i0..i0 + R` against weight rows `j0..j1`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pass<const R: usize, const FP6: bool>((xs, w, bias, out, i0, j0, j1): PassArgs<'_, '_>) {
    let (n, k, group) = (w.n, w.k, w.group);
    let groups = k.div_ceil(group);
    let per_tensor = w.scale.len() == groups && n != 1;
    let offset = match w.format {
        WeightFormat::Int4 { offset } => offset as f32,
        WeightFormat::Fp6 => 0.0,
    };
    let nibble = _mm256_set1_epi32(15);
    let xp = xs.as_ptr().add(i0 * k);
    for j in j0..j1 {
        let srow = if per_tensor { 0 } else { j * groups };
        let codes = w.data.as_ptr().add(j * k / 2);
        let plane2 = w.data2.unwrap_or_default().as_ptr().wrapping_add(j * k / 4);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for g in 0..groups {
            let s = _mm256_set1_ps(w.scale[srow + g]);
            let z = _mm256_set1_ps(w.zero.map_or(offset, |z| z[srow + g]));
            for run in (g * group / 16)..(((g + 1) * group).min(k) / 16) {
                if run % 8 == 0 {
                    // A hint only: the address may lie past the weight (never read).
                    let ahead = codes.wrapping_add(run * 8 + PREFETCH);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                }
                let (wl, wh) = if FP6 {
                    let (even, odd) = fp6_run(codes.add(run * 8), plane2.add(run * 4));
                    (_mm256_mul_ps(even, s), _mm256_mul_ps(odd, s))
                } else {
                    let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(codes.add(run * 8).cast()));
                    let lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, nibble));
                    let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v));
                    (
                        _mm256_mul_ps(_mm256_sub_ps(lo, z), s),
                        _mm256_mul_ps(_mm256_sub_ps(hi, z), s),
                    )
                };
                for (i, a) in acc.iter_mut().enumerate() {
                    let x = xp.add(i * k + run * 16);
                    let (xe, xo) = (_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)));
                    if R <= TWO_CHAINS {
                        a[0] = _mm256_fmadd_ps(wl, xe, a[0]);
                        a[1] = _mm256_fmadd_ps(wh, xo, a[1]);
                    } else {
                        a[0] = _mm256_fmadd_ps(wh, xo, _mm256_fmadd_ps(wl, xe, a[0]));
                    }
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            let sum = if R <= TWO_CHAINS {
                _mm256_add_ps(a[0], a[1])
            } else {
                a[0]
            };
            let y = hsum(sum) + bias.map_or(0.0, |b| b[j]);
            // SAFETY: column j of row i0 + i belongs to this block alone.
            *out.get().add((i0 + i) * n + j) = y;
        }
    }
}
