//! Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"):
//! `c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = b2*m + (1-b2)*g`.

use super::{check_beta, check_len, check_lr, check_step, check_weight_decay};
use crate::simd::multiversion;
use crate::{par, Elem, KernelError};

/// Hyperparameters of one Lion step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub maximize: bool,
    /// 1-based index of this step (Lion has no bias correction; checked only).
    pub step: u64,
}

impl Default for LionConfig {
    fn default() -> Self {
        LionConfig {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.99,
            weight_decay: 0.0,
            maximize: false,
            step: 1,
        }
    }
}

#[derive(Clone, Copy)]
struct Scalars {
    lr: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    param_scale: f32,
    grad_sign: f32,
}

/// `sign` with `sign(0) = 0`, as `torch.sign`; branch-free.
#[inline(always)]
fn sign(x: f32) -> f32 {
    ((x > 0.0) as i32 - (x < 0.0) as i32) as f32
}

#[inline(always)]
fn lion_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], k: &Scalars) {
    for ((p, g), m) in p.iter_mut().zip(g).zip(m.iter_mut()) {
        let grad = k.grad_sign * g.to_f32();
        let mf = m.to_f32();
        let c = k.beta1 * mf + k.one_minus_beta1 * grad;
        *p = *p * k.param_scale - k.lr * sign(c);
        *m = S::from_f32(k.beta2 * mf + k.one_minus_beta2 * grad);
    }
}

multiversion!(lion_dispatch => lion_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], m: &mut [S], k: &Scalars));

/// One Lion step over `params` in place, updating `exp_avg`.
pub fn lion_step<G: Elem, S: Elem>(
    params: &mut [f32],
    grads: &[G],
    exp_avg: &mut [S],
    cfg: &LionConfig,
) -> Result<(), KernelError> {
    let n = params.len();
    check_len("grads", n, grads.len())?;
    check_len("exp_avg", n, exp_avg.len())?;
    check_lr(cfg.lr)?;
    check_beta("beta1", cfg.beta1)?;
    check_beta("beta2", cfg.beta2)?;
    check_weight_decay(cfg.weight_decay)?;
    check_step(cfg.step)?;
    let k = Scalars {
        lr: cfg.lr as f32,
        beta1: cfg.beta1 as f32,
        one_minus_beta1: (1.0 - cfg.beta1) as f32,
        beta2: cfg.beta2 as f32,
        one_minus_beta2: (1.0 - cfg.beta2) as f32,
        param_scale: (1.0 - cfg.lr * cfg.weight_decay) as f32,
        grad_sign: if cfg.maximize { -1.0 } else { 1.0 },
    };
    par::for_each_chunk3(params, grads, exp_avg, |p, g, m| lion_dispatch(p, g, m, &k));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::testutil::{assert_close, rand_vec};

    #[test]
    fn matches_reference() {
        let n = 2 * par::CHUNK + 3;
        let mut p = rand_vec(n, 1);
        let mut m = vec![0f32; n];
        let mut pr = p.clone();
        let mut mr = m.clone();
        let cfg0 = LionConfig {
            lr: 1e-3,
            weight_decay: 0.1,
            ..Default::default()
        };
        for step in 1..=8u64 {
            let g = rand_vec(n, 20 + step);
            lion_step(&mut p, &g, &mut m, &LionConfig { step, ..cfg0 }).unwrap();
            for i in 0..n {
                let c = 0.9 * mr[i] + 0.1 * g[i];
                let s = if c > 0.0 {
                    1.0
                } else if c < 0.0 {
                    -1.0
                } else {
                    0.0
                };
                pr[i] = pr[i] * (1.0 - 1e-4) - 1e-3 * s;
                mr[i] = 0.99 * mr[i] + 0.01 * g[i];
            }
        }
        assert_close(&p, &pr, 1e-6, 1e-6);
        assert_close(&m, &mr, 1e-6, 1e-7);
    }

    #[test]
    fn sign_of_zero_is_zero() {
        assert_eq!(sign(0.0), 0.0);
        assert_eq!(sign(-0.0), 0.0);
        assert_eq!(sign(-3.0), -1.0);
    }
}
