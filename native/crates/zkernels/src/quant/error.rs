//! Errors of the quantization kernels (the binding maps shape errors to
//! `ShapeMismatchError` and bad parameters to `HyperparameterError`).

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// A buffer's length does not match the dimensions given.
    #[error(
        "{what} has {got} elements but {expected_desc} = {expected}; pass buffers of those shapes"
    )]
    Shape {
        what: &'static str,
        expected_desc: String,
        expected: usize,
        got: usize,
    },
    /// A parameter out of its range (bits, group size, offset).
    #[error("invalid {name} = {value}: expected {expected}")]
    Param {
        name: &'static str,
        value: i64,
        expected: &'static str,
    },
}

pub(crate) fn check_len(
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
