//! Dequantize INT4 (two per byte) and FP6 e3m2 (4+2 bit planes) weights, and the
//! fused dequantize-and-multiply linear.
//!
//! Layouts (see `zquant.packing`): a weight `(n, k)` is stored row by row; the
//! INT4 plane holds element `2t` in the low nibble of byte `t`; the FP6 2-bit
//! plane holds element `4t+i` in bits `2i..2i+1` of byte `t`, and the 6-bit code
//! is `(two_bit << 4) | four_bit`. Scales are `(scale_rows, groups)` float32
//! with `scale_rows` 1 (per tensor) or `n`; group `g` covers columns
//! `g·group .. (g+1)·group`. INT4 levels are `code - offset` (symmetric, offset
//! `2^(bits-1)`) or `code - zero[row, g]` (asymmetric). FP6 (bias 3) decodes by
//! moving its bits into a float32 and multiplying by `2^124`.
//!
//! The fused linear dequantizes [`NB`] weight rows into a float32 tile that
//! stays in cache and multiplies every activation row by it, so the full
//! float32 weight never exists.

use super::error::{check_len, QuantError};
use super::{for_blocks, SharedOut};
use crate::simd::multiversion;

/// Weight rows dequantized at a time by [`dequant_linear`].
const NB: usize = 16;

/// How the codes of a [`PackedWeight`] are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// INT4 container, two codes per byte; `offset` is subtracted when there is no zero point.
    Int4 { offset: i32 },
    /// FP6 e3m2 as a 4-bit plane (`data`) and a 2-bit plane (`data2`).
    Fp6,
}

/// A packed `(n, k)` weight and its scales.
#[derive(Clone, Copy, Debug)]
pub struct PackedWeight<'a> {
    pub format: WeightFormat,
    pub data: &'a [u8],
    pub data2: Option<&'a [u8]>,
    pub scale: &'a [f32],
    pub zero: Option<&'a [f32]>,
    pub n: usize,
    pub k: usize,
    pub group: usize,
}

const FP6_RESCALE: f32 = 21267647932558653966460912964485513216.0; // 2^124

impl PackedWeight<'_> {
    fn groups(&self) -> usize {
        self.k.div_ceil(self.group)
    }

    fn scale_rows(&self) -> usize {
        if self.scale.len() == self.groups() && self.n != 1 {
            1
        } else {
            self.n
        }
    }

    /// Checks every buffer against `n`, `k` and `group`.
    pub fn validate(&self) -> Result<(), QuantError> {
        let (n, k) = (self.n, self.k);
        if self.group == 0 {
            return Err(QuantError::Param {
                name: "group_size",
                value: 0,
                expected: "a positive number of columns",
            });
        }
        let g = self.groups();
        if self.scale.len() != g {
            check_len("scale", self.scale.len(), n * g, || {
                format!("rows·groups = {n}·{g} (or 1·{g} per tensor)")
            })?;
        }
        if let Some(z) = self.zero {
            check_len("zero", z.len(), self.scale.len(), || {
                "scale's size".to_string()
            })?;
        }
        check_len("data", self.data.len(), n * k.div_ceil(2), || {
            format!("n·ceil(k/2) = {n}·{}", k.div_ceil(2))
        })?;
        match self.format {
            WeightFormat::Fp6 => {
                let got = self.data2.map_or(0, <[u8]>::len);
                check_len("data2", got, n * k.div_ceil(4), || {
                    format!("n·ceil(k/4) = {n}·{}", k.div_ceil(4))
                })
            }
            WeightFormat::Int4 { offset } if !(0..=15).contains(&offset) => {
                Err(QuantError::Param {
                    name: "offset",
                    value: i64::from(offset),
                    expected: "0..=15",
                })
            }
            WeightFormat::Int4 { .. } => Ok(()),
        }
    }
}

#[inline(always)]
fn fp6_value(code: u32) -> f32 {
    f32::from_bits(((code & 0x20) << 26) | ((code & 0x1F) << 21)) * FP6_RESCALE
}

/// Columns per pass of [`fp6_run`]: the codes of one pass live in a stack buffer.
const FP6_RUN: usize = 256;

/// FP6 codes of a 4-aligned run of columns to `value * s`, in passes that the compiler
/// vectorizes: unpack the two planes into byte codes, then decode the codes.
#[inline(always)]
fn fp6_run(p4: &[u8], p2: &[u8], s: f32, out: &mut [f32]) {
    let mut codes = [0u8; FP6_RUN];
    for (run, o) in out.chunks_mut(FP6_RUN).enumerate() {
        let len = o.len();
        let c = &mut codes[..len];
        let b4 = &p4[run * FP6_RUN / 2..][..len / 2];
        let b2 = &p2[run * FP6_RUN / 4..][..len / 4];
        for (pair, &byte) in c.chunks_exact_mut(2).zip(b4) {
            pair[0] = byte & 15;
            pair[1] = byte >> 4;
        }
        for (quad, &byte) in c.chunks_exact_mut(4).zip(b2) {
            quad[0] |= (byte & 3) << 4;
            quad[1] |= ((byte >> 2) & 3) << 4;
            quad[2] |= ((byte >> 4) & 3) << 4;
            quad[3] |= (byte >> 6) << 4;
        }
        for (v, &code) in o.iter_mut().zip(c.iter()) {
            *v = fp6_value(u32::from(code)) * s;
        }
    }
}

/// Dequantizes weight row `j` into `out` (`k` floats).
#[inline(always)]
fn dequant_row(w: &PackedWeight<'_>, j: usize, out: &mut [f32]) {
    let (k, group, groups) = (w.k, w.group, w.groups());
    let srow = if w.scale_rows() == 1 { 0 } else { j * groups };
    let p4 = &w.data[j * k.div_ceil(2)..(j + 1) * k.div_ceil(2)];
    match w.format {
        WeightFormat::Int4 { offset } => {
            for g in 0..groups {
                let s = w.scale[srow + g];
                let z = w.zero.map_or(offset as f32, |z| z[srow + g]);
                let (c0, c1) = (g * group, ((g + 1) * group).min(k));
                if c0 % 2 == 0 && c1 % 2 == 0 {
                    // Whole bytes: two codes each.
                    for (pair, &byte) in out[c0..c1].chunks_exact_mut(2).zip(&p4[c0 / 2..c1 / 2]) {
                        pair[0] = (f32::from(byte & 15) - z) * s;
                        pair[1] = (f32::from(byte >> 4) - z) * s;
                    }
                } else {
                    for (c, o) in out.iter_mut().enumerate().take(c1).skip(c0) {
                        let code = (p4[c / 2] >> ((c % 2) * 4)) & 15;
                        *o = (f32::from(code) - z) * s;
                    }
                }
            }
        }
        WeightFormat::Fp6 => {
            let k4 = k.div_ceil(4);
            let p2 = &w.data2.unwrap_or_default()[j * k4..(j + 1) * k4];
            for g in 0..groups {
                let s = w.scale[srow + g];
                let (c0, c1) = (g * group, ((g + 1) * group).min(k));
                if c0 % 4 == 0 && c1 % 4 == 0 {
                    fp6_run(
                        &p4[c0 / 2..c1.div_ceil(2)],
                        &p2[c0 / 4..c1.div_ceil(4)],
                        s,
                        &mut out[c0..c1],
                    );
                } else {
                    for (c, o) in out.iter_mut().enumerate().take(c1).skip(c0) {
                        let hi = u32::from(p2[c / 4] >> ((c % 4) * 2)) & 3;
                        let lo = u32::from(p4[c / 2] >> ((c % 2) * 4)) & 15;
                        *o = fp6_value((hi << 4) | lo) * s;
                    }
                }
            }
        }
    }
}

#[inline(always)]
fn dequant_rows_body(w: &PackedWeight<'_>, j0: usize, out: &mut [f32]) {
    for (r, row) in out.chunks_exact_mut(w.k).enumerate() {
        dequant_row(w, j0 + r, row);
    }
}

multiversion!(dequant_rows => dequant_rows_body<>(w: &PackedWeight<'_>, j0: usize, out: &mut [f32]));

/// Dequantizes the whole weight into `out (n, k)` float32.
pub fn dequantize(w: &PackedWeight<'_>, out: &mut [f32]) -> Result<(), QuantError> {
    w.validate()?;
    let (n, k) = (w.n, w.k);
    check_len("out", out.len(), n * k, || format!("n·k = {n}·{k}"))?;
    if n == 0 || k == 0 {
        return Ok(());
    }
    let rows_per_block = (1usize << 16).div_ceil(k).max(1);
    let blocks = n.div_ceil(rows_per_block);
    let ptr = SharedOut(out.as_mut_ptr());
    for_blocks(blocks, |b| {
        let (j0, j1) = (b * rows_per_block, ((b + 1) * rows_per_block).min(n));
        // SAFETY: rows j0..j1 of the (n, k) output belong to this block alone.
        let part = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(j0 * k), (j1 - j0) * k) };
        dequant_rows(w, j0, part);
    });
    Ok(())
}

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
struct LinearJob<'a> {
    x: &'a [f32],
    w: &'a PackedWeight<'a>,
    bias: Option<&'a [f32]>,
    out: SharedOut<f32>,
    m: usize,
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

/// `out (m, n) = x (m, k) · dequant(w)ᵀ + bias`, dequantizing [`NB`] weight rows at a time.
pub fn dequant_linear(
    x: &[f32],
    w: &PackedWeight<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    m: usize,
) -> Result<(), QuantError> {
    w.validate()?;
    let (n, k) = (w.n, w.k);
    check_len("x", x.len(), m * k, || format!("m·k = {m}·{k}"))?;
    if let Some(b) = bias {
        check_len("bias", b.len(), n, || format!("n = {n}"))?;
    }
    check_len("out", out.len(), m * n, || format!("m·n = {m}·{n}"))?;
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
        linear_block(&job, j0, j1, &mut tile);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition of e3m2 with bias 3, computed without bit tricks.
    fn fp6_definition(code: u32) -> f32 {
        let sign = if code & 0x20 != 0 { -1.0 } else { 1.0 };
        let (e, mant) = ((code >> 2) & 7, (code & 3) as f32);
        let mag = if e == 0 {
            mant / 4.0 * 0.25
        } else {
            (1.0 + mant / 4.0) * 2f32.powi(e as i32 - 3)
        };
        sign * mag
    }

    #[test]
    fn fp6_bit_decode_matches_definition_for_all_codes() {
        for code in 0..64 {
            let (got, want) = (fp6_value(code), fp6_definition(code));
            assert_eq!(got.to_bits(), want.to_bits(), "code {code}");
        }
    }

    fn pack(codes: &[u32], bits: u32) -> Vec<u8> {
        let per = (8 / bits) as usize;
        codes
            .chunks(per)
            .map(|c| {
                c.iter()
                    .enumerate()
                    .fold(0u8, |b, (i, &v)| b | ((v as u8) << (i as u32 * bits)))
            })
            .collect()
    }

    fn scalar_ref(
        codes: &[u32],
        scale: &[f32],
        n: usize,
        k: usize,
        group: usize,
        fp6: bool,
    ) -> Vec<f32> {
        let groups = k.div_ceil(group);
        let mut out = vec![0.0; n * k];
        for j in 0..n {
            for c in 0..k {
                let s = scale[if scale.len() == groups { 0 } else { j * groups } + c / group];
                let code = codes[j * k + c];
                out[j * k + c] = if fp6 {
                    fp6_definition(code) * s
                } else {
                    (code as f32 - 8.0) * s
                };
            }
        }
        out
    }

    #[test]
    fn int4_and_fp6_dequantize_and_linear_match_reference() {
        let mut seed = 3u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for &(n, k, group, m) in &[
            (5usize, 7usize, 7usize, 3usize),
            (33, 576, 128, 4),
            (17, 100, 32, 1),
            (4, 64, 3, 2),
        ] {
            let groups = k.div_ceil(group);
            let scale: Vec<f32> = (0..n * groups).map(|i| 0.01 + i as f32 * 1e-3).collect();
            let x: Vec<f32> = (0..m * k)
                .map(|_| next() as f32 / 2f32.powi(31) - 0.5)
                .collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.5).collect();
            for fp6 in [false, true] {
                let codes: Vec<u32> = (0..n * k)
                    .map(|_| next() % if fp6 { 64 } else { 16 })
                    .collect();
                let (mut p4, mut p2) = (Vec::new(), Vec::new());
                for row in codes.chunks(k) {
                    p4.extend(pack(&row.iter().map(|c| c & 15).collect::<Vec<_>>(), 4));
                    p2.extend(pack(&row.iter().map(|c| c >> 4).collect::<Vec<_>>(), 2));
                }
                let w = PackedWeight {
                    format: if fp6 {
                        WeightFormat::Fp6
                    } else {
                        WeightFormat::Int4 { offset: 8 }
                    },
                    data: &p4,
                    data2: fp6.then_some(&p2[..]),
                    scale: &scale,
                    zero: None,
                    n,
                    k,
                    group,
                };
                let want = scalar_ref(&codes, &scale, n, k, group, fp6);
                let mut got = vec![0.0; n * k];
                dequantize(&w, &mut got).unwrap();
                assert_eq!(got, want, "dequantize fp6={fp6} {n}x{k} g{group}");
                let mut y = vec![0.0; m * n];
                dequant_linear(&x, &w, Some(&bias), &mut y, m).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let exact: f64 = (0..k)
                            .map(|c| f64::from(x[i * k + c]) * f64::from(want[j * k + c]))
                            .sum();
                        let mag: f64 = (0..k)
                            .map(|c| f64::from((x[i * k + c] * want[j * k + c]).abs()))
                            .sum();
                        let err = (f64::from(y[i * n + j]) - exact - f64::from(bias[j])).abs();
                        assert!(
                            err <= 1e-5 * (mag + 1.0),
                            "linear fp6={fp6} ({i},{j}) err {err}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_buffers_are_rejected() {
        let scale = [1.0f32; 2];
        let data = [0u8; 4];
        let w = PackedWeight {
            format: WeightFormat::Fp6,
            data: &data,
            data2: None,
            scale: &scale,
            zero: None,
            n: 2,
            k: 4,
            group: 4,
        };
        assert!(matches!(
            w.validate(),
            Err(QuantError::Shape { what: "data2", .. })
        ));
        let w = PackedWeight { group: 0, ..w };
        assert!(matches!(w.validate(), Err(QuantError::Param { .. })));
    }

    /// k = 0: the product is empty, so every output row is the bias (it used to panic
    /// in `chunks_exact_mut(0)`).
    #[test]
    fn linear_with_no_input_features_gives_the_bias() {
        let (data, scale) = (Vec::<u8>::new(), Vec::<f32>::new());
        let w = PackedWeight {
            format: WeightFormat::Int4 { offset: 8 },
            data: &data,
            data2: None,
            scale: &scale,
            zero: None,
            n: 3,
            k: 0,
            group: 4,
        };
        let bias = [1.0f32, -2.0, 0.5];
        let mut out = vec![9.0f32; 2 * 3];
        dequant_linear(&[], &w, Some(&bias), &mut out, 2).unwrap();
        assert_eq!(out, [1.0, -2.0, 0.5, 1.0, -2.0, 0.5]);
        dequant_linear(&[], &w, None, &mut out, 2).unwrap();
        assert_eq!(out, [0.0; 6]);
    }
}
