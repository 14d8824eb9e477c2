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

// ---- async file IO (zaio) ----
//
// `AioError(OSError)` is the base of every IO failure, with `errno`, `path`
// and `offset` set. Failures that have a builtin OSError subclass get a class
// deriving from both, so `except FileNotFoundError` and `except AioError`
// both work; ENOSPC, EFBIG and other errnos raise `AioError` itself.

pyo3::create_exception!(
    znative,
    AioError,
    pyo3::exceptions::PyOSError,
    "An async file-IO request failed; `errno`, `path` and `offset` say where."
);

static AIO_NOT_FOUND: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
    pyo3::sync::PyOnceLock::new();
static AIO_PERMISSION: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
    pyo3::sync::PyOnceLock::new();
static AIO_SHORT_READ: pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>> =
    pyo3::sync::PyOnceLock::new();

/// `class name(AioError, *extra)` created through `type()` (pyo3 classes have one base).
fn aio_subclass<'py>(
    py: Python<'py>,
    cell: &'static pyo3::sync::PyOnceLock<Py<pyo3::types::PyType>>,
    name: &str,
    extra: Option<Bound<'py, pyo3::types::PyType>>,
    doc: &str,
) -> PyResult<Bound<'py, pyo3::types::PyType>> {
    let t = cell.get_or_try_init(py, || -> PyResult<_> {
        let mut bases = vec![py.get_type::<AioError>().into_any()];
        bases.extend(extra.map(Bound::into_any));
        let ns = pyo3::types::PyDict::new(py);
        ns.set_item("__module__", "znative")?;
        ns.set_item("__doc__", doc)?;
        let bases = pyo3::types::PyTuple::new(py, bases)?;
        let cls = py
            .get_type::<pyo3::types::PyType>()
            .call1((name, bases, ns))?;
        Ok(cls.cast_into::<pyo3::types::PyType>()?.unbind())
    })?;
    Ok(t.bind(py).clone())
}

fn aio_classes(py: Python<'_>) -> PyResult<[Bound<'_, pyo3::types::PyType>; 3]> {
    use pyo3::exceptions::{PyFileNotFoundError, PyPermissionError};
    Ok([
        aio_subclass(
            py,
            &AIO_NOT_FOUND,
            "AioFileNotFoundError",
            Some(py.get_type::<PyFileNotFoundError>()),
            "The file or its directory does not exist (ENOENT).",
        )?,
        aio_subclass(
            py,
            &AIO_PERMISSION,
            "AioPermissionError",
            Some(py.get_type::<PyPermissionError>()),
            "The file or its directory may not be opened (EACCES, EPERM, EROFS).",
        )?,
        aio_subclass(
            py,
            &AIO_SHORT_READ,
            "AioShortReadError",
            None,
            "The file ended before the requested range (errno is None).",
        )?,
    ])
}

/// The one conversion of `zaio::AioError` to a Python exception.
pub fn aio_to_py(e: zaio::AioError) -> PyErr {
    use zaio::AioError as E;
    let msg = e.to_string();
    if matches!(e, E::InvalidConfig { .. } | E::UnknownRequest(_)) {
        return PyValueError::new_err(msg);
    }
    Python::attach(|py| {
        let build = || -> PyResult<PyErr> {
            let [not_found, permission, short_read] = aio_classes(py)?;
            let cls = match &e {
                E::NotFound { .. } => not_found,
                E::PermissionDenied { .. } => permission,
                E::ShortRead { .. } => short_read,
                _ => py.get_type::<AioError>(),
            };
            let path = e.path().map(|p| p.to_string_lossy().into_owned());
            let inst = match (e.errno(), &path) {
                (Some(n), Some(p)) => cls.call1((n, msg.as_str(), p.as_str()))?,
                (Some(n), None) => cls.call1((n, msg.as_str()))?,
                (None, _) => cls.call1((msg.as_str(),))?,
            };
            inst.setattr("path", path)?;
            inst.setattr("offset", e.offset())?;
            Ok(PyErr::from_value(inst))
        };
        build().unwrap_or_else(|err| err)
    })
}

pub fn register_aio(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("AioError", py.get_type::<AioError>())?;
    for cls in aio_classes(py)? {
        m.add(cls.name()?, cls)?;
    }
    Ok(())
}
