//! [`super::linear`]'s tile path on AVX2+FMA: the block's [`super::linear`] float32 tile
//! (dequantized as the portable body does, compiled for AVX2) dotted with two activation
//! rows and four tile rows at a time, 8 accumulators of explicit FMAs. (The portable
//! body's 16-lane arrays were left scalar-ish by the compiler at AVX2; two activation
//! rows per pass read each tile vector once for both, so a step is 6 loads for 8 FMAs.)

use super::linear::LinearJob;
use super::weight::dequant_rows_body;
use crate::avx2::hsum;
use std::arch::x86_64::*;

/// `out[i][r] = x_i · w_r` for `R` (1 or 2) activation rows at `x` (rows `k` apart) and the
/// four tile rows at `w` (rows `k` apart).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rx4<const R: usize>(x: *const f32, w: *const f32, k: usize) -> [[f32; 4]; R] {
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let eights = k / 8 * 8;
    let mut t = 0;
    while t < eights {
        let mut wv = [_mm256_setzero_ps(); 4];
        for (r, v) in wv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(w.add(r * k + t));
        }
        for (i, a) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(i * k + t));
            for r in 0..4 {
                a[r] = _mm256_fmadd_ps(xv, wv[r], a[r]);
            }
        }
        t += 8;
    }
    let mut out = [[0f32; 4]; R];
    for i in 0..R {
        for r in 0..4 {
            let mut s = hsum(acc[i][r]);
            for c in eights..k {
                s += *x.add(i * k + c) * *w.add(r * k + c);
            }
            out[i][r] = s;
        }
    }
    out
}

/// One block of [`super::linear::dequant_linear`]'s tile path: dequantize weight rows
/// `j0..j1` into `tile`, then dot every activation row with them.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `tile` holds at least `(j1 - j0).next_multiple_of(4) · k`
/// floats and the job's buffers were checked by the caller.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn linear_block(job: &LinearJob<'_>, j0: usize, j1: usize, tile: &mut [f32]) {
    let LinearJob { x, w, bias, out, m } = *job;
    let (n, k) = (w.n, w.k);
    let rows = j1 - j0;
    dequant_rows_body(w, j0, &mut tile[..rows * k]);
    // Pad the tile to a multiple of 4 rows by repeating the last one (results dropped).
    for r in rows..rows.next_multiple_of(4) {
        tile.copy_within((rows - 1) * k..rows * k, r * k);
    }
    let (xp, tp) = (x.as_ptr(), tile.as_ptr());
    let write = |i: usize, r0: usize, d: [f32; 4]| {
        for (r, v) in d.iter().enumerate().take(rows - r0) {
            let j = j0 + r0 + r;
            // SAFETY: column j of row i belongs to this block alone.
            unsafe { *out.get().add(i * n + j) = v + bias.map_or(0.0, |b| b[j]) }
        }
    };
    let pairs = m / 2 * 2;
    for i in (0..pairs).step_by(2) {
        for r0 in (0..rows).step_by(4) {
            let d = dot_rx4::<2>(xp.add(i * k), tp.add(r0 * k), k);
            write(i, r0, d[0]);
            write(i + 1, r0, d[1]);
        }
    }
    if pairs < m {
        for r0 in (0..rows).step_by(4) {
            let [d] = dot_rx4::<1>(xp.add(pairs * k), tp.add(r0 * k), k);
            write(pairs, r0, d);
        }
    }
}
