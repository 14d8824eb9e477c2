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
                // SAFETY: every channel is below k (`outlier_channels` picks them from 0..k).
                corr += v * (f32::from(unsafe { *row.get_unchecked(c) }) * ws);
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

/// Outlier channels up to which [`term_body`] gathers the weight's columns into a stack buffer.
const TERM_STACK_T: usize = 16;

/// `out[i, j] += Σ_t xo[i, t] · (W_q[j, C_t] · w_scale[j])` for `j` in `j0..j1` (at most
/// [`TERM_COLS`]), every row: the weight's int8 columns gathered once (a transposed
/// `(t, TERM_COLS)` block, two instructions an element), then each row's sums taken across the
/// columns in lanes (widen, convert, scale, multiply, add). Each output sums its `t` products in
/// order from 0 and adds the sum to the INT8 part, as the scalar definition
/// (`corr += v · (w · ws); y + corr`).
#[inline(always)]
fn term_body(o: &OutlierOut<'_>, m: usize, j0: usize, j1: usize) {
    let (t, nj, k) = (o.cols.len(), j1 - j0, o.k);
    let mut stack = [[0i8; TERM_COLS]; TERM_STACK_T];
    let mut heap = Vec::new();
    let w8: &mut [[i8; TERM_COLS]] = if t <= TERM_STACK_T {
        &mut stack[..t]
    } else {
        heap.resize(t, [0i8; TERM_COLS]);
        &mut heap
    };
    let mut wsv = [0f32; TERM_COLS];
    for (jj, j) in (j0..j1).enumerate() {
        wsv[jj] = if o.w_scale.len() == 1 {
            o.w_scale[0]
        } else {
            o.w_scale[j]
        };
        let row = &o.w[j * k..(j + 1) * k];
        for (col, &c) in w8.iter_mut().zip(o.cols) {
            col[jj] = row[c];
        }
    }
    for i in 0..m {
        let mut corr = [0f32; TERM_COLS];
        for (wrow, &v) in w8.iter().zip(&o.xo[i * t..(i + 1) * t]) {
            for ((c, &w), &s) in corr.iter_mut().zip(wrow).zip(&wsv) {
                *c += v * (f32::from(w) * s);
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
    let by_max = |a: &usize, b: &usize| colmax[*b].total_cmp(&colmax[*a]).then(a.cmp(b));
    if t <= SCAN_T {
        return top_by_scan(&colmax, t);
    }
    let mut idx: Vec<usize> = (0..k).collect();
    if t < k {
        idx.select_nth_unstable_by(t, by_max);
        idx.truncate(t);
    }
    idx.sort_by(by_max);
    idx
}

/// Channel counts up to which [`outlier_channels`] keeps its best `t` in one scan.
const SCAN_T: usize = 32;

/// The `t` indices of `colmax` largest by `total_cmp`, ties to the lower index, in that order:
/// one pass keeping the best `t` sorted (a new entry goes after its equals, whose indices are
/// lower), the order `outlier_channels`' select-and-sort gives.
fn top_by_scan(colmax: &[f32], t: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(t + 1);
    if t == 0 {
        return best;
    }
    for (c, v) in colmax.iter().enumerate() {
        if best.len() == t && v.total_cmp(&colmax[best[t - 1]]).is_le() {
            continue;
        }
        let at = best.partition_point(|&b| colmax[b].total_cmp(v).is_ge());
        best.insert(at, c);
        best.truncate(t);
    }
    best
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
#[path = "int8_outliers_tests.rs"]
mod tests;
