//! Adam over 32 elements (two vectors) per iteration.
//!
//! bf16 loads widen with one instruction per vector. bf16 stores round to
//! nearest even exactly as [`crate::bf16::f32_to_bf16`] does: with one
//! `vcvtne2ps2bf16` where the CPU has AVX512-BF16 (which flushes denormal
//! inputs to zero, so a block holding a denormal takes the integer path), else
//! in integer lanes packed by one permute. (The compiler's own version used a
//! truncating store per vector that is slow on some cores.)

use super::Scalars;
use crate::Elem;
use std::arch::x86_64::*;

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn load<T: Elem>(ptr: *const T) -> (__m512, __m512) {
    if T::BF16 {
        let ptr = ptr as *const __m256i;
        let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(ptr));
        let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(ptr.add(1)));
        (
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(lo)),
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(hi)),
        )
    } else {
        let ptr = ptr as *const f32;
        (_mm512_loadu_ps(ptr), _mm512_loadu_ps(ptr.add(16)))
    }
}

/// f32 bits rounded to nearest even at bit 16 (NaN quietened): the bf16 value
/// is the high half of each lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn round_bf16(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let r = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), lsb);
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000)))
}

/// 32 bf16 values (`lo` then `hi`), rounded in integer lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn pack_bf16_int(lo: __m512, hi: __m512) -> __m512i {
    // The odd 16-bit words (high halves) of lo's lanes, then of hi's.
    let idx = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19,
        17, 15, 13, 11, 9, 7, 5, 3, 1,
    );
    _mm512_permutex2var_epi16(round_bf16(lo), idx, round_bf16(hi))
}

/// 32 bf16 values (`lo` then `hi`) with the AVX512-BF16 conversion.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,avx512bf16")]
unsafe fn pack_bf16_ne(lo: __m512, hi: __m512) -> __m512i {
    // Denormal inputs would be flushed to zero; they are rare, so check the block.
    let denormal = _mm512_fpclass_ps_mask::<0x20>(lo) | _mm512_fpclass_ps_mask::<0x20>(hi);
    if denormal != 0 {
        return pack_bf16_int(lo, hi);
    }
    _mm512_castps_si512(std::mem::transmute::<__m512bh, __m512>(
        _mm512_cvtne2ps_pbh(hi, lo),
    ))
}

struct Consts {
    beta1: __m512,
    one_minus_beta1: __m512,
    beta2: __m512,
    one_minus_beta2: __m512,
    eps: __m512,
    step_size: __m512,
    inv_sqrt_bc2: __m512,
    grad_wd: __m512,
    param_scale: __m512,
    grad_sign: __m512,
}

impl Consts {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
    unsafe fn new(k: &Scalars) -> Consts {
        Consts {
            beta1: _mm512_set1_ps(k.beta1),
            one_minus_beta1: _mm512_set1_ps(k.one_minus_beta1),
            beta2: _mm512_set1_ps(k.beta2),
            one_minus_beta2: _mm512_set1_ps(k.one_minus_beta2),
            eps: _mm512_set1_ps(k.eps),
            step_size: _mm512_set1_ps(k.step_size),
            inv_sqrt_bc2: _mm512_set1_ps(k.inv_sqrt_bc2),
            grad_wd: _mm512_set1_ps(k.grad_wd),
            param_scale: _mm512_set1_ps(k.param_scale),
            grad_sign: _mm512_set1_ps(k.grad_sign),
        }
    }
}

/// One vector of the update (the math of `super::adam_body`); returns (p, m, v).
/// `PLAIN`: no weight decay of either kind and no `maximize`, so the gradient is
/// used as is and the parameter is not rescaled (four operations fewer).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
unsafe fn update<const PLAIN: bool>(
    p: __m512,
    g: __m512,
    m: __m512,
    v: __m512,
    c: &Consts,
) -> (__m512, __m512, __m512) {
    // Unfused multiply and add, rounding each step as `adam_body` (and torch's
    // eager ops) do: an FMA here moves a bf16 state across a rounding boundary
    // now and then, which shows up in the parameters one step later.
    let (grad, p) = if PLAIN {
        (g, p)
    } else {
        (
            _mm512_add_ps(_mm512_mul_ps(c.grad_sign, g), _mm512_mul_ps(c.grad_wd, p)),
            _mm512_mul_ps(p, c.param_scale),
        )
    };
    let m = _mm512_add_ps(
        _mm512_mul_ps(c.beta1, m),
        _mm512_mul_ps(c.one_minus_beta1, grad),
    );
    let v = _mm512_add_ps(
        _mm512_mul_ps(c.beta2, v),
        _mm512_mul_ps(_mm512_mul_ps(c.one_minus_beta2, grad), grad),
    );
    let denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), c.inv_sqrt_bc2), c.eps);
    let p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(c.step_size, m), denom));
    (p, m, v)
}

/// The kernel loop, stamped out once per bf16 packing (each needs its own
/// target features for the packing to inline).
macro_rules! kernel {
    ($name:ident, $features:literal, $pack:ident) => {
        /// Updates the longest prefix that is a whole number of 32-element
        /// blocks and returns its length; the caller finishes the rest.
        ///
        /// # Safety
        /// The CPU must support the enabled features; all slices as long as `p`.
        #[target_feature(enable = $features)]
        unsafe fn $name<G: Elem, S: Elem, const PLAIN: bool>(
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
            let end = n - n % 32;
            let mut i = 0;
            while i < end {
                let (p0, p1) = load(pp.add(i));
                let (g0, g1) = load(gp.add(i));
                let (m0, m1) = load(mp.add(i));
                let (v0, v1) = load(vp.add(i));
                let (p0, m0, v0) = update::<PLAIN>(p0, g0, m0, v0, &c);
                let (p1, m1, v1) = update::<PLAIN>(p1, g1, m1, v1, &c);
                _mm512_storeu_ps(pp.add(i), p0);
                _mm512_storeu_ps(pp.add(i + 16), p1);
                if S::BF16 {
                    _mm512_storeu_si512(mp.add(i) as *mut __m512i, $pack(m0, m1));
                    _mm512_storeu_si512(vp.add(i) as *mut __m512i, $pack(v0, v1));
                } else {
                    let (mp, vp) = (mp as *mut f32, vp as *mut f32);
                    _mm512_storeu_ps(mp.add(i), m0);
                    _mm512_storeu_ps(mp.add(i + 16), m1);
                    _mm512_storeu_ps(vp.add(i), v0);
                    _mm512_storeu_ps(vp.add(i + 16), v1);
                }
                i += 32;
            }
            end
        }
    };
}

kernel!(
    adam_int,
    "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma",
    pack_bf16_int
);
kernel!(
    adam_ne,
    "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,avx512bf16",
    pack_bf16_ne
);

/// Runs the AVX-512 kernel over the longest whole-block prefix and returns its
/// length.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ and FMA.
#[inline]
pub(super) unsafe fn adam<G: Elem, S: Elem>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    k: &Scalars,
) -> usize {
    // Without weight decay or maximize (the common case) the kernel skips their
    // arithmetic: a few percent on a bf16-state step when the cores, not DRAM,
    // set the pace.
    match (S::BF16 && crate::simd::has_avx512_bf16(), k.plain()) {
        (true, true) => adam_ne::<G, S, true>(p, g, m, v, k),
        (true, false) => adam_ne::<G, S, false>(p, g, m, v, k),
        (false, true) => adam_int::<G, S, true>(p, g, m, v, k),
        (false, false) => adam_int::<G, S, false>(p, g, m, v, k),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::f32_to_bf16;

    /// Both packings round every kind of value exactly as the scalar conversion.
    #[test]
    fn bf16_packing_matches_scalar_rounding() {
        if crate::simd::detected() < crate::simd::SimdLevel::Avx512 {
            return;
        }
        let mut bits: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x0000_0001,
            0x807f_ffff,
            0x0040_8000,
            0x0000_8000,
            0x0001_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x3f80_8001,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f80_0000,
            0x7f80_0001,
            0xffc0_0000,
            0x7fbf_ffff,
            0x0080_0000,
            0x007f_ffff,
        ];
        let mut s = 0x9e37_79b9u32;
        while bits.len() < 32 * 64 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            bits.push(s);
        }
        let xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let want: Vec<u16> = xs.iter().map(|&x| f32_to_bf16(x)).collect();
        for ne in [false, true] {
            if ne && !crate::simd::has_avx512_bf16() {
                continue;
            }
            for (block, want) in xs.chunks(32).zip(want.chunks(32)) {
                let mut got = [0u16; 32];
                // SAFETY: AVX-512 (and AVX512-BF16 for `ne`) checked above.
                unsafe {
                    let lo = _mm512_loadu_ps(block.as_ptr());
                    let hi = _mm512_loadu_ps(block.as_ptr().add(16));
                    let packed = if ne {
                        pack_bf16_ne(lo, hi)
                    } else {
                        pack_bf16_int(lo, hi)
                    };
                    _mm512_storeu_si512(got.as_mut_ptr() as *mut __m512i, packed);
                }
                assert_eq!(&got[..], want, "ne={ne}, inputs {block:?}");
            }
        }
    }
}
