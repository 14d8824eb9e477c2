//! [`super::linear::linear_rows`] for many activation rows (prefill and batched steps) as a
//! register-blocked AVX2 GEMM: `out = x W^T`, f32 accumulation, each output rounded once.
//!
//! The activation rows are packed once per call into panels of [`PANEL`] rows, k-major
//! (`panel[kk][r]`), widened to f32; each weight row is read in place (float32) or widened
//! once per call into a small buffer (bfloat16). A microkernel call computes a tile of
//! [`WR`] weight rows by one panel: per `kk` it loads the panel's two 8-lane vectors,
//! broadcasts each weight row's element and issues `2 · WR` FMAs into `2 · WR` accumulators
//! (12 + 2 + 1 of AVX2's 16 vector registers), so there is no horizontal sum per output
//! and no transposed copy of `W`. Tasks split the weight rows, each task reading its rows
//! once per call and every panel from cache.
//!
//! Each output is `sum_k x[m, k] * w[n, k]` added in `k` order in one f32 lane (the order
//! differs from the rows kernel's, so the last bits may too).

use crate::bf16::Elem;
use std::arch::x86_64::*;

/// Activation rows a packed panel holds (two 8-lane vectors).
pub(super) const PANEL: usize = 16;
/// Weight rows one microkernel call broadcasts.
const WR: usize = 6;
/// Weight rows one task computes (a multiple of [`WR`]).
pub(super) const ROWS_PER_TASK: usize = 8 * WR;

/// `x` (`rows` x `k`) widened to f32 and packed into panels of [`PANEL`] rows:
/// `packed[(p * k + kk) * PANEL + r] = x[(p * PANEL + r) * k + kk]`, rows past `rows` zero.
pub(super) fn pack_rows<E: Elem>(x: &[E], rows: usize, k: usize) -> Vec<f32> {
    let mut packed = vec![0f32; rows.div_ceil(PANEL) * PANEL * k];
    for (m, row) in x.chunks_exact(k).take(rows).enumerate() {
        let base = (m / PANEL) * PANEL * k + m % PANEL;
        for (kk, v) in row.iter().enumerate() {
            packed[base + kk * PANEL] = v.to_f32();
        }
    }
    packed
}

/// The `R x (8 * H)` tile `acc[i][h] = sum_kk w[i * k + kk] * panel[kk][8h..8h + 8]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize, const H: usize>(
    w: *const f32,
    k: usize,
    panel: *const f32,
) -> [[__m256; 2]; WR] {
    let mut acc = [[_mm256_setzero_ps(); 2]; WR];
    for kk in 0..k {
        let p = panel.add(kk * PANEL);
        let b0 = _mm256_loadu_ps(p);
        let b1 = if H == 2 {
            _mm256_loadu_ps(p.add(8))
        } else {
            b0
        };
        for (i, a) in acc.iter_mut().enumerate().take(R) {
            let wv = _mm256_broadcast_ss(&*w.add(i * k + kk));
            a[0] = _mm256_fmadd_ps(wv, b0, a[0]);
            if H == 2 {
                a[1] = _mm256_fmadd_ps(wv, b1, a[1]);
            }
        }
    }
    acc
}

/// One task's outputs: `out[m * n + j] = x[m] · w[j]` for every activation row `m < rows`
/// and the weight rows `j0..j0 + w.len() / k`; `packed` is [`pack_rows`]'s, `out` points
/// at the whole `(rows, n)` output.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `w` holds whole rows of `k`, `packed` the panels of
/// `rows` rows of `k`, and `out` `rows * n` elements of which this call writes only the
/// columns `j0..j0 + w.len() / k` (no other thread may touch them meanwhile).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn task<E: Elem>(
    packed: &[f32],
    rows: usize,
    k: usize,
    w: &[E],
    j0: usize,
    n: usize,
    out: *mut E,
) {
    let nb = w.len() / k;
    let mut widened = if E::BF16 {
        vec![0f32; WR * k]
    } else {
        Vec::new()
    };
    for g0 in (0..nb).step_by(WR) {
        let r = (nb - g0).min(WR);
        let wg = &w[g0 * k..(g0 + r) * k];
        let wp: *const f32 = if E::BF16 {
            for (d, s) in widened.iter_mut().zip(wg) {
                *d = s.to_f32();
            }
            widened.as_ptr()
        } else {
            wg.as_ptr().cast()
        };
        for p0 in (0..rows).step_by(PANEL) {
            let panel = packed.as_ptr().add(p0 * k);
            let live = (rows - p0).min(PANEL);
            let acc = if live > 8 {
                run::<2>(r, wp, k, panel)
            } else {
                run::<1>(r, wp, k, panel)
            };
            let mut lanes = [0f32; PANEL];
            for (i, a) in acc.iter().enumerate().take(r) {
                _mm256_storeu_ps(lanes.as_mut_ptr(), a[0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a[1]);
                for (l, &v) in lanes.iter().enumerate().take(live) {
                    *out.add((p0 + l) * n + j0 + g0 + i) = E::from_f32(v);
                }
            }
        }
    }
}

/// [`tile`] for `r` (1 to [`WR`]) weight rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn run<const H: usize>(
    r: usize,
    w: *const f32,
    k: usize,
    panel: *const f32,
) -> [[__m256; 2]; WR] {
    match r {
        1 => tile::<1, H>(w, k, panel),
        2 => tile::<2, H>(w, k, panel),
        3 => tile::<3, H>(w, k, panel),
        4 => tile::<4, H>(w, k, panel),
        5 => tile::<5, H>(w, k, panel),
        _ => tile::<6, H>(w, k, panel),
    }
}
