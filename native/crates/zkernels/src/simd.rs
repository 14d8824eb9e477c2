//! Runtime CPU feature dispatch.
//!
//! The build targets baseline x86-64 (no `-march=native`); kernels carry
//! AVX-512 and AVX2+FMA variants compiled with `#[target_feature]` and
//! [`active`] picks the best one the CPU supports. `ZNATIVE_SIMD=scalar|avx2|avx512`
//! or [`set_override`] forces a lower level (tests use this to check that every
//! variant computes the same thing).

use std::str::FromStr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::KernelError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar = 0,
    Avx2 = 1,
    Avx512 = 2,
}

impl SimdLevel {
    pub const fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    const fn from_u8(v: u8) -> Option<SimdLevel> {
        match v {
            0 => Some(SimdLevel::Scalar),
            1 => Some(SimdLevel::Avx2),
            2 => Some(SimdLevel::Avx512),
            _ => None,
        }
    }
}

impl FromStr for SimdLevel {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => Ok(SimdLevel::Scalar),
            "avx2" | "avx2+fma" => Ok(SimdLevel::Avx2),
            "avx512" | "avx-512" => Ok(SimdLevel::Avx512),
            other => Err(KernelError::UnknownSimd(other.to_string())),
        }
    }
}

/// The best level this CPU supports (checked once).
pub fn detected() -> SimdLevel {
    static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> SimdLevel {
    if std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("fma")
    {
        SimdLevel::Avx512
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        SimdLevel::Avx2
    } else {
        SimdLevel::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> SimdLevel {
    SimdLevel::Scalar
}

/// Whether the CPU has AVX512-BF16 (f32 to bf16 conversion instructions); only
/// used on top of [`SimdLevel::Avx512`].
pub fn has_avx512_bf16() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

const NO_OVERRIDE: u8 = u8::MAX;
const UNREAD: u8 = u8::MAX - 1;
static OVERRIDE: AtomicU8 = AtomicU8::new(UNREAD);

/// The level kernels run at now: the override if one is set, else [`detected`].
pub fn active() -> SimdLevel {
    let mut v = OVERRIDE.load(Ordering::Relaxed);
    if v == UNREAD {
        // An unusable ZNATIVE_SIMD value is ignored here; `znative` reports it at import.
        v = std::env::var("ZNATIVE_SIMD")
            .ok()
            .and_then(|s| s.parse::<SimdLevel>().ok())
            .filter(|l| *l <= detected())
            .map_or(NO_OVERRIDE, |l| l as u8);
        OVERRIDE.store(v, Ordering::Relaxed);
    }
    SimdLevel::from_u8(v).unwrap_or_else(detected)
}

/// Calls of [`set_override`] so far: a test comparing the bits of two calls at one level
/// checks that no test running beside it forced another level in between.
#[cfg(test)]
pub(crate) static OVERRIDES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Forces kernels to run at `level` (`None` restores detection). Fails if the
/// CPU cannot run that level.
pub fn set_override(level: Option<SimdLevel>) -> Result<(), KernelError> {
    #[cfg(test)]
    OVERRIDES.fetch_add(1, Ordering::SeqCst);
    match level {
        Some(l) if l > detected() => Err(KernelError::UnsupportedSimd {
            requested: l.name().to_string(),
            available: detected().name(),
        }),
        Some(l) => {
            OVERRIDE.store(l as u8, Ordering::Relaxed);
            Ok(())
        }
        None => {
            OVERRIDE.store(NO_OVERRIDE, Ordering::Relaxed);
            Ok(())
        }
    }
}

/// Declares the AVX-512 and AVX2 variants of a kernel body and a dispatcher
/// `$dispatch` that calls the variant for [`active`]. The body must be
/// `#[inline(always)]` so it is compiled under each variant's features.
macro_rules! multiversion {
    ($dispatch:ident => $body:ident <$($g:ident: $bound:path),*> ($($arg:ident: $ty:ty),* $(,)?)) => {
        #[inline]
        fn $dispatch<$($g: $bound),*>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                unsafe fn avx512<$($g: $bound),*>($($arg: $ty),*) {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2<$($g: $bound),*>($($arg: $ty),*) {
                    $body($($arg),*)
                }
                match $crate::simd::active() {
                    // SAFETY: `active()` never returns a level above what the CPU reports.
                    $crate::simd::SimdLevel::Avx512 => return unsafe { avx512($($arg),*) },
                    $crate::simd::SimdLevel::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::simd::SimdLevel::Scalar => {}
                }
            }
            $body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names() {
        assert_eq!("AVX2".parse::<SimdLevel>().unwrap(), SimdLevel::Avx2);
        assert!(matches!(
            "sse9".parse::<SimdLevel>(),
            Err(KernelError::UnknownSimd(_))
        ));
    }

    #[test]
    fn detected_is_at_least_scalar_and_override_checks() {
        let d = detected();
        assert!(d >= SimdLevel::Scalar);
        if d < SimdLevel::Avx512 {
            assert!(set_override(Some(SimdLevel::Avx512)).is_err());
        }
    }
}
