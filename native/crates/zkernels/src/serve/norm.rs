//! RMSNorm of rows: `w * (x * rsqrt(mean(x^2) + eps))`, the product with `x`
//! in f32 rounded to the element type before the weight multiplies it (as
//! transformers' `LlamaRMSNorm` and `zserve.model.llama.rms_norm` do).

use super::{check_len, for_tasks, param, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;
use crate::simd::multiversion;

/// Normalizes each row of `x` (rows of `weight.len()` elements) into `out`.
pub fn rms_norm<E: Elem>(x: &[E], weight: &[E], eps: f32, out: &mut [E]) -> Result<(), QuantError> {
    let h = weight.len();
    if h == 0 {
        return Err(param("hidden", 0, "weight of at least one element"));
    }
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(param("eps", eps as i64, "a finite eps >= 0"));
    }
    let rows = x.len() / h;
    check_len("x", x.len(), rows * h, || format!("rows * hidden ({h})"))?;
    check_len("out", out.len(), x.len(), || "x's length".to_string())?;
    let dst = Shared(out.as_mut_ptr());
    for_tasks(rows, rows * h, |r| {
        // SAFETY: row r owns out[r * h .. (r + 1) * h].
        let o = unsafe { dst.range(r * h, h) };
        norm_auto(&x[r * h..(r + 1) * h], weight, eps, o);
    });
    Ok(())
}

#[inline(always)]
fn norm_body<E: Elem>(x: &[E], w: &[E], eps: f32, out: &mut [E]) {
    let mut lanes = [0f32; 16];
    let h = x.len();
    let full = h / 16 * 16;
    for c in x[..full].chunks_exact(16) {
        for l in 0..16 {
            let v = c[l].to_f32();
            lanes[l] += v * v;
        }
    }
    let mut ss = lanes.iter().sum::<f32>();
    for v in &x[full..] {
        ss += v.to_f32() * v.to_f32();
    }
    let r = 1.0 / (ss / h as f32 + eps).sqrt();
    for ((o, &v), &wv) in out.iter_mut().zip(x).zip(w) {
        let y = E::from_f32(v.to_f32() * r).to_f32();
        *o = E::from_f32(wv.to_f32() * y);
    }
}

multiversion!(norm_auto => norm_body<E: Elem>(x: &[E], w: &[E], eps: f32, out: &mut [E]));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_definition() {
        let h = 40;
        let x: Vec<f32> = (0..3 * h)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let w: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 / 40.0).collect();
        let mut out = vec![0f32; x.len()];
        rms_norm(&x, &w, 1e-5, &mut out).unwrap();
        for r in 0..3 {
            let row = &x[r * h..(r + 1) * h];
            let ms = row
                .iter()
                .map(|v| f64::from(*v) * f64::from(*v))
                .sum::<f64>()
                / h as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            for i in 0..h {
                let want = f64::from(w[i]) * f64::from(row[i]) * inv;
                assert!((f64::from(out[r * h + i]) - want).abs() < 1e-5 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        let mut out = vec![0f32; 5];
        assert!(rms_norm(&[1f32; 5], &[1f32; 2], 1e-5, &mut out).is_err());
        assert!(rms_norm(&[1f32; 4], &[1f32; 2], 1e-5, &mut out).is_err());
        assert!(rms_norm::<f32>(&[], &[], 1e-5, &mut []).is_err());
    }
}
