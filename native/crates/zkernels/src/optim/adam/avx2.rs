//! Adam over 16 elements (two vectors) per iteration, for CPUs with AVX2 and FMA
//! but not AVX-512.
//!
//! The math is [`super::adam_body`]'s, one unfused operation at a time, so the
//! results are its bits. bf16 loads widen with one instruction per vector; bf16
//! stores round to nearest even in integer lanes as [`crate::bf16::f32_to_bf16`]
//! does and pack 16 values with one saturating pack and one lane permute. (The
//! compiler's own vectorization of the bf16 store spends several shuffles per
//! vector; with it a bf16-state step gained 1.26-1.27x over the fp32 one where
//! this kernel gains 1.3x and more.)

use super::Scalars;
use crate::avx2::{load8, pack_bf16};
use crate::Elem;
use std::arch::x86_64::*;

/// 16 elements at `ptr` as two f32 vectors.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn load<T: Elem>(ptr: *const T) -> (__m256, __m256) {
    (load8(ptr), load8(ptr.add(8)))
}

struct Consts {
    beta1: __m256,
    one_minus_beta1: __m256,
    beta2: __m256,
    one_minus_beta2: __m256,
    eps: __m256,
    step_size: __m256,
    inv_sqrt_bc2: __m256,
    grad_wd: __m256,
    param_scale: __m256,
    grad_sign: __m256,
}

impl Consts {
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn new(k: &Scalars) -> Consts {
        Consts {
            beta1: _mm256_set1_ps(k.beta1),
            one_minus_beta1: _mm256_set1_ps(k.one_minus_beta1),
            beta2: _mm256_set1_ps(k.beta2),
            one_minus_beta2: _mm256_set1_ps(k.one_minus_beta2),
            eps: _mm256_set1_ps(k.eps),
            step_size: _mm256_set1_ps(k.step_size),
            inv_sqrt_bc2: _mm256_set1_ps(k.inv_sqrt_bc2),
            grad_wd: _mm256_set1_ps(k.grad_wd),
            param_scale: _mm256_set1_ps(k.param_scale),
            grad_sign: _mm256_set1_ps(k.grad_sign),
        }
    }
}

/// One vector of the update; returns (p, m, v). `PLAIN` as in the AVX-512 kernel.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn update<const PLAIN: bool>(
    p: __m256,
    g: __m256,
    m: __m256,
    v: __m256,
    c: &Consts,
) -> (__m256, __m256, __m256) {
    // Unfused, rounding each step as `adam_body` does (see the AVX-512 kernel).
    let (grad, p) = if PLAIN {
        (g, p)
    } else {
        (
            _mm256_add_ps(_mm256_mul_ps(c.grad_sign, g), _mm256_mul_ps(c.grad_wd, p)),
            _mm256_mul_ps(p, c.param_scale),
        )
    };
    let m = _mm256_add_ps(
        _mm256_mul_ps(c.beta1, m),
        _mm256_mul_ps(c.one_minus_beta1, grad),
    );
    let v = _mm256_add_ps(
        _mm256_mul_ps(c.beta2, v),
        _mm256_mul_ps(_mm256_mul_ps(c.one_minus_beta2, grad), grad),
    );
    let denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), c.inv_sqrt_bc2), c.eps);
    let p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(c.step_size, m), denom));
    (p, m, v)
}

/// # Safety
/// The CPU must support AVX2 and FMA; all slices as long as `p`.
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<G: Elem, S: Elem, const PLAIN: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    k: &Scalars,
) -> usize {
    let n = p.len();
    assert!(g.len() == n && m.len() == n && v.len() == n);
    let c = Consts::new(k);
    let (pp, gp) = (p.as_mut_ptr(), g.as_ptr());
    let (mp, vp) = (m.as_mut_ptr(), v.as_mut_ptr());
    let end = n - n % 16;
    let mut i = 0;
    while i < end {
        let (p0, p1) = load(pp.add(i));
        let (g0, g1) = load(gp.add(i));
        let (m0, m1) = load(mp.add(i));
        let (v0, v1) = load(vp.add(i));
        let (p0, m0, v0) = update::<PLAIN>(p0, g0, m0, v0, &c);
        let (p1, m1, v1) = update::<PLAIN>(p1, g1, m1, v1, &c);
        _mm256_storeu_ps(pp.add(i), p0);
        _mm256_storeu_ps(pp.add(i + 8), p1);
        if S::BF16 {
            _mm256_storeu_si256(mp.add(i) as *mut __m256i, pack_bf16(m0, m1));
            _mm256_storeu_si256(vp.add(i) as *mut __m256i, pack_bf16(v0, v1));
        } else {
            let (mp, vp) = (mp as *mut f32, vp as *mut f32);
            _mm256_storeu_ps(mp.add(i), m0);
            _mm256_storeu_ps(mp.add(i + 8), m1);
            _mm256_storeu_ps(vp.add(i), v0);
            _mm256_storeu_ps(vp.add(i + 8), v1);
        }
        i += 16;
    }
    end
}

/// Runs the AVX2 kernel over the longest whole-block prefix and returns its length;
/// the caller finishes the rest.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[inline]
pub(super) unsafe fn adam<G: Elem, S: Elem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    k: &Scalars,
) -> usize {
    if k.plain() {
        kernel::<G, S, true>(p, g, m, v, k)
    } else {
        kernel::<G, S, false>(p, g, m, v, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::f32_to_bf16;

    /// The packing rounds every kind of value exactly as the scalar conversion.
    #[test]
    fn bf16_packing_matches_scalar_rounding() {
        if crate::simd::detected() < crate::simd::SimdLevel::Avx2 {
            return;
        }
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x0000_0001,
            0x807f_ffff,
            0x0000_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0xff80_0000,
            0x7f80_0001,
            0xffc0_0000,
            0x7fbf_ffff,
            0xffff_ffff,
        ];
        let mut s = 0x9e37_79b9u32;
        while bits.len() < 16 * 64 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            bits.push(s);
        }
        let xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        for block in xs.chunks(16) {
            let want: Vec<u16> = block.iter().map(|&x| f32_to_bf16(x)).collect();
            let mut got = [0u16; 16];
            // SAFETY: AVX2 checked above.
            unsafe {
                let lo = _mm256_loadu_ps(block.as_ptr());
                let hi = _mm256_loadu_ps(block.as_ptr().add(8));
                _mm256_storeu_si256(got.as_mut_ptr() as *mut __m256i, pack_bf16(lo, hi));
            }
            assert_eq!(&got[..], &want[..], "inputs {block:?}");
        }
    }
}
