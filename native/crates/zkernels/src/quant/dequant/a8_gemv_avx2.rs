//! [`super::a8`]'s body on AVX2 for a decode step's few activation rows (1 to [`MAX_ROWS`]):
//! the INT4 codes are widened in registers straight from the weight, with no tile.
//!
//! The tile body ([`super::a8_avx2`]) lays a task's 32 weight rows out as panels first; at
//! one activation row that layout costs as much as the product. Here a weight row's codes
//! of two 32-column blocks (32 bytes) are split into low nibbles (even columns) and high
//! nibbles (odd columns) and `vpmaddubsw`-ed with the activation codes, which the caller
//! reordered to match ([`split_codes`]); `vpmaddwd` with ones gives 8 i32 partial sums (4 per
//! block). Eight weight rows (a panel) are then reduced with `vphaddd` twice and a 128-bit
//! permute into one vector per block whose lane `l` is row `l`'s exact integer sum `D_b`,
//! and folded with [`super::a8_avx2::fold`], the tile body's own fold. So each output is the
//! same float operations in the same order as the tile body's: the two bodies give the same
//! bits, and a row's outputs do not depend on how many rows share its call.

use super::a8::{A8Job, QuantizedRows, BLOCK};
use super::a8_avx2::{fold, store};
use std::arch::x86_64::*;

/// Most activation rows this body takes (more run the tile body).
pub(super) const MAX_ROWS: usize = 4;
/// Weight rows of a panel: one i32 lane each in the fold.
pub(super) const PANEL: usize = 8;

/// Activation codes `(m, k)` reordered for [`rows`]: per pair of 32-column blocks
/// `(b, b + 1)`, 64 bytes `[b even | b+1 even | b odd | b+1 odd]` (16 codes each); a lone
/// last block as `[even | odd]`.
pub(super) fn split_codes(codes: &[i8], k: usize) -> Vec<i8> {
    let mut out = vec![0i8; codes.len()];
    for (src, dst) in codes.chunks_exact(k).zip(out.chunks_exact_mut(k)) {
        for (s, d) in src.chunks(2 * BLOCK).zip(dst.chunks_mut(2 * BLOCK)) {
            let blocks = s.len() / BLOCK; // 2, or 1 for a lone last block
            for (b, sb) in s.chunks_exact(BLOCK).enumerate() {
                for t in 0..BLOCK / 2 {
                    d[b * BLOCK / 2 + t] = sb[2 * t];
                    d[(blocks + b) * BLOCK / 2 + t] = sb[2 * t + 1];
                }
            }
        }
    }
    out
}

/// Output columns `j0..j1` of every activation row (`job.m` at most [`MAX_ROWS`]), `xs` the
/// codes of [`split_codes`].
///
/// # Safety
/// The CPU must have AVX2 and FMA; `dequant_linear_a8` checked the shapes (an INT4 weight,
/// `k` and the group multiples of [`BLOCK`]); the task writes columns `j0..j1` alone.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(job: &A8Job<'_>, xs: &[i8], j0: usize, j1: usize) {
    let asym = job.w.zero.is_some();
    match (job.m, asym) {
        (1, false) => panels::<1, false>(job, xs, j0, j1),
        (2, false) => panels::<2, false>(job, xs, j0, j1),
        (3, false) => panels::<3, false>(job, xs, j0, j1),
        (_, false) => panels::<4, false>(job, xs, j0, j1),
        (1, true) => panels::<1, true>(job, xs, j0, j1),
        (2, true) => panels::<2, true>(job, xs, j0, j1),
        (3, true) => panels::<3, true>(job, xs, j0, j1),
        (_, true) => panels::<4, true>(job, xs, j0, j1),
    }
}

/// Constants of the widening: the nibble mask and the `vpmaddwd` ones.
#[derive(Clone, Copy)]
struct Consts {
    nibble: __m256i,
    ones: __m256i,
}

/// Weight rows `j0..j1` against the `R` activation rows, a panel of [`PANEL`] rows at a
/// time (a last short panel repeats its last row; those lanes are not stored).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn panels<const R: usize, const ASYM: bool>(
    job: &A8Job<'_>,
    xs: &[i8],
    j0: usize,
    j1: usize,
) {
    let w = job.w;
    let (n, k, group) = (w.n, w.k, w.group);
    let (nb, groups) = (k / BLOCK, k.div_ceil(group)); // the last group may be shorter
    let per_group = group / BLOCK;
    let per_tensor = w.scale.len() == groups && n != 1;
    let c = Consts {
        nibble: _mm256_set1_epi8(15),
        ones: _mm256_set1_epi16(1),
    };
    let mut p0 = j0;
    while p0 < j1 {
        let last = (j1 - p0).min(PANEL) - 1;
        let rows: [*const u8; PANEL] =
            std::array::from_fn(|l| w.data.as_ptr().add((p0 + l.min(last)) * k / 2));
        // Row l's scale (and zero point) of group g at `sbase + lanes[l] + g`.
        let stride = if per_tensor { 0 } else { groups };
        let sbase = if per_tensor { 0 } else { p0 * groups };
        let lanes: [usize; PANEL] = std::array::from_fn(|l| l.min(last) * stride);
        let idx = _mm256_setr_epi32(
            lanes[0] as i32,
            lanes[1] as i32,
            lanes[2] as i32,
            lanes[3] as i32,
            lanes[4] as i32,
            lanes[5] as i32,
            lanes[6] as i32,
            lanes[7] as i32,
        );
        let scale = w.scale.as_ptr().add(sbase);
        let zero = w.zero.map(|z| z.as_ptr().add(sbase));
        let gather = |g: usize| {
            let z = zero.map_or(_mm256_setzero_ps(), |z| {
                _mm256_i32gather_ps::<4>(z.add(g), idx)
            });
            (_mm256_i32gather_ps::<4>(scale.add(g), idx), z)
        };
        let (mut s, mut z) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut f = [_mm256_setzero_ps(); R];
        // The group of the next block, and its blocks left (no division in the loop).
        let (mut g, mut left) = (0, 0);
        for bp in 0..nb / 2 {
            let b = 2 * bp;
            let (d0, d1) = pair::<R>(&rows, b * BLOCK / 2, xs.as_ptr().add(b * BLOCK), k, c);
            if per_group == 1 {
                // Blocks b and b + 1 are groups b and b + 1: 8 bytes a row hold both scales.
                let (s0, s1) = two_groups(scale.add(b), &lanes);
                let (z0, z1) = zero.map_or((s, s), |z| two_groups(z.add(b), &lanes));
                fold_rows::<R, ASYM>(&mut f, &d0, job.q, b, z0, s0);
                fold_rows::<R, ASYM>(&mut f, &d1, job.q, b + 1, z1, s1);
                continue;
            }
            for (blk, d) in [(b, d0), (b + 1, d1)] {
                if left == 0 {
                    ((s, z), g, left) = (gather(g), g + 1, per_group);
                }
                left -= 1;
                fold_rows::<R, ASYM>(&mut f, &d, job.q, blk, z, s);
            }
        }
        if nb % 2 == 1 {
            let b = nb - 1;
            let d = single::<R>(&rows, b * BLOCK / 2, xs.as_ptr().add(b * BLOCK), k, c);
            if per_group == 1 || left == 0 {
                (s, z) = gather((b * BLOCK) / group);
            }
            fold_rows::<R, ASYM>(&mut f, &d, job.q, b, z, s);
        }
        for (i, v) in f.iter().enumerate() {
            store(job, *v, i, p0, j1);
        }
        p0 += PANEL;
    }
}

/// [`fold`] of block `b`'s sums `d` into each activation row's accumulator.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fold_rows<const R: usize, const ASYM: bool>(
    f: &mut [__m256; R],
    d: &[__m256i; R],
    q: &QuantizedRows,
    b: usize,
    z: __m256,
    s: __m256,
) {
    let nb = q.scale.len() / R;
    for i in 0..R {
        f[i] = fold::<ASYM>(f[i], d[i], q, i * nb + b, z, s);
    }
}

/// The 8 rows' values of groups `g` and `g + 1` (`p` at group `g` of the panel's first row,
/// row `l` at `p + lanes[l]`), one 8-byte load a row and two shuffles.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn two_groups(p: *const f32, lanes: &[usize; PANEL]) -> (__m256, __m256) {
    let two = |a: usize, b: usize| {
        let lo = _mm_load_sd(p.add(lanes[a]).cast());
        _mm_castpd_ps(_mm_loadh_pd(lo, p.add(lanes[b]).cast()))
    };
    // [r0 g, r0 g+1, r1 g, r1 g+1 | r4 .., r5 ..] and the same for rows 2-3 | 6-7.
    let a = _mm256_set_m128(two(4, 5), two(0, 1));
    let b = _mm256_set_m128(two(6, 7), two(2, 3));
    (
        _mm256_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm256_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}

/// The panel's exact sums `D` of blocks `b` and `b + 1` (lane `l`: weight row `l`) for each
/// activation row: `off` the blocks' first byte in a weight row, `x` their 64 split codes
/// in activation row 0 (row `i` at `x + i · k`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pair<const R: usize>(
    rows: &[*const u8; PANEL],
    off: usize,
    x: *const i8,
    k: usize,
    c: Consts,
) -> ([__m256i; R], [__m256i; R]) {
    let halves = reduce::<R, false>(rows, off, x, k, c);
    (
        std::array::from_fn(|i| _mm256_permute2x128_si256::<0x20>(halves[i][0], halves[i][1])),
        std::array::from_fn(|i| _mm256_permute2x128_si256::<0x31>(halves[i][0], halves[i][1])),
    )
}

/// [`pair`] for one block alone (its 16 bytes at `off`, its 32 split codes at `x`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn single<const R: usize>(
    rows: &[*const u8; PANEL],
    off: usize,
    x: *const i8,
    k: usize,
    c: Consts,
) -> [__m256i; R] {
    let halves = reduce::<R, true>(rows, off, x, k, c);
    // Each half holds the even columns' and the odd columns' sums of the same block.
    std::array::from_fn(|i| {
        let (a, b) = (halves[i][0], halves[i][1]);
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(a, b),
            _mm256_permute2x128_si256::<0x31>(a, b),
        )
    })
}

/// Weight row `l`'s 8 i32 partial sums (4 per 128-bit half) for each activation row: two
/// blocks (32 bytes at `off`, 64 split codes at `x`), or with `ONE` one block (16 bytes,
/// 32 codes: even columns' sums in the low half, odd columns' in the high).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn sums<const R: usize, const ONE: bool>(
    row: *const u8,
    off: usize,
    x: *const i8,
    k: usize,
    c: Consts,
) -> [__m256i; R] {
    if ONE {
        let v = _mm_loadu_si128(row.add(off).cast());
        let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(v), v), c.nibble);
        std::array::from_fn(|i| {
            let xv = _mm256_loadu_si256(x.add(i * k).cast());
            _mm256_madd_epi16(_mm256_maddubs_epi16(v, xv), c.ones)
        })
    } else {
        let v = _mm256_loadu_si256(row.add(off).cast());
        let lo = _mm256_and_si256(v, c.nibble);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), c.nibble);
        std::array::from_fn(|i| {
            let xe = _mm256_loadu_si256(x.add(i * k).cast());
            let xo = _mm256_loadu_si256(x.add(i * k + BLOCK).cast());
            let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
            _mm256_madd_epi16(p, c.ones)
        })
    }
}

/// The panel's 8 rows of [`sums`] reduced across lanes: per activation row
/// `[rows 0-3 of the low halves | rows 0-3 of the high halves]` and the same for rows 4-7.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce<const R: usize, const ONE: bool>(
    rows: &[*const u8; PANEL],
    off: usize,
    x: *const i8,
    k: usize,
    c: Consts,
) -> [[__m256i; 2]; R] {
    let lo = reduce4::<R, ONE>(rows, 0, off, x, k, c);
    let hi = reduce4::<R, ONE>(rows, 4, off, x, k, c);
    std::array::from_fn(|i| [lo[i], hi[i]])
}

/// [`reduce`]'s half: rows `l..l + 4`, `[4 low-half sums | 4 high-half sums]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce4<const R: usize, const ONE: bool>(
    rows: &[*const u8; PANEL],
    l: usize,
    off: usize,
    x: *const i8,
    k: usize,
    c: Consts,
) -> [__m256i; R] {
    let d0 = sums::<R, ONE>(rows[l], off, x, k, c);
    let d1 = sums::<R, ONE>(rows[l + 1], off, x, k, c);
    let q0: [__m256i; R] = std::array::from_fn(|i| _mm256_hadd_epi32(d0[i], d1[i]));
    let d2 = sums::<R, ONE>(rows[l + 2], off, x, k, c);
    let d3 = sums::<R, ONE>(rows[l + 3], off, x, k, c);
    std::array::from_fn(|i| _mm256_hadd_epi32(q0[i], _mm256_hadd_epi32(d2[i], d3[i])))
}
