//! Element types a kernel can read and write: `f32` and bfloat16 stored as its
//! 16 raw bits in a `u16` (the layout of `torch.bfloat16`).

/// A storage type that converts to and from `f32` for arithmetic.
pub trait Elem: Copy + Send + Sync + 'static {
    /// Human-readable dtype name, for messages.
    const NAME: &'static str;
    /// Whether this is bfloat16 (`u16` bits) rather than `f32`; lets SIMD kernels
    /// pick their loads and stores at compile time.
    const BF16: bool;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
}

impl Elem for f32 {
    const NAME: &'static str = "float32";
    const BF16: bool = false;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
}

/// bfloat16 as raw bits.
impl Elem for u16 {
    const NAME: &'static str = "bfloat16";
    const BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f32_to_bf16(x)
    }
}

/// Widens bfloat16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Rounds f32 to bfloat16 bits, round-to-nearest-even, as `tensor.to(torch.bfloat16)` does.
/// NaN stays NaN (quietened). Written branch-free so it vectorizes.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + lsb) >> 16;
    let nan = (bits >> 16) | 0x0040;
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    (if is_nan { nan } else { rounded }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_exact_values() {
        for &x in &[
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            65536.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(bf16_to_f32(f32_to_bf16(x)).to_bits(), x.to_bits());
        }
    }

    #[test]
    fn rounds_to_nearest_even() {
        // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties go to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even): rounds up.
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3f82);
        // just above halfway rounds up
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
    }

    #[test]
    fn nan_stays_nan() {
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        // a NaN whose payload lives only in the low bits must not round to infinity
        assert!(bf16_to_f32(f32_to_bf16(f32::from_bits(0x7f80_0001))).is_nan());
    }

    #[test]
    fn overflow_rounds_to_infinity() {
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
    }
}
