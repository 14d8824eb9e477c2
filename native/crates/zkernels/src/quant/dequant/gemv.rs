//! INT4 and FP6 linear for a decode step's few activation rows, codes widened in
//! registers: no dequantized tile is written and read back.
//!
//! [`super::dequant_linear`]'s tile path dequantizes 16 weight rows to float32 in
//! cache and dots every activation row with them; at one activation row that
//! store-and-reload of `k` floats per weight row costs more than the product
//! (measured 3.5x slower than an fp32 matrix-vector product of the same shape).
//! Here each run of codes (AVX-512: 16 bytes, 32 INT4 columns) is widened to two float
//! vectors (low nibbles = even columns, high = odd) of dequantized values `(q - z) · s`,
//! bit-equal to `dequantize`'s, and multiply-added with up to 8 activation rows'
//! even and odd columns (split once per call) while in registers: the numbers are
//! the reference's (`x · dequant(w)ᵀ`) summed in another order. (An earlier body
//! summed `Σ (q - z) · x` per group and scaled it: one dependent chain per row,
//! ~11 cycles per run; at 16 rows the tile path's f32 tile ran at ~20 GFLOP/s.)
//!
//! Which body runs is [`body`]: INT4 at AVX-512 up to [`GEMV_MAX_ROWS`] rows where whole
//! 32-column runs tile each group; otherwise, at AVX2 or above, [`super::gemv_avx2`]
//! (16-column runs, INT4 up to [`GEMV_MAX_ROWS_AVX2`] rows, FP6 up to [`FP6_MAX_ROWS`])
//! where whole 16-column runs tile each group; otherwise the tile path.

pub(super) use super::weight::{PackedWeight, WeightFormat};
pub(super) use crate::quant::{for_blocks, SharedOut};

/// Activation rows up to which [`super::dequant_linear`] takes this path where AVX-512 is
/// active (decode steps of up to 64 sequences; measured no slower than the tile path up to
/// 64 rows, 3x faster at 16).
pub(super) const GEMV_MAX_ROWS: usize = 64;
/// The same where AVX2 is the level: the AVX2 tile ([`super::tile_avx2`], two activation
/// rows by four weight rows of FMAs) overtakes this path between 8 and 16 rows (SmolLM2's
/// 1536 x 576, one thread, GMAC/s, this path against the tile: 19 against 12 at 4 rows;
/// 23.5 at 8 as one pass; two 4-row passes 19 against 24 at 16, 19 against 33 at 64).
pub(super) const GEMV_MAX_ROWS_AVX2: usize = 8;
/// Activation rows up to which an FP6 weight takes [`super::gemv_avx2`] at AVX2 and AVX-512
/// (there is no AVX-512 FP6 body), instead of the tile path.
pub(super) const FP6_MAX_ROWS: usize = 8;
/// Parallel tasks per thread of the team: few and long, so that each thread streams long
/// contiguous runs of the weight, with a second one to even out a late thread. (SmolLM2's
/// 120 decode products, 53 MB of codes packed in call order, two threads, noisy VM,
/// medians of 250 steps: 64-row tasks 6.9-8.1 ms, 256-row 6.6-6.7, two per thread
/// 4.1-5.3 with the prefetch below; one thread 7.4-8.3.)
const TASKS_PER_THREAD: usize = 2;
/// Fewest weight rows in a task.
const MIN_ROWS: usize = 16;

/// Which body serves `w` at `m` activation rows on this CPU, if any.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Body {
    /// The AVX-512 INT4 body (32-column runs).
    Avx512,
    /// [`super::gemv_avx2`] (16-column runs, INT4 and FP6), at AVX2 or above.
    Avx2,
}

/// The body that serves `w` at `m` activation rows on this CPU, if this path applies.
pub(super) fn body(w: &PackedWeight<'_>, m: usize) -> Option<Body> {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::simd::SimdLevel;
        let level = crate::simd::active();
        let int4 = matches!(w.format, WeightFormat::Int4 { .. });
        let runs = |r: usize| w.group.is_multiple_of(r) && w.k.is_multiple_of(r) && w.k > 0;
        if level == SimdLevel::Avx512 && int4 && (1..=GEMV_MAX_ROWS).contains(&m) && runs(32) {
            return Some(Body::Avx512);
        }
        let avx2_rows = if int4 {
            GEMV_MAX_ROWS_AVX2
        } else {
            FP6_MAX_ROWS
        };
        (level >= SimdLevel::Avx2 && (1..=avx2_rows).contains(&m) && runs(16)).then_some(Body::Avx2)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (w, m);
        None
    }
}

/// `out (m, n) = x (m, k) · dequant(w)ᵀ + bias` on `body`; the caller checked the buffers and
/// that [`body`] chose it.
#[cfg(target_arch = "x86_64")]
pub(super) fn packed_rows(
    x: &[f32],
    w: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
    body: Body,
) {
    let (n, k) = (w.n, w.k);
    let wide = body == Body::Avx512;
    // Each run of x (32 columns for AVX-512, 16 for AVX2) as its even columns then its odd ones.
    let run = if wide { 32 } else { 16 };
    let mut xs = vec![0f32; m * k];
    for (row, dst) in x.chunks_exact(k).zip(xs.chunks_exact_mut(k)) {
        for (src, d) in row.chunks_exact(run).zip(dst.chunks_exact_mut(run)) {
            for t in 0..run / 2 {
                d[t] = src[2 * t];
                d[run / 2 + t] = src[2 * t + 1];
            }
        }
    }
    let dst = SharedOut(out.as_mut_ptr());
    let tasks = TASKS_PER_THREAD * crate::team::threads();
    let nb = n.div_ceil(tasks).next_multiple_of(MIN_ROWS);
    for_blocks(n.div_ceil(nb), |b| {
        let (j0, j1) = (b * nb, ((b + 1) * nb).min(n));
        // SAFETY: `body` checked AVX2 (and for `wide` AVX-512) and the run widths; the block
        // writes only columns j0..j1.
        unsafe {
            if wide {
                avx512::rows(&xs, w, bias, dst, m, j0, j1)
            } else {
                super::gemv_avx2::rows(&xs, w, bias, dst, m, j0, j1)
            }
        }
    });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PackedWeight, SharedOut, WeightFormat};
    use std::arch::x86_64::*;

    /// Activation rows one pass over the weight block dots with each widened run.
    const PASS: usize = 8;
    /// Bytes ahead of the codes being read that each fourth run prefetches (the same 120
    /// products with a 35 µs gap after each, as Python leaves: 8.3-8.4 ms p10 against
    /// 8.6-9.2 without; a few per cent, within the VM's noise at the median).
    const PREFETCH: usize = 4096;

    /// Weight rows `j0..j1` against the `m` split activation rows `xs`, [`PASS`] rows a pass.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
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
                4 => pass::<4>(args),
                5 => pass::<5>(args),
                6 => pass::<6>(args),
                7 => pass::<7>(args),
                _ => pass::<8>(args),
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

    /// Activation rows `i0..i0 + R` against weight rows `j0..j1`. Each 32-column run of a
    /// weight row is widened once to its dequantized values `(q - z) · s` (the reference's
    /// arithmetic, so bit-equal to `dequantize`), then multiply-added into the `R` rows'
    /// even-column and odd-column accumulators (`2 R` independent FMA chains).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn pass<const R: usize>((xs, w, bias, out, i0, j0, j1): PassArgs<'_, '_>) {
        let (n, k, group) = (w.n, w.k, w.group);
        let groups = k.div_ceil(group); // the last one may be shorter (whole 32-column runs)
        let per_tensor = w.scale.len() == groups && n != 1;
        let offset = match w.format {
            WeightFormat::Int4 { offset } => offset as f32,
            WeightFormat::Fp6 => 0.0,
        };
        let nibble = _mm512_set1_epi32(15);
        let bytes_per_row = k / 2;
        let xp = xs.as_ptr().add(i0 * k);
        for j in j0..j1 {
            let srow = if per_tensor { 0 } else { j * groups };
            let codes = w.data.as_ptr().add(j * bytes_per_row);
            let mut even = [_mm512_setzero_ps(); R];
            let mut odd = [_mm512_setzero_ps(); R];
            for g in 0..groups {
                let s = _mm512_set1_ps(w.scale[srow + g]);
                let z = _mm512_set1_ps(w.zero.map_or(offset, |z| z[srow + g]));
                for run in (g * group / 32)..(((g + 1) * group).min(k) / 32) {
                    if run % 4 == 0 {
                        // A hint only: the address may lie past the weight (never read), hence wrapping_add.
                        let ahead = codes.wrapping_add(run * 16 + PREFETCH);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    }
                    let b = _mm_loadu_si128(codes.add(run * 16).cast());
                    let v = _mm512_cvtepu8_epi32(b);
                    let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
                    let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                    let wl = _mm512_mul_ps(_mm512_sub_ps(lo, z), s);
                    let wh = _mm512_mul_ps(_mm512_sub_ps(hi, z), s);
                    for i in 0..R {
                        let x = xp.add(i * k + run * 32);
                        even[i] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(x), even[i]);
                        odd[i] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(x.add(16)), odd[i]);
                    }
                }
            }
            for i in 0..R {
                let y = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i]))
                    + bias.map_or(0.0, |b| b[j]);
                // SAFETY: column j of row i0 + i belongs to this block alone.
                *out.get().add((i0 + i) * n + j) = y;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixture::{at_every_level, Fixture, Shape};
    use super::super::{dequant_linear, dequantize};

    fn check(n: usize, k: usize, group: usize, m: usize, asym: bool, per_tensor: bool) {
        check_format(n, k, group, m, asym, per_tensor, false);
    }

    /// `fp6`: an FP6 weight (every 6-bit code), else INT4 (`asym`: with zero points).
    fn check_format(
        n: usize,
        k: usize,
        group: usize,
        m: usize,
        asym: bool,
        per_tensor: bool,
        fp6: bool,
    ) {
        let f = Fixture::new(Shape {
            n,
            k,
            group,
            m,
            asym,
            per_tensor,
        });
        let (x, bias, w) = (&f.x, &f.bias, f.weight(fp6));
        let mut deq = vec![0f32; n * k];
        dequantize(&w, &mut deq).unwrap();
        at_every_level(|level| {
            let mut y = vec![0f32; m * n];
            dequant_linear(x, &w, Some(bias), &mut y, m).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let (mut exact, mut mag) = (f64::from(bias[j]), 1.0f64);
                    for c in 0..k {
                        let p = f64::from(x[i * k + c]) * f64::from(deq[j * k + c]);
                        exact += p;
                        mag += p.abs();
                    }
                    let err = (f64::from(y[i * n + j]) - exact).abs();
                    assert!(
                        err <= 1e-5 * mag,
                        "{level:?} fp6 {fp6} {n}x{k} g{group} m{m} ({i},{j}) {err}"
                    );
                }
            }
        });
    }

    #[test]
    fn matches_the_dequantized_product_at_every_level() {
        check(70, 576, 32, 1, false, false);
        check(9, 1536, 32, 4, false, false);
        check(33, 128, 64, 3, true, false);
        check(5, 64, 32, 2, false, true);
        check(1, 32, 32, 1, true, false);
        check(33, 576, 128, 4, false, false);
        check(70, 576, 32, 16, false, false);
        check(9, 1536, 32, 11, true, false);
        check(17, 96, 32, 8, false, true);
        // 5-8 rows: one pass of one FMA chain per row at AVX2; 16-column runs (AVX2 only).
        check(70, 576, 32, 5, true, false);
        check(9, 1536, 32, 7, false, false);
        check(21, 48, 16, 6, true, false);
        check(3, 80, 16, 1, false, true);
    }

    #[test]
    fn fp6_matches_the_dequantized_product_at_every_level() {
        for m in 1..=9 {
            check_format(70, 576, 576, m, false, false, true);
        }
        check_format(33, 576, 128, 3, false, false, true);
        check_format(5, 64, 32, 2, false, true, true);
        check_format(1, 32, 32, 1, false, false, true);
        check_format(21, 48, 16, 8, false, false, true);
        check_format(9, 40, 8, 2, false, false, true); // runs do not tile: the tile path
    }
}
