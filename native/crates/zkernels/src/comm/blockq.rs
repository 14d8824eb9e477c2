//! Blockwise symmetric INT8 / INT4 quantization for collectives (ZeRO++'s
//! qwZ / qgZ): `x` read flat, cut into blocks of `block` elements (the last
//! one possibly short), one f32 scale per block. This is
//! `zcomm.blockquant.quantize_blocks` / `dequantize_blocks`:
//!
//! ```text
//! qmax     = 2^(bits-1) - 1                       127 (INT8), 7 (INT4)
//! scale[b] = max|x[b]| / qmax, or 1 where that is 0 (an all-zero or all-tiny block)
//! code     = clamp(round_half_even(x / scale[b]), -qmax, qmax) + 2^(bits-1)
//! ```
//!
//! A block with a NaN or an infinity gets scale NaN and level-0 codes, so it
//! dequantizes to NaN (an overflow stays visible after the collective). INT8
//! codes take a byte each; INT4 codes two per byte, the first element in the
//! low nibble, and an odd total leaves the last high nibble 0. INT4 needs an
//! even `block` so every block starts on a byte. Dequantization is
//! `(code - 2^(bits-1)) * scale` in f32. Both directions are exact: the same
//! IEEE operations as the torch reference, at every SIMD level.
//!
//! `quant::quantize_tokenwise` computes the same INT8 levels per row, but it
//! skips NaN (`f32::max`), writes `i8` and has no short last block or INT4
//! packing, so the block body is its own; a test checks the two agree on
//! finite input.

use super::{check_len, map_parts, Shared, PART};
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Code width and block size, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockParams {
    bits: u32,
    block: usize,
}

impl BlockParams {
    /// `bits` 8 or 4; `block` ≥ 1, even for INT4.
    pub fn new(bits: u32, block: usize) -> Result<Self, QuantError> {
        if bits != 8 && bits != 4 {
            return Err(QuantError::Param {
                name: "bits",
                value: i64::from(bits),
                expected: "8 or 4",
            });
        }
        if block == 0 || (bits == 4 && block % 2 == 1) {
            return Err(QuantError::Param {
                name: "block",
                value: i64::try_from(block).unwrap_or(i64::MAX),
                expected: "a positive block size, even for INT4 (two codes per byte)",
            });
        }
        Ok(Self { bits, block })
    }

    pub fn bits(self) -> u32 {
        self.bits
    }

    pub fn block(self) -> usize {
        self.block
    }

    /// Blocks (and scales) for `n` elements.
    pub fn num_blocks(self, n: usize) -> usize {
        n.div_ceil(self.block)
    }

    /// Code bytes for `n` elements.
    pub fn code_bytes(self, n: usize) -> usize {
        if self.bits == 8 {
            n
        } else {
            n.div_ceil(2)
        }
    }

    fn qmax(self) -> f32 {
        ((1u32 << (self.bits - 1)) - 1) as f32
    }

    fn offset(self) -> f32 {
        (1u32 << (self.bits - 1)) as f32
    }

    /// Blocks per parallel part: about [`PART`] elements, at least one block.
    fn blocks_per_part(self) -> usize {
        (PART / self.block).max(1)
    }

    fn check(self, n: usize, codes: usize, scales: usize) -> Result<(), QuantError> {
        let desc = || format!("for n = {n}, bits = {}, block = {}", self.bits, self.block);
        check_len("codes", codes, self.code_bytes(n), desc)?;
        check_len("scales", scales, self.num_blocks(n), desc)
    }
}

/// Quantizes `x` into `codes` ([`BlockParams::code_bytes`]) and `scales`
/// ([`BlockParams::num_blocks`]).
pub fn quantize_blocks(
    x: &[f32],
    p: BlockParams,
    codes: &mut [u8],
    scales: &mut [f32],
) -> Result<(), QuantError> {
    let n = x.len();
    p.check(n, codes.len(), scales.len())?;
    let (bpp, nb) = (p.blocks_per_part(), p.num_blocks(n));
    let (dc, ds) = (Shared(codes.as_mut_ptr()), Shared(scales.as_mut_ptr()));
    map_parts(nb.div_ceil(bpp), |part| {
        let (b0, b1) = (part * bpp, nb.min(part * bpp + bpp));
        let (e0, e1) = (b0 * p.block, n.min(b1 * p.block));
        // SAFETY: this part owns blocks b0..b1: their codes and scales, inside the buffers
        // (INT4 blocks are even, so e0 / 2 is where block b0's bytes start).
        let (cs, ss) = unsafe {
            (
                dc.range(p.code_bytes(e0), p.code_bytes(e1) - p.code_bytes(e0)),
                ds.range(b0, b1 - b0),
            )
        };
        quantize_auto(&x[e0..e1], p, cs, ss);
    });
    Ok(())
}

/// Writes the `out.len()` values that `codes` and `scales` encode.
pub fn dequantize_blocks(
    codes: &[u8],
    scales: &[f32],
    p: BlockParams,
    out: &mut [f32],
) -> Result<(), QuantError> {
    let n = out.len();
    p.check(n, codes.len(), scales.len())?;
    let (bpp, nb) = (p.blocks_per_part(), p.num_blocks(n));
    let dst = Shared(out.as_mut_ptr());
    map_parts(nb.div_ceil(bpp), |part| {
        let (b0, b1) = (part * bpp, nb.min(part * bpp + bpp));
        let (e0, e1) = (b0 * p.block, n.min(b1 * p.block));
        // SAFETY: this part owns out[e0..e1].
        let os = unsafe { dst.range(e0, e1 - e0) };
        let cs = &codes[p.code_bytes(e0)..p.code_bytes(e1)];
        dequantize_auto(cs, &scales[b0..b1], p, os);
    });
    Ok(())
}

/// `(max |x|, every element finite)`; `v * 0` is ±0 for finite `v` and NaN otherwise.
#[inline(always)]
fn absmax_finite(x: &[f32]) -> (f32, bool) {
    let mut m = [0f32; 16];
    let mut bad = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for l in 0..16 {
            let a = c[l].abs();
            m[l] = if a > m[l] { a } else { m[l] };
            bad[l] += c[l] * 0.0;
        }
    }
    let mut absmax = m.iter().fold(0f32, |a, &b| if b > a { b } else { a });
    let mut flag = bad.iter().sum::<f32>();
    for &v in chunks.remainder() {
        absmax = if v.abs() > absmax { v.abs() } else { absmax };
        flag += v * 0.0;
    }
    (absmax, flag == 0.0)
}

#[inline(always)]
fn code(v: f32, scale: f32, qmax: f32, offset: f32) -> u8 {
    // max/min rather than clamp (no assert in the loop); the sum is in 0..=255 (finite block),
    // and an i32 conversion vectorizes where a saturating u8 one does not.
    let level = (v / scale).round_ties_even().max(-qmax).min(qmax);
    (level + offset) as i32 as u8
}

#[inline(always)]
fn quantize_body(x: &[f32], p: BlockParams, codes: &mut [u8], scales: &mut [f32]) {
    let (qmax, off) = (p.qmax(), p.offset());
    let cb = p.code_bytes(p.block);
    for ((xb, cs), s) in x.chunks(p.block).zip(codes.chunks_mut(cb)).zip(scales) {
        let (absmax, finite) = absmax_finite(xb);
        if !finite {
            *s = f32::NAN;
            let zero = off as u8;
            if p.bits == 8 {
                cs.fill(zero);
            } else {
                cs.fill(zero | (zero << 4));
                if xb.len() % 2 == 1 {
                    cs[cs.len() - 1] = zero;
                }
            }
            continue;
        }
        let q = absmax / qmax;
        let sc = if q > 0.0 { q } else { 1.0 };
        *s = sc;
        if p.bits == 8 {
            for (v, c) in xb.iter().zip(cs.iter_mut()) {
                *c = code(*v, sc, qmax, off);
            }
        } else {
            let mut pairs = xb.chunks_exact(2);
            for (pr, c) in (&mut pairs).zip(cs.iter_mut()) {
                *c = code(pr[0], sc, qmax, off) | (code(pr[1], sc, qmax, off) << 4);
            }
            if let [last] = pairs.remainder() {
                cs[cs.len() - 1] = code(*last, sc, qmax, off);
            }
        }
    }
}

multiversion!(quantize_auto => quantize_body<>(x: &[f32], p: BlockParams, codes: &mut [u8], scales: &mut [f32]));

#[inline(always)]
fn dequantize_body(codes: &[u8], scales: &[f32], p: BlockParams, out: &mut [f32]) {
    let off = p.offset();
    let cb = p.code_bytes(p.block);
    for ((os, cs), &sc) in out.chunks_mut(p.block).zip(codes.chunks(cb)).zip(scales) {
        if p.bits == 8 {
            for (o, &c) in os.iter_mut().zip(cs) {
                *o = (f32::from(c) - off) * sc;
            }
        } else {
            let mut pairs = os.chunks_exact_mut(2);
            for (pr, &c) in (&mut pairs).zip(cs) {
                pr[0] = (f32::from(c & 15) - off) * sc;
                pr[1] = (f32::from(c >> 4) - off) * sc;
            }
            if let [last] = pairs.into_remainder() {
                *last = (f32::from(cs[cs.len() - 1] & 15) - off) * sc;
            }
        }
    }
}

multiversion!(dequantize_auto => dequantize_body<>(codes: &[u8], scales: &[f32], p: BlockParams, out: &mut [f32]));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_tokenwise;
    use crate::simd::{detected, set_override, SimdLevel};

    /// The rule written out element by element.
    fn reference(x: &[f32], bits: u32, block: usize) -> (Vec<u8>, Vec<f32>) {
        let qmax = ((1 << (bits - 1)) - 1) as f32;
        let off = (1 << (bits - 1)) as f32;
        let mut levels = Vec::new();
        let mut scales = Vec::new();
        for b in x.chunks(block) {
            let finite = b.iter().all(|v| v.is_finite());
            let absmax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
            let sc = if !finite {
                f32::NAN
            } else if absmax / qmax > 0.0 {
                absmax / qmax
            } else {
                1.0
            };
            scales.push(sc);
            for v in b {
                let l = if finite {
                    (v / sc).round_ties_even().clamp(-qmax, qmax)
                } else {
                    0.0
                };
                levels.push((l + off) as u8);
            }
        }
        if bits == 4 {
            let packed = levels
                .chunks(2)
                .map(|c| c[0] | c.get(1).map_or(0, |h| h << 4))
                .collect();
            return (packed, scales);
        }
        (levels, scales)
    }

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
            })
            .collect()
    }

    #[test]
    fn matches_reference_and_round_trips_at_every_level() {
        for &(n, block) in &[
            (0, 4),
            (1, 2),
            (7, 4),
            (33, 16),
            (1000, 256),
            (PART + 300, 2048),
            (3 * PART + 1, 6),
        ] {
            let mut x = data(n, n as u64 + 1);
            if n > 40 {
                x[3] = f32::NAN; // block 0 (or 0-1) non-finite
                x[n - 1] = f32::INFINITY;
                for v in &mut x[block..(2 * block).min(n - 1)] {
                    *v = 0.0; // an all-zero block
                }
            }
            for bits in [8, 4] {
                let p = BlockParams::new(bits, block).unwrap();
                let (want_c, want_s) = reference(&x, bits, block);
                for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
                    if level > detected() {
                        continue;
                    }
                    set_override(Some(level)).unwrap();
                    let mut c = vec![0u8; p.code_bytes(n)];
                    let mut s = vec![0f32; p.num_blocks(n)];
                    quantize_blocks(&x, p, &mut c, &mut s).unwrap();
                    assert_eq!(c, want_c, "bits {bits} n {n} block {block} {level:?}");
                    let bits_of = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits_of(&s), bits_of(&want_s));
                    let mut y = vec![0f32; n];
                    dequantize_blocks(&c, &s, p, &mut y).unwrap();
                    for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                        let sc = s[i / block];
                        if sc.is_nan() {
                            assert!(b.is_nan());
                        } else {
                            assert!((a - b).abs() <= sc / 2.0 * 1.0001, "{a} {b} {sc}");
                        }
                    }
                }
                set_override(None).unwrap();
            }
        }
    }

    #[test]
    fn int8_agrees_with_tokenwise_rows_on_finite_input() {
        let (m, k) = (5, 96);
        let x = data(m * k, 3);
        let (mut q, mut s) = (vec![0i8; m * k], vec![0f32; m]);
        quantize_tokenwise(&x, m, k, 8, &mut q, &mut s).unwrap();
        let p = BlockParams::new(8, k).unwrap();
        let (mut c, mut bs) = (vec![0u8; m * k], vec![0f32; m]);
        quantize_blocks(&x, p, &mut c, &mut bs).unwrap();
        assert_eq!(s, bs);
        let levels: Vec<i8> = c.iter().map(|&v| (i16::from(v) - 128) as i8).collect();
        assert_eq!(levels, q);
    }

    #[test]
    fn bad_parameters_and_lengths_are_refused() {
        assert!(BlockParams::new(3, 8).is_err());
        assert!(BlockParams::new(8, 0).is_err());
        assert!(BlockParams::new(4, 7).is_err());
        let p = BlockParams::new(4, 8).unwrap();
        let mut c = vec![9u8; 4];
        let mut s = vec![0f32; 2];
        let err = quantize_blocks(&[1.0; 9], p, &mut c, &mut s).unwrap_err();
        assert!(err.to_string().contains("codes"), "{err}");
        assert_eq!(c, vec![9u8; 4]);
        let mut out = vec![0f32; 9];
        assert!(dequantize_blocks(&[0u8; 5], &[1.0], p, &mut out).is_err());
    }
}
