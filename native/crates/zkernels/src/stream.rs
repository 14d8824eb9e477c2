//! Memory-bandwidth probe with the access pattern of an Adam step: four
//! streams read and three written back per element, on the same pool and chunking as the
//! kernels. Bytes moved over its time is the ceiling an optimizer step can reach.

use crate::simd::multiversion;
use crate::{par, KernelError};

#[inline(always)]
fn stream_body(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], s: &f32) {
    // a,b,c,d read; a,c,d written. Coefficients keep values bounded over repeats.
    for (((a, b), c), d) in a.iter_mut().zip(b).zip(c.iter_mut()).zip(d.iter_mut()) {
        let cn = *s * *c + *b;
        let dn = *s * *d + *b;
        *a = *s * *a + cn - dn;
        *c = cn;
        *d = dn;
    }
}

multiversion!(stream_auto => stream_body<>(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], s: &f32));

/// The probe should stream no worse than the best kernel with its access pattern,
/// so on AVX-512 it is written like the hand-written Adam kernel: 32 elements per
/// iteration, all loads before the stores.
fn stream_dispatch(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], s: &f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
        // SAFETY: `active()` only reports AVX-512 when the CPU has it.
        let done = unsafe { stream_avx512(a, b, c, d, *s) };
        return stream_body(
            &mut a[done..],
            &b[done..],
            &mut c[done..],
            &mut d[done..],
            s,
        );
    }
    stream_auto(a, b, c, d, s)
}

/// Runs the probe over the longest whole 32-element prefix and returns its length.
/// Same operations (unfused) as [`stream_body`], so the same results.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_avx512(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], s: f32) -> usize {
    use std::arch::x86_64::*;
    let n = a.len();
    assert!(b.len() == n && c.len() == n && d.len() == n);
    let (ap, bp, cp, dp) = (a.as_mut_ptr(), b.as_ptr(), c.as_mut_ptr(), d.as_mut_ptr());
    let s = _mm512_set1_ps(s);
    let end = n - n % 32;
    let mut i = 0;
    while i < end {
        let (a0, a1) = (_mm512_loadu_ps(ap.add(i)), _mm512_loadu_ps(ap.add(i + 16)));
        let (b0, b1) = (_mm512_loadu_ps(bp.add(i)), _mm512_loadu_ps(bp.add(i + 16)));
        let (c0, c1) = (_mm512_loadu_ps(cp.add(i)), _mm512_loadu_ps(cp.add(i + 16)));
        let (d0, d1) = (_mm512_loadu_ps(dp.add(i)), _mm512_loadu_ps(dp.add(i + 16)));
        let c0 = _mm512_add_ps(_mm512_mul_ps(s, c0), b0);
        let c1 = _mm512_add_ps(_mm512_mul_ps(s, c1), b1);
        let d0 = _mm512_add_ps(_mm512_mul_ps(s, d0), b0);
        let d1 = _mm512_add_ps(_mm512_mul_ps(s, d1), b1);
        let a0 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(s, a0), c0), d0);
        let a1 = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(s, a1), c1), d1);
        _mm512_storeu_ps(ap.add(i), a0);
        _mm512_storeu_ps(ap.add(i + 16), a1);
        _mm512_storeu_ps(cp.add(i), c0);
        _mm512_storeu_ps(cp.add(i + 16), c1);
        _mm512_storeu_ps(dp.add(i), d0);
        _mm512_storeu_ps(dp.add(i + 16), d1);
        i += 32;
    }
    end
}

/// One pass of the 4-read/3-write stream over equally long buffers.
/// Moves `28 * len` bytes.
pub fn stream_4r3w(
    a: &mut [f32],
    b: &[f32],
    c: &mut [f32],
    d: &mut [f32],
) -> Result<(), KernelError> {
    let n = a.len();
    crate::optim::check_len("b", n, b.len())?;
    crate::optim::check_len("c", n, c.len())?;
    crate::optim::check_len("d", n, d.len())?;
    let s = 0.5f32;
    par::for_each_chunk4(a, b, c, d, |a, b, c, d| stream_dispatch(a, b, c, d, &s));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn computes_the_stated_update() {
        let n = 3 * par::CHUNK;
        let (mut a, b, mut c, mut d) = (vec![1f32; n], vec![2f32; n], vec![4f32; n], vec![8f32; n]);
        stream_4r3w(&mut a, &b, &mut c, &mut d).unwrap();
        assert!(a.iter().all(|&x| x == 0.5 + 4.0 - 6.0));
        assert!(c.iter().all(|&x| x == 4.0) && d.iter().all(|&x| x == 6.0));
        assert!(stream_4r3w(&mut a, &b[..1], &mut c, &mut d).is_err());
    }
}
