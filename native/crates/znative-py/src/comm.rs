//! Compressed-collective kernels exposed to Python (`zkernels::comm`), for
//! zcomm. Same rules as the quantization bindings: every buffer is borrowed
//! and checked (dtype, C-contiguous, writeable output) before the kernel runs
//! with the GIL released; the kernel re-checks every length. Arrays are read
//! flat, whatever their shape.

use pyo3::prelude::*;
use zkernels::comm::{self, BlockParams};

use crate::arrays::{self, Slice};
use crate::quant::{ro, rw, slice, slice_mut, to_py};

/// Packs the signs of `x` (float32, or bfloat16 viewed as int16/uint16) into
/// `out` (uint8, `ceil(n / 8)` bytes, most significant bit first, 1 where not
/// negative) and returns the sum of squares of `x` (for the scale
/// `sqrt(sum / n)`), from the same pass.
#[pyfunction]
pub fn pack_signs(py: Python<'_>, x: &Bound<'_, PyAny>, out: &Bound<'_, PyAny>) -> PyResult<f64> {
    let rx = arrays::ro("x", x, true)?;
    let mut ro_out = rw::<u8>("out", out, "uint8")?;
    let so = slice_mut("out", &mut ro_out)?;
    match rx.slice("x")? {
        Slice::F32(sx) => py.detach(|| comm::pack_signs(sx, so)),
        Slice::Bf16(sx) => py.detach(|| comm::pack_signs(sx, so)),
    }
    .map_err(to_py)
}

/// Writes `scale` / `-scale` into `out` (float32, n elements) for the first n
/// signs in `packed` (uint8, exactly `ceil(n / 8)` bytes).
#[pyfunction]
pub fn unpack_signs(
    py: Python<'_>,
    packed: &Bound<'_, PyAny>,
    scale: f32,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let rp = ro::<u8>("packed", packed, "uint8")?;
    let mut ro_out = rw::<f32>("out", out, "float32")?;
    let (sp, so) = (slice("packed", &rp)?, slice_mut("out", &mut ro_out)?);
    py.detach(|| comm::unpack_signs(sp, scale, so))
        .map_err(to_py)
}

/// Blockwise symmetric quantization of `x` (float32) into `codes` (uint8:
/// n bytes for bits=8, ceil(n / 2) for bits=4, low nibble first) and `scales`
/// (float32, one per block of `block` elements), as `zcomm.blockquant`.
#[pyfunction]
#[pyo3(signature = (x, codes, scales, *, bits, block))]
pub fn quantize_blocks(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    bits: u32,
    block: usize,
) -> PyResult<()> {
    let p = BlockParams::new(bits, block).map_err(to_py)?;
    let rx = ro::<f32>("x", x, "float32")?;
    let mut rc = rw::<u8>("codes", codes, "uint8")?;
    let mut rs = rw::<f32>("scales", scales, "float32")?;
    let (sx, sc, ss) = (
        slice("x", &rx)?,
        slice_mut("codes", &mut rc)?,
        slice_mut("scales", &mut rs)?,
    );
    py.detach(|| comm::quantize_blocks(sx, p, sc, ss))
        .map_err(to_py)
}

/// Writes the values that `codes` and `scales` encode into `out` (float32,
/// n elements): `(code - 2^(bits-1)) * scale`.
#[pyfunction]
#[pyo3(signature = (codes, scales, out, *, bits, block))]
pub fn dequantize_blocks(
    py: Python<'_>,
    codes: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    bits: u32,
    block: usize,
) -> PyResult<()> {
    let p = BlockParams::new(bits, block).map_err(to_py)?;
    let rc = ro::<u8>("codes", codes, "uint8")?;
    let rs = ro::<f32>("scales", scales, "float32")?;
    let mut ro_out = rw::<f32>("out", out, "float32")?;
    let (sc, ss, so) = (
        slice("codes", &rc)?,
        slice("scales", &rs)?,
        slice_mut("out", &mut ro_out)?,
    );
    py.detach(|| comm::dequantize_blocks(sc, ss, p, so))
        .map_err(to_py)
}
