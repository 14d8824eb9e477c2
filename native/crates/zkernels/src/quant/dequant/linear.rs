//! The fused dequantize-and-multiply linear: it dequantizes [`NB`] weight rows into
//! a float32 tile that stays in cache and multiplies every activation row by it, so
//! the full float32 weight never exists.

use super::weight::{dequant_rows_body, PackedWeight};
use crate::quant::error::{check_len, QuantError};
use crate::quant::{for_blocks, SharedOut};
use crate::simd::multiversion;

/// Weight rows dequantized at a time by [`dequant_linear`].
const NB: usize = 16;

/// Dot products of `x` with the four rows of `w (4, k)`, in 16 float lanes per row
/// (separate lanes so the compiler vectorizes without reassociating a sum).
#[inline(always)]
fn dot4(x: &[f32], w: &[f32], k: usize) -> [f32; 4] {
    let (w0, rest) = w.split_at(k);
    let (w1, rest) = rest.split_at(k);
    let (w2, w3) = rest.split_at(k);
    let mut acc = [[0f32; 16]; 4];
    // Fixed-size chunks: the compiler sees 16 in-bounds lanes and vectorizes.
    let (xs, _) = x[..k].as_chunks::<16>();
    let (r0, _) = w0.as_chunks::<16>();
    let (r1, _) = w1.as_chunks::<16>();
    let (r2, _) = w2.as_chunks::<16>();
    let (r3, _) = w3.as_chunks::<16>();
    for ((((xc, c0), c1), c2), c3) in xs.iter().zip(r0).zip(r1).zip(r2).zip(r3) {
        for l in 0..16 {
            acc[0][l] += xc[l] * c0[l];
            acc[1][l] += xc[l] * c1[l];
            acc[2][l] += xc[l] * c2[l];
            acc[3][l] += xc[l] * c3[l];
        }
    }
    let full = k / 16 * 16;
    let ws = [w0, w1, w2, w3];
    std::array::from_fn(|r| {
        let tail: f32 = (full..k).map(|c| x[c] * ws[r][c]).sum();
        acc[r].iter().sum::<f32>() + tail
    })
}

/// The operands of one [`dequant_linear`] call, shared by its blocks.
pub(super) struct LinearJob<'a> {
    pub(super) x: &'a [f32],
    pub(super) w: &'a PackedWeight<'a>,
    pub(super) bias: Option<&'a [f32]>,
    pub(super) out: SharedOut<f32>,
    pub(super) m: usize,
}

#[inline(always)]
fn linear_block_body(job: &LinearJob<'_>, j0: usize, j1: usize, tile: &mut [f32]) {
    linear_block_with(job, j0, j1, tile, dot4);
}

/// One block of [`dequant_linear`]: dequantize rows `j0..j1` into `tile`, then `dot` every
/// activation row with each four of them.
#[inline(always)]
fn linear_block_with(
    job: &LinearJob<'_>,
    j0: usize,
    j1: usize,
    tile: &mut [f32],
    dot: impl Fn(&[f32], &[f32], usize) -> [f32; 4],
) {
    let LinearJob { x, w, bias, out, m } = *job;
    let (n, k) = (w.n, w.k);
    let rows = j1 - j0;
    dequant_rows_body(w, j0, &mut tile[..rows * k]);
    // Pad the tile to a multiple of 4 rows by repeating the last one (results dropped).
    for r in rows..rows.next_multiple_of(4) {
        tile.copy_within((rows - 1) * k..rows * k, r * k);
    }
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for r0 in (0..rows).step_by(4) {
            let d = dot(xr, &tile[r0 * k..(r0 + 4) * k], k);
            for (r, v) in d.iter().enumerate().take(rows - r0) {
                let j = j0 + r0 + r;
                let y = v + bias.map_or(0.0, |b| b[j]);
                // SAFETY: column j of row i belongs to this block alone.
                unsafe { *out.get().add(i * n + j) = y }
            }
        }
    }
}

multiversion!(linear_block => linear_block_body<>(job: &LinearJob<'_>, j0: usize, j1: usize, tile: &mut [f32]));

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The fused linear's dot products with explicit AVX-512 FMAs (the portable
    //! body's lane arrays were not vectorized by the compiler).

    use super::{linear_block_with, LinearJob};
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn dot4(x: &[f32], w: &[f32], k: usize) -> [f32; 4] {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let full = k / 16 * 16;
        let mut t = 0;
        while t < full {
            let xv = _mm512_loadu_ps(xp.add(t));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wp.add(r * k + t)), *a);
            }
            t += 16;
        }
        if full < k {
            let mask: __mmask16 = (1u16 << (k - full)) - 1;
            let xv = _mm512_maskz_loadu_ps(mask, xp.add(full));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(mask, wp.add(r * k + full)), *a);
            }
        }
        std::array::from_fn(|r| _mm512_reduce_add_ps(acc[r]))
    }

    /// [`super::linear_block_body`] compiled for AVX-512 with the FMA dot products.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    pub(super) unsafe fn linear_block(job: &LinearJob<'_>, j0: usize, j1: usize, tile: &mut [f32]) {
        // SAFETY (of the calls): this function only runs where the CPU has AVX-512,
        // and `dot4` reads k floats of x and of each of the tile's 4 rows.
        linear_block_with(job, j0, j1, tile, |x, w, k| unsafe { dot4(x, w, k) });
    }
}

/// The checks every INT4/FP6 linear makes of its operands: a valid packed weight and
/// `x (m, k)`, `bias (n)`, `out (m, n)`.
pub(super) fn check_args(
    x: &[f32],
    w: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    out: &[f32],
    m: usize,
) -> Result<(), QuantError> {
    w.validate()?;
    let (n, k) = (w.n, w.k);
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    if let Some(b) = bias {
        check_len("bias", b.len(), n, || format!("n = {n}"))?;
    }
    check_len("out", out.len(), m * n, || format!("m·n = {m}·{n}"))
}

/// `out (m, n) = x (m, k) · dequant(w)ᵀ + bias`, dequantizing `NB` weight rows at a time.
pub fn dequant_linear(
    x: &[f32],
    w: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
) -> Result<(), QuantError> {
    check_args(x, w, bias, out, m)?;
    let (n, k) = (w.n, w.k);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        // An empty product: every row is the bias (or zero).
        for row in out.chunks_exact_mut(n) {
            match bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
        }
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(body) = super::gemv::body(w, m) {
        // A decode step's few rows: INT4 or FP6 codes widened in registers (see `gemv`).
        super::gemv::packed_rows(x, w, bias, out, m, body);
        return Ok(());
    }
    let job = LinearJob {
        x,
        w,
        bias,
        out: SharedOut(out.as_mut_ptr()),
        m,
    };
    for_blocks(n.div_ceil(NB), |b| {
        let (j0, j1) = (b * NB, ((b + 1) * NB).min(n));
        let mut tile = vec![0f32; NB * k];
        #[cfg(target_arch = "x86_64")]
        if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
            // SAFETY: `active()` only reports AVX-512 when the CPU has every enabled feature.
            unsafe { avx512::linear_block(&job, j0, j1, &mut tile) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if crate::simd::active() == crate::simd::SimdLevel::Avx2 {
            // SAFETY: as above, for AVX2 and FMA; `tile` holds NB rows of k.
            unsafe { super::tile_avx2::linear_block(&job, j0, j1, &mut tile) };
            return;
        }
        linear_block(&job, j0, j1, &mut tile);
    });
    Ok(())
}
