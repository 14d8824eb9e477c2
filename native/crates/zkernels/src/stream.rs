//! Memory-bandwidth probes with the access pattern of an Adam step: four
//! streams read and three written back per element, on the same pool and chunking as the
//! kernels. Bytes moved over its time is the ceiling an optimizer step can reach.
//!
//! [`stream_4r3w`] has the fp32-state layout (28 bytes per element);
//! [`stream_4r3w_bf16`] the bf16-state layout (fp32 parameter and gradient, 16-bit
//! states: 20 bytes), with as little arithmetic as a pass can have, so it is the
//! ceiling of a bf16-state step on the same buffers.

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

#[inline(always)]
fn stream_bf16_body(a: &mut [f32], b: &[f32], c: &mut [u16], d: &mut [u16], s: &f32) {
    // a,b,c,d read; a,c,d written. The states flip their lowest bit (one bf16 ulp,
    // undone by the next pass), so repeated passes keep every value where it was.
    for (((a, b), c), d) in a.iter_mut().zip(b).zip(c.iter_mut()).zip(d.iter_mut()) {
        *a = *s * *a + *b;
        *c ^= 1;
        *d ^= 1;
    }
}

multiversion!(stream_bf16_auto => stream_bf16_body<>(a: &mut [f32], b: &[f32], c: &mut [u16], d: &mut [u16], s: &f32));

fn stream_bf16_dispatch(a: &mut [f32], b: &[f32], c: &mut [u16], d: &mut [u16], s: &f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
        // SAFETY: `active()` only reports AVX-512 when the CPU has it.
        let done = unsafe { stream_bf16_avx512(a, b, c, d, *s) };
        return stream_bf16_body(
            &mut a[done..],
            &b[done..],
            &mut c[done..],
            &mut d[done..],
            s,
        );
    }
    stream_bf16_auto(a, b, c, d, s)
}

/// The bf16-state probe over the longest whole 32-element prefix, shaped like the
/// Adam kernel's loop (one 64-byte vector per state per iteration); returns its length.
///
/// # Safety
/// The CPU must support AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn stream_bf16_avx512(
    a: &mut [f32],
    b: &[f32],
    c: &mut [u16],
    d: &mut [u16],
    s: f32,
) -> usize {
    use std::arch::x86_64::*;
    let n = a.len();
    assert!(b.len() == n && c.len() == n && d.len() == n);
    let (ap, bp) = (a.as_mut_ptr(), b.as_ptr());
    let (cp, dp) = (
        c.as_mut_ptr() as *mut __m512i,
        d.as_mut_ptr() as *mut __m512i,
    );
    let s = _mm512_set1_ps(s);
    let one = _mm512_set1_epi16(1);
    let end = n - n % 32;
    let mut i = 0;
    while i < end {
        let (a0, a1) = (_mm512_loadu_ps(ap.add(i)), _mm512_loadu_ps(ap.add(i + 16)));
        let (b0, b1) = (_mm512_loadu_ps(bp.add(i)), _mm512_loadu_ps(bp.add(i + 16)));
        let c0 = _mm512_loadu_si512(cp.add(i / 32));
        let d0 = _mm512_loadu_si512(dp.add(i / 32));
        _mm512_storeu_ps(ap.add(i), _mm512_add_ps(_mm512_mul_ps(s, a0), b0));
        _mm512_storeu_ps(ap.add(i + 16), _mm512_add_ps(_mm512_mul_ps(s, a1), b1));
        _mm512_storeu_si512(cp.add(i / 32), _mm512_xor_si512(c0, one));
        _mm512_storeu_si512(dp.add(i / 32), _mm512_xor_si512(d0, one));
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

/// One pass of the 4-read/3-write stream in the bf16-state layout: `a` (f32) and
/// `c`, `d` (16-bit) read and written, `b` (f32) read. Moves `20 * len` bytes.
/// `a` becomes `a / 2 + b`; `c` and `d` flip their lowest bit.
pub fn stream_4r3w_bf16(
    a: &mut [f32],
    b: &[f32],
    c: &mut [u16],
    d: &mut [u16],
) -> Result<(), KernelError> {
    let n = a.len();
    crate::optim::check_len("b", n, b.len())?;
    crate::optim::check_len("c", n, c.len())?;
    crate::optim::check_len("d", n, d.len())?;
    let s = 0.5f32;
    par::for_each_chunk4(a, b, c, d, |a, b, c, d| {
        stream_bf16_dispatch(a, b, c, d, &s)
    });
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

    #[test]
    fn bf16_probe_computes_the_stated_update_at_every_level() {
        use crate::simd::{self, SimdLevel};
        let n = 3 * par::CHUNK + 13;
        for level in [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512] {
            if level > simd::detected() {
                continue;
            }
            simd::set_override(Some(level)).unwrap();
            let (mut a, b) = (vec![1f32; n], vec![2f32; n]);
            let (mut c, mut d) = (vec![0x3f80u16; n], vec![0x0001u16; n]);
            stream_4r3w_bf16(&mut a, &b, &mut c, &mut d).unwrap();
            assert!(a.iter().all(|&x| x == 2.5), "{level:?}");
            assert!(
                c.iter().all(|&x| x == 0x3f81) && d.iter().all(|&x| x == 0),
                "{level:?}"
            );
            stream_4r3w_bf16(&mut a, &b, &mut c, &mut d).unwrap();
            assert!(
                c.iter().all(|&x| x == 0x3f80) && d.iter().all(|&x| x == 1),
                "{level:?}"
            );
        }
        simd::set_override(None).unwrap();
        let (mut a, b, mut c) = (vec![0f32; 8], vec![0f32; 8], vec![0u16; 8]);
        assert!(stream_4r3w_bf16(&mut a, &b, &mut c, &mut [0u16; 7]).is_err());
        assert!(a.iter().all(|&x| x == 0.0) && c.iter().all(|&x| x == 0));
    }
}
