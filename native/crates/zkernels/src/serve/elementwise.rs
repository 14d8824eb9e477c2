//! Elementwise products of a decode step's small activations: `out = a * b`,
//! each product of the f32 values rounded once to the element type, which is
//! what `torch.mul` gives for float32 and bfloat16 tensors (bit for bit).
//!
//! SwiGLU's `silu(gate) * up` keeps torch's `silu` (its exp decides the bits
//! that `z eval` and the per-op path see) and takes this product: one small
//! native call instead of a torch op, which after each projection streamed its
//! weight cost 12-20 us in situ against ~2 us warm.

use super::{check_len, for_tasks, Shared};
use crate::bf16::Elem;
use crate::quant::QuantError;

/// Elements per task of a long product.
const PART: usize = 1 << 14;

/// `out[i] = a[i] * b[i]`, rounded to `E`.
pub fn mul_into<E: Elem>(a: &[E], b: &[E], out: &mut [E]) -> Result<(), QuantError> {
    check_len("b", b.len(), a.len(), || "a's length".to_string())?;
    check_len("out", out.len(), a.len(), || "a's length".to_string())?;
    let n = a.len();
    let dst = Shared(out.as_mut_ptr());
    for_tasks(n.div_ceil(PART), n, |t| {
        let (i0, i1) = (t * PART, ((t + 1) * PART).min(n));
        // SAFETY: task t owns out[i0..i1].
        let o = unsafe { dst.range(i0, i1 - i0) };
        for ((o, &x), &y) in o.iter_mut().zip(&a[i0..i1]).zip(&b[i0..i1]) {
            *o = E::from_f32(x.to_f32() * y.to_f32());
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{bf16_to_f32, f32_to_bf16};

    #[test]
    fn products_rounded_once() {
        let a: Vec<f32> = (0..40_000).map(|i| (i as f32 - 20_000.0) / 777.0).collect();
        let b: Vec<f32> = (0..40_000)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 13.0)
            .collect();
        let mut out = vec![0f32; a.len()];
        mul_into(&a, &b, &mut out).unwrap();
        assert!(out
            .iter()
            .zip(a.iter().zip(&b))
            .all(|(o, (x, y))| *o == x * y));
        let (ab, bb): (Vec<u16>, Vec<u16>) = (
            a.iter().map(|&v| f32_to_bf16(v)).collect(),
            b.iter().map(|&v| f32_to_bf16(v)).collect(),
        );
        let mut ob = vec![0u16; a.len()];
        mul_into(&ab, &bb, &mut ob).unwrap();
        for ((o, x), y) in ob.iter().zip(&ab).zip(&bb) {
            assert_eq!(*o, f32_to_bf16(bf16_to_f32(*x) * bf16_to_f32(*y)));
        }
        assert!(mul_into(&a, &b[1..], &mut out).is_err());
        assert!(mul_into(&a, &b, &mut out[1..]).is_err());
    }
}
