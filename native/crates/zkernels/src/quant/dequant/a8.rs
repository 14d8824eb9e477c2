//! The INT4 linear with its activations quantized to INT8 ([`dequant_linear_a8`]): a
//! numeric path of its own, beside the exact [`super::dequant_linear`].
//!
//! Each activation row is quantized per block of [`BLOCK`] columns, symmetric, as
//! llama.cpp's Q8 activations are: `amax` the block's largest magnitude, its scale
//! `sx = amax / 127` and codes `round_ties_even(x · (127 / amax))` in `-127..=127` (a zero
//! block: scale 0, codes 0). The output is then `bias + Σ_b sx_b · Σ_{c∈b} code_c ·
//! dequant(w)[j, c]`, with `dequant(w) = (q - z) · s` as `dequantize` gives it: that is
//! `x' · dequant(w)ᵀ + bias` for `x'` the activations rounded to their codes, computed as
//! `Σ_b s_g · (sx_b · D_b - z · sx_b · S_b)` with the integer sums `D_b = Σ q · code` and
//! `S_b = Σ code` exact (the float terms in another order than a plain dot product: within
//! 1e-5 of the magnitude `Σ |x' · w|` of the exact product of `x'`). Against the unquantized
//! product each activation moves by at most `sx_b / 2`, so `|y - x · dequant(w)ᵀ| <=
//! Σ_c sx_b(c) / 2 · |dequant(w)[j, c]|` (plus the float rounding).
//!
//! Why: an INT4 weight times INT8 codes is a `vpmaddubsw` (u8 x s8 -> i16 pairs) on AVX2,
//! 32 products an instruction against 8 for an f32 FMA, so a prefill's products run at
//! several times the float tile path's rate (`benchmarks/results/serve-avx2.md`).
//! A block holding a non-finite activation makes that row's outputs NaN.
//!
//! Bodies: at AVX2 and above [`super::a8_gemv_avx2`] for calls of up to 4 rows (a decode
//! step's) and [`super::a8_avx2`]'s tiles for more, the two giving the same bits (so a row's
//! outputs do not depend on how many rows share its call); the portable one below elsewhere.
//! All need `k` and the group size to be multiples of [`BLOCK`] (the last group may be
//! shorter, as `dequantize` allows).

use super::linear::check_args;
use super::weight::{PackedWeight, WeightFormat};
use crate::quant::error::QuantError;
use crate::quant::{for_blocks, SharedOut};
use crate::simd::multiversion;

/// Columns of an activation block sharing one INT8 scale.
pub const BLOCK: usize = 32;

/// The activations of a call quantized per [`BLOCK`]: codes row-major `(m, k)`, and per
/// `(row, block)` the scale `sx` and `zsum = zmul · (sx · S)` (`S` the sum of the block's
/// codes; `zmul` the weight's offset when it is symmetric, else 1).
pub(super) struct QuantizedRows {
    pub(super) codes: Vec<i8>,
    pub(super) scale: Vec<f32>,
    pub(super) zsum: Vec<f32>,
}

#[inline(always)]
fn quantize_rows_body(x: &[f32], zmul: f32, codes: &mut [i8], scale: &mut [f32], zsum: &mut [f32]) {
    for (((xb, cb), s), ss) in x
        .chunks_exact(BLOCK)
        .zip(codes.chunks_exact_mut(BLOCK))
        .zip(scale.iter_mut())
        .zip(zsum.iter_mut())
    {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let finite = xb.iter().all(|v| v.is_finite());
        if amax == 0.0 || !finite {
            cb.fill(0);
            *s = if finite { 0.0 } else { f32::NAN };
            *ss = *s;
            continue;
        }
        let inv = 127.0 / amax;
        let mut sum = 0i32;
        for (c, v) in cb.iter_mut().zip(xb) {
            let q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i32;
            *c = q as i8;
            sum += q;
        }
        *s = amax / 127.0;
        *ss = zmul * (*s * sum as f32);
    }
}

/// `x (m, k)` quantized per [`BLOCK`] columns (`k % BLOCK == 0`), `zmul` as in
/// [`QuantizedRows`]; the AVX2 body gives the same bits.
pub(super) fn quantize_activations(x: &[f32], m: usize, k: usize, zmul: f32) -> QuantizedRows {
    let nb = k / BLOCK;
    let mut q = QuantizedRows {
        codes: vec![0; m * k],
        scale: vec![0.0; m * nb],
        zsum: vec![0.0; m * nb],
    };
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() >= crate::simd::SimdLevel::Avx2 {
        // SAFETY: AVX2 and FMA checked; the buffers were sized above for `x`'s m·k floats.
        unsafe { super::a8_avx2::quantize(x, zmul, &mut q.codes, &mut q.scale, &mut q.zsum) };
        return q;
    }
    quantize_rows_body(x, zmul, &mut q.codes, &mut q.scale, &mut q.zsum);
    q
}

/// The operands of one [`dequant_linear_a8`] call, shared by its tasks.
pub(super) struct A8Job<'a> {
    pub(super) q: &'a QuantizedRows,
    pub(super) w: &'a PackedWeight<'a>,
    pub(super) bias: Option<&'a [f32]>,
    pub(super) out: SharedOut<f32>,
    pub(super) m: usize,
}

/// The portable body: output columns `j0..j1` of every row, integer sums per block.
#[inline(always)]
fn rows_body(job: &A8Job<'_>, j0: usize, j1: usize) {
    let A8Job { q, w, bias, out, m } = *job;
    let (n, k, group) = (w.n, w.k, w.group);
    let (nb, groups) = (k / BLOCK, k.div_ceil(group)); // the last group may be shorter
    let per_tensor = w.scale.len() == groups && n != 1;
    for j in j0..j1 {
        let srow = if per_tensor { 0 } else { j * groups };
        let codes = &w.data[j * k / 2..(j + 1) * k / 2];
        for i in 0..m {
            let xq = &q.codes[i * k..(i + 1) * k];
            let mut acc = 0f32;
            for b in 0..nb {
                let g = b * BLOCK / group;
                let d: i32 = (0..BLOCK / 2)
                    .map(|t| {
                        let byte = codes[b * BLOCK / 2 + t];
                        let c = b * BLOCK + 2 * t;
                        i32::from(byte & 15) * i32::from(xq[c])
                            + i32::from(byte >> 4) * i32::from(xq[c + 1])
                    })
                    .sum();
                let (sx, zs) = (q.scale[i * nb + b], q.zsum[i * nb + b]);
                // zsum is z · sx · S for a symmetric weight, sx · S with zero points.
                let zterm = w.zero.map_or(zs, |z| z[srow + g] * zs);
                acc += w.scale[srow + g] * (d as f32 * sx - zterm);
            }
            // SAFETY: column j of row i belongs to this task alone.
            unsafe { *out.get().add(i * n + j) = acc + bias.map_or(0.0, |b| b[j]) };
        }
    }
}

multiversion!(rows => rows_body<>(job: &A8Job<'_>, j0: usize, j1: usize));

/// Weight rows a task of the portable body computes.
const ROWS_PER_TASK: usize = 32;
/// Tasks per thread of the team for the GEMV body (a decode step's few rows): whole panels
/// of contiguous weight rows, more than one per thread so a late thread's share is small.
#[cfg(target_arch = "x86_64")]
const GEMV_TASKS_PER_THREAD: usize = 4;

/// `out (m, n) = x' (m, k) · dequant(w)ᵀ + bias` for an INT4 `w`, `x'` the activations
/// quantized to INT8 per [`BLOCK`] columns (see the module documentation).
///
/// # Errors
/// The buffers of the wrong size, an FP6 weight, or `k` or the group size not a multiple
/// of [`BLOCK`].
pub fn dequant_linear_a8(
    x: &[f32],
    w: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
) -> Result<(), QuantError> {
    check_args(x, w, bias, out, m)?;
    let (n, k) = (w.n, w.k);
    if w.format == WeightFormat::Fp6 {
        return Err(QuantError::Param {
            name: "fmt",
            value: 6,
            expected: "an INT4 weight (activations quantized to INT8 serve INT4 only)",
        });
    }
    if !k.is_multiple_of(BLOCK) || k == 0 {
        return Err(QuantError::Param {
            name: "in_features",
            value: k as i64,
            expected: "a positive multiple of 32 (INT8 activation blocks of 32 columns)",
        });
    }
    if !w.group.is_multiple_of(BLOCK) || w.group > k {
        return Err(QuantError::Param {
            name: "group_size",
            value: w.group as i64,
            expected: "a multiple of 32 up to in_features (whole INT8 activation blocks)",
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let zmul = match (w.format, w.zero) {
        (WeightFormat::Int4 { offset }, None) => offset as f32,
        _ => 1.0,
    };
    let q = quantize_activations(x, m, k, zmul);
    let job = A8Job {
        q: &q,
        w,
        bias,
        out: SharedOut(out.as_mut_ptr()),
        m,
    };
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() >= crate::simd::SimdLevel::Avx2 && m <= super::a8_gemv_avx2::MAX_ROWS {
        use super::a8_gemv_avx2::{rows, split_codes, PANEL};
        let xs = split_codes(&q.codes, k);
        let per = n
            .div_ceil(GEMV_TASKS_PER_THREAD * crate::team::threads())
            .next_multiple_of(PANEL);
        for_blocks(n.div_ceil(per), |t| {
            let (j0, j1) = (t * per, ((t + 1) * per).min(n));
            // SAFETY: as below; `xs` holds the m·k codes split as `rows` reads them.
            unsafe { rows(&job, &xs, j0, j1) };
        });
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() >= crate::simd::SimdLevel::Avx2 {
        use super::a8_avx2::{task, ROWS_PER_TASK as PER};
        for_blocks(n.div_ceil(PER), |t| {
            let (j0, j1) = (t * PER, ((t + 1) * PER).min(n));
            // SAFETY: `active()` reports AVX2 or above only where the CPU has AVX2 and FMA;
            // the shapes were checked above, and the task writes columns j0..j1 alone.
            unsafe { task(&job, j0, j1) };
        });
        return Ok(());
    }
    for_blocks(n.div_ceil(ROWS_PER_TASK), |t| {
        let (j0, j1) = (t * ROWS_PER_TASK, ((t + 1) * ROWS_PER_TASK).min(n));
        rows(&job, j0, j1);
    });
    Ok(())
}
