//! Memory-bandwidth probes with the access pattern of an Adam step: four
//! streams read and three written back per element, on the same pool and chunking as the
//! kernels. Bytes moved over its time is the ceiling an optimizer step can reach.
//!
//! [`stream_4r3w`] has the fp32-state layout (28 bytes per element);
//! [`stream_4r3w_bf16`] the bf16-state layout (fp32 parameter and gradient, 16-bit
//! states: 20 bytes).
//!
//! `pace` adds that many dependent square-root/divide pairs per vector to one of the
//! values written. A bare pass (`pace = 0`) is not always the fastest way to stream: on
//! the 2-core Zen 4 VMs this was written on, pace 2 moved about 6% more bytes per second
//! than a bare pass with DRAM shared with other tenants, and up to 25% more with DRAM idle
//! (where the Adam step itself, one square root and one divide per vector, had outrun the
//! bare pass by up to 16%). So a ceiling is the fastest of a few paces, each timed on the
//! same buffers.

use crate::simd::multiversion;
use crate::{par, KernelError};

/// Paces a probe takes: 0 (bare) to this.
pub const MAX_PACE: u32 = 3;

/// `x` itself at pace 0, else `pace` rounds of `y <- sqrt(y) / (y + 1)` from `|x|`
/// (bounded in [0, 1/2] after one round, so repeated passes stay finite).
#[inline(always)]
fn paced(x: f32, pace: u32) -> f32 {
    if pace == 0 {
        return x;
    }
    let mut y = x.abs();
    for _ in 0..pace {
        y = y.sqrt() / (y + 1.0);
    }
    y
}

#[inline(always)]
fn stream_body(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], k: &(f32, u32)) {
    // a,b,c,d read; a,c,d written. Coefficients keep values bounded over repeats.
    let (s, pace) = *k;
    for (((a, b), c), d) in a.iter_mut().zip(b).zip(c.iter_mut()).zip(d.iter_mut()) {
        let cn = s * *c + *b;
        let dn = s * paced(*d, pace) + *b;
        *a = s * *a + cn - dn;
        *c = cn;
        *d = dn;
    }
}

multiversion!(stream_auto => stream_body<>(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], k: &(f32, u32)));

#[inline(always)]
fn stream_bf16_body(a: &mut [f32], b: &[f32], c: &mut [u16], d: &mut [u16], k: &(f32, u32)) {
    // a,b,c,d read; a,c,d written. The states flip their lowest bit (one bf16 ulp,
    // undone by the next pass), so repeated passes keep every value where it was.
    let (s, pace) = *k;
    for (((a, b), c), d) in a.iter_mut().zip(b).zip(c.iter_mut()).zip(d.iter_mut()) {
        *a = s * paced(*a, pace) + *b;
        *c ^= 1;
        *d ^= 1;
    }
}

multiversion!(stream_bf16_auto => stream_bf16_body<>(a: &mut [f32], b: &[f32], c: &mut [u16], d: &mut [u16], k: &(f32, u32)));

/// A probe's dispatcher: the hand-written AVX-512 loop at the pace asked for where the
/// CPU has it, its scalar body on the tail; else the compiler-vectorized body.
macro_rules! dispatch {
    ($name:ident, $state:ty, $body:ident, $auto:ident, $avx512:ident) => {
        fn $name(a: &mut [f32], b: &[f32], c: &mut [$state], d: &mut [$state], k: &(f32, u32)) {
            #[cfg(target_arch = "x86_64")]
            if crate::simd::active() == crate::simd::SimdLevel::Avx512 {
                // SAFETY: `active()` only reports AVX-512 when the CPU has it.
                let done = unsafe {
                    match k.1 {
                        0 => avx512::$avx512::<0>(a, b, c, d, k.0),
                        1 => avx512::$avx512::<1>(a, b, c, d, k.0),
                        2 => avx512::$avx512::<2>(a, b, c, d, k.0),
                        _ => avx512::$avx512::<3>(a, b, c, d, k.0),
                    }
                };
                let (a, b, c, d) = (&mut a[done..], &b[done..], &mut c[done..], &mut d[done..]);
                return $body(a, b, c, d, k);
            }
            $auto(a, b, c, d, k)
        }
    };
}

// The probes should stream no worse than the best kernel with their access pattern, so on
// AVX-512 they are written like the hand-written Adam kernel: 32 elements per iteration,
// all loads before the stores.
dispatch!(stream_dispatch, f32, stream_body, stream_auto, stream);
dispatch!(
    stream_bf16_dispatch,
    u16,
    stream_bf16_body,
    stream_bf16_auto,
    stream_bf16
);

#[cfg(target_arch = "x86_64")]
mod avx512 {
    //! The probes over the longest whole 32-element prefix; each returns its length.
    //! Same operations (unfused) as the scalar bodies, so the same results.

    use std::arch::x86_64::*;

    /// [`super::paced`] on a vector.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn paced<const PACE: u32>(x: __m512) -> __m512 {
        if PACE == 0 {
            return x;
        }
        let mut y = _mm512_abs_ps(x);
        for _ in 0..PACE {
            y = _mm512_div_ps(_mm512_sqrt_ps(y), _mm512_add_ps(y, _mm512_set1_ps(1.0)));
        }
        y
    }

    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn stream<const PACE: u32>(
        a: &mut [f32],
        b: &[f32],
        c: &mut [f32],
        d: &mut [f32],
        s: f32,
    ) -> usize {
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
            let d0 = _mm512_add_ps(_mm512_mul_ps(s, paced::<PACE>(d0)), b0);
            let d1 = _mm512_add_ps(_mm512_mul_ps(s, paced::<PACE>(d1)), b1);
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

    /// The bf16-state probe, shaped like the Adam kernel's loop (one 64-byte vector
    /// per state per iteration).
    ///
    /// # Safety
    /// The CPU must support AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn stream_bf16<const PACE: u32>(
        a: &mut [f32],
        b: &[f32],
        c: &mut [u16],
        d: &mut [u16],
        s: f32,
    ) -> usize {
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
            let a0 = _mm512_add_ps(_mm512_mul_ps(s, paced::<PACE>(a0)), b0);
            let a1 = _mm512_add_ps(_mm512_mul_ps(s, paced::<PACE>(a1)), b1);
            _mm512_storeu_ps(ap.add(i), a0);
            _mm512_storeu_ps(ap.add(i + 16), a1);
            _mm512_storeu_si512(cp.add(i / 32), _mm512_xor_si512(c0, one));
            _mm512_storeu_si512(dp.add(i / 32), _mm512_xor_si512(d0, one));
            i += 32;
        }
        end
    }
}

fn check(n: usize, b: usize, c: usize, d: usize, pace: u32) -> Result<(), KernelError> {
    crate::optim::check_len("b", n, b)?;
    crate::optim::check_len("c", n, c)?;
    crate::optim::check_len("d", n, d)?;
    if pace > MAX_PACE {
        return Err(KernelError::InvalidHyperparameter {
            name: "pace",
            value: pace as f64,
            expected: "an integer from 0 to 3",
        });
    }
    Ok(())
}

/// One pass of the 4-read/3-write stream over equally long buffers: `a`, `c`, `d`
/// read and written, `b` read. Moves `28 * len` bytes.
pub fn stream_4r3w(
    a: &mut [f32],
    b: &[f32],
    c: &mut [f32],
    d: &mut [f32],
    pace: u32,
) -> Result<(), KernelError> {
    check(a.len(), b.len(), c.len(), d.len(), pace)?;
    let k = (0.5f32, pace);
    par::for_each_chunk4(a, b, c, d, |a, b, c, d| stream_dispatch(a, b, c, d, &k));
    Ok(())
}

/// One pass of the 4-read/3-write stream in the bf16-state layout: `a` (f32) and
/// `c`, `d` (16-bit) read and written, `b` (f32) read. Moves `20 * len` bytes.
/// `a` becomes `paced(a) / 2 + b`; `c` and `d` flip their lowest bit.
pub fn stream_4r3w_bf16(
    a: &mut [f32],
    b: &[f32],
    c: &mut [u16],
    d: &mut [u16],
    pace: u32,
) -> Result<(), KernelError> {
    check(a.len(), b.len(), c.len(), d.len(), pace)?;
    let k = (0.5f32, pace);
    par::for_each_chunk4(a, b, c, d, |a, b, c, d| {
        stream_bf16_dispatch(a, b, c, d, &k)
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simd::{self, SimdLevel};

    fn levels() -> impl Iterator<Item = SimdLevel> {
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|&l| l <= simd::detected())
    }

    #[test]
    fn computes_the_stated_update_at_every_level_and_pace() {
        let n = 3 * par::CHUNK + 13;
        for level in levels() {
            simd::set_override(Some(level)).unwrap();
            let (mut a, b, mut c, mut d) =
                (vec![1f32; n], vec![2f32; n], vec![4f32; n], vec![8f32; n]);
            stream_4r3w(&mut a, &b, &mut c, &mut d, 0).unwrap();
            assert!(a.iter().all(|&x| x == 0.5 + 4.0 - 6.0), "{level:?}");
            assert!(c.iter().all(|&x| x == 4.0) && d.iter().all(|&x| x == 6.0));
            for pace in 1..=MAX_PACE {
                let (mut a, mut c, mut d) = (vec![1f32; n], vec![4f32; n], vec![-8f32; n]);
                stream_4r3w(&mut a, &b, &mut c, &mut d, pace).unwrap();
                let want_d = 0.5 * paced(-8.0, pace) + 2.0;
                assert!(d.iter().all(|&x| x == want_d), "{level:?} pace {pace}");
                assert!(a.iter().all(|&x| x == 0.5 + 4.0 - want_d));
            }
        }
        simd::set_override(None).unwrap();
        let (mut a, b, mut c, mut d) = (vec![1f32; 8], vec![2f32; 8], vec![4f32; 8], vec![8f32; 8]);
        assert!(stream_4r3w(&mut a, &b[..1], &mut c, &mut d, 0).is_err());
        assert!(stream_4r3w(&mut a, &b, &mut c, &mut d, MAX_PACE + 1).is_err());
        assert!(a.iter().all(|&x| x == 1.0) && d.iter().all(|&x| x == 8.0));
    }

    #[test]
    fn bf16_probe_computes_the_stated_update_at_every_level_and_pace() {
        let n = 3 * par::CHUNK + 13;
        for level in levels() {
            simd::set_override(Some(level)).unwrap();
            for pace in 0..=MAX_PACE {
                let (mut a, b) = (vec![-1f32; n], vec![2f32; n]);
                let (mut c, mut d) = (vec![0x3f80u16; n], vec![0x0001u16; n]);
                stream_4r3w_bf16(&mut a, &b, &mut c, &mut d, pace).unwrap();
                let want = 0.5 * paced(-1.0, pace) + 2.0;
                assert!(a.iter().all(|&x| x == want), "{level:?} pace {pace}");
                assert!(c.iter().all(|&x| x == 0x3f81) && d.iter().all(|&x| x == 0));
                stream_4r3w_bf16(&mut a, &b, &mut c, &mut d, pace).unwrap();
                assert!(c.iter().all(|&x| x == 0x3f80) && d.iter().all(|&x| x == 1));
            }
        }
        simd::set_override(None).unwrap();
        let (mut a, b, mut c) = (vec![0f32; 8], vec![0f32; 8], vec![0u16; 8]);
        assert!(stream_4r3w_bf16(&mut a, &b, &mut c, &mut [0u16; 7], 0).is_err());
        assert!(stream_4r3w_bf16(&mut a, &b, &mut c, &mut [0u16; 8], 9).is_err());
        assert!(a.iter().all(|&x| x == 0.0) && c.iter().all(|&x| x == 0));
    }
}
