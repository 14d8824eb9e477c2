//! The dequantize and the fused linear against the formats' definitions, computed
//! here without bit tricks.

use super::fixture::{at_every_level, lcg};
use super::weight::fp6_value;
use super::{dequant_linear, dequantize, PackedWeight, WeightFormat};
use crate::quant::QuantError;

/// The definition of e3m2 with bias 3, computed without bit tricks.
fn fp6_definition(code: u32) -> f32 {
    let sign = if code & 0x20 != 0 { -1.0 } else { 1.0 };
    let (e, mant) = ((code >> 2) & 7, (code & 3) as f32);
    let mag = if e == 0 {
        mant / 4.0 * 0.25
    } else {
        (1.0 + mant / 4.0) * 2f32.powi(e as i32 - 3)
    };
    sign * mag
}

#[test]
fn fp6_bit_decode_matches_definition_for_all_codes() {
    for code in 0..64 {
        let (got, want) = (fp6_value(code), fp6_definition(code));
        assert_eq!(got.to_bits(), want.to_bits(), "code {code}");
    }
}

fn pack(codes: &[u32], bits: u32) -> Vec<u8> {
    let per = (8 / bits) as usize;
    codes
        .chunks(per)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u8, |b, (i, &v)| b | ((v as u8) << (i as u32 * bits)))
        })
        .collect()
}

fn scalar_ref(
    codes: &[u32],
    scale: &[f32],
    n: usize,
    k: usize,
    group: usize,
    fp6: bool,
) -> Vec<f32> {
    let groups = k.div_ceil(group);
    let mut out = vec![0.0; n * k];
    for j in 0..n {
        for c in 0..k {
            let s = scale[if scale.len() == groups { 0 } else { j * groups } + c / group];
            let code = codes[j * k + c];
            out[j * k + c] = if fp6 {
                fp6_definition(code) * s
            } else {
                (code as f32 - 8.0) * s
            };
        }
    }
    out
}

#[test]
fn int4_and_fp6_dequantize_and_linear_match_reference() {
    check_linear_shapes(&[
        (5, 7, 7, 3),
        (33, 576, 128, 4),
        (17, 100, 32, 1),
        (4, 64, 3, 2),
    ]);
}

/// The tile path (rows past the GEMV's, FP6 at any rows) at every SIMD level: an odd row
/// count (the AVX2 tile's pairs and its lone last row), weight rows not a multiple of 4,
/// k with and without an 8-wide tail.
#[test]
fn tile_path_matches_reference_at_every_level() {
    at_every_level(|_| {
        check_linear_shapes(&[(17, 100, 32, 11), (33, 576, 32, 70), (6, 36, 12, 9)]);
    });
}

/// `dequantize` and `dequant_linear` of random INT4 and FP6 weights `(n, k)` in groups of
/// `group` against the definitions, at `m` activation rows, for each `(n, k, group, m)`.
fn check_linear_shapes(shapes: &[(usize, usize, usize, usize)]) {
    let mut next = lcg(3);
    for &(n, k, group, m) in shapes {
        let groups = k.div_ceil(group);
        let scale: Vec<f32> = (0..n * groups).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let x: Vec<f32> = (0..m * k)
            .map(|_| next() as f32 / 2f32.powi(31) - 0.5)
            .collect();
        let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.5).collect();
        for fp6 in [false, true] {
            let codes: Vec<u32> = (0..n * k)
                .map(|_| next() % if fp6 { 64 } else { 16 })
                .collect();
            let (mut p4, mut p2) = (Vec::new(), Vec::new());
            for row in codes.chunks(k) {
                p4.extend(pack(&row.iter().map(|c| c & 15).collect::<Vec<_>>(), 4));
                p2.extend(pack(&row.iter().map(|c| c >> 4).collect::<Vec<_>>(), 2));
            }
            let w = PackedWeight {
                format: if fp6 {
                    WeightFormat::Fp6
                } else {
                    WeightFormat::Int4 { offset: 8 }
                },
                data: &p4,
                data2: fp6.then_some(&p2[..]),
                scale: &scale,
                zero: None,
                n,
                k,
                group,
            };
            let want = scalar_ref(&codes, &scale, n, k, group, fp6);
            let mut got = vec![0.0; n * k];
            dequantize(&w, &mut got).unwrap();
            assert_eq!(got, want, "dequantize fp6={fp6} {n}x{k} g{group}");
            let mut y = vec![0.0; m * n];
            dequant_linear(&x, &w, Some(&bias), &mut y, m).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let exact: f64 = (0..k)
                        .map(|c| f64::from(x[i * k + c]) * f64::from(want[j * k + c]))
                        .sum();
                    let mag: f64 = (0..k)
                        .map(|c| f64::from((x[i * k + c] * want[j * k + c]).abs()))
                        .sum();
                    let err = (f64::from(y[i * n + j]) - exact - f64::from(bias[j])).abs();
                    assert!(
                        err <= 1e-5 * (mag + 1.0),
                        "linear fp6={fp6} ({i},{j}) err {err}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_buffers_are_rejected() {
    let scale = [1.0f32; 2];
    let data = [0u8; 4];
    let w = PackedWeight {
        format: WeightFormat::Fp6,
        data: &data,
        data2: None,
        scale: &scale,
        zero: None,
        n: 2,
        k: 4,
        group: 4,
    };
    assert!(matches!(
        w.validate(),
        Err(QuantError::Shape { what: "data2", .. })
    ));
    let w = PackedWeight { group: 0, ..w };
    assert!(matches!(w.validate(), Err(QuantError::Param { .. })));
}

/// k = 0: the product is empty, so every output row is the bias (it used to panic
/// in `chunks_exact_mut(0)`).
#[test]
fn linear_with_no_input_features_gives_the_bias() {
    let (data, scale) = (Vec::<u8>::new(), Vec::<f32>::new());
    let w = PackedWeight::int4(&data, &scale, 3, 0, 4);
    let bias = [1.0f32, -2.0, 0.5];
    let mut out = vec![9.0f32; 2 * 3];
    dequant_linear(&[], &w, Some(&bias), &mut out, 2).unwrap();
    assert_eq!(out, [1.0, -2.0, 0.5, 1.0, -2.0, 0.5]);
    dequant_linear(&[], &w, None, &mut out, 2).unwrap();
    assert_eq!(out, [0.0; 6]);
}
