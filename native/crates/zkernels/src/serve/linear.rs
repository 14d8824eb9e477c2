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
//! widened in registers and dotted with the activation rows (up to [`GROUP`] at a
//! time) while it is in registers, so for a decode step's rows `W` is streamed
//! once, front to back.

use super::{check_len, dot, for_tasks, param, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Weight rows one task computes.
const ROWS_PER_TASK: usize = 256;

/// Activation rows a kernel call dots with each weight row while it is in registers.
pub(super) const GROUP: usize = 4;

/// Activation rows from which an AVX2 (or AVX-512) CPU runs the call as a register-blocked
/// GEMM (`super::linear_gemm_avx2`) instead of dotting each weight row with [`GROUP`] rows.
pub(super) const GEMM_MIN_ROWS: usize = 9;

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
    let dst = Shared(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if rows >= GEMM_MIN_ROWS && crate::simd::active() >= crate::simd::SimdLevel::Avx2 {
        use super::linear_gemm_avx2::{pack_rows, task, ROWS_PER_TASK as PER};
        let packed = pack_rows(x, rows, k);
        for_tasks(n.div_ceil(PER), rows * n * k, |t| {
            let (j0, j1) = (t * PER, ((t + 1) * PER).min(n));
            // SAFETY: `active()` only reports AVX2 or above when the CPU has AVX2 and FMA;
            // `packed` holds `rows` rows of `k`, and task t writes only columns j0..j1.
            unsafe { task(&packed, rows, k, &w[j0 * k..j1 * k], j0, n, dst.ptr()) };
        });
        return Ok(());
    }
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let tasks = n.div_ceil(ROWS_PER_TASK);
    for_tasks(tasks, rows * n * k, |t| {
        let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
        let (nb, wr) = (j1 - j0, &w[j0 * k..j1 * k]);
        let mut sums = [0f32; GROUP * ROWS_PER_TASK];
        for m0 in (0..rows).step_by(GROUP) {
            let mr = (rows - m0).min(GROUP);
            let (xr, s) = (&xf[m0 * k..(m0 + mr) * k], &mut sums[..mr * nb]);
            #[cfg(target_arch = "x86_64")]
            if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
                // SAFETY: `active()` only reports AVX-512 when the CPU has every enabled
                // feature; `xr` holds `mr <= GROUP` rows and `s` `mr` rows of `nb` sums.
                unsafe { avx512::rows(xr, mr, wr, s) };
            } else if crate::simd::active() == crate::simd::SimdLevel::Avx2 {
                // SAFETY: as above, for AVX2 and FMA.
                unsafe { super::linear_avx2::rows(xr, mr, wr, s) };
            } else {
                rows_auto(xr, mr, wr, s);
            }
            #[cfg(not(target_arch = "x86_64"))]
            rows_auto(xr, mr, wr, s);
            for (m, sr) in s.chunks_exact(nb).enumerate() {
                // SAFETY: task t owns columns j0..j1 of every output row.
                let o = unsafe { dst.range((m0 + m) * n + j0, nb) };
                for (o, &v) in o.iter_mut().zip(sr) {
                    *o = E::from_f32(v);
                }
            }
        }
    });
    Ok(())
}

/// `sums[m, j] = x[m] · w[j]` for the `mr` rows of `x` and every row of `w`: each weight
/// row is dotted with all `mr` activation rows while it is in L1, so `w` is read once.
#[inline(always)]
fn rows_body<E: Elem>(x: &[f32], mr: usize, w: &[E], sums: &mut [f32]) {
    let k = x.len() / mr;
    let nb = w.len() / k;
    for (j, row) in w.chunks_exact(k).enumerate() {
        for (m, xm) in x.chunks_exact(k).enumerate() {
            sums[m * nb + j] = dot(xm, row);
        }
    }
}

multiversion!(rows_auto => rows_body<E: Elem>(x: &[f32], mr: usize, w: &[E], sums: &mut [f32]));

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! [`super::rows_body`] with explicit AVX-512 FMAs: one weight row at a time, read
    //! front to back, so the whole matrix is one sequential stream the hardware
    //! prefetcher follows across rows; four accumulators along K per activation row
    //! keep the FMA chains independent.
    //!
    //! An earlier body dotted four weight rows at once (four streams 4*K apart): every
    //! four rows three streams restarted cold, and a decode step's matrices (SmolLM2:
    //! 576 or 1536 wide, 1-7 MB, never in cache) streamed from memory at about half
    //! the rate of one sequential stream.

    use crate::bf16::Elem;
    use std::arch::x86_64::*;

    /// Accumulators per activation row; a step of the K loop covers `16 * ACC` elements.
    const ACC: usize = 4;

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

    /// [`super::rows_body`] for exactly `MR` activation rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn rows_of<const MR: usize, E: Elem>(x: &[f32], w: &[E], sums: &mut [f32]) {
        let k = x.len() / MR;
        let nb = w.len() / k;
        let whole = k / (16 * ACC) * (16 * ACC);
        let xp = x.as_ptr();
        for j in 0..nb {
            let wp = w.as_ptr().add(j * k);
            let mut acc = [[_mm512_setzero_ps(); ACC]; MR];
            let mut t = 0;
            while t < whole {
                for q in 0..ACC {
                    let wv = load16(wp.add(t + 16 * q), u16::MAX);
                    for (m, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(xp.add(m * k + t + 16 * q));
                        a[q] = _mm512_fmadd_ps(xv, wv, a[q]);
                    }
                }
                t += 16 * ACC;
            }
            while t < k {
                let mask: __mmask16 = if k - t >= 16 {
                    u16::MAX
                } else {
                    (1u16 << (k - t)) - 1
                };
                let wv = load16(wp.add(t), mask);
                for (m, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_maskz_loadu_ps(mask, xp.add(m * k + t));
                    a[0] = _mm512_fmadd_ps(xv, wv, a[0]);
                }
                t += 16;
            }
            for (m, a) in acc.iter().enumerate() {
                let s = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
                sums[m * nb + j] = _mm512_reduce_add_ps(s);
            }
        }
    }

    /// `sums[m, j] = x[m] · w[j]` for the `mr` (1 to 4) rows of `x` and every row of `w`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    pub(super) unsafe fn rows<E: Elem>(x: &[f32], mr: usize, w: &[E], sums: &mut [f32]) {
        debug_assert!((1..=super::GROUP).contains(&mr));
        match mr {
            1 => rows_of::<1, E>(x, w, sums),
            2 => rows_of::<2, E>(x, w, sums),
            3 => rows_of::<3, E>(x, w, sums),
            _ => rows_of::<4, E>(x, w, sums),
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
        // Every group size (1-4 rows; 5 = a group of 4 and one of 1), the GEMM from 9 rows
        // (a part-filled two-vector panel; 17 = a full panel and a one-vector panel of 1;
        // part-filled weight-row groups), K with and without a tail past the 64-wide step,
        // and more weight rows than one task.
        for &(m, n, k) in &[
            (1, 301, 576),
            (4, 7, 1536),
            (2, 5, 37),
            (3, 260, 100),
            (5, 9, 64),
            (17, 13, 37),
            (64, 50, 576),
            (9, 97, 5),
        ] {
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
    fn bf16_matches_the_definition_at_every_level() {
        use crate::simd::{detected, set_override, SimdLevel};
        for &(m, n, k) in &[(3, 300, 37), (5, 11, 576), (1, 7, 1536), (20, 53, 100)] {
            let x: Vec<u16> = (0..m * k)
                .map(|i| f32_to_bf16(((i * 13 % 17) as f32 - 8.0) / 5.0))
                .collect();
            let w: Vec<u16> = (0..n * k)
                .map(|i| f32_to_bf16(((i * 7 % 11) as f32 - 5.0) / 9.0))
                .collect();
            for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
                .iter()
                .filter(|&&l| l <= detected())
            {
                set_override(Some(level)).unwrap();
                let mut out = vec![0u16; m * n];
                linear_rows(&x, &w, m, &mut out).unwrap();
                for r in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|i| {
                                f64::from(bf16_to_f32(x[r * k + i]))
                                    * f64::from(bf16_to_f32(w[j * k + i]))
                            })
                            .sum();
                        let got = f64::from(bf16_to_f32(out[r * n + j]));
                        // One bf16 rounding of the f32 sum: 2^-8 relative.
                        assert!(
                            (got - want).abs() <= 4e-3 * (1.0 + want.abs()),
                            "{level:?} {r} {j}: {got} {want}"
                        );
                    }
                }
            }
            set_override(None).unwrap();
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let (m, n, k) = (3, 30, 37);
        let (x, w) = (vec![0u16; m * k], vec![0u16; n * k]);
        let mut out = vec![0u16; m * n];
        assert!(linear_rows(&x, &w[..n * k - 1], m, &mut out).is_err());
        assert!(linear_rows(&x, &w, 0, &mut out).is_err());
        assert!(linear_rows(&x, &w, m, &mut out[1..]).is_err());
    }
}
