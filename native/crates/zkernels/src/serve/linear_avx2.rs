//! [`super::linear`]'s rows body with explicit AVX2 FMAs: one weight row at a time, read
//! front to back (bfloat16 widened to f32 in registers: zero-extend to 32 bits and shift
//! left by 16, exact), dotted with up to [`super::linear::GROUP`] activation rows while it
//! is in registers. Two accumulators along K per activation row keep the FMA chains
//! independent; `2 · 4` accumulators, the weight vector and an activation vector fit
//! AVX2's 16 vector registers.

use crate::avx2::{hsum, load8};
use crate::bf16::Elem;
use std::arch::x86_64::*;

/// Accumulators per activation row; a step of the K loop covers `8 * ACC` elements.
const ACC: usize = 2;

/// `sums[m, j] = x[m] · w[j]` for exactly `MR` activation rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_of<const MR: usize, E: Elem>(x: &[f32], w: &[E], sums: &mut [f32]) {
    let k = x.len() / MR;
    let nb = w.len() / k;
    let whole = k / (8 * ACC) * (8 * ACC);
    let eights = k / 8 * 8;
    let xp = x.as_ptr();
    for j in 0..nb {
        let wp = w.as_ptr().add(j * k);
        let mut acc = [[_mm256_setzero_ps(); ACC]; MR];
        let mut t = 0;
        while t < whole {
            for q in 0..ACC {
                let wv = load8(wp.add(t + 8 * q));
                for (m, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xp.add(m * k + t + 8 * q));
                    a[q] = _mm256_fmadd_ps(xv, wv, a[q]);
                }
            }
            t += 8 * ACC;
        }
        if t < eights {
            let wv = load8(wp.add(t));
            for (m, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(xp.add(m * k + t));
                a[0] = _mm256_fmadd_ps(xv, wv, a[0]);
            }
            t += 8;
        }
        for (m, a) in acc.iter().enumerate() {
            let mut s = hsum(_mm256_add_ps(a[0], a[1]));
            for i in t..k {
                s += *xp.add(m * k + i) * (*wp.add(i)).to_f32();
            }
            sums[m * nb + j] = s;
        }
    }
}

/// `sums[m, j] = x[m] · w[j]` for the `mr` (1 to 4) rows of `x` and every row of `w`.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x` holds `mr` rows of `k`, `w` whole rows of `k` and
/// `sums` `mr` rows of `w.len() / k`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows<E: Elem>(x: &[f32], mr: usize, w: &[E], sums: &mut [f32]) {
    debug_assert!((1..=super::linear::GROUP).contains(&mr));
    match mr {
        1 => rows_of::<1, E>(x, w, sums),
        2 => rows_of::<2, E>(x, w, sums),
        3 => rows_of::<3, E>(x, w, sums),
        _ => rows_of::<4, E>(x, w, sums),
    }
}
