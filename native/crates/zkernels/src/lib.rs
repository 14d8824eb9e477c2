//! zstack CPU kernels.
//!
//! Pure Rust, no Python: the pyo3 binding (`znative-py`) is a thin layer over
//! this crate. Every kernel validates its inputs before touching memory, so an
//! error leaves the caller's buffers unchanged, and never panics on user input.
//!
//! Kernels are written once as scalar loops over slices and compiled several
//! times under `#[target_feature]` (AVX-512, AVX2+FMA, baseline x86-64), with
//! the variant picked at run time from the CPU's features ([`simd`]). Large
//! inputs are split into chunks processed on a shared thread pool ([`par`]); the short loops of inference kernels
//! run on a team the calling thread takes part in ([`team`]).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub mod bf16;
pub mod comm;
pub mod error;
pub mod optim;
pub mod par;
pub mod quant;
pub mod serve;
pub mod simd;
pub mod stream;
pub mod team;

pub use bf16::Elem;
pub use error::KernelError;
pub use simd::SimdLevel;
