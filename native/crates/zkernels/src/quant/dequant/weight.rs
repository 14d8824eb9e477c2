//! The packed weight (`PackedWeight`), its validation, and its decoding to float32:
//! one row at a time (shared with the fused linear) or the whole weight
//! ([`dequantize`]). Layouts are in the parent module's documentation.

use crate::quant::error::{check_len, QuantError};
use crate::quant::{for_blocks, SharedOut};
use crate::simd::multiversion;

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

/// float32's exponent bias less FP6's (127 - 3), in place in the exponent field.
pub(super) const FP6_REBIAS: u32 = 124 << 23;

impl<'a> PackedWeight<'a> {
    /// A symmetric INT4 weight (codes offset by 8, no zero points) of `(n, k)` in groups of
    /// `group` columns, its `scale` per group of each row (or of the whole tensor).
    pub fn int4(data: &'a [u8], scale: &'a [f32], n: usize, k: usize, group: usize) -> Self {
        Self {
            format: WeightFormat::Int4 { offset: 8 },
            data,
            data2: None,
            scale,
            zero: None,
            n,
            k,
            group,
        }
    }
}

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

/// The value of FP6 e3m2 `code` (bias 3), exactly, with no subnormal float32 in the
/// arithmetic (a multiply by a subnormal takes a microcode assist on x86, ~100 cycles):
/// the exponent and mantissa bits are placed in a float32 with the exponent rebiased by
/// [`FP6_REBIAS`], exact for a normal code; a subnormal code (exponent 0, value `m/16`)
/// gives `1/8 + m/32` that way, so `2f - 1/4` (exact) is its value; the sign is or-ed in.
#[inline(always)]
pub(super) fn fp6_value(code: u32) -> f32 {
    let exp_mant = (code & 0x1F) << 21;
    let f = f32::from_bits(exp_mant + FP6_REBIAS);
    let v = if exp_mant < 4 << 21 {
        2.0 * f - 0.25
    } else {
        f
    };
    f32::from_bits(v.to_bits() | ((code & 0x20) << 26))
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
pub(super) fn dequant_rows_body(w: &PackedWeight<'_>, j0: usize, out: &mut [f32]) {
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
