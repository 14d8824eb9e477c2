//! W8A8 linear with LLM.int8()'s outlier split fused into one call: the `t`
//! input channels with the largest magnitude over the call's rows stay in
//! float32, the rest go through the INT8 GEMM.
//!
//! `zquant.nn.OutlierQuantLinear` (its torch reference) runs it as ~10 torch
//! ops per layer (abs, amax, topk, index_select, index_fill, the INT8 linear,
//! a gather of the weight's columns, a small matmul, an add). At batch 1 those
//! cost as much as the GEMM itself; here the outlier term is added in the
//! GEMM's epilogue while the weight row is still in cache, so the weight is
//! read once:
//!
//! ```text
//! C    = the t channels of largest max_i |x[i, c]| (ties: lower index first)
//! y    = Q(x with C zeroed) · W_qᵀ · a_scale · w_scale + bias
//! y   += Σ_{c in C} x[i, c] · (W_q[j, c] · w_scale[j])
//! ```
//!
//! Same INT8 codes and int32 sums as the reference; the float32 outlier term
//! sums its `t` products in order, so it matches torch's matmul to rounding.

use super::error::{check_len, QuantError};
use super::int8::{gemm, quantize_tokenwise, scaled, Epilogue};
use super::SharedOut;
use crate::simd::multiversion;

struct OutlierOut<'a> {
    out: SharedOut<f32>,
    n: usize,
    k: usize,
    a_scale: &'a [f32],
    w_scale: &'a [f32],
    bias: Option<&'a [f32]>,
    w: &'a [i8],
    cols: &'a [usize],
    /// `x[i, cols[t]]` at `i * cols.len() + t`.
    xo: &'a [f32],
    /// The outlier term added by [`Epilogue::finish`] (at least [`DEFERRED_ROWS`] rows),
    /// not per output. Both add `Σ_t` in order from 0 to the INT8 part: the same bits.
    deferred: bool,
}

impl Epilogue for OutlierOut<'_> {
    /// The INT8 part, and for a few rows the outlier term too (the weight row is in cache
    /// right after its dot products); more rows get the term from [`Epilogue::finish`].
    #[inline(always)]
    fn write(&self, i: usize, j: usize, acc: i32) {
        let (y, ws) = scaled(acc, self.a_scale[i], self.w_scale, self.bias, j);
        let mut corr = 0f32;
        if !self.deferred {
            let t = self.cols.len();
            let row = &self.w[j * self.k..(j + 1) * self.k];
            for (&c, &v) in self.cols.iter().zip(&self.xo[i * t..(i + 1) * t]) {
                corr += v * (f32::from(row[c]) * ws);
            }
        }
        // SAFETY: (i, j) is inside the (m, n) output and owned by this block.
        unsafe { *self.out.get().add(i * self.n + j) = y + corr }
    }

    fn finish(&self, m: usize, j0: usize, j1: usize) {
        if self.deferred {
            for c0 in (j0..j1).step_by(TERM_COLS) {
                term_auto(self, m, c0, (c0 + TERM_COLS).min(j1));
            }
        }
    }
}

/// Rows from which the outlier term is one pass over each finished block ([`term_body`]):
/// its gather of the weight's columns then serves many rows. Below, each output adds its
/// own term (kbench, 1 row: the pass was 25-30 % slower on the 49152-row head, at AVX2).
const DEFERRED_ROWS: usize = 4;

/// Output columns the outlier term adds in one pass (its per-row sums stay in registers).
const TERM_COLS: usize = 64;

/// `out[i, j] += Σ_t xo[i, t] · (W_q[j, C_t] · w_scale[j])` for `j` in `j0..j1` (at most
/// [`TERM_COLS`]), every row: the weight columns gathered once, then each row's sums taken
/// across the columns in lanes. Each output sums its `t` products in order from 0 and adds
/// the sum to the INT8 part, as the scalar definition (`corr += v · w; y + corr`).
#[inline(always)]
fn term_body(o: &OutlierOut<'_>, m: usize, j0: usize, j1: usize) {
    let (t, nj) = (o.cols.len(), j1 - j0);
    let mut wc = vec![0f32; t * TERM_COLS];
    for (jj, j) in (j0..j1).enumerate() {
        let ws = if o.w_scale.len() == 1 {
            o.w_scale[0]
        } else {
            o.w_scale[j]
        };
        let row = &o.w[j * o.k..(j + 1) * o.k];
        for (tt, &c) in o.cols.iter().enumerate() {
            wc[tt * TERM_COLS + jj] = f32::from(row[c]) * ws;
        }
    }
    for i in 0..m {
        let mut corr = [0f32; TERM_COLS];
        for (wrow, &v) in wc.chunks_exact(TERM_COLS).zip(&o.xo[i * t..(i + 1) * t]) {
            for (c, &w) in corr.iter_mut().zip(wrow) {
                *c += v * w;
            }
        }
        // SAFETY: row i's columns j0..j1 are inside the (m, n) output and owned by this
        // block, whose INT8 part is written.
        let out = unsafe { std::slice::from_raw_parts_mut(o.out.get().add(i * o.n + j0), nj) };
        for (y, c) in out.iter_mut().zip(corr) {
            *y += c;
        }
    }
}

multiversion!(term_auto => term_body<>(o: &OutlierOut<'_>, m: usize, j0: usize, j1: usize));

#[inline(always)]
fn colmax_body(x: &[f32], k: usize, out: &mut [f32]) {
    out.fill(0.0);
    for row in x.chunks_exact(k) {
        for (c, &v) in out.iter_mut().zip(row) {
            let a = v.abs();
            // NaN propagates, as torch's amax (a NaN column is the largest for topk).
            *c = if a > *c || a.is_nan() { a } else { *c };
        }
    }
}

multiversion!(colmax_auto => colmax_body<>(x: &[f32], k: usize, out: &mut [f32]));

/// `out[c] = max_i |x[i, c]|` over the rows of `x (m, k)` (`x.abs().amax(0)`, exact; a NaN
/// in a column makes its maximum NaN, as torch's): the column maxima the outlier channels
/// are chosen from.
pub fn column_absmax(x: &[f32], m: usize, k: usize, out: &mut [f32]) -> Result<(), QuantError> {
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    check_len("out", out.len(), k, || format!("k = {k}"))?;
    if k > 0 {
        colmax_auto(x, k, out);
    }
    Ok(())
}

/// The `t` channels of `x (m, k)` with the largest `max_i |x[i, c]|`, largest first
/// (ties: lower index first), as `torch.topk` of the column maxima.
pub fn outlier_channels(x: &[f32], m: usize, k: usize, t: usize) -> Vec<usize> {
    let mut colmax = vec![0f32; k];
    if k > 0 {
        colmax_auto(&x[..m * k], k, &mut colmax);
    }
    let mut idx: Vec<usize> = (0..k).collect();
    let by_max = |a: &usize, b: &usize| colmax[*b].total_cmp(&colmax[*a]).then(a.cmp(b));
    if t < k {
        idx.select_nth_unstable_by(t, by_max);
        idx.truncate(t);
    }
    idx.sort_by(by_max);
    idx
}

/// W8A8 linear of `x (m, k)` by the INT8 weight `w (n, k)` with the `outliers` largest input
/// channels kept in float32; see the module docs. `outliers = 0` is [`super::int8_linear`].
#[allow(clippy::too_many_arguments)]
pub fn int8_linear_outliers(
    x: &[f32],
    w: &[i8],
    w_scale: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    outliers: usize,
) -> Result<(), QuantError> {
    if outliers == 0 {
        return super::int8_linear(x, w, w_scale, bias, out, m, n, k);
    }
    if outliers > k {
        return Err(QuantError::Param {
            name: "outliers",
            value: outliers as i64,
            expected: "0..=in_features",
        });
    }
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    check_len("w", w.len(), n * k, || format!("n·k = {n}·{k}"))?;
    if w_scale.len() != 1 {
        check_len("w_scale", w_scale.len(), n, || format!("n = {n} (or 1)"))?;
    }
    if let Some(b) = bias {
        check_len("bias", b.len(), n, || format!("n = {n}"))?;
    }
    check_len("out", out.len(), m * n, || format!("m·n = {m}·{n}"))?;
    let cols = outlier_channels(x, m, k, outliers);
    let mut rest = x.to_vec();
    let mut xo = vec![0f32; m * outliers];
    for (row, o) in rest.chunks_exact_mut(k).zip(xo.chunks_exact_mut(outliers)) {
        for (&c, v) in cols.iter().zip(o.iter_mut()) {
            *v = row[c];
            row[c] = 0.0;
        }
    }
    let mut q = vec![0i8; m * k];
    let mut a_scale = vec![1f32; m];
    quantize_tokenwise(&rest, m, k, 8, &mut q, &mut a_scale)?;
    let epi = OutlierOut {
        out: SharedOut(out.as_mut_ptr()),
        n,
        k,
        a_scale: &a_scale,
        w_scale,
        bias,
        w,
        cols: &cols,
        xo: &xo,
        deferred: m >= DEFERRED_ROWS,
    };
    gemm(&q, w, m, n, k, &epi);
    Ok(())
}

/// [`int8_linear_outliers`] with the channels C given (`cols`, in the caller's order) and its
/// outlier term left to the caller, for calls whose result must be the torch path's to the
/// bit (zquant's prompts, as `z eval` scores them; torch's `topk` orders tied column maxima
/// its own way, and GQA's attention outputs tie across a KV group's heads): `out` gets the
/// INT8 part `Q(x with C zeroed) · W_qᵀ · a_scale · w_scale + bias` (the numbers of
/// [`super::int8_linear`] of `x` with C zeroed), `xo (m, t)` the values `x[i, C]` and
/// `wc (n, t)` the weight's columns `W_q[j, C] · w_scale[j]`; the caller adds `xo · wcᵀ`.
/// One call instead of five torch ops around the INT8 GEMM (two index_select, index_fill,
/// to, mul).
#[allow(clippy::too_many_arguments)]
pub fn int8_linear_split(
    x: &[f32],
    w: &[i8],
    w_scale: &[f32],
    bias: Option<&[f32]>,
    cols: &[i64],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    xo: &mut [f32],
    wc: &mut [f32],
) -> Result<(), QuantError> {
    let t = cols.len();
    if let Some(&c) = cols.iter().find(|&&c| c < 0 || c as usize >= k) {
        return Err(QuantError::Param {
            name: "cols",
            value: c,
            expected: "input channels in 0..in_features",
        });
    }
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    check_len("w", w.len(), n * k, || format!("n·k = {n}·{k}"))?;
    check_len("xo", xo.len(), m * t, || format!("m·len(cols) = {m}·{t}"))?;
    check_len("wc", wc.len(), n * t, || format!("n·len(cols) = {n}·{t}"))?;
    if w_scale.len() != 1 {
        check_len("w_scale", w_scale.len(), n, || format!("n = {n} (or 1)"))?;
    }
    let mut rest = x.to_vec();
    if t > 0 {
        for (row, o) in rest.chunks_exact_mut(k).zip(xo.chunks_exact_mut(t)) {
            for (&c, v) in cols.iter().zip(o.iter_mut()) {
                *v = row[c as usize];
                row[c as usize] = 0.0;
            }
        }
        for (j, (row, o)) in w.chunks_exact(k).zip(wc.chunks_exact_mut(t)).enumerate() {
            let ws = if w_scale.len() == 1 {
                w_scale[0]
            } else {
                w_scale[j]
            };
            for (&c, v) in cols.iter().zip(o.iter_mut()) {
                *v = f32::from(row[c as usize]) * ws;
            }
        }
    }
    super::int8_linear(&rest, w, w_scale, bias, out, m, n, k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{detected, set_override, SimdLevel};

    /// The definition in f64 (INT8 part exact, outlier term in f64).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f32],
        w: &[i8],
        ws: &[f32],
        m: usize,
        n: usize,
        k: usize,
        cols: &[usize],
    ) -> Vec<f64> {
        let mut rest = x.to_vec();
        for row in rest.chunks_exact_mut(k) {
            cols.iter().for_each(|&c| row[c] = 0.0);
        }
        let mut q = vec![0i8; m * k];
        let mut s = vec![0f32; m];
        quantize_tokenwise(&rest, m, k, 8, &mut q, &mut s).unwrap();
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let acc: i32 = (0..k)
                    .map(|t| i32::from(q[i * k + t]) * i32::from(w[j * k + t]))
                    .sum();
                let corr: f64 = cols
                    .iter()
                    .map(|&c| f64::from(x[i * k + c]) * f64::from(w[j * k + c]) * f64::from(ws[j]))
                    .sum();
                out[i * n + j] = f64::from(acc) * f64::from(s[i]) * f64::from(ws[j]) + corr;
            }
        }
        out
    }

    #[test]
    fn matches_the_definition_at_every_level() {
        for &(m, n, k, t) in &[
            (1, 70, 130, 8),
            (5, 33, 576, 8),
            (4, 9, 64, 1),
            (2, 5, 7, 7),
        ] {
            let mut x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
                .collect();
            x[k / 2] = 40.0; // an outlier channel
            let w: Vec<i8> = (0..n * k)
                .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
                .collect();
            let ws: Vec<f32> = (0..n).map(|j| 0.001 * (j + 1) as f32).collect();
            let cols = outlier_channels(&x, m, k, t);
            assert_eq!(cols[0], k / 2);
            let want = reference(&x, &w, &ws, m, n, k, &cols);
            for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
                .iter()
                .filter(|&&l| l <= detected())
            {
                set_override(Some(level)).unwrap();
                let mut out = vec![0f32; m * n];
                int8_linear_outliers(&x, &w, &ws, None, &mut out, m, n, k, t).unwrap();
                for (g, r) in out.iter().zip(&want) {
                    assert!(
                        (f64::from(*g) - r).abs() <= 1e-5 * (1.0 + r.abs()),
                        "{g} {r}"
                    );
                }
                // The split: its parts, the outlier term added here, give the same numbers.
                let (mut xo, mut wc) = (vec![0f32; m * t], vec![0f32; n * t]);
                let c64: Vec<i64> = cols.iter().map(|&c| c as i64).collect();
                int8_linear_split(&x, &w, &ws, None, &c64, &mut out, m, n, k, &mut xo, &mut wc)
                    .unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let term: f32 = (0..t).map(|c| xo[i * t + c] * wc[j * t + c]).sum();
                        let (g, r) = (f64::from(out[i * n + j] + term), want[i * n + j]);
                        assert!((g - r).abs() <= 1e-5 * (1.0 + r.abs()), "split {g} {r}");
                    }
                }
                assert_eq!(xo[0], x[cols[0]]);
                assert_eq!(wc[t], f32::from(w[k + cols[0]]) * ws[1]);
            }
            set_override(None).unwrap();
        }
    }

    /// The fused epilogue's float32 arithmetic, to the bit: the INT8 part, then the outlier
    /// term summed in channel order from 0 and added (blocks of 64 columns and a short
    /// last one, 1-17 rows, more channels than one pass of 8).
    #[test]
    fn fused_term_is_the_scalar_order_at_every_level() {
        for &(m, n, k, t) in &[(1, 200, 576, 8), (3, 70, 130, 8), (17, 131, 96, 11)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
                .collect();
            let w: Vec<i8> = (0..n * k)
                .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
                .collect();
            let ws: Vec<f32> = (0..n).map(|j| 0.0013 * (j + 1) as f32).collect();
            let bias: Vec<f32> = (0..n).map(|j| 0.5 - j as f32 * 0.01).collect();
            let cols = outlier_channels(&x, m, k, t);
            let mut rest = x.clone();
            for row in rest.chunks_exact_mut(k) {
                cols.iter().for_each(|&c| row[c] = 0.0);
            }
            let mut want = vec![0f32; m * n];
            set_override(Some(SimdLevel::Scalar)).unwrap();
            super::super::int8_linear(&rest, &w, &ws, Some(&bias), &mut want, m, n, k).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let mut corr = 0f32;
                    for &c in &cols {
                        corr += x[i * k + c] * (f32::from(w[j * k + c]) * ws[j]);
                    }
                    want[i * n + j] += corr;
                }
            }
            for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
                .iter()
                .filter(|&&l| l <= detected())
            {
                set_override(Some(level)).unwrap();
                let mut out = vec![0f32; m * n];
                int8_linear_outliers(&x, &w, &ws, Some(&bias), &mut out, m, n, k, t).unwrap();
                assert_eq!(out, want, "{level:?} {m}x{n}x{k} t={t}");
            }
            set_override(None).unwrap();
        }
    }

    #[test]
    fn split_rejects_bad_channels() {
        let (x, w, ws) = ([1f32; 8], [1i8; 8], [1f32]);
        let mut out = [0f32; 4];
        let (mut xo, mut wc) = ([0f32; 2], [0f32; 2]);
        let r = int8_linear_split(&x, &w, &ws, None, &[4], &mut out, 2, 2, 4, &mut xo, &mut wc);
        assert!(matches!(r, Err(QuantError::Param { name: "cols", .. })));
        let mut wc = [0f32; 3];
        let r = int8_linear_split(&x, &w, &ws, None, &[1], &mut out, 2, 2, 4, &mut xo, &mut wc);
        assert!(matches!(r, Err(QuantError::Shape { what: "wc", .. })));
    }

    #[test]
    fn column_absmax_is_exact_at_every_level() {
        let (m, k) = (5, 37);
        let mut x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 29 % 31) as f32 - 15.0) * 0.37)
            .collect();
        x[3 * k + 4] = -1e30;
        let want: Vec<f32> = (0..k)
            .map(|c| (0..m).fold(0f32, |a, i| a.max(x[i * k + c].abs())))
            .collect();
        for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .iter()
            .filter(|&&l| l <= detected())
        {
            set_override(Some(level)).unwrap();
            let mut out = vec![-1f32; k];
            column_absmax(&x, m, k, &mut out).unwrap();
            assert_eq!(out, want, "{level:?}");
            x[2 * k + 9] = f32::NAN;
            column_absmax(&x, m, k, &mut out).unwrap();
            assert!(
                out[9].is_nan() && out[10] == want[10],
                "{level:?}: NaN propagates"
            );
            x[2 * k + 9] = 0.0;
        }
        set_override(None).unwrap();
        assert!(column_absmax(&x, m, k, &mut [0f32; 3]).is_err());
    }

    #[test]
    fn channels_are_topk_of_column_maxima() {
        let x = [1.0, -5.0, 2.0, 0.5, /* row 2 */ -3.0, 0.0, 2.0, 4.0];
        assert_eq!(outlier_channels(&x, 2, 4, 2), vec![1, 3]);
        assert_eq!(outlier_channels(&x, 2, 4, 4), vec![1, 3, 0, 2]);
        let mut out = [0f32; 2];
        let w = [1i8; 4];
        assert!(int8_linear_outliers(&x, &w, &[1.0], None, &mut out, 2, 1, 4, 5).is_err());
    }
}
