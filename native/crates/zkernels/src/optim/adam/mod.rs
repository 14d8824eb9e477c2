//! Adam and AdamW (`amsgrad=False`), as `torch.optim.Adam` / `AdamW` compute them.

use super::{check_beta, check_eps, check_len, check_lr, check_step, check_weight_decay};
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

/// The update, element by element; `PLAIN` leaves out weight decay and `maximize`
/// (for a step that has neither), as the AVX-512 kernel's `update` does.
#[inline(always)]
fn adam_math<G: Elem, S: Elem, const PLAIN: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [S],
    v: &mut [S],
    k: &Scalars,
) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let mut pf = *p;
        let grad = if PLAIN {
            g.to_f32()
        } else {
            let grad = k.grad_sign * g.to_f32() + k.grad_wd * pf;
            pf *= k.param_scale;
            grad
        };
        let mf = k.beta1 * m.to_f32() + k.one_minus_beta1 * grad;
        let vf = k.beta2 * v.to_f32() + k.one_minus_beta2 * grad * grad;
        let denom = vf.sqrt() * k.inv_sqrt_bc2 + k.eps;
        *p = pf - k.step_size * mf / denom;
        *m = S::from_f32(mf);
        *v = S::from_f32(vf);
    }
}

/// The update with weight decay and `maximize`; the SIMD kernels finish their tails
/// with it.
#[inline(always)]
fn adam_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], k: &Scalars) {
    adam_math::<G, S, false>(p, g, m, v, k)
}

impl Scalars {
    /// No weight decay of either kind and no `maximize`: the gradient is used as is
    /// and the parameter is not rescaled. Results are the same bits either way, but
    /// for the sign of a zero state and for an infinite parameter (the full path's
    /// `0 * inf` gives NaN; torch also leaves weight decay out when it is 0).
    fn plain(&self) -> bool {
        self.grad_wd == 0.0 && self.param_scale == 1.0 && self.grad_sign == 1.0
    }
}

/// Runs the hand-written kernel for the active SIMD level over the longest
/// whole-block prefix and the element loop over the rest.
#[inline]
fn adam_dispatch<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], v: &mut [S], k: &Scalars) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::simd::SimdLevel;
        let done = match crate::simd::active() {
            // SAFETY: `active()` only reports a level whose features the CPU has.
            SimdLevel::Avx512 => unsafe { avx512::adam(p, g, m, v, k) },
            SimdLevel::Avx2 => unsafe { avx2::adam(p, g, m, v, k) },
            SimdLevel::Scalar => 0,
        };
        if done > 0 {
            return adam_body(
                &mut p[done..],
                &g[done..],
                &mut m[done..],
                &mut v[done..],
                k,
            );
        }
    }
    if k.plain() {
        adam_math::<G, S, true>(p, g, m, v, k)
    } else {
        adam_body(p, g, m, v, k)
    }
}

// AVX-512 intrinsics are stable since Rust 1.89, as are the AVX-512 target
// features `simd::multiversion` already enables, so the crate needs 1.89 anyway.
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2;

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

    /// With no weight decay or maximize every level takes its plain path; the AVX2
    /// and AVX-512 ones give the scalar loop's bits, for fp32 and bf16 states and grads.
    #[test]
    fn plain_path_matches_the_scalar_loop_bit_for_bit() {
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
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > simd::detected() {
                continue;
            }
            simd::set_override(Some(level)).unwrap();
            let (mut p32, mut m32, mut v32) = (rand_vec(n, 24), m0.clone(), v0.clone());
            adam_step(&mut p32, &g, &mut m32, &mut v32, &cfg).unwrap();
            let (mut p16, mut m16, mut v16) = (rand_vec(n, 24), bf(&m0), bf(&v0));
            adam_step(&mut p16, &bf(&g), &mut m16, &mut v16, &cfg).unwrap();
            out.push((p32, m32, v32, p16, m16, v16));
        }
        simd::set_override(None).unwrap();
        let bits = |x: &[f32]| -> Vec<u32> { x.iter().map(|x| x.to_bits()).collect() };
        let a = &out[0];
        for b in &out[1..] {
            assert_eq!(bits(&a.0), bits(&b.0));
            assert_eq!(bits(&a.1), bits(&b.1));
            assert_eq!(bits(&a.2), bits(&b.2));
            assert_eq!(bits(&a.3), bits(&b.3));
            assert_eq!(a.4, b.4);
            assert_eq!(a.5, b.5);
        }
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
