//! Borrowing numpy arrays as Rust slices without copying.
//!
//! Every argument is checked (is an ndarray, dtype, C-contiguous, writeable,
//! not aliased, no async IO in flight on it) before any kernel runs, so a bad call changes nothing. bf16
//! buffers arrive as 16-bit integer views (`tensor.view(torch.int16).numpy()`);
//! `uint16` and `int16` are both taken as raw bfloat16 bits.

use numpy::{
    Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::errors::{DTypeError, LayoutError};

/// A read-only f32 or bf16 buffer.
pub enum RoBuf<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    Bf16(PyReadonlyArrayDyn<'py, u16>),
    Bf16Signed(PyReadonlyArrayDyn<'py, i16>),
}

/// A writeable f32 or bf16 buffer.
pub enum RwBuf<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    Bf16(PyReadwriteArrayDyn<'py, u16>),
    Bf16Signed(PyReadwriteArrayDyn<'py, i16>),
}

/// A slice view of a buffer, `u16` holding bf16 bits.
pub enum Slice<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

pub enum SliceMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

fn untyped<'a, 'py>(
    name: &str,
    obj: &'a Bound<'py, PyAny>,
) -> PyResult<&'a Bound<'py, PyUntypedArray>> {
    obj.cast::<PyUntypedArray>().map_err(|_| {
        DTypeError::new_err(format!(
            "{name}: expected a numpy array (a CPU tensor's `.numpy()` view), got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string())
        ))
    })
}

/// Refuses memory that async IO is still using (see [`crate::inflight`]).
fn check_inflight(name: &str, a: &Bound<'_, PyUntypedArray>, writes: bool) -> PyResult<()> {
    // SAFETY: `a` is a live ndarray; its header is read, not written.
    let data = unsafe { (*a.as_array_ptr()).fields.data as usize };
    let len = a.len() * a.dtype().itemsize();
    match crate::inflight::conflict(data, len, writes) {
        Some(why) => Err(LayoutError::new_err(format!("{name}: {why}"))),
        None => Ok(()),
    }
}

fn is<T: Element>(a: &Bound<'_, PyUntypedArray>) -> bool {
    a.dtype().is_equiv_to(&numpy::dtype::<T>(a.py()))
}

fn dtype_name(a: &Bound<'_, PyUntypedArray>) -> String {
    a.dtype()
        .str()
        .map_or_else(|_| "?".to_string(), |s| s.to_string())
}

fn check_contiguous(name: &str, a: &Bound<'_, PyUntypedArray>) -> PyResult<()> {
    if a.is_c_contiguous() {
        Ok(())
    } else {
        Err(LayoutError::new_err(format!(
            "{name}: buffer is not C-contiguous; the kernel updates memory in place, so pass a contiguous tensor (`.contiguous()` before creating the optimizer)"
        )))
    }
}

fn borrow_err(name: &str, e: impl std::fmt::Display) -> PyErr {
    LayoutError::new_err(format!(
        "{name}: cannot borrow the buffer ({e}); it must be writeable and must not alias another argument"
    ))
}

/// Borrows a read-only buffer; `allow_bf16` admits 16-bit integer (bf16) arrays.
pub fn ro<'py>(name: &str, obj: &Bound<'py, PyAny>, allow_bf16: bool) -> PyResult<RoBuf<'py>> {
    let a = untyped(name, obj)?;
    check_contiguous(name, a)?;
    check_inflight(name, a, false)?;
    let b = if is::<f32>(a) {
        RoBuf::F32(
            obj.cast::<PyArrayDyn<f32>>()?
                .try_readonly()
                .map_err(|e| borrow_err(name, e))?,
        )
    } else if allow_bf16 && is::<u16>(a) {
        RoBuf::Bf16(
            obj.cast::<PyArrayDyn<u16>>()?
                .try_readonly()
                .map_err(|e| borrow_err(name, e))?,
        )
    } else if allow_bf16 && is::<i16>(a) {
        RoBuf::Bf16Signed(
            obj.cast::<PyArrayDyn<i16>>()?
                .try_readonly()
                .map_err(|e| borrow_err(name, e))?,
        )
    } else {
        return Err(dtype_err(name, a, allow_bf16));
    };
    Ok(b)
}

/// Borrows a writeable buffer; `allow_bf16` admits 16-bit integer (bf16) arrays.
pub fn rw<'py>(name: &str, obj: &Bound<'py, PyAny>, allow_bf16: bool) -> PyResult<RwBuf<'py>> {
    let a = untyped(name, obj)?;
    check_contiguous(name, a)?;
    check_inflight(name, a, true)?;
    let b = if is::<f32>(a) {
        RwBuf::F32(
            obj.cast::<PyArrayDyn<f32>>()?
                .try_readwrite()
                .map_err(|e| borrow_err(name, e))?,
        )
    } else if allow_bf16 && is::<u16>(a) {
        RwBuf::Bf16(
            obj.cast::<PyArrayDyn<u16>>()?
                .try_readwrite()
                .map_err(|e| borrow_err(name, e))?,
        )
    } else if allow_bf16 && is::<i16>(a) {
        RwBuf::Bf16Signed(
            obj.cast::<PyArrayDyn<i16>>()?
                .try_readwrite()
                .map_err(|e| borrow_err(name, e))?,
        )
    } else {
        return Err(dtype_err(name, a, allow_bf16));
    };
    Ok(b)
}

fn dtype_err(name: &str, a: &Bound<'_, PyUntypedArray>, allow_bf16: bool) -> PyErr {
    let want = if allow_bf16 {
        "float32, or bfloat16 viewed as int16/uint16"
    } else {
        "float32"
    };
    DTypeError::new_err(format!(
        "{name}: expected {want}, got dtype {}",
        dtype_name(a)
    ))
}

fn not_contiguous(name: &str) -> PyErr {
    LayoutError::new_err(format!("{name}: buffer is not C-contiguous"))
}

/// Borrows a writeable float32 buffer (parameters, bandwidth-probe arrays).
pub fn rw_f32<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<PyReadwriteArrayDyn<'py, f32>> {
    match rw(name, obj, false)? {
        RwBuf::F32(a) => Ok(a),
        _ => Err(dtype_err(name, untyped(name, obj)?, false)),
    }
}

/// Borrows a read-only float32 buffer.
pub fn ro_f32<'py>(name: &str, obj: &Bound<'py, PyAny>) -> PyResult<PyReadonlyArrayDyn<'py, f32>> {
    match ro(name, obj, false)? {
        RoBuf::F32(a) => Ok(a),
        _ => Err(dtype_err(name, untyped(name, obj)?, false)),
    }
}

/// The contiguous f32 slice of a borrowed buffer.
pub fn f32_mut<'a>(name: &str, a: &'a mut PyReadwriteArrayDyn<'_, f32>) -> PyResult<&'a mut [f32]> {
    a.as_slice_mut().map_err(|_| not_contiguous(name))
}

/// The contiguous f32 slice of a read-only buffer.
pub fn f32_ref<'a>(name: &str, a: &'a PyReadonlyArrayDyn<'_, f32>) -> PyResult<&'a [f32]> {
    a.as_slice().map_err(|_| not_contiguous(name))
}

impl RoBuf<'_> {
    pub fn slice(&self, name: &str) -> PyResult<Slice<'_>> {
        Ok(match self {
            RoBuf::F32(a) => Slice::F32(a.as_slice().map_err(|_| not_contiguous(name))?),
            RoBuf::Bf16(a) => Slice::Bf16(a.as_slice().map_err(|_| not_contiguous(name))?),
            RoBuf::Bf16Signed(a) => {
                let s = a.as_slice().map_err(|_| not_contiguous(name))?;
                // SAFETY: i16 and u16 have the same size and alignment; bits are reinterpreted.
                Slice::Bf16(unsafe {
                    std::slice::from_raw_parts(s.as_ptr().cast::<u16>(), s.len())
                })
            }
        })
    }
}

impl RwBuf<'_> {
    pub fn slice_mut(&mut self, name: &str) -> PyResult<SliceMut<'_>> {
        Ok(match self {
            RwBuf::F32(a) => SliceMut::F32(a.as_slice_mut().map_err(|_| not_contiguous(name))?),
            RwBuf::Bf16(a) => SliceMut::Bf16(a.as_slice_mut().map_err(|_| not_contiguous(name))?),
            RwBuf::Bf16Signed(a) => {
                let s = a.as_slice_mut().map_err(|_| not_contiguous(name))?;
                // SAFETY: i16 and u16 have the same size and alignment; bits are reinterpreted.
                SliceMut::Bf16(unsafe {
                    std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u16>(), s.len())
                })
            }
        })
    }
}
