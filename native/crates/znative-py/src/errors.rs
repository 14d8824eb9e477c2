//! Python exceptions of znative, each a subclass of a builtin so `except
//! ValueError` / `except TypeError` catch them, and the one conversion from
//! `KernelError`.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use zkernels::KernelError;

pyo3::create_exception!(
    znative,
    ShapeMismatchError,
    PyValueError,
    "Buffers that must have one element per parameter differ in length."
);
pyo3::create_exception!(
    znative,
    HyperparameterError,
    PyValueError,
    "A hyperparameter is outside its valid range."
);
pyo3::create_exception!(
    znative,
    LayoutError,
    PyValueError,
    "A buffer is not C-contiguous, not writeable, or aliases another argument."
);
pyo3::create_exception!(
    znative,
    SimdError,
    PyValueError,
    "An unknown or unsupported SIMD level was requested."
);
pyo3::create_exception!(
    znative,
    DTypeError,
    PyTypeError,
    "A buffer has a dtype the kernel does not accept."
);

pub fn to_py(e: KernelError) -> PyErr {
    let msg = e.to_string();
    match e {
        KernelError::LengthMismatch { .. } => ShapeMismatchError::new_err(msg),
        KernelError::InvalidHyperparameter { .. } => HyperparameterError::new_err(msg),
        KernelError::UnsupportedSimd { .. } | KernelError::UnknownSimd(_) => {
            SimdError::new_err(msg)
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ShapeMismatchError", py.get_type::<ShapeMismatchError>())?;
    m.add("HyperparameterError", py.get_type::<HyperparameterError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("SimdError", py.get_type::<SimdError>())?;
    m.add("DTypeError", py.get_type::<DTypeError>())?;
    Ok(())
}
