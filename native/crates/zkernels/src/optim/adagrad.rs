//! Adagrad, as `torch.optim.Adagrad` computes it.

use super::{check, check_eps, check_len, check_lr, check_step, check_weight_decay};
use crate::simd::multiversion;
use crate::{par, Elem, KernelError};

/// Hyperparameters of one Adagrad step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdagradConfig {
    pub lr: f64,
    pub lr_decay: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub maximize: bool,
    /// 1-based index of this step.
    pub step: u64,
}

impl Default for AdagradConfig {
    fn default() -> Self {
        AdagradConfig {
            lr: 1e-2,
            lr_decay: 0.0,
            eps: 1e-10,
            weight_decay: 0.0,
            maximize: false,
            step: 1,
        }
    }
}

#[derive(Clone, Copy)]
struct Scalars {
    clr: f32,
    eps: f32,
    wd: f32,
    grad_sign: f32,
}

#[inline(always)]
fn adagrad_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], sum: &mut [S], k: &Scalars) {
    for ((p, g), s) in p.iter_mut().zip(g).zip(sum.iter_mut()) {
        let grad = k.grad_sign * g.to_f32() + k.wd * *p;
        let sf = s.to_f32() + grad * grad;
        *p -= k.clr * grad / (sf.sqrt() + k.eps);
        *s = S::from_f32(sf);
    }
}

multiversion!(adagrad_dispatch => adagrad_body<G: Elem, S: Elem>(p: &mut [f32], g: &[G], sum: &mut [S], k: &Scalars));

/// One Adagrad step over `params` in place, updating the squared-gradient sum.
pub fn adagrad_step<G: Elem, S: Elem>(
    params: &mut [f32],
    grads: &[G],
    state_sum: &mut [S],
    cfg: &AdagradConfig,
) -> Result<(), KernelError> {
    let n = params.len();
    check_len("grads", n, grads.len())?;
    check_len("state_sum", n, state_sum.len())?;
    check_lr(cfg.lr)?;
    check(
        "lr_decay",
        cfg.lr_decay,
        cfg.lr_decay >= 0.0 && cfg.lr_decay.is_finite(),
        "a finite value >= 0",
    )?;
    check_eps(cfg.eps)?;
    check_weight_decay(cfg.weight_decay)?;
    check_step(cfg.step)?;
    let k = Scalars {
        clr: (cfg.lr / (1.0 + (cfg.step - 1) as f64 * cfg.lr_decay)) as f32,
        eps: cfg.eps as f32,
        wd: cfg.weight_decay as f32,
        grad_sign: if cfg.maximize { -1.0 } else { 1.0 },
    };
    par::for_each_chunk3(params, grads, state_sum, |p, g, s| {
        adagrad_dispatch(p, g, s, &k)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::testutil::{assert_close, rand_vec};

    #[test]
    fn matches_reference() {
        let n = 3 * par::CHUNK + 5;
        let mut p = rand_vec(n, 1);
        let mut s = vec![0.1f32; n];
        let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let mut sr = vec![0.1f64; n];
        for step in 1..=10u64 {
            let g = rand_vec(n, 10 + step);
            let cfg = AdagradConfig {
                lr: 0.05,
                lr_decay: 0.01,
                weight_decay: 0.02,
                step,
                ..Default::default()
            };
            adagrad_step(&mut p, &g, &mut s, &cfg).unwrap();
            let clr = cfg.lr / (1.0 + (step - 1) as f64 * cfg.lr_decay);
            for i in 0..n {
                let grad = g[i] as f64 + cfg.weight_decay * pr[i];
                sr[i] += grad * grad;
                pr[i] -= clr * grad / (sr[i].sqrt() + cfg.eps);
            }
        }
        let pr32: Vec<f32> = pr.iter().map(|&x| x as f32).collect();
        assert_close(&p, &pr32, 1e-5, 1e-6);
    }

    #[test]
    fn rejects_bad_lr_decay() {
        let mut p = vec![0f32; 4];
        let mut s = vec![0f32; 4];
        let cfg = AdagradConfig {
            lr_decay: -1.0,
            ..Default::default()
        };
        assert!(adagrad_step(&mut p, &[0f32; 4], &mut s, &cfg).is_err());
    }
}
