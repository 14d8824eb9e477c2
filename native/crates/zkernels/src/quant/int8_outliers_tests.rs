//! Tests of [`super`]: the fused split against its definition at every SIMD level.

use super::*;
use crate::simd::{detected, set_override, SimdLevel};

/// The definition in f64 (INT8 part exact, outlier term in f64).
#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f32],
    w: &[i8],
    ws: &[f32],
    m: usize,
    n: usize,
    k: usize,
    cols: &[usize],
) -> Vec<f64> {
    let mut rest = x.to_vec();
    for row in rest.chunks_exact_mut(k) {
        cols.iter().for_each(|&c| row[c] = 0.0);
    }
    let mut q = vec![0i8; m * k];
    let mut s = vec![0f32; m];
    quantize_tokenwise(&rest, m, k, 8, &mut q, &mut s).unwrap();
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let acc: i32 = (0..k)
                .map(|t| i32::from(q[i * k + t]) * i32::from(w[j * k + t]))
                .sum();
            let corr: f64 = cols
                .iter()
                .map(|&c| f64::from(x[i * k + c]) * f64::from(w[j * k + c]) * f64::from(ws[j]))
                .sum();
            out[i * n + j] = f64::from(acc) * f64::from(s[i]) * f64::from(ws[j]) + corr;
        }
    }
    out
}

#[test]
fn matches_the_definition_at_every_level() {
    for &(m, n, k, t) in &[
        (1, 70, 130, 8),
        (5, 33, 576, 8),
        (4, 9, 64, 1),
        (2, 5, 7, 7),
    ] {
        let mut x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
            .collect();
        x[k / 2] = 40.0; // an outlier channel
        let w: Vec<i8> = (0..n * k)
            .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
            .collect();
        let ws: Vec<f32> = (0..n).map(|j| 0.001 * (j + 1) as f32).collect();
        let cols = outlier_channels(&x, m, k, t);
        assert_eq!(cols[0], k / 2);
        let want = reference(&x, &w, &ws, m, n, k, &cols);
        for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .iter()
            .filter(|&&l| l <= detected())
        {
            set_override(Some(level)).unwrap();
            let mut out = vec![0f32; m * n];
            int8_linear_outliers(&x, &w, &ws, None, &mut out, m, n, k, t).unwrap();
            for (g, r) in out.iter().zip(&want) {
                assert!(
                    (f64::from(*g) - r).abs() <= 1e-5 * (1.0 + r.abs()),
                    "{g} {r}"
                );
            }
            // The split: its parts, the outlier term added here, give the same numbers.
            let (mut xo, mut wc) = (vec![0f32; m * t], vec![0f32; n * t]);
            let c64: Vec<i64> = cols.iter().map(|&c| c as i64).collect();
            int8_linear_split(&x, &w, &ws, None, &c64, &mut out, m, n, k, &mut xo, &mut wc)
                .unwrap();
            for i in 0..m {
                for j in 0..n {
                    let term: f32 = (0..t).map(|c| xo[i * t + c] * wc[j * t + c]).sum();
                    let (g, r) = (f64::from(out[i * n + j] + term), want[i * n + j]);
                    assert!((g - r).abs() <= 1e-5 * (1.0 + r.abs()), "split {g} {r}");
                }
            }
            assert_eq!(xo[0], x[cols[0]]);
            assert_eq!(wc[t], f32::from(w[k + cols[0]]) * ws[1]);
        }
        set_override(None).unwrap();
    }
}

/// The fused epilogue's float32 arithmetic, to the bit: the INT8 part, then the outlier
/// term summed in channel order from 0 and added (blocks of 64 columns and a short
/// last one, 1-17 rows, more channels than one pass of 8).
#[test]
fn fused_term_is_the_scalar_order_at_every_level() {
    for &(m, n, k, t) in &[(1, 200, 576, 8), (3, 70, 130, 8), (17, 131, 96, 11)] {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.173)
            .collect();
        let w: Vec<i8> = (0..n * k)
            .map(|i| ((i * 7 % 255) as i32 - 127) as i8)
            .collect();
        let ws: Vec<f32> = (0..n).map(|j| 0.0013 * (j + 1) as f32).collect();
        let bias: Vec<f32> = (0..n).map(|j| 0.5 - j as f32 * 0.01).collect();
        let cols = outlier_channels(&x, m, k, t);
        let mut rest = x.clone();
        for row in rest.chunks_exact_mut(k) {
            cols.iter().for_each(|&c| row[c] = 0.0);
        }
        let mut want = vec![0f32; m * n];
        set_override(Some(SimdLevel::Scalar)).unwrap();
        super::super::int8_linear(&rest, &w, &ws, Some(&bias), &mut want, m, n, k).unwrap();
        for i in 0..m {
            for j in 0..n {
                let mut corr = 0f32;
                for &c in &cols {
                    corr += x[i * k + c] * (f32::from(w[j * k + c]) * ws[j]);
                }
                want[i * n + j] += corr;
            }
        }
        for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .iter()
            .filter(|&&l| l <= detected())
        {
            set_override(Some(level)).unwrap();
            let mut out = vec![0f32; m * n];
            int8_linear_outliers(&x, &w, &ws, Some(&bias), &mut out, m, n, k, t).unwrap();
            assert_eq!(out, want, "{level:?} {m}x{n}x{k} t={t}");
        }
        set_override(None).unwrap();
    }
}

#[test]
fn split_rejects_bad_channels() {
    let (x, w, ws) = ([1f32; 8], [1i8; 8], [1f32]);
    let mut out = [0f32; 4];
    let (mut xo, mut wc) = ([0f32; 2], [0f32; 2]);
    let r = int8_linear_split(&x, &w, &ws, None, &[4], &mut out, 2, 2, 4, &mut xo, &mut wc);
    assert!(matches!(r, Err(QuantError::Param { name: "cols", .. })));
    let mut wc = [0f32; 3];
    let r = int8_linear_split(&x, &w, &ws, None, &[1], &mut out, 2, 2, 4, &mut xo, &mut wc);
    assert!(matches!(r, Err(QuantError::Shape { what: "wc", .. })));
}

#[test]
fn column_absmax_is_exact_at_every_level() {
    let (m, k) = (5, 37);
    let mut x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 29 % 31) as f32 - 15.0) * 0.37)
        .collect();
    x[3 * k + 4] = -1e30;
    let want: Vec<f32> = (0..k)
        .map(|c| (0..m).fold(0f32, |a, i| a.max(x[i * k + c].abs())))
        .collect();
    for &level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
        .iter()
        .filter(|&&l| l <= detected())
    {
        set_override(Some(level)).unwrap();
        let mut out = vec![-1f32; k];
        column_absmax(&x, m, k, &mut out).unwrap();
        assert_eq!(out, want, "{level:?}");
        x[2 * k + 9] = f32::NAN;
        column_absmax(&x, m, k, &mut out).unwrap();
        assert!(
            out[9].is_nan() && out[10] == want[10],
            "{level:?}: NaN propagates"
        );
        x[2 * k + 9] = 0.0;
    }
    set_override(None).unwrap();
    assert!(column_absmax(&x, m, k, &mut [0f32; 3]).is_err());
}

#[test]
fn channels_are_topk_of_column_maxima() {
    let x = [1.0, -5.0, 2.0, 0.5, /* row 2 */ -3.0, 0.0, 2.0, 4.0];
    assert_eq!(outlier_channels(&x, 2, 4, 2), vec![1, 3]);
    assert_eq!(outlier_channels(&x, 2, 4, 4), vec![1, 3, 0, 2]);
    let mut out = [0f32; 2];
    let w = [1i8; 4];
    assert!(int8_linear_outliers(&x, &w, &[1.0], None, &mut out, 2, 1, 4, 5).is_err());
}

/// The one-scan choice of up to [`SCAN_T`] channels is the select-and-sort order: ties
/// (to the lower index), NaN (largest, as `total_cmp` ranks it), every `t` from 0 to k.
#[test]
fn scan_choice_is_select_and_sort() {
    let k = 70;
    let mut colmax: Vec<f32> = (0..k).map(|c| ((c * 29 % 13) as f32) * 0.5).collect();
    colmax[17] = f32::NAN;
    colmax[40] = f32::INFINITY;
    for t in 0..=k {
        let mut want: Vec<usize> = (0..k).collect();
        want.sort_by(|a, b| colmax[*b].total_cmp(&colmax[*a]).then(a.cmp(b)));
        want.truncate(t);
        if t <= SCAN_T {
            assert_eq!(top_by_scan(&colmax, t), want, "t={t}");
        }
        // outlier_channels (either path) on rows whose column maxima are `colmax`.
        let x: Vec<f32> = colmax
            .iter()
            .map(|v| -v)
            .chain(colmax.iter().map(|v| v * 0.5))
            .collect();
        assert_eq!(outlier_channels(&x, 2, k, t), want, "t={t}");
    }
}
