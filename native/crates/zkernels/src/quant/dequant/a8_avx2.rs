//! [`super::a8`]'s body on AVX2: INT4 codes times INT8 activation codes with `vpmaddubsw`.
//!
//! A task takes [`ROWS_PER_TASK`] weight rows and first lays their codes out as a tile of
//! panels of 8 rows: for each 32-column block and each of its 8 steps of 4 columns, one
//! 32-byte vector whose lane `l` (4 bytes) holds row `l`'s codes of those 4 columns, as
//! unsigned bytes `0..=15` (the nibbles widened, then an 8x8 transpose of 4-byte lanes);
//! beside it each panel's group scales (and zero points) as 8-lane vectors. The tile stays
//! in L1 while every activation row streams past it.
//!
//! The microkernel takes `R` activation rows by `P` panels. Per step it broadcasts each
//! row's 4 activation codes to the 8 lanes and `vpmaddubsw`s them with each panel's vector
//! (u8 x s8 -> i16 pairs), adding into 16-bit accumulators: over a block's 8 steps a lane
//! sums at most `8 · 2 · 15 · 127 = 30480`, inside i16. After the block `vpmaddwd` with ones
//! widens to i32 (that lane's row's `D_b`), converted to float and scaled once:
//! `acc += s_g · (D_b · sx_b - z · sx_b · S_b)` (symmetric: `z · sx_b · S_b` a scalar per row).

use super::a8::{A8Job, QuantizedRows, BLOCK};
use std::arch::x86_64::*;

/// Weight rows of one task (its tile: `ROWS_PER_TASK · k` bytes of codes).
pub(super) const ROWS_PER_TASK: usize = 32;
/// Weight rows of a panel: the 8 i32 lanes of a vector.
const LANES: usize = 8;
/// Panels of a task.
const PANELS: usize = ROWS_PER_TASK / LANES;
/// Activation rows of the microkernel.
const MR: usize = 4;
/// Panels of the microkernel.
const NP: usize = 2;
/// Steps (of 4 columns) in a block.
const STEPS: usize = BLOCK / 4;

/// A task's weight rows laid out for the microkernel.
struct Tile {
    /// `(panel, block, step)` -> 32 bytes.
    codes: Vec<__m256i>,
    /// `(panel, group)` -> 8 scales.
    scale: Vec<__m256>,
    /// `(panel, group)` -> 8 zero points (asymmetric weights only).
    zero: Vec<__m256>,
}

/// The 8x8 transpose of the 4-byte lanes of `r`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
    let t: [__m256i; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_epi32(a, b)
        } else {
            _mm256_unpackhi_epi32(a, b)
        }
    });
    // u[q]: lanes 4q'.. of rows 0-3 (q < 4) or 4-7; quads q (and q + 4 in the high half).
    let u = |lo: __m256i, hi: __m256i, high: bool| {
        if high {
            _mm256_unpackhi_epi64(lo, hi)
        } else {
            _mm256_unpacklo_epi64(lo, hi)
        }
    };
    let a = [
        u(t[0], t[2], false),
        u(t[0], t[2], true),
        u(t[1], t[3], false),
        u(t[1], t[3], true),
    ];
    let b = [
        u(t[4], t[6], false),
        u(t[4], t[6], true),
        u(t[5], t[7], false),
        u(t[5], t[7], true),
    ];
    std::array::from_fn(|s| {
        if s < 4 {
            _mm256_permute2x128_si256::<0x20>(a[s], b[s])
        } else {
            _mm256_permute2x128_si256::<0x31>(a[s - 4], b[s - 4])
        }
    })
}

/// Lays out weight rows `j0..j1` (at most [`ROWS_PER_TASK`]; missing rows are zero codes
/// with zero scales).
#[target_feature(enable = "avx2,fma")]
unsafe fn tile(job: &A8Job<'_>, j0: usize, j1: usize) -> Tile {
    let w = job.w;
    let (n, k, group) = (w.n, w.k, w.group);
    let (nb, groups) = (k / BLOCK, k.div_ceil(group)); // the last group may be shorter
    let per_tensor = w.scale.len() == groups && n != 1;
    let mut t = Tile {
        codes: vec![_mm256_setzero_si256(); PANELS * nb * STEPS],
        scale: vec![_mm256_setzero_ps(); PANELS * groups],
        zero: vec![_mm256_setzero_ps(); if w.zero.is_some() { PANELS * groups } else { 0 }],
    };
    let nibble = _mm_set1_epi8(15);
    for p in 0..(j1 - j0).div_ceil(LANES) {
        let rows = (j1 - j0 - p * LANES).min(LANES);
        for b in 0..nb {
            let r: [__m256i; 8] = std::array::from_fn(|l| {
                if l >= rows {
                    return _mm256_setzero_si256();
                }
                let j = j0 + p * LANES + l;
                let v = _mm_loadu_si128(w.data.as_ptr().add(j * k / 2 + b * BLOCK / 2).cast());
                let lo = _mm_and_si128(v, nibble);
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), nibble);
                _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi))
            });
            let s = transpose8(r);
            t.codes[(p * nb + b) * STEPS..][..STEPS].copy_from_slice(&s);
        }
        // Row l's scale (and zero point) of group g at `l · stride + g` past the panel's
        // first row (stride 0 per tensor); lanes past the weight's last row stay 0.
        let first = if per_tensor {
            0
        } else {
            (j0 + p * LANES) * groups
        };
        let stride = if per_tensor { 0 } else { groups as i32 };
        let lanes = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(stride),
        );
        let live = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(rows as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        let live = _mm256_castsi256_ps(live);
        let zero = _mm256_setzero_ps();
        for g in 0..groups {
            let at = _mm256_add_epi32(lanes, _mm256_set1_epi32(g as i32));
            let base = w.scale.as_ptr().add(first);
            t.scale[p * groups + g] = _mm256_mask_i32gather_ps::<4>(zero, base, at, live);
            if let Some(z) = w.zero {
                let zb = z.as_ptr().add(first);
                t.zero[p * groups + g] = _mm256_mask_i32gather_ps::<4>(zero, zb, at, live);
            }
        }
    }
    t
}

/// Output columns `j0..j1` (at most [`ROWS_PER_TASK`]) of every activation row.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `dequant_linear_a8` checked the shapes (an INT4 weight,
/// `k` and the group multiples of [`BLOCK`]).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn task(job: &A8Job<'_>, j0: usize, j1: usize) {
    let t = tile(job, j0, j1);
    let panels = (j1 - j0).div_ceil(LANES);
    if job.w.zero.is_some() {
        rows_of::<true>(job, &t, panels, j0, j1);
    } else {
        rows_of::<false>(job, &t, panels, j0, j1);
    }
}

/// Every activation row against the tile's `panels`, [`MR`] rows by [`NP`] panels at a time.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_of<const ASYM: bool>(
    job: &A8Job<'_>,
    t: &Tile,
    panels: usize,
    j0: usize,
    j1: usize,
) {
    let mut i0 = 0;
    while i0 < job.m {
        let r = (job.m - i0).min(MR);
        let mut p0 = 0;
        while p0 < panels {
            let np = (panels - p0).min(NP);
            let at = (i0, p0, j0, j1);
            match (r, np) {
                (1, 1) => kernel::<1, 1, ASYM>(job, t, at),
                (1, _) => kernel::<1, 2, ASYM>(job, t, at),
                (2, 1) => kernel::<2, 1, ASYM>(job, t, at),
                (2, _) => kernel::<2, 2, ASYM>(job, t, at),
                (3, 1) => kernel::<3, 1, ASYM>(job, t, at),
                (3, _) => kernel::<3, 2, ASYM>(job, t, at),
                (_, 1) => kernel::<4, 1, ASYM>(job, t, at),
                (_, _) => kernel::<4, 2, ASYM>(job, t, at),
            }
            p0 += np;
        }
        i0 += r;
    }
}

/// `acc + maddubs(w, x)`: 16 pairs of u8 x s8 products added into 16 i16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_add(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
}

/// 4 activation codes at `p` broadcast to the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// Activation rows `i0..i0 + R` against panels `p0..p0 + P` of the tile of weight rows
/// `j0..j1`: `R · P` i16 accumulators for a block, as many f32 ones across blocks.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel<const R: usize, const P: usize, const ASYM: bool>(
    job: &A8Job<'_>,
    t: &Tile,
    (i0, p0, j0, j1): (usize, usize, usize, usize),
) {
    let (k, group) = (job.w.k, job.w.group);
    let (nb, groups) = (k / BLOCK, k.div_ceil(group)); // the last group may be shorter
    let per_group = group / BLOCK;
    let q = job.q;
    let x0 = q.codes.as_ptr().add(i0 * k);
    let w0 = t.codes.as_ptr().add(p0 * nb * STEPS);
    let mut accf = [[_mm256_setzero_ps(); P]; R];
    let (mut g, mut left) = (0, per_group);
    for b in 0..nb {
        let mut acc = [[_mm256_setzero_si256(); P]; R];
        let wb = w0.add(b * STEPS);
        let xb = x0.add(b * BLOCK);
        // An opaque trip count: unrolled, LLVM hoisted all 8 steps' loads and spilled them.
        for s in 0..std::hint::black_box(STEPS) {
            let mut wv = [_mm256_setzero_si256(); P];
            for (p, v) in wv.iter_mut().enumerate() {
                *v = *wb.add(p * nb * STEPS + s);
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let x = bcast4(xb.add(i * k + 4 * s));
                for p in 0..P {
                    a[p] = dot_add(a[p], wv[p], x);
                }
            }
        }
        for (i, (af, a)) in accf.iter_mut().zip(&acc).enumerate() {
            let at = (i0 + i) * nb + b;
            for p in 0..P {
                let tg = (p0 + p) * groups + g;
                let z = if ASYM {
                    *t.zero.get_unchecked(tg)
                } else {
                    _mm256_setzero_ps()
                };
                let d = _mm256_madd_epi16(a[p], _mm256_set1_epi16(1));
                af[p] = fold::<ASYM>(af[p], d, q, at, z, *t.scale.get_unchecked(tg));
            }
        }
        left -= 1;
        if left == 0 {
            (g, left) = (g + 1, per_group);
        }
    }
    for (i, af) in accf.iter().enumerate() {
        for (p, v) in af.iter().enumerate() {
            store(job, *v, i0 + i, j0 + (p0 + p) * LANES, j1);
        }
    }
}

/// `f + s_g · (D · sx - zterm)` for the block's exact sums `d` (8 weight rows) of activation
/// row/block `at`: `zterm` is `zsum` (symmetric) or `z · zsum` (zero points `z`), `s` the
/// rows' scales of the block's group. (The GEMV body, [`super::a8_gemv_avx2`], folds with
/// this too: the same bits.)
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fold<const ASYM: bool>(
    f: __m256,
    d: __m256i,
    q: &QuantizedRows,
    at: usize,
    z: __m256,
    s: __m256,
) -> __m256 {
    let d = _mm256_cvtepi32_ps(d);
    let sx = _mm256_set1_ps(*q.scale.get_unchecked(at));
    let zs = _mm256_set1_ps(*q.zsum.get_unchecked(at));
    let inner = if ASYM {
        _mm256_fnmadd_ps(z, zs, _mm256_mul_ps(d, sx))
    } else {
        _mm256_fmsub_ps(d, sx, zs)
    };
    _mm256_fmadd_ps(inner, s, f)
}

/// Row `i` of the output, columns `jp..` (8, or as many as are left below `j1`), `v` plus
/// the bias.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn store(job: &A8Job<'_>, v: __m256, i: usize, jp: usize, j1: usize) {
    let mut y = [0f32; LANES];
    _mm256_storeu_ps(y.as_mut_ptr(), v);
    let out = job.out.get().add(i * job.w.n);
    for (l, yl) in y.iter().enumerate().take(j1.saturating_sub(jp).min(LANES)) {
        // SAFETY: column jp + l of row i belongs to this task alone.
        *out.add(jp + l) = yl + job.bias.map_or(0.0, |b| b[jp + l]);
    }
}

/// [`super::a8::quantize_activations`]' rounding on AVX2, bit-equal to the portable body:
/// each 32-column block of `x` to codes, its scale and `zmul · sx · S`.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `x.len() % 32 == 0`, `codes` as long as `x`, `scale`
/// and `zsum` one element per block.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize(
    x: &[f32],
    zmul: f32,
    codes: &mut [i8],
    scale: &mut [f32],
    zsum: &mut [f32],
) {
    let sign = _mm256_set1_ps(-0.0);
    let inf = _mm256_set1_ps(f32::INFINITY);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (blk, (xb, cb)) in x
        .chunks_exact(BLOCK)
        .zip(codes.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        let v: [__m256; 4] = std::array::from_fn(|c| _mm256_loadu_ps(xb.as_ptr().add(8 * c)));
        let a: [__m256; 4] = std::array::from_fn(|c| _mm256_andnot_ps(sign, v[c]));
        let fin = _mm256_and_ps(
            _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_LT_OQ>(a[0], inf),
                _mm256_cmp_ps::<_CMP_LT_OQ>(a[1], inf),
            ),
            _mm256_and_ps(
                _mm256_cmp_ps::<_CMP_LT_OQ>(a[2], inf),
                _mm256_cmp_ps::<_CMP_LT_OQ>(a[3], inf),
            ),
        );
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let finite = _mm256_movemask_ps(fin) == 0xFF;
        if amax == 0.0 || !finite {
            _mm256_storeu_si256(cb.as_mut_ptr().cast(), _mm256_setzero_si256());
            scale[blk] = if finite { 0.0 } else { f32::NAN };
            zsum[blk] = scale[blk];
            continue;
        }
        let inv = _mm256_set1_ps(127.0 / amax);
        let c: [__m256i; 4] = std::array::from_fn(|i| _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(c[0], c[1]),
            _mm256_packs_epi32(c[2], c[3]),
        );
        _mm256_storeu_si256(
            cb.as_mut_ptr().cast(),
            _mm256_permutevar8x32_epi32(packed, order),
        );
        let sum = crate::avx2::hsum_epi32(_mm256_add_epi32(
            _mm256_add_epi32(c[0], c[1]),
            _mm256_add_epi32(c[2], c[3]),
        ));
        let sx = amax / 127.0;
        scale[blk] = sx;
        zsum[blk] = zmul * (sx * sum as f32);
    }
}
