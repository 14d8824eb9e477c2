//! Dequantize INT4 (two per byte) and FP6 e3m2 (4+2 bit planes) weights, and the
//! fused dequantize-and-multiply linear.
//!
//! Layouts (see `zquant.packing`): a weight `(n, k)` is stored row by row; the
//! INT4 plane holds element `2t` in the low nibble of byte `t`; the FP6 2-bit
//! plane holds element `4t+i` in bits `2i..2i+1` of byte `t`, and the 6-bit code
//! is `(two_bit << 4) | four_bit`. Scales are `(scale_rows, groups)` float32
//! with `scale_rows` 1 (per tensor) or `n`; group `g` covers columns
//! `g·group .. (g+1)·group`. INT4 levels are `code - offset` (symmetric, offset
//! `2^(bits-1)`) or `code - zero[row, g]` (asymmetric). FP6 (bias 3) decodes by
//! moving its bits into a float32 with the exponent rebiased (`weight::fp6_value`).
//!
//! [`weight`] holds the packed weight, its validation and the plain dequantize;
//! [`linear`] the fused dequantize-and-multiply built on its row decoder; [`a8`] the INT4
//! linear with activations quantized to INT8 (a numeric path of its own).

mod a8;
#[cfg(target_arch = "x86_64")]
mod a8_avx2;
#[cfg(target_arch = "x86_64")]
mod a8_gemv_avx2;
mod gemv;
#[cfg(target_arch = "x86_64")]
mod gemv_avx2;
mod linear;
#[cfg(target_arch = "x86_64")]
mod tile_avx2;
mod weight;

pub use a8::{dequant_linear_a8, BLOCK as A8_BLOCK};
pub use linear::dequant_linear;
pub use weight::{dequantize, PackedWeight, WeightFormat};

#[cfg(test)]
mod a8_tests;
#[cfg(test)]
mod fixture;
#[cfg(test)]
mod tests;
