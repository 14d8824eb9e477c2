//! 1-bit compression: signs packed 8 to a byte, plus the sum of squares that
//! gives the scale `||x|| / sqrt(n)`, in one pass over `x`.
//!
//! Element `8i + j` is bit `7 - j` of byte `i` (most significant first); the
//! bit is 1 where the element is *not negative* (`v >= 0` or NaN), so `+0`, `-0`
//! and NaN are 1; the unused low bits of a last partial byte are 0. This is
//! `zcomm.signs.pack_signs` (DeepSpeed's `x.sign().add_(1).bool()` packed by
//! `numpy.packbits`).
//!
//! The packing is exact at every SIMD level. The sum of squares is accumulated
//! in f32 lanes over runs of [`SUB`] elements and in f64 across runs and
//! parts, so it agrees with an f64 sum to about 1e-6 relative; its last bits
//! depend on the SIMD level (lane count), never on the thread count.

use super::{check_len, map_parts, Shared, PART};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::{active, multiversion, SimdLevel};

/// Elements summed in f32 lanes before the run's total is added in f64.
const SUB: usize = 1024;

/// Bytes that hold `n` signs.
pub fn packed_len(n: usize) -> usize {
    n.div_ceil(8)
}

/// Packs the signs of `x` into `out` (`ceil(n / 8)` bytes) and returns the sum
/// of the squares of `x`, as `f64`. `x` is `f32` or bfloat16 bits (`u16`).
pub fn pack_signs<E: Elem>(x: &[E], out: &mut [u8]) -> Result<f64, QuantError> {
    let n = x.len();
    check_len("out", out.len(), packed_len(n), || {
        format!("ceil(n / 8) for n = {n}")
    })?;
    let parts = n.div_ceil(PART);
    let dst = Shared(out.as_mut_ptr());
    let sums = map_parts(parts, |p| {
        let start = p * PART;
        let xs = &x[start..n.min(start + PART)];
        // SAFETY: part p owns bytes start/8 .. start/8 + ceil(len/8), inside `out`.
        let os = unsafe { dst.range(start / 8, packed_len(xs.len())) };
        pack_part(xs, os)
    });
    Ok(sums.iter().sum())
}

fn pack_part<E: Elem>(x: &[E], out: &mut [u8]) -> f64 {
    let mut total = 0f64;
    for (xs, os) in x.chunks(SUB).zip(out.chunks_mut(SUB / 8)) {
        let mut s = 0f32;
        pack_run(xs, os, &mut s);
        total += f64::from(s);
    }
    total
}

/// One run: SIMD for f32 at AVX2 / AVX-512, the generic body otherwise.
#[inline]
fn pack_run<E: Elem>(x: &[E], out: &mut [u8], sumsq: &mut f32) {
    #[cfg(target_arch = "x86_64")]
    if !E::BF16 {
        // SAFETY: E is f32 (E::BF16 is false), so the slice is one of f32.
        let xf = unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) };
        match active() {
            // SAFETY: `active()` never returns a level the CPU lacks.
            SimdLevel::Avx512 => return unsafe { x86::pack_avx512(xf, out, sumsq) },
            SimdLevel::Avx2 => return unsafe { x86::pack_avx2(xf, out, sumsq) },
            SimdLevel::Scalar => {}
        }
    }
    pack_auto(x, out, sumsq);
}

/// Scalar packing (compiled per SIMD level for bf16 by [`multiversion`]).
#[inline(always)]
fn pack_body<E: Elem>(x: &[E], out: &mut [u8], sumsq: &mut f32) {
    let mut lanes = [0f32; 8];
    for (c, o) in x.chunks(8).zip(out.iter_mut()) {
        let mut byte = 0u8;
        for (j, &e) in c.iter().enumerate() {
            let v = e.to_f32();
            lanes[j] += v * v;
            byte |= u8::from(v >= 0.0 || v.is_nan()) << (7 - j);
        }
        *o = byte;
    }
    *sumsq += lanes.iter().sum::<f32>();
}

multiversion!(pack_auto => pack_body<E: Elem>(x: &[E], out: &mut [u8], sumsq: &mut f32));

/// Writes `scale` where the bit is 1 and `-scale` where it is 0 for the first
/// `out.len()` signs in `packed` (which must hold exactly `ceil(n / 8)` bytes).
pub fn unpack_signs(packed: &[u8], scale: f32, out: &mut [f32]) -> Result<(), QuantError> {
    let n = out.len();
    check_len("packed", packed.len(), packed_len(n), || {
        format!("ceil(n / 8) for n = {n}")
    })?;
    let dst = Shared(out.as_mut_ptr());
    map_parts(n.div_ceil(PART), |p| {
        let start = p * PART;
        let len = PART.min(n - start);
        // SAFETY: part p owns out[start .. start + len].
        let os = unsafe { dst.range(start, len) };
        unpack_auto(&packed[start / 8..(start + len).div_ceil(8)], scale, os);
    });
    Ok(())
}

#[inline(always)]
fn unpack_body(packed: &[u8], scale: f32, out: &mut [f32]) {
    let full = out.len() / 8;
    let mut chunks = out.chunks_exact_mut(8);
    for (o, &b) in (&mut chunks).zip(packed) {
        for (j, v) in o.iter_mut().enumerate() {
            *v = if (b >> (7 - j)) & 1 != 0 {
                scale
            } else {
                -scale
            };
        }
    }
    for (j, v) in chunks.into_remainder().iter_mut().enumerate() {
        *v = if (packed[full] >> (7 - j)) & 1 != 0 {
            scale
        } else {
            -scale
        };
    }
}

multiversion!(unpack_auto => unpack_body<>(packed: &[u8], scale: f32, out: &mut [f32]));

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 8 floats per step: compare "not less than 0" (true for NaN) on the
    /// lanes in reverse order, so `movemask` puts element 0 in bit 7.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn pack_avx2(x: &[f32], out: &mut [u8], sumsq: &mut f32) {
        let full = x.len() / 8;
        let rev = _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0);
        let zero = _mm256_setzero_ps();
        let mut acc = _mm256_setzero_ps();
        for i in 0..full {
            // SAFETY: 8 * i + 8 <= x.len() and i < out.len() (out holds ceil(len / 8)).
            unsafe {
                let v = _mm256_loadu_ps(x.as_ptr().add(8 * i));
                acc = _mm256_fmadd_ps(v, v, acc);
                let r = _mm256_permutevar8x32_ps(v, rev);
                let m = _mm256_cmp_ps::<_CMP_NLT_UQ>(r, zero);
                *out.get_unchecked_mut(i) = _mm256_movemask_ps(m) as u8;
            }
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        *sumsq += lanes.iter().sum::<f32>();
        super::pack_body(&x[full * 8..], &mut out[full..], sumsq);
    }

    /// 16 floats per step: the lanes reversed within each half, so the 16-bit
    /// compare mask stored little-endian is two MSB-first bytes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    pub unsafe fn pack_avx512(x: &[f32], out: &mut [u8], sumsq: &mut f32) {
        let full = x.len() / 16;
        let rev = _mm512_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8);
        let zero = _mm512_setzero_ps();
        let mut acc = _mm512_setzero_ps();
        for i in 0..full {
            // SAFETY: 16 * i + 16 <= x.len() and 2 * i + 2 <= out.len().
            unsafe {
                let v = _mm512_loadu_ps(x.as_ptr().add(16 * i));
                acc = _mm512_fmadd_ps(v, v, acc);
                let r = _mm512_permutexvar_ps(rev, v);
                let k: u16 = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(r, zero);
                out.as_mut_ptr()
                    .add(2 * i)
                    .cast::<[u8; 2]>()
                    .write_unaligned(k.to_le_bytes());
            }
        }
        *sumsq += _mm512_reduce_add_ps(acc);
        super::pack_body(&x[full * 16..], &mut out[full * 2..], sumsq);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::f32_to_bf16;
    use crate::simd::{detected, set_override};

    fn reference(x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; packed_len(x.len())];
        for (i, v) in x.iter().enumerate() {
            if *v >= 0.0 || v.is_nan() {
                out[i / 8] |= 0x80 >> (i % 8);
            }
        }
        out
    }

    fn data(n: usize) -> Vec<f32> {
        let mut seed = 11u64;
        (0..n)
            .map(|i| match i % 97 {
                0 => -0.0,
                1 => f32::NAN,
                2 => 0.0,
                3 => f32::NEG_INFINITY,
                _ => {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
                }
            })
            .collect()
    }

    #[test]
    fn pack_matches_reference_at_every_level_and_size() {
        for &n in &[0, 1, 7, 8, 9, 15, 16, 17, 1023, 1024, 1025, 3 * PART + 77] {
            let x = data(n);
            let want = reference(&x);
            let finite: Vec<f32> = x
                .iter()
                .map(|v| if v.is_finite() { *v } else { 0.0 })
                .collect();
            let want_sq: f64 = finite.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
                if level > detected() {
                    continue;
                }
                set_override(Some(level)).unwrap();
                let mut out = vec![0xAAu8; packed_len(n)];
                pack_signs(&x, &mut out).unwrap();
                assert_eq!(out, want, "level {level:?} n {n}");
                let mut out = vec![0u8; packed_len(n)];
                let sq = pack_signs(&finite, &mut out).unwrap();
                assert!(
                    (sq - want_sq).abs() <= 1e-6 * want_sq.max(1e-30),
                    "{sq} vs {want_sq}"
                );
                let bf: Vec<u16> = x.iter().map(|&v| f32_to_bf16(v)).collect();
                let mut out = vec![0u8; packed_len(n)];
                pack_signs(&bf, &mut out).unwrap();
                assert_eq!(out, want, "bf16 level {level:?} n {n}");
            }
            set_override(None).unwrap();
        }
    }

    #[test]
    fn unpack_inverts_pack_with_scale() {
        for &n in &[0, 1, 9, 16, 1000, 2 * PART + 5] {
            let x = data(n);
            let packed = reference(&x);
            for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
                if level > detected() {
                    continue;
                }
                set_override(Some(level)).unwrap();
                let mut out = vec![0f32; n];
                unpack_signs(&packed, 0.25, &mut out).unwrap();
                for (v, o) in x.iter().zip(&out) {
                    let want = if *v < 0.0 { -0.25 } else { 0.25 };
                    assert_eq!(o.to_bits(), f32::to_bits(want), "level {level:?} n {n}");
                }
            }
            set_override(None).unwrap();
        }
    }

    #[test]
    fn wrong_lengths_are_refused_without_writing() {
        let x = [1.0f32; 9];
        let mut out = [7u8; 1];
        assert!(matches!(
            pack_signs(&x, &mut out),
            Err(QuantError::Shape { .. })
        ));
        assert_eq!(out, [7]);
        let mut vals = [3f32; 17];
        assert!(unpack_signs(&[0u8; 2], 1.0, &mut vals).is_err());
        assert_eq!(vals, [3f32; 17]);
    }
}
