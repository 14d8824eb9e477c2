//! In-place optimizer steps on fp32 master parameters.
//!
//! Gradients may be `f32` or bf16 (`u16` bits); optimizer states may be `f32`
//! or bf16 (bf16 states cut the bytes moved per parameter from 28 to 20 for
//! Adam, and the step is memory-bound). Arithmetic is always f32. The math
//! follows `torch.optim` so results match it to rounding.

mod adagrad;
mod adam;
mod lion;

pub use adagrad::{adagrad_step, AdagradConfig};
pub use adam::{adam_step, AdamConfig};
pub use lion::{lion_step, LionConfig};

use crate::KernelError;

pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

fn check(
    name: &'static str,
    value: f64,
    ok: bool,
    expected: &'static str,
) -> Result<(), KernelError> {
    if ok && !value.is_nan() {
        Ok(())
    } else {
        Err(KernelError::InvalidHyperparameter {
            name,
            value,
            expected,
        })
    }
}

fn check_lr(lr: f64) -> Result<(), KernelError> {
    check("lr", lr, lr >= 0.0 && lr.is_finite(), "a finite value >= 0")
}

fn check_beta(name: &'static str, b: f64) -> Result<(), KernelError> {
    check(name, b, (0.0..1.0).contains(&b), "a value in [0, 1)")
}

fn check_weight_decay(wd: f64) -> Result<(), KernelError> {
    check(
        "weight_decay",
        wd,
        wd >= 0.0 && wd.is_finite(),
        "a finite value >= 0",
    )
}

fn check_eps(eps: f64) -> Result<(), KernelError> {
    check(
        "eps",
        eps,
        eps >= 0.0 && eps.is_finite(),
        "a finite value >= 0",
    )
}

fn check_step(step: u64) -> Result<(), KernelError> {
    check(
        "step",
        step as f64,
        step >= 1,
        "the 1-based count of steps taken, including this one",
    )
}

#[cfg(test)]
pub(crate) mod testutil {
    /// Deterministic pseudo-random values in [-1, 1) (xorshift), for tests.
    pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    pub fn assert_close(a: &[f32], b: &[f32], rtol: f32, atol: f32) {
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= atol + rtol * y.abs(),
                "index {i}: {x} vs {y}"
            );
        }
    }
}
