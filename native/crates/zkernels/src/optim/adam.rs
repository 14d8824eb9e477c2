//! Adam and AdamW (`amsgrad=False`), as `torch.optim.Adam` / `AdamW` compute them.

use super::{check_beta, check_eps, check_len, check_lr, check_step, check_weight_decay};
use crate::simd::multiversion;
use crate::{par, Elem, KernelError};

/// Hyperparameters of one Adam step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: decay the parameter directly (`p *= 1 - lr * wd`) instead of adding
    /// `wd * p` to the gradient.
    pub decoupled_weight_decay: bool,
    pub bias_correction: bool,
    /// Ascend instead of descend (torch's `maximize`).
    pub maximize: bool,
    /// 1-based index of this step.
    pub step: u64,
}

impl Default for AdamConfig {
    fn default() -> Self {
        AdamConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled_weight_decay: false,
            bias_correction: true,
            maximize: false,
            step: 1,
        }
    }
}

/// Per-step scalars, folded once in f64 and rounded to f32.
#[derive(Clone, Copy)]
struct Scalars {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    /// `lr / (1 - beta1^t)`
    step_size: f32,
    /// `1 / sqrt(1 - beta2^t)`
    inv_sqrt_bc2: f32,
    /// coupled (Adam) weight decay, added to the gradient
    grad_wd: f32,
    /// decoupled (AdamW) factor `1 - lr * wd`
    param_scale: f32,
    grad_sign: f32,
}

impl AdamConfig {
    fn validate(&self) -> Result<(), KernelError> {
        check_lr(self.lr)?;
        check_beta("beta1", self.beta1)?;
        check_beta("beta2", self.beta2)?;
        check_eps(self.eps)?;
        check_weight_decay(self.weight_decay)?;
        check_step(self.step)
    }

    fn scalars(&self) -> Scalars {
        let t = self.step.min(i32::MAX as u64) as i32;
        let (bc1, bc2) = if self.bias_correction {
            (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t))
        } else {
            (1.0, 1.0)
        };
        let (grad_wd, param_scale) = if self.decoupled_weight_decay {
            (0.0, 1.0 - self.lr * self.weight_decay)
        } else {
            (self.weight_decay, 1.0)
        };
        Scalars {
            beta1: self.beta1 as f32,
            one_minus_beta1: (1.0 - self.beta1) as f32,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            step_size: (self.lr / bc1) as f32,
            inv_sqrt_bc2: (1.0 / bc2.sqrt()) as f32,
            grad_wd: grad_wd as f32,
            param_scale: param_scale as f32,
            grad_sign: if self.maximize { -1.0 } else { 1.0 },
        }
    }
}

#[inline(always)]
fn adam_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], k: &Scalars) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let mut pf = *p;
        let grad = k.grad_sign * g.to_f32() + k.grad_wd * pf;
        pf *= k.param_scale;
        let mf = k.beta1 * m.to_f32() + k.one_minus_beta1 * grad;
        let vf = k.beta2 * v.to_f32() + k.one_minus_beta2 * grad * grad;
        let denom = vf.sqrt() * k.inv_sqrt_bc2 + k.eps;
        *p = pf - k.step_size * mf / denom;
        *m = S::from_f32(mf);
        *v = S::from_f32(vf);
    }
}

multiversion!(adam_auto => adam_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], k: &Scalars));

/// Runs the hand-written AVX-512 kernel where the CPU has it, else the
/// compiler-vectorized body for the active level.
#[inline]
fn adam_dispatch<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], k: &Scalars) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
        // SAFETY: `active()` only reports AVX-512 when the CPU has every feature it enables.
        let done = unsafe { avx512::adam(p, g, m, v, k) };
        return adam_body(
            &mut p[done..],
            &g[done..],
            &mut m[done..],
            &mut v[done..],
            k,
        );
    }
    adam_auto(p, g, m, v, k)
}

// AVX-512 intrinsics are stable since Rust 1.89, as are the AVX-512 target
// features `simd::multiversion` already enables, so the crate needs 1.89 anyway.
#[cfg(target_arch = "x86_64")]
mod avx512 {
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
            63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
            19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
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
        // set the pace. Results are the same bits either way, but for the sign of a
        // zero state, and for an infinite parameter (the full path's `0 * inf` gives
        // NaN; torch also leaves weight decay out when it is 0).
        let plain = k.grad_wd == 0.0 && k.param_scale == 1.0 && k.grad_sign == 1.0;
        match (S::BF16 && crate::simd::has_avx512_bf16(), plain) {
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
}

/// One Adam/AdamW step over `params` in place, updating `exp_avg` and `exp_avg_sq`.
///
/// All four buffers must have the same length. Nothing is written if the
/// arguments are invalid.
pub fn adam_step<G: Elem, S: Elem>(
    params: &mut [f32],
    grads: &[G],
    exp_avg: &mut [S],
    exp_avg_sq: &mut [S],
    cfg: &AdamConfig,
) -> Result<(), KernelError> {
    let n = params.len();
    check_len("grads", n, grads.len())?;
    check_len("exp_avg", n, exp_avg.len())?;
    check_len("exp_avg_sq", n, exp_avg_sq.len())?;
    cfg.validate()?;
    let k = cfg.scalars();
    par::for_each_chunk4(params, grads, exp_avg, exp_avg_sq, |p, g, m, v| {
        adam_dispatch(p, g, m, v, &k)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::testutil::{assert_close, rand_vec};
    use crate::simd::{self, SimdLevel};

    /// Straight transcription of torch.optim.Adam's single-tensor loop, in f64.
    fn reference(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], c: &AdamConfig) {
        let t = c.step as i32;
        for i in 0..p.len() {
            let mut grad = if c.maximize { -g[i] } else { g[i] };
            if c.decoupled_weight_decay {
                p[i] *= 1.0 - c.lr * c.weight_decay;
            } else {
                grad += c.weight_decay * p[i];
            }
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * grad;
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * grad * grad;
            let bc1 = 1.0 - c.beta1.powi(t);
            let bc2 = 1.0 - c.beta2.powi(t);
            let denom = v[i].sqrt() / bc2.sqrt() + c.eps;
            p[i] -= c.lr / bc1 * m[i] / denom;
        }
    }

    fn run_f32(n: usize, cfg_base: AdamConfig, steps: u64) {
        let mut p = rand_vec(n, 1);
        let mut m = vec![0f32; n];
        let mut v = vec![0f32; n];
        let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let mut mr = vec![0f64; n];
        let mut vr = vec![0f64; n];
        for s in 1..=steps {
            let g = rand_vec(n, 100 + s);
            let gr: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            let cfg = AdamConfig {
                step: s,
                ..cfg_base
            };
            adam_step(&mut p, &g, &mut m, &mut v, &cfg).unwrap();
            reference(&mut pr, &gr, &mut mr, &mut vr, &cfg);
        }
        let pr32: Vec<f32> = pr.iter().map(|&x| x as f32).collect();
        assert_close(&p, &pr32, 1e-5, 1e-6);
    }

    #[test]
    fn adam_matches_reference_small_and_parallel() {
        let cfg = AdamConfig {
            lr: 1e-2,
            weight_decay: 0.01,
            ..Default::default()
        };
        run_f32(1000, cfg, 20);
        run_f32(5 * par::CHUNK + 7, cfg, 5);
    }

    #[test]
    fn adamw_and_maximize_match_reference() {
        let cfg = AdamConfig {
            lr: 3e-3,
            weight_decay: 0.1,
            decoupled_weight_decay: true,
            maximize: true,
            beta1: 0.8,
            beta2: 0.95,
            ..Default::default()
        };
        run_f32(4097, cfg, 15);
    }

    #[test]
    fn simd_variants_agree() {
        let n = 3 * par::CHUNK + 13;
        let g = rand_vec(n, 9);
        let cfg = AdamConfig {
            weight_decay: 0.05,
            step: 3,
            ..Default::default()
        };
        let mut results = Vec::new();
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > simd::detected() {
                continue;
            }
            simd::set_override(Some(level)).unwrap();
            let mut p = rand_vec(n, 2);
            let mut m = rand_vec(n, 3);
            let mut v: Vec<f32> = rand_vec(n, 4).iter().map(|x| x * x).collect();
            adam_step(&mut p, &g, &mut m, &mut v, &cfg).unwrap();
            results.push(p);
        }
        simd::set_override(None).unwrap();
        for r in &results[1..] {
            // FMA contraction may differ from the scalar build by an ulp or two.
            assert_close(r, &results[0], 1e-6, 1e-7);
        }
    }

    /// With no weight decay or maximize the AVX-512 kernel takes its plain path; it
    /// gives the scalar loop's bits, for fp32 and bf16 states and grads.
    #[test]
    fn plain_path_matches_the_scalar_loop_bit_for_bit() {
        if simd::detected() < SimdLevel::Avx512 {
            return;
        }
        let n = 3 * par::CHUNK + 13;
        let cfg = AdamConfig {
            lr: 1e-2,
            step: 4,
            ..Default::default()
        };
        let bf =
            |x: &[f32]| -> Vec<u16> { x.iter().map(|&x| crate::bf16::f32_to_bf16(x)).collect() };
        let g = rand_vec(n, 21);
        let (m0, v0) = (
            rand_vec(n, 22),
            rand_vec(n, 23).iter().map(|x| x * x).collect::<Vec<_>>(),
        );
        let mut out = Vec::new();
        for level in [SimdLevel::Scalar, SimdLevel::Avx512] {
            simd::set_override(Some(level)).unwrap();
            let (mut p32, mut m32, mut v32) = (rand_vec(n, 24), m0.clone(), v0.clone());
            adam_step(&mut p32, &g, &mut m32, &mut v32, &cfg).unwrap();
            let (mut p16, mut m16, mut v16) = (rand_vec(n, 24), bf(&m0), bf(&v0));
            adam_step(&mut p16, &bf(&g), &mut m16, &mut v16, &cfg).unwrap();
            out.push((p32, m32, v32, p16, m16, v16));
        }
        simd::set_override(None).unwrap();
        let bits = |x: &[f32]| -> Vec<u32> { x.iter().map(|x| x.to_bits()).collect() };
        let (a, b) = (&out[0], &out[1]);
        assert_eq!(bits(&a.0), bits(&b.0));
        assert_eq!(bits(&a.1), bits(&b.1));
        assert_eq!(bits(&a.2), bits(&b.2));
        assert_eq!(bits(&a.3), bits(&b.3));
        assert_eq!(a.4, b.4);
        assert_eq!(a.5, b.5);
    }

    #[test]
    fn bf16_states_track_f32_states() {
        let n = 2048;
        let mut p32 = rand_vec(n, 5);
        let mut p16 = p32.clone();
        let (mut m32, mut v32) = (vec![0f32; n], vec![0f32; n]);
        let (mut m16, mut v16) = (vec![0u16; n], vec![0u16; n]);
        for s in 1..=10 {
            let g = rand_vec(n, 50 + s);
            let gb: Vec<u16> = g.iter().map(|&x| crate::bf16::f32_to_bf16(x)).collect();
            let cfg = AdamConfig {
                step: s,
                ..Default::default()
            };
            adam_step(&mut p32, &g, &mut m32, &mut v32, &cfg).unwrap();
            adam_step(&mut p16, &gb, &mut m16, &mut v16, &cfg).unwrap();
        }
        // 10 steps of lr 1e-3 move each parameter by at most ~1e-2; bf16 rounding of
        // states and grads perturbs the update by a few percent of that.
        assert_close(&p16, &p32, 0.0, 2e-3);
    }

    #[test]
    fn errors_leave_buffers_untouched() {
        let mut p = vec![1.0f32; 8];
        let mut m = vec![0f32; 8];
        let mut v = vec![0f32; 8];
        let g = vec![1.0f32; 7];
        let e = adam_step(&mut p, &g, &mut m, &mut v, &AdamConfig::default()).unwrap_err();
        assert!(matches!(
            e,
            KernelError::LengthMismatch {
                what: "grads",
                expected: 8,
                got: 7
            }
        ));
        let g = vec![1.0f32; 8];
        for bad in [
            AdamConfig {
                beta1: 1.0,
                ..Default::default()
            },
            AdamConfig {
                lr: f64::NAN,
                ..Default::default()
            },
            AdamConfig {
                step: 0,
                ..Default::default()
            },
        ] {
            assert!(matches!(
                adam_step(&mut p, &g, &mut m, &mut v, &bad),
                Err(KernelError::InvalidHyperparameter { .. })
            ));
        }
        assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&x| x == 0.0));
    }
}
