//! A linear layer for the few rows of a decode step: `out = x W^T` with `x`
//! `(M, K)`, `W` `(N, K)` and `out` `(M, N)`, f32 accumulation, each output
//! rounded once to the element type. Reference: `torch.nn.functional.linear`
//! (zserve's `zserve.model.native.linear`), which for a bfloat16 model also
//! accumulates in f32 and rounds once; the sums differ only in their order.
//!
//! Why: at batch 1 a bfloat16 decode step is a matrix-vector product per
//! projection, bound by reading `W` once. torch's bfloat16 path for one row
//! ran ~5x slower than its float16 one over the same bytes (SmolLM2's tied
//! 49152 x 576 LM head: the bulk of a decode step). Here each weight row is
//! widened in registers and dotted with every activation row while it is in
//! cache, so `W` is streamed once for all `M` rows.

use super::{check_len, dot, for_tasks, param, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Weight rows one task computes.
const ROWS_PER_TASK: usize = 256;

/// `out[m, n] = sum_k x[m, k] * w[n, k]` for `m < rows`; see the module docs.
pub fn linear_rows<E: Elem>(
    x: &[E],
    w: &[E],
    rows: usize,
    out: &mut [E],
) -> Result<(), QuantError> {
    if rows == 0 {
        return Err(param("rows", 0, "at least one activation row"));
    }
    let k = x.len() / rows;
    if k == 0 {
        return Err(param("in_features", 0, "at least one input feature"));
    }
    check_len("x", x.len(), rows * k, || {
        format!("rows ({rows}) * in_features")
    })?;
    let n = w.len() / k;
    check_len("weight", w.len(), n * k, || {
        format!("out_features * in_features ({k})")
    })?;
    check_len("out", out.len(), rows * n, || {
        format!("rows ({rows}) * out_features ({n})")
    })?;
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let dst = Shared(out.as_mut_ptr());
    let tasks = n.div_ceil(ROWS_PER_TASK);
    for_tasks(tasks, rows * n * k, |t| {
        let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
        for m in 0..rows {
            // SAFETY: task t owns columns j0..j1 of every output row.
            let o = unsafe { dst.range(m * n + j0, j1 - j0) };
            let (xr, wr) = (&xf[m * k..(m + 1) * k], &w[j0 * k..j1 * k]);
            #[cfg(target_arch = "x86_64")]
            if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
                // SAFETY: `active()` only reports AVX-512 when the CPU has every enabled
                // feature; `wr` holds `o.len()` rows of `xr.len()` elements.
                unsafe { avx512::rows(xr, wr, o) };
                continue;
            }
            rows_auto(xr, wr, o);
        }
    });
    Ok(())
}

#[inline(always)]
fn rows_body<E: Elem>(x: &[f32], w: &[E], out: &mut [E]) {
    let k = x.len();
    for (o, row) in out.iter_mut().zip(w.chunks_exact(k)) {
        *o = E::from_f32(dot(x, row));
    }
}

multiversion!(rows_auto => rows_body<E: Elem>(x: &[f32], w: &[E], out: &mut [E]));

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! [`super::rows_body`] with explicit AVX-512 FMAs over four weight rows at a time:
    //! four independent accumulator chains and four weight streams in flight (one row
    //! at a time, the portable body read SmolLM2's 576 x 1536 down projection at about
    //! half the speed of its 576-wide ones).

    use crate::bf16::Elem;
    use std::arch::x86_64::*;

    /// 16 elements at `p` (those of `mask`) as f32; bfloat16 widened exactly.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn load16<E: Elem>(p: *const E, mask: __mmask16) -> __m512 {
        if E::BF16 {
            let h = _mm256_maskz_loadu_epi16(mask, p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_maskz_loadu_ps(mask, p.cast())
        }
    }

    /// `out[q] = x · w[j + q]` for the R rows from `j`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn block<const R: usize, E: Elem>(x: &[f32], w: &[E], j: usize, out: &mut [E]) {
        let k = x.len();
        let full = k / 16 * 16;
        let (xp, wp) = (x.as_ptr(), w.as_ptr().add(j * k));
        let mut acc = [_mm512_setzero_ps(); R];
        let mut t = 0;
        while t < full {
            let xv = _mm512_loadu_ps(xp.add(t));
            for (q, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, load16(wp.add(q * k + t), u16::MAX), *a);
            }
            t += 16;
        }
        if full < k {
            let mask: __mmask16 = (1u16 << (k - full)) - 1;
            let xv = _mm512_maskz_loadu_ps(mask, xp.add(full));
            for (q, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(xv, load16(wp.add(q * k + full), mask), *a);
            }
        }
        for (q, a) in acc.iter().enumerate() {
            out[j + q] = E::from_f32(_mm512_reduce_add_ps(*a));
        }
    }

    /// `out[j] = x · w[j]` for every row of `w (out.len(), x.len())`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    pub(super) unsafe fn rows<E: Elem>(x: &[f32], w: &[E], out: &mut [E]) {
        let n = out.len();
        let whole = n / 4 * 4;
        for j in (0..whole).step_by(4) {
            block::<4, E>(x, w, j, out);
        }
        for j in whole..n {
            block::<1, E>(x, w, j, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{bf16_to_f32, f32_to_bf16};

    #[test]
    fn f32_matches_the_definition_at_every_level() {
        use crate::simd::{detected, set_override, SimdLevel};
        for &(m, n, k) in &[(1, 301, 576), (4, 7, 1536), (2, 5, 37)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 13 % 17) as f32 - 8.0) / 5.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7 % 11) as f32 - 5.0) / 9.0)
                .collect();
            for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
                .iter()
                .filter(|&&l| l <= detected())
            {
                set_override(Some(level)).unwrap();
                let mut out = vec![0f32; m * n];
                linear_rows(&x, &w, m, &mut out).unwrap();
                for r in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i]))
                            .sum();
                        let got = f64::from(out[r * n + j]);
                        assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "{level:?}");
                    }
                }
            }
            set_override(None).unwrap();
        }
    }

    #[test]
    fn matches_the_definition() {
        let (m, n, k) = (3, 300, 37);
        let x: Vec<u16> = (0..m * k)
            .map(|i| f32_to_bf16(((i * 13 % 17) as f32 - 8.0) / 5.0))
            .collect();
        let w: Vec<u16> = (0..n * k)
            .map(|i| f32_to_bf16(((i * 7 % 11) as f32 - 5.0) / 9.0))
            .collect();
        let mut out = vec![0u16; m * n];
        linear_rows(&x, &w, m, &mut out).unwrap();
        for r in 0..m {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| {
                        f64::from(bf16_to_f32(x[r * k + i])) * f64::from(bf16_to_f32(w[j * k + i]))
                    })
                    .sum();
                let got = f64::from(bf16_to_f32(out[r * n + j]));
                assert!(
                    (got - want).abs() <= 1e-2 * (1.0 + want.abs()),
                    "{r} {j}: {got} {want}"
                );
            }
        }
        assert!(linear_rows(&x, &w[..n * k - 1], m, &mut out).is_err());
        assert!(linear_rows(&x, &w, 0, &mut out).is_err());
        assert!(linear_rows(&x, &w, m, &mut out[1..]).is_err());
    }
}
