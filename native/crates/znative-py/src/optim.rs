//! Optimizer and bandwidth-probe kernels exposed to Python. Each function
//! borrows and checks every buffer first, then runs the kernel with the GIL
//! released.

use pyo3::prelude::*;
use zkernels::optim::{self, AdagradConfig, AdamConfig, LionConfig};

use crate::arrays::{f32_mut, f32_ref, ro, ro_f32, rw, rw_f32, Slice, SliceMut};
use crate::errors::{to_py, DTypeError};

fn same_state_dtype(a: &SliceMut<'_>, b: &SliceMut<'_>) -> PyResult<()> {
    match (a, b) {
        (SliceMut::F32(_), SliceMut::F32(_)) | (SliceMut::Bf16(_), SliceMut::Bf16(_)) => Ok(()),
        _ => Err(DTypeError::new_err(
            "exp_avg and exp_avg_sq must share one dtype (both float32 or both bfloat16)",
        )),
    }
}

/// One Adam / AdamW step in place. See `znative._native.adam_step` in the stub.
#[pyfunction]
#[pyo3(signature = (params, grads, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, adamw=false, bias_correction=true, maximize=false))]
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    py: Python<'_>,
    params: &Bound<'_, PyAny>,
    grads: &Bound<'_, PyAny>,
    exp_avg: &Bound<'_, PyAny>,
    exp_avg_sq: &Bound<'_, PyAny>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
    adamw: bool,
    bias_correction: bool,
    maximize: bool,
) -> PyResult<()> {
    let mut p = rw_f32("params", params)?;
    let g = ro("grads", grads, true)?;
    let mut m = rw("exp_avg", exp_avg, true)?;
    let mut v = rw("exp_avg_sq", exp_avg_sq, true)?;
    let cfg = AdamConfig {
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        decoupled_weight_decay: adamw,
        bias_correction,
        maximize,
        step,
    };
    let (p, g) = (f32_mut("params", &mut p)?, g.slice("grads")?);
    let (m, v) = (m.slice_mut("exp_avg")?, v.slice_mut("exp_avg_sq")?);
    same_state_dtype(&m, &v)?;
    py.detach(|| match (g, m, v) {
        (Slice::F32(g), SliceMut::F32(m), SliceMut::F32(v)) => optim::adam_step(p, g, m, v, &cfg),
        (Slice::Bf16(g), SliceMut::F32(m), SliceMut::F32(v)) => optim::adam_step(p, g, m, v, &cfg),
        (Slice::F32(g), SliceMut::Bf16(m), SliceMut::Bf16(v)) => optim::adam_step(p, g, m, v, &cfg),
        (Slice::Bf16(g), SliceMut::Bf16(m), SliceMut::Bf16(v)) => {
            optim::adam_step(p, g, m, v, &cfg)
        }
        // Excluded by `same_state_dtype` above.
        _ => Ok(()),
    })
    .map_err(to_py)
}

/// One Adagrad step in place.
#[pyfunction]
#[pyo3(signature = (params, grads, state_sum, *, lr, lr_decay, eps, weight_decay, step, maximize=false))]
#[allow(clippy::too_many_arguments)]
pub fn adagrad_step(
    py: Python<'_>,
    params: &Bound<'_, PyAny>,
    grads: &Bound<'_, PyAny>,
    state_sum: &Bound<'_, PyAny>,
    lr: f64,
    lr_decay: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
    maximize: bool,
) -> PyResult<()> {
    let mut p = rw_f32("params", params)?;
    let g = ro("grads", grads, true)?;
    let mut s = rw("state_sum", state_sum, true)?;
    let cfg = AdagradConfig {
        lr,
        lr_decay,
        eps,
        weight_decay,
        maximize,
        step,
    };
    let (p, g, s) = (
        f32_mut("params", &mut p)?,
        g.slice("grads")?,
        s.slice_mut("state_sum")?,
    );
    py.detach(|| match (g, s) {
        (Slice::F32(g), SliceMut::F32(s)) => optim::adagrad_step(p, g, s, &cfg),
        (Slice::Bf16(g), SliceMut::F32(s)) => optim::adagrad_step(p, g, s, &cfg),
        (Slice::F32(g), SliceMut::Bf16(s)) => optim::adagrad_step(p, g, s, &cfg),
        (Slice::Bf16(g), SliceMut::Bf16(s)) => optim::adagrad_step(p, g, s, &cfg),
    })
    .map_err(to_py)
}

/// One Lion step in place.
#[pyfunction]
#[pyo3(signature = (params, grads, exp_avg, *, lr, beta1, beta2, weight_decay, step, maximize=false))]
#[allow(clippy::too_many_arguments)]
pub fn lion_step(
    py: Python<'_>,
    params: &Bound<'_, PyAny>,
    grads: &Bound<'_, PyAny>,
    exp_avg: &Bound<'_, PyAny>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    step: u64,
    maximize: bool,
) -> PyResult<()> {
    let mut p = rw_f32("params", params)?;
    let g = ro("grads", grads, true)?;
    let mut m = rw("exp_avg", exp_avg, true)?;
    let cfg = LionConfig {
        lr,
        beta1,
        beta2,
        weight_decay,
        maximize,
        step,
    };
    let (p, g, m) = (
        f32_mut("params", &mut p)?,
        g.slice("grads")?,
        m.slice_mut("exp_avg")?,
    );
    py.detach(|| match (g, m) {
        (Slice::F32(g), SliceMut::F32(m)) => optim::lion_step(p, g, m, &cfg),
        (Slice::Bf16(g), SliceMut::F32(m)) => optim::lion_step(p, g, m, &cfg),
        (Slice::F32(g), SliceMut::Bf16(m)) => optim::lion_step(p, g, m, &cfg),
        (Slice::Bf16(g), SliceMut::Bf16(m)) => optim::lion_step(p, g, m, &cfg),
    })
    .map_err(to_py)
}

/// One pass of the 4-read/3-write bandwidth probe: 28 bytes per element, or 20
/// when `c` and `d` are bfloat16 bits (the bf16-state layout). `pace`: dependent
/// square-root/divide pairs per vector (0-3; see `zkernels::stream`).
#[pyfunction]
#[pyo3(signature = (a, b, c, d, *, pace=0))]
pub fn stream_4r3w(
    py: Python<'_>,
    a: &Bound<'_, PyAny>,
    b: &Bound<'_, PyAny>,
    c: &Bound<'_, PyAny>,
    d: &Bound<'_, PyAny>,
    pace: u32,
) -> PyResult<()> {
    let (mut a, b) = (rw_f32("a", a)?, ro_f32("b", b)?);
    let (mut c, mut d) = (rw("c", c, true)?, rw("d", d, true)?);
    let b = f32_ref("b", &b)?;
    let a = f32_mut("a", &mut a)?;
    match (c.slice_mut("c")?, d.slice_mut("d")?) {
        (SliceMut::F32(c), SliceMut::F32(d)) => {
            py.detach(|| zkernels::stream::stream_4r3w(a, b, c, d, pace))
        }
        (SliceMut::Bf16(c), SliceMut::Bf16(d)) => {
            py.detach(|| zkernels::stream::stream_4r3w_bf16(a, b, c, d, pace))
        }
        _ => {
            return Err(DTypeError::new_err(
                "c and d must share one dtype (both float32, or both bfloat16 bits)",
            ))
        }
    }
    .map_err(to_py)
}
