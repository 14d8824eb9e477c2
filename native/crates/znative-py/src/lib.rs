//! `znative._native`: the pyo3 binding over `zkernels`. No kernel logic here;
//! only argument checking, GIL release and error conversion.

mod aio;
mod arrays;
mod comm;
mod errors;
mod inflight;
mod optim;
mod quant;
mod serve;

use pyo3::prelude::*;
use zkernels::{par, simd};

/// The SIMD level kernels run at now (`avx512`, `avx2` or `scalar`).
#[pyfunction]
fn simd_level() -> &'static str {
    simd::active().name()
}

/// The best SIMD level this CPU supports.
#[pyfunction]
fn detected_simd_level() -> &'static str {
    simd::detected().name()
}

/// Forces kernels to a SIMD level no higher than detected; `None` restores detection.
#[pyfunction]
#[pyo3(signature = (level=None))]
fn set_simd_level(level: Option<&str>) -> PyResult<()> {
    let parsed = level
        .map(str::parse::<simd::SimdLevel>)
        .transpose()
        .map_err(errors::to_py)?;
    simd::set_override(parsed).map_err(errors::to_py)
}

/// Threads in the kernels' pool (`ZNATIVE_NUM_THREADS`, else the usable cores).
#[pyfunction]
fn num_threads() -> usize {
    par::num_threads()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(detected_simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(set_simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(optim::adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(optim::adagrad_step, m)?)?;
    m.add_function(wrap_pyfunction!(optim::lion_step, m)?)?;
    m.add_function(wrap_pyfunction!(optim::stream_4r3w, m)?)?;
    m.add_function(wrap_pyfunction!(quant::int8_gemm, m)?)?;
    m.add_function(wrap_pyfunction!(quant::int8_linear, m)?)?;
    m.add_function(wrap_pyfunction!(quant::int8_linear_split, m)?)?;
    m.add_function(wrap_pyfunction!(quant::column_absmax, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quantize_tokenwise, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize_weight, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequant_linear, m)?)?;
    m.add_function(wrap_pyfunction!(quant::int8_vnni_available, m)?)?;
    m.add_function(wrap_pyfunction!(comm::pack_signs, m)?)?;
    m.add_function(wrap_pyfunction!(comm::unpack_signs, m)?)?;
    m.add_function(wrap_pyfunction!(comm::quantize_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(comm::dequantize_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(serve::rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(serve::linear_rows, m)?)?;
    m.add_function(wrap_pyfunction!(serve::rotary_kv_write, m)?)?;
    m.add_function(wrap_pyfunction!(serve::team_stats, m)?)?;
    m.add_function(wrap_pyfunction!(serve::add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(serve::paged_decode_attention, m)?)?;
    errors::register_aio(m)?;
    m.add_class::<aio::AioHandle>()?;
    m.add_class::<aio::AlignedAllocation>()?;
    m.add_function(wrap_pyfunction!(aio::aligned_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(aio::io_backend_probe, m)?)?;
    Ok(())
}
