//! [`super::int8`]'s tests: every SIMD level against the definition.

use super::*;
use crate::simd::{detected, set_override, SimdLevel};

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

fn reference(a: &[i8], b: &[i8], m: usize, n: usize, k: usize) -> Vec<i32> {
    let mut out = vec![0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|t| i32::from(a[i * k + t]) * i32::from(b[j * k + t]))
                .sum();
        }
    }
    out
}

#[test]
fn gemm_matches_scalar_reference_at_every_level() {
    let mut seed = 7;
    let levels = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];
    for &(m, n, k) in &[
        (1, 1, 1),
        (3, 5, 7),
        (4, 4, 64),
        (17, 70, 130),
        (5, 131, 576),
        (16, 64, 1),
        (1, 200, 1536),
        (2, 9, 65),
        (6, 33, 64),
    ] {
        let a: Vec<i8> = (0..m * k)
            .map(|_| (lcg(&mut seed) % 256) as u8 as i8)
            .collect();
        let b: Vec<i8> = (0..n * k)
            .map(|_| ((lcg(&mut seed) % 255) as i32 - 127) as i8)
            .collect();
        let want = reference(&a, &b, m, n, k);
        for &level in levels.iter().filter(|&&l| l <= detected()) {
            set_override(Some(level)).unwrap();
            let mut out = vec![0; m * n];
            int8_gemm(&a, &b, &mut out, m, n, k).unwrap();
            assert_eq!(out, want, "level {level:?} shape {m}x{n}x{k}");
        }
        set_override(None).unwrap();
    }
}

#[test]
fn extreme_values_are_exact() {
    let (m, n, k) = (5, 4, 1000);
    for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
        .iter()
        .filter(|&&l| l <= detected())
    {
        set_override(Some(level)).unwrap();
        for wv in [-127i8, -128] {
            let a = vec![-128i8; m * k];
            let b = vec![wv; n * k];
            let mut out = vec![0; m * n];
            int8_gemm(&a, &b, &mut out, m, n, k).unwrap();
            let want = 128 * -i32::from(wv) * 1000;
            assert!(out.iter().all(|&v| v == want), "{level:?} {wv}");
        }
    }
    set_override(None).unwrap();
}

#[test]
fn tokenwise_quantization_matches_definition() {
    let x: Vec<f32> = (0..3 * 10)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
        .collect();
    let mut q = vec![0; 30];
    let mut s = vec![0.0; 3];
    quantize_tokenwise(&x, 3, 10, 8, &mut q, &mut s).unwrap();
    for i in 0..3 {
        let row = &x[i * 10..(i + 1) * 10];
        let absmax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(s[i], absmax / 127.0);
        for t in 0..10 {
            let want = (row[t] / s[i]).round_ties_even().clamp(-127.0, 127.0) as i8;
            assert_eq!(q[i * 10 + t], want);
        }
    }
    let mut zq = vec![1; 4];
    let mut zs = vec![0.0; 1];
    quantize_tokenwise(&[0.0; 4], 1, 4, 8, &mut zq, &mut zs).unwrap();
    assert_eq!((zq, zs), (vec![0; 4], vec![1.0]));
    assert!(quantize_tokenwise(&x, 3, 10, 9, &mut q, &mut s).is_err());
}

#[test]
fn linear_applies_scales_and_bias() {
    let (m, n, k) = (5, 6, 33);
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.1)
        .collect();
    let w: Vec<i8> = (0..n * k)
        .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
        .collect();
    let ws: Vec<f32> = (0..n).map(|j| 0.01 * (j + 1) as f32).collect();
    let bias: Vec<f32> = (0..n).map(|j| j as f32).collect();
    let mut out = vec![0.0; m * n];
    int8_linear(&x, &w, &ws, Some(&bias), &mut out, m, n, k).unwrap();
    let mut q = vec![0; m * k];
    let mut s = vec![0.0; m];
    quantize_tokenwise(&x, m, k, 8, &mut q, &mut s).unwrap();
    let acc = reference(&q, &w, m, n, k);
    for i in 0..m {
        for j in 0..n {
            assert_eq!(
                out[i * n + j],
                acc[i * n + j] as f32 * (s[i] * ws[j]) + bias[j]
            );
        }
    }
    assert!(int8_linear(&x, &w, &ws[..2], None, &mut out, m, n, k).is_err());
}

/// 1-3 activation rows with no -128 code (every linear's: AVX2's `vpmaddubsw` sign body) at
/// every level against the definition: k of whole 64- and 32-byte steps and tails, random
/// codes, and the extremes (|w·a| pairs of 128·127 each, the int16 lanes' largest sums).
#[test]
fn decode_rows_without_minus_128_match_at_every_level() {
    let mut seed = 5;
    let levels = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];
    for &(m, n, k) in &[
        (1, 70, 576),
        (2, 9, 1536),
        (3, 5, 100),
        (1, 3, 31),
        (2, 4, 96),
    ] {
        let a: Vec<i8> = (0..m * k)
            .map(|_| lcg(&mut seed) as i8)
            .map(|v| if v == i8::MIN { 127 } else { v })
            .collect();
        let b: Vec<i8> = (0..n * k).map(|_| lcg(&mut seed) as i8).collect();
        let want = reference(&a, &b, m, n, k);
        for &level in levels.iter().filter(|&&l| l <= detected()) {
            set_override(Some(level)).unwrap();
            let mut out = vec![0; m * n];
            int8_gemm(&a, &b, &mut out, m, n, k).unwrap();
            assert_eq!(out, want, "{level:?} {m}x{n}x{k}");
            for (av, bv) in [(-127i8, -128i8), (127, -128), (-127, 127), (127, 127)] {
                let (a, b) = (vec![av; m * k], vec![bv; n * k]);
                int8_gemm(&a, &b, &mut out, m, n, k).unwrap();
                let v = i32::from(av) * i32::from(bv) * k as i32;
                assert!(out.iter().all(|&o| o == v), "{level:?} {av}·{bv}");
            }
        }
        set_override(None).unwrap();
    }
}

/// Token-wise INT8 codes at every SIMD level equal the definition, to the code: ties to even,
/// the clamp, a zero row, and a NaN (code 0) or infinite input.
#[test]
fn tokenwise_codes_match_the_definition_at_every_level() {
    let (m, k) = (4, 67);
    let mut x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37)
        .collect();
    // Row 0's scale is 1 (absmax 127): 2.5 and -3.5 are ties, to 2 and -4.
    x[..3].copy_from_slice(&[127.0, 2.5, -3.5]);
    x[k + 3] = f32::NAN;
    x[2 * k..3 * k].fill(0.0);
    x[3 * k + 9] = f32::INFINITY;
    for bits in [8, 4] {
        let qmax = ((1i32 << (bits - 1)) - 1) as f32;
        for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .iter()
            .filter(|&&l| l <= detected())
        {
            set_override(Some(level)).unwrap();
            let (mut q, mut s) = (vec![9i8; m * k], vec![0f32; m]);
            quantize_tokenwise(&x, m, k, bits, &mut q, &mut s).unwrap();
            for i in 0..m {
                for t in 0..k {
                    let want = (x[i * k + t] / s[i]).round_ties_even().clamp(-qmax, qmax) as i8;
                    assert_eq!(q[i * k + t], want, "{level:?} bits={bits} ({i}, {t})");
                }
            }
            assert_eq!(s[2], 1.0);
            if bits == 8 {
                assert_eq!((s[0], q[1], q[2]), (1.0, 2, -4), "{level:?}");
            }
        }
        set_override(None).unwrap();
    }
}
