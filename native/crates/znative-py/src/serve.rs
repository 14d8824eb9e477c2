//! zserve's CPU forward kernels exposed to Python (`zkernels::serve`). Same
//! rules as the other bindings: every buffer is borrowed and checked (dtype,
//! C-contiguous, writeable output) before the kernel runs with the GIL
//! released, and the kernel re-checks every length. The element buffers of one
//! call are all float32 or all bfloat16 (viewed as int16/uint16).

use pyo3::prelude::*;
use zkernels::serve::{self, AttnDims, RotaryDims};

use numpy::{PyUntypedArray, PyUntypedArrayMethods};

use crate::arrays::{self, Slice, SliceMut};
use crate::errors::DTypeError;
use crate::quant::{ro, slice, to_py};

/// The shape of an ndarray argument.
fn shape(obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let a = obj.cast::<PyUntypedArray>().map_err(|_| {
        DTypeError::new_err("expected numpy arrays (a CPU tensor's `.numpy()` view)")
    })?;
    Ok(a.shape().to_vec())
}

fn mixed(call: &str) -> PyErr {
    DTypeError::new_err(format!(
        "{call}: the activations, weights and caches must all be float32 or all bfloat16 \
         (int16 views); cast them to the model dtype"
    ))
}

/// RMSNorm of each row of `x` into `out`: `weight * (x * rsqrt(mean(x^2) + eps))`,
/// the normalized row rounded to the dtype before the weight multiplies it.
#[pyfunction]
#[pyo3(signature = (x, weight, out, *, eps))]
pub fn rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let (rx, rw) = (
        arrays::ro("x", x, true)?,
        arrays::ro("weight", weight, true)?,
    );
    let mut ro_out = arrays::rw("out", out, true)?;
    match (
        rx.slice("x")?,
        rw.slice("weight")?,
        ro_out.slice_mut("out")?,
    ) {
        (Slice::F32(a), Slice::F32(w), SliceMut::F32(o)) => {
            py.detach(|| serve::rms_norm(a, w, eps, o))
        }
        (Slice::Bf16(a), Slice::Bf16(w), SliceMut::Bf16(o)) => {
            py.detach(|| serve::rms_norm(a, w, eps, o))
        }
        _ => return Err(mixed("rms_norm")),
    }
    .map_err(to_py)
}

/// `x += delta` (rounded to the dtype), then [`rms_norm`] of the new `x` into `out`: a
/// decoder layer's residual add and the next norm in one call, bit-identical to the two.
#[pyfunction]
#[pyo3(signature = (x, delta, weight, out, *, eps))]
pub fn add_rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    delta: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    eps: f32,
) -> PyResult<()> {
    let (rd, rw) = (
        arrays::ro("delta", delta, true)?,
        arrays::ro("weight", weight, true)?,
    );
    let mut rx = arrays::rw("x", x, true)?;
    let mut ro_out = arrays::rw("out", out, true)?;
    match (
        rx.slice_mut("x")?,
        rd.slice("delta")?,
        rw.slice("weight")?,
        ro_out.slice_mut("out")?,
    ) {
        (SliceMut::F32(a), Slice::F32(d), Slice::F32(w), SliceMut::F32(o)) => {
            py.detach(|| serve::add_rms_norm(a, d, w, eps, o))
        }
        (SliceMut::Bf16(a), Slice::Bf16(d), Slice::Bf16(w), SliceMut::Bf16(o)) => {
            py.detach(|| serve::add_rms_norm(a, d, w, eps, o))
        }
        _ => return Err(mixed("add_rms_norm")),
    }
    .map_err(to_py)
}

/// `out = x W^T` for the few rows of a decode step: `x` `(M, K)`, `weight`
/// `(N, K)`, `out` `(M, N)`, f32 accumulation rounded once to the dtype.
#[pyfunction]
#[pyo3(signature = (x, weight, out))]
pub fn linear_rows(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let rows = shape(x)?.first().copied().unwrap_or(0);
    let (rx, rw) = (
        arrays::ro("x", x, true)?,
        arrays::ro("weight", weight, true)?,
    );
    let mut ro_out = arrays::rw("out", out, true)?;
    match (
        rx.slice("x")?,
        rw.slice("weight")?,
        ro_out.slice_mut("out")?,
    ) {
        (Slice::F32(a), Slice::F32(w), SliceMut::F32(o)) => {
            py.detach(|| serve::linear_rows(a, w, rows, o))
        }
        (Slice::Bf16(a), Slice::Bf16(w), SliceMut::Bf16(o)) => {
            py.detach(|| serve::linear_rows(a, w, rows, o))
        }
        _ => return Err(mixed("linear_rows")),
    }
    .map_err(to_py)
}

/// Rotates the q and k heads of `qkv` `(T, (H + 2 KV) * D)` in place by the
/// `cos`/`sin` rows `(max_positions, D)` at `positions` (int64, T), then writes
/// each token's k and v heads to `k_cache`/`v_cache` `(slots, KV, D)` at
/// `slots` (int64, T, unique).
#[pyfunction]
#[pyo3(signature = (qkv, cos, sin, positions, slots, k_cache, v_cache, *, num_heads, num_kv_heads, head_dim))]
#[allow(clippy::too_many_arguments)]
pub fn rotary_kv_write(
    py: Python<'_>,
    qkv: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
) -> PyResult<()> {
    let (rp, rs) = (
        ro::<i64>("positions", positions, "int64")?,
        ro::<i64>("slots", slots, "int64")?,
    );
    let (sp, ss) = (slice("positions", &rp)?, slice("slots", &rs)?);
    let (rc, rsn) = (arrays::ro("cos", cos, true)?, arrays::ro("sin", sin, true)?);
    let mut rq = arrays::rw("qkv", qkv, true)?;
    let mut rk = arrays::rw("k_cache", k_cache, true)?;
    let mut rv = arrays::rw("v_cache", v_cache, true)?;
    let kvw = num_kv_heads * head_dim;
    let dims = |table_len: usize, cache_len: usize| RotaryDims {
        tokens: sp.len(),
        num_heads,
        num_kv_heads,
        head_dim,
        max_positions: table_len.checked_div(head_dim).unwrap_or(0),
        num_slots: cache_len.checked_div(kvw).unwrap_or(0),
    };
    match (
        rq.slice_mut("qkv")?,
        rc.slice("cos")?,
        rsn.slice("sin")?,
        rk.slice_mut("k_cache")?,
        rv.slice_mut("v_cache")?,
    ) {
        (SliceMut::F32(q), Slice::F32(c), Slice::F32(s), SliceMut::F32(k), SliceMut::F32(v)) => {
            let d = dims(c.len(), k.len());
            py.detach(|| serve::rotary_kv_write(q, c, s, sp, ss, d, k, v))
        }
        (
            SliceMut::Bf16(q),
            Slice::Bf16(c),
            Slice::Bf16(s),
            SliceMut::Bf16(k),
            SliceMut::Bf16(v),
        ) => {
            let d = dims(c.len(), k.len());
            py.detach(|| serve::rotary_kv_write(q, c, s, sp, ss, d, k, v))
        }
        _ => return Err(mixed("rotary_kv_write")),
    }
    .map_err(to_py)
}

/// Decode attention of `q` `(S, H, D)` over the paged caches
/// `(num_blocks, block_size, KV, D)` through `block_tables` (int64,
/// `(S, max_blocks)`) for `context_lens` (int32, S) keys, into `out`.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, context_lens, out, *, scale))]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    scale: f32,
) -> PyResult<()> {
    let (qs, cs, ts) = (shape(q)?, shape(k_cache)?, shape(block_tables)?);
    let (&[s_n, h, hd], &[nb, bs, kv, _], &[_, mb]) = (&qs[..], &cs[..], &ts[..]) else {
        return Err(crate::errors::ShapeMismatchError::new_err(format!(
            "paged_decode_attention: expected q (S, H, D), caches (blocks, block_size, KV, D) \
             and block_tables (S, max_blocks); got {qs:?}, {cs:?}, {ts:?}"
        )));
    };
    let d = AttnDims {
        num_seqs: s_n,
        num_heads: h,
        num_kv_heads: kv,
        head_dim: hd,
        num_blocks: nb,
        block_size: bs,
        max_blocks: mb,
    };
    let rt = ro::<i64>("block_tables", block_tables, "int64")?;
    let rl = ro::<i32>("context_lens", context_lens, "int32")?;
    let (st, sl) = (slice("block_tables", &rt)?, slice("context_lens", &rl)?);
    let (rq, rk, rv) = (
        arrays::ro("q", q, true)?,
        arrays::ro("k_cache", k_cache, true)?,
        arrays::ro("v_cache", v_cache, true)?,
    );
    let mut ro_out = arrays::rw("out", out, true)?;
    match (
        rq.slice("q")?,
        rk.slice("k_cache")?,
        rv.slice("v_cache")?,
        ro_out.slice_mut("out")?,
    ) {
        (Slice::F32(a), Slice::F32(k), Slice::F32(v), SliceMut::F32(o)) => {
            py.detach(|| serve::paged_decode_attention(a, k, v, st, sl, scale, d, o))
        }
        (Slice::Bf16(a), Slice::Bf16(k), Slice::Bf16(v), SliceMut::Bf16(o)) => {
            py.detach(|| serve::paged_decode_attention(a, k, v, st, sl, scale, d, o))
        }
        _ => return Err(mixed("paged_decode_attention")),
    }
    .map_err(to_py)
}

/// The kernels' fork-join team's counters since the process started
/// (`zkernels::team::Stats`): loops run on the team, loops run alone while it stood down,
/// tasks and the helpers' share of them, stand-downs (late helper / idle helpers), and
/// nanoseconds callers waited for helpers.
#[pyfunction]
pub fn team_stats() -> std::collections::HashMap<&'static str, u64> {
    let s = zkernels::team::stats();
    std::collections::HashMap::from([
        ("loops", s.loops),
        ("stood_down", s.stood_down),
        ("tasks", s.tasks),
        ("helped", s.helped),
        ("late", s.late),
        ("idle", s.idle),
        ("waited_ns", s.waited_ns),
    ])
}
