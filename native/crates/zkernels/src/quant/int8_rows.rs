//! The INT8 GEMM's body for a decode step's few activation rows (fewer than the 4-row
//! tile of [`super::int8`]), AVX-512 VNNI. Same arithmetic as the tile (`vpdpbusd` of
//! the activations + 128 with the signed weights, `128 · Σ_k w[j, k]` summed in the same
//! pass and subtracted), so the int32 results are exact and equal the tile's.

use super::int8::Epilogue;
use std::arch::x86_64::*;

/// Accumulator pairs along k per activation row in [`rows`].
const KA: usize = 2;

/// The lane-wise sum of `KA` accumulators.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
unsafe fn fold(v: [__m512i; KA]) -> __m512i {
    let mut s = v[0];
    for &x in &v[1..] {
        s = _mm512_add_epi32(s, x); // a loop, not a closure: see `int8::vnni::tile`
    }
    s
}

/// Weight rows `j0..j1` against the `R < MR` activation rows of a decode step, one
/// weight row at a time front to back: the block is one sequential stream the
/// hardware prefetcher follows across rows. (Tiles of NR weight rows read NR
/// streams k apart that restarted cold every NR rows; SmolLM2's INT8 matrices,
/// never in cache, streamed at about half the rate of one stream.) `KA`
/// accumulators along k keep the `vpdpbusd` chains independent.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub(super) unsafe fn rows<const R: usize, E: Epilogue>(
    a: *const u8,
    b: *const i8,
    k: usize,
    j0: usize,
    j1: usize,
    epi: &E,
) {
    let bias = _mm512_set1_epi8(-128);
    let whole = k / (64 * KA) * (64 * KA);
    for j in j0..j1 {
        let w = b.add(j * k);
        let mut acc = [[_mm512_setzero_si512(); KA]; R];
        let mut comp = [_mm512_setzero_si512(); KA];
        let mut t = 0;
        while t < whole {
            for q in 0..KA {
                let bv = _mm512_loadu_si512(w.add(t + 64 * q).cast());
                comp[q] = _mm512_dpbusd_epi32(comp[q], bias, bv);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let av = _mm512_loadu_si512(a.add(r * k + t + 64 * q).cast());
                    acc[q] = _mm512_dpbusd_epi32(acc[q], av, bv);
                }
            }
            t += 64 * KA;
        }
        while t < k {
            let mask: __mmask64 = if k - t >= 64 {
                u64::MAX
            } else {
                (1u64 << (k - t)) - 1
            };
            let bv = _mm512_maskz_loadu_epi8(mask, w.add(t).cast());
            comp[0] = _mm512_dpbusd_epi32(comp[0], bias, bv);
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_maskz_loadu_epi8(mask, a.add(r * k + t).cast());
                acc[0] = _mm512_dpbusd_epi32(acc[0], av, bv);
            }
            t += 64;
        }
        let comp = _mm512_reduce_add_epi32(fold(comp));
        for (r, acc) in acc.iter().enumerate() {
            epi.write(r, j, _mm512_reduce_add_epi32(fold(*acc)) - comp);
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::quant::int8_gemm;

    /// `int8_gemm` of 1-3 activation rows (this body where VNNI runs) against the
    /// definition: k with and without a tail past the 128-byte step, and the extremes.
    #[test]
    fn decode_rows_match_the_definition() {
        let mut seed = 11u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as i32
        };
        for &(m, n, k) in &[
            (3, 70, 576),
            (1, 5, 200),
            (2, 3, 128),
            (1, 9, 1536),
            (3, 4, 7),
        ] {
            let a: Vec<i8> = (0..m * k).map(|_| (next() % 256 - 128) as i8).collect();
            let b: Vec<i8> = (0..n * k).map(|_| (next() % 255 - 127) as i8).collect();
            let mut out = vec![0; m * n];
            int8_gemm(&a, &b, &mut out, m, n, k).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: i32 = (0..k)
                        .map(|t| i32::from(a[i * k + t]) * i32::from(b[j * k + t]))
                        .sum();
                    assert_eq!(out[i * n + j], want, "{m}x{n}x{k} ({i}, {j})");
                }
            }
        }
        for m in [1, 3] {
            let (n, k) = (5, 1000);
            let (a, b) = (vec![-128i8; m * k], vec![-127i8; n * k]);
            let mut out = vec![0; m * n];
            int8_gemm(&a, &b, &mut out, m, n, k).unwrap();
            assert!(out.iter().all(|&v| v == 128 * 127 * 1000), "{m} rows");
        }
    }
}
