//! [`super::norm`]'s row body on AVX2: the sum of squares in torch's order with one 8-lane
//! register per accumulator of torch's cascade (its `Vectorized<float>` lanes are 8, so
//! the adds are the portable body's, lane for lane: the result is bit-identical to it and
//! to `zserve.model.llama.rms_norm`), then `x · r` rounded to the element type and
//! multiplied by the weight 8 elements at a time (bfloat16 widened and rounded in
//! registers). Squares are a multiply then an add, never a fused FMA, as torch's are.

use super::norm::{ceil_log2, sum_sq_torch_order, ILP, LANES, LEVELS};
use crate::avx2::{load8, round_bf16, store8};
use crate::bf16::Elem;
use std::arch::x86_64::*;

/// `v` rounded to `E` and widened back to f32 (bfloat16 rounds to nearest even).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn round_to<E: Elem>(v: __m256) -> __m256 {
    if E::BF16 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(round_bf16(v)))
    } else {
        v
    }
}

/// The squares of the 8 elements at `p`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn sq8<E: Elem>(p: *const E) -> __m256 {
    let v = load8(p);
    _mm256_mul_ps(v, v)
}

/// torch's `multi_row_sum` (see [`super::norm`]'s portable one) over `size` steps of
/// [`ILP`] vectors at `x`: level 0 in registers, carried up the cascade every
/// `2^level_power` steps.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn multi_row_sum<E: Elem>(x: *const E, size: usize) -> [__m256; ILP] {
    let level_power = (ceil_log2(size) / LEVELS).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let zero = _mm256_setzero_ps();
    let mut a0 = [zero; ILP];
    let mut up = [[zero; ILP]; LEVELS - 1];
    let step = |a0: &mut [__m256; ILP], i: usize| {
        for (k, a) in a0.iter_mut().enumerate() {
            // SAFETY: step i's ILP vectors lie inside the row; the caller has AVX2.
            *a = unsafe { _mm256_add_ps(*a, sq8(x.add((i * ILP + k) * LANES))) };
        }
    };
    let mut i = 0;
    while i + level_step <= size {
        for _ in 0..level_step {
            step(&mut a0, i);
            i += 1;
        }
        for j in 1..LEVELS {
            let below = if j == 1 { &mut a0 } else { &mut up[j - 2] };
            let moved = std::mem::replace(below, [zero; ILP]);
            for (u, m) in up[j - 1].iter_mut().zip(moved) {
                *u = _mm256_add_ps(*u, m);
            }
            if i & (level_mask << (j * level_power)) != 0 {
                break;
            }
        }
    }
    while i < size {
        step(&mut a0, i);
        i += 1;
    }
    for level in up {
        for (a, l) in a0.iter_mut().zip(level) {
            *a = _mm256_add_ps(*a, l);
        }
    }
    a0
}

/// `x.float().pow(2).sum()` of one row in torch's order (as `sum_sq_torch_order`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_sq<E: Elem>(x: &[E]) -> f32 {
    if x.len() < LANES {
        return sum_sq_torch_order(x);
    }
    let vecs = x.len() / LANES;
    let size = vecs / ILP;
    let mut p = multi_row_sum(x.as_ptr(), size);
    for i in size * ILP..vecs {
        p[0] = _mm256_add_ps(p[0], sq8(x.as_ptr().add(i * LANES)));
    }
    let mut sum = p[0];
    for &v in &p[1..] {
        sum = _mm256_add_ps(sum, v);
    }
    let mut lanes = [0f32; LANES];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    let mut acc = 0f32;
    for &v in &x[vecs * LANES..] {
        let f = v.to_f32();
        acc += f * f;
    }
    for lane in lanes {
        acc += lane;
    }
    acc
}

/// RMSNorm of one row: `out = w · E(x · rsqrt(mean(x²) + eps))`, rounded to `E`.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x`, `w` and `out` have the same length.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn norm<E: Elem>(x: &[E], w: &[E], eps: f32, out: &mut [E]) {
    let h = x.len();
    let ss = sum_sq(x);
    let r = 1.0 / (ss / h as f32 + eps).sqrt();
    let rv = _mm256_set1_ps(r);
    let eights = h / LANES * LANES;
    let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), out.as_mut_ptr());
    for c in (0..eights).step_by(LANES) {
        let y = round_to::<E>(_mm256_mul_ps(load8(xp.add(c)), rv));
        store8(op.add(c), _mm256_mul_ps(load8(wp.add(c)), y));
    }
    for c in eights..h {
        let y = E::from_f32(x[c].to_f32() * r).to_f32();
        out[c] = E::from_f32(w[c].to_f32() * y);
    }
}

#[cfg(test)]
mod tests {
    use crate::bf16::{f32_to_bf16, Elem};
    use crate::serve::rms_norm;
    use crate::simd::{detected, set_override, SimdLevel};

    /// Rows of `h` at every level the CPU has, bit for bit against the scalar body.
    fn same_bits_at_every_level<E: Elem + PartialEq + std::fmt::Debug>(
        h: usize,
        conv: impl Fn(f32) -> E,
    ) {
        let rows = 3;
        let x: Vec<E> = (0..rows * h)
            .map(|i| conv(((i * 37 % 23) as f32 - 11.0) / 7.0 * (1.0 + (i % 5) as f32 * 1e3)))
            .collect();
        let w: Vec<E> = (0..h).map(|i| conv(0.5 + i as f32 / 40.0)).collect();
        set_override(Some(SimdLevel::Scalar)).unwrap();
        let mut want = vec![conv(0.0); x.len()];
        rms_norm(&x, &w, 1e-5, &mut want).unwrap();
        for level in [SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > detected() {
                continue;
            }
            set_override(Some(level)).unwrap();
            let mut got = vec![conv(0.0); x.len()];
            rms_norm(&x, &w, 1e-5, &mut got).unwrap();
            assert_eq!(got, want, "{} h {h} at {level:?}", E::NAME);
        }
        set_override(None).unwrap();
    }

    #[test]
    fn every_level_is_bit_identical_to_the_scalar_body() {
        // Rows below one vector, tails of every length, whole ILP steps, and rows long
        // enough for torch's cascade to carry (4 levels of 16 steps: > 64 · 32 elements).
        for h in [
            1usize, 5, 8, 12, 31, 32, 33, 100, 576, 1000, 2048, 4099, 8192, 70_001,
        ] {
            same_bits_at_every_level::<f32>(h, |v| v);
            same_bits_at_every_level::<u16>(h, f32_to_bf16);
        }
    }
}
