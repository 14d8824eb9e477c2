//! Quantization kernels exposed to Python (`zkernels::quant`). Each function
//! borrows and checks every buffer (dtype, C-contiguous, writeable output),
//! then runs the kernel with the GIL released. Dimensions come from the
//! arrays' shapes; the kernel re-checks every length.

use numpy::{
    Element, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn,
    PyReadwriteArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use zkernels::quant::{self, PackedWeight, QuantError, WeightFormat};

use crate::errors::{DTypeError, HyperparameterError, LayoutError, ShapeMismatchError};

pub(crate) fn to_py(e: QuantError) -> PyErr {
    let msg = e.to_string();
    match e {
        QuantError::Shape { .. } => ShapeMismatchError::new_err(msg),
        QuantError::Param { .. } => HyperparameterError::new_err(msg),
    }
}

fn array<'a, 'py, T: Element>(
    name: &str,
    obj: &'a Bound<'py, PyAny>,
    want: &str,
) -> PyResult<&'a Bound<'py, PyArrayDyn<T>>> {
    let untyped = obj.cast::<PyUntypedArray>().map_err(|_| {
        DTypeError::new_err(format!(
            "{name}: expected a numpy array of {want} (a CPU tensor's `.numpy()`), got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".to_string(), |n| n.to_string())
        ))
    })?;
    if !untyped.dtype().is_equiv_to(&numpy::dtype::<T>(obj.py())) {
        let got = untyped
            .dtype()
            .str()
            .map_or_else(|_| "?".to_string(), |s| s.to_string());
        return Err(DTypeError::new_err(format!(
            "{name}: expected dtype {want}, got {got}"
        )));
    }
    if !untyped.is_c_contiguous() {
        return Err(LayoutError::new_err(format!(
            "{name}: buffer is not C-contiguous; pass `.contiguous()`"
        )));
    }
    Ok(obj.cast::<PyArrayDyn<T>>()?)
}

pub(crate) fn ro<'py, T: Element>(
    name: &str,
    obj: &Bound<'py, PyAny>,
    want: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, T>> {
    array::<T>(name, obj, want)?
        .try_readonly()
        .map_err(|e| LayoutError::new_err(format!("{name}: cannot borrow the buffer ({e})")))
}

pub(crate) fn rw<'py, T: Element>(
    name: &str,
    obj: &Bound<'py, PyAny>,
    want: &str,
) -> PyResult<PyReadwriteArrayDyn<'py, T>> {
    array::<T>(name, obj, want)?.try_readwrite().map_err(|e| {
        LayoutError::new_err(format!(
            "{name}: cannot borrow the buffer ({e}); it must be writeable and must not alias an input"
        ))
    })
}

/// `(rows, cols)` of a 2-D array.
fn dims2(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<(usize, usize)> {
    let shape = obj.cast::<PyUntypedArray>()?.shape().to_vec();
    match shape[..] {
        [r, c] => Ok((r, c)),
        _ => Err(ShapeMismatchError::new_err(format!(
            "{name}: expected a 2-D array, got shape {shape:?}"
        ))),
    }
}

pub(crate) fn slice<'a, T: Element>(
    name: &str,
    a: &'a PyReadonlyArrayDyn<'_, T>,
) -> PyResult<&'a [T]> {
    a.as_slice()
        .map_err(|_| LayoutError::new_err(format!("{name}: buffer is not C-contiguous")))
}

pub(crate) fn slice_mut<'a, T: Element>(
    name: &str,
    a: &'a mut PyReadwriteArrayDyn<'_, T>,
) -> PyResult<&'a mut [T]> {
    a.as_slice_mut()
        .map_err(|_| LayoutError::new_err(format!("{name}: buffer is not C-contiguous")))
}

/// `out (m, n) int32 = a (m, k) int8 · b (n, k) int8ᵀ`, exact.
#[pyfunction]
pub fn int8_gemm(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let ((m, k), (n, _)) = (dims2("a", a)?, dims2("b", b)?);
    let (ra, rb) = (ro::<i8>("a", a, "int8")?, ro::<i8>("b", b, "int8")?);
    let mut ro_out = rw::<i32>("out", out, "int32")?;
    let (sa, sb, so) = (
        slice("a", &ra)?,
        slice("b", &rb)?,
        slice_mut("out", &mut ro_out)?,
    );
    py.detach(|| quant::int8_gemm(sa, sb, so, m, n, k))
        .map_err(to_py)
}

/// Token-wise symmetric quantization of `x (m, k) float32` into `q (m, k) int8`, `scale (m,)`.
#[pyfunction]
#[pyo3(signature = (x, q, scale, *, bits=8))]
pub fn quantize_tokenwise(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    q: &Bound<'_, PyAny>,
    scale: &Bound<'_, PyAny>,
    bits: u32,
) -> PyResult<()> {
    let (m, k) = dims2("x", x)?;
    let rx = ro::<f32>("x", x, "float32")?;
    let mut rq = rw::<i8>("q", q, "int8")?;
    let mut rs = rw::<f32>("scale", scale, "float32")?;
    let (sx, sq, ss) = (
        slice("x", &rx)?,
        slice_mut("q", &mut rq)?,
        slice_mut("scale", &mut rs)?,
    );
    py.detach(|| quant::quantize_tokenwise(sx, m, k, bits, sq, ss))
        .map_err(to_py)
}

/// W8A8 linear: `out (m, n) = int8(x) · w (n, k) int8ᵀ · a_scale · w_scale + bias`;
/// with `outliers` > 0, that many input channels (the largest over the rows) stay float32.
#[pyfunction]
#[pyo3(signature = (x, w, w_scale, bias, out, *, outliers=0))]
#[allow(clippy::too_many_arguments)]
pub fn int8_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    w_scale: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    outliers: usize,
) -> PyResult<()> {
    let ((m, k), (n, _)) = (dims2("x", x)?, dims2("w", w)?);
    let (rx, rw_) = (ro::<f32>("x", x, "float32")?, ro::<i8>("w", w, "int8")?);
    let rs = ro::<f32>("w_scale", w_scale, "float32")?;
    let rb = bias.map(|b| ro::<f32>("bias", b, "float32")).transpose()?;
    let mut ro_out = rw::<f32>("out", out, "float32")?;
    let (sx, sw, ss) = (slice("x", &rx)?, slice("w", &rw_)?, slice("w_scale", &rs)?);
    let sb = rb.as_ref().map(|b| slice("bias", b)).transpose()?;
    let so = slice_mut("out", &mut ro_out)?;
    py.detach(|| quant::int8_linear_outliers(sx, sw, ss, sb, so, m, n, k, outliers))
        .map_err(to_py)
}

/// W8A8 linear with the input channels `cols` (int64) kept float32 and the outlier term
/// left to the caller: `out` the INT8 part (+ bias), `xo (m, t)` the channels' values, `wc
/// (n, t)` the weight's columns times their scales (the caller adds `xo @ wc.T`).
#[pyfunction]
#[pyo3(signature = (x, w, w_scale, bias, cols, out, xo, wc))]
#[allow(clippy::too_many_arguments)]
pub fn int8_linear_split(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    w_scale: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    cols: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    xo: &Bound<'_, PyAny>,
    wc: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let ((m, k), (n, _)) = (dims2("x", x)?, dims2("w", w)?);
    let (rx, rw_) = (ro::<f32>("x", x, "float32")?, ro::<i8>("w", w, "int8")?);
    let rs = ro::<f32>("w_scale", w_scale, "float32")?;
    let rb = bias.map(|b| ro::<f32>("bias", b, "float32")).transpose()?;
    let rc = ro::<i64>("cols", cols, "int64")?;
    let mut ro_out = rw::<f32>("out", out, "float32")?;
    let mut ro_xo = rw::<f32>("xo", xo, "float32")?;
    let mut ro_wc = rw::<f32>("wc", wc, "float32")?;
    let (sx, sw, ss) = (slice("x", &rx)?, slice("w", &rw_)?, slice("w_scale", &rs)?);
    let sb = rb.as_ref().map(|b| slice("bias", b)).transpose()?;
    let sc = slice("cols", &rc)?;
    let so = slice_mut("out", &mut ro_out)?;
    let (sxo, swc) = (slice_mut("xo", &mut ro_xo)?, slice_mut("wc", &mut ro_wc)?);
    py.detach(|| quant::int8_linear_split(sx, sw, ss, sb, sc, so, m, n, k, sxo, swc))
        .map_err(to_py)
}

/// `out (k,) = max_i |x[i, :]|` of `x (m, k) float32` (`x.abs().amax(0)`, exact; NaN propagates).
#[pyfunction]
pub fn column_absmax(py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<()> {
    let (m, k) = dims2("x", x)?;
    let rx = ro::<f32>("x", x, "float32")?;
    let mut r_out = rw::<f32>("out", out, "float32")?;
    let (sx, so) = (slice("x", &rx)?, slice_mut("out", &mut r_out)?);
    py.detach(|| quant::column_absmax(sx, m, k, so))
        .map_err(to_py)
}

/// Borrowed buffers of a packed weight, kept alive while the kernel runs.
struct Packed<'py> {
    data: PyReadonlyArrayDyn<'py, u8>,
    data2: Option<PyReadonlyArrayDyn<'py, u8>>,
    scale: PyReadonlyArrayDyn<'py, f32>,
    zero: Option<PyReadonlyArrayDyn<'py, f32>>,
    n: usize,
}

impl<'py> Packed<'py> {
    fn borrow(
        data: &Bound<'py, PyAny>,
        data2: Option<&Bound<'py, PyAny>>,
        scale: &Bound<'py, PyAny>,
        zero: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        Ok(Packed {
            n: dims2("data", data)?.0,
            data: ro::<u8>("data", data, "uint8")?,
            data2: data2.map(|d| ro::<u8>("data2", d, "uint8")).transpose()?,
            scale: ro::<f32>("scale", scale, "float32")?,
            zero: zero.map(|z| ro::<f32>("zero", z, "float32")).transpose()?,
        })
    }

    fn weight(&self, format: WeightFormat, k: usize, group: usize) -> PyResult<PackedWeight<'_>> {
        Ok(PackedWeight {
            format,
            data: slice("data", &self.data)?,
            data2: self.data2.as_ref().map(|d| slice("data2", d)).transpose()?,
            scale: slice("scale", &self.scale)?,
            zero: self.zero.as_ref().map(|z| slice("zero", z)).transpose()?,
            n: self.n,
            k,
            group,
        })
    }
}

fn format(fmt: &str, offset: i32) -> PyResult<WeightFormat> {
    match fmt {
        "int4" => Ok(WeightFormat::Int4 { offset }),
        "fp6" => Ok(WeightFormat::Fp6),
        other => Err(HyperparameterError::new_err(format!(
            "invalid fmt = {other:?}: expected \"int4\" or \"fp6\""
        ))),
    }
}

/// Dequantizes a packed INT4 / FP6 weight into `out (n, k) float32`.
#[pyfunction]
#[pyo3(signature = (data, scale, out, *, fmt, group_size, data2=None, zero=None, offset=8))]
#[allow(clippy::too_many_arguments)]
pub fn dequantize_weight(
    py: Python<'_>,
    data: &Bound<'_, PyAny>,
    scale: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    fmt: &str,
    group_size: usize,
    data2: Option<&Bound<'_, PyAny>>,
    zero: Option<&Bound<'_, PyAny>>,
    offset: i32,
) -> PyResult<()> {
    let (_, k) = dims2("out", out)?;
    let packed = Packed::borrow(data, data2, scale, zero)?;
    let w = packed.weight(format(fmt, offset)?, k, group_size)?;
    let mut ro_out = rw::<f32>("out", out, "float32")?;
    let so = slice_mut("out", &mut ro_out)?;
    py.detach(|| quant::dequantize(&w, so)).map_err(to_py)
}

/// `out (m, n) = x (m, k) · dequant(w)ᵀ + bias` without materializing the float weight;
/// `act_bits=8`: `x` quantized to INT8 per 32 columns first (`quant::dequant_linear_a8`,
/// INT4 only).
#[pyfunction]
#[pyo3(signature = (x, data, scale, bias, out, *, fmt, group_size, data2=None, zero=None, offset=8, act_bits=None))]
#[allow(clippy::too_many_arguments)]
pub fn dequant_linear(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    data: &Bound<'_, PyAny>,
    scale: &Bound<'_, PyAny>,
    bias: Option<&Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    fmt: &str,
    group_size: usize,
    data2: Option<&Bound<'_, PyAny>>,
    zero: Option<&Bound<'_, PyAny>>,
    offset: i32,
    act_bits: Option<u32>,
) -> PyResult<()> {
    if act_bits.is_some_and(|b| b != 8) {
        return Err(HyperparameterError::new_err(format!(
            "invalid act_bits = {}: expected None (float activations) or 8",
            act_bits.unwrap_or_default()
        )));
    }
    let (m, k) = dims2("x", x)?;
    let packed = Packed::borrow(data, data2, scale, zero)?;
    let w = packed.weight(format(fmt, offset)?, k, group_size)?;
    let rx = ro::<f32>("x", x, "float32")?;
    let rb = bias.map(|b| ro::<f32>("bias", b, "float32")).transpose()?;
    let mut ro_out = rw::<f32>("out", out, "float32")?;
    let sx = slice("x", &rx)?;
    let sb = rb.as_ref().map(|b| slice("bias", b)).transpose()?;
    let so = slice_mut("out", &mut ro_out)?;
    let linear = if act_bits.is_some() {
        quant::dequant_linear_a8
    } else {
        quant::dequant_linear
    };
    py.detach(|| linear(sx, &w, sb, so, m)).map_err(to_py)
}

/// Whether the INT8 GEMM runs on AVX-512 VNNI at the active SIMD level.
#[pyfunction]
pub fn int8_vnni_available() -> bool {
    quant::vnni_available()
}
