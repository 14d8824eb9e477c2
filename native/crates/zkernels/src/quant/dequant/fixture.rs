//! Test operands the INT4/FP6 linears' tests share: a seeded random packed weight with its
//! scales and zero points, activations and a bias, and the SIMD levels to run at.

use super::{PackedWeight, WeightFormat};
use crate::simd::{detected, set_override, SimdLevel};

/// A linear congruential generator: the next 31 random bits on each call.
pub(super) fn lcg(mut seed: u64) -> impl FnMut() -> u32 {
    move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    }
}

/// Runs `f` at every SIMD level this CPU has (forced), then restores detection.
pub(super) fn at_every_level(mut f: impl FnMut(SimdLevel)) {
    for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
        if level <= detected() {
            set_override(Some(level)).unwrap();
            f(level);
        }
    }
    set_override(None).unwrap();
}

/// `f()` run with `level` forced and no other test forcing a level while it ran (tests run
/// beside each other and the level is global): for comparisons of bits between calls.
pub(super) fn alone_at<R>(level: SimdLevel, mut f: impl FnMut() -> R) -> R {
    use std::sync::atomic::Ordering;
    loop {
        set_override(Some(level)).unwrap();
        let before = crate::simd::OVERRIDES.load(Ordering::SeqCst);
        let r = f();
        if crate::simd::OVERRIDES.load(Ordering::SeqCst) == before {
            return r;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A weight `(n, k)` in groups of `group` and `m` activation rows.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shape {
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) group: usize,
    pub(super) m: usize,
    /// INT4 with zero points (else symmetric, offset 8).
    pub(super) asym: bool,
    /// One scale row for the whole tensor (else one per output row).
    pub(super) per_tensor: bool,
}

/// Random operands of a [`Shape`]: codes of both planes (FP6 uses the second), scales
/// `0.01 + (i % 13) · 1e-3`, zero points `i % 16 + 0.25`, activations in `(-1.5, 1.5)`
/// and bias `j / 4 - 1`.
pub(super) struct Fixture {
    pub(super) shape: Shape,
    pub(super) data: Vec<u8>,
    pub(super) data2: Vec<u8>,
    pub(super) scale: Vec<f32>,
    pub(super) zero: Vec<f32>,
    pub(super) x: Vec<f32>,
    pub(super) bias: Vec<f32>,
}

impl Fixture {
    pub(super) fn new(shape: Shape) -> Fixture {
        let Shape {
            n,
            k,
            group,
            m,
            per_tensor,
            ..
        } = shape;
        let mut next = lcg((n * 131 + k * 7 + m * 3 + group) as u64);
        let srows = if per_tensor { 1 } else { n };
        let groups = k.div_ceil(group);
        Fixture {
            shape,
            data: (0..n * k / 2).map(|_| next() as u8).collect(),
            data2: (0..n * k / 4).map(|_| next() as u8).collect(),
            scale: (0..srows * groups)
                .map(|i| 0.01 + (i % 13) as f32 * 1e-3)
                .collect(),
            zero: (0..srows * groups)
                .map(|i| (i % 16) as f32 + 0.25)
                .collect(),
            x: (0..m * k)
                .map(|_| (next() as f32 / 2f32.powi(31) - 0.5) * 3.0)
                .collect(),
            bias: (0..n).map(|j| j as f32 * 0.25 - 1.0).collect(),
        }
    }

    /// The packed weight: FP6 (both planes, no zero points) or INT4 (zero points if `asym`).
    pub(super) fn weight(&self, fp6: bool) -> PackedWeight<'_> {
        let s = self.shape;
        PackedWeight {
            format: if fp6 {
                WeightFormat::Fp6
            } else {
                WeightFormat::Int4 { offset: 8 }
            },
            data: &self.data,
            data2: fp6.then_some(&self.data2[..]),
            scale: &self.scale,
            zero: (s.asym && !fp6).then_some(&self.zero[..]),
            n: s.n,
            k: s.k,
            group: s.group,
        }
    }
}
