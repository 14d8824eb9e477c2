//! Quantized-inference kernels: INT8 GEMM with int32 accumulation, token-wise
//! INT8 activation quantization, and dequantize(-and-multiply) of INT4 and FP6
//! (4+2 bit split) weights. The layouts are those of `zquant.packing` /
//! `zquant.quantizers` (the torch reference these kernels are tested against).
//!
//! Matrices are row-major slices with explicit dimensions; weights are
//! `(n, k)` (`nn.Linear` layout, `n` outputs) and activations `(m, k)`.

mod dequant;
mod error;
mod int8;
#[cfg(target_arch = "x86_64")]
mod int8_avx2;
mod int8_outliers;
#[cfg(target_arch = "x86_64")]
mod int8_rows;

pub use dequant::{
    dequant_linear, dequant_linear_a8, dequantize, PackedWeight, WeightFormat, A8_BLOCK,
};
pub use error::QuantError;
pub use int8::{int8_gemm, int8_linear, quantize_tokenwise, vnni_available};
pub use int8_outliers::{column_absmax, int8_linear_outliers, int8_linear_split};

/// Runs `f(block_index)` for `blocks` blocks on the kernels' team, the caller
/// taking part ([`crate::team`]; inline when there is one block or one thread).
fn for_blocks<F: Fn(usize) + Sync + Send>(blocks: usize, f: F) {
    crate::team::run(blocks, f);
}

/// A raw pointer that tasks of [`for_blocks`] share to write disjoint parts of
/// one output buffer.
#[derive(Clone, Copy)]
struct SharedOut<T>(*mut T);
// SAFETY: every user writes only the elements of its own block, so no two
// threads touch the same element, and the buffer outlives the parallel loop.
unsafe impl<T> Send for SharedOut<T> {}
unsafe impl<T> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    fn get(self) -> *mut T {
        self.0
    }
}
