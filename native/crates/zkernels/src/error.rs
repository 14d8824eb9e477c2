//! The one error type of the kernels. The binding maps each variant to a
//! Python exception that subclasses a builtin.

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum KernelError {
    /// Two buffers that must have one element per parameter differ in length.
    #[error("{what} has {got} elements but params has {expected}; pass tensors of the same numel")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A hyperparameter outside its valid range.
    #[error("invalid {name} = {value}: expected {expected}")]
    InvalidHyperparameter {
        name: &'static str,
        value: f64,
        expected: &'static str,
    },
    /// A SIMD level was requested that this CPU cannot run.
    #[error(
        "SIMD level `{requested}` is not supported by this CPU (best available: `{available}`)"
    )]
    UnsupportedSimd {
        requested: String,
        available: &'static str,
    },
    /// A name that is not a SIMD level.
    #[error("unknown SIMD level `{0}`; use one of `avx512`, `avx2`, `scalar`")]
    UnknownSimd(String),
}
