//! INT8 GEMM with int32 accumulation and token-wise INT8 activation quantization.
//!
//! `out (m, n) = a (m, k) · b (n, k)ᵀ`: both operands are K-contiguous (the
//! weight in `nn.Linear` layout needs no repacking), so each output is a dot
//! product. A 4×4 tile of outputs keeps 16 accumulators in registers while the
//! tile's 4 activation rows and 4 weight rows stream through once.
//!
//! With AVX-512 VNNI, `vpdpbusd` multiplies unsigned by signed bytes and adds
//! groups of four into int32 lanes (64 MACs per instruction). The activations
//! are made unsigned by adding 128 (`a ^ 0x80`), and `128 · Σ_k b[j, k]` is
//! subtracted once per output, so the result is exact. Without VNNI, at AVX2 or
//! above, [`super::int8_avx2`] runs (`vpmaddwd` on int16-widened operands, or for a
//! decode step's rows `vpmaddubsw` with the weight's sign moved to the activations); the
//! scalar level is a plain loop the compiler vectorizes.
//! Weight rows are split into blocks of [`NB`] that run on the thread pool.

use super::error::{check_len, QuantError};
use super::{for_blocks, SharedOut};
use crate::simd::multiversion;

const MR: usize = 4;
const NR: usize = 4;
/// Weight rows per parallel block (64 rows × k bytes stay in L2 while the activations stream past).
const NB: usize = 64;

/// Whether [`int8_gemm`] uses the AVX-512 VNNI tile at the active SIMD level.
pub fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::simd::active() == crate::simd::SimdLevel::Avx512
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Where the int32 dot products go.
pub(super) trait Epilogue: Sync {
    fn write(&self, i: usize, j: usize, acc: i32);
    /// Called once a block's outputs `(0..m, j0..j1)` are all written, on the thread that
    /// wrote them (a pass over the block while it is in cache).
    #[inline(always)]
    fn finish(&self, _m: usize, _j0: usize, _j1: usize) {}
}

struct I32Out {
    out: SharedOut<i32>,
    n: usize,
}

impl Epilogue for I32Out {
    #[inline(always)]
    fn write(&self, i: usize, j: usize, acc: i32) {
        // SAFETY: (i, j) is inside the (m, n) output and owned by this block.
        unsafe { *self.out.get().add(i * self.n + j) = acc }
    }
}

/// `acc · (a_scale[i] · w_scale[j]) + bias[j]` in float32, the order the torch path uses.
struct F32Out<'a> {
    out: SharedOut<f32>,
    n: usize,
    a_scale: &'a [f32],
    w_scale: &'a [f32],
    bias: Option<&'a [f32]>,
}

/// Column `j`'s weight scale (one per tensor or per output channel) and
/// `acc · (a_scale[i] · ws) + bias[j]`, the float32 order the torch path uses.
#[inline(always)]
pub(crate) fn scaled(
    acc: i32,
    a_scale: f32,
    w_scale: &[f32],
    bias: Option<&[f32]>,
    j: usize,
) -> (f32, f32) {
    let ws = if w_scale.len() == 1 {
        w_scale[0]
    } else {
        w_scale[j]
    };
    let mut y = acc as f32 * (a_scale * ws);
    if let Some(b) = bias {
        y += b[j];
    }
    (y, ws)
}

impl Epilogue for F32Out<'_> {
    #[inline(always)]
    fn write(&self, i: usize, j: usize, acc: i32) {
        let (y, _) = scaled(acc, self.a_scale[i], self.w_scale, self.bias, j);
        // SAFETY: (i, j) is inside the (m, n) output and owned by this block.
        unsafe { *self.out.get().add(i * self.n + j) = y }
    }
}

#[inline(always)]
fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    let mut lanes = [0i32; 32];
    let mut ca = a.chunks_exact(32);
    let mut cb = b.chunks_exact(32);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..32 {
            lanes[l] += i32::from(x[l]) * i32::from(y[l]);
        }
    }
    let tail: i32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum();
    lanes.iter().sum::<i32>() + tail
}

/// Rows `i0..i0+MR` clamped to the last row: edge tiles recompute it and drop the copy.
#[inline(always)]
fn clamped<const R: usize>(start: usize, end: usize) -> [usize; R] {
    std::array::from_fn(|r| (start + r).min(end - 1))
}

#[inline(always)]
fn block_body<E: Epilogue>(a: &[i8], b: &[i8], m: usize, k: usize, j0: usize, j1: usize, epi: &E) {
    for (i, ar) in a.chunks_exact(k).take(m).enumerate() {
        for j in j0..j1 {
            epi.write(i, j, dot_i8(ar, &b[j * k..(j + 1) * k]));
        }
    }
}

multiversion!(block_auto => block_body<E: Epilogue>(a: &[i8], b: &[i8], m: usize, k: usize, j0: usize, j1: usize, epi: &E));

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{clamped, Epilogue, MR, NR};
    use std::arch::x86_64::*;

    /// One R×NR tile of `Σ (a+128)·b - 128·Σ b` over the whole k. The correction
    /// `128·Σ_k b[j, k]` is summed in the same pass (`vpdpbusd` of 0x80 bytes with the
    /// weight vector already in registers), so the weight is read once per call.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
    unsafe fn tile<const R: usize>(
        a: *const u8,
        b: *const i8,
        k: usize,
        rows: [usize; R],
        cols: [usize; NR],
    ) -> [[i32; NR]; R] {
        let mut acc = [[_mm512_setzero_si512(); NR]; R];
        let mut comp = [_mm512_setzero_si512(); NR];
        let bias = _mm512_set1_epi8(-128);
        let full = k / 64;
        for t in 0..full {
            let off = t * 64;
            // Plain loops, not `array::from_fn`: a closure does not inherit the target
            // features, so its intrinsics would become calls with vectors in memory.
            let mut bv = [_mm512_setzero_si512(); NR];
            for c in 0..NR {
                bv[c] = _mm512_loadu_si512(b.add(cols[c] * k + off).cast());
                comp[c] = _mm512_dpbusd_epi32(comp[c], bias, bv[c]);
            }
            for r in 0..R {
                let av = _mm512_loadu_si512(a.add(rows[r] * k + off).cast());
                for c in 0..NR {
                    acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], av, bv[c]);
                }
            }
        }
        let rem = k - full * 64;
        if rem > 0 {
            let off = full * 64;
            let mask: __mmask64 = (1u64 << rem) - 1;
            let mut bv = [_mm512_setzero_si512(); NR];
            for c in 0..NR {
                bv[c] = _mm512_maskz_loadu_epi8(mask, b.add(cols[c] * k + off).cast());
                comp[c] = _mm512_dpbusd_epi32(comp[c], bias, bv[c]);
            }
            for r in 0..R {
                let av = _mm512_maskz_loadu_epi8(mask, a.add(rows[r] * k + off).cast());
                for c in 0..NR {
                    acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], av, bv[c]);
                }
            }
        }
        let mut out = [[0i32; NR]; R];
        for c in 0..NR {
            let comp = _mm512_reduce_add_epi32(comp[c]);
            for r in 0..R {
                out[r][c] = _mm512_reduce_add_epi32(acc[r][c]) - comp;
            }
        }
        out
    }

    /// Weight rows `j0..j1` against every activation row: MR rows per tile while
    /// MR remain, then one row per tile; fewer than MR rows in all (a decode step)
    /// go through [`super::super::int8_rows::rows`], which computes each dot product once.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
    pub(super) unsafe fn block<E: Epilogue>(
        a_u8: &[u8],
        b: &[i8],
        m: usize,
        k: usize,
        j0: usize,
        j1: usize,
        epi: &E,
    ) {
        use super::super::int8_rows::rows;
        let (a, bp) = (a_u8.as_ptr(), b.as_ptr());
        match m {
            1 => return rows::<1, E>(a, bp, k, j0, j1, epi),
            2 => return rows::<2, E>(a, bp, k, j0, j1, epi),
            3 => return rows::<3, E>(a, bp, k, j0, j1, epi),
            _ => {}
        }
        let whole = m / MR * MR;
        for jt in (j0..j1).step_by(NR) {
            let cols = clamped::<NR>(jt, j1);
            let ncols = NR.min(j1 - jt);
            for i0 in (0..whole).step_by(MR) {
                let rows = clamped::<MR>(i0, m);
                let acc = tile::<MR>(a_u8.as_ptr(), b.as_ptr(), k, rows, cols);
                for r in 0..MR {
                    for c in 0..ncols {
                        epi.write(rows[r], cols[c], acc[r][c]);
                    }
                }
            }
            for i in whole..m {
                let acc = tile::<1>(a_u8.as_ptr(), b.as_ptr(), k, [i], cols);
                for c in 0..ncols {
                    epi.write(i, cols[c], acc[0][c]);
                }
            }
        }
    }
}

pub(super) fn gemm<E: Epilogue>(a: &[i8], b: &[i8], m: usize, n: usize, k: usize, epi: &E) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        (0..m).for_each(|i| (0..n).for_each(|j| epi.write(i, j, 0)));
        return;
    }
    let blocks = n.div_ceil(NB);
    #[cfg(target_arch = "x86_64")]
    if vnni_available() {
        let a_u8: Vec<u8> = a.iter().map(|&v| (v as u8) ^ 0x80).collect();
        for_blocks(blocks, |blk| {
            let (j0, j1) = (blk * NB, ((blk + 1) * NB).min(n));
            // SAFETY: `vnni_available()` checked that the CPU has every enabled feature;
            // the tile reads stay inside a (m·k) and b (n·k) because rows/cols are clamped.
            unsafe { vnni::block(&a_u8, b, m, k, j0, j1, epi) }
            epi.finish(m, j0, j1);
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() >= crate::simd::SimdLevel::Avx2 {
        if m < super::int8_avx2::MR && !a.contains(&i8::MIN) {
            for_blocks(blocks, |blk| {
                let (j0, j1) = (blk * NB, ((blk + 1) * NB).min(n));
                // SAFETY: as below; a holds m·k codes, none -128 (checked).
                unsafe { super::int8_avx2::block_signed(a, b, m, k, j0, j1, epi) }
                epi.finish(m, j0, j1);
            });
            return;
        }
        let a16: Vec<i16> = a.iter().map(|&v| i16::from(v)).collect();
        for_blocks(blocks, |blk| {
            let (j0, j1) = (blk * NB, ((blk + 1) * NB).min(n));
            // SAFETY: `active()` reports AVX2 only when the CPU has AVX2 and FMA; a16 holds
            // m·k and b n·k elements.
            unsafe { super::int8_avx2::block(&a16, b, m, k, j0, j1, epi) }
            epi.finish(m, j0, j1);
        });
        return;
    }
    for_blocks(blocks, |blk| {
        let (j0, j1) = (blk * NB, ((blk + 1) * NB).min(n));
        block_auto(a, b, m, k, j0, j1, epi);
        epi.finish(m, j0, j1);
    });
}

fn check_gemm(a: usize, b: usize, m: usize, n: usize, k: usize) -> Result<(), QuantError> {
    check_len("a", a, m * k, || format!("m·k = {m}·{k}"))?;
    check_len("b", b, n * k, || format!("n·k = {n}·{k}"))
}

/// `out (m, n) = a (m, k) · b (n, k)ᵀ` with exact int32 accumulation.
pub fn int8_gemm(
    a: &[i8],
    b: &[i8],
    out: &mut [i32],
    m: usize,
    n: usize,
    k: usize,
) -> Result<(), QuantError> {
    check_gemm(a.len(), b.len(), m, n, k)?;
    check_len("out", out.len(), m * n, || format!("m·n = {m}·{n}"))?;
    let epi = I32Out {
        out: SharedOut(out.as_mut_ptr()),
        n,
    };
    gemm(a, b, m, n, k, &epi);
    Ok(())
}

#[inline(always)]
fn quantize_rows_body(x: &[f32], k: usize, qmax: f32, q: &mut [i8], scale: &mut [f32]) {
    for ((row, qrow), s) in x.chunks_exact(k).zip(q.chunks_exact_mut(k)).zip(scale) {
        let mut lanes = [0f32; 16];
        let mut chunks = row.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                lanes[l] = lanes[l].max(c[l].abs());
            }
        }
        let absmax = chunks
            .remainder()
            .iter()
            .fold(lanes.iter().fold(0f32, |a, &b| a.max(b)), |a, &b| {
                a.max(b.abs())
            });
        let sc = if absmax > 0.0 { absmax / qmax } else { 1.0 };
        *s = sc;
        for (v, o) in row.iter().zip(qrow.iter_mut()) {
            let r = (v / sc).round_ties_even().clamp(-qmax, qmax);
            // `r as i8` (a NaN code is 0), written so that it vectorizes: `as` from a float is a
            // saturating cast the compiler turned into one scalar conversion per element.
            let r = if r.is_nan() { 0.0 } else { r };
            // SAFETY: r is finite and within ±qmax ≤ 127 (clamped, NaN replaced).
            *o = unsafe { r.to_int_unchecked::<i32>() } as i8;
        }
    }
}

multiversion!(quantize_rows => quantize_rows_body<>(x: &[f32], k: usize, qmax: f32, q: &mut [i8], scale: &mut [f32]));

/// Symmetric per-row (token) quantization: `scale[i] = max|x[i]| / (2^(bits-1) - 1)` (1 for an
/// all-zero row), `q = clamp(round_half_even(x / scale))`, as `zquant.quantize_activation_tokenwise`.
pub fn quantize_tokenwise(
    x: &[f32],
    m: usize,
    k: usize,
    bits: u32,
    q: &mut [i8],
    scale: &mut [f32],
) -> Result<(), QuantError> {
    if !(2..=8).contains(&bits) {
        return Err(QuantError::Param {
            name: "bits",
            value: i64::from(bits),
            expected: "2..=8",
        });
    }
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    check_len("q", q.len(), m * k, || format!("m·k = {m}·{k}"))?;
    check_len("scale", scale.len(), m, || format!("m = {m}"))?;
    if k == 0 {
        scale.fill(1.0);
        return Ok(());
    }
    let qmax = ((1i32 << (bits - 1)) - 1) as f32;
    quantize_rows(x, k, qmax, q, scale);
    Ok(())
}

/// W8A8 linear: quantizes `x (m, k)` per token, multiplies by the INT8 weight `w (n, k)` in int32
/// and writes `out (m, n) = acc · a_scale · w_scale + bias` (w_scale per channel `(n,)` or `(1,)`).
#[allow(clippy::too_many_arguments)]
pub fn int8_linear(
    x: &[f32],
    w: &[i8],
    w_scale: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) -> Result<(), QuantError> {
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    check_len("w", w.len(), n * k, || format!("n·k = {n}·{k}"))?;
    if w_scale.len() != 1 {
        check_len("w_scale", w_scale.len(), n, || format!("n = {n} (or 1)"))?;
    }
    if let Some(b) = bias {
        check_len("bias", b.len(), n, || format!("n = {n}"))?;
    }
    check_len("out", out.len(), m * n, || format!("m·n = {m}·{n}"))?;
    let mut q = vec![0i8; m * k];
    let mut a_scale = vec![1f32; m];
    quantize_tokenwise(x, m, k, 8, &mut q, &mut a_scale)?;
    let epi = F32Out {
        out: SharedOut(out.as_mut_ptr()),
        n,
        a_scale: &a_scale,
        w_scale,
        bias,
    };
    gemm(&q, w, m, n, k, &epi);
    Ok(())
}

#[cfg(test)]
#[path = "int8_tests.rs"]
mod tests;
