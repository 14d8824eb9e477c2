//! [`super::dequant_linear_a8`] against its definition at every SIMD level: the activations
//! rounded to INT8 codes per 32-column block (computed here plainly), then the exact
//! (f64) product with the dequantized weight; and against the unquantized product within
//! the rounding bound of the module documentation.

use super::fixture::{alone_at, at_every_level, Fixture, Shape};
use super::{dequant_linear_a8, dequantize, PackedWeight, WeightFormat};
use crate::quant::QuantError;

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

/// `shape`'s fixture against the definition and the unquantized product at every level.
fn check(shape: Shape, bias: bool) {
    let Shape { n, k, m, .. } = shape;
    let mut f = Fixture::new(shape);
    if m > 1 && k > 32 {
        f.x[k..k + 32].fill(0.0); // a zero block: scale 0
        f.x[k + 40] = 50.0; // an outlier dominating its block
    }
    let (x, b) = (&f.x, &f.bias);
    let w = f.weight(false);
    let mut deq = vec![0f32; n * k];
    dequantize(&w, &mut deq).unwrap();
    let xq = quantized(x);
    at_every_level(|level| {
        let mut y = vec![f32::NAN; m * n];
        dequant_linear_a8(x, &w, bias.then_some(&b[..]), &mut y, m).unwrap();
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
                let what = format!("{level:?} {shape:?} ({i},{j})");
                assert!(err <= 1e-5 * mag, "{what}: {got} vs {exact} ({err})");
                assert!((got - plain).abs() <= bound * 1.0001 + 1e-5 * mag, "{what}");
            }
        }
    });
}

fn shape(n: usize, k: usize, group: usize, m: usize, asym: bool, per_tensor: bool) -> Shape {
    Shape {
        n,
        k,
        group,
        m,
        asym,
        per_tensor,
    }
}

#[test]
fn matches_the_product_of_the_rounded_activations_at_every_level() {
    for (s, bias) in [
        (shape(70, 576, 32, 1, false, false), true),
        (shape(70, 576, 32, 2, false, false), false),
        (shape(37, 576, 32, 5, false, false), true),
        (shape(64, 128, 64, 16, true, false), true),
        (shape(33, 96, 32, 17, true, false), false),
        (shape(9, 256, 128, 3, false, true), true),
        (shape(1, 32, 32, 4, true, false), true),
        (shape(40, 64, 64, 7, false, false), true),
        // k 96 in groups of 64: a last group of 32 (a tensor-parallel cut's), 2 scales a row
        (shape(96, 96, 64, 12, false, false), false),
        (shape(20, 160, 64, 5, true, false), true),
        // The GEMV body's rows (1-4): an odd block count (a lone last block), a short last
        // panel, groups of several blocks with a short last one, zero points, per tensor.
        (shape(13, 96, 32, 1, false, false), true),
        (shape(13, 96, 32, 3, true, false), true),
        (shape(21, 160, 64, 2, true, false), false),
        (shape(17, 160, 64, 4, false, false), true),
        (shape(8, 32, 32, 2, false, false), true),
        (shape(3, 64, 32, 4, true, true), true),
        (shape(200, 576, 32, 4, false, false), true),
        (shape(24, 1536, 128, 1, false, false), false),
    ] {
        check(s, bias);
    }
}

/// Each row of a call gives the same bits as that row alone: the GEMV body (up to 4 rows)
/// and the tile body (more) fold the same integer sums in the same order, at every level.
#[test]
fn a_row_does_not_depend_on_its_batch() {
    for (n, k, group, asym, per_tensor) in [
        (70, 576, 32, false, false),
        (13, 96, 32, true, false),
        (41, 160, 64, false, false),
        (9, 128, 64, true, true),
    ] {
        let f = Fixture::new(shape(n, k, group, 19, asym, per_tensor));
        let w = f.weight(false);
        at_every_level(|level| {
            let call = |m: usize| {
                let mut y = vec![0f32; m * n];
                dequant_linear_a8(&f.x[..m * k], &w, Some(&f.bias), &mut y, m).unwrap();
                y
            };
            for m in [2, 3, 4, 5, 8, 19] {
                let (batch, alone) = alone_at(level, || {
                    let alone: Vec<f32> = (0..m)
                        .flat_map(|i| {
                            let mut y = vec![0f32; n];
                            let x = &f.x[i * k..(i + 1) * k];
                            dequant_linear_a8(x, &w, Some(&f.bias), &mut y, 1).unwrap();
                            y
                        })
                        .collect();
                    (call(m), alone)
                });
                for (e, (a, b)) in batch.iter().zip(&alone).enumerate() {
                    let what = format!("{level:?} {n}x{k} g{group} m{m} ({}, {})", e / n, e % n);
                    assert_eq!(a.to_bits(), b.to_bits(), "{what}: {a} vs {b}");
                }
            }
        });
    }
}

#[test]
fn a_non_finite_activation_gives_nan_rows() {
    let (n, k) = (8, 64);
    let data = vec![0x5au8; n * k / 2];
    let scale = vec![0.5f32; n * 2];
    let w = PackedWeight::int4(&data, &scale, n, k, 32);
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
    let w = PackedWeight::int4(&data, &scale, 4, 48, 16);
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
