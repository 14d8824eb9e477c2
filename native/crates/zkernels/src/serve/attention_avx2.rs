//! [`super::attention`]'s task body on AVX2+FMA, for heads of a multiple of 8 elements:
//! each key is found by walking the block table (no division per key), its dot product
//! with a query head runs in four 8-lane FMA chains summed as a tree (the portable body's
//! 16 lanes were summed one after another: a chain of 16 dependent adds per score), the
//! softmax's exponentials go 8 lanes at a time ([`exp8`]), and the weighted sum of the
//! values keeps a head's 32 columns in registers across the keys. bfloat16 is widened in
//! registers. Scores, softmax and sums stay f32. (SmolLM2's layer, 96 keys, one thread:
//! 19.5 µs a call for the portable body at AVX2, 7.8 here.)

use super::attention::Task;
use crate::avx2::{hsum, load8};
use crate::bf16::Elem;
use std::arch::x86_64::*;

/// `e^x` in each lane, for `x <= 0` (softmax's shifted scores): `x = n ln 2 + r` with
/// `|r| <= ln 2 / 2`, `e^r` by the degree-7 polynomial of Cephes' `expf` (relative error
/// about 1e-7, as `f32::exp`'s rounding), times `2^n` built in the exponent bits. Inputs
/// below -87 give `e^-87` (~1.6e-38) instead of a smaller number or 0: a weight that
/// small adds nothing a sum of weights at least 1 (the maximum's) can show.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // ln 2 in two parts, the first exact in few bits, so `n · LN2_HI` is exact.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut y = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(r, r),
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
}

/// The cache offset of each key `0 .. len` of the task, in order, passed to `f(j, offset)`.
#[inline(always)]
fn for_keys(p: &Task<'_>, mut f: impl FnMut(usize, usize)) {
    for (b, &block) in p.table.iter().enumerate() {
        let start = b * p.bs;
        if start >= p.len {
            break;
        }
        for off in 0..p.bs.min(p.len - start) {
            f(
                start + off,
                ((block as usize * p.bs + off) * p.kv + p.g) * p.hd,
            );
        }
    }
}

/// One (sequence, KV head) task: `q` its `group` query heads, `out` theirs; `scores`
/// holds `group · len` and `acc` `group · hd` zeros.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `p.hd % 8 == 0`, and the caller checked the block
/// table and buffer sizes as for the portable body.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn attend<E: Elem>(
    q: &[E],
    kc: &[E],
    vc: &[E],
    p: &Task<'_>,
    scores: &mut [f32],
    acc: &mut [f32],
    out: &mut [E],
) {
    let (hd, len) = (p.hd, p.len);
    let group = q.len() / hd;
    let qf: Vec<f32> = q.iter().map(|v| v.to_f32()).collect();
    let (qp, kp, vp) = (qf.as_ptr(), kc.as_ptr(), vc.as_ptr());
    // A head at a time (its query stays in L1 across the keys), each score's 8-lane
    // products in four FMA chains.
    for i in 0..group {
        let qi = qp.add(i * hd);
        let srow = scores.as_mut_ptr().add(i * len);
        for_keys(p, |j, at| {
            let k = kp.add(at);
            let mut a = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c + 32 <= hd {
                for (t, a) in a.iter_mut().enumerate() {
                    let (x, y) = (_mm256_loadu_ps(qi.add(c + 8 * t)), load8(k.add(c + 8 * t)));
                    *a = _mm256_fmadd_ps(x, y, *a);
                }
                c += 32;
            }
            while c < hd {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(qi.add(c)), load8(k.add(c)), a[0]);
                c += 8;
            }
            let sum = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            *srow.add(j) = hsum(sum) * p.scale;
        });
    }
    let mut sums = [0f32; 64];
    let mut sums_big = Vec::new();
    let sums: &mut [f32] = if group <= 64 {
        &mut sums[..group]
    } else {
        sums_big.resize(group, 0f32);
        &mut sums_big
    };
    for (i, l) in sums.iter_mut().enumerate() {
        let row = &mut scores[i * len..(i + 1) * len];
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (rp, mv) = (row.as_mut_ptr(), _mm256_set1_ps(m));
        let mut total = _mm256_setzero_ps();
        let eights = len / 8 * 8;
        for c in (0..eights).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(rp.add(c)), mv));
            _mm256_storeu_ps(rp.add(c), e);
            total = _mm256_add_ps(total, e);
        }
        *l = hsum(total);
        for x in &mut row[eights..] {
            *x = (*x - m).exp();
            *l += *x;
        }
    }
    // The weighted sum of the values, a head and 32 columns at a time in 4 registers (each
    // value row read once per head and column block, from L1); columns past the last whole
    // 32 go through `acc` in memory.
    let ap = acc.as_mut_ptr();
    let whole = hd / 32 * 32;
    for i in 0..group {
        let w = scores.as_ptr().add(i * len);
        for c0 in (0..whole).step_by(32) {
            let mut a = [_mm256_setzero_ps(); 4];
            for_keys(p, |j, at| {
                let (wj, v) = (_mm256_set1_ps(*w.add(j)), vp.add(at + c0));
                for (t, a) in a.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wj, load8(v.add(8 * t)), *a);
                }
            });
            for (t, a) in a.iter().enumerate() {
                _mm256_storeu_ps(ap.add(i * hd + c0 + 8 * t), *a);
            }
        }
        if whole < hd {
            for_keys(p, |j, at| {
                let (wj, v) = (_mm256_set1_ps(*w.add(j)), vp.add(at));
                let a = ap.add(i * hd);
                for c in (whole..hd).step_by(8) {
                    let y = _mm256_fmadd_ps(wj, load8(v.add(c)), _mm256_loadu_ps(a.add(c)));
                    _mm256_storeu_ps(a.add(c), y);
                }
            });
        }
    }
    for i in 0..group {
        let inv = 1.0 / sums[i];
        for (o, &a) in out[i * hd..(i + 1) * hd]
            .iter_mut()
            .zip(&acc[i * hd..(i + 1) * hd])
        {
            *o = E::from_f32(a * inv);
        }
    }
}
