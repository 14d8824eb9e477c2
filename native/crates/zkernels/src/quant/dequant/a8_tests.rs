//! [`super::dequant_linear_a8`] against its definition at every SIMD level: the activations
//! rounded to INT8 codes per 32-column block (computed here plainly), then the exact
//! (f64) product with the dequantized weight; and against the unquantized product within
//! the rounding bound of the module documentation.

use super::{dequant_linear_a8, dequantize, PackedWeight, WeightFormat};
use crate::quant::QuantError;
use crate::simd::{detected, set_override, SimdLevel};

/// The activations as the kernel rounds them: per 32 columns, codes and scale.
fn quantized(x: &[f32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for block in x.chunks(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        for &v in block {
            if amax == 0.0 {
                out.push(0.0);
                continue;
            }
            let code = (v * (127.0 / amax)).round_ties_even();
            assert!(code.abs() <= 127.0);
            out.push(f64::from(code) * f64::from(amax / 127.0));
        }
    }
    out
}

struct Case {
    n: usize,
    k: usize,
    group: usize,
    m: usize,
    asym: bool,
    per_tensor: bool,
    bias: bool,
}

fn check(c: &Case) {
    let Case {
        n,
        k,
        group,
        m,
        asym,
        per_tensor,
        bias,
    } = *c;
    let mut seed = (n * 131 + k * 7 + m * 3 + group) as u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u32
    };
    let groups = k.div_ceil(group);
    let srows = if per_tensor { 1 } else { n };
    let scale: Vec<f32> = (0..srows * groups)
        .map(|i| 0.01 + (i % 13) as f32 * 1e-3)
        .collect();
    let zero: Vec<f32> = (0..srows * groups)
        .map(|i| (i % 16) as f32 + 0.25)
        .collect();
    let data: Vec<u8> = (0..n * k / 2).map(|_| next() as u8).collect();
    let mut x: Vec<f32> = (0..m * k)
        .map(|_| (next() as f32 / 2f32.powi(31) - 0.5) * 3.0)
        .collect();
    if m > 1 && k > 32 {
        x[k..k + 32].fill(0.0); // a zero block: scale 0
        x[k + 40] = 50.0; // an outlier dominating its block
    }
    let b: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 1.0).collect();
    let w = PackedWeight {
        format: WeightFormat::Int4 { offset: 8 },
        data: &data,
        data2: None,
        scale: &scale,
        zero: asym.then_some(&zero[..]),
        n,
        k,
        group,
    };
    let mut deq = vec![0f32; n * k];
    dequantize(&w, &mut deq).unwrap();
    let xq = quantized(&x);
    for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
        if level > detected() {
            continue;
        }
        set_override(Some(level)).unwrap();
        let mut y = vec![f32::NAN; m * n];
        dequant_linear_a8(&x, &w, bias.then_some(&b[..]), &mut y, m).unwrap();
        for i in 0..m {
            for j in 0..n {
                let bj = if bias { f64::from(b[j]) } else { 0.0 };
                let (mut exact, mut mag, mut plain, mut bound) = (bj, 1.0, bj, 0.0);
                for c in 0..k {
                    let wv = f64::from(deq[j * k + c]);
                    exact += xq[i * k + c] * wv;
                    mag += (xq[i * k + c] * wv).abs();
                    plain += f64::from(x[i * k + c]) * wv;
                    let blk = &x[i * k + c / 32 * 32..][..32];
                    let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                    bound += f64::from(amax) / 127.0 / 2.0 * wv.abs();
                }
                let got = f64::from(y[i * n + j]);
                let err = (got - exact).abs();
                let what = format!("{level:?} {n}x{k} g{group} m{m} asym {asym} ({i},{j})");
                assert!(err <= 1e-5 * mag, "{what}: {got} vs {exact} ({err})");
                assert!((got - plain).abs() <= bound * 1.0001 + 1e-5 * mag, "{what}");
            }
        }
    }
    set_override(None).unwrap();
}

#[test]
fn matches_the_product_of_the_rounded_activations_at_every_level() {
    let case = |n, k, group, m, asym, per_tensor, bias| Case {
        n,
        k,
        group,
        m,
        asym,
        per_tensor,
        bias,
    };
    for c in [
        case(70, 576, 32, 1, false, false, true),
        case(70, 576, 32, 2, false, false, false),
        case(37, 576, 32, 5, false, false, true),
        case(64, 128, 64, 16, true, false, true),
        case(33, 96, 32, 17, true, false, false),
        case(9, 256, 128, 3, false, true, true),
        case(1, 32, 32, 4, true, false, true),
        case(40, 64, 64, 7, false, false, true),
        // k 96 in groups of 64: a last group of 32 (a tensor-parallel cut's), 2 scales a row
        case(96, 96, 64, 12, false, false, false),
        case(20, 160, 64, 5, true, false, true),
    ] {
        check(&c);
    }
}

#[test]
fn a_non_finite_activation_gives_nan_rows() {
    let (n, k) = (8, 64);
    let data = vec![0x5au8; n * k / 2];
    let scale = vec![0.5f32; n * 2];
    let w = PackedWeight {
        format: WeightFormat::Int4 { offset: 8 },
        data: &data,
        data2: None,
        scale: &scale,
        zero: None,
        n,
        k,
        group: 32,
    };
    let mut x = vec![1.0f32; 2 * k];
    x[k + 3] = f32::INFINITY;
    let mut y = vec![0f32; 2 * n];
    dequant_linear_a8(&x, &w, None, &mut y, 2).unwrap();
    assert!(y[..n].iter().all(|v| v.is_finite()));
    assert!(y[n..].iter().all(|v| v.is_nan()), "{y:?}");
}

#[test]
fn shapes_it_cannot_serve_are_errors() {
    let data = vec![0u8; 4 * 48 / 2];
    let data2 = vec![0u8; 4 * 48 / 4];
    let scale = vec![1.0f32; 4 * 3];
    let w = PackedWeight {
        format: WeightFormat::Int4 { offset: 8 },
        data: &data,
        data2: None,
        scale: &scale,
        zero: None,
        n: 4,
        k: 48,
        group: 16,
    };
    let (x, mut y) = (vec![0f32; 48], vec![0f32; 4]);
    let err = dequant_linear_a8(&x, &w, None, &mut y, 1).unwrap_err();
    assert!(matches!(
        err,
        QuantError::Param {
            name: "in_features",
            value: 48,
            ..
        }
    ));
    let fp6 = PackedWeight {
        format: WeightFormat::Fp6,
        data2: Some(&data2),
        ..w
    };
    let err = dequant_linear_a8(&x, &fp6, None, &mut y, 1).unwrap_err();
    assert!(matches!(err, QuantError::Param { name: "fmt", .. }));
    let scale = vec![1.0f32; 4 * 4];
    let data = vec![0u8; 4 * 64 / 2];
    let g16 = PackedWeight {
        data: &data,
        scale: &scale,
        k: 64,
        ..w
    };
    let (x, mut y) = (vec![0f32; 64], vec![0f32; 4]);
    let err = dequant_linear_a8(&x, &g16, None, &mut y, 1).unwrap_err();
    assert!(matches!(
        err,
        QuantError::Param {
            name: "group_size",
            value: 16,
            ..
        }
    ));
}
