//! Kernels for compressed collectives (zcomm): 1-bit sign packing with the
//! scale's sum of squares fused into the same pass (`signs`), and blockwise
//! symmetric INT8 / INT4 quantization with one f32 scale per block (`blockq`).
//!
//! The layouts are those of the torch references these kernels are tested
//! against: `zcomm.signs` (bits most significant first, 1 where the element is
//! not negative) and `zcomm.blockquant` (offset-binary codes, INT4 low nibble
//! first). Errors are [`QuantError`]s, like the other quantization kernels.
//!
//! Large inputs are cut into parts of a fixed number of elements ([`PART`]),
//! not a number that depends on the thread count, so every reduction (the
//! signs' sum of squares) adds the same partial sums in the same order whatever
//! the pool size.

mod blockq;
mod signs;

pub use blockq::{dequantize_blocks, quantize_blocks, BlockParams};
pub use signs::{pack_signs, packed_len, unpack_signs};

use crate::quant::QuantError;

/// Elements per parallel part: 64 Ki (a multiple of 128, so parts start on
/// whole sign bytes and whole 16-float vectors).
pub const PART: usize = 1 << 16;

fn check_len(
    what: &'static str,
    got: usize,
    expected: usize,
    desc: impl FnOnce() -> String,
) -> Result<(), QuantError> {
    if got == expected {
        Ok(())
    } else {
        Err(QuantError::Shape {
            what,
            expected_desc: desc(),
            expected,
            got,
        })
    }
}

/// Runs `f(part_index)` for `parts` parts on the kernels' pool (inline when
/// there are fewer than two parts or one thread) and returns the results in
/// part order.
fn map_parts<T: Send, F: Fn(usize) -> T + Sync + Send>(parts: usize, f: F) -> Vec<T> {
    if parts <= 1 || crate::par::num_threads() <= 1 {
        return (0..parts).map(f).collect();
    }
    crate::par::install(|| {
        use rayon::prelude::*;
        (0..parts).into_par_iter().map(f).collect()
    })
}

/// A raw pointer that parts of [`map_parts`] share to write disjoint ranges
/// of one output buffer.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: every part writes only its own range, no two threads touch the same
// element, and the buffer outlives the parallel loop.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    /// The sub-slice `start..start + len`.
    ///
    /// # Safety
    /// The range must lie inside the buffer and be used by one part only.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        // SAFETY: the caller guarantees the range is in bounds and unshared.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}
