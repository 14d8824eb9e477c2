//! RMSNorm of rows: `w * (x * rsqrt(mean(x^2) + eps))`, the product with `x`
//! in f32 rounded to the element type before the weight multiplies it (as
//! transformers' `LlamaRMSNorm` and `zserve.model.llama.rms_norm` do). The
//! sum of squares is added in the order of torch's CPU sum kernel, so the
//! result is bit-identical to that torch reference (f32 and bf16).

use super::{check_len, for_tasks, param, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Normalizes each row of `x` (rows of `weight.len()` elements) into `out`.
pub fn rms_norm<E: Elem>(x: &[E], weight: &[E], eps: f32, out: &mut [E]) -> Result<(), QuantError> {
    let h = check_norm(x.len(), weight, eps, out.len())?;
    let dst = Shared(out.as_mut_ptr());
    let rows = x.len() / h;
    for_tasks(rows, rows * h, |r| {
        // SAFETY: row r owns out[r * h .. (r + 1) * h].
        let o = unsafe { dst.range(r * h, h) };
        norm_row(&x[r * h..(r + 1) * h], weight, eps, o);
    });
    Ok(())
}

/// The residual add and the next RMSNorm of a decoder layer in one call: `x += delta`
/// (each sum rounded to the element type, as torch's `x += delta` rounds it), then
/// [`rms_norm`] of the new `x` into `out`. The same float operations in the same order
/// as the two separate steps, so the same bits.
pub fn add_rms_norm<E: Elem>(
    x: &mut [E],
    delta: &[E],
    weight: &[E],
    eps: f32,
    out: &mut [E],
) -> Result<(), QuantError> {
    let h = check_norm(x.len(), weight, eps, out.len())?;
    check_len("delta", delta.len(), x.len(), || "x's length".to_string())?;
    let (src, dst) = (Shared(x.as_mut_ptr()), Shared(out.as_mut_ptr()));
    let rows = x.len() / h;
    for_tasks(rows, rows * h, |r| {
        // SAFETY: row r owns x[r * h .. (r + 1) * h] and out[r * h .. (r + 1) * h].
        let (xr, o) = unsafe { (src.range(r * h, h), dst.range(r * h, h)) };
        for (v, &d) in xr.iter_mut().zip(&delta[r * h..(r + 1) * h]) {
            *v = E::from_f32(v.to_f32() + d.to_f32());
        }
        norm_row(xr, weight, eps, o);
    });
    Ok(())
}

/// Checks a norm's arguments; returns the row length (`weight.len()`).
fn check_norm<E: Elem>(
    len: usize,
    weight: &[E],
    eps: f32,
    out: usize,
) -> Result<usize, QuantError> {
    let h = weight.len();
    if h == 0 {
        return Err(param("hidden", 0, "weight of at least one element"));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(param("eps", eps as i64, "a finite eps >= 0"));
    }
    check_len("x", len, len / h * h, || format!("rows * hidden ({h})"))?;
    check_len("out", out, len, || "x's length".to_string())?;
    Ok(h)
}

/// One row's RMSNorm at the active SIMD level.
fn norm_row<E: Elem>(xr: &[E], weight: &[E], eps: f32, o: &mut [E]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() >= crate::simd::SimdLevel::Avx2 {
        // SAFETY: `active()` reports AVX2 (or above) only where the CPU has AVX2 and FMA;
        // the three rows have `h` elements.
        unsafe { super::norm_avx2::norm(xr, weight, eps, o) };
        return;
    }
    norm_auto(xr, weight, eps, o);
}

#[inline(always)]
fn norm_body<E: Elem>(x: &[E], w: &[E], eps: f32, out: &mut [E]) {
    let ss = sum_sq_torch_order(x);
    let r = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &v), &wv) in out.iter_mut().zip(x).zip(w) {
        let y = E::from_f32(v.to_f32() * r).to_f32();
        *o = E::from_f32(wv.to_f32() * y);
    }
}

/// Lanes of torch's CPU sum kernel: 8 f32 (`Vectorized<float>` on AVX2; measured equal on
/// an AVX512 torch too).
pub(super) const LANES: usize = 8;
/// Independent accumulators torch's row sum interleaves (its `ilp_factor`).
pub(super) const ILP: usize = 4;
/// Levels of torch's cascade sum (its `num_levels`).
pub(super) const LEVELS: usize = 4;

#[inline(always)]
fn sq<E: Elem>(v: E) -> f32 {
    let f = v.to_f32();
    f * f
}

/// torch's `CeilLog2` (`ATen/native/cpu/utils.h`): 1 for `x <= 2`.
pub(super) fn ceil_log2(x: usize) -> usize {
    if x <= 2 {
        1
    } else {
        (usize::BITS - (x - 1).leading_zeros()) as usize
    }
}

/// `x.float().pow(2).sum()` of one contiguous row in the order torch's CPU sum kernel adds
/// (`ATen/native/cpu/SumKernel.cpp`: `vectorized_inner_sum` over [`LANES`]-wide vectors, or
/// `scalar_inner_sum` for rows shorter than one vector; both a `row_sum` of [`ILP`]
/// interleaved accumulators, each a cascade of [`LEVELS`] partial sums). The f32 result is
/// then bit-identical to `zserve.model.llama.rms_norm`'s: a row summed in another order
/// differs in its last bits, and in a W8A8 model those flip INT8 activation codes of the
/// next GEMM (served perplexity moved 5e-3 from `z eval`'s on SmolLM2).
pub(super) fn sum_sq_torch_order<E: Elem>(x: &[E]) -> f32 {
    if x.len() < LANES {
        let p = row_sum::<E, 1>(x, x.len());
        return p[0];
    }
    let vecs = x.len() / LANES;
    let p = row_sum::<E, LANES>(x, vecs);
    let mut acc = 0f32;
    for &v in &x[vecs * LANES..] {
        acc += sq(v);
    }
    for lane in p {
        acc += lane;
    }
    acc
}

/// torch's `row_sum` of `n` groups of `G` lanes of `x` (squared): the groups dealt to
/// [`ILP`] accumulators in turn ([`multi_row_sum`]), the leftover groups added to the first,
/// then the others added to it.
// Index loops: the lanes, accumulators and levels read as torch's code does.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn row_sum<E: Elem, const G: usize>(x: &[E], n: usize) -> [f32; G] {
    let size = n / ILP;
    let mut p = multi_row_sum::<E, G>(x, size);
    for i in size * ILP..n {
        for l in 0..G {
            p[0][l] += sq(x[i * G + l]);
        }
    }
    for k in 1..ILP {
        for l in 0..G {
            p[0][l] += p[k][l];
        }
    }
    p[0]
}

/// torch's `multi_row_sum`: `size` steps of [`ILP`] groups, each step added to level 0;
/// every `2^level_power` steps level `j - 1` is carried into level `j` (up to the first
/// level whose step bits are not all zero), then all levels added into level 0.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn multi_row_sum<E: Elem, const G: usize>(x: &[E], size: usize) -> [[f32; G]; ILP] {
    let level_power = (ceil_log2(size) / LEVELS).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0f32; G]; ILP]; LEVELS];
    let add = |acc0: &mut [[f32; G]; ILP], i: usize| {
        for (k, a) in acc0.iter_mut().enumerate() {
            let base = (i * ILP + k) * G;
            for (l, s) in a.iter_mut().enumerate() {
                *s += sq(x[base + l]);
            }
        }
    };
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            add(&mut acc[0], i);
            i += 1;
        }
        for j in 1..LEVELS {
            let (lo, hi) = acc.split_at_mut(j);
            for k in 0..ILP {
                for l in 0..G {
                    hi[0][k][l] += lo[j - 1][k][l];
                    lo[j - 1][k][l] = 0.0;
                }
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        add(&mut acc[0], i);
        i += 1;
    }
    let (first, rest) = acc.split_at_mut(1);
    for level in rest.iter() {
        for k in 0..ILP {
            for l in 0..G {
                first[0][k][l] += level[k][l];
            }
        }
    }
    first[0]
}

multiversion!(norm_auto => norm_body<E: Elem>(x: &[E], w: &[E], eps: f32, out: &mut [E]));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{detected, set_override, SimdLevel};

    #[test]
    fn matches_the_definition() {
        let h = 40;
        let x: Vec<f32> = (0..3 * h)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 / 40.0).collect();
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-5, &mut out).unwrap();
        for r in 0..3 {
            let row = &x[r * h..(r + 1) * h];
            let ms = row
                .iter()
                .map(|v| f64::from(*v) * f64::from(*v))
                .sum::<f64>()
                / h as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for i in 0..h {
                let want = f64::from(w[i]) * f64::from(row[i]) * inv;
                assert!((f64::from(out[r * h + i]) - want).abs() < 1e-5 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn torch_order_sum_is_the_sum() {
        for h in [1usize, 3, 7, 8, 9, 40, 576, 1000, 2048, 4099, 70_000] {
            let x: Vec<f32> = (0..h)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let want = x.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>();
            let got = f64::from(sum_sq_torch_order(&x));
            assert!((got - want).abs() <= 1e-6 * want, "h {h}: {got} vs {want}");
        }
        // below one vector: torch's scalar row sum, ((a + e) + b) + c) + d for 5 elements
        let x = [1e8f32, 1.0, 1.0, 1.0, 3.0];
        let s: Vec<f32> = x.iter().map(|v| v * v).collect();
        assert_eq!(
            sum_sq_torch_order(&x),
            (((s[0] + s[4]) + s[1]) + s[2]) + s[3]
        );
        assert_eq!(ceil_log2(2), 1);
        assert_eq!(ceil_log2(17), 5);
    }

    /// The fused residual add gives the bits of the add then the norm, at every level.
    #[test]
    fn add_then_norm_is_the_two_steps() {
        fn check<E: Elem + PartialEq + std::fmt::Debug + Copy>(f: impl Fn(f32) -> E) {
            let h = 576;
            let x: Vec<E> = (0..3 * h)
                .map(|i| f(((i * 37 % 23) as f32 - 11.0) / 7.3))
                .collect();
            let d: Vec<E> = (0..3 * h)
                .map(|i| f(((i * 13 % 19) as f32 - 9.0) / 3.1))
                .collect();
            let w: Vec<E> = (0..h).map(|i| f(0.5 + i as f32 / 400.0)).collect();
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
                if level > detected() {
                    continue;
                }
                set_override(Some(level)).unwrap();
                let mut want_x: Vec<E> = x
                    .iter()
                    .zip(&d)
                    .map(|(a, b)| E::from_f32(a.to_f32() + b.to_f32()))
                    .collect();
                let mut want = vec![f(0.0); x.len()];
                rms_norm(&want_x, &w, 1e-5, &mut want).unwrap();
                let mut got_x = x.clone();
                let mut got = vec![f(0.0); x.len()];
                add_rms_norm(&mut got_x, &d, &w, 1e-5, &mut got).unwrap();
                assert_eq!(got_x, want_x, "{level:?}");
                assert_eq!(got, want, "{level:?}");
                want_x.clear();
            }
            set_override(None).unwrap();
        }
        check::<f32>(|v| v);
        check::<u16>(crate::bf16::f32_to_bf16);
        let mut x = vec![1f32; 4];
        assert!(add_rms_norm(&mut x, &[1f32; 3], &[1f32; 2], 1e-5, &mut [0f32; 4]).is_err());
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut out = vec![0f32; 5];
        assert!(rms_norm(&[1f32; 5], &[1f32; 2], 1e-5, &mut out).is_err());
        assert!(rms_norm(&[1f32; 4], &[1f32; 2], 1e-5, &mut out).is_err());
        assert!(rms_norm::<f32>(&[], &[], 1e-5, &mut []).is_err());
    }
}
