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

multiversion!(stream_dispatch => stream_body<>(a: &mut [f32], b: &[f32], c: &mut [f32], d: &mut [f32], s: &f32));

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
