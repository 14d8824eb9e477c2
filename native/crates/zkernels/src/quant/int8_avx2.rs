//! The INT8 GEMM's body on AVX2 (no VNNI): the activations are sign-extended to int16
//! once per call, each 16-byte run of a weight row is sign-extended in registers
//! (`vpmovsxbw`), and `vpmaddwd` multiplies the int16 pairs and adds each pair into an
//! int32 lane. Every product and pair sum is exact for any int8 operands (|a·b| ≤ 2^14,
//! a pair ≤ 2^15), so the int32 results equal the definition and the VNNI body's, with
//! no ±128 correction to fold.
//!
//! Fewer than [`MR`] activation rows (a decode step) stream the weight block one row at a
//! time, front to back (one stream the prefetcher follows, as the VNNI rows body). When
//! no activation code is -128 (every linear's: its quantizer clamps to ±127) they run
//! [`rows_signed`]: `vpmaddubsw` on |w| and the activation with w's sign, 32 bytes a step,
//! exact because no pair can reach the int16 limit (with a -128 activation it could, so
//! [`rows`] stays for those). More rows run [`MR`]×[`NR`] tiles: 12 int32 accumulators and
//! 3 widened weight vectors fill AVX2's 16 vector registers, the activation operand coming
//! from memory.

use super::int8::Epilogue;
use crate::avx2::hsum_epi32 as hsum;
use std::arch::x86_64::*;

/// Activation rows per tile (fewer take [`rows`] / [`rows_signed`]).
pub(super) const MR: usize = 4;
/// Weight rows per tile.
const NR: usize = 3;

/// 16 int8 at `p` sign-extended to int16.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen(p: *const i8) -> __m256i {
    _mm256_cvtepi8_epi16(_mm_loadu_si128(p.cast()))
}

/// `Σ a·b` over the tail `t..k` of a row (fewer than 16 elements), scalar.
#[inline(always)]
unsafe fn tail(a: *const i16, b: *const i8, t: usize, k: usize) -> i32 {
    (t..k)
        .map(|i| i32::from(*a.add(i)) * i32::from(*b.add(i)))
        .sum()
}

/// Weight rows `j0..j1` against the `R < MR` activation rows of a decode step, one
/// weight row at a time; two accumulators along k per activation row.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows<const R: usize, E: Epilogue>(
    a: *const i16,
    b: *const i8,
    k: usize,
    j0: usize,
    j1: usize,
    epi: &E,
) {
    let whole = k / 32 * 32;
    let sixteen = k / 16 * 16;
    for j in j0..j1 {
        let w = b.add(j * k);
        let mut acc = [[_mm256_setzero_si256(); 2]; R];
        let mut t = 0;
        while t < whole {
            let b0 = widen(w.add(t));
            let b1 = widen(w.add(t + 16));
            for (r, acc) in acc.iter_mut().enumerate() {
                let ar = a.add(r * k + t);
                let p0 = _mm256_madd_epi16(_mm256_loadu_si256(ar.cast()), b0);
                let p1 = _mm256_madd_epi16(_mm256_loadu_si256(ar.add(16).cast()), b1);
                acc[0] = _mm256_add_epi32(acc[0], p0);
                acc[1] = _mm256_add_epi32(acc[1], p1);
            }
            t += 32;
        }
        if t < sixteen {
            let b0 = widen(w.add(t));
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_loadu_si256(a.add(r * k + t).cast());
                acc[0] = _mm256_add_epi32(acc[0], _mm256_madd_epi16(av, b0));
            }
            t += 16;
        }
        for (r, acc) in acc.iter().enumerate() {
            let s = hsum(_mm256_add_epi32(acc[0], acc[1])) + tail(a.add(r * k), w, t, k);
            epi.write(r, j, s);
        }
    }
}

/// `acc + Σ pairs (|w| · (a with w's sign))` over 32 bytes at `ap` (see [`rows_signed`]).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn step(acc: __m256i, ones: __m256i, wabs: __m256i, w: __m256i, ap: *const i8) -> __m256i {
    let sa = _mm256_sign_epi8(_mm256_loadu_si256(ap.cast()), w);
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, sa), ones))
}

/// [`rows`] for activation codes in `-127..=127` (every INT8 linear's: the quantizer clamps
/// to ±127), on the int8 operands as they are: `vpmaddubsw` multiplies |w| (unsigned, 128 for
/// -128) by the activation with w's sign (`vpsignb`, within ±127), so every product is
/// |w|·|a| ≤ 128·127 and a pair sum ≤ 32512 fits its int16 lane without saturating: exact,
/// the same int32 sums as [`rows`]. 32 bytes of a weight row cost no shuffle (`vpmovsxbw`
/// takes the one shuffle port), and the weight is not widened.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_signed<const R: usize, E: Epilogue>(
    a: *const i8,
    b: *const i8,
    k: usize,
    j0: usize,
    j1: usize,
    epi: &E,
) {
    let ones = _mm256_set1_epi16(1);
    let whole = k / 64 * 64;
    let thirty_two = k / 32 * 32;
    for j in j0..j1 {
        let w = b.add(j * k);
        let mut acc = [[_mm256_setzero_si256(); 2]; R];
        let mut t = 0;
        while t < whole {
            let w0 = _mm256_loadu_si256(w.add(t).cast());
            let w1 = _mm256_loadu_si256(w.add(t + 32).cast());
            let (a0, a1) = (_mm256_abs_epi8(w0), _mm256_abs_epi8(w1));
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[0] = step(acc[0], ones, a0, w0, a.add(r * k + t));
                acc[1] = step(acc[1], ones, a1, w1, a.add(r * k + t + 32));
            }
            t += 64;
        }
        if t < thirty_two {
            let w0 = _mm256_loadu_si256(w.add(t).cast());
            let a0 = _mm256_abs_epi8(w0);
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[0] = step(acc[0], ones, a0, w0, a.add(r * k + t));
            }
            t += 32;
        }
        for (r, acc) in acc.iter().enumerate() {
            let tail: i32 = (t..k)
                .map(|i| i32::from(*a.add(r * k + i)) * i32::from(*w.add(i)))
                .sum();
            epi.write(r, j, hsum(_mm256_add_epi32(acc[0], acc[1])) + tail);
        }
    }
}

/// Weight rows `j0..j1` against the `m` (1 to [`MR`] - 1) activation rows of a decode step,
/// whose codes are all in `-127..=127` ([`rows_signed`]).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `a` holds `m·k` and `b` at least `j1·k` elements.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block_signed<E: Epilogue>(
    a: &[i8],
    b: &[i8],
    m: usize,
    k: usize,
    j0: usize,
    j1: usize,
    epi: &E,
) {
    debug_assert!(m < MR && !a.contains(&i8::MIN));
    let (a, bp) = (a.as_ptr(), b.as_ptr());
    match m {
        1 => rows_signed::<1, E>(a, bp, k, j0, j1, epi),
        2 => rows_signed::<2, E>(a, bp, k, j0, j1, epi),
        _ => rows_signed::<3, E>(a, bp, k, j0, j1, epi),
    }
}

/// One `R`×[`NR`] tile of `Σ a·b` over the whole k.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(
    a: *const i16,
    b: *const i8,
    k: usize,
    rows: [usize; R],
    cols: [usize; NR],
) -> [[i32; NR]; R] {
    let mut acc = [[_mm256_setzero_si256(); NR]; R];
    let sixteen = k / 16 * 16;
    let mut t = 0;
    while t < sixteen {
        // Plain loops, not closures: a closure does not inherit the target features.
        let mut bv = [_mm256_setzero_si256(); NR];
        for c in 0..NR {
            bv[c] = widen(b.add(cols[c] * k + t));
        }
        for r in 0..R {
            let av = _mm256_loadu_si256(a.add(rows[r] * k + t).cast());
            for c in 0..NR {
                acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(av, bv[c]));
            }
        }
        t += 16;
    }
    let mut out = [[0i32; NR]; R];
    for r in 0..R {
        for c in 0..NR {
            out[r][c] = hsum(acc[r][c]) + tail(a.add(rows[r] * k), b.add(cols[c] * k), t, k);
        }
    }
    out
}

/// Weight rows `j0..j1` against every activation row (`a16`: the activations as int16).
///
/// # Safety
/// The CPU must have AVX2 and FMA; `a16` holds `m·k` and `b` at least `j1·k` elements.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn block<E: Epilogue>(
    a16: &[i16],
    b: &[i8],
    m: usize,
    k: usize,
    j0: usize,
    j1: usize,
    epi: &E,
) {
    let (a, bp) = (a16.as_ptr(), b.as_ptr());
    match m {
        1 => return rows::<1, E>(a, bp, k, j0, j1, epi),
        2 => return rows::<2, E>(a, bp, k, j0, j1, epi),
        3 => return rows::<3, E>(a, bp, k, j0, j1, epi),
        _ => {}
    }
    let whole = m / MR * MR;
    for jt in (j0..j1).step_by(NR) {
        let cols: [usize; NR] = std::array::from_fn(|c| (jt + c).min(j1 - 1));
        let ncols = NR.min(j1 - jt);
        for i0 in (0..whole).step_by(MR) {
            let rows: [usize; MR] = std::array::from_fn(|r| i0 + r);
            let acc = tile::<MR>(a, bp, k, rows, cols);
            for r in 0..MR {
                for c in 0..ncols {
                    epi.write(rows[r], cols[c], acc[r][c]);
                }
            }
        }
        for i in whole..m {
            let acc = tile::<1>(a, bp, k, [i], cols);
            for c in 0..ncols {
                epi.write(i, cols[c], acc[0][c]);
            }
        }
    }
}
